"""The interval for a document the tool never read (issue 38, item 3): which rows are one document (a ``document``
tensor, a directory of text files, a text separator), the fit/held-out and search/verification lines on document
boundaries, the block length chosen from the data, the seeded draws, the verification judged on the unseen
interval's upper end, and each bad input exiting 2 with one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from auditor.calibration.data.documents import document_cut, pop_documents, runs, split_text
from auditor.calibration.data.inputs import Batch, load_calibration
from auditor.calibration.measure.resample import (autocorrelation, block_draws, block_length, document_draws,
                                                  percentile_interval, row_draws)
from auditor.calibration.measure.verify import Documents, Verifier, split_rows, unseen_interval
from auditor.calresults import UnseenInterval, Verification
from auditor.errors import AuditError

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ROOT / "sample_models" / "llama"


# --- which rows are one document ----------------------------------------------------------------------------------

def test_runs_and_the_cut_on_a_document_boundary():
    assert runs([7, 7, 3, 3, 3, 9]) == [0, 0, 1, 1, 1, 2]
    ids = [0, 0, 1, 1, 1, 2, 3, 3]  # boundaries at rows 2, 5, 6
    assert document_cut(ids, 0.25) == 6  # the last 2 rows: document 3 whole
    assert document_cut(ids, 0.5) == 5  # 4 wanted: row 5 is 1 away, row 2 is 2 away
    assert document_cut(ids, 0.0) == 8  # nothing held out
    assert document_cut([0, 0, 1, 1], 0.5) == 2
    assert document_cut([0, 1, 1, 1, 1, 1, 1, 1], 0.25) == 1  # the only boundary
    assert document_cut([0, 0, 0, 1, 1, 1], 0.25) == 3  # a tie goes nowhere else: one boundary


def test_document_tensor_taken_out_and_checked():
    named = {"input": torch.zeros(6, 3), "document": torch.tensor([4, 4, 4, 2, 2, 8])}
    assert pop_documents(named, "c.safetensors") == [0, 0, 0, 1, 1, 2]
    assert list(named) == ["input"]  # never given to the forward
    assert pop_documents({"input": torch.zeros(2, 3)}, "c") is None


@pytest.mark.parametrize("doc, message", [
    (torch.tensor([0.0, 0, 1, 1]), "the document tensor in c.safetensors is float32, not integer ids"),
    (torch.tensor([True, True, False, False]), "the document tensor in c.safetensors is bool, not integer ids"),
    (torch.tensor([0, 0, 1]), "the document tensor in c.safetensors has shape 3, not one id for each of 4 rows"),
    (torch.zeros(4, 2, dtype=torch.long), "the document tensor in c.safetensors has shape 4x2, not one id for each "
                                          "of 4 rows"),
    (torch.tensor([5, 5, 5, 5]), "the document tensor in c.safetensors names one document only, so none can be "
                                 "held out whole"),
    (torch.tensor([0, 1, 0, 1]), "the document tensor in c.safetensors gives some document's rows in two or more "
                                 "places"),
])
def test_bad_document_tensor(doc, message):
    with pytest.raises(AuditError) as e:
        pop_documents({"input": torch.zeros(4, 3), "document": doc}, "c.safetensors")
    assert e.value.what == message


def test_separator_pieces_and_bad_separators():
    assert split_text("a\n---\nb\n---\n  \n---\nc", "\n---\n", "t.txt") == ["a", "b", "c"]  # blank pieces dropped
    with pytest.raises(AuditError) as e:
        split_text("a b c", "@@", "t.txt")
    assert e.value.what == "calibration text t.txt never contains the document separator '@@'"
    with pytest.raises(AuditError, match="gives one document only between the separators"):
        split_text("a b c@@   ", "@@", "t.txt")
    with pytest.raises(AuditError, match="the document separator is empty"):
        split_text("a b c", "", "t.txt")


def test_held_out_rows_are_whole_documents(tmp_path):
    from safetensors.torch import save_file

    doc = torch.tensor([0] * 10 + [1] * 7 + [2] * 9 + [3] * 6 + [4] * 8)  # 40 rows, boundaries 10, 17, 26, 32
    save_file({"input": torch.randn(40, 4), "document": doc}, str(tmp_path / "c.safetensors"))
    cal = load_calibration(tmp_path / "c.safetensors", None, 0.25)
    assert (cal.fit_rows, cal.holdout_rows) == (32, 8)  # 30 wanted: row 32 is the nearest boundary
    assert cal.held_documents == (0,) * 8
    cal = load_calibration(tmp_path / "c.safetensors", None, 0.4)  # 24 wanted: 26
    assert (cal.fit_rows, cal.held_documents) == (26, (0,) * 6 + (1,) * 8)
    # the search and verification parts of those 14 held-out rows: cut on the boundary at 6
    search, verify = split_rows(cal.holdout, 0.5, cal.held_documents)
    assert (sum(b.rows for b in search), sum(b.rows for b in verify)) == (6, 8)
    # without documents the same file is cut by rows, as before (and the digest differs)
    save_file({"input": torch.randn(40, 4)}, str(tmp_path / "plain.safetensors"))
    plain = load_calibration(tmp_path / "plain.safetensors", None, 0.25)
    assert (plain.fit_rows, plain.held_documents) == (30, None)


def test_held_out_second_file_keeps_its_documents(tmp_path):
    from safetensors.torch import save_file

    save_file({"input": torch.randn(12, 4)}, str(tmp_path / "fit.safetensors"))
    save_file({"input": torch.randn(9, 4), "document": torch.tensor([3, 3, 3, 1, 1, 1, 1, 2, 2])},
              str(tmp_path / "held.safetensors"))
    cal = load_calibration(tmp_path / "fit.safetensors", None, str(tmp_path / "held.safetensors"))
    assert (cal.fit_rows, cal.holdout_rows) == (12, 9)
    assert cal.held_documents == (0, 0, 0, 1, 1, 1, 1, 2, 2)


# --- the draws ----------------------------------------------------------------------------------------------------

def test_block_length_from_the_autocorrelation():
    runs16 = np.array(([1.0] * 16 + [0.0] * 16) * 2)  # n = 64: autocorrelation (64 - 7k) / 64 at lag k <= 16
    assert autocorrelation(runs16, 6) == 22 / 64 and autocorrelation(runs16, 7) == 15 / 64
    assert block_length(runs16) == 7  # the first lag below 2 / sqrt(64) = 0.25
    assert block_length(np.zeros(64)) == 4  # a constant: ceil(64^(1/3)) = 4
    assert block_length(np.array([1.0, 0.0] * 32)) == 16  # alternating: every lag alike, capped at 64 // 4
    assert block_length(np.array([1.0, 2.0])) == 1  # too few rows for blocks
    assert block_length(np.array([1.0, 1.0, 0.0, 0.0] * 16)) == 4  # no memory past lag 1: the rule of thumb


def test_block_draws_are_contiguous_runs():
    draws = block_draws(10, 4, 50, 0)
    starts = np.random.default_rng(0).integers(0, 7, size=(50, 3))
    assert len(draws) == 50 and all(len(d) == 10 for d in draws)
    for d, s in zip(draws, starts):
        assert d.tolist() == [x + j for x in s for j in range(4)][:10]


def test_document_draws_take_whole_documents():
    ids = np.array([0, 0, 0, 1, 2, 2])
    draws = document_draws(ids, 20, 0)
    picks = np.random.default_rng(0).integers(0, 3, size=(20, 3))
    members = {0: [0, 1, 2], 1: [3], 2: [4, 5]}
    for d, p in zip(draws, picks):
        assert d.tolist() == [r for k in p for r in members[k]]


def test_seeded_intervals_on_fixed_values_are_exact():
    """Two documents of 10 rows, every row of one worth 1 and of the other 3, the metric their mean (2): a draw of
    documents is worth 1, 2 or 3 with chances 1/4, 1/2, 1/4, and the difference of two draws -2 or +2 with 1/16
    each, more than the 5% in each tail: the 90% interval for unseen text is exactly 2 - 2 to 2 + 2."""
    values = np.array([1.0] * 10 + [3.0] * 10)

    def mean(idx: np.ndarray) -> float:
        return float(values[idx].mean())

    u = unseen_interval(mean, 20, 2.0, 0.9, Documents(np.repeat([0, 1], 10), "files", "windows"))
    assert u == UnseenInterval(0.0, 4.0, "documents", 2, "files", 0)
    assert u.label == "documents: 2 files"
    rows = percentile_interval(np.array([mean(d) for d in row_draws(20, 2000, 0)]), 0.9, 2.0)
    assert 1.4 < rows[0] < 1.7 and 2.3 < rows[1] < 2.6  # the row interval: far narrower
    # the same values with no documents named: the autocorrelation at lag k is (20 - 3k) / 20, first below
    # 2 / sqrt(20) = 0.447 at k = 4 (0.4): blocks of 4 rows, 5 to a draw
    b = unseen_interval(mean, 20, 2.0, 0.9, Documents(None, "files", "windows"))
    assert (b.kind, b.block, b.groups, b.label) == ("blocks", 4, 5, "block bootstrap, blocks of 4 windows")
    assert b.low < rows[0] and b.high > rows[1]


class _Mean:
    """A row scorer whose metric is the mean of fixed per-row values."""

    baseline = None
    last_top1 = None

    def __init__(self, values: np.ndarray) -> None:
        self.values = values

    def value(self, sums, idx=slice(None)) -> float:
        return float(sums[0][idx].mean())


def _verifier(tol: float, documents: Documents | None) -> Verifier:
    from auditor.calibration.measure.metric import Metric

    v = Verifier.__new__(Verifier)
    v.metric, v.confidence, v.documents, v.unseen, v.rows = Metric(tolerance=tol), 0.9, documents, True, 20
    v._rows, v._at_once = _Mean(np.zeros(0)), None
    return v


def test_the_plan_is_judged_on_the_unseen_intervals_upper_end():
    sums = (np.array([1.0] * 10 + [3.0] * 10),)
    docs = Documents(np.repeat([0, 1], 10), "files", "windows")
    v = _verifier(2.6, docs).judge(sums)  # the row interval ends below 2.6; the unseen one at 4
    assert v.high < 2.6 and v.unseen.high == 4.0
    assert (v.ok, v.straddles, v.judged) == (False, True, "straddles the tolerance")
    assert v.words(2.6, "m") == (f"m 2 (90% interval {v.low:.4g} to {v.high:.4g} over 20 verification rows; for an "
                                 "unseen document 0 to 4, documents: 2 files): straddles the tolerance 2.6")
    held = _verifier(4.5, docs).judge(sums)
    assert (held.ok, held.straddles) == (True, False)
    ahead = _verifier(-0.5, docs).judge(sums)  # the lower end past the tolerance: a miss
    assert (ahead.ok, ahead.straddles, ahead.judged) == (False, False, "misses the tolerance")


def test_staged_verifiers_draw_no_unseen_interval():
    v = _verifier(2.6, None)
    v.unseen = False
    got = v.judge((np.array([1.0] * 10 + [3.0] * 10),))
    assert got.unseen is None and got.ok == (got.high <= 2.6)


def test_json_names_the_interval():
    from auditor.calresults import report_dict

    v = Verification(1.0, 0.9, 1.1, 0.9, 20, True, False, unseen=UnseenInterval(0.8, 1.2, "blocks", 3, "windows", 8))
    assert report_dict(v)["unseen"] == {"low": 0.8, "high": 1.2, "kind": "blocks", "groups": 3, "unit": "windows",
                                        "block": 8, "label": "block bootstrap, blocks of 8 windows"}


# --- text: a directory of files, a separator ----------------------------------------------------------------------

def _tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(LLAMA), local_files_only=True)


def _stdlib(n: int) -> list[str]:
    import sysconfig

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    return [f.read_text(encoding="utf-8", errors="replace")[:3000] for f in files[:n]]


def _expected(tok, texts: list[str], length: int) -> list[int]:
    before = len(tok("a", add_special_tokens=True)["input_ids"]) - len(tok("a", add_special_tokens=False)["input_ids"])
    chunk = length - before
    out: list[int] = []
    for d, t in enumerate(texts):
        out += [d] * (len(tok(t, add_special_tokens=False)["input_ids"]) // chunk)
    return out


def test_a_directory_of_text_files_is_one_document_per_file(tmp_path):
    tok = _tokenizer()
    texts = _stdlib(6)
    folder = tmp_path / "docs"
    folder.mkdir()
    for i, t in enumerate(texts):
        (folder / f"{i:02d}.py").write_text(t, encoding="utf-8")
    (folder / "weights.safetensors").write_bytes(b"\0" * 8)  # not text: not a document
    cal = load_calibration(folder, None, 0.25, tokenizer=LLAMA, length=32)
    ids = _expected(tok, texts, 32)
    assert cal.documents == tuple(ids) and cal.document_unit == "files"
    assert cal.fit_rows == document_cut(ids, 0.25)
    assert f"in 6 files" in cal.tokenized and "tokens at the documents' ends left out" in cal.tokenized
    # each window is the file's own tokens: the first window of file 2 starts with its first tokens
    first = ids.index(2)
    rows = torch.cat([b.args[0] for b in cal.fit + cal.holdout])  # no model: the one input, positional
    assert rows[first, -5:].tolist() == tok(texts[2], add_special_tokens=False)["input_ids"][27:32]


def test_a_separator_cuts_one_text_into_documents(tmp_path):
    tok = _tokenizer()
    texts = _stdlib(4)
    path = tmp_path / "all.txt"
    path.write_text("\n<|doc|>\n".join(texts), encoding="utf-8")
    cal = load_calibration(path, None, 0.25, tokenizer=LLAMA, length=32, separator="\n<|doc|>\n")
    assert cal.documents == tuple(_expected(tok, texts, 32)) and cal.document_unit == "documents"
    with pytest.raises(AuditError, match="never contains the document separator '@@@'"):
        load_calibration(path, None, 0.25, tokenizer=LLAMA, length=32, separator="@@@")


def test_a_directory_of_one_file_is_refused(tmp_path):
    folder = tmp_path / "one"
    folder.mkdir()
    (folder / "a.txt").write_text("some text " * 50, encoding="utf-8")
    with pytest.raises(AuditError, match="holds one text file, and a directory of text files is read as one document "
                                         "per file"):
        load_calibration(folder, None, 0.25, tokenizer=LLAMA, length=32)


def test_separator_on_a_tensor_file_is_refused(tmp_path):
    from safetensors.torch import save_file

    save_file({"input": torch.randn(8, 4)}, str(tmp_path / "c.safetensors"))
    with pytest.raises(AuditError, match="a calibration document separator applies to a text file"):
        load_calibration(tmp_path / "c.safetensors", None, 0.25, separator="\n\n")


# --- the command line ---------------------------------------------------------------------------------------------

def test_cli_bad_documents_exit_2_with_one_line(cli_inproc, tmp_path):
    pytest.importorskip("transformers")
    text = tmp_path / "calib.txt"
    text.write_text("word " * 2000, encoding="utf-8")
    out = tmp_path / "out"
    r = cli_inproc(LLAMA, "--calibration", text, "--document-separator", r"\n\n\n", "--format", "json", "-o", out,
                   "--no-cache")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"error: calibration text {text} never contains the document separator '\\n\\n\\n'. Give the text that "
        "stands between its documents, or drop --document-separator."]
    assert not out.exists() or not any(out.iterdir())
    r = cli_inproc(LLAMA, "--document-separator", "x")
    assert r.returncode == 2 and "--document-separator need(s) calibration data" in r.stderr


def test_cli_document_tensor_of_the_wrong_length_exits_2(cli_inproc, tmp_path):
    from safetensors.torch import load_file, save_file

    named = load_file(str(ROOT / "sample_models" / "chargpt_holdout.safetensors"))
    named["document"] = torch.arange(10)
    save_file(named, str(tmp_path / "held.safetensors"))
    r = cli_inproc("sample_models/chargpt.py:chargpt", "--calibration", "sample_models/chargpt_calib.safetensors",
                   "--holdout", tmp_path / "held.safetensors", "--format", "json", "-o", tmp_path / "out",
                   "--no-cache")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "has shape 10, not one id for each of 256 rows" in lines[0], r.stderr
