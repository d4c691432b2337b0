"""Training step time of PLM against the matched AR baseline at one preset, fresh models, one process run, for
several auxiliary settings (N_aux / top-M), with the share of each PLM step spent fitting the auxiliaries.

    python scripts/experiments/plm_step_time.py --preset small --settings 128/32 256/64 512/128
"""

import argparse
import cProfile
import json
import pstats

import torch

from hf_latentlm.eval.harness import nll_rows, split_stream
from hf_latentlm.eval.speed import fresh_training_step_time
from hf_latentlm.families import build_model
from hf_latentlm.presets import get_preset
from hf_latentlm.training.corpus import load_default_tokenizer


def step_time(family: str, preset: str, tokenizer, rows, steps: int, **overrides) -> dict:
    """Training step time of a fresh `family` model of `preset` (seed 0) with config `overrides`, and for PLM the
    share of each step spent fitting the auxiliaries (`auxiliary_owners_share`)."""
    torch.manual_seed(0)
    model = build_model(family, preset, tokenizer, **overrides)
    return fresh_training_step_time(model, rows, steps, get_preset(preset).batch_size,
                                    "auxiliary_owners" if family == "plm" else None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--settings", nargs="+", default=["128/32", "512/128"], help="N_aux/top-M pairs")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    parser.add_argument("--top", type=int, default=0, help="cProfile one more PLM measurement per setting and "
                        "list this many functions by cumulative and by own time")
    args = parser.parse_args()
    tokenizer = load_default_tokenizer()
    rows = nll_rows(split_stream(tokenizer, "train"), get_preset(args.preset).seq_len)
    ar = step_time("ar", args.preset, tokenizer, rows, args.steps)
    print(json.dumps({"ar": ar}), flush=True)
    print("| N_aux / M | PLM s/step | AR s/step | PLM / AR | fit share | fit s/step |\n|---|---|---|---|---|---|")
    for setting in args.settings:
        n_aux, top_m = (int(x) for x in setting.split("/"))
        plm = step_time("plm", args.preset, tokenizer, rows, args.steps, num_auxiliaries=n_aux, auxiliary_top_m=top_m)
        if args.top:
            profiler = cProfile.Profile()
            profiler.runcall(step_time, "plm", args.preset, tokenizer, rows, 1, num_auxiliaries=n_aux,
                             auxiliary_top_m=top_m)
            for key in ("cumulative", "tottime"):
                pstats.Stats(profiler).sort_stats(key).print_stats(args.top)
        share = plm["auxiliary_owners_share"]
        print(f"| {n_aux} / {top_m} | {plm['seconds_per_step']:.2f} | {ar['seconds_per_step']:.2f} | "
              f"{plm['seconds_per_step'] / ar['seconds_per_step']:.2f} | {share:.2f} | "
              f"{share * plm['seconds_per_step']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
