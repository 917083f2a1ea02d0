"""Helpers shared by the kernels in this package: deterministic reductions, bit reinterpretation,
exactly rounded float32 steps (`rint`, `mul_rn`: libdevice on the GPU, numpy float32 under the
simulator, which has no libdevice) and launcher-side argument checks.

Reductions. On a GPU a warp sum is a butterfly of ``shfl_xor_sync`` with lane offsets 16, 8, 4,
2, 1: at each step lane i adds its partner's value, ``v_i + v_(i^o)``. IEEE addition is
commutative, so lanes i and i^o compute the same bits and after the 5 steps every lane holds the
identical total, combined in a fixed tree that depends only on lane numbers. The CUDA simulator
has no warp shuffles, so when ``numba.config.ENABLE_CUDASIM`` is true the same functions are
replaced by twins that run the SAME butterfly through a shared-memory scratch row (read partner,
barrier, write, barrier). Results are therefore identical between the two, up to the simulator's
own float rounding of ``fma`` (it computes ``a * b + c`` with two roundings).

Calling convention: every thread of the block must call a reduction from uniform control flow
(the twins use ``cuda.syncthreads()``; on the device ``shfl_xor_sync`` with a full mask needs all
32 lanes). Each kernel declares a ``(n_warps, 32)`` float32 scratch array (used only by the
simulator twin, dead code on the device) and passes it with the warp and lane numbers.

Block sums: each warp reduces by the butterfly, lane 0 stores its warp's total, and after a
barrier every thread adds the warp totals sequentially in warp order 0, 1, 2, ... . The order is
fixed by the block shape, which every kernel fixes at compile time and never derives from the
number of rows in a launch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numba
import numpy as np
from numba import cuda, float32, int32, int64, uint32, uint64

from ...errors import BackendError
from ...model.init_state import C1, C2, mix

SIM = bool(numba.config.ENABLE_CUDASIM)
FULL_MASK = 0xFFFFFFFF
NEG_INF = float32(-np.inf)

if not SIM:
    _U_C1 = np.uint64(C1)
    _U_C2 = np.uint64(C2)

    @cuda.jit(device=True)
    def splitmix64(z):
        """The splitmix64 finalizer on a uint64 (tinyloop.model.init_state.mix on the device);
        the counter hash of the random initial state."""
        z = (z ^ (z >> uint64(30))) * _U_C1
        z = (z ^ (z >> uint64(27))) * _U_C2
        return z ^ (z >> uint64(31))

    @cuda.jit(device=True)
    def warp_sum(v, scratch, warp, lane):
        """Butterfly sum over the 32 lanes of a warp; every lane returns the same total."""
        v += cuda.shfl_xor_sync(FULL_MASK, v, 16)
        v += cuda.shfl_xor_sync(FULL_MASK, v, 8)
        v += cuda.shfl_xor_sync(FULL_MASK, v, 4)
        v += cuda.shfl_xor_sync(FULL_MASK, v, 2)
        v += cuda.shfl_xor_sync(FULL_MASK, v, 1)
        return v

    @cuda.jit(device=True)
    def warp_max(v, scratch, warp, lane):
        """Butterfly max over the 32 lanes of a warp (exact: order cannot change the result)."""
        v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 16))
        v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 8))
        v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 4))
        v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 2))
        v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 1))
        return v

    @cuda.jit(device=True)
    def as_float(bits):
        """Reinterpret the low 32 bits of an integer as a float32."""
        return cuda.libdevice.int_as_float(bits)

    @cuda.jit(device=True)
    def as_bits(f):
        """Reinterpret a float32 as int32 bits."""
        return cuda.libdevice.float_as_int(f)

    @cuda.jit(device=True)
    def rint(x):
        """float32 x rounded to the nearest integer, ties to even (numpy's rint)."""
        return cuda.libdevice.rintf(x)

    @cuda.jit(device=True)
    def mul_rn(a, b):
        """float32 a * b rounded once and never contracted into an fma with a following add
        (mul.rn: ptxas fuses a plain multiply-add by default)."""
        return cuda.libdevice.fmul_rn(a, b)

    @cuda.jit(device=True)
    def sync_warp():
        """Barrier of the calling warp's lanes (every lane must reach it)."""
        cuda.syncwarp()

    @cuda.jit(device=True)
    def seg_max(v, width, scratch, tid):
        """Max of v over the aligned segment of `width` lanes (a power of two <= 32) holding
        thread tid, in every lane of it. Exact (max is exact in any order); every lane of the warp
        must call it. `scratch` (one entry per thread) serves only the simulator's twin."""
        o = width >> 1
        while o > 0:
            v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, o))
            o >>= 1
        return v

    @cuda.jit(device=True)
    def seg_sum(v, width, scratch, tid):
        """Integer sum of v over the aligned segment of `width` lanes holding tid (exact for
        integers in any order), in every lane of it; as `seg_max`."""
        o = width >> 1
        while o > 0:
            v += cuda.shfl_xor_sync(FULL_MASK, v, o)
            o >>= 1
        return v

    @cuda.jit(device=True)
    def rint64(x):
        """float64 x rounded to the nearest integer, ties to even (numpy's rint)."""
        return cuda.libdevice.rint(x)

    @cuda.jit(device=True)
    def pow2n(e):
        """2.0 ** e for e in the normal range [-1022, 1023], built from its exponent bits: one
        integer add and shift (libdevice's ldexp guards the whole range with clamps, selects and
        four float64 multiplies)."""
        return cuda.libdevice.longlong_as_double(int64(int32(e) + int32(1023)) << 52)

else:  # CUDA simulator twins: same butterfly, through shared memory.
    # Each lane publishes its value, reads all 32, and replays the butterfly locally, so the result
    # is bit for bit the shuffle version's, with two barriers instead of one per step (the
    # simulator's barriers are what makes it slow). warp_max replays every lane's partial at every
    # step (self, partner in that order: Python's max is not symmetric in a NaN). warp_sum needs
    # only lane 0's tree: at each step lanes i and i^o add the same two float32 values (addition is
    # commutative), so every lane ends with lane 0's bits; its 31 adds are the ones lane 0 of the
    # shuffle version makes, v[i] + v[i + o] for i < o.

    @cuda.jit(device=True)
    def _gather(v, scratch, warp, lane):
        """Publish v and return the warp's 32 values as a list."""
        scratch[warp, lane] = v
        # Every lane's value must be stored before any lane reads the warp's values.
        cuda.syncthreads()
        vals = [scratch[warp, i] for i in range(32)]
        # Every lane must have read the values before a later call overwrites them.
        cuda.syncthreads()
        return vals

    @cuda.jit(device=True)
    def _replay(v, scratch, warp, lane, combine):
        """Replay the butterfly with `combine` over the warp's values; lane's result."""
        vals = _gather(v, scratch, warp, lane)
        for o in (16, 8, 4, 2, 1):
            vals = [combine(vals[i], vals[i ^ o]) for i in range(32)]
        return vals[lane]

    @cuda.jit(device=True)
    def warp_sum(v, scratch, warp, lane):
        vals = _gather(v, scratch, warp, lane)
        for o in (16, 8, 4, 2, 1):
            vals = [vals[i] + vals[i + o] for i in range(o)]
        return vals[0]

    @cuda.jit(device=True)
    def warp_max(v, scratch, warp, lane):
        return _replay(v, scratch, warp, lane, max)

    @cuda.jit(device=True)
    def splitmix64(z):
        # numpy warns on uint64 wrap-around; Python integers give the same bits.
        return np.uint64(mix(int(z)))

    @cuda.jit(device=True)
    def as_float(bits):
        return np.uint32(int(bits) & 0xFFFFFFFF).view(np.float32)

    @cuda.jit(device=True)
    def as_bits(f):
        return np.float32(f).view(np.int32)

    @cuda.jit(device=True)
    def rint(x):
        return np.rint(np.float32(x))

    @cuda.jit(device=True)
    def mul_rn(a, b):
        return np.float32(a) * np.float32(b)

    @cuda.jit(device=True)
    def sync_warp():
        # the simulator has no warp barrier: callers reach this from block-uniform control flow
        cuda.syncthreads()

    @cuda.jit(device=True)
    def _seg_values(v, width, scratch, tid):
        scratch[tid] = v
        cuda.syncthreads()
        base = tid - tid % width
        vals = [scratch[base + i] for i in range(width)]
        cuda.syncthreads()
        return vals

    @cuda.jit(device=True)
    def seg_max(v, width, scratch, tid):
        # (block-uniform callers: the twin's barriers are block barriers)
        return max(_seg_values(v, width, scratch, tid))

    @cuda.jit(device=True)
    def seg_sum(v, width, scratch, tid):
        vals = _seg_values(v, width, scratch, tid)
        return type(v)(sum(int(a) for a in vals))

    @cuda.jit(device=True)
    def rint64(x):
        return np.rint(np.float64(x))

    @cuda.jit(device=True)
    def pow2n(e):
        assert -1022 <= e <= 1023
        return np.ldexp(np.float64(1.0), int(e))


@cuda.jit(device=True)
def block_sum_once(v, scratch, part, warp, lane, n_warps):
    """Sum of v over the block, identical bits in every thread: warp butterflies, then the warp
    totals added in warp order. `part` is a shared float32 array of at least n_warps entries. No
    barrier at the end: the caller must pass one before `part` is written again (block_sum)."""
    w = warp_sum(v, scratch, warp, lane)
    if lane == 0:
        part[warp] = w
    # The warp totals (and whatever the caller stored before the call) must be visible before any
    # thread adds them up.
    cuda.syncthreads()
    tot = part[0]
    for i in range(1, n_warps):
        tot += part[i]
    return tot


@cuda.jit(device=True)
def block_sum_first(v, scratch, part, warp, lane, n_warps):
    """`block_sum` of the first n_warps warps' values, called by a block of at least that many
    warps (all of them, uniform control flow: every warp runs its butterfly and the barriers):
    the same bits as `block_sum` in a block of exactly n_warps warps holding the same values.
    `scratch` has a row per warp of the block, `part` at least n_warps entries."""
    w = warp_sum(v, scratch, warp, lane)
    if lane == 0 and warp < n_warps:
        part[warp] = w
    # The warp totals must be visible before any thread adds them up.
    cuda.syncthreads()
    tot = part[0]
    for i in range(1, n_warps):
        tot += part[i]
    # Every thread must have read `part` before a later call overwrites it.
    cuda.syncthreads()
    return tot


@cuda.jit(device=True)
def block_max_once(v, scratch, part, warp, lane, n_warps):
    """Max of v over the block (exact), returned to every thread; no barrier at the end (as
    block_sum_once)."""
    w = warp_max(v, scratch, warp, lane)
    if lane == 0:
        part[warp] = w
    # The warp maxima must be stored before any thread combines them.
    cuda.syncthreads()
    m = part[0]
    for i in range(1, n_warps):
        m = max(m, part[i])
    return m


@cuda.jit(device=True)
def block_sum(v, scratch, part, warp, lane, n_warps):
    """block_sum_once, then a barrier: `part` may be reused at once."""
    tot = block_sum_once(v, scratch, part, warp, lane, n_warps)
    # Every thread must have read `part` before a later call overwrites it.
    cuda.syncthreads()
    return tot


@cuda.jit(device=True)
def block_max(v, scratch, part, warp, lane, n_warps):
    """block_max_once, then a barrier: `part` may be reused at once."""
    m = block_max_once(v, scratch, part, warp, lane, n_warps)
    # Every thread must have read `part` before a later call overwrites it.
    cuda.syncthreads()
    return m


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def is_device_array(a) -> bool:
    if SIM:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        return isinstance(a, FakeCUDAArray)
    return cuda.is_cuda_array(a)


def check_array(op: str, name: str, a, dtypes, ndim: int, shape=None):
    """Validate a launcher argument: a C-contiguous device array of one of `dtypes` with `ndim`
    dimensions and, where `shape` is given, that shape (None entries are free). Host (numpy)
    arrays are refused: numba would copy them synchronously, which breaks stream ordering and
    graph capture."""
    if a is None:
        raise BackendError(f"{op}: {name} is required")
    if not is_device_array(a):
        raise BackendError(f"{op}: {name} must be a device array (numba.cuda.to_device / "
                           f"device_array), got {type(a).__name__}")
    if isinstance(dtypes, (str, np.dtype, type)):
        dtypes = (dtypes,)
    allowed = tuple(np.dtype(d) for d in dtypes)
    if np.dtype(a.dtype) not in allowed:
        raise BackendError(f"{op}: {name} has dtype {np.dtype(a.dtype).name}, expected "
                           f"{' or '.join(d.name for d in allowed)}")
    if a.ndim != ndim:
        raise BackendError(f"{op}: {name} must be {ndim}-D, got shape {tuple(a.shape)}")
    if shape is not None:
        for i, (got, want) in enumerate(zip(a.shape, shape)):
            if want is not None and got != want:
                raise BackendError(f"{op}: {name} has shape {tuple(a.shape)}, expected "
                                   f"{tuple('*' if s is None else s for s in shape)}")
    if not a.flags["C_CONTIGUOUS"]:
        raise BackendError(f"{op}: {name} must be C-contiguous")
    return a


def check_workspace(op: str, name: str, a, dtype, need: int, what: str):
    """A 1-D device workspace array of `dtype` with at least `need` entries (`what` says who needs
    them, e.g. "3 rows (work_shapes)")."""
    check_array(op, name, a, dtype, 1)
    if a.shape[0] < need:
        raise BackendError(f"{op}: {name} has {a.shape[0]} elements; {what} need at least {need}")
    return a


def device_pointer(a) -> int:
    """Device address of `a` (0 under the simulator, where alignment is irrelevant)."""
    if SIM:
        return 0
    return int(a.__cuda_array_interface__["data"][0])


_NO_TREE = []


def no_tree():
    """The empty (depth, path) tables that select the causal layout (made once, on first use;
    call it before any graph capture)."""
    if not _NO_TREE:
        _NO_TREE.extend([cuda.to_device(np.zeros(0, np.int32)), cuda.to_device(np.zeros((0, 1), np.int32))])
    return _NO_TREE[0], _NO_TREE[1]


def check_tree(op, depth, path, T):
    """Validate optional tree tables for a T-row launch: None or empty tables select the causal
    layout (the empty tables are returned); otherwise they must cover the T rows."""
    if depth is None:
        return no_tree()
    check_array(op, "depth", depth, np.int32, 1)
    check_array(op, "path", path, np.int32, 2, (depth.shape[0], None))
    if 0 < depth.shape[0] < T:
        raise BackendError(f"{op}: tree tables of {depth.shape[0]} rows for {T} rows")
    return depth, path


class Epilogue(NamedTuple):
    """A pair epilogue for `matmul.matmul(..., epilogue=)`: the matmul computes weight rows in pairs
    (na, nb) = ``rows(args, p, N)`` for p = 0 .. N/2 - 1 (each row reduced exactly as the plain
    matmul reduces it) and hands each pair's two results to ``store(args, out, t, p, va, vb, N)``
    instead of writing them to ``out[t, na]`` and ``out[t, nb]``. Both are @cuda.jit device
    functions of the module that owns the fused op; `args` is a tuple of device arrays and
    scalars passed to the kernel as one argument; `name` keys the compiled kernel; `n_rows` is
    the weight's row count N the epilogue was built for and `out_cols` the width of `out`;
    `sig` is the numba type of `args` (PTX compile tests); `t_rows`, when >= 0, the number of
    token rows the epilogue's arrays were checked for (the launch must have exactly that many)."""
    name: str
    rows: Any
    store: Any
    args: tuple
    n_rows: int
    out_cols: int
    sig: str
    t_rows: int = -1


class RowTail(NamedTuple):
    """A row tail for a one-row `matmul.matmul(..., epilogue=)`: once every block of the launch has
    stored its outputs, the block that arrives last runs ``run(args, out, tid, warp, lane,
    scratch, part)`` with all its threads (uniform control flow; at least 256 of them) on the
    finished row ``out[0]`` — a whole-row op that would otherwise be the next launch (the
    sandwich block's rmsnorm, the sublayer block's norm_add). ``args[0]`` is an int32 arrival
    counter (zero before the launch; the last block leaves it zero), the rest is the op's own.
    `run` is a @cuda.jit device function of the module that owns the op; `scratch` is shared
    float32 (warps, 32), `part` shared float32 of at least 8 entries. `name` keys the compiled
    kernel; `sig` is the numba type of `args` (PTX compile tests); `cols` the row width the op
    was built for (the launch's N); `distinct` the op's arrays that must not be `out`."""
    name: str
    run: Any
    args: tuple
    sig: str
    cols: int
    distinct: tuple = ()


__all__ = ["SIM", "Epilogue", "RowTail", "block_sum_first", "FULL_MASK", "NEG_INF", "warp_sum", "warp_max", "block_sum",
           "block_max", "block_sum_once", "block_max_once", "as_float", "as_bits", "cdiv",
           "is_device_array", "check_array", "check_workspace", "device_pointer", "no_tree",
           "check_tree", "rint", "mul_rn", "rint64", "pow2n", "sync_warp", "seg_max", "seg_sum", "float32", "uint32"]
