"""IncrementalText: what a row streams joins into exactly what it returns whole, with characters split across
byte-level tokens and with stop sequences."""

import pytest

from hf_latentlm.serving.text import IncrementalText

TEXT = "café 🙂 naïve — ROMEO. O"  # é, ï, 🙂 and — are each split across several byte-level tokens


def stream(tokenizer, ids, stop=(), step=1):
    text = IncrementalText(tokenizer, list(stop))
    pieces = [text.add(ids[i:i + step]) for i in range(0, len(ids), step)]
    return pieces + [text.finish()], text


@pytest.mark.parametrize("step", [1, 3])
def test_pieces_join_into_the_whole_decoding_and_never_split_a_character(tokenizer, step):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    prefixes = [tokenizer.decode(ids[:n]) for n in range(1, len(ids) + 1)]
    assert any(p.endswith("\ufffd") for p in prefixes), "the text must split a character across tokens"
    pieces, text = stream(tokenizer, ids, step=step)
    assert "".join(pieces) == tokenizer.decode(ids) == TEXT
    assert not any("\ufffd" in piece for piece in pieces)
    assert not text.stopped


@pytest.mark.parametrize("stop, before", [(["naï"], "café 🙂 "), (["ROMEO", "🙂 n"], "café "), ([". O"], "café 🙂 naïve — ROMEO")])
@pytest.mark.parametrize("step", [1, 3])
def test_a_stop_sequence_ends_the_text_before_it_and_no_piece_of_it_is_sent(tokenizer, stop, before, step):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    pieces, text = stream(tokenizer, ids, stop, step)
    assert TEXT[:min(TEXT.find(s) for s in stop)] == before  # the hand cut
    assert "".join(pieces) == before == text.text
    assert text.stopped
    assert text.add(ids[:2]) == "" and text.finish() == ""  # nothing more after the stop


def test_a_held_back_stop_prefix_that_does_not_complete_is_sent(tokenizer):
    ids = tokenizer("ROMEO. ROME", add_special_tokens=False)["input_ids"]
    pieces, text = stream(tokenizer, ids, ["ROMEO!"])
    assert "".join(pieces) == "ROMEO. ROME" and not text.stopped
    assert pieces[-1].endswith("ROME")  # held back until the end: it could have become the stop sequence
