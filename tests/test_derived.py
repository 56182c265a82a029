import gc
import weakref

import torch

from hf_cpt.numerics import derived as derived_module
from hf_cpt.numerics.derived import derived
from hf_cpt.numerics.fake_quant import levels_on, num_levels
from hf_cpt.numerics.rotation import _axis_steps, get_rotation


class Counter:
    def __init__(self, compute):
        self.calls, self.compute = 0, compute

    def __call__(self):
        self.calls += 1
        return self.compute()


def test_a_derived_value_is_computed_once_per_value_of_its_source():
    bits = torch.tensor(6.0)
    count = Counter(lambda: num_levels(bits))
    first = derived(bits, "levels", count)
    assert derived(bits, "levels", count) is first and count.calls == 1 and first.item() == 63
    bits.fill_(4.0)  # an in-place change moves the version counter: computed anew, with the new value
    assert derived(bits, "levels", count).item() == 15 and count.calls == 2
    assert derived(bits, "other key", count) is not first and count.calls == 3


def test_a_derived_value_goes_with_its_source_and_does_not_keep_it_alive():
    source = torch.tensor(5.0)
    derived(source, "levels", lambda: torch.tensor(31.0))
    alive = weakref.ref(source)
    gc.collect()
    before = len(derived_module._DERIVED)
    del source
    gc.collect()
    assert alive() is None and len(derived_module._DERIVED) == before - 1


def test_inference_tensors_and_subclasses_compute_anew():
    with torch.inference_mode():
        bits = torch.tensor(3.0)  # no version counter to tell a change
    count = Counter(lambda: num_levels(bits.clone()))
    derived(bits, "levels", count), derived(bits, "levels", count)
    parameter = torch.nn.Parameter(torch.tensor(3.0), requires_grad=False)
    derived(parameter, "levels", count)
    assert count.calls == 3


def test_nothing_computed_under_a_fake_tensor_mode_is_kept():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    bits = torch.tensor(6.0)
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert isinstance(levels_on(bits, torch.device("cpu"), torch.float32), FakeTensor)
    real = levels_on(bits, torch.device("cpu"), torch.float32)
    assert not isinstance(real, FakeTensor) and real.item() == 63


def test_what_is_computed_inside_inference_mode_serves_training_afterwards():
    bits = torch.tensor(8.0)
    with torch.inference_mode():
        levels = levels_on(bits, torch.device("cpu"), torch.float32)
    assert not levels.is_inference() and not levels.requires_grad
    x = torch.randn(4, requires_grad=True)
    (x / levels).sum().backward()  # an inference tensor here would fail: it cannot be saved for backward
    assert torch.equal(x.grad, torch.full((4,), 1 / 255))


def test_levels_on_follows_the_bits_and_the_requested_device_and_dtype():
    bits = torch.tensor(7.0)
    assert levels_on(bits, torch.device("cpu"), torch.float64).dtype == torch.float64
    assert levels_on(bits, torch.device("meta"), torch.float32).device.type == "meta"
    assert levels_on(bits, torch.device("cpu"), torch.float32) is levels_on(bits, torch.device("cpu"), torch.float32)
    bits.fill_(2.0)
    assert levels_on(bits, torch.device("cpu"), torch.float32).item() == 3


def test_rotation_steps_are_built_once_and_keep_no_factor_alive():
    rotation = get_rotation(768)
    steps = _axis_steps(rotation.factors, rotation.kinds, transpose=True)
    again = _axis_steps(rotation.factors, rotation.kinds, transpose=True)
    assert all(a is b for a, b in zip(steps, again))
    assert all(step.is_contiguous() for step in steps)
    for step in _axis_steps(rotation.factors, rotation.kinds, transpose=False):
        assert step._base is None and not any(step is f for f in rotation.factors)
    x = torch.randn(3, 768)
    assert torch.allclose(rotation.apply(rotation.apply(x), transpose=True), x, atol=1e-5)
    alive = weakref.ref(rotation.factors[0])
    gc.collect()
    before = len(derived_module._DERIVED)
    del rotation, steps, again
    gc.collect()
    assert alive() is None and len(derived_module._DERIVED) < before
