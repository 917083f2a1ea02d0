"""On-device sampling of one token from one logits row: temperature -> top-k -> top-p -> draw,
with a counter-based random number, so a given (seed, step) always gives the same token.

Shapes::

    logits  float32 (V,)
    params  float32 (3,)   [temperature, top_k, top_p]      read on the device
    rng     int64 (2,)     [seed, step]                     read (and optionally advanced)
    out     int32 (1,)     the token
    u_out   float64 (1,)   optional: the uniform number the draw used

Everything that may change between decode steps lives in device arrays, so a captured CUDA graph
replays unchanged; with ``advance=True`` the kernel itself stores step + 1 into rng[1] after the
draw, so successive replays use successive steps with no host work.

The algorithm, exactly (`reference_sample` below is the same algorithm in numpy):

0. ``u = uniform(seed, step)``: ``h = mix(mix(seed + G) + step * G)`` in uint64 arithmetic, with
   G = 0x9E3779B97F4A7C15 and ``mix`` the splitmix64 finalizer; ``u = (h >> 11) * 2^-53``, a float64
   in [0, 1). `uniform` computes it on the host, bit for bit.
1. If not (temperature > 0) (zero, negative or NaN): greedy, the lowest index of the largest logit
   (same rule as `argmax`). Otherwise ``z_i = float32(logits_i / temperature)``; NaN z count
   as -inf.
   Logits must not be +inf.
2. top-k: k = top_k if 0 < top_k < V, else V (no top-k). Candidates are ordered by
   (z descending, index ascending), a strict total order.
3. Full path, when k == V and not (top_p < 1): ``m = max z``, ``p_i = exp(f64(z_i) - f64(m))``
   (float64), ``r = u * sum_i p_i``, token = the smallest index i with p_i > 0 and
   ``sum_{j <= i} p_j > r`` (cumulative over indices in increasing order); if rounding leaves no
   such i, the largest index with p_i > 0 (0 when no p_i is positive, i.e. every z is -inf).
4. Candidate path otherwise: kc = min(k, KMAX) candidates, the first kc in the order of step 2
   (**cap**: when top-k is off or top_k > KMAX = 1024, top-p works within the 1024 most likely
   tokens). With z_0 the largest, ``p_j = exp(f64(z_j) - f64(z_0))`` and ``c_j = p_0 + ... + p_j``
   summed sequentially in float64 in candidate order.
   top-p: if top_p < 1, n = 1 + (the first j with ``c_j >= f64(top_p) * c_{kc-1}``), or kc if none;
   else n = kc. Draw: ``r = u * c_{n-1}``; token = candidate j* = the first j < n with c_j > r
   (n - 1 if none).

Thread mapping: one block of NT threads (512; 64 under the simulator, where each thread is a
Python thread). Maxima and counts are exact, so their reduction order is irrelevant; float64
sums use fixed trees (`_common.block_sum`) or one thread's sequential loop, so the result is
deterministic. The full path uses contiguous per-thread index segments (sequential sums within a
segment, then a fixed-order scan of the NT segment sums) so the draw needs one pass over the vocab
after the sum. The candidate path finds the kc-th largest key by a 4 x 8-bit radix select
(shared-memory histograms with atomic counts, exact), gathers the candidates with a scan of
per-segment counts, and sorts them with a bitonic sort in shared memory.
Sampling one row is not a batched op, so batch invariance does not apply.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, float64, int32, int64, uint32, uint64

from ...errors import BackendError
from ...model.init_state import MASK64, G, mix
from ._common import NEG_INF, SIM, as_bits, block_max, check_array, splitmix64
from ._pdl import grid_dep_wait

NT = 64 if SIM else 512
#: 512 threads x 128 registers fill the register file; without the cap the compiler may use more
#: and the launch fails with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES.
_JIT_OPTS = {} if SIM else {"max_registers": 128}
NW = NT // 32
KMAX = 1024
_BIG = 2 ** 31 - 1

# ----------------------------------------------------------------------------- random numbers
def uniform(seed: int, step: int) -> float:
    """The uniform number in [0, 1) the sampler draws for (seed, step) (seed, step as int64)."""
    s = int(seed) & MASK64
    t = int(step) & MASK64
    h = mix((mix((s + G) & MASK64) + t * G) & MASK64)
    return float(h >> 11) * 2.0 ** -53


if not SIM:
    _U_G = np.uint64(G)

    @cuda.jit(device=True)
    def _uniform_dev(seed, step):
        h = splitmix64(splitmix64(uint64(seed) + _U_G) + uint64(step) * _U_G)
        return float64(h >> uint64(11)) * float64(2.0 ** -53)
else:
    @cuda.jit(device=True)
    def _uniform_dev(seed, step):
        # numpy warns on uint64 wrap-around; Python integers give the same bits.
        return uniform(int(seed), int(step))


# ----------------------------------------------------------------------------- device helpers
@cuda.jit(device=True)
def _z(logits, i, temp):
    z = logits[i] / temp
    if z != z:
        z = NEG_INF
    if z == float32(0.0):
        z = float32(0.0)  # -0 -> +0: equal floats must get equal sort keys
    return z


@cuda.jit(device=True)
def _key(z):
    """Order-preserving map of a float32 to uint32 (larger float -> larger key)."""
    b = uint32(as_bits(z))
    if b & uint32(0x80000000):
        return ~b
    return b | uint32(0x80000000)


@cuda.jit(device=True)
def _better(v, i, bv, bi):
    return v > bv or (v == bv and i < bi)


def _make_sample_kernel(write_u):
    @cuda.jit(**_JIT_OPTS)
    def kernel(out, logits, params, rng, u_out, advance):
        grid_dep_wait()
        V = logits.shape[0]
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        scratch = cuda.shared.array((NW, 32), float32)
        part = cuda.shared.array(NW, float32)
        seg64 = cuda.shared.array(NT, float64)     # per-thread segment sums / prefix
        segi = cuda.shared.array(NT, int64)        # packed per-thread counts / prefix
        comp = cuda.shared.array(KMAX, uint64)     # candidate sort keys
        cum = cuda.shared.array(KMAX, float64)     # candidate probabilities, then prefix sums
        hist = cuda.shared.array(256, int32)
        sv = cuda.shared.array(NT, float32)
        si = cuda.shared.array(NT, int32)
        bc = cuda.shared.array(4, int32)           # broadcast slots

        seed = rng[0]
        step = rng[1]
        u = _uniform_dev(seed, step)
        temp = params[0]
        top_k = int32(params[1]) if params[1] == params[1] else int32(0)
        top_p = params[2]
        token = int32(0)

        if not (temp > float32(0.0)):
            # Greedy: argmax over the raw logits, ties to the lowest index (exact tree).
            bv = NEG_INF
            bi = int32(_BIG)
            for i in range(tid, V, NT):
                v = logits[i]
                if _better(v, i, bv, bi):
                    bv = v
                    bi = int32(i)
            sv[tid] = bv
            si[tid] = bi
            # All candidates must be stored before the tree reads them.
            cuda.syncthreads()
            st = NT // 2
            while st > 0:
                if tid < st and _better(sv[tid + st], si[tid + st], sv[tid], si[tid]):
                    sv[tid] = sv[tid + st]
                    si[tid] = si[tid + st]
                # This level's merges must land before the next level reads them.
                cuda.syncthreads()
                st //= 2
            token = si[0]
            if token == _BIG:
                token = int32(0)
        else:
            k = V
            if 0 < top_k < V:
                k = top_k
            if k == V and not (top_p < float32(1.0)):
                # ---------------- full path: inverse CDF over the whole vocabulary
                m = NEG_INF
                for i in range(tid, V, NT):
                    m = max(m, _z(logits, i, temp))
                m = block_max(m, scratch, part, warp, lane, NW)
                m64 = float64(m)
                seg = (V + NT - 1) // NT
                lo = tid * seg
                hi = min(V, lo + seg)
                s = float64(0.0)
                for i in range(lo, hi):
                    s += math.exp(float64(_z(logits, i, temp)) - m64)
                seg64[tid] = s
                # Segment sums must be stored before thread 0 scans them.
                cuda.syncthreads()
                if tid == 0:
                    run = float64(0.0)
                    for i in range(NT):
                        sg = seg64[i]
                        seg64[i] = run       # exclusive prefix
                        run += sg
                    cum[0] = run             # total
                # The prefixes and the total must be visible before the walk.
                cuda.syncthreads()
                r = u * cum[0]
                start = seg64[tid]
                first = int32(_BIG)
                last = int32(-1)
                if start <= r and m > NEG_INF:
                    c = start
                    for i in range(lo, hi):
                        p = math.exp(float64(_z(logits, i, temp)) - m64)
                        c += p
                        if p > 0.0:
                            if c > r:
                                first = int32(i)
                                break
                            last = int32(i)
                si[tid] = first
                # Every thread's crossing must be stored before the minimum is taken.
                cuda.syncthreads()
                if tid == 0:
                    f = int32(_BIG)
                    for i in range(NT):
                        f = min(f, si[i])
                    bc[0] = f
                # bc[0] must be read by everyone before si is reused below.
                cuda.syncthreads()
                token = bc[0]
                if token == _BIG:
                    # Rounding left r at or past the total: take the last positive-probability
                    # index reached below r (index 0 when nothing has positive probability).
                    si[tid] = last
                    # Every thread's fallback must be stored before the maximum is taken.
                    cuda.syncthreads()
                    if tid == 0:
                        f = int32(-1)
                        for i in range(NT):
                            f = max(f, si[i])
                        bc[1] = max(f, int32(0))
                    # bc[1] must be written before everyone reads it.
                    cuda.syncthreads()
                    token = bc[1]
            else:
                # ---------------- candidate path
                kc = min(k, KMAX)
                # Radix select: find the kc-th largest key, 8 bits at a time from the top.
                prefix = uint32(0)
                pmask = uint32(0)
                remaining = kc
                for sh in (24, 16, 8, 0):
                    for b in range(tid, 256, NT):
                        hist[b] = 0
                    # The histogram must be cleared before anyone counts into it.
                    cuda.syncthreads()
                    for i in range(tid, V, NT):
                        key = _key(_z(logits, i, temp))
                        if key & pmask == prefix:
                            cuda.atomic.add(hist, int32((key >> uint32(sh)) & uint32(0xFF)), 1)
                    # All counts must be in before thread 0 walks the histogram.
                    cuda.syncthreads()
                    if tid == 0:
                        acc = 0
                        sel = 0
                        for b in range(255, -1, -1):
                            if acc + hist[b] >= remaining:
                                sel = b
                                break
                            acc += hist[b]
                        bc[0] = sel
                        bc[1] = remaining - acc
                    # The chosen digit must be visible before everyone reads it.
                    cuda.syncthreads()
                    prefix = prefix | (uint32(bc[0]) << uint32(sh))
                    pmask = pmask | (uint32(0xFF) << uint32(sh))
                    remaining = bc[1]
                    # bc must be read by everyone before thread 0 rewrites it next pass.
                    cuda.syncthreads()
                tau = prefix
                need_eq = remaining
                n_gt = kc - need_eq
                # Gather: keys > tau (all of them) and the first need_eq keys == tau by index.
                seg = (V + NT - 1) // NT
                lo = tid * seg
                hi = min(V, lo + seg)
                ngt = 0
                neq = 0
                for i in range(lo, hi):
                    key = _key(_z(logits, i, temp))
                    if key > tau:
                        ngt += 1
                    elif key == tau:
                        neq += 1
                segi[tid] = (int64(ngt) << 32) | int64(neq)
                # Counts must be stored before thread 0 turns them into offsets.
                cuda.syncthreads()
                if tid == 0:
                    run = int64(0)
                    for i in range(NT):
                        c = segi[i]
                        segi[i] = run
                        run += c
                # Offsets must be visible before the gather writes.
                cuda.syncthreads()
                og = segi[tid] >> 32
                oe = segi[tid] & int64(0xFFFFFFFF)
                for i in range(lo, hi):
                    key = _key(_z(logits, i, temp))
                    slot = -1
                    if key > tau:
                        slot = og
                        og += 1
                    elif key == tau:
                        if oe < need_eq:
                            slot = n_gt + oe
                        oe += 1
                    if slot >= 0:
                        comp[slot] = (uint64(key) << uint64(32)) | uint64(0xFFFFFFFF - i)
                n2 = 1
                while n2 < kc:
                    n2 *= 2
                for j in range(kc + tid, n2, NT):
                    comp[j] = uint64(0)
                # Every candidate must be in place before sorting.
                cuda.syncthreads()
                # Bitonic sort of comp[0:n2], descending.
                size = 2
                while size <= n2:
                    stride = size // 2
                    while stride > 0:
                        for e in range(tid, n2 // 2, NT):
                            i = 2 * stride * (e // stride) + (e % stride)
                            j = i + stride
                            a = comp[i]
                            b = comp[j]
                            if (i & size) == 0:
                                if a < b:
                                    comp[i] = b
                                    comp[j] = a
                            else:
                                if a > b:
                                    comp[i] = b
                                    comp[j] = a
                        # This stage's swaps must land before the next stage compares.
                        cuda.syncthreads()
                        stride //= 2
                    size *= 2
                # Probabilities relative to the top candidate.
                i0 = int64(0xFFFFFFFF) - int64(comp[0] & uint64(0xFFFFFFFF))
                z0 = float64(_z(logits, i0, temp))
                for j in range(tid, kc, NT):
                    ij = int64(0xFFFFFFFF) - int64(comp[j] & uint64(0xFFFFFFFF))
                    cum[j] = math.exp(float64(_z(logits, ij, temp)) - z0)
                # Every probability must be stored before thread 0 accumulates them.
                cuda.syncthreads()
                if tid == 0:
                    run = float64(0.0)
                    for j in range(kc):
                        run += cum[j]
                        cum[j] = run
                    n = kc
                    if top_p < float32(1.0):
                        thr = float64(top_p) * cum[kc - 1]
                        for j in range(kc):
                            if cum[j] >= thr:
                                n = j + 1
                                break
                    r = u * cum[n - 1]
                    js = n - 1
                    for j in range(n):
                        if cum[j] > r:
                            js = j
                            break
                    bc[2] = int32(0xFFFFFFFF - int64(comp[js] & uint64(0xFFFFFFFF)))
                # The chosen token must be visible before everyone reads it.
                cuda.syncthreads()
                token = bc[2]

        # Every thread has read rng above; the barriers since make the update below safe, and
        # this one also orders it after the last reads of shared state.
        cuda.syncthreads()
        if tid == 0:
            out[0] = token
            if write_u:
                u_out[0] = u
            if advance:
                rng[1] = step + 1

    return kernel


_kernels = {}


def _kernel(write_u):
    if write_u not in _kernels:
        _kernels[write_u] = _make_sample_kernel(write_u)
    return _kernels[write_u]


def sample(out, logits, params, rng, u_out=None, advance=False, stream=0):
    """Sample one token from `logits` (float32 (V,)) into out (int32 (1,)) with
    params = [temperature, top_k, top_p] (float32 (3,)) and rng = [seed, step] (int64 (2,)), all
    device arrays; see the module doc for the exact algorithm. With `u_out` (float64 (1,)) the
    uniform number used is stored there; with advance=True rng[1] is incremented on the device
    after the draw."""
    op = "sample"
    check_array(op, "logits", logits, np.float32, 1)
    V = logits.shape[0]
    if V == 0:
        raise BackendError(f"{op}: empty vocabulary")
    if V >= 2 ** 31 - 1:
        raise BackendError(f"{op}: vocabulary of {V} is too large")
    check_array(op, "out", out, np.int32, 1, (1,))
    check_array(op, "params", params, np.float32, 1, (3,))
    check_array(op, "rng", rng, np.int64, 1, (2,))
    if u_out is not None:
        check_array(op, "u_out", u_out, np.float64, 1, (1,))
        _kernel(True)[1, NT, stream](out, logits, params, rng, u_out, 1 if advance else 0)
    else:
        # The kernel variant without u_out never touches its u_out argument.
        _kernel(False)[1, NT, stream](out, logits, params, rng, params, 1 if advance else 0)


# ----------------------------------------------------------------------------- reference
def reference_sample(logits, temperature, top_k, top_p, u):
    """numpy implementation of the algorithm in the module doc, for a given uniform u."""
    logits = np.asarray(logits, dtype=np.float32)
    V = logits.shape[0]
    temperature = np.float32(temperature)
    if not temperature > 0:
        m = np.max(logits[~np.isnan(logits)]) if np.any(~np.isnan(logits)) else None
        if m is None:
            return 0
        return int(np.flatnonzero(logits == m)[0])
    with np.errstate(all="ignore"):
        z = (logits / temperature).astype(np.float32)
    z[np.isnan(z)] = -np.inf
    k = V
    tk = int(np.float32(top_k)) if np.float32(top_k) == np.float32(top_k) else 0
    if 0 < tk < V:
        k = tk
    top_p = np.float32(top_p)
    if k == V and not top_p < 1:
        m = np.max(z)
        if m == -np.inf:
            return 0
        p = np.exp(z.astype(np.float64) - np.float64(m))
        r = u * p.sum()
        c = np.cumsum(p)
        hit = np.flatnonzero((p > 0) & (c > r))
        if hit.size:
            return int(hit[0])
        ok = np.flatnonzero(p > 0)
        return int(ok[-1]) if ok.size else 0
    kc = min(k, KMAX)
    order = np.lexsort((np.arange(V), -z.astype(np.float64)))[:kc]
    zc = z[order].astype(np.float64)
    p = np.exp(zc - zc[0])
    c = np.zeros(kc)
    run = 0.0
    for j in range(kc):
        run += p[j]
        c[j] = run
    n = kc
    if top_p < 1:
        thr = np.float64(top_p) * c[kc - 1]
        hit = np.flatnonzero(c >= thr)
        if hit.size:
            n = int(hit[0]) + 1
    r = u * c[n - 1]
    hit = np.flatnonzero(c[:n] > r)
    js = int(hit[0]) if hit.size else n - 1
    return int(order[js])


def ptx_signatures():
    base = "int32[::1], float32[::1], float32[::1], int64[::1]"
    return [("sample_u", _kernel(True).py_func, f"void({base}, float64[::1], int64)"),
            ("sample", _kernel(False).py_func, f"void({base}, float32[::1], int64)")]
