"""Elementwise residual add in place: ``x[t, k] += y[t, k]`` (residual, loop input injection).

Shapes::

    x  float32 (T, D)     updated in place
    y  float32 (T, D)

Thread mapping: a flat grid-stride loop, one element per thread per step. Each output is a
single addition, so the result cannot depend on T or on the grid: batch-invariant.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from ...errors import BackendError
from ._cache import jit_kernel
from ._common import cdiv, check_array
from ._pdl import grid_dep_wait

NT = 256
MAX_BLOCKS = 1024


@jit_kernel
def _add_kernel(x, y):
    grid_dep_wait()
    D = x.shape[1]
    n = x.shape[0] * D
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        t = i // D
        k = i - t * D
        x[t, k] = x[t, k] + y[t, k]


def add(x, y, stream=0):
    """``x += y`` elementwise (both float32 (T, D))."""
    op = "add"
    check_array(op, "x", x, np.float32, 2)
    check_array(op, "y", y, np.float32, 2, tuple(x.shape))
    n = x.shape[0] * x.shape[1]
    if n == 0:
        return
    if n >= 2 ** 31:
        raise BackendError(f"{op}: {n} elements is too many for one launch")
    blocks = min(cdiv(n, NT), MAX_BLOCKS)
    _add_kernel[blocks, NT, stream](x, y)


def ptx_signatures():
    return [("add", _add_kernel.py_func, "void(float32[:, ::1], float32[:, ::1])")]
