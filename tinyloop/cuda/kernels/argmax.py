"""Greedy token choice: ``out[t] = argmax_i logits[t, i]`` with ties going to the lowest index;
and its generalisation ``topk``: ``out[t, 0:K]`` = the K indices of largest logit, best first
(tree-speculative drafts keep K candidates per node).

Shapes (T rows, V = vocab_size)::

    logits  float32 (T, V)
    out     int32 (T,) for argmax, (T, K) for topk      written on the device (no host sync)

NaN logits never win (they compare false); a row with no value above -inf (all -inf or NaN)
yields the lowest index holding -inf, or 0 if every entry is NaN.

Thread mapping: one block of NT threads per row. Thread i scans i, i+NT, ... keeping the best
(value, index) under the total order "larger value, then smaller index" — as UNROLL independent
candidates (element i + u*NT of each step of NT*UNROLL goes to candidate u, so UNROLL loads are in
flight), merged at the end of the scan; a shared-memory tree then merges the NT candidates. The order is a strict total order on (value, index) pairs, so the
winner is the same whatever the merge order: deterministic and batch-invariant. Shared memory
only (no shuffles), so the simulator runs the same code.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32

from ...core.errors import BackendError
from ._common import NEG_INF, SIM, check_array

#: Threads per block (a power of two). Fewer under the simulator, where each thread is a
#: Python thread; the result does not depend on it.
NT = 128 if SIM else 1024
#: Elements a thread scans per step (independent candidates, loads issued together).
UNROLL = 4
_BIG = 2 ** 31 - 1


@cuda.jit(device=True)
def better(v, i, bv, bi):
    """True when (v, i) beats (bv, bi): larger value, ties to the smaller index."""
    return v > bv or (v == bv and i < bi)


@cuda.jit
def _topk_kernel(out, logits):
    V = logits.shape[1]
    K = out.shape[1]
    t = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    sv = cuda.shared.array(NT, float32)
    si = cuda.shared.array(NT, int32)
    pv = float32(np.inf)      # the previous round's winner (value, index)
    pi = int32(-1)
    for r in range(K):
        # UNROLL independent candidates per thread, so UNROLL loads are in flight per step; the
        # winner under a strict total order does not depend on who compares what first.
        cv = cuda.local.array(UNROLL, float32)
        ci = cuda.local.array(UNROLL, int32)
        for u in range(UNROLL):
            cv[u] = NEG_INF
            ci[u] = int32(_BIG)
        for i0 in range(tid, V, NT * UNROLL):
            for u in range(UNROLL):
                i = i0 + u * NT
                if i < V:
                    v = logits[t, i]
                    if better(pv, pi, v, i) and better(v, i, cv[u], ci[u]):
                        cv[u] = v
                        ci[u] = int32(i)
        bv = cv[0]
        bi = ci[0]
        for u in range(1, UNROLL):
            if better(cv[u], ci[u], bv, bi):
                bv = cv[u]
                bi = ci[u]
        sv[tid] = bv
        si[tid] = bi
        # All candidates must be stored before the tree reads them.
        cuda.syncthreads()
        step = NT // 2
        while step > 0:
            if tid < step:
                if better(sv[tid + step], si[tid + step], sv[tid], si[tid]):
                    sv[tid] = sv[tid + step]
                    si[tid] = si[tid + step]
            # This level's merges must land before the next level reads them.
            cuda.syncthreads()
            step //= 2
        w = si[0]
        if w == _BIG:         # nothing left above -inf (or only NaN): the lowest unused index
            w = min(pi + 1, V - 1)
        pv = logits[t, w]
        pi = w
        if tid == 0:
            out[t, r] = w
        # Every thread has read the winner before the next round overwrites sv / si.
        cuda.syncthreads()


def topk(out, logits, stream=0):
    """``out[t, 0:K]`` = the K indices of largest ``logits[t]``, best first (int32, ties to the
    lowest index), for every row t; K = out.shape[1] <= V."""
    op = "topk"
    check_array(op, "logits", logits, np.float32, 2)
    T, V = logits.shape
    check_array(op, "out", out, np.int32, 2, (T, None))
    if V == 0:
        raise BackendError(f"{op}: empty vocabulary")
    if not 1 <= out.shape[1] <= V:
        raise BackendError(f"{op}: K={out.shape[1]} is outside [1, {V}] (the vocabulary)")
    if T == 0:
        return
    _topk_kernel[T, NT, stream](out, logits)


def argmax(out, logits, stream=0):
    """``out[t] = argmax(logits[t])`` (int32, ties to the lowest index), for every row t: top-1."""
    check_array("argmax", "out", out, np.int32, 1, (logits.shape[0],))
    topk(out.reshape(out.shape[0], 1), logits, stream=stream)


def ptx_signatures():
    return [("topk", _topk_kernel.py_func, "void(int32[:, ::1], float32[:, ::1])")]
