"""What a saved model folder holds, and the checks that refuse a damaged one with one line.

The bottom of the package: pure file checks (json, safetensors headers, tokenizer files) and the names of the files
the package writes into a folder. Nothing here imports torch, transformers or another module of the package, so
every layer (the family registry, loading, training, the Hub upload) can use it.
"""

from __future__ import annotations

import json
from pathlib import Path

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
#: Written by `hf-latentlm sft` / `dpo` into their output folder: {"stage", "base_model", "lora", "task"}, and
#: "policy_rejections" / "sampled_rejections" for a DPO run on the model's own wrong samples; the model card reads it.
POST_TRAINING_RECORD = "post_training.json"
#: The checkpoint's own `hf-latentlm eval` JSON, read by `push` when it gets no `--eval-results`
#: (`hf-latentlm eval --model DIR > DIR/eval_results.json`).
EVAL_RESULTS_FILE = "eval_results.json"
#: Written by `hf-latentlm convert`: where the official weights came from (source, repository, license, notes).
CONVERSION_RECORD = "conversion.json"


def read_json_file(path: Path, label: str):
    """The parsed content of `path`; ValueError naming `label` and the file when it is not readable JSON."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{label}: {Path(path).name} is not valid JSON ({err})") from err


def weight_files(folder: Path, label: str) -> list[Path]:
    """The safetensors files of a saved model: `model.safetensors`, or every shard its index names."""
    if (folder / WEIGHTS_FILE).is_file():
        return [folder / WEIGHTS_FILE]
    if (folder / WEIGHTS_INDEX_FILE).is_file():
        index = read_json_file(folder / WEIGHTS_INDEX_FILE, label)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{label}: {WEIGHTS_INDEX_FILE} has no weight_map")
        shards = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [shard.name for shard in shards if not shard.is_file()]
        if missing:
            raise FileNotFoundError(f"{label}: {WEIGHTS_INDEX_FILE} names missing shards {missing[:3]}")
        return shards
    raise FileNotFoundError(f"{label} has no weights ({WEIGHTS_FILE}): not a saved model folder, or one whose "
                            f"saving did not finish")


def check_model_folder(path: str | Path, label: str | None = None) -> dict:
    """The parsed `config.json` of a saved model folder, after checking what `from_pretrained` would otherwise
    fail on with a traceback: the folder and config.json exist, config.json is a JSON object with a `model_type`,
    weights exist and every safetensors header reads (a truncated file does not). `label` names the folder in
    the errors (default: "model folder '<path>'")."""
    from safetensors import SafetensorError, safe_open

    folder = Path(path)
    label = label or f"model folder {str(path)!r}"
    if folder.is_file():
        raise ValueError(f"{label} is a file, not a model folder: pass the folder that holds it ({folder.parent})")
    if not folder.is_dir():
        raise FileNotFoundError(f"{label} does not exist")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{label} has no config.json: not a saved model folder")
    config = read_json_file(folder / "config.json", label)
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ValueError(f"{label}: config.json has no model_type: not a saved transformers model")
    for weights in weight_files(folder, label):
        try:
            with safe_open(str(weights), framework="pt"):
                pass
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{label}: {weights.name} is damaged or truncated ({err})") from err
    return config


def check_tokenizer_files(folder: Path, label: str) -> None:
    """Tokenizer files present, JSON ones parsing and `tokenizer.json` loading in `tokenizers`."""
    tokenizer_json, tokenizer_config = folder / "tokenizer.json", folder / "tokenizer_config.json"
    if not tokenizer_json.is_file() and not tokenizer_config.is_file():
        raise FileNotFoundError(f"{label} has no tokenizer files; models saved by `hf-latentlm train` include them")
    if tokenizer_config.is_file():
        read_json_file(tokenizer_config, label)
    if tokenizer_json.is_file():
        from tokenizers import Tokenizer

        read_json_file(tokenizer_json, label)
        try:
            Tokenizer.from_file(str(tokenizer_json))
        except Exception as err:  # tokenizers raises a bare Exception for any file it cannot read
            raise ValueError(f"{label}: tokenizer.json is not a valid tokenizer ({err})") from err


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hub can be asked for files now: not when `HF_HUB_OFFLINE` is set, nor when its host does not
    answer within `timeout` seconds (huggingface_hub would otherwise retry for over a minute before failing)."""
    import os
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    endpoint = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout):
            return True
    except OSError:
        return False

