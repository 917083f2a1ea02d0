"""Four-way byte dot product through inline PTX (numba has no dp4a API).

``dp4a_us(a, b, c)`` is ``c + sum_i ubyte_i(a) * sbyte_i(b)`` in int32 (``dp4a.u32.s32``): byte i
of the unsigned operand a times byte i of the signed operand b, the four products and c added
exactly. The exact integer matmul's one-row kernel (matmul_exact.py) multiplies four 4-bit weight
codes (one per byte after a mask) by four signed 7-bit limbs of x with it. Integer sums are exact,
so the result is the tensor-core kernel's and the CPU's, whatever the order of additions.

Arguments are int32 or uint32 (their bits are used); the result is int32. Under the CUDA
simulator a Python twin computes the same value.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from ._common import SIM

if SIM:
    @cuda.jit(device=True)
    def dp4a_us(a, b, c):
        a, b = int(a) & 0xFFFFFFFF, int(b) & 0xFFFFFFFF
        s = int(c)
        for i in range(4):
            sb = (b >> (8 * i)) & 255
            s += ((a >> (8 * i)) & 255) * (sb - 256 if sb > 127 else sb)
        return np.int32(s)
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    _I32 = ir.IntType(32)

    def _dp4a_codegen(context, builder, sig, args):
        vals = [context.cast(builder, v, t, types.int32) for v, t in zip(args, sig.args)]
        fnty = ir.FunctionType(_I32, [_I32] * 3)
        return builder.call(ir.InlineAsm(fnty, "dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r"), vals)

    @intrinsic
    def dp4a_us(typingctx, a, b, c):
        """c + the four products unsigned byte of a x signed byte of b (int32)."""
        ok = (types.int32, types.uint32)
        if a not in ok or b not in ok or c not in ok:
            return None
        return types.int32(a, b, c), _dp4a_codegen
