"""The post-training task `count-tens` through lm-evaluation-harness (`hf-latentlm` model), next to the project's own
harness (`eval.task.evaluate_task`, results/post_training_grpo/post_training_grpo.json) on the same 298 test
prompts: does lm-eval give the same exact match?

Writes the task (its documents as JSONL, a YAML, and a small module whose `process_results` is the project's
`tasks.exact_match`) into a temporary folder, then runs `lm_eval.simple_evaluate` with only that folder indexed.
Decoding as in the project's harness (`eval.task.PLAIN_SAMPLING`): sampling at temperature 1 from the whole
distribution (top_k 0, top_p 1), until end of text, room for the longest reference
plus 8 tokens. The seeds differ (lm-eval's per-request seeds, the harness's seed + row), so the two measure the same
accuracy with independent draws: compare the intervals.

    python scripts/experiments/lm_eval_count_tens.py --model ar:grpo-4e-5=runs/grpo/ar/grpo-4e-5 ... \
        --reference results/post_training_grpo/post_training_grpo.json \
        --output results/lm_eval_count_tens/lm_eval_count_tens.json
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

TASK = "latentlm_count_tens"
DOCS_MODULE = '''import json
from pathlib import Path

import datasets

from hf_latentlm.training.tasks import exact_match


def load(**metadata):
    lines = (Path(__file__).parent / "count_tens.jsonl").read_text().splitlines()
    return {"test": datasets.Dataset.from_list([json.loads(line) for line in lines])}


def process_results(doc, results):
    return {"exact_match": float(exact_match(results[0], doc["response"]))}
'''
YAML = f'''task: {TASK}
custom_dataset: !function count_tens_docs.load
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{response}}}}"
process_results: !function count_tens_docs.process_results
generation_kwargs:
  until: ["<|endoftext|>"]
  do_sample: true
  temperature: 1.0
  top_k: 0
  top_p: 1.0
  max_gen_toks: MAX_GEN_TOKS
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
'''


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", required=True, metavar="FAMILY:STAGE=DIR")
    parser.add_argument("--test-size", type=int, default=298)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--reference", help="eval_post_training_stages.py JSON with the same folders' accuracies")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()

    import lm_eval
    from lm_eval.tasks import TaskManager

    import hf_latentlm.eval.lm_eval  # noqa: F401  (registers the "hf-latentlm" model)
    from hf_latentlm.training.tasks import load_default_tokenizer, load_task

    tokenizer = load_default_tokenizer()
    test = load_task("count-tens", tokenizer=tokenizer, split_sizes={"train": 1, "test": args.test_size})["test"]
    # As eval.task.evaluate_task: room for the longest reference answer and its end-of-text token, plus 8.
    max_gen = max(len(tokenizer(r, add_special_tokens=False)["input_ids"]) for r in test["completion"]) + 8
    reference = {}
    if args.reference:
        for row in json.loads(Path(args.reference).read_text())["rows"]:
            reference[row["folder"]] = row
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        with open(Path(folder) / "count_tens.jsonl", "w") as f:
            for doc in test:
                f.write(json.dumps({"prompt": doc["prompt"], "response": doc["response"]}) + "\n")
        (Path(folder) / "count_tens_docs.py").write_text(DOCS_MODULE)
        (Path(folder) / f"{TASK}.yaml").write_text(YAML.replace("MAX_GEN_TOKS", str(max_gen)))
        manager = TaskManager(include_path=folder, include_defaults=False)
        for spec in args.model:
            label, _, model_dir = spec.partition("=")
            family, _, stage = label.partition(":")
            begin = time.perf_counter()
            out = lm_eval.simple_evaluate(model="hf-latentlm", model_args=f"pretrained={model_dir}", tasks=[TASK],
                                          task_manager=manager, batch_size=args.batch_size, device="cpu")
            accuracy = out["results"][TASK]["exact_match,none"]
            n = len(test)
            low, high = wilson(round(accuracy * n), n)
            row = {"family": family, "stage": stage, "folder": model_dir, "lm_eval_exact_match": accuracy,
                   "lm_eval_interval": [low, high], "num_examples": n, "seconds": time.perf_counter() - begin}
            own = reference.get(model_dir)
            if own is not None:
                row["own_harness_exact_match"] = own["accuracy"]
                row["own_harness_interval"] = own["accuracy_interval"]
                # Unpaired (independent draws): difference and its normal-approximation 95% interval.
                diff = accuracy - own["accuracy"]
                se = math.sqrt(accuracy * (1 - accuracy) / n + own["accuracy"] * (1 - own["accuracy"]) / n)
                row["difference"] = diff
                row["difference_interval"] = [diff - 1.96 * se, diff + 1.96 * se]
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(args.output).write_text(json.dumps({"task": "count-tens", "test_size": args.test_size,
                                             "max_gen_toks": max_gen, "rows": rows,
                                             "command": "python scripts/experiments/lm_eval_count_tens.py " +
                                             " ".join(f"--model {m}" for m in args.model) +
                                             (f" --reference {args.reference}" if args.reference else "") +
                                             f" --output {args.output}"}, indent=2) + "\n")


if __name__ == "__main__":
    main()
