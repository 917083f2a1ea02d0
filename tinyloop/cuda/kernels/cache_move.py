"""Moving KV-cache slots: for each move m in order, ``K[l, dst[m]] = K[l, src[m]]`` and the same for
V, in every layer l of one layer group — the codes and, for quantized codecs, the per-row scale
and zero point with them (tree-speculative decoding compacts the accepted path of a draft tree
into consecutive slots).

Shapes (L layers, S slots, Hkv kv heads, cols codes per row: hd, or hd / 2 for int4, M moves)::

    k_cache, v_cache  the codec's codes (L, S, Hkv, cols): float16, float32, int8 or uint8
    k_scale, v_scale  float32 (L, S, Hkv)   optional (codecs with a scale)
    k_zero, v_zero    float32 (L, S, Hkv)   optional (codecs with a zero point; needs the scales)
    moves             int32 (2, M)        row 0 the source slots, row 1 the destination slots

Slots are slots: a ring (sliding-window cache) needs nothing else, the caller names the slots
(trees, the only user, are rejected with rings anyway).

Thread mapping: one thread per (layer, head, code) element of a slot, grid-stride; the threads of
code 0 of each (layer, head) also move that row's scale and zero. Each thread applies the M moves
to its elements one after another, so the moves have sequential semantics (a slot written by
move a and read by a later move b reads the new value) with no cross-thread hazard. Pure copies:
nothing is computed, so the result is exact. Compiled per (scale, zero) presence; absent arrays
are stood in for by the code arrays, unused.
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
#: Storage dtypes of the codes (float codecs, int8, packed int4).
CODE_DTYPES = (np.float16, np.float32, np.int8, np.uint8)

_kernels = {}


def _make_kernel(scale, zero):
    """The move kernel with the per-row scale (and zero point) arrays moved too."""
    key = (bool(scale), bool(zero))
    if key in _kernels:
        return _kernels[key]
    SCALE, ZERO = key

    @jit_kernel
    def kernel(k_cache, v_cache, k_scale, v_scale, k_zero, v_zero, moves, n_moves):
        grid_dep_wait()
        L, S, Hk, cols = k_cache.shape
        per_layer = Hk * cols
        n = L * per_layer
        for idx in range(cuda.grid(1), n, cuda.gridsize(1)):
            layer = idx // per_layer
            r = idx - layer * per_layer
            h = r // cols
            d = r - h * cols
            for m in range(n_moves):
                s = moves[0, m]
                t = moves[1, m]
                k_cache[layer, t, h, d] = k_cache[layer, s, h, d]
                v_cache[layer, t, h, d] = v_cache[layer, s, h, d]
                if SCALE and d == 0:
                    k_scale[layer, t, h] = k_scale[layer, s, h]
                    v_scale[layer, t, h] = v_scale[layer, s, h]
                    if ZERO:
                        k_zero[layer, t, h] = k_zero[layer, s, h]
                        v_zero[layer, t, h] = v_zero[layer, s, h]

    _kernels[key] = kernel
    return kernel


def move_slots(k_cache, v_cache, moves, n_moves, stream=0, k_scale=None, v_scale=None, k_zero=None,
               v_zero=None):
    """Apply the first n_moves columns of `moves` (src row 0, dst row 1) to every layer, in order,
    to the codes and the given scale / zero arrays. Slots must lie in [0, S) (checked on the host
    by the caller, which wrote `moves`)."""
    op = "move_slots"
    check_array(op, "k_cache", k_cache, CODE_DTYPES, 4)
    check_array(op, "v_cache", v_cache, k_cache.dtype, 4, tuple(k_cache.shape))
    check_array(op, "moves", moves, np.int32, 2, (2, None))
    L, S, Hk, cols = k_cache.shape
    scale = k_scale is not None or v_scale is not None
    zero = k_zero is not None or v_zero is not None
    if zero and not scale:
        raise BackendError(f"{op}: zero points given without scales")
    for name, a, want in (("k_scale", k_scale, scale), ("v_scale", v_scale, scale),
                          ("k_zero", k_zero, zero), ("v_zero", v_zero, zero)):
        if want:
            check_array(op, name, a, np.float32, 3, (L, S, Hk))
    n_moves = int(n_moves)
    if not 0 <= n_moves <= moves.shape[1]:
        raise BackendError(f"{op}: n_moves={n_moves} is outside [0, {moves.shape[1]}]")
    n = L * Hk * cols
    if n_moves == 0 or n == 0:
        return
    ks = k_scale if scale else k_cache
    vs = v_scale if scale else v_cache
    kz = k_zero if zero else ks
    vz = v_zero if zero else vs
    _make_kernel(scale, zero)[min(cdiv(n, NT), MAX_BLOCKS), NT, stream](k_cache, v_cache, ks, vs, kz, vz,
                                                                        moves, n_moves)


def ptx_signatures():
    sigs = []
    s3 = "float32[:, :, ::1]"
    for ct, scale, zero in (("float16", False, False), ("float32", False, False), ("int8", True, False),
                            ("uint8", True, True)):
        c = f"{ct}[:, :, :, ::1]"
        ks = s3 if scale else c
        kz = s3 if zero else ks
        sigs.append((f"move_slots_{ct}", _make_kernel(scale, zero).py_func,
                     f"void({c}, {c}, {ks}, {ks}, {kz}, {kz}, int32[:, ::1], int64)"))
    return sigs
