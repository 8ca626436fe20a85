"""Block grouping and plan globs on generated Llama-, BERT- and T5-like layer names (no model needed)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from auditor.config import tomllib
from auditor.planning.groups import (LayerShape, escape_glob, glob_matches, group_layers, natural_key, plan_globs,
                            toml_string)
from auditor.planning.plan import Plan, resolve

LLAMA7B_TOTAL = 6_738_415_616  # Llama-2-7B's parameter count, norms included


def llama7b() -> list[LayerShape]:
    d, ff, vocab = 4096, 11008, 32000
    out = [LayerShape("model.embed_tokens", vocab, d)]
    for i in range(32):
        p = f"model.layers.{i}."
        out += [LayerShape(p + f"self_attn.{x}_proj", d, d) for x in "qkvo"]
        out += [LayerShape(p + "mlp.gate_proj", ff, d), LayerShape(p + "mlp.up_proj", ff, d),
                LayerShape(p + "mlp.down_proj", d, ff)]
    return out + [LayerShape("lm_head", vocab, d)]


def bert_base() -> list[LayerShape]:
    d, ff = 768, 3072
    out = [LayerShape("bert.embeddings.word_embeddings", 30522, d),
           LayerShape("bert.embeddings.position_embeddings", 512, d),
           LayerShape("bert.embeddings.token_type_embeddings", 2, d)]
    for i in range(12):
        p = f"bert.encoder.layer.{i}."
        out += [LayerShape(p + f"attention.self.{x}", d, d) for x in ("query", "key", "value")]
        out += [LayerShape(p + "attention.output.dense", d, d), LayerShape(p + "intermediate.dense", ff, d),
                LayerShape(p + "output.dense", d, ff)]
    return out + [LayerShape("bert.pooler.dense", d, d)]


def t5_small() -> list[LayerShape]:
    d, ff, blocks = 512, 2048, 6
    out = [LayerShape("shared", 32128, d)]
    for stack in ("encoder", "decoder"):
        for i in range(blocks):
            p = f"{stack}.block.{i}.layer."
            out += [LayerShape(p + f"0.SelfAttention.{x}", d, d) for x in "qkvo"]
            if i == 0:
                out.append(LayerShape(p + "0.SelfAttention.relative_attention_bias", 32, 8))
            if stack == "decoder":
                out += [LayerShape(p + f"1.EncDecAttention.{x}", d, d) for x in "qkvo"]
            k = 1 if stack == "encoder" else 2
            out += [LayerShape(p + f"{k}.DenseReluDense.wi", ff, d), LayerShape(p + f"{k}.DenseReluDense.wo", d, ff)]
    return out + [LayerShape("lm_head", 32128, d)]


def by_label(groups):
    return {g.label: g for g in groups}


def test_llama7b_groups_exact():
    layers = llama7b()
    assert sum(l.params for l in layers) == LLAMA7B_TOTAL - 65 * 4096  # 65 RMSNorm vectors are not factorizable
    groups = group_layers(layers, total_params=LLAMA7B_TOTAL)
    assert len(groups) == 9
    assert [g.label for g in groups] == [
        "model.layers.*.mlp.gate_proj", "model.layers.*.mlp.up_proj", "model.layers.*.mlp.down_proj",
        *(f"model.layers.*.self_attn.{x}_proj" for x in "qkvo"), "model.embed_tokens", "lm_head"]
    down = by_label(groups)["model.layers.*.mlp.down_proj"]
    assert down.size == 32 and down.is_group and down.same_shape
    assert down.params_each == 45_088_768 and down.params == 32 * 45_088_768 == 1_442_840_576
    assert down.shapes == ((4096, 11008),)
    assert down.share == 1_442_840_576 / LLAMA7B_TOTAL and round(100 * down.share, 4) == 21.4122
    assert down.members[:3] == tuple(f"model.layers.{i}.mlp.down_proj" for i in range(3))
    assert down.members[10] == "model.layers.10.mlp.down_proj"  # natural order, not "1, 10, 11, ..."
    head = by_label(groups)["lm_head"]
    assert not head.is_group and head.members == ("lm_head",) and head.params == 131_072_000
    assert sum(g.params for g in groups) == 6_738_149_376
    assert sum(g.size for g in groups) == len(layers) == 226


def test_grouping_ignores_input_order():
    layers = llama7b()
    shuffled = layers[:]
    random.Random(0).shuffle(shuffled)
    a, b = group_layers(layers), group_layers(shuffled)
    assert {g.label: g.members for g in a} == {g.label: g.members for g in b}


def test_bert_groups_and_narrowed_globs():
    layers = bert_base()
    groups = by_label(group_layers(layers))
    assert len(groups) == 10
    assert groups["bert.encoder.layer.*.attention.self.query"].size == 12
    out_dense = groups["bert.encoder.layer.*.output.dense"]
    att_dense = groups["bert.encoder.layer.*.attention.output.dense"]
    assert out_dense.size == att_dense.size == 12 and set(out_dense.members).isdisjoint(att_dense.members)
    assert out_dense.shapes == ((768, 3072),) and att_dense.shapes == ((768, 768),)
    # "*" also matches dots, so the plain glob of output.dense would reach attention.output.dense as well
    names = [l.name for l in layers]
    assert len(glob_matches(out_dense.pattern, names)) == 24
    ranks = {n: 128 for n in names if n.startswith("bert.encoder.")}
    globs = plan_globs(ranks, names)
    assert globs == {
        "bert.encoder.layer.*.attention.output.dense": 128,
        "bert.encoder.layer.*.attention.self.key": 128,
        "bert.encoder.layer.*.attention.self.query": 128,
        "bert.encoder.layer.*.attention.self.value": 128,
        "bert.encoder.layer.*.intermediate.dense": 128,
        "bert.encoder.layer.[0-9].output.dense": 128,
        "bert.encoder.layer.[0-9][0-9].output.dense": 128,
    }
    assert_exact(globs, ranks, layers)


def test_t5_encoder_and_decoder_stay_apart():
    layers = t5_small()
    groups = by_label(group_layers(layers))
    assert len(groups) == 2 + (6 + 1) + (10 + 1)  # shared, lm_head; encoder; decoder (+ the bias tables)
    enc, dec = groups["encoder.block.*.layer.0.SelfAttention.q"], groups["decoder.block.*.layer.0.SelfAttention.q"]
    assert enc.size == dec.size == 6 and set(enc.members).isdisjoint(dec.members)
    assert groups["decoder.block.*.layer.1.EncDecAttention.q"].size == 6
    # the two relative_attention_bias tables are single layers with their full, distinct names
    for stack in ("encoder", "decoder"):
        g = groups[f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias"]
        assert g.members == (g.label,) and g.params == 256
    ranks = {l.name: 64 for l in layers if "DenseReluDense" in l.name or "Attention.q" in l.name}
    globs = plan_globs(ranks, [l.name for l in layers])
    assert len(globs) == 7 and set(globs.values()) == {64}
    assert "encoder.block.*.layer.1.DenseReluDense.wi" in globs and "decoder.block.*.layer.2.DenseReluDense.wo" in globs
    assert_exact(globs, ranks, layers)


def test_llama_plan_globs_collapse_only_where_members_agree():
    layers = llama7b()
    names = [l.name for l in layers]
    ranks = {n: 1024 for n in names if "mlp" in n}
    ranks.update({n: 512 for n in names if "q_proj" in n})
    ranks["model.layers.5.self_attn.q_proj"] = 256  # one member disagrees: the group is listed member by member
    for n in [n for n in names if "k_proj" in n][:31]:  # k_proj of the last layer stays dense: no glob either
        ranks[n] = 256
    globs = plan_globs(ranks, names)
    assert {k: v for k, v in globs.items() if "mlp" in k} == {
        "model.layers.*.mlp.gate_proj": 1024, "model.layers.*.mlp.up_proj": 1024, "model.layers.*.mlp.down_proj": 1024}
    assert len(globs) == 3 + 32 + 31
    assert globs["model.layers.5.self_attn.q_proj"] == 256 and globs["model.layers.6.self_attn.q_proj"] == 512
    assert "model.layers.31.self_attn.k_proj" not in globs
    assert_exact(globs, ranks, layers)


def test_plan_globs_narrow_where_star_reaches_another_layer():
    layers = [LayerShape(f"blocks.{i}", 8, 8) for i in range(3)] + [LayerShape("blocks.9.extra", 8, 8)]
    names = [l.name for l in layers]
    ranks = {f"blocks.{i}": 2 for i in range(3)}
    assert plan_globs(ranks, names) == {"blocks.[0-9]": 2}  # "blocks.*" would select blocks.9.extra
    assert_exact(plan_globs(ranks, names), ranks, layers)


def test_plan_globs_respect_parameter_names():
    layers = [LayerShape(f"h.{i}", 8, 8) for i in range(3)] + [LayerShape("head", 8, 8)]
    params = {l.name + ".weight": l.name for l in layers}
    names = [l.name for l in layers]
    ranks = {f"h.{i}": 2 for i in range(3)}
    # "h.*" selects h.0.weight, which stands for h.0 itself: harmless, the glob stays
    assert plan_globs(ranks, names, params) == {"h.*": 2}
    params["h.7.weight"] = "head"  # a parameter named like a member but owned by another layer
    assert plan_globs(ranks, names, params) == {"h.[0-9]": 2}
    assert plan_globs(ranks, names, params | {"h.5": "head"}) == {"h.0": 2, "h.1": 2, "h.2": 2}


@pytest.mark.parametrize("names", [
    ["w[0]", "w[1]", "a*b", "q?", "x]y", "[", "*", "?"],
    [f"blk.{i}.w[1]" for i in range(12)] + [f"blk.{i}.w*" for i in range(3)] + ["blk.1.w1"],
    ["tiny\n[thresholds]\nfail_on = \"never\"\n#", "emoji.\U0001F600", "rtl.\u202egpj", "ctl.\x1b[31m", "q\"uote\\"],
])
def test_hostile_names_read_back_through_toml(names):
    layers = [LayerShape(n, 16, 16) for n in names]
    ranks = {n: 3 + i % 2 for i, n in enumerate(names)}
    globs = plan_globs(ranks, names)
    assert_exact(globs, ranks, layers)
    text = "[ranks]\n" + "".join(f"{toml_string(p)} = {r}\n" for p, r in globs.items())
    assert all(ord(c) >= 0x20 or c == "\n" for c in text) and "\u202e" not in text and "\x1b" not in text
    parsed = tomllib.loads(text)
    assert set(parsed) == {"ranks"} and parsed["ranks"] == globs
    assert_exact(parsed["ranks"], ranks, layers)


def test_grouped_hostile_names_collapse():
    names = [f"blk.{i}.w[1]" for i in range(12)]
    assert plan_globs({n: 4 for n in names}) == {"blk.*.w[[]1]": 4}
    assert group_layers([LayerShape(n, 4, 4) for n in names])[0].label == "blk.*.w[1]"


def test_helpers():
    assert escape_glob("a[b]*c?") == "a[[]b][*]c[?]"
    assert sorted(["a.10", "a.9", "a.b", "a.1.c"], key=natural_key) == ["a.1.c", "a.9", "a.10", "a.b"]
    assert toml_string("a\tb\x7f\u2029") == '"a\\tb\\u007F\\u2029"'
    with pytest.raises(ValueError, match="appears twice"):
        group_layers([LayerShape("a", 1, 1), LayerShape("a", 1, 1)])
    with pytest.raises(ValueError, match="surrogate"):
        toml_string("a\ud800")
    g = group_layers([LayerShape("features.0", 64, 27), LayerShape("features.3", 128, 576)])[0]
    assert g.label == "features.*" and not g.same_shape and g.params_each is None
    assert g.shapes == ((64, 27), (128, 576)) and g.params == 64 * 27 + 128 * 576


def assert_exact(globs: dict[str, int], ranks: dict[str, int], layers: list[LayerShape]) -> None:
    """Each pattern selects (by auditor.planning.plan's rules, names and parameter names) only layers planned with its rank,
    patterns never overlap, and resolving the plan with auditor.planning.plan.resolve gives back ``ranks`` exactly."""
    keys = {l.name: l.name for l in layers} | {l.name + ".weight": l.name for l in layers}
    seen: set[str] = set()
    for pattern, r in globs.items():
        hit = {keys[k] for k in glob_matches(pattern, keys)}
        assert hit and all(ranks.get(h) == r for h in hit), pattern
        assert not hit & seen, pattern
        seen |= hit
    assert seen == set(ranks)
    fake = SimpleNamespace(
        layers=[SimpleNamespace(name=l.name, param=l.name + ".weight", break_even=l.m * l.n / (l.m + l.n))
                for l in layers], spectra={})
    got = resolve(fake, Plan.from_dict({"ranks": globs}, "test"))  # type: ignore[arg-type]
    assert {name: r for name, r, _, _ in got} == ranks
