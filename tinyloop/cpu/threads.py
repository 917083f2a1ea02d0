"""How the CPU kernels use threads: the threading layer and the thread count, decided here only.

Two kernels run parallel regions (``prange``): ``ops.matmul`` (over blocks of weight rows) and the attention
kernels (over row x head tasks). A decode step of the demo model runs ~80 such regions of
~20-500 µs each, and each one ends when the last thread of numba's team arrives. With as many
threads as cores, one other busy process on the machine is enough for a team thread to wait a whole
scheduler slice for its core in most regions (demo decode on the 2-core development machine: ~250
tokens/s idle, 61-64 beside one busy process, 2-16 beside heavier load; one thread: ~145 idle and
~135 beside it; docs/BENCHMARKS.md, "CPU: first token and threads"). Hence:

* **Thread count**: ``TINYLOOP_CPU_THREADS`` (read by :func:`configure`, once per backend); unset:
  half the CPUs this process may run on, at least 1 (1 on a 2-core machine), which leaves as many
  cores for other processes before one of them shares a core with a team thread. ``0``: every
  CPU (numba's pool, ``NUMBA_NUM_THREADS``); a larger count is capped at the pool. The results do
  not depend on it (ops.py: every reduction has a fixed order, whichever thread computes it).
* **Threading layer**: a thread-safe one (numba's "threadsafe": TBB if installed, else OpenMP),
  since two models may decode from two Python threads at once (the kernels release the GIL), which
  aborts the process under numba's 'workqueue' layer. Where neither loads, or the process already
  runs 'workqueue' (or NUMBA_THREADING_LAYER names it), the parallel kernels of all models take
  one lock (taken by :class:`Region`), so they never run two at once. NUMBA_THREADING_LAYER, when
  set, wins.

numba's thread count is per Python thread, so every parallel launch goes through a :class:`Region`,
which sets it in the launching thread (once per thread and count).
"""

from __future__ import annotations

import os
import threading

import numba

from ..errors import ConfigError

ENV = "TINYLOOP_CPU_THREADS"

#: one lock for every parallel launch of the process, where the layer is not thread-safe
_SERIAL = None
_CONFIGURED = False
_CONFIG_LOCK = threading.Lock()


class _Local(threading.local):
    n = 0          # the count numba.set_num_threads last set in this thread (0: not yet)


_TLS = _Local()


def available_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def requested_threads() -> int:
    """The thread count TINYLOOP_CPU_THREADS asks for (0: every CPU), or the default."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return max(1, available_cpus() // 2)
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise ConfigError(f"{ENV}={raw!r}: expected a whole number >= 0 (0: every CPU)")
    return n


def _launch() -> None:
    """Start numba's threading layer (once per process), thread-safe where one loads."""
    global _SERIAL, _CONFIGURED
    with _CONFIG_LOCK:
        if _CONFIGURED:
            return
        try:
            numba.threading_layer()                     # already started in this process
            started = True
        except ValueError:
            started = False
        if not started and "NUMBA_THREADING_LAYER" not in os.environ:
            numba.config.THREADING_LAYER = "threadsafe"
            try:
                numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)     # starts the layer
            except ValueError:                          # neither TBB nor OpenMP loads
                numba.config.THREADING_LAYER = "workqueue"
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        if numba.threading_layer() == "workqueue":
            _SERIAL = threading.Lock()
        _CONFIGURED = True


def configure() -> int:
    """Start the threading layer and return the thread count for the CPU kernels."""
    n = requested_threads()
    _launch()
    pool = numba.config.NUMBA_NUM_THREADS
    return pool if n == 0 else min(n, pool)


class Region:
    """``with region:`` around a parallel kernel launch: the thread count set in the launching
    thread, and the process-wide lock held where the layer is not thread-safe."""

    __slots__ = ("n",)

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        if _SERIAL is not None:
            _SERIAL.acquire()
        if _TLS.n != self.n:
            numba.set_num_threads(self.n)
            _TLS.n = self.n
        return self

    def __exit__(self, *exc):
        if _SERIAL is not None:
            _SERIAL.release()
        return False
