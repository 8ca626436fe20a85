"""Singular values cached on disk by content hash, validated on every read.

An entry is ``<dir>/<key[:2]>/<key>.f64``: the raw float64 values (groups x k, C order) followed by 32 bytes of
BLAKE3 over the key and those values. A read accepts an entry only if it is a regular file (never a FIFO or device:
it is opened non-blocking and checked before a byte is read) of exactly the right size whose checksum matches and
whose values are finite, non-negative and descending within rounding; anything else is a miss and is recomputed.
Writes go to a temporary file renamed into place, so concurrent audits sharing a cache never see half an entry.

Entries are kept apart per spectral backend: a cache is bound to one (:meth:`SpectrumCache.for_backend`), and the
key of an entry is :func:`entry_key` of the tensor's content key and that backend, so switching backends never
reads values another backend computed.
"""

from __future__ import annotations

import os
import stat
import threading
import uuid
from pathlib import Path

import numpy as np

CHECK = 32  # bytes of BLAKE3 after the values
DEFAULT_BACKEND = "lapack-gram"  # LapackBackend's cache id: its entries keep the plain content key
DESCENDING_SLACK = 1e-9  # sigma[i+1] may exceed sigma[i] by this much of sigma_max (eigensolver rounding)


def default_cache_dir() -> Path:
    env = os.environ.get("LOWRANK_AUDITOR_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lowrank-auditor" / "spectra"


def entry_key(key: str, backend: str = DEFAULT_BACKEND) -> str:
    """The cache key of one tensor's values from one backend: the content key itself for the default LAPACK backend
    (caches written before backends were selectable stay valid), BLAKE3 over the backend's cache id and the content
    key for any other; empty for an empty key (nothing cached).

    >>> entry_key("ab" * 32) == "ab" * 32 != entry_key("ab" * 32, "torch-cpu") != entry_key("ab" * 32, "torch-cuda")
    True
    """
    if not key or backend == DEFAULT_BACKEND:
        return key
    from blake3 import blake3

    return blake3(f"backend|{backend}|{key}".encode()).hexdigest()


def _check(key: str, payload: bytes) -> bytes:
    from blake3 import blake3

    return blake3(key.encode() + b"|" + payload).digest()


def valid(sigma: np.ndarray) -> bool:
    """Finite, non-negative, and descending in each row within rounding."""
    if sigma.size == 0:
        return True
    if not np.isfinite(sigma).all() or (sigma < 0).any():
        return False
    slack = DESCENDING_SLACK * float(sigma.max())
    return bool((np.diff(sigma, axis=1) <= slack).all())


class SpectrumCache:
    """get/put singular values by content key, for one backend (``backend``: its cache id; default the LAPACK
    backend's). Safe to share between threads, processes and concurrent audits."""

    def __init__(self, directory: Path | str | None = None, backend: str = DEFAULT_BACKEND) -> None:
        self.directory = Path(directory) if directory is not None else default_cache_dir()
        self.backend = backend

    def for_backend(self, backend: str) -> "SpectrumCache":
        """This cache directory, for another backend's entries (itself when it is the same backend)."""
        return self if backend == self.backend else SpectrumCache(self.directory, backend)

    def path(self, key: str) -> Path:
        """Where the entry of this content key lies (for this cache's backend)."""
        return self._file(entry_key(key, self.backend))

    def _file(self, entry: str) -> Path:
        return self.directory / entry[:2] / f"{entry}.f64"

    def get(self, key: str, groups: int, k: int) -> np.ndarray | None:
        """The cached (groups x k) values, or None when absent, unreadable or failing validation."""
        if not key:
            return None
        key = entry_key(key, self.backend)
        size = groups * k * 8
        try:
            fd = os.open(self._file(key), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size + CHECK:
                return None
            raw = b""
            while len(raw) < size + CHECK:
                chunk = os.read(fd, size + CHECK - len(raw))
                if not chunk:
                    return None
                raw += chunk
        except OSError:
            return None
        finally:
            os.close(fd)
        payload, check = raw[:size], raw[size:]
        if _check(key, payload) != check:
            return None
        sigma = np.frombuffer(payload, dtype="<f8").astype(np.float64).reshape(groups, k)
        return sigma if valid(sigma) else None

    def put(self, key: str, sigma: np.ndarray) -> bool:
        """Store values atomically; False (and no error) where the cache cannot be written."""
        if not key or not valid(sigma):
            return False
        path = self.path(key)
        key = entry_key(key, self.backend)
        payload = np.ascontiguousarray(sigma, dtype="<f8").tobytes()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(payload + _check(key, payload))
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            os.replace(tmp, path)
        except OSError:
            return False  # a read-only or full cache is not an error
        return True
