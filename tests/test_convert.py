import copy

import pytest
import torch
from torch import nn

from hf_cpt import CPTConfig, dequantize_model, quantize_model, set_precision
from hf_cpt.convert import output_head_names
from hf_cpt.nn.base import QuantLayerMixin


def quantized_names(model):
    return {name for name, module in model.named_modules() if isinstance(module, QuantLayerMixin)}


def test_bert_keeps_embeddings_norms_and_classifier_in_fp32(tiny_bert):
    keys_before = list(tiny_bert.state_dict())
    params_before = list(tiny_bert.parameters())
    report = quantize_model(tiny_bert, CPTConfig())
    names = quantized_names(tiny_bert)
    assert names == set(report.quantized)
    # 2 layers x (q, k, v, attention output, intermediate, output) + pooler
    assert len(names) == 2 * 6 + 1
    assert "classifier" in report.kept and "output head" in report.kept["classifier"]
    assert not any("embeddings" in n or "LayerNorm" in n for n in names)
    assert list(tiny_bert.state_dict()) == keys_before
    assert all(a is b for a, b in zip(tiny_bert.parameters(), params_before))


def test_gpt2_conv1d_layers_are_quantized_and_tied_lm_head_kept(tiny_gpt2):
    report = quantize_model(tiny_gpt2, CPTConfig())
    assert len(report.quantized) == 2 * 4  # c_attn, c_proj, mlp.c_fc, mlp.c_proj per block
    assert "lm_head" in report.kept
    assert tiny_gpt2.lm_head.weight is tiny_gpt2.transformer.wte.weight
    set_precision(tiny_gpt2, 4, 8)
    out = tiny_gpt2(torch.randint(0, 128, (2, 10)), labels=torch.randint(0, 128, (2, 10)))
    out.loss.backward()
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("architecture, head", [("resnet18", "fc"), ("vit_tiny_patch16_224", "head")])
def test_timm_models_keep_their_classifier(architecture, head):
    import timm

    model = timm.create_model(architecture, pretrained=False, num_classes=10)
    assert head in output_head_names(model)
    report = quantize_model(model, CPTConfig())
    assert head in report.kept
    convs = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    assert set(convs) <= set(report.quantized)  # stem / patch embedding included, as in the CIFAR code
    set_precision(model, 4, 8)
    size = 32 if architecture == "resnet18" else 224
    model(torch.randn(2, 3, size, size)).sum().backward()


def test_timm_wrapper_from_transformers():
    from transformers import TimmWrapperConfig, TimmWrapperForImageClassification

    model = TimmWrapperForImageClassification(TimmWrapperConfig(architecture="resnet18", num_labels=4))
    report = quantize_model(model, CPTConfig())
    assert "timm_model.fc" in report.kept
    assert len(report.quantized) == 20


def test_include_and_exclude_patterns(tiny_bert):
    report = quantize_model(
        tiny_bert, CPTConfig(include_modules=["classifier"], exclude_modules=["pooler.dense", r".*\.key"])
    )
    assert "classifier" in report.quantized
    assert "excluded by exclude_modules" in report.kept["bert.pooler.dense"]
    assert "bert.encoder.layer.0.attention.self.key" in report.kept
    assert "bert.encoder.layer.0.attention.self.query" in report.quantized


def test_target_modules_restrict_the_swap(tiny_bert):
    report = quantize_model(tiny_bert, CPTConfig(target_modules=["query", "value"]))
    assert len(report.quantized) == 4
    assert report.kept["bert.pooler.dense"] == "not matched by target_modules"


def test_errors_for_double_quantization_and_nothing_to_quantize(tiny_bert):
    quantize_model(tiny_bert, CPTConfig())
    with pytest.raises(ValueError, match="already CPT-quantized"):
        quantize_model(tiny_bert, CPTConfig())
    with pytest.raises(ValueError, match="no layer to quantize"):
        quantize_model(nn.Sequential(nn.Linear(3, 3)), CPTConfig(exclude_modules=["0"]))
    with pytest.raises(ValueError, match="quantize_model"):
        set_precision(nn.Sequential(nn.Linear(3, 3)), 4, 8)
    with pytest.raises(ValueError, match="bits"):
        set_precision(tiny_bert, 0, 8)


def test_dequantize_restores_plain_layers_with_trained_weights(tiny_cnn):
    original = copy.deepcopy(tiny_cnn)
    quantize_model(tiny_cnn, CPTConfig())
    set_precision(tiny_cnn, 4, 8)
    optimizer = torch.optim.SGD(tiny_cnn.parameters(), lr=0.1)
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    tiny_cnn(pixel_values=x, labels=y)["loss"].backward()
    optimizer.step()
    dequantize_model(tiny_cnn)
    assert not quantized_names(tiny_cnn)
    assert type(tiny_cnn.features[0]) is nn.Conv2d
    assert not torch.equal(tiny_cnn.features[0].weight, original.features[0].weight)  # trained
    assert "act_min" not in dict(tiny_cnn.named_buffers())
    tiny_cnn.eval()
    reference = copy.deepcopy(tiny_cnn)
    assert torch.equal(tiny_cnn(pixel_values=x)["logits"], reference(pixel_values=x)["logits"])


def test_peft_lora_wraps_quantized_layers(tiny_bert):
    from peft import LoraConfig, get_peft_model

    quantize_model(tiny_bert, CPTConfig())
    peft_model = get_peft_model(tiny_bert, LoraConfig(r=4, target_modules=["query", "value"], task_type="SEQ_CLS"))
    base = peft_model.base_model.model.bert.encoder.layer[0].attention.self.query.base_layer
    assert isinstance(base, QuantLayerMixin)
    set_precision(peft_model, 4, 8)
    out = peft_model(input_ids=torch.randint(0, 128, (2, 8)), labels=torch.tensor([0, 1]))
    out.loss.backward()
    lora_a = peft_model.base_model.model.bert.encoder.layer[0].attention.self.query.lora_A["default"]
    assert lora_a.weight.grad is not None and not isinstance(lora_a, QuantLayerMixin)


def test_quantizing_a_peft_model_skips_adapters(tiny_bert):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(tiny_bert, LoraConfig(r=4, target_modules=["query"], task_type="SEQ_CLS"))
    report = quantize_model(peft_model, CPTConfig())
    assert any(name.endswith("query.base_layer") for name in report.quantized)
    assert not any("lora_" in name for name in report.quantized)
    assert any("peft adapter" in reason for reason in report.kept.values())


def test_quantizing_a_model_from_outside_transformers_does_not_load_transformers_modeling_code():
    """A timm or hand-written model is told apart from a PreTrainedModel without importing transformers' modeling
    stack (hundreds of modules, tens of MB its user never loads); a transformers model still routes attention."""
    import subprocess
    import sys

    script = (
        "import sys, torch; from hf_cpt import CPTConfig, quantize_model; "
        "report = quantize_model(torch.nn.Sequential(torch.nn.Linear(8, 8)), CPTConfig()); "
        "print('transformers.modeling_utils' in sys.modules, 'not a transformers PreTrainedModel' in report.attention)"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.stdout.split() == ["False", "True"], result.stderr[-2000:]


@pytest.mark.parametrize("field,value,problem", [
    ("target_modules", 5, "must be a list of module-name patterns, got 5"),
    ("exclude_modules", ["*"], "pattern '\\*' is no regular expression"),
])
def test_module_patterns_that_are_no_patterns_are_refused_naming_the_field(field, value, problem):
    with pytest.raises(ValueError, match=f"CPTConfig.{field}.*{problem}"):
        CPTConfig(**{field: value})


@pytest.mark.parametrize("field", ["target_modules", "include_modules", "exclude_modules"])
def test_a_module_pattern_that_matches_nothing_is_an_error_before_any_layer_changes(tiny_bert, field):
    """A typo in a pattern would otherwise quantize (or keep) silently other layers than meant."""
    before = [type(m) for m in tiny_bert.modules()]
    with pytest.raises(ValueError, match=f"CPTConfig.{field}: the pattern 'qeury' matches no module of "
                                         "BertForSequenceClassification"):
        quantize_model(tiny_bert, CPTConfig(**{field: ["qeury"]}))
    assert [type(m) for m in tiny_bert.modules()] == before  # nothing converted
    quantize_model(tiny_bert, CPTConfig(**{field: ["query"]}))  # a dotted suffix names modules
