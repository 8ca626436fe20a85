"""Issue 41, hardening round 5 continued. The default calibrated audit (output-gradient sensitivity) of a model whose
forward the gradients cannot go back through, in five shapes (part of it under ``torch.no_grad()``, a detached
tensor, integer outputs, a trip through numpy, a detach in half precision): the planned layers no gradient reaches
fall back to truncation probes, said in one line in every format, and the audit exits 0 or 1, never 3 (so does a
backward that raises); layers that do get gradients keep their gradient-predicted costs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

FACTORIES = '''
import numpy as np
import torch
from torch import nn


def _mlp():
    g = torch.Generator().manual_seed(0)
    m = nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 4))
    with torch.no_grad():
        m[0].weight.copy_(torch.randn(64, 3, generator=g) @ torch.randn(3, 48, generator=g))
        m[2].weight.copy_(torch.randn(48, 3, generator=g) @ torch.randn(3, 64, generator=g))
        m[4].weight.copy_(torch.randn(4, 48, generator=g))
    return m


class Shape(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.net, self.how = _mlp(), how

    def forward(self, x):
        n = self.net
        if self.how == "no_grad":  # the first layer under no_grad: its output gets no gradient
            with torch.no_grad():
                h = n[1](n[0](x))
            return n[4](n[3](n[2](h)))
        if self.how == "detach":  # the first layer's output detached
            return n[4](n[3](n[2](n[1](n[0](x)).detach())))
        if self.how == "integer":  # the class index
            return n(x).argmax(-1)
        if self.how == "numpy":  # post-processing in numpy
            return torch.from_numpy(np.tanh(n(x).detach().numpy()))
        if self.how == "half":  # a quantized stub: detached and rounded to half precision
            return n(x).detach().half().float()
        return n(x)


class NoBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("this stub has no backward")


class Stub(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _mlp()

    def forward(self, x):
        return NoBackward.apply(self.net(x))


def stub():
    return Stub(), (torch.zeros(1, 48),)


def _factory(how):
    def model():
        return Shape(how), (torch.zeros(1, 48),)
    return model


no_grad, detach, integer, numpy_out, half, plain = (_factory(h) for h in
                                                    ("no_grad", "detach", "integer", "numpy", "half", "plain"))


def cal():
    return [torch.randn(16, 48, generator=torch.Generator().manual_seed(s)) for s in range(8)]
'''

SHAPES = ["no_grad", "detach", "integer", "numpy_out", "half"]
PARTIAL = {"no_grad", "detach"}  # the layers after the detached part still get gradients


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("shapes")
    (d / "shapes.py").write_text(FACTORIES)
    return str(d / "shapes.py")


def _audit(cli_inproc, src: str, fn: str, out: Path, *extra: str) -> dict:
    res = cli_inproc(f"{src}:{fn}", "-q", "--calibration", f"{src}:cal", "--no-cache", "--format",
                     "text,json,md,html", "-o", str(out), *extra)
    assert res.returncode in (0, 1), res.stderr
    assert "internal error" not in res.stderr and "Traceback" not in res.stderr
    return json.loads((out / "lowrank-audit.json").read_text())["calibration"]


@pytest.mark.parametrize("budget", [[], ["--budget", "0.3"]], ids=["default", "budget"])
@pytest.mark.parametrize("fn", SHAPES)
def test_gradients_that_cannot_reach_fall_back_to_probes(cli_inproc, src, tmp_path, fn, budget):
    cal = _audit(cli_inproc, src, fn, tmp_path, *budget)
    fb = cal["sensitivity_fallback"]
    assert fb["method"].startswith("truncation probes")
    assert fb["planned"] == 2
    if fn in PARTIAL:  # net.0 is cut off; net.2 keeps its gradient-predicted costs
        assert fb["layers"] == ["net.0"] and not fb["every"]
        assert "no gradient reached its output" in fb["reason"]
        assert cal["budget"]["source"] == "gradient"
        assert cal["layers"]["net.0"]["probes"] and not cal["layers"]["net.0"]["predicted"]
        assert cal["layers"]["net.2"]["predicted"] and not cal["layers"]["net.2"]["probes"]
        said = "Output gradients do not reach 1 of the 2 planned layers (net.0: no gradient reached its output"
    else:  # the output needs no gradient at all: every planned layer probed, as --probe
        assert fb["layers"] == ["net.0", "net.2"] and fb["every"]
        assert fb["reason"].startswith("the model's output does not require grad")
        assert cal["budget"]["source"] == "probed"
        assert all(cal["layers"][n]["probes"] and not cal["layers"][n]["predicted"] for n in ("net.0", "net.2"))
        said = "Output gradients reach none of the 2 planned layers (the model"
    for name in ("lowrank-audit.txt", "lowrank-audit.md", "lowrank-audit.html"):
        text = " ".join((tmp_path / name).read_text().replace("&#39;", "'").split())
        assert said in text, name
        assert "falls back to truncation probes" in text, name


def test_layers_gradients_reach_keep_them(cli_inproc, src, tmp_path):
    """The same network with nothing detached: no fallback, gradient-predicted costs for both planned layers."""
    cal = _audit(cli_inproc, src, "plain", tmp_path)
    assert "sensitivity_fallback" not in cal
    assert cal["budget"]["source"] == "gradient"
    assert all(cal["layers"][n]["predicted"] and not cal["layers"][n]["probes"] for n in ("net.0", "net.2"))


def test_a_backward_that_fails_falls_back_for_every_layer(cli_inproc, src, tmp_path):
    cal = _audit(cli_inproc, src, "stub", tmp_path)
    fb = cal["sensitivity_fallback"]
    assert fb["every"] and fb["layers"] == ["net.0", "net.2"]
    assert fb["reason"] == "the backward pass failed: RuntimeError: this stub has no backward"
    assert cal["budget"]["source"] == "probed"
