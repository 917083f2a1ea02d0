"""RMSNorm: ``out[t, k] = x[t, k] * (1 / sqrt(mean_k(x[t]^2) + eps)) * w[k]``.

Shapes (T rows, D features)::

    x    float32 (T, D)
    w    float32 (D,)
    out  float32 (T, D)      may be the same array as x (in place)

Thread mapping: one block of NT = 256 threads (8 warps) per row t; thread i accumulates
``fma(x, x, ss)`` over k = i, i+256, ... in ascending order, then `_common.block_sum` combines the
256 partials (warp xor-butterflies, then warp totals in warp order). Launches of up to REGS_T
rows (decode) take the register form: a thread requests all its values of a row (up to ROW_REGS
of x and of w) before its first fma and writes the outputs from those registers, so a row costs
one memory round trip instead of one per element (in the loop form the stores may alias the
loads, so nothing can be moved across them: a 5280-wide row took 11 us on an H100). The block shape is fixed, so
the sum of a row, and hence every output element, does not depend on T or on the grid:
batch-invariant. Warp reductions: shuffles on the GPU, shared-memory twin under the simulator.

The per-thread partial (`sumsq_partial`) and the scale formula (`inv_rms`) are device functions:
the matmul's fused-norm prologue (matmul.py, ``norm_w=``) reproduces this kernel's summation order
with them (the NW warp partials, each a butterfly, added in warp order), so a fused norm computes
the same inverse RMS bits as this kernel.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from ...errors import BackendError
from ._cache import jit_kernel
from ._common import RowTail, block_sum, block_sum_first, check_array
from ._pdl import grid_dep_wait

NW = 8
NT = NW * 32
#: Values of a row each thread of the row kernels (rmsnorm, norm_add) holds in registers: rows of
#: up to NT * ROW_REGS = 8192 elements are read once, every load of the thread requested before
#: its first fma, and written from the same registers after the block sum; longer rows go in
#: chunks of that many. Loads only: the order of every fma and product is the loop's
#: (k = i, i + NT, ... ascending), so the bits are unchanged.
ROW_REGS = 32
#: Loads in flight together in `sumsq_partial` (the matmul's fused-norm prologue and
#: `row_inv_rms`): a thread's partial over k = i, i + NT, ... reads its x in chunks of this many.
SUMSQ_CHUNK = 8
#: Row-norm launches of at most this many rows take the register form (`regs_form`).
REGS_T = 128
#: Values a thread of a row tail (`rmsnorm_tail`, norm_add's) requests together before storing
#: them: the tail runs inside a matmul kernel, whose registers it must not raise.
TAIL_CHUNK = 8
#: Threads a row tail needs: the row kernels' block (the partials of threads 0 .. NT - 1).
TAIL_THREADS = NT
#: Widest row whose norm rides as a row tail in decode (`tail_pays`): one chunk a thread.
TAIL_ROW_MAX = NT * TAIL_CHUNK


def tail_pays(D: int) -> bool:
    """Whether a row of D elements is normed faster as a one-row matmul's row tail than by the
    separate kernel: rows a thread covers in one chunk (D <= TAIL_ROW_MAX). H100, decode profile
    (bench/profile_decode.py, docs/BENCHMARKS.md): Ouro's 2048-wide norm_add, 0.531 -> 0.500
    ms/token with the tail; Huginn's 5280-wide sandwich rmsnorm (three chunks a thread, run by one
    block after the whole grid) 2.000 -> 2.028, slower than the separate register-form kernel.
    Which form runs never changes a bit."""
    return 0 < D <= TAIL_ROW_MAX


@cuda.jit(device=True)
def sumsq_partial(x, t, i, D):
    """Thread i's partial sum of squares of row t: ``fma(x, x, ss)`` over k = i, i+NT, ...
    ascending from 0, its x requested SUMSQ_CHUNK values at a time before they are used."""
    ss = float32(0.0)
    v = cuda.local.array(SUMSQ_CHUNK, float32)
    for k0 in range(i, D, NT * SUMSQ_CHUNK):
        for j in range(SUMSQ_CHUNK):
            if k0 + j * NT < D:
                v[j] = x[t, k0 + j * NT]
        for j in range(SUMSQ_CHUNK):
            if k0 + j * NT < D:
                ss = cuda.fma(v[j], v[j], ss)
    return ss


@cuda.jit(device=True)
def inv_rms(ss, D, eps):
    """``1 / sqrt(ss / D + eps)`` in float32 (ss: the row's sum of squares)."""
    return float32(1.0) / math.sqrt(ss / float32(D) + eps)


@cuda.jit(device=True)
def row_inv_rms(x, t, eps):
    """``1 / sqrt(mean(x[t]^2) + eps)`` of row t, computed by the whole block of NT threads
    (every thread gets it; call from uniform control flow)."""
    D = x.shape[1]
    tid = cuda.threadIdx.x
    scratch = cuda.shared.array((NW, 32), float32)
    part = cuda.shared.array(NW, float32)
    ss = sumsq_partial(x, t, tid, D)
    ss = block_sum(ss, scratch, part, tid // 32, tid % 32, NW)
    return inv_rms(ss, D, eps)


@cuda.jit(device=True)
def load_row(v, a, t, k0, D):
    """v[j] = a[t, k0 + j * NT] for the ROW_REGS positions below D (others untouched)."""
    for j in range(ROW_REGS):
        if k0 + j * NT < D:
            v[j] = a[t, k0 + j * NT]


@cuda.jit(device=True)
def load_vec(v, a, k0, D):
    """v[j] = a[k0 + j * NT] for the ROW_REGS positions below D (others untouched)."""
    for j in range(ROW_REGS):
        if k0 + j * NT < D:
            v[j] = a[k0 + j * NT]


@cuda.jit(device=True)
def regs_inv_rms(v, tid, D, eps):
    """`row_inv_rms` of a row of at most NT * ROW_REGS elements whose values thread tid holds in
    v (`load_row` at k0 = tid): the same partial, block sum and formula, so the same bits. (Its
    own shared arrays: a helper holding them, called here and from `row_inv_rms` in the other
    branch of the register kernels, made NVVM reject those kernels with ERROR_INVALID_IR.)"""
    scratch = cuda.shared.array((NW, 32), float32)
    part = cuda.shared.array(NW, float32)
    ss = float32(0.0)
    for j in range(ROW_REGS):
        if tid + j * NT < D:
            ss = cuda.fma(v[j], v[j], ss)
    ss = block_sum(ss, scratch, part, tid // 32, tid % 32, NW)
    return inv_rms(ss, D, eps)


@jit_kernel
def _rmsnorm_kernel(out, x, w, eps):
    grid_dep_wait()
    D = x.shape[1]
    t = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    inv = row_inv_rms(x, t, eps)
    # x is read again after the block sum's barriers, so out may alias x: each element is
    # read and written by the same thread.
    for k in range(tid, D, NT):
        out[t, k] = (x[t, k] * inv) * w[k]


@jit_kernel
def _rmsnorm_regs_kernel(out, x, w, eps):
    """The register form (module doc): the same values as _rmsnorm_kernel."""
    grid_dep_wait()
    D = x.shape[1]
    t = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    xv = cuda.local.array(ROW_REGS, float32)
    wv = cuda.local.array(ROW_REGS, float32)
    # Every element is read and written by the same thread, and its reads come first, so out may
    # alias x.
    if D <= NT * ROW_REGS:
        load_row(xv, x, t, tid, D)
        load_vec(wv, w, tid, D)
        inv = regs_inv_rms(xv, tid, D, eps)
        for j in range(ROW_REGS):
            if tid + j * NT < D:
                out[t, tid + j * NT] = (xv[j] * inv) * wv[j]
    else:
        inv = row_inv_rms(x, t, eps)
        for k0 in range(tid, D, NT * ROW_REGS):
            load_row(xv, x, t, k0, D)
            load_vec(wv, w, k0, D)
            for j in range(ROW_REGS):
                if k0 + j * NT < D:
                    out[t, k0 + j * NT] = (xv[j] * inv) * wv[j]


@cuda.jit(device=True)
def tail_inv_rms(y, eps, tid, warp, lane, scratch, part):
    """`row_inv_rms` of row 0 of y inside a block of at least NT threads (a row tail): threads
    tid < NT form the row kernels' partials (`sumsq_partial`), the others join the barriers with
    nothing, and `block_sum_first` adds the first NW warps' totals in warp order: the same bits."""
    ss = float32(0.0)
    if tid < NT:
        ss = sumsq_partial(y, 0, tid, y.shape[1])
    return inv_rms(block_sum_first(ss, scratch, part, warp, lane, NW), y.shape[1], eps)


@cuda.jit(device=True)
def _rmsnorm_tail_run(args, out, tid, warp, lane, scratch, part):
    """The row tail of `rmsnorm_tail`: ``out[0] = rmsnorm(out[0]) * w`` in place, each element
    ``(x * inv) * w`` as the row kernels write it, TAIL_CHUNK values of a thread requested before
    their stores."""
    w = args[1]
    D = out.shape[1]
    inv = tail_inv_rms(out, args[2], tid, warp, lane, scratch, part)
    xv = cuda.local.array(TAIL_CHUNK, float32)
    wv = cuda.local.array(TAIL_CHUNK, float32)
    if tid < NT:
        for k0 in range(tid, D, NT * TAIL_CHUNK):
            for j in range(TAIL_CHUNK):
                k = k0 + j * NT
                if k < D:
                    xv[j] = out[0, k]
                    wv[j] = w[k]
            for j in range(TAIL_CHUNK):
                k = k0 + j * NT
                if k < D:
                    out[0, k] = (xv[j] * inv) * wv[j]


def rmsnorm_tail(w, eps, counter) -> RowTail:
    """The rmsnorm of a one-row matmul's output row, in place, as the launch's row tail
    (`_common.RowTail`): ``matmul(x, src, W, accumulate=True, epilogue=rmsnorm_tail(w, eps, c))``
    leaves in x what the matmul followed by ``rmsnorm(x, x, w, eps)`` leaves, bit for bit, in one
    launch. `counter`: an int32 device array of at least one entry, zero (the launch leaves it
    zero); one launch at a time may use it."""
    eps = check_eps("rmsnorm_tail", eps)
    check_array("rmsnorm_tail", "w", w, np.float32, 1)
    check_array("rmsnorm_tail", "counter", counter, np.int32, 1)
    if w.shape[0] == 0 or counter.shape[0] == 0:
        raise BackendError(f"rmsnorm_tail: empty w {tuple(w.shape)} or counter {tuple(counter.shape)}")
    return RowTail("rmsnorm_tail", _rmsnorm_tail_run, (counter, w, eps), TAIL_SIG, w.shape[0])


#: numba type of a row tail's args: (counter, w, eps).
TAIL_SIG = "Tuple((int32[::1], float32[::1], float32))"


def regs_form(T: int) -> bool:
    """Whether a row-norm launch of T rows takes the register form: up to REGS_T rows, where the
    grid is at most one block per SM and each block's latency is the launch's; above, the loop
    form's 32 registers keep eight blocks per SM resident (the register form takes ~136). The
    same bits either way."""
    return T <= REGS_T


def rmsnorm(out, x, w, eps, stream=0):
    """``out = x / sqrt(mean(x^2, axis=1) + eps) * w`` row by row; out may be x. `eps` is a
    model constant (a Python float, cast to float32)."""
    T, eps = check_row_args("rmsnorm", ("x", x), ("out", out), w, eps)
    if T == 0:
        return
    kernel = _rmsnorm_regs_kernel if regs_form(T) else _rmsnorm_kernel
    kernel[T, NT, stream](out, x, w, eps)


def check_row_args(op, src, dst, w, eps):
    """The row-norm launchers' shared checks: `src` (whose shape is taken) and `dst` are
    (name, array) pairs of float32 (T, D) arrays with D > 0, `w` float32 (D,), `eps` finite and
    >= 0. Returns (T, eps as float32); raises BackendError naming `op` and the argument."""
    (src_name, x), (dst_name, out) = src, dst
    check_array(op, src_name, x, np.float32, 2)
    T, D = x.shape
    check_array(op, dst_name, out, np.float32, 2, (T, D))
    check_array(op, "w", w, np.float32, 1, (D,))
    if D == 0:
        raise BackendError(f"{op}: empty feature dimension")
    return T, check_eps(op, eps)


def check_eps(op, eps):
    """`eps` as a float32 after checking it is finite and >= 0 (raises BackendError)."""
    eps = float(eps)
    if not (eps >= 0.0 and math.isfinite(eps)):
        raise BackendError(f"{op}: eps={eps!r} must be finite and >= 0")
    return np.float32(eps)


def ptx_tails():
    """The row tail as matmul's PTX signatures need it (name, device function, args type)."""
    return [RowTail("rmsnorm_tail", _rmsnorm_tail_run, (), TAIL_SIG, 0)]


def ptx_signatures():
    sig = "void(float32[:, ::1], float32[:, ::1], float32[::1], float32)"
    return [("rmsnorm", _rmsnorm_kernel.py_func, sig), ("rmsnorm_regs", _rmsnorm_regs_kernel.py_func, sig)]
