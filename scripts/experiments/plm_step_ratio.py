"""PLM's training step over AR's, steps alternated (AR, PLM, AR, PLM, ...), saved models, one process run.

    python scripts/experiments/plm_step_ratio.py --ar runs/untrained/ar --plm runs/plm-small [--steps 6]

Each model is a copy with a fresh AdamW (`make_optimizer`), trained on consecutive `small` batches (16 x 256 rows of
the train split); one warm-up step each, then `--steps` timed pairs. Prints the median step of each, the median and
range of the per-pair ratio PLM / AR, and the mean share of a PLM step spent fitting the auxiliaries
(`auxiliary_owners`). Alternating matters on a shared machine: the speed of the same step drifts by ±10-25% between
minutes, and a ratio of two medians taken minutes apart takes that drift in.
"""

import argparse
import copy
import json
import statistics
import time

import torch

from hf_latentlm.eval.harness import nll_rows, split_stream
from hf_latentlm.eval.speed import timing_method
from hf_latentlm.loading import load_model_and_tokenizer
from hf_latentlm.presets import get_preset
from hf_latentlm.training.loop import TrainConfig, make_optimizer


def trainable_copy(folder: str):
    model, tokenizer = load_model_and_tokenizer(folder)
    torch.manual_seed(0)
    model = copy.deepcopy(model).train()
    return model, make_optimizer(model, TrainConfig().resolved()), tokenizer


def timed_step(model, optimizer, batch) -> float:
    start = time.perf_counter()
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ar", required=True)
    parser.add_argument("--plm", required=True)
    parser.add_argument("--preset", default="small", help="batch size and row length of the steps")
    parser.add_argument("--steps", type=int, default=6, help="timed AR/PLM pairs, after one warm-up step each")
    args = parser.parse_args()
    preset = get_preset(args.preset)
    ar, ar_optimizer, tokenizer = trainable_copy(args.ar)
    plm, plm_optimizer, _ = trainable_copy(args.plm)
    rows = nll_rows(split_stream(tokenizer, "train"), preset.seq_len)
    batches = rows[:(args.steps + 1) * preset.batch_size].split(preset.batch_size)
    if len(batches) < args.steps + 1 or len(batches[-1]) < preset.batch_size:
        raise SystemExit(f"the train split has too few rows for {args.steps + 1} batches of {preset.batch_size}")
    ar_times, plm_times, fit_shares = [], [], []
    fit = [0.0]
    with timing_method(plm, "auxiliary_owners", fit):
        for i, batch in enumerate(batches):
            ar_seconds = timed_step(ar, ar_optimizer, batch)
            fit[0] = 0.0
            plm_seconds = timed_step(plm, plm_optimizer, batch)
            if i:  # the first pair is the warm-up
                ar_times.append(ar_seconds)
                plm_times.append(plm_seconds)
                fit_shares.append(fit[0] / plm_seconds)
    ratios = sorted(p / a for a, p in zip(ar_times, plm_times))
    print(json.dumps({
        "ar_seconds_per_step": statistics.median(ar_times), "plm_seconds_per_step": statistics.median(plm_times),
        "plm_over_ar": {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]},
        "plm_fit_share": statistics.fmean(fit_shares), "steps": args.steps,
        "batch": [preset.batch_size, preset.seq_len]}, indent=1))


if __name__ == "__main__":
    main()
