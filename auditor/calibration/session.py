"""One calibration session: everything the tiers, the plan check, ``factorize`` and recovery measure with, built once.

A :class:`CalibrationSession` owns, for one model:

- the model (put in eval mode while anything is measured; every module's own mode is restored afterwards);
- the :class:`~auditor.calibration.inputs.Calibration` batches (the fit part feeds the statistics, the held-out part
  every measurement);
- the :class:`~auditor.calibration.stats.InputStatistics` of its layers, computed once, lazily, on first use (read
  from and written to the on-disk cache when the session has the audit's options: ``<cache dir>/calibration/<key>.npz``,
  keyed by a hash of every weight and buffer of the model, the calibration's digest and the layer names);
- the :class:`~auditor.calibration.metric.Metric`, and ONE :class:`~auditor.calibration.metric.Evaluator` on the
  held-out batches, built on first use: the dense reference (the dense model's outputs, or its perplexity, or its
  user-metric value) is computed once and every later measurement compares against it.

Tier 1 (:func:`~auditor.calibration.tier1.tier1`), tier 2 (:func:`~auditor.calibration.sweep.measure_floors`),
tier 3 (:func:`~auditor.calibration.budget.plan_for_budget`), the plan check (``stage.check_plan``),
``auditor.factorize.factorize`` and :func:`auditor.recover.recover` take a session where they take calibration data;
given raw data (a ``Calibration``, a path, tensors) they build one with :meth:`CalibrationSession.of`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from torch import nn

from ..errors import AuditError
from .. import kinds
from ..results import Kind, Layer
from .hashing import weights_hash
from .inputs import Calibration, eval_mode, load_calibration
from .metric import Evaluator, Metric, load_metric
from .stats import InputStatistics, by_name, input_statistics

if TYPE_CHECKING:
    from ..options import AuditOptions
    from ..progress import Progress


def cache_path(cache_dir: Path | None, model: nn.Module, calibration: Calibration, layers: list[Layer]) -> Path:
    from ..spectra import default_cache_dir

    key = hashlib.sha256("|".join([weights_hash(model), calibration.digest, *sorted(l.name for l in layers)])
                         .encode()).hexdigest()
    return (cache_dir or default_cache_dir()) / "calibration" / f"{key}.npz"


STATS_KINDS = kinds.registry.KindSet(lambda k: type(k).statistics is not kinds.LayerKind.statistics,
                                     "read for input statistics")  # a live view of auditor.kinds


def statistics_memory(layers: list[Layer]) -> tuple[int, str]:
    """Bytes the input statistics of ``layers`` take, and the largest one in words: a float64 Gram, groups x n x n,
    per layer (a vector of n lookup counts for an embedding), plus two more of the largest: one batch's Gram being
    added to the running sum, and the new sum."""
    sizes: list[tuple[int, str]] = []
    for l in layers:
        if l.kind not in STATS_KINDS:
            continue
        if l.kind == Kind.EMBEDDING:
            sizes.append((8 * l.m, f"layer {l.name} ({l.m:,} lookup counts)"))
        else:
            g = max(1, int(l.groups or 1))
            sizes.append((8 * g * l.n * l.n, f"layer {l.name} ({'%d x ' % g if g > 1 else ''}{l.n:,} x {l.n:,})"))
    if not sizes:
        return 0, ""
    big = max(sizes)
    return sum(b for b, _ in sizes) + 2 * big[0], big[1]


def _statistics(model: nn.Module, layers: list[Layer], cal: Calibration, options: "AuditOptions",
                progress: "Progress | None" = None) -> tuple[InputStatistics, bool]:
    """The input statistics of ``layers``: from the cache when an entry saved under this key is intact and fits
    the layers (checksum, shapes, finite, symmetric, PSD checks), else computed (and cached). Refused with one line,
    before any is allocated, when the float64 Grams need more memory than is available."""
    from ..spectra.backend import available_memory
    from .inputs import size_text
    from .stats import StatisticsMismatch, gram_problem

    need, largest = statistics_memory(layers)
    avail = available_memory()
    if avail is not None and need > avail:
        raise AuditError(f"calibration statistics need about {size_text(need)} of memory (a float64 Gram n x n per "
                         f"layer input; the largest: {largest}), and {size_text(avail)} is available",
                         "Run on a machine with more memory, or audit without --calibration (the weight spectra "
                         "need no input Grams)")
    path = cache_path(options.cache_dir, model, cal, layers) if options.cache else None
    named = by_name(layers)
    if path is not None and path.is_file():
        try:
            stats = InputStatistics.load(path, key=path.stem)
            for name, inp in stats.layers.items():
                layer = named.get(name)
                if layer is None or inp.width != (layer.m if inp.diagonal else layer.n) or gram_problem(inp):
                    raise StatisticsMismatch(f"{name} does not fit the layer")
            if stats.digest != cal.digest or set(stats.layers) | set(stats.missing) != set(named):
                raise StatisticsMismatch("another calibration or other layers")
            if progress is not None:
                progress.update(len(cal.fit), len(cal.fit), note="cached")
            return stats, True
        except Exception:  # noqa: BLE001 - a damaged, foreign or invalid entry is recomputed (and replaced)
            pass
    try:
        from .stream import stream_statistics  # block by block when the model has repeated blocks, else one pass

        stats = stream_statistics(model, layers, cal, device=options.device, offload=options.offload,
                                  progress=progress.update if progress is not None else None)
    except AuditError:
        raise
    except Exception as exc:  # noqa: BLE001 - a batch the forward refuses, said in one line
        from ..errors import first_line

        raise AuditError(f"the forward failed on the calibration batches while reading input statistics: "
                         f"{first_line(exc)}", "Give every batch the inputs and width the model takes") from None
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp")
            stats.save(tmp, key=path.stem)
            tmp.replace(path)
        except OSError:  # a read-only cache is not an error
            pass
    return stats, False


def metric_of(options: "AuditOptions", model: nn.Module | None = None, cal: Calibration | None = None) -> Metric:
    """The metric ``options.metric`` names: "perplexity", "kl", "masked-perplexity" (alias "masked-ce", "mlm"),
    "output-error", ``file.py:fn`` / ``module:fn``, a function, or a ``Metric``; None follows the model: perplexity
    for a causal LM (:func:`is_causal_lm`, probed on the first held-out batch of ``cal``), the masked-token
    perplexity for a masked LM (:func:`is_masked_lm`), the relative output error otherwise."""
    from .metric import NAMES, is_causal_lm, is_masked_lm

    fn = options.metric
    if isinstance(fn, Metric):
        m = fn
    elif fn is None:
        batch = cal.measure[0] if cal is not None and cal.measure else None
        causal = model is not None and is_causal_lm(model, batch)
        m = Metric(kind="perplexity" if causal else "masked" if model is not None and is_masked_lm(model)
                   else "output")
    elif isinstance(fn, str) and fn.strip().lower() in NAMES:
        m = Metric(kind=NAMES[fn.strip().lower()])
    elif isinstance(fn, str):
        m = Metric(fn=load_metric(fn), name=fn.rpartition(":")[2])
    else:
        m = Metric(fn=fn)
    return replace(m, tolerance=options.tolerance) if options.tolerance is not None else m


def as_metric(metric: "Metric | Any | None", tolerance: float | None = None) -> Metric:
    """A ``Metric`` from what the library calls accept: a ``Metric``, a user function (higher is better), or None
    (the relative output error); ``tolerance`` replaces its tolerance when given (the kind is kept)."""
    if metric is None or callable(metric) and not isinstance(metric, Metric):
        metric = Metric(fn=metric)
    return replace(metric, tolerance=tolerance) if tolerance is not None else metric


class CalibrationSession:
    """The model, its calibration batches, their input statistics, the metric and one evaluator, for one audit.

    ``layers``: the layers the statistics are read for (the audit's, in its order); ``options``: the audit's
    options (the statistics' cache: without them nothing is cached); ``stats``: statistics already at hand (a
    caller's, or the cache's), used as they are."""

    def __init__(self, model: nn.Module, calibration: Calibration, metric: Metric | None = None, *,
                 layers: dict[str, Layer] | list[Layer] | None = None, options: "AuditOptions | None" = None,
                 stats: InputStatistics | None = None) -> None:
        if not isinstance(calibration, Calibration):
            raise AuditError(f"calibration is a {type(calibration).__name__}",
                             "Pass a Calibration (auditor.calibration.load_calibration)")
        self.model = model
        self.calibration = calibration
        self.metric = metric if metric is not None else Metric()
        self.layers: dict[str, Layer] = by_name(layers) if layers is not None else {}
        self.options = options
        self._held: dict[str, Any] = {"stats": stats, "cached": False}  # shared with with_metric's sessions
        self._evaluator: Evaluator | None = None

    @property
    def _stats(self) -> InputStatistics | None:
        return self._held["stats"]

    @property
    def cached(self) -> bool:
        """The statistics came from the on-disk cache."""
        return bool(self._held["cached"])

    @classmethod
    def of(cls, data: Any, model: nn.Module, *, metric: Metric | Any | None = None, tolerance: float | None = None,
           layers: dict[str, Layer] | list[Layer] | None = None, stats: InputStatistics | None = None,
           holdout: Any = 0.25) -> "CalibrationSession":
        """``data`` as a session on ``model``: a session as it is (with ``metric`` / ``tolerance`` given and
        different, a session sharing its batches and statistics with that metric), a ``Calibration``, or what
        :func:`~auditor.calibration.inputs.load_calibration` reads (``holdout`` held out)."""
        if isinstance(data, CalibrationSession):
            if data.model is not model:
                raise AuditError("the calibration session belongs to another model",
                                 "Pass the model the session was built for, or its Calibration")
            if stats is not None and data._stats is None:
                data._held["stats"] = stats
            if metric is None and tolerance is None:
                return data
            return data.with_metric(as_metric(metric if metric is not None else data.metric, tolerance))
        cal = data if isinstance(data, Calibration) else load_calibration(data, model, holdout)
        return cls(model, cal, as_metric(metric, tolerance), layers=layers, stats=stats)

    @classmethod
    def from_options(cls, model: nn.Module, layers: list[Layer], options: "AuditOptions") -> "CalibrationSession":
        """The audit's session: the calibration ``options`` name (read once), its metric and the audit's layers."""
        cal = load_calibration(options.calibration, model, options.holdout, tokenizer=options.tokenizer,
                               length=options.calibration_length, max_rows=options.calibration_max_rows,
                               max_bytes=options.calibration_max_bytes)
        return cls(model, cal, metric_of(options, model, cal), layers=layers, options=options)

    def with_metric(self, metric: Metric) -> "CalibrationSession":
        """This session measured with ``metric``: itself when it is the same, else a session sharing the batches and
        the statistics (computed once for both) with its own evaluator."""
        if metric == self.metric:
            return self
        other = CalibrationSession(self.model, self.calibration, metric, layers=self.layers, options=self.options)
        other._held = self._held
        return other

    @contextlib.contextmanager
    def measuring(self) -> Iterator[nn.Module]:
        """The model in eval mode while the block runs (dropout off: measurements repeat), then as it was."""
        with eval_mode(self.model) as m:
            yield m

    def covers(self, layers: dict[str, Layer] | list[Layer]) -> bool:
        """The statistics at hand were read for every one of ``layers`` (held, or missing with a reason)."""
        s = self._stats
        return s is not None and all(k in s.layers or k in s.missing for k in by_name(layers))

    def statistics(self, layers: dict[str, Layer] | list[Layer] | None = None,
                   progress: "Progress | None" = None) -> InputStatistics:
        """The input statistics: computed once (through the cache with the audit's options), then reused. Asked for
        ``layers`` the session's statistics do not cover (a caller's own set), they are read for those."""
        want = by_name(layers) if layers is not None else self.layers
        if self._stats is not None and (layers is None or self.covers(want)):
            return self._stats
        with self.measuring():
            if self.options is not None:
                stats, cached = _statistics(self.model, list(want.values()), self.calibration, self.options, progress)
            else:
                stats, cached = input_statistics(self.model, want, self.calibration,
                                                 progress=progress.update if progress is not None else None), False
        if self._stats is None:
            self._held.update(stats=stats, cached=cached)
        return stats

    @property
    def stats(self) -> InputStatistics:
        return self.statistics()

    @property
    def evaluator(self) -> Evaluator:
        """The one evaluator on the held-out batches: the dense reference is measured (and the forward checked to
        repeat) on first use, with the model in eval mode."""
        if self._evaluator is None:
            with self.measuring():
                self._evaluator = Evaluator(self.model, self.calibration, self.metric)
        return self._evaluator


__all__ = ["CalibrationSession", "as_metric", "cache_path", "metric_of", "statistics_memory"]
