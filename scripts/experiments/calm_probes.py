"""Small CALM measurements quoted in results/calm_vs_ar/, results/calm_equal_compute/ and in tests, each
reproducible from here.

    python scripts/experiments/calm_probes.py params                       # parameter counts of the `small` CALM, both heads
    python scripts/experiments/calm_probes.py ae-init --steps 80           # autoencoder: embedding init std 0.02 vs 1.0
    python scripts/experiments/calm_probes.py ae-recipe --steps 1500       # autoencoder: this project's recipe vs the reference's
    python scripts/experiments/calm_probes.py ae-recipe --trained project=runs/calm-ae-small --trained reference=runs/calm-ae-ref
                                                               # the same accuracies for autoencoders already trained
    python scripts/experiments/calm_probes.py lr --autoencoder runs/calm-ae-small --steps 150   # CALM learning rate / head size
    python scripts/experiments/calm_probes.py heads --autoencoder runs/calm-ae-small --steps 600  # energy heads × 1, 2, 4 blocks
    python scripts/experiments/calm_probes.py ae-accuracy runs/calm-ae-small   # accuracy (μ, sampled z) and σ, 20k val tokens
    python scripts/experiments/calm_probes.py context-spread runs/calm-small-600 [more folders]   # does the backbone use context?
    python scripts/experiments/calm_probes.py pool-bias                    # pool sampler vs p^(1/T)/Σ on known laws (no model)
    python scripts/experiments/calm_probes.py flops                        # FLOPs/token (inference, training): AR vs CALM small,
                                                               # and CALM backbones within AR small's FLOPs
"""

from __future__ import annotations

import argparse
import json

import torch

from hf_latentlm.eval.components import calm_autoencoder_report
from hf_latentlm.eval.brier import evaluate_brier
from hf_latentlm.eval.harness import nll_rows, split_stream
from hf_latentlm.families import build_model
from hf_latentlm.loading import load_model_and_tokenizer
from hf_latentlm.modeling.configuration_calm import ENERGY_HEAD_TYPES, REFERENCE_AUTOENCODER_RECIPE
from hf_latentlm.modeling.energy import pool_temperature_choice
from hf_latentlm.modeling.modeling_calm import context_spread, energy_head_parameter_count
from hf_latentlm.training.corpus import load_default_tokenizer
from hf_latentlm.training.loop import TrainConfig, train


def params(args, tokenizer):
    ae = build_model("calm-ae", "small", tokenizer)
    result = {}
    for head_type in ENERGY_HEAD_TYPES:
        calm = build_model("calm", "small", tokenizer, autoencoder=ae, energy_head_type=head_type)
        trainable = sum(p.numel() for p in calm.parameters() if p.requires_grad)
        head = sum(p.numel() for p in calm.energy_head.parameters())
        result[head_type] = {"trainable": trainable, "energy_head": head, "head_share": head / trainable,
                             "head_formula": energy_head_parameter_count(calm.config),
                             "frozen_autoencoder": sum(p.numel() for p in calm.autoencoder.parameters())}
    return result


def train_autoencoder(tokenizer, rows, steps: int, name: str, **overrides):
    torch.manual_seed(0)
    model = build_model("calm-ae", "small", tokenizer, **overrides)
    cfg = TrainConfig(family="calm-ae", preset="small", output_dir=f"/tmp/calm-probe-ae-{name}", max_steps=steps,
                      eval_every=0, save_every=10**9, progress_bar=False)
    train(cfg, model=model, tokenizer=tokenizer, train_rows=rows)
    return model.eval()


def ae_init(args, tokenizer):
    rows = nll_rows(split_stream(tokenizer, "train"), 256)
    validation = split_stream(tokenizer, "validation")[:20000][None]
    result = {}
    for std in (0.02, 1.0):
        model = train_autoencoder(tokenizer, rows, args.steps, str(std), embedding_init_std=std)
        result[f"embedding_init_std={std}"] = model.reconstruction_accuracy(
            validation, generator=torch.Generator().manual_seed(0))
    return result


@torch.no_grad()
def seen_unseen_accuracy(model, tokens: torch.Tensor, seen_ids: torch.Tensor) -> dict:
    """Token accuracy decoding a sampled z, split by whether the token id occurs in the training rows."""
    chunks = tokens[: tokens.numel() // model.config.chunk_size * model.config.chunk_size].view(
        -1, model.config.chunk_size)
    mean, log_std = model.encode(chunks)
    noise = torch.randn(mean.shape, generator=torch.Generator().manual_seed(0))
    correct = model.decode(mean + log_std.exp() * noise) == chunks
    seen = torch.isin(chunks, seen_ids)
    return {"seen_accuracy": correct[seen].float().mean().item(), "seen_tokens": int(seen.sum()),
            "unseen_accuracy": correct[~seen].float().mean().item() if (~seen).any() else None,
            "unseen_tokens": int((~seen).sum()), "all_accuracy": correct.float().mean().item()}


def ae_recipe(args, tokenizer):
    """This project's autoencoder recipe (2 + 2 blocks per side, N(0, 1) embeddings, random replacement ids) vs the
    reference's (1 + 1, std 0.02, replacement id 0); accuracy from a sampled z on the whole validation split, on
    token ids that occur in the train split and on those that do not (runs of ≥ 1 epoch see every train row).
    `--trained NAME=DIR` (repeatable): measure those trained autoencoders instead of training two here."""
    rows = nll_rows(split_stream(tokenizer, "train"), 256)
    validation = split_stream(tokenizer, "validation")
    seen_ids = rows.unique()
    if args.trained:
        models = {name: load_model_and_tokenizer(folder, language_model=False)[0].eval()
                  for name, folder in (item.split("=", 1) for item in args.trained)}
    else:
        recipes = {"project": {}, "reference": REFERENCE_AUTOENCODER_RECIPE}
        models = {name: train_autoencoder(tokenizer, rows, args.steps, name, **overrides)
                  for name, overrides in recipes.items()}
    return {name: seen_unseen_accuracy(model, validation, seen_ids) for name, model in models.items()}


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


def heads(args, tokenizer):
    """Each energy head type with 1, 2 and 4 blocks at `small`, same data and schedule: validation energy loss and
    BrierLM-2 (T = 1) on `--positions` validation positions."""
    stream = split_stream(tokenizer, "validation")
    result = {}
    for head_type in ENERGY_HEAD_TYPES:
        for blocks in (1, 2, 4):
            torch.manual_seed(0)
            model = build_model("calm", "small", tokenizer, autoencoder=args.autoencoder,
                                energy_head_type=head_type, num_head_blocks=blocks)
            cfg = TrainConfig(family="calm", preset="small", output_dir=f"/tmp/calm-probe-{head_type}-{blocks}",
                              max_steps=args.steps, eval_every=args.steps, save_every=10**9, progress_bar=False,
                              components={"autoencoder": args.autoencoder})
            val_loss = train(cfg, model=model, tokenizer=tokenizer)["val_loss"]
            brier = evaluate_brier(model.eval(), stream, num_positions=args.positions)
            result[f"{head_type}, {blocks} block(s)"] = {
                "val_energy_loss": val_loss, "brierlm_2": brier["brierlm_2"],
                "head_parameters": sum(p.numel() for p in model.energy_head.parameters())}
    return result


@torch.no_grad()
def hidden_state_spread(folder: str, rows: int = 32, length: int = 64) -> dict:
    """How much the backbone's hidden states differ between positions: for each recorded hidden state (the chunk
    embeddings, then after each layer; the last one is after the final norm, what the energy head reads), the
    spread that CALM's training logs (`modeling_calm.context_spread`: feature-wise standard deviation over
    positions, averaged over features) over `rows` × `length`/K validation positions, and the RMS. A last-layer
    spread near 0 at RMS 1 means every position hands the head the same vector: the model ignores its context."""
    model, tokenizer = load_model_and_tokenizer(folder)
    ids = split_stream(tokenizer, "validation")[: rows * length].view(rows, length)
    states = model.eval()(input_ids=ids, output_hidden_states=True).hidden_states
    every_step = torch.ones(states[0].shape[:2], dtype=torch.bool)
    return {"spread_over_positions": [round(context_spread(h, every_step).item(), 4) for h in states],
            "rms": [round(h.pow(2).mean().sqrt().item(), 2) for h in states]}


def pool_bias(args, tokenizer=None):
    """Law of the pool sampler against the tempered law p^(1/T)/Σ for a fake model with a known categorical law:
    the largest |frequency − target| over outcomes (pool bias + sampling error, whose sd is given)."""
    gen = torch.Generator().manual_seed(0)
    laws = {"6 outcomes": torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], dtype=torch.float64),
            "p=0.05 + 950 × 0.001": torch.cat([torch.tensor([0.05]), torch.full((950,), 0.001)]).double()}
    result = {}
    for law_name, p in laws.items():
        for size in (64, 200, 256, 1024):
            pools = 100000 if size <= 256 else 20000
            draws = torch.multinomial(p.float().expand(pools, -1), size, replacement=True, generator=gen)[..., None]
            for temperature in (0.8, 0.6, 0.5, 0.3):
                picked = pool_temperature_choice(draws, temperature, torch.rand(pools, generator=gen,
                                                                                 dtype=torch.float64))
                outcome = draws[torch.arange(pools), picked, 0]
                freq = torch.bincount(outcome, minlength=len(p)).double() / pools
                target = p ** (1 / temperature)
                target /= target.sum()
                result[f"{law_name}, pool {size}, T={temperature}"] = {
                    "max_abs_deviation": (freq - target).abs().max().item(),
                    "first_outcome": [freq[0].item(), target[0].item()],
                    "sampling_sd": (target * (1 - target) / pools).sqrt().max().item(), "pools": pools}
    return result


def _calm_backbone(hidden: int, layers: int) -> dict:
    """Backbone overrides for a CALM of width `hidden` and depth `layers`, shaped like the presets: head dim 64, two
    query heads per kv head, SwiGLU width 2.625·hidden (small's 672 / 256) rounded to a multiple of 32. The energy
    head keeps small's single block (its width is the backbone's, by construction)."""
    heads = hidden // 64
    return {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": max(1, heads // 2), "intermediate_size": round(hidden * 2.625 / 32) * 32,
            "num_head_blocks": 1}


def flops(args, tokenizer):
    """FLOPs per token counted with torch's FlopCounterMode (hf_latentlm/eval/flops.py): inference at a context of
    `--context` tokens (batch 1, T = 1) and one training step on a row of `--seq-len` tokens, for AR small and CALM
    small (its autoencoder at small, with this project's recipe and with the reference's; inference also at T = 0.5
    through the pool sampler), then a search over CALM backbone widths / depths (energy head: 1 block; autoencoder:
    small) for those within AR small's FLOPs. "trainable_params_vs_ar": backbone + head over AR's parameters."""
    from hf_latentlm.eval.flops import inference_flops_per_token, parameter_counts, training_flops_per_token

    def measure(model):
        return {"inference": inference_flops_per_token(model, args.context),
                "training": training_flops_per_token(model, args.seq_len), "parameters": parameter_counts(model)}

    torch.manual_seed(0)
    ar = measure(build_model("ar", "small", tokenizer))
    result = {"context": args.context, "seq_len": args.seq_len, "ar_small": ar, "calm_small": {}, "search": {}}
    ar_inf, ar_train, ar_params = ar["inference"]["per_token"], ar["training"]["per_token"], ar["parameters"]["total"]
    for recipe, overrides in (("project", {}), ("reference", REFERENCE_AUTOENCODER_RECIPE)):
        ae = build_model("calm-ae", "small", tokenizer, **overrides)
        small = build_model("calm", "small", tokenizer, autoencoder=ae)
        result["calm_small"][recipe] = measure(small)
        # The pool sampler (T < 1) runs the head and the decoder once per pool draw.
        result["calm_small"][recipe]["inference_pool_T0.5"] = inference_flops_per_token(small, args.context, 0.5)
        rows = []
        for hidden in args.hidden:
            for layers in args.layers:
                calm = build_model("calm", "small", tokenizer, autoencoder=ae, **_calm_backbone(hidden, layers))
                inf = inference_flops_per_token(calm, args.context)
                train = training_flops_per_token(calm, args.seq_len)
                count = parameter_counts(calm)
                rows.append({"hidden": hidden, "layers": layers, "heads": hidden // 64,
                             "intermediate": calm.config.intermediate_size,
                             "inference_per_token": inf["per_token"], "inference_vs_ar": inf["per_token"] / ar_inf,
                             "training_per_token": train["per_token"], "training_vs_ar": train["per_token"] / ar_train,
                             "trainable_params": count["trainable"],
                             "trainable_params_vs_ar": count["trainable"] / ar_params,
                             "params_with_autoencoder_vs_ar": count["total"] / ar_params,
                             "inference_within_ar": inf["per_token"] <= ar_inf,
                             "training_within_ar": train["per_token"] <= ar_train})
        result["search"][recipe] = rows
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("probe", choices=["params", "ae-init", "ae-recipe", "lr", "heads", "ae-accuracy", "pool-bias",
                                          "flops", "context-spread"])
    parser.add_argument("folder", nargs="*", help="ae-accuracy: the autoencoder (or checkpoint) folder; "
                                                  "context-spread: CALM folders")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--positions", type=int, default=2000, help="heads: BrierLM positions")
    parser.add_argument("--autoencoder", default="runs/calm-ae-small")
    parser.add_argument("--trained", action="append", default=[], metavar="NAME=DIR",
                        help="ae-recipe: a trained autoencoder folder to measure (repeatable)")
    parser.add_argument("--context", type=int, default=256, help="flops: tokens in the cache at inference")
    parser.add_argument("--seq-len", type=int, default=256, help="flops: tokens per training row")
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 384, 512], help="flops: CALM widths")
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4, 6, 8, 10, 12, 16],
                        help="flops: CALM depths")
    args = parser.parse_args()
    if args.probe in ("ae-accuracy", "context-spread") and not args.folder:
        parser.error(f"{args.probe} needs at least one model folder")
    if args.probe == "ae-accuracy":
        print(calm_autoencoder_report(*load_model_and_tokenizer(args.folder[0], language_model=False)))
        return
    if args.probe == "context-spread":
        print(json.dumps({folder: hidden_state_spread(folder) for folder in args.folder}, indent=1))
        return
    if args.probe == "pool-bias":
        print(json.dumps(pool_bias(args), indent=1))
        return
    tokenizer = load_default_tokenizer()
    probe = {"params": params, "ae-init": ae_init, "ae-recipe": ae_recipe, "lr": learning_rate, "heads": heads,
             "flops": flops}
    print(json.dumps(probe[args.probe](args, tokenizer), indent=1))


if __name__ == "__main__":
    main()
