"""Every schedule against docs/method.md §5's formulas, the published cost grouping, costs, delay, user schedules."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest

from hf_cpt import CPTConfig, PrecisionSchedule, ScheduleShape, get_schedule, register_schedule
from hf_cpt.numerics.bitops import bitops_per_mac, relative_cost
from hf_cpt.schedules.schedule import cost_group, training_precision
from hf_cpt.schedules.shapes import FOLLOW_UP_SCHEDULES, available_schedules, unregister_schedule

# -- docs/method.md §5, written out independently of the library ----------------------------------------


def _growth(profile, z, lo, hi):
    d = hi - lo
    if profile == "C":
        return lo + d / 2 * (1 - math.cos(math.pi * z))
    if profile == "L":
        return lo + d * z
    if profile == "E":
        return hi - d * math.exp(-4 * z)
    r = lambda u: u / (0.1 + 0.9 * u)  # noqa: E731 - REX
    return hi - d * r(1 - z)


def _decay(profile, flip, z, lo, hi):
    if profile in ("C", "L") or flip == "V":  # vertical mirror (the same for symmetric profiles)
        return lo + hi - _growth(profile, z, lo, hi)
    return _growth(profile, 1 - z, lo, hi)  # horizontal flip: time reversal


def reference_smooth(name, t, lo, hi, total, n):
    """S(t) of docs/method.md §5 (and the CPT paper's variants as documented in hf_cpt.schedules)."""
    if name == "fp32":
        return None
    if name == "static":
        return hi
    if name == "progressive":
        ramp = total * 0.5
        return lo + (hi - lo) * (t / ramp) if t < ramp else hi
    if name in ("cpt", "cpt-triangular", "cpt-cosine-anneal"):
        T = total / n
        z = (t % T) / T
        if name == "cpt":
            return lo + (hi - lo) / 2 * (1 - math.cos(math.pi * z))
        if name == "cpt-triangular":
            return lo + (hi - lo) * (2 * z if z < 0.5 else 2 * (1 - z))
        return lo + (hi - lo) / 2 * (1 + math.cos(math.pi * z))
    T = int(total / n) + 1
    z, k = (t % T) / T, t // T
    profile, kind = name[0], name[1]
    flip = name[3] if len(name) > 2 else None
    if kind == "R" or k % 2 == 1:
        return _growth(profile, z, lo, hi)
    return _decay(profile, flip, z, lo, hi)


def reference_bits(name, t, lo, hi, total, n):
    s = reference_smooth(name, t, lo, hi, total, n)
    return None if s is None else round(s)  # Python's round: half to even, like np.rint


PUBLISHED = ["cpt", "cpt-triangular", "cpt-cosine-anneal", "progressive", "static", "fp32", *FOLLOW_UP_SCHEDULES]


def test_all_published_schedules_are_registered():
    assert set(PUBLISHED) <= set(available_schedules())
    assert FOLLOW_UP_SCHEDULES == ("CR", "CT", "LR", "LT", "ER", "ET-V", "ET-H", "RR", "RT-V", "RT-H")


def _probe_steps(total, T):
    """About 1500 steps spread over the run, plus the steps around every cycle boundary."""
    steps = set(range(0, total, max(7, total // 1500))) | {total - 1}
    k = 0
    while k * T < total + T:
        for offset in (-1, 0, 1):
            step = math.floor(k * T) + offset
            if 0 <= step < total:
                steps.add(step)
        k += 1
    return sorted(steps)


@pytest.mark.parametrize("name", PUBLISHED)
@pytest.mark.parametrize("lo, hi, total, n", [(3, 8, 64000, 8), (4, 8, 10007, 32), (5, 6, 2000, 2), (2, 8, 97, 3)])
def test_schedule_matches_reference_formula(name, lo, hi, total, n):
    schedule = get_schedule(name, lo, hi, total, n)
    T = total / n if name.startswith("cpt") else int(total / n) + 1
    for t in _probe_steps(total, T):
        expected = reference_smooth(name, t, lo, hi, total, n)
        smooth = schedule.smooth(t)
        if expected is None:
            assert smooth is None and schedule(t) is None
            continue
        assert smooth == pytest.approx(expected, abs=1e-12), (name, t)
        assert schedule(t) == reference_bits(name, t, lo, hi, total, n), (name, t)


@pytest.mark.parametrize("name", FOLLOW_UP_SCHEDULES)
def test_cycle_boundaries(name):
    total, n = 800, 8
    schedule = get_schedule(name, 3, 8, total, n)
    T = int(total / n) + 1  # the follow-up code's +1
    assert schedule.cycle_length == T == 101
    triangular = name[1] == "T"
    assert schedule(0) == (8 if triangular else 3)  # triangular starts at bits_max
    for k in range(1, 7):
        decays, previous_decayed = triangular and k % 2 == 0, triangular and k % 2 == 1
        assert schedule(k * T) == (8 if decays else 3), (name, k)  # a cycle starts at its profile's start
        assert schedule(k * T - 1) == (3 if previous_decayed else 8), (name, k)  # the previous one ended at its end


def test_cpt_restarts_at_bits_min_and_ends_at_bits_max():
    schedule = get_schedule("cpt", 3, 8, 64000, 32)
    assert schedule.cycle_length == 2000
    assert [schedule(k * 2000) for k in range(32)] == [3] * 32
    assert schedule(63999) == 8
    # The CPT code's iterations at each precision for 3 -> 8 over T = 2000 (reference_code.md §2).
    assert get_schedule("cpt", 3, 8, 2000, 1).steps_at_bits() == {3: 410, 4: 329, 5: 261, 6: 262, 7: 329, 8: 409}


def test_round_half_to_even_and_ceil():
    # LR over 72 steps and 8 cycles: T = 10, S = 3 + t / 2 exactly at t = 1, 3, 5, 7.
    nearest = get_schedule("LR", 3, 8, 72, 8)
    assert [nearest.smooth(t) for t in (1, 3, 5, 7)] == [3.5, 4.5, 5.5, 6.5]
    assert [nearest(t) for t in (1, 3, 5, 7)] == [4, 4, 6, 6]  # ties to even, as np.rint
    ceil = get_schedule("LR", 3, 8, 72, 8, rounding="ceil")
    assert [ceil(t) for t in (0, 1, 2, 3, 5, 7)] == [3, 4, 4, 5, 6, 7]  # the paper's ceiling; 4.0 stays 4


def test_published_cost_grouping_for_3_to_8_bits_and_8_cycles():
    groups = {"small": {"RR", "RT-H"}, "medium": {"CR", "CT", "LR", "LT", "ET-V", "RT-V"}, "large": {"ER", "ET-H"}}
    means = {"small": 3.81, "medium": 5.50, "large": 6.83}
    for total in (64000, 4000):
        for group, names in groups.items():
            for name in names:
                schedule = get_schedule(name, 3, 8, total, 8)
                assert schedule.cost_group == group, (name, total, schedule.mean_bits())
                assert schedule.mean_bits() == pytest.approx(means[group], abs=0.05), name
    # cost ratios vs FP32 of reference_code.md §8.1
    assert get_schedule("RR", 3, 8, 64000, 8).relative_cost(8) == pytest.approx(0.0249, abs=5e-5)
    assert get_schedule("ER", 3, 8, 64000, 8).relative_cost(8) == pytest.approx(0.0514, abs=5e-5)
    assert 0.039 <= get_schedule("CR", 3, 8, 64000, 8).relative_cost(8) <= 0.040


def test_cost_group_boundaries():
    assert cost_group(3.0, 3, 8) == "small"
    assert cost_group(3 + 5 / 3 - 1e-9, 3, 8) == "small"
    assert cost_group(5.5, 3, 8) == "medium"
    assert cost_group(3 + 10 / 3 + 1e-9, 3, 8) == "large"
    assert cost_group(8, 8, 8) == "large"
    assert get_schedule("static", 3, 8, 100).cost_group == "large"


@pytest.mark.parametrize(
    "lo, hi, saving", [(3, 8, 0.367), (3, 6, 0.300), (4, 8, 0.301), (4, 6, 0.207), (5, 8, 0.232)]
)
def test_cpt_savings_of_the_papers(lo, hi, saving):
    schedule = get_schedule("cpt", lo, hi, 64000, 32)
    assert 1 - schedule.cost_vs_static(hi) == pytest.approx(saving, abs=6e-4)


@pytest.mark.parametrize("name", ["cpt", "RT-V", "progressive", "fp32"])
def test_costs_are_exact_sums_of_the_cost_formula(name):
    schedule = get_schedule(name, 3, 8, 997, 8, delay=0.1, delay_precision="fp32")
    bits = [schedule(t) for t in range(997)]
    per_step = [relative_cost(*training_precision(b, 6, t)) for t, b in enumerate(bits)]
    assert schedule.relative_cost(6) == pytest.approx(sum(per_step) / 997, rel=1e-12)
    static = bitops_per_mac(8, 6) * 997
    expected = sum(bitops_per_mac(*training_precision(b, 6, t)) for t, b in enumerate(bits)) / static
    assert schedule.cost_vs_static(6) == pytest.approx(expected, rel=1e-12)
    assert schedule.mean_bits() == pytest.approx(sum(32 if b is None else b for b in bits) / 997)
    assert sum(schedule.steps_at_bits().values()) == 997


def test_grad_bits_can_follow_a_schedule():
    forward = get_schedule("CR", 3, 8, 500, 4)
    grad = get_schedule("CT", 6, 8, 500, 4)
    expected = sum(bitops_per_mac(forward(t), grad(t)) for t in range(500)) / (500 * bitops_per_mac(None, None))
    assert forward.relative_cost(grad) == pytest.approx(expected, rel=1e-12)
    assert forward.static_grad_bits(grad) == 8
    assert forward.cost_vs_static(grad) == pytest.approx(
        sum(bitops_per_mac(forward(t), grad(t)) for t in range(500)) / (500 * bitops_per_mac(8, 8))
    )
    assert forward.static_grad_bits(lambda t: 4 + t % 3) == 6  # any callable: its maximum


@pytest.mark.parametrize("name", ["CR", "RT-H", "cpt", "progressive"])
@pytest.mark.parametrize("precision, held", [("max", 8), ("fp32", None)])
def test_delayed_start(name, precision, held):
    total, delay = 1000, 0.3
    delayed = get_schedule(name, 3, 8, total, 4, delay=delay, delay_precision=precision)
    assert delayed.delay_steps == 300
    assert all(delayed(t) == held for t in range(300))
    rest = get_schedule(name, 3, 8, total - 300, 4)  # the schedule runs its cycles over the remaining steps
    assert [delayed(300 + t) for t in range(700)] == [rest(t) for t in range(700)]
    assert delayed.mean_bits() > rest.mean_bits() * 0.7 + (8 if held else 32) * 0.3 - 1e-9


def test_user_callable_schedule():
    def my_schedule(step):
        return 8 if step < 10 else (None if step >= 90 else 4 + (step % 3) / 2)  # smooth values are rounded

    schedule = get_schedule(my_schedule, 3, 8, 100)
    assert [schedule(t) for t in (0, 10, 11, 12, 95)] == [8, 4, 5, 4, None]  # 4.5 -> 4: half to even
    assert schedule.steps_at_bits()[None] == 10
    assert "my_schedule" in schedule.name
    with pytest.raises(ValueError, match="bits must be in"):
        get_schedule(lambda step: 0, 3, 8, 10)(0)
    with pytest.raises(ValueError, match="must return bits"):
        get_schedule(lambda step: "four", 3, 8, 10)(0)


def test_register_by_name_shape_level_or_step_function():
    try:
        register_schedule("test-half", ScheduleShape(lambda z, k, lo, hi: (lo + hi) / 2, description="middle"))
        register_schedule("test-level", lambda z, k, lo, hi: lo if z < 0.5 else hi)
        register_schedule("test-step", lambda step: 4 if step % 2 else 6)
        assert get_schedule("test-half", 4, 8, 10, 1)(3) == 6
        level = get_schedule("test-level", 3, 8, 100, 2)
        assert [level(t) for t in (0, 24, 25, 49, 50)] == [3, 3, 8, 8, 3]
        assert [get_schedule("test-step", 3, 8, 10, 1)(t) for t in range(3)] == [6, 4, 6]
        assert CPTConfig(schedule="test-step").schedule == "test-step"
        with pytest.raises(ValueError, match="already registered"):
            register_schedule("test-step", lambda step: 4)
        with pytest.raises(ValueError, match="takes 2 arguments"):
            register_schedule("test-bad", lambda a, b: 4)
        with pytest.raises(ValueError, match="ScheduleShape or a callable"):
            register_schedule("test-bad", 3)
    finally:
        for name in ("test-half", "test-level", "test-step"):
            if name in available_schedules():
                unregister_schedule(name)


def test_config_accepts_callables_delay_and_grad_schedule():
    def fn(step):
        return 5

    config = CPTConfig(schedule=fn, delay=0.2, delay_precision="fp32", grad_schedule="CR", grad_bits_min=6)
    json.dumps(config.to_dict())  # JSON-safe even with a callable
    assert config.to_dict()["schedule"] == "<callable " + fn.__qualname__ + ">"
    forward = config.schedule_config.forward_schedule(100)
    grad = config.schedule_config.error_schedule(100)
    assert forward(0) is None and forward(20) == 5
    assert grad(20) == 6 and grad(0) == 8
    assert training_precision(forward(0), grad, 0) == (None, None)  # full-precision steps: both ways
    assert CPTConfig().schedule_config.forward_schedule(64000, bits_min=4).bits_min == 4
    assert CPTConfig().schedule_config.error_schedule(100) is None


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"delay": 1.0}, "delay"),
        ({"delay": -0.1}, "delay"),
        ({"delay_precision": "min"}, "delay_precision"),
        ({"grad_schedule": "CR"}, "grad_bits_min"),
        ({"grad_schedule": "zigzag", "grad_bits_min": 6}, "grad_schedule"),
        ({"grad_schedule": "CR", "grad_bits_min": 9}, "grad_bits_min"),
        ({"schedule": 3}, "schedule"),
        ({"bits_min": "auto", "schedule": lambda step: 4}, "bits_min"),
        ({"prt_start_bits": 0}, "prt_start_bits"),
        ({"bits_min": "auto", "prt_start_bits": 9}, "prt_start_bits"),
        ({"prt_steps_per_precision": 0}, "prt_steps_per_precision"),
        ({"prt_threshold": 0}, "prt_threshold"),
        ({"prt_metric": "f1"}, "prt_metric"),
        ({"prt_window": 50}, "prt_window"),
    ],
)
def test_config_rejects_bad_new_fields(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CPTConfig(**kwargs)


def test_config_checks_cycles_after_the_delay():
    config = CPTConfig(num_cycles=8, delay=0.5)
    config.check_total_steps(16)
    with pytest.raises(ValueError, match="num_cycles"):
        config.check_total_steps(14)
    CPTConfig(schedule="progressive", num_cycles=32).check_total_steps(4)  # not cyclic: no check


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        (("zigzag", 3, 8, 100), {}, "Unknown schedule"),
        (("CR", 0, 8, 100), {}, "bits_min"),
        (("CR", 3, 33, 100), {}, "bits_max"),
        (("CR", 8, 3, 100), {}, "bits_min"),
        (("CR", 3, 8, 0), {}, "total_steps"),
        (("CR", 3, 8, 100, 0), {}, "num_cycles"),
        (("cpt", 3, 8, 10, 20), {}, "num_cycles"),
        (("CR", 3, 8, 100), {"rounding": "floor"}, "rounding"),
        (("CR", 3, 8, 100), {"delay": 1.5}, "delay"),
        (("CR", 3, 8, 100), {"delay_precision": "min"}, "delay_precision"),
    ],
)
def test_bad_schedule_arguments(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        get_schedule(*args, **kwargs)


def test_bad_steps_and_grad_bits():
    schedule = get_schedule("CR", 3, 8, 100, 4)
    with pytest.raises(ValueError, match="step"):
        schedule(-1)
    with pytest.raises(ValueError, match="grad_bits"):
        schedule.relative_cost(0)


def test_existing_api_still_works():
    schedule = PrecisionSchedule("cpt", 3, 8, 64000)
    assert schedule.num_cycles == 32 and schedule(0) == 3 and schedule(1999) == 8
    assert "cpt" in repr(schedule)


@pytest.mark.parametrize("name", sorted(available_schedules()))
def test_steps_at_bits_counted_by_cycles_equal_the_step_by_step_count(name):
    """Every registered shape declares where it turns, so a run's steps at each precision are counted per monotone
    piece (bisection); the counts equal those of walking every step, at odd lengths, cycle counts, delays and both
    roundings, and a run of 1e11 steps answers at once."""
    cases = [(1000, 32, 0.0, "nearest"), (997, 7, 0.1, "ceil"), (5003, 3, 0.0, "ceil"), (96, 64, 0.25, "nearest"),
             (12_345, 9, 0.05, "nearest")]
    for total, cycles, delay, rounding in cases:
        schedule = PrecisionSchedule(name, 3, 8, total, cycles, rounding, delay=delay)
        walked = dict(Counter(schedule(step) for step in range(total)))
        assert schedule.steps_at_bits() == walked, (total, cycles, delay, rounding)
    long = PrecisionSchedule(name, 3, 8, 100_000_000_000, 32)
    counts = long.steps_at_bits()
    assert sum(counts.values()) == 100_000_000_000 and long._bits_cache is None  # nothing walked step by step


def test_a_shape_without_turns_is_counted_step_by_step():
    """A registered level function says nothing of its turns: its steps are walked one by one (exact)."""
    register_schedule("test-wobble", lambda z, k, lo, hi: lo + (hi - lo) * abs(math.sin(7 * math.pi * z)))
    try:
        schedule = PrecisionSchedule("test-wobble", 3, 8, 997, 4)
        assert schedule.steps_at_bits() == dict(Counter(schedule(step) for step in range(997)))
    finally:
        unregister_schedule("test-wobble")
