"""Train the sample models on scikit-learn's digits data and save them as safetensors (each well under 2 MB).

    python sample_models/train_digits.py

Deterministic (fixed seeds, one thread); takes a few seconds on a CPU. Prints test accuracy.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from digits import HERE, DigitsCNN, DigitsMLP  # noqa: E402


def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(x), generator=g)
    x, y = x[perm], y[perm]
    return x[:1400], y[:1400], x[1400:], y[1400:]


def train(model: nn.Module, image: bool, epochs: int) -> float:
    xtr, ytr, xte, yte = data()
    if image:
        xtr, xte = xtr.reshape(-1, 1, 8, 8), xte.reshape(-1, 1, 8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(epochs):
        model.train()
        for idx in torch.randperm(len(xtr), generator=g).split(64):
            opt.zero_grad()
            nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        return (model(xte).argmax(1) == yte).float().mean().item()


def main() -> None:
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    for name, cls, image, epochs in (("mlp", DigitsMLP, False, 40), ("cnn", DigitsCNN, True, 25)):
        torch.manual_seed(0)
        model = cls()
        with torch.no_grad():  # small initialisation: the trained weights, not the random init, dominate the spectra
            for p in model.parameters():
                if p.dim() > 1:
                    p.mul_(0.25)
        acc = train(model, image, epochs)
        path = HERE / f"digits_{name}.safetensors"
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
        print(f"{name}: test accuracy {acc:.3f}, {sum(p.numel() for p in model.parameters()):,} params, "
              f"{path.stat().st_size:,} bytes -> {path.name}")


if __name__ == "__main__":
    main()
