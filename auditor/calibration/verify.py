"""Search on one split, verify on another: the held-out rows cut in two, and a confidence interval over windows.

The held-out rows (windows of text, examples) are cut into a search part (the first ``SEARCH_SHARE`` of the rows,
contiguous: the text the search reads) and a verification part (the rest) that tiers 2 and 3 never touch. A plan is
verified by measuring it on every verification row and resampling the rows (the bootstrap over windows, ``RESAMPLES``
draws, seeded): the metric is recomputed from each draw's per-row sums (the squared error and the dense output's
squared norm; the cross-entropy and its positions for the model and the dense model; the KL and its positions), and
the interval is the draws' central ``confidence`` share (percentiles). A plan holds when the interval's upper end is
within the tolerance, misses when its lower end is beyond it, and straddles it otherwise.

A user metric ``fn(model, batches)`` scores all batches at once, so it gets its value on the verification rows and no
interval.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import nn

from ..calresults import Verification
from .inputs import Batch, Calibration, model_device
from .metric import Evaluator, Metric, _check_targets, _masked_targets, _row_mask, _targets, main_output

SEARCH_SHARE = 0.5  # of the held-out rows, for the search; the rest verify
RESAMPLES = 2000
SEED = 0
MIN_ROWS = 8  # fewer verification rows than this: no interval worth the name
RESOLVE = 0.25  # an interval resolves the tolerance when its half-width is at most this share of it


def _slice(b: Batch, lo: int, hi: int) -> Batch:
    n = b.rows

    def cut(x: Any) -> Any:
        return x[lo:hi] if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == n else x

    return Batch(tuple(cut(a) for a in b.args), {k: cut(v) for k, v in b.kwargs.items()})


def split_rows(batches: list[Batch], share: float = SEARCH_SHARE) -> tuple[list[Batch], list[Batch]]:
    """(search, verification) batches: the first ``share`` of the rows and the rest, cut inside a batch where the
    line falls there. Fewer than two rows: both parts are every row (nothing to split; the report says so)."""
    total = sum(b.rows for b in batches)
    if total < 2:
        return list(batches), list(batches)
    cut = min(total - 1, max(1, int(round(total * share))))
    search: list[Batch] = []
    verify: list[Batch] = []
    seen = 0
    for b in batches:
        n = b.rows
        if seen + n <= cut:
            search.append(b)
        elif seen >= cut:
            verify.append(b)
        else:
            search.append(_slice(b, 0, cut - seen))
            verify.append(_slice(b, cut - seen, n))
        seen += n
    return search, verify


def with_holdout(cal: Calibration, batches: list[Batch]) -> Calibration:
    """``cal`` measuring on ``batches`` (the same fit rows, digest and warnings list)."""
    return replace(cal, holdout=batches, warnings=cal.warnings)


def _per_row(y: torch.Tensor, b: Batch, fn: Any) -> torch.Tensor:
    """Per-row sums of fn(y) over every dimension but the first, positions with ``attention_mask`` 0 left out."""
    v = fn(y)
    keep = _row_mask(b)
    if keep is not None and v.dim() >= 2 and tuple(v.shape[:2]) == tuple(keep.shape):
        v = v * keep.reshape(*keep.shape, *([1] * (v.dim() - 2))).to(v.dtype)
    return v.reshape(v.shape[0], -1).sum(1)


class Verifier:
    """Measures models on the verification rows, row by row, against the dense model's per-row sums."""

    def __init__(self, dense: nn.Module, batches: list[Batch], metric: Metric, confidence: float = 0.9,
                 frozen: nn.Module | None = None) -> None:
        if not 0 < confidence < 1:
            raise ValueError(f"confidence must be in (0, 1), not {confidence!r}")
        self.metric = metric
        self.confidence = confidence
        device = model_device(dense)
        self.batches = [b.to(device) for b in batches]
        self.rows = sum(b.rows for b in self.batches)
        self.evaluations = 0
        self._dense = None
        self._ref: list[torch.Tensor] = []
        self.last_top1: tuple[np.ndarray, np.ndarray] | None = None  # per-row (agreeing, counted) positions of
        #                                                               the last model measured (output error, KL)
        self.reference = 0.0
        kind = metric.kind
        with torch.no_grad():
            if kind == "output":
                self._ref = [main_output(dense(*b.args, **b.kwargs)).detach() for b in self.batches]
                self._den = np.concatenate([_per_row(r.double(), b, lambda t: t.pow(2)).cpu().numpy()
                                            for r, b in zip(self._ref, self.batches)])
            elif kind in ("perplexity", "masked"):
                nll, cnt = self._nll(dense)
                self._ref_nll, self._cnt = nll, cnt
                self.reference = math.exp(nll.sum() / cnt.sum()) if cnt.sum() > 0 else math.nan
            elif kind == "kl" and frozen is not None:  # another verifier's frozen dense copy, shared
                self._dense = frozen
            elif kind == "kl":
                import copy

                self._dense = copy.deepcopy(dense).eval()
                for p in self._dense.parameters():
                    p.requires_grad_(False)
            else:
                self._user = Evaluator(dense, Calibration([], list(batches)), metric)
                self.reference = self._user.reference

    def _nll(self, model: nn.Module) -> tuple[np.ndarray, np.ndarray]:
        """Per-row summed next-token (or masked-token) cross-entropy and scored positions."""
        nll, cnt = [], []
        for i, b in enumerate(self.batches):
            y = main_output(model(*b.args, **b.kwargs))
            _check_targets(b, y.shape[-1], "masked-token" if self.metric.kind == "masked" else "next-token", i)
            if self.metric.kind == "masked":
                tgt, keep, _ = _masked_targets(b)
                logits = y
            else:
                tgt, keep = _targets(b)
                logits = y[:, :-1]
            logp = torch.log_softmax(logits.float(), dim=-1)
            tok = -logp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1).double()
            nll.append((tok * keep).sum(1).cpu().numpy())
            cnt.append(keep.sum(1).double().cpu().numpy())
        return np.concatenate(nll), np.concatenate(cnt)

    def _sums(self, model: nn.Module) -> tuple[np.ndarray, ...]:
        kind = self.metric.kind
        with torch.no_grad():
            if kind == "output":
                num, agree, seen = [], [], []
                for b, r in zip(self.batches, self._ref):
                    y = main_output(model(*b.args, **b.kwargs))
                    num.append(_per_row(y.double() - r.double(), b, lambda t: t.pow(2)).cpu().numpy())
                    if r.dim() >= 2 and r.shape[-1] >= 2:
                        hit = (y.argmax(-1) == r.argmax(-1)).double()
                        agree.append(_per_row(hit, b, lambda t: t).cpu().numpy())
                        seen.append(_per_row(torch.ones_like(hit), b, lambda t: t).cpu().numpy())
                self.last_top1 = ((np.concatenate(agree), np.concatenate(seen))
                                  if agree and len(agree) == len(num) else None)
                return np.concatenate(num), self._den
            if kind in ("perplexity", "masked"):
                nll, cnt = self._nll(model)
                return nll, self._ref_nll, cnt
            kl, cnt, agree = [], [], []
            for b in self.batches:
                tgt, keep = _targets(b)
                p = torch.log_softmax(main_output(self._dense(*b.args, **b.kwargs))[:, :-1].float(), -1)
                q = torch.log_softmax(main_output(model(*b.args, **b.kwargs))[:, :-1].float(), -1)
                k = (p.exp() * (p - q)).sum(-1).double()
                kl.append((k * keep).sum(1).cpu().numpy())
                cnt.append(keep.sum(1).double().cpu().numpy())
                agree.append(((p.argmax(-1) == q.argmax(-1)).double() * keep).sum(1).cpu().numpy())
            self.last_top1 = np.concatenate(agree), np.concatenate(cnt)
            return np.concatenate(kl), np.concatenate(cnt)

    def _value(self, sums: tuple[np.ndarray, ...], idx: Any = slice(None)) -> float:
        kind = self.metric.kind
        if kind == "output":
            num, den = sums
            d = float(den[idx].sum())
            return math.sqrt(float(num[idx].sum()) / d) if d > 0 else math.sqrt(float(num[idx].sum()))
        if kind in ("perplexity", "masked"):
            nll, ref, cnt = sums
            c = float(cnt[idx].sum())
            if c <= 0:
                return math.nan
            return math.expm1((float(nll[idx].sum()) - float(ref[idx].sum())) / c)
        kl, cnt = sums
        c = float(cnt[idx].sum())
        return float(kl[idx].sum()) / c if c > 0 else math.nan

    def measure(self, model: nn.Module) -> Verification:
        """The metric on every verification row, with the bootstrap interval over rows at ``confidence``."""
        self.evaluations += 1
        tol = self.metric.tolerance
        if self.metric.kind == "user":
            m = self._user.measure(model)
            return Verification(m.value, None, None, self.confidence, self.rows, m.ok, False, self._needed(None))
        return self.judge(self._sums(model))

    def judge(self, sums: tuple[np.ndarray, ...]) -> Verification:
        """The value of per-row sums (:meth:`_sums`) over every row, with the bootstrap interval over rows."""
        tol = self.metric.tolerance
        value = self._value(sums)
        self.rows = n = len(sums[-1])  # the outputs' rows (windows, examples): what is resampled
        lo = hi = None
        if n >= 2 and math.isfinite(value):  # an infinite or undefined value has no interval
            rng = np.random.default_rng(SEED)
            draws = rng.integers(0, n, size=(RESAMPLES, n))
            vals = np.array([self._value(sums, d) for d in draws])
            a = (1 - self.confidence) / 2
            lo, hi = (float(x) for x in np.quantile(vals, [a, 1 - a]))
            lo, hi = min(lo, value), max(hi, value)
        ok = hi <= tol if hi is not None else value <= tol  # one row: no interval (a warning says so)
        straddles = hi is not None and lo <= tol < hi
        needed = (self._needed(None if hi is None else (hi - lo) / 2, value if straddles else None)
                  if math.isfinite(value) else None)
        return Verification(value, lo, hi, self.confidence, self.rows, ok, straddles, needed,
                            reference=self.reference if self.metric.kind in ("perplexity", "masked") else None)

    def _needed(self, half: float | None, straddling: float | None = None) -> int | None:
        """Verification rows that would resolve the tolerance, when these do not (None when they do, or nothing
        can be said): a half-width at most ``RESOLVE`` of the tolerance and, for a value whose interval straddles
        it, at most the value's distance from it (the interval shrinks as one over the square root of the rows)."""
        tol = self.metric.tolerance
        if half is None:
            return None if self.metric.kind == "user" else max(MIN_ROWS, 2 * self.rows)
        want = RESOLVE * tol
        if straddling is not None and straddling != tol:
            want = min(want, abs(straddling - tol))
        if self.rows >= MIN_ROWS and half <= want:
            return None
        return max(MIN_ROWS, int(math.ceil(self.rows * (half / want) ** 2))) if half > 0 else MIN_ROWS


__all__ = ["MIN_ROWS", "RESAMPLES", "SEARCH_SHARE", "Verifier", "split_rows", "with_holdout"]
