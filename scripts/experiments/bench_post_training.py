"""Post-training benchmark (issue 13): SFT then DPO of every given model on one task, AR included, in ONE run.

    python scripts/experiments/bench_post_training.py --model ar=runs/ar-small-120 --model plm=runs/plm-small \
        --out runs/post --sft-steps 300 --dpo-steps 60 --dpo-pairs 400 --test-size 100 \
        --output results/post_training_verse_repeat/post_training.json

A stage whose output folder already holds a finished model is reused and an interrupted one resumes, so a long run
can be split over several sessions; `--sft-only` stops after SFT.

For each model: exact-match accuracy on the task's held-out split, mean answer length, batch-1 tokens per call and
tokens/s (`hf_latentlm.eval.task.evaluate_task`) before SFT, after SFT (`run_sft`, full fine-tune), after DPO
(`run_dpo`, length-normalised: TRL's `sigmoid_norm` for AR, the family's normalised score otherwise), after the
unnormalised DPO ablation (`loss_type=["sigmoid"]`, from the same SFT model) and, with `--policy-rejections`, after
both DPO runs again on pairs whose rejected answers are the SFT model's own wrong samples. The DPO reward-margin curve is read
from the trainer's log. A family's `speed_variants` (PLM: nucleus acceptance) are evaluated after every stage too.
Speed ratios are to the model labelled `ar`, measured in this process on the same prompts. Writes JSON and prints
Markdown.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from hf_latentlm.eval.task import evaluate_task
from hf_latentlm.families import family_of_model_type
from hf_latentlm.loading import load_model_and_tokenizer
from hf_latentlm.recipes import run_dpo, run_sft
from hf_latentlm.training.checkpoint import latest_checkpoint
from hf_latentlm.training.tasks import DEFAULT_TASK, load_task


def evaluate_folder(folder: str, test, args) -> dict:
    """Every decoding variant of the model in `folder` on the test split."""
    model, tokenizer = load_model_and_tokenizer(folder)
    spec = family_of_model_type(model.config.model_type)
    variants = {"default": {}, **(dict(spec.speed_variants) if spec is not None else {})}
    if spec is not None:
        variants.update({label: options for (family, label), options in args.variant.items() if family == spec.name})
    report = {}
    for label, options in variants.items():
        result = evaluate_task(model, tokenizer, test, batch_size=args.batch_size, seed=args.seed,
                               speed_prompts=args.speed_prompts, generate_kwargs=dict(options))
        report[label] = result
        print(f"  {folder} [{label}]: accuracy {result['accuracy']:.3f}, answer {result['mean_answer_tokens']:.1f} "
              f"tokens, {result['tokens_per_call_batch_1']:.2f} tokens/call, "
              f"{result['tokens_per_s_batch_1']:.1f} tokens/s (b1)", flush=True)
    return report


def margin_curve(folder: str) -> list[dict]:
    log = json.loads((Path(folder) / "post_training_log.json").read_text())
    keys = ("step", "loss", "rewards/margins", "rewards/accuracies", "rewards/chosen", "rewards/rejected")
    return [{k: entry[k] for k in keys if k in entry} for entry in log if "rewards/margins" in entry]


def train_stage(run, model_dir: str, output_dir: str, **kwargs) -> dict:
    """`run_sft` / `run_dpo` into `output_dir`, or its summary when a finished model is already there (the bench is
    resumable stage by stage: a finished stage is reused, an interrupted one resumes from its newest checkpoint)."""
    log_path = Path(output_dir) / "post_training_log.json"
    if log_path.exists():
        log = json.loads(log_path.read_text())
        losses = [entry["loss"] for entry in log if "loss" in entry]
        steps = max((entry.get("step", 0) for entry in log), default=0)
        print(f"  {output_dir}: finished earlier ({steps} steps), reused", flush=True)
        return {"output_dir": output_dir, "steps": steps, "losses": losses, "reused": True}
    t = time.perf_counter()
    summary = run(model_dir, output_dir, resume=latest_checkpoint(output_dir) is not None, **kwargs)
    summary["seconds"] = time.perf_counter() - t
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", required=True, help="LABEL=DIR (the AR baseline as ar=DIR)")
    parser.add_argument("--out", required=True, help="folder for the SFT / DPO checkpoints")
    parser.add_argument("--task", default=DEFAULT_TASK)
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--dpo-steps", type=int, default=60)
    parser.add_argument("--sft-examples", type=int, default=2000)
    parser.add_argument("--dpo-pairs", type=int, default=400)
    parser.add_argument("--test-size", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--sft-batch-size", type=int, default=None, help="SFT examples per step (default: --batch-size)")
    parser.add_argument("--speed-prompts", type=int, default=8)
    parser.add_argument("--sft-learning-rate", type=float, default=None)
    parser.add_argument("--dpo-learning-rate", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="results/post_training_verse_repeat/post_training.json")
    parser.add_argument("--sft-only", action="store_true", help="stop after SFT and its evaluation (no DPO)")
    parser.add_argument("--policy-rejections", action="store_true",
                        help="two more DPO runs (normalised and not) whose rejected answers are the SFT model's own "
                             "wrong samples (run_dpo(policy_rejections=True))")
    parser.add_argument("--variant", action="append", default=[], metavar="FAMILY:LABEL=JSON",
                        help='extra generate() options evaluated for every model of FAMILY, e.g. '
                             '\'plm:k8 nucleus={"k_pred": 8, "acceptance": "nucleus"}\'')
    args = parser.parse_args()
    try:
        args.variant = {tuple(name.split(":", 1)): json.loads(options)
                        for name, options in (v.split("=", 1) for v in args.variant)}
        if any(len(key) != 2 for key in args.variant):
            raise ValueError("no FAMILY: before the label")
    except ValueError as error:
        parser.error(f"--variant takes FAMILY:LABEL=JSON: {error}")
    models = dict(m.split("=", 1) for m in args.model)
    started = time.perf_counter()
    test = load_task(args.task, split_sizes={"train": 1, "test": args.test_size}, seed=args.seed)["test"]
    variants = {f"{family}:{label}": options for (family, label), options in args.variant.items()}
    results = {"settings": {**vars(args), "variant": variants}, "models": {}}
    for label, folder in models.items():
        out = Path(args.out) / label
        stage = {"base": folder, "sft": str(out / "sft"), "dpo": str(out / "dpo"),
                 "dpo_unnormalised": str(out / "dpo-unnormalised"), "dpo_policy": str(out / "dpo-policy"),
                 "dpo_policy_unnormalised": str(out / "dpo-policy-unnormalised")}
        record = {"folders": stage, "evaluation": {}, "training": {}}
        print(f"== {label}: before post-training", flush=True)
        record["evaluation"]["base"] = evaluate_folder(folder, test, args)
        record["training"]["sft"] = train_stage(run_sft, folder, stage["sft"], task=args.task,
                                                max_steps=args.sft_steps, seed=args.seed, train_size=args.sft_examples,
                                                learning_rate=args.sft_learning_rate,
                                                batch_size=args.sft_batch_size or args.batch_size)
        print(f"== {label}: after SFT ({args.sft_steps} steps)", flush=True)
        record["evaluation"]["sft"] = evaluate_folder(stage["sft"], test, args)
        dpo_runs = [("dpo", "sigmoid_norm", False), ("dpo_unnormalised", "sigmoid", False)]
        if args.policy_rejections:
            dpo_runs += [("dpo_policy", "sigmoid_norm", True), ("dpo_policy_unnormalised", "sigmoid", True)]
        for name, loss_type, policy_rejections in ([] if args.sft_only else dpo_runs):
            record["training"][name] = train_stage(run_dpo, stage["sft"], stage[name], task=args.task,
                                                   max_steps=args.dpo_steps, seed=args.seed, train_size=args.dpo_pairs,
                                                   learning_rate=args.dpo_learning_rate, batch_size=args.batch_size,
                                                   loss_type=[loss_type], logging_steps=5,
                                                   policy_rejections=policy_rejections)
            record["training"][name]["margin_curve"] = margin_curve(stage[name])
            print(f"== {label}: after {name} ({args.dpo_steps} steps)", flush=True)
            record["evaluation"][name] = evaluate_folder(stage[name], test, args)
        results["models"][label] = record
        results["seconds"] = time.perf_counter() - started
        Path(args.output).write_text(json.dumps(results, indent=1) + "\n")  # after every model: nothing is lost
    print(markdown(results))


def markdown(results: dict) -> str:
    baseline = results["models"].get("ar")
    lines = ["| model | decoding | stage | accuracy | answer tokens | tokens/call b1 | tokens/s b1 | ×AR tokens/s |",
             "|---|---|---|---|---|---|---|---|"]
    for label, record in results["models"].items():
        for stage, variants in record["evaluation"].items():
            for variant, r in variants.items():
                ratio = "—"
                if baseline is not None and stage in baseline["evaluation"]:
                    ar = baseline["evaluation"][stage]["default"]["tokens_per_s_batch_1"]
                    ratio = f"{r['tokens_per_s_batch_1'] / ar:.2f}"
                lines.append(f"| {label} | {variant} | {stage} | {r['accuracy']:.3f} | {r['mean_answer_tokens']:.1f} | "
                             f"{r['tokens_per_call_batch_1']:.2f} | {r['tokens_per_s_batch_1']:.1f} | {ratio} |")
    lines += ["", "| model | DPO | step | loss | margin | reward accuracy |", "|---|---|---|---|---|---|"]
    for label, record in results["models"].items():
        for name, summary in record["training"].items():
            for point in summary.get("margin_curve", []):
                lines.append(f"| {label} | {name} | {point.get('step')} | {point.get('loss', float('nan')):.4f} | "
                             f"{point['rewards/margins']:.4f} | {point.get('rewards/accuracies', float('nan')):.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
