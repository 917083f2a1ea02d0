"""Integer tensor-core multiply-accumulate through inline PTX (numba has no mma API).

``mma_u8s8(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)`` issues one warp-wide
``mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32``: D (16 x 8, int32) = A (16 x 32, unsigned
bytes) x B (32 x 8, signed bytes) + C. Every lane of the warp must call it from uniform control
flow. Integer products and sums are exact, so the result does not depend on the order in which
the hardware adds them: that is what lets a tensor-core kernel and a CUDA-core or CPU kernel
give the same bits (docs/KERNELS.md, "Exact integer matmul").

Fragments (lane = 4 * gid + tig, gid = lane >> 2, tig = lane & 3; bytes little-endian in each
32-bit register, byte i is element i):

* A: ``a0`` row gid, k-slots 4 tig .. 4 tig + 3; ``a1`` row gid + 8, same slots; ``a2`` row gid,
  slots 16 + 4 tig ..; ``a3`` row gid + 8, slots 16 + 4 tig ...
* B: ``b0`` column gid, k-slots 4 tig .. 4 tig + 3; ``b1`` column gid, slots 16 + 4 tig ...
* C / D: ``c0, c1`` row gid, columns 2 tig, 2 tig + 1; ``c2, c3`` row gid + 8, same columns.

The k-slots are only names: a kernel may map any 32 k values onto them as long as A and B use the
same map in every lane (a sum does not care which slot carries which k).

Arguments must already be uint32 (a*, b*) and int32 (c*). Compiles only for compute capability
>= 8.0. Under the CUDA simulator (which runs a block's threads as Python threads) a twin does the
warp's exchange itself: each lane posts its fragments, waits at a barrier of its warp's 32 lanes,
computes its own D fragment from all of them in exact integers, and waits again before the slots
are reused; so the tensor-core kernels run, slowly, against the numpy reference in CI.
"""

from __future__ import annotations

import threading

import numpy as np

from ._common import SIM

try:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic
except ImportError:        # a numba-cuda without CUDA intrinsics
    intrinsic = None

if SIM:
    intrinsic = None

_ASM = ("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 "
        "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};")
_CONSTRAINTS = ",".join(["=r"] * 4 + ["r"] * 10)

if intrinsic is not None:
    def _mma_codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32] * 10)
        res = builder.call(ir.InlineAsm(fnty, _ASM, _CONSTRAINTS), list(args))
        vals = [builder.extract_value(res, i) for i in range(4)]
        return context.make_tuple(builder, sig.return_type, vals)

    @intrinsic
    def mma_u8s8(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """One m16n8k32 u8 x s8 -> s32 tensor-core step (see the module doc)."""
        ab = (a0, a1, a2, a3, b0, b1)
        cs = (c0, c1, c2, c3)
        if not all(t == types.uint32 for t in ab) or not all(t == types.int32 for t in cs):
            return None
        return types.UniTuple(types.int32, 4)(*ab, *cs), _mma_codegen
elif SIM:
    from numba import cuda

    _warps = {}
    _warps_lock = threading.Lock()

    def _warp_state(key):
        with _warps_lock:
            if key not in _warps:
                # a timeout turns a warp whose lanes do not all arrive (an exception elsewhere, or
                # divergent control flow: a kernel bug) into an error instead of a hang
                _warps[key] = (threading.Barrier(32, timeout=120), [None] * 32)
            return _warps[key]

    def _wait(key, bar):
        try:
            bar.wait()
        except threading.BrokenBarrierError:
            with _warps_lock:
                _warps.pop(key, None)      # the next launch starts from a fresh barrier
            raise RuntimeError("mma_u8s8 (simulator): not every lane of the warp reached the mma")

    def _bytes(r, signed):
        b = np.array([(int(r) >> (8 * i)) & 255 for i in range(4)], np.int64)
        return np.where(b > 127, b - 256, b) if signed else b

    @cuda.jit(device=True)
    def mma_u8s8(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """The simulator's twin (module doc): the same D fragment, exactly."""
        bd, ti, bi = cuda.blockDim, cuda.threadIdx, cuda.blockIdx
        tid = ti.x + bd.x * (ti.y + bd.y * ti.z)
        lane = tid % 32
        key = (bi.x, bi.y, bi.z, tid // 32)
        bar, slots = _warp_state(key)
        slots[lane] = (a0, a1, a2, a3, b0, b1)
        _wait(key, bar)
        A = np.zeros((16, 32), np.int64)
        B = np.zeros((32, 8), np.int64)
        for ln in range(32):
            g, t = ln >> 2, ln & 3
            f = slots[ln]
            A[g, 4 * t:4 * t + 4] = _bytes(f[0], False)
            A[g + 8, 4 * t:4 * t + 4] = _bytes(f[1], False)
            A[g, 16 + 4 * t:20 + 4 * t] = _bytes(f[2], False)
            A[g + 8, 16 + 4 * t:20 + 4 * t] = _bytes(f[3], False)
            B[4 * t:4 * t + 4, g] = _bytes(f[4], True)
            B[16 + 4 * t:20 + 4 * t, g] = _bytes(f[5], True)
        _wait(key, bar)
        D = A @ B
        g, t = lane >> 2, lane & 3
        return (np.int32(D[g, 2 * t] + c0), np.int32(D[g, 2 * t + 1] + c1),
                np.int32(D[g + 8, 2 * t] + c2), np.int32(D[g + 8, 2 * t + 1] + c3))
else:
    mma_u8s8 = None
