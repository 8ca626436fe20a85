"""The pooled-embedding cosine distance of a sentence encoder: on a tiny random BERT saved in the
sentence-transformers layout (modules.json, 1_Pooling/config.json, 2_Normalize) with a right-padded held-out batch,
1 - cosine of the mean / CLS / max pooled embedding equals a hand computation (each row run alone, without its
pads), padding changes nothing, the directory gets the metric by default with its pooling, and a pooling config it
cannot read is one line, exit 2."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from auditor.calibration import load_calibration
from auditor.calibration.data.inputs import Batch
from auditor.calibration.measure.metric import Evaluator, Metric
from auditor.calibration.session import metric_of
from auditor.errors import AuditError
from auditor.sources.sentence import sentence_pooling

transformers = pytest.importorskip("transformers")

VOCAB, PAD, POSITIONS = 60, 0, 16
LENGTHS = [8, 5, 2]  # real tokens per held-out row


def _bert(seed: int = 0, width: int = 16) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=width, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=2 * width, max_position_embeddings=POSITIONS, pad_token_id=PAD,
                                  initializer_range=0.3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                  architectures=["BertModel"], attn_implementation="eager")
    return transformers.BertModel(cfg).eval()


def _held(width: int = 8, pad_with: int = PAD, seed: int = 2) -> dict[str, torch.Tensor]:
    """Right-padded rows of LENGTHS real tokens; the pads hold ``pad_with`` (-1: random ids)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (len(LENGTHS), POSITIONS), generator=g)[:, :width]  # the same real tokens
    mask = torch.zeros_like(ids)
    for r, n in enumerate(LENGTHS):
        mask[r, :n] = 1
    if pad_with >= 0:
        ids = torch.where(mask.bool(), ids, torch.full_like(ids, pad_with))
    return {"input_ids": ids, "attention_mask": mask}


def _fit() -> dict[str, torch.Tensor]:
    ids = torch.randint(2, VOCAB, (8, 8), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _perturbed(model: nn.Module) -> nn.Module:
    other = copy.deepcopy(model)
    with torch.no_grad():
        w = other.encoder.layer[1].intermediate.dense.weight
        w.add_(0.4 * torch.randn(w.shape, generator=torch.Generator().manual_seed(5)))
    return other


def _hand(model: nn.Module, other: nn.Module, held: dict[str, torch.Tensor], mode: str) -> float:
    """Mean over the rows of 1 - cosine of the pooled embeddings, each row run alone on its real tokens only."""
    total = 0.0
    for r, n in enumerate(LENGTHS):
        ids = held["input_ids"][r:r + 1, :n]
        with torch.no_grad():
            a, b = (m(input_ids=ids).last_hidden_state[0].double() for m in (model, other))
        pa, pb = ({"mean": h.mean(0), "cls": h[0], "max": h.amax(0)}[mode] for h in (a, b))
        total += 1.0 - float(torch.nn.functional.cosine_similarity(pa, pb, dim=0))
    return total / len(LENGTHS)


@pytest.fixture(scope="module")
def bert():
    model = _bert()
    held = _held()
    return model, load_calibration(_fit(), model, holdout=held, batch_size=8), held


@pytest.mark.parametrize("mode", ["mean", "cls", "max"])
def test_pooled_cosine_equals_a_hand_computation(bert, mode):
    model, cal, held = bert
    other = _perturbed(model)
    want = _hand(model, other, held, mode)
    assert 1e-3 < want < 0.5
    metric = Metric(kind="pooled", pooling=(mode,), tolerance=0.01)
    ev = Evaluator(model, cal, metric)
    m = ev.measure(other)
    assert m.value == pytest.approx(want, rel=1e-5) and m.ok == (want <= 0.01)
    assert ev.reference == 0.0 and ev.measure(model).value == pytest.approx(0.0, abs=1e-12)
    rows = metric.spec.row_scorer(model, cal.holdout)  # the verification's per-row sums: the same value
    sums = rows.sums(other)
    assert rows.value(sums) == pytest.approx(want, rel=1e-5)
    d, counted = sums
    assert list(counted) == [1.0, 1.0, 1.0] and float(d.sum()) / 3 == pytest.approx(want, rel=1e-5)
    assert rows.value(sums, np.array([0, 2])) == pytest.approx((d[0] + d[2]) / 2, rel=1e-12)
    assert (metric.label, metric.higher_is_better) == (f"pooled-embedding cosine distance ({mode} pooling)", False)


def test_padding_changes_nothing(bert):
    """Other ids at the pads, and more pad columns, give the same value (the pads are masked out of attention and
    out of mean and max pooling)."""
    model, _, held = bert
    other = _perturbed(model)
    for mode in ("mean", "max", "cls"):
        values = []
        for h in (held, _held(pad_with=-1), _held(width=12, pad_with=-1)):
            cal = load_calibration(_fit(), model, holdout=h, batch_size=8)
            values.append(Evaluator(model, cal, Metric(kind="pooled", pooling=(mode,))).measure(other).value)
        assert values[1] == pytest.approx(values[0], rel=1e-5) and values[2] == pytest.approx(values[0], rel=1e-5)


def _save(folder: Path, pooling: object = "mean", modules: object = None, width: int = 16) -> Path:
    """The model in the sentence-transformers layout: the transformer at the root, 1_Pooling, 2_Normalize."""
    _bert(width=width).save_pretrained(folder)
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "2_Normalize").mkdir(exist_ok=True)
    listed = modules if modules is not None else [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (folder / "modules.json").write_text(json.dumps(listed))
    if isinstance(pooling, str) and pooling in ("mean", "cls", "max"):
        config = {"word_embedding_dimension": 16, "pooling_mode_cls_token": pooling == "cls",
                  "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": pooling == "max",
                  "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
                  "pooling_mode_lasttoken": False, "include_prompt": True}
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(config))
    else:
        (folder / "1_Pooling" / "config.json").write_text(pooling if isinstance(pooling, str) else json.dumps(pooling))
    return folder


@pytest.mark.parametrize("mode", ["mean", "cls", "max"])
def test_a_sentence_transformers_directory_gets_the_pooled_metric_by_default(tmp_path, bert, mode):
    model, cal, _ = bert
    folder = _save(tmp_path / "st", mode)
    default = SimpleNamespace(metric=None, tolerance=None)
    assert sentence_pooling(folder) == (mode,)
    assert metric_of(default, model, cal, str(folder)) == Metric(kind="pooled", pooling=(mode,))
    assert metric_of(default, model, cal, str(folder / "config.json")).pooling == (mode,)
    named = metric_of(SimpleNamespace(metric="pooled-cosine", tolerance=0.02), model, cal, str(folder))
    assert named == Metric(kind="pooled", pooling=(mode,), tolerance=0.02)
    assert metric_of(SimpleNamespace(metric="output-error", tolerance=None), model, cal, str(folder)).kind == "output"
    plain = tmp_path / "plain"  # the same model without the sentence-transformers files: the output error
    _bert().save_pretrained(plain)
    assert sentence_pooling(plain) is None and metric_of(default, model, cal, str(plain)) == Metric(kind="output")
    assert metric_of(SimpleNamespace(metric="pooled", tolerance=None), model, cal, str(plain)).pooling == ()
    assert Metric(kind="pooled").spec.modes == ("mean",)  # no pooling given: mean


def test_several_modes_concatenate_and_bad_pooling_is_refused(tmp_path):
    folder = _save(tmp_path / "st", {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True})
    assert sentence_pooling(folder) == ("cls", "mean")
    assert Metric(kind="pooled", pooling=("mean", "cls")).spec.modes == ("cls", "mean")
    with pytest.raises(ValueError, match="'sqrt' is not one the pooled-cosine metric pools"):
        Metric(kind="pooled", pooling=("sqrt",))
    with pytest.raises(ValueError, match="pools nothing"):
        Metric(kind="output", pooling=("mean",))


BAD = {
    "not-json": ("{pooling_mode_mean_tokens: true", "cannot read the sentence-transformers pooling config"),
    "unknown-mode": ({"pooling_mode_median_tokens": True}, "sets pooling_mode_median_tokens, an unknown pooling mode"),
    "unsupported-mode": ({"pooling_mode_lasttoken": True},
                         "sets pooling_mode_lasttoken, a pooling mode the pooled-cosine metric does not pool"),
    "not-a-bool": ({"pooling_mode_mean_tokens": "yes"}, "pooling_mode_mean_tokens in the sentence-transformers "
                                                        "pooling config"),
    "no-mode": ({"pooling_mode_mean_tokens": False}, "sets no pooling mode"),
    "outside": ("mean", "puts the Pooling module at '../elsewhere', outside"),
    "modules": ("mean", "is not a list of modules"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_pooling_config_is_one_line_exit_2(cli_inproc, tmp_path, case):
    from safetensors.torch import save_file

    pooling, words = BAD[case]
    modules = ([{"path": "../elsewhere", "type": "sentence_transformers.models.Pooling"}] if case == "outside" else
               {"0": "Transformer"} if case == "modules" else None)
    folder = _save(tmp_path / "st", pooling, modules)
    with pytest.raises(AuditError, match=words.replace("(", r"\(").replace(".", r"\.")):
        sentence_pooling(folder)
    calib = tmp_path / "calib.safetensors"
    save_file({**_fit(), "attention_mask": torch.ones(8, 8, dtype=torch.long)}, str(calib))
    out = tmp_path / "out"
    r = cli_inproc(folder, "--calibration", calib, "--format", "json", "-o", out, "-q", "--no-cache")
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and words in r.stderr, r.stderr
    assert not out.exists() or not any(out.iterdir())
    ok = cli_inproc(folder, "--calibration", calib, "--metric", "output-error", "--format", "json", "-o", out, "-q",
                    "--no-cache", "--no-probe")  # another metric named: the pooling is never read
    assert ok.returncode == 0, ok.stderr


def _whitened_cut(w: torch.Tensor, gram: np.ndarray, r: int) -> torch.Tensor:
    """U_r U_r^T F, U the leading eigenvectors of F S F^T (the whitened truncation the gradient costs are of)."""
    from auditor.calibration.statistics.whiten import DAMP

    f = w.detach().double().numpy()
    mm = f @ gram @ f.T
    vals, vecs = np.linalg.eigh((mm + mm.T) / 2 + DAMP * float(np.mean(np.diag(gram))) * (f @ f.T))
    u = vecs[:, np.argsort(vals)[::-1][:r]]
    return torch.tensor(u @ u.T @ f, dtype=w.dtype)


@pytest.mark.parametrize("mode", ["mean", "cls", "max"])
def test_the_embedding_gradient_predicts_the_distance_in_its_own_units(mode):
    """The gradient pass projects the unit pooled embeddings: costs that add up as they are (linear), scaled by
    1 / (2 rows), and a layer's predicted cost at a rank within a factor of two of what truncating it alone measures
    on the same rows (measured / predicted: mean 1.51-1.57, CLS 0.67-0.78, max 0.96-1.0 at ranks 10 and 12 of 16;
    mean pooling sums a row's positions, which the per-position KFAC moments miss, so it reads low:
    docs/calibration.md)."""
    from auditor.calibration import input_statistics
    from auditor.calibration.data.inputs import Calibration
    from auditor.calibration.statistics.stats import by_name
    from auditor.calibration.tiers.fisher import gradient_costs, output_gradients
    from auditor.structure.layers import ParamTable, collect_layers

    model = _bert()
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(2, VOCAB, (48, 12), generator=g)
    mask = (torch.arange(12)[None] < torch.randint(4, 13, (48, 1), generator=g)).long()
    cal = Calibration([Batch(kwargs={"input_ids": ids, "attention_mask": mask})], [])
    same = Calibration(cal.fit, cal.fit)
    name = "encoder.layer.1.output.dense"
    layer = by_name(collect_layers(model, ParamTable.of(model)))[name]
    stats = input_statistics(model, {name: layer}, cal)
    metric = Metric(kind="pooled", pooling=(mode,))
    grads = output_gradients(model, [layer], cal, metric, samples=16)
    assert grads.linear and grads.scale == pytest.approx(1.0 / (2 * 48), rel=1e-12)
    w = model.encoder.layer[1].output.dense.weight
    cost = gradient_costs(layer, w, stats.layers[name], grads)
    ev = Evaluator(model, same, metric)
    for r in (10, 12):
        other = copy.deepcopy(model)
        with torch.no_grad():
            other.encoder.layer[1].output.dense.weight.copy_(_whitened_cut(w, stats.layers[name].gram[0], r))
        measured = ev.measure(other).value
        assert 0.5 < measured / cost[r] < 2.0, (r, measured, cost[r])  # here 0.67 .. 1.57


def test_a_calibrated_audit_of_a_sentence_encoder_speaks_in_the_pooled_metric(cli_inproc, tmp_path):
    """End to end on the directory: by default and with --metric pooled-cosine --budget 0.2 the audit measures,
    verifies and reports the pooled cosine distance with the directory's pooling."""
    from safetensors.torch import save_file

    folder = _save(tmp_path / "st", "cls", width=64)  # layers of 64: some below break-even ranks to cut
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(2, VOCAB, (64, 12), generator=g)
    mask = (torch.arange(12)[None] < torch.randint(4, 13, (64, 1), generator=g)).long()
    calib = tmp_path / "calib.safetensors"
    save_file({"input_ids": ids * mask, "attention_mask": mask}, str(calib))
    label = "pooled-embedding cosine distance (cls pooling)"
    for extra in ([], ["--metric", "pooled-cosine", "--budget", "0.2"]):
        out = tmp_path / f"out{len(extra)}"
        r = cli_inproc(folder, "--calibration", calib, *extra, "--format", "text,json", "-o", out, "-q", "--no-cache")
        assert r.returncode == 0, r.stderr
        c = json.loads((out / "lowrank-audit.json").read_text())["calibration"]
        assert (c["metric"], c["higher_is_better"], c["tolerance"], c["reference"]) == (label, False, 0.01, 0.0)
        assert (c["limit"], c["display"]) == (0.01, "number")
        pc = c["plan_check"]
        v = pc["verification"]
        assert pc["ok"] and v["low"] <= pc["measured"] == v["value"] <= v["high"] <= 0.01
        assert pc["basis"].startswith("gradient-predicted single-layer cosine distances (output-gradient second")
        text = " ".join((out / "lowrank-audit.txt").read_text().split())
        assert f"metric {label}, tolerance 0.01" in text
        assert f"{label} {c['budget']['metric']:.4g} (tolerance 0.01) measured all at once on the" in text
        assert (f"predicted {pc['predicted']:.4g} (the gradient-predicted single-layer cosine distances" in text and
                f"measured {pc['measured']:.4g} on {v['rows']} verification rows the search never read" in text)
        assert "holds the tolerance 0.01" in text
    assert c["budget"]["budget"] == 0.2 and 0 < c["budget"]["removed_fraction"] <= 0.2
    assert "Plan that holds (at most 20% removed, over gradient-predicted curves" in text
