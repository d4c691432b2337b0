"""Every multi-token language-model family of the registry, held to one contract: each `check_*` function of
tests/family_contract.py runs for each family (batched == alone, EOS and min_new_tokens, streamer, transformers'
length defaults, bad input named, the harness's call counting, a checkpoint that loads without the package, the CLI
round trip, and the transformers contract: hidden states and attentions, return_dict, past_key_values, backbones on
input_ids, unknown arguments). A new check or a new registered family needs no edit here."""

import inspect

import pytest

import family_contract as contract

FAMILY_NAMES = contract.multi_token_families()
CHECKS = {name.removeprefix("check_"): check for name, check in vars(contract).items() if name.startswith("check_")}
FIXTURE_FOR_PARAMETER = {"rows": "tiny_rows"}  # a check's parameter name -> the pytest fixture that provides it


def test_the_registry_has_multi_token_families():
    assert {"plm", "calm"} <= set(FAMILY_NAMES)


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def model(family, tokenizer):
    return contract.build_tiny(family, tokenizer).eval()


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_family_contract(check, family, model, request):
    arguments = {}
    for name in inspect.signature(CHECKS[check]).parameters:
        if name == "family":
            arguments[name] = family
        elif name == "model":
            arguments[name] = model
        else:
            arguments[name] = request.getfixturevalue(FIXTURE_FOR_PARAMETER.get(name, name))
    CHECKS[check](**arguments)
