import json
import logging
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_cpt import CPTCallback, CPTConfig, CPTTrainer, quantize_model
from hf_cpt.convert import activation_ranges
from hf_cpt.nn.base import QuantLayerMixin
from hf_cpt.schedules.schedule import PrecisionSchedule


def training_args(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=16,
        learning_rate=2e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        data_seed=0,
    )
    values.update(overrides)
    return TrainingArguments(**values)


def token_classification_data(n=256, seq_len=12, seed=0):
    """Label = first token id mod 3: learnable by a tiny BERT in a few dozen steps."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 128, (n, seq_len), generator=generator)
    return [{"input_ids": row, "attention_mask": torch.ones(seq_len, dtype=torch.long), "labels": int(row[0] % 3)}
            for row in ids]


def digits_data():
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    return [{"pixel_values": image, "labels": int(label)} for image, label in zip(images, digits.target)]


class BitsProbe(TrainerCallback):
    """Records the bits each training forward pass of one layer actually used."""

    def __init__(self):
        self.forward_bits, self.eval_bits, self.logs = [], [], []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.ranges_at_start = activation_ranges(model)
        layer = next(m for m in model.modules() if isinstance(m, QuantLayerMixin))

        def record(module, inputs):
            bits = module.forward_bits()
            value = None if bits is None else int(bits.item())
            (self.forward_bits if module.training else self.eval_bits).append((self.step, value))

        layer.register_forward_pre_hook(record)

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_cpt_trainer_trains_a_small_bert_and_follows_the_schedule(tiny_bert, tmp_path):
    probe = BitsProbe()
    config = CPTConfig(bits_min=3, bits_max=8, num_cycles=4)
    trainer = CPTTrainer(
        model=tiny_bert,
        args=training_args(tmp_path, max_steps=60),
        train_dataset=token_classification_data(),
        eval_dataset=token_classification_data(64, seed=1),
        callbacks=[probe],
        cpt_config=config,
    )
    assert trainer.cpt_report is not None and len(trainer.cpt_report.quantized) == 13
    trainer.train()
    history = losses(trainer)
    assert np.mean(history[-10:]) < np.mean(history[:10]) - 0.2
    schedule = PrecisionSchedule("cpt", 3, 8, 60, 4)
    assert probe.forward_bits == [(step, schedule(step)) for step in range(60)]
    assert {b for _, b in probe.forward_bits} == {3, 4, 5, 6, 7, 8}
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert all("cpt/bits" in entry and entry["cpt/grad_bits"] == 8 for entry in logged)
    assert logged[0]["cpt/bits"] == schedule(0) and logged[-1]["cpt/bits"] == schedule(59)
    assert 0.6 < logged[-1]["cpt/cost_vs_static"] < 1.0
    # Evaluation runs at bits_max whatever the schedule says.
    metrics = trainer.evaluate()
    assert np.isfinite(metrics["eval_loss"])
    assert probe.eval_bits and all(bits == 8 for _, bits in probe.eval_bits)
    report = json.load(open(os.path.join(trainer.args.output_dir, "cpt_cost_report.json")))
    assert report["steps"] == 60 and sum(report["steps_at_bits"].values()) == 60
    assert report["gbitops"] < report["static_gbitops"] < report["fp32_gbitops"]


def test_cpt_trainer_trains_a_small_cnn_on_digits(tiny_cnn, tmp_path):
    trainer = CPTTrainer(
        model=tiny_cnn,
        args=training_args(tmp_path, num_train_epochs=1, per_device_train_batch_size=32, learning_rate=1e-2),
        train_dataset=digits_data(),
        cpt_config=CPTConfig(bits_min=3, bits_max=8, num_cycles=4),
    )
    trainer.train()
    history = losses(trainer)
    assert trainer.state.max_steps == 57  # epochs x steps per epoch as the Trainer computes them
    assert np.mean(history[-10:]) < 0.6 * np.mean(history[:5])


def test_bits_are_constant_across_gradient_accumulation(tiny_bert, tmp_path):
    probe = BitsProbe()
    trainer = CPTTrainer(
        model=tiny_bert,
        args=training_args(tmp_path, max_steps=8, gradient_accumulation_steps=2, per_device_train_batch_size=4),
        train_dataset=token_classification_data(64),
        callbacks=[probe],
        cpt_config=CPTConfig(bits_min=3, bits_max=8, num_cycles=2),
    )
    trainer.train()
    schedule = PrecisionSchedule("cpt", 3, 8, 8, 2)
    assert len(probe.forward_bits) == 16
    assert probe.forward_bits == [(step, schedule(step)) for step in range(8) for _ in range(2)]


def test_gradient_accumulation_rotates_each_weight_once_per_step_and_trains_the_same(tmp_path, monkeypatch):
    from transformers import BertForSequenceClassification

    from .helpers import tiny_bert_config

    kept = []  # how many layers' codes the cache holds: after each training forward, and during each optimizer step
    training = []

    class CacheProbe(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            training[:] = [True]  # (the run's start also runs forwards: the fidelity check's)

        def on_optimizer_step(self, args, state, control, **kwargs):
            kept.append(("optimizer", len(precision_of_probe[0].reused_weights._entries)))

    precision_of_probe = []

    def train(reuse: bool):
        if not reuse:
            monkeypatch.setattr(QuantLayerMixin, "_weight_reuse_key", lambda self, bits, training: None)
        torch.manual_seed(0)
        trainer = CPTTrainer(
            # 16 batches an epoch: five steps of 3 micro-batches, then one of 1; the seventh step starts an epoch
            model=BertForSequenceClassification(tiny_bert_config()),
            args=training_args(tmp_path / str(reuse), max_steps=7, gradient_accumulation_steps=3,
                               per_device_train_batch_size=4),
            train_dataset=token_classification_data(64),
            cpt_config=CPTConfig(bits_min=4, bits_max=8, num_cycles=2),
            callbacks=[CacheProbe()] if reuse else None,
        )
        precision_of_probe[:] = [trainer.model.bert.encoder.layer[0].attention.self.query.cpt_precision]
        trainer.model.register_forward_hook(
            lambda *_: training and kept.append(("forward", len(precision_of_probe[0].reused_weights._entries))))
        trainer.train()
        monkeypatch.undo()
        callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, CPTCallback))
        return trainer.model, callback.meter

    reused_model, reused_meter = train(True)
    # The micro-batches share the codes; a step's last forward hands them over to its backward instead of keeping
    # them (they would add a byte per weight to the backward's end), and the optimizer step runs with none kept.
    quantized = sum(isinstance(m, QuantLayerMixin) for m in reused_model.modules())
    full_step = [("forward", quantized), ("forward", quantized), ("forward", 0), ("optimizer", 0)]
    assert kept == full_step * 5 + [("forward", 0), ("optimizer", 0)] + full_step
    plain_model, plain_meter = train(False)
    for (name, a), b in zip(reused_model.state_dict().items(), plain_model.state_dict().values()):
        assert torch.equal(a, b), name  # reusing the codes changes no value
    layers = [m for m in reused_model.modules() if isinstance(m, QuantLayerMixin) and m.rotation is not None]
    precision = layers[0].cpt_precision
    assert precision.reused_weights.reuses == 6 * 2 * len(layers) and precision.reused_weights.epoch is None
    # The meter counts the weight rotations that ran: one per step instead of one per micro-batch.
    skipped = 6 * 2 * sum(m.weight.numel() * reused_meter._rotation_price[id(m)] for m in layers)
    assert plain_meter.totals.rotation_bitops - reused_meter.totals.rotation_bitops == pytest.approx(skipped)


def test_a_steps_micro_batches_are_counted_as_the_trainer_splits_an_epoch():
    from types import SimpleNamespace

    from hf_cpt.integrations.callback import micro_batches_of_step

    args = SimpleNamespace(gradient_accumulation_steps=3)
    # 16 batches an epoch: five steps of 3, one of 1, then the next epoch
    assert [micro_batches_of_step(args, step, range(16)) for step in range(8)] == [3, 3, 3, 3, 3, 1, 3, 3]
    assert [micro_batches_of_step(args, step, range(2)) for step in range(3)] == [2, 2, 2]  # fewer than one step
    assert micro_batches_of_step(args, 5, iter(range(16))) == 3  # no length: full steps


def test_resuming_from_the_last_checkpoint_reads_its_files_there(tmp_path):
    """``resume_from_checkpoint=True``: the callback's own files come from the last checkpoint; with none there the
    Trainer's error stands, before any training."""
    from transformers import BertForSequenceClassification, TrainerCallback

    from .helpers import tiny_bert_config

    class Interrupt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 2

    args = training_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2, per_device_train_batch_size=8)

    def trainer(*callbacks):
        torch.manual_seed(0)
        return CPTTrainer(model=BertForSequenceClassification(tiny_bert_config()), args=args, callbacks=list(callbacks),
                          train_dataset=token_classification_data(64), cpt_config=CPTConfig(bits_min=4))

    with pytest.raises(ValueError, match="No valid checkpoint"):
        trainer().train(resume_from_checkpoint=True)
    trainer(Interrupt()).train()
    resumed = trainer()
    resumed.train(resume_from_checkpoint=True)
    assert resumed.cpt_callback.resume_checkpoint == os.path.join(args.output_dir, "checkpoint-2")
    assert resumed.cpt_callback.meter.totals.steps == 4  # two restored from there, two run


def test_bits_after_resuming_from_a_checkpoint(tmp_path):
    from transformers import BertForSequenceClassification

    from .helpers import tiny_bert_config

    config = CPTConfig(bits_min=2, bits_max=8, num_cycles=2, quant_scheme="paper")
    args = training_args(tmp_path, max_steps=12, save_strategy="steps", save_steps=6, per_device_train_batch_size=8)
    torch.manual_seed(0)
    first = CPTTrainer(model=BertForSequenceClassification(tiny_bert_config()), args=args,
                       train_dataset=token_classification_data(128), cpt_config=config)
    first.train()
    uninterrupted = first.cpt_callback.cost_report()
    probe = BitsProbe()
    torch.manual_seed(0)
    resumed = CPTTrainer(model=BertForSequenceClassification(tiny_bert_config()), args=args,
                         train_dataset=token_classification_data(128), cpt_config=config, callbacks=[probe])
    resumed.train(resume_from_checkpoint=os.path.join(args.output_dir, "checkpoint-6"))
    # The cost meter resumes too: the resumed run reports the whole run's cost, as the uninterrupted one.
    report = resumed.cpt_callback.cost_report()
    assert report["steps"] == 12 and report["steps_at_bits"] == uninterrupted["steps_at_bits"]
    for key in ("gbitops", "static_gbitops", "fp32_gbitops", "cost_vs_static"):
        assert report[key] == pytest.approx(uninterrupted[key], rel=1e-9), key
    with open(os.path.join(args.output_dir, "cpt_cost_report.json")) as f:
        assert json.load(f)["gbitops"] == pytest.approx(uninterrupted["gbitops"], rel=1e-9)
    schedule = PrecisionSchedule("cpt", 2, 8, 12, 2)
    assert probe.forward_bits == [(step, schedule(step)) for step in range(6, 12)]
    assert len({b for _, b in probe.forward_bits}) > 2
    # The eval-mode activation ranges (buffers outside state_dict) resume too.
    from safetensors.torch import load_file

    saved = load_file(os.path.join(args.output_dir, "checkpoint-6", "cpt_activation_ranges.safetensors"))
    assert saved.keys() == probe.ranges_at_start.keys()
    assert all(torch.equal(saved[k], probe.ranges_at_start[k]) for k in saved)
    assert any(float(v) != 0.0 for v in saved.values())


def test_callback_with_a_plain_trainer_reaches_reporting_callbacks(tiny_bert, tmp_path):
    config = CPTConfig(bits_min=4, bits_max=8, num_cycles=2)
    quantize_model(tiny_bert, config)
    reporter = BitsProbe()  # registered before CPTCallback, like the report_to integrations
    trainer = Trainer(
        model=tiny_bert,
        args=training_args(tmp_path, max_steps=6),
        train_dataset=token_classification_data(96),
        callbacks=[reporter],
    )
    callback = CPTCallback(config).attach(trainer)
    assert trainer.callback_handler.callbacks[0] is callback and reporter in trainer.callback_handler.callbacks
    trainer.train()
    step_logs = [logs for logs in reporter.logs if "loss" in logs]
    assert len(step_logs) == 6 and all("cpt/bits" in logs and "cpt/gbitops" in logs for logs in step_logs)
    assert all("cpt/bits" in entry for entry in trainer.state.log_history if "loss" in entry)
    final = trainer.state.log_history[-1]
    assert "train_runtime" in final and "cpt/cost_vs_fp32" in final


def test_a_callback_behind_the_reporting_integrations_says_how_to_attach_it(caplog):
    callback = CPTCallback(CPTConfig())
    with caplog.at_level(logging.WARNING, logger="hf_cpt.integrations.callback"):
        callback._check_log_order(SimpleNamespace(report_to=["tensorboard"]))
    assert "CPTCallback(config).attach(trainer)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_cpt.integrations.callback"):
        callback._check_log_order(SimpleNamespace(report_to=["none"]))
        callback.attached = True
        callback._check_log_order(SimpleNamespace(report_to=["tensorboard"]))
    assert caplog.text == ""


def test_callback_refuses_a_model_that_was_not_quantized(tiny_bert, tmp_path):
    trainer = Trainer(model=tiny_bert, args=training_args(tmp_path, max_steps=2),
                      train_dataset=token_classification_data(32), callbacks=[CPTCallback(CPTConfig())])
    with pytest.raises(ValueError, match="quantize_model"):
        trainer.train()


def test_too_many_cycles_for_the_run_is_reported_before_training(tiny_bert, tmp_path):
    trainer = CPTTrainer(model=tiny_bert, args=training_args(tmp_path, max_steps=4),
                         train_dataset=token_classification_data(32), cpt_config=CPTConfig(num_cycles=32))
    with pytest.raises(ValueError, match="num_cycles"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_static_and_fp32_baselines_through_the_same_config(tiny_bert, tmp_path):
    from transformers import BertForSequenceClassification

    from .helpers import tiny_bert_config

    costs = {}
    for schedule in ("static", "fp32", "cpt"):
        torch.manual_seed(0)
        model = BertForSequenceClassification(tiny_bert_config())
        probe = BitsProbe()
        trainer = CPTTrainer(model=model, args=training_args(tmp_path / schedule, max_steps=8),
                             train_dataset=token_classification_data(128), callbacks=[probe],
                             cpt_config=CPTConfig(schedule=schedule, num_cycles=2))
        trainer.train()
        costs[schedule] = trainer.cpt_callback.cost_report()
        expected = {"static": {8}, "fp32": {None}, "cpt": {3, 4, 5, 6, 7, 8}}[schedule]
        assert {b for _, b in probe.forward_bits} <= expected
    assert costs["fp32"]["cost_vs_fp32"] == 1.0
    assert costs["static"]["cost_vs_static"] == 1.0
    assert costs["cpt"]["gbitops"] < costs["static"]["gbitops"] < costs["fp32"]["gbitops"]


def test_the_cost_report_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """A write that fails half-way (a full disk, a value JSON cannot hold) leaves the earlier report as it was and no
    partial file."""
    import json
    import types

    import hf_cpt.integrations.callback as callback_module
    from hf_cpt import CPTCallback, CPTConfig

    callback = CPTCallback(CPTConfig())
    callback.meter = types.SimpleNamespace(remove=lambda: None)
    monkeypatch.setattr(callback, "cost_report", lambda: {"steps": 1})
    monkeypatch.setattr(callback_module, "format_cost_report", lambda report: "report")
    (tmp_path / "cpt_cost_report.json").write_text('{"earlier": true}')

    def half_a_dump(report, f, **kwargs):
        f.write('{"steps": ')
        raise OSError("No space left on device")

    monkeypatch.setattr(callback_module.json, "dump", half_a_dump)
    args, state = types.SimpleNamespace(output_dir=str(tmp_path)), types.SimpleNamespace(is_world_process_zero=True)
    with pytest.raises(OSError, match="No space left"):
        callback.on_train_end(args, state, None)
    monkeypatch.undo()
    assert json.loads((tmp_path / "cpt_cost_report.json").read_text()) == {"earlier": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpt_cost_report.json"]


def test_a_nan_input_never_reaches_a_running_range_and_stops_the_trainer_at_its_step(tmp_path):
    """One NaN in one training batch: the per-tensor layers' running ranges skip it (a NaN range would quantize every
    later input, eval and export included, to NaN), count it, and the Trainer integration stops the run at that step
    naming the layers, instead of training on."""
    from transformers import BertForSequenceClassification, TrainingArguments

    from hf_cpt import CPTTrainer, quantize_model, set_precision
    from hf_cpt.convert import quant_layers
    from hf_cpt.diagnostics.finite import nonfinite_inputs

    from .helpers import tiny_bert_config

    torch.manual_seed(0)
    model = BertForSequenceClassification(tiny_bert_config())
    config = CPTConfig(quant_scheme="paper", schedule="static", fidelity_threshold=None)
    quantize_model(model, config)
    set_precision(model, 8, 8)
    model.train()
    embeds = torch.randn(2, 6, model.config.hidden_size)
    model(inputs_embeds=embeds)
    ranges = {name: (layer.act_min.clone(), layer.act_max.clone()) for name, layer in quant_layers(model)}
    assert nonfinite_inputs(model) == {}
    embeds[1, 2, 3] = float("nan")
    model(inputs_embeds=embeds)
    counts = nonfinite_inputs(model)
    assert counts and all(value == 1 for value in counts.values())
    assert nonfinite_inputs(model) == {}  # read once, then counted afresh
    for name, layer in quant_layers(model):
        assert torch.isfinite(layer.act_min) and torch.isfinite(layer.act_max), name
        if name in counts:
            assert (layer.act_min, layer.act_max) == ranges[name]  # skipped, not absorbed

    rows = [{"inputs_embeds": torch.randn(6, model.config.hidden_size), "labels": torch.tensor(i % 2)}
            for i in range(8)]
    rows[5]["inputs_embeds"][0, 0] = float("inf")  # the second batch of 4
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, report_to=[],
                             save_strategy="no", use_cpu=True, dataloader_drop_last=True)
    trainer = CPTTrainer(model=BertForSequenceClassification(tiny_bert_config()), args=args, cpt_config=config,
                         train_dataset=rows)
    with pytest.raises(ValueError, match=r"hf_cpt: at step 2 the training inputs of \d+ quantized layer\(s\) held "
                                         r"NaN or inf \(first: bert\.encoder\.layer\.0\.attention\.self\.query"):
        trainer.train()


def test_skipped_nonfinite_inputs_are_counted_and_weights_gone_nonfinite_stop_the_run(tmp_path, caplog):
    """With ``nonfinite_inputs="skip"`` the run goes past a non-finite input (one warning, a count in the logs);
    when the weights themselves go non-finite (here the inf's gradient, or a learning rate that overflows) the
    Trainer integration stops the run at that step naming the parameter, where the Trainer would log a filtered
    loss and train on."""
    import logging

    from transformers import BertForSequenceClassification, TrainingArguments

    from hf_cpt import CPTTrainer

    from .helpers import tiny_bert_config

    config = CPTConfig(quant_scheme="paper", schedule="static", fidelity_threshold=None, nonfinite_inputs="skip")
    rows = [{"inputs_embeds": torch.randn(6, 32), "labels": torch.tensor(i % 2)} for i in range(8)]
    rows[5]["inputs_embeds"][0, 0] = float("inf")
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, report_to=[],
                             save_strategy="no", use_cpu=True, dataloader_drop_last=True, logging_steps=1)
    torch.manual_seed(0)
    trainer = CPTTrainer(model=BertForSequenceClassification(tiny_bert_config()), args=args, cpt_config=config,
                         train_dataset=rows)
    with caplog.at_level(logging.WARNING, logger="hf_cpt.integrations.callback"), \
            pytest.raises(FloatingPointError, match=r"after optimizer step 2 the trained parameter '.+' holds NaN"):
        trainer.train()
    assert caplog.text.count("held NaN or inf") == 1 and trainer.cpt_callback.skipped_inputs > 0
    args.learning_rate = 1e38
    trainer = CPTTrainer(model=BertForSequenceClassification(tiny_bert_config()), args=args, cpt_config=config,
                         train_dataset=rows[:4] * 2)
    with pytest.raises(FloatingPointError, match="after optimizer step 1 the trained parameter"):
        trainer.train()


def test_a_model_quantized_with_another_config_is_refused_by_the_trainer(tmp_path):
    """A pre-quantized model keeps the numerics of the config it was quantized with: a CPTTrainer given another is
    refused, naming the settings (then, now); one that differs only in its schedule is the user's to choose."""
    from transformers import BertForSequenceClassification, TrainingArguments

    from hf_cpt import CPTTrainer, quantize_model

    from .helpers import tiny_bert_config

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    model = BertForSequenceClassification(tiny_bert_config())
    quantize_model(model, CPTConfig(quant_scheme="paper", exclude_modules=["pooler"]))
    with pytest.raises(ValueError, match=r"quantized with another CPTConfig \(\{'exclude_modules': \(\['pooler'\], "
                                         r"None\), 'quant_scheme': \('paper', 'auto'\)\}"):
        CPTTrainer(model=model, args=args, cpt_config=CPTConfig())
    same = CPTConfig(quant_scheme="paper", exclude_modules=["pooler"], bits_min=3, schedule="static")
    assert CPTTrainer(model=model, args=args, cpt_config=same).cpt_report is None  # kept as it was
