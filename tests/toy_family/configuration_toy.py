"""A throwaway family, written by following docs/adding_a_family.md (step 1: the configuration file)."""

from .configuration_backbone import BackboneConfig, check_positive


class ToyConfig(BackboneConfig):
    r"""A context-free model that predicts the next `tokens_per_call` tokens from the last one.

    Args:
        tokens_per_call (`int`, 2): tokens drawn per network call. Backbone fields: see `BackboneConfig`.
    """

    model_type = "toy"

    def __init__(self, tokens_per_call: int = 2, **kwargs):
        self.tokens_per_call = tokens_per_call
        super().__init__(**kwargs)
        check_positive(self, ("tokens_per_call",))
