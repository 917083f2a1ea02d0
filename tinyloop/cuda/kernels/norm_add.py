"""Residual add of a normed sublayer output: ``x[t, k] += (y[t, k] * inv_rms(y[t])) * w[k]``
(block_norm "sublayer", Ouro's decoder layer: x = x + norm(sublayer(h))).

Shapes (T rows, D features)::

    x    float32 (T, D)      updated in place
    y    float32 (T, D)      the sublayer's output (read only)
    w    float32 (D,)        the norm weight

Thread mapping and reduction: rmsnorm.py's, exactly (one block of NT = 256 threads per row,
`rmsnorm.row_inv_rms`), so the added term has the bits
rmsnorm would write and the result equals rmsnorm into a scratch row followed by add.py, in one
launch instead of two. Batch-invariant as rmsnorm is.
"""

from __future__ import annotations

from numba import cuda, float32

import numpy as np

from ...errors import BackendError
from ._cache import jit_kernel
from ._common import RowTail, check_array, mul_rn
from ._pdl import grid_dep_wait
from .rmsnorm import (NT, ROW_REGS, TAIL_CHUNK, check_eps, check_row_args, load_row, load_vec, regs_form,
                      regs_inv_rms, row_inv_rms, tail_inv_rms)


@jit_kernel
def _norm_add_kernel(x, y, w, eps):
    grid_dep_wait()
    D = y.shape[1]
    t = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    inv = row_inv_rms(y, t, eps)
    for k in range(tid, D, NT):
        # the product rounded once before the add (mul_rn: ptxas would contract it into an fma),
        # so the term is rmsnorm's stored value
        x[t, k] = x[t, k] + mul_rn(y[t, k] * inv, w[k])


@jit_kernel
def _norm_add_regs_kernel(x, y, w, eps):
    """rmsnorm's register form of _norm_add_kernel (same values): a thread's y, w and x requested
    before its first fma."""
    grid_dep_wait()
    D = y.shape[1]
    t = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    yv = cuda.local.array(ROW_REGS, float32)
    wv = cuda.local.array(ROW_REGS, float32)
    xv = cuda.local.array(ROW_REGS, float32)
    if D <= NT * ROW_REGS:
        load_row(yv, y, t, tid, D)
        load_vec(wv, w, tid, D)
        load_row(xv, x, t, tid, D)
        inv = regs_inv_rms(yv, tid, D, eps)
        for j in range(ROW_REGS):
            if tid + j * NT < D:
                x[t, tid + j * NT] = xv[j] + mul_rn(yv[j] * inv, wv[j])
    else:
        inv = row_inv_rms(y, t, eps)
        for k0 in range(tid, D, NT * ROW_REGS):
            load_row(yv, y, t, k0, D)
            load_vec(wv, w, k0, D)
            load_row(xv, x, t, k0, D)
            for j in range(ROW_REGS):
                if k0 + j * NT < D:
                    x[t, k0 + j * NT] = xv[j] + mul_rn(yv[j] * inv, wv[j])


def norm_add(x, y, w, eps, stream=0):
    """``x += y / sqrt(mean(y^2, axis=1) + eps) * w`` row by row (x must not be y)."""
    T, eps = check_row_args("norm_add", ("x", x), ("y", y), w, eps)
    if T == 0:
        return
    kernel = _norm_add_regs_kernel if regs_form(T) else _norm_add_kernel
    kernel[T, NT, stream](x, y, w, eps)


@cuda.jit(device=True)
def _norm_add_tail_run(args, y, tid, warp, lane, scratch, part):
    """The row tail of `norm_add_tail`: ``x[0] += rmsnorm(y[0]) * w`` with y the matmul's output
    row, each element ``x + mul_rn(y * inv, w)`` as the kernels above write it."""
    x = args[1]
    w = args[2]
    D = y.shape[1]
    inv = tail_inv_rms(y, args[3], tid, warp, lane, scratch, part)
    yv = cuda.local.array(TAIL_CHUNK, float32)
    wv = cuda.local.array(TAIL_CHUNK, float32)
    xv = cuda.local.array(TAIL_CHUNK, float32)
    if tid < NT:
        for k0 in range(tid, D, NT * TAIL_CHUNK):
            for j in range(TAIL_CHUNK):
                k = k0 + j * NT
                if k < D:
                    yv[j] = y[0, k]
                    wv[j] = w[k]
                    xv[j] = x[0, k]
            for j in range(TAIL_CHUNK):
                k = k0 + j * NT
                if k < D:
                    x[0, k] = xv[j] + mul_rn(yv[j] * inv, wv[j])


#: numba type of norm_add_tail's args: (counter, x, w, eps).
TAIL_SIG = "Tuple((int32[::1], float32[:, ::1], float32[::1], float32))"


def norm_add_tail(x, w, eps, counter) -> RowTail:
    """norm_add as a one-row matmul's row tail (`_common.RowTail`): ``matmul(y, src, W,
    epilogue=norm_add_tail(x, w, eps, c))`` leaves in x and y what the matmul followed by
    ``norm_add(x, y, w, eps)`` leaves, bit for bit, in one launch. x: float32 (1, D), not the
    matmul's output; `counter` as `rmsnorm.rmsnorm_tail`'s."""
    op = "norm_add_tail"
    eps = check_eps(op, eps)
    check_array(op, "x", x, np.float32, 2, (1, None))
    D = x.shape[1]
    check_array(op, "w", w, np.float32, 1, (D,))
    check_array(op, "counter", counter, np.int32, 1)
    if D == 0 or counter.shape[0] == 0:
        raise BackendError(f"{op}: empty x {tuple(x.shape)} or counter {tuple(counter.shape)}")
    return RowTail(op, _norm_add_tail_run, (counter, x, w, eps), TAIL_SIG, D, (x,))


def ptx_tails():
    """The row tail as matmul's PTX signatures need it (name, device function, args type)."""
    return [RowTail("norm_add_tail", _norm_add_tail_run, (), TAIL_SIG, 0)]


def ptx_signatures():
    sig = "void(float32[:, ::1], float32[:, ::1], float32[::1], float32)"
    return [("norm_add", _norm_add_kernel.py_func, sig), ("norm_add_regs", _norm_add_regs_kernel.py_func, sig)]
