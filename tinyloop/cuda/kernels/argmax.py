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

Split argmax (``argmax(..., work=(cand_v, cand_i, counter))``, the CUDA backend's greedy step): a
row's V entries are cut into SPLIT contiguous slices, one block of SPLIT_NT threads each (grid
(SPLIT, T)); a block finds its slice's best (value, index) as above and stores it in the caller's
candidate arrays at ``t * SPLIT + b``, then fences and counts its arrival in ``counter[t]``
atomically; the block that arrives last fences, merges the SPLIT candidates with the same tree and
writes out[t], then resets counter[t] to 0 (the "last block" pattern of attention.py). The winner
is the same as the one-block kernel's (strict total order; the all-NaN row gives 0 as well); a
one-token decode step then spreads the vocabulary over SPLIT SMs instead of one.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32

from ...errors import BackendError
from ._cache import jit_kernel
from ._common import NEG_INF, SIM, check_array, check_workspace
from ._pdl import grid_dep_wait

#: Threads per block (a power of two). Fewer under the simulator, where each thread is a
#: Python thread; the result does not depend on it.
NT = 128 if SIM else 1024
#: Elements a thread scans per step (independent candidates, loads issued together).
UNROLL = 4
_BIG = 2 ** 31 - 1
#: Split argmax: blocks per row and threads per block (SPLIT <= SPLIT_NT: the last block's threads
#: b < SPLIT load one candidate each).
SPLIT = 4 if SIM else 32
SPLIT_NT = 32 if SIM else 256
#: Rows one split launch takes (they go on the grid's y dimension).
MAX_SPLIT_ROWS = 65535


@cuda.jit(device=True)
def better(v, i, bv, bi):
    """True when (v, i) beats (bv, bi): larger value, ties to the smaller index."""
    return v > bv or (v == bv and i < bi)


@cuda.jit(device=True)
def _tree_best(sv, si, tid, nt):
    """Merge sv/si[0:nt] (nt a power of two) into entry 0; every thread of the block calls it after
    a barrier that published the entries; entry 0 is final after it returns."""
    step = nt // 2
    while step > 0:
        if tid < step:
            if better(sv[tid + step], si[tid + step], sv[tid], si[tid]):
                sv[tid] = sv[tid + step]
                si[tid] = si[tid + step]
        # This level's merges must land before the next level reads them.
        cuda.syncthreads()
        step //= 2


@cuda.jit(device=True)
def _block_best(cv, ci, sv, si, tid, nt):
    """The block's best of every thread's UNROLL candidates (cv, ci) into sv/si[0] (nt threads, a
    power of two); every thread calls it."""
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
    _tree_best(sv, si, tid, nt)


@jit_kernel
def _topk_kernel(out, logits):
    grid_dep_wait()
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
        _block_best(cv, ci, sv, si, tid, NT)
        w = si[0]
        if w == _BIG:         # nothing left above -inf (or only NaN): the lowest unused index
            w = min(pi + 1, V - 1)
        pv = logits[t, w]
        pi = w
        if tid == 0:
            out[t, r] = w
        # Every thread has read the winner before the next round overwrites sv / si.
        cuda.syncthreads()


@jit_kernel
def _argmax_split_kernel(out, logits, cand_v, cand_i, counter):
    grid_dep_wait()
    V = logits.shape[1]
    b = cuda.blockIdx.x
    t = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    sv = cuda.shared.array(SPLIT_NT, float32)
    si = cuda.shared.array(SPLIT_NT, int32)
    is_last = cuda.shared.array(1, int32)
    chunk = (V + SPLIT - 1) // SPLIT
    lo = b * chunk
    hi = min(V, lo + chunk)
    cv = cuda.local.array(UNROLL, float32)
    ci = cuda.local.array(UNROLL, int32)
    for u in range(UNROLL):
        cv[u] = NEG_INF
        ci[u] = int32(_BIG)
    for i0 in range(lo + tid, hi, SPLIT_NT * UNROLL):
        for u in range(UNROLL):
            i = i0 + u * SPLIT_NT
            if i < hi:
                v = logits[t, i]
                if better(v, i, cv[u], ci[u]):
                    cv[u] = v
                    ci[u] = int32(i)
    _block_best(cv, ci, sv, si, tid, SPLIT_NT)
    if tid == 0:
        cand_v[t * SPLIT + b] = sv[0]
        cand_i[t * SPLIT + b] = si[0]
        # Release: the candidate is visible device-wide before the arrival is counted.
        cuda.threadfence()
        last = cuda.atomic.add(counter, t, 1) == SPLIT - 1
        if last:
            cuda.threadfence()   # acquire: the other blocks' candidates after their counts
        is_last[0] = 1 if last else 0
    # is_last must be stored before the block reads it (and sv/si[0] read before reuse).
    cuda.syncthreads()
    if is_last[0] != 0:
        cuda.threadfence()
        if tid < SPLIT:
            sv[tid] = cand_v[t * SPLIT + tid]
            si[tid] = cand_i[t * SPLIT + tid]
        else:
            sv[tid] = NEG_INF
            si[tid] = int32(_BIG)
        # The SPLIT candidates must be stored before the tree reads them.
        cuda.syncthreads()
        _tree_best(sv, si, tid, SPLIT_NT)
        if tid == 0:
            w = si[0]
            out[t, 0] = 0 if w == _BIG else w      # all NaN: index 0, as the one-block kernel
            counter[t] = 0


def work_shapes(T: int) -> tuple:
    """Shapes of the split argmax's (candidate values float32, candidate indices int32, arrival
    counters int32) for T rows; allocate the counters zeroed, once (launches leave them zero)."""
    return (T * SPLIT,), (T * SPLIT,), (T,)


def _check_logits(op, logits):
    """(T, V) of a float32 (T, V) logits array with a non-empty vocabulary."""
    check_array(op, "logits", logits, np.float32, 2)
    T, V = logits.shape
    if V == 0:
        raise BackendError(f"{op}: empty vocabulary")
    return T, V


def topk(out, logits, stream=0):
    """``out[t, 0:K]`` = the K indices of largest ``logits[t]``, best first (int32, ties to the
    lowest index), for every row t; K = out.shape[1] <= V."""
    op = "topk"
    T, V = _check_logits(op, logits)
    check_array(op, "out", out, np.int32, 2, (T, None))
    if not 1 <= out.shape[1] <= V:
        raise BackendError(f"{op}: K={out.shape[1]} is outside [1, {V}] (the vocabulary)")
    if T == 0:
        return
    _topk_kernel[T, NT, stream](out, logits)


def argmax(out, logits, stream=0, work=None):
    """``out[t] = argmax(logits[t])`` (int32, ties to the lowest index), for every row t: top-1.
    With `work` = (cand_v, cand_i, counter) (at least `work_shapes(T)`, counter zero before the
    first launch; one launch at a time) the row is split over SPLIT blocks (module doc); without
    it one block per row scans the whole row (`topk` with K = 1). Both give the same index."""
    op = "argmax"
    check_array(op, "out", out, np.int32, 1, (logits.shape[0],))
    if work is None:
        topk(out.reshape(out.shape[0], 1), logits, stream=stream)
        return
    T, _ = _check_logits(op, logits)
    if not isinstance(work, (tuple, list)) or len(work) != 3:
        raise BackendError(f"{op}: work must be a (cand_v, cand_i, counter) tuple, got "
                           f"{type(work).__name__}")
    if T > MAX_SPLIT_ROWS:
        raise BackendError(f"{op}: {T} rows exceed the split kernel's {MAX_SPLIT_ROWS} (grid y); "
                           f"launch without work for more")
    for name, a, dt, n in zip(("cand_v", "cand_i", "counter"), work, (np.float32, np.int32, np.int32),
                              work_shapes(T)):
        check_workspace(op, name, a, dt, n[0], f"{T} rows (work_shapes)")
    if T == 0:
        return
    _argmax_split_kernel[(SPLIT, T), SPLIT_NT, stream](out.reshape(T, 1), logits, *work)


def ptx_signatures():
    return [("topk", _topk_kernel.py_func, "void(int32[:, ::1], float32[:, ::1])"),
            ("argmax_split", _argmax_split_kernel.py_func,
             "void(int32[:, ::1], float32[:, ::1], float32[::1], int32[::1], int32[::1])")]
