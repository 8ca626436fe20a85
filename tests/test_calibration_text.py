"""A text file as calibration for a Hugging Face directory that holds its tokenizer: a real WordPiece tokenizer
trained offline on the Python standard library's own sources, saved with a 2-layer BERT. The windows, the fit and
held-out rows, the ids (the tokenizer's own encoding), the digest, the command line, and each bad input exiting 2
with one line and no report."""

from __future__ import annotations

import json
import os
import random
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

import auditor
from auditor.calibration import load_calibration
from auditor.calibration.data.text import is_text_file, tokenizer_home
from auditor.errors import AuditError

pytest.importorskip("transformers")

POSITIONS = 64  # the model's positions: the default window
CHUNK = POSITIONS - 2  # text tokens per window beside [CLS] and [SEP]
WINDOWS = 12
LEFT = 7  # tokens after the last whole window
SYNTHETIC = "looks like token ids drawn uniformly at random"


def _stdlib_text(limit: int) -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out: list[str] = []
    size = 0
    for f in sorted(stdlib.glob("*.py")):
        out.append(f.read_text(encoding="utf-8", errors="replace"))
        size += len(out[-1])
        if size > limit:
            break
    return "".join(out)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A BERT directory (config.json, model.safetensors) with its tokenizer (tokenizer.json, tokenizer_config.json)."""
    import transformers as T
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator([_stdlib_text(200_000)], trainers.WordPieceTrainer(
        vocab_size=500, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], show_progress=False))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    fast = T.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                     sep_token="[SEP]", mask_token="[MASK]")
    folder = tmp_path_factory.mktemp("bert")
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = T.BertConfig(vocab_size=500, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=64, max_position_embeddings=POSITIONS, architectures=["BertModel"])
    T.BertModel(cfg).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer(hf_dir):
    import transformers as T

    return T.AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)


@pytest.fixture(scope="module")
def words(tokenizer) -> list[str]:
    """Whitespace-separated words of real Python source (the test's own stdlib files, in order) that the
    tokenizer encodes as exactly one token each: a text of n of them is n tokens."""
    raw = _stdlib_text(400_000).split()[::-1]  # another part of the library than the tokenizer's training text
    enc = tokenizer(raw, add_special_tokens=False)["input_ids"]
    return [w for w, ids in zip(raw, enc) if len(ids) == 1]


def _text(path: Path, words: list[str], n: int, start: int = 0) -> Path:
    path.write_text(" ".join(words[start:start + n]) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def model(hf_dir):
    from auditor.sources import load_source

    return load_source(str(hf_dir)).model


def test_windows_rows_and_ids_are_the_tokenizers_own(tmp_path, hf_dir, tokenizer, words, model):
    text = _text(tmp_path / "calib.txt", words, WINDOWS * CHUNK + LEFT)
    enc = tokenizer(text.read_text(), add_special_tokens=False)["input_ids"]
    assert len(enc) == WINDOWS * CHUNK + LEFT == 751
    cal = load_calibration(text, model, 0.25, tokenizer=hf_dir)
    assert (len(cal.fit), len(cal.holdout), cal.fit_rows, cal.holdout_rows) == (1, 1, 9, 3)  # 12 - round(3.0)
    ids = torch.cat([cal.fit[0].kwargs["input_ids"], cal.holdout[0].kwargs["input_ids"]])
    assert ids.shape == (WINDOWS, POSITIONS) and ids.dtype == torch.long
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    for i in range(WINDOWS):
        assert ids[i].tolist() == [cls, *enc[i * CHUNK:(i + 1) * CHUNK], sep]
        # each window is what the tokenizer gives for its own chunk
        assert ids[i].tolist() == tokenizer(" ".join(words[i * CHUNK:(i + 1) * CHUNK]))["input_ids"]
    mask = torch.cat([cal.fit[0].kwargs["attention_mask"], cal.holdout[0].kwargs["attention_mask"]])
    assert mask.shape == (WINDOWS, POSITIONS) and int(mask.sum()) == WINDOWS * POSITIONS
    assert cal.tokenized == (f"tokenized by {type(tokenizer).__name__} from {hf_dir}: 751 tokens, 12 windows of 64 "
                             f"(62 text tokens and 2 special), the last 7 tokens left out")
    assert cal.warnings == []
    # a shorter window and no held-out share: 751 // 14 = 53 windows of 16, all fit
    short = load_calibration(text, model, 0, tokenizer=hf_dir, length=16)
    assert (short.fit_rows, short.holdout_rows, short.fit[0].kwargs["input_ids"].shape[1]) == (53, 0, 16)
    assert short.fit[1].kwargs["input_ids"][0].tolist() == [cls, *enc[32 * 14:33 * 14], sep]  # batches of 32


def test_held_out_text_file_and_digest(tmp_path, hf_dir, tokenizer, words, model):
    fit = _text(tmp_path / "fit.txt", words, 5 * CHUNK)
    held = _text(tmp_path / "held.md", words, 3 * CHUNK + 61, start=5 * CHUNK)
    cal = load_calibration(fit, model, held, tokenizer=hf_dir)
    assert (cal.fit_rows, cal.holdout_rows) == (5, 3)
    assert cal.holdout[0].kwargs["input_ids"][0, 1:-1].tolist() == \
        tokenizer(held.read_text(), add_special_tokens=False)["input_ids"][:CHUNK]
    assert cal.tokenized.startswith("fit: tokenized by") and "; held out: tokenized by" in cal.tokenized
    # the digest is a function of the ids and the tokenizer: same text, same tokenizer -> same digest ...
    one = load_calibration(fit, model, 0.25, tokenizer=hf_dir)
    assert load_calibration(fit, model, 0.25, tokenizer=hf_dir).digest == one.digest
    # ... the same ids from a tokenizer whose files differ -> another digest
    other = tmp_path / "other"
    shutil.copytree(hf_dir, other)
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    cfg["model_max_length"] = POSITIONS
    (other / "tokenizer_config.json").write_text(json.dumps(cfg))
    two = load_calibration(fit, model, 0.25, tokenizer=other)
    assert torch.equal(two.fit[0].kwargs["input_ids"], one.fit[0].kwargs["input_ids"])
    assert two.digest != one.digest
    # and other text -> another digest
    assert load_calibration(_text(tmp_path / "b.txt", words, 5 * CHUNK, start=1), model, 0.25,
                            tokenizer=hf_dir).digest != one.digest


def test_text_rule(tmp_path):
    (tmp_path / "a.safetensors").write_text("{}")
    (tmp_path / "corpus").write_text("plain words\n")
    (tmp_path / "blob").write_bytes(b"PK\x03\x04\x00\x00binary")
    (tmp_path / "latin.dat").write_bytes("caf\xe9".encode("latin-1"))
    assert is_text_file(tmp_path / "notes.md") and is_text_file(tmp_path / "corpus")
    assert not is_text_file(tmp_path / "a.safetensors") and not is_text_file(tmp_path / "blob")
    assert not is_text_file(tmp_path / "latin.dat")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text("{}")
    assert tokenizer_home(tmp_path / "d") == tmp_path / "d" == tokenizer_home(tmp_path / "d" / "config.json")
    assert tokenizer_home("sample_models/digits.py:mlp") is None


def test_cli_audit_with_a_text_file(cli_inproc, tmp_path, hf_dir, tokenizer, words):
    text = _text(tmp_path / "calib.txt", words, WINDOWS * CHUNK + LEFT)
    out = tmp_path / "out"
    r = cli_inproc(hf_dir, "--calibration", text, "--format", "json", "-o", out, "-q", "--no-cache")
    assert r.returncode == 0, r.stderr
    c = json.loads((out / "lowrank-audit.json").read_text())["calibration"]
    assert (c["fit_rows"], c["holdout_rows"], c["holdout"]) == (9, 3, "0.25")
    assert c["source"].startswith(f"{text} (tokenized by {type(tokenizer).__name__} from {hf_dir}: 751 tokens, 12 windows")
    assert c["layers"]["encoder.layer.0.attention.self.query"]["rows"] == 9 * POSITIONS
    # real text: not synthetic; only the pooler (one [CLS] row per window: 9 < 32) has too few rows
    # and the 3 held-out windows leave 1 for the verification: no interval, a warning naming the rows that would do
    ver, pooler = c["warnings"]
    assert not c["synthetic"] and pooler.split(" saw ")[0] == "pooler.dense"
    assert pooler.startswith("pooler.dense saw 9 calibration rows, fewer than its input width 32")
    assert ver.startswith("the 1 verification rows (held out, never searched) give no interval")
    assert c["plan_check"]["verification"]["low"] is None and c["plan_check"]["verification"]["rows_needed"] == 8


def _word_level(folder: Path, specials: bool) -> Path:
    """A word-level tokenizer (every token a whole word: random words are uniformly random ids) with a BERT."""
    import transformers as T
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator([_stdlib_text(200_000)], trainers.WordLevelTrainer(
        vocab_size=500, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"], show_progress=False))
    if specials:
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    T.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(folder)
    torch.manual_seed(0)
    T.BertModel(T.BertConfig(vocab_size=500, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                             intermediate_size=64, max_position_embeddings=POSITIONS, architectures=["BertModel"])
                ).save_pretrained(folder)
    return folder


def test_synthetic_and_few_rows_warnings_still_apply(tmp_path, model):
    import transformers as T

    folder = _word_level(tmp_path / "wl", specials=True)
    vocab = [t for t, i in T.AutoTokenizer.from_pretrained(str(folder)).get_vocab().items() if i >= 4]
    assert len(vocab) == 496
    rng = random.Random(0)
    text = tmp_path / "random.txt"
    text.write_text(" ".join(rng.choice(vocab) for _ in range(14 * 30)), encoding="utf-8")
    a = auditor.audit_source(str(folder), options=auditor.AuditOptions(
        calibration=str(text), calibration_length=16, progress=False, cache=False))
    c = a.calibration
    assert (c.fit_rows, c.holdout_rows) == (22, 8)  # 30 windows of 16 (14 words + [CLS], [SEP]); round(7.5) = 8
    # the check looks at the text tokens: the [CLS]/[SEP] in every window would otherwise hide the random text
    assert c.synthetic and any(SYNTHETIC in w for w in c.warnings)
    # fewer rows than the input width is said, layer by layer: 22 x 16 = 352 lookups of a 500-row embedding, 16
    # positions (one batch of 22 windows) of 64, 22 [CLS] rows into the 32-wide pooler; the 64-wide layers see 352
    few = {w.split(" saw ")[0]: int(w.split(" saw ")[1].split()[0]) for w in c.warnings
           if "fewer than its input width" in w}
    assert few == {"embeddings.word_embeddings": 352, "embeddings.position_embeddings": 16, "pooler.dense": 22}
    assert {k: c.layers[k].rows for k in few} == few and c.layers["encoder.layer.0.output.dense"].rows == 352
    # without special tokens the windows are the encoding itself, cut in 16s
    plain = _word_level(tmp_path / "plain", specials=False)
    cal = load_calibration(text, model, 0, tokenizer=plain, length=16)
    enc = T.AutoTokenizer.from_pretrained(str(plain))(text.read_text())["input_ids"]
    ids = torch.cat([b.kwargs["input_ids"] for b in cal.fit])
    assert ids.shape == (26, 16) and ids.reshape(-1).tolist() == enc[:26 * 16]  # 420 // 16; 4 left out
    assert SYNTHETIC in cal.warnings[0]


def test_in_memory_model_takes_the_tokenizer_as_an_option(tmp_path, hf_dir, model, words):
    text = _text(tmp_path / "calib.txt", words, 200)
    with pytest.raises(AuditError, match="is text, and the audited model has no tokenizer"):
        auditor.audit(model, calibration=str(text), spectra=False, progress=False)
    # the tokenizer given as an option: 200 // 62 = 3 windows, 1 held out
    a = auditor.audit(model, calibration=str(text), tokenizer=hf_dir, spectra=False, progress=False, cache=False)
    assert (a.calibration.fit_rows, a.calibration.holdout_rows) == (2, 1)


BAD = {
    "factory": "is text, and the audited model has no tokenizer to turn it into token ids. Give token ids as a "
               "safetensors file of input_ids",
    "weights-only": "a weights-only checkpoint cannot run a forward pass",
    "no-tokenizer-files": "holds no tokenizer files (tokenizer.json, tokenizer_config.json, vocab.txt, vocab.json, "
                          "...). Add the tokenizer files",
    "empty": "calibration text {text} is empty",
    "whitespace": "calibration text {text} is only whitespace",
    "short": "calibration text {text} gives 40 tokens, fewer than one window of 64 (62 text tokens and 2 special)",
    "latin-1": "calibration text {text} is not UTF-8 (byte 0xe9 at offset 3)",
    "broken-tokenizer": "cannot load the tokenizer in {tok}: ",
    "too-long": "calibration window length 100 is longer than the 64 positions the model has",
    "length-not-text": "a calibration window length applies to a text file",
    "missing-holdout": "held-out file {text}.held does not exist. Check the path given to --holdout",
    "one-window": "calibration text {text} gives one window of 64 tokens, so nothing can be held out of it "
                  "(--holdout 0.25). Give a longer text",
    "fifo": "calibration file {text} is a FIFO (named pipe), not a file. Check the path given to --calibration",
    "folder": "calibration file {text} is a folder, not a file",
    "over-the-cap": "calibration text {text} is 1.5 KiB, more than the 1.0 KiB calibration data is capped at. Give a "
                    "smaller sample of the text, or raise the cap with --calibration-max-bytes 1G",
    "vocabulary": "gives token id {top}, but the model's largest embedding has 400 rows. Use the tokenizer the model "
                  "was trained with",
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_text_calibration_exits_2_with_one_line_and_no_report(cli_inproc, tmp_path, hf_dir, words, case):
    text = _text(tmp_path / "calib.txt", words, 3 * CHUNK)
    source, extra, tok = str(hf_dir), [], hf_dir
    if case == "factory":
        source = "sample_models/digits.py:mlp"
    elif case == "weights-only":
        source = str(hf_dir / "model.safetensors")
    elif case == "no-tokenizer-files":
        source = str(tmp_path / "bare")
        (tmp_path / "bare").mkdir()
        for name in ("config.json", "model.safetensors"):
            shutil.copy(hf_dir / name, tmp_path / "bare" / name)
    elif case == "empty":
        text.write_text("")
    elif case == "whitespace":
        text.write_text(" \n\t\n")
    elif case == "short":
        _text(text, words, 40)
    elif case == "latin-1":
        text.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    elif case == "broken-tokenizer":
        tok = tmp_path / "broken"
        shutil.copytree(hf_dir, tok)
        (tok / "tokenizer.json").write_text("{not json")
        source = str(tok)
    elif case == "vocabulary":  # the same tokenizer beside a model with a smaller vocabulary
        import transformers as T

        tok = tmp_path / "small"
        tok.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(hf_dir / name, tok / name)
        T.BertModel(T.BertConfig(vocab_size=400, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=64, max_position_embeddings=POSITIONS)).save_pretrained(tok)
        source = str(tok)
    elif case == "too-long":
        extra = ["--calibration-length", "100"]
    elif case == "missing-holdout":
        extra = ["--holdout", f"{text}.held"]
    elif case == "one-window":
        _text(text, words, CHUNK + 5)  # one window and 5 tokens: 0.25 of it cannot be held out
    elif case in ("fifo", "folder"):
        text.unlink()
        os.mkfifo(text) if case == "fifo" else text.mkdir()
    elif case == "over-the-cap":
        text.write_text("x" * 1536)
        extra = ["--calibration-max-bytes", "1K"]
    else:
        from safetensors.torch import save_file

        text = tmp_path / "ids.safetensors"
        save_file({"input_ids": torch.zeros(4, 8, dtype=torch.long)}, str(text))
        extra = ["--calibration-length", "16"]
    out = tmp_path / "out"
    r = cli_inproc(source, "--calibration", text, *extra, "--format", "json,md", "-o", out, "-q", "--no-cache")
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: "), r.stderr
    top = int(load_calibration(text, None, 0, tokenizer=hf_dir, length=POSITIONS).fit[0].args[0].max()) \
        if case == "vocabulary" else None
    assert BAD[case].format(text=text, tok=tok, top=top) in r.stderr, r.stderr
    assert not out.exists() or not any(out.iterdir())


def test_factorize_takes_a_text_file(cli_inproc, tmp_path, hf_dir, words):
    """`lowrank-audit factorize` tokenizes a text calibration file like the audit: whitened init, plan measured."""
    text = _text(tmp_path / "calib.txt", words, WINDOWS * CHUNK + LEFT)
    plan = tmp_path / "plan.toml"
    plan.write_text('[ranks]\n"encoder.layer.*.intermediate.dense" = 8\n')
    out = tmp_path / "fact"
    r = cli_inproc("factorize", hf_dir, "--plan", plan, "--calibration", text, "-o", out, "--no-cache")
    assert r.returncode == 0, r.stderr
    meta = json.loads((out / "plan.json").read_text())
    assert meta["init"] == "whitened"
    assert meta["plan"] == {"encoder.layer.0.intermediate.dense": 8, "encoder.layer.1.intermediate.dense": 8}
    # two 64 x 32 Linears (2,048 weights each) become 8 * (64 + 32) = 768 each
    assert meta["params_before"] - meta["params"] == 2 * (64 * 32 - 8 * (64 + 32))
    r = cli_inproc("factorize", hf_dir, "--plan", plan, "--calibration-length", "16", "-o", tmp_path / "f2")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--calibration-length needs --calibration" in r.stderr
