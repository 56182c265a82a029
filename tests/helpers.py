"""Test helpers shared by several test modules: tiny model configs, a local tokenizer, data paths."""

from __future__ import annotations

import contextlib
import os
import tempfile

import torch
from torch import nn

SHARED_DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")


@contextlib.contextmanager
def cpu_backend(int8_dot: bool):
    """CPU products on codes through int8 GEMMs (``int8_dot=True``) or the float32 GEMM of the codes, whatever this
    CPU has: both paths run on every machine (as ``HF_CPT_INT8_DOT`` forces them for a whole process)."""
    from hf_cpt.backends import CPUBackend, register_backend

    previous = register_backend("cpu", CPUBackend(int8_dot=int8_dot))
    try:
        yield
    finally:
        register_backend("cpu", previous)


def tiny_bert_config(num_labels: int = 3, layers: int = 2):
    from transformers import BertConfig

    return BertConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=num_labels,
    )


def tiny_gpt2_config(layers: int = 2):
    from transformers import GPT2Config

    return GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=layers, n_head=2)


class TinyCNN(nn.Module):
    """A small CNN classifier for 8x8 single-channel images (the sklearn digits)."""

    def __init__(self, num_classes: int = 10, channels: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
        )
        self.classifier = nn.Linear(4 * channels, num_classes)

    def forward(self, pixel_values=None, labels=None):
        logits = self.classifier(self.features(pixel_values).flatten(1))
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits} if loss is not None else {"logits": logits}


def build_word_tokenizer(words: list[str], save_dir: str | None = None):
    """A BERT WordPiece tokenizer over a given vocabulary, built without any download."""
    from transformers import BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + sorted(set(words))
    directory = save_dir or tempfile.mkdtemp()
    path = os.path.join(directory, "vocab.txt")
    with open(path, "w") as f:
        f.write("\n".join(vocab) + "\n")
    return BertTokenizerFast.from_pretrained(directory, do_lower_case=True)


def save_local_bert(directory, model_class) -> None:
    """A tiny BERT (``model_class``: BertModel, BertForSequenceClassification, ...) and its word tokenizer saved in
    ``directory``: a stand-in for all-MiniLM-L6-v2 in the benches' checks."""
    torch.manual_seed(0)
    config = tiny_bert_config()
    config.vocab_size, config.max_position_embeddings = 200, 512
    model_class(config).save_pretrained(directory)
    build_word_tokenizer(["the", "a", "man", "woman", "is", "not", "dog"], str(directory))


def two_quantizable_layers(kind: str) -> tuple[nn.Module, torch.Tensor]:
    """Two quantized layers in a row, large enough for the native kernels (16K values) and the fused error kernel
    (64K), so that both backwards take the reused buffers in turn."""
    from transformers.pytorch_utils import Conv1D

    if kind == "conv2d":
        layers = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1))
        return layers, torch.randn(4, 8, 32, 32)
    first, second = (nn.Linear(256, 512), nn.Linear(512, 256)) if kind == "linear" else (Conv1D(512, 256),
                                                                                        Conv1D(256, 512))
    return nn.Sequential(first, nn.GELU(), second), torch.randn(2, 64, 256)
