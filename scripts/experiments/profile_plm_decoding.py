"""Where one quadratic-decoding call of PLM spends its time, next to an AR step, batch 1, one process run.

    python scripts/experiments/profile_plm_decoding.py --plm runs/plm-small --ar runs/ar-small [--acceptance nucleus]
        [--k-pred N] [--task count --new-tokens 48] [--compile]

Times `generate()` of both models on the same prompt (a 64-token validation prompt, or with `--task` the first
test prompt of that post-training task; 128 new tokens, EOS ignored, median of 3 after a warm-up) and splits the PLM time per call into the Voronoi fit (`auxiliary_owners`), the network forward and the
rest (auxiliary lookup, acceptance, cache and state bookkeeping); then prints a cProfile of one PLM run, top
functions by cumulative and by own time. With `--compile` both decode compiled (`decoding_compile_config`; AR with
transformers' static cache, as `hf-latentlm bench --compile`), after one untimed compiling run each; the forward is
then not timed apart (compiled decoding replaces it for the call), only the fit.
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


def timed_generate(model, prompt, new_tokens: int, repeats: int = 3, **kwargs) -> dict:
    fit, forward = [0.0], [0.0]
    runs = []
    warmups = 2 if "compile_config" in kwargs else 1  # compiled: the static graphs, then the dynamic ones
    for attempt in range(repeats + warmups):
        fit[0] = forward[0] = 0.0
        torch.manual_seed(0)
        with (timing_method(model, "auxiliary_owners", fit) if hasattr(model, "auxiliary_owners") else
              nullcontext()), (nullcontext() if "compile_config" in kwargs else
                               timing_method(model, "forward", forward)), CallCounter(model) as calls:
            start = time.perf_counter()
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, eos_token_id=None, **kwargs)
            total = time.perf_counter() - start
        if attempt >= warmups:
            runs.append((total, fit[0], forward[0], calls.calls))
    total, fit_s, forward_s, calls = (statistics.median(r[i] for r in runs) for i in range(4))
    return {"ms_per_call": 1e3 * total / calls, "fit_ms_per_call": 1e3 * fit_s / calls,
            "forward_ms_per_call": 1e3 * forward_s / calls, "calls": calls, "tokens_per_call": new_tokens / calls,
            "tokens_per_s": new_tokens / total}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plm", required=True)
    parser.add_argument("--ar", required=True)
    parser.add_argument("--acceptance", default="nucleus")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--k-pred", type=int, default=None, help="PLM proposal width (default: the config's)")
    parser.add_argument("--task", default=None, help="prompt: the first test prompt of this post-training task")
    parser.add_argument("--compile", action="store_true", help="both models decode compiled (no cProfile)")
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
    with torch.no_grad():
        ar_row = timed_generate(ar.eval(), prompt, args.new_tokens, do_sample=True, top_k=0, top_p=1.0, **ar_options)
        plm_row = timed_generate(plm.eval(), prompt, args.new_tokens, **plm_options)
    plm_row["call_cost_in_ar_steps"] = plm_row["ms_per_call"] / ar_row["ms_per_call"]
    plm_row["fit_share_of_call"] = plm_row["fit_ms_per_call"] / plm_row["ms_per_call"]
    if not args.compile:
        plm_row["forward_cost_in_ar_steps"] = plm_row["forward_ms_per_call"] / ar_row["ms_per_call"]
    plm_row["speed_vs_ar"] = plm_row["tokens_per_s"] / ar_row["tokens_per_s"]
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
