"""Where one quadratic-decoding call of PLM spends its time, next to an AR step, batch 1, one process run.

    python scripts/experiments/profile_plm_decoding.py --plm runs/plm-small --ar runs/ar-small [--acceptance nucleus]
        [--k-pred N] [--task count --new-tokens 48] [--compile] [--breakdown]

Times `generate()` of both models on the same prompt (a 64-token validation prompt, or with `--task` the first
test prompt of that post-training task; 128 new tokens, EOS ignored): `--repeats` alternating AR/PLM runs after a
warm-up, medians, and the ratio PLM call / AR step per pair. Splits the PLM time per call into the Voronoi fit
(`VoronoiSampler.decoding_cells`), the network forward and the rest (auxiliary lookup, acceptance, cache and state
bookkeeping); then prints a cProfile of one PLM run, top functions by cumulative and by own time.

With `--compile` both decode compiled (`decoding_compile_config`; AR with transformers' static cache, as
`hf-latentlm bench --compile`), after two untimed compiling runs each; the forward is then not timed apart (compiled
decoding replaces it for the call), only the fit. `--breakdown` adds one torch.profiler run per model, its self time
per call split into matmul, attention, compiled kernels, guard checks and the rest (`CATEGORIES`; profiled times run
~10% above the plain timing).
"""

import argparse
import cProfile
import json
import pstats
import statistics
import time
from contextlib import nullcontext

import torch

from hf_latentlm.eval.harness import split_stream
from hf_latentlm.eval.speed import CallCounter, decoding_compile_config, timing_method
from hf_latentlm.loading import load_model_and_tokenizer
from hf_latentlm.training.tasks import load_task


def timed_run(model, prompt, new_tokens: int, **kwargs) -> tuple[float, float, float, int]:
    """Wall seconds of one generate(), of its Voronoi fits and (eager only) of its forwards, and its model calls."""
    fit, forward = [0.0], [0.0]
    torch.manual_seed(0)
    with (timing_method(model.auxiliary_sampler, "decoding_cells", fit) if hasattr(model, "auxiliary_sampler") else
          nullcontext()), (nullcontext() if "compile_config" in kwargs else
                           timing_method(model, "forward", forward)), CallCounter(model) as calls:
        start = time.perf_counter()
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, eos_token_id=None, **kwargs)
        total = time.perf_counter() - start
    return total, fit[0], forward[0], calls.calls


def summary(runs: list[tuple], new_tokens: int) -> dict:
    total, fit_s, forward_s, calls = (statistics.median(r[i] for r in runs) for i in range(4))
    return {"ms_per_call": 1e3 * total / calls, "fit_ms_per_call": 1e3 * fit_s / calls,
            "forward_ms_per_call": 1e3 * forward_s / calls, "calls": calls, "tokens_per_call": new_tokens / calls,
            "tokens_per_s": new_tokens / total}


def timed_pair(ar, plm, prompt, new_tokens: int, repeats: int, ar_options: dict, plm_options: dict) -> tuple:
    """`summary` of AR and of PLM, timed alternately (AR, PLM, AR, PLM, ...) after warm-ups, and the median and
    range of the per-pair ratio PLM call / AR step. Alternating matters: on a shared machine the AR step, bound by
    reading the weights, drifts by up to 2x between minutes, and a ratio of two separate medians takes that in."""
    warmups = 2 if "compile_config" in plm_options else 1  # compiled: the static graphs, then the dynamic ones
    for _ in range(warmups):
        timed_run(ar, prompt, new_tokens, **ar_options)
        timed_run(plm, prompt, new_tokens, **plm_options)
    ar_runs, plm_runs = [], []
    for _ in range(repeats):
        ar_runs.append(timed_run(ar, prompt, new_tokens, **ar_options))
        plm_runs.append(timed_run(plm, prompt, new_tokens, **plm_options))
    ratios = sorted((p[0] / p[3]) / (a[0] / a[3]) for a, p in zip(ar_runs, plm_runs))
    return (summary(ar_runs, new_tokens), summary(plm_runs, new_tokens),
            {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]})


# Operator-level split of a decoding call (torch.profiler self times): the matrix products and attention are the
# arithmetic; the compiled graphs' own time is their fused elementwise kernels; the guard checks and everything else
# (eager ops, Python) are overhead.
CATEGORIES = {"matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear"),
              "attention": ("aten::_scaled_dot_product",),
              "compiled kernels": ("## Call CompiledFxGraph",),
              "dynamo guards": ("TorchDynamo Cache Lookup",)}


def operator_breakdown(model, prompt, new_tokens: int, calls: int, **kwargs) -> dict:
    """ms per model call by `CATEGORIES` (self CPU time of one profiled generate()), and "other"."""
    from torch.profiler import profile

    torch.manual_seed(0)
    with profile() as prof:
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, eos_token_id=None, **kwargs)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    split = {name: sum(e.self_cpu_time_total for e in events if e.key.startswith(prefixes))
             for name, prefixes in CATEGORIES.items()}
    split["other"] = total - sum(split.values())
    return {f"{name}_ms_per_call": 1e-3 * us / calls for name, us in split.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plm", required=True)
    parser.add_argument("--ar", required=True)
    parser.add_argument("--acceptance", default="nucleus")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--k-pred", type=int, default=None, help="PLM proposal width (default: the config's)")
    parser.add_argument("--task", default=None, help="prompt: the first test prompt of this post-training task")
    parser.add_argument("--compile", action="store_true", help="both models decode compiled (no cProfile)")
    parser.add_argument("--repeats", type=int, default=5, help="timed AR/PLM pairs after the warm-ups")
    parser.add_argument("--breakdown", action="store_true",
                        help="also split one profiled run per model into matmul, attention, compiled kernels, guards")
    parser.add_argument("--top", type=int, default=25, help="functions listed by cumulative time (0: no cProfile)")
    args = parser.parse_args()
    plm, tokenizer = load_model_and_tokenizer(args.plm)
    ar, _ = load_model_and_tokenizer(args.ar)
    if args.task is None:
        prompt = split_stream(tokenizer, "validation")[:64][None]
    else:
        text = load_task(args.task, split_sizes={"test": 1}, tokenizer=tokenizer)["test"][0]["prompt"]
        prompt = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    options = {"acceptance": args.acceptance, **({} if args.k_pred is None else {"k_pred": args.k_pred})}
    ar_options, plm_options = {}, dict(options)
    if args.compile:
        compile_config = decoding_compile_config(prompt.device)
        ar_options = {"compile_config": compile_config, "cache_implementation": "static"}
        plm_options["compile_config"] = compile_config
        args.top = 0
    ar_options.update(do_sample=True, top_k=0, top_p=1.0)
    with torch.no_grad():
        ar_row, plm_row, ratio = timed_pair(ar.eval(), plm.eval(), prompt, args.new_tokens, args.repeats,
                                            ar_options, plm_options)
    plm_row["call_cost_in_ar_steps"] = ratio  # per alternating pair: median, min, max
    plm_row["fit_share_of_call"] = plm_row["fit_ms_per_call"] / plm_row["ms_per_call"]
    if not args.compile:
        plm_row["forward_cost_in_ar_steps"] = plm_row["forward_ms_per_call"] / ar_row["ms_per_call"]
    plm_row["speed_vs_ar"] = plm_row["tokens_per_s"] / ar_row["tokens_per_s"]
    if args.breakdown:
        with torch.no_grad():
            ar_row["profiled"] = operator_breakdown(ar, prompt, args.new_tokens, ar_row["calls"], **ar_options)
            plm_row["profiled"] = operator_breakdown(plm, prompt, args.new_tokens, plm_row["calls"], **plm_options)
    label = ", ".join([*(f"{k}={v}" for k, v in options.items()), *(["compiled"] if args.compile else [])])
    print(json.dumps({"ar": ar_row, f"plm ({label})": plm_row}, indent=1))
    if args.top:
        # One more PLM run under cProfile: torch ops show as builtins, so their tottime is arithmetic (plus the
        # per-op dispatch) and the rest of a function's cumulative time is Python overhead.
        profiler = cProfile.Profile()
        with torch.no_grad():
            profiler.enable()
            plm.generate(prompt, max_new_tokens=args.new_tokens, eos_token_id=None, **options)
            profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.top)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
