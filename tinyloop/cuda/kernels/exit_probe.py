"""The early-exit probe: a stability statistic of one row against the previous probe's, the
stability count, and the exit decision, where the row lives (tinyloop.runtime.early_exit).

Shapes::

    row    float32 (n,)   the probed row: the residual (n = d_model) or the head logits (vocab)
    prev   float32 (N,)   N >= n; the previous probe's row, replaced by `row` at the end
    state  int32 (2,)     [consecutive stable probes, exit depth (0: none yet)]

Statistics (compile-time mode; numpy references in tinyloop.runtime.early_exit.STATISTICS),
accumulated in float64 (kl's exponentials in float32: float64 exp over a large vocabulary on one
block cost ~0.2 ms per probe on the H200):

    rel_l2         ||row - prev|| / ||row||                     stable below the threshold
    top2_margin    row's largest minus second largest value      stable at or above it
    kl             KL(softmax(row) || softmax(prev)), nats       stable below it
    argmax_change  0 when argmax row == argmax prev, else 1      stable below it (0.5)
    gate_cdf       1 - exp(S), S += -softplus(gw . row + gb)     stable at or above it

gate_cdf is the learned exit gate's cumulative exit probability: `gw` (n,) and `gb` (1,) the
gate's weight and bias, `acc` (1,) float64 the step's running log-survival S (reset zeroes it);
it reads no previous row. The other statistics ignore gw, gb and acc.

With ``compare`` the probe updates the count (+1 when stable, else 0) and, when it reaches
`patience` and no depth is recorded yet, records `depth` and, inside a guarded graph, sets the
graph's conditional handles through the CUDA device runtime's cudaGraphSetConditional (linked from
libcudadevrt): the handles of the stretches still to come (``conts[first:]``; a handle belongs to
one conditional node, so each stretch has its own) to 0 and `fill` (this depth's K/V fill) to 1.
Outside a graph there are none to set, and the host reads `state` instead.

Thread mapping: one block of `threads_for(n)` threads (128 for rows of at most 8192 values, 1024
above; 32 under the simulator); each thread folds a stride of the row, then each warp combines its
threads by an xor butterfly of shuffles and every thread folds the warp results in warp order
(`_bsum` and its siblings), so the result depends on the
row's length only. Argmax ties go to the lowest index. `reset` zeroes the state at the start of a
step, or the step's first probe does (`fresh`: it reads a cleared state instead of the stored one). (Until 2026-12-05 every row had 1024 threads and a 10-level shared-memory tree per
reduction: ~4.3 us per probe of the demo model's residual on an H100, against ~1 us for the
smallest kernels of a step; docs/BENCHMARKS.md, "What a guarded step costs".)
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, float64, int32, types

from ...errors import BackendError
from ._common import FULL_MASK, SIM, check_array, warp_max, warp_sum
from ._pdl import grid_dep_wait

#: Threads of the one block: NT_SMALL for rows of at most SMALL_ROW values (the residual, small
#: vocabularies), NT_LARGE above (a head's logits); 32 under the simulator, which runs each thread as
#: a Python thread.
NT_SMALL = 32 if SIM else 128
NT_LARGE = 32 if SIM else 1024
SMALL_ROW = 8192
MODES = {"rel_l2": 0, "top2_margin": 1, "kl": 2, "argmax_change": 3, "gate_cdf": 4}
_NEG = -math.inf


def threads_for(n: int) -> int:
    """The block size a row of `n` values is probed with (fixed by the row's length only)."""
    return NT_SMALL if n <= SMALL_ROW else NT_LARGE


def _devrt_path():
    """libcudadevrt.a as numba-cuda finds it (None where it is missing)."""
    try:
        from numba.cuda.cudadrv.libs import get_cudalib
        return get_cudalib("cudadevrt", static=True)
    except Exception:       # numba-cuda cannot locate the CUDA libraries
        return None


DEVRT = None if SIM else _devrt_path()

if DEVRT is not None:
    set_conditional = cuda.declare_device("cudaGraphSetConditional", types.void(types.uint64, types.uint32),
                                          link=[DEVRT], abi="c")
else:
    @cuda.jit(device=True)
    def set_conditional(handle, value):     # no device runtime: guarded graphs are not built
        pass


# Block reductions of float64 values (and value/index, top-two pairs) over the block's nw warps;
# every thread of the block calls them from uniform control flow and gets the same result. On the
# GPU each warp combines by an xor butterfly of shuffles, lane 0 stores the warp's result in
# shared memory `sa` (`sb`, `si`), and after a barrier every thread folds the nw warp results in
# warp order. Sums and maxima use _common's warp reductions (whose simulator twins replay the same
# butterfly through `scr`); the pair reductions (`_pair_reduce`) have one simulator twin (one warp
# there, a shared-memory tree). Max, top-two and argmax are exact whatever the order; the sums' order is
# fixed by the block shape (`threads_for`).
@cuda.jit(device=True, inline=True)
def _add(a, b):
    return a + b


@cuda.jit(device=True, inline=True)
def _max(a, b):
    return max(a, b)


def _block_reduce(warp_op, combine):
    """A block reduction of one float64 per thread: `warp_op` (_common's warp_sum / warp_max) in
    each warp, then the warp results folded by `combine` in warp order."""
    @cuda.jit(device=True, inline=True)
    def reduce(v, sa, scr, t, nw):
        v = warp_op(v, scr, t >> 5, t & 31)
        if (t & 31) == 0:
            sa[t >> 5] = v
        cuda.syncthreads()
        r = sa[0]
        for w in range(1, nw):
            r = combine(r, sa[w])
        cuda.syncthreads()          # every thread has read sa before a later call writes it
        return r
    return reduce


_bsum = _block_reduce(warp_sum, _add)
_bmax = _block_reduce(warp_max, _max)


@cuda.jit(device=True, inline=True)
def _top2_combine(a1, a2, c1, c2):
    """(largest, second largest) of two such pairs."""
    return max(a1, c1), max(min(a1, c1), max(a2, c2))


@cuda.jit(device=True, inline=True)
def _argmax_combine(v, i, c, j):
    """(largest value, its lowest index) of two such pairs."""
    if c > v or (c == v and j < i):
        return c, j
    return v, i


def _pair_reduce(combine):
    """A block reduction of (a, b) pairs by `combine` (a warp butterfly of shuffles, then the warp
    results folded in order; under the simulator a shared-memory tree), results in sa / sb."""
    if not SIM:
        @cuda.jit(device=True, inline=True)
        def reduce(a, b, sa, sb, t, nw):
            o = 16
            while o > 0:
                a, b = combine(a, b, cuda.shfl_xor_sync(FULL_MASK, a, o), cuda.shfl_xor_sync(FULL_MASK, b, o))
                o //= 2
            if (t & 31) == 0:
                sa[t >> 5] = a
                sb[t >> 5] = b
            cuda.syncthreads()
            ra = sa[0]
            rb = sb[0]
            for w in range(1, nw):
                ra, rb = combine(ra, rb, sa[w], sb[w])
            cuda.syncthreads()
            return ra, rb
    else:
        @cuda.jit(device=True, inline=True)
        def reduce(a, b, sa, sb, t, nw):
            sa[t] = a
            sb[t] = b
            cuda.syncthreads()
            step = NT_SMALL // 2
            while step > 0:
                if t < step:
                    sa[t], sb[t] = combine(sa[t], sb[t], sa[t + step], sb[t + step])
                cuda.syncthreads()
                step //= 2
            ra, rb = sa[0], sb[0]
            cuda.syncthreads()
            return ra, rb
    return reduce


_btop2 = _pair_reduce(_top2_combine)
_bargmax = _pair_reduce(_argmax_combine)     # (value, index): ties to the lowest index


_kernels = {}


def _make_kernel(mode: int, nt: int):
    key = (mode, nt)
    if key in _kernels:
        return _kernels[key]
    MODE = mode
    NT = nt
    NW = max(1, NT // 32)

    # not jit_kernel: kernels that link the device runtime cannot be cached (numba-cuda refuses to
    # pickle a code library with linked files, and the refusal would fail the launch)
    @cuda.jit
    def kernel(row, prev, n, state, threshold, patience, depth, compare, conts, first, fill, gw, gb, acc, fresh):
        grid_dep_wait()
        t = cuda.threadIdx.x
        acc0 = 0.0 if fresh else acc[0]
        sa = cuda.shared.array(NT, float64)
        sb = cuda.shared.array(NT, float64)
        si = cuda.shared.array(NT, int32)
        scr = cuda.shared.array((NW, 32), float64)      # the simulator's warp reductions only
        if compare:
            value = 0.0
            if MODE == 0:
                a = 0.0
                b = 0.0
                for i in range(t, n, NT):
                    c = float64(row[i])
                    d = c - float64(prev[i])
                    a += d * d
                    b += c * c
                a = _bsum(a, sa, scr, t, NW)
                b = _bsum(b, sa, scr, t, NW)
                if b > 0.0:
                    value = math.sqrt(a) / math.sqrt(b)
                elif a > 0.0:
                    value = math.inf
            elif MODE == 1:
                b1 = _NEG
                b2 = _NEG
                for i in range(t, n, NT):
                    v = float64(row[i])
                    if v > b1:
                        b2 = b1
                        b1 = v
                    elif v > b2:
                        b2 = v
                b1, b2 = _btop2(b1, b2, sa, sb, t, NW)
                value = b1 - b2
            elif MODE == 2:
                mc = _NEG
                mp = _NEG
                for i in range(t, n, NT):
                    mc = max(mc, float64(row[i]))
                    mp = max(mp, float64(prev[i]))
                mc = _bmax(mc, sa, scr, t, NW)
                mp = _bmax(mp, sa, scr, t, NW)
                ec = 0.0
                ep = 0.0
                mc32 = float32(mc)
                mp32 = float32(mp)
                for i in range(t, n, NT):        # float32 exponentials, float64 sums
                    ec += float64(math.exp(row[i] - mc32))
                    ep += float64(math.exp(prev[i] - mp32))
                lc = mc + math.log(_bsum(ec, sa, scr, t, NW))
                lp = mp + math.log(_bsum(ep, sa, scr, t, NW))
                kl = 0.0
                lc32 = float32(lc)
                for i in range(t, n, NT):
                    a = float64(row[i]) - lc
                    kl += float64(math.exp(row[i] - lc32)) * (a - (float64(prev[i]) - lp))
                value = max(0.0, _bsum(kl, sa, scr, t, NW))
            elif MODE == 4:
                a = 0.0
                for i in range(t, n, NT):
                    a += float64(row[i]) * float64(gw[i])
                z = _bsum(a, sa, scr, t, NW) + float64(gb[0])
                ls = acc0 - (max(z, 0.0) + math.log1p(math.exp(-abs(z))))
                value = -math.expm1(ls)
                if t == 0:
                    acc[0] = ls
            else:
                bc = _NEG
                bp = _NEG
                ic = n
                ip = n
                for i in range(t, n, NT):
                    v = float64(row[i])
                    if v > bc:
                        bc = v
                        ic = i
                    v = float64(prev[i])
                    if v > bp:
                        bp = v
                        ip = i
                bc, ic = _bargmax(bc, ic, sa, si, t, NW)
                bp, ip = _bargmax(bp, ip, sa, si, t, NW)
                value = 0.0 if ic == ip else 1.0
            if t == 0:
                stable = value >= threshold if MODE == 1 or MODE == 4 else value < threshold
                run = (0 if fresh else state[0]) + 1 if stable else 0
                recorded = 0 if fresh else state[1]
                state[0] = run
                state[1] = recorded
                if run >= patience and recorded == 0:
                    state[1] = depth
                    for j in range(first, conts.shape[0]):
                        set_conditional(conts[j], 0)
                    if fill != 0:
                        set_conditional(fill, 1)
            cuda.syncthreads()
        elif fresh and t == 0:
            state[0] = 0
            state[1] = 0
            acc[0] = 0.0
        for i in range(t, n, NT):
            prev[i] = row[i]

    _kernels[key] = kernel
    return kernel


@cuda.jit   # not jit_kernel, as above
def _reset_kernel(state, acc):
    grid_dep_wait()
    if cuda.grid(1) == 0:
        state[0] = 0
        state[1] = 0
        acc[0] = 0.0


def reset(state, acc, stream=0) -> None:
    """state := [0, 0], acc := [0] (a guarded step's start)."""
    check_array("exit_reset", "state", state, np.int32, 1, (2,))
    check_array("exit_reset", "acc", acc, np.float64, 1, (1,))
    _reset_kernel[1, 32, stream](state, acc)


def probe(row, prev, state, stat: str, threshold: float, patience: int, depth: int, compare: bool,
          conts, first: int, fill: int = 0, gate=None, acc=None, fresh: bool = False, stream=0) -> None:
    """One probe of `row` (see the module doc). Inside a guarded graph: `conts` (uint64, device)
    the handles of the graph's stretches, of which an exit clears ``conts[first:]``, and `fill`
    the handle an exit sets (0: none). Outside one: `first` = len(conts) and `fill` 0. `gate`
    (weight (n,), bias (1,), float32) and `acc` (float64 (1,)): gate_cdf's, which needs both.
    `fresh`: the step's first probe, which starts from a cleared state and running sum (what
    `reset` leaves) instead of reading them, so a captured step needs no reset launch."""
    op = "exit_probe"
    if stat not in MODES:
        raise BackendError(f"{op}: unknown statistic {stat!r}; known: {', '.join(MODES)}")
    check_array(op, "row", row, np.float32, 1)
    check_array(op, "prev", prev, np.float32, 1)
    check_array(op, "state", state, np.int32, 1, (2,))
    check_array(op, "conts", conts, np.uint64, 1)
    if not 0 <= first <= conts.shape[0]:
        raise BackendError(f"{op}: first={first} is outside [0, {conts.shape[0]}]")
    n = row.shape[0]
    if prev.shape[0] < n:
        raise BackendError(f"{op}: prev holds {prev.shape[0]} values, fewer than the row's {n}")
    if stat == "gate_cdf":
        if gate is None or acc is None:
            raise BackendError(f"{op}: gate_cdf needs the gate's (weight, bias) and the running sum `acc`")
        gw, gb = gate
        check_array(op, "gate weight", gw, np.float32, 1, (n,))
        check_array(op, "gate bias", gb, np.float32, 1, (1,))
        check_array(op, "acc", acc, np.float64, 1, (1,))
    else:           # unread placeholders of the kernel's gate arguments
        gw, gb = prev, prev
        if acc is None:
            raise BackendError(f"{op}: `acc` (float64 (1,)) is the kernel's running-sum argument")
    nt = threads_for(n)
    _make_kernel(MODES[stat], nt)[1, nt, stream](row, prev, np.int32(n), state, np.float64(threshold),
                                             np.int32(patience), np.int32(depth), bool(compare),
                                             conts, np.int32(first), np.uint64(fill), gw, gb, acc, bool(fresh))


def ptx_signatures():
    sig = ("void(float32[::1], float32[::1], int32, int32[::1], float64, int32, int32, boolean, uint64[::1], int32, "
           "uint64, float32[::1], float32[::1], float64[::1], boolean)")
    return ([(f"exit_probe_{name}_{nt}", _make_kernel(m, nt).py_func, sig) for name, m in MODES.items()
             for nt in sorted({NT_SMALL, NT_LARGE})]
            + [("exit_reset", _reset_kernel.py_func, "void(int32[::1], float64[::1])")])
