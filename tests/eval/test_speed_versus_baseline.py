import time

import pytest
import torch

from hf_latentlm.eval import bench
from hf_latentlm.eval.sampling import evaluation_windows
from hf_latentlm.eval.speed import alternating_speed_ratio, speed_versus_baseline, speed_versus_fresh_baseline
from hf_latentlm.families import build_model


@pytest.fixture(scope="module")
def two_tiny_ar(tokenizer):
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        models.append(build_model("ar", "tiny", tokenizer).eval())
    return models


@pytest.fixture(scope="module")
def prompts(validation_stream):
    return evaluation_windows(validation_stream, 2, 8, 1)[0]


def test_ratio_is_model_over_baseline_with_both_measured(two_tiny_ar, prompts):
    model, baseline = two_tiny_ar
    # Different per-model options show that each side is really generated with its own.
    result = speed_versus_baseline(model, baseline, prompts, batch_sizes=(1, 2), max_new_tokens=6, repeats=2,
                                   baseline_generate_kwargs={"max_new_tokens": 3})
    assert set(result["ratio"]) == {"batch_1", "batch_2"}
    for key, b in (("batch_1", 1), ("batch_2", 2)):
        mine, base = result["model"][key], result["baseline"][key]
        assert mine["batch_size"] == base["batch_size"] == b
        assert mine["new_tokens_per_row"] == 6 and base["new_tokens_per_row"] == 3
        assert len(mine["times_s"]) == len(base["times_s"]) == 2
        assert result["ratio"][key] == pytest.approx(mine["tokens_per_s"] / base["tokens_per_s"])
    n = sum(p.numel() for p in model.parameters())
    assert result["num_parameters"] == {"model": n, "baseline": n}


def test_a_model_against_itself_is_timed_once(two_tiny_ar, prompts):
    model = two_tiny_ar[0]
    result = speed_versus_baseline(model, model, prompts, max_new_tokens=4, repeats=1)
    assert result["baseline"]["batch_2"] is result["model"]["batch_2"] and result["ratio"] == {"batch_2": 1.0}
    other_options = speed_versus_baseline(model, model, prompts, max_new_tokens=4, repeats=1,
                                          baseline_generate_kwargs={"max_new_tokens": 2})
    assert other_options["baseline"]["batch_2"]["new_tokens_per_row"] == 2
    with pytest.raises(ValueError, match="need 3 prompts"):
        speed_versus_baseline(model, model, prompts, batch_sizes=(1, 3))


def test_fresh_baseline_is_the_baseline_family_at_the_preset(two_tiny_ar, prompts, tokenizer):
    model = two_tiny_ar[0]
    result = speed_versus_fresh_baseline(model, "tiny", tokenizer, prompts[:1], max_new_tokens=4, repeats=1)
    fresh = sum(p.numel() for p in build_model("ar", "tiny", tokenizer).parameters())
    assert result["num_parameters"]["baseline"] == fresh
    speed, base = result["model"]["batch_1"], result["baseline"]["batch_1"]
    assert base["model_calls_per_token"] == pytest.approx(1.0) and base["new_tokens_per_row"] == 4
    assert result["ratio"]["batch_1"] == pytest.approx(speed["tokens_per_s"] / base["tokens_per_s"])


def test_benchmark_pairs_every_model_with_the_baseline_and_routes_options(two_tiny_ar, tokenizer, tmp_path,
                                                                          monkeypatch):
    paths = {}
    for name, model in zip(("ar", "ar2"), two_tiny_ar):
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
        paths[name] = str(tmp_path / name)
    seen = {}

    def quality(model, tokenizer, *args, generate_kwargs=None, **kwargs):  # quality has its own tests; speed here
        seen[model.name_or_path] = generate_kwargs
        return {"brier": {"brierlm_2": {"value": 10.0}}}

    monkeypatch.setattr(bench, "evaluate_model", quality)
    with pytest.raises(ValueError, match="'ar3'"):
        bench.benchmark_models(paths, "ar", generate_kwargs={"ar3": {}})
    report = bench.benchmark_models(paths, "ar", max_new_tokens=6, repeats=1, batch_sizes=(1, 2), progress=False,
                                    generate_kwargs={"ar2": {"max_new_tokens": 3}})
    assert seen == {paths["ar"]: None, paths["ar2"]: {"max_new_tokens": 3}}
    assert report["settings"]["generate_kwargs"] == {"ar2": {"max_new_tokens": 3}}
    base, other = report["models"]["ar"], report["models"]["ar2"]
    assert base["ratio_to_baseline"] == {"tokens_per_s_batch_1": 1.0, "tokens_per_s_batch_2": 1.0, "brierlm_2": 1.0,
                                         "flops_per_s_batch_1": 1.0, "flops_per_s_batch_2": 1.0}
    for k in ("batch_1", "batch_2"):
        assert other["speed"][k]["new_tokens_per_row"] == 3 and other["baseline_speed"][k]["new_tokens_per_row"] == 6
        assert other["ratio_to_baseline"][f"tokens_per_s_{k}"] == pytest.approx(
            other["speed"][k]["tokens_per_s"] / other["baseline_speed"][k]["tokens_per_s"])


def test_compiled_decoding_is_timed_next_to_eager_with_the_same_arithmetic(two_tiny_ar, prompts, tokenizer,
                                                                            monkeypatch):
    """The AR baseline compiles through transformers' own generate() (static cache), a family through its
    `compile_config` option; the compiled rows run compiled graphs, count the same FLOPs (counted uncompiled) and time
    their first, compiling call apart."""
    from transformers import CompileConfig

    from hf_latentlm.eval import speed

    graphs = []

    def recording_backend(graph, example_inputs):  # runs each captured graph as it is (inductor is torch's to test)
        graphs.append(graph)
        return graph.forward

    def eager_graphs_config(device):
        config = CompileConfig(backend=recording_backend, mode="default")
        config._compile_all_devices = True
        return config

    monkeypatch.setattr(speed, "decoding_compile_config", eager_graphs_config)
    torch.manual_seed(0)
    plm = build_model("plm", "tiny", tokenizer).eval()
    # The family first: transformers' own compile of the baseline must still capture its graphs afterwards.
    for model, static_cache in ((plm, False), (two_tiny_ar[0], True)):
        graphs.clear()
        result = speed.compiled_decoding_speed(model, prompts, (2,), max_new_tokens=6, repeats=1,
                                               static_cache=static_cache)
        assert graphs, type(model).__name__
        for key in ("batch_2",):
            eager, compiled = result["eager"][key], result["compiled"][key]
            assert eager["new_tokens_per_row"] == compiled["new_tokens_per_row"] == 6
            assert compiled["flops_per_token"] == eager["flops_per_token"] > 0
            assert compiled["first_call_s"] > 0 and "first_call_s" not in eager
            assert result["compiled_over_eager"][key] == pytest.approx(compiled["tokens_per_s"] / eager["tokens_per_s"])
    with pytest.raises(ValueError, match="need 8 prompts"):
        speed.compiled_decoding_speed(plm, prompts, (1, 8))


def test_alternating_pairs_give_the_median_ratio_of_the_pairs_and_its_range(two_tiny_ar, prompts, monkeypatch):
    """Model and baseline alternate, one warm-up each; each pair's ratio is baseline time / model time (same tokens),
    the result their median with the range. A model slowed by half a second a call is slower than its twin in every pair."""
    model, baseline = two_tiny_ar
    order, generate = [], type(model).generate

    def slowed(self, *args, **kwargs):
        order.append("model" if self is model else "baseline")
        if self is model:
            time.sleep(0.5)
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "generate", slowed)
    result = alternating_speed_ratio(model, baseline, prompts[:1], pairs=3, max_new_tokens=4)
    assert order == ["model", "baseline"] * 4
    pairs = [b / m for m, b in zip(result["model"]["times_s"], result["baseline"]["times_s"])]
    assert len(pairs) == 3 and result["ratio"] == pytest.approx(sorted(pairs)[1])
    assert result["ratio_range"] == pytest.approx((min(pairs), max(pairs)))
    assert result["ratio_range"][1] < 1 and result["baseline"]["tokens_per_call"] == pytest.approx(1.0)
    assert result["spread"] >= 1.0
