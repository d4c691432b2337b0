"""The private TRL methods the latent trainers still override, pinned to TRL's signatures.

TRL offers no public hook for these (the family's own rollouts, its log-likelihood, the precomputed draws and the
dataset columns that carry them), so an override silently stops working when TRL renames a method, changes its
parameters or stops calling it. Each case fails with a message naming the method.
"""

import inspect

import pytest
import transformers.trainer
from trl import DPOTrainer, GRPOTrainer
from trl.trainer import dpo_trainer, grpo_trainer

from hf_latentlm.training.grpo import LatentGRPOTrainer
from hf_latentlm.training.post_training import LatentDPOTrainer

#: (our trainer, TRL's trainer, the module whose code calls the method, method, the leading parameters (after self)
#: the override is written against).
PRIVATE_OVERRIDES = [
    (LatentGRPOTrainer, GRPOTrainer, grpo_trainer, "_generate_single_turn",
     ["prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"]),
    (LatentGRPOTrainer, GRPOTrainer, grpo_trainer, "_generate_and_score_completions", ["inputs"]),
    (LatentGRPOTrainer, GRPOTrainer, grpo_trainer, "_get_per_token_logps_and_entropies",
     ["model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy", "compute_aux_loss"]),
    (LatentDPOTrainer, DPOTrainer, dpo_trainer, "_precompute_ref_logps", ["dataset", "name", "batch_size"]),
    (LatentDPOTrainer, DPOTrainer, transformers.trainer, "_set_signature_columns_if_needed", []),
]


def parameters(function) -> list[str]:
    return [name for name in inspect.signature(function).parameters if name != "self"]


@pytest.mark.parametrize(("ours", "base", "caller", "method", "expected"), PRIVATE_OVERRIDES,
                         ids=[case[3] for case in PRIVATE_OVERRIDES])
def test_each_private_override_matches_trls_method(ours, base, caller, method, expected):
    where = f"{base.__name__}.{method}"
    assert method in vars(ours), f"{ours.__name__} no longer overrides {method}: drop it from this list"
    assert hasattr(base, method), f"TRL has no {where} any more: {ours.__name__}.{method} overrides nothing"
    trl = parameters(getattr(base, method))
    assert trl[:len(expected)] == expected, (f"TRL's {where} now takes {trl}; {ours.__name__}.{method} is written "
                                             f"against {expected}: update the override")
    try:  # every call TRL can make binds to the override
        inspect.signature(getattr(ours, method)).bind(None, **dict.fromkeys(trl))
    except TypeError as error:
        pytest.fail(f"{ours.__name__}.{method} cannot take TRL's parameters {trl} of {where}: {error}")
    assert f".{method}(" in inspect.getsource(caller), (f"{caller.__name__} no longer calls {method}: the "
                                                        f"{ours.__name__} override is dead")
