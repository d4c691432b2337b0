"""The fields Cola DLM and AURORA-LM share (`BlockLatentConfig`): one spelling per option, the old one accepted."""

import json

import pytest

from hf_latentlm.modeling import AuroraConfig, ColaConfig
from hf_latentlm.modeling.modeling_aurora import AuroraGenerationOptions
from hf_latentlm.modeling.modeling_cola import ColaGenerationOptions

FAMILIES = [(ColaConfig, ColaGenerationOptions), (AuroraConfig, AuroraGenerationOptions)]


@pytest.mark.parametrize("config_class,options_class", FAMILIES)
def test_num_inference_steps_is_the_config_field_generate_defaults_to(config_class, options_class):
    config = config_class(num_inference_steps=5)
    saved = config.to_dict()
    assert saved["num_inference_steps"] == 5 and "num_ode_steps" not in saved
    assert options_class().resolved(config, batch_size=1).num_inference_steps == 5
    assert options_class(num_inference_steps=2).resolved(config, batch_size=1).num_inference_steps == 2
    assert config_class().num_inference_steps == 16


@pytest.mark.parametrize("config_class,options_class", FAMILIES)
def test_num_ode_steps_is_a_deprecated_alias_in_code_and_in_old_config_files(tmp_path, config_class, options_class):
    with pytest.warns(FutureWarning, match="num_ode_steps is deprecated; use num_inference_steps"):
        assert config_class(num_ode_steps=3).num_inference_steps == 3
    # A config.json written before the rename.
    old = config_class().to_dict()
    old["num_ode_steps"] = old.pop("num_inference_steps") - 9
    (tmp_path / "config.json").write_text(json.dumps(old))
    with pytest.warns(FutureWarning, match="num_ode_steps"):
        loaded = config_class.from_pretrained(tmp_path)
    assert loaded.num_inference_steps == 7 and "num_ode_steps" not in loaded.to_dict()
    assert options_class().resolved(loaded, batch_size=1).num_inference_steps == 7
    with pytest.warns(FutureWarning):
        loaded.num_ode_steps = 4  # read and written through the new field
    assert loaded.num_inference_steps == 4
    with pytest.warns(FutureWarning):
        assert loaded.num_ode_steps == 4


def test_both_spellings_with_different_values_are_refused():
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="give num_inference_steps only"):
        ColaConfig(num_ode_steps=3, num_inference_steps=8)
