"""Cola DLM vs the matched AR baseline, measured in ONE process run.

    python scripts/bench_cola.py --ar runs/ar-small --cola runs/cola-small --vae runs/cola-vae-small \
        [--mauve] [--num-positions 2000] [--sweep-positions 500]

Runs the shared side-by-side benchmark (`hf_latentlm.eval.bench`: generation tokens/s at batch 1/8, model calls
per token, Brier-1..4 with intervals, BrierLM-2, MAUVE) and adds what only Cola has: network evaluations per
generated token by network (DiT, VAE encoder, VAE decoder) with and without classifier-free guidance; BrierLM-2
versus the CFG scale w and versus the ODE steps per block (with tokens/s, and each BrierLM-2 over that of 32 steps,
or of the most steps given); the VAE's token accuracy (posterior mean, sampled z, noised z_t) of the stage-1 folder
and of the jointly trained copy inside Cola; training step time Cola/AR for fresh models of the preset; and a
cProfile of one batch-1 `generate()`.
Every number comes from this run. Writes JSON (--output) and prints Markdown.
"""

from __future__ import annotations

import time

import latent_bench as lb

from hf_latentlm.eval.brier import evaluate_brier
from hf_latentlm.eval.cola import vae_measurements
from hf_latentlm.loading import load_model_and_tokenizer


def main():
    parser = lb.argument_parser(__doc__, "cola", "vae", "the stage-1 VAE folder Cola was built from")
    lb.add_shared_arguments(parser)
    parser.add_argument("--cfg-scales", default="0,3,7,10,20", help="guidance scales w of the CFG sweep")
    parser.add_argument("--steps", default="2,4,8,16,32", help="ODE steps per block of the steps sweep")
    parser.add_argument("--output", default="docs/cola_benchmark.json")
    args = parser.parse_args()
    cfg_scales, step_counts = lb.numbers(args.cfg_scales, float), lb.numbers(args.steps)
    started = time.perf_counter()

    report, cola, ar, tokenizer, stream, prompts = lb.benchmark_and_load(args.ar, "cola", args.cola, args)
    c = cola.config
    extras = {"settings": {"cfg_scales": cfg_scales, "steps": step_counts, "sweep_positions": args.sweep_positions,
                           "new_tokens": args.new_tokens, "preset": args.preset, "train_steps": args.train_steps,
                           # Cola's read-out samples at temperature 1 in Brier, MAUVE and speed, not greedily.
                           "harness_generate_kwargs": lb.harness_generate_kwargs(),
                           "cola_defaults": {"block_size": c.block_size, "num_ode_steps": c.num_ode_steps,
                                             "ode_solver": c.ode_solver, "cfg_scale": c.cfg_scale,
                                             "decode_temperature": c.decode_temperature,
                                             "vae_block_size": c.vae_config.vae_block_size,
                                             "latent_size": c.latent_size}}}

    extras["network_calls"] = {label: lb.network_calls(cola, prompts[:1], args.new_tokens, kwargs)
                               for label, kwargs in (("default", {}), ("guidance_scale=1", {"guidance_scale": 1.0}))}

    extras["cfg_sweep"] = {f"{w:g}": evaluate_brier(cola, stream, args.sweep_positions,
                                                    generate_kwargs={"guidance_scale": w}) for w in cfg_scales}

    extras["steps_sweep"] = lb.steps_sweep(cola, ar, stream, prompts, step_counts,
                                        32 if 32 in step_counts else max(step_counts), args.sweep_positions,
                                        args.new_tokens)

    vae, _ = load_model_and_tokenizer(args.vae, language_model=False)
    extras["vae"] = {"stage 1": vae_measurements(vae, stream),
                     "joint (inside Cola)": vae_measurements(cola.model.vae, stream)}

    extras["training"] = lb.training_times("cola", {"vae": args.vae}, args.preset, tokenizer, args.train_steps)

    extras["profile"] = lb.profile_generate(cola, prompts[:1], args.new_tokens)
    extras["wall_s"] = time.perf_counter() - started
    report["cola"] = extras
    lb.write_report(report, args.output, lambda: markdown_extras(extras))


def markdown_extras(extras: dict) -> str:
    titles = {"dit": "DiT", "vae_encoder": "VAE encoder", "vae_decoder": "VAE decoder"}
    out = lb.network_calls_markdown(extras, titles, calls_column="calls (DiT / enc / dec)")
    out += ["", "CFG sweep (default ODE steps):", "", "| w | BrierLM-2 | Brier-1 | Brier-2 | positions |",
            "|---|---|---|---|---|"]
    for w, b in extras["cfg_sweep"].items():
        out.append(f"| {w} | {lb.interval(b['brierlm_2'])} | {b['brier_1']['value']:.4f} | "
                   f"{b['brier_2']['value']:.4f} | {b['num_positions']} |")
    out += lb.steps_sweep_markdown(extras["steps_sweep"], "CFG")
    levels = list(next(iter(extras["vae"].values()))["accuracy_vs_noise"])
    out += ["", "VAE token accuracy on the validation split:", "",
            "| VAE | tokens | logSNR | from μ | sampled z | " + " | ".join(f"t={t:g}" for t in levels) + " |",
            "|---|---|---|---|---|" + "---|" * len(levels)]
    for name, r in extras["vae"].items():
        out.append(f"| {name} | {r['num_tokens']} | {r['logsnr']:.2f} | {r['accuracy_mean']:.2%} | "
                   f"{r['accuracy_sampled']:.2%} | " + " | ".join(f"{a:.2%}" for a in r["accuracy_vs_noise"].values())
                   + " |")
    out += lb.training_and_profile_markdown(extras, "cola", "Cola")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
