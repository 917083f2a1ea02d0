"""Row-broadcast bias add in place: ``x[t, k] += b[k]`` (the q / k / v projection biases of a
model with qkv_bias, added before RoPE).

Shapes::

    x  float32 (T, N)     updated in place
    b  float32 (N,)

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
def _bias_kernel(x, b):
    grid_dep_wait()
    N = x.shape[1]
    n = x.shape[0] * N
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        t = i // N
        k = i - t * N
        x[t, k] = x[t, k] + b[k]


def add_bias(x, b, stream=0):
    """``x[t] += b`` for every row t of x (float32 (T, N)); b float32 (N,)."""
    op = "add_bias"
    check_array(op, "x", x, np.float32, 2)
    check_array(op, "b", b, np.float32, 1, (x.shape[1],))
    n = x.shape[0] * x.shape[1]
    if n == 0:
        return
    if n >= 2 ** 31:
        raise BackendError(f"{op}: {n} elements is too many for one launch")
    _bias_kernel[min(cdiv(n, NT), MAX_BLOCKS), NT, stream](x, b)


def ptx_signatures():
    return [("add_bias", _bias_kernel.py_func, "void(float32[:, ::1], float32[::1])")]
