"""The CUDA kernels, one op per module (docs/KERNELS.md)."""


def kernel_modules():
    """Every op module of this package (each has `ptx_signatures()`)."""
    from . import (accept, add, argmax, attention, bias, cache_move, embed, exit_probe, init_state,
                   kv_layer_copy, kv_store, matmul, matmul_exact, norm_add, position, rmsnorm, rope, sample, swiglu, token_mask)
    return (matmul, matmul_exact, rmsnorm, norm_add, rope, attention, kv_store, swiglu, embed, add, bias, argmax, sample,
            position, accept, cache_move, token_mask, exit_probe, kv_layer_copy, init_state)


def ptx_signatures():
    """(name, python function, signature) of every kernel the launchers compile, the matmul's pair
    variants for the rope (qkv and qkv staging) and swiglu epilogues and its one-row variants for
    the rmsnorm and norm_add row tails included (PTX tests, bench/sass_report.py)."""
    from . import matmul, matmul_exact, norm_add, rmsnorm, rope, swiglu
    sigs = [s for m in kernel_modules() if m not in (matmul, matmul_exact) for s in m.ptx_signatures()]
    return (sigs + matmul.ptx_signatures(rope.ptx_epilogues() + swiglu.ptx_epilogues(),
                                         rmsnorm.ptx_tails() + norm_add.ptx_tails())
            + matmul_exact.ptx_signatures(swiglu.ptx_epilogues()))
