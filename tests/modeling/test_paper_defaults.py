"""The constants the four papers (and the project's documented choices, /work/shared/notes/method-specs.md and
calm-supplement.md) fix, as the configs' defaults: a default changed by accident would otherwise pass every test
that sets its own value. Configs only, no model is built."""

import pytest

from hf_latentlm.modeling.configuration_aurora import AuroraAutoencoderConfig, AuroraConfig
from hf_latentlm.modeling.configuration_calm import CALMAutoencoderConfig, CALMConfig
from hf_latentlm.modeling.configuration_cola import ColaConfig, ColaVAEConfig
from hf_latentlm.modeling.configuration_plm import PLMConfig


def test_aurora_defaults_are_the_papers():
    ae = AuroraAutoencoderConfig()
    assert (ae.keep_ratio, ae.token_dropout, ae.latent_dropout, ae.statistics_eps) == (1.0, 0.3, 0.6, 1e-6)
    cfg = AuroraConfig()
    assert cfg.block_size == 16 and cfg.noisy_input_rank == 128 and cfg.loss_space == "x0"
    assert cfg.time_sampler == "tan" and cfg.time_sampler_kwargs() == {"shift": 7.0}  # tan-d, d = 7
    assert cfg.self_condition_prob == 0.6 and cfg.self_condition_guidance == 4.0
    assert (cfg.consistency_weight, cfg.consistency_warmup_steps, cfg.consistency_steps, cfg.ema_decay) == (
        1.0, 10000, 16, 0.9999)
    assert cfg.cfg_scale == 2.0 and cfg.cfg_min_sigma == 0.9 and cfg.num_inference_steps == 16


def test_cola_defaults_are_the_papers_and_the_reference_codes():
    vae = ColaVAEConfig()
    assert (vae.latent_size, vae.vae_block_size, vae.logsnr_init) == (16, 4, 1.5)
    cfg = ColaConfig()
    assert cfg.block_size == 16 and cfg.time_sampler == "logit_normal"
    assert cfg.time_sampler_kwargs() == {"loc": 1.0, "scale": 1.0}  # LogitNormal(1, 1)
    assert (cfg.cfg_scale, cfg.num_inference_steps, cfg.ode_solver) == (7.0, 16, "euler")
    assert (cfg.prompt_block_prob, cfg.history_dropout) == (0.05, 0.1)


def test_calm_defaults_are_the_reference_implementations():
    ae = CALMAutoencoderConfig()
    assert (ae.chunk_size, ae.latent_size, ae.hidden_size, ae.intermediate_size) == (4, 128, 512, 1280)
    assert (ae.num_encoder_layers, ae.num_decoder_layers) == (2, 2)
    assert (ae.kl_weight, ae.kl_clamp, ae.token_replace_prob, ae.latent_dropout) == (1e-3, 0.5, 0.15, 0.15)
    cfg = CALMConfig(num_hidden_layers=16)
    assert (cfg.chunk_size, cfg.noise_size, cfg.num_model_samples, cfg.num_target_samples) == (4, 64, 8, 100)
    assert cfg.num_head_blocks == 4 and cfg.temperature_pool_size == 200  # ⌈16 / 4⌉ head blocks
    assert CALMConfig(num_hidden_layers=6).num_head_blocks == 2


@pytest.mark.parametrize("layers,decoder,encoder", [(7, 2, 3), (12, 4, 6)])
def test_plm_defaults_are_the_papers(layers, decoder, encoder):
    cfg = PLMConfig(num_hidden_layers=layers)
    assert (cfg.num_auxiliaries, cfg.auxiliary_top_m, cfg.auxiliary_type) == (512, 128, "voronoi")
    assert cfg.alignment_weight == 5.0
    assert (cfg.alignment_decoder_layer, cfg.alignment_encoder_layer) == (decoder, encoder)  # ⌊L/3⌋, ⌊L/2⌋
    assert (cfg.acceptance_epsilon, cfg.acceptance_nucleus) == (2e-3, 0.94)
    assert cfg.block_stride == cfg.block_size  # β = 1 unless asked
