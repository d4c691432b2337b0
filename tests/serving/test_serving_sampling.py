"""Request sampling fields -> generate() options: refusals carry the family's own message (the one its generate()
raises), equal resolved options share a batch key, and the AR path's per-row sampler draws from the right law."""

import pytest
import torch

from family_contract import build_tiny
from hf_latentlm.serving.protocol import OpenAIError
from hf_latentlm.serving.sampling import resolve_sampling


@pytest.fixture(scope="module")
def models(tokenizer):
    return {family: build_tiny(family, tokenizer).eval() for family in ("ar", "plm", "calm", "cola")}


def refusal(model, **fields) -> OpenAIError:
    extra = {k: v for k, v in fields.items() if k not in ("temperature", "top_p")}
    with pytest.raises(OpenAIError) as err:
        resolve_sampling(model, fields.get("temperature"), fields.get("top_p"), 0, extra)
    assert err.value.status == 400 and err.value.body()["error"]["type"] == "invalid_request_error"
    return err.value


def generate_error(model, **options) -> str:
    with pytest.raises(ValueError) as err:
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, **options)
    return str(err.value)


@pytest.mark.parametrize("family, fields", [
    ("plm", {"temperature": 0.5}), ("plm", {"top_p": 0.9}), ("calm", {"temperature": 1.5}),
    ("cola", {"top_p": 0.5}), ("cola", {"num_inference_steps": 0}), ("cola", {"ode_solver": "rk4"}),
])
def test_a_family_refusal_is_a_400_with_the_message_its_generate_raises(models, family, fields):
    err = refusal(models[family], **fields)
    assert err.message == generate_error(models[family], **fields)
    assert err.param == next(iter(fields))


@pytest.mark.parametrize("family", ["plm", "cola"])
def test_temperature_zero_is_greedy(models, family):
    assert resolve_sampling(models[family], 0, None, 0, {}).options == {"do_sample": False}


def test_openai_ranges_and_unknown_fields_are_refused_by_name(models):
    assert refusal(models["ar"], temperature=2.5).param == "temperature"
    assert refusal(models["ar"], top_p=0.0).param == "top_p"
    assert refusal(models["cola"], guidance=2.0).param == "guidance"
    assert refusal(models["ar"], num_inference_steps=2).param == "num_inference_steps"
    assert refusal(models["plm"], auxiliary_seeds=[1]).param == "auxiliary_seeds"  # the server sets it from seed
    with pytest.raises(OpenAIError) as err:
        resolve_sampling(models["ar"], None, None, -1, {})
    assert err.value.param == "seed"


def test_rows_share_a_batch_key_exactly_when_their_resolved_options_are_equal(models):
    cola = models["cola"]
    key = lambda temperature=None, **extra: resolve_sampling(cola, temperature, None, 1, extra).batch_key
    default_steps = cola.config.num_inference_steps
    assert key() == key(num_inference_steps=default_steps) == key(timestep_shift=1.0)
    assert key() != key(num_inference_steps=default_steps + 1)
    assert key(temperature=0.5) == key(temperature=0.5, num_inference_steps=default_steps) != key()
    # seeds never split a batch; the AR path batches any temperatures (each row samples at its own)
    assert resolve_sampling(cola, None, None, 1, {}).batch_key == resolve_sampling(cola, None, None, 2, {}).batch_key
    ar = models["ar"]
    assert resolve_sampling(ar, 0.3, 0.9, 1, {}).batch_key == resolve_sampling(ar, None, None, 2, {}).batch_key
    assert resolve_sampling(ar, None, None, 1, {}).temperature == 1.0  # OpenAI's default (greedy config)
