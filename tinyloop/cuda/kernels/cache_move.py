"""Moving KV-cache slots: for each move m in order, ``K[l, dst[m]] = K[l, src[m]]`` and the same for
V, in every layer l (tree-speculative decoding compacts the accepted path of a draft tree into
consecutive slots).

Shapes (L layers, S slots, Hkv kv heads, hd head width, M moves)::

    k_cache, v_cache  float16 or float32 (L, S, Hkv, hd)
    moves             int32 (2, M)        row 0 the source slots, row 1 the destination slots

Thread mapping: one thread per (layer, head, dim) element of a slot, grid-stride; each thread
applies the M moves to its element one after another, so the moves have sequential semantics
(a slot written by move a and read by a later move b reads the new value) with no cross-thread
hazard. Pure copies: nothing is computed, so the result is exact.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from ...core.errors import BackendError
from ._common import cdiv, check_array
from ._pdl import grid_dep_wait

NT = 256
MAX_BLOCKS = 1024


@cuda.jit
def _move_slots_kernel(k_cache, v_cache, moves, n_moves):
    grid_dep_wait()
    L, S, Hk, hd = k_cache.shape
    per_layer = Hk * hd
    n = L * per_layer
    for idx in range(cuda.grid(1), n, cuda.gridsize(1)):
        layer = idx // per_layer
        r = idx - layer * per_layer
        h = r // hd
        d = r - h * hd
        for m in range(n_moves):
            s = moves[0, m]
            t = moves[1, m]
            k_cache[layer, t, h, d] = k_cache[layer, s, h, d]
            v_cache[layer, t, h, d] = v_cache[layer, s, h, d]


def move_slots(k_cache, v_cache, moves, n_moves, stream=0):
    """Apply the first n_moves columns of `moves` (src row 0, dst row 1) to every layer, in order.
    Slots must lie in [0, S) (checked on the host by the caller, which wrote `moves`)."""
    op = "move_slots"
    check_array(op, "k_cache", k_cache, (np.float16, np.float32), 4)
    check_array(op, "v_cache", v_cache, k_cache.dtype, 4, tuple(k_cache.shape))
    check_array(op, "moves", moves, np.int32, 2, (2, None))
    n_moves = int(n_moves)
    if not 0 <= n_moves <= moves.shape[1]:
        raise BackendError(f"{op}: n_moves={n_moves} is outside [0, {moves.shape[1]}]")
    L, S, Hk, hd = k_cache.shape
    n = L * Hk * hd
    if n_moves == 0 or n == 0:
        return
    _move_slots_kernel[min(cdiv(n, NT), MAX_BLOCKS), NT, stream](k_cache, v_cache, moves, n_moves)


def ptx_signatures():
    sigs = []
    for ct in ("float16", "float32"):
        c = f"{ct}[:, :, :, ::1]"
        sigs.append((f"move_slots_{ct}", _move_slots_kernel.py_func, f"void({c}, {c}, int32[:, ::1], int64)"))
    return sigs
