"""Copying one position's K/V rows between layers of a layer group:
``a[first + k * stride, slot] = a[src, slot]`` for k = 0 .. count-1, where slot is the slot of the
device-resident position (early exit's ``copy_last``: the layers of the loop iterations a token
skipped get the rows of the last iteration it ran, for the same loop layer).

Shapes (L layers, S slots, Hkv kv heads, C codes per row)::

    a      one storage array of the group: codes (L, S, Hkv, C) of any code dtype, or a per-row
           scale / zero point (L, S, Hkv), passed as (L, S, Hkv, 1)
    pos    int32 (1,)    the absolute position; slot = pos if not ring else pos % S

The position is read on the device, so a captured step replays unchanged. ``copy_from_exit``
reads the exit depth on the device too (a guarded step's probe state), so one launch in the
step's tail serves every exit depth. One thread per
(destination layer, head, code) element, grid-stride; pure copies, exact. The launcher always
launches (an empty range copies nothing), so the kernel is compiled and loaded the first time a
cache is set up, never while a graph is being captured.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from ...errors import BackendError
from ._cache import jit_kernel
from ._common import cdiv, check_array
from ._pdl import grid_dep_wait

NT = 128
MAX_BLOCKS = 256
#: Storage dtypes of codes, scales and zero points.
DTYPES = (np.float16, np.float32, np.int8, np.uint8)


@jit_kernel
def _copy_kernel(a, pos, ring, src, first, stride, count):
    grid_dep_wait()
    L, S, H, C = a.shape
    p = pos[0]
    slot = p % S if ring else p
    per = H * C
    for idx in range(cuda.grid(1), count * per, cuda.gridsize(1)):
        k = idx // per
        r = idx - k * per
        h = r // C
        c = r - h * C
        a[first + k * stride, slot, h, c] = a[src, slot, h, c]


def copy_layers_at(a, pos, ring: bool, src: int, dst: range, stream=0) -> None:
    """For each layer l of `dst` (a range of local layers): a[l, slot(pos)] = a[src, slot(pos)]
    (`a` 3-D arrays are taken as (L, S, Hkv, 1))."""
    op = "kv_layer_copy"
    if a is not None and a.ndim == 3:
        a = a.reshape(tuple(a.shape) + (1,))
    check_array(op, "a", a, DTYPES, 4)
    check_array(op, "pos", pos, np.int32, 1, (1,))
    L = a.shape[0]
    if not isinstance(dst, range) or dst.step < 1:
        raise BackendError(f"{op}: the destination layers must be an increasing range, got {dst!r}")
    if not 0 <= src < L or (len(dst) and not (0 <= dst[0] and dst[-1] < L)):
        raise BackendError(f"{op}: layers src={src}, dst={dst!r} are outside the group's {L} layers")
    n = len(dst) * a.shape[2] * a.shape[3]
    _copy_kernel[max(1, min(cdiv(n, NT), MAX_BLOCKS)), NT, stream](
        a, pos, bool(ring), np.int32(src), np.int32(dst.start if len(dst) else 0), np.int32(dst.step),
        np.int32(len(dst)))


@jit_kernel
def _copy_from_exit_kernel(a, pos, ring, state, first, n_loop, loops):
    grid_dep_wait()
    d = state[1]
    if d == 0:
        return
    L, S, H, C = a.shape
    p = pos[0]
    slot = p % S if ring else p
    per = H * C
    count = loops - d
    for idx in range(cuda.grid(1), n_loop * count * per, cuda.gridsize(1)):
        j = idx // (count * per)
        r = idx - j * count * per
        k = r // per
        r -= k * per
        h = r // C
        c = r - h * C
        a[first + (d + k) * n_loop + j, slot, h, c] = a[first + (d - 1) * n_loop + j, slot, h, c]


def copy_from_exit(a, pos, ring: bool, state, first: int, n_loop: int, loops: int, stream=0) -> None:
    """Early exit's copy_last after a guarded step, with the depth d read on the device
    (``state[1]``, 0: the step did not exit, nothing is copied): for each loop layer j < n_loop and
    iteration i in d .. loops-1, local layer first + i * n_loop + j := first + (d - 1) * n_loop + j
    at the position's slot."""
    op = "kv_layer_copy"
    if a is not None and a.ndim == 3:
        a = a.reshape(tuple(a.shape) + (1,))
    check_array(op, "a", a, DTYPES, 4)
    check_array(op, "pos", pos, np.int32, 1, (1,))
    check_array(op, "state", state, np.int32, 1, (2,))
    if n_loop < 1 or loops < 1 or first < 0 or first + loops * n_loop > a.shape[0]:
        raise BackendError(f"{op}: loop layers {first} + {loops} x {n_loop} exceed the group's {a.shape[0]} layers")
    n = n_loop * (loops - 1) * a.shape[2] * a.shape[3]
    _copy_from_exit_kernel[max(1, min(cdiv(n, NT), MAX_BLOCKS)), NT, stream](
        a, pos, bool(ring), state, np.int32(first), np.int32(n_loop), np.int32(loops))


def ptx_signatures():
    return [(f"kv_layer_copy_{dt}", _copy_kernel.py_func,
             f"void({dt}[:, :, :, ::1], int32[::1], boolean, int32, int32, int32, int32)")
            for dt in ("float16", "float32", "int8", "uint8")] + \
        [(f"kv_layer_copy_from_exit_{dt}", _copy_from_exit_kernel.py_func,
          f"void({dt}[:, :, :, ::1], int32[::1], boolean, int32[::1], int32, int32, int32)")
         for dt in ("float16", "float32", "int8", "uint8")]
