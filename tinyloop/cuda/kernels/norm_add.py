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

from numba import cuda

from ._cache import jit_kernel
from ._common import mul_rn
from ._pdl import grid_dep_wait
from .rmsnorm import NT, check_row_args, row_inv_rms


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


def norm_add(x, y, w, eps, stream=0):
    """``x += y / sqrt(mean(y^2, axis=1) + eps) * w`` row by row (x must not be y)."""
    T, eps = check_row_args("norm_add", ("x", x), ("y", y), w, eps)
    if T == 0:
        return
    _norm_add_kernel[T, NT, stream](x, y, w, eps)


def ptx_signatures():
    return [("norm_add", _norm_add_kernel.py_func,
             "void(float32[:, ::1], float32[:, ::1], float32[::1], float32)")]
