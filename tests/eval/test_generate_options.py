"""`generate_kwargs` reaches the model's own generate(), merged over the unbiased-sampling defaults."""

import pytest
import torch

from hf_latentlm.eval.brier import MAX_N, evaluate_brier
from hf_latentlm.eval.harness import evaluate_model, generate_mauve_texts
from hf_latentlm.eval.sampling import evaluation_windows, sample_continuations, unbiased_sampling_kwargs
from hf_latentlm.families import build_model

GREEDY = {"do_sample": False}


@pytest.fixture(scope="module")
def tiny_ar(tokenizer):
    torch.manual_seed(0)
    return build_model("ar", "tiny", tokenizer).eval()


def greedy(model, contexts, num_tokens):
    with torch.no_grad():
        out = model.generate(contexts, attention_mask=torch.ones_like(contexts), do_sample=False,
                             max_new_tokens=num_tokens, eos_token_id=None)
    return out[:, contexts.shape[1]:]


def test_options_are_merged_over_the_defaults():
    merged = unbiased_sampling_kwargs(4, {"temperature": 0.5, "acceptance": "epsilon"})
    assert merged == {**unbiased_sampling_kwargs(4), "temperature": 0.5, "acceptance": "epsilon"}
    assert unbiased_sampling_kwargs(4, None) == unbiased_sampling_kwargs(4)



def test_the_defaults_are_plain_ancestral_sampling_of_exactly_n_tokens():
    """Pure draws from the model (what BrierLM's unbiasedness needs): sampling on, temperature 1, no top-k (0 turns
    off transformers' default of 50) and no top-p, exactly n tokens with EOS an ordinary token."""
    assert unbiased_sampling_kwargs(3) == dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=3,
                                               eos_token_id=None)

def test_greedy_options_give_the_models_greedy_continuations(tiny_ar, validation_stream):
    contexts, _ = evaluation_windows(validation_stream, 4, 16, 1)
    draws = sample_continuations(tiny_ar, contexts, 6, seed=0, generate_kwargs=GREEDY)
    assert torch.equal(draws, greedy(tiny_ar, contexts, 6))
    assert torch.equal(draws, sample_continuations(tiny_ar, contexts, 6, seed=1, generate_kwargs=GREEDY))
    assert not torch.equal(draws, sample_continuations(tiny_ar, contexts, 6, seed=0)), "default: sampling"


def test_brier_with_greedy_options_scores_the_greedy_continuation(tiny_ar, validation_stream):
    stream = validation_stream[:600]
    result = evaluate_brier(tiny_ar, stream, num_positions=24, context_len=16, batch_size=8, num_bootstrap=10,
                            generate_kwargs=GREEDY)
    # Both draws are the greedy continuation x, so each term is 1{x = y} + 1{x = y} - 1.
    contexts, targets = evaluation_windows(stream, 24, 16, MAX_N)
    hits = (greedy(tiny_ar, contexts, MAX_N) == targets).long().cumprod(dim=1).double()
    for n in range(1, MAX_N + 1):
        assert result[f"brier_{n}"]["value"] == pytest.approx((2 * hits[:, n - 1] - 1).mean().item())


def test_mauve_texts_with_greedy_options_decode_the_greedy_continuations(tiny_ar, tokenizer, validation_stream):
    stream = validation_stream[:400]
    model_texts, human_texts = generate_mauve_texts(tiny_ar, tokenizer, stream, num_samples=3, prompt_len=8,
                                                    continuation_len=5, batch_size=2, generate_kwargs=GREEDY)
    prompts, human = evaluation_windows(stream, 3, 8, 5)
    assert model_texts == tokenizer.batch_decode(greedy(tiny_ar, prompts, 5), skip_special_tokens=True)
    assert human_texts == tokenizer.batch_decode(human, skip_special_tokens=True)


def test_evaluate_model_hands_options_to_generate(tiny_ar, tokenizer):
    # An option the model does not take is refused by transformers' own generate(): proof that it got there.
    with pytest.raises(ValueError, match="not_an_option"):
        evaluate_model(tiny_ar, tokenizer, num_positions=4, context_len=8, generate_kwargs={"not_an_option": 1})
