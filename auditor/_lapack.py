"""BLAS dsyrk and LAPACK dsyevd called without the GIL, and a cap on BLAS threads while layers run side by side.

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
        _routine("scipy.linalg.cython_lapack", "dsyevd", 11) is not None
    )


def _ref(x: object) -> ctypes._Pointer:  # type: ignore[name-defined]
    return ctypes.byref(x)  # type: ignore[arg-type]


def syrk(c: np.ndarray, a: np.ndarray, *, k_rows: bool, beta: float) -> None:
    """C (n x n, Fortran order, upper triangle) = A^T A + beta C in place, for a C-ordered block ``a``.

    ``k_rows``: ``a`` is (rows x n) and the Gram runs over its rows (a tall matrix's W^T W); otherwise ``a`` is
    (n x cols) and the Gram runs over its columns (a wide matrix's W W^T)."""
    fn = _routine("scipy.linalg.cython_blas", "dsyrk", 10)
    assert fn is not None and a.flags.c_contiguous and c.flags.f_contiguous and a.dtype == c.dtype == np.float64
    if k_rows:  # Fortran sees the (rows x n) C array as A^T (n x rows): C = (A^T)(A^T)^T, no transpose
        k, trans, lda = a.shape[0], b"N", a.shape[1]
    else:  # Fortran sees (n x cols) as (cols x n): C = (.)^T (.)
        k, trans, lda = a.shape[1], b"T", a.shape[1]
    n = c.shape[0]
    fn(ctypes.c_char_p(b"U"), ctypes.c_char_p(trans), _ref(ctypes.c_int(n)), _ref(ctypes.c_int(k)),
       _ref(ctypes.c_double(1.0)), a.ctypes.data_as(_P), _ref(ctypes.c_int(lda)), _ref(ctypes.c_double(beta)),
       c.ctypes.data_as(_P), _ref(ctypes.c_int(n)))


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
