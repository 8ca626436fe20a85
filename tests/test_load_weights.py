"""Weights a source promises but does not hold are an error naming them, never a silent random init; a partial
audit is asked for, and then noted. Tiny checkpoints are written into tmp_path by each test."""

import json

import pytest
import torch
from torch import nn

from auditor.errors import AuditError
from auditor.sources import load_source

FACTORY = "from torch import nn\ndef model():\n    return nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4))\n"


@pytest.fixture
def mlp_file(tmp_path):
    p = tmp_path / "mlp.py"
    p.write_text(FACTORY)
    return p


def _state(seed=1):
    g = torch.Generator().manual_seed(seed)
    return {"0.weight": torch.randn(6, 8, generator=g), "0.bias": torch.randn(6, generator=g),
            "2.weight": torch.randn(4, 6, generator=g), "2.bias": torch.randn(4, generator=g)}


def test_weights_file_missing_a_tensor_names_it(tmp_path, mlp_file):
    state = _state()
    del state["2.weight"]
    torch.save(state, tmp_path / "w.pt")
    with pytest.raises(AuditError) as exc:
        load_source(f"{mlp_file}:model", weights=str(tmp_path / "w.pt"))
    # 82 parameters, 2.weight holds 24 of them
    assert exc.value.what == (f"{tmp_path / 'w.pt'} lacks 1 of the model's parameter tensors "
                              "(29.3% of its parameters): 2.weight")
    assert "--partial" in exc.value.fix and "\n" not in exc.value.line()


def test_partial_audit_loads_what_is_there_and_notes_the_rest(tmp_path, mlp_file):
    state = _state()
    del state["2.weight"]
    state["extra.weight"] = torch.ones(3, 3)
    torch.save(state, tmp_path / "w.pt")
    loaded = load_source(f"{mlp_file}:model", weights=str(tmp_path / "w.pt"), partial=True)
    assert torch.equal(loaded.model[0].weight, state["0.weight"]) and torch.equal(loaded.model[2].bias, state["2.bias"])
    assert loaded.notes == [
        f"Partial audit: {tmp_path / 'w.pt'} lacks 1 of the model's parameter tensors (29.3% of its parameters): "
        "2.weight. They keep random initial values: their spectra describe noise.",
        f"1 tensor(s) in {tmp_path / 'w.pt'} are not part of the model and were ignored: extra.weight.",
    ]


def test_complete_weights_load_exactly_in_chunks(tmp_path, mlp_file, monkeypatch):
    import auditor.sources.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "CHUNK_BYTES", 1)  # one load_state_dict call per tensor
    state = _state()
    from safetensors.torch import save_file

    save_file(state, str(tmp_path / "w.safetensors"))
    loaded = load_source(f"{mlp_file}:model", weights=str(tmp_path / "w.safetensors"))
    assert loaded.notes == []
    assert all(torch.equal(loaded.model.state_dict()[k], v) for k, v in state.items())


def test_weights_directory_without_weights_is_an_error(tmp_path, mlp_file):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(AuditError, match="holds no weights"):
        load_source(f"{mlp_file}:model", weights=str(empty))
    (empty / "tf_model.h5").write_bytes(b"\x89HDF")
    with pytest.raises(AuditError, match=r"format the auditor does not read \(tf_model.h5\)"):
        load_source(f"{mlp_file}:model", weights=str(empty))


def test_weights_directory_with_one_state_dict_is_used(tmp_path, mlp_file):
    d = tmp_path / "ckpt"
    d.mkdir()
    torch.save(_state(), d / "model.pth")
    loaded = load_source(f"{mlp_file}:model", weights=str(d))
    assert torch.equal(loaded.model[2].weight, _state()["2.weight"])


def test_buffers_missing_are_a_note_not_an_error(tmp_path):
    p = tmp_path / "bn.py"
    p.write_text("from torch import nn\ndef model():\n    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))\n")
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    state = {k: v for k, v in m.state_dict().items() if "running" not in k}
    torch.save(state, tmp_path / "w.pt")
    loaded = load_source(f"{p}:model", weights=str(tmp_path / "w.pt"))
    assert loaded.notes == [f"{tmp_path / 'w.pt'} lacks 2 buffer(s), which keep their initial values: "
                            "1.running_mean, 1.running_var."]


def test_weights_matching_nothing_is_an_error(tmp_path, mlp_file):
    torch.save({"a.weight": torch.zeros(2, 2)}, tmp_path / "w.pt")
    with pytest.raises(AuditError, match="none of the tensors in .* match the model"):
        load_source(f"{mlp_file}:model", weights=str(tmp_path / "w.pt"))


def test_weights_with_a_weights_only_source_are_refused(tmp_path):
    from safetensors.torch import save_file

    save_file(_state(), str(tmp_path / "m.safetensors"))
    with pytest.raises(AuditError, match="already a checkpoint"):
        load_source(str(tmp_path / "m.safetensors"), weights=str(tmp_path / "m.safetensors"))


def test_bin_shard_index_loads_and_refuses_paths_outside(tmp_path, mlp_file):
    state = _state()
    d = tmp_path / "shards"
    d.mkdir()
    torch.save({k: state[k] for k in ("0.weight", "0.bias")}, d / "a.bin")
    torch.save({k: state[k] for k in ("2.weight", "2.bias")}, d / "b.bin")
    index = {"weight_map": {"0.weight": "a.bin", "0.bias": "a.bin", "2.weight": "b.bin", "2.bias": "b.bin"}}
    (d / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    loaded = load_source(f"{mlp_file}:model", weights=str(d))
    assert all(torch.equal(loaded.model.state_dict()[k], v) for k, v in state.items())
    index["weight_map"]["2.bias"] = "../b.bin"
    (d / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    with pytest.raises(AuditError, match="not a file beside it"):
        load_source(f"{mlp_file}:model", weights=str(d))


def test_legacy_non_zip_state_dict_is_read_weights_only(tmp_path, cli_inproc, mlp_file):
    state = _state()
    torch.save(state, tmp_path / "legacy.bin", _use_new_zipfile_serialization=False)
    res = cli_inproc(tmp_path / "legacy.bin", "--format", "json", "-q", "--no-spectra")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["totals"]["params"] == 82
    loaded = load_source(f"{mlp_file}:model", weights=str(tmp_path / "legacy.bin"))
    assert torch.equal(loaded.model[0].weight, state["0.weight"])


class Payload:
    marker = None

    def __reduce__(self):
        return (open, (str(Payload.marker), "w"))  # would create a file if ever unpickled


def test_legacy_unsafe_pickle_is_refused_in_one_line(tmp_path, cli_inproc):
    Payload.marker = tmp_path / "pwned"
    torch.save({"w": torch.zeros(2, 2), "p": Payload()}, tmp_path / "evil.bin", _use_new_zipfile_serialization=False)
    res = cli_inproc(tmp_path / "evil.bin")
    assert res.returncode == 2 and not Payload.marker.exists()
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("error: refused to load")


def test_state_dict_with_non_string_keys_is_refused(tmp_path):
    torch.save({0: torch.zeros(2, 2)}, tmp_path / "odd.pt")
    with pytest.raises(AuditError, match="not strings, e.g. 0"):
        load_source(str(tmp_path / "odd.pt"))
