"""A pretrained-like transformer (outlier features injected) is not trained into chance silently."""

import logging

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, TrainingArguments

from hf_cpt import CPTConfig, CPTTrainer, quantize_model
from hf_cpt.diagnostics.fidelity import cosine_fidelity, output_fidelity

OUTLIER_CHANNELS = [3, 17]


def outlier_bert() -> BertForSequenceClassification:
    """A small BERT whose FFN output projections see a few huge input features, as pretrained BERTs do.

    The outlier channels of each intermediate layer are scaled up 300x and the matching columns of the
    output projection down 300x, so the network's function is nearly unchanged but a per-tensor range set
    by the outliers leaves the other features almost no levels.
    """
    torch.manual_seed(0)
    model = BertForSequenceClassification(
        BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512,
                   max_position_embeddings=64, num_labels=3)
    )
    with torch.no_grad():
        for layer in model.bert.encoder.layer:
            layer.intermediate.dense.weight[OUTLIER_CHANNELS] *= 300.0
            layer.intermediate.dense.bias[OUTLIER_CHANNELS] = 300.0
            layer.output.dense.weight[:, OUTLIER_CHANNELS] /= 300.0
    return model


def batch():
    return {"input_ids": torch.randint(5, 128, (8, 16), generator=torch.Generator().manual_seed(1))}


def test_cosine_fidelity_reference():
    a = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    assert cosine_fidelity(a, a) == pytest.approx(1.0)
    assert cosine_fidelity(a, torch.tensor([[0.0, 1.0], [0.0, 5.0]])) == pytest.approx(0.5)


def test_default_scheme_keeps_the_representation_the_paper_scheme_loses():
    paper = outlier_bert()
    quantize_model(paper, CPTConfig(quant_scheme="paper"))
    default = outlier_bert()
    quantize_model(default, CPTConfig())
    low_paper, low_default = output_fidelity(paper, batch(), 4)[4], output_fidelity(default, batch(), 4)[4]
    assert low_paper < 0.2 and low_default > low_paper + 0.4
    # at 8 bits both keep it, and the measurement leaves the model as it was (training mode, eval precision)
    default.train()
    assert output_fidelity(default, batch(), [8])[8] > 0.99 and default.training


def _train(config, tmp_path, caplog):
    tokens = torch.Generator().manual_seed(2)  # the same data whatever ran before in this process
    dataset = [{"input_ids": torch.randint(5, 128, (16,), generator=tokens), "labels": i % 3} for i in range(16)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=8, logging_steps=1,
                             save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, seed=0)
    trainer = CPTTrainer(model=outlier_bert(), args=args, train_dataset=dataset, cpt_config=config)
    with caplog.at_level(logging.WARNING, logger="hf_cpt.integrations.callback"):
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer.cpt_callback.fidelity, losses


def test_trainer_warns_with_the_figure_and_the_fix(tmp_path, caplog):
    fidelity, _ = _train(CPTConfig(bits_min=4, num_cycles=1, quant_scheme="paper"), tmp_path, caplog)
    assert fidelity[4] < 0.8
    warning = next(r.getMessage() for r in caplog.records if "cosine similarity" in r.getMessage())
    assert f"{fidelity[4]:.3f}" in warning and "quant_scheme='rotated-per-token'" in warning


def test_trainer_says_when_no_bits_min_up_to_bits_max_passes(tmp_path, caplog):
    fidelity, _ = _train(CPTConfig(bits_min=3, bits_max=4, num_cycles=1, quant_scheme="paper"), tmp_path, caplog)
    assert fidelity[3] < 0.8 and fidelity[4] < 0.8  # measured on the way: neither passes
    warning = next(r.getMessage() for r in caplog.records if "cosine similarity" in r.getMessage())
    assert "no bits_min up to bits_max=4 passes" in warning and "CPTConfig(bits_min=" not in warning


def test_trainer_default_names_the_lowest_bits_min_that_passes_and_the_check_changes_nothing(tmp_path, caplog):
    fidelity, losses = _train(CPTConfig(bits_min=4, num_cycles=1), tmp_path / "a", caplog)
    warnings = [r.getMessage() for r in caplog.records if "cosine similarity" in r.getMessage()]
    assert fidelity[4] < 0.8 and len(warnings) == 1  # the outliers defeat 4 bits even with the default scheme
    passing = max(fidelity)  # the search stops at the first bit-width that passes
    assert 4 < passing <= 8 and fidelity[passing] >= 0.8 and all(fidelity[b] < 0.8 for b in range(4, passing))
    assert f"CPTConfig(bits_min={passing}) (cosine {fidelity[passing]:.3f}" in warnings[0]
    assert "quant_scheme=" not in warnings[0].split("Use ")[1]  # the default scheme already applies
    caplog.clear()
    unchecked, unchecked_losses = _train(CPTConfig(bits_min=4, num_cycles=1, fidelity_threshold=None),
                                         tmp_path / "b", caplog)
    assert unchecked is None and unchecked_losses == losses  # same data order, same random numbers
