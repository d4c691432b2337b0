"""Small CALM measurements quoted in docs/benchmarks.md, each reproducible from here.

    python scripts/calm_probes.py params                       # parameter counts of the `small` CALM
    python scripts/calm_probes.py ae-init --steps 80           # autoencoder: embedding init std 0.02 vs 1.0
    python scripts/calm_probes.py lr --autoencoder runs/calm-ae-small --steps 150   # CALM learning rate / head size
    python scripts/calm_probes.py ae-accuracy runs/calm-ae-small   # accuracy (μ, sampled z) and σ, 20k val tokens
"""

from __future__ import annotations

import argparse
import json

import torch

from hf_latentlm.eval.autoencoder import autoencoder_report
from hf_latentlm.eval.harness import nll_rows, split_stream
from hf_latentlm.families import build_model
from hf_latentlm.training.corpus import load_default_tokenizer
from hf_latentlm.training.loop import TrainConfig, train


def params(args, tokenizer):
    calm = build_model("calm", "small", tokenizer, autoencoder=build_model("calm-ae", "small", tokenizer))
    trainable = sum(p.numel() for p in calm.parameters() if p.requires_grad)
    head = sum(p.numel() for p in calm.energy_head.parameters())
    frozen = sum(p.numel() for p in calm.autoencoder.parameters())
    return {"trainable": trainable, "energy_head": head, "head_share": head / trainable, "frozen_autoencoder": frozen}


def ae_init(args, tokenizer):
    rows = nll_rows(split_stream(tokenizer, "train"), 256)
    validation = split_stream(tokenizer, "validation")[:20000][None]
    result = {}
    for std in (0.02, 1.0):
        torch.manual_seed(0)
        model = build_model("calm-ae", "small", tokenizer, embedding_init_std=std)
        cfg = TrainConfig(family="calm-ae", preset="small", output_dir=f"/tmp/calm-probe-ae-{std}", max_steps=args.steps,
                          eval_every=0, save_every=10**9, progress_bar=False)
        train(cfg, model=model, tokenizer=tokenizer, train_rows=rows)
        result[f"embedding_init_std={std}"] = model.eval().reconstruction_accuracy(
            validation, generator=torch.Generator().manual_seed(0))
    return result


def learning_rate(args, tokenizer):
    result = {}
    for name, lr, blocks in (("lr=1e-3", 1e-3, 1), ("lr=2e-3", 2e-3, 1), ("lr=4e-3", 4e-3, 1),
                             ("lr=2e-3, 2 head blocks", 2e-3, 2)):
        cfg = TrainConfig(family="calm", preset="small", output_dir=f"/tmp/calm-probe-{lr}-{blocks}",
                          max_steps=args.steps, eval_every=args.steps, save_every=10**9, learning_rate=lr,
                          components={"autoencoder": args.autoencoder}, model_kwargs={"num_head_blocks": blocks},
                          progress_bar=False)
        result[name] = train(cfg, tokenizer=tokenizer)["val_loss"]
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("probe", choices=["params", "ae-init", "lr", "ae-accuracy"])
    parser.add_argument("folder", nargs="?", help="ae-accuracy: the autoencoder (or checkpoint) folder")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--autoencoder", default="runs/calm-ae-small")
    args = parser.parse_args()
    if args.probe == "ae-accuracy":
        print(autoencoder_report(args.folder))
        return
    tokenizer = load_default_tokenizer()
    probe = {"params": params, "ae-init": ae_init, "lr": learning_rate}[args.probe]
    print(json.dumps(probe(args, tokenizer), indent=1))


if __name__ == "__main__":
    main()
