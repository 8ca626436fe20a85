"""Executors: run picklable work items somewhere and hand back results as they complete.

The contract is small so that a cluster scheduler can implement it: ``run(fn, items, sizes)`` yields
``(index, result)`` pairs in completion order, where ``fn`` is a module-level function (picklable by reference) and
``items`` are picklable; ``sizes`` are the bytes each item needs while it runs, for an executor that budgets
memory. ``cancel()`` drops what has not started. Exceptions raised by ``fn`` come out of the iterator.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
from typing import Any, Callable, Iterator, Protocol, Sequence, TypeVar, runtime_checkable

from . import _lapack

T = TypeVar("T")
R = TypeVar("R")


@runtime_checkable
class Executor(Protocol):
    """Where work items run. ``where`` says it in words for the report ("local: 4 threads")."""

    @property
    def where(self) -> str: ...

    def run(self, fn: Callable[[Any], Any], items: Sequence[Any], sizes: Sequence[int]) -> Iterator[tuple[int, Any]]:
        """Yield (index into items, fn(item)) as each completes."""
        ...

    def cancel(self) -> None:
        """Drop every item that has not started; running ones finish."""
        ...


class FuturesExecutor:
    """Runs items on a ``concurrent.futures`` pool made per run, admitting them largest-first-as-given while the
    bytes in flight stay within a budget (at least one item always runs). Subclasses choose the pool."""

    def __init__(self, workers: int | None = None, budget_bytes: int | None = None) -> None:
        self.workers = max(1, workers or min(4, os.cpu_count() or 1))
        self.budget_bytes = budget_bytes
        self._pending: list[cf.Future] = []

    @property
    def where(self) -> str:
        return f"local: {self.workers} worker(s)"

    def _pool(self, workers: int) -> cf.Executor:  # pragma: no cover - abstract
        raise NotImplementedError

    def _workers(self, n_items: int) -> int:
        return min(self.workers, n_items)

    def run(self, fn: Callable[[Any], Any], items: Sequence[Any], sizes: Sequence[int]) -> Iterator[tuple[int, Any]]:
        if not items:
            return
        workers = self._workers(len(items))
        budget = self.budget_bytes or max(2 * max(sizes, default=0), 256 << 20)
        pool = self._pool(workers)
        running: dict[cf.Future, int] = {}
        inflight = 0
        nxt = 0
        try:
            with self._blas(workers):
                while nxt < len(items) or running:
                    while nxt < len(items) and len(running) < 2 * workers and (
                            not running or inflight + sizes[nxt] <= budget):
                        fut = pool.submit(fn, items[nxt])
                        running[fut] = nxt
                        inflight += sizes[nxt]
                        nxt += 1
                    self._pending = list(running)
                    done, _ = cf.wait(list(running), return_when=cf.FIRST_COMPLETED)
                    for fut in done:
                        i = running.pop(fut)
                        inflight -= sizes[i]
                        yield i, fut.result()
        finally:
            self.cancel()
            pool.shutdown(wait=True, cancel_futures=True)
            self._pending = []

    def _blas(self, workers: int) -> Any:
        return _lapack.blas_threads(None)

    def cancel(self) -> None:
        for fut in self._pending:
            fut.cancel()


class ThreadExecutor(FuturesExecutor):
    """The default: threads in this process. Layers run side by side only where the BLAS/LAPACK calls drop the GIL
    (``_lapack.available()``); each worker then gets an equal share of the cores for its BLAS (one thread each on a
    small machine), which beats one layer at a time on all cores: the eigensolver's matrix-vector half does not
    scale across threads, separate layers do."""

    @property
    def where(self) -> str:
        return f"local: {self.workers} thread(s)"

    def _workers(self, n_items: int) -> int:
        return min(self.workers, n_items) if _lapack.available() else 1

    def _pool(self, workers: int) -> cf.Executor:
        return cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="spectra")

    def _blas(self, workers: int) -> Any:
        return _lapack.blas_threads(max(1, (os.cpu_count() or 1) // workers) if workers > 1 else None)


def _init_process(blas: int) -> None:
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=blas, user_api="blas")
    import torch

    torch.set_num_threads(blas)


class ProcessExecutor(FuturesExecutor):
    """Worker processes started with ``spawn`` (no state inherited): items and results cross by pickle, so file
    references (not tensors) are what to send. Each process gets an equal share of the cores for its BLAS."""

    @property
    def where(self) -> str:
        return f"local: {self.workers} process(es)"

    def _pool(self, workers: int) -> cf.Executor:
        import multiprocessing

        blas = max(1, (os.cpu_count() or 1) // workers)
        return cf.ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                                      initializer=_init_process, initargs=(blas,))
