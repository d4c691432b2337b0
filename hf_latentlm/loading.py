"""Load a trained model folder (a `train` output or a checkpoint) with its tokenizer."""

from __future__ import annotations

from pathlib import Path


def load_model_and_tokenizer(path: str, device: str | None = None, language_model: bool = True):
    """`AutoModelForCausalLM` + `AutoTokenizer` from a local folder, offline-friendly.

    Our own families register their Auto classes when `hf_latentlm.families` is imported, so the
    installed classes are used; `trust_remote_code=True` lets a folder's own modeling files load
    where the package is not installed. `language_model=False` also accepts components (families
    registered with `language_model=False`, loaded with `AutoModel`).
    """
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    from .families import FAMILIES, family_of_model_type

    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {path!r} does not exist")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{path!r} has no config.json: not a saved model folder")
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{path!r} has no tokenizer files; models saved by `hf-latentlm train` include them")
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    spec = family_of_model_type(config.model_type)
    is_component = spec is not None and not spec.language_model
    if language_model and is_component:
        users = sorted(s.name for s in FAMILIES.values() if spec.name in s.components.values())
        raise ValueError(f"{path!r} holds a {config.model_type} (a component, not a language model); pass the folder "
                         f"written by `train --family {'/'.join(users)}`, which uses it")
    auto_class = AutoModel if is_component else AutoModelForCausalLM
    model = auto_class.from_pretrained(folder, trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if device:
        model.to(device)
    model.eval()
    return model, tokenizer
