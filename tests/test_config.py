
import dataclasses
import logging

import pytest

from hf_cpt import CPTConfig, get_schedule
from hf_cpt.config import ActivationConfig, ModuleSelection, RangeTestConfig, ScheduleConfig
from hf_cpt.numerics.errors import ErrorQuantization
from hf_cpt.runtime import RuntimeSettings


def test_defaults_follow_the_cpt_paper_where_the_evidence_does_not_say_otherwise():
    config = CPTConfig()
    assert (config.bits_min, config.bits_max, config.grad_bits) == (4, 8, 8)  # 3 fails the fidelity check
    assert config.schedule == "cpt" and config.num_cycles == "auto" and config.rounding == "nearest"
    assert config.eval_precision == 8


@pytest.mark.parametrize("steps, cycles", [(40, 1), (250, 2), (1563, 15), (64000, 32), (10**6, 32)])
def test_auto_cycles_follow_the_run_length(steps, cycles):
    assert CPTConfig().cycles_for(steps) == cycles
    assert CPTConfig(num_cycles=8).cycles_for(steps) == 8
    assert CPTConfig(delay=0.5).cycles_for(steps) == max(1, min(32, (steps - steps // 2) // 100))


def test_cycles_too_short_to_visit_every_bit_width_are_warned_with_the_auto_value(caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="hf_cpt.config.cpt_config"):
        CPTConfig(num_cycles=32).check_total_steps(40)
    assert "num_cycles=32 gives cycles of 1.2 steps in a run of 40 optimizer steps" in caplog.text
    assert "fewer than the 5 bit-widths from bits_min=4 to bits_max=8" in caplog.text
    assert "num_cycles='auto' gives 1" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_cpt.config.cpt_config"):
        CPTConfig().check_total_steps(40)
        CPTConfig(num_cycles=8).check_total_steps(400)
    assert caplog.text == ""


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"bits_min": 0}, "bits_min"),
        ({"bits_max": 33}, "bits_max"),
        ({"bits_min": 2.5}, "bits_min"),
        ({"bits_min": 8, "bits_max": 4}, "bits_min"),
        ({"grad_bits": 0}, "grad_bits"),
        ({"schedule": "zigzag"}, "schedule"),
        ({"num_cycles": 0}, "num_cycles"),
        ({"rounding": "floor"}, "rounding"),
        ({"eval_bits": "half"}, "eval_bits"),
        ({"eval_bits": 40}, "eval_bits"),
        ({"activation_momentum": 1.0}, "activation_momentum"),
        ({"activation_ema_init": "ones"}, "activation_ema_init"),
        ({"exclude_modules": [3]}, "exclude_modules"),
    ],
)
def test_invalid_fields_raise_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CPTConfig(**kwargs)


def test_cycles_shorter_than_one_step_are_rejected():
    config = CPTConfig(num_cycles=32)
    with pytest.raises(ValueError, match="num_cycles"):
        config.check_total_steps(10)
    config.check_total_steps(32)
    with pytest.raises(ValueError, match="at least one optimizer step"):
        config.check_total_steps(0)


def test_round_trip_through_dict_and_unknown_fields():
    config = CPTConfig(bits_min=4, schedule="static", exclude_modules="pooler")
    assert config.exclude_modules == ["pooler"]
    assert CPTConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="bitz"):
        CPTConfig.from_dict({"bitz": 3})


def test_eval_precision_options():
    assert CPTConfig(eval_bits="fp32").eval_precision is None
    assert CPTConfig(eval_bits=6).eval_precision == 6
    assert CPTConfig(schedule="fp32").eval_precision is None


def test_parts_validate_their_own_fields_and_the_config_names_the_flat_field():
    with pytest.raises(ValueError, match=r"^ScheduleConfig\.bits_min \(9\) must not exceed bits_max"):
        ScheduleConfig(bits_min=9, bits_max=8)
    with pytest.raises(ValueError, match=r"^CPTConfig\.bits_min \(9\) must not exceed bits_max"):
        CPTConfig(bits_min=9, bits_max=8)
    with pytest.raises(ValueError, match=r"^RangeTestConfig\.metric must be one of"):
        RangeTestConfig(metric="f1")
    with pytest.raises(ValueError, match=r"^CPTConfig\.prt_metric must be one of"):
        CPTConfig(prt_metric="f1")
    with pytest.raises(ValueError, match=r"^ErrorQuantization\.products must be one of"):
        ErrorQuantization(products="neither")
    with pytest.raises(ValueError, match=r"^CPTConfig\.schedule='nope' is unknown"):
        CPTConfig(schedule="nope")


def test_a_config_is_composed_of_its_parts_and_flat_names_are_routed_to_them():
    errors = ErrorQuantization(granularity="token", rounding="nearest", products="input", range="auto")
    config = CPTConfig(bits_min=3, bits_max=6, num_cycles=4, delay=0.25, errors=errors,
                       range_test=RangeTestConfig(metric="accuracy"), eval_bits="fp32")
    assert (config.bits_min, config.bits_max, config.num_cycles, config.delay) == (3, 6, 4, 0.25)
    assert (config.error_granularity, config.error_rounding, config.error_products) == ("token", "nearest", "input")
    assert config.prt_metric == "accuracy" and config.eval_bits == "fp32" and config.errors == errors
    assert config.schedule_config == ScheduleConfig(bits_min=3, bits_max=6, num_cycles=4, delay=0.25)
    assert config.modules == ModuleSelection() and config.activations == ActivationConfig()
    flat = CPTConfig(bits_min=3, bits_max=6, num_cycles=4, delay=0.25, error_granularity="token",
                     error_rounding="nearest", error_products="input", prt_metric="accuracy", eval_bits="fp32")
    assert flat == config and CPTConfig.from_dict(config.to_dict()) == config
    flat.error_range = "symmetric"  # a flat name set later goes to its part too
    assert flat.errors.range == "symmetric" and "error_range" not in vars(flat)
    with pytest.raises(ValueError, match=r"^CPTConfig\.errors must be a ErrorQuantization"):
        CPTConfig(errors="token")


def test_the_top_level_holds_the_users_choices_and_engine_switches_are_never_saved():
    fields = [f.name for f in dataclasses.fields(CPTConfig)]
    assert len(fields) <= 22
    assert {"integer_matmul", "recompute_activation_inputs", "fused_error_quantizer", "error_granularity"}.isdisjoint(
        fields)
    config = CPTConfig(integer_matmul=False, recompute_activation_inputs=False)
    assert config.runtime == RuntimeSettings(integer_matmul=False, recompute_activation_inputs=False)
    assert "runtime" not in repr(config) and "integer_matmul" not in config.to_dict()
    assert config == CPTConfig()  # the same run, whatever engine computes it


def test_removed_settings_still_load_with_a_deprecation_note(caplog):
    with caplog.at_level(logging.WARNING, logger="hf_cpt.config.cpt_config"):
        config = CPTConfig.from_dict({**CPTConfig().to_dict(), "output_mappings": False, "dropout_masks": True})
    assert config == CPTConfig()
    assert "['dropout_masks', 'output_mappings'] were removed" in caplog.text


def test_named_recipes():
    paper = CPTConfig.from_recipe("paper")
    assert (paper.bits_min, paper.bits_max, paper.rounding, paper.quant_scheme) == (3, 8, "ceil", "paper")
    assert (paper.error_granularity, paper.error_range, paper.fidelity_threshold) == ("tensor", "minmax", None)
    assert CPTConfig.from_recipe("finetune") == CPTConfig()
    assert CPTConfig.from_recipe("from-scratch", bits_min=4).bits_min == 4
    with pytest.raises(ValueError, match="Unknown CPTConfig recipe 'fast'"):
        CPTConfig.from_recipe("fast")


def test_the_schedule_and_the_config_refuse_the_same_short_runs():
    """One check of the run length (the schedule's): the follow-up shapes were accepted by get_schedule with cycles
    of under one step while CPTConfig refused them."""
    with pytest.raises(ValueError, match="num_cycles=8 gives cycles shorter than one step for a run of 4"):
        get_schedule("RR", total_steps=4, num_cycles=8)
    with pytest.raises(ValueError, match="num_cycles=8 gives cycles shorter than one step for a run of 4"):
        CPTConfig(schedule="RR", num_cycles=8).check_total_steps(4)
    assert get_schedule("RR", total_steps=8, num_cycles=8).num_cycles == 8


def test_a_config_pickles_with_its_parts_and_runtime():
    """Configs cross process boundaries (multiprocessing, a pickled model's hooks): every part, the generated
    `ScheduleOptions` included, and the runtime settings come back equal."""
    import pickle

    config = CPTConfig(bits_min=3, grad_bits_min=4, grad_schedule="cpt", error_granularity="token",
                       integer_matmul=False)
    copied = pickle.loads(pickle.dumps(config))
    assert copied == config and copied.schedule_options == config.schedule_options
    assert copied.runtime == config.runtime and copied.runtime.integer_matmul is False


def test_numbers_of_any_integral_or_real_type_become_python_numbers():
    """``numpy.int64(4)`` (what arrays and sweeps hand out) is an int like any other: validated, equal to the config
    of plain ints, and written to JSON (a run's cost report holds the config) without an error at the end of a run."""
    import json

    import numpy as np

    config = CPTConfig(bits_min=np.int64(4), bits_max=np.int32(8), num_cycles=np.int64(2), delay=np.float32(0.25),
                       grad_bits=np.uint8(8), prt_steps_per_precision=np.int16(3))
    assert config == CPTConfig(bits_min=4, bits_max=8, num_cycles=2, delay=0.25, grad_bits=8, prt_steps_per_precision=3)
    assert type(config.bits_min) is int and type(config.delay) is float
    assert json.loads(json.dumps(config.to_dict()))["bits_min"] == 4
    with pytest.raises(ValueError, match="bits_min"):
        CPTConfig(bits_min=np.float64(4.5))
