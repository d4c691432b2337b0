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


class CountingDecodes:
    """The tokenizer, recording how many ids each decode() call is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.sizes = tokenizer, []

    def decode(self, ids, **kwargs):
        self.sizes.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


@pytest.mark.parametrize("step", [1, 5])
def test_a_long_row_streams_its_whole_decoding_decoding_only_a_few_recent_tokens_each_step(tokenizer, step):
    # ~3000 tokens: the repeated text with its split characters, ending in a stop sequence found only at the end
    ids = tokenizer(" ".join(f"{TEXT} {i}" for i in range(200)) + " THE END.", add_special_tokens=False)["input_ids"]
    assert len(ids) > 2000
    counting = CountingDecodes(tokenizer)
    pieces, text = stream(counting, ids, step=step)
    assert "".join(pieces) == tokenizer.decode(ids) and not any("\ufffd" in piece for piece in pieces)
    assert max(counting.sizes) <= 16, "add() decodes a window of recent tokens, not the whole row"
    cut, _ = stream(tokenizer, ids, ["THE END"], step)
    assert "".join(cut) == tokenizer.decode(ids)[:-len("THE END.")]


def test_random_token_ids_stream_their_whole_decoding(tokenizer):
    """Random ids include lone and truncated byte tokens (invalid UTF-8): the pieces still join into the decoding."""
    import random

    rng = random.Random(0)
    byte_tokens = [i for i in range(len(tokenizer)) if len(tokenizer.convert_ids_to_tokens(i)) == 1]
    for _ in range(20):
        ids = [rng.choice(byte_tokens) if rng.random() < 0.6 else rng.randrange(len(tokenizer)) for _ in range(60)]
        pieces, _ = stream(tokenizer, ids, step=rng.randint(1, 4))
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True), ids


def test_tokens_used_counts_the_row_up_to_the_token_that_completes_the_stop(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    stop = "ROMEO"
    # by brute force: the shortest prefix of the row whose decoding contains the stop sequence
    needed = next(n for n in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:n]))
    text = IncrementalText(tokenizer, [stop])
    text.add(ids[:needed - 2])
    assert text.tokens_used == needed - 2 and not text.stopped
    text.add(ids[needed - 2:])  # the rest in one step, as a multi-token family commits them
    assert text.stopped and text.tokens_used == needed < len(ids)


def byte_level_tokenizer_with_tokens_ending_mid_character():
    """A GPT-2-style byte-level BPE whose tokens "ab" + the first byte of "é" and "c" + the first two bytes of "🙂"
    hold whole characters followed by part of a multi-byte one (ours has no such token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    to_char = bytes_to_unicode()  # byte -> its printable stand-in
    vocab = {char: index for index, char in enumerate(sorted(to_char.values()))}
    e_first, smile = "é".encode()[0], "🙂".encode()
    merges = [("a", "b"), ("ab", to_char[e_first]), ("c", to_char[smile[0]]), ("c" + to_char[smile[0]], to_char[smile[1]])]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


@pytest.mark.parametrize("step", [1, 2])
def test_a_token_ending_in_part_of_a_character_streams_its_whole_characters_once(step):
    tokenizer = byte_level_tokenizer_with_tokens_ending_mid_character()
    whole = "abé c🙂 abé"
    ids = tokenizer(whole, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids[:1]) == "ab\ufffd", "the first token must hold 'ab' and part of 'é'"
    pieces, _ = stream(tokenizer, ids, step=step)
    assert "".join(pieces) == tokenizer.decode(ids) == whole
    assert not any("\ufffd" in piece for piece in pieces)
