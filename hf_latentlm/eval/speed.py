"""Generation speed: wall-clock tokens/s including prefill, and model calls per generated token.

Model calls are counted with a forward hook on the model itself, so the count is honest for any decoding scheme (one
call per token for AR, fewer for multi-token families). Warm-up runs are discarded; the reported figure is the median
of `repeats` timed runs. Absolute tokens/s drift on shared machines, so a family's speed is reported as a ratio to the
AR baseline (`speed_versus_baseline`): both models timed on the same prompts, with the same settings, in one process.
"""

from __future__ import annotations

import copy
import functools
import statistics
import time
from contextlib import contextmanager, nullcontext

import torch
from transformers import CompileConfig

from ..modeling.modeling_backbone import training_hooks
from ..modeling.sampling import model_mode
from .flops import FlopCounter
from .sampling import unbiased_sampling_kwargs


# generate() options of compiled decoding: transformers' `compile_config`, and `cache_implementation` ("static": the
# fixed-size cache its own generate() compiles with).
COMPILE_OPTIONS = ("compile_config", "cache_implementation")


class CallCounter:
    """Counts calls of `module.forward` while active (context manager). A model that runs several networks names
    them in `counted_modules()` (Cola DLM: DiT, VAE encoder, VAE decoder); each of their calls counts."""

    def __init__(self, module: torch.nn.Module):
        self.module, self.calls, self._handles = module, 0, []

    def _hook(self, *_):
        self.calls += 1

    def __enter__(self):
        self.calls = 0
        modules = training_hooks(self.module).counted_modules()
        self._handles = [m.register_forward_hook(self._hook) for m in modules]
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` before a clock is read: CUDA kernels run asynchronously, so a timer
    around a call would otherwise stop while its work is still queued. Nothing to wait for on a CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def timed_generate(model, prompts: torch.Tensor, seed: int, kwargs: dict):
    """One seeded `generate()` of `prompts`: (seconds, model calls, new tokens per row, calls by network or None)."""
    device = prompts.device
    torch.manual_seed(seed)
    with CallCounter(model) as counter:
        synchronize(device)
        start = time.perf_counter()
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), **kwargs)
        synchronize(device)
        elapsed = time.perf_counter() - start
    sequences = out.sequences if hasattr(out, "sequences") else out
    return elapsed, counter.calls, sequences.shape[1] - prompts.shape[1], getattr(out, "calls_by_network", None)


def measure_generation_speed(model, prompts: torch.Tensor, max_new_tokens: int = 64, repeats: int = 3,
                             seed: int = 0, generate_kwargs: dict | None = None) -> dict:
    """Time `model.generate` on a batch of equal-length prompts [B, T] (B rows generate in parallel).

    Returns tokens_per_s (new tokens over all rows / median wall time), model_calls_per_token
    (forward calls / new tokens per row), the per-run times and the batch size, and the call's matrix-product FLOPs
    per generated token (`FlopCounter` over the warm-up run, which the timed runs repeat) with the achieved FLOP/s.
    `generate_kwargs`: extra `generate()` options, merged over the unbiased-sampling defaults.
    """
    if prompts.dim() != 2 or prompts.shape[0] == 0:
        raise ValueError(f"prompts must be a non-empty [batch, length] tensor, got {tuple(prompts.shape)}")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    prompts = prompts.to(next(model.parameters()).device)
    kwargs = unbiased_sampling_kwargs(max_new_tokens, generate_kwargs)
    run = functools.partial(timed_generate, model, prompts, seed, kwargs)  # kwargs as updated below
    # Two warm-up runs. The first does a model's one-time work (allocator, lazy initialisation, PLM's token-auxiliary
    # scores, computed once per model), which is no cost of a generated token; the second is counted, and the timed
    # runs repeat its work exactly (same seed). A compiled call is counted uncompiled (the same arithmetic; the
    # counter sees torch functions, which a compiled graph no longer calls), then warmed up once more compiled: that
    # first compiled call, compiling included, is timed apart.
    compile_options = {name: kwargs.pop(name) for name in COMPILE_OPTIONS if name in kwargs}
    with model_mode(model, False):
        run()
        with FlopCounter() as flops:
            run()
        first_call_s = None
        if compile_options:
            kwargs.update(compile_options)
            first_call_s = run()[0]
        runs = [run() for _ in range(repeats)]
    times = [r[0] for r in runs]
    calls, new_tokens, by_network = runs[-1][1:]
    median = statistics.median(times)
    result = {
        "batch_size": prompts.shape[0],
        "prompt_len": prompts.shape[1],
        "new_tokens_per_row": new_tokens,
        "tokens_per_s": prompts.shape[0] * new_tokens / median,
        "model_calls_per_token": calls / max(new_tokens, 1),
        "median_s": median,
        "times_s": times,
        # Matrix-product FLOPs of the whole call (prefill and every network) per generated token, and per second.
        "flops_per_token": flops.forward / (prompts.shape[0] * max(new_tokens, 1)),
    }
    result["achieved_flops_per_s"] = result["flops_per_token"] * result["tokens_per_s"]
    if first_call_s is not None:
        result["first_call_s"] = first_call_s
    if by_network:  # a family with several networks, asked with return_dict_in_generate=True (first row's counts)
        result["calls_per_token_by_network"] = {name: int(n[0]) / max(new_tokens, 1) for name, n in by_network.items()}
    return result


def speed_versus_baseline(model, baseline, prompts: torch.Tensor, batch_sizes: tuple[int, ...] | None = None,
                          max_new_tokens: int = 64, repeats: int = 3, seed: int = 0,
                          generate_kwargs: dict | None = None, baseline_generate_kwargs: dict | None = None) -> dict:
    """Generation speed of `model` and of `baseline` on the same prompts, with the same settings, and their ratio.

    For each batch size b (default: all rows of `prompts`) both models generate `max_new_tokens` for the first b
    prompts (`measure_generation_speed`; each with its own `generate_kwargs`, merged over the unbiased-sampling
    defaults). Returns {"model": {"batch_<b>": speed}, "baseline": {...}, "ratio": {"batch_<b>": model tokens/s
    / baseline tokens/s}, "flops_per_s_ratio": {"batch_<b>": model achieved FLOP/s / baseline's}, "num_parameters":
    {"model": n, "baseline": n}}. A model compared with itself under the same options is timed once (ratio 1): a
    second timing would only measure noise.
    """
    batch_sizes = batch_sizes or (len(prompts),)
    if max(batch_sizes) > len(prompts):
        raise ValueError(f"batch sizes {tuple(batch_sizes)} need {max(batch_sizes)} prompts, got {len(prompts)}")
    same = model is baseline and (generate_kwargs or {}) == (baseline_generate_kwargs or {})
    result = {"model": {}, "baseline": {}, "ratio": {}, "flops_per_s_ratio": {},
              "num_parameters": {name: sum(p.numel() for p in m.parameters())
                                 for name, m in (("model", model), ("baseline", baseline))}}
    for b in batch_sizes:
        key = f"batch_{b}"
        result["model"][key] = measure_generation_speed(model, prompts[:b], max_new_tokens, repeats, seed,
                                                        generate_kwargs)
        result["baseline"][key] = result["model"][key] if same else measure_generation_speed(
            baseline, prompts[:b], max_new_tokens, repeats, seed, baseline_generate_kwargs)
        result["ratio"][key] = result["model"][key]["tokens_per_s"] / result["baseline"][key]["tokens_per_s"]
        result["flops_per_s_ratio"][key] = (result["model"][key]["achieved_flops_per_s"]
                                            / result["baseline"][key]["achieved_flops_per_s"])
    return result


def decoding_compile_config(device) -> CompileConfig:
    """The `compile_config` of compiled decoding on `device`: inductor with CUDA graphs on a GPU ("reduce-overhead",
    transformers' default), plain inductor elsewhere. It also lets transformers' own generate() compile on a CPU,
    which it otherwise skips (its `_compile_all_devices` switch)."""
    config = CompileConfig(mode="reduce-overhead" if torch.device(device).type == "cuda" else "default")
    config._compile_all_devices = True
    return config


def compiled_decoding_speed(model, prompts: torch.Tensor, batch_sizes: tuple[int, ...] = (1, 8),
                            max_new_tokens: int = 64, repeats: int = 3, seed: int = 0,
                            static_cache: bool = False) -> dict:
    """`measure_generation_speed` of `model` as it is ("eager") and with its decoding compiled ("compiled":
    `decoding_compile_config`, plus transformers' static cache when `static_cache`, as its generate() needs for
    compiling) for the first b prompts, b in `batch_sizes`, with the compiled/eager tokens/s ratio. The compiled rows
    carry `first_call_s`, the wall time of the first compiled call, compiling included."""
    if max(batch_sizes) > len(prompts):
        raise ValueError(f"batch sizes {tuple(batch_sizes)} need {max(batch_sizes)} prompts, got {len(prompts)}")
    compiled_options = {"compile_config": decoding_compile_config(next(model.parameters()).device)}
    if static_cache:
        compiled_options["cache_implementation"] = "static"
    result = {"eager": {}, "compiled": {}, "compiled_over_eager": {}}
    for b in batch_sizes:
        key = f"batch_{b}"
        result["eager"][key] = measure_generation_speed(model, prompts[:b], max_new_tokens, repeats, seed)
        result["compiled"][key] = measure_generation_speed(model, prompts[:b], max_new_tokens, repeats, seed,
                                                           compiled_options)
        result["compiled_over_eager"][key] = (result["compiled"][key]["tokens_per_s"]
                                              / result["eager"][key]["tokens_per_s"])
    return result


def fresh_baseline(model, preset: str, tokenizer):
    """An untrained baseline-family model of `preset` on `model`'s device and dtype. With EOS ignored every run
    generates the same number of tokens whatever the weights, so it times exactly like a trained one."""
    from ..families import BASELINE_FAMILY, build_model

    reference = next(model.parameters())
    return build_model(BASELINE_FAMILY, preset, tokenizer).to(device=reference.device, dtype=reference.dtype).eval()


def speed_versus_fresh_baseline(model, preset, tokenizer, prompts: torch.Tensor, **options) -> dict:
    """`speed_versus_baseline` against `fresh_baseline(model, preset, tokenizer)`. `options`: those of
    `speed_versus_baseline` (batch_sizes, max_new_tokens, repeats, seed, generate_kwargs, ...)."""
    return speed_versus_baseline(model, fresh_baseline(model, preset, tokenizer), prompts, **options)


def alternating_speed_ratio(model, baseline, prompts: torch.Tensor, pairs: int = 3, max_new_tokens: int = 64,
                            seed: int = 0, generate_kwargs: dict | None = None) -> dict:
    """tokens/s of `model` over `baseline`'s, timed in `pairs` alternating pairs (model, baseline, model, ...) after
    one warm-up each, so that a machine whose speed drifts slows both alike. Returns each side's median tokens/s and
    tokens per call, the median ratio with its range over the pairs, and `spread`: the largest ratio of one side's
    slowest run to its fastest (1.0 for a steady machine)."""
    if pairs < 1:
        raise ValueError(f"pairs must be at least 1, got {pairs}")
    sides = {"model": (model, unbiased_sampling_kwargs(max_new_tokens, generate_kwargs)),
             "baseline": (baseline, unbiased_sampling_kwargs(max_new_tokens))}
    runs = {name: [] for name in sides}
    with model_mode(model, False), model_mode(baseline, False):
        for repeat in range(pairs + 1):  # the first pair warms up
            for name, (m, kwargs) in sides.items():
                run = timed_generate(m, prompts.to(next(m.parameters()).device), seed, kwargs)
                if repeat:
                    runs[name].append(run)
    result = {}
    for name, timed in runs.items():
        times = [run[0] for run in timed]
        new_tokens = timed[-1][2]
        result[name] = {"tokens_per_s": prompts.shape[0] * new_tokens / statistics.median(times),
                        "tokens_per_call": new_tokens / max(timed[-1][1], 1), "times_s": times}
    ratios = [b[0] / m[0] for m, b in zip(runs["model"], runs["baseline"])]
    result.update(ratio=statistics.median(ratios), ratio_range=(min(ratios), max(ratios)), pairs=pairs,
                  spread=max(max(r["times_s"]) / min(r["times_s"]) for r in (result["model"], result["baseline"])))
    return result


@contextmanager
def timing_method(obj, name: str, total: list[float]):
    """While active, calls of `obj.<name>` add their wall time to `total[0]`."""
    original = getattr(obj, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - start

    setattr(obj, name, timed)
    try:
        yield
    finally:
        delattr(obj, name)  # back to the class's method


def training_step_time(model, rows: torch.Tensor, steps: int, batch_size: int, optimizer,
                       timed_method: str | None = None) -> dict:
    """Median seconds per optimizer step of `model` on consecutive batches of `rows` (the first step is a warm-up),
    tokens/s, and optionally the share of each step spent inside `model.<timed_method>`."""
    if len(rows) < (steps + 1) * batch_size:
        raise ValueError(f"need {(steps + 1) * batch_size} rows for {steps} timed steps, got {len(rows)}")
    model.train()
    spent = [0.0]
    times, shares = [], []
    with timing_method(model, timed_method, spent) if timed_method else nullcontext():
        for step in range(steps + 1):
            batch = rows[step * batch_size:(step + 1) * batch_size]
            spent[0] = 0.0
            synchronize(batch.device)
            start = time.perf_counter()
            model(input_ids=batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            synchronize(batch.device)
            if step:
                times.append(time.perf_counter() - start)
                shares.append(spent[0] / times[-1])
    median = statistics.median(times)
    result = {"seconds_per_step": median, "tokens_per_s": batch.numel() / median}
    if timed_method:
        result[f"{timed_method}_share"] = statistics.fmean(shares)
    return result


def fresh_training_step_time(model, rows: torch.Tensor, steps: int, batch_size: int,
                             timed_method: str | None = None) -> dict:
    """`training_step_time` of a copy of `model` (its own configuration; step time does not depend on the weights)
    with a fresh optimizer of the training loop, from seed 0. `model` itself is left as it was."""
    from ..training.loop import TrainConfig, make_optimizer

    torch.manual_seed(0)
    model = copy.deepcopy(model)
    optimizer = make_optimizer(model, TrainConfig().resolved())
    return training_step_time(model, rows, steps, batch_size, optimizer, timed_method)
