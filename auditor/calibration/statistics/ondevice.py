"""Whitened decompositions on an accelerator: :func:`~.whiten.decompose`'s numbers, made with torch on a device.

With ``--device cuda`` tier 1's decompositions (the spectra, and the truncators tier 3, the rounding floor and the
uniform baseline cut their factors from) run where the statistics were read, two layers at a time
(``whiten.DEVICE_JOBS``), instead of on the host's LAPACK; the same products in the same order as
:func:`~.whiten.decompose`, in float64 by default, so the spectra, the error curves and the ranks are the CPU path's
to float64 rounding (tests/test_ondevice.py).

Float32 eigenvectors were measured and are not the default (``EIGH``). With every product, the energies q_i, the
total ||F X^T||^2 and each sigma_i^2 kept in float64, and the float32 eigenvectors made orthonormal in float64 (a
QR, which keeps each leading set of them spanning the same space) with their sigma_i^2 taken as float64 Rayleigh
quotients, every number shown is still exact for the basis the truncation uses; but that basis is not the best one
where the error curve is read. A whitened spectrum spans six decades and more of sigma^2, and float32 resolves an
eigenvector only to about eps32 sigma_1^2 / gap: the directions at a 0.5% layer-output error (sigma_i^2 about 1e-6
of sigma_1^2 on the char transformer) come out mixed. On the trained char transformer with its calibration
(2026-12-07) every layer's ranks for 1, 2, 5 and 10% error and its suggested rank were the same as float64's, but
the layer-output errors came out up to 4.6e-5 larger where the error is 0.5% or more (0.9% of it; 1.9e-4 anywhere
on the curve), the digits MLP's and CNN's up to 6e-6 and 2.4e-5: outside what the reports print. An H100's float64
(67 TFLOPS) makes the decompositions a small part of the audit anyway. ``eigh=torch.float32`` keeps the measured
route for that comparison.

Alive at once on the device per layer being decomposed: F, G (in x in, float64) and the products of the CPU path
(out x in once, two k x k); the bases come back to the host as NumPy float64, as :class:`~.whiten.Basis` holds them,
where the kept truncators are cut.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from .whiten import DAMP, GRADIENT_DAMP, Basis, Decomposer, short_side_products

EIGH = torch.float64  # the eigensolver's precision on a device (the module docstring: float32 measured, not kept)


def _put(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device`` as float64."""
    return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=torch.float64)


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def _eigh(a: torch.Tensor, eigh: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues and eigenvectors (columns) of the symmetric float64 ``a``, largest first. ``eigh`` float32: the
    vectors solved in float32, made orthonormal in float64 and ordered by their float64 Rayleigh quotients, which
    stand for the eigenvalues; a float32 solve that fails or is not finite is made in float64 instead."""
    v32 = None
    if eigh != torch.float64:
        try:
            v32 = torch.linalg.eigh(a.to(eigh))[1]
        except RuntimeError:  # torch.linalg.LinAlgError: the float32 solver did not converge
            v32 = None
        if v32 is not None and not bool(torch.isfinite(v32).all()):
            v32 = None
    if v32 is None:
        vals, v = torch.linalg.eigh(a)
        order = torch.argsort(vals, descending=True, stable=True)
        return vals[order], v[:, order]
    v, _ = torch.linalg.qr(v32.flip(-1).to(a.dtype))  # largest first; the QR keeps each leading span
    ritz = ((v.T @ a) * v.T).sum(dim=1)
    order = torch.argsort(ritz, descending=True, stable=True)
    return ritz[order], v[:, order]


def _short_side(f: torch.Tensor, gram: torch.Tensor, diagonal: bool, lam: float,
                eigh: torch.dtype) -> tuple[torch.Tensor, ...]:
    """out <= in: M = F G F^T (undamped) and the eigenvectors of M + lam F F^T, as whiten.decompose forms them."""
    mm, ff = short_side_products(f, gram, diagonal)
    mm = (mm + mm.T) / 2
    sigma2, u = _eigh(mm + lam * ff, eigh)
    q = ((u.T @ mm) * u.T).sum(dim=1)
    return u, sigma2, q, torch.trace(mm)


def _long_side(f: torch.Tensor, g: torch.Tensor, lam: float, need_u: bool,
               eigh: torch.dtype) -> tuple[torch.Tensor | None, ...]:
    """out > in: the eigenvectors V of S^T (F^T F) S and U = F S V / sigma, zero where F S does not reach; float32
    vectors' U made orthonormal by a QR in V's order (its leading columns span what F S V's leading ones span)."""
    n = g.shape[0]
    s = torch.linalg.cholesky(g + lam * torch.eye(n, dtype=g.dtype, device=g.device))
    a = f.T @ f
    a = (a + a.T) / 2
    kk = s.T @ a @ s
    sigma2, v = _eigh((kk + kk.T) / 2, eigh)
    sig = sigma2.clamp(min=0).sqrt()
    keep = sig > sig[0] * 1e-13 if sig.numel() and float(sig[0]) > 0 else torch.zeros_like(sig, dtype=torch.bool)
    w = torch.zeros((n, n), dtype=g.dtype, device=g.device)
    w[:, keep] = (s @ v[:, keep]) / sig[keep]
    t = w.T @ a  # u^T F, k x n
    u = f @ w if need_u or eigh != torch.float64 else None
    if eigh != torch.float64:
        u, _ = torch.linalg.qr(u)
        u[:, ~keep] = 0  # directions F never reaches carry no energy, as on the CPU
        t = u.T @ f
    q = ((t @ g) * t).sum(dim=1)
    return (u if need_u else None), sigma2, q, (g * a).sum()


def decompose_on(f: np.ndarray, gram: np.ndarray, diagonal: bool = False, damp: float = DAMP,
                 need_u: bool = True, *, device: torch.device, eigh: torch.dtype = EIGH) -> Basis:
    """:func:`~.whiten.decompose` of one group's F (out x in) under G (in x in, or its diagonal) on ``device``, its
    eigenvectors solved in ``eigh`` (the module docstring)."""
    m, n = f.shape
    ft, gt = _put(f, device), _put(gram, device)
    diag = gt if diagonal else torch.diagonal(gt)
    scale = float(diag.mean()) if diag.numel() else 0.0
    lam = damp * scale if scale > 0 else damp
    if diagonal and m > n:  # a tall map over one-hot inputs: the dense route, as on the CPU
        gt, diagonal = torch.diag(gt), False
    if m <= n:
        u, sigma2, q, total = _short_side(ft, gt, diagonal, lam, eigh)
        u = u if need_u else None
    else:
        u, sigma2, q, total = _long_side(ft, gt, lam, need_u, eigh)
    return Basis(_host(u) if u is not None else None, np.clip(_host(sigma2), 0.0, None),
                 np.clip(_host(q), 0.0, None), float(total), lam)


def weighted_on(f: np.ndarray, gram: np.ndarray, diagonal: bool, h: np.ndarray, carried: bool,
                damp: float = DAMP, samples: int = 0, *,
                device: torch.device) -> tuple[np.ndarray, dict[str, list[np.ndarray]]] | None:
    """:func:`~.whiten.weighted_bases` (the gradient pass's loss-aware truncation) made on ``device``: its products,
    Cholesky factors, solves and eigendecomposition in float64 there, the whitened decomposition of L^T F by
    :func:`decompose_on`; the same numbers as the host's to float64 rounding (tests/test_ondevice.py)."""
    h = (h + h.T) / 2
    m, n = f.shape
    shrink = GRADIENT_DAMP + (m / samples if samples > 0 else 0.0)
    if not np.all(np.isfinite(h)):  # a gradient that overflowed: the whitened truncation, as without one
        return None
    ht, ft = _put(h, device), _put(f, device)
    if not carried:  # an oblique projection on the output side
        scale = float(np.trace(h)) / m if m else 0.0
        if not scale > 0 or not math.isfinite(scale):
            return None
        low = torch.linalg.cholesky(ht + shrink * scale * torch.eye(m, dtype=torch.float64, device=device))
        basis = decompose_on(_host(low.T @ ft), gram, diagonal, damp, device=device)
        u = _put(basis.u, device)
        return basis.sigma2, {"u": [_host(torch.linalg.solve(low.T, u))], "w": [_host(low @ u)]}
    ff = ft.T @ ft  # an oblique projection on the input side
    reach = float(torch.trace(ff))
    scale = float(torch.trace(ht)) / reach if reach > 0 else 0.0
    if not scale > 0 or not math.isfinite(scale):
        return None
    g = _put(np.diag(gram) if diagonal else gram, device)
    diag = torch.diagonal(g)
    lam = damp * float(diag.mean()) if diag.numel() and float(diag.mean()) > 0 else damp
    s = torch.linalg.cholesky(g + lam * torch.eye(n, dtype=torch.float64, device=device))
    kk = s.T @ (ht + shrink * scale * ff) @ s
    vals, v = torch.linalg.eigh((kk + kk.T) / 2)
    order = torch.argsort(vals, descending=True, stable=True)
    v = v[:, order]
    return (np.clip(_host(vals[order]), 0.0, None),
            {"z": [_host(s @ v)], "y": [_host(torch.linalg.solve(s.T, v))]})


def on(device: torch.device, eigh: torch.dtype = EIGH) -> Decomposer:
    """:func:`decompose_on` on ``device``, called as :func:`~.whiten.decompose` is (what
    :func:`~.whiten.whitened_spectra` takes as its ``decomposer``)."""
    def decompose(f: np.ndarray, gram: np.ndarray, diagonal: bool = False, damp: float = DAMP,
                  need_u: bool = True) -> Basis:
        return decompose_on(f, gram, diagonal, damp, need_u, device=device, eigh=eigh)

    return decompose


def weighted(device: torch.device) -> "Callable[..., tuple[np.ndarray, dict[str, list[np.ndarray]]] | None]":
    """:func:`weighted_on` on ``device``, called as :func:`~.whiten.weighted_bases` is."""
    def bases(f: np.ndarray, gram: np.ndarray, diagonal: bool, h: np.ndarray, carried: bool, damp: float = DAMP,
              samples: int = 0) -> tuple[np.ndarray, dict[str, list[np.ndarray]]] | None:
        return weighted_on(f, gram, diagonal, h, carried, damp, samples, device=device)

    return bases


__all__ = ["EIGH", "decompose_on", "on", "weighted", "weighted_on"]
