# Copyright 2025 The hf-latentlm authors. Licensed under the Apache License, Version 2.0.
"""Shared latent-flow core for the latent-diffusion LM families (Cola DLM, AURORA-LM): training-time samplers of
the flow time, ODE samplers in the style of diffusers' schedulers, helpers for clean-latent (x0) predictions,
clean-condition repainting, classifier-free guidance and the timestep embedding.

Convention (rectified flow): x_t = (1 - t) * x0 + t * x1 with x0 the clean latent (data) and x1 ~ N(0, I) the noise,
so the target velocity is v = dx_t/dt = x1 - x0. Sampling integrates from t = 1 (noise) down to t = 0 (data).

This file is copied into Hub checkpoints as remote code, so it imports only torch and the standard library.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["logit_normal_times", "shift_times", "tan_shift_times", "LogitNormalTimeSampler", "ShiftedTimeSampler",
           "TanShiftTimeSampler", "make_time_sampler", "FlowMatchEulerSampler", "FlowMatchHeunSampler",
           "x0_to_velocity", "euler_step_from_x0", "repaint", "classifier_free_guidance",
           "sinusoidal_timestep_embedding", "TimestepEmbedding"]


# ---------------------------------------------------------------------------------------------------------------------
# Training-time samplers of t
# ---------------------------------------------------------------------------------------------------------------------


def _default_device(device, generator: Optional[torch.Generator]):
    # A CUDA generator can only draw on CUDA: follow it when no device is given.
    if device is None and generator is not None:
        return generator.device
    return device


def _wide_float(device) -> torch.dtype:
    # float64 for exact comparisons and the tan pole; MPS has no float64.
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


def _clamp_inside_unit_interval(t: torch.Tensor) -> torch.Tensor:
    # Keep float32 times strictly inside (0, 1) so that x_t is never exactly the data or exactly the noise.
    finfo = torch.finfo(torch.float32)
    return t.clamp(min=finfo.tiny, max=1.0 - finfo.eps / 2)


def logit_normal_times(shape, loc: float = 0.0, scale: float = 1.0, generator: Optional[torch.Generator] = None,
                       device=None) -> torch.Tensor:
    """Flow times t = sigmoid(loc + scale * z), z ~ N(0, 1): float32 tensor of `shape` (int or tuple), in (0, 1)
    (SD3's logit-normal sampling: loc > 0 puts more mass near the noise end). device: default the generator's."""
    z = torch.randn(shape, generator=generator, device=_default_device(device, generator), dtype=torch.float32)
    t = torch.sigmoid(loc + scale * z)
    # float32 sigmoid rounds to exactly 1 for logits above ~17 (and to 0 far below).
    return _clamp_inside_unit_interval(t)


def shift_times(t, shift: float) -> torch.Tensor:
    """SD3-style time shift: shift * t / (1 + (shift - 1) * t), elementwise on times t in [0, 1]: a monotone map of
    [0, 1] onto itself; shift > 1 moves times toward 1 (more noise), shift = 1 is the identity."""
    if not shift > 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    return shift * t / (1 + (shift - 1) * t)


def _check_tan_shift(shift) -> float:
    # Finite as well as positive: d = inf would give inf / inf = NaN at u = 0.
    try:
        value = float(shift)
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(shift, bool) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"shift must be a finite number > 0, got {shift!r}")
    return value


def tan_shift_times(u, shift: float) -> torch.Tensor:
    """AURORA-LM's "tan-d" noise schedule σ(u; d) = d·tan(πu/2) / (1 + d·tan(πu/2)), elementwise on u (tensor or
    number, values in [0, 1]) with d = shift > 0 -> float32 tensor of u's shape, values in [0, 1].

    Monotone increasing with σ(0) = 0 and σ(1) = 1 exactly (the pole of tan gives the limit, not NaN). It equals the
    SD3 shift of the d = 1 schedule, shift_times(σ(u; 1), d). With u ~ U[0, 1), Pr(σ > a) = 1 - (2/π)·atan(a /
    ((1 - a)·d)).
    """
    shift = _check_tan_shift(shift)
    u = torch.as_tensor(u)
    theta = (math.pi / 2) * u.to(_wide_float(u.device))
    sine = torch.sin(theta)
    # d·tan/(1 + d·tan) = d·sin/(cos + d·sin): no overflow near the pole; at u = 1 set 1 exactly because cos(π/2)
    # rounds to a tiny nonzero value (negative in float32).
    sigma = shift * sine / (torch.cos(theta) + shift * sine)
    sigma = torch.where(u == 1, torch.ones_like(sigma), sigma)
    return sigma.to(torch.float32)


class LogitNormalTimeSampler:
    """Draws training times t = sigmoid(loc + scale * N(0, 1)) (see `logit_normal_times`)."""

    def __init__(self, loc: float = 0.0, scale: float = 1.0):
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        self.loc = float(loc)
        self.scale = float(scale)

    def sample(self, shape, generator: Optional[torch.Generator] = None, device=None) -> torch.Tensor:
        """shape: int or tuple -> float32 times of that shape in (0, 1)."""
        return logit_normal_times(shape, self.loc, self.scale, generator=generator, device=device)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(loc={self.loc}, scale={self.scale})"


class ShiftedTimeSampler:
    """Draws training times t = shift_times(u, shift), u ~ U[0, 1); shift = 1 is uniform."""

    def __init__(self, shift: float = 1.0):
        if not shift > 0:
            raise ValueError(f"shift must be > 0, got {shift}")
        self.shift = float(shift)

    def sample(self, shape, generator: Optional[torch.Generator] = None, device=None) -> torch.Tensor:
        """shape: int or tuple -> float32 times of that shape in [0, 1)."""
        u = torch.rand(shape, generator=generator, device=_default_device(device, generator), dtype=torch.float32)
        return shift_times(u, self.shift)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shift={self.shift})"


class TanShiftTimeSampler:
    """Draws training noise levels σ = tan_shift_times(u, shift), u ~ U[0, 1) (AURORA-LM's "tan-d", paper d = 7).

    shift: d > 0; larger d puts more mass at high noise (Pr(σ > 0.7) = 0.258 / 0.579 / 0.722 / 0.795 for
    d = 1 / 3 / 5 / 7).
    """

    def __init__(self, shift: float = 7.0):
        self.shift = _check_tan_shift(shift)

    def sample(self, shape, generator: Optional[torch.Generator] = None, device=None) -> torch.Tensor:
        """shape: int or tuple -> float32 noise levels of that shape in (0, 1)."""
        u = torch.rand(shape, generator=generator, device=_default_device(device, generator), dtype=torch.float32)
        # u = 0 gives σ = 0, and u near 1 (or a large d) rounds σ to 1 in float32.
        return _clamp_inside_unit_interval(tan_shift_times(u, self.shift))

    def high_noise_mass(self, threshold: float = 0.7) -> float:
        """Exact Pr(σ > threshold) of the continuous schedule: 1 - (2/π)·atan(threshold / ((1 - threshold)·d)).

        threshold in [0, 1] (1 gives 0). The paper compares schedules by this mass at threshold 0.7.
        """
        if not 0 <= threshold <= 1:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        if threshold == 1:
            return 0.0
        return 1.0 - (2 / math.pi) * math.atan(threshold / ((1 - threshold) * self.shift))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shift={self.shift})"


def make_time_sampler(kind: str, **kwargs):
    """Build a training-time sampler by name: "logit_normal" (kwargs loc, scale), "shifted" (kwarg shift),
    "uniform" (no kwargs; a shifted sampler with shift 1) or "tan" (kwarg shift: AURORA-LM's tan-d schedule,
    `TanShiftTimeSampler`). Raises ValueError for any other kind."""
    if kind == "logit_normal":
        return LogitNormalTimeSampler(**kwargs)
    if kind == "shifted":
        return ShiftedTimeSampler(**kwargs)
    if kind == "uniform":
        if kwargs:
            raise TypeError(f"the uniform time sampler takes no arguments, got {sorted(kwargs)}")
        return ShiftedTimeSampler(shift=1.0)
    if kind == "tan":
        return TanShiftTimeSampler(**kwargs)
    raise ValueError(f"unknown time sampler kind {kind!r}; expected 'logit_normal', 'shifted', 'uniform' or 'tan'")


# ---------------------------------------------------------------------------------------------------------------------
# ODE samplers
# ---------------------------------------------------------------------------------------------------------------------


def repaint(sample: torch.Tensor, known: Optional[torch.Tensor], known_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Clean-condition repaint: put the known clean values back where `known_mask` is True. known and the bool
    known_mask broadcast to `sample` (e.g. [B, Q, 1] against [B, Q, D]); both None returns `sample` itself. The result
    keeps `sample`'s dtype."""
    if known is None and known_mask is None:
        return sample
    if known is None or known_mask is None:
        raise ValueError("known and known_mask must be given together (or both None)")
    if known_mask.dtype != torch.bool:
        raise ValueError(f"known_mask must be a bool tensor, got {known_mask.dtype}")
    # Cast so a float32 condition does not promote a bf16 state.
    return torch.where(known_mask, known.to(sample.dtype), sample)


def _check_num_steps(num_steps) -> int:
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be an integer >= 1, got {num_steps!r}")
    return num_steps


class FlowMatchEulerSampler:
    """Euler ODE integration of a velocity field from t=1 (noise) to t=0 (data) on a uniform grid, optionally shifted.

    num_steps: number of integration steps S (>= 1); shift: SD3 time shift of the grid (> 0, 1 = uniform grid).
    After construction (or `set_timesteps`), `timesteps` is a float32 tensor [S + 1] from 1.0 down to 0.0.
    """

    def __init__(self, num_steps: int = 16, shift: float = 1.0):
        self.shift = float(shift)  # checked by `shift_times`
        self.num_steps = _check_num_steps(num_steps)
        self.set_timesteps()

    def set_timesteps(self, num_steps: Optional[int] = None, device=None) -> None:
        """Build `self.timesteps` = shift_times(1 - i/S, shift), i = 0..S (float32, strictly decreasing) on `device`;
        num_steps: a new step count S, or None to keep the current one."""
        if num_steps is not None:
            self.num_steps = _check_num_steps(num_steps)
        steps = self.num_steps
        # (S - i) / S in float64 is exact at both ends and correctly rounded inside; the shift keeps 1 -> 1, 0 -> 0.
        grid = torch.arange(steps, -1, -1, dtype=torch.float64) / steps
        timesteps = shift_times(grid, self.shift).to(torch.float32)
        if not bool((timesteps[1:] < timesteps[:-1]).all()):
            raise ValueError(f"num_steps={steps} with shift={self.shift} gives repeated float32 timesteps")
        self.timesteps = timesteps.to(device)

    @classmethod
    def evaluations(cls, num_steps: int) -> int:
        """Number of velocity_fn calls `solve` makes with `num_steps` steps."""
        return _check_num_steps(num_steps)

    def step(self, velocity: torch.Tensor, step_index: int, sample: torch.Tensor) -> torch.Tensor:
        """One Euler step from timesteps[step_index] to timesteps[step_index + 1]: sample + (t_{i+1} - t_i) * velocity
        (the 0-dim step size does not promote their dtype)."""
        if not 0 <= step_index < self.num_steps:
            raise IndexError(f"step_index must be in [0, {self.num_steps}), got {step_index}")
        dt = self.timesteps[step_index + 1] - self.timesteps[step_index]
        return sample + dt * velocity

    def previous_timestep(self, t: torch.Tensor) -> torch.Tensor:
        """Where this sampler's next Euler step goes from time t: the largest grid time strictly below t.

        t: tensor [...] of times in (0, 1], not necessarily on the grid -> tensor of the same shape, dtype and device.
        A t exactly on the grid goes to the next grid point down (t = 1 -> timesteps[1]); t at or below the smallest
        positive grid time goes to 0. This is Prev_S(t) of AURORA-LM's self-trajectory consistency. The comparison
        is exact (in float64); the result is then rounded to t's dtype, so pass float32 times (bf16 can round a
        fine grid's neighbour back onto t).
        """
        wide = _wide_float(t.device)
        ascending = self.timesteps.flip(0).to(device=t.device, dtype=wide)  # 0.0 first, 1.0 last
        # First index with grid >= t; the one before it is the largest grid time < t (index 0, time 0, for t <= 0).
        index = torch.searchsorted(ascending, t.to(wide).reshape(-1), right=False)
        previous = ascending[(index - 1).clamp(min=0)]
        return previous.reshape(t.shape).to(t.dtype)

    def solve(self, velocity_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], noise: torch.Tensor,
              known: Optional[torch.Tensor] = None, known_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Integrate from `noise` (the state at t = 1) to t = 0 and return the final state. velocity_fn(x, t [0-dim
        float32]) -> velocity shaped like x. known, known_mask: optional clean condition (`repaint`), re-imposed
        before every velocity call and on the result, so the field sees the known values and they come out exactly."""
        x = noise
        for i in range(self.num_steps):
            x = repaint(x, known, known_mask)
            x = self.step(velocity_fn(x, self.timesteps[i]), i, x)
        return repaint(x, known, known_mask)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_steps={self.num_steps}, shift={self.shift})"


class FlowMatchHeunSampler(FlowMatchEulerSampler):
    """Heun (2nd-order) integration on the same grid as `FlowMatchEulerSampler`: an Euler predictor, then the step
    with the average of the velocities at both ends. The last step (to t = 0) is plain Euler, as in EDM: the field is
    never trained at exactly t = 0, and one Euler step there keeps the global error second order.

    `step` stays the single Euler step; `solve` runs Heun and calls velocity_fn 2 * S - 1 times.
    """

    @classmethod
    def evaluations(cls, num_steps: int) -> int:
        return 2 * _check_num_steps(num_steps) - 1

    def solve(self, velocity_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], noise: torch.Tensor,
              known: Optional[torch.Tensor] = None, known_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Same contract as `FlowMatchEulerSampler.solve`; the predictor state is repainted too, so every call of
        velocity_fn sees the known values."""
        x = noise
        for i in range(self.num_steps):
            x = repaint(x, known, known_mask)
            velocity = velocity_fn(x, self.timesteps[i])
            predicted = self.step(velocity, i, x)
            if i == self.num_steps - 1:
                x = predicted
            else:
                predicted = repaint(predicted, known, known_mask)
                x = self.step((velocity + velocity_fn(predicted, self.timesteps[i + 1])) / 2, i, x)
        return repaint(x, known, known_mask)


# ---------------------------------------------------------------------------------------------------------------------
# Clean-latent (x0) predictions
# ---------------------------------------------------------------------------------------------------------------------


def x0_to_velocity(sample: torch.Tensor, x0: torch.Tensor, t) -> torch.Tensor:
    """Velocity implied by a clean-latent prediction x0 of the state `sample` = x_t: v = (sample - x0) / t, since
    x_t = x0 + t * (x1 - x0). t: a number or a tensor broadcastable to sample, > 0. Returns sample's dtype."""
    return ((sample - x0) / t).to(sample.dtype)


def euler_step_from_x0(sample: torch.Tensor, x0: torch.Tensor, t, t_next) -> torch.Tensor:
    """One Euler step from t (> 0) to t_next with the velocity of a clean-latent prediction, written in x0 form:
    (t_next / t) * sample + (1 - t_next / t) * x0, i.e. sample + (t_next - t) * x0_to_velocity(sample, x0, t).
    Exact at both ends (t_next = 0 gives x0, t_next = t gives sample); the result has sample's dtype."""
    ratio = t_next / t
    return (ratio * sample + (1 - ratio) * x0).to(sample.dtype)


def classifier_free_guidance(conditional: torch.Tensor, unconditional: torch.Tensor, scale: float) -> torch.Tensor:
    """unconditional + scale * (conditional - unconditional); scale 1 returns `conditional` itself (no rounding)."""
    if scale == 1:
        return conditional
    return unconditional + scale * (conditional - unconditional)


# ---------------------------------------------------------------------------------------------------------------------
# Timestep embedding
# ---------------------------------------------------------------------------------------------------------------------


def sinusoidal_timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal features of times t [...] -> float32 [..., dim]: cat(cos(t * f), sin(t * f)) with f_i =
    max_period^(-i / half), half = dim // 2 (an odd dim gets a zero last column); float32 whatever t's dtype (bf16
    times would collide)."""
    if dim < 1:
        raise ValueError(f"dim must be >= 1, got {dim}")
    half = dim // 2
    exponent = torch.arange(half, dtype=torch.float32, device=t.device) / half
    freqs = torch.exp(-math.log(max_period) * exponent)
    angles = t.to(torch.float32)[..., None] * freqs
    embedding = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)
    if dim % 2:
        embedding = F.pad(embedding, (0, 1))
    return embedding


class TimestepEmbedding(nn.Module):
    """t in [0,1] -> conditioning vector [..., hidden_size]: sinusoidal(t * time_scale, frequency_size) -> Linear ->
    SiLU -> Linear. time_scale spreads times in [0, 1] over the periods the frequencies are laid out for (DiT: 1000)."""

    def __init__(self, hidden_size: int, frequency_size: int = 256, time_scale: float = 1000.0,
                 max_period: float = 10000.0):
        super().__init__()
        self.frequency_size = frequency_size
        self.time_scale = time_scale
        self.max_period = max_period
        self.linear_1 = nn.Linear(frequency_size, hidden_size)
        self.linear_2 = nn.Linear(hidden_size, hidden_size)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """t [...] -> [..., hidden_size] in the dtype of the linear weights."""
        features = sinusoidal_timestep_embedding(t.to(torch.float32) * self.time_scale, self.frequency_size,
                                                 self.max_period)
        return self.linear_2(F.silu(self.linear_1(features.to(self.linear_1.weight.dtype))))

    def extra_repr(self) -> str:
        return f"frequency_size={self.frequency_size}, time_scale={self.time_scale}, max_period={self.max_period}"
