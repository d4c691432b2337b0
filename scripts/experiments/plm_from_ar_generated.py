"""PLM started from a pretrained AR model on the generated language: gap closed, tokens per call and speed against
the source AR as the PLM trains, next to a PLM from scratch at the same total training FLOPs (AR's pretraining
counted).

    python scripts/experiments/plm_from_ar_generated.py --level medium --preset tiny --ar-steps 400 \
        --plm-steps 100 --curve 0 50 100 --encoder-kl-weight 1 --output results/plm_from_ar/generated_medium_tiny.json

An AR model of the preset trains `--ar-steps` on `generated:LEVEL`; a PLM starts from it (`init_from`) and trains
`--plm-steps` (one run, its cosine schedule spanning them), measured at the `--curve` steps: BrierLM-2 gap closed
(exact and nucleus acceptance), tokens per call, and tokens/s against the source AR at batch 1 (alternating pairs).
A PLM from scratch then trains for the FLOPs of AR's pretraining plus the last curve point's PLM steps.
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
from hf_latentlm.eval.flops import training_flops_per_token
from hf_latentlm.eval.optimum import evaluate_against_optimum, evaluation_stream
from hf_latentlm.eval.speed import alternating_speed_ratio
from hf_latentlm.families import build_model
from hf_latentlm.presets import get_preset
from hf_latentlm.training.checkpoint import save_tokenizer
from hf_latentlm.training.loop import TrainConfig, train

DECODINGS = {"exact": {"acceptance": "exact"}, "nucleus": {"acceptance": "nucleus"}}


def gap(optimum: dict) -> dict:
    g = optimum["gap_closed"]["brierlm_2"]
    return {"value": g["value"], "ci_low": g["ci_low"], "ci_high": g["ci_high"]}


def measure(model, source, language, prompts, args, decodings=DECODINGS) -> dict:
    """Gap closed and speed against the source for each decoding of `model` (eval mode; restored by the caller)."""
    model.eval()
    context_len = get_preset(args.preset).seq_len - 4
    row = {}
    for name, options in decodings.items():
        optimum = evaluate_against_optimum(model, language, args.positions, context_len, seed=0,
                                           generate_kwargs=options, likelihood=False)
        speed = alternating_speed_ratio(model, source, prompts, pairs=args.pairs, max_new_tokens=32,
                                        generate_kwargs=options)
        row[name] = {"gap_closed": gap(optimum), "tokens_per_call": speed["model"]["tokens_per_call"],
                     "tokens_per_s": speed["model"]["tokens_per_s"], "source_tokens_per_s":
                     speed["baseline"]["tokens_per_s"], "speed_ratio": speed["ratio"]}
        print(name, json.dumps(row[name]), flush=True)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--level", default="medium")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--ar-steps", type=int, default=400)
    parser.add_argument("--plm-steps", type=int, default=100)
    parser.add_argument("--curve", type=int, nargs="+", default=[0, 50, 100])
    parser.add_argument("--encoder-kl-weight", type=float, default=1.0)
    parser.add_argument("--positions", type=int, default=500, help="BrierLM-2 windows per measurement")
    parser.add_argument("--pairs", type=int, default=2, help="alternating speed pairs per measurement")
    parser.add_argument("--output", default="results/plm_from_ar/generated_medium_tiny.json")
    args = parser.parse_args()
    corpus = f"generated:{args.level}"
    language = parse_corpus(corpus)
    tokenizer = language.tokenizer()
    preset = get_preset(args.preset)
    prompts = evaluation_stream(language, "validation")[:16][None]
    report = {"corpus": corpus, "preset": args.preset, "settings": vars(args), "curve": []}
    with tempfile.TemporaryDirectory() as work:
        source_dir = str(Path(work) / "ar")
        start = time.perf_counter()
        train(TrainConfig(family="ar", preset=args.preset, output_dir=source_dir, max_steps=args.ar_steps,
                          eval_every=0, save_every=args.ar_steps, keep_checkpoints=1, corpus=corpus,
                          progress_bar=False))
        save_tokenizer(tokenizer, source_dir)
        report["ar_train_seconds"] = time.perf_counter() - start
        source = AutoModelForCausalLM.from_pretrained(source_dir).eval()
        context_len = preset.seq_len - 4
        report["source"] = {"gap_closed": gap(evaluate_against_optimum(source, language, args.positions, context_len,
                                                                       seed=0, likelihood=False))}
        print("source AR", json.dumps(report["source"]), flush=True)
        flops = {family: training_flops_per_token(build_model(family, args.preset, tokenizer), preset.seq_len)
                 ["per_token"] for family in ("ar", "plm")}
        tokens_per_step = preset.batch_size * preset.seq_len
        report["flops_per_token"] = flops

        torch.manual_seed(0)
        model = build_model("plm", args.preset, tokenizer, init_from=source_dir)

        def on_step(step, metrics):
            if step in args.curve:
                report["curve"].append({"plm_steps": step, **measure(model, source, language, prompts, args)})
                model.train()

        if 0 in args.curve:
            report["curve"].append({"plm_steps": 0, **measure(model, source, language, prompts, args)})
        train(TrainConfig(family="plm", preset=args.preset, output_dir=str(Path(work) / "plm-from-ar"),
                          max_steps=args.plm_steps, eval_every=0, save_every=args.plm_steps, keep_checkpoints=1,
                          corpus=corpus, progress_bar=False, init_from=source_dir,
                          encoder_kl_weight=args.encoder_kl_weight),
              model=model, tokenizer=tokenizer, on_step=on_step)
        for point in report["curve"]:
            point["total_flops"] = (args.ar_steps * flops["ar"] + point["plm_steps"] * flops["plm"]) * tokens_per_step

        last = max(args.curve)
        scratch_steps = round(args.ar_steps * flops["ar"] / flops["plm"]) + last
        torch.manual_seed(0)
        scratch = build_model("plm", args.preset, tokenizer)
        train(TrainConfig(family="plm", preset=args.preset, output_dir=str(Path(work) / "plm-scratch"),
                          max_steps=scratch_steps, eval_every=0, save_every=scratch_steps, keep_checkpoints=1,
                          corpus=corpus, progress_bar=False), model=scratch, tokenizer=tokenizer)
        report["scratch"] = {"plm_steps": scratch_steps, "total_flops": scratch_steps * flops["plm"] * tokens_per_step,
                             **measure(scratch, source, language, prompts, args)}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    src = report["source"]["gap_closed"]
    print(f"source AR ({args.ar_steps} steps): BrierLM-2 gap closed {100 * src['value']:.1f}% "
          f"[{100 * src['ci_low']:.1f}, {100 * src['ci_high']:.1f}]")
    print("| model | PLM steps | total FLOPs | decoding | gap closed (BrierLM-2) | tokens/call | speed vs source AR |\n"
          "|---|---|---|---|---|---|---|")
    rows = [("PLM from AR", point) for point in report["curve"]] + [("PLM from scratch", report["scratch"])]
    for label, point in rows:
        for name in DECODINGS:
            m = point[name]
            g = m["gap_closed"]
            print(f"| {label} | {point['plm_steps']} | {point['total_flops']:.3g} | {name} | {100 * g['value']:.1f}% "
                  f"[{100 * g['ci_low']:.1f}, {100 * g['ci_high']:.1f}] | {m['tokens_per_call']:.2f} | "
                  f"{m['speed_ratio']:.2f}x |")


if __name__ == "__main__":
    main()
