"""One report across families: every model and decoding setting next to the AR baseline, in one process run.

`build_report` runs the side-by-side benchmark (`bench.benchmark_models`) once per model and decoding setting (a
family's default `generate()` and each of its registry `speed_variants`), adds what each model was trained on and
every value relative to the AR entry. `write_report` writes `report.md`, `report.json` and `speed_quality.png`:
BrierLM-2 ÷ AR against tokens/s ÷ AR, one point per entry with its interval, the shape of the PLM paper's Figure 1.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..families import BASELINE_FAMILY, FAMILIES, family_of_model_type
from ..folders import check_model_folder, read_json_file
from ..presets import get_preset
from ..training.checkpoint import STATE_FILE, latest_checkpoint
from .bench import benchmark_models, format_ci, gap_cell, markdown_table

#: The name the AR baseline must be given (`--model ar=DIR`): every relative value divides by its entry.
BASELINE_NAME = BASELINE_FAMILY
BATCH_SIZES = (1, 8)


def training_record(folder: str | os.PathLike) -> dict:
    """Optimizer steps and training tokens of a `train` output folder.

    Steps: the last logged step of `metrics.jsonl`. Tokens: its last logged `tokens`; for folders written before the
    loop logged them, the newest `checkpoint-*/trainer_state.json`, which holds the
    rows consumed (`data_position`, all processes and accumulation steps included) and the run's `seq_len`; tokens
    per step times the logged steps. None where the folder does not hold that record (e.g. only the final model
    was copied), never a guess from the preset.
    """
    folder = Path(folder)
    steps = tokens = components = None
    metrics = folder / "metrics.jsonl"
    if metrics.is_file():
        logged = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        steps = max((record["step"] for record in logged if "step" in record), default=None)
        tokens = max((record["tokens"] for record in logged if "tokens" in record), default=None)
    checkpoint = latest_checkpoint(folder) if folder.is_dir() else None
    if checkpoint is not None and (checkpoint / STATE_FILE).is_file():
        state = read_json_file(checkpoint / STATE_FILE, f"checkpoint {str(checkpoint)!r}")
        components = state["config"].get("components") or None  # the component folders it was built from
        if tokens is None and state.get("step"):
            tokens_per_step = state["data_position"] * state["config"]["seq_len"] / state["step"]
            steps = steps if steps is not None else state["step"]
            tokens = round(tokens_per_step * steps)
    return {"steps": steps, "tokens": tokens, "components": components}


def training_compute(folder: str | os.PathLike, language_model: bool = True) -> dict:
    """`training_record` of a `train` folder plus its training FLOPs: tokens × the FLOPs per token of one training
    step of the saved model (`flops.training_flops_per_token` at the length it was trained at; a frozen component
    counts its forward only, as in training), and the same for each component it was built from. `train_flops` is
    None where the tokens are unknown."""
    from ..loading import load_model_and_tokenizer
    from .flops import training_flops_per_token
    from .sampling import trained_length

    record = training_record(folder)
    model, _ = load_model_and_tokenizer(str(folder), language_model=language_model)
    seq_len = trained_length(model.config) or get_preset("small").seq_len
    per_token = training_flops_per_token(model, seq_len)["per_token"]
    del model
    record.update(flops_per_token=per_token,
                  train_flops=None if record["tokens"] is None else record["tokens"] * per_token)
    record["components"] = {name: training_compute(path, language_model=False)
                            for name, path in (record["components"] or {}).items() if Path(path).is_dir()}
    return record


#: A model whose training FLOPs differ from AR's by more than this fraction is flagged in the table.
BUDGET_TOLERANCE = 0.10


def budget_ratios(records: dict[str, dict], baseline: str = BASELINE_NAME) -> dict[str, float | None]:
    """Each model's training FLOPs ÷ the baseline's (its own run; components apart); None where either is unknown."""
    reference = records[baseline]["train_flops"]
    return {name: None if not reference or r["train_flops"] is None else r["train_flops"] / reference
            for name, r in records.items()}


def plan_entries(models: dict[str, str]) -> dict[str, dict]:
    """Entry name -> {model, path, family, decoding, generate_kwargs}; every folder checked before anything runs.

    Refused with one line: no `ar` model, a folder that is missing or not a saved model."""
    if BASELINE_NAME not in models:
        raise ValueError(f"the report needs the AR baseline as --model {BASELINE_NAME}=DIR: every speed and quality "
                         f"value is relative to it (got {sorted(models)})")
    entries = {}
    for name, path in models.items():
        model_type = check_model_folder(path, f"--model {name}={path}")["model_type"]
        spec = family_of_model_type(model_type)
        family = spec.name if spec else BASELINE_FAMILY if name == BASELINE_NAME else model_type
        if spec is not None and not spec.language_model:
            raise ValueError(f"--model {name}={path} holds a {spec.name} component, not a language model")
        # The family's default decoding and each of its registry speed variants (label -> extra generate() options).
        for label, kwargs in {"default": {}, **(spec.speed_variants if spec else {})}.items():
            entry = name if label == "default" else f"{name} ({label})"
            entries[entry] = {"model": name, "path": str(path), "family": family, "decoding": label,
                              "generate_kwargs": dict(kwargs)}
    return entries


def relative_to_baseline(rows: dict, baseline: str = BASELINE_NAME) -> None:
    """Adds `relative_to_ar` to every row: tokens/s ÷ AR's timed next to it (the bench's ratios, per batch size) and
    BrierLM-2 with its interval ÷ AR's BrierLM-2 (None where AR's is 0: the ratio is undefined)."""
    reference = rows[baseline]["brier"]["brierlm_2"]["value"]
    for row in rows.values():
        b2 = row["brier"]["brierlm_2"]
        row["relative_to_ar"] = {
            **{f"tokens_per_s_batch_{b}": row["ratio_to_baseline"][f"tokens_per_s_batch_{b}"] for b in BATCH_SIZES},
            **{f"brierlm_2{suffix}": (b2[key] / reference if reference else None)
               for suffix, key in (("", "value"), ("_ci_low", "ci_low"), ("_ci_high", "ci_high"))}}


def build_report(models: dict[str, str], num_positions: int = 2000, context_len: int = 128,
                 max_new_tokens: int = 64, repeats: int = 3, mauve: bool = True, mauve_samples: int = 400,
                 seed: int = 0, progress: bool = True, command: str | None = None) -> dict:
    """Measure every model (name -> folder; `ar` is the baseline) at every decoding setting, in this process."""
    entries = plan_entries(models)
    require_plotting()  # before the long run, not after it
    load_at_start = os.getloadavg()
    if mauve:
        from .mauve import _require_extra

        _require_extra()
    # NLL is left out: not in the table, and for a likelihood model it costs a pass over the whole split per entry.
    report = benchmark_models({name: e["path"] for name, e in entries.items()}, BASELINE_NAME, num_positions,
                              context_len, max_new_tokens=max_new_tokens, repeats=repeats, batch_sizes=BATCH_SIZES,
                              mauve=mauve, mauve_samples=mauve_samples, nll=False, seed=seed, progress=progress,
                              generate_kwargs={n: e["generate_kwargs"] for n, e in entries.items()
                                               if e["generate_kwargs"]})
    records = {name: training_compute(path) for name, path in models.items()}
    ratios = budget_ratios(records)
    for name, row in report["models"].items():
        model = entries[name]["model"]
        row.update({key: entries[name][key] for key in ("model", "family", "decoding", "generate_kwargs")},
                   training={**records[model], "flops_over_ar": ratios[model]})
    relative_to_baseline(report["models"])
    present = {e["family"] for e in entries.values()}
    report["families_not_reported"] = sorted(
        s.name for s in FAMILIES.values() if s.language_model and s.name not in present)
    report["command"] = command
    # Absolute tokens/s depend on what else the machine ran; the ratios to AR much less so.
    report["machine"]["load_average_1min"] = {"start": load_at_start[0], "end": os.getloadavg()[0]}
    return report


def _tokens(training: dict) -> str:
    if training["tokens"] is not None:
        tokens = training["tokens"]
        return f"{f'{tokens / 1e6:.2f}M' if tokens >= 10_000 else tokens} ({training['steps']} steps)"
    return f"— ({training['steps']} steps)" if training["steps"] is not None else "—"


def _flops(training: dict) -> str:
    """Training FLOPs with their ratio to AR's, flagged when it is off by more than `BUDGET_TOLERANCE`."""
    if training.get("train_flops") is None:
        return "—"
    ratio = training.get("flops_over_ar")
    if ratio is None:
        return f"{training['train_flops']:.3g}"
    flag = " ⚠ not AR's budget" if abs(ratio - 1) > BUDGET_TOLERANCE else ""
    return f"{training['train_flops']:.3g} ({ratio:.2f}× AR){flag}"


def _components(training: dict) -> str:
    parts = [f"{name}: {_tokens(c)}, {c['train_flops']:.3g}" if c.get("train_flops") is not None else
             f"{name}: {_tokens(c)}" for name, c in (training.get("components") or {}).items()]
    return "; ".join(parts) or "—"


def _ratio(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def report_table(report: dict) -> str:
    """One row per model and decoding setting."""
    head = ["model", "decoding", "params", "trained on", "train FLOPs", "components (tokens, FLOPs)", "tok/s b1", "tok/s b8", "calls/token", "speed×AR b1",
            "speed×AR b8", "BrierLM-2", "BrierLM-2 ×AR", "MAUVE"]
    optimum = any("optimum" in row for row in report["models"].values())
    if optimum:  # trained on a generated language: the share of the gap between its unigram and its optimum
        head.append("gap closed (BrierLM-2)")
    rows = []
    for name, row in report["models"].items():
        s, r = row["speed"], row["relative_to_ar"]
        relative_b2 = ("—" if r["brierlm_2"] is None else
                       f"{r['brierlm_2']:.2f} [{r['brierlm_2_ci_low']:.2f}, {r['brierlm_2_ci_high']:.2f}]")
        rows.append([name, row["decoding"], f"{row['num_parameters'] / 1e6:.2f}M", _tokens(row["training"]),
                     _flops(row["training"]), _components(row["training"]),
                     f"{s['batch_1']['tokens_per_s']:.0f}", f"{s['batch_8']['tokens_per_s']:.0f}",
                     f"{s['batch_1']['model_calls_per_token']:.2f}", _ratio(r["tokens_per_s_batch_1"]),
                     _ratio(r["tokens_per_s_batch_8"]), format_ci(row["brier"]["brierlm_2"], 2), relative_b2,
                     f"{row['mauve']['mauve']:.3f}" if "mauve" in row else "—", *([gap_cell(row)] if optimum else [])])
    return markdown_table(head, rows)


def markdown_report(report: dict) -> str:
    settings, machine = report["settings"], report["machine"]
    run = (f"One process run, {report['date']}, {machine['platform']}, {machine['cpu_count']} CPUs, torch "
           f"{machine['torch']} ({machine['torch_threads']} threads), load average "
           f"{machine['load_average_1min']['start']:.1f} at the start and {machine['load_average_1min']['end']:.1f} "
           f"at the end.")
    brier = (f"- BrierLM-2 = 100·√(Brier-1·Brier-2) on {report['models'][BASELINE_NAME]['brier']['num_positions']} "
             f"validation positions (context {settings['context_len']}), 95% bootstrap interval; (≈0): an interval "
             f"that contains 0. ×AR divides the value and its interval by AR's BrierLM-2 (AR's own uncertainty is "
             f"not propagated).")
    speed = (f"- Speed: {settings['max_new_tokens']} new tokens after {settings['speed_prompt_len']}-token "
             f"validation prompts, EOS ignored, median of {settings['repeats']} runs after a warm-up; speed×AR "
             f"divides by the AR baseline timed again next to each entry. calls/token: network evaluations per "
             f"generated token at batch 1 (every network a family runs, prefill included).")
    mauve = (f"- MAUVE: {settings['mauve_samples']} continuations of 128 tokens against the human ones "
             f"(all-MiniLM-L6-v2 features)." if "mauve_samples" in settings else "- MAUVE: not measured in this run.")
    columns = ("- params: every parameter of the checkpoint (frozen autoencoders and EMA copies included). trained "
               "on: tokens of the model's own training run; — where the folder holds no record of it. train FLOPs: "
               "those tokens × the FLOPs of one training step per token (forward + backward, torch's FlopCounterMode; "
               "a frozen component's forward included), and the ratio to AR's; ⚠ marks a model whose budget differs "
               f"from AR's by more than {BUDGET_TOLERANCE:.0%}. components: the stages trained before the model "
               "(an autoencoder, a VAE), listed apart as the papers count them, not in its train FLOPs.")
    out = ["# Speed and quality of every family against the AR baseline", "", "```bash", report["command"] or "",
           "```", "", run, "", report_table(report), brier, speed, mauve, columns,
           "- Plot: [speed_quality.png](speed_quality.png); raw numbers: [report.json](report.json)."]
    if report["families_not_reported"]:
        out.append(f"- Not in this report (no model given): {', '.join(report['families_not_reported'])}.")
    return "\n".join(out) + "\n"


def require_plotting():
    """matplotlib, or an ImportError that says how to get it."""
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError("the report's plot needs matplotlib: pip install 'hf-latentlm[eval]'") from err
    return matplotlib


def speed_quality_figure(report: dict):
    """The figure: one panel per batch size, x = tokens/s ÷ AR, y = BrierLM-2 ÷ AR with its interval, one point per
    entry (entries whose relative BrierLM-2 is undefined are left out and named in the title)."""
    matplotlib = require_plotting()
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(BATCH_SIZES), figsize=(6 * len(BATCH_SIZES), 4.8), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, b in zip(axes[0], BATCH_SIZES):
        skipped = []
        for i, (name, row) in enumerate(report["models"].items()):
            r = row["relative_to_ar"]
            if r["brierlm_2"] is None:
                skipped.append(name)
                continue
            x, y = r[f"tokens_per_s_batch_{b}"], r["brierlm_2"]
            yerr = [[y - r["brierlm_2_ci_low"]], [r["brierlm_2_ci_high"] - y]]
            ax.errorbar([x], [y], yerr=yerr, fmt="o", capsize=4, color=colors[i % len(colors)], label=name)
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.axvline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xlabel(f"tokens/s relative to AR (batch {b})")
        ax.set_ylabel("BrierLM-2 relative to AR (95% interval)")
        ax.set_title(f"batch {b}" + (f" — not plotted (AR BrierLM-2 = 0): {', '.join(skipped)}" if skipped else ""),
                     fontsize=10)
        ax.grid(alpha=0.3)
        if len(skipped) < len(report["models"]):
            ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return fig


def write_report(report: dict, output: str | os.PathLike) -> dict[str, Path]:
    """`report.md`, `report.json` and `speed_quality.png` in `output` (created); returns their paths."""
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": output / "report.md", "json": output / "report.json", "plot": output / "speed_quality.png"}
    paths["json"].write_text(json.dumps(report, indent=1) + "\n")
    paths["markdown"].write_text(markdown_report(report))
    fig = speed_quality_figure(report)
    fig.savefig(paths["plot"], dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return paths
