"""SwiGLU activation: ``out[t, j] = silu(g[t, j]) * u[t, j]`` with ``silu(g) = g / (1 + exp(-g))``.

Shapes (T rows, F = d_ff)::

    swiglu:        g, u float32 (T, F)          out float32 (T, F)   (out may be g or u)
    swiglu_fused:  gu   float32 (T, 2F)         gate in columns [0, F), up in [F, 2F)
                                                out float32 (T, F)

Thread mapping: flat grid-stride loop, one output element per thread per step; elementwise, so
batch-invariant. exp is the float32 libdevice expf (not the fast approximation).

`glu_epilogue(F)` fuses the activation into the gate|up matmul instead (``matmul(out, x, wgu,
..., epilogue=glu_epilogue(F))`` with wgu = gate rows then up rows, out (T, F)): the matmul
reduces gate row j and up row F + j in one warp and stores ``silu(g) * u`` through the same
`_silu_mul`, so the result equals the matmul into (T, 2F) followed by `swiglu_fused`, bit for bit,
without the intermediate buffer or the extra launch.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from ...errors import BackendError
from ._cache import jit_kernel
from ._common import Epilogue, cdiv, check_array
from ._pdl import grid_dep_wait

NT = 256
MAX_BLOCKS = 1024


@cuda.jit(device=True)
def _silu_mul(g, u):
    return g / (float32(1.0) + math.exp(-g)) * u


@jit_kernel
def _swiglu_kernel(out, g, u):
    grid_dep_wait()
    F = out.shape[1]
    n = out.shape[0] * F
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        t = i // F
        j = i - t * F
        out[t, j] = _silu_mul(g[t, j], u[t, j])


@jit_kernel
def _swiglu_fused_kernel(out, gu):
    grid_dep_wait()
    F = out.shape[1]
    n = out.shape[0] * F
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        t = i // F
        j = i - t * F
        out[t, j] = _silu_mul(gu[t, j], gu[t, j + F])


@cuda.jit(device=True)
def _glu_rows(ep, p, N):
    """Weight rows of pair p: gate row p and up row F + p (ep = (F,))."""
    return p, p + ep[0]


@cuda.jit(device=True)
def _glu_store(ep, out, t, p, g, u, N):
    out[t, p] = _silu_mul(g, u)


#: The SwiGLU epilogue without sizes; `glu_epilogue` fills them in.
_GLU_EPILOGUE = Epilogue("glu", _glu_rows, _glu_store, (), 0, 0, "UniTuple(int64, 1)")


def glu_epilogue(F: int) -> Epilogue:
    """The SwiGLU epilogue for a gate|up matmul with F = d_ff: weight (2F, K), out (T, F)."""
    F = int(F)
    if F <= 0:
        raise BackendError(f"glu_epilogue: F={F} must be positive (the MLP width d_ff)")
    return _GLU_EPILOGUE._replace(args=(np.int64(F),), n_rows=2 * F, out_cols=F)


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


def ptx_epilogues():
    """The SwiGLU epilogue without sizes (its `sig` only), for PTX tests of the matmul variant."""
    return [_GLU_EPILOGUE]


def ptx_signatures():
    m = "float32[:, ::1]"
    return [("swiglu", _swiglu_kernel.py_func, f"void({m}, {m}, {m})"),
            ("swiglu_fused", _swiglu_fused_kernel.py_func, f"void({m}, {m})")]
