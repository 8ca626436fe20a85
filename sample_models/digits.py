"""Small models with real trained weights, for demos and tests: an MLP and a CNN trained on scikit-learn's bundled
digits data (8x8 images, 10 classes) by ``train_digits.py`` beside this file.

Factories for ``lowrank-audit sample_models/digits.py:mlp`` return (model, example inputs): a batch of real digits.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent


class DigitsMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 512)
        self.fc2 = nn.Linear(512, 512)
        self.fc3 = nn.Linear(512, 256)
        self.head = nn.Linear(256, 10)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.fc1(x))
        x = self.act(self.fc2(x))
        x = self.act(self.fc3(x))
        return self.head(x)


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(64 * 4 * 4, 256)
        self.head = nn.Linear(256, 10)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.conv1(x))
        x = self.pool(self.act(self.conv2(x)))
        x = self.act(self.fc1(x.flatten(1)))
        return self.head(x)


def digits(n: int = 16, image: bool = False) -> torch.Tensor:
    """The first ``n`` digits of scikit-learn's bundled data set, scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    x = torch.tensor(load_digits().data[:n], dtype=torch.float32) / 16.0
    return x.reshape(n, 1, 8, 8) if image else x


def _load(model: nn.Module, file: str) -> nn.Module:
    from safetensors.torch import load_file

    model.load_state_dict(load_file(str(HERE / file)))
    return model.eval()


def mlp() -> tuple[nn.Module, tuple[torch.Tensor]]:
    return _load(DigitsMLP(), "digits_mlp.safetensors"), (digits(16),)


def cnn() -> tuple[nn.Module, tuple[torch.Tensor]]:
    return _load(DigitsCNN(), "digits_cnn.safetensors"), (digits(16, image=True),)
