"""SwiGLU activation: ``out[t, j] = silu(g[t, j]) * u[t, j]`` with ``silu(g) = g / (1 + exp(-g))``.

Shapes (T rows, F = d_ff)::

    swiglu:        g, u float32 (T, F)          out float32 (T, F)   (out may be g or u)
    swiglu_fused:  gu   float32 (T, 2F)         gate in columns [0, F), up in [F, 2F)
                                                out float32 (T, F)

Thread mapping: flat grid-stride loop, one output element per thread per step; elementwise, so
batch-invariant. exp is the float32 libdevice expf (not the fast approximation).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from ...core.errors import BackendError
from ._common import cdiv, check_array

NT = 256
MAX_BLOCKS = 1024


@cuda.jit(device=True)
def _silu_mul(g, u):
    return g / (float32(1.0) + math.exp(-g)) * u


@cuda.jit
def _swiglu_kernel(out, g, u):
    F = out.shape[1]
    n = out.shape[0] * F
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        t = i // F
        j = i - t * F
        out[t, j] = _silu_mul(g[t, j], u[t, j])


@cuda.jit
def _swiglu_fused_kernel(out, gu):
    F = out.shape[1]
    n = out.shape[0] * F
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        t = i // F
        j = i - t * F
        out[t, j] = _silu_mul(gu[t, j], gu[t, j + F])


def _blocks(n):
    if n >= 2 ** 31:
        raise BackendError(f"swiglu: {n} elements is too many for one launch")
    return min(cdiv(n, NT), MAX_BLOCKS)


def swiglu(out, g, u, stream=0):
    """``out = silu(g) * u`` elementwise; out may alias g or u."""
    op = "swiglu"
    check_array(op, "g", g, np.float32, 2)
    check_array(op, "u", u, np.float32, 2, tuple(g.shape))
    check_array(op, "out", out, np.float32, 2, tuple(g.shape))
    n = g.shape[0] * g.shape[1]
    if n == 0:
        return
    _swiglu_kernel[_blocks(n), NT, stream](out, g, u)


def swiglu_fused(out, gu, stream=0):
    """``out = silu(gu[:, :F]) * gu[:, F:]`` with F = out.shape[1] and gu of shape (T, 2F)."""
    op = "swiglu_fused"
    check_array(op, "out", out, np.float32, 2)
    T, F = out.shape
    check_array(op, "gu", gu, np.float32, 2, (T, 2 * F))
    n = T * F
    if n == 0:
        return
    _swiglu_fused_kernel[_blocks(n), NT, stream](out, gu)


def ptx_signatures():
    m = "float32[:, ::1]"
    return [("swiglu", _swiglu_kernel.py_func, f"void({m}, {m}, {m})"),
            ("swiglu_fused", _swiglu_fused_kernel.py_func, f"void({m}, {m})")]
