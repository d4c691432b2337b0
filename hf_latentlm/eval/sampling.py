"""The one interface the evaluation harness needs from a model: draw continuations.

`sample_continuations(model, contexts, num_tokens, seed)` works for any model with a `generate()` that follows the
transformers contract (`do_sample`, `max_new_tokens`, `attention_mask`). Pure ancestral sampling (temperature 1, no
top-k/top-p) and no early stop at the end-of-document token, so every row yields exactly `num_tokens` draws from the
model. Every helper that calls `generate()` (here, Brier, MAUVE, speed) takes `generate_kwargs`, merged over these
defaults, to measure the model under other options (a temperature, an acceptance rule).
"""

from __future__ import annotations

import torch


#: Plain sampling at temperature 1 from the whole distribution: the only decoding every family shares.
PLAIN_SAMPLING = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}


def unbiased_sampling_kwargs(num_tokens: int, generate_kwargs: dict | None = None) -> dict:
    """generate() options for plain draws from the model's distribution, exactly `num_tokens` long, with
    `generate_kwargs` (if any) merged over them. `eos_token_id=None` keeps EOS as an ordinary token instead of a
    stop signal."""
    return {**PLAIN_SAMPLING, "max_new_tokens": num_tokens, "eos_token_id": None, **(generate_kwargs or {})}


def model_device(model) -> torch.device:
    """Where the model's inputs go: its `device` (a transformers model, a reference language), else its first
    parameter's."""
    device = getattr(model, "device", None)
    return torch.device(device) if device is not None else next(model.parameters()).device


def trained_length(config) -> int | None:
    """The sequence length a model was trained at: `trained_seq_len` of its config (an object or config.json's
    dict), recorded by the training loop; None for a model trained elsewhere (then nothing is checked)."""
    return config.get("trained_seq_len") if isinstance(config, dict) else getattr(config, "trained_seq_len", None)


def fitting_context_len(configs, num_tokens: int, longest: int = 128) -> int:
    """The longest context, up to `longest`, after which `num_tokens` more tokens stay inside the
    positions every one of `configs` was trained at (at least 1: a shorter model is then refused by the check)."""
    trained = [length for length in map(trained_length, configs) if length is not None]
    return max(1, min([longest, *(length - num_tokens for length in trained)]))


def trained_row_length(config, default: int) -> int:
    """`default`, or the length the model was trained at when that is shorter: rows for measurements that read
    whole rows (NLL, likelihood, reconstruction) stay inside the trained positions."""
    return min(default, trained_length(config) or default)


def check_trained_length(config, context_len: int, num_tokens: int, what: str, label: str = "the model") -> None:
    """ValueError naming both lengths when `what` (contexts of `context_len` tokens followed by `num_tokens` more)
    reaches past the sequence length the model was trained at: positions it never trained at are not evaluated."""
    trained = trained_length(config)
    if trained is not None and context_len + num_tokens > trained:
        raise ValueError(f"{what}: a {context_len}-token context + {num_tokens} tokens reach {context_len + num_tokens} "
                         f"positions, beyond the {trained} {label} was trained at (config.trained_seq_len); use "
                         f"contexts of at most {max(trained - num_tokens, 0)} tokens")


@torch.no_grad()
def sample_continuations(model, contexts: torch.Tensor, num_tokens: int, seed: int,
                         attention_mask: torch.Tensor | None = None,
                         generate_kwargs: dict | None = None) -> torch.Tensor:
    """Return [B, num_tokens] sampled ids continuing each row of `contexts` [B, T].

    `generate_kwargs`: extra `generate()` options, merged over the unbiased-sampling defaults."""
    if contexts.dim() != 2 or contexts.shape[0] == 0:
        raise ValueError(f"contexts must be a non-empty [batch, length] tensor, got shape {tuple(contexts.shape)}")
    check_trained_length(getattr(model, "config", None), contexts.shape[1], num_tokens, "sampling")
    device = model_device(model)
    contexts = contexts.to(device)
    if attention_mask is None:
        attention_mask = torch.ones_like(contexts)
    torch.manual_seed(seed)
    out = model.generate(contexts, attention_mask=attention_mask.to(device),
                         **unbiased_sampling_kwargs(num_tokens, generate_kwargs))
    sequences = out.sequences if hasattr(out, "sequences") else out
    new = sequences[:, contexts.shape[1]:]
    if new.shape[1] != num_tokens:
        raise RuntimeError(f"model generated {new.shape[1]} tokens, expected {num_tokens}")
    return new.cpu()


def evaluation_windows(stream: torch.Tensor, num_positions: int, context_len: int, target_len: int):
    """Evenly spaced (context, target) windows over a 1-D token stream: contexts [P, context_len] and targets
    [P, target_len] with P = min(num_positions, available positions). Every window has the same context length, so
    batches need no padding and every family sees exactly the same prompts."""
    available = stream.numel() - context_len - target_len + 1
    if available < 1:
        raise ValueError(f"text of {stream.numel()} tokens is too short for context {context_len} + target {target_len}")
    count = min(num_positions, available)
    starts = torch.linspace(0, available - 1, count).round().long().unique()
    offsets_ctx = torch.arange(context_len)
    offsets_tgt = torch.arange(target_len) + context_len
    return stream[starts[:, None] + offsets_ctx], stream[starts[:, None] + offsets_tgt]
