"""A Dask distributed executor: every weight's spectrum is one task on a cluster.

Tasks carry a :class:`auditor.sources.tensorref.TensorRef` (file, tensor name, byte range, dtype, matrix view), never the
tensor: each worker opens the checkpoint itself (a shared filesystem, with an optional client-to-worker path prefix
map). Results are the singular values, the content key and the method; the client writes its own
:class:`~auditor.spectra.cache.SpectrumCache` as for a local run, so a re-audit on one machine reuses the cluster's
work.

Decisions:

- **Checkpoints go to the cluster.** In-memory tensors (a module's parameters, a ``.bin`` state dict) are computed
  here, on the local engine: shipping them would send every weight through this process's network link, which is
  what a local audit does faster. ``where`` says so. The scheduler only ever sees references of a few hundred bytes.
- **URLs.** A ``--path-map`` worker prefix may be an fsspec URL (``s3://bucket/ckpt``, ``file:///mnt/ckpt``): the
  worker then reads its tensor's byte range through fsspec (:meth:`auditor.sources.tensorref.TensorRef.load`).
- **Memory.** A task whose bytes (tensor + the backend's working memory) exceed every worker's memory limit is refused
  before it runs: it becomes a skipped spectrum whose reason names the tensor and the largest limit. Tasks are not
  pinned to workers (a pinned task would wait forever for a worker that died and came back at a new address); on a
  cluster of unequal workers, a worker too small for its task skips it with the GiB it lacks (the backend's own
  check), as a local run does.
- **Faults.** A worker that dies mid-task is Dask's business: its nanny starts a new one and the scheduler reruns the
  task (up to ``distributed.scheduler.allowed-failures`` times, then :class:`AuditError`). Each task is a pure
  function of its reference, so a rerun gives the same bits. A worker that cannot open the file answers with the
  path and its own address (exit 2, no hang). Ctrl-C (or any error) cancels every task still on the cluster.

``distributed`` is an optional dependency (``pip install lowrank-auditor[dask]``), imported only here and only when a
scheduler is given.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Sequence

from ..errors import AuditError, first_line
from ..sources.tensorref import TensorRef, is_url  # noqa: F401 - is_url: part of this module's interface

CONNECT_TIMEOUT = 5.0  # seconds to reach the scheduler, unless $LOWRANK_AUDITOR_CONNECT_TIMEOUT says otherwise
TIMEOUT_ENV = "LOWRANK_AUDITOR_CONNECT_TIMEOUT"
WORKERS_TIMEOUT = 30.0  # seconds to wait for a first worker on a scheduler that has none
GIB = float(1 << 30)
SCHEDULER_ENV = "LOWRANK_AUDITOR_SCHEDULER"


def env_connect_timeout() -> float:
    """Seconds to reach the scheduler: ``$LOWRANK_AUDITOR_CONNECT_TIMEOUT`` (a positive number) or 5.

    >>> os.environ[TIMEOUT_ENV] = "2.5"; env_connect_timeout()
    2.5
    >>> os.environ[TIMEOUT_ENV] = "soon"; env_connect_timeout()
    Traceback (most recent call last):
    ...
    auditor.errors.AuditError: $LOWRANK_AUDITOR_CONNECT_TIMEOUT='soon' is not a number of seconds. Set it to a \
positive number such as 5, or unset it.
    >>> del os.environ[TIMEOUT_ENV]
    """
    import math

    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return CONNECT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= 86400):
        raise AuditError(f"${TIMEOUT_ENV}={text!r} is not a number of seconds",
                         "Set it to a positive number such as 5, or unset it")
    return value


def check_address(address: str) -> str:
    """A scheduler address the command line can connect to: ``tcp://HOST:PORT`` or ``HOST:PORT`` (tcp), checked
    before any Dask client exists (a failed client leaves a traceback behind seconds later). TLS, UCX and in-process
    addresses are refused with the reason; the Python API takes a ``distributed.Client`` for those.

    >>> check_address("tcp://10.0.0.5:8786"), check_address("localhost:8786"), check_address("tcp://[::1]:8786")
    ('tcp://10.0.0.5:8786', 'tcp://localhost:8786', 'tcp://[::1]:8786')
    >>> check_address("tls://h:8786")
    Traceback (most recent call last):
    ...
    auditor.errors.AuditError: --scheduler 'tls://h:8786': tls:// needs TLS certificates (a distributed.Security), \
which the command line does not take. Use a tcp:// scheduler, or pass a distributed.Client with its security to \
auditor.audit(scheduler=...).
    """
    import re

    text = str(address).strip()
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "tcp", text
    scheme = scheme.lower()
    fix = "Give the scheduler as tcp://HOST:PORT, e.g. tcp://10.0.0.5:8786 (`dask scheduler` prints it)"
    if scheme in ("tls", "wss"):
        raise AuditError(f"--scheduler {text!r}: {scheme}:// needs TLS certificates (a distributed.Security), which "
                         "the command line does not take", "Use a tcp:// scheduler, or pass a distributed.Client with "
                         "its security to auditor.audit(scheduler=...)")
    if scheme in ("ucx", "inproc", "ws"):
        why = {"ucx": "needs UCX and the ucx-py package, which this tool does not set up",
               "inproc": "is a scheduler inside another process's memory", "ws": "is not supported here"}[scheme]
        raise AuditError(f"--scheduler {text!r}: {scheme}:// {why}",
                         "Use a tcp:// scheduler, or pass a distributed.Client to auditor.audit(scheduler=...)")
    if scheme != "tcp":
        raise AuditError(f"--scheduler {text!r} has the unknown scheme {scheme}://", fix)
    m = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})", rest)
    if m is None or not 1 <= int(m.group(2)) <= 65535:
        raise AuditError(f"--scheduler {text!r} is not a scheduler address (HOST:PORT, port 1 to 65535)", fix)
    return f"tcp://{rest}"


def parse_path_map(entries: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """``["CLIENT_PREFIX=WORKER_PREFIX", ...]`` -> pairs; one clear error for an entry without ``=``.

    >>> parse_path_map(["/home/me/ckpt=/mnt/shared/ckpt"])
    (('/home/me/ckpt', '/mnt/shared/ckpt'),)
    """
    out = []
    for e in entries:
        client, sep, worker = e.partition("=")
        if not sep or not client or not worker:
            raise AuditError(f"--path-map {e!r} is not CLIENT_PREFIX=WORKER_PREFIX",
                             "Write it as /data/ckpt=/mnt/shared/ckpt (the path here = the same path on the workers)")
        out.append((client, worker))
    return tuple(out)


def map_path(path: str, path_map: Sequence[tuple[str, str]]) -> str:
    """``path`` with the first matching client prefix replaced by the worker prefix (whole path components only).

    >>> map_path("/data/m/model.safetensors", [("/data", "/mnt/nfs")])
    '/mnt/nfs/m/model.safetensors'
    >>> map_path("/database/x", [("/data", "/mnt/nfs")])
    '/database/x'
    >>> map_path("/data/m/model.safetensors", [("/data", "s3://bucket/ckpts/")])
    's3://bucket/ckpts/m/model.safetensors'
    """
    for client, worker in path_map:
        c = client.rstrip("/") or "/"
        if path == c or path.startswith(c.rstrip("/") + "/"):
            return worker.rstrip("/") + path[len(c.rstrip("/")):]
    return path


@dataclass(frozen=True)
class WorkerFailure:
    """A worker's answer when the task's input is bad there (a file it cannot open): the error and its address."""

    what: str
    fix: str
    worker: str


def run_on_worker(fn: Callable[[Any], Any], item: Any) -> Any:
    """The task Dask runs: ``fn(item)``, with an :class:`AuditError` turned into a :class:`WorkerFailure` that names
    this worker (an exception would be retried by nobody and lose the address)."""
    try:
        return fn(item)
    except AuditError as exc:
        try:
            from distributed import get_worker

            addr = get_worker().address
        except Exception:  # noqa: BLE001 - run outside a worker (tests call it directly)
            addr = "this process"
        return WorkerFailure(exc.what, exc.fix, addr)


def _ref_of(item: Any) -> TensorRef | None:
    ref = getattr(item, "ref", None)
    return ref if isinstance(ref, TensorRef) else None


class DaskExecutor:
    """The :class:`~auditor.spectra.executor.Executor` protocol on a Dask cluster.

    ``DaskExecutor("tcp://host:8786")`` connects (within ``connect_timeout`` seconds, else :class:`AuditError`) and
    closes its client on :meth:`close`; ``DaskExecutor(client)`` uses a ``distributed.Client`` the caller owns.
    ``path_map``: (client prefix, worker prefix) pairs applied to every file reference before it is sent."""

    def __init__(self, scheduler: Any, path_map: Sequence[tuple[str, str]] = (),
                 connect_timeout: float | None = None) -> None:
        if not hasattr(scheduler, "submit"):  # an address, not a client: checked before distributed is imported
            scheduler = check_address(scheduler)
        timeout = connect_timeout if connect_timeout is not None else env_connect_timeout()
        try:
            import distributed
        except ImportError:
            raise AuditError("a scheduler was given but the Dask distributed package is not installed",
                             "pip install 'lowrank-auditor[dask]'") from None
        self.path_map = tuple(path_map)
        self._pending: list[Any] = []
        self.local_items = 0  # in-memory tensors computed here (a module's parameters)
        self.cluster_items = 0
        self.client, self._owned = _client(distributed, scheduler, timeout)
        self.address = str(self.client.scheduler.address)
        try:
            self.client.wait_for_workers(1, timeout=WORKERS_TIMEOUT)
        except (TimeoutError, OSError):
            self.close()
            raise AuditError(f"the Dask scheduler at {self.address} has no workers (waited {WORKERS_TIMEOUT:g} s)",
                             f"Start workers with `dask worker {self.address}`") from None
        self.workers = max(1, len(self._worker_limits()))

    def _worker_limits(self) -> dict[str, int]:
        """Worker address -> memory limit in bytes (0: none set)."""
        info = self.client.scheduler_info(n_workers=-1) if _takes_n_workers(self.client) \
            else self.client.scheduler_info()
        return {a: int(w.get("memory_limit") or 0) for a, w in info.get("workers", {}).items()}

    @property
    def where(self) -> str:
        """``dask ADDR (N workers)``; ``local (in-memory weights)`` when every item ran here; both when mixed."""
        n = len(self._worker_limits())
        cluster = f"dask {self.address} ({n} worker{'s' if n != 1 else ''})"
        if self.local_items and not self.cluster_items:
            return "local (in-memory weights)"
        if self.local_items:
            return f"{cluster}; {self.local_items} in-memory weights local"
        return cluster

    @staticmethod
    def _in_memory(item: Any) -> bool:
        ref = _ref_of(item)
        return ref is not None and ref.path is None

    def run(self, fn: Callable[[Any], Any], items: Sequence[Any], sizes: Sequence[int],
            prefer: Sequence[str] = ()) -> Iterator[tuple[int, Any]]:
        """Submit every item as one task (highest priority first, as given), yield (index, result) as they finish.
        Items too large for every worker come back as refusals without running. Items whose tensor is in this
        process's memory run here, on the local engine. ``prefer``: worker addresses to run on when they are
        still there (any other worker otherwise)."""
        if not items:
            return
        from distributed import as_completed

        from .executor import ThreadExecutor
        from .work import compute_task

        prepared = [_mapped(it, self.path_map) for it in items]
        refused: list[tuple[int, Any]] = []
        futures: dict[Any, int] = {}
        self._pending = []
        try:
            self._submit(fn, prepared, sizes, prefer, (refused, futures))
            yield from refused
            local = [i for i, item in enumerate(prepared) if self._in_memory(item)]
            self.local_items += len(local) if fn is compute_task else 0
            self.cluster_items += len(futures) if fn is compute_task else 0
            if local:  # meanwhile the cluster works on the rest
                for j, res in ThreadExecutor().run(fn, [prepared[i] for i in local], [sizes[i] for i in local]):
                    yield local[j], res
            for fut in as_completed(list(futures), loop=self.client.loop):
                i = futures[fut]
                yield i, _result(fn, fut, prepared[i], i, self.address)
        finally:
            self.cancel()
            self._pending = []

    def _submit(self, fn: Callable[[Any], Any], prepared: Sequence[Any], sizes: Sequence[int],
                prefer: Sequence[str], out: tuple[list[tuple[int, Any]], dict[Any, int]]) -> None:
        """Submit every item not in this process's memory, highest priority first; ``out``: (the refusals of items
        too large for every worker, future -> item index), filled as it goes so a Ctrl-C cancels what was sent."""
        from .work import SpectrumResult, SpectrumTask, compute_task

        refused, futures = out
        limits = self._worker_limits()
        largest = max(limits.values(), default=0)
        unlimited = any(v == 0 for v in limits.values())
        for i, (item, size) in enumerate(zip(prepared, sizes)):
            if self._in_memory(item):
                continue
            if fn is compute_task and not unlimited and limits and size > largest:
                name = item.ref.tensor if isinstance(item, SpectrumTask) else f"item {i}"
                reason = (f"{name} needs {_size(size)} (tensor + float64 Gram), more than any Dask worker's "
                          f"memory limit ({_size(largest)})")
                if isinstance(item, SpectrumTask):
                    refused.append((i, SpectrumResult(item.layer, None, key=item.key, skipped=reason)))
                    continue
                raise AuditError(reason, "Start workers with a larger --memory-limit")
            layer = getattr(item, "layer", "")
            fut = self.client.submit(run_on_worker, fn, item, pure=False, priority=len(prepared) - i,
                                     key=f"{getattr(fn, '__name__', 'task')}-{i}-{layer}-{os.urandom(4).hex()}",
                                     workers=list(prefer) or None, allow_other_workers=bool(prefer))
            futures[fut] = i
            self._pending.append(fut)  # cancellable from the first submission on (Ctrl-C while submitting)

    def cancel(self) -> None:
        """Cancel every task of the current run still on the cluster."""
        pending = [f for f in self._pending if not f.done()]
        if pending:
            try:
                self.client.cancel(pending, force=True)
            except Exception:  # noqa: BLE001 - the scheduler may be gone already
                pass

    def close(self) -> None:
        """Close the client if this executor opened it."""
        if self._owned:
            try:
                self.client.close(timeout=CONNECT_TIMEOUT)
            except Exception:  # noqa: BLE001
                pass
            self._owned = False

    def __enter__(self) -> "DaskExecutor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _client(distributed: Any, scheduler: Any, timeout: float) -> tuple[Any, bool]:
    """(the client, whether the executor opened it and closes it): ``scheduler`` itself when it is a
    ``distributed.Client``, else a new client of that address; an unreachable scheduler is one line."""
    if isinstance(scheduler, distributed.Client):
        return scheduler, False
    address = str(scheduler)
    try:
        return distributed.Client(address, timeout=timeout, set_as_default=False), True
    except (OSError, TimeoutError, ValueError) as exc:
        raise AuditError(f"cannot reach the Dask scheduler at {address} within {timeout:g} s ({first_line(exc)})",
                         "Start it with `dask scheduler` (and `dask worker ADDRESS`), or check --scheduler "
                         f"/ ${SCHEDULER_ENV}") from None


def _mapped(item: Any, path_map: tuple[tuple[str, str], ...]) -> Any:
    """The item with its file reference's path as the workers see it (``path_map``)."""
    ref = _ref_of(item)
    if ref is None or ref.path is None:
        return item
    mapped = map_path(ref.path, path_map)
    if mapped == ref.path:
        return item
    return replace(item, ref=TensorRef(ref.tensor, ref.shape, ref.dtype, ref.kind, ref.m, ref.n, ref.groups,
                                       mapped, ref.offset, ref.nbytes, None, ref.device, ref.layout))


def _result(fn: Callable[[Any], Any], fut: Any, item: Any, i: int, address: str) -> Any:
    """A finished future's result; a lost worker or a worker-side failure is one :class:`AuditError` line."""
    from .work import compute_task, hash_task

    try:
        res = fut.result()
    except AuditError:
        raise
    except Exception as exc:  # noqa: BLE001 - KilledWorker, a lost scheduler, a worker-side bug
        name = getattr(_ref_of(item), "tensor", None) or getattr(item, "layer", f"item {i}")
        raise AuditError(f"the Dask cluster at {address} failed on {name}: {first_line(exc)}",
                         "See the workers' logs; a worker killed repeatedly (memory?) stops the task "
                         "after distributed.scheduler.allowed-failures tries") from None
    if isinstance(res, WorkerFailure):
        unseen = fn in (compute_task, hash_task) and res.what.startswith("cannot open")
        hint = ("; every worker must see the checkpoint at the same path, or pass --path-map "
                "CLIENT_PREFIX=WORKER_PREFIX") if unseen else ""
        raise AuditError(f"{res.what} (on Dask worker {res.worker})", res.fix + hint)
    return res


def _size(b: int) -> str:
    """Bytes in GiB, or MiB below one GiB.

    >>> _size(3 << 30), _size(66_880)
    ('3.00 GiB', '0.06 MiB')
    """
    return f"{b / GIB:.2f} GiB" if b >= GIB else f"{b / (1 << 20):.2f} MiB"


def _takes_n_workers(client: Any) -> bool:
    import inspect

    try:
        return "n_workers" in inspect.signature(client.scheduler_info).parameters
    except (TypeError, ValueError):
        return False


def executor_for(scheduler: Any, path_map: Sequence[tuple[str, str]] = ()) -> DaskExecutor:
    """The executor for a scheduler address (``tcp://host:8786``) or a ``distributed.Client``."""
    return DaskExecutor(scheduler, path_map)
