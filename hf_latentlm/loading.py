"""Load a trained model folder (a `train` output or a checkpoint) with its tokenizer.

A damaged folder (config.json that is not JSON, no weights, a truncated `model.safetensors`, a corrupt tokenizer
file) is refused with a ValueError / FileNotFoundError naming the folder and the file, never a traceback from deep
inside transformers.
"""

from __future__ import annotations

from pathlib import Path

from .folders import check_model_folder, check_tokenizer_files


#: The AR baseline's model type (transformers' Llama), loaded beside the registry's families.
BASELINE_MODEL_TYPE = "llama"


def check_model_type(model_type: str, label: str) -> None:
    """ValueError naming the model type when it is neither the AR baseline's nor one of the registry's families': a
    folder of another architecture would load with a head its weights never trained (a BERT generating text)."""
    from .families import FAMILIES

    known = [BASELINE_MODEL_TYPE, *(spec.model_type for spec in FAMILIES.values() if spec.model_type)]
    if model_type not in known:
        raise ValueError(f"{label} holds a {model_type!r} model, which hf-latentlm does not load; it loads "
                         f"{', '.join(known)}")


def load_model_and_tokenizer(path: str, device: str | None = None, language_model: bool = True):
    """`AutoModelForCausalLM` + `AutoTokenizer` from a local folder. The package's own families use the installed
    classes (importing `hf_latentlm.modeling` registers them); `trust_remote_code=True` lets a folder's own modeling
    files load where the package is not installed. `language_model=False` also accepts components (`AutoModel`)."""
    folder = Path(path)
    label = f"model folder {path!r}"
    model_type = check_model_folder(folder, label)["model_type"]  # before the slow imports: refused in a second
    check_model_type(model_type, label)
    check_tokenizer_files(folder, label)
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    from . import modeling  # noqa: F401  (registers our classes before AutoConfig reads the folder)
    from .families import families_using, family_of_model_type

    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    except OSError as err:
        raise ValueError(f"{label}: cannot read its config.json ({err})") from err
    spec = family_of_model_type(config.model_type)
    is_component = spec is not None and not spec.language_model
    if language_model and is_component:
        users = families_using(spec.name)
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
