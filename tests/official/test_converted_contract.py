"""The family contract (tests/family_contract.py) held against a converted official CALM and Cola DLM (the
vocab-4096 official-format fixtures, converted and loaded back from their folders). Cola's DiT attention runs in
float32 here: the contract compares padded batches with rows alone, which bf16 autocast rounds alike only on some
CPUs' kernels (test_cola_official.py holds the bf16 form to the official outputs)."""

import inspect

import pytest
from official_checkpoints import convert_calm_fixture, convert_cola_fixture

import family_contract as contract
from hf_latentlm.modeling.modeling_calm import CALMForCausalLM
from hf_latentlm.modeling.modeling_cola import ColaForCausalLM

CONTRACT = {name.removeprefix("check_"): check for name, check in vars(contract).items()
            if name.startswith("check_") and "family" not in inspect.signature(check).parameters}
CONVERTERS = {"calm": (convert_calm_fixture, CALMForCausalLM), "cola": (convert_cola_fixture, ColaForCausalLM)}


@pytest.fixture(scope="module", params=sorted(CONVERTERS))
def converted(request, tmp_path_factory):
    convert, model_class = CONVERTERS[request.param]
    folder = convert(tmp_path_factory.mktemp("converted") / request.param)
    float32_attention = {"attention_dtype": None} if request.param == "cola" else {}
    return model_class.from_pretrained(folder, **float32_attention).eval()


@pytest.mark.parametrize("check", sorted(CONTRACT))
def test_converted_model_passes_the_family_contract(check, converted, request):
    arguments = {}
    for name in inspect.signature(CONTRACT[check]).parameters:
        arguments[name] = converted if name == "model" else request.getfixturevalue(
            {"rows": "tiny_rows"}.get(name, name))
    CONTRACT[check](**arguments)
