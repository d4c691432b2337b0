"""`PreTrainedModel` base shared by every family built on `layers.py`: the class attributes transformers reads,
weight init, token-embedding accessors and a `save_pretrained` that writes the full `auto_map`."""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.utils import can_return_tuple, logging
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.output_capturing import capture_outputs

from .layers import init_backbone_weights

logger = logging.get_logger(__name__)

# Keyword arguments transformers (and TRL) pass to a model's forward besides the named ones; anything else is a
# mistake that must not pass silently.
ACCEPTED_FORWARD_KWARGS = frozenset({"output_attentions", "output_hidden_states", "num_items_in_batch"})


def check_forward_kwargs(model, kwargs: dict) -> None:
    unknown = sorted(set(kwargs) - ACCEPTED_FORWARD_KWARGS)
    if unknown:
        raise TypeError(f"{type(model).__name__}.forward() got unexpected keyword argument(s) {unknown}")


def check_backbone_inputs(model, kwargs: dict, **inputs) -> None:
    """What every backbone forward checks: exactly one of its `inputs` (input_ids, inputs_embeds, and a block-latent
    family's latents) given, and `inputs_embeds` as wide as the token embedding: they mean
    `get_input_embeddings()(input_ids)` in every family, as in transformers. Attentions asked of the SDPA path (which
    has no probabilities to return) give one warning and an empty tuple, as transformers' own models do."""
    given = [name for name, value in inputs.items() if value is not None]
    if len(given) != 1:
        raise ValueError(f"pass exactly one of {', '.join(inputs)} (got {', '.join(given) or 'none'})")
    embeds = inputs.get("inputs_embeds")
    width = model.get_input_embeddings().embedding_dim
    if embeds is not None and (embeds.dim() != 3 or embeds.shape[-1] != width):
        hint = " (latents go in as latents=)" if "latents" in inputs else ""
        raise ValueError(f"inputs_embeds must be token embeddings [batch, length, {width}] "
                         f"(get_input_embeddings()(input_ids)), got shape {tuple(embeds.shape)}{hint}")
    config = model.config
    if kwargs.get("output_attentions") and config._attn_implementation != "eager":
        logger.warning_once(f"`{config._attn_implementation}` attention does not support `output_attentions=True`; "
                            "no attentions are returned. Load the model with attn_implementation='eager' to get them.")


def recording_nothing(method):
    """For a component's method that a composite model calls inside its own forward (Cola's VAE, AURORA's
    autoencoder): transformers' recorder hooks fire into whichever capture is active, so the component's recorded
    states would land in the composite model's. The method runs in a capture of its own with every recording off,
    whatever the configs say (a config may ask for hidden states in every sub-config)."""
    def without_flags(self, *args, output_hidden_states=None, output_attentions=None, **kwargs):
        return method(self, *args, **kwargs)

    captured = capture_outputs(without_flags)

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        return captured(self, *args, output_hidden_states=False, output_attentions=False, return_dict=True, **kwargs)

    return call


def runs_scoring_pass(forward):
    """For a model's forward: `model(scoring_pass=fn, **inputs)` returns `fn(model, **inputs)` instead. A trainer
    whose loss is not the forward's (a DPO response score under frozen draws) runs it this way, through the wrappers'
    own forwards, so that DDP prepares its gradient reduction and PEFT applies (or disables) its adapters as they do
    for any forward. `fn` also receives what the wrappers add (PEFT passes `labels=None`, ...): it takes `**kwargs`."""
    @functools.wraps(forward)
    def dispatch(self, *args, scoring_pass=None, **kwargs):
        if scoring_pass is not None:
            return scoring_pass(self, *args, **kwargs)
        return forward(self, *args, **kwargs)

    return dispatch


def head_forward(forward):
    """The decorators of a family head model's forward: Llama's (`cache`, with `past_key_values` as its deprecated
    name; a tuple when `return_dict=False`), and `runs_scoring_pass`."""
    return runs_scoring_pass(deprecate_kwarg("past_key_values", version="5.40.0", new_name="cache")(
        can_return_tuple(forward)))


def embedded_config(component_config):
    """A copy of a trained component's config to embed in a composite model's config (CALM's autoencoder, Cola's
    VAE): without its folder path or `auto_map`, so the composite checkpoint never points at another folder."""
    embedded = copy.deepcopy(component_config)
    embedded._name_or_path = ""
    embedded.auto_map = None
    return embedded


def composite_config(config_class, field: str, component_config, config=None, validate: str | None = None,
                     component_name: str = "component", shared: tuple[str, ...] = ("vocab_size",), **config_kwargs):
    """The config of a model built around a trained component (CALM's and AURORA's autoencoders, Cola's VAE):
    `config` (a copy) or `config_class(**config_kwargs)` with the component's config embedded (`embedded_config`) as
    `field`. The `shared` fields default to the component's; a given config that disagrees on one is refused.
    `validate` names its method that re-checks it after the component config is set."""
    embedded = embedded_config(component_config)
    if config is None:
        for name in shared:
            config_kwargs.setdefault(name, getattr(embedded, name))
        return config_class(**config_kwargs, **{field: embedded})
    for name in shared:
        if getattr(embedded, name) != getattr(config, name):
            raise ValueError(f"the {component_name}'s {name} ({getattr(embedded, name)}) disagrees with the "
                             f"{config_class.__name__}'s {name} ({getattr(config, name)})")
    config = copy.deepcopy(config)
    setattr(config, field, embedded)
    if validate is not None:
        getattr(config, validate)()
    return config


def resized_vocab_size(model, new_num_tokens: int | None, pad_to_multiple_of: int | None) -> int:
    """The vocabulary size `resize_token_embeddings(new_num_tokens, pad_to_multiple_of)` would give, computed before
    anything changes so that a family can refuse it first."""
    size = model.get_input_embeddings().weight.shape[0] if new_num_tokens is None else new_num_tokens
    if pad_to_multiple_of is not None:
        size = -(-size // pad_to_multiple_of) * pad_to_multiple_of
    return size


def refuse_vocab_resize(model, size: int, owner: str, component: str, rebuild: str) -> None:
    """NotImplementedError unless `size` is the model's vocabulary size: for families whose vocabulary belongs to a
    trained component (`owner`), retrained as `component` and rebuilt with `rebuild`."""
    if size != model.config.vocab_size:
        raise NotImplementedError(
            f"{type(model).__name__} cannot resize its token embeddings ({model.config.vocab_size} -> {size}): the "
            f"vocabulary belongs to {owner}. Resize and retrain {component}, then build a new model with {rebuild}")


def is_right_padded(attention_mask: torch.Tensor) -> bool:
    """True when every row is real tokens followed by padding (no 0 -> 1 step along a row)."""
    return not bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any())


def check_block_training_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, family: str) -> None:
    """What a block-latent training objective (Cola DLM, AURORA-LM) refuses: input_ids that are not [batch, length],
    and left padding (its blocks are counted from column 0)."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    if attention_mask is not None and not is_right_padded(attention_mask):
        raise ValueError(f"the {family} training objective needs right padding (blocks are counted from column 0)")


def masked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """Mean CE over the `scored` positions (0, not NaN, when none is scored); static shapes (no boolean indexing)."""
    nll = F.cross_entropy(logits.flatten(0, -2).float(), targets.clamp(min=0).flatten(), reduction="none")
    keep = scored.flatten().float()
    return (nll * keep).sum() / keep.sum().clamp(min=1)


def scored_positions(labels: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    scored = labels != -100
    return scored if attention_mask is None else scored & attention_mask.bool()


class TrainingHooks:
    """What the training loop and the evaluation harness call on a model besides `forward`, with their defaults.
    Every family has them (`BackbonePreTrainedModel`); `training_hooks(model)` gives them for any model."""

    #: How many training rows `prepare_training` reads; 0: it is not called (reading a streamed corpus's first rows
    #: costs a pass over its first documents).
    training_rows_needed: int = 0

    def prepare_training(self, train_rows: torch.Tensor) -> None:
        """Once before the first step, with up to `training_rows_needed` training rows [N, L] (AURORA: its latent
        statistics)."""

    def on_optimizer_step(self) -> None:
        """After every optimizer step (AURORA: its step count and EMA copy)."""

    def parameter_learning_rate_scales(self) -> dict[str, float]:
        """Parameter-name prefix -> learning-rate multiplier for the optimizer (Cola: the VAE's)."""
        return {}

    def counted_modules(self) -> list[torch.nn.Module]:
        """The modules whose forward calls are the network evaluations `generate()` reports: the model itself,
        unless a family runs several networks."""
        return [self]


class DefaultTrainingHooks(TrainingHooks):
    """The hooks of a model without them (a plain transformers model: the AR baseline's `LlamaForCausalLM`)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def counted_modules(self) -> list[torch.nn.Module]:
        return [self.model]


def training_hooks(model) -> TrainingHooks:
    # Asked by attribute, not by class: a PEFT wrapper passes attribute reads on to the model it wraps.
    return model if hasattr(model, "on_optimizer_step") else DefaultTrainingHooks(model)


class BackbonePreTrainedModel(PreTrainedModel, TrainingHooks):
    """Subclasses set `config_class`; a model with a head sets `base_model_class`, the backbone class that `AutoModel`
    resolves to (as `LlamaModel` for `LlamaForCausalLM`). The token embedding is `embed_tokens` of the base model
    (`self.model`, or the model itself)."""

    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DecoderBlock"]
    # `layers.Attention` takes any boolean mask through sdpa, eager and flex attention (as a BlockMask); flash
    # attention takes causality as a flag and padding as [batch, keys] only, so a family whose masks are just that
    # (CALM) turns it on.
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_flash_attn = False
    base_model_class: type | None = None

    @torch.no_grad()
    def _init_weights(self, module):
        init_backbone_weights(module, self.config.initializer_range)

    def _flash_attn_can_dispatch(self, flash_attn_version: int, is_init_check: bool = False) -> bool:
        if not self._supports_flash_attn:
            raise ValueError(f"{type(self).__name__} cannot use flash_attention_{flash_attn_version}: flash attention "
                             "takes only causal masks with padding, and this model's attention masks are not; use "
                             "attn_implementation='sdpa' or 'flex_attention'")
        return super()._flash_attn_can_dispatch(flash_attn_version, is_init_check)

    def save_pretrained(self, save_directory, *args, **kwargs):
        # Each class records only its own Auto class; write them all, so that every Auto class loads the folder where
        # the package is not installed (the flat module names are those of the copied files).
        def flat_name(cls) -> str:
            return f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}"

        self.config.auto_map = {"AutoConfig": flat_name(type(self.config)),
                                "AutoModel": flat_name(self.base_model_class or type(self))}
        if self.can_generate():
            self.config.auto_map["AutoModelForCausalLM"] = flat_name(type(self))
        return super().save_pretrained(save_directory, *args, **kwargs)

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True):
        """transformers' resize (embedding, output layer and `config.vocab_size` together), after
        `check_vocab_resize` has had the chance to refuse it before anything changes."""
        if new_num_tokens is not None or pad_to_multiple_of is not None:
            self.check_vocab_resize(resized_vocab_size(self, new_num_tokens, pad_to_multiple_of))
        return super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        # transformers replaces every loaded weight with a new, trainable `nn.Parameter`, which undoes what `__init__`
        # froze (a frozen component would then break DDP with parameters that get no gradient).
        loaded = super().from_pretrained(*args, **kwargs)
        (loaded[0] if isinstance(loaded, tuple) else loaded).freeze_components()
        return loaded

    def freeze_components(self) -> None:
        """Set `requires_grad=False` on the parts this model never trains (called by `__init__` and again after
        `from_pretrained`); default: none."""

    def check_vocab_resize(self, size: int) -> None:
        """Raise if resizing the vocabulary to `size` would leave the checkpoint inconsistent (default: any size)."""

    @property
    def vocab_size(self) -> int:
        """The vocabulary size, as transformers' models expose it (read from the config, so a resize shows)."""
        return self.config.vocab_size

    @vocab_size.setter
    def vocab_size(self, value: int) -> None:  # transformers' resize sets it
        self.config.vocab_size = value

    def get_input_embeddings(self):
        return self.base_model.embed_tokens

    def set_input_embeddings(self, value):
        self.base_model.embed_tokens = value


__all__ = ["BackbonePreTrainedModel", "DefaultTrainingHooks", "TrainingHooks", "check_backbone_inputs",
           "check_block_training_rows", "check_forward_kwargs", "composite_config", "embedded_config", "head_forward",
           "masked_cross_entropy", "recording_nothing", "refuse_vocab_resize", "resized_vocab_size",
           "runs_scoring_pass", "scored_positions", "training_hooks"]
