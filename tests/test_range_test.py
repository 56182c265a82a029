"""Precision range test: on a task built to fail below k bits and succeed from k bits, it finds k."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import hf_cpt
from hf_cpt import CPTConfig, precision_range_test
from hf_cpt.diagnostics.range_test import PrecisionRangeResult


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run several times faster on one thread (and leave the other cores alone)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def k_bit_task(k: int, n: int = 2048, dim: int = 8, seed: int = 0):
    """Binary labels that only a k-bit input quantizer can see.

    Every input holds a 1 and a 0 (so each batch's activation range is exactly [0, 1]) and, in its
    other features, ``delta * label``. A b-bit quantizer of [0, 1] rounds ``delta * (2^b - 1)``; with
    ``0.5 / (2^k - 1) < delta < 0.5 / (2^(k-1) - 1)`` that is 0 for every b < k (both classes give
    the same quantized input: training cannot beat chance) and 1 for b >= k (the classes separate).
    """
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (n,), generator=g)
    delta = (0.5 / (2**k - 1) + 0.5 / (2 ** (k - 1) - 1)) / 2
    x = torch.zeros(n, dim)
    x[:, 0] = 1.0
    x[:, 2:] = delta * labels[:, None].float()
    return x, labels


class MLP(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.hidden = nn.Linear(dim, 16)
        self.out = nn.Linear(16, 2)  # not a head name: quantized too

    def forward(self, x=None, labels=None):
        logits = self.out(torch.relu(self.hidden(x)))
        if labels is None:
            return logits
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def quantized_mlp(seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    model = MLP()
    hf_cpt.quantize_model(model, CPTConfig(fused_error_quantizer=False, quant_scheme="paper"))
    return model


def loader(k: int):
    x, y = k_bit_task(k)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0)
    )


def adam(params):
    return torch.optim.Adam(params, lr=0.03)


def test_the_task_fails_below_k_bits_and_trains_from_k_bits():
    """The premise of the PRT tests, checked directly: 60 steps at 3 bits stay at chance, 4 bits learn."""
    final = {}
    for bits in (3, 4):
        model = quantized_mlp()
        hf_cpt.set_precision(model, bits, 8)
        optimizer = adam(model.parameters())
        accuracies = []
        batches = list(loader(4))
        for step in range(60):
            x, y = batches[step % len(batches)]
            logits = model(x)
            nn.functional.cross_entropy(logits, y).backward()
            optimizer.step()
            optimizer.zero_grad()
            accuracies.append((logits.argmax(-1) == y).float().mean().item())
        final[bits] = sum(accuracies[-15:]) / 15
    assert final[3] < 0.62 and final[4] > 0.95, final


@pytest.mark.parametrize("k", [3, 4])
def test_prt_finds_the_known_lower_bound(k, tmp_path):
    model = quantized_mlp()
    before = {name: p.detach().clone() for name, p in model.state_dict().items()}
    rng_before = torch.random.get_rng_state()
    result = precision_range_test(
        model, loader(k), start_bits=2, max_bits=8, steps_per_precision=30, threshold=0.2, optimizer=adam
    )
    assert result.found and result.bits_min == k, str(result)
    assert result.bits == k
    assert list(result.curve) == list(range(2, k + 1))  # stops at the first precision that passes
    assert result.steps == 30 * (k - 1) and all(len(values) == 30 for values in result.curve.values())
    assert result.gbitops > 0
    assert result.baseline == pytest.approx(0.5, abs=0.15)
    for bits in range(2, k):
        assert result.scores[bits] < 0.65 and result.improvements[bits] < 0.2
    assert result.scores[k] > 0.9
    # restore_weights=True (default): the test leaves no trace on the model, its precision or the RNG
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    assert hf_cpt.find_precision_state(model).current == (None, None)
    # saved as a plot and as JSON
    png = result.save_plot(str(tmp_path / "prt.png"))
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    restored = PrecisionRangeResult.from_dict(json.loads(json.dumps(result.to_dict())))
    assert restored.bits_min == k and restored.curve[k] == result.curve[k]
    assert f"bits_min = {k}" in str(result)


def test_prt_with_the_loss_and_dict_batches():
    x, y = k_bit_task(4)
    batches = [{"x": x[i : i + 64], "labels": y[i : i + 64]} for i in range(0, 2048, 64)]
    result = precision_range_test(
        quantized_mlp(), batches, steps_per_precision=30, threshold=0.3, metric="loss", optimizer=adam,
        stop_at_first=False,
    )
    assert result.bits_min == 4, str(result)
    assert list(result.curve) == list(range(2, 9))  # stop_at_first=False measures every precision
    assert result.improvements[3] < 0.05 < 0.3 < result.improvements[4]


def test_prt_keeping_the_weights_as_in_the_paper():
    model = quantized_mlp()
    before = model.hidden.weight.detach().clone()
    # A gentler lr than elsewhere: here the 2- and 3-bit iterations train the real weights, and at
    # lr 0.03 they leave this small ReLU net unable to learn even at 8 bits (the damage that
    # restore_weights=True, the default, keeps away from the model).
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    result = precision_range_test(
        model, loader(4), steps_per_precision=40, threshold=0.2, optimizer=optimizer, restore_weights=False
    )
    assert result.bits_min == 4 and not result.restore_weights, str(result)
    assert not torch.equal(model.hidden.weight, before)  # the iterations were real training
    assert optimizer.state  # and the optimizer kept its state


def test_prt_on_a_plain_model_converts_it_for_the_test_only():
    torch.manual_seed(0)
    model = MLP()
    result = precision_range_test(model, loader(3), steps_per_precision=30, threshold=0.2, optimizer=adam,
                                  cpt_config=CPTConfig(quant_scheme="paper"))
    assert result.bits_min == 3
    assert not hf_cpt.convert.is_quantized(model) and type(model.hidden) is nn.Linear


def test_no_precision_passing_falls_back_to_max_bits():
    result = precision_range_test(
        quantized_mlp(), loader(4), start_bits=2, max_bits=3, steps_per_precision=10, threshold=0.2, optimizer=adam
    )
    assert not result.found and result.bits_min == 3
    assert "no precision passed" in str(result)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"start_bits": 0}, "start_bits"),
        ({"max_bits": 33}, "max_bits"),
        ({"start_bits": 6, "max_bits": 4}, "start_bits"),
        ({"steps_per_precision": 0}, "steps_per_precision"),
        ({"threshold": -1}, "threshold"),
        ({"metric": "f1"}, "metric"),
        ({"window": 100}, "window"),
        ({"grad_bits": 0}, "grad_bits"),
        ({"optimizer": "adam"}, "optimizer"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        precision_range_test(quantized_mlp(), loader(4), **kwargs)


def test_bad_data():
    with pytest.raises(ValueError, match="data"):
        precision_range_test(quantized_mlp(), None)
    with pytest.raises(ValueError, match="ran out of batches"):
        precision_range_test(quantized_mlp(), iter([]), steps_per_precision=2)
    with pytest.raises(ValueError, match="batch must be"):
        precision_range_test(quantized_mlp(), [torch.zeros(4, 8)], steps_per_precision=2)
    with pytest.raises(ValueError, match="metric='loss'"):  # accuracy of a model without class logits
        x = torch.zeros(4, 8)
        precision_range_test(quantized_mlp(), [(x, torch.zeros(4, 2, dtype=torch.long))], steps_per_precision=2,
                             loss_fn=lambda logits, labels: logits.sum())


class DictDataset(torch.utils.data.Dataset):
    def __init__(self, k: int) -> None:
        self.x, self.y = k_bit_task(k)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def test_trainer_with_bits_min_auto(tmp_path):
    from transformers import TrainingArguments

    torch.manual_seed(0)
    config = CPTConfig(
        bits_min="auto", bits_max=8, quant_scheme="paper", schedule="CR", num_cycles=2, fused_error_quantizer=False,
        prt_metric="accuracy", prt_threshold=0.2, prt_steps_per_precision=30,
    )
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=16, per_device_train_batch_size=64, learning_rate=0.03,
        warmup_steps=0, weight_decay=0.0, logging_steps=8, save_strategy="no", report_to=[], use_cpu=True,
        disable_tqdm=True, seed=0,
    )
    trainer = hf_cpt.CPTTrainer(model=MLP(), args=args, train_dataset=DictDataset(4), cpt_config=config)
    trainer.train()
    callback = trainer.cpt_callback
    assert callback.prt_result.bits_min == 4, str(callback.prt_result)
    assert callback.schedule.bits_min == 4 and callback.schedule.bits_max == 8
    with open(tmp_path / "cpt_cost_report.json") as f:
        report = json.load(f)
    assert report["bits_min"] == 4 and report["prt"]["bits_min"] == 4 and report["prt"]["steps"] == 90
    assert report["cpt_config"]["bits_min"] == "auto"
    assert set(report["steps_at_bits"]) <= {"4", "5", "6", "7", "8"} and report["steps"] == 16
    assert report["gbitops"] < report["static_gbitops"] < report["fp32_gbitops"]
    assert os.path.exists(tmp_path / "cpt_prt.png") and os.path.exists(tmp_path / "cpt_prt.json")
    final = [entry for entry in trainer.state.log_history if "train_loss" in entry][-1]
    assert final["cpt/bits_min"] == 4 and final["cpt/prt_steps"] == 90
    assert final["cpt/static_gbitops"] == pytest.approx(report["static_gbitops"])
    assert final["cpt/fp32_gbitops"] == pytest.approx(report["fp32_gbitops"])


def test_trainer_with_a_callable_schedule_delay_and_grad_schedule(tmp_path):
    from transformers import TrainingArguments

    def two_levels(step):
        return 4 if step % 2 else 6

    config = CPTConfig(
        schedule=two_levels, delay=0.25, delay_precision="fp32", grad_schedule="LR", grad_bits_min=6, grad_bits=8,
        num_cycles=1, fused_error_quantizer=False,
    )
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=64, logging_steps=4, save_strategy="no",
        report_to=[], use_cpu=True, disable_tqdm=True,
    )
    trainer = hf_cpt.CPTTrainer(model=MLP(), args=args, train_dataset=DictDataset(4), cpt_config=config)
    seen = []
    original = trainer.cpt_callback._set_bits

    def record(step):
        original(step)
        seen.append((trainer.cpt_callback.bits, trainer.cpt_callback.grad_bits))

    trainer.cpt_callback._set_bits = record
    trainer.train()
    per_step = dict(zip(range(8), seen[1:]))  # seen[0]: on_train_begin
    assert [per_step[t] for t in range(8)] == [
        (None, None), (None, None), (6, 6), (4, 6), (6, 7), (4, 7), (6, 7), (4, 7)
    ]
    with open(tmp_path / "cpt_cost_report.json") as f:
        report = json.load(f)
    assert report["steps_at_bits"] == {"4": 3, "6": 3, "fp32": 2}
    assert report["cpt_config"]["schedule"].startswith("<callable")


def test_prt_with_the_default_rotated_per_token_scheme():
    torch.manual_seed(0)
    model = MLP()
    hf_cpt.quantize_model(model, CPTConfig(fused_error_quantizer=False))
    assert model.hidden.rotation is not None and model.hidden.cpt_granularity == "token"
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = precision_range_test(model, loader(3), start_bits=2, max_bits=4, steps_per_precision=10,
                                  threshold=0.2, optimizer=adam, stop_at_first=False)
    assert set(result.scores) == {2, 3, 4} and all(v == v for v in result.scores.values())
    assert 2 <= result.bits_min <= 4 and result.gbitops > 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # weights restored
