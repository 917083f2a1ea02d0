"""Quantized KV store: float32 K and V rows (the rotated k and the raw v of T launch rows, staged by
the q|k|v epilogue or by `rope`) encoded by a quantized codec (int8, int4;
tinyloop/cuda/kv_codecs.py) into one cache layer, codes, scale and zero point per (row, kv head).

Why a kernel of its own: a row's scale is a reduction over all head_dim values of the (row, kv
head) — max |x| for int8, min and max for int4 — while the q|k|v matmul epilogue that computes
those values holds one rotation pair per warp. So for a quantized codec the epilogue writes
float32 rows and this launch (one per attention block) encodes them.

Shapes (T rows, Hkv kv heads, hd head width, L layers of the group, S slots, cols = hd / pack)::

    k, v          float32 (T, Hkv * hd)      staged rows (kv head h in columns h*hd .. h*hd + hd)
    k_data, v_data  the codec's codes (L, S, Hkv, cols)    int8 (hd) or uint8 (hd / 2, int4)
    k_scale, v_scale  float32 (L, S, Hkv)
    k_zero, v_zero    float32 (L, S, Hkv)    codecs with a zero point (int4); else the scale
                                             arrays stand in, unused
    pos           int32 (1,)                 position of row 0, read on the device
    depth, path   int32 (T,), (T, D+1)       optional draft-tree tables (linear caches only;
                                             empty: causal)

Placement: row t at position p = pos[0] + t goes to slot p of a linear cache (not written when
p >= S) or slot p % S of a ring (``window`` > 0); with tree tables to slot
pos[0] + path[t, depth[t]] (rope.row_place), exactly where the float codecs' stores put it.

Thread mapping: one warp per (K or V, row t, kv head): unit u of the grid, blocks of NW warps, u
= (which * T + t) * Hkv + kvh, which 0 for K and 1 for V. Lane l holds the dim pairs
(2j, 2j + 1) for j = l, l + 32, ... (so an int4 byte is one lane's). The codec's ``stat`` folds
the lane's values into two statistics, two warp max butterflies (`_common.warp_max`; exact, so
the order does not matter) give every lane the row's values, ``params`` gives inv, scale and
zero, and ``put`` writes each pair's codes; lane 0 writes the scale and zero. Every quantity is
the codec reference's float32 operation (``x * inv`` or ``(x - lo) * inv``, ``rint`` half to
even, clip; ``inv`` and the scale correctly rounded divisions), so the codes, scales and zeros
are those of ``codec.encode`` bit for bit, and each row's result depends only on its own values:
batch-invariant. Warps past the last unit run the butterflies on a clamped unit (uniform control
flow for the simulator's shared-memory twins) and store nothing.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32

from ...errors import BackendError
from ..kv_codecs import INT4, INT8, as_rows
from ._cache import jit_kernel
from ._common import SIM, cdiv, check_array, check_tree, warp_max
from ._pdl import grid_dep_wait
from .rope import ring_slot, row_place

#: Warps (units) per block: 4 on the GPU, 2 under the simulator.
NW = 2 if SIM else 4
NT = NW * 32
MAX_BLOCKS = 65535

_kernels = {}


def _make_kernel(codec):
    """The store kernel of quantized codec `codec` (a kv_codecs.CUDAKVCodec with ``quant``)."""
    if codec in _kernels:
        return _kernels[codec]
    qz = codec.quant
    a0, b0 = qz.init
    stat, params, put = qz.stat, qz.params, qz.put
    ZERO = codec.has_zero

    @jit_kernel
    def kernel(k, v, kd, ks, kz, vd, vs, vz, layer, pos, S, W, depth, path):
        grid_dep_wait()
        T = k.shape[0]
        Hk = kd.shape[2]
        hd = k.shape[1] // Hk
        n_units = 2 * T * Hk
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        scratch = cuda.shared.array((NW, 32), float32)
        unit = cuda.blockIdx.x * NW + warp
        u = min(unit, n_units - 1)
        which = u // (T * Hk)
        r = u - which * (T * Hk)
        t = r // Hk
        kvh = r - t * Hk
        src = k if which == 0 else v
        c0 = kvh * hd
        a = a0
        b = b0
        for j in range(lane, hd // 2, 32):
            a, b = stat(a, b, src[t, c0 + 2 * j], src[t, c0 + 2 * j + 1])
        a = warp_max(a, scratch, warp, lane)
        b = warp_max(b, scratch, warp, lane)
        inv, scale, zero = params(a, b)
        _, slot = row_place(t, pos[0], depth, path)
        slot = ring_slot(slot, W, S)
        if unit < n_units and 0 <= slot < S:
            dd = kd if which == 0 else vd
            for j in range(lane, hd // 2, 32):
                put(dd, layer, slot, kvh, j, src[t, c0 + 2 * j], src[t, c0 + 2 * j + 1], inv, zero)
            if lane == 0:
                if which == 0:
                    ks[layer, slot, kvh] = scale
                    if ZERO:
                        kz[layer, slot, kvh] = zero
                else:
                    vs[layer, slot, kvh] = scale
                    if ZERO:
                        vz[layer, slot, kvh] = zero

    _kernels[codec] = kernel
    return kernel


def _check_rows(op, name, rows, codec, shape):
    check_array(op, f"{name}_data", rows.data, codec.dtype, 4, shape)
    check_array(op, f"{name}_scale", rows.scale, np.float32, 3, shape[:3])
    if codec.has_zero:
        check_array(op, f"{name}_zero", rows.zero, np.float32, 3, shape[:3])
        return rows.zero
    if rows.zero is not None:
        raise BackendError(f"{op}: {name}_zero given for the {codec.name} codec, which has none")
    return rows.scale


def kv_store(k, v, k_cache, v_cache, layer, pos, codec, stream=0, depth=None, path=None, window=0):
    """Encode the float32 rows k, v (T, Hkv * hd) with quantized `codec` (kv_codecs.INT8 / INT4, or
    any CUDAKVCodec with ``quant``) into layer `layer` of `k_cache` / `v_cache` (kv_codecs.Rows:
    data, scale, zero) at the rows' slots: pos[0] + t, the tree layout's (depth / path), or
    (pos[0] + t) % S of a ring when `window` > 0 (module doc)."""
    op = "kv_store"
    if codec is None or not getattr(codec, "quantized", False):
        raise BackendError(f"{op}: codec {getattr(codec, 'name', codec)!r} is not a quantized KV codec "
                           f"(fp32 / fp16 rows are stored by the rope kernels)")
    kr, vr = as_rows(k_cache), as_rows(v_cache)
    check_array(op, "k_data", kr.data, codec.dtype, 4)
    L, S, Hk, cols = kr.data.shape
    hd = cols * codec.pack
    if Hk == 0 or hd == 0 or hd % 2:
        raise BackendError(f"{op}: cache data of shape {tuple(kr.data.shape)} (head_dim={hd} must be "
                           f"even and positive)")
    kz = _check_rows(op, "k", kr, codec, (L, S, Hk, cols))
    vz = _check_rows(op, "v", vr, codec, (L, S, Hk, cols))
    check_array(op, "k", k, np.float32, 2, (None, Hk * hd))
    T = k.shape[0]
    check_array(op, "v", v, np.float32, 2, (T, Hk * hd))
    check_array(op, "pos", pos, np.int32, 1, (1,))
    layer = int(layer)
    if not 0 <= layer < L:
        raise BackendError(f"{op}: layer={layer} is outside [0, {L})")
    window = int(window)
    if not 0 <= window <= S:
        raise BackendError(f"{op}: window={window} is outside [0, {S}] (a ring of {S} slots)")
    if T > S:
        raise BackendError(f"{op}: {T} rows do not fit a cache of {S} slots")
    depth, path = check_tree(op, depth, path, T)
    if window and depth.shape[0] > 0:
        raise BackendError(f"{op}: a draft tree's rows cannot be stored in a ring (window={window}); "
                           f"trees need a linear cache")
    if T == 0:
        return
    blocks = cdiv(2 * T * Hk, NW)
    if blocks > MAX_BLOCKS:
        raise BackendError(f"{op}: {T} rows x {Hk} kv heads need {blocks} blocks, more than {MAX_BLOCKS}")
    _make_kernel(codec)[blocks, NT, stream](k, v, kr.data, kr.scale, kz, vr.data, vr.scale, vz, layer,
                                            pos, S, window, depth, path)


def ptx_signatures():
    m = "float32[:, ::1]"
    s3 = "float32[:, :, ::1]"
    sigs = []
    for codec in (INT8, INT4):
        c = f"{np.dtype(codec.dtype).name}[:, :, :, ::1]"
        sigs.append((f"kv_store_{codec.name}", _make_kernel(codec).py_func,
                     f"void({m}, {m}, {c}, {s3}, {s3}, {c}, {s3}, {s3}, int64, int32[::1], int64, int64, "
                     "int32[::1], int32[:, ::1])"))
    return sigs
