"""The backend seam (`hf_cpt.backends`): every fast path against the reference, and a third backend that plugs in
through `register_backend` alone."""

import copy

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from hf_cpt import CPTConfig, quantize_model, set_precision
from hf_cpt.backends import Backend, CPUBackend, ReferenceBackend, backend_for, register_backend

from .helpers import cpu_backend


def _gpt2():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_embd=64, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def _step(model, backend: Backend, integer_matmul):
    """One CPT 6/8 training step of a copy of ``model`` with ``backend`` serving the CPU: (loss, gradients)."""
    model = copy.deepcopy(model)
    previous = register_backend("cpu", backend)
    try:
        quantize_model(model, CPTConfig(integer_matmul=integer_matmul, error_rounding="nearest"))
        set_precision(model, 6, 8)
        model.train()
        ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    finally:
        register_backend("cpu", previous)
    return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("int8_dot", [True, False])
def test_the_cpu_backends_paths_train_as_the_reference_does(int8_dot):
    """The C kernels and products on codes (int8 GEMMs, or the float32 GEMM of the codes) against the torch formulas
    with float products: the same loss and gradients up to float rounding (nearest-rounded errors: no noise)."""
    model = _gpt2()
    reference_loss, reference_grads = _step(model, ReferenceBackend(), False)
    for integer_matmul in (True, False):
        loss, grads = _step(model, CPUBackend(int8_dot=int8_dot), integer_matmul)
        assert torch.allclose(loss, reference_loss, rtol=1e-3)
        assert grads.keys() == reference_grads.keys()
        for name, grad in grads.items():  # a rounding apart can move a code by one step: close, not equal
            assert (grad - reference_grads[name]).norm() <= 0.05 * reference_grads[name].norm(), name


def test_a_third_backend_needs_nothing_but_its_registration():
    """A backend of its own (here one that counts what the layers ask of it) serves every quantized product of a
    training step once registered for the device, with the reference's results, and leaves with it."""

    def counted(name):
        def method(self, *args, **kwargs):
            self.calls[name] += 1
            return getattr(ReferenceBackend, name)(self, *args, **kwargs)
        return method

    operations = ("operand", "restore", "error", "code_product")

    class CountingBackend(ReferenceBackend):
        name = "counting"

        def __init__(self):
            self.calls = dict.fromkeys(operations, 0)

        def products_on_codes(self, setting):
            return setting is True  # products on codes where asked, as a device with fast int8 GEMMs would

    for operation in operations:
        setattr(CountingBackend, operation, counted(operation))
    model = _gpt2()
    counting = CountingBackend()
    loss, grads = _step(model, counting, True)
    layers = 4 * model.config.n_layer  # c_attn, c_proj, c_fc, mlp.c_proj per block (the head stays FP32)
    # one product per layer, and each GELU's input recomputed from its c_fc's codes in the backward
    assert counting.calls["code_product"] == layers + model.config.n_layer and counting.calls["error"] == layers
    assert counting.calls["operand"] >= 2 * layers and counting.calls["restore"] > 0
    class CodesReference(ReferenceBackend):  # the reference formulas, on codes where asked
        def products_on_codes(self, setting):
            return setting is True

    reference_loss, reference_grads = _step(model, CodesReference(), True)
    assert torch.equal(loss, reference_loss)
    assert all(torch.equal(grads[name], reference_grads[name]) for name in grads)
    assert isinstance(backend_for("cpu"), CPUBackend)  # registration undone


def test_int8_dot_products_can_be_forced_either_way(monkeypatch):
    from hf_cpt.backends import cpu

    monkeypatch.setenv(cpu.INT8_DOT_VARIABLE, "0")
    assert CPUBackend().products_on_codes("auto") is False
    monkeypatch.setenv(cpu.INT8_DOT_VARIABLE, "1")
    assert CPUBackend().products_on_codes("auto") is True and CPUBackend().products_on_codes(False) is False
    monkeypatch.setenv(cpu.INT8_DOT_VARIABLE, "yes")
    with pytest.raises(ValueError, match="HF_CPT_INT8_DOT must be 0 or 1"):
        CPUBackend()
    with cpu_backend(int8_dot=False):
        assert backend_for(torch.device("cpu")).int8_gemm() is False
    assert isinstance(backend_for("meta"), ReferenceBackend) and backend_for("meta").products_on_codes(True) is False


def test_a_backend_that_packs_saved_codes_halves_them_at_4_bits_and_gives_the_same_gradients():
    """Codes saved for the backward two a byte at 4 bits or fewer (`Backend.packs_saved_codes`, the CUDA backend's
    choice), unpacked bit for bit in backward; above 4 bits one a byte, as without packing."""
    class Packing(ReferenceBackend):
        packs_saved_codes = True

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 32))
    x = torch.randn(4, 50, 64)

    def run(backend, bits):
        previous = register_backend("cpu", backend)
        try:
            model = copy.deepcopy(base)
            quantize_model(model, CPTConfig(quant_scheme="per-token"))
            set_precision(model, bits, 8)
            codes = []

            def pack(t):
                if t.dtype == torch.uint8:
                    codes.append(t.numel())
                return t

            torch.manual_seed(1)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                model(x).sum().backward()
            return sum(codes), [p.grad for p in model.parameters()]
        finally:
            register_backend("cpu", previous)

    for bits, share in ((4, 0.5), (3, 0.5), (5, 1.0)):
        (plain_bytes, plain), (packed_bytes, packed) = run(ReferenceBackend(), bits), run(Packing(), bits)
        assert packed_bytes == share * plain_bytes > 0, bits
        assert all(torch.equal(a, b) for a, b in zip(plain, packed)), bits
