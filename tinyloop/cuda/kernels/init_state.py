"""The seeded random initial state of the loop (loop_init "random"): ``x[t, :]`` = the draw of
row t's position, exactly tinyloop.model.init_state.random_state.

Shapes::

    x      float32 (T, d)      written
    pos    int32 (1,)          position of row 0, read on the device
    depth, path  int32 (T,), (T, D+1)  optional draft-tree tables: row t is then at position
                 pos[0] + depth[t] (tinyloop.runtime.backend.TreeRows; empty tables (0,), (0, 1)
                 mean the causal layout, row t at pos[0] + t)

Element (t, i), row position p, n = p * d + i: six splitmix64 hashes ``mix(key + (6 n + k) G)``
(key = mix(seed + G), made on the host), their twelve 32-bit halves summed as an exact integer S,
``float32(((2 S - (12 * 2^32 - 12)) * 2^-33) * scale)`` with the inner product exact in float64
(model/init_state.py). Only integer arithmetic and one float64 multiply, so the device, the
simulator and numpy agree bit for bit.

Thread mapping: one thread per element, flat grid-stride. Every element depends only on its
position and channel: independent of T and the grid (batch-invariant). The position is read
from the device array, so a captured graph replays unchanged while the host advances pos[0].
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, float64, int64, uint64

from ...errors import BackendError
from ...model.init_state import DRAWS, G, OFFSET, seed_key, state_element
from ._cache import jit_kernel
from ._common import SIM, cdiv, check_array, check_tree, splitmix64
from ._pdl import grid_dep_wait
from .rope import row_place

NT = 256
MAX_BLOCKS = 4096

if not SIM:
    _U_G = np.uint64(G)
    _U_MASK32 = np.uint64(0xFFFFFFFF)

    @cuda.jit(device=True)
    def _element(key, n, scale):
        s = uint64(0)
        base = n * uint64(DRAWS)
        for k in range(DRAWS):
            h = splitmix64(key + (base + uint64(k)) * _U_G)
            s += (h & _U_MASK32) + (h >> uint64(32))
        v = int64(s) * int64(2) - int64(OFFSET)
        return float32(float64(v) * float64(2.0 ** -33) * scale)
else:
    @cuda.jit(device=True)
    def _element(key, n, scale):
        # numpy warns on uint64 wrap-around; the host definition on Python integers is the same.
        return np.float32(state_element(int(key), int(n), float(scale)))


@jit_kernel
def _init_state_kernel(x, pos, key, scale, depth, path):
    grid_dep_wait()
    T, d = x.shape
    p0 = pos[0]
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for e in range(start, T * d, stride):
        t = e // d
        i = e - t * d
        p, _ = row_place(t, p0, depth, path)
        x[t, i] = _element(key, uint64(p) * uint64(d) + uint64(i), scale)


def init_state(x, pos, seed, scale, stream=0, depth=None, path=None):
    """x[t] = the random initial state of row t's position (module doc), for every row of x."""
    op = "init_state"
    check_array(op, "x", x, np.float32, 2)
    check_array(op, "pos", pos, np.int32, 1, (1,))
    T, d = x.shape
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) < 2 ** 64:
        raise BackendError(f"{op}: seed={seed!r} must be an integer in [0, 2**64)")
    scale = float(scale)
    if not 0 < scale < 1e6:
        raise BackendError(f"{op}: scale={scale!r} must be a finite number in (0, 1e6)")
    if T * d >= 2 ** 31:
        raise BackendError(f"{op}: {T} x {d} elements are too many for one launch")
    depth, path = check_tree(op, depth, path, T)
    if T == 0 or d == 0:
        return
    _init_state_kernel[min(cdiv(T * d, NT), MAX_BLOCKS), NT, stream](
        x, pos, np.uint64(seed_key(int(seed))), np.float64(scale), depth, path)


def ptx_signatures():
    return [("init_state", _init_state_kernel.py_func,
             "void(float32[:, ::1], int32[::1], uint64, float64, int32[::1], int32[:, ::1])")]
