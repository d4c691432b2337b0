"""`hf-latentlm convert`: an official CALM or Cola DLM checkpoint (a local folder or a Hub id) -> an ordinary
hf_latentlm model folder (config with `auto_map`, safetensors, remote code, tokenizer, generation config, card)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch

from ..folders import CONVERSION_RECORD, hub_reachable
from ..hub import is_hub_repo_id
from ..training.checkpoint import atomic_directory_write, save_tokenizer

WEIGHT_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "*.bin", "*.index.json"]
TOKENIZER_PATTERNS = ["tokenizer*", "special_tokens_map.json", "*.model", "vocab*", "merges.txt", "config.json"]


def fetch_source(source: str, label: str, patterns: list[str] = WEIGHT_PATTERNS) -> Path:
    """A local folder as is, or a Hub repository's files matching `patterns`, downloaded through huggingface_hub
    (its cache). Offline or missing: one line naming what could not be fetched."""
    path = Path(source)
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"{label} {source} is a file; give the folder that holds config.json and the weights")
    if not is_hub_repo_id(source):
        raise FileNotFoundError(f"{label} {source}: no such folder (nor a Hub id of the form OWNER/NAME)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    online = hub_reachable()  # else huggingface_hub retries for a minute before failing
    try:
        return Path(snapshot_download(source, allow_patterns=patterns, local_files_only=not online))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as err:
        why = str(err).splitlines()[0] if online else "the Hub is not reachable from here and it is not in the cache"
        raise ValueError(f"could not fetch {label} {source} from the Hub: {why}") from None


def read_config(folder: Path, label: str) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{label} {folder} has no config.json")
    return json.loads(path.read_text(encoding="utf-8"))


def read_official_weights(folder: Path, label: str) -> dict[str, torch.Tensor]:
    """Every tensor of an official checkpoint folder: `model.safetensors`, `pytorch_model.bin` (read only with
    `torch.load(weights_only=True)`), or either sharded with its `.index.json`."""
    from safetensors.torch import load_file

    for name in ("model.safetensors", "pytorch_model.bin"):
        index = folder / f"{name}.index.json"
        files = ([folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
                 if index.is_file() else [folder / name] if (folder / name).is_file() else [])
        if files:
            state = {}
            for file in files:
                state.update(load_file(file) if file.suffix == ".safetensors" else _load_bin(file, label))
            return state
    raise FileNotFoundError(f"{label} {folder} holds no model.safetensors or pytorch_model.bin")


def _load_bin(file: Path, label: str) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(f"{label} {file} holds more than tensors ({str(err).splitlines()[0]}); it is refused: only "
                         f"weights are read from a .bin file") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{label} {file} is not a state dict of tensors")
    return state


def convert_calm(model: str, output_dir: str, autoencoder: str | None = None, tokenizer: str | None = None,
                 overwrite: bool = False) -> tuple[Path, list[str]]:
    """An official CALM (`EnergyTransformer`, with its autoencoder inside as `ae_model.*` or given apart) -> a
    `CALMForCausalLM` folder. Returns the folder and the notes on fields that did not carry over."""
    from .calm import calm_from_official

    folder = fetch_source(model, "--model")
    official_config, state = read_config(folder, "--model"), read_official_weights(folder, "--model")
    ae_config = ae_state = None
    if autoencoder is not None:
        ae_folder = fetch_source(autoencoder, "--autoencoder")
        ae_config, ae_state = read_config(ae_folder, "--autoencoder"), read_official_weights(ae_folder,
                                                                                             "--autoencoder")
    converted, notes = calm_from_official(official_config, state, ae_config, ae_state)
    source = {"sources": {"model": model, "autoencoder": autoencoder},
              "repository": "https://github.com/shaochenze/calm", "license": "mit"}
    return write_folder(converted, output_dir, tokenizer, source, notes, overwrite), notes


def convert_cola(vae: str, dit: str, output_dir: str, tokenizer: str | None = None,
                 overwrite: bool = False) -> tuple[Path, list[str]]:
    """The official Cola DLM text VAE and DiT -> a `ColaForCausalLM` folder."""
    from .cola import (OFFICIAL_GENERATION, cola_config_from_official, cola_conversion_notes,
                       cola_state_dict_from_official)

    vae_folder, dit_folder = fetch_source(vae, "--vae"), fetch_source(dit, "--dit")
    config, notes = cola_config_from_official(read_config(vae_folder, "--vae"), read_config(dit_folder, "--dit"))
    notes = notes + cola_conversion_notes(config)
    from ..modeling.modeling_cola import ColaForCausalLM
    from .calm import load_into

    converted = ColaForCausalLM(config).float().eval()
    state = cola_state_dict_from_official(read_official_weights(vae_folder, "--vae"),
                                          read_official_weights(dit_folder, "--dit"), config)
    load_into(converted, state, "the official Cola checkpoint")
    source = {"sources": {"vae": vae, "dit": dit}, "repository": "https://github.com/ByteDance-Seed/Cola-DLM",
              "license": "apache-2.0"}
    return write_folder(converted, output_dir, tokenizer, source, notes, overwrite, OFFICIAL_GENERATION), notes


def write_folder(model, output_dir: str, tokenizer: str | None, source: dict, notes: list[str],
                 overwrite: bool, generation: dict | None = None) -> Path:
    """save_pretrained (config with auto_map, safetensors, remote code), the tokenizer or a note that ids must be
    passed, the family's generation config (with the official inference's `generation` fields) and a model card,
    written atomically."""
    from transformers import AutoTokenizer, GenerationConfig

    target = Path(output_dir)
    if target.exists() and any(target.iterdir()) and not overwrite:
        raise ValueError(f"--output-dir {target} is not empty; pass --overwrite-output-dir to replace it")
    loaded_tokenizer = None
    if tokenizer is not None:
        tokenizer_folder = fetch_source(tokenizer, "--tokenizer", TOKENIZER_PATTERNS)
        loaded_tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
        if len(loaded_tokenizer) > model.config.vocab_size:
            raise ValueError(f"--tokenizer {tokenizer} has {len(loaded_tokenizer)} tokens, more than the model's "
                             f"vocabulary ({model.config.vocab_size}): it is not this model's tokenizer")
    config = model.config
    model.generation_config = GenerationConfig(
        **model.generation_options_class.sampling_defaults(config), bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, **(generation or {}))

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        if loaded_tokenizer is not None:
            save_tokenizer(loaded_tokenizer, tmp)
        (tmp / "README.md").write_text(model_card(model, source, notes, loaded_tokenizer is not None),
                                       encoding="utf-8")
        (tmp / CONVERSION_RECORD).write_text(json.dumps({**source, "notes": notes}, indent=1) + "\n", encoding="utf-8")

    atomic_directory_write(target, write)
    return target


def model_card(model, source: dict, notes: list[str], has_tokenizer: bool) -> str:
    family = type(model).__name__
    origin = ", ".join(f"{k} `{v}`" for k, v in source["sources"].items() if v)
    lines = [
        "---", f"license: {source['license']}", "library_name: transformers", "tags:", "- hf-latentlm",
        "- converted", "---", "",
        f"# {family}, converted from the official checkpoint",
        "",
        f"Converted by `hf-latentlm convert` from {origin}, trained and released by the authors "
        f"({source['repository']}, license {source['license']}). Same weights, in hf_latentlm's official form: "
        "in fp32 the converted model reproduces the official code's outputs within 1e-5 "
        "(`scripts/checks/official_parity.py` in hf_latentlm, run in its test suite on official-format "
        "checkpoints).",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        "model = AutoModelForCausalLM.from_pretrained(PATH, trust_remote_code=True)",
        "```",
        "",
    ]
    if not has_tokenizer:
        lines += ["No tokenizer was given at conversion: pass token ids (`input_ids`), or convert again with "
                  "`--tokenizer`.", ""]
    if notes:
        lines += ["Conversion notes:", ""] + [f"- {note}" for note in notes] + [""]
    return "\n".join(lines)


__all__ = ["convert_calm", "convert_cola", "fetch_source", "read_config", "read_official_weights", "write_folder"]
