"""One calibration session: everything the tiers, the plan check, ``factorize`` and recovery measure with, built once.

A :class:`CalibrationSession` owns, for one model:

- the model (put in eval mode while anything is measured; every module's own mode is restored afterwards);
- the :class:`~auditor.calibration.data.inputs.Calibration` batches (the fit part feeds the statistics, the held-out part
  every measurement);
- the :class:`~auditor.calibration.statistics.stats.InputStatistics` of its layers, computed once, lazily, on first use (read
  from and written to the on-disk cache when the session has the audit's options: ``<cache dir>/calibration/<key>.npz``,
  keyed by everything that determines them: :func:`statistics_key`);
- the :class:`~auditor.calibration.measure.metric.Metric`, the held-out rows' split into a search part and a
  verification part (``split``, cut once) and the verification interval's ``confidence``.

It holds inputs, and the statistics derived from them (a cache of the inputs: the same inputs give the same
statistics). What the passes measure is theirs: the dense model's references are the ``references`` pass's
(:func:`~auditor.calibration.references.references_of`), the gradient pass's loss metric is the sensitivity pass's
result; they travel by argument, and nothing a pass learns is written here.

Tier 1 (:func:`~auditor.calibration.tiers.tier1.tier1`), tier 2 (:func:`~auditor.calibration.tiers.sweep.measure_floors`),
tier 3 (:func:`~auditor.calibration.tiers.budget.plan_for_budget`), the plan check (``stage.check_plan``),
``auditor.factorize.factorize`` and :func:`auditor.recover.recover` take a session where they take calibration data;
given raw data (a ``Calibration``, a path, tensors) they build one with :meth:`CalibrationSession.of`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from torch import nn

from .. import kinds
from .._env import trim_heap
from ..errors import AuditError
from ..results import Layer
from .data.hashing import code_hash, weights_hash
from .data.inputs import Batch, Calibration, eval_mode, load_calibration
from .measure.metric import Metric, load_metric
from .statistics.placement import Decompositions
from .statistics.stats import InputStatistics, by_name, input_statistics

if TYPE_CHECKING:
    from .measure.metric import UserMetric
    from .statistics.whiten import Keep, WhitenedSpectrum
    from ..options import AuditOptions, TierOptions
    from .statistics.stats import GramStore
    from ..progress import Progress


STATISTICS_KEY_VERSION = 2  # 1 (until issue 32): weights, the whole calibration's digest, layers, compute dtype


def statistics_key(model: nn.Module, calibration: Calibration, layers: list[Layer], compute_dtype: str | None = None,
                   device: str | None = None) -> str:
    """The statistics cache's key: a hash of everything that determines the statistics. The weights and buffers
    (names, shapes, dtypes, bytes: :func:`~auditor.calibration.data.hashing.weights_hash`), the code the model runs and
    its non-weight state (:func:`~auditor.calibration.data.hashing.code_hash`: an edited forward or hyperparameter is
    another key), the exact fit rows in their batches (the held-out split changes which rows those are), the whole
    calibration's digest (the tokenizer's files for a text file; the window length is in the rows' shapes), the
    layers, the compute dtype, and the dtype each batch's product is formed in (float32 on a GPU, float64 on the
    CPU)."""
    from .data.inputs import _digest, model_device
    from .statistics.stream import batch_dtype_for, compute_dtype_for, resolve_device

    dev = resolve_device(device) if device is not None else None
    bdt = batch_dtype_for(dev if dev is not None else model_device(model))
    compute = compute_dtype_for(compute_dtype)
    parts = [f"v{STATISTICS_KEY_VERSION}", weights_hash(model), code_hash(model), f"fit={_digest(calibration.fit)}",
             f"fit_batches={len(calibration.fit)}", f"all={calibration.digest}", *sorted(by_name(layers)),
             f"compute={compute}", f"batch={bdt}"]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def cache_path(cache_dir: Path | None, model: nn.Module, calibration: Calibration, layers: list[Layer],
               compute_dtype: str | None = None, device: str | None = None) -> Path:
    """The statistics' cache entry: a directory ``<cache dir>/calibration/<key>`` (``meta.json`` and one ``.npy``
    per distinct Gram, :meth:`InputStatistics.spill`), keyed by :func:`statistics_key`."""
    from ..spectra import default_cache_dir

    key = statistics_key(model, calibration, layers, compute_dtype, device)
    return (cache_dir or default_cache_dir()) / "calibration" / key


STATS_KINDS = kinds.registry.KindSet(lambda k: type(k).statistics is not kinds.LayerKind.statistics,
                                     "read for input statistics")  # a live view of auditor.kinds


def _gram_bytes(layer: Layer) -> tuple[int, str]:
    if kinds.for_kind(layer.kind).lookup_counts:
        return 8 * layer.m, f"layer {layer.name} ({layer.m:,} lookup counts)"
    g = max(1, int(layer.groups or 1))
    return (8 * g * layer.n * layer.n,
            f"layer {layer.name} ({'%d x ' % g if g > 1 else ''}{layer.n:,} x {layer.n:,})")


def statistics_memory(layers: list[Layer], model: nn.Module | None = None) -> tuple[int, str]:
    """Bytes of input statistics alive at once while they are read, and the largest Gram in words. Without
    ``model``, or when it has no repeated blocks (:func:`~auditor.calibration.statistics.stream.find_blocks`): every layer's
    float64 Gram (groups x n x n; n lookup counts for an embedding), as the one pass keeps them all. With blocks, the
    statistics are streamed and each block's Grams spilled to disk before the next: the larger of one block's Grams
    and the outside layers' (embeddings, output head). Plus two more of the largest: one batch's product being added
    to the running sum, and the new sum. Layers reading one input (q, k and v) share one Gram when they run, but
    which do is only seen then: each is counted here, so the estimate is high by the shared ones."""
    sizes = [_gram_bytes(l) for l in layers if l.kind in STATS_KINDS]
    if not sizes:
        return 0, ""
    big = max(sizes)
    found = None
    if model is not None:
        from .statistics.stream import find_blocks

        found = find_blocks(model, [l for l in layers if l.kind in STATS_KINDS])
    if found is None:
        return sum(b for b, _ in sizes) + 2 * big[0], big[1]
    parts = [[_gram_bytes(l)[0] for l in ls] for ls in [*found.layers, found.outside]]
    return max(sum(p) for p in parts) + 2 * big[0], big[1]


MMAP_THRESHOLD = 1 << 20  # bytes: arrays this large or larger are mapped, and unmapped when freed


def map_large_arrays() -> bool:
    """glibc's ``mallopt(M_MMAP_THRESHOLD, 1 MiB)`` (nothing elsewhere): every allocation of 1 MiB or more is mapped
    and handed back to the system when freed. Without it glibc raises the threshold as large blocks are freed, and
    the many float64 arrays of a few MiB the calibrated audit allocates and frees (moments, decompositions read
    back, Grams) stay in its heap: measured, the whole audit's peak grew 2.12x the weights' growth from depth 2 to 8,
    1.10x with the threshold fixed (docs/calibration.md). Process-wide, as glibc's ``MALLOC_MMAP_THRESHOLD_``, and
    not undoable: glibc has no getter, and any ``mallopt(M_MMAP_THRESHOLD, v)`` turns its dynamic threshold off for
    good (setting the documented 128 KiB back would leave every later 128 KiB allocation mapped, slower than the
    default). So it is done only in the tool's own process (the command line, :func:`auditor._env.own_process`);
    a library call (``auditor.audit`` in a notebook) leaves the host's allocator alone and returns False."""
    from .._env import libc, owns_process

    if not owns_process():
        return False
    c = libc()
    if not c:
        return False
    c.malloc_trim(0)
    return bool(c.mallopt(-3, MMAP_THRESHOLD))  # M_MMAP_THRESHOLD


def _statistics(model: nn.Module, layers: list[Layer], cal: Calibration, options: "AuditOptions",
                progress: "Progress | None" = None,
                on_block: "Callable[[int, InputStatistics], None] | None" = None) -> tuple[InputStatistics, bool]:
    """The input statistics of ``layers``: from the cache when an entry saved under this key is intact and fits
    the layers (checksums, shapes, finite, symmetric, PSD checks), else computed. Refused with one line, before any
    is allocated, when the float64 Grams alive at once (:func:`statistics_memory`) need more memory than is
    available. Computed, they are read block by block where the model has repeated blocks; ``on_block(i, stats)``
    gets each block's statistics while they are in memory, and they are then written to disk: to the cache entry
    (``options.cache``), else to a temporary directory removed with the statistics. The result's ``layers`` is a
    :class:`~auditor.calibration.statistics.stats.GramStore` that reads one layer's Gram back when asked for."""
    _check_memory(layers, model)
    entry = _cache_entry(model, layers, cal, options)
    if entry is not None and (entry / "meta.json").is_file():
        stats = _open_cached(entry, by_name(layers), cal)
        if stats is not None:
            if progress is not None:
                progress.update(len(cal.fit), len(cal.fit), note="cached")
            return stats, True
    store = _gram_store(entry)
    stats = _stream_into(store, model, layers, cal, options, progress, on_block)
    if entry is not None and store.dir.name.startswith(f".{entry.name}."):
        _commit_entry(stats, store, entry)
    return stats, False


def _check_memory(layers: list[Layer], model: nn.Module) -> None:
    """One line, before anything is allocated, when the Grams alive at once need more memory than is available."""
    from ..spectra.backend import available_memory
    from .data.inputs import size_text

    need, largest = statistics_memory(layers, model)
    avail = available_memory()
    if avail is not None and need > avail:
        raise AuditError(f"calibration statistics need about {size_text(need)} of memory (a float64 Gram n x n per "
                         f"layer input; the largest: {largest}), and {size_text(avail)} is available",
                         "Run on a machine with more memory, or audit without --calibration (the weight spectra "
                         "need no input Grams)")


def _cache_entry(model: nn.Module, layers: list[Layer], cal: Calibration, options: "AuditOptions") -> Path | None:
    """The statistics' cache entry for these options (None without a cache, or where nothing can be keyed)."""
    if not options.cache:
        return None
    try:
        return cache_path(options.cache_dir, model, cal, layers, options.statistics.compute_dtype,
                          options.statistics.device)
    except AuditError:
        raise
    except Exception:  # noqa: BLE001 - what cannot be keyed is not cached (never trusted), and not an error
        return None


def _open_cached(entry: Path, named: dict[str, Layer], cal: Calibration) -> InputStatistics | None:
    """The statistics saved at ``entry`` when they are intact and fit the layers and the calibration, else None."""
    from .statistics.stats import StatisticsMismatch

    try:
        stats = InputStatistics.open(entry, key=entry.name)
        for name, m in stats.layers.meta.items():  # type: ignore[union-attr]
            layer = named.get(name)
            if layer is None or m["width"] != (layer.m if m["diagonal"] else layer.n):
                raise StatisticsMismatch(f"{name} does not fit the layer")
        if stats.digest != cal.digest or set(stats.layers) | set(stats.missing) != set(named):
            raise StatisticsMismatch("another calibration or other layers")
        return stats
    except Exception:  # noqa: BLE001 - a damaged, foreign or invalid entry is recomputed (and replaced)
        return None


def _gram_store(entry: Path | None) -> "GramStore":
    """Where the Grams are written as each block completes: a temporary directory beside the cache entry (renamed to
    it once complete), else (no cache, or a read-only one) a temporary directory removed with the statistics."""
    from .statistics.stats import GramStore

    if entry is not None:
        from .._env import sweep_scratch

        sweep_scratch(entry.parent)  # what killed runs left staged beside the cache's entries
        tmp = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
        try:
            with contextlib.suppress(OSError):
                _clear(tmp)
            return GramStore(tmp, temporary=True)  # removed unless it becomes the entry
        except OSError:  # a read-only cache is not an error: a temporary directory then
            pass
    return GramStore()


def _stream_into(store: "GramStore", model: nn.Module, layers: list[Layer], cal: Calibration,
                 options: "AuditOptions", progress: "Progress | None",
                 on_block: "Callable[[int, InputStatistics], None] | None") -> InputStatistics:
    """The statistics read block by block (one pass without repeated blocks), each block's Grams handed to
    ``on_block`` and then written to ``store``, which becomes the result's ``layers``."""
    def block(i: int, st: InputStatistics) -> None:
        if on_block is not None:
            on_block(i, st)
        try:
            store.put(st.layers)
        except OSError as exc:
            raise AuditError(f"cannot write the input statistics to {store.dir}: {exc.strerror or exc}",
                             "Free disk space there, or give --cache-dir a directory with room (without a cache: "
                             "set TMPDIR)") from None
        trim_heap()

    try:
        from .statistics.stream import stream_statistics  # block by block with repeated blocks, else one pass

        stats = stream_statistics(
            model, layers, cal, device=options.statistics.device, offload=options.statistics.offload,
            compute_dtype=options.statistics.compute_dtype, on_block=block, keep=False,
            progress=progress.update if progress is not None else None)
    except AuditError:
        store.close()
        raise
    except Exception as exc:  # noqa: BLE001 - a batch the forward refuses, said in one line
        from ..errors import first_line

        store.close()
        raise AuditError(f"the forward failed on the calibration batches while reading input statistics: "
                         f"{first_line(exc)}", "Give every batch the inputs and width the model takes") from None
    stats.layers = store
    return stats


def _commit_entry(stats: InputStatistics, store: "GramStore", entry: Path) -> None:
    """The temporary directory the Grams were written to becomes the cache entry (it stays temporary, removed with
    the statistics, where that fails)."""
    try:
        stats.spill(store.dir, key=entry.name)
        _clear(entry)
        store.dir.replace(entry)
        store.dir = entry
        if store._remove is not None:
            store._remove.detach()
        store.temporary, store._remove = False, None
    except OSError:  # the temporary directory stays, removed with the statistics
        pass


def _clear(entry: Path) -> None:
    """Remove what stands at ``entry``: a directory (the old entry) with its files, anything else (a file, a link, a
    FIFO) by unlinking it; ``shutil.rmtree`` would open a FIFO and wait for a writer forever."""
    import shutil
    import stat

    try:
        mode = os.lstat(entry).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(entry)
    else:
        os.unlink(entry)


def metric_of(tiers: "TierOptions", model: nn.Module | None = None, cal: Calibration | None = None,
              source: "str | os.PathLike[str] | None" = None) -> Metric:
    """The metric ``tiers.metric`` names: "perplexity", "kl", "masked-perplexity" (alias "masked-ce", "mlm"),
    "pooled-cosine", "output-error", ``file.py:fn`` / ``module:fn``, a function, or a ``Metric``; None follows the
    model: the pooled-embedding cosine distance for a sentence encoder saved in the sentence-transformers layout at
    ``source`` (its Hugging Face directory, :func:`~auditor.sources.sentence.sentence_pooling`), perplexity for a
    causal LM (:func:`is_causal_lm`, probed on the first held-out batch of ``cal``), the masked-token perplexity for a
    masked LM (:func:`is_masked_lm`), the relative output error otherwise. A metric that pools takes the directory's
    pooling (mean without one)."""
    from ..sources.sentence import sentence_pooling
    from .data.text import tokenizer_home
    from .measure.metric import is_causal_lm, is_masked_lm
    from .metrics import for_kind, for_name
    from .metrics.pooled import KIND as POOLED

    fn = tiers.metric
    named = for_name(fn) if isinstance(fn, str) else None
    pools = fn is None or named is not None and for_kind(named).pools  # read the directory only where it is asked
    pooling = sentence_pooling(tokenizer_home(source)) if pools and source is not None else None
    if isinstance(fn, Metric):
        m = fn
    elif fn is None and pooling is not None:
        m = Metric(kind=POOLED.kind, pooling=pooling)
    elif fn is None:
        batch = cal.measure[0] if cal is not None and cal.measure else None
        causal = model is not None and is_causal_lm(model, batch)
        m = Metric(kind="perplexity" if causal else "masked" if model is not None and is_masked_lm(model)
                   else "output")
    elif named is not None:
        m = Metric(kind=named, pooling=pooling or ())
    elif isinstance(fn, str):
        m = Metric(fn=load_metric(fn), name=fn.rpartition(":")[2])
    else:
        m = Metric(fn=fn)
    return replace(m, tolerance=tiers.tolerance) if tiers.tolerance is not None else m


def as_metric(metric: "Metric | UserMetric | None", tolerance: float | None = None) -> Metric:
    """A ``Metric`` from what the library calls accept: a ``Metric``, a user function (higher is better), or None
    (the relative output error); ``tolerance`` replaces its tolerance when given (the kind is kept)."""
    if metric is None or callable(metric) and not isinstance(metric, Metric):
        metric = Metric(fn=metric)
    return replace(metric, tolerance=tolerance) if tolerance is not None else metric


@dataclass
class Held:
    """What a session and the sessions :meth:`CalibrationSession.with_metric` makes from it share: the input
    statistics (computed once for all of them), whether they came from the cache, tier 1's whitened spectra keyed by
    ``(align, target)``, and the held-out rows cut into a search part and a verification part (cut once)."""

    stats: InputStatistics | None = None
    cached: bool = False
    spectra: "dict[tuple[int, float], dict[str, WhitenedSpectrum]]" = field(default_factory=dict)
    search: list[Batch] | None = None
    verify: list[Batch] | None = None


class _Produced:
    """A name the session once held but a pass now produces: asked for, one line saying whose result holds it."""

    def __init__(self, owner: str) -> None:
        self.owner = owner

    def __set_name__(self, cls: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: object, cls: type | None = None) -> "_Produced":
        if obj is None:
            return self
        raise AttributeError(f"a calibration session holds inputs only; {self.name!r} is {self.owner}")

    def __set__(self, obj: object, value: object) -> None:
        raise AttributeError(f"a calibration session holds inputs only; {self.name!r} is {self.owner}, by argument")


def _read(session: "CalibrationSession", want: dict[str, Layer], progress: "Progress | None",
          spectra: tuple[int, float] | None,
          keep: "Keep | None") -> "tuple[InputStatistics, bool, dict[str, WhitenedSpectrum]]":
    """``want``'s input statistics read (through the cache with the session's options), whether they came from the
    cache, and with ``spectra=(align, target)`` tier 1's whitened spectra made block by block as each block's
    statistics complete (before its Grams leave memory), ``keep``'s truncators with them:
    :meth:`CalibrationSession.statistics`."""
    got: "dict[str, WhitenedSpectrum]" = {}
    on_block = None
    model = session.model
    with (session.decompositions.spectra() if spectra else contextlib.nullcontext()) as spectra_of, \
            session.measuring():
        if spectra_of is not None:
            table = {n: p for n, p in model.named_parameters(remove_duplicate=False)}

            def on_block(_i: int, st: InputStatistics) -> None:
                got.update(spectra_of([want[k] for k in st.layers if k in want], table, st, *spectra, keep=keep))

        if session.options is not None:
            stats, cached = _statistics(model, list(want.values()), session.calibration, session.options, progress,
                                        on_block=on_block)
        else:
            stats, cached = input_statistics(model, want, session.calibration,
                                             progress=progress.update if progress is not None else None), False
            if on_block is not None:
                on_block(-1, stats)
    return stats, cached, got


def _placement(model: nn.Module, options: "AuditOptions | None") -> Decompositions:
    """Where the session's decompositions run: the audit's cluster (``--scheduler``), its device, or here."""
    cluster = options.cluster if options is not None else None
    from .statistics.stream import accelerator

    # tier 1's decompositions on the statistics' device where it is an accelerator; NumPy's LAPACK for the CPU
    return Decompositions(model, *((cluster.scheduler, cluster.path_map) if cluster else ()),
                          device=accelerator(options.statistics.device if options is not None else None))


class CalibrationSession:
    """The model, its calibration batches, their input statistics and the metric, for one audit.

    ``layers``: the layers the statistics are read for (the audit's, in its order); ``options``: the audit's
    options (the statistics' cache: without them nothing is cached); ``stats``: statistics already at hand (a
    caller's, or the cache's), used as they are; ``split``: the held-out rows cut into a search part and a
    verification part (the audit's); ``confidence``: the verification interval's level."""

    def __init__(self, model: nn.Module, calibration: Calibration, metric: Metric | None = None, *,
                 layers: dict[str, Layer] | list[Layer] | None = None, options: "AuditOptions | None" = None,
                 stats: InputStatistics | None = None, split: bool = False, confidence: float = 0.9) -> None:
        if not isinstance(calibration, Calibration):
            raise AuditError(f"calibration is a {type(calibration).__name__}",
                             "Pass a Calibration (auditor.calibration.load_calibration)")
        self.model = model
        self.calibration = calibration
        self.metric = metric if metric is not None else Metric()
        self.layers: dict[str, Layer] = by_name(layers) if layers is not None else {}
        self.options = options
        self._held = Held(stats)  # shared with with_metric's sessions
        self.split = split
        self.confidence = confidence
        self.decompositions = _placement(model, options)
        if split:  # the held-out rows cut once, as the session opens: its inputs
            from .measure.verify import split_rows

            self._held.search, self._held.verify = split_rows(calibration.holdout, documents=calibration.held_documents)

    evaluator = _Produced("the references pass's (references_of(session).evaluator)")
    search_evaluator = _Produced("the references pass's (references_of(session).search)")
    verifier = _Produced("the references pass's (references_of(session).verifier)")
    loss_metric = _Produced("the sensitivity pass's (Gradients.loss_metric; Calibrated.loss_metric after an audit)")

    @property
    def _stats(self) -> InputStatistics | None:
        return self._held.stats

    @property
    def cached(self) -> bool:
        """The statistics came from the on-disk cache."""
        return self._held.cached

    @classmethod
    def of(cls, data: object, model: nn.Module, *, metric: "Metric | UserMetric | None" = None, tolerance: float | None = None,
           layers: dict[str, Layer] | list[Layer] | None = None, stats: InputStatistics | None = None,
           holdout: "float | str | os.PathLike[str]" = 0.25) -> "CalibrationSession":
        """``data`` as a session on ``model``: a session as it is (with ``metric`` / ``tolerance`` given and
        different, a session sharing its batches and statistics with that metric), a ``Calibration``, or what
        :func:`~auditor.calibration.data.inputs.load_calibration` reads (``holdout`` held out)."""
        if isinstance(data, CalibrationSession):
            if data.model is not model:
                raise AuditError("the calibration session belongs to another model",
                                 "Pass the model the session was built for, or its Calibration")
            if stats is not None and data._stats is None:
                data._held.stats = stats
            if metric is None and tolerance is None:
                return data
            return data.with_metric(as_metric(metric if metric is not None else data.metric, tolerance))
        cal = data if isinstance(data, Calibration) else load_calibration(data, model, holdout)
        return cls(model, cal, as_metric(metric, tolerance), layers=layers, stats=stats)

    @classmethod
    def from_options(cls, model: nn.Module, layers: list[Layer], options: "AuditOptions") -> "CalibrationSession":
        """The audit's session: the calibration ``options`` name (read once), its metric and the audit's layers."""
        data = options.calibration_data
        cal = load_calibration(data.source, model, data.holdout, tokenizer=data.tokenizer, length=data.length,
                               max_rows=data.max_rows, max_bytes=data.max_bytes, separator=data.separator)
        map_large_arrays()  # the freed arrays of each block handed back, so the peak does not grow with the depth
        metric = metric_of(options.tiers, model, cal, options.source)
        # a user metric fn(model, batches) may line its own labels up with every held-out row: never cut
        split = bool(cal.holdout) and metric.spec.verified_by_rows and bool(options.tiers.split)
        return cls(model, cal, metric, layers=layers, options=options, split=split,
                   confidence=float(options.tiers.confidence))

    def with_metric(self, metric: Metric) -> "CalibrationSession":
        """This session measured with ``metric``: itself when it is the same, else a session sharing the batches and
        the statistics (computed once for both) with its own evaluator."""
        if metric == self.metric:
            return self
        other = CalibrationSession(self.model, self.calibration, metric, layers=self.layers, options=self.options,
                                   split=self.split, confidence=self.confidence)
        other._held, other.decompositions = self._held, self.decompositions
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
                   progress: "Progress | None" = None,
                   spectra: tuple[int, float] | None = None, keep: "Keep | None" = None) -> InputStatistics:
        """The input statistics: computed once (through the cache with the audit's options), then reused. Asked for
        ``layers`` the session's statistics do not cover (a caller's own set), they are read for those.
        ``spectra=(align, target)``: while the statistics are computed, tier 1's whitened spectra are computed too,
        block by block as each block's statistics complete (before its Grams leave memory), and kept for
        :meth:`spectra`; ``keep``: the truncators of its layers kept as they are made (``whitened_spectra``)."""
        want = by_name(layers) if layers is not None else self.layers
        if self._stats is not None and (layers is None or self.covers(want)):
            return self._stats
        stats, cached, got = _read(self, want, progress, spectra if layers is None else None, keep)
        if self._stats is None:
            self._held.stats, self._held.cached = stats, cached
            if got:
                self._held.spectra[spectra] = {k: got[k] for k in want if k in got}
        return stats

    def spectra(self, align: int = 8, target: float = 0.01, progress: "Callable[[int, int], None] | None" = None,
                keep: "Keep | None" = None) -> "dict[str, WhitenedSpectrum]":
        """Tier 1's whitened spectra of the session's layers, keyed by ``Layer.name`` in the layers' order: those
        computed with the statistics (``statistics(spectra=(align, target))``), else from the statistics, each
        layer's Gram read when its spectrum is computed (``keep``'s truncators with them)."""
        held = self._held.spectra
        if (align, target) not in held:
            table = {n: p for n, p in self.model.named_parameters(remove_duplicate=False)}
            stats = self.stats
            with self.decompositions.spectra() as spectra_of:
                held[(align, target)] = spectra_of(list(self.layers.values()), table, stats, align, target,
                                                   progress=progress, keep=keep)
        elif progress is not None:
            progress(len(held[(align, target)]), len(held[(align, target)]))
        return held[(align, target)]

    @property
    def stats(self) -> InputStatistics:
        return self.statistics()

    @property
    def search_calibration(self) -> Calibration:
        """The calibration the search measures on: the held-out rows' search part when the session is ``split``
        (:mod:`~auditor.calibration.measure.verify`), else every held-out row."""
        if not self.split:
            return self.calibration
        from .measure.verify import with_holdout

        return with_holdout(self.calibration, self.held_out_parts[0])

    @property
    def held_out_parts(self) -> tuple[list[Batch], list[Batch]]:
        """The held-out rows' search part and verification part (``split`` sessions: cut when the session opens, by
        document where the calibration has them; :mod:`~auditor.calibration.measure.verify`)."""
        assert self.split and self._held.search is not None and self._held.verify is not None, "not a split session"
        return self._held.search, self._held.verify


__all__ = ["CalibrationSession", "as_metric", "cache_path", "metric_of", "statistics_key", "statistics_memory"]
