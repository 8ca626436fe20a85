"""Block-by-block input statistics (auditor/calibration/statistics/stream.py): equal to the one-pass statistics, one Gram per
distinct input, the device option, and the float32-per-batch path."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from auditor.calibration import input_statistics, load_calibration
from auditor.calibration.statistics.stats import StatisticsHooks, by_name
from auditor.calibration.statistics.stream import find_blocks, resolve_device, stream_statistics
from auditor.errors import AuditError
from auditor.structure.layers import ParamTable, collect_layers


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=101, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).eval()


def _padded_batches():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 101, (8, 12), generator=g)
    mask = torch.ones(8, 12, dtype=torch.long)
    mask[1, 9:] = 0  # right padding
    mask[5, 4:] = 0
    mask[2, :3] = 0  # left padding
    ids[mask == 0] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _layers(model):
    return collect_layers(model, ParamTable.of(model))


def _assert_equal_stats(a, b, tol=1e-10):
    assert set(a.layers) == set(b.layers) and a.missing == b.missing
    for name, x in a.layers.items():
        y = b.layers[name]
        assert (x.rows, x.width, x.groups, x.diagonal) == (y.rows, y.width, y.groups, y.diagonal), name
        top = float(np.abs(y.gram).max())
        assert float(np.abs(x.gram - y.gram).max()) <= tol * top, name


def test_llama_streamed_equals_one_pass_with_padding():
    model = _tiny_llama()
    layers = _layers(model)
    found = find_blocks(model, layers)
    assert found is not None and found.path == "model.layers" and len(found.blocks) == 2
    assert sorted(l.name for l in found.outside) == ["lm_head", "model.embed_tokens"]
    assert sorted(l.name for l in found.layers[1]) == sorted(f"model.layers.1.{p}" for p in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))
    cal = load_calibration(_padded_batches(), model, holdout=0.25)
    one = input_statistics(model, layers, cal)
    seen: list[int] = []
    streamed = stream_statistics(model, layers, cal, on_block=lambda i, st: seen.append(i))
    assert seen == [0, 1, -1]
    _assert_equal_stats(streamed, one)
    # the padded positions are not counted: 6 fit rows of 12 positions, 3 + 8 + 3 of them pads
    real = int(cal.fit[0].kwargs["attention_mask"].sum())
    assert real == 6 * 12 - 3 - 8 - 3
    assert streamed.layers["model.layers.1.self_attn.q_proj"].rows == real
    assert streamed.layers["model.embed_tokens"].gram.sum() == real
    # q, k and v read one tensor: one array; gate and up another
    lay = streamed.layers
    assert lay["model.layers.0.self_attn.q_proj"].gram is lay["model.layers.0.self_attn.v_proj"].gram
    assert lay["model.layers.0.mlp.gate_proj"].gram is lay["model.layers.0.mlp.up_proj"].gram
    assert lay["model.layers.0.mlp.gate_proj"].gram is not lay["model.layers.0.self_attn.q_proj"].gram
    # keep=False: the blocks' statistics go to the callback only
    got: dict[str, object] = {}
    empty = stream_statistics(model, layers, cal, keep=False, on_block=lambda i, st: got.update(st.layers))
    assert not empty.layers and set(got) == set(one.layers)


def test_chargpt_streamed_equals_one_pass():
    from chargpt import chargpt

    model = chargpt()[0]
    layers = _layers(model)
    found = find_blocks(model, layers)
    assert found is not None and found.path == "blocks"
    ids = torch.randint(0, model.cfg.vocab, (6, 32), generator=torch.Generator().manual_seed(2))
    cal = load_calibration({"idx": ids}, model, holdout=0.25)
    _assert_equal_stats(stream_statistics(model, layers, cal), input_statistics(model, layers, cal))


def test_mlp_without_blocks_falls_back(digits_mlp):
    from sklearn.datasets import load_digits

    model = digits_mlp[0]
    layers = _layers(model)
    assert find_blocks(model, layers) is None
    x = torch.tensor(load_digits().data[:200], dtype=torch.float32) / 16
    cal = load_calibration({"x": x}, model, holdout=0.25)
    calls: list[int] = []
    st = stream_statistics(model, layers, cal, on_block=lambda i, s: calls.append(i))
    assert calls == [-1]
    _assert_equal_stats(st, input_statistics(model, layers, cal), tol=0.0)


def test_shared_sums_diverge_exactly():
    """Two layers that read one tensor share a sum; when a later batch feeds them different tensors each keeps
    its own exact history."""
    from torch import nn

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(5, 3), nn.Linear(5, 3)

        def forward(self, x, y):
            return self.a(x) + self.b(y)

    torch.manual_seed(3)
    m = Two()
    layers = _layers(m)
    xs = [torch.randn(7, 5) for _ in range(3)]
    ys = [xs[0], xs[1], torch.randn(7, 5)]  # the same tensor twice, then another
    hooks = StatisticsHooks(m, layers)
    with torch.no_grad():
        for i, (x, y) in enumerate(zip(xs, ys)):
            with hooks.batch():
                m(x, y)
            if i == 1:
                assert hooks.accs["a"].sum is hooks.accs["b"].sum
    st = hooks.close()
    want_a = sum(x.double().T @ x.double() for x in xs)
    want_b = sum(y.double().T @ y.double() for y in ys)
    assert st.layers["a"].gram is not st.layers["b"].gram
    np.testing.assert_allclose(st.layers["a"].gram[0], want_a.numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(st.layers["b"].gram[0], want_b.numpy(), rtol=0, atol=1e-12)


def test_float32_batches_keep_the_tier1_formula():
    """The GPU path (each batch's X^T X in float32, summed in float64), forced on the CPU: the tier-1 error at each
    rank still matches the layer-output error measured in float64 to 1e-4."""
    from auditor.calibration.statistics.whiten import truncated_weight, whitened_spectrum

    model = _tiny_llama()
    layers = by_name(_layers(model))
    cal = load_calibration(_padded_batches(), model, holdout=0.25)
    st32 = stream_statistics(model, list(layers.values()), cal, batch_dtype=torch.float32)
    st64 = stream_statistics(model, list(layers.values()), cal)
    name = "model.layers.1.mlp.down_proj"
    mod = model.get_submodule(name)
    seen: list[torch.Tensor] = []
    h = mod.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().double()))
    with torch.no_grad():
        for b in cal.fit:
            model(**b.kwargs)
    h.remove()
    keep = cal.fit[0].kwargs["attention_mask"] != 0
    x = torch.cat([s[keep] for s in seen])
    w = mod.weight.detach().double()
    assert st32.layers[name].rows == x.shape[0]
    spec = whitened_spectrum(layers[name], mod.weight, st32.layers[name])
    for r in (4, 16, 40):
        wr = truncated_weight(layers[name], w, r, st64.layers[name])
        measured = math.sqrt(float(((x @ (w - wr).T) ** 2).sum()) / float(((x @ w.T) ** 2).sum()))
        assert spec.error_at(r) == pytest.approx(measured, rel=1e-4)
    assert not np.array_equal(st32.layers[name].gram, st64.layers[name].gram)  # the float32 path ran


def test_device_names():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(AuditError, match="unknown device 'tpu'"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(AuditError, match="not available"):
            resolve_device("cuda:0")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("offload", [False, True])
def test_cuda_streamed_matches_cpu(offload):
    model = _tiny_llama()
    layers = _layers(model)
    cal = load_calibration(_padded_batches(), model, holdout=0.25)
    cpu = stream_statistics(model, layers, cal)
    gpu = stream_statistics(model, layers, cal, device="cuda", offload=offload)
    assert next(model.parameters()).device.type == "cpu"
    _assert_equal_stats(gpu, cpu, tol=1e-5)


def test_blocks_fed_other_inputs_fall_back_to_one_pass():
    """Blocks that each get their own extra input (here a per-block scale) are not streamed: the check on the first
    batch sees it, and the one-pass statistics come back (equal to input_statistics, no block callbacks)."""
    from torch import nn

    class Blk(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 6)

        def forward(self, x, scale):
            return torch.tanh(self.fc(x * scale))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Blk() for _ in range(3))

        def forward(self, x):
            for i, b in enumerate(self.blocks):
                x = b(x, torch.tensor(float(i + 1)))
            return x

    torch.manual_seed(4)
    m = Net().eval()
    layers = _layers(m)
    assert find_blocks(m, layers) is not None
    cal = load_calibration({"x": torch.randn(16, 6)}, m, holdout=0.25)
    calls: list[int] = []
    st = stream_statistics(m, layers, cal, on_block=lambda i, s: calls.append(i))
    assert calls == [-1]
    _assert_equal_stats(st, input_statistics(m, layers, cal), tol=0.0)


@pytest.mark.parametrize("flags, message", [
    (["--device", "tpu"], "error: unknown device 'tpu'"),
    (["--device", "cuda:7"], "error: device 'cuda:7' is not available"),
])
def test_cli_device_errors(cli_inproc, flags, message):
    if torch.cuda.is_available() and "cuda" in flags[1]:
        pytest.skip("a GPU is here")
    r = cli_inproc("sample_models/digits.py:mlp", "--calibration", "sample_models/digits_mlp.safetensors", *flags)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [r.stderr.strip()] and r.stderr.startswith(message)
    r = cli_inproc("sample_models/digits.py:mlp", "--offload")
    assert r.returncode == 2 and "--offload need(s) calibration data" in r.stderr


def test_bf16_read_in_float32_one_block_at_a_time():
    """--compute-dtype float32: a bf16 model's statistics equal those of its float32 copy (the bf16 weights are exact
    in float32), one block is upcast at a time, and every weight comes back bf16 and bit-identical."""
    model = _tiny_llama().to(torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    layers = _layers(model)
    cal = load_calibration(_padded_batches(), model, holdout=0.25)
    blocks = model.model.layers
    seen: list[list[torch.dtype]] = []
    hooks = [b.self_attn.q_proj.register_forward_hook(lambda m, a, o: seen.append([blk.self_attn.q_proj.weight.dtype
                                                                                   for blk in blocks]))
             for b in blocks]
    try:
        got = stream_statistics(model, layers, cal, compute_dtype="float32")
    finally:
        for h in hooks:
            h.remove()
    # block 0 alone, then block 1 alone, upcast while it runs (the first run checks block 0's output's shape)
    fit = len(cal.fit)
    assert [tuple(s) for s in seen] == [(torch.float32, torch.bfloat16)] * (fit + 1) + \
        [(torch.bfloat16, torch.float32)] * fit
    for n, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, before[n]), n
    ref = copy.deepcopy(model).float()
    _assert_equal_stats(got, input_statistics(ref, _layers(ref), cal), tol=1e-10)
    with pytest.raises(AuditError, match="unknown compute dtype 'int8'"):
        stream_statistics(model, layers, cal, compute_dtype="int8")


def test_cli_compute_dtype_needs_calibration(cli_inproc):
    r = cli_inproc("sample_models/digits.py:mlp", "--compute-dtype", "float32")
    assert r.returncode == 2 and "--compute-dtype need(s) calibration data" in r.stderr
