"""How well AURORA denoisers predict the clean latent block, at fixed noise levels, on validation rows.

    python scripts/experiments/aurora_denoising_probe.py --model base=runs/aurora-abl-base --model no-stc=runs/aurora-abl-no-stc \
        [--rows 32] [--sigmas 0.1,0.3,0.5,0.7,0.9] [--output results/aurora_vs_ar/aurora_denoising_probe.json]

For every model and σ: one dual-stream pass over validation rows (every block noised to σ with the same ε for every
model, its clean history visible, a zero self-conditioning draft), then
- x0 MSE: mean over positions and channels of (ẑ − z)² in the standardised latent space (the same measure whatever
  the model's `loss_space`; predicting 0 scores about 1);
- token accuracy: the frozen autoencoder's argmax read-out of ẑ against the row's tokens (its read-out of z itself is
  the ceiling, reported as `autoencoder`).
A measure of the trained field that does not go through sampling, so ablations of short runs can be compared even
while their samples are not yet text. Models must share one autoencoder.

With `--generate-steps 4,8,16,32`, also few-step sampling: each model continues `--rows` validation prefixes of 64
tokens by one block through `generate()` (fixed noise seeds per row, shared by every model and step count; the
config's guidance; argmax read-out) at each step count, and the report gives the share of generated tokens equal to
the true continuation (`match_truth`) and to the model's own output at the most steps (`match_most_steps`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hf_latentlm.loading import load_model_and_tokenizer
from hf_latentlm.training.corpus import load_corpus_documents
from hf_latentlm.training.data import token_stream


@torch.no_grad()
def probe(model, rows: torch.Tensor, sigmas: list[float], seed: int) -> dict:
    autoencoder = model.model.autoencoder
    raw = autoencoder.encode(rows)
    z = autoencoder.standardize(raw)
    noise = torch.randn(z.shape, generator=torch.Generator().manual_seed(seed))
    report = {"autoencoder": (autoencoder.decode_logits(raw).argmax(-1) == rows).float().mean().item()}
    length = rows.shape[1]
    for sigma in sigmas:
        level = torch.full(rows.shape, sigma)
        _, latents, timesteps, noisy, positions, mask = model.dual_stream_inputs(z, level, noise)
        draft = None if model.model.denoiser.self_condition_proj is None else torch.zeros_like(latents)
        x0 = model.predict_x0(latents, timesteps, noisy, draft, mask, positions)[:, length:]
        tokens = autoencoder.decode_logits(autoencoder.unstandardize(x0)).argmax(-1)
        report[f"sigma={sigma}"] = {"x0_mse": (x0 - z).pow(2).mean().item(),
                                    "token_accuracy": (tokens == rows).float().mean().item()}
    return report


@torch.no_grad()
def few_step_sampling(model, rows: torch.Tensor, step_counts: list[int], prefix: int = 64) -> dict:
    block = model.config.block_size
    prompts, truth = rows[:, :prefix], rows[:, prefix:prefix + block]
    seeds = list(range(len(rows)))
    outputs = {s: model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=block,
                                 num_inference_steps=s, noise_seeds=seeds, eos_token_id=None)[:, prefix:]
               for s in step_counts}
    most = outputs[max(step_counts)]
    return {str(s): {"match_truth": (out == truth).float().mean().item(),
                     "match_most_steps": (out == most).float().mean().item()} for s, out in outputs.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", required=True, help="LABEL=DIR")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--sigmas", default="0.1,0.3,0.5,0.7,0.9")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--generate-steps", default="", help="e.g. 4,8,16,32: few-step sampling as well")
    parser.add_argument("--output", default="results/aurora_vs_ar/aurora_denoising_probe.json")
    args = parser.parse_args()
    sigmas = [float(s) for s in args.sigmas.split(",")]
    results = {"settings": vars(args), "models": {}}
    rows = None
    for label, folder in (m.split("=", 1) for m in args.model):
        model, tokenizer = load_model_and_tokenizer(folder)
        model.eval()
        if rows is None:
            stream = token_stream(load_corpus_documents("validation"), tokenizer)
            rows = stream[: args.rows * args.seq_len].view(args.rows, args.seq_len)
        results["models"][label] = probe(model, rows, sigmas, args.seed)
        if args.generate_steps:
            steps = [int(s) for s in args.generate_steps.split(",")]
            results["models"][label]["sampling"] = few_step_sampling(model, rows, steps)
    Path(args.output).write_text(json.dumps(results, indent=1) + "\n")
    mse_columns = " | ".join(f"x0 MSE σ={s}" for s in sigmas)
    accuracy_columns = " | ".join(f"tokens σ={s}" for s in sigmas)
    print(f"| model | AE read-out of z | {mse_columns} | {accuracy_columns} |")
    print("|---|---|" + "---|" * (2 * len(sigmas)))
    for label, r in results["models"].items():
        mse = " | ".join(f"{r[f'sigma={s}']['x0_mse']:.3f}" for s in sigmas)
        acc = " | ".join(f"{100 * r[f'sigma={s}']['token_accuracy']:.1f}%" for s in sigmas)
        print(f"| {label} | {100 * r['autoencoder']:.1f}% | {mse} | {acc} |")
    if args.generate_steps:
        print("\n| model | steps | tokens equal to the true continuation | tokens equal to the most-steps output |")
        print("|---|---|---|---|")
        for label, r in results["models"].items():
            for steps, m in r["sampling"].items():
                print(f"| {label} | {steps} | {100 * m['match_truth']:.1f}% | {100 * m['match_most_steps']:.1f}% |")


if __name__ == "__main__":
    main()
