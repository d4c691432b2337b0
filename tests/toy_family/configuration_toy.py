"""A throwaway family, written by following docs/adding_a_family.md (step 1: the configuration file)."""

from huggingface_hub.dataclasses import strict

from .configuration_backbone import BackboneConfig, check_positive


@strict
class ToyConfig(BackboneConfig):
    r"""A context-free model that predicts the next `tokens_per_call` tokens from the last one."""

    model_type = "toy"

    tokens_per_call: int = 2  # tokens drawn per network call

    def validate_architecture(self) -> None:
        super().validate_architecture()
        check_positive(self, ("tokens_per_call",))
