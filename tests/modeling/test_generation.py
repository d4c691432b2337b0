"""The shared generate() bookkeeping (hf_latentlm/modeling/generation.py), each piece on its own. The loop itself is
held to its contract for every family in tests/test_family_contract.py."""

from dataclasses import dataclass

import pytest
import torch
from transformers import GenerationConfig

from hf_latentlm.modeling.generation import (
    NewTokens,
    pop_options,
    refuse_token_filters,
    reject_unknown_options,
    resolve_generation_request,
)


@dataclass
class Config:
    max_position_embeddings: int = 64
    pad_token_id: int = 1


def request_for(input_ids, max_new_tokens=None, generation_config=None, **kwargs):
    return resolve_generation_request("Toy", Config(), generation_config or GenerationConfig(eos_token_id=0),
                                      input_ids, None, max_new_tokens, kwargs)


def test_lengths_resolve_like_transformers():
    ids = torch.ones(1, 5, dtype=torch.long)
    assert request_for(ids).max_new_tokens == 15  # default max_length 20 counts the prompt
    assert request_for(ids, max_length=9).max_new_tokens == 4
    assert request_for(ids, 7, max_length=9).max_new_tokens == 7  # max_new_tokens wins
    assert request_for(ids, generation_config=GenerationConfig(max_new_tokens=3)).max_new_tokens == 3
    assert request_for(ids, generation_config=GenerationConfig(max_length=8)).max_new_tokens == 3
    with pytest.raises(ValueError, match="max_length \\(5\\) leaves no room"):
        request_for(ids, max_length=5)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        request_for(ids, 60)


def test_special_tokens_come_from_the_call_then_the_generation_config_then_the_config():
    ids = torch.ones(1, 3, dtype=torch.long)
    assert request_for(ids, 4).eos_ids.tolist() == [0] and request_for(ids, 4).pad_token_id == 1
    assert request_for(ids, 4, eos_token_id=None).eos_ids.numel() == 0  # None: never stop
    assert request_for(ids, 4, eos_token_id=[5, 6], pad_token_id=9).eos_ids.tolist() == [5, 6]
    assert request_for(ids, 4, generation_config=GenerationConfig(pad_token_id=7)).pad_token_id == 7
    with pytest.raises(ValueError, match="num_beams"):
        request_for(ids, 4, num_beams=3)


def commit_all(request, batch, steps):
    new = NewTokens(request, batch, "cpu")
    for tokens, counts in steps:
        new.commit(torch.tensor(tokens), None if counts is None else torch.tensor(counts))
    return new


def test_commit_keeps_counted_tokens_up_to_eos_and_max_new_tokens():
    ids = torch.ones(2, 3, dtype=torch.long)
    request = request_for(ids, 5, eos_token_id=9, pad_token_id=1)
    new = commit_all(request, 2, [([[4, 5, 6], [4, 9, 7]], [2, 3]), ([[7, 8, 9], [2, 2, 2]], None)])
    # Row 0: 2 counted tokens, then 3 more hit max_new_tokens = 5 before its EOS. Row 1: stops at EOS.
    assert new.tokens.tolist() == [[4, 5, 7, 8, 9], [4, 9, 1, 1, 1]]
    assert new.count.tolist() == [5, 2] and new.done
    assert new.sequences(ids).shape == (2, 8)


def test_min_new_tokens_ignores_early_eos():
    ids = torch.ones(1, 3, dtype=torch.long)
    request = request_for(ids, 8, eos_token_id=9, min_new_tokens=3)
    new = commit_all(request, 1, [([[9, 9]], None), ([[5, 9, 6]], None)])
    assert new.tokens[0, :new.count[0]].tolist() == [9, 9, 5, 9] and new.done  # EOS at index 3 counts


@dataclass
class ToyOptions:
    seeds: list | None = None
    width: int = 2


def test_options_are_popped_by_field_name_and_the_rest_named():
    kwargs = {"width": 3, "use_cache": True, "frobnicate": 1}
    assert pop_options(ToyOptions, kwargs) == ToyOptions(width=3)
    assert kwargs == {"use_cache": True, "frobnicate": 1}
    with pytest.raises(ValueError, match=r"unsupported generation option\(s\) for Toy: \['frobnicate'\]"):
        reject_unknown_options(kwargs, "Toy")
    reject_unknown_options({"use_cache": True}, "Toy")  # harmless transformers options pass
    refuse_token_filters("Toy", "no token probabilities", 0, 1.0)
    with pytest.raises(ValueError, match="top_k is not supported by Toy"):
        refuse_token_filters("Toy", "no token probabilities", 5, None)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_read_out_samples_the_decoder_softmax_at_the_temperature(temperature):
    """A latent family's decoder read-out at T ∉ {0, 1}: over 6000 positions of p = (0.5, 0.3, 0.2) the token
    frequencies match p^(1/T)/Σ (hand values) to 0.025, for each row from its own generator (two rows, other
    seeds, other draws); T = 0 is the argmax."""
    from hf_latentlm.modeling.generation import read_out_tokens

    p = torch.tensor([0.5, 0.3, 0.2])
    logits = p.log().expand(2, 6000, 3)
    tokens = read_out_tokens(logits, [torch.Generator().manual_seed(s) for s in (1, 2)], temperature)
    expected = p ** (1 / temperature) / (p ** (1 / temperature)).sum()
    for row in tokens:
        frequencies = torch.bincount(row, minlength=3).float() / row.numel()
        torch.testing.assert_close(frequencies, expected, atol=0.025, rtol=0)
    assert not torch.equal(tokens[0], tokens[1])
    assert (read_out_tokens(logits[:, :5], [], 0.0) == 0).all()


def test_repetition_penalty_by_hand():
    """`penalize_repetitions` at every position of a block: the logit s of each earlier token becomes s·p if s < 0,
    else s/p (a repeated id counted once), the other logits unchanged (hand values)."""
    from hf_latentlm.modeling.generation import penalize_repetitions

    logits = torch.tensor([[[2.0, -1.0, 0.5, -3.0], [-2.0, 4.0, 1.0, 0.0]]])
    out = penalize_repetitions(logits, torch.tensor([[1, 3, 3]]), 2.0)
    expected = torch.tensor([[[2.0, -2.0, 0.5, -6.0], [-2.0, 2.0, 1.0, 0.0]]])
    assert torch.equal(out, expected)


def test_a_family_without_repetition_penalty_names_it(tokenizer):
    """PLM has no repetition penalty: passed to generate(), or set in the generation config, it is refused by name."""
    from hf_latentlm.families import build_model

    model = build_model("plm", "tiny", tokenizer).eval()
    prompt = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match=r"unsupported generation option\(s\) for PLM: \['repetition_penalty'\]"):
        model.generate(prompt, max_new_tokens=2, repetition_penalty=1.2)
    model.generation_config.repetition_penalty = 1.2
    with pytest.raises(ValueError, match=r"generation_config.repetition_penalty = 1.2 is not supported by PLM"):
        model.generate(prompt, max_new_tokens=2)
