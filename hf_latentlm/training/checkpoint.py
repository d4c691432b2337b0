"""Atomic, pickle-free training checkpoints.

A checkpoint folder `checkpoint-<step>` holds:
- the model (`save_pretrained`) and the tokenizer files, so the folder alone serves `generate`, `eval` and a Hub
  upload; `tokenizer_config.json` names a tokenizer class transformers has itself (`save_tokenizer`), so the
  tokenizer needs no remote code;
- `optimizer.safetensors`: every optimizer state tensor, keyed `state.<param index>.<name>`;
- `rng_rank<r>.safetensors`: each process's torch (CPU, CUDA) RNG state; `rng_rank<r>.json` (r > 0): its Python
  and NumPy RNG state;
- `trainer_state.json`: step, data position, number of processes, optimizer param groups, scheduler state, rank 0's
  Python and NumPy RNG state, the training config.
Everything is written into a temporary sibling folder and renamed into place, so a crash never leaves a
half-written `checkpoint-<step>`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

#: Both our loop's folders (`checkpoint-0000100`) and transformers' Trainer's (`checkpoint-100`, `hf-latentlm sft` /
#: `dpo`) match; both write `trainer_state.json` after everything else.
CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "trainer_state.json"
#: Fault injection for the kill-and-resume test (tests/training/test_checkpoint.py): set to a step, the process
#: that writes `checkpoint-<step>` SIGKILLs itself after its temporary folder is complete and before the rename, the
#: worst moment for a crash. Unset in normal use.
KILL_BEFORE_RENAME_ENV = "HF_LATENTLM_KILL_BEFORE_RENAME"


class DamagedCheckpoint(ValueError):
    """A file of a checkpoint is missing or does not read; the message names the checkpoint and the file."""

    def __init__(self, checkpoint: Path, name: str, problem: str):
        self.checkpoint, self.file, self.problem = Path(checkpoint), name, problem
        super().__init__(f"checkpoint {checkpoint} is damaged: {name} {problem}")


def read_tensors(checkpoint: Path, name: str) -> dict:
    """The tensors of `checkpoint/name`; DamagedCheckpoint naming the file if it is missing, truncated or not a
    safetensors file (safetensors' own error names neither)."""
    path = Path(checkpoint) / name
    if not path.is_file():
        raise DamagedCheckpoint(checkpoint, name, "is missing")
    try:
        return load_file(path)
    except (SafetensorError, OSError) as err:
        raise DamagedCheckpoint(checkpoint, name, f"does not read ({err})") from err


def read_json(checkpoint: Path, name: str) -> dict:
    """`checkpoint/name` parsed; DamagedCheckpoint naming the file if it is missing or not JSON."""
    path = Path(checkpoint) / name
    if not path.is_file():
        raise DamagedCheckpoint(checkpoint, name, "is missing")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise DamagedCheckpoint(checkpoint, name, f"is not readable JSON ({err})") from err


def optimizer_state_to_flat(optimizer: torch.optim.Optimizer) -> tuple[dict, list]:
    state = optimizer.state_dict()
    tensors = {f"state.{index}.{name}": torch.as_tensor(value).contiguous().cpu()
               for index, per_param in state["state"].items() for name, value in per_param.items()}
    return tensors, state["param_groups"]


def gather_optimizer_state(model, optimizer: torch.optim.Optimizer) -> tuple[dict, list]:
    """`optimizer_state_to_flat` for an optimizer over sharded (FSDP) parameters. A collective: every rank calls it;
    the full state lands on rank 0 (other ranks get no tensors). torch keys the gathered state by parameter name;
    it is re-keyed by index, as `Optimizer.state_dict()` numbers parameters, so the checkpoint looks the same
    however the run was sharded."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not state:  # not rank 0
        return {}, []
    index = {name: i for i, name in enumerate(name for group in state["param_groups"] for name in group["params"])}
    # (On CPU, torch hands back DTensors still: gathered here, on every rank.)
    tensors = {f"state.{index[param]}.{name}": torch.as_tensor(value.full_tensor() if hasattr(value, "full_tensor")
                                                                else value).contiguous().cpu()
               for param, per_param in state["state"].items() for name, value in per_param.items()}
    return tensors, [dict(group, params=[index[name] for name in group["params"]]) for group in state["param_groups"]]


def scatter_optimizer_state(checkpoint: Path, model, optimizer: torch.optim.Optimizer) -> None:
    """Load a checkpoint's optimizer state into an optimizer over sharded (FSDP) parameters: each rank keeps its
    shard. A collective, like `gather_optimizer_state`."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    checkpoint = Path(checkpoint)
    saved = optimizer_state_from_flat(read_tensors(checkpoint, "optimizer.safetensors"),
                                      read_json(checkpoint, STATE_FILE)["param_groups"])
    # The parameter names in the order torch numbers them, read off this (fresh) optimizer.
    current = get_optimizer_state_dict(model, optimizer)
    names = [name for group in current["param_groups"] for name in group["params"]]
    if len(names) != sum(len(group["params"]) for group in saved["param_groups"]):
        raise ValueError(f"{checkpoint}: the optimizer state does not match the model's trainable parameters")
    set_optimizer_state_dict(model, optimizer, {
        "state": {names[index]: per_param for index, per_param in saved["state"].items()},
        "param_groups": [dict(group, params=[names[i] for i in group["params"]]) for group in saved["param_groups"]],
    }, options=StateDictOptions(full_state_dict=True))


def optimizer_state_from_flat(tensors: dict, param_groups: list) -> dict:
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = value
    return {"state": state, "param_groups": param_groups}


def capture_rng_state() -> tuple[dict, dict]:
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = s
    np_state = np.random.get_state()
    tensors["numpy_keys"] = torch.from_numpy(np.asarray(np_state[1], dtype=np.int64))
    py_version, py_internal, py_gauss = random.getstate()
    meta = {
        "python": [py_version, list(py_internal), py_gauss],
        "numpy": [np_state[0], int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }
    return tensors, meta


def restore_rng_state(tensors: dict, meta: dict) -> None:
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("cuda."))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    name, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((name, tensors["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))


def is_complete_checkpoint(folder: Path) -> bool:
    """True when `folder`'s `trainer_state.json`, written last, reads as JSON. Our saves are atomic, but the
    Trainer's (`sft` / `dpo`) write straight into the folder, so a crash can leave a half-written one."""
    try:
        json.loads((folder / STATE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return True


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints in `output_dir`, oldest first; an incomplete `checkpoint-<step>` is skipped with a
    warning."""
    complete = []
    for path in checkpoint_folders(output_dir):
        if is_complete_checkpoint(path):
            complete.append(path)
        else:
            logger.warning("skipping the incomplete checkpoint %s (no readable %s)", path, STATE_FILE)
    return complete


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in `output_dir`, or None: the one `sft` / `dpo --resume` continue from."""
    checkpoints = list_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


def checkpoint_folders(output_dir: str | os.PathLike) -> list[Path]:
    """Every `checkpoint-<step>` folder in `output_dir`, complete or not, oldest first."""
    root = Path(output_dir)
    found = [(int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() else ())
             if (m := CHECKPOINT_PATTERN.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def resume_checkpoint(output_dir: str | os.PathLike, which: str = "latest") -> Path:
    """The checkpoint `train --resume [which]` continues from: "latest", the newest `checkpoint-<step>` folder
    (complete or not: our saves are atomic, so a damaged one is refused by `read_checkpoint`, not skipped), or
    "previous", the newest complete one before it (the fallback when the latest is damaged)."""
    folders = checkpoint_folders(output_dir)
    if not folders:
        raise FileNotFoundError(f"--resume: no checkpoint-* folder in {output_dir}")
    if which == "latest":
        return folders[-1]
    previous = previous_complete_checkpoint(folders[-1])
    if previous is None:
        raise FileNotFoundError(f"--resume previous: no complete checkpoint before {folders[-1]}")
    return previous


def previous_complete_checkpoint(checkpoint: Path) -> Path | None:
    """The newest complete checkpoint older than `checkpoint` in its folder, or None."""
    folders = checkpoint_folders(Path(checkpoint).parent)
    step = int(CHECKPOINT_PATTERN.match(Path(checkpoint).name).group(1))
    earlier = [folder for folder in folders
               if int(CHECKPOINT_PATTERN.match(folder.name).group(1)) < step and is_complete_checkpoint(folder)]
    return earlier[-1] if earlier else None


def atomic_directory_write(target: Path, write) -> None:
    """Call `write(tmp_dir)` then move `tmp_dir` to `target`, replacing an older `target`. An interrupted write
    (Ctrl-C, an error) removes its temporary folder; one a killed process left is removed by the next write of the
    same target."""
    target = Path(target)
    for stale in target.parent.glob(f".tmp-{target.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = target.parent / f".tmp-{target.name}-{os.getpid()}"
    tmp.mkdir(parents=True)
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    kill_at = os.environ.get(KILL_BEFORE_RENAME_ENV)
    if kill_at and (match := CHECKPOINT_PATTERN.match(target.name)) and int(match.group(1)) == int(kill_at):
        os.kill(os.getpid(), signal.SIGKILL)  # only for the kill test (KILL_BEFORE_RENAME_ENV)
    if target.exists():
        old = target.parent / f".old-{target.name}-{os.getpid()}"
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old)
    else:
        os.replace(tmp, target)


def save_checkpoint(output_dir, step: int, model, tokenizer, optimizer, scheduler, state: dict,
                    keep_last: int | None = 2, rank_rng: list | None = None, model_state_dict: dict | None = None,
                    optimizer_state: tuple[dict, list] | None = None) -> Path:
    """Write `checkpoint-<step>` atomically (main process only) and prune older ones (`keep_last` 0 or
    None keeps all). `rank_rng`: every rank's `capture_rng_state()`, rank 0 first (default: this process's
    only). `model_state_dict` / `optimizer_state`: states gathered from a sharded run (`accelerator.get_state_dict`,
    `gather_optimizer_state`) instead of the model's and optimizer's own."""
    target = Path(output_dir) / f"checkpoint-{step:07d}"
    rank_rng = rank_rng or [capture_rng_state()]

    def write(folder: Path):
        model.save_pretrained(folder, state_dict=model_state_dict)
        if tokenizer is not None:
            save_tokenizer(tokenizer, folder)
        tensors, param_groups = optimizer_state or optimizer_state_to_flat(optimizer)
        save_file(tensors, folder / "optimizer.safetensors")
        for rank, (rng_tensors, rng_meta) in enumerate(rank_rng):
            save_file(rng_tensors, folder / f"rng_rank{rank}.safetensors")
            if rank > 0:  # rank 0's goes into the trainer state
                (folder / f"rng_rank{rank}.json").write_text(json.dumps(rng_meta))
        full_state = dict(state, step=step, param_groups=param_groups,
                          scheduler=scheduler.state_dict(), rng={"0": rank_rng[0][1]})
        (folder / STATE_FILE).write_text(json.dumps(full_state, indent=1, default=_json_default))

    atomic_directory_write(target, write)
    if keep_last:
        for old in list_checkpoints(output_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return target


def save_tokenizer(tokenizer, folder: str | os.PathLike) -> None:
    """`tokenizer.save_pretrained(folder)`, with a `tokenizer_config.json` that `AutoTokenizer` resolves without
    remote code.

    A tokenizer of a custom class (remote code from its Hub repository, or a subclass defined by the user) is
    saved under that class's name and, if registered for the Auto classes, an `auto_map`: `AutoTokenizer` then
    asks for `trust_remote_code` (an interactive [y/N] prompt). When the folder has a `tokenizer.json`, which holds
    the whole tokenization pipeline, the config names the nearest transformers class the custom one derives from
    instead and drops the `auto_map`; the switch is kept only if that class tokenizes a probe text exactly as the
    tokenizer does (else the custom class stays, and loading it needs its code)."""
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    def own_class(name):
        found = tokenizer_class_from_name(name) if isinstance(name, str) else None
        return found if found is not None and found.__module__.startswith("transformers.") else None

    folder = Path(folder)
    tokenizer.save_pretrained(folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    if own_class(config.get("tokenizer_class")) is not None and "auto_map" not in config:
        return
    base = next((cls for cls in type(tokenizer).__mro__ if own_class(cls.__name__) is cls), None)
    if base is None or not (folder / "tokenizer.json").is_file():
        return
    custom = config_file.read_text(encoding="utf-8")
    config["tokenizer_class"] = base.__name__
    config.pop("auto_map", None)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
    probe = "ROMEO.\nBut, soft! what light through yonder window breaks? 123 \u00e9t\u00e9 \u65e5\u672c\t<|endoftext|>"
    try:
        same = base.from_pretrained(folder)(probe)["input_ids"] == tokenizer(probe)["input_ids"]
    except Exception:  # whatever keeps the base class from reading these files: the custom class stays
        same = False
    if not same:
        config_file.write_text(custom, encoding="utf-8")


def read_checkpoint(checkpoint: Path, rank: int = 0, num_processes: int | None = None) -> tuple[dict, dict, dict]:
    """Read every file a resume of rank `rank` needs, before anything is loaded into the model: (trainer state,
    weights, optimizer tensors). DamagedCheckpoint names the first file that is missing, truncated or unreadable;
    `num_processes`: ValueError for a checkpoint written by another number of processes."""
    checkpoint = Path(checkpoint)
    state = read_json(checkpoint, STATE_FILE)
    missing = [key for key in ("step", "param_groups", "scheduler", "rng") if key not in state]
    if missing:
        raise DamagedCheckpoint(checkpoint, STATE_FILE, f"has no {', '.join(missing)} entry")
    written_by = state.get("num_processes", 1)
    if num_processes is not None and num_processes != written_by:
        # The data order and the per-rank RNG streams are both functions of the number of processes.
        raise ValueError(f"{checkpoint} was written by {written_by} process(es); resume it with {written_by}, "
                         f"not {num_processes}")
    index = checkpoint / "model.safetensors.index.json"
    if index.is_file():  # sharded weights: every shard the index names
        shards = sorted(set(read_json(checkpoint, index.name).get("weight_map", {}).values()))
    else:
        shards = ["model.safetensors"]
    weights = {}
    for shard in shards:
        weights.update(read_tensors(checkpoint, shard))
    optimizer_tensors = read_tensors(checkpoint, "optimizer.safetensors")
    read_rank_rng(checkpoint, rank, state)  # read now, restored after `prepare`: a bad one fails before any work
    return state, weights, optimizer_tensors


def load_checkpoint(checkpoint: Path, model, optimizer, scheduler, rank: int = 0, restore_rng: bool = True,
                    num_processes: int | None = None) -> dict:
    """Restore weights, optimizer (unless None: a sharded one loads later, `scatter_optimizer_state`), scheduler and
    (`restore_rng`) this rank's RNG; return the trainer state. Every file is read first (`read_checkpoint`), so a
    damaged checkpoint is refused, naming the file, before the model changes. `num_processes`: refuse a checkpoint
    written by another number of processes."""
    checkpoint = Path(checkpoint)
    state, weights, optimizer_tensors = read_checkpoint(checkpoint, rank, num_processes)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # Tied weights are stored once; anything else missing means a different architecture.
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    really_missing = [k for k in missing if k not in tied]
    if really_missing or unexpected:
        raise ValueError(f"checkpoint {checkpoint} does not match the model: missing {really_missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    if "lm_head.weight" in missing and getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    if optimizer is not None:
        optimizer.load_state_dict(optimizer_state_from_flat(optimizer_tensors, state["param_groups"]))
    scheduler.load_state_dict(state["scheduler"])
    if restore_rng:
        load_rank_rng(checkpoint, rank)
    return state


def read_rank_rng(checkpoint: Path, rank: int = 0, state: dict | None = None) -> tuple[dict, dict]:
    """Rank `rank`'s RNG state in `checkpoint` (tensors, meta); a missing or unreadable one is DamagedCheckpoint,
    not a silent skip (the run would go on, just not the same run). `state`: the trainer state, if already read."""
    checkpoint = Path(checkpoint)
    name = f"rng_rank{rank}.safetensors"
    if not (checkpoint / name).is_file():
        raise DamagedCheckpoint(checkpoint, name, f"is missing (no RNG state for rank {rank})")
    tensors = read_tensors(checkpoint, name)
    if rank == 0:
        meta = (state or read_json(checkpoint, STATE_FILE)).get("rng", {}).get("0")
        if meta is None:
            raise DamagedCheckpoint(checkpoint, STATE_FILE, "has no RNG state for rank 0")
    else:
        meta = read_json(checkpoint, f"rng_rank{rank}.json")
    return tensors, meta


def load_rank_rng(checkpoint: Path, rank: int = 0) -> None:
    """Set this process's RNG to rank `rank`'s state in `checkpoint` (`read_rank_rng`)."""
    tensors, meta = read_rank_rng(checkpoint, rank)
    try:
        restore_rng_state(tensors, meta)
    except (KeyError, ValueError, TypeError, RuntimeError) as err:
        raise DamagedCheckpoint(checkpoint, f"rng_rank{rank}.safetensors",
                                f"holds no usable RNG state ({err})") from err


def _json_default(value):
    if isinstance(value, (np.integer, np.floating, torch.Tensor)):
        return value.tolist()
    if isinstance(value, (set, tuple)):
        return list(value)
    raise TypeError(f"cannot store {type(value).__name__} in trainer_state.json")
