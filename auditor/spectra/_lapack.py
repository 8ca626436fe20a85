"""BLAS dsyrk/dgemm and LAPACK dsyevd called without the GIL, and a cap on BLAS threads while layers run side by side.

SciPy's Python wrappers (``scipy.linalg.blas.dsyrk``, ``scipy.linalg.eigh``) hold the GIL for the whole call, so two
Python threads running them take turns instead of sharing the cores. SciPy also publishes the same routines as C
function pointers for Cython (``scipy.linalg.cython_blas`` / ``cython_lapack``, a public API). Called through ctypes,
which drops the GIL for every foreign call, they run truly in parallel; and they are the very BLAS/LAPACK SciPy was
built with, so nothing here depends on which one that is. Where the pointers cannot be had, ``available()`` is False
and the engine runs one layer at a time through SciPy's wrappers.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from typing import Iterator

import numpy as np

_P = ctypes.c_void_p  # every Fortran argument is passed by address


@functools.lru_cache(maxsize=None)
def _routine(module: str, name: str, nargs: int) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        import importlib

        capsule = importlib.import_module(module).__pyx_capi__[name]
        api = ctypes.pythonapi
        api.PyCapsule_GetName.restype = ctypes.c_char_p
        api.PyCapsule_GetName.argtypes = [ctypes.py_object]
        api.PyCapsule_GetPointer.restype = ctypes.c_void_p
        api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
        address = api.PyCapsule_GetPointer(capsule, api.PyCapsule_GetName(capsule))
    except Exception:  # noqa: BLE001 - an unusual SciPy build: fall back to its Python wrappers
        return None
    if not address:
        return None
    return ctypes.CFUNCTYPE(None, *([_P] * nargs))(address)


def available() -> bool:
    return _routine("scipy.linalg.cython_blas", "dsyrk", 10) is not None and (
        _routine("scipy.linalg.cython_lapack", "dsyevd", 11) is not None) and (
        _routine("scipy.linalg.cython_blas", "dgemm", 13) is not None)


def _ref(x: object) -> ctypes._Pointer:  # type: ignore[name-defined]
    return ctypes.byref(x)  # type: ignore[arg-type]


def _int(v: int) -> ctypes._Pointer:  # type: ignore[name-defined]
    return _ref(ctypes.c_int(v))


def _dbl(v: float) -> ctypes._Pointer:  # type: ignore[name-defined]
    return _ref(ctypes.c_double(v))


def syrk(c: np.ndarray, a: np.ndarray, *, k_rows: bool, beta: float, tile: int | None = None) -> None:
    """C (n x n, Fortran order, upper triangle) = A^T A + beta C in place, for a C-ordered block ``a``.

    ``k_rows``: ``a`` is (rows x n) and the Gram runs over its rows (a tall matrix's W^T W); otherwise ``a`` is
    (n x cols) and the Gram runs over its columns (a wide matrix's W W^T). ``tile``: with n above it, the upper
    triangle is built from tiles of at most ``tile`` (dsyrk on the diagonal, dgemm above it), because the threaded
    dsyrk of SciPy's bundled OpenBLAS 0.3.30 writes out of bounds once n reaches about 28,000 (measured here:
    n = 27,000 runs, n = 28,000 dies with SIGSEGV on 2 threads and runs on 1)."""
    fsyrk = _routine("scipy.linalg.cython_blas", "dsyrk", 10)
    fgemm = _routine("scipy.linalg.cython_blas", "dgemm", 13)
    assert fsyrk is not None and fgemm is not None
    assert a.flags.c_contiguous and c.flags.f_contiguous and a.dtype == c.dtype == np.float64
    n = c.shape[0]
    if k_rows:  # Fortran sees the (rows x n) C array as X = A^T (n x rows): C = X X^T; row i of X at offset i
        k, lda, step = a.shape[0], a.shape[1], 1
        t_syrk, t_a, t_b = b"N", b"N", b"T"
    else:  # Fortran sees (n x cols) as Y (cols x n): C = Y^T Y; column i of Y at offset i * cols
        k, lda, step = a.shape[1], a.shape[1], a.shape[1]
        t_syrk, t_a, t_b = b"T", b"T", b"N"
    base, cbase, size = a.ctypes.data, c.ctypes.data, 8
    width = n if not tile or n <= tile else tile
    for i0 in range(0, n, width):
        ni = min(width, n - i0)
        ai = _P(base + i0 * step * size)
        fsyrk(ctypes.c_char_p(b"U"), ctypes.c_char_p(t_syrk), _int(ni), _int(k), _dbl(1.0), ai, _int(lda),
              _dbl(beta), _P(cbase + (i0 + i0 * n) * size), _int(n))
        for j0 in range(i0 + width, n, width):
            nj = min(width, n - j0)
            fgemm(ctypes.c_char_p(t_a), ctypes.c_char_p(t_b), _int(ni), _int(nj), _int(k), _dbl(1.0), ai, _int(lda),
                  _P(base + j0 * step * size), _int(lda), _dbl(beta), _P(cbase + (i0 + j0 * n) * size), _int(n))


def eigvalsh_upper(g: np.ndarray) -> np.ndarray:
    """Eigenvalues (ascending) of a symmetric matrix given by the upper triangle of a Fortran-ordered array, which
    is overwritten (LAPACK dsyevd, values only)."""
    fn = _routine("scipy.linalg.cython_lapack", "dsyevd", 11)
    assert fn is not None and g.flags.f_contiguous and g.dtype == np.float64
    n = g.shape[0]
    w = np.empty(n)
    info = ctypes.c_int(0)
    args = (ctypes.c_char_p(b"N"), ctypes.c_char_p(b"U"), _ref(ctypes.c_int(n)), g.ctypes.data_as(_P),
            _ref(ctypes.c_int(max(n, 1))), w.ctypes.data_as(_P))
    qwork, qiwork = ctypes.c_double(0.0), ctypes.c_int(0)
    fn(*args, _ref(qwork), _ref(ctypes.c_int(-1)), _ref(qiwork), _ref(ctypes.c_int(-1)), _ref(info))
    lwork, liwork = max(int(qwork.value), 2 * n + 1), max(int(qiwork.value), 1)
    work, iwork = np.empty(lwork), np.empty(liwork, dtype=np.intc)
    fn(*args, work.ctypes.data_as(_P), _ref(ctypes.c_int(lwork)), iwork.ctypes.data_as(_P),
       _ref(ctypes.c_int(liwork)), _ref(info))
    if info.value != 0:
        raise np.linalg.LinAlgError(f"dsyevd failed to converge (info={info.value})")
    return w


@contextlib.contextmanager
def blas_threads(n: int | None) -> Iterator[None]:
    """Cap the BLAS thread pools at ``n`` threads inside the block (``None``: leave them as they are)."""
    if n is None:
        yield
        return
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - threadpoolctl is a dependency; be lenient all the same
        yield
        return
    with threadpool_limits(limits=n, user_api="blas"):
        yield
