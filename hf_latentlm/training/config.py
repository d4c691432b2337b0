"""`TrainConfig`, every knob of a training run, and its checks. Kept apart from the loop and free of torch, so that
`hf-latentlm train` refuses a bad value in a second, before the slow imports."""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import asdict, dataclass, field

from ..data.generated import parse_corpus
from ..presets import get_preset

#: The experiment trackers `report_to` names, each with the package it needs (the `track` extra installs them all).
TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}


def parse_report_to(value: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """The trackers `value` names, as `TrainingArguments.report_to` reads it: "none" (or None) for none, "all" for
    every installed one of `TRACKERS`, else one name, a comma-separated list or a list of names.

    Raises ValueError for an unknown name, and ImportError (naming the extra) for a named tracker whose package is
    not installed: both before anything trains."""
    if value is None:
        return []
    names = [part.strip() for part in value.split(",")] if isinstance(value, str) else [str(v).strip() for v in value]
    names = [name for name in names if name]
    choices = ", ".join(["none", "all", *TRACKERS])
    unknown = [name for name in names if name not in ("none", "all", *TRACKERS)]
    if unknown:
        raise ValueError(f"report_to: unknown tracker(s) {', '.join(map(repr, unknown))}; choose from {choices} "
                         f"(or a comma-separated list of trackers)")
    if ("none" in names or "all" in names) and len(names) > 1:
        raise ValueError(f"report_to: 'none' and 'all' stand alone, got {value!r}")
    if names in ([], ["none"]):
        return []
    installed = [name for name, package in TRACKERS.items() if importlib.util.find_spec(package) is not None]
    if names == ["all"]:
        return installed
    missing = [TRACKERS[name] for name in dict.fromkeys(names) if name not in installed]
    if missing:
        raise ImportError(f"report_to {', '.join(missing)}: the package {', '.join(missing)} is not installed; "
                          f"pip install 'hf-latentlm[track]' (or {' '.join(missing)})")
    return list(dict.fromkeys(names))


@dataclass
class TrainConfig:
    """Every knob of a training run. `None` means "take the preset's default".

    family / preset: what to build (`hf_latentlm.families`, `hf_latentlm.presets`).
    output_dir: checkpoints (`checkpoint-<step>`), `metrics.jsonl` and the final model.
    max_steps: optimizer steps; the learning-rate schedule spans exactly this many.
    stop_at_step: stop early after this step (checkpoint written) as if interrupted;
        continue later with `resume=True`. The schedule still spans `max_steps`.
    resume: False (a fresh run), True or "latest" (continue from the newest `checkpoint-<step>`; a damaged one is
        refused, naming the file), or "previous" (from the newest complete checkpoint before it: the fallback).
    batch_size: sequences per device per micro-step; grad_accum: micro-steps per optimizer
        step; the global batch is batch_size × grad_accum × number of processes.
    seq_len: packed sequence length in tokens.
    learning_rate, schedule ("cosine" | "wsd"), warmup_steps (default: the preset's, capped at
        a tenth of max_steps), min_lr_ratio (floor of the decay
        as a fraction of the peak), decay_fraction (WSD: share of steps spent decaying).
    weight_decay, adam_beta1, adam_beta2, adam_eps: AdamW settings (decay is not applied to norms,
        biases or other 1-D parameters); grad_clip: global gradient-norm clip (0 turns it off; the
        norm is logged either way).
    eval_every / eval_batches: validation loss every N steps over the first N batches of the
        validation split (eval_every 0 disables). save_every: checkpoint period (the last step
        always saves); keep_checkpoints: how many to keep (0 keeps all). log_every: metrics period
        (loss values leave the device only on log steps).
    corpus: "shakespeare" (the embedded corpus, the default) or "generated:LEVEL", a generated language with an
        exact likelihood (`hf_latentlm.data.generated`): endless training documents from stream `seed` (every rank
        its own documents), fixed validation documents, the language's word-level tokenizer, and the language
        recorded in `output_dir` (`generated_language.json`) for `eval` / `bench` to measure against its optimum.
    train_files / validation_files: the user's own text files instead of the embedded corpus;
        tokenizer: a tokenizer folder or hub id instead of the embedded one.
    dataset: a corpus too large for memory, streamed (`data.dataset_documents`): a folder written by
        `save_to_disk`, a text file or a folder of `*.txt` files. Rows come in corpus order, each rank reading every
        world-th document; validation is the dataset's `validation` split or `validation_files` (else none).
        text_column: its text column (default "text", or its only string column).
    mixed_precision: passed to Accelerate ("no", "bf16", "fp16"); None takes the launch config's
        (`accelerate launch --config_file ...`), else "no".
    components: the trained components the family needs, name -> folder (e.g. `{"autoencoder": DIR}` for
        `calm`; the family registry says which); each is frozen and copied into the model.
    autoencoder: deprecated spelling of `components={"autoencoder": DIR}`.
    model_kwargs: overrides for the family's config.
    report_to: experiment trackers that get the metrics `metrics.jsonl` gets, at the same steps, through Accelerate's
        tracker API: "none" (the default, as `TrainingArguments`'), "tensorboard", "wandb", "trackio", a
        comma-separated list or a list of them, or "all" (every installed one). `resolved()` turns it into a list
        (`parse_report_to`). docs/tracking.md says where each writes and how a resumed run continues.
    """

    family: str = "ar"
    preset: str = "small"
    output_dir: str = "runs/ar-small"
    max_steps: int | None = None
    stop_at_step: int | None = None
    batch_size: int | None = None
    grad_accum: int = 1
    seq_len: int | None = None
    learning_rate: float | None = None
    schedule: str = "cosine"
    warmup_steps: int | None = None
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 20
    save_every: int = 100
    keep_checkpoints: int = 2
    log_every: int = 10
    seed: int = 0
    resume: bool | str = False
    corpus: str | None = None
    train_files: list[str] | None = None
    validation_files: list[str] | None = None
    tokenizer: str | None = None
    dataset: str | None = None
    text_column: str | None = None
    mixed_precision: str | None = None
    progress_bar: bool = True
    components: dict[str, str] = field(default_factory=dict)
    autoencoder: str | None = None
    model_kwargs: dict = field(default_factory=dict)
    report_to: str | list[str] = "none"

    def resolved(self) -> "TrainConfig":
        """A copy with every `None` filled from the preset, checked for bad values."""
        preset = get_preset(self.preset)
        values = asdict(self)
        if values.pop("autoencoder") is not None:
            warnings.warn("TrainConfig.autoencoder is deprecated; use components={'autoencoder': DIR}",
                          FutureWarning, stacklevel=2)
            values["components"] = {**values["components"], "autoencoder": self.autoencoder}
        for name in ("max_steps", "batch_size", "seq_len", "learning_rate"):
            if values[name] is None:
                values[name] = getattr(preset, name)
        if values["warmup_steps"] is None:
            # A shortened run (--max-steps) keeps warmup to at most a tenth of its steps.
            values["warmup_steps"] = min(preset.warmup_steps, values["max_steps"] // 10)
        values["report_to"] = parse_report_to(values["report_to"])
        cfg = TrainConfig(**values)
        for name in ("max_steps", "batch_size", "grad_accum", "seq_len", "save_every", "log_every", "eval_batches"):
            if getattr(cfg, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(cfg, name)}")
        for name in ("eval_every", "keep_checkpoints", "grad_clip"):
            if getattr(cfg, name) < 0:
                raise ValueError(f"{name} must be at least 0, got {getattr(cfg, name)}")
        if cfg.resume not in (False, True, "latest", "previous"):
            raise ValueError(f"resume must be False, True, 'latest' or 'previous', got {cfg.resume!r}")
        if cfg.learning_rate <= 0:
            raise ValueError(f"learning_rate must be positive, got {cfg.learning_rate}")
        if cfg.schedule not in ("cosine", "wsd"):
            raise ValueError(f"schedule must be 'cosine' or 'wsd', got {cfg.schedule!r}")
        if not 0 <= cfg.warmup_steps <= cfg.max_steps:
            raise ValueError(f"warmup_steps must be in [0, max_steps={cfg.max_steps}], got {cfg.warmup_steps}")
        if cfg.stop_at_step is not None and not 1 <= cfg.stop_at_step <= cfg.max_steps:
            raise ValueError(f"stop_at_step must be in [1, max_steps={cfg.max_steps}], got {cfg.stop_at_step}")
        if cfg.dataset is not None and cfg.train_files:
            raise ValueError("dataset and train_files are two sources of training text: give one")
        if parse_corpus(cfg.corpus) is not None:
            given = [name for name in ("dataset", "train_files", "validation_files", "tokenizer") if getattr(cfg, name)]
            if given:
                raise ValueError(f"corpus {cfg.corpus} brings its own documents and tokenizer; drop "
                                 f"{', '.join(given)}")
        if cfg.seq_len > preset.max_position_embeddings:
            raise ValueError(f"seq_len {cfg.seq_len} exceeds the preset's max_position_embeddings "
                             f"{preset.max_position_embeddings}")
        return cfg


__all__ = ["TRACKERS", "TrainConfig", "parse_report_to"]
