"""Advance device-resident decode positions: ``pos[t] += n`` for t < T.

Shapes::

    pos  int32 (>= T,)     a one-token step's position (T = 1), or a lanes step's per-row
                           positions (the depth table of its tree layout)

Launched at the end of a captured decode step so the next replay reads the next positions without
a host-to-device copy. One thread per row; no reduction, trivially batch-invariant.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from ...errors import BackendError
from ._cache import jit_kernel
from ._common import check_array
from ._pdl import grid_dep_wait


@jit_kernel
def _advance_kernel(pos, T, n):
    grid_dep_wait()
    t = cuda.grid(1)
    if t < T:
        pos[t] = pos[t] + n


def advance_position(pos, n=1, stream=0):
    """``pos[0] += n`` on the device (pos int32 (1,))."""
    check_array("advance_position", "pos", pos, np.int32, 1, (1,))
    _advance_kernel[1, 32, stream](pos, np.int32(1), np.int32(n))


def advance_rows(pos, T, n=1, stream=0):
    """``pos[t] += n`` for t < T on the device (pos int32 (>= T,))."""
    check_array("advance_rows", "pos", pos, np.int32, 1)
    T = int(T)
    if not 0 <= T <= pos.shape[0]:
        raise BackendError(f"advance_rows: T={T} rows outside [0, {pos.shape[0]}]")
    if T:
        _advance_kernel[(T + 127) // 128, 128, stream](pos, np.int32(T), np.int32(n))


def ptx_signatures():
    return [("advance_position", _advance_kernel.py_func, "void(int32[::1], int32, int32)")]
