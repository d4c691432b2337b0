"""cProfile of training steps of saved models (a copy each, fresh optimizer, `small` batches), top functions by
cumulative and by own time: where a family's step spends the time its counted FLOPs do not explain
(results/training_flops/).

    python scripts/experiments/profile_training_step.py --model ar=runs/real-small/ar-x1 --model plm=... --top 15
"""

import argparse
import copy
import cProfile
import io
import pstats

import torch

from hf_latentlm.eval.harness import nll_rows, split_stream
from hf_latentlm.loading import load_model_and_tokenizer
from hf_latentlm.presets import get_preset
from hf_latentlm.training.loop import TrainConfig, make_optimizer


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", required=True, metavar="NAME=DIR")
    parser.add_argument("--preset", default="small", help="batch size and row length of the steps")
    parser.add_argument("--steps", type=int, default=2, help="profiled steps, after one warm-up step")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    preset = get_preset(args.preset)
    for spec in args.model:
        name, _, folder = spec.partition("=")
        model, tokenizer = load_model_and_tokenizer(folder)
        rows = nll_rows(split_stream(tokenizer, "train"), preset.seq_len)
        torch.manual_seed(0)
        model = copy.deepcopy(model).train()
        optimizer = make_optimizer(model, TrainConfig().resolved())

        def step(batch):
            model(input_ids=batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step(rows[:preset.batch_size])  # warm-up
        profiler = cProfile.Profile()
        profiler.enable()
        for i in range(1, args.steps + 1):
            step(rows[i * preset.batch_size:(i + 1) * preset.batch_size])
        profiler.disable()
        for order in ("cumulative", "tottime"):
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats(order).print_stats(args.top)
            text = out.getvalue()
            print(f"=== {name} ({folder}): {args.steps} steps of {preset.batch_size}x{preset.seq_len}, by {order} ===")
            print(text[text.index("ncalls"):].rstrip() if "ncalls" in text else text)


if __name__ == "__main__":
    main()
