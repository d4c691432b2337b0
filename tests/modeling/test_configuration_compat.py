"""Every family's config.json as the previous configuration classes wrote it (fixtures/configs/<family>.json, a tiny
model of each family) loads into the current classes with the same values, by class and through AutoConfig, and
still builds the family's model."""

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoConfig

from hf_latentlm.families import FAMILIES

FIXTURES = Path(__file__).parent / "fixtures" / "configs"
SAVED = sorted(path.stem for path in FIXTURES.glob("*.json"))


def saved_folder(family: str, tmp_path: Path) -> tuple[Path, dict]:
    shutil.copy(FIXTURES / f"{family}.json", tmp_path / "config.json")
    return tmp_path, json.loads((FIXTURES / f"{family}.json").read_text())


def assert_same_values(saved: dict, loaded: dict, where: str = "") -> None:
    for key, value in saved.items():
        if key == "transformers_version":
            continue
        assert key in loaded, f"{where}{key} is lost"
        if isinstance(value, dict) and isinstance(loaded[key], dict):
            assert_same_values(value, {str(k): v for k, v in loaded[key].items()}, f"{where}{key}.")
        else:
            assert loaded[key] == value, f"{where}{key}: saved {value!r}, read back {loaded[key]!r}"


def test_every_family_but_the_baseline_has_a_saved_config():
    assert SAVED == sorted(name for name in FAMILIES if name != "ar")


@pytest.mark.parametrize("family", SAVED)
def test_saved_config_loads_with_the_same_values(family, tmp_path):
    folder, saved = saved_folder(family, tmp_path)
    spec = FAMILIES[family]
    loaded = spec.config_class.from_pretrained(folder)
    assert type(loaded) is spec.config_class
    assert_same_values(saved, json.loads(loaded.to_json_string(use_diff=False)))
    for name in getattr(loaded, "sub_configs", {}):
        assert type(getattr(loaded, name)) is spec.config_class.sub_configs[name]  # the nested dict became a config
    again = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    assert type(again) is spec.config_class
    assert {**again.to_dict(), "_name_or_path": ""} == {**loaded.to_dict(), "_name_or_path": ""}
    assert type(spec.model_class(loaded)).__name__ == saved["architectures"][0]


@pytest.mark.parametrize("family", ["calm", "cola", "aurora", "plm"])
def test_saved_config_round_trips_through_the_current_classes(family, tmp_path):
    folder, _ = saved_folder(family, tmp_path)
    config_class = FAMILIES[family].config_class
    loaded = config_class.from_pretrained(folder)
    loaded.save_pretrained(tmp_path / "again")
    assert config_class.from_pretrained(tmp_path / "again").to_dict() == loaded.to_dict()
