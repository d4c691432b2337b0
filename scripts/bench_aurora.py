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

import time

import latent_bench as lb

from hf_latentlm.eval.aurora import autoencoder_accuracy
from hf_latentlm.eval.brier import evaluate_brier
from hf_latentlm.loading import load_model_and_tokenizer


def main():
    parser = lb.argument_parser(__doc__, "aurora", "autoencoder", "the autoencoder folder AURORA was built from")
    parser.add_argument("--variant", action="append", default=[], help="LABEL=DIR: an ablation model")
    parser.add_argument("--stc-pair", help="WITH,WITHOUT: labels of the variants compared at every --stc-steps")
    parser.add_argument("--stc-steps", default="4,8,16,32")
    parser.add_argument("--steps", default="4,8,16,32,64", help="ODE steps per block of the main model's sweep")
    lb.add_shared_arguments(parser)
    parser.add_argument("--output", default="docs/aurora_benchmark.json")
    args = parser.parse_args()
    variants = dict(v.split("=", 1) for v in args.variant)
    step_counts, stc_steps = lb.numbers(args.steps), lb.numbers(args.stc_steps)
    started = time.perf_counter()

    report, aurora, ar, tokenizer, stream, prompts = lb.benchmark_and_load(args.ar, "aurora", args.aurora, args)
    c = aurora.config
    extras = {"settings": {"steps": step_counts, "stc_steps": stc_steps, "sweep_positions": args.sweep_positions,
                           "new_tokens": args.new_tokens, "preset": args.preset, "variants": variants,
                           # The read-out samples at temperature 1 in Brier, MAUVE and speed, not greedily.
                           "harness_generate_kwargs": lb.harness_generate_kwargs(),
                           "aurora_defaults": {name: getattr(c, name) for name in (
                               "block_size", "num_ode_steps", "self_condition_guidance", "cfg_scale",
                               "cfg_min_sigma", "decode_temperature", "noisy_input_rank", "latent_size",
                               "loss_space", "consistency_weight", "time_sampler", "time_shift")}}}

    extras["network_calls"] = {label: lb.network_calls(aurora, prompts[:1], args.new_tokens, kwargs)
                               for label, kwargs in (("default", {}),
                                                     ("no SC-CFG", {"self_condition_guidance": 1.0}),
                                                     ("no guidance", {"self_condition_guidance": 1.0,
                                                                      "guidance_scale": 1.0}))}

    extras["steps_sweep"] = lb.steps_sweep(aurora, ar, stream, prompts, step_counts, max(step_counts),
                                        args.sweep_positions, args.new_tokens)

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

    extras["training"] = lb.training_times("aurora", {"autoencoder": args.autoencoder}, args.preset, tokenizer,
                                        args.train_steps)

    extras["profile"] = lb.profile_generate(aurora, prompts[:1], args.new_tokens)
    extras["wall_s"] = time.perf_counter() - started
    report["aurora"] = extras
    lb.write_report(report, args.output, lambda: markdown_extras(extras))


def markdown_extras(extras: dict) -> str:
    out = lb.network_calls_markdown(extras)
    out += lb.steps_sweep_markdown(extras["steps_sweep"], "guidance")
    if extras["variants"]:
        out += ["", "Ablation variants (separately trained; BrierLM-2 by ODE steps per block):", "",
                "| variant | trained steps | D_b | loss space | λ_ct | steps: BrierLM-2 |", "|---|---|---|---|---|---|"]
        for label, v in extras["variants"].items():
            cfg = v["config"]
            cells = "; ".join(f"{s}: {lb.interval(b['brierlm_2'])}" for s, b in v["by_steps"].items())
            out.append(f"| {label} | {v['trained_steps']} | {cfg['noisy_input_rank'] or 'full'} | {cfg['loss_space']} "
                       f"| {cfg['consistency_weight']:g} | {cells} |")
    ae = extras["autoencoder"]
    out += ["", f"Autoencoder reconstruction accuracy on {ae['num_tokens']} validation tokens: {ae['accuracy']:.2%}"]
    out += lb.training_and_profile_markdown(extras, "aurora", "AURORA")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
