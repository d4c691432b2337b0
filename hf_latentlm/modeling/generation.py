# Copyright 2025 The hf-latentlm authors. Licensed under the Apache License, Version 2.0.
"""Bookkeeping every family's custom `generate()` shares: reading the transformers-style arguments (EOS, padding,
`max_new_tokens`, left-padded `attention_mask`) with clear errors, and committing each call's new tokens per row
(stop at EOS, never past `max_new_tokens`, stream, pad finished rows).

Copied into Hub checkpoints, so torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GenerationRequest:
    """The resolved arguments of one `generate()` call."""

    attention_mask: torch.Tensor  # [B, T], left padding, last column all ones
    max_new_tokens: int
    eos_ids: torch.Tensor  # [E] ids that stop a row (empty: never stop)
    pad_token_id: int
    prompt_lengths: torch.Tensor  # [B] real (unpadded) tokens per row


def check_prompt(input_ids: torch.Tensor | None) -> None:
    if input_ids is None or input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError("input_ids must be a non-empty [batch, length] tensor (empty batch or empty prompt)")


def pop_special_token_options(kwargs: dict) -> dict:
    """Remove `eos_token_id` / `pad_token_id` from `kwargs`; remember whether EOS was given (None = never stop)."""
    return {"eos_given": "eos_token_id" in kwargs, "eos_token_id": kwargs.pop("eos_token_id", None),
            "pad_token_id": kwargs.pop("pad_token_id", None)}


# Options of transformers' generate() that a custom loop can accept without acting on them: they only concern
# outputs these loops do not produce (scores), the cache (always used) or the length limit (max_new_tokens wins).
HARMLESS_HF_OPTIONS = frozenset({"use_cache", "max_length", "bos_token_id", "output_scores", "output_logits"})


def base_generation_config(model, generation_config, kwargs: dict, family: str, no_beams_reason: str):
    """The GenerationConfig to read defaults from; refuses beam search (from `kwargs` or the config) by name."""
    gen = generation_config if generation_config is not None else model.generation_config
    if kwargs.pop("num_beams", getattr(gen, "num_beams", 1) or 1) > 1:
        raise ValueError(f"num_beams > 1 is not supported by {family}: {no_beams_reason}")
    return gen


def reject_unknown_options(kwargs: dict, family: str, also_accepted: frozenset = frozenset()) -> None:
    """Call after a family has popped the options it honours: drop the harmless ones and name the rest."""
    unknown = sorted(name for name in kwargs if name not in HARMLESS_HF_OPTIONS | also_accepted)
    if unknown:
        raise ValueError(f"unsupported generation option(s) for {family}: {unknown}")


def resolve_generation_request(family: str, config, generation_config, input_ids: torch.Tensor,
                               attention_mask: torch.Tensor | None, max_new_tokens: int | None,
                               special: dict, streamer=None) -> GenerationRequest:
    """Defaults from `generation_config` then `config`, as transformers does, and a ValueError naming any problem
    (no room for a token, mask shape, right padding, prompt + new tokens over `max_position_embeddings`, a
    streamer with more than one row)."""
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError("streamer supports batch size 1 only")
    eos = special["eos_token_id"] if special["eos_given"] else generation_config.eos_token_id
    eos_ids = torch.tensor([] if eos is None else ([eos] if isinstance(eos, int) else list(eos)), dtype=torch.long,
                           device=input_ids.device)
    pad = special["pad_token_id"]
    if pad is None:
        pad = generation_config.pad_token_id if generation_config.pad_token_id is not None else (config.pad_token_id or 0)
    if max_new_tokens is None:
        max_new_tokens = (generation_config.max_new_tokens if generation_config.max_new_tokens is not None
                          else max(generation_config.max_length - input_ids.shape[1], 0))
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                         f"{tuple(input_ids.shape)}")
    if not bool(attention_mask[:, -1].all()):
        raise ValueError(f"{family} generate needs left padding: the last column of attention_mask must be all ones")
    lengths = attention_mask.long().sum(1)
    if int(lengths.max()) + max_new_tokens > config.max_position_embeddings:
        raise ValueError(f"prompt ({int(lengths.max())} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"max_position_embeddings ({config.max_position_embeddings})")
    return GenerationRequest(attention_mask, max_new_tokens, eos_ids, int(pad), lengths)


def row_seeds(seeds: list[int] | None, batch: int, name: str) -> list[int]:
    """One RNG seed per row, so a row's random draws do not depend on the rest of the batch. Default: drawn from
    the global torch RNG (`torch.manual_seed` makes a call repeatable)."""
    if seeds is None:
        return torch.randint(0, 2**62, (batch,)).tolist()
    if len(seeds) != batch:
        raise ValueError(f"{name} has {len(seeds)} entries for a batch of {batch}")
    return [int(s) for s in seeds]


class NewTokens:
    """Per-row output buffer: `commit` takes each call's candidate tokens and keeps, per unfinished row, those
    that fit in `max_new_tokens`, up to and including a first EOS."""

    def __init__(self, request: GenerationRequest, batch: int, device, streamer=None):
        self.request, self.streamer = request, streamer
        self.tokens = torch.full((batch, request.max_new_tokens), request.pad_token_id, dtype=torch.long,
                                 device=device)
        self.count = torch.zeros(batch, dtype=torch.long, device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)

    def commit(self, candidates: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """candidates [B, W]; valid [B]: how many leading candidates count (default: all W)."""
        width = candidates.shape[1]
        slot = torch.arange(width, device=candidates.device)[None]
        room = self.request.max_new_tokens - self.count
        fits = slot < (room if valid is None else torch.minimum(valid, room))[:, None]
        is_eos = torch.isin(candidates, self.request.eos_ids) & fits
        stop_at = torch.where(is_eos.any(1), is_eos.long().argmax(1) + 1, width)
        keep = fits & (slot < stop_at[:, None]) & ~self.finished[:, None]
        rows, cols = keep.nonzero(as_tuple=True)
        self.tokens[rows, self.count[rows] + cols] = candidates[rows, cols]
        if self.streamer is not None and keep.any():
            self.streamer.put(candidates[0][keep[0]].cpu())
        self.count += keep.sum(1)
        self.finished |= (is_eos & keep).any(1) | (self.count >= self.request.max_new_tokens)

    @property
    def done(self) -> bool:
        return bool(self.finished.all())

    def sequences(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T + longest row's new tokens]; rows that stopped earlier are padded."""
        return torch.cat([input_ids, self.tokens[:, : int(self.count.max())]], dim=1)


__all__ = ["GenerationRequest", "NewTokens", "HARMLESS_HF_OPTIONS", "base_generation_config", "check_prompt",
           "reject_unknown_options", "pop_special_token_options",
           "resolve_generation_request", "row_seeds"]
