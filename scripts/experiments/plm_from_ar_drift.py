"""How far a PLM started from a pretrained AR model (`train --family plm --init-from SRC`) lets its encoder drift
from that source during training, with and without the KL term to the frozen source (`--encoder-kl-weight`).

    python scripts/experiments/plm_from_ar_drift.py --preset tiny --ar-steps 300 --plm-steps 150 \
        --kl-weights 0 1 --output results/plm_from_ar/drift_tiny.json

First an AR model of the preset trains on the embedded corpus (`--ar-steps`); then, for each KL weight, a PLM starts
from it and trains `--plm-steps` steps at the preset's learning rate. Every `--every` steps, on the same validation
rows: the encoder's NLL against the source's, KL(source || encoder), and the PLM objective's decoder NLL and R
(reconstructed tokens per block, block phase 0). At the end: tokens per model call of exact and nucleus quadratic
decoding on validation prompts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from hf_latentlm.eval.harness import nll_rows, split_stream
from hf_latentlm.eval.plm import reconstruction, tokens_per_call
from hf_latentlm.eval.sampling import evaluation_windows
from hf_latentlm.families import build_model
from hf_latentlm.modeling.layers import token_nll
from hf_latentlm.presets import get_preset
from hf_latentlm.training.checkpoint import save_tokenizer
from hf_latentlm.training.corpus import load_default_tokenizer
from hf_latentlm.training.encoder_kl import token_kl
from hf_latentlm.training.loop import TrainConfig, train


@torch.no_grad()
def encoder_measures(model, source, rows: torch.Tensor, batch_size: int = 16) -> dict:
    """Encoder NLL of `model` and KL(source || encoder) per token on `rows`, next to the source's NLL."""
    model.eval()
    nll, source_nll, kl = [], [], []
    for start in range(0, len(rows), batch_size):
        batch = rows[start:start + batch_size]
        logits, reference = model(input_ids=batch).logits, source(input_ids=batch).logits
        nll.append(float(token_nll(logits[:, :-1], batch[:, 1:]).mean()))
        source_nll.append(float(token_nll(reference[:, :-1], batch[:, 1:]).mean()))
        kl.append(float(token_kl(logits, reference)))
    return {"encoder_nll": statistics.fmean(nll), "source_nll": statistics.fmean(source_nll),
            "encoder_kl": statistics.fmean(kl)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--ar-steps", type=int, default=300)
    parser.add_argument("--plm-steps", type=int, default=150)
    parser.add_argument("--kl-weights", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--every", type=int, default=25, help="measure every N PLM steps")
    parser.add_argument("--rows", type=int, default=32, help="validation rows measured")
    parser.add_argument("--output", default="results/plm_from_ar/drift_tiny.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    preset = get_preset(args.preset)
    tokenizer = load_default_tokenizer()
    val = split_stream(tokenizer, "validation")
    rows = nll_rows(val, preset.seq_len)[:args.rows]
    prompts, _ = evaluation_windows(val, 8, 32, 1)
    report = {"preset": args.preset, "ar_steps": args.ar_steps, "plm_steps": args.plm_steps,
              "learning_rate": preset.learning_rate, "validation_rows": args.rows, "seq_len": preset.seq_len,
              "runs": {}}
    with tempfile.TemporaryDirectory() as work:
        source_dir = str(Path(work) / "ar")
        start = time.perf_counter()
        train(TrainConfig(family="ar", preset=args.preset, output_dir=source_dir, max_steps=args.ar_steps,
                          eval_every=0, save_every=args.ar_steps, keep_checkpoints=1, progress_bar=False))
        save_tokenizer(tokenizer, source_dir)
        report["ar_train_seconds"] = time.perf_counter() - start
        source = AutoModelForCausalLM.from_pretrained(source_dir).eval()
        for weight in args.kl_weights:
            torch.manual_seed(0)
            model = build_model("plm", args.preset, tokenizer, init_from=source_dir)
            curve = [{"step": 0, **encoder_measures(model, source, rows), **reconstruction(model, rows)}]
            print(f"kl {weight}: {json.dumps(curve[-1])}", flush=True)

            def measure(step, metrics, model=model, curve=curve, weight=weight):
                if step % args.every == 0 or step == args.plm_steps:
                    curve.append({"step": step, **encoder_measures(model, source, rows),
                                  **reconstruction(model, rows)})
                    model.train()
                    print(f"kl {weight}: {json.dumps(curve[-1])}", flush=True)

            start = time.perf_counter()
            train(TrainConfig(family="plm", preset=args.preset, output_dir=str(Path(work) / f"plm-{weight}"),
                              max_steps=args.plm_steps, eval_every=0, save_every=args.plm_steps, keep_checkpoints=1,
                              progress_bar=False, init_from=source_dir, encoder_kl_weight=weight),
                  model=model, tokenizer=tokenizer, on_step=measure)
            seconds = time.perf_counter() - start
            model.eval()
            report["runs"][str(weight)] = {
                "encoder_kl_weight": weight, "train_seconds": seconds, "curve": curve,
                "tokens_per_call_exact": tokens_per_call(model, prompts, 32, acceptance="exact"),
                "tokens_per_call_nucleus": tokens_per_call(model, prompts, 32, acceptance="nucleus")}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    print("| KL weight | step | encoder NLL | source NLL | KL(source‖encoder) | decoder NLL | R |\n|---|---|---|---|---|---|---|")
    for run in report["runs"].values():
        for point in run["curve"]:
            print(f"| {run['encoder_kl_weight']:g} | {point['step']} | {point['encoder_nll']:.3f} | "
                  f"{point['source_nll']:.3f} | {point['encoder_kl']:.4f} | {point['decoder_nll']:.3f} | "
                  f"{point['reconstructed_tokens']:.3f} |")
    for run in report["runs"].values():
        print(f"KL weight {run['encoder_kl_weight']:g}: tokens per call exact {run['tokens_per_call_exact']:.2f}, "
              f"nucleus {run['tokens_per_call_nucleus']:.2f} ({run['train_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
