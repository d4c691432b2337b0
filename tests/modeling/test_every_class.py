"""Every class of every family (components and base models included), held to transformers' structural checks:
tensor-parallel plans (`test_tp_plan_matches_params`, `test_tied_weights_are_sharded_together`: every rule names a
parameter or module that exists, a tied head is sharded with its embedding, AURORA's embedding, which its decoder
also reads out through, never split by vocabulary) and initialisation (a meta-device build, as `from_pretrained`
makes, followed by `init_weights()` is a fresh model: every parameter and buffer set, none left as memory)."""

import pytest
import torch
from transformers.distributed.parallel_utils import _get_parameter_plan

from family_contract import build_tiny
from hf_latentlm.families import FAMILIES
from hf_latentlm.modeling.layers import DecoderBlock


def every_class(tokenizer):
    """(label, model) for each registered family's model and, where it has one, its base model (`AutoModel`)."""
    for family in sorted(name for name in FAMILIES if name != "ar"):
        model = build_tiny(family, tokenizer)
        yield family, model
        if model.base_model is not model:
            yield f"{family} base", model.base_model


@pytest.fixture(scope="module")
def models(tokenizer):
    return list(every_class(tokenizer))


def test_every_rule_names_a_parameter_or_module(models):
    seen = 0
    for label, model in models:
        params = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
        modules = {name for name, _ in model.named_modules()}
        unused = [rule for rule in model.tp_plan
                  if not any(_get_parameter_plan(p, {rule: "x"}, is_weight=True) for p in params)
                  and not any(_get_parameter_plan(m, {rule: "x"}, is_weight=False) for m in modules)]
        assert not unused, (label, unused)
        seen += bool(model.tp_plan)
    assert seen >= 10  # every class with a backbone config has a plan (CALM's MLP autoencoder has none)


def test_tied_weights_are_sharded_together(models):
    for label, model in models:
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
        if not isinstance(head, torch.nn.Linear):
            continue
        names = {module: name for name, module in model.named_modules()}
        if f"{names[head]}.weight" in (model._tied_weights_keys or {}):
            assert (names[head] in model.tp_plan) == (names[embedding] in model.tp_plan), label
            assert model.tp_plan[names[head]] == "colwise_gather_output", label


def test_every_trained_decoder_block_is_sharded_and_aurora_reads_out_through_a_whole_embedding(models):
    """Each trained block list is in the plan (the EMA copy with the denoiser it follows); only Cola's frozen
    reference encoder stays replicated (it is its own module, never mixed with the VAE's)."""
    for label, model in models:
        for name, module in model.named_modules():
            if isinstance(module, DecoderBlock) and "reference_encoder" not in name:
                assert _get_parameter_plan(f"{name}.self_attn.q_proj.weight", model.tp_plan) == "colwise", (label, name)
                assert _get_parameter_plan(f"{name}.mlp.down_proj.weight", model.tp_plan) == "rowwise", (label, name)
        if label.startswith("aurora"):
            embedding = {module: name for name, module in model.named_modules()}[model.get_input_embeddings()]
            assert model.tp_plan.get(embedding) == "replicate", label


def test_a_meta_device_build_initialises_every_parameter_and_buffer(models):
    """Filled with NaN (floats) and 7 (integers) before `init_weights()`, nothing may keep that: every tensor is
    finite, and each that a normal build sets to a constant (zero queries, unset latent statistics, step counts,
    norm scales, zero-initialised heads) has exactly that constant. AURORA's EMA copy starts as its denoiser."""
    checked = 0
    for label, fresh in models:
        with torch.device("meta"):
            model = type(fresh)(fresh.config)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for tensor in list(model.parameters()) + list(model.buffers()):
                tensor.fill_(float("nan") if tensor.is_floating_point() else 7)
        model.init_weights()
        built = type(fresh)(fresh.config)  # the class's own init (build_tiny randomises zero-initialised matrices)
        expected = dict(list(built.named_parameters()) + list(built.named_buffers()))
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            want = expected[name]
            assert not tensor.is_floating_point() or torch.isfinite(tensor).all(), (label, name)
            if want.numel() and bool((want == want.flatten()[0]).all()):
                assert torch.equal(tensor, want), (label, name)
            checked += 1
        if getattr(model, "ema_denoiser", None) is not None:
            for ema, online in zip(model.ema_denoiser.parameters(), model.model.denoiser.parameters()):
                assert torch.equal(ema, online), label
    assert checked > 100
