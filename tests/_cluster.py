"""Shared by the cluster tests: kill (SIGKILL, by its own pid) the worker running a task, mid-run."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Callable


def kill_worker_mid_task(client: Any, job: Callable[[], Any], marker: str, settle: float,
                         timeout: float = 60) -> tuple[Any, str]:
    """Run ``job()`` in a thread; once a task whose key contains ``marker`` is processing, wait ``settle`` seconds
    (to be inside it) and kill its worker. Returns (the job's result, the killed worker's address); the job's
    exception is re-raised."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = job()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            out["error"] = exc

    th = threading.Thread(target=run)
    th.start()
    pids = client.run(os.getpid)  # worker address -> pid, all on this machine
    victim = None
    deadline = time.monotonic() + 30
    while victim is None and time.monotonic() < deadline:
        for addr, keys in client.processing().items():
            if any(marker in str(k) for k in keys):
                victim = addr
        time.sleep(0.02)
    assert victim is not None, f"no task matching {marker!r} started"
    time.sleep(settle)
    os.kill(pids[victim], signal.SIGKILL)
    th.join(timeout=timeout)
    assert not th.is_alive(), "the job did not finish after its worker was killed"
    if "error" in out:
        raise out["error"]
    return out["result"], victim
