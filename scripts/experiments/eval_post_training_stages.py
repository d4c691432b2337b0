"""Exact match of post-training stages on a task's held-out prompts, each with a 95% interval, and each stage's
change over a base stage of the same family as a PAIRED difference (same prompts, same seeds) with its 95% interval;
plus tokens/s at batch 1 and, against the AR model of the same stage name, its ratio and the paired difference in
exact match.

    python scripts/experiments/eval_post_training_stages.py --task count-tens --test-size 298 \
        --model ar:sft=runs/grpo/ar/sft --model ar:grpo=runs/grpo/ar/grpo \
        --model plm:sft=runs/grpo/plm/sft --model plm:grpo=runs/grpo/plm/grpo --base sft \
        --output results/post_training_grpo/grpo.json

Each model answers every test prompt through its own generate() (plain sampling at temperature 1, batch 8, per-row
seeds: `hf_latentlm.eval.task.evaluate_task`); batch-1 speed is the first 8 prompts one at a time, timed once per
model, interleaved in the order given.
"""

from __future__ import annotations

import argparse
import json
import math
import time

from hf_latentlm.eval.task import evaluate_task
from hf_latentlm.loading import load_model_and_tokenizer
from hf_latentlm.training.tasks import load_task, partial_credit

Z95 = 1.959964


def wilson(successes: int, n: int) -> tuple[float, float]:
    """95% Wilson score interval of a proportion."""
    p = successes / n
    centre = (p + Z95 ** 2 / (2 * n)) / (1 + Z95 ** 2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95 ** 2 / (4 * n * n)) / (1 + Z95 ** 2 / n)
    return centre - half, centre + half


def paired_difference(new: list[bool], base: list[bool]) -> dict:
    """Mean of new_i − base_i with a 95% normal interval of the paired differences."""
    d = [float(a) - float(b) for a, b in zip(new, base)]
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1)) if n > 1 else 0.0
    half = Z95 * sd / math.sqrt(n)
    return {"difference": mean, "interval": [mean - half, mean + half], "improved": sum(x > 0 for x in d),
            "worsened": sum(x < 0 for x in d)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", required=True, metavar="FAMILY:STAGE=DIR")
    parser.add_argument("--task", default="count-tens")
    parser.add_argument("--test-size", type=int, default=298)
    parser.add_argument("--base", default="sft", help="the stage every other stage of a family is compared with")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output")
    args = parser.parse_args()

    entries = []
    for spec in args.model:
        label, _, folder = spec.partition("=")
        family, _, stage = label.partition(":")
        entries.append({"family": family, "stage": stage, "folder": folder})
    results = {}
    test = None
    for entry in entries:
        model, tokenizer = load_model_and_tokenizer(entry["folder"])
        if test is None:
            test = load_task(args.task, tokenizer=tokenizer, split_sizes={"train": 1, "test": args.test_size})["test"]
        begin = time.perf_counter()
        result = evaluate_task(model, tokenizer, test, batch_size=8, seed=args.seed)
        correct = result.pop("correct")
        answers = result.pop("answers")
        result["partial_credit"] = sum(map(partial_credit, answers, test["completion"])) / len(answers)
        low, high = wilson(sum(correct), len(correct))
        results[(entry["family"], entry["stage"])] = {**entry, **result, "correct": correct,
                                                      "accuracy_interval": [low, high],
                                                      "seconds": time.perf_counter() - begin}
        print(f"{entry['family']:>6} {entry['stage']:>12}: exact match {result['accuracy']:.3f} "
              f"[{low:.3f}, {high:.3f}], partial credit {result['partial_credit']:.3f}, "
              f"{result['tokens_per_s_batch_1']:.1f} tokens/s at batch 1", flush=True)
    rows = []
    for (family, stage), r in results.items():
        base = results.get((family, args.base))
        ar = results.get(("ar", stage))
        row = {k: v for k, v in r.items() if k != "correct"}
        if base is not None and stage != args.base:
            row["change_over_" + args.base] = paired_difference(r["correct"], base["correct"])
        if ar is not None:
            row["tokens_per_s_vs_ar"] = r["tokens_per_s_batch_1"] / ar["tokens_per_s_batch_1"]
            if family != "ar":  # the same prompts and seeds as the AR model of this stage
                row["change_over_ar"] = paired_difference(r["correct"], ar["correct"])
        rows.append(row)
    print("\n| family | stage | exact match [95%] | change over " + args.base + " [95%] | partial credit | "
          "tokens/s b1 | ×AR |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        change = row.get("change_over_" + args.base)
        change_text = (f"{100 * change['difference']:+.1f} [{100 * change['interval'][0]:+.1f}, "
                       f"{100 * change['interval'][1]:+.1f}]") if change else "—"
        ratio = row.get("tokens_per_s_vs_ar")
        print(f"| {row['family']} | {row['stage']} | {row['accuracy']:.3f} [{row['accuracy_interval'][0]:.3f}, "
              f"{row['accuracy_interval'][1]:.3f}] | {change_text} | {row['partial_credit']:.3f} | "
              f"{row['tokens_per_s_batch_1']:.1f} | "
              f"{'—' if ratio is None else f'{ratio:.2f}'} |")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"task": args.task, "test_size": args.test_size, "base": args.base, "rows": rows,
                       "command": "python scripts/experiments/eval_post_training_stages.py " +
                                  " ".join(f"--model {m}" for m in args.model)}, f, indent=1)


if __name__ == "__main__":
    main()
