"""The configuration fields every block-latent family (Cola DLM, AURORA-LM) shares: a trained text component with one
latent per token (embedded as a sub-config) and a prior that denoises blocks of `block_size` latents, bidirectional
inside a block and causal across blocks."""

import warnings

from huggingface_hub.dataclasses import strict

from .configuration_backbone import BackboneConfig, check_fraction, check_non_negative, check_positive

TIME_SAMPLERS = ("logit_normal", "shifted", "uniform")


@strict
class BlockLatentConfig(BackboneConfig):
    r"""Base of `ColaConfig` and `AuroraConfig` (a family may change the defaults of these fields). A family sets
    `sub_configs_defaults` (its component's config), `component_config_name` (that entry's name) and
    `component_name` (the component in messages), and may widen `time_samplers`."""

    component_config_name = ""
    component_name = "component"
    time_samplers = TIME_SAMPLERS
    keys_to_ignore_at_inference = ["cache"]
    has_token_likelihood = False

    block_size: int = 16  # latent positions per block of the prior
    time_sampler: str = "logit_normal"  # how training draws one noise level per (row, block)
    time_loc: int | float = 1.0  # loc and scale of "logit_normal"
    time_scale: int | float = 1.0
    time_shift: int | float = 1.0  # shift of "shifted" (or of the family's own sampler)
    # Probability that a noisy block sees no clean history: trains the unconditional branch of classifier-free guidance.
    history_dropout: int | float = 0.1
    # Probability that a block's first k positions enter clean and unscored: trains the repaint of a prompt that ends
    # mid-block.
    prompt_block_prob: int | float = 0.05
    # Generation defaults, each can be overridden in `generate()`. num_inference_steps: ODE steps per block, None ->
    # 16 (`num_ode_steps` is its deprecated spelling); cfg_scale: guidance weight w (1 = off); decode_temperature: 0
    # reads tokens out greedily from the component's decoder, > 0 samples.
    num_inference_steps: int | None = None
    cfg_scale: int | float = 7.0
    decode_temperature: int | float = 0.0

    def __post_init__(self, **kwargs):
        self.embed_component_config(vocab_size=self.vocab_size)
        old = kwargs.pop("num_ode_steps", None)  # the deprecated spelling, also found in old config.json files
        if old is not None:
            warn_num_ode_steps()
            if self.num_inference_steps is not None and self.num_inference_steps != old:
                raise ValueError(f"num_ode_steps ({old}) and num_inference_steps ({self.num_inference_steps}) are one "
                                 f"field; give num_inference_steps only")
            self.num_inference_steps = old
        if self.num_inference_steps is None:
            self.num_inference_steps = 16
        super().__post_init__(**kwargs)

    @property
    def num_ode_steps(self) -> int:
        """Deprecated spelling of `num_inference_steps` (the name `generate()` takes)."""
        warn_num_ode_steps()
        return self.num_inference_steps

    @num_ode_steps.setter
    def num_ode_steps(self, value: int) -> None:
        warn_num_ode_steps()
        self.num_inference_steps = value

    @property
    def component_config(self):
        return getattr(self, self.component_config_name)

    @property
    def latent_size(self) -> int:
        return self.component_config.latent_size

    def embed_component_config(self, **defaults) -> None:
        """Make the component's entry a config: a dict of its fields from a config.json, or None for a new one with
        `defaults` (the fields it shares with this config)."""
        value = self.component_config
        config_class = self.sub_configs_defaults[self.component_config_name].config_class
        if value is None or isinstance(value, dict):
            setattr(self, self.component_config_name, config_class(**(value or defaults)))

    def time_sampler_kwargs(self) -> dict:
        """The keyword arguments of `flow.make_time_sampler(self.time_sampler, ...)`."""
        if self.time_sampler == "logit_normal":
            return {"loc": self.time_loc, "scale": self.time_scale}
        return {} if self.time_sampler == "uniform" else {"shift": self.time_shift}

    def validate_architecture(self) -> None:
        """Raise a ValueError naming the first bad field among the backbone's, the component's and the shared ones."""
        super().validate_architecture()
        check_positive(self, ("block_size", "num_inference_steps"))
        self.validate_component()
        name = type(self).__name__
        if self.time_sampler not in self.time_samplers:
            raise ValueError(f"{name}.time_sampler must be one of {self.time_samplers}, got {self.time_sampler!r}")
        if self.time_scale <= 0 or self.time_shift <= 0:
            raise ValueError(f"{name}.time_scale and time_shift must be > 0, got {self.time_scale} and "
                             f"{self.time_shift}")
        check_fraction(self, ("history_dropout", "prompt_block_prob"))
        check_non_negative(self, ("cfg_scale", "decode_temperature"))

    def validate_component(self) -> None:
        """Raise a ValueError if the embedded component config disagrees with this one (a family adds its own
        checks); run again when a model is built around a trained component."""
        component = self.component_config
        if component.vocab_size != self.vocab_size:
            raise ValueError(f"the {self.component_name}'s vocab_size ({component.vocab_size}) disagrees with "
                             f"{type(self).__name__}.vocab_size ({self.vocab_size})")


def warn_num_ode_steps() -> None:
    warnings.warn("num_ode_steps is deprecated; use num_inference_steps (the name generate() and the CLI take)",
                  FutureWarning, stacklevel=3)


__all__ = ["BlockLatentConfig", "TIME_SAMPLERS"]
