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

import argparse
import cProfile
import io
import json
import pstats
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

import hf_latentlm
from hf_latentlm.eval.bench import benchmark_models, markdown_table
from hf_latentlm.eval.brier import evaluate_brier
from hf_latentlm.eval.cola import vae_measurements
from hf_latentlm.eval.harness import nll_rows, split_stream
from hf_latentlm.eval.sampling import evaluation_windows, unbiased_sampling_kwargs
from hf_latentlm.eval.speed import CallCounter, measure_generation_speed, training_step_time
from hf_latentlm.families import build_model
from hf_latentlm.loading import load_model_and_tokenizer
from hf_latentlm.presets import get_preset
from hf_latentlm.training.loop import TrainConfig, make_optimizer

def numbers(text: str, kind=int) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ar", required=True)
    parser.add_argument("--cola", required=True)
    parser.add_argument("--vae", required=True, help="the stage-1 VAE folder Cola was built from")
    parser.add_argument("--preset", default="small", help="preset of the fresh models timed for training")
    parser.add_argument("--num-positions", type=int, default=2000, help="Brier positions of the main table")
    parser.add_argument("--sweep-positions", type=int, default=500, help="Brier positions of each sweep point")
    parser.add_argument("--mauve", action="store_true")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--train-steps", type=int, default=3)
    parser.add_argument("--cfg-scales", default="0,3,7,10,20", help="guidance scales w of the CFG sweep")
    parser.add_argument("--steps", default="2,4,8,16,32", help="ODE steps per block of the steps sweep")
    parser.add_argument("--output", default="docs/cola_benchmark.json")
    args = parser.parse_args()
    cfg_scales, step_counts = numbers(args.cfg_scales, float), numbers(args.steps)
    started = time.perf_counter()

    report = benchmark_models({"ar": args.ar, "cola": args.cola}, "ar", num_positions=args.num_positions,
                              max_new_tokens=args.new_tokens, mauve=args.mauve)
    report["command"] = shlex.join(["python", *sys.argv])
    report["git"] = git_state()
    cola, tokenizer = load_model_and_tokenizer(args.cola)
    ar, _ = load_model_and_tokenizer(args.ar)
    cola.eval()
    ar.eval()
    stream = split_stream(tokenizer, "validation")
    prompts, _ = evaluation_windows(stream, 8, 64, 1)
    c = cola.config
    extras = {"settings": {"cfg_scales": cfg_scales, "steps": step_counts, "sweep_positions": args.sweep_positions,
                           "new_tokens": args.new_tokens, "preset": args.preset, "train_steps": args.train_steps,
                           # Brier, MAUVE and speed run generate() with these (plus a sweep's option): the harness's
                           # plain sampling, so Cola's read-out samples at temperature 1, not its greedy default.
                           "harness_generate_kwargs": {k: v for k, v in unbiased_sampling_kwargs(0).items()
                                                       if k != "max_new_tokens"},
                           "cola_defaults": {"block_size": c.block_size, "num_ode_steps": c.num_ode_steps,
                                             "ode_solver": c.ode_solver, "cfg_scale": c.cfg_scale,
                                             "decode_temperature": c.decode_temperature,
                                             "vae_block_size": c.vae_config.vae_block_size,
                                             "latent_size": c.latent_size}}}

    extras["network_calls"] = {label: network_calls(cola, prompts[:1], args.new_tokens, kwargs)
                               for label, kwargs in (("default", {}), ("guidance_scale=1", {"guidance_scale": 1.0}))}

    extras["cfg_sweep"] = {f"{w:g}": evaluate_brier(cola, stream, args.sweep_positions,
                                                    generate_kwargs={"guidance_scale": w}) for w in cfg_scales}

    ar_speed = {f"batch_{b}": measure_generation_speed(ar, prompts[:b], args.new_tokens, repeats=3)
                for b in (1, 8)}
    steps = {}
    for s in step_counts:
        kwargs = {"num_inference_steps": s}
        row = {"brier": evaluate_brier(cola, stream, args.sweep_positions, generate_kwargs=kwargs)}
        for b in (1, 8):
            speed = measure_generation_speed(cola, prompts[:b], args.new_tokens, repeats=3, generate_kwargs=kwargs)
            row[f"speed_batch_{b}"] = speed
            row[f"speed_over_ar_batch_{b}"] = speed["tokens_per_s"] / ar_speed[f"batch_{b}"]["tokens_per_s"]
        steps[str(s)] = row
    reference = str(32 if 32 in step_counts else max(step_counts))
    top = steps[reference]["brier"]["brierlm_2"]["value"]
    for row in steps.values():
        row[f"brierlm_2_over_{reference}_steps"] = row["brier"]["brierlm_2"]["value"] / top if top else None
    extras["steps_sweep"] = {"ar_speed": ar_speed, "reference_steps": int(reference), "rows": steps}

    vae, _ = load_model_and_tokenizer(args.vae, language_model=False)
    extras["vae"] = {"stage 1": vae_measurements(vae, stream),
                     "joint (inside Cola)": vae_measurements(cola.model.vae, stream)}

    preset = get_preset(args.preset)
    train_rows = nll_rows(split_stream(tokenizer, "train"), preset.seq_len)
    extras["training"] = {"preset": args.preset, "batch_size": preset.batch_size, "seq_len": preset.seq_len}
    for family in ("ar", "cola"):
        torch.manual_seed(0)
        model = build_model(family, args.preset, tokenizer, **({"vae": args.vae} if family == "cola" else {}))
        optimizer = make_optimizer(model, TrainConfig(preset=args.preset).resolved())
        extras["training"][family] = training_step_time(model, train_rows, args.train_steps, preset.batch_size,
                                                        optimizer)
        del model, optimizer
    extras["training"]["cola_over_ar_tokens_per_s"] = (extras["training"]["cola"]["tokens_per_s"]
                                                       / extras["training"]["ar"]["tokens_per_s"])

    extras["profile"] = profile_generate(cola, prompts[:1], args.new_tokens)
    extras["wall_s"] = time.perf_counter() - started
    report["cola"] = extras
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    print(markdown_table(report))
    print(markdown_extras(extras))
    if report["git"]["modified"]:
        print(f"WARNING: the package differed from commit {report['git']['commit'][:10]} when this run started: "
              f"{report['git']['modified']}", file=sys.stderr)


def git_state() -> dict:
    """The commit of the imported package and its files that differed from it when the run started."""
    root = Path(hf_latentlm.__file__).resolve().parents[1]

    def git(*args):
        return subprocess.run(["git", *args], check=False, capture_output=True, text=True, cwd=root).stdout.strip()

    return {"package": str(root / "hf_latentlm"), "commit": git("rev-parse", "HEAD"),
            "modified": git("status", "--porcelain", "--", "hf_latentlm").splitlines()}


@torch.no_grad()
def network_calls(model, prompt: torch.Tensor, new_tokens: int, kwargs: dict) -> dict:
    """Network evaluations of one `generate()` of `prompt` [1, T] (the model's defaults plus `kwargs`, EOS ignored,
    fixed noise seed): per network and in all, and per generated token; cross-checked with forward hooks (`CallCounter`:
    `hooked_calls`, a warning when they disagree)."""
    with CallCounter(model) as counter:
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                             eos_token_id=None, noise_seeds=[0], return_dict_in_generate=True, **kwargs)
    generated = int(out.num_new_tokens[0])
    calls = {name: int(count[0]) for name, count in out.calls_by_network.items()}
    if counter.calls != int(out.model_calls[0]):
        print(f"WARNING: generate() reports {int(out.model_calls[0])} network calls, forward hooks counted "
              f"{counter.calls}", file=sys.stderr)
    return {"generate_kwargs": kwargs, "prompt_len": prompt.shape[1], "new_tokens": generated, "calls": calls,
            "model_calls": int(out.model_calls[0]), "hooked_calls": counter.calls,
            "per_token": {name: n / generated for name, n in calls.items()},
            "model_calls_per_token": int(out.model_calls[0]) / generated}


@torch.no_grad()
def profile_generate(model, prompt: torch.Tensor, new_tokens: int, top: int = 15) -> dict:
    """cProfile of one batch-1 `generate()` (Cola's defaults, EOS ignored) after a warm-up run: the top `top`
    functions by cumulative time, as pstats text and as rows. torch ops show as builtins, so their tottime is
    arithmetic (plus dispatch) and the rest of a Python function's cumulative time is its overhead."""
    kwargs = {"attention_mask": torch.ones_like(prompt), "max_new_tokens": new_tokens, "eos_token_id": None,
              "noise_seeds": [0]}
    model.generate(prompt, **kwargs)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    model.generate(prompt, **kwargs)
    profiler.disable()
    wall = time.perf_counter() - start
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).sort_stats("cumulative")
    stats.print_stats(top)
    rows = []
    for func in stats.fcn_list[:top]:
        _, total_calls, tottime, cumtime, _ = stats.stats[func]
        rows.append({"function": short_paths(pstats.func_std_string(func)), "ncalls": total_calls,
                     "tottime_s": tottime, "cumtime_s": cumtime})
    return {"new_tokens": new_tokens, "wall_s": wall, "top_by_cumulative": rows, "text": short_paths(text.getvalue())}


def short_paths(text: str) -> str:
    """Profile text with paths relative to the repository or to site-packages."""
    return re.sub(r"\S*/site-packages/", "", text.replace(str(Path.cwd()) + "/", ""))


def _interval(entry: dict) -> str:
    return f"{entry['value']:.2f} [{entry['ci_low']:.2f}, {entry['ci_high']:.2f}]"


def markdown_extras(extras: dict) -> str:
    prompt_len = next(iter(extras["network_calls"].values()))["prompt_len"]
    out = [(f"Network evaluations per generated token (batch 1, {prompt_len}-token prompt, "
            f"{extras['settings']['new_tokens']} new tokens, prefill included):"), "",
           "| setting | DiT | VAE encoder | VAE decoder | all | calls (DiT / enc / dec) |", "|---|---|---|---|---|---|"]
    for label, row in extras["network_calls"].items():
        per, calls = row["per_token"], row["calls"]
        out.append(f"| {label} | {per['dit']:.3f} | {per['vae_encoder']:.3f} | {per['vae_decoder']:.3f} | "
                   f"{row['model_calls_per_token']:.3f} | {calls['dit']} / {calls['vae_encoder']} / "
                   f"{calls['vae_decoder']} |")
    out += ["", "CFG sweep (default ODE steps):", "", "| w | BrierLM-2 | Brier-1 | Brier-2 | positions |",
            "|---|---|---|---|---|"]
    for w, b in extras["cfg_sweep"].items():
        out.append(f"| {w} | {_interval(b['brierlm_2'])} | {b['brier_1']['value']:.4f} | {b['brier_2']['value']:.4f} "
                   f"| {b['num_positions']} |")
    sweep = extras["steps_sweep"]
    ref, ar = sweep["reference_steps"], sweep["ar_speed"]
    out += ["", (f"ODE steps per block (default CFG; AR timed in the same run: {ar['batch_1']['tokens_per_s']:.0f} / "
                 f"{ar['batch_8']['tokens_per_s']:.0f} tok/s at b1 / b8):"), "",
            f"| steps | BrierLM-2 | ÷ {ref} steps | tok/s b1 | tok/s b8 | ×AR b1 | ×AR b8 | calls/token b1 |",
            "|---|---|---|---|---|---|---|---|"]
    for s, row in sweep["rows"].items():
        ratio = row[f"brierlm_2_over_{ref}_steps"]
        out.append(f"| {s} | {_interval(row['brier']['brierlm_2'])} | "
                   f"{'—' if ratio is None else f'{ratio:.2f}'} | {row['speed_batch_1']['tokens_per_s']:.0f} | "
                   f"{row['speed_batch_8']['tokens_per_s']:.0f} | {row['speed_over_ar_batch_1']:.2f} | "
                   f"{row['speed_over_ar_batch_8']:.2f} | {row['speed_batch_1']['model_calls_per_token']:.2f} |")
    levels = list(next(iter(extras["vae"].values()))["accuracy_vs_noise"])
    out += ["", "VAE token accuracy on the validation split:", "",
            "| VAE | tokens | logSNR | from μ | sampled z | " + " | ".join(f"t={t:g}" for t in levels) + " |",
            "|---|---|---|---|---|" + "---|" * len(levels)]
    for name, r in extras["vae"].items():
        out.append(f"| {name} | {r['num_tokens']} | {r['logsnr']:.2f} | {r['accuracy_mean']:.2%} | "
                   f"{r['accuracy_sampled']:.2%} | " + " | ".join(f"{a:.2%}" for a in r["accuracy_vs_noise"].values())
                   + " |")
    t = extras["training"]
    out += ["", f"Training step time, fresh `{t['preset']}` models (batch {t['batch_size']} × {t['seq_len']}):", "",
            "| family | s/step | tokens/s |", "|---|---|---|"]
    out += [f"| {f} | {t[f]['seconds_per_step']:.3f} | {t[f]['tokens_per_s']:.0f} |" for f in ("ar", "cola")]
    out += [f"\nCola/AR training tokens/s: {t['cola_over_ar_tokens_per_s']:.2f}x", "",
            (f"cProfile of one batch-1 Cola generate() ({extras['profile']['new_tokens']} new tokens, "
             f"{extras['profile']['wall_s']:.2f} s under the profiler), top by cumulative time:"), "```",
            extras["profile"]["text"].strip(), "```", f"\nwhole run: {extras['wall_s']:.0f} s"]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
