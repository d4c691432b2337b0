"""Load a trained model folder (a `train` output or a checkpoint) with its tokenizer."""

from __future__ import annotations

from pathlib import Path

NOT_LANGUAGE_MODELS = ("calm_autoencoder",)


def load_model_and_tokenizer(path: str, device: str | None = None, language_model: bool = True):
    """`AutoModelForCausalLM` + `AutoTokenizer` from a local folder, offline-friendly.

    Our own families register their Auto classes when `hf_latentlm.modeling` is imported, so the
    installed classes are used; `trust_remote_code=True` lets a folder's own modeling files load
    where the package is not installed. `language_model=False` also accepts components (the CALM
    autoencoder, loaded with `AutoModel`).
    """
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    import hf_latentlm.modeling  # noqa: F401  (registers the families' Auto classes)

    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {path!r} does not exist")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{path!r} has no config.json: not a saved model folder")
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{path!r} has no tokenizer files; models saved by `hf-latentlm train` include them")
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    if language_model and config.model_type in NOT_LANGUAGE_MODELS:
        raise ValueError(f"{path!r} holds a {config.model_type} (a component, not a language model); for CALM, pass "
                         f"the folder written by `train --family calm`")
    # Components that are not language models (the CALM autoencoder) load through AutoModel.
    auto_class = AutoModel if config.model_type in NOT_LANGUAGE_MODELS else AutoModelForCausalLM
    model = auto_class.from_pretrained(folder, trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if device:
        model.to(device)
    model.eval()
    return model, tokenizer
