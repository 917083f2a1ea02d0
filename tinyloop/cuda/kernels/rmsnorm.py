"""RMSNorm: ``out[t, k] = x[t, k] * (1 / sqrt(mean_k(x[t]^2) + eps)) * w[k]``.

Shapes (T rows, D features)::

    x    float32 (T, D)
    w    float32 (D,)
    out  float32 (T, D)      may be the same array as x (in place)

Thread mapping: one block of NT = 256 threads (8 warps) per row t; thread i accumulates
``fma(x, x, ss)`` over k = i, i+256, ... in ascending order, then `_common.block_sum` combines the
256 partials (warp xor-butterflies, then warp totals in warp order). The block shape is fixed, so
the sum of a row, and hence every output element, does not depend on T or on the grid:
batch-invariant. Warp reductions: shuffles on the GPU, shared-memory twin under the simulator.

The per-thread partial (`sumsq_partial`) and the scale formula (`inv_rms`) are device functions:
the matmul's fused-norm prologue (matmul.py, ``norm_w=``) reproduces this kernel's summation order
with them (the NW warp partials, each a butterfly, added in warp order), so a fused norm computes
the same inverse RMS bits as this kernel.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from ...errors import BackendError
from ._cache import jit_kernel
from ._common import block_sum, check_array
from ._pdl import grid_dep_wait

NW = 8
NT = NW * 32


@cuda.jit(device=True)
def sumsq_partial(x, t, i, D):
    """Thread i's partial sum of squares of row t: ``fma(x, x, ss)`` over k = i, i+NT, ...
    ascending, from 0."""
    ss = float32(0.0)
    for k in range(i, D, NT):
        v = x[t, k]
        ss = cuda.fma(v, v, ss)
    return ss


@cuda.jit(device=True)
def inv_rms(ss, D, eps):
    """``1 / sqrt(ss / D + eps)`` in float32 (ss: the row's sum of squares)."""
    return float32(1.0) / math.sqrt(ss / float32(D) + eps)


@cuda.jit(device=True)
def row_inv_rms(x, t, eps):
    """``1 / sqrt(mean(x[t]^2) + eps)`` of row t, computed by the whole block of NT threads
    (every thread gets it; call from uniform control flow)."""
    D = x.shape[1]
    tid = cuda.threadIdx.x
    scratch = cuda.shared.array((NW, 32), float32)
    part = cuda.shared.array(NW, float32)
    ss = sumsq_partial(x, t, tid, D)
    ss = block_sum(ss, scratch, part, tid // 32, tid % 32, NW)
    return inv_rms(ss, D, eps)


@jit_kernel
def _rmsnorm_kernel(out, x, w, eps):
    grid_dep_wait()
    D = x.shape[1]
    t = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    inv = row_inv_rms(x, t, eps)
    # x is read again after the block sum's barriers, so out may alias x: each element is
    # read and written by the same thread.
    for k in range(tid, D, NT):
        out[t, k] = (x[t, k] * inv) * w[k]


def rmsnorm(out, x, w, eps, stream=0):
    """``out = x / sqrt(mean(x^2, axis=1) + eps) * w`` row by row; out may be x. `eps` is a
    model constant (a Python float, cast to float32)."""
    T, eps = check_row_args("rmsnorm", ("x", x), ("out", out), w, eps)
    if T == 0:
        return
    _rmsnorm_kernel[T, NT, stream](out, x, w, eps)


def check_row_args(op, src, dst, w, eps):
    """The row-norm launchers' shared checks: `src` (whose shape is taken) and `dst` are
    (name, array) pairs of float32 (T, D) arrays with D > 0, `w` float32 (D,), `eps` finite and
    >= 0. Returns (T, eps as float32); raises BackendError naming `op` and the argument."""
    (src_name, x), (dst_name, out) = src, dst
    check_array(op, src_name, x, np.float32, 2)
    T, D = x.shape
    check_array(op, dst_name, out, np.float32, 2, (T, D))
    check_array(op, "w", w, np.float32, 1, (D,))
    if D == 0:
        raise BackendError(f"{op}: empty feature dimension")
    return T, check_eps(op, eps)


def check_eps(op, eps):
    """`eps` as a float32 after checking it is finite and >= 0 (raises BackendError)."""
    eps = float(eps)
    if not (eps >= 0.0 and math.isfinite(eps)):
        raise BackendError(f"{op}: eps={eps!r} must be finite and >= 0")
    return np.float32(eps)


def ptx_signatures():
    return [("rmsnorm", _rmsnorm_kernel.py_func,
             "void(float32[:, ::1], float32[:, ::1], float32[::1], float32)")]
