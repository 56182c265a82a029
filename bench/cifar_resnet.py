"""The CPT paper's CIFAR model, a ResNet of depth 6n+2 (`CifarResNet`), on its own: `bench/cifar10.py` trains it
with `CPTTrainer`; `bench/overhead.py`'s ResNet-20 cases build it in processes that measure a training step's peak
memory, where the modules that importing the Trainer loads (datasets, pandas, pyarrow) would add to both sides'
peaks alike and so pull their ratio towards 1."""

from __future__ import annotations

import torch
from torch import nn


def _relu_function(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, functional_relu: bool = False) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        # one module, called twice, as in the paper's code (or ``torch.relu``, as much other CIFAR code calls it)
        self.relu = _relu_function if functional_relu else nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class CifarResNet(nn.Module):
    """The CIFAR ResNet of He et al. (depth 6n+2: 16/32/64 channels) as the CPT paper's code builds it (its ReLUs
    modules, in place; ``functional_relu``: calls to ``torch.relu``); returns ``{"loss", "logits"}`` so that the
    `transformers` Trainer drives it."""

    def __init__(self, depth: int = 20, num_classes: int = 10, functional_relu: bool = False) -> None:
        super().__init__()
        if (depth - 2) % 6:
            raise ValueError(f"CifarResNet depth must be 6n+2 (20, 32, 44, ...), got {depth}.")
        n = (depth - 2) // 6
        self.conv1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu = _relu_function if functional_relu else nn.ReLU(inplace=True)
        layers, cin = [], 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(n):
                layers.append(BasicBlock(cin, cout, stride if i == 0 else 1, functional_relu))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        x = self.layers(self.relu(self.bn1(self.conv1(pixel_values))))
        logits = self.fc(x.mean(dim=(2, 3)))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out
