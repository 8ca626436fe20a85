"""Tier 1, step 2: whitened spectra and the layer-output error at every rank.

Every layer computes ``y = F x`` for a function matrix F (out x in) per group: W for Linear, RNN and attention
projections, W viewed per group for convolutions, the stored (in, out) weight transposed for transformers' Conv1D,
and W^T (dim x vocab) for an embedding, whose inputs are one-hot rows. With G = X^T X (the input statistics) and S
its damped Cholesky factor (S S^T = G + lambda I), the whitened singular values sigma_i are those of F S.

The truncation kept at rank r is F_r = U_r U_r^T F, U_r the top-r left singular vectors of F S: the rank-r map that
best preserves the layer's outputs on the calibration data. Its layer-output error is exactly

    e(r)^2 = ||(F - F_r) X^T||^2 / ||F X^T||^2 = (sum_{i>r} q_i) / sum_i q_i,   q_i = u_i^T F G F^T u_i,

which equals sqrt(sum of the dropped sigma_i^2) / ||F X^T|| when lambda = 0 and differs from it by the damping's
share otherwise. The curve is computed from the q_i, so it is exact with damping too. Where the output side is the
shorter one (out <= in), sigma_i^2 and u_i come from F (G + lambda I) F^T, which equals (F S)(F S)^T, without forming S.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, MutableMapping, NamedTuple, Sequence, TypeVar

import numpy as np
import torch

from ... import kinds, lrmath
from ...results import Layer
from .stats import LayerInput

_T = TypeVar("_T")
_R = TypeVar("_R")
_A = TypeVar("_A", np.ndarray, torch.Tensor)

if TYPE_CHECKING:
    from .stats import InputStatistics

DAMP = 1e-6  # lambda = DAMP * mean(diag G): enough for a Cholesky of a singular G, negligible otherwise
ERROR_TARGETS = (0.01, 0.02, 0.05, 0.10)


def stored_weight(layer: Layer, f: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """Function matrices ``f`` (groups, out, in) as ``layer``'s weight: its kind's stored layout, reshaped to
    ``shape``, in ``dtype`` on ``device`` (differentiable, for the block refinement's factors)."""
    return kinds.for_kind(layer.kind).stored(layer, f).reshape(shape).to(dtype=dtype, device=device)


def function_matrices(layer: Layer, weight: torch.Tensor) -> np.ndarray:
    """The layer's map as (groups, out, in) float64: y = F x for each group."""
    w = weight.detach().to(torch.float64).cpu()
    return kinds.for_kind(layer.kind).function_matrices(layer, w)


@dataclass
class Basis:
    """The whitened decomposition of one group: U (out x k) descending, sigma^2 (damped), q (exact energies)."""

    u: np.ndarray | None
    sigma2: np.ndarray
    q: np.ndarray
    total: float  # ||F X^T||^2
    damping: float


CHUNK = 4096  # columns of a wide one-hot map (an embedding's vocabulary) multiplied at a time


def decompose(f: np.ndarray, gram: np.ndarray, diagonal: bool = False, damp: float = DAMP,
              need_u: bool = True) -> Basis:
    """Whitened decomposition of one group's F (out x in) under G (in x in, or its diagonal). ``need_u=False``: the
    spectrum and energies only (``u`` is None where it would be out x in: a tall map such as an output head).

    Working memory beyond F: out x in once (F G) for a dense map with out <= in; for an embedding's one-hot inputs
    out x ``CHUNK`` (its vocabulary in chunks); for a tall map (out > in) in x in matrices only: F^T F is formed
    once, and (F S)^T (F S) = S^T (F^T F) S, so F S (out x in) is never formed; U = F S V / sigma (out x in) only
    with ``need_u``."""
    m, n = f.shape
    diag = gram if diagonal else np.diagonal(gram)
    scale = float(np.mean(diag)) if diag.size else 0.0
    lam = damp * scale if scale > 0 else damp
    if diagonal and m > n:  # a tall map over one-hot inputs (tiny vocabulary): the dense route below
        return decompose(f, np.diag(gram), False, damp, need_u)
    if m <= n:
        # M = F G F^T (out x out) once: the eigenproblem, the energies q_i = u_i^T M u_i and the total trace(M)
        # all read it, so G is multiplied once (a 512 x 2048 layer: 4.9 s -> 3.0 s under load, equal to 1e-15)
        mm, ff = short_side_products(f, gram, diagonal)
        mm = (mm + mm.T) / 2
        vals, vecs = np.linalg.eigh(mm + lam * ff)
        order = np.argsort(vals)[::-1]
        sigma2 = np.clip(vals[order], 0.0, None)
        u = vecs[:, order]
        q = np.sum((u.T @ mm) * u.T, axis=1)
        total = float(np.trace(mm))
    else:
        g = np.diag(gram) if diagonal else gram
        s = np.linalg.cholesky(g + lam * np.eye(n))
        a = f.T @ f  # n x n
        a = (a + a.T) / 2
        kk = s.T @ a @ s  # (F S)^T (F S)
        vals, v = np.linalg.eigh((kk + kk.T) / 2)
        order = np.argsort(vals)[::-1]
        sigma2 = np.clip(vals[order], 0.0, None)
        sig = np.sqrt(sigma2)
        keep = sig > sig[0] * 1e-13 if sig.size and sig[0] > 0 else np.zeros(len(sig), dtype=bool)
        w = np.zeros((n, n))  # u_i = F w_i; directions F never reaches keep zero columns: they carry no energy
        w[:, keep] = (s @ v[:, order][:, keep]) / sig[keep]
        t = w.T @ a  # u^T F, k x n
        q = np.sum((t @ g) * t, axis=1)
        total = float(np.sum(g * a))
        u = f @ w if need_u else None
    return Basis(u, sigma2, np.clip(q, 0.0, None), total, lam)


def short_side_products(f: "_A", gram: "_A", diagonal: bool) -> "tuple[_A, _A]":
    """(F G F^T, F F^T), out x out, for a map with out <= in under G (in x in, or its diagonal: an embedding's one-hot
    inputs, F's columns taken ``CHUNK`` at a time); NumPy arrays or torch tensors alike (:mod:`.ondevice`)."""
    if not diagonal:
        return (f @ gram) @ f.T, f @ f.T
    mm, ff = f[:, :0] @ f[:, :0].T, f[:, :0] @ f[:, :0].T  # zeros of F's kind, dtype and device
    for c in range(0, f.shape[1], CHUNK):
        fc = f[:, c:c + CHUNK]
        mm += (fc * gram[None, c:c + CHUNK]) @ fc.T
        ff += fc @ fc.T
    return mm, ff


# what makes one group's decomposition, called as decompose(f, gram, diagonal, damp, need_u): decompose here, or
# ondevice.on(device)'s on an accelerator (--device cuda)
Decomposer = Callable[..., Basis]
DEVICE_JOBS = 2  # layers decomposed at once on a device (each holds its F, G and products there: 4-5 GB at 11,008)


@dataclass
class WhitenedSpectrum:
    """A layer's whitened spectrum and its layer-output error curve (plain numbers only)."""

    layer: str
    sigma: list[list[float]]  # groups x k: whitened singular values, descending
    error: list[float]  # error[r] for r = 0..k: layer-output relative error at rank r (error[0] = 1)
    output_norm: float  # ||F X^T||_F over the calibration rows (all groups)
    rows: int
    damping: float  # lambda added to the diagonal of X^T X (largest over groups)
    ranks_for: dict[str, int] = field(default_factory=dict)  # error target -> smallest rank meeting it
    suggested: int | None = None  # aligned data-aware rank below break-even; None: keep dense
    verdict: str = ""  # "factorize" | "keep dense"
    reason: str = ""
    approximate: str = ""  # non-empty when the error is an estimate (see LayerInput.approximate)

    def error_at(self, r: int) -> float:
        return self.error[min(max(r, 0), len(self.error) - 1)]

    def rank_for(self, target: float) -> int:
        """Smallest rank whose layer-output error is at most ``target``."""
        for r, e in enumerate(self.error):
            if e <= target:
                return r
        return len(self.error) - 1

    def dropped_sigma_error(self, r: int) -> float:
        """sqrt(sum of dropped sigma_i^2) / ||F X^T||: the textbook formula (equal to ``error_at`` without damping)."""
        dropped = sum(sum(s * s for s in g[r:]) for g in self.sigma)
        return math.sqrt(dropped) / self.output_norm if self.output_norm > 0 else 0.0


def whitened_bases(layer: Layer, weight: torch.Tensor, inp: LayerInput, damp: float = DAMP,
                   need_u: bool = True, decomposer: Decomposer | None = None) -> list[Basis]:
    f = function_matrices(layer, weight)
    grams = [inp.gram] if inp.diagonal else list(inp.gram)
    one = decomposer or decompose
    return [one(f[g], grams[g], inp.diagonal, damp, need_u) for g in range(f.shape[0])]


def whitened_spectrum(layer: Layer, weight: torch.Tensor, inp: LayerInput, align: int = 8,
                      target: float = 0.01, damp: float = DAMP,
                      decomposer: Decomposer | None = None) -> WhitenedSpectrum:
    """The whitened spectrum of ``layer`` under its input statistics, the error curve, the ranks for 1, 2, 5 and 10%
    layer-output error, and a suggested rank: the one for ``target`` rounded up to a multiple of ``align``, kept only
    below break-even ("keep dense" otherwise). ``decomposer``: what decomposes (default :func:`decompose`)."""
    return _spectrum(layer, whitened_bases(layer, weight, inp, damp, False, decomposer), inp, align, target)


def _spectrum(layer: Layer, bases: list[Basis], inp: LayerInput, align: int, target: float) -> WhitenedSpectrum:
    """:func:`whitened_spectrum` from the layer's decompositions (``bases``, one per group)."""
    k = min(len(b.q) for b in bases)
    total = sum(b.total for b in bases)
    kept = np.zeros(k + 1)
    for b in bases:
        kept[1:] += np.cumsum(b.q[:k])
    err = np.sqrt(np.clip(total - kept, 0.0, None) / total) if total > 0 else np.zeros(k + 1)
    err[0] = 1.0 if total > 0 else 0.0
    spec = WhitenedSpectrum(
        layer=layer.name,
        sigma=[np.sqrt(b.sigma2[:k]).tolist() for b in bases],
        error=err.tolist(),
        output_norm=math.sqrt(total),
        rows=inp.rows,
        damping=max(b.damping for b in bases),
        approximate=inp.approximate,
    )
    spec.ranks_for = {f"{t:g}": spec.rank_for(t) for t in ERROR_TARGETS}
    need = spec.rank_for(target)
    useful = lrmath.max_useful_rank(layer.m, layer.n)
    aligned = int(math.ceil(max(need, 1) / align) * align)
    r = aligned if aligned <= useful else need
    if r > useful or r < 1:
        spec.verdict = "keep dense"
        spec.reason = (f"{100 * target:g}% layer-output error needs rank {need}, at or above the useful maximum "
                       f"{useful} (break-even {layer.break_even:.1f})")
    else:
        spec.suggested = r
        spec.verdict = "factorize"
        spec.reason = (f"rank {r} keeps the layer's outputs within {100 * spec.error_at(r):.2f}% on the calibration "
                       f"data at {layer.compression(r):.2f}x compression")
    return spec


class Truncator:
    """One layer's truncations at any rank from one decomposition: whitened under ``inp``, plain SVD without.

    Per group, the rank-r factors are A = U_r, B = U_r^T F (``u``: orthonormal, the whitened truncation). A
    loss-aware truncator (:meth:`from_bases`; the gradient pass makes them, :func:`.fisher.loss_aware`) keeps
    either ``w`` beside ``u`` (A = U_r, B = W_r^T F: an oblique projection on the output side) or, with ``u``
    empty, ``z`` and ``y`` (A = F Z_r, B = Y_r^T: an oblique projection on the input side). A cut truncator
    (:meth:`cut`: what a :class:`TruncatorStore` keeps) holds instead each group's factors at full rank, whose first
    r columns and rows are the rank-r factors (``full``), and neither F nor the bases."""

    w: "list[np.ndarray] | None" = None
    z: "list[np.ndarray] | None" = None
    y: "list[np.ndarray] | None" = None
    full: "list[tuple[np.ndarray, np.ndarray]] | None" = None  # a cut one's per group (A_k^T, B_k), k = min(out, in)
    oblique: bool = False  # a cut one's: its A's columns are not unit vectors (loss-aware)

    def __init__(self, layer: Layer, weight: torch.Tensor, inp: LayerInput | None, damp: float = DAMP) -> None:
        self.layer = layer
        self.shape, self.dtype, self.device = tuple(weight.shape), weight.dtype, weight.device
        self.f = function_matrices(layer, weight)
        self.u: list[np.ndarray] = []
        for g in range(self.f.shape[0]):
            if inp is None:
                self.u.append(np.linalg.svd(self.f[g], full_matrices=False)[0])
            else:
                gram = inp.gram if inp.diagonal else inp.gram[g]
                self.u.append(decompose(self.f[g], gram, inp.diagonal, damp).u)

    @classmethod
    def from_parts(cls, layer: Layer, weight: torch.Tensor, u: list[np.ndarray]) -> "Truncator":
        """The truncator of ``layer`` with its decompositions' ``u`` (one per group) computed elsewhere (a Dask
        worker: :mod:`~auditor.calibration.statistics.remote`); F is made here from ``weight`` as ``__init__`` does."""
        trunc = cls.__new__(cls)
        trunc.layer = layer
        trunc.shape, trunc.dtype, trunc.device = tuple(weight.shape), weight.dtype, weight.device
        trunc.f = function_matrices(layer, weight)
        trunc.u = list(u)
        return trunc

    @classmethod
    def from_bases(cls, layer: Layer, weight: torch.Tensor, f: np.ndarray,
                   bases: dict[str, list[np.ndarray]]) -> "Truncator":
        """A truncator of the map ``f`` (groups, out, in) from its per-group bases: ``{"u": ..., "w": ...}`` (left
        form) or ``{"z": ..., "y": ...}`` (right form), columns in the order they are kept."""
        trunc = cls.__new__(cls)
        trunc.layer = layer
        trunc.shape, trunc.dtype, trunc.device = tuple(weight.shape), weight.dtype, weight.device
        trunc.f = f
        trunc.u = list(bases.get("u", []))
        for key in ("w", "z", "y"):
            if key in bases:
                setattr(trunc, key, list(bases[key]))
        return trunc

    def parts(self) -> dict[str, list[np.ndarray]]:
        """The per-group bases by name (``u``, and ``w`` or ``z`` and ``y`` where loss-aware)."""
        return {k: v for k, v in (("u", self.u), ("w", self.w), ("z", self.z), ("y", self.y)) if v}

    def _pair(self, g: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """Group ``g``'s unbalanced factors at ``rank``."""
        if self.full is not None:  # slices: A_k^T's first rows (contiguous, as B_k's), no product
            at, b = self.full[g]
            return at[:rank].T, b[:rank]
        if self.z is not None and self.y is not None:
            return self.f[g] @ self.z[g][:, :rank], np.ascontiguousarray(self.y[g][:, :rank].T)
        ur = self.u[g][:, :rank]
        return ur, (self.w[g][:, :rank] if self.w is not None else ur).T @ self.f[g]

    @classmethod
    def of_function(cls, layer: Layer, weight: torch.Tensor, f: np.ndarray, inp: LayerInput,
                    damp: float = DAMP) -> "Truncator":
        """A truncator of the map ``f`` (groups, out, in) in place of the layer's own, whitened under ``inp``: the
        sequential fit's W* (:mod:`.sequential`); ``weight`` gives the stored layout, dtype and device."""
        trunc = cls.__new__(cls)
        trunc.layer = layer
        trunc.shape, trunc.dtype, trunc.device = tuple(weight.shape), weight.dtype, weight.device
        trunc.f = f
        grams = [inp.gram] * f.shape[0] if inp.diagonal else list(inp.gram)
        trunc.u = [decompose(f[g], grams[g], inp.diagonal, damp).u for g in range(f.shape[0])]
        return trunc

    def _dims(self) -> tuple[int, int, int]:
        """(groups, out, in) of the map."""
        if self.full is not None:
            return len(self.full), self.full[0][0].shape[1], self.full[0][1].shape[1]
        return self.f.shape  # type: ignore[return-value]

    def _oblique(self) -> bool:
        return self.oblique if self.full is not None else self.w is not None or self.z is not None

    def cut(self) -> "Truncator":
        """The same truncations held as each group's factors at full rank k = min(out, in): A_k^T (k x out) and B_k
        (k x in), whose first r rows give the rank-r pair, so that a plan's factors at any rank are slices instead
        of the product U_r^T F (or F Z_r) of out x in x r multiply-adds each time a plan is measured (tier 3, the
        baseline, the verification's candidates and the plan check cut each layer once per plan). Made once (one
        product at rank k), never more bytes than F and the bases; B_k = U^T F's first r rows equal U_r^T F to
        rounding (the same dot products; the BLAS may sum a smaller product in another order)."""
        g_, m, n = self._dims()
        k = min(m, n)
        out = Truncator.__new__(Truncator)
        out.layer, out.shape, out.dtype, out.device = self.layer, self.shape, self.dtype, self.device
        out.u, out.oblique = [], self._oblique()
        out.full = [(np.ascontiguousarray(a.T), np.ascontiguousarray(b)) for a, b in
                    (self._pair(g, k) for g in range(g_))]
        return out

    @property
    def cut_bytes(self) -> int:
        """Bytes a :meth:`cut` of this truncator holds."""
        g_, m, n = self._dims()
        return 8 * g_ * min(m, n) * (m + n)

    def factors(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """(groups, out, r) and (groups, r, in), float64, F ~ A B, each column/row pair balanced to equal norms."""
        g_, m, n = self._dims()
        if rank < 1 or rank > min(m, n):
            raise ValueError(f"rank {rank} outside 1..{min(m, n)} for {self.layer.name}")
        return _balanced([self._pair(g, rank) for g in range(g_)], self._oblique())

    def pinned(self, rank: int) -> "Pinned":
        """This truncation at ``rank`` alone (:class:`Pinned`): its factors and weight there, the same numbers, without
        the decomposition (F and the bases: 8 (out + in) x min(out, in) bytes a group, not 8 r (out + in))."""
        g_, m, n = self._dims()
        if rank < 1 or rank > min(m, n):
            raise ValueError(f"rank {rank} outside 1..{min(m, n)} for {self.layer.name}")
        pairs = [tuple(np.ascontiguousarray(x) for x in self._pair(g, rank)) for g in range(g_)]
        return Pinned(self.layer, rank, pairs, self._oblique(),  # type: ignore[arg-type]
                      self.shape, self.dtype, self.device)

    def weight(self, rank: int) -> torch.Tensor:
        """The dense weight (stored layout, dtype and device) of the rank-``rank`` truncation."""
        f = np.stack([np.matmul(*self._pair(g, rank)) for g in range(self._dims()[0])])
        return stored_weight(self.layer, torch.from_numpy(f), self.shape, self.dtype, self.device)


def _balanced(pairs: list[tuple[np.ndarray, np.ndarray]], both: bool) -> tuple[np.ndarray, np.ndarray]:
    """(groups, out, r) and (groups, r, in) from each group's unbalanced (A, B): each column/row pair scaled to equal
    norms (``both``: A's columns are not unit vectors, both scaled to one norm)."""
    g_, (m, rank), n = len(pairs), pairs[0][0].shape, pairs[0][1].shape[1]
    a = np.empty((g_, m, rank))
    b = np.empty((g_, rank, n))
    for g, (ar, br) in enumerate(pairs):
        s = np.linalg.norm(br, axis=1)
        if both:
            s = s / np.maximum(np.linalg.norm(ar, axis=0), 1e-300)
        s = np.sqrt(s)
        s[(s == 0) | ~np.isfinite(s)] = 1.0
        a[g] = ar * s[None, :]
        b[g] = br / s[:, None]
    return a, b


class Pinned:
    """A :class:`Truncator` at one rank (:meth:`Truncator.pinned`): each group's unbalanced factors there, so
    ``factors`` and ``weight`` at that rank give the truncator's numbers bit for bit, and nothing else is kept.
    :meth:`spilled` writes them to a file and reads them back memory-mapped."""

    def __init__(self, layer: Layer, rank: int, pairs: list[tuple[np.ndarray, np.ndarray]], both: bool,
                 shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.layer, self.rank, self.pairs, self.both = layer, rank, pairs, both
        self.shape, self.dtype, self.device = shape, dtype, device

    def _check(self, rank: int) -> None:
        if rank != self.rank:
            raise ValueError(f"{self.layer.name} was fitted at rank {self.rank}, not {rank}")

    def factors(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        self._check(rank)
        return _balanced(self.pairs, self.both)

    def weight(self, rank: int) -> torch.Tensor:
        self._check(rank)
        f = np.stack([np.matmul(ar, br) for ar, br in self.pairs])
        return stored_weight(self.layer, torch.from_numpy(f), self.shape, self.dtype, self.device)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) + int(b.nbytes) for a, b in self.pairs)

    @property
    def on_disk(self) -> bool:
        """Whether the factors are :meth:`spilled` (memory-mapped files)."""
        return all(isinstance(x, np.memmap) for pair in self.pairs for x in pair)

    def remove_files(self) -> None:
        """The spilled files removed, where nothing will read them again (a mapping of them stays valid until it is
        dropped); nothing for factors in memory."""
        if self.on_disk:
            for pair in self.pairs:
                for x in pair:
                    with contextlib.suppress(OSError):
                        os.remove(x.filename)

    def remapped(self) -> "Pinned":
        """The same, its spilled files mapped afresh: the pages a read brought into the process's resident memory are
        not held by the new mapping (they are the old one's, unmapped once it is dropped)."""
        pairs = [(np.load(a.filename, mmap_mode="c"), np.load(b.filename, mmap_mode="c")) for a, b in self.pairs]
        return Pinned(self.layer, self.rank, pairs, self.both, self.shape, self.dtype, self.device)

    def spilled(self, base: str) -> "Pinned":
        """The same, its arrays written to ``base``.a{g}.npy / .b{g}.npy and read back memory-mapped."""
        pairs = []
        for g, (a, b) in enumerate(self.pairs):
            pairs.append((spill_array(f"{base}.a{g}.npy", a), spill_array(f"{base}.b{g}.npy", b)))
        return Pinned(self.layer, self.rank, pairs, self.both, self.shape, self.dtype, self.device)


def spill_array(path: str, a: np.ndarray, what: str = "the sequential fit's factors") -> np.ndarray:
    """``a`` written to ``path`` and read back memory-mapped (copy-on-write, never written: torch takes it without a
    read-only warning): the same values, out of the heap."""
    save_spilled(path, a, what)
    return np.load(path, mmap_mode="c")


def truncator_bytes(layer: Layer) -> int:
    """Bytes of the float64 arrays a store keeps of a :class:`Truncator` of ``layer`` (its :meth:`~Truncator.cut`:
    A_k and B_k, k = min(out, in)). An estimate made before any is built, from the stored matrix (high for grouped
    maps)."""
    out, inp = kinds.for_kind(layer.kind).function_shape(layer)
    return 8 * min(out, inp) * (out + inp)


def save_spilled(path: str, a: np.ndarray, what: str) -> None:
    """``a`` written to ``path`` (a temporary directory's file), or one line saying the disk refused it."""
    try:
        np.save(path, a, allow_pickle=False)
    except OSError as exc:
        from ...errors import AuditError

        raise AuditError(f"cannot write {what} to {os.path.dirname(path)}: {exc.strerror or exc}",
                         "Free disk space there, or set TMPDIR to a directory with room") from None


REUSE_SHARE = 0.25  # of the memory available when tier 3 starts, for the decompositions kept across plans
REUSE_CAP = 8 * 2**30  # bytes, at most, by default
REUSE_FALLBACK = 2 * 2**30  # bytes by default where the available memory cannot be read


def default_reuse_bytes() -> int:
    """The default budget of a :class:`TruncatorStore`: a quarter of the memory available now, at most 8 GiB; 2 GiB
    where it cannot be read."""
    from ...spectra.backend import available_memory

    avail = available_memory()
    return REUSE_FALLBACK if avail is None else max(0, min(int(avail * REUSE_SHARE), REUSE_CAP))


class TruncatorStore(dict):
    """The per-layer truncators (:class:`Truncator`) kept across the plans tier 3 measures (``factorize``'s
    ``reuse``), each as its :meth:`~Truncator.cut` (its factors at full rank: a plan's at any rank are slices), with
    at most ``budget`` bytes of them in memory (None: :func:`default_reuse_bytes`). What does not fit is, with
    ``spill`` (the audit's store), written to a temporary directory (each group's A_k^T and B_k as ``.npy``) and read
    back (memory-mapped, read-only: no copy in the heap; a rank-r cut reads r rows of each) when a plan asks for it,
    so the decompositions alive at once do not grow with the depth; without ``spill`` (a library search's default) it
    is not kept, and computed again for the next plan that needs it (the same factors: the same arrays in, the same
    LAPACK calls). A layer is decomposed once per store entry; a cut read back is the same arrays, bit for bit.
    ``bytes``: those in memory; ``spilled``: how many went to disk; ``refused``: how many were not kept. Safe to
    put into from several threads (tier 1's decompositions)."""

    def __init__(self, budget: int | None = None, spill: bool = True) -> None:
        super().__init__()
        self.budget = default_reuse_bytes() if budget is None else int(budget)
        self.spill = spill
        self.bytes = 0
        self.spilled = 0
        self.refused = 0
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._disk: dict[str, tuple[Layer, tuple[int, ...], torch.dtype, torch.device, int, bool, int]] = {}
        self._lock = threading.Lock()  # tier 1 and the gradient pass put truncators in from their threads
        self._taken: set[str] = set()  # keys being cut or written now
        self._slots = 0

    def __setitem__(self, key: str, trunc: Truncator) -> None:
        """``trunc`` kept under ``key`` (as its cut), unless a truncator is kept there already. The cut and the writes
        run on the calling thread outside the lock: threads putting truncators in cut and write them at once."""
        n = trunc.cut_bytes
        with self._lock:
            if key in self or key in self._disk or key in self._taken:
                return
            if self.bytes + n > self.budget and not self.spill:
                self.refused += 1
                return
            self._taken.add(key)
        try:
            cut = trunc if trunc.full is not None else trunc.cut()
            with self._lock:
                if self.bytes + n <= self.budget:
                    super().__setitem__(key, cut)
                    self.bytes += n
                    return
                slot, self._slots = self._slots, self._slots + 1
                base = os.path.join(self._folder(), f"t{slot}")
            assert cut.full is not None
            for g, (at, b) in enumerate(cut.full):
                save_spilled(f"{base}.at{g}.npy", at, "the kept decompositions")
                save_spilled(f"{base}.b{g}.npy", b, "the kept decompositions")
            with self._lock:
                self._disk[key] = (cut.layer, cut.shape, cut.dtype, cut.device, len(cut.full), cut.oblique, slot)
                self.spilled += 1
        finally:
            with self._lock:
                self._taken.discard(key)

    def _folder(self) -> str:
        """The store's temporary folder, made on first use."""
        from ..._env import scratch_prefix, sweep_scratch

        if self._dir is None:
            sweep_scratch()  # a killed run's folders first
            self._dir = tempfile.TemporaryDirectory(prefix=scratch_prefix("truncators"))
        return self._dir.name

    def holds(self, key: str) -> bool:
        """Whether ``key``'s truncator is kept, in memory or on disk."""
        return key in self or key in self._disk

    def get(self, key: str, default: Truncator | None = None) -> Truncator | None:  # type: ignore[override]
        if key in self:
            return super().__getitem__(key)
        if key not in self._disk:
            return default
        layer, shape, dtype, device, groups, oblique, slot = self._disk[key]
        assert self._dir is not None
        base = os.path.join(self._dir.name, f"t{slot}")
        trunc = Truncator.__new__(Truncator)
        trunc.layer, trunc.shape, trunc.dtype, trunc.device = layer, shape, dtype, device
        trunc.u, trunc.oblique = [], oblique
        trunc.full = [(np.load(f"{base}.at{g}.npy", mmap_mode="r", allow_pickle=False),  # maps: no heap copy
                       np.load(f"{base}.b{g}.npy", mmap_mode="r", allow_pickle=False)) for g in range(groups)]
        return trunc

    def close(self) -> None:
        """Remove the spilled decompositions (also done when the store is garbage-collected)."""
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None
        self._disk.clear()


def part_bytes(model: torch.nn.Module, layers: list[Layer]) -> int:
    """The decompositions of the largest part of the model: one repeated block's layers together, or one layer
    outside the blocks (:func:`~auditor.calibration.statistics.stream.find_blocks`); every layer together where the model has
    no repeated blocks. What :class:`TruncatorStore` keeps in memory in the audit."""
    from .stream import find_blocks

    found = find_blocks(model, layers) if layers else None
    if found is None:
        return sum(truncator_bytes(l) for l in layers)
    parts = [sum(truncator_bytes(l) for l in ls) for ls in found.layers]
    return max([*parts, *(truncator_bytes(l) for l in found.outside)], default=0)


def truncated_factors(layer: Layer, weight: torch.Tensor, rank: int, inp: LayerInput | None,
                      damp: float = DAMP) -> tuple[np.ndarray, np.ndarray]:
    """Factors (groups, out, r) and (groups, r, in), float64, with F ~ A B: whitened (A = U_r, B = U_r^T F) when
    ``inp`` is given, the plain SVD truncation otherwise; each column/row pair balanced to equal norms."""
    return Truncator(layer, weight, inp, damp).factors(rank)


def truncated_weight(layer: Layer, weight: torch.Tensor, rank: int, inp: LayerInput | None,
                     damp: float = DAMP) -> torch.Tensor:
    """The dense weight (stored layout and dtype) of the rank-``rank`` truncation: what the factorized layer computes."""
    return Truncator(layer, weight, inp, damp).weight(rank)


class Keep(NamedTuple):
    """Tier 1's decompositions kept for the passes after it (:func:`whitened_spectra`): the truncators of the layers
    in ``names`` (their eigenvectors, which tier 1 makes anyway, and for a tall map U = F W) put into ``store``."""

    store: "TruncatorStore"
    names: frozenset[str]


def whitened_spectra(layers: dict[str, Layer] | list[Layer], weights: dict[str, torch.Tensor],
                     stats: "InputStatistics", align: int = 8, target: float = 0.01,
                     progress: Callable[[int, int], None] | None = None,
                     keep: Keep | None = None, decomposer: Decomposer | None = None) -> dict[str, WhitenedSpectrum]:
    """The whitened spectrum of every layer in ``layers`` that has input statistics, keyed by ``Layer.name`` in
    the layers' order. ``weights``: parameter name -> tensor. The decompositions are many small eigh calls, so
    they run on a thread per core, each with one BLAS thread: NumPy's LAPACK releases the GIL, and one thread per
    core beats OpenBLAS threads spinning against each other. ``progress(done, total)`` is
    called (on the calling thread) as each layer's spectrum comes back, in the layers' order. ``keep``: the
    truncators of its layers put into its store as they are made (the same arrays :class:`Truncator` makes: one
    decomposition per layer for tier 1 and the passes that cut factors). ``decomposer``: what decomposes each layer
    (default :func:`decompose` here; :func:`.ondevice.on`'s on a device, ``DEVICE_JOBS`` layers at a time: one
    thread's host work, F made and the kept truncator cut, beside the other's on the device)."""
    from .stats import by_name

    todo = [(layer, stats.layers[layer.name]) for layer in by_name(layers).values() if layer.name in stats.layers]

    def one(t: tuple[Layer, LayerInput]) -> WhitenedSpectrum:
        if keep is None or t[0].name not in keep.names or keep.store.holds(t[0].name):
            return whitened_spectrum(t[0], weights[t[0].param], t[1], align, target, decomposer=decomposer)
        return _kept_spectrum(t[0], weights[t[0].param], t[1], (align, target), keep.store, decomposer)

    done: list[WhitenedSpectrum] = []
    for spec in on_every_core(one, todo, DEVICE_JOBS if decomposer is not None else None):
        done.append(spec)
        if progress is not None:
            progress(len(done), len(todo))
    return {spec.layer: spec for spec in done}


def on_every_core(fn: "Callable[[_T], _R]", items: "Sequence[_T]", jobs: int | None = None,
                  share: bool = False) -> "Iterator[_R]":
    """``fn`` of each of ``items``, on ``jobs`` threads at once (default: the CPU count), each with one BLAS thread,
    yielded in the items' order (the caller's loop runs on its own thread, under the same BLAS limit). The
    decompositions are many eigh calls: NumPy's LAPACK releases the GIL, one thread per core beats OpenBLAS threads
    spinning against each other, and one BLAS thread is what the calibration runs them on, so each result is the same
    arrays as made alone (tier 1's spectra, on a cluster's workers too; the gradient pass's loss-aware truncations).
    ``share``: where there are fewer items than cores, each gets its share of the cores' BLAS threads (the sequential
    fit's stages: a Llama block's o_proj or down_proj alone; on 2 cores a 4,096 x 4,096 loss-aware truncation took
    19.5 s where one thread took 33.8 s); the audit's fit and ``factorize``'s, made alike, are the same arrays."""
    from threadpoolctl import threadpool_limits

    cores = os.cpu_count() or 1
    jobs = max(1, min(jobs or cores, len(items) or 1))
    with threadpool_limits(limits=max(1, cores // jobs) if share else 1, user_api="blas"):
        if jobs == 1:
            yield from map(fn, items)
            return
        with ThreadPoolExecutor(jobs) as pool:
            yield from pool.map(fn, items)


def _kept_spectrum(layer: Layer, weight: torch.Tensor, inp: LayerInput, ranked: tuple[int, float],
                   store: "TruncatorStore", decomposer: Decomposer | None = None) -> WhitenedSpectrum:
    """:func:`whitened_spectrum` with the decomposition's U kept: the layer's :class:`Truncator` put into ``store``
    (F made again from the weight: a copy, against the decomposition's products)."""
    bases = whitened_bases(layer, weight, inp, DAMP, decomposer=decomposer)
    store[layer.name] = Truncator.from_parts(layer, weight, [b.u for b in bases])
    return _spectrum(layer, bases, inp, *ranked)


GRADIENT_DAMP = 1e-2  # G + (GRADIENT_DAMP + out / samples) * mean(diag G) I: the output-gradient moment shrunk toward
#                      its mean (a few thousand position-samples estimate an out x out moment: directions they never
#                      moved are not free to drop, and the fewer the samples per dimension the less the estimate is
#                      trusted: a single layer's exact G is I, which 300 samples of a 128-wide output miss badly)


def weighted_bases(f: np.ndarray, gram: np.ndarray, diagonal: bool, h: np.ndarray, carried: bool,
                   damp: float = DAMP, samples: int = 0) -> tuple[np.ndarray, dict[str, list[np.ndarray]]] | None:
    """(the squared singular values, descending; the truncator's bases) of F (out x in) truncated in the KFAC metric:
    with L L^T = G + delta I (``h`` = G, out x out; delta = (``GRADIENT_DAMP`` + out / ``samples``) * mean(diag G),
    ``samples`` the position-samples G is a mean over, 0: not counted) and S S^T the input
    Gram damped as the whitening is (``damp``), F_r = L^-T [L^T F S]_r S^-1, the rank-r map with the least
    trace(G (F - F_r) X^T X (F - F_r)^T): truncated in the metric the loss puts on the layer's outputs as well as its
    inputs (SVD-LLM whitens the inputs only; LEMS's KFAC-SVD). The left form: A = L^-T U'_r, B = U'_r^T L^T F.
    ``carried`` (out > in): ``h`` is H = F^T G F (in x in) and the same F_r = F S V_r V_r^T S^-1, V the eigenvectors
    of S^T (H + delta F^T F) S (delta the same share of trace(H) / trace(F^T F)): A = F Z_r, B = Y_r^T. None where
    the moment is zero or not finite."""
    h = (h + h.T) / 2
    m, n = f.shape
    shrink = GRADIENT_DAMP + (m / samples if samples > 0 else 0.0)
    if not np.all(np.isfinite(h)):  # a gradient that overflowed: the whitened truncation, as without one
        return None
    if not carried:  # an oblique projection on the output side
        scale = float(np.trace(h)) / m if m else 0.0
        if not scale > 0 or not math.isfinite(scale):
            return None
        low = np.linalg.cholesky(h + shrink * scale * np.eye(m))
        basis = decompose(low.T @ f, gram, diagonal, damp)
        assert basis.u is not None
        return basis.sigma2, {"u": [np.linalg.solve(low.T, basis.u)], "w": [low @ basis.u]}
    ff = f.T @ f  # an oblique projection on the input side
    scale = float(np.trace(h)) / float(np.trace(ff)) if np.trace(ff) > 0 else 0.0
    if not scale > 0 or not math.isfinite(scale):
        return None
    g = np.diag(gram) if diagonal else gram
    diag = np.diagonal(g)
    lam = damp * float(np.mean(diag)) if diag.size and np.mean(diag) > 0 else damp
    s = np.linalg.cholesky(g + lam * np.eye(n))
    kk = s.T @ (h + shrink * scale * ff) @ s
    vals, v = np.linalg.eigh((kk + kk.T) / 2)
    order = np.argsort(vals)[::-1]
    v = v[:, order]
    return np.clip(vals[order], 0.0, None), {"z": [s @ v], "y": [np.linalg.solve(s.T, v)]}


@dataclass
class LossMetric:
    """What the gradient pass leaves ``factorize``: each reached layer's loss-aware truncator (``store``), the mean
    output-gradient moments (``moments``: layer -> (moment, carried to input space, position-samples), read lazily) and the layers the
    pass covered."""

    store: "MutableMapping[str, Truncator]"
    moments: "Mapping[str, tuple[np.ndarray, bool, int]]"
    layers: frozenset[str]
