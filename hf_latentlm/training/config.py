"""`TrainConfig`, every knob of a training run, and its checks. Kept apart from the loop and free of torch, so that
`hf-latentlm train` refuses a bad value in a second, before the slow imports.

Each field's `metadata["help"]` is its documentation and its `--help` line: `hf-latentlm train` builds one option per
field with TRL's dataclass parser (`trl.TrlParser`), so a default lives only here."""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..data.generated import parse_corpus
from ..families import FAMILIES, check_init_from
from ..presets import PRESETS, get_preset

#: The experiment trackers `report_to` names, each with the package it needs (the `track` extra installs them all).
TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}
REPORT_TO_HELP = ("experiment trackers that get the logged metrics (docs/tracking.md): none, tensorboard, wandb, "
                  "trackio, a comma-separated list, or all (every installed one); pip install 'hf-latentlm[track]'")


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
    """Every knob of a training run; `None` takes the preset's value (`resolved()` fills it in and checks the
    rest). The global batch is batch_size × grad_accum × number of processes."""

    family: str = field(default="ar", metadata={"help": f"model family: {', '.join(sorted(FAMILIES))}"})
    preset: str = field(default="small", metadata={"help": f"model size: {', '.join(PRESETS)}"})
    output_dir: str | None = field(default=None, metadata={
        "help": "where checkpoints (checkpoint-<step>), metrics.jsonl and the final model go (None: "
                "runs/<family>-<preset>)"})
    max_steps: int | None = field(default=None, metadata={
        "help": "optimizer steps, which the learning-rate schedule spans (None: the preset's)"})
    stop_at_step: int | None = field(default=None, metadata={
        "help": "stop early after this step, checkpoint written, as if interrupted; continue later with --resume "
                "(the schedule still spans --max-steps)"})
    resume: Literal[False, True, "latest", "previous"] = field(default=False, metadata={
        "nargs": "?", "const": "latest", "metavar": "{latest,previous}",
        "help": "continue from the newest checkpoint-<step> in --output-dir (a damaged one is refused, naming the "
                "file); `--resume previous`: from the complete checkpoint before it, the fallback"})
    overwrite_output_dir: bool = field(default=False, metadata={
        "help": "start afresh in an --output-dir that holds an earlier run, removing its checkpoints (without it, "
                "such a folder is refused unless --resume continues it)"})
    batch_size: int | None = field(default=None, metadata={
        "help": "rows per process per micro-step (None: the preset's)"})
    grad_accum: int = field(default=1, metadata={"help": "micro-steps per optimizer step"})
    seq_len: int | None = field(default=None, metadata={
        "help": "tokens per packed training row; at least one block or chunk of the family (None: the preset's)"})
    learning_rate: float | None = field(default=None, metadata={"help": "peak learning rate of AdamW (None: the "
                                                                        "preset's)"})
    schedule: Literal["cosine", "wsd"] = field(default="cosine", metadata={
        "help": "after warmup: cosine decay, or warmup-stable-decay"})
    warmup_steps: int | None = field(default=None, metadata={
        "help": "linear warmup steps (None: the preset's, at most a tenth of --max-steps)"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "floor of the decay, as a fraction of the peak"})
    decay_fraction: float = field(default=0.2, metadata={"help": "wsd: the share of steps spent decaying"})
    weight_decay: float = field(default=0.1, metadata={
        "help": "AdamW's weight decay, not applied to norms, biases or other 1-D parameters"})
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW's beta1"})
    adam_beta2: float = field(default=0.95, metadata={"help": "AdamW's beta2"})
    adam_eps: float = field(default=1e-8, metadata={"help": "AdamW's epsilon"})
    grad_clip: float = field(default=1.0, metadata={
        "help": "global gradient-norm clip, 0 for none (the norm is logged either way)"})
    eval_every: int = field(default=100, metadata={"help": "validation loss every N steps, 0 for none"})
    eval_batches: int = field(default=20, metadata={"help": "validation batches per evaluation (the split's first)"})
    save_every: int = field(default=100, metadata={"help": "a resumable checkpoint every N steps, and at the last"})
    keep_checkpoints: int = field(default=2, metadata={"help": "checkpoints kept, the newest; 0 keeps all"})
    log_every: int = field(default=10, metadata={
        "help": "metrics every N steps (loss values leave the device only then)"})
    seed: int = field(default=0, metadata={"help": "model initialisation and data order"})
    corpus: str | None = field(default=None, metadata={
        "help": "'shakespeare' (None: the embedded corpus) or 'generated:LEVEL', a generated language with a known "
                "optimum (LEVEL: easy, medium, hard; docs/generated_language.md): its own documents and word-level "
                "tokenizer, recorded in --output-dir for `eval` and `bench`"})
    train_files: list[str] | None = field(default=None, metadata={
        "aliases": ["--train-file"], "action": "extend", "metavar": "FILE",
        "help": "your own text files instead of the embedded corpus (repeatable; one document each)"})
    validation_files: list[str] | None = field(default=None, metadata={
        "aliases": ["--validation-file"], "action": "extend", "metavar": "FILE",
        "help": "your own validation texts (repeatable; None: the embedded corpus's validation split)"})
    tokenizer: str | None = field(default=None, metadata={
        "help": "tokenizer folder or hub id (None: the embedded BPE)"})
    dataset: str | None = field(default=None, metadata={
        "help": "a corpus too large for memory, streamed: a folder written by datasets' save_to_disk (its train "
                "split; its validation split or --validation-file, else none), a text file or a folder of *.txt "
                "files; each rank reads every world-th document"})
    text_column: str | None = field(default=None, metadata={
        "help": "--dataset's text column (None: 'text', or its only string column)"})
    mixed_precision: Literal["no", "bf16", "fp16"] | None = field(default=None, metadata={
        "help": "Accelerate's mixed precision (None: the launch config's, `accelerate launch --config_file`, else "
                "'no')"})
    progress_bar: bool = field(default=True, metadata={"help": "a progress bar on the main process"})
    # A mapping is one JSON object on the command line, as in `TrainingArguments`' dict fields.
    components: dict[str, str] | str | None = field(default_factory=dict, metadata={
        "help": "the trained components the family needs, name -> folder, e.g. {\"autoencoder\": DIR} for calm "
                "(the registry says which); each is frozen and copied into the model"})
    model_kwargs: dict[str, Any] | str | None = field(default_factory=dict, metadata={
        "help": "overrides of the family's config fields, e.g. {\"block_size\": 8}"})
    report_to: list[str] | str | None = field(default="none", metadata={"help": REPORT_TO_HELP})
    init_from: str | None = field(default=None, metadata={
        "help": "start from a pretrained causal LM, a folder or Hub id (--family plm: a LlamaForCausalLM, e.g. an "
                "`ar` run): its sizes, weights, vocabulary and tokenizer replace the preset's"})
    encoder_kl_weight: float = field(default=0.0, metadata={
        "help": "with --init-from: weight of KL(source || encoder) on the encoder pass, added to the loss, which "
                "holds the encoder near its frozen source (0: none)"})

    def __post_init__(self):
        for name in ("components", "model_kwargs"):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{name}: not a JSON object: {value!r} ({err})") from None
            if not isinstance(value or {}, dict):
                raise ValueError(f"{name} must be a mapping (or a JSON object), got {value!r}")
            setattr(self, name, dict(value or {}))

    def resolved(self) -> "TrainConfig":
        """A copy with every `None` filled from the preset, checked for bad values."""
        preset = get_preset(self.preset)
        values = asdict(self)
        if values["output_dir"] is None:
            values["output_dir"] = f"runs/{self.family}-{self.preset}"
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
        if cfg.init_from is not None:
            check_init_from(cfg.family)
            if cfg.tokenizer:
                raise ValueError(f"--init-from {cfg.init_from} brings its own tokenizer; drop --tokenizer")
            path = Path(cfg.init_from).expanduser()
            if not path.exists() and (path.is_absolute() or cfg.init_from.startswith((".", "~"))
                                      or cfg.init_from.count("/") > 1):
                raise FileNotFoundError(f"--init-from {cfg.init_from!r}: no such folder")  # a path, not a Hub id
        if cfg.encoder_kl_weight < 0:
            raise ValueError(f"encoder_kl_weight must be >= 0, got {cfg.encoder_kl_weight}")
        if cfg.encoder_kl_weight > 0 and cfg.init_from is None:
            raise ValueError("--encoder-kl-weight needs --init-from: the KL is to the source model")
        if cfg.init_from is None and cfg.seq_len > preset.max_position_embeddings:
            raise ValueError(f"seq_len {cfg.seq_len} exceeds the preset's max_position_embeddings "
                             f"{preset.max_position_embeddings}")
        return cfg


#: What an output folder of an earlier `train` run holds (besides `checkpoint-<step>` folders).
RUN_FILES = ("metrics.jsonl", "model.safetensors", "model.safetensors.index.json")


def earlier_run_files(output_dir: str) -> list[Path]:
    """The checkpoints and run files of an earlier run in `output_dir` (none for a new or empty folder); ValueError
    when `output_dir` is a file."""
    folder = Path(output_dir)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--output-dir {output_dir!r} is a file, not a folder")
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if (p.is_dir() and re.fullmatch(r"checkpoint-\d+", p.name))
                  or p.name in RUN_FILES)


def check_output_dir(cfg: "TrainConfig") -> list[Path]:
    """Refuse (ValueError) to start a fresh run over an earlier one: its checkpoints would end up beside the new
    run's. Returns the earlier run's checkpoint folders that `overwrite_output_dir` removes before training."""
    earlier = earlier_run_files(cfg.output_dir)
    if earlier and not cfg.resume and not cfg.overwrite_output_dir:
        raise ValueError(f"--output-dir {cfg.output_dir!r} holds an earlier run ({earlier[0].name}, ...): continue it "
                         f"with --resume, or start afresh with --overwrite-output-dir")
    return [p for p in earlier if p.is_dir()] if cfg.overwrite_output_dir and not cfg.resume else []


__all__ = ["REPORT_TO_HELP", "TRACKERS", "TrainConfig", "check_output_dir", "parse_report_to"]
