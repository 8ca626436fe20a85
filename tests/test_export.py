"""export(): a torch.export program that reproduces the factorized model and loads with plain torch; the tool's
loader refuses a tampered program or plan.json with one line; ONNX only where its packages are installed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from auditor.errors import AuditError
from auditor.artifacts.export import cli_write, load_program, parse_formats, relative_error
from auditor.factorize import factorize, save_factorized

ONNX = importlib.util.find_spec("onnx") is not None and importlib.util.find_spec("onnxscript") is not None
ORT = importlib.util.find_spec("onnxruntime") is not None


def _x(n: int, image: bool = False) -> torch.Tensor:
    from digits import digits

    return digits(n, image)


def _write(tmp_path, model, plan, example, name="out"):
    new = factorize(model, plan)
    out = tmp_path / name
    save_factorized(new, plan, out, source="digits.py")
    files = cli_write(out, new, None, example, ("pt2",))
    return new, out, files


@pytest.fixture
def mlp_export(tmp_path, digits_mlp):
    model = digits_mlp[0]
    return _write(tmp_path, model, {"fc1": 8, "fc2": 16}, (_x(32),))


def test_the_program_reproduces_the_factorized_model(mlp_export, tmp_path, digits_cnn):
    new, out, files = mlp_export
    assert files == ["model.pt2", "README.md"]
    meta = json.loads((out / "plan.json").read_text())
    e = meta["export"]["pt2"]
    assert e["dynamic_batch"] and e["inputs"] == [{"name": "arg0", "shape": ["batch", 64], "dtype": "float32"}]
    assert [c["rows"] for c in e["checks"]] == [32, 31] and all(c["relative_error"] <= 1e-5 for c in e["checks"])
    prog = load_program(out)
    x = _x(200)[100:107]  # rows the export never saw, another batch size
    with torch.no_grad():
        got, want = prog.module()(x), new(x)
    assert relative_error(got, want) <= 1e-5 and want.shape == (7, 10)
    cnn, out2, _ = _write(tmp_path, digits_cnn[0], {"conv2": 8, "fc1": 16}, (_x(16, image=True),), "cnn")
    xi = _x(40, image=True)[20:]
    with torch.no_grad():
        assert relative_error(load_program(out2).module()(xi), cnn(xi)) <= 1e-5


def test_loads_with_plain_torch_and_the_readme_says_how(mlp_export):
    new, out, _ = mlp_export
    text = (out / "README.md").read_text()
    assert 'torch.export.load("model.pt2")' in text and "x: float32[batch, 64]" not in text
    assert "arg0: float32[batch, 64]" in text and json.loads((out / "plan.json").read_text())[
        "export"]["pt2"]["sha256"] in text
    code = ("import sys, torch\n"
            "m = torch.export.load('model.pt2').module()\n"
            "x = torch.load('x.pt', weights_only=True)\n"
            "torch.save(m(x).detach(), 'y.pt')\n"
            "assert not any(k == 'auditor' or k.startswith('auditor.') for k in sys.modules)\n")
    x = _x(10)
    torch.save(x, out / "x.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-I", "-c", code], cwd=out, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-500:]
    with torch.no_grad():
        assert relative_error(torch.load(out / "y.pt", weights_only=True), new(x)) <= 1e-5


def _one_line(exc: pytest.ExceptionInfo) -> str:
    line = exc.value.line()
    assert "\n" not in line
    return line


def test_a_tampered_program_is_refused(mlp_export, tmp_path, digits_mlp):
    _, out, _ = mlp_export
    pt2 = out / "model.pt2"
    data = bytearray(pt2.read_bytes())
    good = bytes(data)
    data[len(data) // 2] ^= 0x01
    pt2.write_bytes(bytes(data))
    with pytest.raises(AuditError) as e:
        load_program(out)
    assert "does not match the size and sha256 plan.json records" in _one_line(e)
    pt2.write_bytes(good + b"\0")
    with pytest.raises(AuditError, match="does not match the size and sha256"):
        load_program(out)
    # another export's program with its digest copied into plan.json: the ranks give it away
    _, other, _ = _write(tmp_path, digits_mlp[0], {"fc1": 8, "fc2": 24}, (_x(32),), "other")
    pt2.write_bytes((other / "model.pt2").read_bytes())
    meta = json.loads((out / "plan.json").read_text())
    meta["export"]["pt2"].update({k: json.loads((other / "plan.json").read_text())["export"]["pt2"][k]
                                  for k in ("sha256", "bytes")})
    (out / "plan.json").write_text(json.dumps(meta))
    with pytest.raises(AuditError) as e:
        load_program(out)
    assert "plan.json gives fc2 rank 16; the program's factors have rank 24" in _one_line(e)


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["plan"].update(fc2=12), "plan.json gives fc2 rank 12; the program's factors have rank 16"),
    (lambda m: m["plan"].update(fc3=8), "plan.json names 'fc3', which the program has no factors for"),
    (lambda m: m["plan"].update(fc2="eight"), "holds no valid plan"),
    (lambda m: m.update(params=m["params"] + 1), "parameters; the program holds"),
    (lambda m: m["export"]["pt2"].update(sha256="0" * 64), "does not match the size and sha256"),
    (lambda m: m["export"]["pt2"].update(sha256="zz"), "malformed export entry"),
    (lambda m: m.pop("export"), "records no exported program"),
    (lambda m: m.update(format="other"), "is not a factorized-model plan"),
])
def test_a_tampered_plan_is_refused(mlp_export, edit, message):
    _, out, _ = mlp_export
    meta = json.loads((out / "plan.json").read_text())
    edit(meta)
    (out / "plan.json").write_text(json.dumps(meta))
    with pytest.raises(AuditError) as e:
        load_program(out)
    assert message in _one_line(e)


@pytest.mark.parametrize("raw, message", [
    (b'{"format": NaN}', "not valid UTF-8 JSON"),
    (b'{"a": 1, "a": 2}', "duplicate key"),
    (b"\xff\xfe{}", "not valid UTF-8 JSON"),
    (b"[" * 100000 + b"]" * 100000, "not valid UTF-8 JSON"),
    (b"[1, 2]", "is not a factorized-model plan"),
])
def test_a_broken_plan_json_is_one_line(mlp_export, raw, message):
    _, out, _ = mlp_export
    (out / "plan.json").write_bytes(raw)
    with pytest.raises(AuditError) as e:
        load_program(out)
    assert message in _one_line(e)


def test_export_formats(cli_inproc, tmp_path):
    assert parse_formats("pt2") == ("pt2",)
    with pytest.raises(AuditError, match="--export 'zip' names 'zip'"):
        parse_formats("zip")
    plan = tmp_path / "plan.toml"
    plan.write_text("[ranks]\nfc1 = 8\n")
    r = cli_inproc("factorize", "sample_models/digits.py:mlp", "--plan", plan, "-o", tmp_path / "o", "--export", "tar")
    assert r.returncode == 2 and "--export 'tar' names 'tar'" in r.stderr and len(r.stderr.splitlines()) == 1
    if not ONNX:
        with pytest.raises(AuditError) as e:
            parse_formats("pt2,onnx")
        assert "--export onnx needs the onnx" in _one_line(e) and "pip install onnx onnxscript" in e.value.line()
        r = cli_inproc("factorize", "sample_models/digits.py:mlp", "--plan", plan, "-o", tmp_path / "o",
                       "--export", "onnx")
        assert r.returncode == 2 and "needs the onnx" in r.stderr and len(r.stderr.splitlines()) == 1
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(not ONNX, reason="onnx and onnxscript are not installed")
def test_onnx_export(tmp_path, digits_mlp):
    new = factorize(digits_mlp[0], {"fc1": 8})
    out = tmp_path / "o"
    save_factorized(new, {"fc1": 8}, out)
    assert cli_write(out, new, None, (_x(16),), ("pt2", "onnx"))[:2] == ["model.pt2", "model.onnx"]
    e = json.loads((out / "plan.json").read_text())["export"]["onnx"]
    assert e["file"] == "model.onnx"
    if not ORT:
        assert e["checked_with"] is None and e["relative_error"] is None
        return
    assert e["checked_with"].startswith("onnxruntime ") and 0 <= e["relative_error"] <= 1e-4
    # the file alone, in onnxruntime, on rows the export never saw, against the in-memory factorized model
    import onnxruntime as ort

    sess = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    x = _x(64)[16:48]
    got = torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0])
    with torch.no_grad():
        want = new.eval()(x)
    assert got.shape == want.shape == (32, 10)
    assert relative_error([got], [want]) <= 1e-5
    assert relative_error([got], [digits_mlp[0].eval()(x).detach()]) > 1e-3  # rank 8 is not the dense model


def test_cli_recover_and_export_end_to_end(cli_inproc, tmp_path):
    from safetensors.torch import save_file

    save_file({"x": _x(128)}, str(tmp_path / "cal.safetensors"))
    plan = tmp_path / "plan.toml"
    plan.write_text("[ranks]\nfc1 = 8\nfc2 = 8\n")
    out = tmp_path / "out"
    r = cli_inproc("factorize", "sample_models/digits.py:mlp", "--plan", plan, "--calibration",
                   tmp_path / "cal.safetensors", "--no-split", "--recover", "6", "--recover-lr", "1e-3", "--export", "pt2",
                   "-o", out, "--no-cache", "--allow-miss")
    assert r.returncode == 0, r.stderr  # rank 8 misses the default tolerance: --allow-miss writes it, exit 0
    meta = json.loads((out / "plan.json").read_text())
    rec = meta["recovery"]
    assert rec["steps"] == rec["done"] == 6 and rec["lr"] == 1e-3 and rec["trainable"] == "factors"
    assert [p["step"] for p in rec["points"]] == [0, 1, 2, 3, 4, 5, 6] and rec["fit_rows"] == 96
    assert rec["before"]["metric"] == pytest.approx(meta["measured"]["value"], rel=1e-9)
    assert "recovery: 6 of 6 steps" in r.stderr and "README.md" in r.stderr
    prog = load_program(out)  # the program holds the recovered weights
    from safetensors.torch import load_file

    w = load_file(str(out / "model.safetensors"))
    assert torch.equal(prog.state_dict["fc1.0.weight"], w["fc1.0.weight"])
    assert "Recovery: 6 distillation steps" in (out / "README.md").read_text()
    assert meta["fit"] == "sequential" and "whitened (sequential fit) initialisation" in (out / "README.md").read_text()


@pytest.fixture(scope="module")
def chargpt_export(tmp_path_factory):
    import chargpt

    model, example = chargpt.chargpt()
    plan = {"blocks.0.fc": 32, "blocks.1.out": 32, "head": 48}
    new = factorize(model, plan)
    out = tmp_path_factory.mktemp("chargpt") / "out"
    save_factorized(new, plan, out, source="chargpt.py")
    assert cli_write(out, new, None, example, ("pt2",)) == ["model.pt2", "README.md"]
    return out


@pytest.mark.parametrize("shape", [(1, 16), (2, 64), (1, 128)])
def test_the_char_transformers_program_takes_any_batch_and_length(chargpt_export, shape):
    """Issue 40: the program ran only at the example's 1 x 128 (`Guard failed: idx.size()[1] == 128`)."""
    import chargpt

    from auditor.folder import load_factorized

    program = load_program(chargpt_export).module()
    ref = load_factorized(chargpt.model(), chargpt_export)
    ids = torch.randint(0, len(chargpt.VOCAB), shape, generator=torch.Generator().manual_seed(sum(shape)))
    with torch.no_grad():
        got, want = program(ids), ref(ids)
    assert got.shape == (*shape, len(chargpt.VOCAB))
    assert relative_error(got, want) <= 1e-4


def test_the_char_transformers_export_says_what_it_takes(chargpt_export):
    import chargpt

    from auditor.folder import load_factorized

    e = json.loads((chargpt_export / "plan.json").read_text())["export"]["pt2"]
    assert e["inputs"] == [{"name": "arg0", "shape": ["batch", "seq"], "dtype": "int64"}]
    assert e["dynamic_batch"] and e["dynamic_sequence"] and e["static_because"] is None
    ran = {c["length"] for c in e["checks"] if "relative_error" in c}
    assert {2, 16, 64, 128} <= ran and all(c["relative_error"] <= 1e-5 for c in e["checks"] if "relative_error" in c)
    assert {c["length"] for c in e["checks"] if "refused" in c} == {1, 256}  # the model's 128 positions bound it
    text = " ".join((chargpt_export / "README.md").read_text().split())
    assert "arg0: int64[batch, seq]" in text and "checked at 2, 16, 64, 128 positions and refused at 1, 256" in text
    assert "`ids.long()`" in text and "model(torch.zeros(2, 16, dtype=torch.int64))" in text
    windows = chargpt.load_ids(chargpt.CALIB)[:3]  # the shipped uint8 windows, cast as the README says
    assert windows.dtype == torch.uint8
    with torch.no_grad():
        got = load_program(chargpt_export).module()(windows.long())
        assert relative_error(got, load_factorized(chargpt.model(), chargpt_export)(windows)) <= 1e-4


def test_the_llamas_program_takes_a_tokenizers_output(tmp_path):
    """input_ids and attention_mask (padding included) at any batch and length, as a tokenizer returns them."""
    from transformers import AutoTokenizer

    from auditor.folder import load_factorized
    from auditor.sources import load_source

    llama = "sample_models/llama"
    loaded = load_source(llama)
    plan = {"model.layers.0.mlp.up_proj": 16, "model.layers.1.self_attn.q_proj": 32}
    new = factorize(loaded.model, plan)
    out = tmp_path / "out"
    save_factorized(new, plan, out, source=llama)
    cli_write(out, new, None, loaded.example_inputs, ("pt2",))
    e = json.loads((out / "plan.json").read_text())["export"]["pt2"]
    assert e["keywords"] == ["input_ids", "attention_mask"] and e["dynamic_sequence"]
    assert "attention_mask: int64[batch, seq]" in (out / "README.md").read_text()
    program = load_program(out).module()
    ref = load_factorized(load_source(llama).model, out)
    enc = AutoTokenizer.from_pretrained(llama)(["def f(x):\n    return x + 1\n", "import os"], return_tensors="pt",
                                              padding=True)
    assert int(enc["attention_mask"].sum()) < enc["attention_mask"].numel()  # one row is padded
    with torch.no_grad():
        got = program(**enc)["logits"]
        want = ref(**enc).logits
    assert got.shape == want.shape and relative_error(got, want) <= 1e-4
