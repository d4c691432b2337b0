"""How fast the `small` AURORA autoencoder learns to copy: the paper's shared query against our residual copy path
(`query_residual`), each with the paper's dropouts (token 0.3 / latent 0.6) and the lighter 0.1 / 0.2.

    OMP_NUM_THREADS=1 python scripts/experiments/aurora_ae_dropout_probe.py --steps 100 --eval-at 25,50,100

Each variant trains with the preset's rows and batch (16 × 256 tokens of the embedded corpus's train split) and
learning rate (AdamW, betas 0.9 / 0.95, constant after nothing: the probe measures learning speed, not a schedule),
seed 0; at every `--eval-at` step it measures the eval-mode reconstruction accuracy of the first 20,000 validation
tokens in rows of 256 (`eval.components.autoencoder_accuracy`). Decoding the standardised latent gives the same
tokens: standardisation is an invertible per-channel affine map the denoiser's side undoes before decoding. Writes
`results.json` and prints the Markdown table of docs/families/aurora.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hf_latentlm.eval.bench import markdown_table
from hf_latentlm.eval.components import autoencoder_accuracy
from hf_latentlm.eval.harness import nll_rows, split_stream
from hf_latentlm.families import build_model
from hf_latentlm.presets import get_preset
from hf_latentlm.training.corpus import load_default_tokenizer

FORMS = {"shared": False, "residual": True}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--forms", default="shared,residual")
    p.add_argument("--dropouts", default="0.1/0.2,0.3/0.6", help="token/latent dropout pairs")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval-at", default="25,50,100,200")
    p.add_argument("--output", default="runs/aurora-ae-copy")
    return p.parse_args()


def main():
    args = parse_args()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    preset = get_preset("small")
    tokenizer = load_default_tokenizer()
    rows = nll_rows(split_stream(tokenizer, "train"), preset.seq_len)
    validation = split_stream(tokenizer, "validation")
    eval_at = {int(s) for s in args.eval_at.split(",")}
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else {}
    for form in args.forms.split(","):
        for pair in args.dropouts.split(","):
            name = f"{form} {pair}"
            if name in results:
                continue
            token_dropout, latent_dropout = (float(x) for x in pair.split("/"))
            torch.manual_seed(0)
            model = build_model("aurora-ae", "small", tokenizer, query_residual=FORMS[form],
                                token_dropout=token_dropout, latent_dropout=latent_dropout)
            optimizer = torch.optim.AdamW(model.parameters(), lr=preset.learning_rate, betas=(0.9, 0.95))
            generator = torch.Generator().manual_seed(0)
            curve, start = {}, time.perf_counter()
            model.train()
            for step in range(1, args.steps + 1):
                ids = rows[torch.randint(0, len(rows), (preset.batch_size,), generator=generator)]
                model(ids, labels=ids).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if step in eval_at:
                    curve[str(step)] = autoencoder_accuracy(model, validation, 20_000, preset.seq_len)["accuracy"]
                    model.train()
                    print(f"{name} step {step}: {curve[str(step)]:.4f} ({time.perf_counter() - start:.0f} s)", flush=True)
            results[name] = {"form": form, "token_dropout": token_dropout, "latent_dropout": latent_dropout,
                             "accuracy": curve, "seconds": time.perf_counter() - start}
            (out / "results.json").write_text(json.dumps(results, indent=1))
    steps = sorted({int(s) for r in results.values() for s in r["accuracy"]})
    print(markdown_table(["query", "dropout (token / latent)", *[f"step {s}" for s in steps], "seconds"],
                         [[r["form"], f"{r['token_dropout']:g} / {r['latent_dropout']:g}",
                           *[f"{100 * r['accuracy'][str(s)]:.1f}%" if str(s) in r["accuracy"] else "—"
                             for s in steps],
                           f"{r['seconds']:.0f}"] for r in results.values()]))


if __name__ == "__main__":
    main()
