"""What the latent families' benchmark scripts (bench_cola.py, bench_aurora.py) share: their common options, loading
the AR baseline and the family model after the shared side-by-side benchmark, network evaluations per generated
token, BrierLM-2 and speed versus the ODE steps per block, training step time of fresh AR and family models, a
cProfile of one `generate()`, writing the JSON report and printing its Markdown, and the Markdown of these sections.

Not a script: imported by the bench scripts (scripts/ is on sys.path when one of them runs).
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
from hf_latentlm.eval.harness import nll_rows, split_stream
from hf_latentlm.eval.sampling import evaluation_windows, unbiased_sampling_kwargs
from hf_latentlm.eval.speed import CallCounter, measure_generation_speed, training_step_time
from hf_latentlm.families import build_model
from hf_latentlm.loading import load_model_and_tokenizer
from hf_latentlm.presets import get_preset
from hf_latentlm.training.loop import TrainConfig, make_optimizer


def numbers(text: str, kind=int) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def argument_parser(doc: str, family: str, component: str, component_help: str) -> argparse.ArgumentParser:
    """A parser described by the first line of the script's docstring `doc`, with the folders every latent bench
    reads: --ar, --`family` and --`component` (the folder the family model was built from, `component_help`)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--ar", required=True)
    parser.add_argument(f"--{family}", required=True)
    parser.add_argument(f"--{component}", required=True, help=component_help)
    return parser


def add_shared_arguments(parser) -> None:
    """The options every latent bench script takes after its model folders (their order is that of --help)."""
    parser.add_argument("--preset", default="small", help="preset of the fresh models timed for training")
    parser.add_argument("--num-positions", type=int, default=2000, help="Brier positions of the main table")
    parser.add_argument("--sweep-positions", type=int, default=500, help="Brier positions of each sweep point")
    parser.add_argument("--mauve", action="store_true")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--train-steps", type=int, default=3)


def benchmark_and_load(ar_folder: str, family: str, folder: str, args) -> tuple:
    """The shared side-by-side benchmark of AR and the `family` model (with the command line and the git state), then
    both models loaded in eval mode, the validation stream and 8 prompts of 64 tokens.
    Returns (report, model, ar, tokenizer, stream, prompts)."""
    report = benchmark_models({"ar": ar_folder, family: folder}, "ar", num_positions=args.num_positions,
                              max_new_tokens=args.new_tokens, mauve=args.mauve)
    report["command"] = shlex.join(["python", *sys.argv])
    report["git"] = git_state()
    model, tokenizer = load_model_and_tokenizer(folder)
    ar, _ = load_model_and_tokenizer(ar_folder)
    model.eval()
    ar.eval()
    stream = split_stream(tokenizer, "validation")
    prompts, _ = evaluation_windows(stream, 8, 64, 1)
    return report, model, ar, tokenizer, stream, prompts


def harness_generate_kwargs() -> dict:
    """What Brier, MAUVE and speed pass to generate() (plus a sweep's option): the harness's plain sampling, so a
    latent model's read-out samples at temperature 1, not its greedy default."""
    return {k: v for k, v in unbiased_sampling_kwargs(0).items() if k != "max_new_tokens"}


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


def steps_sweep(model, ar, stream: torch.Tensor, prompts: torch.Tensor, step_counts: list[int], reference: int,
                sweep_positions: int, new_tokens: int) -> dict:
    """BrierLM-2 and tokens/s at batch 1 and 8 of `model` per ODE step count, the speeds over AR's (timed here, at
    the model's defaults) and each BrierLM-2 over that of the `reference` step count (None when that is 0)."""
    ar_speed = {f"batch_{b}": measure_generation_speed(ar, prompts[:b], new_tokens, repeats=3) for b in (1, 8)}
    steps = {}
    for s in step_counts:
        kwargs = {"num_inference_steps": s}
        row = {"brier": evaluate_brier(model, stream, sweep_positions, generate_kwargs=kwargs)}
        for b in (1, 8):
            speed = measure_generation_speed(model, prompts[:b], new_tokens, repeats=3, generate_kwargs=kwargs)
            row[f"speed_batch_{b}"] = speed
            row[f"speed_over_ar_batch_{b}"] = speed["tokens_per_s"] / ar_speed[f"batch_{b}"]["tokens_per_s"]
        steps[str(s)] = row
    reference = str(reference)
    top = steps[reference]["brier"]["brierlm_2"]["value"]
    for row in steps.values():
        row[f"brierlm_2_over_{reference}_steps"] = row["brier"]["brierlm_2"]["value"] / top if top else None
    return {"ar_speed": ar_speed, "reference_steps": int(reference), "rows": steps}


def training_times(family: str, components: dict, preset_name: str, tokenizer, train_steps: int) -> dict:
    """Training step time of fresh AR and `family` models (built with `components`) of the preset, each from seed 0
    with the loop's optimizer, and the family's tokens/s over AR's."""
    preset = get_preset(preset_name)
    train_rows = nll_rows(split_stream(tokenizer, "train"), preset.seq_len)
    times = {"preset": preset_name, "batch_size": preset.batch_size, "seq_len": preset.seq_len}
    for name in ("ar", family):
        torch.manual_seed(0)
        model = build_model(name, preset_name, tokenizer, **(components if name == family else {}))
        optimizer = make_optimizer(model, TrainConfig(preset=preset_name).resolved())
        times[name] = training_step_time(model, train_rows, train_steps, preset.batch_size, optimizer)
        del model, optimizer
    times[f"{family}_over_ar_tokens_per_s"] = times[family]["tokens_per_s"] / times["ar"]["tokens_per_s"]
    return times


@torch.no_grad()
def profile_generate(model, prompt: torch.Tensor, new_tokens: int, top: int = 15) -> dict:
    """cProfile of one batch-1 `generate()` (the model's defaults, EOS ignored) after a warm-up run: the top `top`
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


def write_report(report: dict, output: str, extras_markdown) -> None:
    """Write `report` as JSON to `output`, print the side-by-side table and `extras_markdown()` as Markdown, and warn
    (stderr) when the package differed from its commit when the run started."""
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text(json.dumps(report, indent=1) + "\n")
    print(markdown_table(report))
    print(extras_markdown())
    if report["git"]["modified"]:
        print(f"WARNING: the package differed from commit {report['git']['commit'][:10]} when this run started: "
              f"{report['git']['modified']}", file=sys.stderr)


# Markdown of the shared sections.

def interval(entry: dict) -> str:
    return f"{entry['value']:.2f} [{entry['ci_low']:.2f}, {entry['ci_high']:.2f}]"


def network_calls_markdown(extras: dict, titles: dict[str, str] | None = None,
                           calls_column: str | None = None) -> list[str]:
    """Caption and table of `extras["network_calls"]`: one column per network (the report's names, or `titles`:
    network -> column title, in that order), all networks, and with `calls_column` (its title) the counts per network
    as 'a / b / c'."""
    first = next(iter(extras["network_calls"].values()))
    names = list(titles or first["calls"])
    heads = [titles[n] for n in names] if titles else names
    extra = [calls_column] if calls_column else []
    out = [(f"Network evaluations per generated token (batch 1, {first['prompt_len']}-token prompt, "
            f"{extras['settings']['new_tokens']} new tokens, prefill included):"), "",
           "| setting | " + " | ".join([*heads, "all", *extra]) + " |",
           "|---|" + "---|" * (len(names) + 1 + len(extra))]
    for label, row in extras["network_calls"].items():
        cells = [f"{row['per_token'][n]:.3f}" for n in names] + [f"{row['model_calls_per_token']:.3f}"]
        if calls_column:
            cells.append(" / ".join(str(row["calls"][n]) for n in names))
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out


def steps_sweep_markdown(sweep: dict, default: str) -> list[str]:
    """A blank line, caption (`default`: the decoding the sweep keeps at its default, e.g. 'CFG') and table of a
    `steps_sweep` result."""
    ref, ar = sweep["reference_steps"], sweep["ar_speed"]
    out = ["", (f"ODE steps per block (default {default}; AR timed in the same run: {ar['batch_1']['tokens_per_s']:.0f}"
                f" / {ar['batch_8']['tokens_per_s']:.0f} tok/s at b1 / b8):"), "",
           f"| steps | BrierLM-2 | ÷ {ref} steps | tok/s b1 | tok/s b8 | ×AR b1 | ×AR b8 | calls/token b1 |",
           "|---|---|---|---|---|---|---|---|"]
    for s, row in sweep["rows"].items():
        ratio = row[f"brierlm_2_over_{ref}_steps"]
        out.append(f"| {s} | {interval(row['brier']['brierlm_2'])} | "
                   f"{'—' if ratio is None else f'{ratio:.2f}'} | {row['speed_batch_1']['tokens_per_s']:.0f} | "
                   f"{row['speed_batch_8']['tokens_per_s']:.0f} | {row['speed_over_ar_batch_1']:.2f} | "
                   f"{row['speed_over_ar_batch_8']:.2f} | {row['speed_batch_1']['model_calls_per_token']:.2f} |")
    return out


def training_and_profile_markdown(extras: dict, family: str, name: str) -> list[str]:
    """A blank line, then the training step times of `training_times` (family key `family`, shown as `name`), the
    cProfile of `profile_generate` and the whole run's time."""
    t = extras["training"]
    out = ["", f"Training step time, fresh `{t['preset']}` models (batch {t['batch_size']} × {t['seq_len']}):", "",
           "| family | s/step | tokens/s |", "|---|---|---|"]
    out += [f"| {f} | {t[f]['seconds_per_step']:.3f} | {t[f]['tokens_per_s']:.0f} |" for f in ("ar", family)]
    out += [f"\n{name}/AR training tokens/s: {t[f'{family}_over_ar_tokens_per_s']:.2f}x", "",
            (f"cProfile of one batch-1 {name} generate() ({extras['profile']['new_tokens']} new tokens, "
             f"{extras['profile']['wall_s']:.2f} s under the profiler), top by cumulative time:"), "```",
            extras["profile"]["text"].strip(), "```", f"\nwhole run: {extras['wall_s']:.0f} s"]
    return out
