"""Tensor references read from safetensors, the weights-only checkpoint (headers once, ties, shard-index safety),
the validated spectrum cache, and work items run in real worker processes."""

import json
import os
import pickle
import struct

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import auditor
from auditor.errors import AuditError
from auditor.sources import WeightsOnly
from auditor.spectra import SpectrumCache, ThreadExecutor, compute_spectra, content_key
from auditor.sources.tensorref import TensorRef, read_header


def _mixed(path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(7, 5, generator=g),
        "odd": torch.randn(3, generator=g).to(torch.float16),  # 6 bytes: what follows starts unaligned
        "b.weight": torch.randn(6, 4, generator=g).to(torch.bfloat16),
        "c.weight": torch.randn(3, 9, generator=g).double(),
        "e.weight": torch.randn(2, 3, 2, 2, generator=g).half(),
    }
    save_file(tensors, str(path))
    return tensors


def test_header_references_read_the_same_bytes_as_safetensors(tmp_path):
    f = tmp_path / "m.safetensors"
    _mixed(f)
    refs = read_header(f)
    with safe_open(str(f), framework="pt") as fh:
        assert sorted(refs) == sorted(fh.keys())
        for k, ref in refs.items():
            want = fh.get_tensor(k)
            got = ref.load()
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got.view(torch.uint8) if got.dim() else got, want.view(torch.uint8) if want.dim() else want)


def test_an_unaligned_tensor_is_read_right(tmp_path):
    half = torch.tensor([1.5, -2.0, 3.25], dtype=torch.float16)  # 6 bytes: the float32 after it is unaligned
    single = torch.tensor([[0.1, 0.2], [0.3, 0.4]], dtype=torch.float32)
    header = {"h": {"dtype": "F16", "shape": [3], "data_offsets": [0, 6]},
              "s": {"dtype": "F32", "shape": [2, 2], "data_offsets": [6, 22]}}
    f = tmp_path / "u.safetensors"
    length = len(json.dumps(header).encode())
    _write_raw(f, header, half.numpy().tobytes() + single.numpy().tobytes(), pad=(1 - (8 + length + 6)) % 4)
    refs = read_header(f)
    assert refs["s"].offset % 4 != 0
    assert torch.equal(refs["s"].load(), single) and torch.equal(refs["h"].load(), half)


def _write_raw(path, header: dict, data: bytes, pad: int = 0):
    text = json.dumps(header).encode() + b" " * pad
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize("header,data,what", [
    ({"t": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, b"\0" * 12, "data section holds 12"),
    ({"t": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, b"\0" * 20, "data section holds 20"),
    ({"t": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}, b"\0" * 12, "do not hold shape"),
    ({"t": {"dtype": "X9", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "unknown dtype"),
    ({"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, "malformed shape"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, "does not start where"),
    ([1, 2], b"", "not a JSON object"),
], ids=["truncated", "trailing", "size-mismatch", "dtype", "shape", "overlap", "not-object"])
def test_malformed_headers_are_one_clear_error(tmp_path, header, data, what):
    f = tmp_path / "bad.safetensors"
    _write_raw(f, header, data)
    with pytest.raises(AuditError, match=what) as err:
        read_header(f)
    assert "\n" not in str(err.value)


def test_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(AuditError, match="is not a regular file"):
        read_header(fifo)


def test_weights_only_parses_each_header_once(tmp_path, monkeypatch):
    from auditor.sources import checkpoint

    tensors = {f"l{i}.weight": torch.randn(4, 3, generator=torch.Generator().manual_seed(i)) for i in range(40)}
    save_file(dict(list(tensors.items())[:25]), str(tmp_path / "a.safetensors"))
    save_file(dict(list(tensors.items())[25:]), str(tmp_path / "b.safetensors"))
    calls = []
    real = checkpoint.read_header
    monkeypatch.setattr(checkpoint, "read_header", lambda f: calls.append(f) or real(f))
    w = WeightsOnly.open(tmp_path)
    for name, t in tensors.items():
        assert torch.equal(w.tensor(name), t)
    assert w.total_params == 40 * 12 and len(w.layers()) == 40
    assert len(calls) == 2


def test_refs_from_weights_only_are_small_picklable_file_references(tmp_path):
    t = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    save_file({"proj.weight": t}, str(tmp_path / "m.safetensors"))
    w = WeightsOnly.open(tmp_path / "m.safetensors")
    layer = w.layers()["proj.weight"]
    ref = w.ref(layer)
    assert (ref.path, ref.tensor, ref.shape, ref.dtype, ref.kind, ref.m, ref.n, ref.groups, ref.data) == (
        str(tmp_path / "m.safetensors"), "proj.weight", (64, 32), "float32", "tensor", 64, 32, 1, None)
    blob = pickle.dumps(ref)
    assert len(blob) < 1000  # the reference, not the 8 KiB tensor
    assert torch.equal(pickle.loads(blob).load(), t)
    assert content_key(ref) == content_key(TensorRef.of_tensor(t, "x", "tensor", 64, 32))  # same bytes, same key


def test_byte_identical_tensors_in_two_shards_count_once_as_aliases(tmp_path):
    g = torch.Generator().manual_seed(2)
    emb = torch.randn(50, 16, generator=g)
    other = torch.randn(50, 16, generator=g)
    zeros = torch.zeros(50, 16)
    save_file({"model.embed_tokens.weight": emb, "h.weight": other, "z1.weight": zeros},
              str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"lm_head.weight": emb.clone(), "z2.weight": zeros.clone()},
              str(tmp_path / "model-00002-of-00002.safetensors"))
    wm = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors", "h.weight": "model-00001-of-00002.safetensors",
          "z1.weight": "model-00001-of-00002.safetensors", "lm_head.weight": "model-00002-of-00002.safetensors",
          "z2.weight": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    w = WeightsOnly.open(tmp_path)
    layers = w.layers()
    assert sorted(layers) == ["h.weight", "model.embed_tokens.weight", "z1.weight", "z2.weight"]
    assert layers["model.embed_tokens.weight"].aliases == ["lm_head.weight"]
    assert w.total_params == 4 * 50 * 16  # the tied copy once; the two all-zero tensors are not ties
    a = auditor.audit(w, cache=False)
    assert a.total_params == 3200 and a.layer("model.embed_tokens").aliases == ["lm_head.weight"]
    assert any("1 byte-identical tensor(s) counted once" in n for n in a.notes)


@pytest.mark.parametrize("entry", ["../outside.safetensors", "/abs/x.safetensors", "sub/../../outside.safetensors",
                                   "link.safetensors"])
@pytest.mark.parametrize("exists", [True, False])
def test_shard_index_entries_outside_the_folder_are_refused_alike(tmp_path, entry, exists):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    outside = tmp_path / "outside.safetensors"
    if exists:
        save_file({"x.weight": torch.ones(2, 2)}, str(outside))
    (ckpt / "link.safetensors").symlink_to(outside)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x.weight": entry}}))
    with pytest.raises(AuditError) as err:
        WeightsOnly.open(ckpt)
    assert str(err.value) == (f"shard index {ckpt / 'model.safetensors.index.json'} names {entry!r}, which is not "
                              f"a file inside {ckpt}. Shards must sit in the index's folder; give plain file names.")


@pytest.mark.parametrize("doc,what", [
    ({"weight_map": {}}, "empty weight_map"),
    ({"weight_map": ["a"]}, "no weight_map of tensor names"),
    ({"weight_map": {"a": 3}}, "no weight_map of tensor names"),
    ({"metadata": {}}, "no weight_map of tensor names"),
])
def test_malformed_weight_maps_are_errors(tmp_path, doc, what):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(doc))
    with pytest.raises(AuditError, match=what):
        WeightsOnly.open(tmp_path)


def test_a_tensor_the_index_names_but_its_shard_lacks_is_an_error(tmp_path):
    save_file({"a.weight": torch.ones(2, 2)}, str(tmp_path / "s.safetensors"))
    wm = {"a.weight": "s.safetensors", "b.weight": "s.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(AuditError, match="1 tensor.s. named in the shard index are not in their shard: b.weight"):
        WeightsOnly.open(tmp_path)


def _entry_layout(cache, key):
    path = cache.path(key)
    return path, path.read_bytes()


@pytest.mark.parametrize("corrupt", ["nan", "negative", "ascending", "flat-forged", "truncated", "fifo", "checksum"])
def test_cache_entries_are_validated_on_read_and_recomputed(tmp_path, corrupt):
    t = torch.randn(20, 8, generator=torch.Generator().manual_seed(3))
    ref = TensorRef.of_tensor(t, "w", "linear", 20, 8)
    cache = SpectrumCache(tmp_path)
    first, stats = compute_spectra([("w", ref)], targets=(0.9,), cache=cache)
    assert stats.computed == 1
    key = content_key(ref)
    path, raw = _entry_layout(cache, key)
    assert len(raw) == 8 * 8 + 32
    good = np.frombuffer(raw[:64], dtype="<f8").copy()
    assert np.array_equal(good, np.asarray(first["w"].sigma[0]))
    again, stats = compute_spectra([("w", ref)], targets=(0.9,), cache=cache)
    assert stats.cached == 1 and again["w"].method == "cache" and again["w"].sigma == first["w"].sigma

    from auditor.spectra.cache import _check

    def forged(values):  # a well-formed entry whose values are wrong: only validation can reject it
        payload = np.asarray(values, dtype="<f8").tobytes()
        return payload + _check(key, payload)

    path.unlink()
    if corrupt == "fifo":
        os.mkfifo(path)
    elif corrupt == "truncated":
        path.write_bytes(raw[:40])
    elif corrupt == "checksum":
        path.write_bytes(np.full(8, 1.0).tobytes() + raw[64:])
    else:
        bad = {"nan": np.where(np.arange(8) == 3, np.nan, good), "negative": -good, "ascending": good[::-1],
               "flat-forged": None}[corrupt]
        if bad is None:  # flat but with a valid checksum would pass validation: forge only what validation rejects
            bad = np.concatenate([good[:4], [np.inf], good[5:]])
        path.write_bytes(forged(bad))
    third, stats = compute_spectra([("w", ref)], targets=(0.9,), cache=cache)
    assert stats.computed == 1 and stats.cached == 0
    assert third["w"].sigma == first["w"].sigma
    if corrupt != "fifo":
        assert path.read_bytes() == raw  # rewritten atomically with the right values


def _sharded(tmp_path):
    g = torch.Generator().manual_seed(4)
    shapes = {"blocks.0.proj.weight": (300, 64), "blocks.0.up.weight": (48, 200), "blocks.1.proj.weight": (96, 96),
              "embed.weight": (500, 32), "conv.weight": (16, 4, 3, 3)}
    tensors = {k: torch.randn(*s, generator=g) for k, s in shapes.items()}
    tensors["blocks.0.up.weight"] = tensors["blocks.0.up.weight"].to(torch.bfloat16)
    names = list(tensors)
    save_file({k: tensors[k] for k in names[:3]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: tensors[k] for k in names[3:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    wm = {k: f"model-0000{1 if i < 3 else 2}-of-00002.safetensors" for i, k in enumerate(names)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    return WeightsOnly.open(tmp_path)


def test_work_items_run_in_spawned_processes_bit_for_bit_like_threads(tmp_path):
    import concurrent.futures as cf
    import multiprocessing

    from auditor.spectra import ProcessExecutor, SpectrumTask, compute_task
    from auditor.spectra.executor import _init_process
    from auditor.spectra.backend import LapackBackend
    from auditor.spectra import _lapack

    w = _sharded(tmp_path)
    layers = sorted(w.layers().values(), key=lambda l: -l.params)
    items = [(l.name, w.ref(l)) for l in layers]
    tasks = [SpectrumTask(name, ref, (0.9, 0.95), LapackBackend()) for name, ref in items]
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(2, mp_context=ctx, initializer=_init_process, initargs=(1,)) as pool:
        remote = list(pool.map(compute_task, tasks))
    with _lapack.blas_threads(1):
        local = [compute_task(t) for t in tasks]
    for r, l in zip(remote, local):
        assert r.layer == l.layer and r.method == l.method and r.skipped == l.skipped == ""
        assert np.array_equal(r.sigma, l.sigma)  # bit for bit
    for (name, ref), r in zip(items, local):  # and right: against numpy's float64 SVD of the stored tensor
        t = ref.load().double()
        ref_s = np.linalg.svd(t.reshape(t.shape[0], -1).numpy(), compute_uv=False)
        assert np.max(np.abs(r.sigma[0] - ref_s)) <= 1e-6 * ref_s[0], name

    cache = SpectrumCache(tmp_path / "cache")
    by_proc, stats_p = compute_spectra(items, targets=(0.9, 0.95), executor=ProcessExecutor(2), cache=cache)
    by_thread, stats_t = compute_spectra(items, targets=(0.9, 0.95), executor=ThreadExecutor(2))
    assert stats_p.computed == stats_t.computed == len(items)
    for name, _ in items:
        assert np.allclose(by_proc[name].sigma, by_thread[name].sigma, rtol=0, atol=1e-12 * by_thread[name].sigma[0][0])
        assert by_proc[name].energy == pytest.approx(by_thread[name].energy, abs=1e-12)
    _, stats_c = compute_spectra(items, targets=(0.9, 0.95), executor=ThreadExecutor(2), cache=cache)
    assert stats_c.cached == len(items)  # what the processes computed is read back here
