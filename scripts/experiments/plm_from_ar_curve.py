"""PLM started from a pretrained AR model: quality, tokens per call and speed against the source AR as the PLM
trains, optionally next to a PLM from scratch at the same total training FLOPs (AR's pretraining counted).

    python scripts/experiments/plm_from_ar_curve.py --corpus generated:medium --preset tiny --ar-steps 400 \
        --curve 0 50 100 --encoder-kl-weight 1 --output runs/plm_from_ar_tiny.json
    python scripts/experiments/plm_from_ar_curve.py --corpus shakespeare --preset small --ar-steps 600 \
        --added-compute 0 0.1 0.25 0.5 --no-scratch --output results/plm_from_ar/shakespeare_small.json

An AR model of the preset trains `--ar-steps` on the corpus; a PLM starts from it (`init_from`) and trains up to the
last curve point (one run, its cosine schedule spanning it), measured at each curve point (`--curve` in PLM steps,
or `--added-compute` as fractions of the AR's training FLOPs): quality with exact and nucleus acceptance, tokens
per call, and tokens/s against the source AR at batch 1 (alternating pairs). Quality is BrierLM-2's share of the
unigram-to-optimum gap on a generated language, BrierLM-2 itself on the embedded corpus. A PLM from scratch then
trains for the FLOPs of AR's pretraining plus the last curve point's PLM steps (unless `--no-scratch`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from hf_latentlm.data.generated import parse_corpus
from hf_latentlm.eval.brier import evaluate_brier
from hf_latentlm.eval.flops import training_flops_per_token
from hf_latentlm.eval.harness import split_stream
from hf_latentlm.eval.optimum import evaluate_against_optimum, evaluation_stream
from hf_latentlm.eval.speed import alternating_speed_ratio
from hf_latentlm.families import build_model
from hf_latentlm.presets import get_preset
from hf_latentlm.training.checkpoint import save_tokenizer
from hf_latentlm.training.corpus import load_default_tokenizer
from hf_latentlm.training.loop import TrainConfig, train

DECODINGS = {"exact": {"acceptance": "exact"}, "nucleus": {"acceptance": "nucleus"}}


def interval(entry: dict) -> dict:
    return {"value": entry["value"], "ci_low": entry["ci_low"], "ci_high": entry["ci_high"]}


class Quality:
    """BrierLM-2's share of the gap to the optimum (a generated language) or BrierLM-2 (the embedded corpus),
    over `positions` evenly spaced validation windows of `context_len` tokens."""

    def __init__(self, corpus: str, tokenizer, positions: int, context_len: int):
        self.language = parse_corpus(corpus)
        self.name = "gap_closed" if self.language is not None else "brierlm_2"
        self.stream = None if self.language is not None else split_stream(tokenizer, "validation")
        self.positions, self.context_len = positions, context_len

    def prompts(self) -> torch.Tensor:
        stream = evaluation_stream(self.language, "validation") if self.language is not None else self.stream
        return stream[:16][None]

    def __call__(self, model, options: dict | None = None) -> dict:
        if self.language is not None:
            result = evaluate_against_optimum(model, self.language, self.positions, self.context_len, seed=0,
                                              generate_kwargs=options, likelihood=False)["gap_closed"]
        else:
            result = evaluate_brier(model, self.stream, self.positions, self.context_len, seed=0,
                                    generate_kwargs=options)
        return interval(result["brierlm_2"])


def measure(model, source, quality: Quality, prompts, args, decodings=DECODINGS) -> dict:
    """Quality and speed against the source for each decoding of `model` (eval mode; restored by the caller)."""
    model.eval()
    row = {}
    for name, options in decodings.items():
        speed = alternating_speed_ratio(model, source, prompts, pairs=args.pairs, max_new_tokens=32,
                                        generate_kwargs=options)
        row[name] = {quality.name: quality(model, options), "tokens_per_call": speed["model"]["tokens_per_call"],
                     "tokens_per_s": speed["model"]["tokens_per_s"], "source_tokens_per_s":
                     speed["baseline"]["tokens_per_s"], "speed_ratio": speed["ratio"]}
        print(name, json.dumps(row[name]), flush=True)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default="generated:medium", help="generated:LEVEL or shakespeare")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--ar-steps", type=int, default=400)
    parser.add_argument("--curve", type=int, nargs="+", default=[0, 50, 100], help="PLM steps to measure at")
    parser.add_argument("--added-compute", type=float, nargs="+", default=None,
                        help="measure where the PLM's training FLOPs reach these fractions of the AR's (instead of "
                             "--curve)")
    parser.add_argument("--encoder-kl-weight", type=float, default=1.0)
    parser.add_argument("--positions", type=int, default=500, help="BrierLM-2 windows per measurement")
    parser.add_argument("--context-len", type=int, default=None, help="default: min(128, the preset's seq_len - 4)")
    parser.add_argument("--pairs", type=int, default=2, help="alternating speed pairs per measurement")
    parser.add_argument("--no-scratch", action="store_true", help="skip the PLM from scratch")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    preset = get_preset(args.preset)
    language = parse_corpus(args.corpus)
    tokenizer = language.tokenizer() if language is not None else load_default_tokenizer()
    context_len = args.context_len or min(128, preset.seq_len - 4)
    quality = Quality(args.corpus, tokenizer, args.positions, context_len)
    prompts = quality.prompts()
    flops = {family: training_flops_per_token(build_model(family, args.preset, tokenizer), preset.seq_len)
             ["per_token"] for family in ("ar", "plm")}
    if args.added_compute is not None:
        args.curve = [round(f * args.ar_steps * flops["ar"] / flops["plm"]) for f in args.added_compute]
    report = {"corpus": args.corpus, "preset": args.preset, "context_len": context_len, "settings": vars(args),
              "flops_per_token": flops, "curve": []}
    tokens_per_step = preset.batch_size * preset.seq_len
    with tempfile.TemporaryDirectory() as work:
        source_dir = str(Path(work) / "ar")
        start = time.perf_counter()
        train(TrainConfig(family="ar", preset=args.preset, output_dir=source_dir, max_steps=args.ar_steps,
                          eval_every=0, save_every=args.ar_steps, keep_checkpoints=1, corpus=args.corpus,
                          progress_bar=False))
        save_tokenizer(tokenizer, source_dir)
        report["ar_train_seconds"] = time.perf_counter() - start
        source = AutoModelForCausalLM.from_pretrained(source_dir).eval()
        report["source"] = {quality.name: quality(source)}
        print("source AR", json.dumps(report["source"]), flush=True)

        torch.manual_seed(0)
        model = build_model("plm", args.preset, tokenizer, init_from=source_dir)
        start = time.perf_counter()

        def on_step(step, metrics):
            if step in args.curve:
                report["curve"].append({"plm_steps": step, **measure(model, source, quality, prompts, args)})
                model.train()

        if 0 in args.curve:
            report["curve"].append({"plm_steps": 0, **measure(model, source, quality, prompts, args)})
        last = max(args.curve)
        if last:
            train(TrainConfig(family="plm", preset=args.preset, output_dir=str(Path(work) / "plm-from-ar"),
                              max_steps=last, eval_every=0, save_every=last, keep_checkpoints=1,
                              corpus=args.corpus, progress_bar=False, init_from=source_dir,
                              encoder_kl_weight=args.encoder_kl_weight),
                  model=model, tokenizer=tokenizer, on_step=on_step)
        report["plm_train_and_measure_seconds"] = time.perf_counter() - start
        for point in report["curve"]:
            point["total_flops"] = (args.ar_steps * flops["ar"] + point["plm_steps"] * flops["plm"]) * tokens_per_step
            point["added_compute"] = point["plm_steps"] * flops["plm"] / (args.ar_steps * flops["ar"])

        if not args.no_scratch:
            scratch_steps = round(args.ar_steps * flops["ar"] / flops["plm"]) + last
            torch.manual_seed(0)
            scratch = build_model("plm", args.preset, tokenizer)
            train(TrainConfig(family="plm", preset=args.preset, output_dir=str(Path(work) / "plm-scratch"),
                              max_steps=scratch_steps, eval_every=0, save_every=scratch_steps, keep_checkpoints=1,
                              corpus=args.corpus, progress_bar=False), model=scratch,
                  tokenizer=tokenizer)
            report["scratch"] = {"plm_steps": scratch_steps,
                                 "total_flops": scratch_steps * flops["plm"] * tokens_per_step,
                                 **measure(scratch, source, quality, prompts, args)}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    print(table(report, quality.name))


def formatted(name: str, entry: dict) -> str:
    scale, unit = (100, "%") if name == "gap_closed" else (1, "")
    return f"{scale * entry['value']:.1f}{unit} [{scale * entry['ci_low']:.1f}, {scale * entry['ci_high']:.1f}]"


def table(report: dict, name: str) -> str:
    lines = [f"source AR ({report['settings']['ar_steps']} steps): {name} {formatted(name, report['source'][name])}",
             f"| model | PLM steps | added compute | decoding | {name} | tokens/call | speed vs source AR |",
             "|---|---|---|---|---|---|---|"]
    rows = [("PLM from AR", point) for point in report["curve"]]
    if "scratch" in report:
        rows.append(("PLM from scratch", report["scratch"]))
    for label, point in rows:
        added = f"{100 * point['added_compute']:.0f}%" if "added_compute" in point else "(all)"
        for decoding in DECODINGS:
            m = point[decoding]
            lines.append(f"| {label} | {point['plm_steps']} | {added} | {decoding} | {formatted(name, m[name])} | "
                         f"{m['tokens_per_call']:.2f} | {m['speed_ratio']:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
