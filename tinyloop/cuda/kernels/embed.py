"""Embedding lookup: ``out[t, :] = dequantized row ids[t] of the embedding table`` (times the
model's embed_scale: one float32 multiply, exact for 1.0).

Shapes (T rows, V = vocab_size, D = d_model, G = D / group_size)::

    ids     int32   (T,)
    out     float32 (T, D)
    table f32: float32 (V, D)   f16: float16 (V, D)
          qB : uint8 (V, D*B/8) with scales float16 (V, G) and zeros uint8 (V, G),
               element k = (q_k - zeros[id, k // group]) * scales[id, k // group]
               (B in 8, 4, 2; element 2j of a q4 row in the LOW nibble of byte j)

Thread mapping: grid (ceil(D / 256), T), one element per thread. Each element is a single
dequantization, ``float32(q - zero) * scale`` (exact difference, one rounding), independent of T:
batch-invariant. An id outside [0, V) cannot be reported from the device; its row is written as
zeros (callers validate ids on the host before upload).
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32

from ...errors import BackendError
from ._cache import jit_kernel
from ._common import cdiv, check_array
from ._pdl import grid_dep_wait

NT = 256


@jit_kernel
def _embed_f_kernel(out, ids, table, scale):
    grid_dep_wait()
    D = out.shape[1]
    V = table.shape[0]
    t = cuda.blockIdx.y
    k = cuda.blockIdx.x * NT + cuda.threadIdx.x
    if k < D:
        i = ids[t]
        v = float32(0.0)
        if 0 <= i < V:
            v = float32(table[i, k]) * scale
        out[t, k] = v


@jit_kernel
def _embed_q_kernel(out, ids, q, scales, zeros, bits, group, scale):
    grid_dep_wait()
    D = out.shape[1]
    V = q.shape[0]
    t = cuda.blockIdx.y
    k = cuda.blockIdx.x * NT + cuda.threadIdx.x
    if k < D:
        i = ids[t]
        v = float32(0.0)
        if 0 <= i < V:
            per = 8 // bits
            b = int32(q[i, k // per])
            qv = (b >> ((k % per) * bits)) & ((1 << bits) - 1)
            g = k // group
            v = float32(qv - int32(zeros[i, g])) * float32(scales[i, g]) * scale
        out[t, k] = v


def embed(out, ids, table, scales=None, zeros=None, stream=0, scale=1.0):
    """Gather rows `ids` (int32 (T,), on the device) of `table` into out (float32 (T, D)), each
    element times `scale` (a float32 multiply).

    `table` is float32/float16 (V, D), or uint8 (V, D*B/8) with `scales` float16 (V, G) and
    `zeros` uint8 (V, G) (storage inferred from dtype and shape, as in `matmul`)."""
    op = "embed"
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not np.isfinite(scale):
        raise BackendError(f"{op}: scale must be a finite number, got {scale!r}")
    scale = np.float32(scale)
    check_array(op, "out", out, np.float32, 2)
    T, D = out.shape
    check_array(op, "ids", ids, np.int32, 1, (T,))
    if table is None:
        raise BackendError(f"{op}: table is required")
    dt = np.dtype(table.dtype)
    if dt in (np.float32, np.float16):
        check_array(op, "table", table, dt, 2, (None, D))
        if scales is not None or zeros is not None:
            raise BackendError(f"{op}: scales/zeros given for an unquantized table")
        if T and D:
            _embed_f_kernel[(cdiv(D, NT), T), NT, stream](out, ids, table, scale)
        return
    check_array(op, "table", table, np.uint8, 2)
    V = table.shape[0]
    if D == 0 or (table.shape[1] * 8) % D or table.shape[1] * 8 // D not in (8, 4, 2):
        raise BackendError(f"{op}: uint8 table of shape {tuple(table.shape)} does not hold "
                           f"d_model={D} elements of 8, 4 or 2 bits per row")
    bits = table.shape[1] * 8 // D
    check_array(op, "scales", scales, np.float16, 2, (V, None))
    G = scales.shape[1]
    check_array(op, "zeros", zeros, np.uint8, 2, (V, G))
    if G == 0 or D % G:
        raise BackendError(f"{op}: d_model={D} is not a whole number of the {G} groups")
    if T:
        _embed_q_kernel[(cdiv(D, NT), T), NT, stream](out, ids, table, scales, zeros, bits,
                                                       D // G, scale)


def ptx_signatures():
    sigs = []
    for wt in ("float32", "float16"):
        sigs.append((f"embed_{wt}", _embed_f_kernel.py_func,
                     f"void(float32[:, ::1], int32[::1], {wt}[:, ::1], float32)"))
    sigs.append(("embed_q", _embed_q_kernel.py_func,
                 "void(float32[:, ::1], int32[::1], uint8[:, ::1], float16[:, ::1], "
                 "uint8[:, ::1], int64, int64, float32)"))
    return sigs
