"""AR vs PLM (k_pred=8, or --k-pred K ...) after SFT on a counting task, batch 1, in one process (first 8 test prompts, as the bench).

    python scripts/experiments/speed_post_training_count.py   # needs runs/count2/{ar,plm}/sft (results/post_training_count)
    python scripts/experiments/speed_post_training_count.py --task count-tens --ar runs/tens/ar/sft --plm runs/tens/plm/sft \
        --repeats 3

With `--repeats N` the timing of each model is taken N times, interleaved (AR, PLM, PLM, AR, ...), and the median
is reported: one timing on a 2-core machine moves by 10-20% with the load.
"""
import argparse
import json
import statistics

from hf_latentlm.eval.task import evaluate_task
from hf_latentlm.loading import load_model_and_tokenizer
from hf_latentlm.training.tasks import load_task

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--task", default="count")
parser.add_argument("--ar", default="runs/count2/ar/sft")
parser.add_argument("--plm", default="runs/count2/plm/sft")
parser.add_argument("--test-size", type=int, default=100)
parser.add_argument("--repeats", type=int, default=1)
parser.add_argument("--k-pred", type=int, nargs="+", default=[8],
                    help="PLM proposal widths timed with exact acceptance (nucleus at the last one)")
args = parser.parse_args()

test = load_task(args.task, split_sizes={"train": 1, "test": args.test_size})["test"]
ar, tokenizer = load_model_and_tokenizer(args.ar)
plm, _ = load_model_and_tokenizer(args.plm)
runs = [("ar", ar, {}), *((f"plm k{k} exact", plm, {"k_pred": k}) for k in args.k_pred),
        (f"plm k{args.k_pred[-1]} nucleus", plm, {"k_pred": args.k_pred[-1], "acceptance": "nucleus"})]
keys = ("accuracy", "mean_answer_tokens", "tokens_per_call_batch_1", "tokens_per_s_batch_1")
timings = {label: [] for label, _, _ in runs}
rows = {}
for repeat in range(args.repeats):
    for label, model, options in (runs if repeat % 2 == 0 else runs[::-1]):
        r = evaluate_task(model, tokenizer, test if repeat == 0 else test.select(range(8)), batch_size=8,
                          speed_prompts=8, generate_kwargs=options)
        timings[label].append(r["tokens_per_s_batch_1"])
        if repeat == 0:
            rows[label] = {k: r[k] for k in keys}
for label, r in rows.items():
    r["tokens_per_s_batch_1"] = statistics.median(timings[label])
    r["tokens_per_s_batch_1_all"] = timings[label]
for label, r in rows.items():
    r["x_ar"] = r["tokens_per_s_batch_1"] / rows["ar"]["tokens_per_s_batch_1"]
print(json.dumps(rows, indent=1))
