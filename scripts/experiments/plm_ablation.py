"""PLM ablations: auxiliary type (none / quantile / voronoi), representation alignment on / off, and the
auxiliaries read in directly (paper) or through a learned projection.

    python scripts/experiments/plm_ablation.py --preset small --max-steps 80 --output results/plm_ablations/plm_ablation.json

Each variant trains from the same seed on the same data for the same number of steps, then reports
on 64 validation rows: encoder NLL, decoder NLL, R (reconstructed tokens per block), the share of
targets read through the mask auxiliary, and tokens per model call of exact quadratic decoding.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from hf_latentlm.eval.harness import nll_rows, split_stream
from hf_latentlm.eval.plm import reconstruction, tokens_per_call
from hf_latentlm.eval.sampling import evaluation_windows
from hf_latentlm.families import build_model
from hf_latentlm.presets import get_preset
from hf_latentlm.training.corpus import load_default_tokenizer
from hf_latentlm.training.loop import TrainConfig, train

VARIANTS = {
    "voronoi + alignment": {"auxiliary_type": "voronoi"},
    "voronoi + alignment, direct e_u (paper)": {"auxiliary_type": "voronoi", "auxiliary_projection": False},
    "voronoi, no alignment": {"auxiliary_type": "voronoi", "alignment_weight": 0.0},
    "quantile + alignment": {"auxiliary_type": "quantile"},
    "none + alignment": {"auxiliary_type": "none"},
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--max-steps", type=int, default=80)
    parser.add_argument("--output", default="results/plm_ablations/plm_ablation.json")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="which variants to train (default: all)")
    args = parser.parse_args()
    tokenizer = load_default_tokenizer()
    val = split_stream(tokenizer, "validation")
    rows = nll_rows(val, get_preset(args.preset).seq_len)[:64]
    prompts, _ = evaluation_windows(val, 8, 64, 1)
    results = {}
    for name in args.variants:
        overrides = VARIANTS[name]
        torch.manual_seed(0)
        model = build_model("plm", args.preset, tokenizer, **overrides)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as out:
            train(TrainConfig(family="plm", preset=args.preset, output_dir=out, max_steps=args.max_steps,
                              eval_every=0, save_every=args.max_steps, keep_checkpoints=1, progress_bar=False),
                  model=model, tokenizer=tokenizer)
        row = {"train_seconds": time.perf_counter() - start, **reconstruction(model.eval(), rows)}
        if overrides["auxiliary_type"] != "none":
            row["tokens_per_call_exact"] = tokens_per_call(model, prompts, 64)
        results[name] = row
        print(name, json.dumps(row), flush=True)
    report = {"preset": args.preset, "max_steps": args.max_steps,
              "tokens": args.max_steps * get_preset(args.preset).batch_size * get_preset(args.preset).seq_len,
              "variants": results}
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    print("| variant | encoder NLL | decoder NLL | R | mask-aux share | tokens/call (exact) |\n|---|---|---|---|---|---|")
    for name, row in results.items():
        tpc = f"{row['tokens_per_call_exact']:.2f}" if "tokens_per_call_exact" in row else "—"
        print(f"| {name} | {row['encoder_nll']:.3f} | {row['decoder_nll']:.3f} | {row['reconstructed_tokens']:.3f} | "
              f"{row.get('mask_auxiliary_fraction', 0):.3f} | {tpc} |")


if __name__ == "__main__":
    main()
