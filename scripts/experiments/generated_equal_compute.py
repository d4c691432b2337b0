"""Every family at equal training compute with AR on a generated language, measured as a fraction of the optimum.

One process per comparison: the components (CALM's and AURORA's autoencoders, Cola's VAE) are trained first on
the same language, then each family at `multiplier × AR's training FLOPs` (FLOPs per token from
`eval.flops.training_flops_per_token`, the same batch and row length as AR, so the step count carries the budget),
then every model is evaluated against the optimum on the same validation windows. Finished entries (a model
folder with `optimum.json`) are kept, so a rerun after an interruption continues.

    python scripts/experiments/generated_equal_compute.py --level medium --ar-steps 400 \
        --families ar,plm,calm,cola,aurora --multipliers 1 --output runs/generated-medium

writes `runs/generated-medium/results.json` and prints the Markdown table (results/generated_equal_compute/).

`--corpus shakespeare` trains the same budgets on the embedded corpus and writes the runs' budgets only (no
optimum exists there): `hf-latentlm report` then measures the models (results/equal_compute_report/report/).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from hf_latentlm.data.generated import parse_corpus
from hf_latentlm.eval.bench import format_ci, markdown_table
from hf_latentlm.eval.flops import training_flops_per_token
from hf_latentlm.eval.harness import split_stream
from hf_latentlm.eval.optimum import evaluate_against_optimum, percent_interval
from hf_latentlm.families import build_model, get_family
from hf_latentlm.loading import load_model_and_tokenizer
from hf_latentlm.training.corpus import load_default_tokenizer
from hf_latentlm.training.loop import TrainConfig, train


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--level", default="medium")
    p.add_argument("--corpus", help="'shakespeare' for the embedded corpus (default: generated:LEVEL)")
    p.add_argument("--preset", default="small")
    p.add_argument("--ar-steps", type=int, default=400, help="AR's optimizer steps: the 1x budget")
    p.add_argument("--families", default="ar,plm,calm,cola,aurora")
    p.add_argument("--multipliers", default="1", help="budgets as multiples of AR's training FLOPs, e.g. 1,4")
    p.add_argument("--component-steps", type=int, default=200, help="steps of each component (autoencoder, VAE)")
    p.add_argument("--positions", type=int, default=4000, help="evaluation windows")
    p.add_argument("--context-len", type=int, default=128)
    p.add_argument("--config", action="append", default=[], metavar="FAMILY:KEY=VALUE",
                   help="a config override for one family (JSON value), e.g. cola:cfg_scale=3")
    p.add_argument("--decoding", action="append", default=[], metavar="FAMILY:JSON",
                   help="also evaluate FAMILY's models with these generate() options, e.g. "
                        "'cola:{\"guidance_scale\": 1.0}' (repeatable)")
    p.add_argument("--pairs", type=int, default=2, help="pairs of model draws per evaluation window")
    p.add_argument("--tag", default="", help="suffix of the run folders (a recipe variant)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="runs/generated-medium")
    return p.parse_args()


def overrides_for(family: str, items: list[str]) -> dict:
    out = {}
    for item in items:
        name, _, assignment = item.partition(":")
        if name == family:
            key, _, value = assignment.partition("=")
            try:
                out[key] = json.loads(value)
            except json.JSONDecodeError:
                out[key] = value
    return out


def decodings_for(family: str, items: list[str]) -> list[dict]:
    return [json.loads(item.partition(":")[2]) for item in items if item.partition(":")[0] == family]


def run_training(cfg: TrainConfig, folder: Path) -> dict:
    """Train unless the folder already holds the finished model; the seconds it took and its last metrics."""
    done = folder / "train_record.json"
    if done.is_file():
        return json.loads(done.read_text())
    start = time.perf_counter()
    metrics = train(cfg)
    record = {"seconds": time.perf_counter() - start, "metrics": metrics, "max_steps": cfg.max_steps}
    done.write_text(json.dumps(record, indent=1))
    return record


def main():
    args = parse_args()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    corpus = args.corpus or f"generated:{args.level}"
    language = parse_corpus(corpus)
    tokenizer = language.tokenizer() if language is not None else load_default_tokenizer()
    families = args.families.split(",")
    multipliers = [float(m) for m in args.multipliers.split(",")]
    seq_len, batch_size = 256, 16  # the small preset's; every family trains on the same rows per step

    component_folders, component_records = {}, {}
    for family in families:
        for name, source in get_family(family).components.items():
            if source in component_folders:
                continue
            folder = out / source
            cfg = TrainConfig(family=source, preset=args.preset, output_dir=str(folder), max_steps=args.component_steps,
                              eval_every=args.component_steps, save_every=args.component_steps, keep_checkpoints=1,
                              corpus=corpus, seed=args.seed, progress_bar=False)
            record = run_training(cfg, folder)
            model, _ = load_model_and_tokenizer(str(folder), language_model=False)
            flops = training_flops_per_token(model, seq_len)["per_token"]
            record.update(flops_per_token=flops, train_flops=flops * args.component_steps * batch_size * seq_len)
            component_folders[source], component_records[source] = str(folder), record
            print(f"component {source}: {record['seconds']:.0f} s, val_loss {record['metrics'].get('val_loss')}")

    def components_of(family):
        return {name: component_folders[source] for name, source in get_family(family).components.items()}

    flops_per_token = {}
    for family in dict.fromkeys(["ar", *families]):  # AR's FLOPs set the budget even when it is not run
        model = build_model(family, args.preset, tokenizer, **components_of(family), **overrides_for(family, args.config))
        flops_per_token[family] = training_flops_per_token(model, seq_len)["per_token"]
        del model
    ar_flops = flops_per_token["ar"] * args.ar_steps * batch_size * seq_len
    print("training FLOPs per token:", {k: f"{v:.3g}" for k, v in flops_per_token.items()})

    results = {"corpus": corpus, "language": language.record() if language is not None else None,
               "train_split_tokens": None if language is not None else split_stream(tokenizer, "train").numel(), "preset": args.preset, "ar_steps": args.ar_steps,
               "ar_train_flops": ar_flops, "flops_per_token": flops_per_token, "components": component_records,
               "settings": vars(args), "runs": {}}
    if (out / "results.json").is_file():  # runs of earlier invocations on the same folder (other multipliers)
        results["runs"] = json.loads((out / "results.json").read_text())["runs"]
    for multiplier in multipliers:
        for family in families:
            steps = max(1, round(multiplier * ar_flops / (flops_per_token[family] * batch_size * seq_len)))
            name = f"{family}-x{multiplier:g}{args.tag}"
            folder = out / name
            cfg = TrainConfig(family=family, preset=args.preset, output_dir=str(folder), max_steps=steps,
                              eval_every=max(1, steps // 4), save_every=max(1, steps // 4), keep_checkpoints=1,
                              corpus=corpus, seed=args.seed, progress_bar=False, components=components_of(family),
                              model_kwargs=overrides_for(family, args.config))
            record = run_training(cfg, folder)
            if language is None:  # no optimum to measure against: the report evaluates these folders
                results["runs"][name] = {"family": family, "multiplier": multiplier, "steps": steps, "folder": str(folder),
                                         "train_tokens": steps * batch_size * seq_len,
                                         "train_flops": steps * batch_size * seq_len * flops_per_token[family],
                                         "train_seconds": record["seconds"], "val_loss": record["metrics"].get("val_loss")}
                print(f"{name}: {steps} steps, {record['seconds']:.0f} s, val_loss {record['metrics'].get('val_loss')}",
                      flush=True)
                (out / "results.json").write_text(json.dumps(results, indent=1))
                continue
            decodings = {"": {}, **{json.dumps(options, sort_keys=True): options
                                    for options in decodings_for(family, args.decoding)}}
            for label, options in decodings.items():
                optimum_file = folder / f"optimum{'-' + label if label else ''}.json"
                if optimum_file.is_file():
                    optimum = json.loads(optimum_file.read_text())
                else:
                    model, _ = load_model_and_tokenizer(str(folder))
                    start = time.perf_counter()
                    optimum = evaluate_against_optimum(model.eval(), language, args.positions, args.context_len,
                                                       seed=args.seed, pairs=args.pairs, generate_kwargs=options)
                    optimum["eval_seconds"] = time.perf_counter() - start
                    optimum_file.write_text(json.dumps(optimum, indent=1))
                    del model
                row_name = f"{name} {label}" if label else name
                results["runs"][row_name] = {
                    "family": family, "multiplier": multiplier, "steps": steps, "decoding": options,
                    "train_tokens": steps * batch_size * seq_len,
                    "train_flops": steps * batch_size * seq_len * flops_per_token[family],
                    "train_seconds": record["seconds"], "val_loss": record["metrics"].get("val_loss"),
                    "optimum": optimum}
                gap = optimum["gap_closed"]["brierlm_2"]
                print(f"{row_name}: {steps} steps, {record['seconds']:.0f} s, BrierLM-2 gap closed "
                      f"{percent_interval(gap)}", flush=True)
                (out / "results.json").write_text(json.dumps(results, indent=1))
    print(results_table(results) if language is not None else budget_table(results))


def budget_table(results: dict) -> str:
    """One row per run of the embedded corpus: steps, tokens, epochs of the train split, training FLOPs and their
    ratio to AR's, seconds, final validation loss (the report measures the models)."""
    train_tokens = results["train_split_tokens"]
    head = ["run", "steps", "tokens", "epochs", "training FLOPs", "× AR", "train s", "val loss (own objective)"]
    rows = [[name, r["steps"], f"{r['train_tokens'] / 1e6:.2f}M", f"{r['train_tokens'] / train_tokens:.2f}",
             f"{r['train_flops']:.3g}", f"{r['train_flops'] / results['ar_train_flops']:.3f}",
             f"{r['train_seconds']:.0f}", f"{r['val_loss']:.3f}" if r["val_loss"] is not None else "—"]
            for name, r in results["runs"].items()]
    components = ", ".join(f"{name} {c['train_flops']:.3g} FLOPs ({100 * c['train_flops'] / results['ar_train_flops']:.0f}% "
                           f"of AR's budget, {c['seconds']:.0f} s)" for name, c in results["components"].items())
    return markdown_table(head, rows) + f"\nComponents, trained once before (not in the runs' FLOPs): {components}.\n"


def results_table(results: dict) -> str:
    """One row per run: budget, time, BrierLM-2 of model / truth / unigram, gap closed, ratio to AR's gap."""
    ar_gap = {r["multiplier"]: r["optimum"]["gap_closed"]["brierlm_2"]["value"]
              for r in results["runs"].values() if r["family"] == "ar"}
    head = ["run", "steps", "train FLOPs", "train s", "BrierLM-2", "gap closed BrierLM-2", "gap closed Brier-1",
            "÷ AR 1× gap", "NLL excess / KL"]
    rows = []
    for name, r in results["runs"].items():
        o = r["optimum"]
        gap = o["gap_closed"]
        lk = o.get("likelihood")
        rows.append([name, r["steps"], f"{r['train_flops']:.3g}", f"{r['train_seconds']:.0f}",
                     format_ci(o["model"]["brierlm_2"], 2), percent_interval(gap["brierlm_2"]), percent_interval(gap["brier_1"]),
                     f"{gap['brierlm_2']['value'] / ar_gap[1]:.2f}" if ar_gap.get(1) else "—",
                     f"{lk['excess_nll']:.3f} / {lk['kl']:.3f}" if lk else "—"])
    any_run = next(iter(results["runs"].values()))["optimum"]
    note = (f"\nTrue language BrierLM-2 {format_ci(any_run['true']['brierlm_2'], 2)}, unigram "
            f"{format_ci(any_run['unigram']['brierlm_2'], 2)} (same windows). Components, trained once before "
            f"(not in the runs' FLOPs): " + ", ".join(f"{name} {100 * c['train_flops'] / results['ar_train_flops']:.0f}% "
                                                      f"of AR's 1× budget" for name, c in results["components"].items())
            + ".\n")
    return markdown_table(head, rows) + note


if __name__ == "__main__":
    main()
