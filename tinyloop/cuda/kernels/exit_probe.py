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

Thread mapping: one block of NT = 1024 threads (32 under the simulator); each thread folds a stride of the row, then a
shared-memory tree (fixed pairs: t with t + s for s = NT/2 .. 1) combines the partials, so the
result depends on the block shape only. Argmax ties go to the lowest index. `reset` zeroes the
state at the start of a step.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, float64, int32, types

from ...errors import BackendError
from ._common import SIM, check_array
from ._pdl import grid_dep_wait

#: Threads of the one block (fewer under the simulator, which runs each thread as a Python thread).
NT = 32 if SIM else 1024
MODES = {"rel_l2": 0, "top2_margin": 1, "kl": 2, "argmax_change": 3, "gate_cdf": 4}
_NEG = -math.inf


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


@cuda.jit(device=True, inline=True)   # inlined: compiled with the kernel (compile_ptx needs no GPU)
def _tree_sum(s, t):
    step = NT // 2
    while step > 0:
        if t < step:
            s[t] = s[t] + s[t + step]
        cuda.syncthreads()
        step //= 2


@cuda.jit(device=True, inline=True)   # inlined: compiled with the kernel (compile_ptx needs no GPU)
def _tree_max(s, t):
    step = NT // 2
    while step > 0:
        if t < step and s[t + step] > s[t]:
            s[t] = s[t + step]
        cuda.syncthreads()
        step //= 2


@cuda.jit(device=True, inline=True)   # inlined: compiled with the kernel (compile_ptx needs no GPU)
def _tree_argmax(sv, si, t):
    step = NT // 2
    while step > 0:
        if t < step:
            v, i = sv[t + step], si[t + step]
            if v > sv[t] or (v == sv[t] and i < si[t]):
                sv[t] = v
                si[t] = i
        cuda.syncthreads()
        step //= 2


_kernels = {}


def _make_kernel(mode: int):
    if mode in _kernels:
        return _kernels[mode]
    MODE = mode

    # not jit_kernel: kernels that link the device runtime cannot be cached (numba-cuda refuses to
    # pickle a code library with linked files, and the refusal would fail the launch)
    @cuda.jit
    def kernel(row, prev, n, state, threshold, patience, depth, compare, conts, first, fill, gw, gb, acc):
        grid_dep_wait()
        t = cuda.threadIdx.x
        sa = cuda.shared.array(NT, float64)
        sb = cuda.shared.array(NT, float64)
        si = cuda.shared.array(NT, int32)
        sj = cuda.shared.array(NT, int32)
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
                sa[t] = a
                sb[t] = b
                cuda.syncthreads()
                _tree_sum(sa, t)
                _tree_sum(sb, t)
                if sb[0] > 0.0:
                    value = math.sqrt(sa[0]) / math.sqrt(sb[0])
                elif sa[0] > 0.0:
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
                sa[t] = b1
                sb[t] = b2
                cuda.syncthreads()
                step = NT // 2
                while step > 0:
                    if t < step:
                        c1, c2 = sa[t + step], sb[t + step]
                        m1, m2 = sa[t], sb[t]
                        sa[t] = max(m1, c1)
                        sb[t] = max(min(m1, c1), max(m2, c2))
                    cuda.syncthreads()
                    step //= 2
                value = sa[0] - sb[0]
            elif MODE == 2:
                mc = _NEG
                mp = _NEG
                for i in range(t, n, NT):
                    mc = max(mc, float64(row[i]))
                    mp = max(mp, float64(prev[i]))
                sa[t] = mc
                sb[t] = mp
                cuda.syncthreads()
                _tree_max(sa, t)
                _tree_max(sb, t)
                mc = sa[0]
                mp = sb[0]
                cuda.syncthreads()
                ec = 0.0
                ep = 0.0
                mc32 = float32(mc)
                mp32 = float32(mp)
                for i in range(t, n, NT):        # float32 exponentials, float64 sums
                    ec += float64(math.exp(row[i] - mc32))
                    ep += float64(math.exp(prev[i] - mp32))
                sa[t] = ec
                sb[t] = ep
                cuda.syncthreads()
                _tree_sum(sa, t)
                _tree_sum(sb, t)
                lc = mc + math.log(sa[0])
                lp = mp + math.log(sb[0])
                cuda.syncthreads()
                acc = 0.0
                lc32 = float32(lc)
                for i in range(t, n, NT):
                    a = float64(row[i]) - lc
                    acc += float64(math.exp(row[i] - lc32)) * (a - (float64(prev[i]) - lp))
                sa[t] = acc
                cuda.syncthreads()
                _tree_sum(sa, t)
                value = max(0.0, sa[0])
            elif MODE == 4:
                a = 0.0
                for i in range(t, n, NT):
                    a += float64(row[i]) * float64(gw[i])
                sa[t] = a
                cuda.syncthreads()
                _tree_sum(sa, t)
                z = sa[0] + float64(gb[0])
                ls = acc[0] - (max(z, 0.0) + math.log1p(math.exp(-abs(z))))
                value = -math.expm1(ls)
                cuda.syncthreads()          # every thread has read acc[0] before thread 0 writes it
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
                sa[t] = bc
                si[t] = ic
                sb[t] = bp
                sj[t] = ip
                cuda.syncthreads()
                _tree_argmax(sa, si, t)
                _tree_argmax(sb, sj, t)
                value = 0.0 if si[0] == sj[0] else 1.0
            if t == 0:
                stable = value >= threshold if MODE == 1 or MODE == 4 else value < threshold
                run = state[0] + 1 if stable else 0
                state[0] = run
                if run >= patience and state[1] == 0:
                    state[1] = depth
                    for j in range(first, conts.shape[0]):
                        set_conditional(conts[j], 0)
                    if fill != 0:
                        set_conditional(fill, 1)
            cuda.syncthreads()
        for i in range(t, n, NT):
            prev[i] = row[i]

    _kernels[mode] = kernel
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
          conts, first: int, fill: int = 0, gate=None, acc=None, stream=0) -> None:
    """One probe of `row` (see the module doc). Inside a guarded graph: `conts` (uint64, device)
    the handles of the graph's stretches, of which an exit clears ``conts[first:]``, and `fill`
    the handle an exit sets (0: none). Outside one: `first` = len(conts) and `fill` 0. `gate`
    (weight (n,), bias (1,), float32) and `acc` (float64 (1,)): gate_cdf's, which needs both."""
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
    _make_kernel(MODES[stat])[1, NT, stream](row, prev, np.int32(n), state, np.float64(threshold),
                                             np.int32(patience), np.int32(depth), bool(compare),
                                             conts, np.int32(first), np.uint64(fill), gw, gb, acc)


def ptx_signatures():
    sig = ("void(float32[::1], float32[::1], int32, int32[::1], float64, int32, int32, boolean, uint64[::1], int32, "
           "uint64, float32[::1], float32[::1], float64[::1])")
    return ([(f"exit_probe_{name}", _make_kernel(m).py_func, sig) for name, m in MODES.items()]
            + [("exit_reset", _reset_kernel.py_func, "void(int32[::1], float64[::1])")])
