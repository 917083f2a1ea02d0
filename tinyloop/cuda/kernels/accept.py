"""A greedy draft cycle's acceptance on the device: the longest path of drafts the verify rows
agree with, the next pending token and position, the cache slot moves that compact an accepted
tree path, and the cycle's record for the host.

Shapes (K branches per node, D levels of drafts, N = 1 + K + .. + K^D nodes in breadth-first
order: node 0 the pending token, the children of node i are nodes i*K + 1 .. i*K + K; a chain of
k drafts is K = 1, D = k, N = k + 1)::

    ids     int32 (>= N,)        the node tokens
    toks    int32 (>= N,)        the verify pass's argmax after each node
    tok     int32 (1,)           OUT: the next cycle's pending token, toks[last accepted node]
    pos     int32 (1,)           the cycle's position (the root's slot); OUT: += n + 1
    rec     int32 (>= 2N + 2,)   OUT: [n, position, ids[0..N-1], toks[0..N-1]]
    moves   int32 (2, >= D)      OUT: columns 0..D-1: the (src, dst) cache slots of the accepted
                                 nodes off their depth's slot (node j at depth d moves from
                                 pos + j to pos + d), in path order, then (pos, pos) pairs: a move
                                 of D columns (kernels/cache_move.py) compacts the path, the
                                 self-moves copying nothing

The walk is the greedy rule of the tree decoder (the chain's as the one-branch tree): from the
root, follow the first child whose token equals the verify argmax after the current node; n is
the path's length, and the verify argmax after its last node is the next token. With ``tok`` and
``pos`` updated here, the next cycle can be queued before the host has read this one (the record
tells it what happened). One block; thread 0 walks, every thread copies; nothing is reduced in
floating point.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from ...errors import BackendError
from ._cache import jit_kernel
from ._common import check_array
from ._pdl import grid_dep_wait

#: Threads of the one block (any count is exact: the copies stride over the nodes).
THREADS = 128
#: Most nodes a cycle's tree may have.
MAX_NODES = 4096


def tree_size(branches: int, depth: int) -> int:
    """Nodes of the full `branches`-ary draft tree with `depth` levels below the root."""
    return sum(branches ** d for d in range(depth + 1))


def record_size(k: int, branches: int = 1) -> int:
    """int32 entries of the record of a cycle of depth k (k drafts for a chain)."""
    return 2 * tree_size(branches, k) + 2


@jit_kernel
def _accept_kernel(ids, toks, tok, pos, rec, moves, K, D, N):
    grid_dep_wait()
    i = cuda.threadIdx.x
    p = pos[0]
    j = i
    while j < N:
        rec[2 + j] = ids[j]
        rec[2 + N + j] = toks[j]
        j += cuda.blockDim.x
    cuda.syncthreads()          # every thread has read pos before thread 0 moves it
    if i == 0:
        node = 0
        n = 0
        m = 0
        while n < D:
            want = toks[node]
            nxt = -1
            c = node * K + 1
            while c <= node * K + K:
                if ids[c] == want:
                    nxt = c
                    break
                c += 1
            if nxt < 0:
                break
            n += 1
            node = nxt
            if node != n:
                moves[0, m] = p + node
                moves[1, m] = p + n
                m += 1
        while m < D:
            moves[0, m] = p
            moves[1, m] = p
            m += 1
        rec[0] = n
        rec[1] = p
        tok[0] = toks[node]
        pos[0] = p + n + 1


def accept(ids, toks, tok, pos, rec, moves, k, branches=1, stream=0):
    """Accept a greedy cycle of depth k on the device (see the module docstring)."""
    k, branches = int(k), int(branches)
    if branches < 1 or k < 1:
        raise BackendError(f"accept: depth k={k} and branches={branches} must both be >= 1")
    N = tree_size(branches, k)
    if N > MAX_NODES:
        raise BackendError(f"accept: a tree of {branches} branches and depth {k} has {N} nodes, over {MAX_NODES}")
    for name, a, n in (("ids", ids, N), ("toks", toks, N), ("rec", rec, 2 * N + 2)):
        check_array("accept", name, a, np.int32, 1)
        if a.shape[0] < n:
            raise BackendError(f"accept: {name} has {a.shape[0]} entries, a cycle of {N} nodes needs {n}")
    check_array("accept", "tok", tok, np.int32, 1, (1,))
    check_array("accept", "pos", pos, np.int32, 1, (1,))
    check_array("accept", "moves", moves, np.int32, 2, (2, None))
    if moves.shape[1] < k:
        raise BackendError(f"accept: moves has {moves.shape[1]} columns, a path of depth {k} needs {k}")
    _accept_kernel[1, THREADS, stream](ids, toks, tok, pos, rec, moves, np.int32(branches), np.int32(k), np.int32(N))


def accept_reference(ids, toks, position: int, k: int, branches: int = 1):
    """The kernel's outputs on the host: (record, next token, next position, moves) with `moves`
    the (src, dst) pairs of the accepted path that move (the kernel's columns before the
    self-moves)."""
    N = tree_size(branches, k)
    node = n = 0
    moves = []
    while n < k:
        want = toks[node]
        nxt = next((c for c in range(node * branches + 1, node * branches + branches + 1) if ids[c] == want), None)
        if nxt is None:
            break
        n += 1
        node = nxt
        if node != n:
            moves.append((position + node, position + n))
    rec = np.array([n, position, *ids[:N], *toks[:N]], np.int32)
    return rec, int(toks[node]), position + n + 1, moves


def ptx_signatures():
    return [("accept", _accept_kernel.py_func,
             "void(int32[::1], int32[::1], int32[::1], int32[::1], int32[::1], int32[:, ::1], int32, int32, int32)")]
