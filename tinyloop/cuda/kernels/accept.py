"""A greedy draft cycle's acceptance on the device: the longest prefix of drafts the verify rows
agree with, the next pending token and position, and the cycle's record for the host.

Shapes::

    ids   int32 (>= k+1,)    row 0 the cycle's pending token, rows 1..k its drafts
    toks  int32 (>= k+1,)    the verify pass's argmax after each of rows 0..k
    tok   int32 (1,)         OUT: the next cycle's pending token, toks[n]
    pos   int32 (1,)         the cycle's position (unchanged by the cycle itself); OUT: += n + 1
    rec   int32 (>= 2k+4,)   OUT: [n, position, ids[0..k], toks[0..k]]

n is the largest n <= k with ids[1 + i] == toks[i] for every i < n (the chain decoder's greedy
rule: the drafts the verify depth would have emitted itself, then its own token after them). With
``tok`` and ``pos`` updated here, the next cycle can be queued before the host has read this one
(the record tells it what happened). One block; thread 0 scans, every thread copies; nothing is
reduced in floating point.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from ...errors import BackendError
from ._cache import jit_kernel
from ._common import check_array
from ._pdl import grid_dep_wait

#: Threads of the one block (>= the most rows a cycle has: 64 drafts and the pending token).
THREADS = 128


def record_size(k: int) -> int:
    """int32 entries of a k-draft cycle's record."""
    return 2 * k + 4


@jit_kernel
def _accept_kernel(ids, toks, tok, pos, rec, k):
    grid_dep_wait()
    i = cuda.threadIdx.x
    p = pos[0]
    j = i
    while j <= k:
        rec[2 + j] = ids[j]
        rec[3 + k + j] = toks[j]
        j += cuda.blockDim.x
    cuda.syncthreads()          # every thread has read pos before thread 0 moves it
    if i == 0:
        n = 0
        while n < k and ids[1 + n] == toks[n]:
            n += 1
        rec[0] = n
        rec[1] = p
        tok[0] = toks[n]
        pos[0] = p + n + 1


def accept(ids, toks, tok, pos, rec, k, stream=0):
    """Accept a greedy k-draft cycle on the device (see the module docstring)."""
    k = int(k)
    if not 1 <= k < THREADS:
        raise BackendError(f"accept: k={k} drafts outside [1, {THREADS - 1}]")
    for name, a, n in (("ids", ids, k + 1), ("toks", toks, k + 1), ("rec", rec, record_size(k))):
        check_array("accept", name, a, np.int32, 1)
        if a.shape[0] < n:
            raise BackendError(f"accept: {name} has {a.shape[0]} entries, a {k}-draft cycle needs {n}")
    check_array("accept", "tok", tok, np.int32, 1, (1,))
    check_array("accept", "pos", pos, np.int32, 1, (1,))
    _accept_kernel[1, THREADS, stream](ids, toks, tok, pos, rec, np.int32(k))


def accept_reference(ids, toks, position: int, k: int):
    """The kernel's outputs on the host: (record, next token, next position)."""
    n = 0
    while n < k and ids[1 + n] == toks[n]:
        n += 1
    rec = np.array([n, position, *ids[:k + 1], *toks[:k + 1]], np.int32)
    return rec, int(toks[n]), position + n + 1


def ptx_signatures():
    return [("accept", _accept_kernel.py_func,
             "void(int32[::1], int32[::1], int32[::1], int32[::1], int32[::1], int32)")]
