"""Side-by-side benchmark of several models in ONE process run, relative to a baseline.

Absolute speed on shared machines drifts, so the headline is each model's ratio to the
baseline measured in the same run: tokens/s at batch 1 and batch 8 (same prompts, same number
of new tokens; the baseline is timed again next to each model), model calls per token, and
quality (BrierLM-2, NLL, MAUVE).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..loading import load_model_and_tokenizer
from .harness import evaluate_model, split_stream
from .sampling import evaluation_windows
from .speed import speed_versus_baseline


def named_models(items: list[str]) -> dict[str, str]:
    """`--model NAME=DIR` items -> {name: folder}, refused with one line when malformed or a name repeats."""
    models = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--model expects NAME=DIR, got {item!r}")
        if name in models:
            raise ValueError(f"model name {name!r} given twice")
        models[name] = path
    return models


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
    base_model, base_tokenizer = load_model_and_tokenizer(models[baseline])
    prompts, _ = evaluation_windows(split_stream(base_tokenizer, "validation"), max(batch_sizes), speed_prompt_len, 1)
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
                                 generate_kwargs=generate_kwargs.get(name), nll=nll)
        rows[name] = {"path": str(path), "num_parameters": speed["num_parameters"]["model"],
                      "model_type": model.config.model_type, "speed": speed["model"],
                      "baseline_speed": speed["baseline"], **quality,
                      "ratio_to_baseline": {f"tokens_per_s_{k}": r for k, r in speed["ratio"].items()}}
        del model
    base = rows[baseline]
    for row in rows.values():
        row["ratio_to_baseline"]["brierlm_2"] = _safe_ratio(row["brier"]["brierlm_2"]["value"],
                                                            base["brier"]["brierlm_2"]["value"])
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


def _safe_ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _fmt_ci(entry: dict, digits: int) -> str:
    mark = " (≈0)" if entry["interval_contains_zero"] else ""
    return f"{entry['value']:.{digits}f} [{entry['ci_low']:.{digits}f}, {entry['ci_high']:.{digits}f}]{mark}"


def markdown_table(report: dict) -> str:
    """One row per model: speed, calls/token, ratios, quality with intervals."""
    head = ("| model | params | tok/s b1 | tok/s b8 | calls/token | speed×AR b1 | speed×AR b8 | NLL | "
            "Brier-1 | Brier-2 | Brier-3 | Brier-4 | BrierLM-2 | MAUVE |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, row in report["models"].items():
        s, b, r = row["speed"], row["brier"], row["ratio_to_baseline"]
        nll = f"{row['nll']['nll']:.3f}" if "nll" in row else "—"
        mauve = f"{row['mauve']['mauve']:.3f}" if "mauve" in row else "—"
        lines.append(
            f"| {name} | {row['num_parameters'] / 1e6:.2f}M | {s['batch_1']['tokens_per_s']:.0f} | "
            f"{s['batch_8']['tokens_per_s']:.0f} | {s['batch_1']['model_calls_per_token']:.2f} | "
            f"{r['tokens_per_s_batch_1']:.2f} | {r['tokens_per_s_batch_8']:.2f} | {nll} | "
            + " | ".join(_fmt_ci(b[f"brier_{n}"], 4) for n in range(1, 5))
            + f" | {_fmt_ci(b['brierlm_2'], 2)} | {mauve} |")
    return "\n".join(lines) + "\n"


def write_report(report: dict, json_path: str | os.PathLike, markdown_path: str | os.PathLike | None = None) -> str:
    table = markdown_table(report)
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    if markdown_path:
        Path(markdown_path).write_text(table)
    return table
