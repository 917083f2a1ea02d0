"""Bulk prefetch into L2 (Hopper: ``cp.async.bulk.prefetch.L2.global``).

``l2_prefetch(a, start, count)`` asks the memory system to bring elements ``a[start : start +
count]`` of a 1-D device array into L2, without registers and without waiting: one instruction per
span, however long. A one-row GEMV that streams its weight from HBM issues it for each of its
rows (codes, scales, zeros) before staging x, so those bytes are in flight while the block
stages and reduces; the later loads then hit L2. It is a hint only: it changes no value, so no
result depends on it. ``l1_prefetch(a, i)`` (``prefetch.global.L1``, any compute capability)
asks for the line of one element in the SM's L1: the matmul's weight-word pipeline asks for its
next steps' scales and zeros so.

The span is widened to whole 16-byte units (start rounded down, end rounded up), as the
instruction requires. Rounding down never leaves the allocation (device allocations are at least
256-byte aligned); rounding up may reach at most 15 bytes past the array's end, inside the same
allocation granule. Emitted only when compiling for compute capability >= 9.0; elsewhere, under
the simulator and for other targets, it is a no-op.
"""

from ._common import SIM

#: Smallest compute capability with cp.async.bulk.prefetch.L2.
MIN_CC = (9, 0)

try:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic
except ImportError:        # a numba-cuda without CUDA intrinsics
    intrinsic = None


def _target_cc():
    """Compute capability the current compilation targets, None when unknown."""
    try:
        from numba.cuda import dispatcher
        return tuple(dispatcher.get_current_device().compute_capability)
    except Exception:
        return None


if SIM or intrinsic is None:
    from numba import cuda

    @cuda.jit(device=True)
    def l2_prefetch(a, start, count):
        """No-op (the simulator, or a numba-cuda that cannot emit the instruction)."""

    @cuda.jit(device=True)
    def l1_prefetch(a, i):
        """No-op (the simulator, or a numba-cuda that cannot emit the instruction)."""

else:
    def _prefetch_codegen(context, builder, sig, args):
        aryty = sig.args[0]
        cc = _target_cc()
        if cc is None or cc < MIN_CC:
            return context.get_dummy_value()
        ary = context.make_array(aryty)(context, builder, args[0])
        i64 = ir.IntType(64)
        item = i64(context.get_abi_sizeof(context.get_data_type(aryty.dtype)))
        base = builder.ptrtoint(ary.data, i64)
        start = builder.sext(args[1], i64) if args[1].type.width < 64 else args[1]
        count = builder.sext(args[2], i64) if args[2].type.width < 64 else args[2]
        lo = builder.add(base, builder.mul(start, item))
        hi = builder.add(lo, builder.mul(count, item))
        mask = i64(-16)
        lo = builder.and_(lo, mask)
        hi = builder.and_(builder.add(hi, i64(15)), mask)
        size = builder.trunc(builder.sub(hi, lo), ir.IntType(32))
        fnty = ir.FunctionType(ir.VoidType(), [i64, ir.IntType(32)])
        asm = ir.InlineAsm(fnty, "cp.async.bulk.prefetch.L2.global [$0], $1;", "l,r", side_effect=True)
        builder.call(asm, [lo, size])
        return context.get_dummy_value()

    @intrinsic
    def l2_prefetch(typingctx, a, start, count):
        """Prefetch ``a[start : start + count]`` (1-D array) into L2 (see the module doc)."""
        if not (isinstance(a, types.Array) and a.ndim == 1 and isinstance(start, types.Integer)
                and isinstance(count, types.Integer)):
            return None
        return types.void(a, start, count), _prefetch_codegen

    def _l1_codegen(context, builder, sig, args):
        aryty, ity = sig.args
        ary = context.make_array(aryty)(context, builder, args[0])
        i64 = ir.IntType(64)
        i = args[1]
        if i.type.width < 64:
            i = builder.sext(i, i64) if ity.signed else builder.zext(i, i64)
        ptr = builder.ptrtoint(builder.gep(ary.data, [i]), i64)
        fnty = ir.FunctionType(ir.VoidType(), [i64])
        asm = "{\n.reg .u64 g;\ncvta.to.global.u64 g, $0;\nprefetch.global.L1 [g];\n}"
        builder.call(ir.InlineAsm(fnty, asm, "l", side_effect=True), [ptr])
        return context.get_dummy_value()

    @intrinsic
    def l1_prefetch(typingctx, a, i):
        """Ask for the line holding ``a[i]`` (1-D array) in this SM's L1 (a hint: no value, no
        wait; an unsigned index is zero-extended)."""
        if not (isinstance(a, types.Array) and a.ndim == 1 and isinstance(i, types.Integer)):
            return None
        return types.void(a, i), _l1_codegen

