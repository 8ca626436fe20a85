"""A layer kind is one object handed to ``auditor.kinds.register``: a new kind defined here, with its own weight
layout, gets counts and MACs, spectra, input statistics, a tier-2 floor and factorize; and the kinds that say they
cannot be factorized (LSTM gates, MultiheadAttention's in_proj) are neither suggested for it nor swept."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import auditor
from auditor import kinds
from auditor.calibration import load_calibration
from auditor.calibration.statistics.stats import input_statistics
from auditor.errors import AuditError
from auditor.factorize import factorize
from auditor.calibration.tiers.sweep import SWEPT
from auditor.kinds.registry import SUPPORTED
from auditor.kinds import Cost, LayerKind, LayerSpec, MatrixView, fill
from auditor.structure.layers import ParamTable, collect_layers
from auditor.results import Kind, Verdict


class FusedQKV(nn.Module):
    """q, k and v projections of one input in one weight stored (3, out, in); returns (..., 3, out)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.in_features, self.out_features = d_in, d_out
        self.weight = nn.Parameter(torch.randn(3, d_out, d_in) / d_in ** 0.5)
        self.bias = nn.Parameter(torch.randn(3, d_out) / 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("...i,koi->...ko", x, self.weight) + self.bias


class FusedQKVKind(LayerKind):
    """The whole kind: found as FusedQKV modules, viewed as one 3*out x in matrix, fed its input rows, swept, and
    replaced by Linear(in, r) -> Linear(r, 3*out) -> Unflatten to (3, out)."""

    kind = "fused_qkv"
    label = "FusedQKV"
    finds = {FusedQKV: LayerSpec(
        weights=lambda mod: ("weight",),
        view=lambda mod, name, s: MatrixView("fused_qkv", s[0] * s[1], s[2], 1, "(3, out, in) viewed as 3*out x in"),
        cost=lambda mod, ins, out: [] if out is None else [Cost("weight", "linear", math.prod(out) * mod.in_features)])}
    swept = True

    def accepts(self, mod: nn.Module) -> bool:
        return isinstance(mod, FusedQKV)

    def statistics(self, path, mod, layers, feeds) -> None:
        for layer in layers:
            feed = feeds.rows(layer, layer.n)
            feeds.hook(mod, lambda m, a, feed=feed: feed.add_rows(a[0], feeds.mask()))

    def replace(self, layer, mod, r, a, b) -> nn.Module:
        first = nn.Linear(layer.n, r, bias=False, dtype=mod.weight.dtype)
        second = nn.Linear(r, layer.m, dtype=mod.weight.dtype)
        if a is not None and b is not None:
            fill(first.weight, b[0])
            fill(second.weight, a[0])
        with torch.no_grad():
            second.bias.copy_(mod.bias.reshape(-1))
        return nn.Sequential(first, second, nn.Unflatten(-1, (3, mod.out_features)))


@pytest.fixture
def fused():
    kind = kinds.register(FusedQKVKind())
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), FusedQKV(32, 24), nn.Flatten(-2), nn.Linear(72, 10))
        with torch.no_grad():  # a weight of rank 8: its floor is rank 8, the first multiple of align
            model[2].weight.copy_((torch.randn(72, 8) @ torch.randn(8, 32)).reshape(3, 24, 32) / 16)
        yield model, torch.randn(256, 16)
    finally:
        kinds.unregister(kind)


def test_a_new_kind_registered_by_one_object_gets_counts_spectra_statistics_floors_and_factorize(fused):
    model, x = fused
    assert "fused_qkv" in SUPPORTED and "fused_qkv" in SWEPT and kinds.for_module(model[2]).kind == "fused_qkv"
    a = auditor.audit(model, x[:4], calibration={"x": x}, measure_floor=True, cache=False, progress=False)
    layer = a.layer("2")
    assert (layer.kind, layer.module_type, layer.m, layer.n, layer.groups) == ("fused_qkv", "FusedQKV", 72, 32, 1)
    assert layer.params == 3 * 24 * 32 and layer.macs == 4 * 72 * 32  # 4 rows of the example input
    w = model[2].weight.detach().double().reshape(72, 32)
    sigma = np.asarray(a.spectra["2"].sigma[0])
    assert np.allclose(sigma, torch.linalg.svdvals(w).numpy(), rtol=1e-5, atol=1e-6 * float(sigma[0]))
    cal = a.calibration
    assert "2" not in cal.missing and cal.layers["2"].suggested == 8
    assert cal.layers["2"].floor.floor == 8 and cal.layers["2"].floor.metric_at_floor < 1e-5
    assert a.suggestions["2"].verdict is Verdict.FACTORIZE and a.suggestions["2"].rank == 8


def test_the_new_kinds_statistics_are_x_transpose_x_and_full_rank_factorize_is_the_dense_module(fused):
    model, x = fused
    layers = collect_layers(model, ParamTable.of(model))
    cal = load_calibration({"x": x}, model, holdout=0.25, batch_size=64)
    stats = input_statistics(model, layers, cal)
    seen: list[torch.Tensor] = []
    h = model[2].register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().double()))
    with torch.no_grad():
        for b in cal.fit:
            model(*b.args, **b.kwargs)
    h.remove()
    xs = torch.cat(seen)
    inp = stats.layers["2"]
    assert (inp.kind, inp.rows, inp.width) == ("fused_qkv", xs.shape[0], 32)
    assert np.allclose(inp.gram[0], (xs.T @ xs).numpy(), rtol=1e-12, atol=1e-9)
    for calibration in (None, stats):
        f = factorize(model, {"2": 32}, calibration)
        assert isinstance(f[2], nn.Sequential) and isinstance(f[2][2], nn.Unflatten)
        with torch.no_grad():
            assert torch.allclose(f(x), model(x), rtol=0, atol=1e-6)
            assert torch.allclose(f[2](xs.float()), model[2](xs.float()), rtol=0, atol=1e-6)


def test_an_unregistered_kind_is_no_longer_found_nor_rewritten(fused):
    model, _ = fused
    kinds.unregister(kinds.for_kind("fused_qkv"))
    assert "fused_qkv" not in SUPPORTED and kinds.for_module(model[2]) is None
    assert "2" not in {l.name for l in collect_layers(model, ParamTable.of(model)).values()}
    assert kinds.rewritable_labels() == "Linear, Conv1D, Conv1d/2d/3d and Embedding"


class RecurrentAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(32, 64, batch_first=True)
        self.attn = nn.MultiheadAttention(64, 4, batch_first=True)
        self.head = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.head(a)


def test_lstm_gates_and_mha_in_proj_are_neither_suggested_for_factorization_nor_swept():
    torch.manual_seed(0)
    model = RecurrentAttention().eval()
    x = torch.randn(32, 6, 32)
    a = auditor.audit(model, x[:2], calibration={"x": x}, measure_floor=True, cache=False, progress=False)
    refused = {"lstm.weight_ih_l0": "rnn", "lstm.weight_hh_l0": "rnn", "attn.in_proj_weight": "mha_in_proj"}
    for name, kind in refused.items():
        layer = a.layer(name)
        assert str(layer.kind) == kind and layer.break_even >= 16  # not narrow: refused for its kind alone
        assert kind not in SUPPORTED and kind not in SWEPT
        sg = a.suggestions[name]
        assert sg.verdict is not Verdict.FACTORIZE and sg.rank is None
        assert sg.reason.startswith(f"keep dense: {kind} cannot be factorized: ") and "measured" not in sg.reason
        assert a.spectra[name].sigma is not None  # the spectrum is kept
        lc = a.calibration.layers[name]  # and the tier-1 statistics
        assert lc.rows > 0 and lc.floor is not None and lc.floor.floor is None and lc.floor.points == []
        assert lc.floor.reason.startswith(f"not swept: {kind} cannot be factorized: ")
    assert "fused recurrence" in a.calibration.layers["lstm.weight_ih_l0"].floor.reason
    assert "fused attention call" in a.calibration.layers["attn.in_proj_weight"].floor.reason
    data_free = auditor.audit(model, x[:2], cache=False, progress=False).suggestions
    assert data_free["lstm.weight_hh_l0"].reason.startswith("rnn cannot be factorized: its gate matrices")
    assert data_free["attn.in_proj_weight"].reason.startswith("mha_in_proj cannot be factorized: MultiheadAttention")
    assert a.suggestions["head"].verdict is not None  # the Linear after them is judged as ever
    with pytest.raises(AuditError, match=r"lstm\.weight_ih_l0 is LSTM \(rnn\): its gate matrices"):
        factorize(model, {"lstm.weight_ih_l0": 8})


def test_weights_only_guesses_come_from_the_kinds():
    assert kinds.guess("model.embed_tokens.weight", (100, 16))[0].kind == Kind.EMBEDDING
    assert kinds.guess("layers.0.mlp.up.weight", (64, 16))[0].kind == Kind.TENSOR
    k, m, n, view = kinds.guess("conv.weight", (8, 3, 3, 3))
    assert (k.kind, m, n, view) == (Kind.CONV, 8, 27, "4-D kernel viewed as dim0 x prod(rest)")
    assert kinds.guess("scale", (16,)) is None


def test_transposed_convolution_is_audited_but_never_suggested():
    """A kind with no replacement says so, so no suggestion asks for what factorize() would refuse."""
    import auditor
    from auditor.factorize import factorize as fz

    model = nn.Sequential(nn.Conv2d(3, 64, 3), nn.ConvTranspose2d(64, 64, 3))
    a = auditor.audit(model, (torch.randn(2, 3, 12, 12),), options=auditor.AuditOptions(cache=False, progress=False))
    s = a.suggestions
    assert s["1"].verdict != "factorize" and "transposed convolution" in s["1"].reason
    assert s["0"].verdict == "keep dense"  # narrow: 64 x 27
    spec = {l.name: l for l in a.layers}["1"]
    assert (spec.m, spec.n) == (64, 576) and a.spectra["1"].sigma[0][0] > 0
    with pytest.raises(Exception, match="transposed convolution"):
        fz(model, {"1": 8})


# ---- every isinstance test of a torch layer class is kinds' ---------------------------------------------------------
ALLOWED_CLASSES = ("Module", "Parameter")  # is it a model at all, is it a parameter; nn.parameter.* too


def _nn_class(node: ast.expr) -> str | None:
    """``nn.X`` / ``torch.nn.X`` (any attribute chain under ``nn``) as its dotted name after ``nn``; None else."""
    chain: list[str] = []
    while isinstance(node, ast.Attribute):
        chain.insert(0, node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    chain.insert(0, node.id)
    for root in (["nn"], ["torch", "nn"]):
        if chain[:len(root)] == root and len(chain) > len(root):
            return ".".join(chain[len(root):])
    return None


def layer_class_tests(source: str, where: str) -> list[str]:
    """``where:line: text`` for each ``isinstance``/``issubclass`` call whose class argument (or an element of its
    tuple) is an ``nn.X`` / ``torch.nn.X`` other than ``nn.Module``, ``nn.Parameter`` and ``nn.parameter.*``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2):
            continue
        cls = node.args[1]
        for c in cls.elts if isinstance(cls, ast.Tuple) else [cls]:
            name = _nn_class(c)
            if name is not None and name not in ALLOWED_CLASSES and not name.startswith("parameter."):
                out.append(f"{where}:{node.lineno}: {node.func.id}(..., nn.{name})")
    return out


def test_the_layer_class_check_finds_nn_classes_and_lets_models_and_parameters_pass():
    src = ("import torch\nfrom torch import nn\n"
           "a = isinstance(m, nn.Linear)\n"
           "b = isinstance(m, (nn.ModuleList, torch.nn.Sequential))\n"
           "c = issubclass(t, nn.modules.conv._ConvNd)\n"
           "d = isinstance(m, nn.Module) or isinstance(p, (nn.Parameter, nn.parameter.UninitializedParameter))\n"
           "e = isinstance(x, torch.Tensor) or isinstance(m, Linear)\n")
    assert layer_class_tests(src, "x.py") == ["x.py:3: isinstance(..., nn.Linear)",
                                              "x.py:4: isinstance(..., nn.ModuleList)",
                                              "x.py:4: isinstance(..., nn.Sequential)",
                                              "x.py:5: issubclass(..., nn.modules.conv._ConvNd)"]


def test_only_the_kinds_test_for_torch_layer_classes():
    """What a torch layer class is (an embedding's size, a list of blocks, a factorized pair) is asked of
    ``auditor.kinds`` (``embedding_sizes``, ``is_block_list``, ``holds_blocks``, ``is_factor_pair``); no module
    outside ``auditor/kinds/`` tests for one itself."""
    pkg = Path(auditor.__file__).resolve().parent
    found = [hit for p in sorted(pkg.rglob("*.py")) if "kinds" not in p.relative_to(pkg).parts[:1]
             for hit in layer_class_tests(p.read_text(encoding="utf-8"), p.relative_to(pkg.parent).as_posix())]
    assert found == [], "ask auditor.kinds instead:\n" + "\n".join(found)


def test_the_kinds_answer_the_layer_class_questions():
    model = nn.Sequential(nn.Embedding(11, 4), nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]),
                          nn.EmbeddingBag(7, 4), nn.ModuleList([nn.Linear(4, 4), nn.ReLU()]))
    assert kinds.embedding_sizes(model) == [11, 7] and kinds.embedding_sizes(nn.Linear(2, 2)) == []
    assert [kinds.is_block_list(m) for m in model] == [False, True, False, False]
    assert not kinds.is_block_list(nn.ModuleList([nn.Linear(2, 2)])) and not kinds.is_block_list(nn.Sequential())
    assert kinds.holds_blocks(model) and kinds.holds_blocks(model[1]) and not kinds.holds_blocks(model[0])
    dense = nn.Linear(4, 4)
    pair = factorize(nn.Sequential(dense), {"0": 2})[0]
    assert kinds.is_factor_pair(pair, dense) and not kinds.is_factor_pair(pair, None)
    assert not kinds.is_factor_pair(pair, pair) and not kinds.is_factor_pair(dense, dense)
    assert not kinds.is_factor_pair(nn.Sequential(nn.Linear(4, 2), nn.ReLU()), dense)
