"""Time overhead of hf_cpt fake quantization against the same plain PyTorch computation.

Run: ``python bench/overhead.py [--repeats N] [--no-fused]``.

Each case times a quantized and a plain version of the same work, alternating between them within
one run, and reports median times and their ratio. Cases: (a) forward + backward of a 768->3072
Linear on 2048 tokens, (b) forward + backward of a 16->16 3x3 conv on a 128x16x32x32 batch, (c) one
training step (forward, backward, AdamW) of a BERT-small-shaped classifier. The quantized versions
run at 8-bit weights/activations and 8-bit errors. A one-off warm-up step of each quantized case,
which includes the ``torch.compile`` time of the fused error quantizer, is timed separately.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from torch import nn

from hf_cpt import CPTConfig, quantize_model, set_precision

Step = Callable[[], None]


@dataclass
class Case:
    name: str
    plain: Step
    quantized: Step
    iters: int  # steps per timed sample
    target: float


QUANT_SCHEME = "auto"  # --quant-scheme


def layer_steps(layer: nn.Module, x: torch.Tensor, fused: bool) -> tuple[Step, Step]:
    """Forward + backward (input and weight gradients) of a layer and of its quantized copy."""
    quantized = nn.Sequential(copy.deepcopy(layer))
    quantize_model(quantized, CPTConfig(fused_error_quantizer=fused, quant_scheme=QUANT_SCHEME))
    set_precision(quantized, 8, 8)
    x = x.clone().requires_grad_(True)
    with torch.no_grad():
        grad_out = torch.randn_like(layer(x))

    def make(module: nn.Module) -> Step:
        params = list(module.parameters())

        def step() -> None:
            x.grad = None
            for p in params:
                p.grad = None
            module(x).backward(grad_out)

        return step

    return make(layer), make(quantized)


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


def time_per_step(step: Step, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - start) / iters


def run_case(case: Case, repeats: int) -> dict[str, float]:
    start = time.perf_counter()
    case.quantized()  # first call: compiles the fused error kernel for this input rank
    warmup = time.perf_counter() - start
    case.plain()
    case.quantized()
    plain, quantized = [], []
    for repeat in range(repeats):
        # Alternate which goes first so that neither side always follows the other.
        order = ((plain, case.plain), (quantized, case.quantized))
        for samples, step in order if repeat % 2 == 0 else order[::-1]:
            samples.append(time_per_step(step, case.iters))
    plain_ms, quant_ms = statistics.median(plain) * 1e3, statistics.median(quantized) * 1e3
    ratios = [q / p for q, p in zip(quantized, plain)]
    return {
        "plain_ms": plain_ms,
        "quant_ms": quant_ms,
        "ratio": quant_ms / plain_ms,
        "paired": statistics.median(ratios),
        "warmup_s": warmup,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed samples per side (median reported)")
    parser.add_argument("--no-fused", action="store_true", help="use the eager error quantizer")
    parser.add_argument("--quant-scheme", default="auto", help="CPTConfig.quant_scheme (default: the library's)")
    parser.add_argument("--bert-batch", type=int, default=8, help="batch size of the BERT training step")
    parser.add_argument("--only", choices=("linear", "conv", "bert"), nargs="*", help="run only these cases")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    global QUANT_SCHEME
    QUANT_SCHEME = args.quant_scheme
    if args.threads:
        torch.set_num_threads(args.threads)
    fused = not args.no_fused

    torch.manual_seed(0)
    cases = {
        "linear": lambda: Case(
            "Linear 768->3072, 2048 tokens, fwd+bwd",
            *layer_steps(nn.Linear(768, 3072), torch.randn(2048, 768), fused),
            iters=2,
            target=1.15,
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
    }
    selected = args.only or list(cases)

    print(f"command: python {' '.join(sys.argv)}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"error quantizer: {'fused (torch.compile)' if fused else 'eager'}, repeats {args.repeats}")
    print("quantized: 8-bit weights/activations, 8-bit errors; times are medians per step")
    # Other processes on the same cores stall multi-threaded ops; the load average says how busy it was.
    print("load average at start: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    header = (
        f"{'case':<44}{'plain ms':>10}{'quant ms':>10}{'ratio':>8}{'paired':>8}{'target':>8}  {'ok':<4}"
        f"{'warm-up s':>10}"
    )
    print(header)
    print("-" * len(header))
    for key in selected:
        case = cases[key]()
        result = run_case(case, args.repeats)
        ok = "yes" if result["ratio"] <= case.target else "NO"
        print(f"{case.name:<44}{result['plain_ms']:>10.1f}{result['quant_ms']:>10.1f}{result['ratio']:>8.3f}"
              f"{result['paired']:>8.3f}{case.target:>8.2f}  {ok:<4}{result['warmup_s']:>10.2f}", flush=True)
    print("ratio = median quantized / median plain; paired = median of per-repeat ratios;")
    print("warm-up = first quantized step, including any torch.compile of the fused error kernel")
    print("load average at end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))


if __name__ == "__main__":
    main()
