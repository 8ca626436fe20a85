"""Picklable references to weight tensors: where the bytes are and how to view them as matrices.

A :class:`TensorRef` names a tensor inside a safetensors file by its absolute byte range (taken from the file's
header, parsed once per file), or carries an in-memory tensor (a module's parameter). Either way it also carries the
matrix view (kind, m, n, groups), so a worker in another process or on another machine can open the file itself,
read exactly that range through memory mapping, and compute the spectrum with nothing else to hand.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import AuditError, first_line, no_duplicate_keys

# safetensors dtype code -> (torch dtype name, bits per element). Names torch lacks still get a byte size, so the
# header can be checked and the tensor skipped with a reason instead of refused.
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 64), "F32": ("float32", 32), "F16": ("float16", 16), "BF16": ("bfloat16", 16),
    "I64": ("int64", 64), "I32": ("int32", 32), "I16": ("int16", 16), "I8": ("int8", 8),
    "U64": ("uint64", 64), "U32": ("uint32", 32), "U16": ("uint16", 16), "U8": ("uint8", 8),
    "BOOL": ("bool", 8), "F8_E4M3": ("float8_e4m3fn", 8), "F8_E5M2": ("float8_e5m2", 8),
    "F8_E8M0": ("float8_e8m0fnu", 8), "C64": ("complex64", 64), "C128": ("complex128", 128),
    "F4": ("float4_e2m1fn_x2", 4), "F6_E2M3": ("float6_e2m3", 6), "F6_E3M2": ("float6_e3m2", 6),
}
MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path: str) -> bool:
    """Whether ``path`` is a URL (``scheme://...``), read through fsspec, rather than a local path.

    >>> is_url("s3://bucket/model.safetensors"), is_url("file:///mnt/x"), is_url("/mnt/x"), is_url("C:/x")
    (True, True, False, False)
    """
    return bool(_URL.match(path))


@dataclass(frozen=True, eq=False)
class TensorRef:
    """A weight tensor and its matrix view, by file location or in memory. Pickles small for file references.

    ``path``/``offset``/``nbytes``: the safetensors file and the absolute byte range of the tensor's data in it
    (``path`` None: the tensor is ``data``). ``kind``, ``m``, ``n``, ``groups``: the matrix view (see
    :func:`auditor.structure.layers.matrix_view`). ``dtype`` is torch's name ("float32", "bfloat16"); ``device`` and
    ``layout`` describe an in-memory tensor ("cpu", "strided")."""

    tensor: str
    shape: tuple[int, ...]
    dtype: str
    kind: str
    m: int
    n: int
    groups: int = 1
    path: str | None = None
    offset: int = 0
    nbytes: int = 0
    data: torch.Tensor | None = None
    device: str = "cpu"
    layout: str = "strided"

    @classmethod
    def of_tensor(cls, t: torch.Tensor, name: str, kind: str, m: int, n: int, groups: int = 1) -> "TensorRef":
        """An in-memory reference (a module's parameter, or a tensor from a state dict)."""
        return cls(tensor=name, shape=tuple(t.shape), dtype=str(t.dtype).replace("torch.", ""), kind=str(kind),
                   m=m, n=n, groups=groups, nbytes=t.numel() * t.element_size(), data=t.detach(),
                   device=t.device.type, layout=str(t.layout).replace("torch.", ""))

    def with_view(self, kind: str, m: int, n: int, groups: int = 1) -> "TensorRef":
        return TensorRef(self.tensor, self.shape, self.dtype, str(kind), m, n, groups, self.path, self.offset,
                         self.nbytes, self.data, self.device, self.layout)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def load(self) -> torch.Tensor:
        """The tensor: ``data``, or its bytes in the file read through a private memory map (pages are read only
        when touched; nothing is written back)."""
        if self.data is not None:
            return self.data
        assert self.path is not None
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise AuditError(f"tensor {self.tensor} has dtype {self.dtype}, which this torch cannot read",
                             "Convert the checkpoint to float32, float16 or bfloat16")
        if is_url(self.path):
            raw = torch.frombuffer(bytearray(read_url_range(self.path, self.offset, self.nbytes, self.tensor)),
                                   dtype=torch.uint8) if self.nbytes else torch.empty(0, dtype=torch.uint8)
            return raw.view(dtype).reshape(self.shape)
        fd = open_regular(self.path)
        try:
            size = os.fstat(fd).st_size
            if self.offset + self.nbytes > size:
                raise AuditError(f"{self.path} is shorter than its header says ({size:,} bytes; tensor "
                                 f"{self.tensor} ends at {self.offset + self.nbytes:,})",
                                 "The file is truncated or changed since it was opened; write it again")
            if self.nbytes == 0:
                return torch.empty(self.shape, dtype=dtype)
            # Only this tensor's pages, private (copied on write, never stored): no commit charge for the file
            start = self.offset - self.offset % mmap.ALLOCATIONGRANULARITY
            mm = mmap.mmap(fd, self.offset + self.nbytes - start, offset=start, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        raw = torch.frombuffer(mm, dtype=torch.uint8, count=self.nbytes, offset=self.offset - start)
        if (self.offset - start) % max(1, dtype.itemsize):
            raw = raw.clone()  # an unaligned tensor: one aligned copy
        return raw.view(dtype).reshape(self.shape)

    def __call__(self) -> torch.Tensor:
        """A reference is also a loader (``ref()`` is ``ref.load()``)."""
        return self.load()

    def raw_bytes(self) -> memoryview:
        """The tensor's bytes as stored (C order), without copying where they already are contiguous."""
        if self.data is None:
            t = self.load()
        else:
            t = self.data.detach()
            if t.device.type != "cpu":
                t = t.to("cpu")
            t = t.contiguous()
        return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def read_url_range(url: str, offset: int, nbytes: int, tensor: str = "") -> bytes:
    """``nbytes`` bytes at ``offset`` of the file at an fsspec URL (``s3://``, ``gs://``, ``file://``, ...). fsspec
    is imported only here. A protocol fsspec cannot load, a missing file or a short one is one :class:`AuditError`
    naming the URL (and what to install)."""
    scheme = url.split("://", 1)[0]
    try:
        import fsspec
    except ImportError:
        raise AuditError(f"cannot read {url}: reading URLs needs fsspec", "pip install fsspec (and its package for "
                         f"{scheme}://, e.g. s3fs) on every worker") from None
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except ImportError as exc:  # fsspec knows the protocol; its package is missing ("Install s3fs to access S3")
        raise AuditError(f"cannot read {url}: fsspec needs a package for {scheme}:// ({first_line(exc)})",
                         f"pip install {_FSSPEC_PACKAGES.get(scheme, 'the fsspec implementation for ' + scheme)} "
                         "where the tensors are read (every Dask worker)") from None
    except ValueError as exc:  # "Protocol not known: foo"
        raise AuditError(f"cannot read {url}: fsspec has no filesystem for {scheme}:// ({first_line(exc)})",
                         "Map to a URL fsspec can read (s3://, gs://, az://, file://, ...) or to a local path",
                         ) from None
    try:
        size = fs.size(path)
        data = fs.cat_file(path, start=offset, end=offset + nbytes) if nbytes else b""
    except FileNotFoundError:
        raise AuditError(f"cannot open {url}: No such file or directory",
                         "Check that the file exists at that URL and is readable") from None
    except OSError as exc:
        raise AuditError(f"cannot read {url}: {first_line(exc)}", "Check the URL and its credentials") from None
    if size is not None and offset + nbytes > size or len(data) != nbytes:
        have = f"{size:,}" if size is not None else f"{offset + len(data):,} or fewer"
        raise AuditError(f"{url} is shorter than its header says ({have} bytes; tensor {tensor} ends at "
                         f"{offset + nbytes:,})",
                         "The file is truncated or changed since it was opened; write it again")
    return bytes(data)


_FSSPEC_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
                    "adl": "adlfs", "hf": "huggingface_hub", "sftp": "paramiko", "ssh": "paramiko", "http": "aiohttp",
                    "https": "aiohttp", "oci": "ocifs", "hdfs": "pyarrow", "arrow_hdfs": "pyarrow"}


def open_regular(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor for a regular file. A FIFO, device or socket is refused before anything blocks on it
    (opened non-blocking, checked with fstat)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise AuditError(f"cannot open {path}: {exc.strerror}", "Check that the file exists and is readable") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise AuditError(f"{path} is not a regular file", "Point to a safetensors file")
    return fd


def read_header(path: str | os.PathLike[str]) -> dict[str, TensorRef]:
    """Every tensor in a safetensors file as a :class:`TensorRef` (matrix view not set yet: kind "", m = n = 0),
    from one read of its header. The header is checked as safetensors checks it: known dtypes, byte ranges that
    match the shapes and tile the data section exactly, in order, with no gap, overlap or trailing bytes."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        try:
            head = os.pread(fd, 8, 0)
            if len(head) < 8:
                raise ValueError("shorter than the 8-byte header length")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > min(MAX_HEADER, size - 8):
                raise ValueError(f"header length {hlen:,} exceeds the file ({size:,} bytes)")
            text = os.pread(fd, hlen, 8)
            if len(text) != hlen or not text.lstrip().startswith(b"{"):
                raise ValueError("the header is not a JSON object")
            header = json.loads(text.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
            refs = _parse(header, str(path), 8 + hlen, size)
        except AuditError:
            raise
        except Exception as exc:  # noqa: BLE001 - any malformed header is one clear error
            raise AuditError(f"{path} is not a readable safetensors file: {first_line(exc)}",
                             "The file may be truncated or corrupt; download or write it again") from None
    finally:
        os.close(fd)
    return refs


def _parse(header: Any, path: str, start: int, size: int) -> dict[str, TensorRef]:
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("__metadata__ is not a map of strings")
    spans: list[tuple[int, int, str]] = []
    refs: dict[str, TensorRef] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or set(info) - {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"entry {name!r} is not {{dtype, shape, data_offsets}}")
        code, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if code not in DTYPES:
            raise ValueError(f"tensor {name!r} has unknown dtype {code!r}")
        if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
            raise ValueError(f"tensor {name!r} has a malformed shape")
        if (not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int for o in offs)
                or not 0 <= offs[0] <= offs[1]):
            raise ValueError(f"tensor {name!r} has malformed data_offsets")
        torch_name, bits = DTYPES[code]
        numel = math.prod(shape)
        if numel * bits % 8 or offs[1] - offs[0] != numel * bits // 8:
            raise ValueError(f"tensor {name!r}: {offs[1] - offs[0]} bytes do not hold shape {shape} of {code}")
        spans.append((offs[0], offs[1], name))
        refs[name] = TensorRef(tensor=name, shape=tuple(shape), dtype=torch_name, kind="", m=0, n=0, path=path,
                               offset=start + offs[0], nbytes=offs[1] - offs[0])
    end = 0
    for b, e, name in sorted(spans):
        if b != end:
            raise ValueError(f"tensor {name!r} does not start where the previous one ends ({b} != {end})")
        end = e
    if start + end != size:
        raise ValueError(f"the data section holds {size - start:,} bytes, the header accounts for {end:,}")
    return refs


def inside(folder: Path, entry: str) -> Path | None:
    """``folder / entry`` resolved (symlinks followed), or None when ``entry`` is absolute or leads outside
    ``folder``. Nothing outside is opened or tested for existence beyond what ``resolve`` itself does."""
    if not entry or "\0" in entry or os.path.isabs(entry) or entry.startswith(("/", "\\")) or ":" in entry[:3]:
        return None
    root = folder.resolve()
    target = (root / entry).resolve()
    try:
        target.relative_to(root)
    except ValueError:
        return None
    return target
