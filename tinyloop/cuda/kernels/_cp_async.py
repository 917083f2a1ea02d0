"""Asynchronous copies from global into shared memory (``cp.async``, compute capability >= 8.0).

``cp_async(dst, i, src, j)`` starts copying element ``src.flat[j]`` into ``dst.flat[i]`` (dst a
shared array, src a global one, both C-contiguous, the same element size of 4, 8 or 16 bytes)
without passing through registers and without waiting for it. ``cp_async_commit()`` closes the
thread's current group of copies; ``cp_async_wait(n)`` returns the device function that waits
until at most n (a build constant) of the thread's committed groups are still in flight. A copy is visible to the thread that
issued it after the wait, to the others after a barrier that follows the wait. A kernel keeps
several steps of loads in flight this way with no registers held for them (the wide tensor-core
kernel of matmul_exact.py stages its next steps' limbs, weight words and group sums so).

Under the simulator (no such instruction) the copy is done at once and commit / wait do nothing:
the same values, in program order.
"""

from ._common import SIM

try:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic
except ImportError:        # a numba-cuda without CUDA intrinsics
    intrinsic = None

if SIM or intrinsic is None:
    from numba import cuda

    @cuda.jit(device=True)
    def cp_async(dst, i, src, j):
        """dst.flat[i] = src.flat[j] (at once: the simulator's form)."""
        dst.reshape(-1)[i] = src.reshape(-1)[j]

    @cuda.jit(device=True)
    def cp_async_commit():
        """No-op (the simulator's form)."""

    @cuda.jit(device=True)
    def _no_wait():
        """No-op (the simulator's form)."""

    def cp_async_wait(n: int):
        """The simulator's wait for at most n groups in flight: nothing to wait for."""
        return _no_wait

else:
    def _index(builder, v, ty):
        """The index v (numba type ty) widened to 64 bits: zero-extended when unsigned."""
        i64 = ir.IntType(64)
        if v.type.width >= 64:
            return v
        return builder.sext(v, i64) if ty.signed else builder.zext(v, i64)

    def _copy_codegen(context, builder, sig, args):
        dty, ity, sty, jty = sig.args
        dst = context.make_array(dty)(context, builder, args[0])
        src = context.make_array(sty)(context, builder, args[2])
        dp = builder.gep(dst.data, [_index(builder, args[1], ity)])
        sp = builder.gep(src.data, [_index(builder, args[3], jty)])
        size = context.get_abi_sizeof(context.get_data_type(dty.dtype))
        asm = ("{\n.reg .u64 d, s;\ncvta.to.shared.u64 d, $0;\ncvta.to.global.u64 s, $1;\n"
               f"cp.async.ca.shared.global [d], [s], {size};\n}}")
        fnty = ir.FunctionType(ir.VoidType(), [dp.type, sp.type])
        builder.call(ir.InlineAsm(fnty, asm, "l,l,~{memory}", side_effect=True), [dp, sp])
        return context.get_dummy_value()

    @intrinsic
    def cp_async(typingctx, dst, i, src, j):
        """Start copying src.flat[j] (global) into dst.flat[i] (shared); see the module doc."""
        if not (isinstance(dst, types.Array) and isinstance(src, types.Array) and dst.layout == "C"
                and src.layout == "C" and dst.dtype == src.dtype and dst.dtype.bitwidth in (32, 64, 128)
                and isinstance(i, types.Integer) and isinstance(j, types.Integer)):
            return None
        return types.void(dst, i, src, j), _copy_codegen

    def _asm_only(text):
        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.VoidType(), [])
            builder.call(ir.InlineAsm(fnty, text, "~{memory}", side_effect=True), [])
            return context.get_dummy_value()
        return codegen

    @intrinsic
    def cp_async_commit(typingctx):
        """Close this thread's current group of asynchronous copies."""
        return types.void(), _asm_only("cp.async.commit_group;")

    _waits = {}

    def cp_async_wait(n: int):
        """The device function that waits until at most n committed groups are in flight."""
        n = int(n)
        if n not in _waits:
            @intrinsic
            def wait_group(typingctx):
                return types.void(), _asm_only(f"cp.async.wait_group {n};")
            _waits[n] = wait_group
        return _waits[n]
