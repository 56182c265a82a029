import pytest

from hf_cpt import CPTConfig


def test_defaults_follow_the_cpt_paper():
    config = CPTConfig()
    assert (config.bits_min, config.bits_max, config.grad_bits) == (3, 8, 8)
    assert config.schedule == "cpt" and config.num_cycles == 32 and config.rounding == "nearest"
    assert config.eval_precision == 8


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
