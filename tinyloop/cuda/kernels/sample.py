"""On-device sampling of one token from one logits row: the draw of
tinyloop.runtime.sampling.sample_token (temperature -> top-k -> top-p -> draw), with the uniform
number read from a per-request table on the device, so only the token id crosses to the host.

Shapes::

    logits  float32 (V,)
    params  float64 (2,)   [temperature, top_p]                          read on the device
    iparams int32 (2,)     [top_k, base]                                 read on the device
    utab    float64 (n,)   the request's uniform numbers, token i uses utab[i]
    pos     int32 (1,)     the position handle of the launch that computed the logits
    out     int32 (1,)     the token
    work    int32 arrays (WORK_NAMES, work_shapes): hist (BINS,), ticket (1,), plan (3,),
            cnt (2,), ckey (CAP,), cidx (CAP,); zero before the first launch; every launch
            leaves hist, ticket and cnt zero

The uniform number of a launch is ``utab[pos[0] + T - base]`` (clamped into the table): with
base = the prompt's length and T the rows of the launch whose last row's logits are sampled, that
is the index of the token being drawn among the generated ones, so a replayed decode step (T = 1)
draws its own number with no host work, and a step that is run again at the same position draws
the same one.

The algorithm is sample_token's, operation for operation (its module doc): candidates are the
k = min(top_k, V) largest logits, ordered by (logit descending, index ascending) -- the order of
z = float64(logit) / temperature for temperature > 0, with -0.0 read as +0.0 and NaN below -inf
(as numpy's sort puts NaN last); ``w_j = exp(float64(l_j) / t - float64(l_0) / t)``, running sums
c_j in float64 by one thread in candidate order; top-p and the draw as steps 4-5. The only
difference from the host: float64 ``exp`` (libdevice here, numpy or libm there) may differ in the
last bit, which changes the token only when u * c lands within a few ulps of a running sum
(probability ~1e-15 per token). Requires 1 <= k <= KMAX (the host sampler serves the rest).

Two kernels (`sample` launches both):

1. ``hist``: ceil(V / CHUNK) blocks histogram the top 12 bits of each logit's order-preserving key
   (shared-memory atomics, then one global atomic per non-empty bin and block); the block that
   arrives last (fence + ticket, the "last block" pattern of argmax.py) finds the bin holding the
   k-th largest key, stores [bin, keys above it, keys at or above it] in ``plan`` and zeroes the
   histogram and the ticket for the next launch.
2. ``pick``: ceil(V / PICK_CHUNK) blocks gather the keys at or above that bin (at most CAP;
   typically a few hundred) with their indices into a global candidate list (one round of loads
   per thread; a global atomic counter gives the slots); the block that arrives last (fence +
   ticket, as ``hist``) reads the plan[2] candidates into shared memory, bitonic-sorts them by
   (key desc, index asc) -- the stages of stride <= 32 in registers by warp shuffles -- and takes
   the first k. When more than CAP keys fall at or above the bin (many equal or nearly
   equal logits) it selects exactly instead: a 4 x 8-bit radix select of the k-th largest key over
   the whole row, a gather of the keys above it and the first of those equal to it by index, a
   bitonic sort. Then the weights (in parallel), the running sums (one thread, candidate order,
   as the host adds them) and the top-p cut and the draw: each "the first j whose running sum
   passes" is a parallel search (the sums never decrease: a minimum of each thread's first hit).

Every selection is exact (counts and order-preserving keys), so the candidates do not depend on
the launch shape. Sampling one row is not a batched op: batch invariance does not apply.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, float64, int32, int64, uint32, uint64

from ...errors import BackendError
from ._cache import jit_kernel
from ._common import FULL_MASK, SIM, as_bits, as_float, cdiv, check_array, check_workspace
from ._pdl import grid_dep_wait

#: Threads of the pick kernel (a power of two); of the histogram kernel.
NT = 64 if SIM else 512
HIST_NT = 64 if SIM else 256
#: Logits per histogram thread, and per histogram block.
HIST_PER = 8
CHUNK = HIST_NT * HIST_PER
#: Logits each pick thread requests per round of its gather over the row.
GATHER_ILP = 16
#: Logits per pick block: one round of GATHER_ILP loads per thread.
PICK_CHUNK = NT * GATHER_ILP
#: Histogram bins: the top BITS bits of the 32-bit key.
BITS = 12
BINS = 1 << BITS
#: Gathered keys the pick kernel sorts (a power of two, >= KMAX); more fall back to the exact select.
CAP = 1024 if SIM else 4096
#: The sort's exchange row: the simulator's twin of the warp shuffle needs one slot per thread.
SCR = NT if SIM else 1
#: Most candidates (top_k) the device sampler takes.
KMAX = 1024
#: 512 threads x 128 registers fill the register file; without the cap the compiler may use more
#: and the launch fails with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES.
_JIT_OPTS = {} if SIM else {"max_registers": 128}
_LOW32 = 0xFFFFFFFF
_HALF = 1 << 31


# ----------------------------------------------------------------------------- device helpers
@cuda.jit(device=True)
def _key(v):
    """Order-preserving map of a float32 logit to uint32 (larger value -> larger key; -0.0 as
    +0.0; NaN -> 0, below -inf)."""
    if v != v:
        return uint32(0)
    if v == 0:
        return uint32(0x80000000)
    b = uint32(as_bits(v))
    if b & uint32(0x80000000):
        return ~b
    return b | uint32(0x80000000)


@cuda.jit(device=True)
def _value(c):
    """The logit of sort key c (the inverse of _key on its high word: -0.0 comes back as +0.0,
    which divides and exponentiates the same; a NaN as a NaN)."""
    key = uint32(c >> uint64(32))
    if key & uint32(0x80000000):
        return as_float(int32(key & uint32(0x7FFFFFFF)))
    return as_float(int32(int64(~key) - (1 << 32)))   # ~key has the sign bit set here


@cuda.jit(device=True)
def _comp(key, i):
    """Sort key of candidate i: larger key first, then smaller index."""
    return (uint64(key) << uint64(32)) | uint64(_LOW32 - int64(i))


@cuda.jit(device=True)
def _index(c):
    return int32(int64(_LOW32) - int64(c & uint64(_LOW32)))


@cuda.jit(device=True)
def _count(sh, v):
    """Count logit v into its bin of the shared histogram."""
    cuda.atomic.add(sh, int32(_key(v) >> uint32(32 - BITS)), 1)


@cuda.jit(device=True)
def _gather(cnt, ckey, cidx, bstar, v, i):
    """Append candidate i (logit v) to the global list (ckey, cidx) when its bin is at or above
    bstar (cnt[0] counts)."""
    key = _key(v)
    if (key >> uint32(32 - BITS)) >= bstar:
        slot = cuda.atomic.add(cnt, 0, 1)
        ckey[slot] = int32(int64(key) - _HALF)   # the key offset into int32's range
        cidx[slot] = i


if SIM:
    @cuda.jit(device=True)
    def _partner(v, m, scratch, tid):
        """The value lane ``lane ^ m`` holds (simulator twin of the shuffle: the same exchange
        through a shared row, every thread of the block calling it)."""
        scratch[tid] = v
        # Every lane's value must be stored before its partner reads it.
        cuda.syncthreads()
        p = scratch[tid ^ m]
        # The partner's value must be read before the row is reused.
        cuda.syncthreads()
        return p
else:
    @cuda.jit(device=True)
    def _partner(v, m, scratch, tid):
        """The value lane ``lane ^ m`` holds (a 64-bit shuffle; the casts keep the bits)."""
        return uint64(cuda.shfl_xor_sync(FULL_MASK, int64(v), m))


@cuda.jit(device=True)
def _lane_stage(a, b, g0, size, stride, scratch, tid):
    """One bitonic stage (size, stride <= 32) on elements g0 (a) and g0 + 1 (b) of a lane, g0
    even: the pair's lower element keeps the larger value in a descending block ((lower & size)
    == 0), the smaller in an ascending one -- the compare-exchange of the shared-memory form."""
    if stride == 1:
        hi = max(a, b)
        lo = min(a, b)
        if (g0 & size) == 0:
            return hi, lo
        return lo, hi
    m = stride >> 1                    # element g0 ^ stride is lane (lane ^ m)'s, same slot
    pa = _partner(a, m, scratch, tid)
    pb = _partner(b, m, scratch, tid)
    if ((g0 & stride) == 0) == ((g0 & size) == 0):
        return max(a, pa), max(b, pb)
    return min(a, pa), min(b, pb)


@cuda.jit(device=True)
def _lane_stages(comp, n2, size, first, scratch, tid):
    """Stages (size, stride) for stride = first, first / 2, ..., 1 (first <= 32) on every
    64-element chunk of comp[0:n2] in registers: lane l of a warp holds elements 2l and 2l + 1 of
    its chunk, so a stride s >= 2 is a shuffle with lane l ^ (s / 2) and stride 1 stays in the
    lane. Every thread runs the same number of rounds (warps without a chunk exchange dummies),
    as the simulator twin's barriers need."""
    lane = tid & 31
    warp = tid >> 5
    nwarp = NT // 32
    nch = n2 // 64
    for r in range((nch + nwarp - 1) // nwarp):
        c = warp + r * nwarp
        g0 = c * 64 + 2 * lane
        a = uint64(0)
        b = uint64(0)
        if c < nch:
            a = comp[g0]
            b = comp[g0 + 1]
        stride = first
        while stride > 0:
            a, b = _lane_stage(a, b, g0, size, stride, scratch, tid)
            stride //= 2
        if c < nch:
            comp[g0] = a
            comp[g0 + 1] = b


@cuda.jit(device=True)
def _shared_stage(comp, n2, size, stride, tid):
    """One bitonic stage (size, stride) through shared memory: every pair (i, i + stride) of
    comp[0:n2] compare-exchanged, descending where (i & size) == 0, ascending elsewhere."""
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


@cuda.jit(device=True)
def _bitonic_desc(comp, n2, scratch, tid):
    """Sort comp[0:n2] (n2 a power of two) descending; every thread calls it after a barrier that
    published the entries; sorted when it returns. The bitonic network of (size, stride) stages
    in the usual order. From 64 keys on, the stages of stride <= 32 run in registers with warp
    shuffles (_lane_stages: sizes 2..64 whole, then the last six stages of every larger size) and
    the others through shared memory with a barrier after each: 10 shared-memory stages for 2048
    keys instead of 66. Fewer keys take the shared-memory stages only (a register pass over a
    padded 64 costs more there). Every stage is the same compare-exchange, so the result is the
    sorted array whichever form ran it."""
    if n2 < 64:
        size = 2
        while size <= n2:
            stride = size // 2
            while stride > 0:
                _shared_stage(comp, n2, size, stride, tid)
                stride //= 2
            size *= 2
        return
    size = 2
    while size <= 64:
        _lane_stages(comp, n2, size, size // 2, scratch, tid)
        size *= 2
    # The chunks must be stored before the shared-memory stages read across them.
    cuda.syncthreads()
    while size <= n2:
        stride = size // 2
        while stride >= 64:
            _shared_stage(comp, n2, size, stride, tid)
            stride //= 2
        _lane_stages(comp, n2, size, 32, scratch, tid)
        # The chunks must be stored before the next size's stages read across them.
        cuda.syncthreads()
        size *= 2


@cuda.jit(device=True)
def _pad_sort(comp, m, scratch, tid):
    """Pad comp[m:] to a power of two with zeros (below every real entry) and sort it."""
    n2 = 1
    while n2 < m:
        n2 *= 2
    for j in range(m + tid, n2, NT):
        comp[j] = uint64(0)
    # The padding must be in place before the sort reads it.
    cuda.syncthreads()
    _bitonic_desc(comp, n2, scratch, tid)


@cuda.jit(device=True)
def _select_exact(logits, V, kc, comp, hist, segi, bc, scr, tid):
    """comp[0:kc] := the kc best candidates of the whole row, sorted (the fallback: radix select
    of the kc-th largest key 8 bits at a time, gather by per-thread segments, sort)."""
    prefix = uint32(0)
    pmask = uint32(0)
    remaining = kc
    for sh in (24, 16, 8, 0):
        for b in range(tid, 256, NT):
            hist[b] = 0
        # The histogram must be cleared before anyone counts into it.
        cuda.syncthreads()
        for i in range(tid, V, NT):
            key = _key(logits[i])
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
    seg = (V + NT - 1) // NT
    lo = tid * seg
    hi = min(V, lo + seg)
    ngt = 0
    neq = 0
    for i in range(lo, hi):
        key = _key(logits[i])
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
    oe = segi[tid] & int64(_LOW32)
    for i in range(lo, hi):
        key = _key(logits[i])
        slot = -1
        if key > tau:
            slot = og
            og += 1
        elif key == tau:
            if oe < need_eq:
                slot = n_gt + oe
            oe += 1
        if slot >= 0:
            comp[slot] = _comp(key, i)
    # Every candidate must be in place before the sort.
    cuda.syncthreads()
    _pad_sort(comp, kc, scr, tid)


@cuda.jit(device=True)
def _last_to_arrive(counter, slot, flag, fslot, tid):
    """The "last block" pattern: the block's arrival is counted on counter[slot] after every
    thread's global writes (release fence); True, in every thread, for the block that arrives
    last, which then sees the other blocks' writes (acquire fence). flag[fslot] is a shared slot
    carrying thread 0's answer to the block. Every thread of the block calls it."""
    # Release: this thread's writes are visible device-wide before the block's arrival is counted.
    cuda.threadfence()
    # Every thread's writes must be fenced before thread 0 counts the arrival.
    cuda.syncthreads()
    if tid == 0:
        last = cuda.atomic.add(counter, slot, 1) == cuda.gridDim.x - 1
        if last:
            cuda.threadfence()   # acquire: the other blocks' writes after their arrivals
        flag[fslot] = 1 if last else 0
    # The flag must be stored before the block reads it.
    cuda.syncthreads()
    last = flag[fslot] != 0
    if last:
        cuda.threadfence()
    return last


# ----------------------------------------------------------------------------- kernels
@jit_kernel
def _hist_kernel(logits, iparams, hist, ticket, plan):
    grid_dep_wait()
    V = logits.shape[0]
    tid = cuda.threadIdx.x
    sh = cuda.shared.array(BINS, int32)
    part = cuda.shared.array(HIST_NT, int32)
    flag = cuda.shared.array(1, int32)
    for j in range(tid, BINS, HIST_NT):
        sh[j] = 0
    # The bins must be cleared before anyone counts into them.
    cuda.syncthreads()
    lo = cuda.blockIdx.x * CHUNK
    hi = min(V, lo + CHUNK)
    if hi - lo == CHUNK:
        # a whole chunk: the thread's HIST_PER logits requested before any is counted (all loads
        # in flight instead of one load's latency per element)
        vals = cuda.local.array(HIST_PER, float32)
        for u in range(HIST_PER):
            vals[u] = logits[lo + tid + u * HIST_NT]
        for u in range(HIST_PER):
            _count(sh, vals[u])
    else:
        for i in range(lo + tid, hi, HIST_NT):
            _count(sh, logits[i])
    # Every count must be in before the block's bins are added to the global histogram.
    cuda.syncthreads()
    for j in range(tid, BINS, HIST_NT):
        c = sh[j]
        if c != 0:
            cuda.atomic.add(hist, j, c)
    if not _last_to_arrive(ticket, 0, flag, 0, tid):
        return
    kc = min(max(iparams[0], 1), V)
    per = BINS // HIST_NT
    # the global totals of this thread's bins copied into the block's (no longer needed) shared
    # bins and cleared for the next launch; the walk below reads shared memory only
    s = 0
    for j in range(tid * per, (tid + 1) * per):
        c = hist[j]
        hist[j] = 0
        sh[j] = c
        s += c
    part[tid] = s
    # suffix sums part[g] = keys in bin groups g.. (a doubling scan; integer sums, exact)
    off = 1
    while off < HIST_NT:
        # The previous step's sums must be stored before anyone reads them.
        cuda.syncthreads()
        v = part[tid + off] if tid + off < HIST_NT else 0
        # Every read of this step must be done before anyone adds.
        cuda.syncthreads()
        part[tid] += v
        off *= 2
    # The suffix sums must be stored before the groups test them.
    cuda.syncthreads()
    # the group holding the kc-th largest key: the one thread whose suffix reaches kc while the
    # groups above it do not (kc <= V = part[0]); it walks its own bins from the top
    above = part[tid + 1] if tid + 1 < HIST_NT else 0
    if above < kc <= part[tid]:
        acc = above
        b = (tid + 1) * per - 1
        while b > tid * per and acc + sh[b] < kc:
            acc += sh[b]
            b -= 1
        plan[0] = b
        plan[1] = acc
        plan[2] = acc + sh[b]
    if tid == 0:
        ticket[0] = 0


@jit_kernel(**_JIT_OPTS)
def _pick_kernel(out, logits, params, iparams, utab, pos, T, plan, cnt, ckey, cidx):
    grid_dep_wait()
    V = logits.shape[0]
    tid = cuda.threadIdx.x
    comp = cuda.shared.array(CAP, uint64)      # candidate sort keys
    cum = cuda.shared.array(KMAX, float64)     # weights, then running sums
    hist = cuda.shared.array(256, int32)
    segi = cuda.shared.array(NT, int64)
    bc = cuda.shared.array(4, int32)           # broadcast slots / the last-block flag
    scr = cuda.shared.array(SCR, uint64)       # the simulator's shuffle row (unused on the GPU)
    kc = min(max(iparams[0], 1), V, KMAX)
    bstar = uint32(plan[0])
    n_ge = plan[2]
    # the scalars the end of the kernel needs, read now so their latency hides behind the gather
    temp = params[0]
    top_p = params[1]
    idx = int64(pos[0]) + T - iparams[1]
    unif = utab[min(max(idx, int64(0)), int64(utab.shape[0] - 1))]
    if n_ge <= CAP:
        # every block gathers the keys at or above the bin from its PICK_CHUNK logits (one round
        # of GATHER_ILP loads per thread) into the global candidate list
        lo = cuda.blockIdx.x * PICK_CHUNK
        hi = min(V, lo + PICK_CHUNK)
        if hi - lo == PICK_CHUNK:
            vals = cuda.local.array(GATHER_ILP, float32)
            for u in range(GATHER_ILP):
                vals[u] = logits[lo + tid + u * NT]
            for u in range(GATHER_ILP):
                _gather(cnt, ckey, cidx, bstar, vals[u], lo + tid + u * NT)
        else:
            for i in range(lo + tid, hi, NT):
                _gather(cnt, ckey, cidx, bstar, logits[i], i)
    if not _last_to_arrive(cnt, 1, bc, 2, tid):
        return
    if n_ge <= CAP:
        # the candidates the histogram counted (plan[2] of them), in arrival order: the sort orders them
        for j in range(tid, n_ge, NT):
            comp[j] = _comp(uint32(int64(ckey[j]) + _HALF), cidx[j])
        # Every candidate must be in place (and the list read) before the sort and the reset.
        cuda.syncthreads()
        _pad_sort(comp, n_ge, scr, tid)
    else:
        _select_exact(logits, V, kc, comp, hist, segi, bc, scr, tid)
    if tid == 0:
        cnt[0] = 0                              # the next launch starts from an empty list
        cnt[1] = 0
    # the logits come back from the sort keys (no second read of the row)
    z0 = float64(_value(comp[0])) / temp
    for j in range(tid, kc, NT):
        cum[j] = math.exp(float64(_value(comp[j])) / temp - z0)
    # Every weight must be stored before thread 0 accumulates them.
    cuda.syncthreads()
    if tid == 0:
        # the running sums in candidate order (the host's order, so the same float64 sums); four
        # weights are read ahead of their additions, which stay one dependent chain
        run = float64(0.0)
        j = 0
        while j + 4 <= kc:
            a0 = cum[j]
            a1 = cum[j + 1]
            a2 = cum[j + 2]
            a3 = cum[j + 3]
            run += a0
            cum[j] = run
            run += a1
            cum[j + 1] = run
            run += a2
            cum[j + 2] = run
            run += a3
            cum[j + 3] = run
            j += 4
        while j < kc:
            run += cum[j]
            cum[j] = run
            j += 1
        bc[0] = kc                              # candidates kept by top-p (the first j + 1 ...)
        bc[1] = KMAX                            # the drawn candidate (the first j ...), if any
    # The running sums and the slots must be in place before the searches.
    cuda.syncthreads()
    # The sums never decrease, so "the first j with cum[j] >= thr" is a minimum over threads of
    # each thread's first hit: the same comparisons as a scan, done in parallel.
    if top_p < 1.0:                             # uniform over the block
        thr = top_p * cum[kc - 1]
        for j in range(tid, kc, NT):
            if cum[j] >= thr:
                cuda.atomic.min(bc, 0, j + 1)
                break
        # The top-p cut must be final before the draw reads it.
        cuda.syncthreads()
    n = bc[0]
    r = unif * cum[n - 1]
    for j in range(tid, n, NT):
        if cum[j] > r:
            cuda.atomic.min(bc, 1, j)
            break
    # Every thread's hit must be in before the token is chosen.
    cuda.syncthreads()
    if tid == 0:
        out[0] = _index(comp[min(bc[1], n - 1)])


# ----------------------------------------------------------------------------- launcher
#: The sampler's work arrays (all int32; allocate them zeroed, once: every launch leaves hist,
#: ticket and cnt zero): the histogram, its arrival ticket, the plan [bin, keys above it, keys at
#: or above it], the gather's [count, arrival ticket], and the candidates' keys and indices.
WORK_NAMES = ("hist", "ticket", "plan", "cnt", "ckey", "cidx")


def work_shapes() -> tuple:
    """Shapes of the work arrays named by WORK_NAMES (int32 each)."""
    return (BINS,), (1,), (3,), (2,), (CAP,), (CAP,)


def hist_launch(logits, iparams, work, stream=0):
    """The first kernel of `sample` alone (arguments checked by `sample`)."""
    hist, ticket, plan = work[:3]
    _hist_kernel[cdiv(logits.shape[0], CHUNK), HIST_NT, stream](logits, iparams, hist, ticket, plan)


def pick_launch(out, logits, params, iparams, utab, pos, T, work, stream=0):
    """The second kernel of `sample` alone (arguments checked by `sample`); it reads the plan the
    last histogram left."""
    plan, cnt, ckey, cidx = work[2:]
    _pick_kernel[cdiv(logits.shape[0], PICK_CHUNK), NT, stream](out, logits, params, iparams, utab, pos,
                                                                int(T), plan, cnt, ckey, cidx)


def sample(out, logits, params, iparams, utab, pos, T: int, work, stream=0):
    """Draw one token from `logits` into `out` (module doc: shapes, the uniform number's index
    ``pos[0] + T - base``, the algorithm); all arrays on the device, read there, so the two
    launches can be captured in a graph and replayed."""
    op = "sample"
    check_array(op, "logits", logits, np.float32, 1)
    V = logits.shape[0]
    if V == 0:
        raise BackendError(f"{op}: empty vocabulary")
    if V >= 2 ** 31 - 1:
        raise BackendError(f"{op}: vocabulary of {V} is too large")
    check_array(op, "out", out, np.int32, 1, (1,))
    check_array(op, "params", params, np.float64, 1, (2,))
    check_array(op, "iparams", iparams, np.int32, 1, (2,))
    check_array(op, "utab", utab, np.float64, 1)
    if utab.shape[0] == 0:
        raise BackendError(f"{op}: utab holds no uniform numbers")
    check_array(op, "pos", pos, np.int32, 1)
    if pos.shape[0] < 1:
        raise BackendError(f"{op}: pos is empty")
    if isinstance(T, bool) or not isinstance(T, (int, np.integer)) or T < 1:
        raise BackendError(f"{op}: T={T!r} must be an integer >= 1")
    if not isinstance(work, (tuple, list)) or len(work) != len(WORK_NAMES):
        raise BackendError(f"{op}: work must be a ({', '.join(WORK_NAMES)}) tuple (work_shapes), got "
                           f"{type(work).__name__}{'' if not isinstance(work, (tuple, list)) else f' of {len(work)}'}")
    for name, a, shape in zip(WORK_NAMES, work, work_shapes()):
        check_workspace(op, name, a, np.int32, shape[0], "the sampler (work_shapes)")
    hist_launch(logits, iparams, work, stream)
    pick_launch(out, logits, params, iparams, utab, pos, T, work, stream)


def ptx_signatures():
    return [("sample_hist", _hist_kernel.py_func,
             "void(float32[::1], int32[::1], int32[::1], int32[::1], int32[::1])"),
            ("sample_pick", _pick_kernel.py_func,
             "void(int32[::1], float32[::1], float64[::1], int32[::1], float64[::1], int32[::1], "
             "int64, int32[::1], int32[::1], int32[::1], int32[::1])")]
