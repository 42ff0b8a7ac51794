"""Data-parallel ranks of a test, each in a spawned process of its own, beside one run in the
test's own process (the one-process reference): every run puts one result on a shared queue."""

from __future__ import annotations

import multiprocessing
import queue
from typing import Callable

from meshrl.testing.ports import free_port


def free_address() -> str:
    """A loopback TCP address for a process group's rendezvous."""
    return f"tcp://127.0.0.1:{free_port()}"


def run_ranks(worker: Callable, ranks: list[tuple], here: tuple, what: str, timeout_s: float = 300) -> dict:
    """``worker(*args, results)`` for each ``args`` of ``ranks`` in a spawned process and for
    ``here`` in this one; each run puts one ``(key, value)`` on ``results``. The results as a dict;
    AssertionError naming ``what`` and the processes' exit codes if one gave none in time. The
    processes are joined, and killed if still alive, whatever happens."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(*args, results)) for args in ranks]
    for p in procs:
        p.start()
    try:
        worker(*here, results)
        return dict(results.get(timeout=timeout_s) for _ in range(len(ranks) + 1))
    except queue.Empty:
        raise AssertionError(f"{what} gave no result (exit codes {[p.exitcode for p in procs]})") from None
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
