"""Faster internals for numba's CUDA simulator (test infrastructure; conftest.py installs them
when NUMBA_ENABLE_CUDASIM is set).

The simulator runs every CUDA thread of a block as a Python thread. Two of its internals, not
the kernels, took most of the time of the whole-model simulator tests (a 3-token generation on
the 32-wide test model: ~85 s):

* the block's barrier: BlockManager releases a ``cuda.syncthreads()`` by polling every thread's
  flag in a loop that holds the GIL (~50 ms per barrier with 256 threads). `install()` replaces
  the block's run loop and the threads' ``syncthreads`` with a condition-variable barrier: same
  semantics (all live threads of the block meet; a thread that has returned no longer counts, as
  in the simulator; an exception in one thread aborts the others at their next barrier and is
  re-raised from the launch), no polling;
* ``cuda.shared.array`` finds a block's array by its call site through
  ``traceback.extract_stack``, which formats the whole stack (source lines included) on every
  call in every thread. The replacement reads the same key, (file, line) of the caller, from the
  caller's frame, and creates it atomically (``dict.setdefault``): the simulator's own
  get-then-set lets two threads of a block that arrive together each make an array of their own.

Nothing of the kernels changes: the code under test and its results are the same, only the
waiting and the bookkeeping are cheaper.
"""

from __future__ import annotations

import sys
import threading

import numpy as np


class BlockBarrier:
    """A reusable barrier for the live threads of one block."""

    def __init__(self, n: int):
        self.cond = threading.Condition()
        self.live = n
        self.arrived = 0
        self.generation = 0
        self.failed = None          # the first thread that raised

    def _release(self):
        self.arrived = 0
        self.generation += 1
        self.cond.notify_all()

    def wait(self):
        with self.cond:
            if self.failed is not None:
                raise RuntimeError("abort: another thread of the block raised")
            self.arrived += 1
            if self.arrived >= self.live:
                self._release()
                return
            gen = self.generation
            while self.generation == gen and self.failed is None:
                self.cond.wait()
            if self.generation == gen:
                raise RuntimeError("abort: another thread of the block raised")

    def leave(self, thread, failed: bool):
        with self.cond:
            self.live -= 1
            if failed and self.failed is None:
                self.failed = thread
                self.cond.notify_all()
            elif self.arrived and self.arrived >= self.live:
                self._release()


def install():
    """Patch numba's simulator (idempotent); a no-op where its internals are not the expected ones."""
    from numba.cuda.simulator import kernel as K

    if getattr(K.BlockManager, "_tinyloop_barrier", False):
        return
    if not (hasattr(K, "BlockThread") and hasattr(K.BlockManager, "run")):
        return

    def run(self, grid_point, *args):
        barrier = BlockBarrier(int(np.prod(self._block_dim)))
        self._barrier = barrier
        threads = []
        for block_point in np.ndindex(*self._block_dim):
            def target(f=self._f):
                me = threading.current_thread()
                try:
                    f(*args)
                except BaseException:
                    barrier.leave(me, True)
                    raise
                barrier.leave(me, False)

            threads.append(K.BlockThread(target, self, grid_point, block_point, self._debug))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        first = barrier.failed
        for t in ([first] if first is not None else []) + threads:
            if t.exception:
                raise t.exception[0].with_traceback(t.exception[1])

    def syncthreads(self):
        self._manager._barrier.wait()

    K.BlockManager.run = run
    K.BlockThread.syncthreads = syncthreads
    K.BlockManager._tinyloop_barrier = True
    _install_shared_lookup()


def _install_shared_lookup():
    from numba.cuda.simulator import kernelapi as KA

    orig = KA.FakeCUDAShared.array
    dtypes = {}                                            # numba type -> numpy dtype
    if getattr(orig, "_tinyloop", False):
        return

    def array(self, shape, dtype, alignment=None):
        if alignment is not None or shape == 0 or not hasattr(self, "_allocations"):
            return orig(self, shape, dtype, alignment)     # the simulator's own paths
        if isinstance(dtype, KA.types.Type):
            np_dtype = dtypes.get(dtype)
            if np_dtype is None:
                np_dtype = dtypes[dtype] = KA.numpy_support.as_dtype(dtype)
            dtype = np_dtype
        f = sys._getframe(1)
        caller = (f.f_code.co_filename, f.f_lineno)        # extract_stack()[-2][0:2]
        res = self._allocations.get(caller)
        if res is None:
            # setdefault, not get-then-set: the block's threads reach their first shared.array
            # call together, and a thread switch between a get and a set gave two threads two
            # different "shared" arrays (numba's own lookup has the same race)
            res = self._allocations.setdefault(caller, np.empty(shape, dtype))
        return res

    array._tinyloop = True
    KA.FakeCUDAShared.array = array
