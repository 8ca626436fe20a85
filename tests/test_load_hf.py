"""Hugging Face sources: missing weights are errors, nothing is fetched or run from a config, memory is budgeted
before a build, and inputs follow the model's main input (made from the config when none are given)."""

import json
import os

import pytest
import torch

from auditor.errors import AuditError
from auditor.sources import load_source

T = pytest.importorskip("transformers")


def bert_cfg(**kw):
    return T.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                        vocab_size=50, max_position_embeddings=64, architectures=["BertModel"], **kw)


def save_bert(folder, **kw):
    torch.manual_seed(0)
    model = T.BertModel(bert_cfg(**kw))
    model.save_pretrained(folder)
    return model


def test_checkpoint_covering_one_matrix_is_an_error_naming_the_rest(tmp_path, cli_inproc):
    from safetensors.torch import save_file

    model = T.BertModel(bert_cfg())
    bert_cfg().save_pretrained(tmp_path)
    keep = "encoder.layer.0.intermediate.dense.weight"
    save_file({keep: model.state_dict()[keep]}, str(tmp_path / "model.safetensors"))
    with pytest.raises(AuditError) as exc:
        load_source(str(tmp_path))
    n_params = len(list(model.parameters()))
    total = sum(p.numel() for p in model.parameters())
    share = 100 * (total - 64 * 32) / total
    assert exc.value.what.startswith(f"{tmp_path} lacks {n_params - 1} of the model's parameter tensors "
                                     f"({share:.1f}% of its parameters): embeddings.word_embeddings.weight, ")
    assert exc.value.what.endswith(f", ... and {n_params - 6} more")
    res = cli_inproc(tmp_path, "--no-spectra", "-q")
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "lacks" in res.stderr
    loaded = load_source(str(tmp_path), partial=True)
    assert torch.equal(loaded.model.encoder.layer[0].intermediate.dense.weight, model.state_dict()[keep])
    assert loaded.notes[0].startswith(f"Partial audit: {tmp_path} lacks {n_params - 1} of")


def test_empty_weight_map_is_an_error(tmp_path):
    bert_cfg().save_pretrained(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    with pytest.raises(AuditError) as exc:
        load_source(str(tmp_path))
    assert str(tmp_path) in exc.value.what


def test_tied_head_saved_once_loads_whole(tmp_path):
    cfg = T.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=60, n_positions=40,
                       architectures=["GPT2LMHeadModel"])
    torch.manual_seed(0)
    T.GPT2LMHeadModel(cfg).save_pretrained(tmp_path)  # lm_head.weight is tied to wte: not saved
    loaded = load_source(str(tmp_path))
    m = loaded.model
    assert m.lm_head.weight is m.transformer.wte.weight
    assert not any("lacks" in n for n in loaded.notes)
    assert tuple(loaded.example_inputs["input_ids"].shape) == (1, 40)  # n_positions caps the default length


def test_task_checkpoint_audited_as_base_model_strips_the_prefix(tmp_path):
    torch.manual_seed(0)
    task = T.BertForSequenceClassification(bert_cfg())
    task.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("architectures")  # AutoModel builds BertModel, whose names lack "bert."
    (tmp_path / "config.json").write_text(json.dumps(raw))
    loaded = load_source(str(tmp_path))
    assert type(loaded.model).__name__ == "BertModel"
    assert torch.equal(loaded.model.encoder.layer[0].output.dense.weight,
                       task.bert.encoder.layer[0].output.dense.weight)
    (unused,) = [n for n in loaded.notes if "not part of the model" in n]
    assert "classifier.weight" in unused


def test_memory_is_estimated_before_building(tmp_path, monkeypatch, map_all):
    import auditor.sources.hf as hf

    model = save_bert(tmp_path)
    monkeypatch.setattr(hf, "available_memory", lambda: 1 << 20)
    built = []
    real_build = hf._build
    monkeypatch.setattr(hf, "_build", lambda *a, meta, **k: built.append(meta) or real_build(*a, meta=meta, **k))
    with pytest.raises(AuditError) as exc:
        load_source(str(tmp_path))
    assert built == [True]  # only the meta build ran
    # safetensors: the weights are the file's pages, so the build needs the buffers and one chunk
    need = (sum(t.numel() * t.element_size() for t in model.buffers()) + hf.CHUNK_BYTES) / (1 << 30)
    assert exc.value.what.endswith(f"needs about {need:.1f} GiB of memory (its buffers and one chunk of tensors; "
                                   "the weights are mapped from the checkpoint), but only 0.0 GiB is available")
    assert "--structure-only" in exc.value.fix
    # a torch state dict is copied into the model: its parameters count
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(AuditError) as exc:
        load_source(str(tmp_path))
    params = sum(p.numel() for p in model.parameters())
    need = (sum(t.numel() for t in [*model.parameters(), *model.buffers()]) * 4 + hf.CHUNK_BYTES) / (1 << 30)
    assert exc.value.what.endswith(f"needs about {need:.1f} GiB of memory ({params:,} parameters as float32), "
                                   "but only 0.0 GiB is available")
    assert load_source(str(tmp_path), structure_only=True).model.embeddings.word_embeddings.weight.is_meta


def test_available_memory_is_a_positive_byte_count():
    from auditor.sources.hf import available_memory

    have = available_memory()
    assert have is None or 0 < have < 1 << 50


def test_offline_is_forced_and_restored(tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    import auditor.sources.hf as hf

    bert_cfg().save_pretrained(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    seen = []
    real_build = hf._build
    monkeypatch.setattr(hf, "_build", lambda *a, meta: seen.append(
        (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"), constants.HF_HUB_OFFLINE))
        or real_build(*a, meta=meta))
    load_source(str(tmp_path))
    assert seen == [("1", "1", True)]
    assert os.environ["HF_HUB_OFFLINE"] == "0" and "TRANSFORMERS_OFFLINE" not in os.environ
    assert constants.HF_HUB_OFFLINE is False


@pytest.mark.parametrize("attn", ["kernels-community/flash-attn", "someone/evil-kernel:fn", "flash_attention_2"])
def test_hub_kernels_in_a_config_are_neutralised(tmp_path, attn):
    bert_cfg().save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["attn_implementation"] = attn
    (tmp_path / "config.json").write_text(json.dumps(raw))
    loaded = load_source(str(tmp_path))
    assert loaded.model.config._attn_implementation in ("sdpa", "eager")
    (note,) = [n for n in loaded.notes if n.startswith("Ignored in config.json")]
    assert f"attn_implementation={attn!r}" in note


def test_neutralise_reaches_nested_configs():
    from auditor.sources.hf import neutralise

    raw = {"model_type": "x", "auto_map": {"AutoModel": "m.M"}, "text_config": {"_attn_implementation": "a/b"},
           "vision_config": {"attn_implementation": "sdpa", "experts_implementation": "org/k"},
           "trust_remote_code": True}
    assert neutralise(raw) == ["auto_map", "text_config._attn_implementation='a/b'",
                               "vision_config.experts_implementation='org/k'", "trust_remote_code"]
    assert raw == {"model_type": "x", "text_config": {}, "vision_config": {"attn_implementation": "sdpa"}}


def test_remote_code_is_never_run(tmp_path):
    bert_cfg().save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["auto_map"] = {"AutoModel": "modeling_evil.EvilModel"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    marker = tmp_path / "ran"
    (tmp_path / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w')\n")
    loaded = load_source(str(tmp_path))
    assert type(loaded.model).__name__ == "BertModel" and not marker.exists()
    assert any("auto_map" in n for n in loaded.notes)
    raw["model_type"] = "evil-model"
    raw.pop("architectures")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(AuditError, match="code lives on the Hub"):
        load_source(str(tmp_path))
    assert not marker.exists()


def test_text_model_refuses_a_float_shape_and_vision_model_token_ids(tmp_path):
    bert_cfg().save_pretrained(tmp_path / "bert")
    with pytest.raises(AuditError) as exc:
        load_source(str(tmp_path / "bert"), input_shape=[(1, 16)])
    assert "takes token ids (input_ids)" in exc.value.what and "--input-ids 1,128" in exc.value.fix
    T.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32,
                patch_size=8, num_channels=3, architectures=["ViTModel"]).save_pretrained(tmp_path / "vit")
    with pytest.raises(AuditError) as exc:
        load_source(str(tmp_path / "vit"), input_ids=(1, 16))
    assert exc.value.line() == ("ViTModel takes pixel_values, not token ids. "
                                "Pass --input-shape 1,3,32,32 instead of --input-ids.")
    loaded = load_source(str(tmp_path / "vit"))
    assert tuple(loaded.example_inputs["pixel_values"].shape) == (1, 3, 32, 32)
    assert loaded.example_inputs["pixel_values"].is_meta
    with pytest.raises(AuditError, match="longer than the 64 positions"):
        load_source(str(tmp_path / "bert"), input_ids=(1, 65))


def test_default_token_ids_give_macs_on_real_weights(tmp_path):
    import auditor

    model = save_bert(tmp_path)
    loaded = load_source(str(tmp_path))
    ids = loaded.example_inputs["input_ids"]
    assert tuple(ids.shape) == (1, 64) and ids.dtype == torch.long and 0 <= ids.min() and ids.max() < 50
    made = "No inputs given: token ids of shape 1 x 64 were made from the config, so MACs and the data-flow graph"
    assert any(n.startswith(made) for n in loaded.notes)
    a = auditor.audit(loaded.model, loaded.example_inputs, spectra=False)
    assert a.layer("encoder.layer.0.intermediate.dense").macs == 64 * 64 * 32
    assert torch.equal(loaded.model.pooler.dense.weight, model.pooler.dense.weight)
    bare = load_source(str(tmp_path), auto_inputs=False)
    assert bare.example_inputs is None and not any("No inputs given" in n for n in bare.notes)


def test_encoder_decoder_gets_decoder_ids_and_given_ids_stay_on_meta(tmp_path):
    T.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, vocab_size=40,
               architectures=["T5ForConditionalGeneration"]).save_pretrained(tmp_path)
    loaded = load_source(str(tmp_path), input_ids=(2, 10))
    assert set(loaded.example_inputs) == {"input_ids", "decoder_input_ids"}
    assert all(v.is_meta and tuple(v.shape) == (2, 10) for v in loaded.example_inputs.values())
    default = load_source(str(tmp_path))
    assert tuple(default.example_inputs["decoder_input_ids"].shape) == (1, 128)  # T5 has no position limit


def test_config_with_weights_flag_loads_them(tmp_path):
    model = save_bert(tmp_path / "ckpt")
    bert_cfg().save_pretrained(tmp_path / "cfg")
    loaded = load_source(str(tmp_path / "cfg" / "config.json"), weights=str(tmp_path / "ckpt" / "model.safetensors"))
    assert torch.equal(loaded.model.encoder.layer[0].output.dense.weight, model.encoder.layer[0].output.dense.weight)
    only = load_source(str(tmp_path / "cfg" / "config.json"), weights=str(tmp_path / "ckpt"), structure_only=True)
    assert only.model.pooler.dense.weight.is_meta
    assert f"Structure only: the weights in {tmp_path / 'ckpt'} were not read." in only.notes


def test_weights_only_directory_with_empty_weight_map_is_an_error(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    with pytest.raises(AuditError) as exc:
        load_source(str(tmp_path))
    assert str(tmp_path) in exc.value.what


def test_llama_7b_with_weights_is_refused_before_anything_is_allocated(tmp_path, monkeypatch):
    """The issue's case: a 7B config on a 24 GB machine was killed by the OOM killer (exit 137)."""
    from safetensors.torch import save_file

    import auditor.sources.hf as hf

    T.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                  vocab_size=32000, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    save_file({"model.norm.weight": torch.ones(4096)}, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(hf, "available_memory", lambda: 24 << 30)
    with pytest.raises(AuditError) as exc:
        load_source(str(tmp_path))
    params = 6_738_415_616
    need = (params * 4 + 64 * 4 + hf.CHUNK_BYTES) / (1 << 30)  # float32 weights, rotary inv_freq, one chunk
    assert exc.value.what.endswith(f"needs about {need:.1f} GiB of memory ({params:,} parameters as float32), "
                                   "but only 24.0 GiB is available")


def test_deeply_nested_config_is_one_error_or_loads(tmp_path):
    for depth in (900, 990, 995, 5000):  # around the recursion limit, in json and in the config walk
        (tmp_path / "config.json").write_text('{"model_type": "bert", "x": ' + "[" * depth + "]" * depth + "}")
        try:
            load_source(str(tmp_path / "config.json"))
        except AuditError as exc:
            assert "cannot read the Hugging Face config" in exc.what and depth >= 990
        else:
            assert depth < 5000


def _tied_llama(folder, dtype=torch.float32, **kw):
    cfg = T.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        tie_word_embeddings=True, architectures=["LlamaForCausalLM"], **kw)
    torch.manual_seed(1)
    model = T.LlamaForCausalLM(cfg).to(dtype).eval()
    model.save_pretrained(folder)
    return model


@pytest.fixture
def map_all(monkeypatch):
    """Every covering safetensors checkpoint mapped, whatever its size (the default maps from 1 GiB)."""
    import auditor.sources.checkpoint as ck

    monkeypatch.setattr(ck, "MAP_MIN_BYTES", 0)


def test_safetensors_weights_are_the_files_pages_ties_kept(tmp_path, map_all):
    """A checkpoint of safetensors that covers every parameter is not copied: each parameter is the file's own pages
    (a private map: a write stays in the process), tied names share one tensor, buffers a constructor computes
    (rotary frequencies) are real, and the model computes what the saved one does, bit for bit."""
    from auditor.sources.checkpoint import mapped_bytes

    model = _tied_llama(tmp_path)
    loaded = load_source(str(tmp_path)).model.eval()
    params = list(loaded.parameters())
    assert mapped_bytes(loaded) == sum(p.numel() * p.element_size() for p in params) > 0
    from auditor.speed.estimate import shapes_of

    assert shapes_of(loaded).mapped_bytes == mapped_bytes(loaded)  # the estimate's check does not count them
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert all(b.device.type == "cpu" for b in loaded.buffers()) and all(p.device.type == "cpu" for p in params)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
        loaded.model.norm.weight.add_(1.0)  # copied on write: the file keeps its bytes
    again = load_source(str(tmp_path)).model.eval()
    assert torch.equal(again.model.norm.weight, model.model.norm.weight)


def test_a_small_model_is_copied_and_a_checkpoint_written_during_the_audit_is_refused(tmp_path, monkeypatch):
    """Under MAP_MIN_BYTES the weights are copied (nothing that writes the checkpoint later reaches them); mapped,
    a checkpoint file written after the load fails the audit with one line (its pages are the weights)."""
    import auditor.sources.checkpoint as ck

    _tied_llama(tmp_path)
    small = load_source(str(tmp_path)).model
    assert ck.mapped_bytes(small) == 0
    ck.check_mapped(small)  # nothing watched
    monkeypatch.setattr(ck, "MAP_MIN_BYTES", 0)
    monkeypatch.chdir(tmp_path.parent)
    model = load_source(tmp_path.name).model  # a relative path, then another working directory: the same file
    monkeypatch.chdir("/")
    assert ck.mapped_bytes(model) > 0
    ck.check_mapped(model)  # unchanged
    st = os.stat(tmp_path / "model.safetensors")
    os.utime(tmp_path / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(AuditError) as exc:
        ck.check_mapped(model)
    assert exc.value.what == (f"the checkpoint file {tmp_path / 'model.safetensors'} changed while it was audited "
                              "(its weights are read from the file as the audit runs), so the numbers may mix two "
                              "versions of the weights")


@pytest.mark.parametrize("saved,config", [(torch.float32, "bfloat16"), (torch.bfloat16, None)])
def test_a_dtype_the_model_does_not_hold_is_copied_and_its_memory_counted(tmp_path, map_all, monkeypatch, saved,
                                                                         config):
    """Tensors in another dtype than the model is built in (float32 for a bfloat16 config; bfloat16 where the config
    names none, built float32) are cast into it, a copy each, as before; the build's memory check counts the model's
    weights then, not the buffers alone (a 7B model would have allocated 28 GB past the check)."""
    import auditor.sources.hf as hf
    from auditor.sources.checkpoint import mapped_bytes

    model = _tied_llama(tmp_path, dtype=saved)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key in ("torch_dtype", "dtype"):
        cfg.pop(key, None)
        if config is not None:
            cfg[key] = config
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = load_source(str(tmp_path)).model
    built = {p.dtype for p in loaded.parameters()}
    assert built != {saved} and mapped_bytes(loaded) == 0
    (dtype,) = built
    assert torch.equal(loaded.model.norm.weight, model.model.norm.weight.to(dtype))
    monkeypatch.setattr(hf, "available_memory", lambda: hf.CHUNK_BYTES + 20_000)  # room for the buffers alone
    with pytest.raises(AuditError) as exc:
        load_source(str(tmp_path))
    assert "parameters as" in exc.value.what


LOAD_RSS = """
import sys
sys.path.insert(0, {root!r})
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
from auditor.sources import load_source
import auditor.sources.checkpoint
auditor.sources.checkpoint.MAP_MIN_BYTES = 0  # this small model mapped as a large one is
import torch, transformers
transformers.LlamaForCausalLM  # the library imported before the count
before = anon()
model = load_source({folder!r}).model
print(anon() - before, sum(p.numel() * p.element_size() for p in model.parameters()))
"""


def test_loading_a_safetensors_model_takes_no_anonymous_memory_for_its_weights(tmp_path):
    """The load of a model of 67 MB of float32 weights grows the process's anonymous memory by far less than them
    (it grew by at least the weights when they were copied into a built model)."""
    import subprocess
    import sys
    from pathlib import Path

    cfg = T.LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64,
                        architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    T.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", LOAD_RSS.format(root=root, folder=str(tmp_path))],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    grown, weights = (int(x) for x in out.stdout.split()[-2:])
    assert weights > 60e6 and grown < 0.25 * weights, (grown, weights)
