import copy
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_latentlm.eval.nll import evaluate_nll
from hf_latentlm.eval.sampling import check_trained_length, evaluation_windows, sample_continuations
from hf_latentlm.eval.speed import measure_generation_speed


@pytest.fixture(scope="module")
def small_vocab_model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, eos_token_id=0, pad_token_id=1, bos_token_id=0)
    return LlamaForCausalLM(cfg).eval()


def test_samples_have_exact_length_and_eos_does_not_stop(small_vocab_model):
    contexts = torch.randint(2, 8, (6, 5))
    draws = sample_continuations(small_vocab_model, contexts, 40, seed=0)
    assert draws.shape == (6, 40)
    assert (draws == 0).any(), "EOS must be sampled as an ordinary token, not end the row"
    assert torch.equal(draws, sample_continuations(small_vocab_model, contexts, 40, seed=0))
    assert not torch.equal(draws, sample_continuations(small_vocab_model, contexts, 40, seed=1))
    with pytest.raises(ValueError, match="non-empty"):
        sample_continuations(small_vocab_model, torch.zeros(0, 5, dtype=torch.long), 4, seed=0)


def test_evaluation_windows_are_contiguous_slices():
    stream = torch.arange(100)
    ctx, tgt = evaluation_windows(stream, 10, 8, 4)
    assert ctx.shape == (10, 8) and tgt.shape == (10, 4)
    assert torch.equal(tgt[:, 0], ctx[:, -1] + 1) and ctx[0, 0] == 0 and tgt[-1, -1] == 99
    with pytest.raises(ValueError, match="too short"):
        evaluation_windows(torch.arange(5), 1, 8, 4)


def test_speed_counts_one_call_per_token_for_ar(small_vocab_model):
    prompts = torch.randint(2, 8, (3, 6))
    result = measure_generation_speed(small_vocab_model, prompts, max_new_tokens=12, repeats=2)
    assert result["new_tokens_per_row"] == 12 and result["batch_size"] == 3
    assert result["model_calls_per_token"] == pytest.approx(1.0)
    assert result["tokens_per_s"] == pytest.approx(3 * 12 / result["median_s"])
    assert len(result["times_s"]) == 2
    with pytest.raises(ValueError, match="repeats"):
        measure_generation_speed(small_vocab_model, prompts, repeats=0)


def test_nll_matches_the_models_own_loss(small_vocab_model):
    rows = torch.randint(0, 8, (5, 16))
    result = evaluate_nll(small_vocab_model, rows, batch_size=2)
    with torch.no_grad():
        expected = small_vocab_model(input_ids=rows, labels=rows).loss.item()
    assert result["nll"] == pytest.approx(expected, rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(expected), rel=1e-5)
    assert result["num_tokens"] == 5 * 15


def test_training_step_time_reports_throughput_and_the_share_of_a_timed_method():
    import time
    from types import SimpleNamespace

    from hf_latentlm.eval.speed import training_step_time

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(8, 4)

        def slow_part(self, x):
            time.sleep(0.02)
            return x

        def forward(self, input_ids, labels):
            time.sleep(0.02)
            return SimpleNamespace(loss=self.slow_part(self.embed(input_ids)).pow(2).mean())

    model = Toy()
    rows = torch.randint(0, 8, (12, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    result = training_step_time(model, rows, 2, 4, optimizer, timed_method="slow_part")
    assert result["tokens_per_s"] == pytest.approx(4 * 16 / result["seconds_per_step"])
    assert result["seconds_per_step"] >= 0.04
    assert 0.3 < result["slow_part_share"] < 0.55  # one of the two equal sleeps
    assert "slow_part" not in vars(model), "the timing wrapper must be removed afterwards"
    with pytest.raises(ValueError, match="need 16 rows"):
        training_step_time(model, rows, 3, 4, optimizer)


def test_fresh_training_step_time_trains_a_copy_and_leaves_the_model_as_it_was(tokenizer, tiny_rows):
    from hf_latentlm.eval.speed import fresh_training_step_time
    from hf_latentlm.families import build_model

    torch.manual_seed(0)
    model = build_model("plm", "tiny", tokenizer).eval()
    before = {name: p.clone() for name, p in model.state_dict().items()}
    result = fresh_training_step_time(model, tiny_rows[:6, :32], 2, 2, timed_method="auxiliary_owners")
    assert result["tokens_per_s"] == pytest.approx(2 * 32 / result["seconds_per_step"])
    assert 0 < result["auxiliary_owners_share"] < 1
    assert not model.training and all(torch.equal(p, before[name]) for name, p in model.state_dict().items())


def test_speed_reports_calls_per_token_by_network_when_generate_returns_them(tokenizer, validation_stream):
    """Cola runs three networks: asked with return_dict_in_generate, the speed row splits its calls per token by
    network, and the parts add up to the hooked count."""
    from hf_latentlm.families import build_model

    torch.manual_seed(0)
    cola = build_model("cola", "tiny", tokenizer, vae=build_model("cola-vae", "tiny", tokenizer)).eval()
    prompts = evaluation_windows(validation_stream, 1, 8, 1)[0]
    split = measure_generation_speed(cola, prompts, 8, repeats=1, generate_kwargs={"return_dict_in_generate": True})
    assert set(split["calls_per_token_by_network"]) == set(cola.network_names.values())
    assert sum(split["calls_per_token_by_network"].values()) == pytest.approx(split["model_calls_per_token"])
    assert "calls_per_token_by_network" not in measure_generation_speed(cola, prompts, 8, repeats=1)


def test_sampling_refuses_positions_past_the_trained_length_and_names_both(small_vocab_model):
    model = copy.deepcopy(small_vocab_model)
    model.config.trained_seq_len = 12
    contexts = torch.randint(2, 8, (3, 8))
    assert sample_continuations(model, contexts, 4, seed=0).shape == (3, 4)  # 8 + 4 = 12: every position trained
    with pytest.raises(ValueError, match=r"8-token context \+ 5 tokens reach 13 positions, beyond the 12 the model "
                                         r"was trained at .*contexts of at most 7 tokens"):
        sample_continuations(model, contexts, 5, seed=0)
    # A config without the record (a model trained elsewhere), or a config.json dict, is read the same way.
    check_trained_length(small_vocab_model.config, 1000, 4, "x")
    with pytest.raises(ValueError, match="beyond the 16 model 'a' was trained at"):
        check_trained_length({"trained_seq_len": 16}, 16, 1, "x", "model 'a'")


def test_evaluation_stays_inside_the_trained_length(tokenizer):
    from hf_latentlm.eval.harness import evaluate_model
    from hf_latentlm.families import build_model

    torch.manual_seed(0)
    model = build_model("ar", "tiny", tokenizer).eval()
    model.config.trained_seq_len = 64
    result = evaluate_model(model, tokenizer, num_positions=8, context_len=16, batch_size=8)
    # NLL rows are the trained 64 tokens, not the default 256, and say so.
    assert result["nll"]["row_length"] == 64
    with pytest.raises(ValueError, match=r"Brier windows \(--context-len 61\): a 61-token context \+ 4 tokens reach "
                                         r"65 positions, beyond the 64"):
        evaluate_model(model, tokenizer, num_positions=8, context_len=61)
    # MAUVE's 64 + 128-token samples are refused before any Brier sampling runs.
    calls = []
    model.generate = lambda *a, **k: calls.append(1)
    with pytest.raises(ValueError, match="MAUVE samples: a 64-token context \\+ 128 tokens reach 192"):
        evaluate_model(model, tokenizer, num_positions=8, context_len=16, mauve=True)
    assert calls == []
