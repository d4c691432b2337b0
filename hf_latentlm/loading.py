"""Load a trained model folder (a `train` output or a checkpoint) with its tokenizer.

A damaged folder (config.json that is not JSON, no weights, a truncated `model.safetensors`, a
corrupt tokenizer file) is refused with a ValueError / FileNotFoundError naming the folder and the
file, never a traceback from deep inside transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"


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


def load_model_and_tokenizer(path: str, device: str | None = None, language_model: bool = True):
    """`AutoModelForCausalLM` + `AutoTokenizer` from a local folder, offline-friendly.

    Our own families register their Auto classes when `hf_latentlm.modeling` is imported, so the
    installed classes are used; `trust_remote_code=True` lets a folder's own modeling files load
    where the package is not installed. `language_model=False` also accepts components (families
    registered with `language_model=False`, loaded with `AutoModel`).
    """
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    from . import modeling  # noqa: F401  (registers our classes before AutoConfig reads the folder)
    from .families import FAMILIES, family_of_model_type

    folder = Path(path)
    label = f"model folder {path!r}"
    check_model_folder(folder, label)
    check_tokenizer_files(folder, label)
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    except OSError as err:
        raise ValueError(f"{label}: cannot read its config.json ({err})") from err
    spec = family_of_model_type(config.model_type)
    is_component = spec is not None and not spec.language_model
    if language_model and is_component:
        users = sorted(s.name for s in FAMILIES.values() if spec.name in s.components.values())
        raise ValueError(f"{path!r} holds a {config.model_type} (a component, not a language model); pass the folder "
                         f"written by `train --family {'/'.join(users)}`, which uses it")
    auto_class = AutoModel if is_component else AutoModelForCausalLM
    try:
        model = auto_class.from_pretrained(folder, trust_remote_code=True)
    except OSError as err:
        raise ValueError(f"{label}: cannot load its model ({err})") from err
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except OSError as err:
        raise ValueError(f"{label}: cannot load its tokenizer ({err})") from err
    if device:
        model.to(device)
    model.eval()
    return model, tokenizer
