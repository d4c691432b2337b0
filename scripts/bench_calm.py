"""CALM vs the matched AR baseline, measured in ONE process run.

    python scripts/bench_calm.py --ar runs/ar-small-600 --calm runs/calm-small-600 \
        --autoencoder runs/calm-ae-small [--mauve] [--num-positions 20000]

Runs the shared side-by-side benchmark (`hf_latentlm.eval.bench`: generation tokens/s at batch 1/8, model calls
per token, Brier-1..4 with intervals, BrierLM-2, MAUVE) and adds what only CALM has: the autoencoder's token
accuracy decoding the posterior mean and a SAMPLED z on the validation split with the mean posterior σ, CALM's
speed and Brier at lower temperatures next to AR's Brier at the same temperatures, FLOPs per token of both models
(counted with `hf_latentlm.eval.flops`), and training step time CALM/AR for models of the two checkpoints' own
configurations. Writes JSON (--output) and prints Markdown.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch

from hf_latentlm.eval.bench import benchmark_models, markdown_table
from hf_latentlm.eval.brier import evaluate_brier, headline
from hf_latentlm.eval.flops import inference_flops_per_token, parameter_counts, training_flops_per_token
from hf_latentlm.eval.harness import nll_rows, split_stream
from hf_latentlm.eval.sampling import evaluation_windows, sample_continuations
from hf_latentlm.eval.speed import measure_generation_speed, speed_versus_fresh_baseline, training_step_time
from hf_latentlm.families import build_model
from hf_latentlm.loading import load_model_and_tokenizer
from hf_latentlm.presets import get_preset
from hf_latentlm.training.loop import TrainConfig, make_optimizer

# Lower temperatures through the pool approximation. The exact rejection sampler is exercised by the tests; on a
# model this small two draws almost never decode to the same 4-token chunk (`exact_acceptance` below measures it),
# so it would spend its whole retry budget.
TEMPERATURES = {"T=1/2 pool": {"temperature": 0.5, "temperature_sampler": "pool"}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ar", required=True)
    parser.add_argument("--calm", required=True)
    parser.add_argument("--autoencoder", required=True, help="the autoencoder folder CALM was built from")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--num-positions", type=int, default=20000)
    parser.add_argument("--temperature-positions", type=int, default=2000)
    parser.add_argument("--mauve", action="store_true")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--train-steps", type=int, default=5)
    parser.add_argument("--flops-context", type=int, default=256,
                        help="tokens in the cache when counting inference FLOPs (training: rows of the preset's seq_len)")
    parser.add_argument("--speed-preset", action="append", default=[],
                        help="also time fresh (untrained) AR and CALM models of this preset: speed does not depend "
                             "on the weights when EOS is ignored (repeatable, e.g. --speed-preset base)")
    parser.add_argument("--output", default="docs/calm_benchmark.json")
    args = parser.parse_args()

    report = benchmark_models({"ar": args.ar, "calm": args.calm}, "ar", num_positions=args.num_positions,
                              mauve=args.mauve)
    calm, tokenizer = load_model_and_tokenizer(args.calm)
    ar, _ = load_model_and_tokenizer(args.ar)
    ae, _ = load_model_and_tokenizer(args.autoencoder, language_model=False)
    stream = split_stream(tokenizer, "validation")
    k = ae.config.chunk_size
    extras = {"autoencoder": ae.reconstruction_accuracy(stream[: stream.numel() // k * k][None],
                                                        generator=torch.Generator().manual_seed(0))}

    prompts, _ = evaluation_windows(stream, 8, 64, 1)
    extras["temperature"] = {}
    for name, kwargs in TEMPERATURES.items():
        row = {f"tokens_per_s_batch_{b}": measure_generation_speed(calm, prompts[:b], args.new_tokens, repeats=3,
                                                                   generate_kwargs=kwargs)["tokens_per_s"]
               for b in (1, 8)}
        row["brier"] = evaluate_brier(calm, stream, args.temperature_positions, generate_kwargs=kwargs)
        # The AR baseline at the same temperature and positions (an AR step has no sampler options beyond T).
        row["ar_brier"] = evaluate_brier(ar, stream, args.temperature_positions,
                                         generate_kwargs={"temperature": kwargs["temperature"]})
        extras["temperature"][name] = row

    contexts, _ = evaluation_windows(stream, 1000, 128, 4)
    draws = sample_continuations(calm, torch.cat([contexts, contexts]), calm.config.chunk_size, seed=0)
    agree = (draws[:len(contexts)] == draws[len(contexts):]).all(1).float()
    extras["exact_acceptance"] = {"two_draws_agree_per_chunk": agree.mean().item(), "contexts": len(contexts)}

    seq_len = get_preset(args.preset).seq_len
    extras["flops"] = {name: {"inference": inference_flops_per_token(model, args.flops_context),
                              "training": training_flops_per_token(model, seq_len),
                              "parameters": parameter_counts(model)}
                       for name, model in (("ar", ar), ("calm", calm))}
    extras["flops"]["calm_over_ar"] = {
        part: extras["flops"]["calm"][part]["per_token"] / extras["flops"]["ar"][part]["per_token"]
        for part in ("inference", "training")}

    # Step time does not depend on the weights: time copies of the two checkpoints (their own configurations).
    train_rows = nll_rows(split_stream(tokenizer, "train"), seq_len)
    extras["training"] = {}
    for name, model in (("ar", ar), ("calm", calm)):
        torch.manual_seed(0)
        model = copy.deepcopy(model)
        optimizer = make_optimizer(model, TrainConfig(preset=args.preset).resolved())
        extras["training"][name] = training_step_time(model, train_rows, args.train_steps, 16, optimizer)
    extras["training"]["calm_over_ar_tokens_per_s"] = (extras["training"]["calm"]["tokens_per_s"]
                                                       / extras["training"]["ar"]["tokens_per_s"])
    extras["speed_by_preset"] = {preset: fresh_model_speed(preset, tokenizer, prompts, args.new_tokens)
                                 for preset in args.speed_preset}
    report["calm"] = extras
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    print(markdown_table(report))
    print(json.dumps({k: extras[k] for k in ("autoencoder", "training", "exact_acceptance")}, indent=1))
    print(f"FLOPs per token CALM/AR: inference {extras['flops']['calm_over_ar']['inference']:.2f}x, "
          f"training {extras['flops']['calm_over_ar']['training']:.2f}x")
    for preset, row in extras["speed_by_preset"].items():
        print(f"{preset} (untrained, speed only): CALM/AR tokens/s {row['calm_over_ar_batch_1']:.2f}x at batch 1, "
              f"{row['calm_over_ar_batch_8']:.2f}x at batch 8")
    for name, row in extras["temperature"].items():
        print(f"{name}: {row['tokens_per_s_batch_1']:.0f} / {row['tokens_per_s_batch_8']:.0f} tok/s (b1/b8); "
              f"{headline(row['brier'])}; AR at the same T: {headline(row['ar_brier'])}")


def fresh_model_speed(preset: str, tokenizer, prompts: torch.Tensor, new_tokens: int) -> dict:
    """Generation tokens/s of freshly initialised CALM (autoencoder of the same preset) and AR models of `preset`."""
    torch.manual_seed(0)
    calm = build_model("calm", preset, tokenizer, autoencoder=build_model("calm-ae", preset, tokenizer))
    speed = speed_versus_fresh_baseline(calm.eval(), preset, tokenizer, prompts, batch_sizes=(1, 8),
                                        max_new_tokens=new_tokens, repeats=3)
    row = {}
    for name, side in (("ar", "baseline"), ("calm", "model")):
        row[name] = {"num_parameters": speed["num_parameters"][side],
                     **{f"tokens_per_s_{k}": v["tokens_per_s"] for k, v in speed[side].items()}}
    row.update({f"calm_over_ar_{k}": ratio for k, ratio in speed["ratio"].items()})
    return row


if __name__ == "__main__":
    main()
