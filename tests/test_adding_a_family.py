"""docs/adding_a_family.md, followed for a throwaway toy family: its two files (tests/toy_family/) dropped next to
the package's modeling files, one `register_family` call, and nothing else edited. The toy then trains, generates
and evaluates through the CLI, loads elsewhere without the package, passes the family contract, is pushed to a
(loopback) Hub with a model card, and is post-trained with `sft` and then `dpo`."""

import contextlib
import importlib
import io
import json
import shutil
import sys
from pathlib import Path

import pytest
from huggingface_hub import ModelCard, constants

import family_contract as contract
from fake_hub import fake_hub  # noqa: F401  (a fixture)
from hf_latentlm import families

MODELING = Path(families.__file__).parent / "modeling"
TOY_FILES = Path(__file__).parent / "toy_family"


@pytest.fixture(scope="module")
def toy_family(tmp_path_factory):
    # Step 1-2 of the guide: the family's configuration and modeling files, flat beside the shared modeling files
    # (a copy of hf_latentlm/modeling, so that the package itself is not touched).
    folder = tmp_path_factory.mktemp("pkg") / "toy_modeling"
    folder.mkdir()
    for path in [*MODELING.glob("*.py"), *TOY_FILES.glob("*.py")]:
        if path.name != "__init__.py":
            shutil.copy(path, folder / path.name)
    (folder / "__init__.py").write_text("")
    sys.path.insert(0, str(folder.parent))
    config_module = importlib.import_module("toy_modeling.configuration_toy")
    modeling_module = importlib.import_module("toy_modeling.modeling_toy")

    # Step 3: the one registry entry.
    def build_toy(preset, tokenizer, **overrides):
        config = config_module.ToyConfig(**{**families.backbone_config_kwargs(preset, tokenizer), **overrides})
        return modeling_module.ToyForCausalLM(config)

    families.register_family(families.FamilySpec(
        name="toy", build=build_toy, config_class=config_module.ToyConfig,
        model_class=modeling_module.ToyForCausalLM, preset_overrides={"tiny": {"tokens_per_call": 3}}))
    yield "toy"
    families.FAMILIES.pop("toy")
    sys.path.remove(str(folder.parent))


@pytest.fixture(scope="module")
def toy(toy_family, tokenizer):
    return contract.build_tiny(toy_family, tokenizer).eval()


def test_the_registry_builds_the_toy_with_its_preset_settings(toy):
    assert toy.config.model_type == "toy" and toy.config.tokens_per_call == 3
    assert toy.config.hidden_size == 64  # the tiny preset's backbone


def test_toy_passes_the_generation_contract(toy, tiny_rows, tokenizer, left_pad, streamer):
    contract.check_batched_rows_match_running_each_alone(toy, tiny_rows, tokenizer, left_pad)
    contract.check_eos_stops_a_row_and_pads_it(toy, tiny_rows, tokenizer)
    contract.check_streamer_receives_prompt_then_every_new_token(toy, tiny_rows, streamer)
    contract.check_lengths_follow_transformers_defaults(toy, tiny_rows)
    contract.check_bad_input_is_named(toy, tiny_rows)
    contract.check_harness_counts_model_calls(toy, tiny_rows)


def test_toy_checkpoint_loads_without_the_package(toy, tokenizer, tmp_path, isolated_generate):
    contract.check_checkpoint_loads_without_the_package(toy, tokenizer, tmp_path, isolated_generate)


@pytest.fixture(scope="module")
def trained_toy(toy_family, tmp_path_factory):
    """The toy trained, generated from and evaluated through the CLI (its folder), once for the tests below."""
    from hf_latentlm.cli import main

    def run_cli(*argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(argv))
        return code, out.getvalue(), err.getvalue()

    folder = tmp_path_factory.mktemp("toy-run")
    contract.check_cli_round_trip(toy_family, folder, run_cli)
    code, stdout, err = run_cli("eval", "--model", str(folder / "toy"), "--num-positions", "16", "--batch-size", "16",
                                "--context-len", "32")  # inside the tiny rows it was trained at
    assert code == 0, err
    result = json.loads(stdout)
    assert result["brier"]["num_positions"] == 16 and -1 <= result["brier"]["brier_1"]["value"] <= 1
    return folder / "toy"


def test_toy_trains_generates_and_evaluates_through_the_cli(trained_toy):
    assert (trained_toy / "config.json").is_file() and (trained_toy / "modeling_toy.py").is_file()


def test_toy_is_pushed_with_a_card_of_its_own(trained_toy, fake_hub, run_cli, monkeypatch):
    """No card text was written for the toy: the registry entry names none, so the card comes from its class."""
    endpoint, hub = fake_hub
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "is_offline_mode", lambda: False)
    monkeypatch.setenv("HF_TOKEN", "hf_dummy_token_for_tests")
    code, stdout, err = run_cli("push", "--model", str(trained_toy), "--repo-id", "someone/tiny-toy")
    assert code == 0, err
    assert "/commit/" in stdout
    files = hub.repos["someone/tiny-toy"]["main"]
    assert files["model.safetensors"] == (trained_toy / "model.safetensors").read_bytes()
    assert {"modeling_toy.py", "configuration_toy.py", "config.json", "tokenizer.json"} <= set(files)
    card = ModelCard(files["README.md"].decode())
    assert card.data.tags[0] == "toy" and "ToyForCausalLM" in card.text and "trust_remote_code=True" in card.text


def test_toy_is_post_trained_with_sft_then_dpo(trained_toy, tmp_path, run_cli):
    """`sft` trains the toy's own objective; `dpo` scores it with the token-likelihood scorer (the toy has logits and
    its registry entry names no scorer). Both write a loadable checkpoint whose weights moved."""
    from safetensors.torch import load_file

    common = ["--max-steps", "2", "--batch-size", "2", "--train-size", "4", "--learning-rate", "1e-2"]
    outputs = {"sft": tmp_path / "sft", "dpo": tmp_path / "dpo"}
    start = trained_toy
    for stage, folder in outputs.items():
        code, stdout, err = run_cli(stage, "--model", str(start), "--output-dir", str(folder), *common)
        assert code == 0, err
        summary = json.loads(stdout.strip().splitlines()[-1])
        assert summary["family"] == "toy" and summary["steps"] == 2 and summary["finite"], summary
        before, after = load_file(start / "model.safetensors"), load_file(folder / "model.safetensors")
        assert any(not (before[name] == after[name]).all() for name in before), f"{stage} trained nothing"
        start = folder
    code, stdout, err = run_cli("generate", "--model", str(outputs["dpo"]), "--prompt", "HAMLET.\n",
                                "--max-new-tokens", "6")
    assert code == 0 and stdout.startswith("HAMLET.\n"), err
