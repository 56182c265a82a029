"""Exports of trained hf_cpt models read where hf_cpt is not installed: the portable and the compressed-tensors
checkpoints, through transformers' ``from_pretrained`` and lm-eval's ``HFLM`` in fresh processes (docs/clients.md)."""

from __future__ import annotations

import json

import pytest
import torch

from hf_cpt import CPTConfig, quantize_model, set_precision
from hf_cpt.convert import quant_layers

from .fresh_python import run_python
from .test_clients import WORDS, _relative, _tiny_llama

REQUESTS = [("the cat sat", " on the mat"), ("a big dog", " ran quickly")]


def _trained_llama(tmp_path, **settings):
    """A tiny Llama-style model with its tokenizer, quantized with ``settings`` and trained 3 steps at 8 bits."""
    from .helpers import build_word_tokenizer

    tokenizer = build_word_tokenizer(WORDS, str(tmp_path))
    tokenizer.bos_token, tokenizer.eos_token = "[CLS]", "[SEP]"  # lm-eval's prefix token
    model = _tiny_llama(len(tokenizer))
    quantize_model(model, CPTConfig(**settings))
    set_precision(model, 8, 8)
    ids = tokenizer([" ".join(WORDS[i:i + 6]) for i in range(8)], return_tensors="pt")["input_ids"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval(), tokenizer, ids


def _elsewhere(path: str, probe: str | None = None) -> dict:
    """Load ``path`` in a fresh process that never imports hf_cpt: transformers' ``from_pretrained`` and lm-eval's
    ``HFLM`` on `REQUESTS`; with a ``probe`` file (ids, {layer: input}), the logits and each layer's output too."""
    code = (
        "import json, sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "from lm_eval.api.instance import Instance\n"
        "from lm_eval.models.huggingface import HFLM\n"
        f"plain = AutoModelForCausalLM.from_pretrained({path!r}).eval()\n"
        "out = {'plain': type(plain.model.layers[0].mlp.up_proj).__name__,\n"
        "       'dtype': str(plain.model.layers[0].mlp.up_proj.weight.dtype)}\n"
        f"probe = {probe!r}\n"
        "if probe:\n"
        "    probe = torch.load(probe)\n"
        "    with torch.no_grad():\n"
        "        out['logits'] = plain(input_ids=probe['ids']).logits.tolist()\n"
        "        out['layers'] = {n: plain.get_submodule(n)(x).tolist() for n, x in probe['inputs'].items()}\n"
        f"lm = HFLM(pretrained={path!r}, device='cpu', batch_size=2)\n"
        f"requests = [Instance('loglikelihood', {{}}, pair, i) for i, pair in enumerate({REQUESTS!r})]\n"
        "out['got'] = [value for value, _ in lm.loglikelihood(requests)]\n"
        "out['tokens'] = [[lm.tok_encode(c), lm.tok_encode(c + x)] for c, x in (r.args for r in requests)]\n"
        "out['hf_cpt'] = any(m.startswith('hf_cpt') for m in sys.modules)\n"
        "print(json.dumps(out))\n"
    )
    return json.loads(run_python(["-c", code], check=True).stdout.strip().splitlines()[-1])


def _loglikelihoods(model, tokens) -> list[float]:
    """The log-likelihood of each continuation under ``model``, on lm-eval's tokens (the continuation cut off the
    whole, as lm-eval pairs them)."""
    expected = []
    for context_ids, whole in tokens:
        sequence = context_ids + whole[len(context_ids):]
        with torch.no_grad():
            logprobs = torch.log_softmax(model(input_ids=torch.tensor([sequence[:-1]])).logits.float(), -1)[0]
        expected.append(sum(float(logprobs[i - 1, sequence[i]]) for i in range(len(context_ids), len(sequence))))
    return expected


def _snapped_float_model(model):
    """``model`` as a float model whose CPT layers' weights are the ones they computed with at 8 bits."""
    from hf_cpt.convert import dequantize_model
    from hf_cpt.nn.base import QuantLayerMixin

    for layer in model.modules():
        if isinstance(layer, QuantLayerMixin):
            with torch.no_grad():
                layer.weight.copy_(layer.quantized_weight(8))
    return dequantize_model(model).eval()


def test_a_portable_export_loads_in_lm_eval_and_transformers_without_hf_cpt(tmp_path):
    """A trained Llama-style model exported portable: in a fresh process that never imports hf_cpt, transformers'
    ``from_pretrained`` and lm-eval's ``HFLM`` load it (no quantization_config for them to refuse) and compute the
    float model whose weights are the trained ones on the 8-bit grid."""
    from hf_cpt import export_portable

    model, tokenizer, _ = _trained_llama(tmp_path)
    export_portable(model, tmp_path / "portable", 8, processing_class=tokenizer, model_card=False)
    out = _elsewhere(str(tmp_path / "portable"))
    assert out["hf_cpt"] is False and out["plain"] == "Linear"
    assert out["got"] == pytest.approx(_loglikelihoods(_snapped_float_model(model), out["tokens"]), abs=1e-4)


def _tie_free_rows(x: torch.Tensor, granularity: str, act_min, act_max, bits: int = 8) -> torch.Tensor:
    """The rows of a layer's input with no value near a rounding tie of its quantization (``(x - m) / s`` within
    1e-4 of ``k + 1/2``, ten times both arithmetics' rounding): the format (``x/s + z``) may round it the other way."""
    if granularity == "token":
        low, high = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    else:
        low, high = act_min, act_max
    steps = (x - low) / ((high - low) / (2**bits - 1)).clamp_min(1e-8)
    return ((steps - steps.floor() - 0.5).abs() > 1e-4).all(-1)


@pytest.mark.parametrize("scheme", ["per-token", "paper"])
def test_a_compressed_tensors_export_computes_the_trained_layers_without_hf_cpt(tmp_path, scheme):
    """Per-token and per-tensor (running range) layers keep their trained int8 codes and their input quantization
    in the compressed-tensors format: in a fresh process with transformers, compressed-tensors and lm-eval but no
    hf_cpt, every layer computes what the trained layer computes on the same input (to float rounding, rows with a
    rounding tie aside; the float model with the same weights differs on every row), and lm-eval's ``HFLM`` scores
    with that model."""
    from transformers import AutoModelForCausalLM

    from hf_cpt import export_compressed_tensors
    from hf_cpt.serialization.compressed_tensors import _watch_inputs

    model, tokenizer, ids = _trained_llama(tmp_path, quant_scheme=scheme)
    path = str(tmp_path / "ct")
    export_compressed_tensors(model, path, 8, processing_class=tokenizer, model_card=False)
    assert json.loads((tmp_path / "ct" / "cpt_config.json").read_text())["export_effect"]["float_layers"] == {}
    seen = {}
    hooks = _watch_inputs(dict(quant_layers(model)), lambda name, x: seen.setdefault(name, x.detach()))
    with torch.no_grad():
        trained = model(input_ids=ids).logits  # in eval at 8 bits (set_precision)
        trained_layers = {name: layer(seen[name]) for name, layer in quant_layers(model)}
    for hook in hooks:
        hook.remove()
    torch.save({"ids": ids, "inputs": seen}, tmp_path / "probe.pt")
    out = _elsewhere(path, str(tmp_path / "probe.pt"))
    assert out["hf_cpt"] is False and out["dtype"] == "torch.int8"  # the codes, until the first forward
    schemes = {name: (layer.cpt_granularity, layer.act_min.clone(), layer.act_max.clone())
               for name, layer in quant_layers(model)}
    float_model = _snapped_float_model(model)
    for name, expected in trained_layers.items():
        rows = _tie_free_rows(seen[name], *schemes[name])
        assert rows.float().mean() > 0.75, name  # the check below reads most rows
        got = torch.tensor(out["layers"][name])
        assert _relative(got[rows], expected[rows]) < 1e-5, name
        with torch.no_grad():
            float_output = float_model.get_submodule(name)(seen[name])
        assert _relative(float_output[rows], expected[rows]) > 1e-4, name  # what the format's quantization changes
    loaded = torch.tensor(out["logits"])
    assert (loaded.argmax(-1) == trained.argmax(-1)).float().mean() > 0.9
    in_this_process = AutoModelForCausalLM.from_pretrained(path).eval()  # transformers + compressed-tensors
    assert out["got"] == pytest.approx(_loglikelihoods(in_this_process, out["tokens"]), abs=1e-4)


@pytest.mark.parametrize("case", ["llama-rotated", "gpt2-conv1d"])
def test_a_compressed_tensors_export_names_the_layers_it_runs_in_float_and_measures_them(tmp_path, case, caplog):
    """Rotated layers (the default scheme: transformers applies no compressed-tensors transforms) and GPT-2's Conv1D
    layers run in float in the format, with the weights they trained to: the export names them (warning,
    cpt_config.json, model card) and its measured change is the loaded model's."""
    import logging

    from transformers import AutoModelForCausalLM, GPT2LMHeadModel

    from hf_cpt import export_compressed_tensors

    from .helpers import tiny_gpt2_config

    if case == "llama-rotated":
        model, _, ids = _trained_llama(tmp_path)
        reason = "rotated inputs"
    else:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(tiny_gpt2_config())
        quantize_model(model, CPTConfig(quant_scheme="per-token"))
        set_precision(model, 8, 8)
        model.eval()
        ids = torch.randint(0, model.config.vocab_size, (4, 10))
        reason = "QuantConv1D is not an nn.Linear"
    layers = [name for name, _ in quant_layers(model)]
    with caplog.at_level(logging.WARNING, logger="hf_cpt.serialization.compressed_tensors"):
        export_compressed_tensors(model, tmp_path / "ct", 8, measure_inputs={"input_ids": ids})
    assert f"runs {len(layers)} CPT layer(s) in float" in caplog.text
    effect = json.loads((tmp_path / "ct" / "cpt_config.json").read_text())["export_effect"]
    assert [names for why, names in effect["float_layers"].items() if why.startswith(reason)] == [layers]
    assert f"{len(layers)} CPT layer(s) run in float here" in (tmp_path / "ct" / "README.md").read_text()
    with torch.no_grad():
        trained = model(input_ids=ids).logits
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ct")(input_ids=ids).logits
        float_model = _snapped_float_model(model)(input_ids=ids).logits
    assert effect["max_relative_output_change"] == pytest.approx(_relative(loaded, trained), rel=1e-5)
    assert _relative(loaded, float_model) < 1e-5  # the trained weights, inputs not quantized


def test_a_per_token_layer_fed_2d_inputs_runs_in_float_where_the_format_would_quantize_them_per_tensor(tmp_path):
    """The format quantizes a 2-D input (BERT's pooler reads one row per sequence) per tensor, not per token: such a
    layer is written as float with its trained weights, named, and the other layers keep their int8 codes."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification, BertForSequenceClassification

    from hf_cpt import export_compressed_tensors

    from .helpers import tiny_bert_config

    torch.manual_seed(0)
    model = BertForSequenceClassification(tiny_bert_config())
    quantize_model(model, CPTConfig(quant_scheme="per-token"))
    set_precision(model, 8, 8)
    model.eval()
    export_compressed_tensors(model, tmp_path / "ct", 8, model_card=False)
    effect = json.loads((tmp_path / "ct" / "cpt_config.json").read_text())["export_effect"]
    assert {why.split(",")[0]: names for why, names in effect["float_layers"].items()} == {
        "2-D inputs": ["bert.pooler.dense"]}
    tensors = load_file(str(tmp_path / "ct" / "model.safetensors"))
    assert tensors["bert.pooler.dense.weight"].dtype == torch.float32
    assert tensors["bert.encoder.layer.0.attention.self.query.weight"].dtype == torch.int8
    x = torch.randn(3, model.config.hidden_size)
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "ct").eval()
    with torch.no_grad():
        loaded(input_ids=torch.randint(5, 100, (2, 6)))  # the first forward decompresses
        pooler = model.bert.pooler.dense
        expected = torch.nn.functional.linear(x, pooler.quantized_weight(8), pooler.bias)
        assert torch.allclose(loaded.bert.pooler.dense(x), expected, atol=1e-6)


def test_cpt_trainer_saves_a_compressed_tensors_export_measured_on_its_eval_batch(tmp_path):
    """``CPTTrainer.save_model(save_format="compressed-tensors")`` writes the export with its tokenizer and model card,
    measured on a batch of the evaluation data; a machine without the package is told before training."""
    import importlib.util
    from unittest import mock

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainingArguments

    from hf_cpt import CPTTrainer, ExportSettings

    model, tokenizer, ids = _trained_llama(tmp_path, quant_scheme="per-token")
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4,
                             report_to=[], use_cpu=True, save_strategy="no")
    trainer = CPTTrainer(model=model, args=args, train_dataset=data, eval_dataset=data, processing_class=tokenizer,
                         cpt_config=CPTConfig(quant_scheme="per-token", bits_min=4, bits_max=8, num_cycles=1))
    trainer.train()
    trainer.save_model(save_format="compressed-tensors")
    out = tmp_path / "out"
    effect = json.loads((out / "cpt_config.json").read_text())["export_effect"]
    assert effect["inputs"] == "evaluation batch" and "loss_change" in effect and effect["float_layers"] == {}
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "compressed-tensors"
    assert "compressed-tensors" in (out / "README.md").read_text() and (out / "tokenizer_config.json").exists()
    with torch.no_grad():
        trained = model.eval()(input_ids=ids).logits
        loaded = AutoModelForCausalLM.from_pretrained(out)(input_ids=ids).logits
    assert torch.equal(loaded.argmax(-1), trained.argmax(-1)) and _relative(loaded, trained) < 1e-3
    real_find_spec = importlib.util.find_spec
    absent = lambda name, *args: None if name == "compressed_tensors" else real_find_spec(name, *args)
    with mock.patch("importlib.util.find_spec", absent), pytest.raises(ImportError, match="pip install compressed"):
        ExportSettings(save_format="compressed-tensors")
