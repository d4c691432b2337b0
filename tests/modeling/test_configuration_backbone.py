"""Config plumbing every family shares (configuration_backbone.py): RoPE in transformers' format, checked against
transformers' own Llama rotary embedding; attn_implementation reaching sub-configs; the tensor-parallel plan."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from hf_latentlm.modeling import CALMConfig, PLMConfig
from hf_latentlm.modeling.layers import RotaryEmbedding

SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


@pytest.mark.parametrize("rope_parameters", [
    None,
    {"rope_type": "default", "rope_theta": 500.0},
    {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0, "original_max_position_embeddings": 128},
    {"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_rope_matches_transformers_llama(rope_parameters):
    ours = PLMConfig(**SMALL, rope_parameters=rope_parameters, block_size=4, k_pred=4, auxiliary_top_m=32,
                     num_auxiliaries=64)
    llama = LlamaConfig(**SMALL, rope_parameters=rope_parameters)
    positions = torch.arange(0, 200, 7)[None]
    cos, sin = RotaryEmbedding.from_config(ours)(positions)
    ref_cos, ref_sin = LlamaRotaryEmbedding(llama)(torch.zeros(1, dtype=torch.float32), positions)
    torch.testing.assert_close(cos, ref_cos, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sin, ref_sin, atol=1e-5, rtol=1e-5)


def test_linear_scaling_divides_positions():
    config = PLMConfig(**SMALL, rope_parameters={"rope_type": "linear", "factor": 4.0}, block_size=4, k_pred=4,
                       auxiliary_top_m=32, num_auxiliaries=64)
    scaled = RotaryEmbedding.from_config(config)(torch.tensor([[0, 4, 8, 40]]))
    plain = RotaryEmbedding(config.head_dim)(torch.tensor([[0, 1, 2, 10]]))
    torch.testing.assert_close(scaled, plain)


def test_rope_parameters_round_trip_and_old_names(tmp_path):
    config = PLMConfig(**SMALL, rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_theta=500.0, block_size=4,
                       k_pred=4, auxiliary_top_m=32, num_auxiliaries=64)
    assert config.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}
    config.save_pretrained(tmp_path)
    again = PLMConfig.from_pretrained(tmp_path)
    assert again.rope_parameters == config.rope_parameters and again.rope_theta == 500.0
    assert PLMConfig(**SMALL, block_size=4, k_pred=4, auxiliary_top_m=32,
                     num_auxiliaries=64).rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}


def test_sequence_dependent_rope_is_refused_by_name():
    with pytest.raises(ValueError, match="rope_type.*'dynamic'"):
        PLMConfig(**SMALL, rope_parameters={"rope_type": "dynamic", "factor": 2.0}, block_size=4, k_pred=4,
                  auxiliary_top_m=32, num_auxiliaries=64)
    # Set after the config's checks (as transformers' RoPE tests do), the model refuses it instead of ignoring it.
    from hf_latentlm.modeling.modeling_plm import PLMModel

    config = PLMConfig(**SMALL, block_size=4, k_pred=4, auxiliary_top_m=32, num_auxiliaries=64)
    config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not supported"):
        PLMModel(config)


def test_attn_implementation_reaches_the_embedded_autoencoder_config():
    config = CALMConfig(vocab_size=512, attn_implementation="eager")
    assert config._attn_implementation == "eager" and config.autoencoder_config._attn_implementation == "eager"
    config._attn_implementation = "sdpa"
    assert config.autoencoder_config._attn_implementation == "sdpa"


def test_backbone_configs_carry_a_tensor_parallel_plan():
    plan = PLMConfig(**SMALL, block_size=4, k_pred=4, auxiliary_top_m=32, num_auxiliaries=64).base_model_tp_plan
    assert plan["layers.*.self_attn.q_proj"] == "colwise" and plan["layers.*.mlp.down_proj"] == "rowwise"
