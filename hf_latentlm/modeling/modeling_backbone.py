"""`PreTrainedModel` base shared by every family built on `layers.py`: the class attributes transformers reads,
weight init, token-embedding accessors and a `save_pretrained` that writes the full `auto_map`."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from .layers import init_backbone_weights


class BackbonePreTrainedModel(PreTrainedModel):
    """Subclasses set `config_class`; causal-LM classes also set `full_auto_map` (Auto class -> "module.Class"),
    written into the config on save because each class otherwise records only its own Auto class. The token
    embedding is `embed_tokens` of the base model (`self.model`, or the model itself)."""

    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DecoderBlock"]
    _supports_sdpa = True
    full_auto_map: dict[str, str] | None = None

    @torch.no_grad()
    def _init_weights(self, module):
        init_backbone_weights(module, self.config.initializer_range)

    def save_pretrained(self, save_directory, *args, **kwargs):
        if self.full_auto_map:
            self.config.auto_map = dict(self.full_auto_map)
        return super().save_pretrained(save_directory, *args, **kwargs)

    def get_input_embeddings(self):
        return self.base_model.embed_tokens

    def set_input_embeddings(self, value):
        self.base_model.embed_tokens = value


__all__ = ["BackbonePreTrainedModel"]
