"""AURORA-LM vs the matched AR baseline, and its ablations, measured in ONE process run.

    python scripts/bench_aurora.py --ar runs/ar-small-600 --aurora runs/aurora-small-600 \
        --autoencoder runs/aurora-ae-small [--variant LABEL=DIR ...] [--stc-pair WITH,WITHOUT] [--mauve] \
        [--num-positions 2000] [--sweep-positions 500]

Runs the shared side-by-side benchmark (`hf_latentlm.eval.bench`: tokens/s at batch 1/8, model calls per token,
Brier-1..4 with intervals, BrierLM-2, MAUVE) for AR and the main AURORA model, and adds: network evaluations per
generated token by network with and without SC-CFG / prompt CFG; BrierLM-2 and speed versus ODE steps per block
(each BrierLM-2 over that of the most steps); the ablation variants (`--variant`, separately trained models: e.g.
without self-trajectory consistency, velocity-space loss, other D_b) at their default decoding, and the two models of
`--stc-pair` at every step count of `--stc-steps`; the autoencoder's reconstruction accuracy; training step time
AURORA/AR for fresh models of the preset; and a cProfile of one batch-1 `generate()`.
Every number comes from this run. Writes JSON (--output) and prints Markdown.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch
from bench_cola import _interval, git_state, network_calls, numbers, profile_generate

from hf_latentlm.eval.aurora import autoencoder_accuracy
from hf_latentlm.eval.bench import benchmark_models, markdown_table
from hf_latentlm.eval.brier import evaluate_brier
from hf_latentlm.eval.harness import nll_rows, split_stream
from hf_latentlm.eval.sampling import evaluation_windows, unbiased_sampling_kwargs
from hf_latentlm.eval.speed import measure_generation_speed, training_step_time
from hf_latentlm.families import build_model
from hf_latentlm.loading import load_model_and_tokenizer
from hf_latentlm.presets import get_preset
from hf_latentlm.training.loop import TrainConfig, make_optimizer


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ar", required=True)
    parser.add_argument("--aurora", required=True)
    parser.add_argument("--autoencoder", required=True, help="the autoencoder folder AURORA was built from")
    parser.add_argument("--variant", action="append", default=[], help="LABEL=DIR: an ablation model")
    parser.add_argument("--stc-pair", help="WITH,WITHOUT: labels of the variants compared at every --stc-steps")
    parser.add_argument("--stc-steps", default="4,8,16,32")
    parser.add_argument("--steps", default="4,8,16,32,64", help="ODE steps per block of the main model's sweep")
    parser.add_argument("--preset", default="small", help="preset of the fresh models timed for training")
    parser.add_argument("--num-positions", type=int, default=2000, help="Brier positions of the main table")
    parser.add_argument("--sweep-positions", type=int, default=500, help="Brier positions of each sweep point")
    parser.add_argument("--mauve", action="store_true")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--train-steps", type=int, default=3)
    parser.add_argument("--output", default="docs/aurora_benchmark.json")
    args = parser.parse_args()
    variants = dict(v.split("=", 1) for v in args.variant)
    step_counts, stc_steps = numbers(args.steps), numbers(args.stc_steps)
    started = time.perf_counter()

    report = benchmark_models({"ar": args.ar, "aurora": args.aurora}, "ar", num_positions=args.num_positions,
                              max_new_tokens=args.new_tokens, mauve=args.mauve)
    report["command"] = shlex.join(["python", *sys.argv])
    report["git"] = git_state()
    aurora, tokenizer = load_model_and_tokenizer(args.aurora)
    ar, _ = load_model_and_tokenizer(args.ar)
    aurora.eval()
    ar.eval()
    stream = split_stream(tokenizer, "validation")
    prompts, _ = evaluation_windows(stream, 8, 64, 1)
    c = aurora.config
    extras = {"settings": {"steps": step_counts, "stc_steps": stc_steps, "sweep_positions": args.sweep_positions,
                           "new_tokens": args.new_tokens, "preset": args.preset, "variants": variants,
                           # Brier, MAUVE and speed run generate() with these (plus a sweep's option): the harness's
                           # plain sampling, so the read-out samples at temperature 1, not its greedy default.
                           "harness_generate_kwargs": {k: v for k, v in unbiased_sampling_kwargs(0).items()
                                                       if k != "max_new_tokens"},
                           "aurora_defaults": {name: getattr(c, name) for name in (
                               "block_size", "num_ode_steps", "self_condition_guidance", "cfg_scale",
                               "cfg_min_sigma", "decode_temperature", "noisy_input_rank", "latent_size",
                               "loss_space", "consistency_weight", "time_sampler", "time_shift")}}}

    extras["network_calls"] = {label: network_calls(aurora, prompts[:1], args.new_tokens, kwargs)
                               for label, kwargs in (("default", {}),
                                                     ("no SC-CFG", {"self_condition_guidance": 1.0}),
                                                     ("no guidance", {"self_condition_guidance": 1.0,
                                                                      "guidance_scale": 1.0}))}

    ar_speed = {f"batch_{b}": measure_generation_speed(ar, prompts[:b], args.new_tokens, repeats=3)
                for b in (1, 8)}
    steps = {}
    for s in step_counts:
        kwargs = {"num_inference_steps": s}
        row = {"brier": evaluate_brier(aurora, stream, args.sweep_positions, generate_kwargs=kwargs)}
        for b in (1, 8):
            speed = measure_generation_speed(aurora, prompts[:b], args.new_tokens, repeats=3, generate_kwargs=kwargs)
            row[f"speed_batch_{b}"] = speed
            row[f"speed_over_ar_batch_{b}"] = speed["tokens_per_s"] / ar_speed[f"batch_{b}"]["tokens_per_s"]
        steps[str(s)] = row
    reference = str(max(step_counts))
    top = steps[reference]["brier"]["brierlm_2"]["value"]
    for row in steps.values():
        row[f"brierlm_2_over_{reference}_steps"] = row["brier"]["brierlm_2"]["value"] / top if top else None
    extras["steps_sweep"] = {"ar_speed": ar_speed, "reference_steps": int(reference), "rows": steps}

    extras["variants"] = {}
    pair = args.stc_pair.split(",") if args.stc_pair else []
    for label, folder in variants.items():
        model, _ = load_model_and_tokenizer(folder)
        model.eval()
        counts = stc_steps if label in pair else [model.config.num_ode_steps]
        extras["variants"][label] = {
            "folder": folder, "config": {name: getattr(model.config, name) for name in (
                "noisy_input_rank", "loss_space", "consistency_weight", "consistency_warmup_steps")},
            "trained_steps": int(model.optimizer_steps),
            "by_steps": {str(s): evaluate_brier(model, stream, args.sweep_positions,
                                                generate_kwargs={"num_inference_steps": s}) for s in counts}}
        del model

    autoencoder, _ = load_model_and_tokenizer(args.autoencoder, language_model=False)
    extras["autoencoder"] = autoencoder_accuracy(autoencoder, stream)

    preset = get_preset(args.preset)
    train_rows = nll_rows(split_stream(tokenizer, "train"), preset.seq_len)
    extras["training"] = {"preset": args.preset, "batch_size": preset.batch_size, "seq_len": preset.seq_len}
    for family in ("ar", "aurora"):
        torch.manual_seed(0)
        model = build_model(family, args.preset, tokenizer,
                            **({"autoencoder": args.autoencoder} if family == "aurora" else {}))
        optimizer = make_optimizer(model, TrainConfig(preset=args.preset).resolved())
        extras["training"][family] = training_step_time(model, train_rows, args.train_steps, preset.batch_size,
                                                        optimizer)
        del model, optimizer
    extras["training"]["aurora_over_ar_tokens_per_s"] = (extras["training"]["aurora"]["tokens_per_s"]
                                                         / extras["training"]["ar"]["tokens_per_s"])

    extras["profile"] = profile_generate(aurora, prompts[:1], args.new_tokens)
    extras["wall_s"] = time.perf_counter() - started
    report["aurora"] = extras
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    print(markdown_table(report))
    print(markdown_extras(extras))
    if report["git"]["modified"]:
        print(f"WARNING: the package differed from commit {report['git']['commit'][:10]} when this run started: "
              f"{report['git']['modified']}", file=sys.stderr)


def markdown_extras(extras: dict) -> str:
    first = next(iter(extras["network_calls"].values()))
    names = list(first["calls"])
    out = [(f"Network evaluations per generated token (batch 1, {first['prompt_len']}-token prompt, "
            f"{extras['settings']['new_tokens']} new tokens, prefill included):"), "",
           "| setting | " + " | ".join(names) + " | all |", "|---|" + "---|" * (len(names) + 1)]
    for label, row in extras["network_calls"].items():
        out.append(f"| {label} | " + " | ".join(f"{row['per_token'][n]:.3f}" for n in names)
                   + f" | {row['model_calls_per_token']:.3f} |")
    sweep = extras["steps_sweep"]
    ref, ar = sweep["reference_steps"], sweep["ar_speed"]
    out += ["", (f"ODE steps per block (default guidance; AR timed in the same run: "
                 f"{ar['batch_1']['tokens_per_s']:.0f} / {ar['batch_8']['tokens_per_s']:.0f} tok/s at b1 / b8):"), "",
            f"| steps | BrierLM-2 | ÷ {ref} steps | tok/s b1 | tok/s b8 | ×AR b1 | ×AR b8 | calls/token b1 |",
            "|---|---|---|---|---|---|---|---|"]
    for s, row in sweep["rows"].items():
        ratio = row[f"brierlm_2_over_{ref}_steps"]
        out.append(f"| {s} | {_interval(row['brier']['brierlm_2'])} | "
                   f"{'—' if ratio is None else f'{ratio:.2f}'} | {row['speed_batch_1']['tokens_per_s']:.0f} | "
                   f"{row['speed_batch_8']['tokens_per_s']:.0f} | {row['speed_over_ar_batch_1']:.2f} | "
                   f"{row['speed_over_ar_batch_8']:.2f} | {row['speed_batch_1']['model_calls_per_token']:.2f} |")
    if extras["variants"]:
        out += ["", "Ablation variants (separately trained; BrierLM-2 by ODE steps per block):", "",
                "| variant | trained steps | D_b | loss space | λ_ct | steps: BrierLM-2 |", "|---|---|---|---|---|---|"]
        for label, v in extras["variants"].items():
            cfg = v["config"]
            cells = "; ".join(f"{s}: {_interval(b['brierlm_2'])}" for s, b in v["by_steps"].items())
            out.append(f"| {label} | {v['trained_steps']} | {cfg['noisy_input_rank'] or 'full'} | {cfg['loss_space']} "
                       f"| {cfg['consistency_weight']:g} | {cells} |")
    ae = extras["autoencoder"]
    t = extras["training"]
    out += ["", f"Autoencoder reconstruction accuracy on {ae['num_tokens']} validation tokens: {ae['accuracy']:.2%}",
            "", f"Training step time, fresh `{t['preset']}` models (batch {t['batch_size']} × {t['seq_len']}):", "",
            "| family | s/step | tokens/s |", "|---|---|---|"]
    out += [f"| {f} | {t[f]['seconds_per_step']:.3f} | {t[f]['tokens_per_s']:.0f} |" for f in ("ar", "aurora")]
    out += [f"\nAURORA/AR training tokens/s: {t['aurora_over_ar_tokens_per_s']:.2f}x", "",
            (f"cProfile of one batch-1 AURORA generate() ({extras['profile']['new_tokens']} new tokens, "
             f"{extras['profile']['wall_s']:.2f} s under the profiler), top by cumulative time:"), "```",
            extras["profile"]["text"].strip(), "```", f"\nwhole run: {extras['wall_s']:.0f} s"]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
