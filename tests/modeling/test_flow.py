"""Latent-flow core (modeling/flow.py): samplers against closed-form flows and hand-computed grids, the order of the
ODE solvers from error ratios, time samplers against their distributions, and (when installed) diffusers' Euler
scheduler."""

import itertools
import math

import numpy as np
import pytest
import torch

from hf_latentlm.modeling.flow import (
    FlowMatchEulerSampler,
    FlowMatchHeunSampler,
    LogitNormalTimeSampler,
    ShiftedTimeSampler,
    TanShiftTimeSampler,
    TimestepEmbedding,
    classifier_free_guidance,
    euler_step_from_x0,
    logit_normal_times,
    make_time_sampler,
    repaint,
    shift_times,
    sinusoidal_timestep_embedding,
    tan_shift_times,
    x0_to_velocity,
)

SAMPLERS = [FlowMatchEulerSampler, FlowMatchHeunSampler]


# --- ODE samplers ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampler_class", SAMPLERS)
@pytest.mark.parametrize("num_steps,shift", [(1, 1.0), (3, 1.0), (7, 3.0), (16, 0.5)])
def test_straight_line_flow_lands_on_the_data(sampler_class, num_steps, shift):
    # Constant field v = x1 - x0: the exact flow is the straight line, and any scheme on any grid from 1 to 0 ends
    # at x1 - 1 * v = x0.
    generator = torch.Generator().manual_seed(0)
    x0, x1 = torch.randn(2, 5, 4, dtype=torch.float64, generator=generator)
    sampler = sampler_class(num_steps=num_steps, shift=shift)
    out = sampler.solve(lambda x, t: x1 - x0, x1)
    torch.testing.assert_close(out, x0, rtol=0, atol=1e-6)
    assert not torch.allclose(x1, x0, atol=1e-1)  # the flow did move


def test_grid_uniform_with_shift_one():
    sampler = FlowMatchEulerSampler(num_steps=8)
    expected = torch.tensor([1 - i / 8 for i in range(9)], dtype=torch.float32)
    assert sampler.timesteps.dtype == torch.float32
    assert torch.equal(sampler.timesteps, expected)  # eighths are exact in float32
    assert torch.equal(sampler.timesteps.diff(), torch.full((8,), -0.125))


def test_grid_matches_the_shift_closed_form():
    # Hand values for shift 3, S = 4: u = 1, 3/4, 1/2, 1/4, 0 -> 3u / (1 + 2u) = 1, 0.9, 0.75, 0.5, 0.
    sampler = FlowMatchHeunSampler(num_steps=4, shift=3.0)
    torch.testing.assert_close(sampler.timesteps, torch.tensor([1.0, 0.9, 0.75, 0.5, 0.0]), rtol=0, atol=1e-7)
    sampler.set_timesteps(num_steps=13)
    expected = [3 * (1 - i / 13) / (1 + 2 * (1 - i / 13)) for i in range(14)]
    t = sampler.timesteps
    assert t.shape == (14,) and sampler.num_steps == 13
    assert t[0].item() == 1.0 and t[-1].item() == 0.0
    assert bool((t.diff() < 0).all())
    torch.testing.assert_close(t, torch.tensor(expected, dtype=torch.float32), rtol=0, atol=1e-7)
    # shift > 1 spends more of the steps near the noise end: the middle grid point sits above 1/2.
    assert FlowMatchEulerSampler(2, shift=3.0).timesteps[1].item() == pytest.approx(0.75)


def test_shift_times_closed_form_and_endpoints():
    t = torch.linspace(0, 1, 11, dtype=torch.float64)
    assert torch.equal(shift_times(t, 1.0), t)
    shifted = shift_times(t, 2.5)
    torch.testing.assert_close(shifted, 2.5 * t / (1 + 1.5 * t))
    assert shifted[0].item() == 0.0 and shifted[-1].item() == 1.0
    assert bool((shifted.diff() > 0).all()) and bool((shifted[1:-1] > t[1:-1]).all())
    assert bool((shift_times(t, 0.4)[1:-1] < t[1:-1]).all())


def euler_exponential(num_steps):
    # Hand computation: Euler on dx/dt = x with step -1/S multiplies by (1 - 1/S) each step.
    return (1 - 1 / num_steps) ** num_steps


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_solver_orders_from_error_ratios(shift):
    # dx/dt = x with x(1) = 1 has x(0) = e^-1. Doubling S halves a first-order error and quarters a second-order one.
    exact = math.exp(-1)

    def error(sampler_class, num_steps):
        out = sampler_class(num_steps, shift=shift).solve(lambda x, t: x, torch.ones(3, dtype=torch.float64))
        return abs(out[0].item() - exact)

    euler = [error(FlowMatchEulerSampler, s) for s in (16, 32, 64)]
    heun = [error(FlowMatchHeunSampler, s) for s in (16, 32, 64)]
    for coarse, fine in zip(euler, euler[1:]):
        assert 1.9 < coarse / fine < 2.15
    for coarse, fine in zip(heun, heun[1:]):
        assert 3.6 < coarse / fine < 4.4
    assert heun[-1] < euler[-1] / 10
    if shift == 1.0:
        assert euler[0] == pytest.approx(abs(euler_exponential(16) - exact), rel=1e-6)


@pytest.mark.parametrize("sampler_class,expected", [(FlowMatchEulerSampler, [1, 2, 5]),
                                                    (FlowMatchHeunSampler, [1, 3, 9])])
def test_evaluations_counts_the_velocity_calls(sampler_class, expected):
    for num_steps, count in zip([1, 2, 5], expected):
        calls = []
        sampler = sampler_class(num_steps)
        sampler.solve(lambda x, t: calls.append(t) or -x, torch.ones(2))
        assert len(calls) == count == sampler.evaluations(num_steps) == sampler_class.evaluations(num_steps)
        assert all(t.dim() == 0 and t.dtype == torch.float32 for t in calls)
        assert calls[0].item() == 1.0 and all(t.item() > 0 for t in calls)  # never asked at t = 0


def test_euler_step_and_dtype():
    sampler = FlowMatchEulerSampler(num_steps=4)
    sample, velocity = torch.tensor([1.0, 2.0]), torch.tensor([4.0, -8.0])
    assert torch.equal(sampler.step(velocity, 0, sample), torch.tensor([0.0, 4.0]))  # dt = -1/4
    noise = torch.randn(3, 2, dtype=torch.bfloat16)
    for sampler_class in SAMPLERS:
        assert sampler_class(3).solve(lambda x, t: x * t, noise).dtype == torch.bfloat16
    with pytest.raises(IndexError):
        sampler.step(velocity, 4, sample)


def brute_force_previous(grid, t):
    # Reference Prev_S(t): scan the whole grid for the largest value strictly below t (0 if there is none).
    best = 0.0
    for value in grid:
        if value < t and value > best:
            best = value
    return best


@pytest.mark.parametrize("num_steps", [1, 4, 16])
@pytest.mark.parametrize("shift", [1.0, 3.0, 0.5])
def test_previous_timestep_against_a_brute_force_scan(num_steps, shift):
    sampler = FlowMatchEulerSampler(num_steps=num_steps, shift=shift)
    grid = sampler.timesteps.tolist()  # float32 values, exact as Python floats
    midpoints = [(a + b) / 2 for a, b in itertools.pairwise(grid)]
    smallest = grid[-2]  # the smallest positive grid time
    random = torch.rand(200, generator=torch.Generator().manual_seed(3)).clamp(min=1e-6).tolist()
    queries = grid[:-1] + midpoints + [1.0, smallest, smallest / 2, 1e-7, 1e-30] + random
    t = torch.tensor(queries, dtype=torch.float32)
    out = sampler.previous_timestep(t)
    assert out.shape == t.shape and out.dtype == torch.float32 and out.device == t.device
    expected = [brute_force_previous(grid, value) for value in t.tolist()]
    assert out.tolist() == expected
    # On-grid times step to the next grid point down; t = 1 goes to timesteps[1]; tiny times go to 0.
    assert out[:num_steps].tolist() == grid[1:]
    assert sampler.previous_timestep(torch.tensor(1.0)).item() == grid[1]
    assert out[-len(random) - 3:-len(random)].tolist() == [0.0, 0.0, 0.0]
    assert sampler.previous_timestep(torch.tensor(smallest)).item() == 0.0


def test_previous_timestep_shapes_dtypes_and_new_grids():
    sampler = FlowMatchEulerSampler(num_steps=16)
    # The 16-step uniform grid: 0.6 lies between 10/16 and 9/16.
    assert sampler.previous_timestep(torch.tensor(0.6)).item() == 9 / 16
    t = torch.tensor([[0.6, 0.5], [1.0, 0.01]], dtype=torch.float64)
    out = sampler.previous_timestep(t)
    assert out.dtype == torch.float64 and out.shape == (2, 2)
    assert out.tolist() == [[9 / 16, 7 / 16], [15 / 16, 0.0]]
    # A float64 time a hair above a grid point still has that grid point strictly below it.
    assert sampler.previous_timestep(torch.tensor([0.5 + 1e-12], dtype=torch.float64)).item() == 0.5
    assert sampler.previous_timestep(torch.tensor([0.75], dtype=torch.bfloat16)).dtype == torch.bfloat16
    sampler.set_timesteps(num_steps=2)
    assert sampler.previous_timestep(torch.tensor([1.0, 0.75, 0.5])).tolist() == [0.5, 0.5, 0.0]


# --- clean-latent (x0) helpers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_steps,shift", [(1, 1.0), (4, 1.0), (16, 3.0), (9, 0.5)])
def test_euler_step_from_x0_is_the_euler_step_of_the_implied_velocity(num_steps, shift):
    generator = torch.Generator().manual_seed(4)
    sample, x0 = torch.randn(2, 3, 5, 4, dtype=torch.float64, generator=generator)
    sampler = FlowMatchEulerSampler(num_steps=num_steps, shift=shift)
    for i in range(num_steps):
        t, t_next = sampler.timesteps[i], sampler.timesteps[i + 1]
        expected = sampler.step(x0_to_velocity(sample, x0, t), i, sample)
        out = euler_step_from_x0(sample, x0, t, t_next)
        assert out.dtype == torch.float64
        # The grid times are float32: the step's dt and the ratio t_next / t each round at float32 precision.
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    # Per-example times broadcast over the trailing dimensions.
    t, t_next = torch.tensor([0.8, 0.3, 0.5], dtype=torch.float64)[:, None, None], 0.25
    expected = sample + (t_next - t) * (sample - x0) / t
    torch.testing.assert_close(euler_step_from_x0(sample, x0, t, t_next), expected, rtol=1e-12, atol=1e-12)


def test_x0_helpers_hand_values_and_endpoints():
    sample, x0 = torch.tensor([1.0, 2.0]), torch.tensor([0.5, -2.0])
    # (sample - x0) / t at t = 1/2: [0.5, 4] * 2.
    assert torch.equal(x0_to_velocity(sample, x0, 0.5), torch.tensor([1.0, 8.0]))
    # t = 1 -> t_next = 1/4: 1/4 * sample + 3/4 * x0.
    assert torch.equal(euler_step_from_x0(sample, x0, 1.0, 0.25), torch.tensor([0.625, -1.0]))
    assert torch.equal(euler_step_from_x0(sample, x0, torch.tensor(0.3), torch.tensor(0.0)), x0)
    assert torch.equal(euler_step_from_x0(sample, x0, 0.3, 0.3), sample)
    bf16 = sample.to(torch.bfloat16)
    assert x0_to_velocity(bf16, x0, torch.full((2,), 0.5)).dtype == torch.bfloat16
    assert euler_step_from_x0(bf16, x0, torch.full((2,), 0.5), torch.zeros(2)).dtype == torch.bfloat16


@pytest.mark.parametrize("num_steps,shift", [(1, 1.0), (2, 1.0), (7, 3.0), (16, 1.0), (33, 0.5)])
def test_exact_x0_prediction_follows_the_straight_line_and_lands_on_the_data(num_steps, shift):
    # With x0_hat = x0 the Euler step in x0 form maps (1 - t) x0 + t eps to (1 - t') x0 + t' eps for any t' < t, and
    # the last step (t' = 0) returns x0_hat itself.
    generator = torch.Generator().manual_seed(5)
    x0, eps = torch.randn(2, 4, 6, dtype=torch.float64, generator=generator)
    times = FlowMatchEulerSampler(num_steps=num_steps, shift=shift).timesteps.double()
    x = eps
    for t, t_next in itertools.pairwise(times):
        x = euler_step_from_x0(x, x0, t, t_next)
        torch.testing.assert_close(x, (1 - t_next) * x0 + t_next * eps, rtol=0, atol=1e-12)
    assert torch.equal(x, x0)


# --- repaint and guidance --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampler_class", SAMPLERS)
def test_repaint_holds_known_positions_for_every_velocity_call(sampler_class):
    generator = torch.Generator().manual_seed(1)
    noise = torch.randn(2, 5, 3, generator=generator)
    known = torch.randn(2, 5, 3, generator=generator)
    known_mask = torch.tensor([[True, True, False, False, False], [True, False, True, False, False]])[..., None]
    seen = []

    def velocity_fn(x, t):
        seen.append(x.clone())
        return torch.sin(3 * x) + t  # moves every position if nothing holds it

    out = sampler_class(num_steps=6, shift=2.0).solve(velocity_fn, noise, known=known, known_mask=known_mask)
    full = known_mask.expand_as(out)
    assert torch.equal(out[full], known[full])
    assert len(seen) == sampler_class.evaluations(6)
    for x in seen:
        assert torch.equal(x[full], known[full])
    assert not torch.allclose(out[~full], noise[~full], atol=1e-2)  # free positions were integrated


def test_repaint_none_and_dtype():
    sample = torch.randn(2, 3)
    assert repaint(sample, None, None) is sample
    with pytest.raises(ValueError, match="known_mask"):
        repaint(sample, torch.zeros(2, 3), None)
    mask = torch.tensor([True, False, True])
    out = repaint(sample.to(torch.bfloat16), torch.zeros(2, 3), mask)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out[:, 0], torch.zeros(2, dtype=torch.bfloat16))
    assert torch.equal(out[:, 1], sample[:, 1].to(torch.bfloat16))


def test_classifier_free_guidance():
    conditional, unconditional = torch.tensor([3.0, -1.0, 0.1]), torch.tensor([1.0, 2.0, 0.7])
    assert classifier_free_guidance(conditional, unconditional, 1.0) is conditional
    assert torch.equal(classifier_free_guidance(conditional, unconditional, 0.0), unconditional)
    # Hand values at scale 7: 1 + 7 * 2 = 15, 2 + 7 * (-3) = -19, 0.7 + 7 * (-0.6) = -3.5.
    torch.testing.assert_close(classifier_free_guidance(conditional, unconditional, 7.0),
                               torch.tensor([15.0, -19.0, -3.5]))


# --- training-time samplers ------------------------------------------------------------------------------------------


def test_logit_normal_times_distribution():
    n, loc, scale = 200_000, 0.5, 1.5
    t = LogitNormalTimeSampler(loc, scale).sample((n,), generator=torch.Generator().manual_seed(0))
    assert t.dtype == torch.float32 and t.shape == (n,)
    assert bool((t > 0).all()) and bool((t < 1).all())
    z = torch.logit(t.double())
    # Tolerances: 4 standard errors of the mean (s/√n), median (1.2533 s/√n) and standard deviation (s/√(2n)).
    assert abs(z.mean().item() - loc) < 4 * scale / math.sqrt(n)
    assert abs(z.std().item() - scale) < 4 * scale / math.sqrt(2 * n)
    sigmoid_loc = 1 / (1 + math.exp(-loc))
    median_tolerance = 4 * 1.2533 * scale / math.sqrt(n) * sigmoid_loc * (1 - sigmoid_loc)  # through sigmoid'(loc)
    assert abs(t.median().item() - sigmoid_loc) < median_tolerance


def test_logit_normal_times_stay_inside_the_interval():
    # Far logits round to exactly 0 or 1 in float32 without the clamp.
    assert bool((logit_normal_times(100, loc=40.0) < 1).all())
    assert bool((logit_normal_times(100, loc=-200.0) > 0).all())
    first = logit_normal_times((2, 3), generator=torch.Generator().manual_seed(5))
    assert torch.equal(first, logit_normal_times((2, 3), generator=torch.Generator().manual_seed(5)))


def test_shifted_time_sampler_cdf():
    n, shift = 200_000, 3.0
    t = ShiftedTimeSampler(shift).sample(n, generator=torch.Generator().manual_seed(0))
    assert t.dtype == torch.float32 and bool((t >= 0).all()) and bool((t < 1).all())
    # P(t <= 1/2) = u* with 3u*/(1 + 2u*) = 1/2, i.e. u* = 1/4; 4 standard errors of a proportion.
    p = 0.25
    assert abs((t <= 0.5).double().mean().item() - p) < 4 * math.sqrt(p * (1 - p) / n)
    uniform = make_time_sampler("uniform").sample(n, generator=torch.Generator().manual_seed(1))
    assert abs((uniform <= 0.5).double().mean().item() - 0.5) < 4 * math.sqrt(0.25 / n)


# Pr(sigma > 0.7) of tan-d as printed in the AURORA-LM paper (Fig. 6b / method specs).
PAPER_HIGH_NOISE_MASS = {1.0: 0.258, 3.0: 0.579, 5.0: 0.722, 7.0: 0.795}


def tan_reference(tau, d):
    return d * math.tan(math.pi * tau / 2) / (1 + d * math.tan(math.pi * tau / 2))


@pytest.mark.parametrize("shift", sorted(PAPER_HIGH_NOISE_MASS))
def test_tan_sampler_high_noise_mass_matches_the_paper(shift):
    n = 400_000
    sampler = TanShiftTimeSampler(shift)
    sigma = sampler.sample((n,), generator=torch.Generator().manual_seed(int(shift)))
    assert sigma.dtype == torch.float32 and sigma.shape == (n,)
    assert bool((sigma > 0).all()) and bool((sigma < 1).all())
    # 0.005 covers the paper's 3-decimal rounding plus > 6 standard errors of a proportion (sqrt(1/4n) < 0.0008).
    assert abs((sigma > 0.7).double().mean().item() - PAPER_HIGH_NOISE_MASS[shift]) < 0.005
    assert sampler.high_noise_mass() == pytest.approx(PAPER_HIGH_NOISE_MASS[shift], abs=0.001)
    assert sampler.high_noise_mass(0.7) == sampler.high_noise_mass()


def test_tan_sampler_cdf_at_other_thresholds():
    n, shift = 400_000, 3.0
    sampler = TanShiftTimeSampler(shift)
    sigma = sampler.sample(n, generator=torch.Generator().manual_seed(11))
    for threshold in (0.1, 0.5, 0.9, 0.99):
        # Reference from inverting sigma > a: tan(pi u / 2) > a / ((1 - a) d), u uniform.
        expected = 1 - 2 / math.pi * math.atan(threshold / ((1 - threshold) * shift))
        assert sampler.high_noise_mass(threshold) == pytest.approx(expected, rel=1e-12)
        assert abs((sigma > threshold).double().mean().item() - expected) < 4 * math.sqrt(expected * (1 - expected) / n)
    assert sampler.high_noise_mass(0.0) == 1.0 and sampler.high_noise_mass(1.0) == 0.0
    with pytest.raises(ValueError, match="threshold"):
        sampler.high_noise_mass(1.5)
    first, second = (sampler.sample((2, 3), generator=torch.Generator().manual_seed(2)) for _ in range(2))
    assert first.shape == (2, 3) and torch.equal(first, second)
    assert repr(TanShiftTimeSampler()) == "TanShiftTimeSampler(shift=7.0)"


def test_tan_shift_times_values_endpoints_and_monotonicity():
    tau = [0.0, 0.1, 0.25, 0.5, 0.8, 0.95, 0.999]
    for d in (0.3, 1.0, 7.0):
        out = tan_shift_times(torch.tensor(tau, dtype=torch.float64), d)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, torch.tensor([tan_reference(x, d) for x in tau], dtype=torch.float32),
                                   rtol=1e-6, atol=1e-7)
    assert tan_shift_times(torch.tensor([0.5]), 1.0).item() == 0.5  # tan(pi/4) = 1 -> 1/2
    # tau = 1 is the pole of tan: the limit 1 exactly, also for float32 input and tiny or huge d.
    for d in (1e-9, 0.01, 1.0, 7.0, 1e9):
        ends = tan_shift_times(torch.tensor([0.0, 1.0]), d)
        assert ends.tolist() == [0.0, 1.0]
    grid = torch.linspace(0, 1, 2001, dtype=torch.float64)
    for d in (0.5, 1.0, 7.0):
        sigma = tan_shift_times(grid, d)
        assert not bool(sigma.isnan().any()) and bool((sigma.diff() > 0).all())
    # Larger d, more noise at every interior time; and tan-d is the SD3 shift of the d = 1 schedule.
    inner = grid[1:-1]
    assert bool((tan_shift_times(inner, 7.0) > tan_shift_times(inner, 3.0)).all())
    via_shift = shift_times(tan_shift_times(inner, 1.0).double(), 7.0).float()
    torch.testing.assert_close(tan_shift_times(inner, 7.0), via_shift, rtol=1e-6, atol=1e-7)


def test_tan_sampler_stays_inside_the_interval():
    # With a huge d nearly every draw rounds to 1 in float32 before the clamp.
    sigma = TanShiftTimeSampler(1e9).sample(1000, generator=torch.Generator().manual_seed(0))
    assert bool((sigma < 1).all()) and bool((sigma > 0).all())


def test_make_time_sampler():
    sampler = make_time_sampler("logit_normal", loc=-0.3, scale=0.8)
    assert isinstance(sampler, LogitNormalTimeSampler) and (sampler.loc, sampler.scale) == (-0.3, 0.8)
    assert make_time_sampler("shifted", shift=2.0).shift == 2.0
    uniform = make_time_sampler("uniform")
    assert isinstance(uniform, ShiftedTimeSampler) and uniform.shift == 1.0
    tan = make_time_sampler("tan", shift=3)
    assert isinstance(tan, TanShiftTimeSampler) and tan.shift == 3.0 and isinstance(tan.shift, float)
    assert make_time_sampler("tan").shift == 7.0
    with pytest.raises(ValueError, match="'tan'"):
        make_time_sampler("tan_d")


def test_bad_arguments_raise_value_errors_naming_them():
    for make in (lambda: FlowMatchEulerSampler(num_steps=0), lambda: FlowMatchHeunSampler(num_steps=0),
                 lambda: FlowMatchEulerSampler(4).set_timesteps(num_steps=0)):
        with pytest.raises(ValueError, match="num_steps"):
            make()
    for make in (lambda: FlowMatchEulerSampler(shift=0.0), lambda: FlowMatchHeunSampler(shift=-1.0),
                 lambda: ShiftedTimeSampler(shift=0.0), lambda: shift_times(torch.rand(3), 0.0),
                 lambda: make_time_sampler("shifted", shift=0.0), lambda: TanShiftTimeSampler(shift=0.0),
                 lambda: TanShiftTimeSampler(shift=-7.0), lambda: TanShiftTimeSampler(shift=float("nan")),
                 lambda: TanShiftTimeSampler(shift=float("inf")), lambda: tan_shift_times(torch.rand(3), 0.0),
                 lambda: make_time_sampler("tan", shift=-1.0)):
        with pytest.raises(ValueError, match="shift"):
            make()
    with pytest.raises(ValueError, match="scale"):
        LogitNormalTimeSampler(scale=0.0)
    with pytest.raises(ValueError, match="beta"):
        make_time_sampler("beta")


# --- timestep embedding ----------------------------------------------------------------------------------------------


def test_sinusoidal_embedding_hand_values():
    at_zero = sinusoidal_timestep_embedding(torch.zeros(2, 3), 8)
    assert at_zero.shape == (2, 3, 8) and at_zero.dtype == torch.float32
    assert torch.equal(at_zero, torch.tensor([1.0] * 4 + [0.0] * 4).expand(2, 3, 8))
    # dim 4, max_period 100: half = 2, f = [1, 100^(-1/2)] = [1, 0.1].
    out = sinusoidal_timestep_embedding(torch.tensor([2.0]), 4, max_period=100.0)
    torch.testing.assert_close(out[0], torch.tensor([math.cos(2.0), math.cos(0.2), math.sin(2.0), math.sin(0.2)]))
    odd = sinusoidal_timestep_embedding(torch.tensor([2.0]), 5, max_period=100.0)
    assert odd.shape == (1, 5) and odd[0, -1].item() == 0.0
    torch.testing.assert_close(odd[:, :4], out)


def test_sinusoidal_embedding_separates_times():
    t = torch.linspace(0, 1, 101) * 1000
    embedding = sinusoidal_timestep_embedding(t.to(torch.bfloat16), 64)
    assert embedding.dtype == torch.float32
    distances = torch.cdist(embedding, embedding) + torch.eye(101) * 1e3
    assert distances.min().item() > 0.1


def test_timestep_embedding_module():
    module = TimestepEmbedding(hidden_size=16, frequency_size=9)
    assert set(module.state_dict()) == {"linear_1.weight", "linear_1.bias", "linear_2.weight", "linear_2.bias"}
    t = torch.rand(2, 3)
    out = module(t)
    assert out.shape == (2, 3, 16) and out.dtype == torch.float32
    # By hand: features of 1000 t, Linear, SiLU (x * sigmoid x), Linear.
    hidden = sinusoidal_timestep_embedding(1000 * t, 9) @ module.linear_1.weight.T + module.linear_1.bias
    expected = (hidden * torch.sigmoid(hidden)) @ module.linear_2.weight.T + module.linear_2.bias
    torch.testing.assert_close(out, expected)
    assert module.to(torch.bfloat16)(t).dtype == torch.bfloat16


# --- diffusers -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_euler_matches_diffusers_flow_match_euler_scheduler(shift):
    diffusers = pytest.importorskip("diffusers")
    num_steps = 12
    sampler = FlowMatchEulerSampler(num_steps=num_steps, shift=shift)
    # diffusers shifts the sigmas it is given (shift * s / (1 + (shift - 1) * s)) and appends the terminal 0, so pass
    # the unshifted grid 1 - i/S, i < S (as a NumPy array: diffusers 0.30 does not convert a list).
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(sigmas=np.array([1 - i / num_steps for i in range(num_steps)], dtype=np.float32))
    torch.testing.assert_close(scheduler.sigmas, sampler.timesteps, rtol=0, atol=1e-7)

    def velocity_fn(x, t):
        return torch.sin(3 * x) * (1 + t) - 0.5 * x * t

    noise = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0))
    x = noise
    for i, timestep in enumerate(scheduler.timesteps):
        x = scheduler.step(velocity_fn(x, scheduler.sigmas[i]), timestep, x).prev_sample
    ours = sampler.solve(velocity_fn, noise)
    torch.testing.assert_close(ours, x, rtol=0, atol=1e-6)
    assert not torch.allclose(ours, noise, atol=1e-1)
