"""One training loop for every family, on Accelerate.

Any model whose forward takes `input_ids`/`labels` and returns `loss` trains here; every other
0-dim tensor in its output (e.g. `encoder_nll`, `decoder_nll`, `alignment_loss`) is logged as a
named loss part. Data order is a pure function of (seed, step, rank) and every rank's RNG state
is checkpointed, so training resumes exactly where it stopped, on one process or many
(`torchrun --nproc_per_node N` or `accelerate launch --multi_gpu --num_processes N`; a resume
needs the same N). Under FSDP (`accelerate launch --config_file configs/accelerate/fsdp.yaml`) the weights and
optimizer state are gathered to rank 0 for each checkpoint, which keeps the single-process layout, and are
sharded again on resume.

`train` runs four phases, each a function: `load_rows`, `build` (model, optimizer, schedule),
`resume`, `train_steps` (the loop, logging, evaluation and checkpoints).

Every record of `metrics.jsonl` goes, with the same values at the same step, to the trackers of `cfg.report_to`
(Accelerate's tracker API: `start_trackers`, `log_metrics`); docs/tracking.md.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, ProjectConfiguration, set_seed
from tqdm.auto import tqdm

from ..data.generated import parse_corpus
from ..families import FAMILIES, build_model
from ..folders import hub_reachable
from ..modeling.modeling_backbone import training_hooks
from ..modeling.sampling import model_mode
from .checkpoint import (
    DamagedCheckpoint,
    capture_rng_state,
    gather_optimizer_state,
    load_checkpoint,
    load_rank_rng,
    previous_complete_checkpoint,
    resume_checkpoint,
    save_checkpoint,
    save_tokenizer,
    scatter_optimizer_state,
)
from .config import TrainConfig
from .corpus import load_default_tokenizer
from .encoder_kl import EncoderKL
from .data import (
    GeneratedRows,
    StreamingRows,
    dataset_documents,
    documents_to_dataset,
    load_split_documents,
    pack_dataset,
)
from .scorers import core_model

logger = logging.getLogger(__name__)


def lr_multiplier(step: int, cfg: TrainConfig) -> float:
    """Learning-rate factor for optimizer step `step` (0-based): linear warmup, then cosine
    decay to `min_lr_ratio`, or warmup-stable-decay with a linear decay over the last
    `decay_fraction` of the steps."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "cosine":
        progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    decay_steps = max(1, int(cfg.decay_fraction * cfg.max_steps))
    decay_start = cfg.max_steps - decay_steps
    if step < decay_start:
        return 1.0
    return 1.0 - (1 - cfg.min_lr_ratio) * min(1.0, (step - decay_start + 1) / decay_steps)


#: Name segments that module wrappers insert before the wrapped model's own parameter names.
WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def parameter_groups(model: torch.nn.Module, learning_rate: float, weight_decay: float,
                     decays: Callable[[str, torch.nn.Parameter], bool] | None = None) -> list[dict]:
    """The optimizer's parameter groups of `model`'s trainable parameters, one per (learning-rate scale, decay).

    A model may scale the learning rate of some parameters with `parameter_learning_rate_scales()` (name prefix ->
    multiplier; Cola DLM's VAE:DiT ratio), read from the innermost model through DDP and PEFT wrappers and matched
    against each parameter's name relative to that model, without the segments FSDP, activation checkpointing or
    torch.compile wrappers insert (`WRAPPER_SEGMENTS`), so LoRA weights inside a scaled module get its scale;
    unmatched parameters get 1. A group has lr = learning_rate × scale and weight_decay = `weight_decay` where
    `decays(name, param)` (default: matrices, ≥ 2 dims), else 0. Scale-0 parameters are left out. Groups come scale 1
    first (the one a schedule's logged rate reads), then by falling scale, decayed before not."""
    core = core_model(model)
    scales = training_hooks(core).parameter_learning_rate_scales()
    relative = {id(param): "".join(part for part in re.split(r"(?<=\.)", name) if part not in WRAPPER_SEGMENTS)
                for name, param in core.named_parameters()}
    decays = decays or (lambda name, param: param.dim() >= 2)
    groups: dict[tuple[float, bool], list] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            own = relative.get(id(param), name)
            scale = next((s for prefix, s in scales.items() if own.startswith(prefix)), 1.0)
            groups.setdefault((scale, bool(decays(name, param))), []).append(param)
    order = sorted(groups, key=lambda key: (key[0] != 1.0, -key[0], not key[1]))
    return [{"params": groups[key], "lr": learning_rate * key[0], "weight_decay": weight_decay if key[1] else 0.0}
            for key in order if key[0] > 0]


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over `parameter_groups` (no decay on 1-D parameters; a family's learning-rate scales as groups, which
    the schedule multiplies alike)."""
    return torch.optim.AdamW(parameter_groups(model, cfg.learning_rate, cfg.weight_decay), lr=cfg.learning_rate,
                             betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)


def sample_indices(step: int, micro: int, rank: int, world: int, cfg: TrainConfig, num_rows: int) -> torch.Tensor:
    """Rows of the packed training set for one micro-batch: a fresh seeded permutation per epoch,
    consumed in order by (step, micro-step, rank). Pure function, hence exact resume."""
    global_batch = cfg.batch_size * cfg.grad_accum * world
    start = step * global_batch + (micro * world + rank) * cfg.batch_size
    positions = torch.arange(start, start + cfg.batch_size)
    epochs = positions // num_rows
    out = torch.empty_like(positions)
    for epoch in epochs.unique().tolist():
        perm = torch.randperm(num_rows, generator=torch.Generator().manual_seed(cfg.seed * 100003 + epoch))
        sel = epochs == epoch
        out[sel] = perm[positions[sel] % num_rows]
    return out


def step_losses(output) -> dict[str, torch.Tensor]:
    """`loss` and every other 0-dim tensor of a model output (the named loss parts), detached and still on
    the device: reading them is left to the log steps."""
    parts = {key: value for key, value in output.items()
             if key != "loss" and isinstance(value, torch.Tensor) and value.dim() == 0}
    return {key: value.detach().float() for key, value in {"loss": output.loss, **parts}.items()}


def to_floats(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """0-dim tensors on one device as floats, in a single device-to-host copy (one sync). A DTensor (FSDP2's
    gradient norm) is replicated: its local value is the value."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors.values()]
    return dict(zip(tensors, torch.stack([t.float() for t in local]).tolist()))


@torch.no_grad()
def evaluate_loss(model, rows: torch.Tensor, batch_size: int, accelerator: Accelerator) -> float:
    """Mean loss over validation rows, split across processes and averaged over batches."""
    shard = rows[accelerator.process_index::accelerator.num_processes]
    total = torch.zeros(2, device=accelerator.device)
    # Every rank runs as many forwards as the largest shard needs (an FSDP forward is a collective); a rank out of
    # rows repeats its first one with weight 0.
    per_rank = -(-len(rows) // accelerator.num_processes)
    with model_mode(model, False):
        for start in range(0, per_rank, batch_size):
            batch = shard[start:start + batch_size]
            weight = torch.tensor(float(len(batch) > 0), device=accelerator.device)
            batch = (batch if len(batch) else rows[:1]).to(accelerator.device)
            total += torch.stack([model(input_ids=batch, labels=batch).loss.float() * weight, weight])
    total = accelerator.reduce(total, reduction="sum")
    return (total[0] / total[1].clamp(min=1)).item()


def train(cfg: TrainConfig, model=None, tokenizer=None, train_rows: torch.Tensor | StreamingRows | None = None,
          val_rows: torch.Tensor | None = None, on_step: Callable[[int, dict], None] | None = None) -> dict:
    """Train `cfg.family` at `cfg.preset` (or the given model) and return the last metrics.

    `train_rows` / `val_rows` ([N, seq_len] id tensors) override the data pipeline, e.g. for a
    `datasets.Dataset` packed with `pack_dataset(...)["input_ids"]`; `train_rows` may also be a `StreamingRows`
    (the loop splits it across processes).
    `on_step(step, metrics)` is called after every optimizer step with float metrics (loss, its parts,
    lr, grad_norm, and tokens_per_s / val_loss on the steps that have them); reading them costs a
    device sync every step, which a run without `on_step` makes only on log steps.
    """
    cfg = cfg.resolved()
    # Without cpu=True, Accelerate under torchrun on a CPU-only machine silently runs every
    # process as an independent single-process job (DistributedType.NO).
    accelerator = Accelerator(mixed_precision=cfg.mixed_precision, cpu=not torch.cuda.is_available(),
                              log_with=cfg.report_to or None,
                              project_config=ProjectConfiguration(project_dir=cfg.output_dir,
                                                                  logging_dir=str(Path(cfg.output_dir) / TRACKER_DIR)))
    set_seed(cfg.seed)

    tokenizer, train_rows, val_rows = load_rows(cfg, tokenizer, train_rows, val_rows, accelerator)
    # The pretrained source of `--init-from`: copied into the model, and kept frozen for the encoder KL term.
    source = load_source_model(cfg.init_from) if cfg.init_from and (model is None or cfg.encoder_kl_weight) else None
    model, optimizer, scheduler = build(cfg, model, tokenizer, source)
    encoder_kl = EncoderKL(source.to(accelerator.device), cfg.encoder_kl_weight) if cfg.encoder_kl_weight else None
    checkpoint, start_step = resume(cfg, accelerator, model, optimizer, scheduler, train_rows)
    hooks = training_hooks(model)
    if count := hooks.training_rows_needed:  # e.g. AURORA's latent statistics, estimated once from the training rows
        # (of a stream, the corpus's first rows, the same on every rank)
        hooks.prepare_training(train_rows.head(count) if isinstance(train_rows, StreamingRows) else train_rows[:count])
    # Created only now that every input (files, tokenizer, components, checkpoint) has loaded: a run refused
    # for a bad input leaves nothing behind.
    if accelerator.is_main_process:
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        language = parse_corpus(cfg.corpus)
        if language is not None:  # what eval / bench measure the model against
            language.write_record(cfg.output_dir, train_stream=cfg.seed)
    accelerator.wait_for_everyone()
    # The scheduler is stepped by us once per optimizer step, so it is not prepared.
    model, optimizer = accelerator.prepare(model, optimizer)
    if checkpoint is not None and is_sharded(accelerator):
        # Sharding replaced the parameters the optimizer held, so its state loads only now, each rank its shard.
        scatter_optimizer_state(checkpoint, model, optimizer.optimizer)
    if checkpoint is not None:
        # The RNG is restored last, after everything that may draw from it (building the model,
        # `prepare`), so the first resumed step draws exactly what the uninterrupted run drew.
        load_rank_rng(checkpoint, accelerator.process_index)
    else:
        # The model is built from one seed on every rank; what the steps draw (PLM block phases and auxiliaries,
        # CALM noise) must differ per rank, so each rank continues from seed + rank.
        set_seed(cfg.seed, device_specific=True)
    model.train()
    return train_steps(cfg, accelerator, model, optimizer, scheduler, tokenizer, train_rows, val_rows,
                       start_step, on_step, encoder_kl)


def load_rows(cfg: TrainConfig, tokenizer, train_rows, val_rows, accelerator: Accelerator | None = None):
    """Phase 1: the tokenizer and the packed [N, seq_len] train / validation rows (the given ones, or
    the embedded corpus / the user's files), or this process's `StreamingRows` of `cfg.dataset`; validation is cut
    to `eval_batches` batches."""
    language = parse_corpus(cfg.corpus)
    if tokenizer is None and language is not None:
        tokenizer = language.tokenizer()
    elif tokenizer is None and cfg.init_from:  # the source's vocabulary, so its tokenizer
        tokenizer = load_tokenizer(cfg.init_from, option="--init-from")
    elif tokenizer is None:
        tokenizer = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else load_default_tokenizer()
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator is not None else (0, 1)
    if language is not None and train_rows is None:
        train_rows = GeneratedRows(language, "train", cfg.seed, tokenizer, cfg.seq_len)
    if language is not None and val_rows is None and cfg.eval_every > 0:
        val_rows = GeneratedRows(language, "validation", 0, tokenizer, cfg.seq_len).head(cfg.eval_batches * cfg.batch_size)
    if cfg.dataset is not None and train_rows is None:
        train_rows = StreamingRows(dataset_documents(cfg.dataset, cfg.text_column), tokenizer, cfg.seq_len)
        if val_rows is None and cfg.eval_every > 0 and not cfg.validation_files:
            documents = dataset_documents(cfg.dataset, cfg.text_column, split="validation")
            if documents is not None:
                val_rows = StreamingRows(documents, tokenizer, cfg.seq_len).head(cfg.eval_batches * cfg.batch_size)
            elif accelerator is None or accelerator.is_main_process:
                print(f"--dataset {cfg.dataset} has no validation split and no --validation-file is given: "
                      f"no evaluation")
    if isinstance(train_rows, StreamingRows):
        train_rows.head(1)  # a corpus shorter than one row is refused now, not at the first step
        train_rows = train_rows.for_rank(rank, world)
    elif train_rows is None:
        docs = load_split_documents("train", cfg.train_files, cfg.validation_files)
        train_rows = pack_dataset(documents_to_dataset(docs), tokenizer, cfg.seq_len)["input_ids"]
    if val_rows is None and cfg.eval_every > 0 and language is None and (cfg.dataset is None or cfg.validation_files):
        docs = load_split_documents("validation", cfg.train_files, cfg.validation_files)
        val_rows = pack_dataset(documents_to_dataset(docs), tokenizer, cfg.seq_len)["input_ids"]
    if val_rows is not None:
        val_rows = val_rows[: cfg.eval_batches * cfg.batch_size]
    return tokenizer, train_rows, val_rows


def load_tokenizer(name: str, option: str = "--tokenizer"):
    """The user's tokenizer (a folder or a Hub id) through `AutoTokenizer`, refused with one ValueError naming it
    (as `option`) when it cannot load. Remote code is not run: a tokenizer that needs it is refused instead of
    prompting [y/N] in the middle of a run (pass such a tokenizer object to `train(tokenizer=...)`)."""
    from transformers import AutoTokenizer

    offline = check_local_or_hub(name, option)
    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=False, local_files_only=offline)
    except (OSError, ValueError) as err:
        if offline:
            raise ValueError(f"{option} {name!r} is not a local folder nor in the Hub cache, and the Hub cannot be "
                             f"reached (offline, or HF_HUB_OFFLINE set): pass a folder") from None
        raise ValueError(f"{option} {name!r}: its tokenizer does not load: {err}") from err


def check_local_or_hub(name: str, option: str) -> bool:
    """ValueError when `name` is written as a path and no such folder exists; else whether it must come from the
    local Hub cache (a Hub id while the Hub cannot be reached)."""
    path = Path(name).expanduser()
    if not path.exists() and (path.is_absolute() or name.startswith((".", "~")) or name.count("/") > 1):
        raise ValueError(f"{option} {name!r}: no such folder")  # a path, not a Hub id
    # Offline, a Hub id can still come from the local cache; if it is not there, one line at once.
    return not path.exists() and not hub_reachable()


def load_source_model(name: str):
    """The pretrained causal LM of `--init-from` (a folder or Hub id) in float32, through `AutoModelForCausalLM`
    (remote code is not run), refused with one ValueError naming it when it cannot load."""
    from transformers import AutoModelForCausalLM

    offline = check_local_or_hub(name, "--init-from")
    try:
        return AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, local_files_only=offline)
    except (OSError, ValueError) as err:
        raise ValueError(f"--init-from {name!r}: the model does not load: {err}") from err


def build(cfg: TrainConfig, model, tokenizer, source=None):
    """Phase 2: the model (unless given; components come from `cfg.components`; with `source`, the pretrained model
    of `--init-from`, built around a copy of it), AdamW and the learning-rate schedule."""
    if model is None:  # components are checked (folder intact, type, weights) by the registry
        model = build_model(cfg.family, cfg.preset, tokenizer, init_from=source, **cfg.components, **cfg.model_kwargs)
    if source is not None:
        check_source_fits(cfg, model.config, tokenizer)
    check_row_length(model.config, cfg.seq_len, cfg.family)
    # Saved with the weights: evaluation refuses windows that reach past the positions the model was trained at.
    model.config.trained_seq_len = max(cfg.seq_len, getattr(model.config, "trained_seq_len", None) or 0)
    optimizer = make_optimizer(model, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg))
    return model, optimizer, scheduler


def check_source_fits(cfg: TrainConfig, config, tokenizer) -> None:
    """ValueError when the model built from `--init-from` cannot read the training rows: a tokenizer (a generated
    language's) with ids past its vocabulary, or rows longer than its positions."""
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"--init-from {cfg.init_from}: its vocabulary ({config.vocab_size}) is smaller than the "
                         f"tokenizer's ({len(tokenizer)}); start from a model trained with this tokenizer")
    if cfg.seq_len > config.max_position_embeddings:
        raise ValueError(f"seq_len {cfg.seq_len} exceeds --init-from {cfg.init_from}'s max_position_embeddings "
                         f"{config.max_position_embeddings}")


def check_row_length(config, seq_len: int, family: str) -> None:
    """ValueError unless a training row of `seq_len` tokens holds the family's unit of prediction: one block of
    `block_size` tokens (PLM, Cola DLM, AURORA-LM; `vae_block_size` for Cola's VAE), whole chunks of `chunk_size`
    (CALM's autoencoder), two chunks for CALM's energy loss (a chunk predicted from the one before). A shorter row
    would train on partial blocks without a word."""
    field = next((name for name in ("block_size", "vae_block_size") if isinstance(getattr(config, name, None), int)),
                 None)
    chunk = getattr(config, "chunk_size", None)
    if field is not None and seq_len < getattr(config, field):
        block = getattr(config, field)
        raise ValueError(f"seq_len {seq_len} is shorter than one block of the {family} model ({field} {block}): "
                         f"give --seq-len {block} or more, or a smaller --config {field}")
    if isinstance(chunk, int):
        spec = FAMILIES.get(family)
        chunks = 2 if spec is None or spec.language_model else 1
        if seq_len % chunk or seq_len < chunks * chunk:
            raise ValueError(f"seq_len {seq_len} must be a multiple of the {family} model's chunk_size {chunk} and at "
                             f"least {chunks * chunk} ({chunks} chunk{'s' if chunks > 1 else ''})")


def is_sharded(accelerator: Accelerator) -> bool:
    """Whether the model's parameters are split across processes (FSDP): saving and loading their state are then
    collectives."""
    return accelerator.distributed_type == DistributedType.FSDP


def gathered_state_dict(accelerator: Accelerator, model) -> dict:
    """The full state dict of a sharded model, for rank 0 to save; a collective. Where torch's full-state-dict path
    hands back DTensors still (FSDP2 on CPU with gloo), they are gathered here."""
    state = accelerator.get_state_dict(model)
    return {name: value.full_tensor() if hasattr(value, "full_tensor") else value for name, value in state.items()}


def resume(cfg: TrainConfig, accelerator: Accelerator, model, optimizer, scheduler,
           train_rows=None) -> tuple[Path | None, int]:
    """Phase 3: with `cfg.resume`, load the latest checkpoint's weights, optimizer and schedule into
    the unwrapped objects, and this rank's position into `train_rows` when it streams; return (checkpoint, its
    step), or (None, 0) for a fresh run. The RNG is restored by the caller, after `prepare`."""
    if not cfg.resume:
        return None, 0
    which = "latest" if cfg.resume is True else cfg.resume
    checkpoint = resume_checkpoint(cfg.output_dir, which)
    try:
        state = load_checkpoint(checkpoint, model, None if is_sharded(accelerator) else optimizer, scheduler,
                                rank=accelerator.process_index, restore_rng=False,
                                num_processes=accelerator.num_processes)
    except DamagedCheckpoint as err:
        # Say how to go on: the fallback is asked for, never taken silently (it repeats the steps since then).
        previous = previous_complete_checkpoint(checkpoint)
        hint = ("no earlier complete checkpoint to fall back to" if previous is None else
                f"to continue from {previous.name}, the complete checkpoint before it, rerun with --resume previous")
        raise DamagedCheckpoint(err.checkpoint, err.file, f"{err.problem}; {hint}") from err
    if isinstance(train_rows, StreamingRows):
        if "data_streams" not in state:
            raise ValueError(f"{checkpoint} has no streaming position: it was not written by a --dataset run")
        train_rows.load_state_dict(state["data_streams"][accelerator.process_index])
    if accelerator.is_main_process:
        print(f"resumed from {checkpoint} at step {state['step']}")
    return checkpoint, state["step"]


def optimizer_step(cfg: TrainConfig, accelerator: Accelerator, model, optimizer, scheduler,
                   train_rows: torch.Tensor | StreamingRows, step: int, encoder_kl: EncoderKL | None = None):
    """One optimizer step over `grad_accum` micro-batches: the loss and its parts averaged over them (on the device),
    and the gradient norm before clipping. `encoder_kl`: a KL term to the frozen source added to the loss."""
    world, rank = accelerator.num_processes, accelerator.process_index
    losses: dict[str, torch.Tensor] = {}
    for micro in range(cfg.grad_accum):
        if isinstance(train_rows, StreamingRows):
            rows = train_rows.take(cfg.batch_size).to(accelerator.device)
        else:
            rows = train_rows[sample_indices(step, micro, rank, world, cfg, len(train_rows))].to(accelerator.device)
        # Gradients are all-reduced on the last micro-step only.
        sync = nullcontext() if micro == cfg.grad_accum - 1 else accelerator.no_sync(model)
        with sync, accelerator.autocast():
            output = model(input_ids=rows, labels=rows)
            loss, parts = output.loss, step_losses(output)
            if encoder_kl is not None:
                loss, kl_parts = encoder_kl.add_to(output, rows)
                parts.update(kl_parts)
            accelerator.backward(loss / cfg.grad_accum)
        for key, value in parts.items():
            losses[key] = losses.get(key, 0.0) + value / cfg.grad_accum
    # grad_clip 0 turns clipping off; an infinite threshold still measures the norm for the log.
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return losses, grad_norm


def train_steps(cfg: TrainConfig, accelerator: Accelerator, model, optimizer, scheduler, tokenizer,
                train_rows: torch.Tensor | StreamingRows, val_rows: torch.Tensor | None, start_step: int,
                on_step: Callable[[int, dict], None] | None, encoder_kl: EncoderKL | None = None) -> dict:
    """Phase 4: optimizer steps `start_step`..end (stop_at_step or max_steps), with logging,
    evaluation and checkpoints; the final model is saved when max_steps is reached."""
    output_dir = Path(cfg.output_dir)
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * accelerator.num_processes
    end_step = cfg.stop_at_step if cfg.stop_at_step is not None else cfg.max_steps
    metrics_path = output_dir / "metrics.jsonl"
    # What a run stopped after its last checkpoint logged is about to be logged again (by the steps a resume
    # repeats), and a fresh run starts its own log: keep the records up to the start step only.
    dropped = accelerator.is_main_process and trim_metrics_log(metrics_path, start_step)
    start_trackers(cfg, accelerator, start_step, continue_runs=not dropped)
    bar = tqdm(total=end_step, initial=start_step, disable=not (cfg.progress_bar and accelerator.is_main_process),
               desc=f"{cfg.family}-{cfg.preset}", dynamic_ncols=True)
    last: dict = {}
    window_start, window_tokens = time.perf_counter(), 0
    hooks = training_hooks(accelerator.unwrap_model(model))

    try:  # the bar is closed however the loop ends, so that a Ctrl-C message after it starts its own line
        for step in range(start_step, end_step):
            losses, grad_norm = optimizer_step(cfg, accelerator, model, optimizer, scheduler, train_rows, step,
                                               encoder_kl)
            hooks.on_optimizer_step()  # a model's own per-step state (AURORA's EMA copy and step count)
            window_tokens += tokens_per_step
            done = step + 1

            log_now = done % cfg.log_every == 0 or done == end_step
            last = {"step": done}
            if log_now or on_step is not None:
                # The step's only device-to-host copy; without on_step it happens on log steps only.
                last.update(to_floats({**losses, "grad_norm": grad_norm}), lr=scheduler.get_last_lr()[0])
            if log_now:
                elapsed = time.perf_counter() - window_start
                last["tokens_per_s"] = window_tokens / max(elapsed, 1e-9)
                last["tokens"] = done * tokens_per_step  # training tokens so far, all processes (the report's)
                window_start, window_tokens = time.perf_counter(), 0
                log_metrics(metrics_path, last, accelerator)
                bar.set_postfix(loss=f"{last['loss']:.3f}", tok_s=f"{last['tokens_per_s']:.0f}")
            if val_rows is not None and cfg.eval_every > 0 and (done % cfg.eval_every == 0 or done == end_step):
                last["val_loss"] = evaluate_loss(model, val_rows, cfg.batch_size, accelerator)
                log_metrics(metrics_path, {"step": done, "val_loss": last["val_loss"]}, accelerator)
                if accelerator.is_main_process:
                    bar.write(f"step {done}: val_loss {last['val_loss']:.4f}")
            if done % cfg.save_every == 0 or done == end_step:
                _save(accelerator, output_dir, done, model, tokenizer, optimizer, scheduler, cfg, train_rows)
            if on_step is not None:
                on_step(done, last)
            bar.update(1)
    finally:
        bar.close()

    if end_step == cfg.max_steps:
        save_final_model(accelerator, output_dir, model, tokenizer)
    # Accelerate's `end_training` would also destroy the process group, which the caller may still use (the CLI
    # ends it itself): only the trackers are closed here (they exist on the main process only).
    for tracker in accelerator.trackers:
        tracker.finish()
    accelerator.wait_for_everyone()
    return last


def save_final_model(accelerator: Accelerator, output_dir: Path, model, tokenizer) -> None:
    """The finished model and tokenizer at the top of `output_dir` (main process), each file replaced atomically."""
    state_dict = gathered_state_dict(accelerator, model) if is_sharded(accelerator) else None  # every rank gathers
    if not accelerator.is_main_process:
        return
    tmp = output_dir / f".tmp-final-{os.getpid()}"
    accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state_dict)
    if tokenizer is not None:
        save_tokenizer(tokenizer, tmp)
    for item in tmp.iterdir():
        os.replace(item, output_dir / item.name)
    tmp.rmdir()


def gather_to_main(accelerator: Accelerator, value) -> list:
    """`value` of every rank, rank 0 first, on the main process (a collective; elsewhere a list of None)."""
    if accelerator.num_processes == 1:
        return [value]
    values = [None] * accelerator.num_processes
    torch.distributed.gather_object(value, values if accelerator.is_main_process else None, dst=0)
    return values


def _save(accelerator, output_dir, step, model, tokenizer, optimizer, scheduler, cfg, train_rows=None):
    state = {"data_position": step * cfg.batch_size * cfg.grad_accum * accelerator.num_processes,
             "num_processes": accelerator.num_processes, "config": asdict(cfg)}
    if isinstance(train_rows, StreamingRows):  # every rank's position in its share of the corpus
        state["data_streams"] = gather_to_main(accelerator, train_rows.state_dict())
    # Every rank's RNG state travels to the main process, which writes it inside the atomic
    # checkpoint: a checkpoint that exists resumes every rank.
    rank_rng = gather_to_main(accelerator, capture_rng_state())
    inner_optimizer = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
    model_state, optimizer_state = None, None
    if is_sharded(accelerator):  # collectives: every rank takes part, rank 0 receives the full states
        model_state = gathered_state_dict(accelerator, model)
        optimizer_state = gather_optimizer_state(model, inner_optimizer)
    if accelerator.is_main_process:
        save_checkpoint(output_dir, step, accelerator.unwrap_model(model), tokenizer, inner_optimizer, scheduler, state,
                        keep_last=cfg.keep_checkpoints, rank_rng=rank_rng, model_state_dict=model_state,
                        optimizer_state=optimizer_state)
    accelerator.wait_for_everyone()


def trim_metrics_log(path: Path, start_step: int) -> bool:
    """Keep the records of the metrics log `path` up to `start_step` (all of them past it dropped; no file: nothing
    to do) and return whether a record was dropped that trackers may hold too.

    A line that does not parse (a record torn, or left as NUL bytes, by a crash) is dropped with one warning naming
    the file; it counts as dropped past `start_step`, as its step cannot be read. The log is rewritten through a
    temporary file in the same folder, replaced atomically, so a crash during the rewrite leaves the old log or the
    new one.
    """
    if not path.exists():
        return False
    lines = [line for line in path.read_bytes().decode("utf-8", errors="replace").splitlines() if line.strip()]
    kept, unreadable = [], 0
    for line in lines:
        try:
            step = json.loads(line)["step"]
        except (ValueError, TypeError, KeyError, IndexError):
            step = None
        if not isinstance(step, int):
            unreadable += 1
        elif step <= start_step:
            kept.append(line)
    if unreadable:
        logger.warning("%s: skipped %d line(s) that are not a metrics record (a record torn by a crash?)", path,
                       unreadable)
    replace_text(path, "".join(line + "\n" for line in kept))
    return len(kept) < len(lines)


def replace_text(path: Path, text: str) -> None:
    """Write `text` to `path` atomically: into a temporary file in the same folder, then `os.replace`d over it."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def log_metrics(path: Path, record: dict, accelerator: Accelerator):
    """The one place metrics leave the loop: `record` ({"step": N, name: value, ...}) appended to `metrics.jsonl`
    and logged to every tracker of `report_to` at step N (main process only)."""
    if accelerator.is_main_process:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
    accelerator.log({key: value for key, value in record.items() if key != "step"}, step=record["step"])


#: The trackers' folder inside `output_dir` (TrainingArguments' `output_dir/runs` convention), the project name the
#: trackers file runs under (TensorBoard: the subfolder; wandb, trackio: the project), and the file in TRACKER_DIR
#: that names a run's tracker runs (the experiment's name, the current run's name, the wandb id), so that a resumed
#: run continues them.
TRACKER_DIR = "runs"
TRACKER_PROJECT = "hf-latentlm"
TRACKER_RUNS = "tracker_runs.json"


def tracker_hyperparameters(cfg: TrainConfig) -> dict:
    """`cfg` as the flat hyperparameters trackers take: nested dicts as dotted keys, lists as JSON strings."""
    flat = {}
    for key, value in asdict(cfg).items():
        items = {f"{key}.{k}": v for k, v in value.items()} if isinstance(value, dict) else {key: value}
        flat.update({k: json.dumps(v) if isinstance(v, (list, tuple, dict)) else v for k, v in items.items()})
    return flat


def start_trackers(cfg: TrainConfig, accelerator: Accelerator, start_step: int, continue_runs: bool = True) -> None:
    """Start the trackers of `cfg.report_to` (none: nothing), with the run's config as hyperparameters.

    A fresh run names its wandb and trackio runs after the output folder plus a random suffix (`run-1a2b3c`). A
    resumed run continues the same tracker runs (`continue_runs`), kept in `TRACKER_DIR/TRACKER_RUNS`, TensorBoard
    purging the steps about to be logged again; with `continue_runs=False` (an earlier process logged past
    `start_step`, which wandb and trackio cannot take back) they start new runs `<experiment>-from-step-<start_step>`
    (docs/tracking.md).
    """
    if not cfg.report_to:
        return
    folder = Path(cfg.output_dir) / TRACKER_DIR
    runs_file = folder / TRACKER_RUNS
    runs = {}
    # Only the main process starts trackers, and only it reads the file it rewrites below.
    if accelerator.is_main_process:
        if start_step > 0 and runs_file.is_file():
            runs = json.loads(runs_file.read_text())
        folder.mkdir(parents=True, exist_ok=True)
    if "experiment" not in runs:
        # os.urandom: the suffix draws nothing from the seeded generators the training steps use.
        runs = {"experiment": f"{Path(cfg.output_dir).resolve().name}-{os.urandom(3).hex()}"}
    elif not continue_runs:
        runs = {"experiment": runs["experiment"], "name": f"{runs['experiment']}-from-step-{start_step}"}
    name = runs.setdefault("name", runs["experiment"])
    options = {"tensorboard": {"purge_step": start_step + 1},
               "wandb": {"name": name, "dir": str(folder), **({"id": runs["wandb"], "resume": "allow"}
                                                              if "wandb" in runs else {})},
               "trackio": {"name": name, "resume": "allow" if runs.get("trackio") == name else "never"}}
    accelerator.init_trackers(TRACKER_PROJECT, config=tracker_hyperparameters(cfg),
                              init_kwargs={tracker: options[tracker] for tracker in cfg.report_to})
    if accelerator.is_main_process:
        started = {"wandb": lambda run: run.id, "trackio": lambda run: run.name}
        runs.update({tracker: started[tracker](accelerator.get_tracker(tracker, unwrap=True))
                     for tracker in cfg.report_to if tracker in started})
        replace_text(runs_file, json.dumps(runs) + "\n")
