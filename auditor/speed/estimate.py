"""``--estimate``: what the default audit will cost, predicted before it runs (docs/performance.md, "Estimate").

Three steps, each testable alone:

- :func:`shapes_of` reads the model's weights as shapes (every weight of two or more dimensions as out x in, the
  repeated blocks, the parameters whose products a forward pays for); :func:`workload_of` the calibration's rows,
  tokens per row and rows per batch, and the options that change the cost;
- :func:`measure` takes a few seconds on this machine: one repeated block's forward and backward at the real batch
  shape (and the activations it keeps for the backward), one whitened decomposition of the costliest layer's shape
  (``calibration.statistics.whiten.decompose``), one Gram's eigenvalues (the spectra's path) and one float64
  product (the Gram sums' rate), each capped to take seconds and scaled by FLOPs;
- :func:`predict` is arithmetic only (no clock): each stage of the default calibrated audit as passes over the rows
  times a forward's cost, decompositions counted per layer and scaled by their FLOPs (m n min(m, n)) from the
  measured one, and each stage's peak host memory from what docs/calibration.md ("What is alive at once") says is
  alive in it.

:func:`refuse_if_short` is the check a calibrated audit makes before it starts: one line (an ``AuditError``, exit 2)
when the predicted peak exceeds the memory available, or what it writes the free space of its scratch folder.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
from torch import nn

from ..calibration.data.inputs import bounded_rows  # rows a batch of a large vocabulary's logits is cut to
from ..calibration.measure.staged import stage_ends  # the first stage's rows: what a plan far from the tolerance reads
from ..calibration.measure.verify import search_rows  # the held-out rows' search part
from ..calibration.metrics.chunks import CHUNK_VALUES  # logits read at once where log-probabilities are taken
from ..calibration.tiers.budget import FRONTIER  # plans around the found one, a uniform baseline beside each
from ..calibration.tiers.fisher import CARRY_VALUES  # a wide head's output gradient carried back in chunks past it
from ..calibration.tiers.fisher import SAMPLES  # sampled label sets (or projections) per fit batch, one backward each
from ..calibration.tiers.passes import VERIFY_BACKSTOPS  # plans the search measures below the one it found
from ..calibration.tiers.sensitivity import GRADIENT_POSITIONS  # positions the gradient pass reads at most
from ..calibration.statistics.refine import CHECK, EPOCHS  # the block refinement's most epochs, its held-back share
from ..calibration.statistics.sequential import input_key  # the fit's own test of "one input tensor"
from ..errors import AuditError

# The calibration's own constants are imported above from the code that uses them (tests/test_estimate.py fails on a
# copy); what follows is the cost model's own, measured or counted on the sample models (docs/performance.md):
GRADIENT_PASSES = 2.0  # the gradient pass: forward, then each checkpointed block's forward again with its backward
SEARCH_PLANS = 8  # tier 3's plans measured (8 to 13 on the sample models), the VERIFY_BACKSTOPS besides
FULL_PLANS = 3  # of those, the plans near the tolerance that read every search row (staged.py); the rest its head
TRACE_FORWARDS = 2.0  # the trace: symbolic tracing and shape propagation, about two forwards of the example input
# the reports: a page with a chart per layer (html, pdf) costs per layer; measured on the sample models under load
REPORT_SECONDS = {"pdf": 1.0, "html": 1.0}  # each, plus REPORT_LAYER_SECONDS per layer; other formats: the default
REPORT_LAYER_SECONDS = {"pdf": 1.2, "html": 1.2}
DEFAULT_REPORT_SECONDS = 0.3
CHART_RSS = 200 * 2**20  # the plotting library and its figures, alive while an html or pdf report renders
REPORT_BYTES = {"pdf": 400_000, "html": 600_000}  # measured on the sample models' reports; else 20 kB + per layer
STAGES = ("load", "trace", "spectra", "calibration data", "statistics", "references", "gradients", "rounding floor",
          "tier 3", "verification", "uniform baseline", "rank or bits", "plan check", "reports")
BYTE_PLANS = 15  # rank or bits: three families at up to four sizes (the budget, the rank plan's, uniform int4's and
#                 int8's) and three uniform baselines, each measured once
BYTE_DECOMPOSITIONS = 9  # every layer's options (its rank SVD and two corrections'), then the plans that factorize:
#                          rank only at four sizes, uniform truncation, and the joint plans' few factorized layers
#                          (about one layer in ten on the trained Llama: counted as one decomposition of every layer)


@dataclass(frozen=True)
class Shapes:
    """The model as shapes. ``layers``: (out, in) of every weight of two or more dimensions outside the embeddings;
    ``block_layers``: those of one repeated block; ``flop_params``: the parameters a forward multiplies by each
    token (every such weight, an output head tied to the embedding too), ``block_flop_params`` one block's;
    ``embedding_params`` the lookup tables'."""

    weight_bytes: int
    layers: tuple[tuple[int, int], ...]
    block_layers: tuple[tuple[int, int], ...] = ()
    blocks: int = 0
    flop_params: int = 0
    block_flop_params: int = 0
    embedding_params: int = 0
    element_bytes: int = 4
    mapped_bytes: int = 0  # of weight_bytes, the checkpoint file's own pages (sources/checkpoint.py: never copied)


@dataclass(frozen=True)
class Workload:
    """The calibration and the options, as counts."""

    fit_rows: int
    holdout_rows: int
    tokens: int  # positions per row (1 for a row of features)
    batch_rows: int  # rows per forward call
    outputs: int  # width of the model's output per position (a vocabulary for a language model)
    token_inputs: bool = False  # token ids in: a language model's metric (per-row sums, no dense outputs kept)
    formats: tuple[str, ...] = ("text",)
    threads: int = 1
    split: bool = True
    calibrated: bool = True
    device: str | None = None
    offload: bool = False
    example_share: float = 1.0  # the trace's example input's positions over a measured batch's
    compared: int = 1  # a batch's outputs alive at once while a plan is measured (2 for KL: the dense one too)
    byte_plan: bool = False  # --budget-bytes / --bits-per-weight: the rank-or-bits pass runs
    sensitivity: str = "gradients"  # tier 3's sensitivity: "gradients" (the default), "probes" (--probe), "" (none)


@dataclass(frozen=True)
class Measurements:
    """What :func:`measure` timed here (seconds) and counted (bytes); tests inject them."""

    base_rss: int  # the process before the model: interpreter, torch, numpy
    load_seconds: float
    block_forward: float  # one repeated block's forward at (batch_rows, tokens); the whole model without blocks
    block_backward: float
    block_saved_bytes: int  # the tensors that forward keeps for its backward
    hidden_bytes: int  # one batch's hidden state between blocks
    decompose_seconds: float  # one whitened decomposition at decompose_shape
    decompose_shape: tuple[int, int]
    eig_seconds: float  # the eigenvalues of one Gram of eig_width on one BLAS thread (the spectra's path: values of
    #                     W^T W, each layer on one of the spectra's threads)
    eig_width: int
    gemm_flops: float  # float64 multiply-adds x 2 per second (X^T X sums)
    seconds: float = 0.0  # what measuring took
    logit_seconds: float = 0.0  # the gradient pass's work per logit and sampled label set: a label drawn from the
    #                             softmax, its negative log-likelihood and that loss's backward (metrics/chunks.py)
    gemm32_flops: float = 0.0  # float32 multiply-adds x 2 per second (the gradient pass's moments g^T g); 0: unmeasured
    block_carry: float = 0.0  # the block's backward to its inputs alone (no weight gradients: the gradient pass's);
    #                           0: unmeasured (the whole backward counted)
    stats_forward: float = 0.0  # the block's forward with its layers' input Grams added, as the statistics pass runs
    #                             it (float64 rows and sums); 0: unmeasured (block_forward and the Grams' products)
    grad_forward: float = 0.0  # the block's forward recording for a backward (the gradient pass's, the refinement's
    #                            training steps); 0: unmeasured (block_forward, timed without gradients, counted)
    loss_seconds: float = 0.0  # one loss-aware truncation (whiten.weighted_bases) at decompose_shape, on the BLAS
    #                            threads as the gradient pass makes them one layer at a time; 0: unmeasured (whitened)
    stage_shares: tuple[float, ...] = ()  # the sequential fit's stages in the block: the share of its multiplied
    #                                       parameters each stage's runs reach (); (): unmeasured (each layer a stage)
    gemm1_flops: float = 0.0  # float64 multiply-adds x 2 per second on one BLAS thread (the decompositions' products);
    #                           0: unmeasured (gemm_flops)
    stage_layers: tuple[int, ...] = ()  # the weighted modules of each of stage_shares' stages, in call order (a
    #                                     Llama block's 3, 1, 2, 1); (): unmeasured (each layer a stage)
    refine_step: float = 0.0  # one block's refinement training step, its Linears factored at the ranks the budget
    #                           leaves (refine.step_seconds), on the device where one was named (the refinement
    #                           trains there); 0: unmeasured (the dense block's, recording, backward)
    device_linalg: tuple[float, float, float] = (0.0, 0.0, 0.0)  # on an accelerator (--device cuda): one whitened
    #   decomposition and one loss-aware truncation at decompose_shape made there (statistics/ondevice.py), and its
    #   float64 FLOP/s; zeros: none (every decomposition on the host's threads)


@dataclass(frozen=True)
class Stage:
    name: str
    seconds: float
    peak_bytes: int
    note: str = ""


@dataclass(frozen=True)
class Estimate:
    stages: tuple[Stage, ...]
    peak_rss_bytes: int
    peak_device_bytes: int | None
    disk_bytes: int
    measure_seconds: float = 0.0
    available_bytes: int | None = None
    basis: dict[str, Any] = field(default_factory=dict)
    mapped_bytes: int = 0  # of every stage's peak, the weights mapped from the checkpoint (paged, not held)
    slack_seconds: float = 0.0  # of the wall, what the block refinement saves if every block stops at its first epoch
    gram_bytes: int = 0  # of the disk, the statistics' Grams (beside the cache entry when the cache is on)

    @property
    def wall_seconds(self) -> float:
        return sum(s.seconds for s in self.stages)

    @property
    def needed_bytes(self) -> int:
        """The peak less the mapped weights: the memory the audit must hold (the kernel pages the weights from the
        checkpoint as they are read, and drops them under pressure)."""
        return self.peak_rss_bytes - self.mapped_bytes

    def as_dict(self) -> dict[str, Any]:
        return {"wall_seconds": round(self.wall_seconds, 3),
                "least_wall_seconds": round(self.wall_seconds - self.slack_seconds, 3),
                "peak_rss_bytes": self.peak_rss_bytes,
                "mapped_bytes": self.mapped_bytes, "needed_bytes": self.needed_bytes,
                "peak_device_bytes": self.peak_device_bytes, "disk_bytes": self.disk_bytes,
                "measure_seconds": round(self.measure_seconds, 3), "available_bytes": self.available_bytes,
                "stages": [{"stage": s.name, "wall_seconds": round(s.seconds, 3), "peak_rss_bytes": s.peak_bytes,
                            "note": s.note} for s in self.stages],
                "basis": self.basis}


# ---- the arithmetic ------------------------------------------------------------------------------------------------
def _batches(rows: int, per: int) -> int:
    return math.ceil(rows / max(1, per)) if rows > 0 else 0


def _cube(shape: tuple[int, int]) -> float:
    m, n = shape
    return float(m) * n * min(m, n)


def forward_seconds(sh: Shapes, me: Measurements, backward: bool = False, carry: bool = False,
                    grad: bool = False) -> float:
    """One batch through the whole model: the block's time times the blocks, and the weights outside them by their
    share of the multiplied parameters (without blocks the measurement was the whole model). The forward without
    gradients, or with ``grad`` recording for a backward where that was measured; ``backward``: the backward with
    every weight's gradient (the refinement's, whose factors make each planned weight's); with ``carry`` the backward
    to the inputs alone where it was measured (the gradient pass's)."""
    t = _block_seconds(me, backward, carry, grad)
    if sh.blocks == 0 or sh.block_flop_params == 0:
        return t
    outside = max(0, sh.flop_params - sh.blocks * sh.block_flop_params)
    return t * (sh.blocks + outside / sh.block_flop_params)


def _block_seconds(me: Measurements, backward: bool = False, carry: bool = False, grad: bool = False) -> float:
    """One repeated block's measured time (the whole model's without blocks), as :func:`forward_seconds` reads it."""
    if backward:
        return me.block_carry if carry and me.block_carry > 0 else me.block_backward
    return me.grad_forward if grad and me.grad_forward > 0 else me.block_forward


def _whiten_cost(shape: tuple[int, int]) -> float:
    """A whitened decomposition's products in multiply-adds, as whiten.decompose forms them: out <= in, F G, (F G)
    F^T and the energies U^T M (m n^2 + m^2 n + m^3); out > in, F^T F, S^T (F^T F) S, S V, W^T A, (T G) T and
    U = F W (2 m n^2 + 5 n^3). Its eigenvectors (of min(m, n) rows) are :func:`_eigen_seconds`'."""
    m, n = float(shape[0]), float(shape[1])
    return m * n * n + m * m * n + m ** 3 if m <= n else 2.0 * m * n * n + 5.0 * n ** 3


def _loss_cost(shape: tuple[int, int]) -> float:
    """A loss-aware truncation's products in multiply-adds (whiten.weighted_bases): out <= in, the output moment's
    Cholesky factor, L^T F, the whitened decomposition of that and the bases back (m n^2 + 2 m^2 n + 3 m^3); out >
    in, F^T F, S^T (H + d F^T F) S, S V and one solve (m n^2 + 4 n^3). One eigendecomposition of min(m, n) rows."""
    m, n = float(shape[0]), float(shape[1])
    return m * n * n + 2.0 * m * m * n + 3.0 * m ** 3 if m <= n else m * n * n + 4.0 * n ** 3


def _linalg_seconds(sh: Shapes, seconds: float, shape: tuple[int, int], cost: Callable[[tuple[int, int]], float],
                    flops: float) -> float:
    """Every layer's decomposition of one kind: its products at ``flops`` (FLOP/s, where it was measured) and its
    eigendecomposition of min(m, n) rows, whose time a k^3 is what the one measured at ``shape`` (``seconds``) left
    after its products. The eigenvectors are most of a square layer's decomposition (at 4,096 x 4,096 on one thread
    here, 27.5 s of which about 6 s products): scaling the whole decomposition by its products, as this did before,
    predicted a fifth of it."""
    return sum(_linalg_each(seconds, shape, cost, flops, sh.layers))


def _linalg_each(seconds: float, shape: tuple[int, int], cost: Callable[[tuple[int, int]], float], flops: float,
                 layers: tuple[tuple[int, int], ...]) -> list[float]:
    """:func:`_linalg_seconds`'s time for each of ``layers``."""
    products = 2.0 * cost(shape) / flops
    eigen = max(0.0, seconds - products) / max(1.0, float(min(shape)) ** 3)
    return [2.0 * cost(s) / flops + eigen * float(min(s)) ** 3 for s in layers]


def _one_thread(me: Measurements) -> float:
    return me.gemm1_flops if me.gemm1_flops > 0 else me.gemm_flops


def decompositions_seconds(sh: Shapes, me: Measurements) -> float:
    """Every layer's whitened decomposition, on one BLAS thread as the audit makes them (:func:`_linalg_seconds`)."""
    return _linalg_seconds(sh, me.decompose_seconds, me.decompose_shape, _whiten_cost, _one_thread(me))


def device_decompositions(sh: Shapes, me: Measurements) -> tuple[float, float] | None:
    """(every layer's whitened decomposition, every layer's loss-aware truncation) on the device, one after another
    (its layers overlap only with the host's work: whiten.DEVICE_JOBS), scaled from the ones timed there as the
    host's are (:func:`_linalg_seconds`); None where none was timed on a device."""
    whiten, loss, flops = me.device_linalg
    if flops <= 0:
        return None
    return (_linalg_seconds(sh, whiten, me.decompose_shape, _whiten_cost, flops),
            _linalg_seconds(sh, loss, me.decompose_shape, _loss_cost, flops))


def tier1_seconds(sh: Shapes, me: Measurements, cores: int) -> float:
    """Tier 1's decompositions as the statistics pass makes them on the host (calibration/session.py): each block's
    layers once the block's statistics are read, on every core at once (one BLAS thread a layer, each layer to the
    first thread free), the next block's forwards waiting; then the layers outside the blocks, likewise. Each
    layer's decomposition (:func:`decompositions_seconds`) and its kept truncator's cut (m n min(m, n) multiply-adds
    at one thread's rate). (2026-12-07: the whole audit's divided by the cores; the 7B-wide depth-2 audit's
    statistics then ran 1.35x their estimate: a block's seven layers do not fill two cores evenly, and its output
    head, 32,000 x 4,096 and alone at the end, runs on one.)"""
    def per(layers: "list[tuple[int, int]] | tuple[tuple[int, int], ...]") -> list[float]:
        made = _linalg_each(me.decompose_seconds, me.decompose_shape, _whiten_cost, _one_thread(me), tuple(layers))
        return [t + 2.0 * _cube(s) / _one_thread(me) for t, s in zip(made, layers)]

    if not sh.block_layers:
        return staged_seconds(per(sh.layers), (len(sh.layers),), cores)
    rest = Counter(sh.layers)
    rest.subtract({s: c * sh.blocks for s, c in Counter(sh.block_layers).items()})
    outside = [s for s, c in rest.items() for _ in range(max(0, c))]
    return (sh.blocks * staged_seconds(per(sh.block_layers), (len(sh.block_layers),), cores)
            + staged_seconds(per(outside), (len(outside),), cores))


def loss_decompositions_seconds(sh: Shapes, me: Measurements) -> float:
    """Every layer's loss-aware truncation (the gradient pass's, and the sequential fit's of W* with its moments), on
    one BLAS thread as the calibration makes them, one layer at a time (:func:`_linalg_seconds`); the whitened
    decompositions' time where it was not measured. (2026-12-07: timed and counted at every thread's rate, about
    half the time on 2 cores.)"""
    return sum(_fit_each(me, True)(sh.layers))


def _fit_each(me: Measurements, loss_aware: bool) -> Callable[[tuple[tuple[int, int], ...]], list[float]]:
    """Each layer's truncation on one BLAS thread: loss-aware (with the output-gradient moments; the whitened
    decomposition's time where that was not measured), or whitened."""
    if loss_aware and me.loss_seconds > 0:
        return lambda layers: _linalg_each(me.loss_seconds, me.decompose_shape, _loss_cost, _one_thread(me), layers)
    return lambda layers: _linalg_each(me.decompose_seconds, me.decompose_shape, _whiten_cost, _one_thread(me), layers)


def _speedup(threads: int, cores: int, scale: float) -> float:
    """``threads`` BLAS threads' speed-up over one, interpolated linearly from 1 (one thread) to ``scale`` (the
    measured rate of all ``cores`` threads over one's)."""
    return 1.0 + (max(1.0, scale) - 1.0) * (threads - 1) / (cores - 1) if cores > 1 else 1.0


def _span(times: "Iterable[float]", threads: int) -> float:
    """``times`` taken in order, each to the first of ``threads`` free: the busiest thread's total."""
    free = [0.0] * max(1, threads)
    for t in times:
        free[free.index(min(free))] += t
    return max(free)


def staged_seconds(times: list[float], counts: tuple[int, ...], cores: int, scale: float = 1.0) -> float:
    """Layers truncated a stage at a time, a stage's on ``cores`` threads at once (whiten.on_every_core: each
    layer, in order, to the first thread free), the stages one after another (each reads the inputs the one before
    it fitted): the sum of the stages' spans. A stage of fewer layers than cores gives each layer its share of the
    BLAS threads: its time (``times`` are one thread's) divided by the speed-up of that many threads, interpolated
    linearly up to ``scale``, the measured rate of all ``cores`` threads over one's. Each layer a stage where
    ``counts`` do not cover ``times``. (2026-12-07: a stage of one layer on one thread: 2 of a Llama block's 4.)"""
    total, i = 0.0, 0
    for c in _stage_counts(counts, len(times)):
        jobs = max(1, min(cores, c))
        speedup = _speedup(cores // jobs, cores, scale)
        total, i = total + _span((t / speedup for t in times[i:i + c]), jobs), i + c
    return total


def _stage_counts(counts: tuple[int, ...], layers: int) -> tuple[int, ...]:
    """The measured stages' sizes where they cover the ``layers`` a block holds; else each layer a stage."""
    return counts if sum(counts) == layers else (1,) * layers


def _solve_cost(shape: tuple[int, int], carried: bool) -> float:
    """W*'s solve in multiply-adds (statistics/sequential.py: fitted_map, ridge_solve): F C (m n^2), the Cholesky
    factor of G + mu I (n^3 / 6) and its two triangular solves (n^2 m); a tall layer's loss-aware fit also solves T
    (n^3 / 6 + n^3) and carries its moment, T^T H T (2 n^3). (2026-12-07: not counted; at the 7B shape about
    44 min of one thread's products, 33 min of the fit on 2 cores.)"""
    m, n = float(shape[0]), float(shape[1])
    return m * n * n + n ** 3 / 6 + n * n * m + ((n ** 3 / 6 + n ** 3 + 2 * n ** 3) if carried else 0.0)


def fit_decompositions_seconds(sh: Shapes, wl: Workload, me: Measurements, loss_aware: bool) -> float:
    """The sequential fit's solves and truncations of W* (statistics/sequential.py: a stage's at once,
    _stage_truncators): a repeated block's by its measured stages (:func:`staged_seconds`), every block alike; the
    layers outside the blocks (each layer of a model without blocks) one after another, each on every core."""
    truncate = _fit_each(me, loss_aware)

    def each(layers: tuple[tuple[int, int], ...]) -> list[float]:
        return [t + 2.0 * _solve_cost(s, loss_aware and s[0] > s[1]) / _one_thread(me)
                for t, s in zip(truncate(layers), layers)]

    cores, scale = _cores(sh, wl), me.gemm_flops / _one_thread(me)
    if not sh.block_layers:
        return staged_seconds(each(sh.layers), (), cores, scale)
    block = each(sh.block_layers)
    outside = sum(each(sh.layers)) - sh.blocks * sum(block)
    return (sh.blocks * staged_seconds(block, me.stage_layers, cores, scale)
            + max(0.0, outside) / _speedup(cores, cores, scale))  # each alone, on every core


SPECTRA_WORKERS = 4  # spectra/executor.py's ThreadExecutor: min(4, the CPU count) threads without -j


def spectra_seconds(sh: Shapes, me: Measurements, cores: int = 1) -> float:
    """Every weight's singular values as spectra/backend.py computes them: the float64 Gram of its short side
    (m n min(m, n) multiply-adds, at one thread's rate) and that Gram's eigenvalues (scaled by min(m, n)^3 from the
    one timed on one BLAS thread), the layers largest first on the spectra's threads at once (min(4, ``cores``),
    each taking the next to the first thread free), each with its share of the cores' BLAS threads. (2026-12-07:
    every layer one after another at every thread's rate: 2.1x the 7B-wide depth-2 shape's measured 71 s, 2.5-3.7x
    the 1.1B shape's.)"""
    unit = me.eig_seconds / max(1.0, float(me.eig_width) ** 3)
    per = sorted((2.0 * _cube(s) / _one_thread(me) + unit * float(min(s)) ** 3 for s in sh.layers), reverse=True)
    workers = max(1, min(SPECTRA_WORKERS, cores, len(per)))
    # spectra/executor.py: each thread's BLAS, cores // workers threads (all of them for a single thread)
    return _span(per, workers) / _speedup(cores // workers, cores, me.gemm_flops / _one_thread(me))


def _rows(wl: Workload) -> dict[str, int]:
    """Rows each calibrated stage forwards: the search and verification halves of the held-out rows, the gradient
    pass's share of the fit rows, tier 3's rows (the dense head once per row read, the plans' stages), the uniform
    baseline's (beside each of the ``FRONTIER`` plans on the rows it read: every search row for those near the
    tolerance, its first stage's for the rest; 2026-12-07: beside every plan of the search, on every search row)."""
    held = wl.holdout_rows or wl.fit_rows
    search = search_rows(held) if wl.split else held
    verify = held - search if wl.split and held >= 2 else held
    grad, grad_batches = gradient_rows(wl)
    head = stage_ends(search)[0]
    plans = SEARCH_PLANS + VERIFY_BACKSTOPS
    full = min(FULL_PLANS, plans)
    tier3 = search + (plans - full) * head + full * search
    frontier = min(FRONTIER, plans)
    baseline = min(full, frontier) * search + (frontier - min(full, frontier)) * head
    return {"search": search, "verify": verify, "gradient": grad, "gradient batches": grad_batches, "tier3": tier3,
            "plans": plans, "baseline": baseline}


def gradient_rows(wl: Workload) -> tuple[int, int]:
    """(rows, batches) the gradient pass reads, as tiers/sensitivity.gradient_rows picks them from a language model's
    fit batches: where those hold more than GRADIENT_POSITIONS positions, each batch's first rows, the same share of
    each rounded up (at least one), then joined into batches of at most ``batch_rows`` rows; every fit row where they
    hold no more. (2026-12-07: counted as GRADIENT_POSITIONS / tokens rows; the rounding up of each batch's share
    read 15 rows in 4 batches where 8 in 2 were counted on the 135M shape.) Other inputs: that many rows, batched."""
    b = max(1, wl.batch_rows)
    if not wl.token_inputs:
        rows = min(wl.fit_rows, math.ceil(GRADIENT_POSITIONS / max(1, wl.tokens)))
        return rows, _batches(rows, b)
    sizes = [min(b, wl.fit_rows - i) for i in range(0, max(0, wl.fit_rows), b)]
    if wl.fit_rows * wl.tokens <= GRADIENT_POSITIONS:
        return wl.fit_rows, len(sizes)
    share = GRADIENT_POSITIONS / (wl.fit_rows * wl.tokens)
    parts = [min(n, max(1, math.ceil(share * n))) for n in sizes]
    batches, held = 0, 0
    for p in parts:  # sensitivity._joined: a batch closed when the next part would pass batch_rows rows
        if held and held + p > b:
            batches, held = batches + 1, 0
        held += p
    return sum(parts), batches + (1 if held else 0)


def fit_runs(sh: Shapes, shares: tuple[float, ...] = ()) -> float:
    """The sequential fit's runs per fit batch, in forwards of the whole model (statistics/sequential.py). A repeated
    block runs dense once, reading every stage's dense rows and its output (the refinement's aim, the next block's
    input); each of its stages then runs the block with the weights fitted so far, ending as the stage's last layer
    is reached, so costing the block's multiplied parameters before its first layer: the previous stage's end in
    ``shares`` as measured (a Llama block's four stages reach 0.25, 0.33, 0.78 and 1 of it, so its stages' runs
    cost 0, 0.25, 0.33 and 0.78), else each layer a stage (the layers in the order the block registers them: a
    transformer block's call order; the bound, as layers reading one input are one stage); then the fitted block
    once more (the next block's input); each layer outside the blocks a stage of two runs of the model outside them
    (an output head reads the last block's kept outputs, the blocks passing them on; a layer before the blocks ends
    the run as it is reached). Without repeated blocks every stage is two runs of the whole model, ending likewise.
    (2026-12-07: each stage ran the dense block too, 2 x shares + 2 runs; then each stage's run went on to its last
    layer, shares + 2.)"""
    if not shares:
        layers = sh.block_layers or sh.layers
        total = float(sum(m * n for m, n in layers)) or 1.0
        cum, ends = 0, []
        for m, n in layers:
            cum += m * n
            ends.append(cum / total)
        shares = tuple(ends)
    share = sum(shares[:-1])  # each stage's run ends where the stage starts: the previous stage's end
    if not sh.block_layers:
        return 2 * share
    inside = sh.blocks * sh.block_flop_params / max(1, sh.flop_params)  # the blocks' share of a forward
    outside = max(0, len(sh.layers) - sh.blocks * len(sh.block_layers))
    return (share + 2) * inside + 2 * outside * (1 - inside)


def refinement_seconds(wl: Workload, check: float, step: float, epochs: int = EPOCHS) -> float:
    """The block refinement at its most epochs (statistics/refine.py), summed over the blocks: the fit batches but
    the last one in ``CHECK`` trained every epoch (``step``: a full batch's forward recording for the backward, and
    the backward, through every block), the held-back ones run forward (``check``) once before the first epoch and
    after each (nothing refined with one fit batch). Training stops at the first epoch that does not lower the
    held-back error: this is the most it costs."""
    b = max(1, wl.batch_rows)
    sizes = [min(b, wl.fit_rows - i) for i in range(0, max(0, wl.fit_rows), b)]
    if len(sizes) < 2:
        return 0.0
    held = sum(sizes[len(sizes) - max(1, len(sizes) // CHECK):])
    trained = wl.fit_rows - held
    return (epochs * trained * step + (epochs + 1) * held * check) / b


def _refinement(sh: Shapes, wl: Workload, me: Measurements, epochs: int = EPOCHS) -> float:
    """The refinement of every repeated block (nothing outside them is refined): each step the block's factored
    training step where it was measured (at the budget's ranks; on the audit's device, where the refinement trains,
    at the break-even ranks without a budget), else the dense block's forward recording for a backward and its
    backward (the bound: a plan's factors multiply fewer weights); each check the dense block's forward (the bound
    likewise), or a third of the device's step. (2026-12-07: the whole model's forward and backward were counted,
    the head too.)"""
    if not (wl.calibrated and sh.block_layers):
        return 0.0
    step = me.refine_step if me.refine_step > 0 else _block_seconds(me, grad=True) + _block_seconds(me, backward=True)
    # on a device (the step timed there) a check's forward is counted as a third of the step, its forward and
    # backward; on the host the dense block's forward as measured
    check = step / 3 if me.refine_step > 0 and me.device_linalg[2] > 0 else me.block_forward
    return max(1, sh.blocks) * refinement_seconds(wl, check, step, epochs)


def refinement_slack(sh: Shapes, wl: Workload, me: Measurements) -> float:
    """Seconds the block refinement saves when every block stops after its first epoch (a block whose first epoch
    does not lower its held-back error, as on a model of random weights) against all ``EPOCHS`` (a trained model's
    blocks kept improving to the last: docs/calibration.md): how far below the estimate a run may come."""
    return _refinement(sh, wl, me) - _refinement(sh, wl, me, 1)


def _sensitivity_seconds(sh: Shapes, wl: Workload, me: Measurements, r: dict[str, int], fwd: float, bwd: float,
                         decomp: float) -> float:
    """Tier 3's sensitivity. The gradient pass: the gradient rows forward twice (checkpointed blocks) and backward
    once per label sample, its loss-aware decompositions, a language model's labels sampled over the vocabulary and
    each sample's output gradients into every layer's moment. ``--probe``: every planned layer truncated alone at two
    ranks and measured on the search rows. None without a sensitivity."""
    b = wl.batch_rows
    if wl.sensitivity == "probes":
        return 2 * len(sh.layers) * r["search"] / b * fwd
    if wl.sensitivity != "gradients":
        return 0.0
    carry = forward_seconds(sh, me, backward=True, carry=True)  # activations' gradients only: the taps
    grad = forward_seconds(sh, me, grad=True)  # recording for the backward
    # the loss-aware truncations on every thread at once, each on one BLAS thread (fisher._layer_costs)
    there = device_decompositions(sh, me)
    out = r["gradient batches"] * (GRADIENT_PASSES * grad + SAMPLES * carry) + (
        loss_decompositions_seconds(sh, me) / _cores(sh, wl) if there is None else there[1])
    if wl.token_inputs:  # a likelihood metric: labels sampled over the vocabulary at every position, SAMPLES times
        out += SAMPLES * r["gradient"] * wl.tokens * wl.outputs * me.logit_seconds
    if me.gemm32_flops > 0:  # each sample's output gradients into every layer's moment (carried back where out > in)
        per = sum(2.0 * min(m, n) ** 2 + (2.0 * m * n if m > n else 0.0) for m, n in sh.layers)
        out += SAMPLES * r["gradient"] * wl.tokens * per / me.gemm32_flops
    return out


def _cores(sh: Shapes, wl: Workload) -> int:
    """The threads the decompositions run on at once (one BLAS thread each: whiten.on_every_core)."""
    return max(1, min(wl.threads, len(sh.layers)))


def stage_seconds(sh: Shapes, wl: Workload, me: Measurements) -> dict[str, float]:
    fwd, bwd = forward_seconds(sh, me), forward_seconds(sh, me, backward=True)
    out = {"load": me.load_seconds, "trace": TRACE_FORWARDS * fwd * wl.example_share,
           "spectra": spectra_seconds(sh, me, wl.threads),
           "reports": sum(REPORT_SECONDS.get(f, DEFAULT_REPORT_SECONDS) + REPORT_LAYER_SECONDS.get(f, 0.0)
                          * len(sh.layers) for f in wl.formats)}
    if not wl.calibrated:
        return out
    r, b = _rows(wl), wl.batch_rows
    # the read runs the first batch once (inputs that do not fit fail there); a language model's first two rows
    # together and its second alone stand for it (rows shown independent: calibration.data.inputs._probe_rows)
    out["calibration data"] = fwd * (min(1.0, 3.0 / b) if wl.token_inputs and b > 2 else 1.0)
    decomp = decompositions_seconds(sh, me)
    grams = gram_flops(sh, wl.fit_rows * wl.tokens, me) / me.gemm_flops
    # a kept truncator is cut once as it is kept (whiten.Truncator.cut: U^T F, or F Z, at full rank, m n min(m, n)
    # multiply-adds), and every plan measured from a store slices its factors from that (no product); a plan cut
    # from a fresh decomposition (the reviewed plan's check) forms U_r^T F, at most the break-even bound
    # r = m n / (m + n) (about half the full rank of a square layer)
    factors = sum(2.0 * _cube(s) for s in sh.layers) / me.gemm_flops
    planned = sum(2.0 * m * n * (m * n / (m + n)) for m, n in sh.layers) / me.gemm_flops
    # tier 1's decompositions run block by block on every thread at once, each on one BLAS thread (tier1_seconds),
    # and are kept (tier1.kept, on disk, cut): the only input-whitened decomposition of each layer the audit makes;
    # each store's cuts are made on those threads as they are put in
    cuts = factors * me.gemm_flops / _one_thread(me)
    there = device_decompositions(sh, me)  # --device cuda: tier 1's and the gradient pass's made there
    out["statistics"] = _batches(wl.fit_rows, b) * fwd + grams + (
        tier1_seconds(sh, me, _cores(sh, wl)) if there is None else there[0] + cuts / _cores(sh, wl))
    if me.stats_forward > 0 and sh.block_layers:  # the blocks' forwards and Grams as measured together
        block_grams = gram_flops(sh, wl.fit_rows * wl.tokens, me, blocks_only=True) / me.gemm_flops
        out["statistics"] += sh.blocks * (_batches(wl.fit_rows, b) * (me.stats_forward - me.block_forward)
                                          - block_grams)
    # the dense model measured once on every held-out row (the search's per-row sums, the verifier's), and its
    # first search batch once more (the forward checked to repeat); 2026-12-07: not counted (19 s of the 135M
    # shape's 8.3 min)
    held, again = ((r["search"] + r["verify"], stage_ends(r["search"])[0]) if wl.split
                   else (r["search"], min(b, r["search"])))
    out["references"] = (held + again) / b * fwd
    out["gradients"] = _sensitivity_seconds(sh, wl, me, r, fwd, bwd, decomp) + (
        cuts / _cores(sh, wl) if wl.sensitivity == "gradients" else 0.0)
    # tier 3 slices its plans from the gradient pass's loss-aware truncations where it ran, else from tier 1's (the
    # rounding floor of a bf16 / fp16 model too: every layer at full rank, its dense reference and one measurement
    # on the search rows): nothing decomposed or multiplied again
    if sh.element_bytes == 2:  # the dense reference, then the copy at full rank: factored, r (m + n) a layer
        out["rounding floor"] = r["search"] / b * fwd * (1 + full_rank_ratio(sh))
    out["tier 3"] = r["tier3"] / b * fwd
    # the chosen plan fitted as factorize writes it (the sequential fit): its runs per fit batch (fit_runs), C and G
    # per stage input (gram_flops), each W* truncated, and the block refinement where the model has repeated blocks
    fitted = fit_decompositions_seconds(sh, wl, me, wl.sensitivity == "gradients")  # W* (with its moments)
    fit = fit_runs(sh, me.stage_shares) * _batches(wl.fit_rows, b) * fwd + 2 * grams + fitted + _refinement(sh, wl, me)
    out["verification"] = 2 * r["verify"] / b * fwd + fit
    # SVD-LLM's uniform truncation beside every frontier plan on the rows that plan read, and the chosen one's on the
    # verification rows, sliced from tier 1's input-whitened decompositions
    out["uniform baseline"] = (r["baseline"] + r["verify"]) / b * fwd
    out["plan check"] = planned
    if wl.byte_plan:
        plans = (r["verify"] if wl.split else r["search"]) / b * fwd
        out["rank or bits"] = BYTE_DECOMPOSITIONS * decomp + BYTE_PLANS * plans
    return out


def _block_grams(sh: Shapes, me: Measurements | None = None) -> int:
    """One block's float64 Grams (every layer's without blocks) and two copies of the largest: one Gram an input,
    as the statistics pass shares one between the layers reading one input (q, k and v; gate and up), where the
    measured stages say which those are (``me``); one a layer otherwise (2026-12-07: always one a layer)."""
    layers = sh.block_layers or sh.layers
    widest = 2 * 8 * max((n * n for _, n in layers), default=0)
    if me is not None and sh.block_layers:
        return sum(8 * n * n for n in _stage_widths(sh, me)) + widest
    return sum(8 * n * n for _, n in layers) + widest


def _fit_sums(sh: Shapes) -> int:
    """The sequential fit's sums alive at once (statistics/sequential.py, ``_Sums``): one stage's C and G at a time,
    one pair for the layers reading one input, and the n x n product being added, float64, at the widest input any
    layer reads. (2026-12-07: a block's Grams were counted here, and the fit held a C and a G per layer of a stage
    and both products and a new sum while adding: five 11,008-wide arrays at the 7B shape's down projection.)"""
    return 3 * 8 * max((n * n for _, n in sh.layers), default=0)


def _plan_factors(sh: Shapes) -> int:
    """One plan's factors: every layer's A and B at about half its rank (float32)."""
    return sum(4 * (m + n) * (min(m, n) // 2) for m, n in sh.layers)


def _mapped_factors(sh: Shapes) -> int:
    """A plan's factors alive at once in ``apply.measured_copy``'s copy: one repeated block's and those of the layers
    outside the blocks (kept in memory)."""
    if not sh.block_layers:
        return _plan_factors(sh)
    one = _plan_factors(replace(sh, layers=sh.block_layers))
    return max(one, _plan_factors(sh) - (max(1, sh.blocks) - 1) * one)


def _refine_bytes(sh: Shapes, wl: Workload, me: Measurements) -> int:
    """The block refinement's (statistics/refine.py) beside the fit's own (:func:`_fit_bytes` without its sums and
    dense rows, freed once the block's stages are fitted): one batch's autograd graph through the block (the saved
    activations measured) and one block's factors four times over (float32 masters, their gradients and Adam's two
    moments). Nothing without repeated blocks. (2026-12-08: the refinement no longer holds the block's closed-form
    factors and fitted weights, which this still counts, nor a float64 copy of the best epoch's factors; while the
    gradient pass's store keeps one part of its truncations in memory beside the verification and the output head's
    fit is its largest, neither counted here. The 7B-wide depth-2 audit's verification, remeasured after the change,
    peaked at 12,412 MiB where the estimate gives 12,422; kept until those parts are measured one by one.)"""
    if not (wl.calibrated and sh.block_layers):
        return 0
    factors = _plan_factors(replace(sh, layers=sh.block_layers))
    return _fit_bytes(sh, wl, me) - _fit_sums(sh) - _dense_row_bytes(sh, wl, me) + me.block_saved_bytes + 4 * factors


def _fit_bytes(sh: Shapes, wl: Workload, me: Measurements) -> int:
    """The sequential fit's own (the verification's and the plan check's default fit): one repeated block's planned
    layers at a time, each with its fitted weight (float32) and decomposition (float64; a finished block's factors
    and fitted weights go to memory-mapped files, statistics/sequential.py), and those of the layers outside the
    blocks; the dense and fitted inputs to the block and the dense block's outputs per fit batch, one stage's sums
    (:func:`_fit_sums`), and the dense rows its stages read (:func:`_dense_row_bytes`)."""
    def own(layers: tuple[tuple[int, int], ...]) -> int:
        return sum(4 * m * n + 8 * (m * min(m, n) + n * n) for m, n in layers)

    held = own(sh.layers)
    if sh.block_layers:
        one = own(sh.block_layers)
        held = one + max(0, held - max(1, sh.blocks) * one)
    return (held + 3 * _batches(wl.fit_rows, wl.batch_rows) * me.hidden_bytes + _fit_sums(sh)
            + _dense_row_bytes(sh, wl, me))


def full_rank_ratio(sh: Shapes) -> float:
    """A forward of the model with every layer factored at full rank (the rounding floor's copy: k = min(m, n), k (m +
    n) multiply-adds a position where m n were) over the dense forward's: at least 1 (2 for square layers)."""
    extra = sum(max(0, (m + n) * min(m, n) - m * n) for m, n in sh.layers)
    return 1.0 + extra / max(1, sh.flop_params)


def _stage_widths(sh: Shapes, me: Measurements) -> list[int]:
    """The input width of each of a repeated block's stages: its first layer's, as a stage's layers read one input
    (each layer a stage where the stages were not measured)."""
    out, i = [], 0
    for c in _stage_counts(me.stage_layers, len(sh.block_layers)):
        out.append(sh.block_layers[i][1])
        i += c
    return out


def gram_flops(sh: Shapes, rows: int, me: Measurements, blocks_only: bool = False) -> float:
    """Multiply-adds of one X^T X over ``rows`` positions of each input the layers read: a repeated block's one a
    stage (the statistics pass and the sequential fit compute one Gram for the layers reading one input: q, k and v;
    gate and up), the layers outside the blocks one each; ``blocks_only``: one block's. (2026-12-07: one a layer was
    counted, q, k and v three.)"""
    staged = sum(float(n) * n for n in _stage_widths(sh, me)) if sh.block_layers else 0.0
    if blocks_only:
        return 2.0 * rows * staged
    every = sum(float(n) * n for _, n in sh.layers)
    if sh.block_layers:
        every += sh.blocks * (staged - sum(float(n) * n for _, n in sh.block_layers))
    return 2.0 * rows * max(0.0, every)


def _dense_row_bytes(sh: Shapes, wl: Workload, me: Measurements) -> int:
    """The dense rows a repeated block's stages read, every fit batch's at once (statistics/sequential.py:
    _dense_rows): one input a stage, of its first layer's width (each layer one where the stages were not measured),
    in the hidden state's dtype: the hidden state's bytes scaled by those widths over its own (what the block's first
    layer reads)."""
    if not sh.block_layers:
        return 0
    widths = sum(_stage_widths(sh, me))
    return int(_batches(wl.fit_rows, wl.batch_rows) * me.hidden_bytes * widths / max(1, sh.block_layers[0][1]))


def _tap_bytes(values: int) -> int:
    """The widest output gradient a tap holds (fisher.py): it, its kept rows and their float32 cast; one larger than
    CARRY_VALUES is gathered and cast a chunk of rows at a time (two chunk-sized copies beside it)."""
    return 4 * values + (2 * CARRY_VALUES if values > CARRY_VALUES else 2 * 4 * values)


def stage_extra(sh: Shapes, wl: Workload, me: Measurements) -> dict[str, int]:
    """Bytes each stage holds beyond the process, the weights and what the stages before it left (docs/calibration.md,
    "What is alive at once")."""
    big = max(sh.layers, key=lambda s: s[0] * s[1], default=(0, 0))
    logits = wl.batch_rows * wl.tokens * wl.outputs * 4
    chunk = 3 * min(logits, 4 * CHUNK_VALUES)  # metrics/chunks.py: one chunk gathered, normalised, read (float32)
    charts = CHART_RSS if set(wl.formats) & set(REPORT_LAYER_SECONDS) else 0
    out = {"load": 0, "trace": me.block_saved_bytes, "spectra": 2 * 8 * big[0] * big[1], "reports": charts}
    if not wl.calibrated:
        return out
    out["calibration data"] = me.block_saved_bytes
    threads = max(1, wl.threads)
    whiten = threads * 2 * 8 * big[0] * big[1]
    hidden = 2 * _batches(wl.fit_rows, wl.batch_rows) * me.hidden_bytes
    out["statistics"] = hidden + me.block_saved_bytes + _block_grams(sh, me) + whiten
    moments = sum(8 * min(m, n) ** 2 for m, n in (sh.block_layers or sh.layers))
    widest = max((m for m, _ in sh.layers), default=0)  # one output gradient alive at a time (fisher.py's taps):
    out["gradients"] = (2 * logits + chunk  # the output, its gradient (written a chunk at a time), one chunk's copies
                        + max(1, sh.blocks) * me.hidden_bytes + me.block_saved_bytes + moments  # it,
                        + _tap_bytes(wl.batch_rows * wl.tokens * widest) + 2 * 8 * big[0] * big[1])
    dense = 0 if wl.token_inputs else wl.holdout_rows * wl.tokens * wl.outputs * 4
    plan = dense + wl.compared * logits + chunk + me.block_saved_bytes
    out["references"] = dense + logits + chunk + me.block_saved_bytes  # the dense model's batch and its log-probs
    block = _mapped_factors(sh)  # apply.measured_copy: one block's factors mapped at a time
    out["tier 3"] = plan + block + _block_grams(sh, me)
    # the verification fits the plan (one block's stages, then its refinement), then measures the fitted plan: the
    # three one after another, so the largest of them (a reviewed plan's check: a fit too). 2026-12-07: the three
    # added, 15,288 MiB estimated where a 7B-wide depth-2 audit measured 12,321 (now 12,422 against 12,412)
    out["verification"] = out["plan check"] = max(plan + block, _fit_bytes(sh, wl, me), _refine_bytes(sh, wl, me))
    out["uniform baseline"] = out["tier 3"]  # one plan's factors of one block at a time, the store's part
    if sh.element_bytes == 2:  # every layer at full rank: twice a half-rank plan's factors, one block's at a time
        out["rounding floor"] = plan + 2 * block + _block_grams(sh, me)
    if wl.byte_plan:  # one plan's replacement weights (every rewritten layer's, in the model's dtype) while measured
        out["rank or bits"] = plan + sum(m * n for m, n in sh.layers) * sh.element_bytes + 2 * 8 * big[0] * big[1]
    return out


def gram_bytes(sh: Shapes, wl: Workload) -> int:
    """The statistics' Grams spilled: every layer's input, float64 (none without calibration)."""
    return sum(8 * n * n for _, n in sh.layers) if wl.calibrated else 0


def disk_bytes(sh: Shapes, wl: Workload) -> int:
    """The statistics' Grams spilled (every layer's input, float64), the decompositions and the gradient moments
    spilled, and the reports."""
    layers = len(sh.layers)
    reports = sum(REPORT_BYTES.get(f, 20_000 + 2_000 * layers) for f in wl.formats)
    if not wl.calibrated:
        return reports + sum(8 * min(s) for s in sh.layers)
    grams = gram_bytes(sh, wl)
    # the kept truncators, cut (A_k and B_k, k = min(m, n): 8 k (m + n) bytes): tier 1's, and beside them the
    # gradient pass's
    kept = sum(8 * min(m, n) * (m + n) * (2 if wl.sensitivity == "gradients" else 1) for m, n in sh.layers)
    moments = sum(8 * min(m, n) ** 2 for m, n in sh.layers)
    return grams + kept + moments + reports


def device_bytes(sh: Shapes, wl: Workload, me: Measurements) -> int | None:
    """On --device: the weights there (one block and the rest with --offload), one batch's block activations, the
    fit batches' hidden states and one block's Grams (float64)."""
    if wl.device in (None, "cpu") or not wl.calibrated:
        return None
    weights = sh.weight_bytes
    if wl.offload and sh.blocks:
        weights -= (sh.blocks - 1) * sh.block_flop_params * sh.element_bytes
    hidden = 2 * _batches(wl.fit_rows, wl.batch_rows) * me.hidden_bytes
    return weights + me.block_saved_bytes + hidden + _block_grams(sh, me)


def predict(sh: Shapes, wl: Workload, me: Measurements, available: int | None = None) -> Estimate:
    """The estimate from the shapes, the workload and the measurements: arithmetic only."""
    seconds, extra = stage_seconds(sh, wl, me), stage_extra(sh, wl, me)
    stages, held = [], me.base_rss + sh.weight_bytes
    for name in STAGES:
        if name not in seconds:
            continue
        stages.append(Stage(name, seconds[name], held + extra[name], _note(name, sh)))
    peak = max(s.peak_bytes for s in stages)
    basis = {"measurements": asdict(me), "rows": _rows(wl) if wl.calibrated else {},
             "shapes": {"layers": len(sh.layers), "blocks": sh.blocks, "weight_bytes": sh.weight_bytes}}
    return Estimate(tuple(stages), peak, device_bytes(sh, wl, me), disk_bytes(sh, wl), me.seconds, available, basis,
                    min(sh.mapped_bytes, sh.weight_bytes), refinement_slack(sh, wl, me), gram_bytes(sh, wl))


def _note(stage: str, sh: Shapes) -> str:
    """What dominates a stage's memory, in words (the statistics: float64 Grams n x n, one per layer input; the
    verification and the plan check: the default fit's float64 Grams C and G and each planned layer's whitening)."""
    if stage not in ("statistics", "verification", "plan check") or not sh.layers:
        return ""
    n = max(n for _, n in sh.layers)
    if stage != "statistics":
        return f"the sequential fit's float64 Grams and whitenings n x n, the largest {n:,} x {n:,}"
    return f"float64 input Grams n x n, the largest {n:,} x {n:,}"


# ---- the memory check ----------------------------------------------------------------------------------------------
def short_of_memory(est: Estimate, available: int | None) -> str | None:
    """The one line a calibrated audit stops with when its predicted peak exceeds ``available``; None when it fits
    (or the memory available is unknown)."""
    if available is None or est.needed_bytes <= available:
        return None
    worst = max(est.stages, key=lambda s: s.peak_bytes)
    note = f": {worst.note}" if worst.note else ""
    mapped = (f", the {_mib(est.mapped_bytes)} of weights mapped from the checkpoint not counted" if est.mapped_bytes
              else "")
    return (f"the audit is estimated to peak at {_mib(est.needed_bytes)} of host memory (in its {worst.name} "
            f"stage{note}{mapped}) but {_mib(available)} is available")


FIX = ("Read fewer rows (--calibration-max-rows N), keep the blocks off the host with --device cuda --offload, free "
       "memory, or run on a larger machine or a cluster (--scheduler ADDR); --estimate prints each stage's cost")


def short_of_disk(est: Estimate, free: int | None, where: str, cached: bool = False) -> str | None:
    """The one line a calibrated audit stops with when what it is predicted to write to its scratch folder ``where``
    (:func:`disk_bytes`: the spilled statistics, the kept decompositions, the gradient moments, the reports; with
    ``cached``, the cache on, the Grams go beside the cache entry instead and are not counted here) exceeds ``free``
    bytes there; None when it fits (or the free space is unknown). A 7B audit writes hundreds of GB: said before it
    starts, not when the disk fills hours in."""
    need = est.disk_bytes - (est.gram_bytes if cached else 0)
    if free is None or need <= free:
        return None
    return (f"the audit is estimated to write {_mib(need)} to {where} (spilled statistics and kept "
            f"decompositions) but {_mib(free)} is free there")


DISK_FIX = ("Set TMPDIR (and --cache-dir) to a folder on a disk with room, or free space there; --estimate prints "
            "what the audit writes")


def scratch_free() -> tuple[int | None, str]:
    """The free bytes of the folder the audit's temporary files go to (``tempfile.gettempdir()``) and its path;
    None where it cannot be read."""
    import shutil
    import tempfile

    where = tempfile.gettempdir()
    try:
        return shutil.disk_usage(where).free, where
    except OSError:
        return None, where


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


# ---- shapes, workload and measurements from a real model ----------------------------------------------------------
def _stats_layers(model: nn.Module) -> list[Any]:
    """The layers the calibration's statistics read (``calibration.session.STATS_KINDS``, from the module walk)."""
    from ..calibration.session import STATS_KINDS
    from ..structure.layers import ParamTable, collect_layers

    return [l for l in collect_layers(model, ParamTable.of(model)).values() if l.kind in STATS_KINDS]


def _repeated(model: nn.Module, layers: list[Any] | None = None) -> nn.ModuleList | None:
    """The repeated blocks as the calibration finds them: ``calibration.statistics.stream.find_blocks`` over the
    layers its statistics read (``layers``, else :func:`_stats_layers`); None without."""
    from ..calibration.statistics.stream import find_blocks

    layers = _stats_layers(model) if layers is None else layers
    found = find_blocks(model, layers) if layers else None
    return found.blocks if found is not None else None


def _weighted(module: nn.Module) -> Iterator[tuple[nn.Module, bool, list[torch.Tensor]]]:
    """Each module of ``module`` with weights of two or more dimensions: whether it is a lookup table (the kinds'
    registry says so: kinds/embedding.py), and those weights (a tensor a module before it holds already left out)."""
    seen: set[int] = set()
    for mod in module.modules():
        own = [p for p in mod.parameters(recurse=False) if id(p) not in seen and p.dim() >= 2]
        seen.update(id(p) for p in own)
        if own:
            yield mod, _is_table(mod), own


def _is_table(mod: nn.Module) -> bool:
    """Whether the kinds' registry calls ``mod`` a lookup table (kinds/embedding.py)."""
    from ..kinds import for_module
    from ..results import Kind

    kind = for_module(mod)
    return kind is not None and kind.kind == Kind.EMBEDDING


def _tied_products(module: nn.Module) -> int:
    """Parameters of weights a module multiplies that a module before it holds (an output head tied to the input
    embedding): counted once among the parameters, as the embedding's, but multiplied by every position (a 135M
    model's 49,152 x 576 head is eight of its blocks' products: its forwards were counted 27% short)."""
    seen: set[int] = set()
    out = 0
    for mod in module.modules():
        for p in mod.parameters(recurse=False):
            if p.dim() >= 2 and id(p) in seen and not _is_table(mod):
                out += p.numel()
            seen.add(id(p))
    return out


def _matrices(module: nn.Module) -> tuple[list[tuple[int, int]], int]:
    """(out, in) of every weight of two or more dimensions outside embeddings, and the embeddings' parameters."""
    shapes, embedding = [], 0
    for _, is_table, own in _weighted(module):
        if is_table:
            embedding += sum(p.numel() for p in own)
        else:
            shapes += [(int(p.shape[0]), int(p.numel() // p.shape[0])) for p in own]
    return shapes, embedding


def shapes_of(model: nn.Module) -> Shapes:
    from ..sources.hf import model_bytes

    layers, embedding = _matrices(model)
    blocks = _repeated(model)
    block_layers = _matrices(blocks[0])[0] if blocks is not None else []
    from ..sources.checkpoint import mapped_bytes

    elem = next((p.element_size() for p in model.parameters()), 4)
    return Shapes(model_bytes(model), tuple(layers), tuple(block_layers), len(blocks) if blocks is not None else 0,
                  sum(m * n for m, n in layers) + _tied_products(model), sum(m * n for m, n in block_layers),
                  embedding, elem,
                  mapped_bytes(model))


def _batch_shape(batch: Any) -> tuple[int, int, bool]:
    """(rows, positions per row, token ids) of a calibration batch."""
    ts = batch.tensors()
    t = ts[0][1] if ts else torch.zeros(1)
    rows = int(t.shape[0]) if t.dim() else 1
    tokens = int(t.shape[1]) if t.dim() == 2 and not t.is_floating_point() else 1
    return rows, tokens, not t.is_floating_point()


def workload_of(cal: Any, options: Any, outputs: int, formats: tuple[str, ...]) -> Workload:
    first = (cal.fit or cal.holdout)[0]
    rows, tokens, ids = _batch_shape(first)
    if ids and tokens > 1:  # a language model's batches, cut at load where their logits pass the budget
        rows = min(rows, bounded_rows(tokens, outputs))
    kl = isinstance(options.tiers.metric, str) and options.tiers.metric.strip().lower() == "kl"
    return Workload(cal.fit_rows, cal.holdout_rows, tokens, rows, outputs, ids, formats, torch.get_num_threads(),
                    bool(options.tiers.split), True, options.statistics.device, bool(options.statistics.offload),
                    compared=2 if kl else 1, byte_plan=options.tiers.bytes_planned,
                    sensitivity=_sensitivity(options.tiers))


def _sensitivity(tiers: Any) -> str:
    """Tier 3's sensitivity as the options ask for it: the gradient pass, ``--probe``'s probes, or none."""
    if not tiers.probe_sensitivity:
        return ""
    return "probes" if tiers.probe else "gradients"


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _block_call(model: nn.Module, block: nn.Module | None, batch: Any) -> tuple[Callable[..., Any], tuple, dict]:
    """What one measured call runs: the first repeated block on the inputs the batch gives it, caught as the
    calibration catches them (``calibration.statistics.stream.first_inputs``: the forward stopped there, caches not
    passed), or the whole model on the batch when there are no blocks or the batch does not reach the first."""
    from ..calibration.data.inputs import model_device
    from ..calibration.statistics.stream import NotSequential, first_inputs

    if block is None:
        return model, tuple(batch.args), dict(batch.kwargs)
    try:
        with torch.no_grad():
            args, kwargs = first_inputs(model, block, [batch], model_device(model))[0]
    except NotSequential:
        return model, tuple(batch.args), dict(batch.kwargs)
    args = tuple(a.detach().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args)
    return block, args, kwargs


def _quickest(run: Callable[[], object], clock: Callable[[], float], enough: float = math.inf) -> float:
    """Seconds of ``run``, the quicker of two (a busy machine's pauses and a first call's warm-up are not the work's
    cost); once only where the first took ``enough`` seconds or more (there the warm-up is noise)."""
    took: list[float] = []
    while len(took) < 2 and (not took or took[0] < enough):
        t0 = clock()
        run()
        took.append(clock() - t0)
    return min(took)


class _StageWatch:
    """The sequential fit's stages in a measured forward, as ``statistics/sequential.py``'s ``_call_order`` forms
    them: the weighted modules in the order they are called, those reading one input tensor together (a Llama block's
    q, k and v; gate and up). ``shares()``: each stage as the share of the forward's multiplied parameters up to its
    last module, where the fit's runs stop; empty where a module is called twice (the fit's runs do not stop then)."""

    def __init__(self, module: nn.Module) -> None:
        weighted = [(mod, own) for mod, is_table, own in _weighted(module) if not is_table]
        self.modules = [mod for mod, _ in weighted]
        self.sizes = {id(mod): sum(p.numel() for p in own) for mod, own in weighted}
        self.calls: list[tuple[int, tuple[object, ...]]] = []
        self.alive: list[object] = []  # the inputs held until the forward ends, so no other tensor reuses their memory
        self.handles: list[Any] = []

    def __enter__(self) -> "_StageWatch":
        self.handles = [m.register_forward_pre_hook(self._note) for m in self.modules]
        return self

    def _note(self, mod: nn.Module, args: tuple[object, ...]) -> None:
        x = args[0] if args else None
        self.calls.append((id(mod), input_key(x, id(mod))))
        self.alive.append(x)

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        self.alive.clear()

    def shares(self) -> tuple[float, ...]:
        return tuple(end for end, _ in self._stages())

    def counts(self) -> tuple[int, ...]:
        """Each stage's modules (the layers the fit decomposes together)."""
        return tuple(count for _, count in self._stages())

    def _stages(self) -> list[tuple[float, int]]:
        ids = [i for i, _ in self.calls]
        if not ids or len(set(ids)) != len(ids):
            return []
        total = float(sum(self.sizes[i] for i in ids))
        out: list[tuple[float, int]] = []
        cum, last = 0, None
        for i, key in self.calls:
            cum += self.sizes[i]
            if out and key == last:
                out[-1] = (cum / total, out[-1][1] + 1)
            else:
                out.append((cum / total, 1))
            last = key
        return out


@dataclass(frozen=True)
class _Timed:
    forward: float  # without gradients, as the statistics, the plans and the fit run it (the quicker of two if short)
    grad_forward: float  # recording for a backward, as the gradient pass and the refinement run it
    backward: float  # every gradient: the inputs' and each weight's
    carry: float  # to the float inputs alone (0 where there are none)
    saved: int  # bytes the forward keeps for its backward (weights not counted)
    out_bytes: int
    shares: tuple[float, ...]  # the sequential fit's stages (_StageWatch)
    counts: tuple[int, ...] = ()  # their modules


def _time_call(fn: Callable[..., Any], args: tuple, kwargs: dict, params: set[int],
               clock: Callable[[], float], backward: bool = True) -> _Timed:
    """The measured call's forwards (without gradients; recording them) and backwards; ``backward`` False: only what a
    memory estimate needs (one forward of each kind, no backward: 0 seconds)."""
    from ..calibration.metrics import main_output

    watch = _StageWatch(fn) if isinstance(fn, nn.Module) else None
    with torch.no_grad(), watch if watch is not None else contextlib.nullcontext():
        t0 = clock()
        y0 = main_output(fn(*args, **kwargs))
        plain = clock() - t0
    out_bytes = y0.numel() * y0.element_size()
    del y0
    if backward and plain < 2.0:  # a first call's warm-up (allocations, kernel choice) is not the work's cost
        with torch.no_grad():
            plain = min(plain, _quickest(lambda: fn(*args, **kwargs), clock, enough=0.0))
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        t0 = clock()
        y = main_output(fn(*args, **kwargs))
        t1 = clock()
    carried, full = 0.0, 0.0  # to the block's inputs alone, as the gradient pass runs it (no weight gradients)
    if y.requires_grad and backward:
        loss = y.float().square().mean()
        leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        t2 = clock()
        if leaves:
            torch.autograd.grad(loss, leaves, retain_graph=True)
            carried = clock() - t2
        t2 = clock()
        loss.backward()
        full = clock() - t2
    return _Timed(plain, t1 - t0, full, carried, saved[0], out_bytes, watch.shares() if watch is not None else (),
                  watch.counts() if watch is not None else ())


def _time_statistics(model: nn.Module, blk: nn.Module, stats_layers: list[Any], args: tuple, kwargs: dict,
                     batch: Any, clock: Callable[[], float]) -> float:
    """One block's forward with its layers' input Grams added as the statistics pass adds them
    (``stats.StatisticsHooks``: each distinct input's rows in float64 and their product, masked positions left out),
    the quicker of two when it takes under 2 s; 0 where the block holds none of ``stats_layers`` (the layers the
    statistics read)."""
    from .. import kinds
    from ..calibration.data.inputs import model_device
    from ..calibration.statistics.stats import StatisticsHooks, batch_mask
    from ..calibration.statistics.stream import batch_dtype_for

    inside = {id(m) for m in blk.modules()}
    layers = [l for l in stats_layers if id(model.get_submodule(kinds.for_kind(l.kind).module_path(l)[0])) in inside]
    if not layers:
        return 0.0
    hooks = StatisticsHooks(model, layers, batch_dtype_for(model_device(model)))

    def one() -> None:
        with torch.no_grad(), hooks.batch(batch_mask(batch), 0):
            blk(*args, **kwargs)
    try:
        return _quickest(one, clock, enough=2.0)
    finally:
        hooks.remove()


GEMM_WIDTH = 512  # the float64 products' rate is timed on X^T X of (1,024 x 512): BLAS near its peak in milliseconds
GEMM_REPEATS = 5  # the quickest of five on every thread (of two, the rate read 82-99 GFLOP/s on 2 threads here where
#                   118 was the product's)


def _decompose_shape(sh: Shapes, limit: int = 768) -> tuple[int, int]:
    """A square map as wide as the model's widest short side, at most ``limit`` (a fraction of a second here): its
    eigendecomposition, of that many rows, is a good part of the time measured (:func:`_linalg_seconds` scales that
    part by k^3 and models each layer's products by its shape)."""
    k = min(limit, max((min(s) for s in sh.layers), default=64))
    return k, k


def _time_linalg(sh: Shapes, clock: Callable[[], float]) -> tuple[float, tuple[int, int], float, int, float, float]:
    """(seconds of one whitened decomposition and its shape, seconds of one Gram's eigenvalues and its width,
    float64 FLOP/s of a product on every thread and on one), each on random matrices of the model's largest shapes,
    capped to take seconds."""
    from scipy.linalg import eigh

    from ..calibration.stage import one_blas_thread
    from ..calibration.statistics.whiten import decompose

    m, n = _decompose_shape(sh)
    rng = np.random.default_rng(0)
    f = rng.standard_normal((m, n))
    x = rng.standard_normal((2 * n, n))
    p = rng.standard_normal((2 * GEMM_WIDTH, GEMM_WIDTH))  # the products' rate at a width BLAS runs near its peak
    warm = f[:8, :8].copy()
    decompose(warm, np.eye(warm.shape[1]))  # BLAS threads started, LAPACK's modules imported: not in the timing
    gram = x.T @ x
    gemm = []
    for _ in range(GEMM_REPEATS):  # the quickest: a busy machine's pauses are not the work's cost
        t0 = clock()
        p.T @ p
        gemm.append(clock() - t0)

    @one_blas_thread  # as the calibration and the spectra's threads run them
    def one_thread() -> tuple[float, float, float]:  # the quicker of two here too: one timing of a fraction of a
        #                                              second is noise; the product's rate on that one thread, and
        #                                              a Gram's eigenvalues as each spectra thread makes them
        return (_quickest(lambda: decompose(f, gram), clock), _quickest(lambda: p.T @ p, clock),
                _quickest(lambda: eigh(gram, eigvals_only=True, driver="evd", check_finite=False), clock))

    dec, one, eig = one_thread()
    work = 2.0 * 2 * GEMM_WIDTH ** 3  # (2w x w)^T (2w x w): 2 w^3 multiply-adds
    return dec, (m, n), eig, n, work / max(min(gemm), 1e-9), work / max(one, 1e-9)


def _time_loss_aware(shape: tuple[int, int], clock: Callable[[], float]) -> float:
    """Seconds of one loss-aware truncation (whiten.weighted_bases) of a random ``shape`` map, its output moment
    carried to the inputs where out > in as the gradient pass carries it; the quicker of two, on one BLAS thread as
    the calibration (``stage.calibrate``, the gradient pass and the sequential fit in it) runs it."""
    from ..calibration.stage import one_blas_thread
    from ..calibration.statistics.whiten import weighted_bases

    m, n = shape
    rng = np.random.default_rng(1)
    f = rng.standard_normal((m, n))
    x = rng.standard_normal((2 * n, n))
    gram = x.T @ x
    side = n if m > n else m
    y = rng.standard_normal((2 * side, side))
    h = y.T @ y
    return one_blas_thread(_quickest)(lambda: weighted_bases(f, gram, False, h, m > n), clock)


@dataclass(frozen=True)
class Process:
    """What was measured before :func:`measure`, carried into its :class:`Measurements`: the process's RSS without
    the model (``base_rss``) and the seconds the load took."""

    base_rss: int
    load_seconds: float = 0.0


@dataclass(frozen=True)
class Asked:
    """What the audit will run, as :func:`measure` times it: ``compute_dtype`` (``float32``: a bf16/fp16 model's
    weights cast while they run, ``--compute-dtype``), ``outputs`` (a language model's vocabulary: the gradient pass's
    labels sampled over it; 0: none), ``keep`` (< 1 with a budget: the share of the blocks' weights a plan keeps,
    at which the refinement's factored step is timed) and ``room`` (the memory available, :func:`stats_timed`)."""

    compute_dtype: str | None = None
    outputs: int = 0
    keep: float = 1.0
    room: int | None = None  # bytes of memory available (None: unknown): the statistics' timing runs only where one
    #                          block's Grams fit in STATS_ROOM of it
    device: torch.device | None = None  # an accelerator the decompositions run on (--device cuda): timed there too


STATS_ROOM = 0.5  # the share of the memory available one block's Grams may take for the statistics pass to be timed
#                   (a Llama-2-70B block's are about 23 GB with the two copies of its 28,672-wide one: timing them
#                   killed the estimate for memory on a 24 GiB host); beyond it the pass is counted from the block's
#                   forward and the Grams' products (stats_forward 0)


def stats_timed(sh: Shapes, room: int | None) -> bool:
    """Whether the statistics pass's block is timed: its Grams (``_block_grams``) fit in STATS_ROOM of ``room``."""
    return room is None or _block_grams(sh) <= STATS_ROOM * room


def time_logits(outputs: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds per logit of one sampled label set in the gradient pass (metrics/chunks.py's ``Scored``: a label drawn
    from each position's softmax, the negative log-likelihood of the draws, its backward), timed on one chunk of
    random float32 logits ``outputs`` wide (the quicker of two)."""
    from ..calibration.metrics.chunks import Scored, chunk_rows

    rows = chunk_rows(max(2, outputs))
    logits = torch.randn(rows, max(2, outputs), generator=torch.Generator().manual_seed(0), requires_grad=True)
    keep = torch.ones(rows, dtype=torch.bool)

    def one() -> None:
        sc = Scored.of(logits, keep, torch.zeros(rows, dtype=torch.long))
        sc.nll(sc.sample(torch.Generator().manual_seed(1))).backward()
        logits.grad = None
    return _quickest(one, clock) / logits.numel()


def time_gemm32(clock: Callable[[], float] = time.perf_counter) -> float:
    """Float32 multiply-adds x 2 per second of a g^T g product (2,048 x 512 rows by columns, the quicker of two), at
    torch's thread count, as the gradient pass accumulates its moments."""
    g = torch.randn(2048, 512, generator=torch.Generator().manual_seed(0))
    return 2.0 * 2048 * 512 * 512 / max(_quickest(lambda: g.T @ g, clock), 1e-9)


def measure(model: nn.Module, batch: Any, sh: Shapes, before: Process, clock: Callable[[], float] = time.perf_counter,
            linalg: bool = True, asked: Asked = Asked()) -> Measurements:
    """The few seconds of measurement the estimate scales: one block forward and backward at the batch's shape,
    one whitened decomposition, one SVD and one float64 product (``linalg=False``: not those three and not the
    backward, for a memory estimate only), as ``asked`` (:class:`Asked`): the block in the audit's compute dtype,
    and with a budget the block refinement's training step, its Linears factored at the ranks the budget leaves."""
    from ..calibration.data.inputs import eval_mode
    from ..calibration.data.precision import computing_in
    from ..calibration.statistics.refine import step_seconds
    from ..calibration.statistics.stream import compute_dtype_for, hidden_state

    start = clock()
    stats_layers = _stats_layers(model)
    block = _repeated(model, stats_layers)
    if batch is None:  # no inputs known (a factory without --input-shape): no forward to time, the audit runs none
        dec, shape, eig, k, flops, one = _time_linalg(sh, clock) if linalg else (0.0, (1, 1), 0.0, 1, 1e12, 0.0)
        return Measurements(before.base_rss, before.load_seconds, 0.0, 0.0, 0, 0, dec, shape, eig, k, flops,
                            clock() - start, gemm1_flops=one)
    try:
        with eval_mode(model), computing_in(model, compute_dtype_for(asked.compute_dtype)):
            fn, args, kwargs = _block_call(model, block[0] if block is not None else None, batch)
            params = {p.data_ptr() for p in model.parameters()}
            timed = _time_call(fn, args, kwargs, params, clock, backward=linalg)
            stats = (_time_statistics(model, fn, stats_layers, args, kwargs, batch, clock)
                     if linalg and block is not None and stats_timed(sh, asked.room) else 0.0)
            step = (step_seconds(fn, (args, kwargs), asked.keep, hidden_state, clock, device=asked.device)
                    if linalg and block is not None and fn is not model and (asked.keep < 1 or asked.device)
                    else 0.0)
    except (AuditError, torch.OutOfMemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 - inputs the forward refuses, said in one line as the audit says it
        from ..calibration.data.inputs import misfit

        raise misfit("the inputs", model, exc) from None
    for p in model.parameters():
        p.grad = None
    hidden = next((a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor)), timed.out_bytes)
    dec, shape, eig, k, flops, one = _time_linalg(sh, clock) if linalg else (0.0, (1, 1), 0.0, 1, 1e12, 0.0)
    logit = time_logits(asked.outputs, clock) if linalg and asked.outputs > 1 else 0.0
    loss = _time_loss_aware(shape, clock) if linalg else 0.0
    flops32 = time_gemm32(clock) if linalg else 0.0
    there = time_device_linalg(asked.device, shape, clock) if linalg and asked.device else (0.0, 0.0, 0.0)
    return Measurements(before.base_rss, before.load_seconds, timed.forward, timed.backward, timed.saved,
                        hidden if block is not None else timed.out_bytes, dec, shape, eig, k, flops, clock() - start,
                        logit, flops32, timed.carry, stats, timed.grad_forward, loss, timed.shares, one,
                        timed.counts, step, there)


def _accelerator(spec: str | None) -> torch.device | None:
    """``stream.accelerator``, but None for a device this machine does not have: the estimate then counts every
    stage on this host, and says so."""
    from ..calibration.statistics.stream import accelerator

    try:
        return accelerator(spec)
    except AuditError:
        return None


def time_device_linalg(dev: torch.device, shape: tuple[int, int],
                       clock: Callable[[], float] = time.perf_counter) -> tuple[float, float, float]:
    """(one whitened decomposition, one loss-aware truncation, float64 FLOP/s of a product) on ``dev``, as the audit
    makes them there (statistics/ondevice.py), on random matrices of ``shape``, the quicker of two each (the first
    run warms the device's libraries)."""
    from ..calibration.statistics.ondevice import decompose_on, weighted_on

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    m, n = shape
    rng = np.random.default_rng(0)
    f, x = rng.standard_normal((m, n)), rng.standard_normal((2 * n, n))
    gram, h = x.T @ x, np.eye(m) + 0.1
    p = torch.randn(2 * GEMM_WIDTH, GEMM_WIDTH, dtype=torch.float64, device=dev)

    def timed(run: Callable[[], object]) -> float:
        return _quickest(lambda: (run(), sync()), clock)

    whiten = timed(lambda: decompose_on(f, gram, device=dev))
    loss = timed(lambda: weighted_on(f, gram, False, h, False, device=dev))
    work = 2.0 * 2 * GEMM_WIDTH ** 3
    return whiten, loss, work / max(timed(lambda: p.T @ p), 1e-9)


def kept_share(sh: Shapes, params: int, budget: float | None) -> float:
    """The share of the repeated blocks' multiplied weights a plan at ``budget`` keeps, the parameters it removes
    (``budget`` of the model's ``params``) all taken from the blocks (the widest layers, where a plan takes them);
    1 without a budget (the tolerance decides the plan: the estimate counts the dense block, the bound) or without
    blocks; at least 5%."""
    if budget is None or not sh.block_layers or sh.blocks * sh.block_flop_params <= 0:
        return 1.0
    return max(0.05, 1.0 - budget * params / (sh.blocks * sh.block_flop_params))


# ---- the entry points ----------------------------------------------------------------------------------------------
def _as_batch(inputs: Any) -> Any:
    from ..calibration.data.inputs import Batch

    if isinstance(inputs, dict):
        return Batch((), dict(inputs))
    if isinstance(inputs, (tuple, list)):
        return Batch(tuple(inputs), {})
    return Batch((inputs,), {})


def _calibration(model: nn.Module, source: str, options: Any) -> Any:
    """The calibration as the audit's session reads it (calibration.session.CalibrationSession.from_options), without
    running its first batches through the model (the audit's own read does; a forward of every block is not a few
    seconds: the measured block's call refuses inputs that do not fit)."""
    from ..calibration.data.inputs import load_calibration
    from ..calibration.data.text import tokenizer_home

    data = options.calibration_data
    tokenizer = data.tokenizer if data.tokenizer is not None else tokenizer_home(source)
    return load_calibration(data.source, model, data.holdout, check_forward=False, tokenizer=tokenizer,
                            length=data.length, max_rows=data.max_rows, max_bytes=data.max_bytes,
                            separator=data.separator)


def _positions(batch: Any) -> int:
    rows, tokens, _ = _batch_shape(batch)
    return max(1, rows * tokens)


def _outputs(model: nn.Module, sh: Shapes) -> int:
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    return int(vocab) if isinstance(vocab, int) else (sh.layers[-1][0] if sh.layers else 1)


def estimate_loaded(loaded: Any, options: Any, formats: tuple[str, ...], load_seconds: float = 0.0,
                    base_rss: int | None = None, clock: Callable[[], float] = time.perf_counter,
                    linalg: bool = True) -> Estimate:
    """The estimate of the audit ``options`` ask for on a loaded source (``sources.Loaded``)."""
    from ..sources import checkpoint
    from ..sources.hf import available_memory

    model = loaded.model
    if not isinstance(model, nn.Module):
        raise AuditError("--estimate needs the model's code: a weights-only checkpoint cannot run the forward it times",
                         "Estimate a factory (file.py:fn) or a Hugging Face directory")
    sh = shapes_of(model)
    timed, built = _measurable(model)
    if built and sh.weight_bytes >= checkpoint.MAP_MIN_BYTES:  # a config alone: its checkpoint would be safetensors
        # in the config's dtype, its parameters mapped as the load maps a model this large (sources/hf.py's test)
        sh = replace(sh, mapped_bytes=sum(p.numel() * p.element_size() for p in model.parameters()))
    if options.calibration_data.source is not None:
        cal = _calibration(model, loaded.source, options)
        wl, batch = workload_of(cal, options, _outputs(model, sh), formats), (cal.fit or cal.holdout)[0]
        batch = batch.cut(0, wl.batch_rows) if wl.batch_rows < batch.rows else batch  # timed as the load cuts it
        # the trace runs the example input, not a calibration batch; without one it runs no forward
        share = (0.0 if loaded.example_inputs is None
                 else min(1.0, _positions(_as_batch(loaded.example_inputs)) / _positions(batch)))
        wl = replace(wl, example_share=share)
    else:
        batch = _as_batch(loaded.example_inputs) if loaded.example_inputs is not None else None
        rows, tokens, ids = _batch_shape(batch) if batch is not None else (1, 1, False)
        wl = Workload(0, 0, tokens, rows, _outputs(model, sh), ids, formats, torch.get_num_threads(), calibrated=False)
    room = available_memory()
    keep = kept_share(sh, sum(p.numel() for p in model.parameters()), options.tiers.budget if wl.calibrated else None)
    acc = _accelerator(wl.device) if wl.calibrated else None
    asked = Asked(options.statistics.compute_dtype if wl.calibrated else None,
                  wl.outputs if wl.token_inputs and wl.calibrated else 0, keep, room, acc)
    me = measure(timed, batch, sh, Process(_rss() if base_rss is None else base_rss, load_seconds), clock, linalg,
                 asked)
    est = predict(sh, wl, me, room)
    if wl.calibrated and wl.device not in (None, "cpu", "auto") and acc is None:
        est = replace(est, basis={**est.basis, "device": f"{wl.device} is not on this machine: every stage "
                                                          "counted on this host"})
    if built:
        est = replace(est, basis={**est.basis, "measured_on": built})
    return est


def _measurable(model: nn.Module) -> tuple[nn.Module, str]:
    """(the model to time, how it was had): the model itself; for a Hugging Face config built on the meta device (a
    directory with no weights), the same architecture with two of its repeated blocks built on the CPU in its dtype,
    random values (the timing needs the shapes; the whole model's shapes come from the meta one)."""
    if not any(p.device.type == "meta" for p in model.parameters()):
        return model, ""
    import copy

    config = getattr(model, "config", None)
    if config is None or not isinstance(getattr(config, "num_hidden_layers", None), int) \
            or not hasattr(type(model), "_from_config"):
        raise AuditError("--estimate cannot time a model on the meta device that is not a Hugging Face config",
                         "Give the weights, or a Hugging Face directory whose config.json names the architecture")
    small = copy.deepcopy(config)
    small.num_hidden_layers = 2
    if isinstance(getattr(small, "layer_types", None), list):
        small.layer_types = small.layer_types[:2]
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    torch.manual_seed(0)
    return type(model)._from_config(small, torch_dtype=dtype).eval(), (
        f"2 of {config.num_hidden_layers} blocks built from the config (no weights: the load not measured)")


def estimate_source(spec: str, options: Any, load: Any, formats: tuple[str, ...],
                    clock: Callable[[], float] = time.perf_counter) -> Estimate:
    """``lowrank-audit MODEL --estimate``: the model loaded (timed: the load stage is measured, not predicted), the
    calibration read, a few seconds measured, the rest predicted. Runs no stage of the audit."""
    from ..sources import load_source

    base = _rss()
    t0 = clock()
    shapes = [tuple(s) for s in load.input_shape] if load.input_shape else None
    loaded = load_source(spec, input_shape=shapes, input_ids=load.input_ids, weights=load.weights,
                         structure_only=load.structure_only, partial=load.partial, auto_inputs=load.auto_inputs)
    seconds = clock() - t0
    if isinstance(loaded.model, nn.Module):  # what loading imported (transformers, a tokenizer) stays too
        from ..sources.hf import model_bytes

        base = max(base, _rss() - model_bytes(loaded.model))
    return estimate_loaded(loaded, options, formats, seconds, base, clock)


def refuse_if_short(loaded: Any, options: Any, formats: tuple[str, ...] = ("text",),
                    available: int | None = None, free_disk: int | None = None) -> Estimate | None:
    """Before a calibrated audit: an ``AuditError`` (one line, exit 2) when its estimated peak exceeds the memory
    available (``available``, default MemAvailable and the cgroup's limit), or what it writes the free space of its
    scratch folder (``free_disk``, default :func:`scratch_free`'s). None without calibration, code or weights."""
    from ..sources.hf import available_memory

    if options.calibration_data.source is None or not isinstance(loaded.model, nn.Module):
        return None
    if any(p.device.type == "meta" for p in loaded.model.parameters()):  # no weights: the audit says calibration
        return None  # needs them, which no memory changes
    try:
        with torch.random.fork_rng(devices=[]):  # the audit's random draws stay those it made before
            est = estimate_loaded(loaded, options, formats, linalg=False)  # memory only: no decomposition timed
    except Exception:  # noqa: BLE001 - a forward the estimate cannot time is the audit's to report, not the check's
        return None
    problem = short_of_memory(est, available if available is not None else available_memory())
    if problem is not None:
        raise AuditError(problem, FIX)
    free, where = scratch_free()
    problem = short_of_disk(est, free_disk if free_disk is not None else free, where, bool(options.cache))
    if problem is not None:
        raise AuditError(problem, DISK_FIX)
    return est


# ---- output --------------------------------------------------------------------------------------------------------
def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min"


def render_table(est: Estimate) -> str:
    rows = [("stage", "wall", "peak RSS")] + [(s.name, _seconds(s.seconds), _mib(s.peak_bytes)) for s in est.stages]
    rows.append(("total", _seconds(est.wall_seconds), _mib(est.peak_rss_bytes)))
    if est.slack_seconds > 0:
        rows.append(("  at least", _seconds(est.wall_seconds - est.slack_seconds), ""))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}" for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    device = "" if est.peak_device_bytes is None else f"; peak device memory {_mib(est.peak_device_bytes)}"
    available = "" if est.available_bytes is None else f" of {_mib(est.available_bytes)} available"
    least = ([f"at least: each block's refinement stopped after one epoch (the total: all {EPOCHS}, as a trained "
              "model's blocks ran them)"] if est.slack_seconds > 0 else [])
    mapped = ([f"  of it {_mib(est.mapped_bytes)} the weights, mapped from the checkpoint (paged from disk as read): "
               f"{_mib(est.needed_bytes)} must be held"] if est.mapped_bytes else [])
    if est.basis.get("measurements", {}).get("device_linalg", (0, 0, 0))[2] > 0:
        mapped += ["tier 1's and the gradient pass's decompositions timed and counted on the device;",
                   "  the forwards, tier 3, the fit and the refinement on this host"]
    if est.basis.get("device"):
        mapped.append(str(est.basis["device"]))
    return "\n".join([f"estimate (measured {est.measure_seconds:.1f} s here, the rest predicted; docs/performance.md)",
                      *lines, f"peak host memory {_mib(est.peak_rss_bytes)}{available}{device}; "
                      f"disk {_mib(est.disk_bytes)} (caches, spilled statistics, reports)", *mapped, *least, ""])


def render(est: Estimate, formats: tuple[str, ...]) -> str:
    """``--format json``: ``{"estimate": ...}``; otherwise the table."""
    import json

    if "json" in formats:
        return json.dumps({"estimate": est.as_dict()}, indent=2) + "\n"
    return render_table(est)
