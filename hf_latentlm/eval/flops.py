"""FLOPs per token, counted over real calls of a model.

- `inference_flops_per_token(model, context_length)`: the FLOPs of one decoding step once `context_length` tokens
  are cached, for AR and CALM: `model.generate()` runs twice under torch's `FlopCounterMode`, with `n` and `n + 1`
  steps, and the difference is divided by the tokens the step emits. CALM's parts (backbone, energy head, decoder;
  per pool draw when `temperature` < 1) are also counted separately, and must add up to that difference.
- `training_flops_per_token(model, seq_len)`: one forward + backward of the loop's training step on random rows,
  per token (a frozen component's no-grad forward included, the optimizer update not).

Under `FlopCounterMode` a multiply-add is 2 FLOPs and only matrix products and attention kernels count. Attention
runs eager while counting, because the counter has no rule for the CPU SDPA kernel; `torch.cdist` gets the rule of
the matrix product it amounts to (`_cdist_flops`).

`FlopCounter` is the project's own counter for achieved FLOP/s: it reads torch functions rather than aten ops, so it
counts SDPA as it runs and is cheap enough for a real `generate()`; tests/eval/test_flops.py holds it close to
`FlopCounterMode` on every family.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from ..modeling.sampling import model_mode

__all__ = ["FlopCounter", "compare_with_flop_counter_mode", "count_flops", "counted_training_flops",
           "inference_flops_per_token", "parameter_counts", "reads_chunks", "training_flops_per_token",
           "weights_updated"]

# Matmul-type ops whose count depends on the context (attention scores and values in eager attention).
_ATTENTION_OPS = ("aten.bmm", "aten.baddbmm")


def _cdist_flops(x1_shape, x2_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of cdist([..., N, l], [..., M, l]) written as the matrix product x1·x2ᵀ it reduces to: 2·N·M·l."""
    batch = math.prod(x1_shape[:-2])
    return 2 * batch * x1_shape[-2] * x2_shape[-2] * x1_shape[-1]


def _cdist_backward_flops(grad_shape, x1_shape, x2_shape, *args, out_shape=None, **kwargs) -> int:
    """The gradient for x1 is another [N, M] × [M, l] product: 2·N·M·l."""
    return _cdist_flops(x1_shape, x2_shape)


# cdist runs as `_euclidean_dist` (the matmul form, chosen when a side has > 25 rows, as the energy loss's 100 target
# draws do) or `_cdist_forward`; both are single CPU kernels the counter cannot see into. The backward of
# `_euclidean_dist` is decomposed into bmm's, which the counter does count, so it needs no rule.
_CUSTOM = {torch.ops.aten._euclidean_dist: _cdist_flops, torch.ops.aten._cdist_forward: _cdist_flops,
           torch.ops.aten._cdist_backward: _cdist_backward_flops}


def reads_chunks(model) -> bool:
    """True for a model that reads and writes whole chunks of `config.chunk_size` tokens through an energy head and
    an autoencoder (CALM's shape); other models are counted as token-per-step LMs."""
    return getattr(model.config, "chunk_size", None) is not None and hasattr(model, "sample_latents")


@contextlib.contextmanager
def _eager_attention(model):
    """Switch attention to the eager path for the measurement and restore it (both families read
    `config._attn_implementation` at every call)."""
    before = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        yield
    finally:
        model.config._attn_implementation = before


class _Count:
    """The result of one counted call: total, FLOPs by module path and by op."""

    def __init__(self, mode: FlopCounterMode):
        counts = mode.get_flop_counts()
        self.total = int(mode.get_total_flops())
        self.by_module = {name: {str(op): int(n) for op, n in ops.items()} for name, ops in counts.items()}

    def module(self, path: str) -> int:
        """FLOPs inside module `path` (its FQN under the root class name). A module whose own forward never ran
        (e.g. the autoencoder, whose `encode` method calls its submodules) has no entry: its children are summed."""
        if path in self.by_module:
            return sum(self.by_module[path].values())
        prefix = path + "."
        children = {name[len(prefix):].split(".")[0] for name in self.by_module if name.startswith(prefix)}
        return sum(self.module(prefix + child) for child in children)

    def ops(self, path: str = "Global") -> dict[str, int]:
        return self.by_module.get(path, {})


def count_flops(fn, model=None) -> tuple[_Count, object]:
    """Run `fn()` under `FlopCounterMode` (eager attention on `model` if given); returns (count, fn's result)."""
    mode = FlopCounterMode(display=False, custom_mapping=_CUSTOM)
    with _eager_attention(model) if model is not None else contextlib.nullcontext(), mode:
        result = fn()
    return _Count(mode), result


def _check_context(model, context_length: int) -> None:
    if not isinstance(context_length, int) or context_length < 1:
        raise ValueError(f"context_length must be an int >= 1 (tokens already in the cache), got {context_length!r}")
    if reads_chunks(model) and context_length % model.config.chunk_size:
        raise ValueError(f"context_length {context_length} is not a multiple of CALM's chunk_size K = "
                         f"{model.config.chunk_size}: CALM reads the context as whole chunks")
    limit = model.config.max_position_embeddings
    extra = 2 * model.config.chunk_size if reads_chunks(model) else 2
    if context_length + extra > limit:
        raise ValueError(f"context_length {context_length} + the measured steps exceeds max_position_embeddings "
                         f"({limit})")


def _generate_count(model, prompt: torch.Tensor, new_tokens: int, **options) -> _Count:
    """Count one `generate()` call that must produce exactly `new_tokens` tokens (EOS disabled by min_new_tokens)."""
    count, out = count_flops(lambda: model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                                    max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                    **options), model)
    if out.shape[1] != prompt.shape[1] + new_tokens:
        raise RuntimeError(f"generate() returned {out.shape[1] - prompt.shape[1]} new tokens, expected {new_tokens}")
    return count


def _random_rows(model, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
    # Token ids above the special ids, so that no token is a pad / EOS.
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (batch_size, seq_len), generator=gen).to(model.device)


@torch.no_grad()
def inference_flops_per_token(model, context_length: int, temperature: float = 1.0, seed: int = 0) -> dict:
    """FLOPs to generate one token with `context_length` tokens already in the cache, batch 1 (see the module
    docstring for how). Returns {"per_token", "parts" (per token), "per_step", "tokens_per_step", "method", ...}.

    temperature (CALM only; an AR step costs the same at any T): 1 = generate()'s default, one energy-head draw per
    step; T < 1 = the pool sampler, `config.temperature_pool_size` draws per step, each decoded."""
    _check_context(model, context_length)
    if not 0 < temperature <= 1:
        raise ValueError(f"temperature must be in (0, 1], got {temperature}")
    with model_mode(model, False):
        prompt = _random_rows(model, 1, context_length, seed)
        if reads_chunks(model):
            return _calm_inference(model, prompt, temperature, seed)
        return _ar_inference(model, prompt)


def _ar_inference(model, prompt: torch.Tensor) -> dict:
    # generate(n=1) is the prefill alone; generate(n=2) adds one decode step whose input token sees the C cached ones.
    root = type(model).__name__
    one = _generate_count(model, prompt, 1, do_sample=False)
    two = _generate_count(model, prompt, 2, do_sample=False)
    step = two.total - one.total
    backbone = two.module(f"{root}.model") - one.module(f"{root}.model")
    attention = sum(two.ops(f"{root}.model").get(op, 0) - one.ops(f"{root}.model").get(op, 0) for op in _ATTENTION_OPS)
    parts = {"backbone_weights": backbone - attention, "attention_over_context": attention,
             "lm_head": two.module(f"{root}.lm_head") - one.module(f"{root}.lm_head")}
    parts["other"] = step - sum(parts.values())
    return {"family": "ar", "context_length": prompt.shape[1], "per_token": step, "per_step": step,
            "tokens_per_step": 1, "parts": parts,
            "method": "generate() with 2 new tokens minus generate() with 1 (one cached decode step), eager attention"}


def _calm_inference(model, prompt: torch.Tensor, temperature: float, seed: int) -> dict:
    K = model.config.chunk_size
    # generate(K) = prefill + the first chunk's head + decoder; generate(2K) adds one full step: the backbone on the
    # first chunk (C cached tokens), the head, the decoder. T = 1: one head draw per step; T < 1: the pool's draws.
    options = {"noise_seeds": [seed], "temperature": temperature, "temperature_sampler": "pool"}
    draws = 1 if temperature == 1 else model.config.temperature_pool_size
    one = _generate_count(model, prompt, K, **options)
    two = _generate_count(model, prompt, 2 * K, **options)
    step = two.total - one.total
    parts = _calm_step_parts(model, prompt, draws, seed)
    if sum(parts.values()) != step:
        raise RuntimeError(f"CALM step parts {parts} (sum {sum(parts.values())}) disagree with the generate() "
                           f"difference ({step}): generate() no longer calls what _calm_step_parts measures")
    return {"family": model.config.model_type, "context_length": prompt.shape[1], "per_token": step / K,
            "per_step": step, "tokens_per_step": K, "parts": {name: value / K for name, value in parts.items()},
            "head_draws_per_step": draws, "temperature": temperature,
            "method": "generate() with 2K new tokens minus generate() with K (one decoding step: backbone on the "
                      "previous chunk + energy head for the step's latent draws + autoencoder decoder of each), / K; "
                      "parts measured by calling the same three pieces separately; eager attention"}


def _calm_step_parts(model, prompt: torch.Tensor, draws: int, seed: int) -> dict[str, int]:
    """What `CALMForCausalLM._decoding_step` calls in one step with `draws` latent draws (1 at T = 1, the pool
    size below), each counted on its own (per step)."""
    from transformers.cache_utils import DynamicCache

    cfg = model.config
    cache = DynamicCache(config=cfg)
    mask = torch.ones_like(prompt)
    hidden = model(input_ids=prompt, attention_mask=mask, cache=cache).last_hidden_state[:, -1]
    chunk = _random_rows(model, 1, cfg.chunk_size, seed + 1)
    mask = torch.cat([mask, torch.ones_like(chunk)], dim=1)
    backbone, out = count_flops(lambda: model(input_ids=chunk, attention_mask=mask, cache=cache), model)
    noise = torch.rand(1, draws, cfg.noise_size, generator=torch.Generator().manual_seed(seed)) - 0.5
    head, latents = count_flops(lambda: model.sample_latents(out.last_hidden_state[:, -1], noise.to(hidden)), model)
    # T = 1 decodes the single draw [B, l]; the pool decodes all of them [B, S, l] (the same products per draw).
    decoder, _ = count_flops(lambda: model.autoencoder.decode(latents[:, 0] if draws == 1 else latents), model)
    attention = sum(backbone.ops().get(op, 0) for op in _ATTENTION_OPS)
    return {"backbone_weights": backbone.total - attention, "attention_over_context": attention,
            "energy_head": head.total, "autoencoder_decoder": decoder.total}


@torch.no_grad()
def weights_updated(model) -> None:
    """Mark every trainable weight as changed, as an optimizer step does (a no-op in place bumps its version), so
    that work a model caches per weight version (PLM's token-auxiliary scores) is counted as a training step,
    which follows an update, recomputes it."""
    for parameter in model.parameters():
        if parameter.requires_grad:
            parameter.add_(0)


def training_flops_per_token(model, seq_len: int, batch_size: int = 1, seed: int = 0) -> dict:
    """FLOPs of one training step (forward + backward of `model(input_ids=rows, labels=rows).loss`) on
    `batch_size` random rows of `seq_len` tokens, per token of the batch. Parts per token, forward and backward
    apart: the direct children of the model (AR: `model`, `lm_head`; CALM: `model` = backbone, `energy_head`,
    `autoencoder` = the frozen encode) and "loss_and_other" (work done in the top-level forward itself: CALM's
    energy-loss distances). Gradients are cleared afterwards; the model's train/eval mode is restored."""
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len must be an int >= 2, got {seq_len!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if reads_chunks(model) and (seq_len % model.config.chunk_size or seq_len < 2 * model.config.chunk_size):
        raise ValueError(f"seq_len {seq_len} must be a multiple of CALM's chunk_size K = {model.config.chunk_size} "
                         f"and at least 2K (the energy loss predicts chunk i+1 from chunk i)")
    rows = _random_rows(model, batch_size, seq_len, seed)

    def step(backward: bool):
        with torch.random.fork_rng(devices=[]):  # same noise draws in both runs; the caller's RNG is left alone
            torch.manual_seed(seed)
            out = model(input_ids=rows, labels=rows)
            if backward:
                out.loss.backward()

    with model_mode(model, True):
        try:
            # The counter attributes backward work to modules only when the forward ran under the same counter, so the
            # step is counted twice: forward alone, then forward + backward; backward = the difference.
            weights_updated(model)
            forward, _ = count_flops(lambda: step(False), model)
            weights_updated(model)
            both, _ = count_flops(lambda: step(True), model)
        finally:
            model.zero_grad(set_to_none=True)
    tokens = rows.numel()
    root = type(model).__name__
    children = [name for name, _ in model.named_children()]

    def split(count: _Count) -> dict[str, int]:
        values = {name: count.module(f"{root}.{name}") for name in children}
        values["loss_and_other"] = count.total - sum(values.values())
        return values

    fwd, total = split(forward), split(both)
    parts = {"forward": {name: value / tokens for name, value in fwd.items() if value},
             "backward": {name: (total[name] - value) / tokens for name, value in fwd.items()
                          if total[name] - value}}
    return {"family": getattr(model.config, "model_type", "?"),
            "seq_len": seq_len, "batch_size": batch_size, "tokens": tokens, "per_token": both.total / tokens,
            "forward_per_token": forward.total / tokens, "backward_per_token": (both.total - forward.total) / tokens,
            "parts": parts,
            "method": "FlopCounterMode over model(input_ids=rows, labels=rows) and loss.backward() (backward = "
                      "forward+backward count minus forward-only count), eager attention"}


def parameter_counts(model) -> dict:
    """Parameters by component: total, trainable, and (CALM) backbone / energy head / frozen autoencoder; AR:
    without the input embedding and lm_head ("non_embedding")."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    result = {"total": total, "trainable": trainable}
    if reads_chunks(model):
        backbone = sum(p.numel() for p in model.model.parameters())
        result.update(backbone=backbone, backbone_non_embedding=backbone - model.model.embed_tokens.weight.numel(),
                      energy_head=sum(p.numel() for p in model.energy_head.parameters()),
                      autoencoder=sum(p.numel() for p in model.autoencoder.parameters()))
    else:
        embeddings = model.get_input_embeddings().weight.numel()
        head = model.get_output_embeddings()
        tied = head is not None and head.weight is model.get_input_embeddings().weight
        result["non_embedding"] = total - embeddings - (0 if tied or head is None else head.weight.numel())
    return result


# ====================================================================================================================
# FlopCounter: matrix-product FLOPs from the torch functions a call makes, forward and the backward it implies
# ====================================================================================================================

def _product_flops(a_shape, b_shape) -> int:
    """2·m·k·n times the broadcast batch of `a @ b` (torch.matmul's shape rules, 1-D operands included)."""
    a_shape = (1, *a_shape) if len(a_shape) == 1 else tuple(a_shape)
    b_shape = (*b_shape, 1) if len(b_shape) == 1 else tuple(b_shape)
    batch = torch.broadcast_shapes(a_shape[:-2], b_shape[:-2])
    return 2 * math.prod(batch) * a_shape[-2] * a_shape[-1] * b_shape[-1]


def _needs_grad(tensor) -> int:
    return int(isinstance(tensor, torch.Tensor) and tensor.requires_grad)


def _matmul_rule(a, b, *args, **kwargs) -> tuple[int, int]:
    # Backward: one product of the same size per operand that requires a gradient (dA = dC·Bᵀ, dB = Aᵀ·dC).
    flops = _product_flops(a.shape, b.shape)
    return flops, flops * (_needs_grad(a) + _needs_grad(b))


def _added_matmul_rule(bias, a, b, *args, **kwargs) -> tuple[int, int]:
    return _matmul_rule(a, b)  # addmm / baddbmm: the added term is elementwise


def _linear_rule(x, weight, bias=None, *args, **kwargs) -> tuple[int, int]:
    flops = 2 * (x.numel() // x.shape[-1]) * weight.shape[0] * weight.shape[1]
    return flops, flops * (_needs_grad(x) + _needs_grad(weight))


def _sdpa_rule(q, k, v, *args, **kwargs) -> tuple[int, int]:
    """q·kᵀ and p·v over every (query, key) pair, masked or not (a mask does not skip work on these kernels), for
    q's heads (grouped keys are shared, not cheaper per head). Backward: dq and dk from the scores' gradient, and dp
    (when q or k needs one) and dv from the output's."""
    batch_heads, queries, keys = math.prod(q.shape[:-2]), q.shape[-2], k.shape[-2]
    scores = 2 * batch_heads * queries * keys * q.shape[-1]
    values = 2 * batch_heads * queries * keys * v.shape[-1]
    score_grad = _needs_grad(q) + _needs_grad(k)
    return scores + values, scores * score_grad + values * (int(score_grad > 0) + _needs_grad(v))


def _cdist_rule(x1, x2, *args, **kwargs) -> tuple[int, int]:
    flops = _cdist_flops(x1.shape, x2.shape)  # as the product x1·x2ᵀ; each gradient is another such product
    return flops, flops * (_needs_grad(x1) + _needs_grad(x2))


_FUNCTION_RULES = {
    torch.nn.functional.linear: _linear_rule,
    torch.nn.functional.scaled_dot_product_attention: _sdpa_rule,
    torch.cdist: _cdist_rule,
    torch.addmm: _added_matmul_rule, torch.baddbmm: _added_matmul_rule,
    torch.Tensor.addmm: _added_matmul_rule, torch.Tensor.baddbmm: _added_matmul_rule,
    **{fn: _matmul_rule for fn in (torch.matmul, torch.mm, torch.bmm, torch.Tensor.matmul, torch.Tensor.mm,
                                   torch.Tensor.bmm, torch.Tensor.__matmul__)},
    torch.Tensor.__rmatmul__: lambda b, a, *args, **kwargs: _matmul_rule(a, b),  # b.__rmatmul__(a) is a @ b
}


class FlopCounter(TorchFunctionMode):
    """Counts matrix-product FLOPs while active (context manager): `forward` (what ran) and `backward` (what
    `loss.backward()` on the result would add, for products run with grad enabled and operands that require a
    gradient). A multiply-add is 2 FLOPs; elementwise work, reductions and lookups are not counted, as in
    `FlopCounterMode`. Nested functions are seen once: torch runs a mode's handler with the mode switched off."""

    def __init__(self):
        super().__init__()
        self.forward, self.backward = 0, 0

    @property
    def total(self) -> int:
        return self.forward + self.backward

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rule = _FUNCTION_RULES.get(func)
        if rule is not None and all(isinstance(arg, torch.Tensor) for arg in args[:2]):  # else torch raises below
            forward, backward = rule(*args, **kwargs)
            self.forward += forward
            self.backward += backward if torch.is_grad_enabled() else 0
        return func(*args, **kwargs)


def counted_training_flops(model, rows: torch.Tensor) -> dict:
    """FLOPs of the training step on `rows` (forward + the backward of `model(input_ids=rows, labels=rows).loss`),
    from the forward alone, as after an optimizer update (`weights_updated`); per token of `rows`. The model's mode
    and the caller's RNG are left as they were."""
    with model_mode(model, True):
        weights_updated(model)
        with torch.random.fork_rng(devices=[]), FlopCounter() as counter:
            model(input_ids=rows, labels=rows)
    tokens = rows.numel()
    return {"per_token": counter.total / tokens, "forward_per_token": counter.forward / tokens,
            "backward_per_token": counter.backward / tokens, "tokens": tokens,
            "method": "FlopCounter (torch-function rules) over the training forward; backward from each product's "
                      "operands that require a gradient"}


def compare_with_flop_counter_mode(model, rows: torch.Tensor, prompt_len: int = 16, new_tokens: int = 8) -> dict:
    """`FlopCounter` next to torch's `FlopCounterMode` on the same work: one training step on `rows` (the reference
    counts the real backward, eager attention; ours the forward alone, SDPA) and one `generate()` of `new_tokens`
    from the first `prompt_len` tokens of each row, same seeds. Returns {"training": (reference, ours), "generate":
    (reference, ours), "same_generation": whether both generate() calls gave the same tokens}."""
    def step():
        torch.manual_seed(0)
        model(input_ids=rows, labels=rows).loss.backward()

    with model_mode(model, True):
        try:
            weights_updated(model)
            reference_step, _ = count_flops(step, model)
            model.zero_grad(set_to_none=True)
            torch.manual_seed(0)
            ours_step = counted_training_flops(model, rows)["per_token"] * rows.numel()
            prompt = rows[:, :prompt_len]
            options = {"attention_mask": torch.ones_like(prompt), "max_new_tokens": new_tokens,
                       "min_new_tokens": new_tokens}
            with model_mode(model, False), torch.no_grad():
                torch.manual_seed(1)
                reference_generate, expected = count_flops(lambda: model.generate(prompt, **options), model)
                torch.manual_seed(1)
                with FlopCounter() as counter:
                    out = model.generate(prompt, **options)
        finally:
            model.zero_grad(set_to_none=True)
    return {"training": (reference_step.total, ours_step), "generate": (reference_generate.total, counter.forward),
            "same_generation": bool(torch.equal(out, expected)), "backward": counter.backward}
