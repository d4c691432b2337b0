"""torch.compile: inference forwards compile in full graph and match eager; the parts of the training forwards that
run every step trace without graph breaks. Tiny models on CPU, so that compiling stays cheap."""

import os

import pytest
import torch

from hf_latentlm.modeling import CALMAutoencoder, CALMAutoencoderConfig, CALMConfig, CALMForCausalLM
from hf_latentlm.modeling import PLMConfig, PLMForCausalLM

BACKBONE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2)
# "aot_eager" runs everything torch.compile checks for us (dynamo's full-graph capture, which refuses any graph break
# with fullgraph=True, and AOT autograd's functional trace) without inductor's C++ code generation, which takes
# minutes on a 2-core CPU (a cold inductor compile of the tiny autoencoder alone took 32 s); inductor's kernels are
# torch's to test, not ours. Every test here also passes with HF_LATENTLM_COMPILE_BACKEND=inductor.
BACKEND = os.environ.get("HF_LATENTLM_COMPILE_BACKEND", "aot_eager")
AUTOENCODER = dict(vocab_size=64, chunk_size=4, hidden_size=32, intermediate_size=64, latent_size=8,
                   num_encoder_layers=1, num_decoder_layers=1)


def tiny(family: str, **overrides):
    torch.manual_seed(0)
    if family == "plm":
        return PLMForCausalLM(PLMConfig(**BACKBONE, block_size=4, k_pred=4, num_auxiliaries=32, auxiliary_top_m=8,
                                        **overrides))
    if family == "calm-ae":
        return CALMAutoencoder(CALMAutoencoderConfig(**AUTOENCODER))
    model = CALMForCausalLM(CALMConfig(**BACKBONE, chunk_size=4, autoencoder_config=CALMAutoencoderConfig(**AUTOENCODER)))
    with torch.no_grad():  # the energy head's last layer starts at zero: give it weights, or every sample is 0
        model.energy_head.out.weight.normal_(0.0, 0.2)
    return model


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def graph_breaks(fn, *args, **kwargs) -> list[str]:
    explained = torch._dynamo.explain(fn)(*args, **kwargs)
    return [reason.reason.splitlines()[0] for reason in explained.break_reasons]


@pytest.mark.parametrize("family,output", [("plm", "logits"), ("calm", "last_hidden_state"), ("calm-ae", "logits")])
def test_inference_forward_compiles_in_full_graph_and_matches_eager(family, output):
    model = tiny(family).eval()
    assert type(model)._can_compile_fullgraph
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    eager = getattr(model(input_ids=ids), output)
    compiled = torch.compile(model, fullgraph=True, backend=BACKEND)
    torch.testing.assert_close(getattr(compiled(input_ids=ids), output), eager, atol=1e-5, rtol=1e-5)
    # Eval mode is deterministic (the autoencoder decodes the posterior mean), so a second call agrees too.
    torch.testing.assert_close(getattr(compiled(input_ids=ids), output), eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("auxiliary_type", ["voronoi", "quantile"])
def test_plm_training_forward_has_no_graph_break(auxiliary_type):
    """Block layout from a tensor phase, auxiliary fit and draw, decoder forward, losses and logged parts."""
    model = tiny("plm", auxiliary_type=auxiliary_type).train()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    assert graph_breaks(model, input_ids=ids, labels=ids) == []
    layout = model.block_layout(12, torch.tensor(1))
    assert graph_breaks(model.decoder_objective, ids, ids, None, layout) == []


def test_plm_eval_objective_compiles_and_matches_eager():
    model = tiny("plm").eval()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    eager = model(input_ids=ids, labels=ids)
    compiled = torch.compile(model, fullgraph=True, backend=BACKEND)(input_ids=ids, labels=ids)
    for name in ("loss", "decoder_logits", "reconstructed_tokens", "mask_auxiliary_fraction"):
        torch.testing.assert_close(getattr(compiled, name), getattr(eager, name), atol=1e-5, rtol=1e-5, msg=name)


def test_calm_training_forwards_have_no_graph_break():
    model = tiny("calm").train()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, 4:8] = -100
    assert graph_breaks(model, input_ids=ids, labels=labels) == []
    autoencoder = tiny("calm-ae").train()
    assert graph_breaks(autoencoder, input_ids=ids, labels=ids) == []


def test_compiled_energy_loss_matches_eager():
    model = tiny("calm").train()
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 3, 32, generator=g)
    targets = torch.randint(0, 64, (2, 3, 4), generator=g)
    scored = torch.tensor([[True, False, True], [False, False, True]])
    targets[~scored] = -100
    noise = (torch.randn(2, 3, model.config.num_target_samples, 8, generator=g),
             torch.rand(2, 3, model.config.num_model_samples, model.config.noise_size, generator=g) - 0.5)
    eager = model.masked_energy_loss(hidden, targets, scored, *noise)
    compiled = torch.compile(model.masked_energy_loss, fullgraph=True, backend=BACKEND)
    compiled = compiled(hidden, targets, scored, *noise)
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
