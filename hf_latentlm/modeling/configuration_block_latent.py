"""The configuration fields every block-latent family (Cola DLM, AURORA-LM) shares: a trained text component with one
latent per token (embedded as a sub-config) and a prior that denoises blocks of `block_size` latents, bidirectional
inside a block and causal across blocks."""

from __future__ import annotations

import warnings

from .configuration_backbone import BackboneConfig, check_fraction, check_non_negative, check_positive

TIME_SAMPLERS = ("logit_normal", "shifted", "uniform")


class BlockLatentConfig(BackboneConfig):
    r"""Base of `ColaConfig` and `AuroraConfig`, whose docstrings describe the fields (a family may change their
    defaults). A family sets `sub_configs` (its component's config), `component_config_name` (that entry's name)
    and `component_name` (the component in messages), and may widen `time_samplers`."""

    component_config_name = ""
    component_name = "component"
    time_samplers = TIME_SAMPLERS
    keys_to_ignore_at_inference = ["past_key_values"]
    has_token_likelihood = False

    def __init__(
        self,
        block_size: int = 16,
        time_sampler: str = "logit_normal",
        time_loc: float = 1.0,
        time_scale: float = 1.0,
        time_shift: float = 1.0,
        history_dropout: float = 0.1,
        prompt_block_prob: float = 0.05,
        num_inference_steps: int | None = None,
        cfg_scale: float = 7.0,
        decode_temperature: float = 0.0,
        **kwargs,
    ):
        old = kwargs.pop("num_ode_steps", None)  # the deprecated spelling, also found in old config.json files
        if old is not None:
            warn_num_ode_steps()
            if num_inference_steps is not None and num_inference_steps != old:
                raise ValueError(f"num_ode_steps ({old}) and num_inference_steps ({num_inference_steps}) are one "
                                 f"field; give num_inference_steps only")
            num_inference_steps = old
        super().__init__(**kwargs)
        self.block_size = block_size
        self.time_sampler = time_sampler
        self.time_loc = time_loc
        self.time_scale = time_scale
        self.time_shift = time_shift
        self.history_dropout = history_dropout
        self.prompt_block_prob = prompt_block_prob
        self.num_inference_steps = 16 if num_inference_steps is None else num_inference_steps
        self.cfg_scale = cfg_scale
        self.decode_temperature = decode_temperature

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

    def time_sampler_kwargs(self) -> dict:
        """The keyword arguments of `flow.make_time_sampler(self.time_sampler, ...)`."""
        if self.time_sampler == "logit_normal":
            return {"loc": self.time_loc, "scale": self.time_scale}
        return {} if self.time_sampler == "uniform" else {"shift": self.time_shift}

    def validate_component(self) -> None:
        """Raise a ValueError if the embedded component config disagrees with this one (a family adds its own
        checks); run again when a model is built around a trained component."""
        component = self.component_config
        if component.vocab_size != self.vocab_size:
            raise ValueError(f"the {self.component_name}'s vocab_size ({component.vocab_size}) disagrees with "
                             f"{type(self).__name__}.vocab_size ({self.vocab_size})")

    def validate_block_latent(self) -> None:
        """Raise a ValueError naming the first bad field among the backbone's, the component's and the shared ones."""
        self.validate_backbone()
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


def warn_num_ode_steps() -> None:
    warnings.warn("num_ode_steps is deprecated; use num_inference_steps (the name generate() and the CLI take)",
                  FutureWarning, stacklevel=3)


__all__ = ["BlockLatentConfig", "TIME_SAMPLERS"]
