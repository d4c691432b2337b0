"""A throwaway family, written by following docs/adding_a_family.md (step 2: the modeling file). It imports only
flat siblings and torch/transformers, like every modeling file."""

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import ModelOutput

from .configuration_toy import ToyConfig
from .generation import DecodingStep, GenerationOptions, MultiTokenGenerationMixin, refuse_token_filters, row_seeds
from .modeling_backbone import BackbonePreTrainedModel


@dataclass
class ToyGenerationOptions(GenerationOptions):
    """seeds: one RNG seed per row. do_sample / temperature / top_k / top_p: plain sampling only."""

    family: ClassVar[str] = "Toy"
    row_seeds_option: ClassVar[str] = "seeds"

    seeds: list[int] | None = None

    def resolved(self, config: ToyConfig, batch_size: int) -> "ToyGenerationOptions":
        refuse_token_filters("Toy", "plain sampling only", self.top_k, self.top_p)
        if not self.do_sample or self.temperature not in (None, 1.0):
            raise ValueError("Toy generate samples at temperature 1 only")
        return replace(self, seeds=row_seeds(self.seeds, batch_size, "seeds"))


@dataclass
class ToyOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None  # [B, T, V] next-token logits
    head_logits: torch.Tensor | None = None  # [B, T, K, V]: position t predicts x_{t+1} .. x_{t+K}


@dataclass
class ToyDecodingState:
    last_token: torch.Tensor  # [B]
    generators: list[torch.Generator]


class ToyModel(nn.Module):
    def __init__(self, config: ToyConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, input_ids):
        return torch.tanh(self.proj(self.embed_tokens(input_ids)))


class ToyForCausalLM(BackbonePreTrainedModel, MultiTokenGenerationMixin):
    config_class = ToyConfig
    generation_options_class = ToyGenerationOptions

    def __init__(self, config: ToyConfig):
        super().__init__(config)
        self.model = ToyModel(config)
        self.heads = nn.Linear(config.hidden_size, config.tokens_per_call * config.vocab_size)
        self.post_init()

    def forward(self, input_ids=None, labels=None, **kwargs):
        batch, length = input_ids.shape
        logits = self.heads(self.model(input_ids)).view(batch, length, self.config.tokens_per_call, -1)
        loss = None
        if labels is not None:
            length = input_ids.shape[1]
            losses = []
            for k in range(min(self.config.tokens_per_call, length - 1)):
                target = labels[:, k + 1:]
                losses.append(F.cross_entropy(logits[:, :length - k - 1, k].transpose(1, 2), target,
                                              ignore_index=-100))
            loss = torch.stack(losses).mean()
        return ToyOutput(loss=loss, logits=logits[:, :, 0], head_logits=logits)

    def _start_decoding(self, input_ids, request, options):
        generators = [torch.Generator().manual_seed(s) for s in options.seeds]
        return ToyDecodingState(input_ids[:, -1], generators), 0  # context-free: no prefill

    def _decoding_step(self, state, new_tokens):
        # Through forward (self(...)), so that hooks such as the harness's call counter see every evaluation.
        probs = self(input_ids=state.last_token[:, None]).head_logits[:, 0].float().softmax(-1)  # [B, K, V]
        tokens = torch.stack([torch.multinomial(p, 1, generator=g).squeeze(-1)
                              for p, g in zip(probs.cpu(), state.generators)]).to(probs.device)
        state.last_token = tokens[:, -1]
        return DecodingStep(tokens)
