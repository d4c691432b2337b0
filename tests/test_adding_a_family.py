"""docs/adding_a_family.md, followed for a throwaway toy family: its two files (tests/toy_family/) dropped next to
the package's modeling files, one `register_family` call, and nothing else edited. The toy then trains, generates
and evaluates through the CLI, loads elsewhere without the package, and passes the family contract."""

import importlib
import json
import shutil
import sys
from pathlib import Path

import pytest

import family_contract as contract
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


def test_toy_trains_generates_and_evaluates_through_the_cli(toy_family, tmp_path, run_cli):
    contract.check_cli_round_trip(toy_family, tmp_path, run_cli)
    code, stdout, err = run_cli("eval", "--model", str(tmp_path / "toy"), "--num-positions", "16", "--batch-size", "16")
    assert code == 0, err
    result = json.loads(stdout)
    assert result["brier"]["num_positions"] == 16 and -1 <= result["brier"]["brier_1"]["value"] <= 1
