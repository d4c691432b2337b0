"""`hf-latentlm push`: upload a saved model folder to the Hugging Face Hub with a model card.

Only what loading needs travels: weights (safetensors), config (with its `auto_map`), the flat remote-code `.py`
files, tokenizer files, the generation config and a generated README.md. Optimizer / scheduler / RNG state,
`checkpoint-*` folders, `metrics.jsonl` and pickles never do. The token comes from huggingface_hub's usual places
(`HF_TOKEN`, `hf auth login`) and is never printed.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

from .families import FAMILIES

UPLOAD_PATTERNS = ("*.safetensors", "model.safetensors.index.json", "config.json", "generation_config.json", "*.py",
                   "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json")
NEVER_UPLOAD = ("optimizer*", "scheduler*", "rng_state*", "trainer_state.json", "training_args*", "metrics.jsonl",
                "*.bin", "*.pt", "*.pth", "*.pkl", "*.pickle", "README.md")

# One sentence per family, as the README introduces it.
FAMILY_SUMMARIES = {
    "ar": "a plain autoregressive Llama baseline (one token per model call).",
    "plm": "PLM (Parallel Language Model): a causal encoder that proposes several future tokens per call and "
           "verifies them (quadratic decoding).",
    "calm": "CALM (Continuous Autoregressive LM): a backbone predicts one continuous latent per chunk of K tokens "
            "with an energy head, decoded by a frozen autoencoder.",
    "cola": "Cola DLM (Continuous Latent Diffusion LM): a block-causal DiT prior denoises text-VAE latents one "
            "block at a time.",
    "aurora": "AURORA-LM: a block-causal x0 denoiser over the latents of a frozen query autoencoder.",
}


def files_to_upload(folder: Path) -> list[str]:
    """Top-level files of `folder` that a push sends (sorted), never a subfolder such as `checkpoint-*`."""
    names = []
    for path in sorted(folder.iterdir()):
        if not path.is_file():
            continue
        if any(fnmatch.fnmatch(path.name, p) for p in NEVER_UPLOAD):
            continue
        if any(fnmatch.fnmatch(path.name, p) for p in UPLOAD_PATTERNS):
            names.append(path.name)
    return names


def family_of(config: dict) -> str:
    model_type = config.get("model_type")
    for name, spec in FAMILIES.items():
        if spec.model_type is not None and spec.model_type == model_type:
            return name
    return "ar" if model_type == "llama" else str(model_type)


def build_model_card(folder: Path, repo_id: str, license: str = "apache-2.0"):
    from huggingface_hub import ModelCard, ModelCardData

    config = json.loads((folder / "config.json").read_text())
    family = family_of(config)
    summary = FAMILY_SUMMARIES.get(family, f"a `{family}` model of hf-latentlm.")
    data = ModelCardData(library_name="transformers", pipeline_tag="text-generation", license=license,
                         tags=[family, "custom_code", "hf-latentlm"])
    remote = "trust_remote_code=True" if config.get("auto_map") else ""
    body = f"""# {repo_id.split('/')[-1]}

A `{family}` model trained with [`hf-latentlm`](https://pypi.org/project/hf-latentlm/) — {summary}

## Use

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{repo_id}"{', ' + remote if remote else ''})
tokenizer = AutoTokenizer.from_pretrained("{repo_id}")
ids = tokenizer("ROMEO.\\n", return_tensors="pt").input_ids
print(tokenizer.decode(model.generate(ids, do_sample=True, max_new_tokens=64)[0]))
```
"""
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}")


def check_folder(folder: Path) -> None:
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder")
    missing = [name for name in ("config.json", "model.safetensors") if not (folder / name).is_file()]
    if (folder / "model.safetensors.index.json").is_file() and "model.safetensors" in missing:
        missing.remove("model.safetensors")  # sharded weights
    if missing:
        raise ValueError(f"{folder} is not a loadable model folder (no {' / '.join(missing)}); give a folder "
                         f"written by `hf-latentlm train` or `save_pretrained`")


def push_model(folder: str | Path, repo_id: str, private: bool = False, revision: str | None = None,
               license: str = "apache-2.0", commit_message: str | None = None) -> str:
    """Create `repo_id` if needed and upload the model folder plus a model card in one commit; returns the commit URL."""
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    folder = Path(folder)
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ValueError(f"bad --repo-id {repo_id!r}: {err}") from err
    if repo_id.count("/") != 1:
        raise ValueError(f"bad --repo-id {repo_id!r}: expected OWNER/NAME")
    check_folder(folder)
    card = build_model_card(folder, repo_id, license)
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(folder / name))
                  for name in files_to_upload(folder)]
    operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=str(card).encode()))
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError

    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.create_commit(repo_id, operations=operations, revision=revision,
                                 commit_message=commit_message or "Upload model with hf-latentlm push")
    except (HfHubHTTPError, LocalTokenNotFoundError) as err:  # the CLI prints ValueErrors as one line
        raise ValueError(f"the Hub refused the push to {repo_id}: {err}") from err
    return info.commit_url
