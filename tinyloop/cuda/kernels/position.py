"""Advance the device-resident decode position: ``pos[0] += n``.

Shapes::

    pos  int32 (1,)

Launched at the end of a captured decode step so the next replay reads the next position without
a host-to-device copy. One thread; no reduction, trivially batch-invariant.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from ._common import check_array
from ._pdl import grid_dep_wait


@cuda.jit
def _advance_kernel(pos, n):
    grid_dep_wait()
    if cuda.grid(1) == 0:
        pos[0] = pos[0] + n


def advance_position(pos, n=1, stream=0):
    """``pos[0] += n`` on the device (pos int32 (1,))."""
    check_array("advance_position", "pos", pos, np.int32, 1, (1,))
    _advance_kernel[1, 32, stream](pos, np.int32(n))


def ptx_signatures():
    return [("advance_position", _advance_kernel.py_func, "void(int32[::1], int32)")]
