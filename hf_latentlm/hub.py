"""`hf-latentlm push`: upload a saved model folder to the Hugging Face Hub with a model card.

Only what loading needs travels: weights (safetensors), config (with its `auto_map`), the flat remote-code `.py`
files, tokenizer files, the generation config and a generated README.md. Optimizer / scheduler / RNG state,
`checkpoint-*` folders, `metrics.jsonl` and pickles never do. The token comes from huggingface_hub's usual places
(`HF_TOKEN`, `hf auth login`) and is never printed.

The card (`build_model_card`) is rendered with `huggingface_hub.ModelCard.from_template` from `CARD_TEMPLATE` and
the family's card (its registry entry's `model_card`, `hf_latentlm/cards.py`); model_cards/README.md describes
what goes into it and from where.
"""

from __future__ import annotations

import fnmatch
import json
import math
from pathlib import Path

from .cards import default_card
from .families import BASELINE_FAMILY, families_using, family_of_model_type, get_family
from .folders import (CONVERSION_RECORD, EVAL_RESULTS_FILE, POST_TRAINING_RECORD, check_model_folder,
                      check_tokenizer_files, read_json_file, weight_files)

UPLOAD_PATTERNS = ("*.safetensors", "model.safetensors.index.json", "config.json", "generation_config.json", "*.py",
                   "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json")
NEVER_UPLOAD = ("optimizer*", "scheduler*", "rng_state*", "rng_rank*", "trainer_state.json", "training_args*",
                "metrics.jsonl", "*.bin", "*.pt", "*.pth", "*.pkl", "*.pickle", "README.md")
#: What the models are trained and evaluated on unless `--train-file` says otherwise (docs/corpus.md).
EMBEDDED_CORPUS = "the Project Gutenberg Shakespeare corpus embedded in hf-latentlm (42 works, public domain)"

CPU_SCALE = ("A research model at CPU scale ({parameters} parameters) trained on a small corpus: it writes "
             "Shakespeare-like pastiche, not facts, and is meant for studying decoding speed against quality next to "
             "the matched autoregressive baseline, not for any application.")

CONVERTED_SCALE = ("The authors' trained weights ({repository}), converted to hf-latentlm's official form: in fp32 the "
                   "converted model reproduces the official code's outputs within 1e-5 (checked in hf-latentlm's "
                   "tests on official-format checkpoints). Quality and intended use are the authors'; see their "
                   "repository and paper.")

CARD_TEMPLATE = """---
{{ card_data }}
---

# {{ model_name }}

{{ about }}

- **Family:** {{ family_title }} (`{{ family }}`), trained with the `hf-latentlm` package
- **Parameters:** {{ parameters }} (every tensor of `model.safetensors`{{ ", frozen components included" if components else "" }})
- **Training:** {{ training }}
{%- if base_model %}
- **Post-trained from:** [{{ base_model }}](https://huggingface.co/{{ base_model }}) ({{ post_training }})
{%- endif %}

## Use

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{{ repo_id }}"{{ load_args }})
tok = AutoTokenizer.from_pretrained("{{ repo_id }}"{{ load_args }})
ids = tok(["ROMEO.\\n", "HAMLET.\\nTo be"], return_tensors="pt", padding=True, padding_side="left")
{{ generate }}
```

{% if remote_code -%}
`trust_remote_code=True` runs the modeling files stored in this repository; `hf_latentlm` need not be installed.
{%- else -%}
A plain `transformers` Llama: no remote code, `hf_latentlm` need not be installed.
{%- endif %}

## Results
{% if results %}
{{ results }}
{% else %}
No evaluation was given to `hf-latentlm push` (`--eval-results`, `--baseline-eval`).
{% endif %}
## Intended use and limitations

{{ cpu_scale }}

{{ limitations }}
{%- if citation %}

## Citation

```bibtex
{{ citation }}
```
{%- endif %}
"""


def files_to_upload(folder: Path) -> list[str]:
    """Top-level files of `folder` that a push sends (sorted), never a subfolder such as `checkpoint-*`."""
    def matches(path, patterns):
        return any(fnmatch.fnmatch(path.name, p) for p in patterns)

    return [path.name for path in sorted(folder.iterdir())
            if path.is_file() and not matches(path, NEVER_UPLOAD) and matches(path, UPLOAD_PATTERNS)]


def family_of(config: dict) -> str:
    """The registry name of a saved model's family (the AR baseline for transformers' own models)."""
    spec = family_of_model_type(config["model_type"])
    return spec.name if spec is not None else BASELINE_FAMILY


def check_folder(folder: Path) -> dict:
    """The folder's config, after refusing what `from_pretrained` could not load as a language model: missing or
    damaged config / weights / tokenizer, a remote-code file its `auto_map` names but the folder lacks, a component
    (autoencoder, VAE), or a model type no card is written for."""
    label = f"--model {str(folder)!r}"
    config = check_model_folder(folder, label)
    check_tokenizer_files(folder, label)
    spec = family_of_model_type(config["model_type"])
    if spec is not None and not spec.language_model:
        users = families_using(spec.name)
        raise ValueError(f"{label} holds a {config['model_type']} (a component, not a language model): push the "
                         f"{'/'.join(users)} model, which carries it in its own weights")
    if spec is None and config["model_type"] != "llama":
        raise ValueError(f"{label} holds a {config['model_type']!r} model, which is not an hf-latentlm family")
    references = [ref for ref in (config.get("auto_map") or {}).values() if isinstance(ref, str)]
    missing = sorted({f"{ref.split('--')[-1].split('.')[0]}.py" for ref in references}
                     - {p.name for p in folder.glob("*.py")})
    if missing:
        raise ValueError(f"{label}: config.json's auto_map names {', '.join(missing)}, which the folder lacks; save "
                         f"the model again with save_pretrained")
    return config


def count_parameters(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in weight_files(folder, str(folder)):
        with safe_open(str(path), framework="pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return total


def training_summary(folder: Path, family: str, datasets: list[str] | None = None) -> str:
    """How the folder was trained, from its newest `checkpoint-*/trainer_state.json` (`hf-latentlm train`); the
    data are `datasets` (`--dataset`) when given."""
    states = sorted(folder.glob("checkpoint-*/trainer_state.json"))
    config = read_json_file(states[-1], str(folder)).get("config", {}) if states else {}
    if datasets:
        data = ", ".join(datasets)
    elif config.get("train_files"):
        data = f"{len(config['train_files'])} text file(s)"
    else:
        data = EMBEDDED_CORPUS
    if not config.get("preset"):
        if datasets:
            return f"on {data}"
        return f"not recorded in the folder (no `hf-latentlm train` checkpoint); `train` uses {data} by default"
    return (f"`hf-latentlm train --family {config.get('family', family)} --preset {config['preset']}` for "
            f"{config.get('max_steps')} steps on {data}")


def read_eval(path: Path, option: str) -> dict:
    """An `hf-latentlm eval` JSON; ValueError naming `option` when the file is not one."""
    if not path.is_file():
        raise FileNotFoundError(f"{option} {str(path)!r} does not exist")
    result = read_json_file(path, f"{option} {str(path)!r}")
    try:
        float(result["brier"]["brierlm_2"]["value"])
    except (TypeError, KeyError, ValueError) as err:
        raise ValueError(f"{option} {str(path)!r} is not the JSON written by `hf-latentlm eval` (no "
                         f"brier.brierlm_2.value)") from err
    return result


def eval_command(result: dict) -> str:
    """The `hf-latentlm eval` command line that the settings recorded in `result` correspond to."""
    brier = result["brier"]
    command = f"hf-latentlm eval --model {result.get('model', 'DIR')} --split {result.get('split', 'validation')}"
    if "num_positions" in brier:
        command += f" --num-positions {brier['num_positions']}"
    if "context_len" in brier:
        command += f" --context-len {brier['context_len']}"
    return command + (" --mauve" if "mauve" in result else "")


def metrics_of(result: dict) -> dict[str, tuple[str, float, dict | None]]:
    """metric key -> (display name, value, the Brier entry with its interval or None), for what `result` holds."""
    brier = result["brier"]
    metrics = {key: (name, float(brier[key]["value"]), brier[key])
               for key, name in (("brierlm_2", "BrierLM-2"), ("brier_1", "Brier-1"), ("brier_2", "Brier-2"))
               if key in brier}
    if "nll" in result:
        metrics["nll"] = ("NLL (nats/token)", float(result["nll"]["nll"]), None)
        metrics["perplexity"] = ("perplexity", float(result["nll"]["perplexity"]), None)
    if "mauve" in result:
        metrics["mauve"] = ("MAUVE", float(result["mauve"]["mauve"]), None)
    return metrics


def eval_results(result: dict):
    """The `model-index` entries (`EvalResult`s) of an `hf-latentlm eval` JSON."""
    from huggingface_hub import EvalResult

    return [EvalResult(task_type="text-generation", dataset_type="hf-latentlm-shakespeare",
                       dataset_name="Shakespeare (hf-latentlm embedded corpus)",
                       dataset_split=result.get("split", "validation"), metric_type=key, metric_name=name,
                       metric_value=round(value, 4))
            for key, (name, value, _) in metrics_of(result).items()]


def results_section(result: dict | None, baseline: dict | None) -> str:
    """A Markdown table of the model's metrics next to the AR baseline's (when given), with the commands."""
    if result is None and baseline is None:
        return ""
    if result is None:
        raise ValueError("--baseline-eval needs the model's own evaluation too (--eval-results, or "
                         f"{EVAL_RESULTS_FILE} in the model folder)")

    from .eval.bench import format_ci  # torch-heavy: imported only when a card has results

    def cell(value, entry):
        return f"{value:.4f}" if entry is None else format_ci(entry, 4)

    ours = metrics_of(result)
    intervals = "95% bootstrap intervals in brackets, ≈0: the interval contains 0"
    if baseline is None:
        lines = ["| metric | this model |", "|---|---|"]
        lines += [f"| {name} | {cell(value, entry)} |" for name, value, entry in ours.values()]
        lines += ["", f"Measured with `{eval_command(result)}` ({intervals})."]
        return "\n".join(lines)

    def settings(r):
        return {"split": r.get("split"), **{k: r["brier"].get(k) for k in ("num_positions", "context_len")}}

    if settings(result) != settings(baseline):
        raise ValueError(f"--baseline-eval was measured with other settings ({settings(baseline)}) than the model's "
                         f"evaluation ({settings(result)}): evaluate both the same way")
    theirs = metrics_of(baseline)
    lines = ["| metric | this model | AR baseline | ratio |", "|---|---|---|---|"]
    for key, (name, value, entry) in ours.items():
        if key not in theirs:
            continue
        _, base_value, base_entry = theirs[key]
        ratio = f"{value / base_value:.2f}" if base_value else "—"
        lines.append(f"| {name} | {cell(value, entry)} | {cell(base_value, base_entry)} | {ratio} |")
    lines += ["", f"Measured with ({intervals}):", "",
              f"- this model: `{eval_command(result)}`", f"- AR baseline: `{eval_command(baseline)}`"]
    return "\n".join(lines)


def post_training_origin(folder: Path, base_model: str | None) -> tuple[str | None, str]:
    """(the Hub repo id of the model `folder` was post-trained from, a description of the post-training), or
    (None, "") for a model that was not post-trained. `base_model` (`--base-model`) overrides the record."""
    record_path = folder / POST_TRAINING_RECORD
    record = read_json_file(record_path, f"--model {str(folder)!r}") if record_path.is_file() else None
    if record is None and base_model is None:
        return None, ""
    stage = "post-trained"
    if record is not None:
        lora = " with LoRA, merged" if record.get("lora") else ""
        task = f"the `{record['task']}` task" if record.get("task") else "a dataset of its own"
        rejections = " (rejected answers: the model's own wrong samples)" if record.get("policy_rejections") else ""
        started = (f"a {record['init_from']['family']} model started from its weights (`--init-from`), then "
                   if record.get("init_from") else "")
        stage = f"{started}{record['stage'].upper()}{lora} on {task}{rejections}"
    source = base_model or str(record["base_model"])
    if not is_hub_repo_id(source):
        if base_model is not None:
            raise ValueError(f"--base-model {base_model!r} is not a Hub repo id OWNER/NAME")
        raise ValueError(f"--model {str(folder)!r} was post-trained from the local folder {source!r}: pass "
                         f"--base-model OWNER/NAME, the Hub repository of that model (push it first)")
    return source, stage


def conversion_record(folder: Path) -> dict | None:
    """What `hf-latentlm convert` recorded about the official checkpoint the folder was converted from, or None."""
    path = folder / CONVERSION_RECORD
    return read_json_file(path, f"--model {str(folder)!r}") if path.is_file() else None


def converted_summary(record: dict) -> str:
    sources = ", ".join(f"`{value}`" for value in record["sources"].values() if value)
    return (f"none here: the authors' released checkpoint ({sources}; {record['repository']}, license "
            f"{record['license']}), converted by `hf-latentlm convert`")


def build_model_card(folder: Path, repo_id: str, license: str | None = None, revision: str | None = None,
                     eval_file: Path | None = None, baseline_file: Path | None = None,
                     base_model: str | None = None, datasets: list[str] | None = None):
    """The model card of the model in `folder` as `repo_id` (see model_cards/README.md)."""
    from huggingface_hub import ModelCard, ModelCardData

    folder = Path(folder)
    config = check_folder(folder)
    family = family_of(config)
    spec = get_family(family)
    card = spec.model_card or default_card(family, spec.model_class)
    if eval_file is None and (folder / EVAL_RESULTS_FILE).is_file():
        eval_file = folder / EVAL_RESULTS_FILE
    result = read_eval(Path(eval_file), "--eval-results") if eval_file is not None else None
    baseline = read_eval(Path(baseline_file), "--baseline-eval") if baseline_file is not None else None
    results = results_section(result, baseline)
    parameters = f"{count_parameters(folder) / 1e6:.2f}M"
    base, post_training = post_training_origin(folder, base_model)
    remote = bool(config.get("auto_map"))
    converted = conversion_record(folder)
    license = license or (converted["license"] if converted else "apache-2.0")
    data = ModelCardData(
        library_name="transformers", pipeline_tag="text-generation", license=license,
        tags=[family, "custom_code", "hf-latentlm"] if remote else [family, "hf-latentlm"],
        datasets=datasets or None, base_model=base,
        eval_results=eval_results(result) if result is not None else None,
        **({"model_name": repo_id.split("/")[-1]} if result is not None else {}),  # the model-index entry's name
        **({"base_model_relation": "finetune"} if base else {}))
    return ModelCard.from_template(
        data, template_str=CARD_TEMPLATE, model_name=repo_id.split("/")[-1], repo_id=repo_id, family=family,
        family_title=card.title, about=card.about, generate=card.generate, limitations=card.limitations,
        citation=card.citation, results=results, base_model=base, post_training=post_training,
        load_args=(f", revision={json.dumps(revision)}" if revision else "") + (", trust_remote_code=True" if remote
                                                                                 else ""),
        remote_code=remote, components=bool(spec.components),
        parameters=parameters,
        training=converted_summary(converted) if converted else training_summary(folder, family, datasets),
        cpu_scale=CONVERTED_SCALE.format(**converted) if converted else CPU_SCALE.format(parameters=parameters))


def repo_id_problem(repo_id: str) -> str | None:
    """Why `repo_id` is not a Hub model repository id OWNER/NAME, or None when it is one."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        return " ".join(str(err).split())
    return None if repo_id.count("/") == 1 else "expected OWNER/NAME"


def is_hub_repo_id(name: str) -> bool:
    """True for OWNER/NAME that is not also a local path (a post-training record holds whichever was loaded)."""
    return repo_id_problem(name) is None and not Path(name).exists()


def push_model(folder: str | Path, repo_id: str, private: bool = False, revision: str | None = None,
               license: str | None = None, commit_message: str | None = None, eval_file: str | Path | None = None,
               baseline_file: str | Path | None = None, base_model: str | None = None,
               datasets: list[str] | None = None) -> str:
    """Create `repo_id` (and branch `revision`) if needed and upload the model folder plus a model card in one
    commit; returns the commit URL. Everything that can be refused is refused before the first network call."""
    from huggingface_hub import CommitOperationAdd, HfApi, constants, get_token
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError, OfflineModeIsEnabled

    folder = Path(folder)
    problem = repo_id_problem(repo_id)
    if problem is not None:
        raise ValueError(f"bad --repo-id {repo_id!r}: {problem}")
    card = build_model_card(folder, repo_id, license, revision, eval_file, baseline_file, base_model, datasets)
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(folder / name))
                  for name in files_to_upload(folder)]
    operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=str(card).encode()))
    # The two causes huggingface_hub reports only as a network error, named here before the first call.
    if constants.is_offline_mode():  # what huggingface_hub's own requests check
        raise ValueError("push needs the network, and offline mode is on (HF_HUB_OFFLINE=1): unset HF_HUB_OFFLINE "
                         "to push")
    if get_token() is None:
        raise ValueError("push needs a Hugging Face token with write access, and none is set: run `hf auth login` "
                         "or set HF_TOKEN")
    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.create_commit(repo_id, operations=operations, revision=revision,
                                 commit_message=commit_message or "Upload model with hf-latentlm push")
    except (HfHubHTTPError, LocalTokenNotFoundError) as err:  # the CLI prints ValueErrors as one line
        raise ValueError(f"the Hub refused the push to {repo_id}: {err}") from err
    except OfflineModeIsEnabled as err:
        raise ValueError(f"push needs the network, and offline mode is on: {err}") from err
    except Exception as err:
        if not is_network_error(err):
            raise
        raise ValueError(f"cannot reach the Hub at {api.endpoint} to push {repo_id} ({type(err).__name__}: {err}): "
                         f"check the network (or HF_ENDPOINT)") from err
    return info.commit_url


def is_network_error(err: Exception) -> bool:
    """Whether `err` is a connection failure: an OSError, or a transport error of the HTTP client huggingface_hub
    uses (httpx, vendored as `httpx2` in some versions: matched by name, not imported)."""
    return isinstance(err, OSError) or any(cls.__name__ in ("TransportError", "ConnectError", "TimeoutException")
                                           for cls in type(err).__mro__)
