"""Real checkpoints: Hugging Face families, weights-only audits of (sharded) safetensors, and safe loading."""

import json
import math

import numpy as np
import pytest
import torch

import auditor

T = pytest.importorskip("transformers")


def ids(b=2, s=12, hi=100):
    return torch.randint(0, hi, (b, s), generator=torch.Generator().manual_seed(0))


FAMILIES = {
    "bert": (lambda: T.BertModel(T.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                              intermediate_size=128, vocab_size=100)),
             lambda: {"input_ids": ids()}, "encoder.layer.0.intermediate.dense", 2 * 12 * 128 * 64),
    "albert": (lambda: T.AlbertModel(T.AlbertConfig(embedding_size=16, hidden_size=64, num_hidden_layers=3,
                                                    num_attention_heads=2, intermediate_size=128, vocab_size=100)),
               lambda: {"input_ids": ids()}, "encoder.albert_layer_groups.0.albert_layers.0.ffn", 3 * 2 * 12 * 128 * 64),
    "gpt2": (lambda: T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=100, use_cache=False,
                                                    bos_token_id=0, eos_token_id=0)),
             lambda: {"input_ids": ids()}, "transformer.h.1.mlp.c_fc", 2 * 12 * 256 * 64),
    "llama-gqa": (lambda: T.LlamaForCausalLM(T.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                           num_attention_heads=4, num_key_value_heads=2,
                                                           vocab_size=100, use_cache=False)),
                  lambda: {"input_ids": ids()}, "model.layers.0.self_attn.k_proj", 2 * 12 * 32 * 64),
    "t5": (lambda: T.T5ForConditionalGeneration(T.T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=2, d_kv=32,
                                                           vocab_size=100, use_cache=False)),
           lambda: {"input_ids": ids(), "decoder_input_ids": ids(2, 7)}, "decoder.block.0.layer.2.DenseReluDense.wi",
           2 * 7 * 128 * 64),
    "vit": (lambda: T.ViTModel(T.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                           intermediate_size=128, image_size=32, patch_size=8)),
            lambda: {"pixel_values": torch.randn(2, 3, 32, 32)}, "embeddings.patch_embeddings.projection",
            2 * 16 * 64 * 192),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_traced_counted_and_costed(family):
    build, inputs, layer, macs = FAMILIES[family]
    torch.manual_seed(0)
    model = build()
    a = auditor.audit(model, inputs(), spectra=False)
    assert a.trace_method == "torch.export"
    assert a.total_params == sum(p.numel() for p in model.parameters())  # unique parameters
    assert a.layer(layer).macs == macs
    assert a.total_macs == sum(l.macs for l in a.layers) > 0
    assert a.unsupported_ops == {}


def test_t5_shared_embedding_has_every_use():
    build, inputs, _, _ = FAMILIES["t5"]
    a = auditor.audit(build(), inputs(), spectra=False)
    shared = a.layer("shared")
    assert {u.site for u in shared.uses} == {"encoder.embed_tokens", "decoder.embed_tokens", "lm_head"}
    assert shared.lookups == 2 * 12 + 2 * 7


def _write_shards(state: dict, folder, n: int = 3) -> None:
    from safetensors.torch import save_file

    names = list(state)
    per = math.ceil(len(names) / n)
    weight_map = {}
    for i in range(n):
        chunk = names[i * per:(i + 1) * per]
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file({k: state[k].contiguous() for k in chunk}, str(folder / fname))
        weight_map.update({k: fname for k in chunk})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_weights_only_sharded_matches_module_audit(tmp_path, digits_cnn):
    model, x = digits_cnn
    _write_shards(model.state_dict(), tmp_path)
    from auditor.sources import load_source

    loaded = load_source(str(tmp_path))
    w = auditor.audit(loaded.model, cache=False)
    m = auditor.audit(model, x, cache=False)
    assert w.trace_method == "weights only" and "No graph" in w.trace_summary
    assert w.total_params == m.total_params
    assert [(l.name, l.m, l.n, l.params) for l in w.layers] == [(l.name, l.m, l.n, l.params) for l in m.layers]
    for l in m.layers:
        assert np.allclose(w.spectra[l.name].sigma, m.spectra[l.name].sigma, rtol=0, atol=1e-9)
        assert w.suggestions[l.name].rank == m.suggestions[l.name].rank


def test_bf16_safetensors_upcast_per_tensor(tmp_path):
    from safetensors.torch import save_file

    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    save_file({"proj.weight": w, "proj.bias": torch.zeros(64, dtype=torch.bfloat16)}, str(tmp_path / "m.safetensors"))
    from auditor.sources import load_source

    a = auditor.audit(load_source(str(tmp_path / "m.safetensors")).model, cache=False)
    assert a.total_params == 64 * 32 + 64
    ref = np.linalg.svd(w.double().numpy(), compute_uv=False)
    assert np.max(np.abs(np.asarray(a.spectra["proj"].sigma[0]) - ref)) < 1e-9 * ref[0] + 1e-12


def test_hf_directory_with_weights(tmp_path, cli):
    cfg = T.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                       vocab_size=100, architectures=["BertModel"])
    torch.manual_seed(0)
    model = T.BertModel(cfg)
    model.save_pretrained(tmp_path / "bert")
    res = cli(tmp_path / "bert", "--input-ids", "1,8", "--format", "json", "-q")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["totals"]["params"] == sum(p.numel() for p in model.parameters())
    sigma = np.linalg.svd(model.encoder.layer[0].intermediate.dense.weight.detach().double().numpy(),
                          compute_uv=False)
    ranks = data["suggestions"]["encoder.layer.0.intermediate.dense"]["ranks_for"]
    cum = np.cumsum(sigma**2) / (sigma**2).sum()
    assert ranks["0.95"] == int(np.searchsorted(cum, 0.95)) + 1  # the saved weights were loaded, not re-initialised


def test_config_without_weights_is_structure_only_with_inputs_from_the_config(tmp_path):
    from auditor.sources import load_source

    T.BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128,
                 vocab_size=100, max_position_embeddings=96, architectures=["BertModel"]).save_pretrained(tmp_path)
    loaded = load_source(str(tmp_path))
    assert all(t.device.type == "meta" for t in loaded.model.state_dict().values())  # nothing random, nothing big
    assert any("No weights in" in n and "meta device" in n for n in loaded.notes)
    ids = loaded.example_inputs["input_ids"]
    assert ids.device.type == "meta" and tuple(ids.shape) == (1, 96)  # 128 capped at max_position_embeddings
    a = auditor.audit(loaded.model, loaded.example_inputs, spectra=False)
    assert a.trace_method == "torch.export"
    assert a.layer("encoder.layer.0.intermediate.dense").macs == 96 * 128 * 64


def test_structure_only_flag_builds_on_meta(tmp_path, cli):
    cfg = T.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                        vocab_size=1000, architectures=["LlamaForCausalLM"])
    cfg.save_pretrained(tmp_path / "llama")
    res = cli(tmp_path / "llama" / "config.json", "--structure-only", "--format", "json", "-q")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    expected = 2 * 1000 * 256 + 2 * (4 * 256 * 256 + 3 * 256 * 512 + 2 * 256) + 256
    assert data["totals"]["params"] == expected
    assert all(s["verdict"] == "skipped" for s in data["suggestions"].values())
    # with token ids (on the meta device too), torch.export gives the MACs without allocating weights
    res = cli(tmp_path / "llama" / "config.json", "--structure-only", "--input-ids", "1,16", "--format", "json", "-q")
    data = json.loads(res.stdout)
    assert data["meta"]["trace_method"] == "torch.export"
    up = next(l for l in data["layers"] if l["name"] == "model.layers.0.mlp.up_proj")
    assert up["macs"] == 16 * 512 * 256
    assert data["totals"]["macs"] == 16 * (2 * (4 * 256 * 256 + 3 * 256 * 512) + 1000 * 256)


def test_missing_shard_and_corrupt_file_exit_2(tmp_path, cli, digits_mlp):
    model, _ = digits_mlp
    _write_shards(model.state_dict(), tmp_path)
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    res = cli(tmp_path)
    assert res.returncode == 2 and "shard(s) missing" in res.stderr and victim.name in res.stderr
    bad = tmp_path / "trunc.safetensors"
    data = (sorted(tmp_path.glob("model-*.safetensors"))[0]).read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    res = cli(bad)
    assert res.returncode == 2 and "truncated or corrupt" in res.stderr and "Traceback" not in res.stderr


def test_shapes_that_do_not_match_the_config_exit_2(tmp_path, cli):
    from safetensors.torch import save_file

    cfg = T.BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128,
                       vocab_size=100, architectures=["BertModel"])
    cfg.save_pretrained(tmp_path)
    save_file({"encoder.layer.0.intermediate.dense.weight": torch.zeros(99, 64)}, str(tmp_path / "model.safetensors"))
    res = cli(tmp_path)
    assert res.returncode == 2 and "has shape (99, 64) but the model has (128, 64)" in res.stderr


class Payload:
    marker = None

    def __reduce__(self):
        return (open, (str(Payload.marker), "w"))  # would create a file if ever unpickled


def test_unsafe_pickle_is_refused_and_never_runs(tmp_path, cli):
    marker = tmp_path / "pwned"
    Payload.marker = marker
    ckpt = tmp_path / "evil.bin"
    torch.save({"weight": torch.zeros(2, 2), "payload": Payload()}, ckpt)
    assert not marker.exists()
    res = cli(ckpt)
    assert res.returncode == 2
    assert "refused to load" in res.stderr and "safetensors" in res.stderr and "weights_only" in res.stderr
    assert not marker.exists()  # the code in the pickle did not run
    (tmp_path / "cfg").mkdir()
    T.BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128,
                 vocab_size=100).save_pretrained(tmp_path / "cfg")
    (tmp_path / "cfg" / "pytorch_model.bin").write_bytes(ckpt.read_bytes())
    res = cli(tmp_path / "cfg")
    assert res.returncode == 2 and "refused to load" in res.stderr and not marker.exists()


def test_plain_state_dict_bin_is_audited_weights_only(tmp_path, cli, digits_mlp):
    model, _ = digits_mlp
    torch.save(model.state_dict(), tmp_path / "mlp.pt")
    res = cli(tmp_path / "mlp.pt", "--format", "json", "-q")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["totals"]["params"] == sum(p.numel() for p in model.parameters())
    assert data["meta"]["trace_method"] == "weights only"
