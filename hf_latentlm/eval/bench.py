"""Side-by-side benchmark of several models in ONE process run, relative to a baseline.

Absolute speed on shared machines drifts, so the headline is each model's ratio to the baseline measured in the same
run: tokens/s at batch 1 and batch 8 (same prompts, same number of new tokens; the baseline is timed again next to
each model), model calls per token, and quality (BrierLM-2, NLL, MAUVE). `bench_extras` measures each model further
in the same process: other decoding settings (its family's, `FamilySpec.bench_decodings`, and sweeps of one
`generate()` option), the family's own measurements, training step time and a profile of `generate()`.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import platform
import pstats
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..data.generated import GeneratedLanguage
from ..families import family_of_model_type
from ..folders import check_model_folder
from ..loading import load_model_and_tokenizer
from ..presets import get_preset
from .brier import evaluate_brier
from .harness import check_evaluation_lengths, evaluate_model, nll_rows, split_stream
from .optimum import evaluation_stream, percent_interval
from .sampling import evaluation_windows
from .flops import counted_training_flops
from .speed import compiled_decoding_speed, fresh_training_step_time, speed_versus_baseline


def benchmark_models(models: dict[str, str], baseline: str, num_positions: int = 20000, context_len: int = 128,
                     speed_prompt_len: int = 64, max_new_tokens: int = 64, repeats: int = 3,
                     batch_sizes: tuple[int, ...] = (1, 8), mauve: bool = False, seed: int = 0,
                     progress: bool = True, generate_kwargs: dict[str, dict] | None = None,
                     mauve_samples: int = 400, nll: bool = True) -> dict:
    """Speed (`speed_versus_baseline`) and quality (`evaluate_model`) of each model, name -> folder.

    All models must share the baseline's tokenizer: speed and quality are compared on the same token ids.
    `generate_kwargs`: model name -> extra `generate()` options for its speed, Brier and MAUVE runs, merged over
    the unbiased-sampling defaults. Each row's `baseline_speed` is the baseline timing its ratio divides by.
    """
    if not models:
        raise ValueError("no models to benchmark")
    if baseline not in models:
        raise ValueError(f"baseline {baseline!r} is not among the models {sorted(models)}")
    generate_kwargs = generate_kwargs or {}
    if set(generate_kwargs) - set(models):
        raise ValueError(f"generate_kwargs names models {sorted(set(generate_kwargs) - set(models))} that are not "
                         f"among {sorted(models)}")
    for name, path in models.items():  # before anything runs: a model trained at shorter rows is refused now
        check_evaluation_lengths(check_model_folder(path, f"model {name!r}"), context_len, mauve, f"model {name!r}")
    language = shared_language(models)
    base_model, base_tokenizer = load_model_and_tokenizer(models[baseline])
    stream = split_stream(base_tokenizer, "validation") if language is None else evaluation_stream(language)
    prompts, _ = evaluation_windows(stream, max(batch_sizes), speed_prompt_len, 1)
    rows = {}
    for name, path in tqdm(models.items(), desc="models", disable=not progress, dynamic_ncols=True):
        model, tokenizer = (base_model, base_tokenizer) if name == baseline else load_model_and_tokenizer(path)
        if tokenizer.get_vocab() != base_tokenizer.get_vocab():
            raise ValueError(f"model {name!r} has another tokenizer than the baseline {baseline!r}; the benchmark "
                             f"compares models on the same token ids")
        speed = speed_versus_baseline(model, base_model, prompts, batch_sizes, max_new_tokens, repeats, seed,
                                      generate_kwargs.get(name), generate_kwargs.get(baseline))
        quality = evaluate_model(model, tokenizer, "validation", num_positions, context_len, seed=seed, mauve=mauve,
                                 mauve_samples=mauve_samples, progress=progress,
                                 generate_kwargs=generate_kwargs.get(name), nll=nll, language=language)
        rows[name] = {"path": str(path), "num_parameters": speed["num_parameters"]["model"],
                      "model_type": model.config.model_type, "speed": speed["model"],
                      "baseline_speed": speed["baseline"], **quality,
                      "ratio_to_baseline": {**{f"tokens_per_s_{k}": r for k, r in speed["ratio"].items()},
                                            **{f"flops_per_s_{k}": r for k, r in speed["flops_per_s_ratio"].items()}}}
        del model
    reference = rows[baseline]["brier"]["brierlm_2"]["value"]
    for row in rows.values():
        row["ratio_to_baseline"]["brierlm_2"] = row["brier"]["brierlm_2"]["value"] / reference if reference else None
    return {
        "command": " ".join(["hf-latentlm", *sys.argv[1:]]) if sys.argv and "hf-latentlm" in sys.argv[0] else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads()},
        "baseline": baseline,
        "settings": {"num_positions": num_positions, "context_len": context_len, "speed_prompt_len": speed_prompt_len,
                     "max_new_tokens": max_new_tokens, "repeats": repeats, "seed": seed,
                     **({"mauve_samples": mauve_samples} if mauve else {}),
                     **({"generate_kwargs": generate_kwargs} if generate_kwargs else {})},
        "models": rows,
    }


def shared_language(models: dict[str, str]) -> GeneratedLanguage | None:
    """The generated language every model folder records (`train --corpus generated:LEVEL`), or None when none
    does; ValueError when they were trained on different corpora (their numbers would not be comparable)."""
    languages = {name: GeneratedLanguage.from_folder(path) for name, path in models.items()}
    specs = {name: None if language is None else language.spec for name, language in languages.items()}
    if len(set(specs.values())) > 1:
        described = ", ".join(f"{name}: {'the embedded corpus' if spec is None else languages[name].name or spec}"
                              for name, spec in specs.items())
        raise ValueError(f"the models were trained on different corpora ({described}); compare models of one corpus")
    return next(iter(languages.values()))


def gap_cell(row: dict) -> str:
    """BrierLM-2 gap closed with its interval, in percent, or — for a model not trained on a generated language."""
    return percent_interval(row["optimum"]["gap_closed"]["brierlm_2"]) if "optimum" in row else "—"


def format_ci(entry: dict, digits: int) -> str:
    """A value with its 95% interval, marked (≈0) when the interval contains 0."""
    mark = " (≈0)" if entry["interval_contains_zero"] else ""
    return f"{entry['value']:.{digits}f} [{entry['ci_low']:.{digits}f}, {entry['ci_high']:.{digits}f}]{mark}"


def markdown_table(head: list[str], rows: list[list]) -> str:
    """A Markdown table: the header cells, the rule, one line per row of cells."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(map(str, row)) + " |" for row in rows]) + "\n"


def bench_table(report: dict) -> str:
    """One row per model: speed, calls/token, ratios, quality with intervals."""
    head = ["model", "params", "tok/s b1", "tok/s b8", "calls/token", "speed×AR b1", "speed×AR b8",
            "FLOPs/token b1", "FLOP/s×AR b1", "FLOP/s×AR b8", "NLL",
            "Brier-1", "Brier-2", "Brier-3", "Brier-4", "BrierLM-2", "MAUVE"]
    optimum = any("optimum" in row for row in report["models"].values())
    if optimum:
        head.append("gap closed (BrierLM-2)")
    rows = []
    for name, row in report["models"].items():
        s, b, r = row["speed"], row["brier"], row["ratio_to_baseline"]
        rows.append([name, f"{row['num_parameters'] / 1e6:.2f}M", f"{s['batch_1']['tokens_per_s']:.0f}",
                     f"{s['batch_8']['tokens_per_s']:.0f}", f"{s['batch_1']['model_calls_per_token']:.2f}",
                     f"{r['tokens_per_s_batch_1']:.2f}", f"{r['tokens_per_s_batch_8']:.2f}",
                     f"{s['batch_1']['flops_per_token']:.3g}", f"{r['flops_per_s_batch_1']:.2f}",
                     f"{r['flops_per_s_batch_8']:.2f}",
                     f"{row['nll']['nll']:.3f}" if "nll" in row else "—",
                     *(format_ci(b[f"brier_{n}"], 4) for n in range(1, 5)), format_ci(b["brierlm_2"], 2),
                     f"{row['mauve']['mauve']:.3f}" if "mauve" in row else "—", *([gap_cell(row)] if optimum else [])])
    settings = report["settings"]
    return (markdown_table(head, rows) + f"\nBrier windows: {settings['context_len']} tokens of context, "
            f"{settings['num_positions']} positions.\n")


def write_report(report: dict, json_path: str | os.PathLike, markdown_path: str | os.PathLike | None = None) -> str:
    table = bench_table(report) + (extras_markdown(report["extras"]) if "extras" in report else "")
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    if markdown_path:
        Path(markdown_path).write_text(table)
    return table


# ====================================================================================================================
# Extras: what one model does beyond the side-by-side table (`hf-latentlm bench --extras / --sweep / --train-steps /
# --profile`), each model measured next to the baseline in the same process.
# ====================================================================================================================

def decoding_row(model, baseline, stream, prompts, options: dict, positions: int, new_tokens: int, repeats: int,
                 seed: int) -> dict:
    """Speed at batch 1 and 8 next to the baseline (with calls per token by network where the family has several)
    and BrierLM-2 of `model` under the `generate()` options."""
    speed = speed_versus_baseline(model, baseline, prompts, (1, 8), new_tokens, repeats, seed,
                                  {**options, "return_dict_in_generate": True})
    return {"generate_kwargs": options, "speed": speed["model"], "baseline_speed": speed["baseline"],
            "ratio_to_baseline": speed["ratio"], "flops_per_s_ratio_to_baseline": speed["flops_per_s_ratio"],
            "brier": evaluate_brier(model, stream, positions, seed=seed, generate_kwargs=options)}


@torch.no_grad()
def profile_generate(model, prompt: torch.Tensor, new_tokens: int, top: int = 15) -> dict:
    """cProfile of one batch-1 `generate()` (the model's defaults, EOS ignored) after a warm-up run: the top `top`
    functions by cumulative time. torch ops show as builtins, so their tottime is arithmetic (plus dispatch) and the
    rest of a Python function's cumulative time is its overhead."""
    kwargs = {"attention_mask": torch.ones_like(prompt), "max_new_tokens": new_tokens, "eos_token_id": None}
    model.generate(prompt, **kwargs)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.runcall(model.generate, prompt, **kwargs)
    wall = time.perf_counter() - start
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(top)
    # Paths relative to the repository or to site-packages.
    text = re.sub(r"\S*/site-packages/", "", text.getvalue().replace(str(Path.cwd()) + "/", ""))
    return {"new_tokens": new_tokens, "wall_s": wall, "text": text}


def git_state() -> dict:
    """The commit of the imported package and its files that differed from it when the run started."""
    root = Path(__file__).resolve().parents[2]

    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=root).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "modified": git("status", "--porcelain", "--", "hf_latentlm").splitlines()}


def bench_extras(models: dict[str, str], baseline: str, sweeps: dict[str, dict[str, dict]] | None = None,
                 family_extras: bool = False, train_steps: int = 0, train_preset: str = "small",
                 profile: bool = False, sweep_positions: int = 500, max_new_tokens: int = 64, repeats: int = 3,
                 seed: int = 0, compiled: bool = False) -> dict:
    """Per model (name -> folder): decoding rows (`decoding_row`) for each `generate()` setting of `sweeps` (model
    name -> label -> options) and, with `family_extras`, of its family's bench decodings, plus the family's own
    measurements; the training step time of a copy of every model (`train_steps` > 0; rows and batch of
    `train_preset`); a cProfile of one batch-1 `generate()` (`profile`); eager and compiled decoding speed at batch 1
    and 8 (`compiled`, `compiled_decoding_speed`: a family compiles its own networks, a plain transformers model
    such as the baseline compiles with transformers' static cache), with each compiled speed over the baseline's."""
    sweeps = sweeps or {}
    base, tokenizer = load_model_and_tokenizer(models[baseline])
    base.eval()
    stream = split_stream(tokenizer, "validation")
    prompts, _ = evaluation_windows(stream, 8, 64, 1)
    if train_steps:
        preset = get_preset(train_preset)
        train_rows = nll_rows(split_stream(tokenizer, "train"), preset.seq_len)
    result = {"settings": {"sweep_positions": sweep_positions, "max_new_tokens": max_new_tokens, "repeats": repeats,
                           "train_steps": train_steps, "train_preset": train_preset, "compiled": compiled},
              "git": git_state(), "models": {}}
    for name, path in models.items():
        model = base if name == baseline else load_model_and_tokenizer(path)[0].eval()
        spec = family_of_model_type(model.config.model_type) if family_extras else None
        row = {}
        decodings = {**(spec.bench_decodings if spec else {}), **sweeps.get(name, {})}
        if decodings:
            decodings = {"default": {}, **decodings}
            row["decodings"] = {label: decoding_row(model, base, stream, prompts, options, sweep_positions,
                                                    max_new_tokens, repeats, seed)
                                for label, options in decodings.items()}
        if spec is not None and spec.bench_measurements is not None:
            row["measurements"] = spec.bench_measurements(model, base, stream)
        if train_steps:
            row["training"] = fresh_training_step_time(model, train_rows, train_steps, preset.batch_size)
            # Achieved FLOP/s = counted FLOPs per token of the step on a batch of the timed size (forward +
            # backward) x tokens/s: above or below the baseline's, a family is faster or slower than its arithmetic.
            flops = counted_training_flops(model, train_rows[:preset.batch_size])["per_token"]
            row["training"].update(flops_per_token=flops, achieved_flops_per_s=flops * row["training"]["tokens_per_s"])
        if profile:
            row["profile"] = profile_generate(model, prompts[:1], max_new_tokens)
        if compiled:
            row["compiled_decoding"] = compiled_decoding_speed(model, prompts, (1, 8), max_new_tokens, repeats, seed,
                                                               static_cache=not hasattr(model, "compiled_methods"))
        result["models"][name] = row
        del model
    if compiled:
        reference = result["models"][baseline]["compiled_decoding"]
        for row in result["models"].values():
            row["compiled_decoding"]["compiled_over_baseline_compiled"] = {
                key: speed["tokens_per_s"] / reference["compiled"][key]["tokens_per_s"]
                for key, speed in row["compiled_decoding"]["compiled"].items()}
    if train_steps:
        reference = result["models"][baseline]["training"]
        for row in result["models"].values():
            for key in ("tokens_per_s", "achieved_flops_per_s"):
                row["training"][f"{key}_over_baseline"] = row["training"][key] / reference[key]
    return result


def extras_markdown(extras: dict) -> str:
    """The Markdown of `bench_extras`: a decoding table per model, the training step times, each family's own
    measurements (JSON) and the profiles."""
    out = []
    for name, row in extras["models"].items():
        if "decodings" in row:
            table = []
            for label, d in row["decodings"].items():
                s, r = d["speed"], d["ratio_to_baseline"]
                by_network = s["batch_1"].get("calls_per_token_by_network", {})
                f = d["flops_per_s_ratio_to_baseline"]
                table.append([label, f"{s['batch_1']['model_calls_per_token']:.3f}",
                              " / ".join(f"{k} {v:.3f}" for k, v in by_network.items()) or "—",
                              f"{s['batch_1']['tokens_per_s']:.0f}", f"{s['batch_8']['tokens_per_s']:.0f}",
                              f"{r['batch_1']:.2f}", f"{r['batch_8']:.2f}", f"{s['batch_1']['flops_per_token']:.3g}",
                              f"{f['batch_1']:.2f}", f"{f['batch_8']:.2f}", format_ci(d["brier"]["brierlm_2"], 2)])
            out += [f"\n{name}: decoding settings (BrierLM-2 on {extras['settings']['sweep_positions']} positions; "
                    f"calls per generated token at batch 1, prefill included):\n",
                    markdown_table(["decoding", "calls/token", "by network", "tok/s b1", "tok/s b8", "×baseline b1",
                                    "×baseline b8", "FLOPs/token b1", "FLOP/s ×baseline b1", "FLOP/s ×baseline b8",
                                    "BrierLM-2"], table)]
    trained = {name: row["training"] for name, row in extras["models"].items() if "training" in row}
    if trained:
        out += [f"\nTraining step time, copies of the models, `{extras['settings']['train_preset']}` batches:\n",
                markdown_table(["model", "s/step", "tokens/s", "×baseline tokens/s", "FLOPs/token", "GFLOP/s achieved",
                                "×baseline FLOP/s"],
                               [[n, f"{t['seconds_per_step']:.3f}", f"{t['tokens_per_s']:.0f}",
                                 f"{t['tokens_per_s_over_baseline']:.2f}", f"{t['flops_per_token']:.3g}",
                                 f"{t['achieved_flops_per_s'] / 1e9:.2f}", f"{t['achieved_flops_per_s_over_baseline']:.2f}"]
                                for n, t in trained.items()])]
    compiled = {name: row["compiled_decoding"] for name, row in extras["models"].items() if "compiled_decoding" in row}
    if compiled:
        out += ["\nCompiled decoding (`generate(compile_config=...)`: the family's networks under torch.compile; a plain "
                "transformers model with its static cache), tokens/s eager → compiled, and compiled over the baseline "
                "compiled; first call: the first compiled generate(), compiling included:\n",
                markdown_table(["model", "tok/s b1 eager → compiled", "×eager b1", "tok/s b8 eager → compiled",
                                "×eager b8", "compiled ×baseline compiled b1 / b8", "first call s b1 / b8"],
                               [[n, *(cell for key in ("batch_1", "batch_8") for cell in (
                                   f"{c['eager'][key]['tokens_per_s']:.0f} → {c['compiled'][key]['tokens_per_s']:.0f}",
                                   f"{c['compiled_over_eager'][key]:.2f}")),
                                 " / ".join(f"{c['compiled_over_baseline_compiled'][k]:.2f}"
                                            for k in ("batch_1", "batch_8")),
                                 " / ".join(f"{c['compiled'][k]['first_call_s']:.0f}" for k in ("batch_1", "batch_8"))]
                                for n, c in compiled.items()])]
    for name, row in extras["models"].items():
        if "measurements" in row:
            out.append(f"\n{name}: family measurements\n```json\n{json.dumps(row['measurements'], indent=1)}\n```")
        if "profile" in row:
            p = row["profile"]
            out.append(f"\n{name}: cProfile of one batch-1 generate() ({p['new_tokens']} new tokens, {p['wall_s']:.2f} s "
                       f"under the profiler), top by cumulative time:\n```\n{p['text'].strip()}\n```")
    if extras["git"]["modified"]:
        out.append(f"\nThe package differed from commit {extras['git']['commit'][:10]}: {extras['git']['modified']}")
    return "\n".join(out) + "\n"
