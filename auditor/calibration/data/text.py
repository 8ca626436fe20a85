"""Calibration from a text file: tokenized with the audited Hugging Face directory's own tokenizer, offline.

Which files are text (:func:`is_text_file`): a name ending ``.txt``, ``.text``, ``.md``, ``.rst`` or ``.py`` always
(it must then be UTF-8); any other file not ending ``.safetensors``, ``.pt``, ``.pth`` or ``.bin`` when its bytes
decode as UTF-8 and hold no NUL byte. Everything else is read as tensors (:mod:`auditor.calibration.data.inputs`).

The text is encoded once without special tokens and cut into windows of a fixed length (default: the model's
positions, at most 512): each window is ``prefix + chunk + suffix``, where prefix and suffix are the special tokens the
tokenizer adds around one sequence (``[CLS]``/``[SEP]`` for BERT, none for GPT-2), so every window is what the
tokenizer itself gives for its chunk. The tokens after the last whole window are left out (padding them would put pad
positions into the input statistics). ``attention_mask`` (all ones) goes with ``input_ids`` when the forward takes it.
"""

from __future__ import annotations

import codecs
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ... import kinds
from ...errors import AuditError, first_line
from ...options import CALIBRATION_MAX_BYTES as MAX_BYTES
from .documents import runs, split_text  # a text file larger than this is refused (unless raised)

TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst", ".py")
TENSOR_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")
# what AutoTokenizer reads from a directory; any one of them means "a tokenizer is here"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "merges.txt",
                   "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "special_tokens_map.json",
                   "added_tokens.json")
MAX_WINDOW = 512  # the default window is the model's positions, capped here
SNIFF_BYTES = 1 << 16
NO_TOKENIZER_FIX = ("Give token ids as a safetensors file of input_ids (batched along dim 0), or audit a Hugging Face "
                    "directory that holds its tokenizer files")


@dataclass(frozen=True)
class TextInputs:
    """A text file as windows of token ids: the named tensors, the tokenizer's identity (a SHA-256 of its class and
    files, part of the calibration's digest) and a one-line description for the report."""

    tensors: dict[str, torch.Tensor]
    tokenizer_digest: str
    description: str
    tokens: int  # text tokens the file gave (no special tokens)
    window: int  # tokens per window, special tokens included
    specials: tuple[int, int] = (0, 0)  # special tokens before and after each window's text
    documents: tuple[int, ...] | None = None  # each window's document (a directory's files, separated pieces)
    unit: str = "documents"  # what a document is: "files" for a directory's, else "documents"

    def text_ids(self) -> torch.Tensor:
        """The windows' text tokens, without the special ones (what the synthetic-input check looks at: the same
        [CLS] at every window's start would hide uniformly random text)."""
        before, after = self.specials
        return self.tensors["input_ids"][:, before:self.window - after]


def is_text_file(path: Path) -> bool:
    """Whether a calibration file is text (the rule is in the module docstring)."""
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        return True
    if suffix in TENSOR_SUFFIXES or not path.is_file():
        return False
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with path.open("rb") as f:
            head = f.read(SNIFF_BYTES)
        decoder.decode(head, final=len(head) < SNIFF_BYTES)
    except (OSError, UnicodeDecodeError):
        return False
    return b"\0" not in head


def text_files(directory: Path) -> list[Path]:
    """The text files in ``directory`` (not recursing), in name order; one-line errors for none and for one."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and not p.name.startswith(".") and is_text_file(p))
    if len(files) < 2:
        raise AuditError(f"calibration directory {directory} holds {'one text file' if files else 'no text files'}, "
                         "and a directory of text files is read as one document per file",
                         "Give a directory of two or more text files, or the one file itself")
    return files


def is_text_source(source: object) -> bool:
    """Whether a calibration source (a path, ``file.py:fn``, tensors, batches) is a text file."""
    if not isinstance(source, (str, Path)):
        return False
    path = Path(source)
    if ":" in path.name and not path.exists():
        return False  # file.py:fn / module:fn
    if path.is_dir():  # a directory of text files: one document per file (data/documents.py)
        return any(p.is_file() and is_text_file(p) for p in path.iterdir())
    return is_text_file(path)


def check_text_sources(sources: list[object], tokenizer: str | Path | None,
                       max_bytes: int | None = MAX_BYTES) -> None:
    """The checks on text calibration files that need no model (the file is a readable regular file no larger than
    ``max_bytes``, None: no cap; it is UTF-8 and not empty; there are tokenizer files), run before an audit's slow
    stages so bad text fails at once; the rest come with :func:`text_inputs`."""
    from ...errors import describe_missing

    for i, source in enumerate(sources):
        if is_text_source(source):
            path = Path(source)
            what, flag = ("calibration", "--calibration") if i == 0 else ("held-out", "--holdout")
            problem = None if path.is_dir() else describe_missing(path)
            if problem:
                raise AuditError(f"{what} file {path} {problem}", f"Check the path given to {flag}")
            if tokenizer is None:
                raise AuditError(f"calibration file {path} is text, and the audited model has no tokenizer to turn "
                                 "it into token ids", NO_TOKENIZER_FIX)
            for f in (text_files(path) if path.is_dir() else [path]):
                read_text(f, max_bytes)
            if not tokenizer_files(Path(tokenizer)):
                load_tokenizer(Path(tokenizer))  # raises: no tokenizer files


def tokenizer_home(source: str | Path) -> Path | None:
    """The directory a Hugging Face source's tokenizer would sit in: the directory itself when it holds
    ``config.json``, or the folder of a ``config.json`` given alone; None for any other source."""
    path = Path(source)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.suffix == ".json" and path.is_file():
        return path.parent
    return None


def tokenizer_files(directory: Path) -> list[Path]:
    """The tokenizer files in ``directory``, in a fixed order."""
    return [directory / n for n in TOKENIZER_FILES if (directory / n).is_file()]


def read_text(path: Path, max_bytes: int | None = None) -> str:
    """The file's text (UTF-8, a byte-order mark dropped); one-line errors for a non-UTF-8 or empty file, and for one
    larger than ``max_bytes`` (checked before a byte is read)."""
    if max_bytes is not None:
        from ...errors import size_text

        size = path.stat().st_size
        if size > max_bytes:
            raise AuditError(f"calibration text {path} is {size_text(size)}, more than the {size_text(max_bytes)} "
                             "calibration data is capped at", "Give a smaller sample of the text, or raise the cap "
                             f"with --calibration-max-bytes {-(-size // (1 << 30))}G")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        raise AuditError(f"calibration text {path} is not UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start})",
                         "Convert it to UTF-8, e.g. iconv -t utf-8") from None
    if not text.strip():
        raise AuditError(f"calibration text {path} is {'empty' if not text else 'only whitespace'}",
                         "Give a text file with the kind of text the model reads")
    return text


def load_tokenizer(directory: Path) -> tuple[Any, str]:
    """The tokenizer in ``directory`` (``AutoTokenizer``, offline, local files only, no remote code) and its
    identity: a SHA-256 of its class name and the bytes of its files."""
    files = tokenizer_files(directory)
    if not files:
        raise AuditError(f"the calibration file is text, but {directory} holds no tokenizer files "
                         f"({', '.join(TOKENIZER_FILES[:4])}, ...)",
                         "Add the tokenizer files (tokenizer.save_pretrained(DIR)), or give token ids as a "
                         "safetensors file of input_ids")
    from ...sources.hf import offline
    from ...sources.factory import stdout_to_stderr

    try:
        import transformers
    except ImportError:
        raise AuditError("a text calibration file needs transformers to load its tokenizer, and it is not installed",
                         "pip install transformers, or give token ids as a safetensors file of input_ids") from None
    with offline(), stdout_to_stderr():
        try:
            tok = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True,
                                                             trust_remote_code=False)
        except Exception as exc:  # noqa: BLE001 - any failure to build it is the directory's
            raise AuditError(f"cannot load the tokenizer in {directory}: {first_line(exc)}",
                             "Save it with tokenizer.save_pretrained(DIR), or give token ids as a safetensors file "
                             "of input_ids") from None
    h = hashlib.sha256(f"{type(tok).__name__};".encode())
    for f in files:
        h.update(f"{f.name}:{f.stat().st_size};".encode())
        h.update(f.read_bytes())
    return tok, h.hexdigest()


def _specials(tok: Any) -> tuple[list[int], list[int]]:
    """The special token ids the tokenizer puts before and after one sequence, found by encoding a probe with and
    without them."""
    for probe in ("a", "the", "0"):
        plain = list(tok(probe, add_special_tokens=False)["input_ids"])
        full = list(tok(probe, add_special_tokens=True)["input_ids"])
        if not plain:
            continue
        for i in range(len(full) - len(plain) + 1):
            if full[i:i + len(plain)] == plain:
                return full[:i], full[i + len(plain):]
    return [], []


def model_positions(model: nn.Module | None) -> int | None:
    """The positions a Hugging Face model has (``max_position_embeddings``, ``n_positions``, ...), if it says."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    from ...sources.hf import max_positions

    return max_positions(config)


def window_length(model: nn.Module | None, tok: Any, length: int | None) -> int:
    """``length`` checked against the model's positions, or the default: the positions (else the tokenizer's
    ``model_max_length`` when it is a real limit), at most 512."""
    positions = model_positions(model)
    if length is not None:
        if length < 1:
            raise AuditError(f"calibration window length {length} is not positive", "Give e.g. --calibration-length 128")
        if positions is not None and length > positions:
            raise AuditError(f"calibration window length {length} is longer than the {positions} positions the "
                             "model has", f"Give --calibration-length {min(positions, MAX_WINDOW)} or less")
        return length
    limit = getattr(tok, "model_max_length", None)
    known = positions or (int(limit) if isinstance(limit, int) and 0 < limit < 1_000_000 else None)
    return min(known or MAX_WINDOW, MAX_WINDOW)


def model_vocab(model: nn.Module | None) -> int | None:
    """The model's vocabulary: its largest embedding table's rows (None without a model or an embedding); read by
    the text windows, by the token checks of every calibration source (inputs.py) and by the causal-LM test
    (measure/metric.py)."""
    return None if model is None else max(kinds.embedding_sizes(model), default=None)


PIECE = 1 << 20  # characters tokenized at once: a 20 MB single-line text is not tokenized whole


def token_ids(tok: Any, text: str, need: int | None = None) -> list[int]:
    """``text``'s token ids, tokenized :data:`PIECE` characters at a time (each piece ending before a space where
    one is near, so a word is not split), stopping once ``need`` ids are had: the tokenizer's memory is bounded
    by a piece, not the text. A text within one piece gives the ids of one call."""
    ids: list[int] = []
    start = 0
    while start < len(text) and (need is None or len(ids) < need):
        end = min(len(text), start + PIECE)
        if end < len(text):
            cut = text.rfind(" ", start + PIECE // 2, end)
            end = cut if cut > start else end
        ids += tok(text[start:end], add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
        start = end
    return ids


def _texts(path: Path, max_bytes: int | None, separator: str | None) -> tuple[list[str], str]:
    """The documents a text source holds, and what they are: a directory's files, a file's pieces between
    ``separator``s, or the file whole (one text, unit "")."""
    if path.is_dir():
        return [read_text(f, max_bytes) for f in text_files(path)], "files"
    text = read_text(path, max_bytes)
    if separator is None:
        return [text], ""
    return split_text(text, separator, str(path)), "documents"


def _chunks(tok: Any, texts: list[str], chunk: int, max_rows: int | None, what: str,
            window: int) -> tuple[list[int], list[int], int, int]:
    """Each text's ids cut into chunks of ``chunk`` on its own: (the chunks' ids, each chunk's text, tokens in all,
    tokens left over); one line when they pass ``max_rows`` chunks (found without tokenizing the rest)."""
    bodies: list[int] = []
    docs: list[int] = []
    tokens = left = 0
    for d, text in enumerate(texts):
        ids = token_ids(tok, text, None if max_rows is None else (max_rows + 1 - len(docs)) * chunk)
        if max_rows is not None and len(docs) + len(ids) // chunk > max_rows:
            raise AuditError(f"{what} gives more than {max_rows:,} windows of {window} tokens, the cap (tokenizing "
                             "stopped there)", "Give a smaller sample of the text, or raise the cap with "
                             f"--calibration-max-rows {2 * max_rows}")
        n = len(ids) // chunk
        bodies += ids[:n * chunk]
        docs += [d] * n
        tokens += len(ids)
        left += len(ids) - n * chunk
    return bodies, docs, tokens, left


def text_inputs(path: Path, tokenizer: str | Path | None, model: nn.Module | None, length: int | None = None,
                attention_mask: bool = True, max_bytes: int | None = None,
                max_rows: int | None = None, separator: str | None = None) -> TextInputs:
    """A text file tokenized with the tokenizer in the directory ``tokenizer`` and cut into windows: ``input_ids``
    (windows x length, int64), with ``attention_mask`` (ones) when ``attention_mask``. One-line
    :class:`AuditError` for: no tokenizer, a file that is not UTF-8, an empty or whitespace-only text, a tokenizer
    that does not load, a text shorter than one window, and one giving more than ``max_rows`` windows (found
    without tokenizing the rest: :func:`token_ids`). A directory of text files, or a file cut at ``separator``,
    is several documents (:mod:`~auditor.calibration.data.documents`): each is windowed on its own, a document
    shorter than one window left out, and ``documents`` says each window's."""
    check_text_sources([path], tokenizer, max_bytes)
    texts, unit = _texts(path, max_bytes, separator)
    tok, identity = load_tokenizer(Path(tokenizer))
    window = window_length(model, tok, length)
    before, after = _specials(tok)
    chunk = window - len(before) - len(after)
    if chunk < 1:
        raise AuditError(f"a calibration window of {window} tokens leaves no room for text beside the tokenizer's "
                         f"{len(before) + len(after)} special tokens", "Give a longer --calibration-length")
    bodies, docs, tokens, left = _chunks(tok, texts, chunk, max_rows, f"calibration text {path}", window)
    count = len(docs)
    specials = f" ({chunk} text tokens and {len(before) + len(after)} special)" if before or after else ""
    if count == 0:
        raise AuditError(f"calibration text {path} gives {tokens} tokens, fewer than one window of {window}"
                         f"{specials}", "Give a longer text, or a shorter window with --calibration-length N")
    if unit and len(set(docs)) < 2:
        raise AuditError(f"calibration text {path} gives whole windows of {window} tokens in one of its "
                         f"{len(texts)} {unit} only, so none can be held out whole",
                         "Give longer documents, or a shorter window with --calibration-length N")
    body = torch.tensor(bodies, dtype=torch.long).reshape(count, chunk)
    parts = [torch.tensor(before, dtype=torch.long).expand(count, -1), body,
             torch.tensor(after, dtype=torch.long).expand(count, -1)]
    input_ids = torch.cat(parts, dim=1).contiguous()
    vocab = model_vocab(model)
    top = int(input_ids.max())
    if vocab is not None and top >= vocab:
        raise AuditError(f"the tokenizer in {tokenizer} gives token id {top}, but the model's largest embedding has "
                         f"{vocab} rows", "Use the tokenizer the model was trained with")
    tensors = {"input_ids": input_ids}
    if attention_mask:
        tensors["attention_mask"] = torch.ones_like(input_ids)
    whole = len(set(docs))
    kept = f" in {whole} {unit}" + (f" ({len(texts) - whole} shorter than a window left out)"
                                    if whole < len(texts) else "") if unit else ""
    cut = f"{left} tokens at the documents' ends left out" if unit else f"the last {left} tokens left out"
    description = (f"tokenized by {type(tok).__name__} from {tokenizer}: {tokens:,} tokens, {count} windows of "
                   f"{window}{specials}{kept}" + (f", {cut}" if left else ""))
    return TextInputs(tensors, identity, description, tokens, window, (len(before), len(after)),
                      tuple(runs(docs)) if unit else None, unit or "documents")
