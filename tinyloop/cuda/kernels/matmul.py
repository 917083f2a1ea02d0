"""Matrix product with a stored weight: ``out[t, n] (+)= sum_k x[t, k] * W[n, k]``.

Shapes (T rows, K = in_features, N = out_features, G = K / group_size groups)::

    x       float32 (T, K)            activations, row-major
    out     float32 (T, N)            written, or added to when accumulate=True (fused residual)
    W  f32: float32 (N, K)
       f16: float16 (N, K)
       qB : uint8   (N, K*B/8)        B in 8, 4, 2; element j of a row sits in byte j*B//8 at bit
                                      offset (j % (8/B))*B (q4: element 2j in the LOW nibble)
            scales float16 (N, G), zeros uint8 (N, G); W[n, k] = (q - zeros[n, g]) * scales[n, g]
            with g = k // group_size

Two kernels; the launcher picks one from the weight's shape and storage only, never from T:

* fast (``_fast_*``): the weight row is read as 8-byte words (``uint64`` view): E = 64/B
  elements per word (q2 32, q4 16, q8 8, f16 4, f32 2). Needs K % E == 0, group_size % E == 0 and
  an 8-byte aligned weight. A block is NW warps; warp w of block b owns output rows
  ``(b*NW + w)*R .. +R`` (R rows per warp so one staged x value feeds R weights; with a pair
  epilogue, the rows of pairs ``(b*NW + w)*R/2 .. +R/2`` instead, see below) and
  TT token rows ``blockIdx.y*TT .. +TT``. The block stages x for its TT rows, KC elements at a
  time, into shared memory in a word-transposed layout ``xs[tt, i, word]`` (padded by one float per
  row) so lane reads and staging writes are free of bank conflicts.
  Dequantization uses the magic-number trick, in place: element p of a segment of a 32-bit half
  (segments of 23 // B elements, each shifted down once) is masked where it lies, and
  ``int_as_float(0x4B000000 | q << B*p)`` is exactly 2^23 + q * 2^(B*p) (all bits below the
  exponent), so subtracting the per-group constant 2^23 + zero * 2^(B*p) gives
  ``(q - zero) * 2^(B*p)`` exactly in one FADD. The staged x elements carry the factor
  2^-(B*p) of their place in the word (``in_place_pos``), so every product equals
  ``(q - zero) * x`` and the sums are bit for bit those of a plain dequantization — for |x| >=
  2^-100; smaller x (near float32's subnormal range) may lose low bits to the scaling, the same
  in every configuration, so batch invariance is unaffected. The group scale is applied once
  per word.
  One-row launches of quantized weights with few blocks (`prefetch_for`) first ask L2 for each
  warp's rows (`_prefetch.l2_prefetch`: codes, scales, zeros), a load hint that changes no value.
* simple (``_simple_*``): one warp per (row t, output n); lane l handles k = l, l+32, ...,
  dequantizing each element on its own. Used when the fast kernel's alignment conditions fail.

Reduction order (batch invariance). In the fast kernel, output (t, n) is computed by ONE warp:
lane l visits the words w = l, l+32, l+64, ... in ascending order (independent of KC, R, NW and TT,
because KC is a multiple of 32 words), and for each word forms the partial
``p = fma(w_{E-1}, x_{E-1}, ... fma(w_0, x_0, 0))`` (quantized: ``w_i = q_i - zero``), then
``acc = fma(scale, p, acc)`` (floats: scale 1, i.e. acc + p). The 32 lane sums are combined by
the fixed xor butterfly (offsets 16, 8, 4, 2, 1) of `_common.warp_sum`, then added to out when
accumulating. Every step is an explicit fma or add, so the compiler has no contraction choice
to make differently between the instantiations for T == 1 (TT=1) and T > 1 (TT=2) (the
configurations differ only in TT, R, NW, KC): row t of a T-row launch is bit-identical to the same
row launched alone. The simple kernel has the same property
(lane l: k = l, l+32, ..., fma per element, then the butterfly).

Fused RMSNorm (``norm_w=``, ``eps=``): ``out (+)= (rmsnorm(x) * norm_w) @ W^T`` in one launch,
without an intermediate normed buffer. Every block first computes the inverse RMS of its token
rows (the norm prologue), then stages ``(x[t, k] * inv[t]) * norm_w[k]`` instead of ``x[t, k]``.
The prologue reproduces the standalone rmsnorm kernel's summation order exactly, independent of
the block shape: the row's sum of squares is split into the 8 partials of rmsnorm's 256-thread
block ("virtual warps": partial i = ``fma(x, x, ss)`` over k = i, i+256, ..., `rmsnorm.sumsq_partial`),
each virtual warp's 32 partials are combined by the same xor butterfly, and the 8 totals are added
in order 0..7; ``inv = 1 / sqrt(ss / K + eps)`` (`rmsnorm.inv_rms`). Warp w of the block takes
virtual warps w, w+NW, ... (each a full-warp butterfly from uniform control flow), so NW, TT, T
and the grid only decide who computes a partial, not the order: the staged values are the bits
the rmsnorm kernel would have written, and the product is the same as rmsnorm followed by the
plain matmul (same kernel choice, same reduction). Both kernels (fast and simple) support it; the
norm is a compile-time variant of each (the launch signature always carries ``norm_w`` and
``eps``; without a norm the launcher passes row 0 of x as an unused placeholder).

Pair epilogues (``epilogue=``, a `_common.Epilogue`): the weight rows are taken in pairs
``(na, nb) = epilogue.rows(args, p, N)``, p = 0 .. N/2 - 1, a warp reducing both rows of its
pairs (R even); instead of storing the two totals, the warp hands them to
``epilogue.store(args, out, t, p, va, vb, N)`` (rope.qkv_epilogue: RoPE + KV append;
swiglu.glu_epilogue: silu(gate) * up). Each row is reduced exactly as without the epilogue, so the
result is the plain matmul's followed by the epilogue's op. The simple kernel does the same with
one warp per pair.

Warp reductions use shuffles on the GPU and the shared-memory twin under the simulator
(see `_common`).
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from ...model.arch import QUANT_BITS
from ...errors import BackendError
from ._cache import jit_kernel
from ._common import SIM, Epilogue, RowTail, as_float, cdiv, check_array, device_pointer, warp_sum
from ._pdl import grid_dep_wait
from ._cp_async import cp_async, cp_async_commit, cp_async_wait
from ._prefetch import l1_prefetch, l2_prefetch
from .rmsnorm import NT as NORM_NT
from .rmsnorm import NW as NORM_NW
from .rmsnorm import TAIL_THREADS
from .rmsnorm import check_eps, inv_rms, sumsq_partial

#: Elements per 8-byte word for each storage kind.
WORD_ELEMS = {"f32": 2, "f16": 4, "q8": 8, "q4": 16, "q2": 32}
#: Storage kind of each quantized width (the inverse of tinyloop.model.arch.QUANT_BITS).
QBITS = {b: k for k, b in QUANT_BITS.items()}

#: (TT token rows per block, R output rows per warp, NW warps per block, KC x elements staged per
#: chunk) for T == 1 and for T > 1. KC must be a multiple of 32 * 32 (the largest warp step, q2).
#: None of these changes the reduction order of an output element, so they are tuned freely
#: (measured on an H200, see docs/KERNELS.md).
GEMV_CONFIG = (1, 2, 8, 4096)
#: T == 1 with at least WIDE_N output rows (gate|up, large heads): more rows per warp (first tuned
#: as (1, 8, 4) with 2-D addressing, bench/matmul_tune.py on the H200: q4 11264x2048 14.2 -> 11.7
#: us against GEMV_CONFIG, while 2048x5632 is 50% slower with it, hence the threshold). With flat
#: addressing (1, 4, 8) is faster: the norm-fused gate|up pair kernel of the 360m decode step
#: 128.6 -> 125.4 and 129.8 -> 125.9 us per token in two device calls (bench/profile_decode.py; 2-D
#: (1, 8, 4) against flat (1, 4, 8)), while flat (1, 8, 4) was 160.8, flat (1, 4, 4) 159.9,
#: flat (1, 2, 8) 159.9, 2-D (1, 4, 8) 133.8. Depends on the weight's shape only, never on T.
GEMV_WIDE_CONFIG = (1, 4, 8, 4096)
WIDE_N = 8192
#: T == 1 with at least XWIDE_N output rows (large heads, the 16384x4096 benchmark matrix): 8 warps
#: of 8 rows, with registers capped at XWIDE_MAX_REGISTERS per thread so two 256-thread blocks fit
#: per SM (uncapped, ptxas takes ~150). H200, q4 g128 (weights from HBM): 16384x4096 31.1 -> 27.1
#: us, head 50304x2048 44.5 -> 42.6 us; gate|up 11264x2048 is slower with it (11.6 -> 13.7 us),
#: hence the second threshold. Shape rule only, like WIDE_N.
GEMV_XWIDE_CONFIG = (1, 8, 8, 4096)
XWIDE_N = 16384
XWIDE_MAX_REGISTERS = 128
#: T == 1 with at least WIDE_N output rows and more than LONG_K inputs (a row that does not fit one
#: 4096-element staged chunk: Huginn-0125's d 5280): 16 warps of 2 rows, one 6144-element chunk.
#: H200, q4 g32, weights from HBM (bench/gemv_stream.py, docs/KERNELS.md): Huginn's gate|up
#: 35840x5280 91.8 -> 66.2 us, head 65536x5280 140.4 -> 114.8, q|k|v 15840x5280 35.1 -> 30.8.
#: Shape rule only, like WIDE_N.
GEMV_LONG_CONFIG = (1, 2, 16, 6144)
LONG_K = 4096
#: T > 1 (same tuning run: (2, 8, 4) beat (4, 4, 4) by 3-9% at T = 16 and 128 on every shape).
GEMM_CONFIG = (2, 8, 4, 1024)
#: 2 <= T <= FEW_T rows of a weight with at most FEW_NK elements (tree levels, verify rows and
#: small lockstep batches on small models such as the demo model). These launches are latency-
#: bound: GEMM_CONFIG gives the demo model's 384-row weights 12-24 blocks. H100, q4 g64 / f16
#: head, weights L2-resident (bench/matmul_tune.py --shapes demo --few, docs/KERNELS.md), us per
#: launch against GEMM_CONFIG: at T = 2-4, N <= FEW_N (q|k|v 640, wo 384, down 384) (1, 1, 8)
#: 2.7-3.2 against 5.3-6.4; N > FEW_N (gate|up 2048, head 4096) (2, 4, 4) 4.2-5.8 against
#: 5.5-6.6; at T = 5-16, N <= FEW_N (1, 2, 8) 3.3-6.1 against 5.4-6.9, while for N > FEW_N
#: GEMM_CONFIG stays the best of the nine candidates. Keyed (T <= FEW_SMALL_T, N <= FEW_N).
FEW_CONFIGS = {(True, True): (1, 1, 8, 4096), (False, True): (1, 2, 8, 4096),
               (True, False): (2, 4, 4, 1024), (False, False): GEMM_CONFIG}
FEW_T = 16
FEW_SMALL_T = 4
FEW_N = 1024
FEW_NK = 1 << 21
#: Largest TT * R * E (fmas per lane per word) the compiler still unrolls fully (read off the
#: PTX); beyond it the accumulators are indexed at run time and live in local memory, so R is
#: lowered to fit.
MAX_UNROLL = 256
#: Largest R * E (weight elements one lane holds decoded per step): q2 with R = 8 (256) spills
#: even at TT = 1 (PTX test), so R is lowered to fit this as well.
MAX_ROW_ELEMS = 128


def config_for(kind: str, T: int, N: int = 0, pair: bool = False, K: int = 0):
    """(TT, R, NW, KC) the fast kernel uses for storage `kind`, T rows, N weight rows and K inputs;
    with `pair` (an epilogue) R is even, so a warp's rows are whole pairs."""
    if T == 1:
        TT, R, NW, KC = (GEMV_LONG_CONFIG if N >= WIDE_N and K > LONG_K else
                         GEMV_XWIDE_CONFIG if N >= XWIDE_N else
                         GEMV_WIDE_CONFIG if N >= WIDE_N else GEMV_CONFIG)
    elif T <= FEW_T and N * K <= FEW_NK:
        TT, R, NW, KC = FEW_CONFIGS[(T <= FEW_SMALL_T, N <= FEW_N)]
    else:
        TT, R, NW, KC = GEMM_CONFIG
    E = WORD_ELEMS[kind]
    R = max(1, min(R, MAX_UNROLL // (TT * E), MAX_ROW_ELEMS // E))
    if pair:
        R = max(2, R - R % 2)
    return TT, R, NW, KC


def max_registers_for(T: int, N: int, K: int = 0) -> int:
    """Register cap per thread of the fast kernel for T rows, N weight rows and K inputs (0: none):
    the cap of GEMV_XWIDE_CONFIG's launches."""
    return XWIDE_MAX_REGISTERS if T == 1 and N >= XWIDE_N and K <= LONG_K else 0


#: x elements each thread of a plain (no norm) one-row GEMV on `GEMV_CONFIG` loads before storing
#: any of them while staging: one L2 round trip per batch instead of one per ~4 elements (LLVM's
#: unroll). Same values, same places: results are unchanged. H200 (bench/profile_decode.py, 360m,
#: L = 8): wo + down 163.6 -> 158.9 us per token; the same batching in the norm-fused and wide
#: kernels made gate|up 142 -> 167 us, so it is limited to these.
STAGE_BATCH = 8


def stage_batch_for(T: int, N: int, norm: bool) -> int:
    """x elements per thread loaded together when staging (1: the plain staging loop)."""
    return STAGE_BATCH if T == 1 and N < WIDE_N and not norm else 1


def flat_for(T: int) -> bool:
    """Whether the fast kernel addresses the weight (and its scales and zeros) as flat arrays with
    32-bit row offsets computed once (True), or through 2-D indexing (False). Addressing only:
    the arithmetic is the same. H200 (bench/profile_decode.py, 360m, L = 8, us per token, 2-D ->
    flat): head 39.9 -> 35.4, q|k|v 107.3 -> 99.8, wo + down 141.7 -> 137.8, INT4 16384x4096
    22.2 -> 19.9 us per launch; the norm-fused gate|up pair kernel was slower flat with its old
    (1, 8, 4) configuration (128.8 -> 160.8) and is faster with GEMV_WIDE_CONFIG's (1, 4, 8),
    so every one-row launch is flat; the many-row ones (unmeasured) keep 2-D indexing."""
    return T == 1


#: One-row launches of quantized weights with at most this many blocks prefetch their rows into
#: L2 (see `prefetch_for`).
PREFETCH_BLOCKS = 128


def prefetch_for(kind: str, T: int, blocks: int) -> bool:
    """Whether a launch of `blocks` blocks (its grid's first dimension) asks L2 for its warps' weight
    rows first (`_make_fast`'s `prefetch`): one-row (flat) launches of quantized weights whose grid
    has at most PREFETCH_BLOCKS blocks, too few resident warps to keep many loads in flight
    otherwise. H200, q4, weights from HBM
    (bench/gemv_stream.py): Ouro's down 2048x5632 11.4 -> 9.8 us, wo 2048x2048 5.7 -> 5.2, the
    360m down 1024x4096 8.7 -> 7.5; with more blocks it gained nothing or lost (Huginn's wo
    5280x5280, 330 blocks: 16.5 -> 17.6). A load hint only: the results are unchanged."""
    return T == 1 and flat_for(T) and kind.startswith("q") and blocks <= PREFETCH_BLOCKS


SIMPLE_WARPS = 4

_U32_MASK = np.uint64(0xFFFFFFFF)
_SH32 = np.uint64(32)
_MAGIC = np.uint32(0x4B000000)
_TWO23 = float32(8388608.0)
_F16_MAG = np.uint32(0x7FFF)
_F16_SIGN = np.uint32(0x8000)
_F16_SCALE = float32(2.0 ** 112)


# ----------------------------------------------------------------------------- word decoders
def in_place_elems(kind: str) -> int:
    """Quantized elements of one segment of a 32-bit half that the decoder masks in place: every
    bit of the segment must lie below the float32 exponent (bit 23). q8: 2, q4: 5, q2: 11."""
    return 23 // QUANT_BITS[kind]


def in_place_pos(kind: str, i: int) -> int:
    """Position p of element i of a quantized word inside its segment: the decoder yields
    ``(q - zero) * 2^(bits * p)`` for it, and the staged x element i carries 2^-(bits * p)."""
    return (i % (WORD_ELEMS[kind] // 2)) % in_place_elems(kind)


def _make_decoder(kind):
    """Device function writing the E elements of one 8-byte word into the local array wv.
    Quantized, ``decode(word, wv, z, magic)`` with z = float32(zero) and magic = 0x4B000000:
    ``(q_i - zero) * 2^(bits * p_i)`` exactly, p_i = `in_place_pos(kind, i)`. Floats,
    ``decode(word, wv, unused)``: the values."""
    E = WORD_ELEMS[kind]
    EH = E // 2

    if kind == "f32":
        @cuda.jit(device=True)
        def decode(word, wv, c):
            wv[0] = as_float(uint32(word & _U32_MASK))
            wv[1] = as_float(uint32(word >> _SH32))
        return decode

    if kind == "f16":
        @cuda.jit(device=True)
        def half_to_float(h):
            # (h & 0x7fff) << 13 is h's exponent and mantissa in float32 position with the float16
            # bias; scaling by 2^112 rebiases exactly, subnormals included (finite values only).
            m = as_float((h & _F16_MAG) << uint32(13)) * _F16_SCALE
            if h & _F16_SIGN:
                m = -m
            return m

        @cuda.jit(device=True)
        def decode(word, wv, c):
            lo = uint32(word & _U32_MASK)
            hi = uint32(word >> _SH32)
            wv[0] = half_to_float(lo & uint32(0xFFFF))
            wv[1] = half_to_float(uint32(lo >> uint32(16)))
            wv[2] = half_to_float(hi & uint32(0xFFFF))
            wv[3] = half_to_float(uint32(hi >> uint32(16)))
        return decode

    bits = QUANT_BITS[kind]
    mask = np.uint32((1 << bits) - 1)
    S = in_place_elems(kind)

    # Straight-line source (LLVM then keeps the callers' row and token loops fully unrolled,
    # which a loop with per-element constants here prevented). Element e of a 32-bit half sits at
    # bit bits*e; segment j = e // S is shifted down by bits*S*j once, and inside it element
    # p = e % S is masked IN PLACE under the magic exponent: as_float(0x4B000000 | q << bits*p) =
    # 2^23 + q * 2^(bits*p) exactly (below bit 23), minus c_p = 2^23 + zero * 2^(bits*p) is
    # (q - zero) * 2^(bits*p) exactly. The staged x carries the factor 2^-(bits*p).
    lines = ["def decode(word, wv, z, magic):"]
    lines += [f"    c{p} = cuda.fma(z, float32({float(2 ** (bits * p))!r}), _TWO23)" for p in range(S)]
    lines += ["    h0 = uint32(word & _U32_MASK)", "    h1 = uint32(word >> _SH32)"]
    for j in range(1, -(-EH // S)):
        lines += [f"    h0s{j} = uint32(h0 >> uint32({bits * S * j}))",
                  f"    h1s{j} = uint32(h1 >> uint32({bits * S * j}))"]
    for e in range(EH):
        j, p = e // S, in_place_pos(kind, e)
        m = int(mask) << (bits * p)
        for half in (0, 1):
            src = f"h{half}" if j == 0 else f"h{half}s{j}"
            lines.append(f"    wv[{e + half * EH}] = as_float(({src} & uint32({m})) | magic) - c{p}")
    ns = {"cuda": cuda, "float32": float32, "uint32": uint32, "as_float": as_float,
          "_TWO23": _TWO23, "_U32_MASK": _U32_MASK, "_SH32": _SH32}
    exec("\n".join(lines), ns)
    decode = cuda.jit(device=True)(ns["decode"])
    return decode


# ----------------------------------------------------------------------------- plain epilogue
@cuda.jit(device=True)
def _no_rows(ep, p, N):
    """Placeholder pair map of a launch without an epilogue (never called)."""
    return p, p


@cuda.jit(device=True)
def _no_store(ep, out, t, p, va, vb, N):
    """Placeholder pair store of a launch without an epilogue (never called)."""
    return


@cuda.jit(device=True)
def _no_tail(ep, out, tid, warp, lane, scratch, part):
    """Placeholder row tail of a launch without one (never called)."""
    return


#: The `ep` argument of a launch without an epilogue (the kernels always take one).
NO_EPILOGUE_ARGS = (np.int64(0),)
NO_EPILOGUE_SIG = "UniTuple(int64, 1)"


# ----------------------------------------------------------------------------- norm prologue
_prologue_cache = {}


def _make_norm_prologue(TT, NW):
    """Device function filling ``invs[tt]`` (shared, TT floats) with the inverse RMS of rows
    t0 + tt < T, in the rmsnorm kernel's summation order (see module doc). `part` is a shared
    float32 array of TT * NORM_NW entries. Every thread of the block must call it (uniform control
    flow: each warp runs the same number of butterflies). `invs` is written by threads tid < TT
    and is visible to the block only after the caller's next ``syncthreads``."""
    key = (TT, NW)
    if key in _prologue_cache:
        return _prologue_cache[key]
    NJ = TT * NORM_NW          # (row, virtual warp) partial sums of the block
    assert NORM_NT == NORM_NW * 32

    @cuda.jit(device=True)
    def norm_prologue(x, t0, T, eps, invs, part, scratch, tid, warp, lane):
        K = x.shape[1]
        for j0 in range(0, NJ, NW):
            j = j0 + warp
            tt = j // NORM_NW
            t = t0 + tt
            ss = float32(0.0)
            if j < NJ and t < T:
                ss = sumsq_partial(x, t, (j - tt * NORM_NW) * 32 + lane, K)
            ss = warp_sum(ss, scratch, warp, lane)
            if lane == 0 and j < NJ:
                part[j] = ss
        # Every virtual warp's total must be stored before they are added up.
        cuda.syncthreads()
        if tid < TT:
            b = tid * NORM_NW
            tot = part[b]
            for i in range(1, NORM_NW):
                tot += part[b + i]
            invs[tid] = inv_rms(tot, K, eps)

    _prologue_cache[key] = norm_prologue
    return norm_prologue


# ----------------------------------------------------------------------------- fast kernels
_fast_cache = {}


def group_shift_for(kind: str, group: int, pair: bool) -> int:
    """log2 of the words per quantization group when that is a power of two and the kernel has no
    pair epilogue: the group index of a word is then a shift, compiled in, instead of a division
    by the run-time group size (-1: divide). Index arithmetic only, results are unchanged. H200
    (bench/profile_decode.py, 360m, L = 8, q4 g128): head 46.6 -> 44.4 us per token, wo + down
    157.1 -> 155.9, INT4 16384x4096 from HBM 27.1 -> 25.8 us; but the norm-fused pair-epilogue
    kernels got slower with it (gate|up 141.9 -> 213.3, q|k|v 111.2 -> 119.1 us per token; ptxas
    gives them fewer registers, 126 -> 96 and 64 -> 56), so they keep the division."""
    if pair or not kind.startswith("q"):
        return -1
    gw = group // WORD_ELEMS[kind]
    return gw.bit_length() - 1 if gw > 0 and gw & (gw - 1) == 0 else -1


def _make_fast(kind, TT, R, NW, KC, norm=False, epi=None, max_registers=0, stage_batch=1, gshift=-1,
               flat=False, prefetch=False, pipe=0):
    """Build the fast kernel for one storage kind and block configuration (see module doc);
    `norm` compiles in the fused-RMSNorm prologue and staging, `epi` (an `Epilogue`) the pair
    row map and store, or (a `RowTail`, TT = 1) the last block's row op; `max_registers` > 0 caps the registers per thread (ptxas);
    `stage_batch` > 1 stages x that many elements per thread at a time (plain staging only);
    `gshift` >= 0 takes a word's group index as ``w >> gshift`` (quantized kinds); `flat`
    takes the weight (and scales, zeros) as 1-D views addressed by 32-bit row offsets; `prefetch`
    (flat quantized kernels) has each warp ask L2 for its rows' codes, scales and zeros before
    anything else (`_prefetch.l2_prefetch`), a hint that changes no value; `pipe` >= 2 (flat
    quantized one-row kernels) keeps that many steps of a lane's weight words in flight through
    shared memory (`PIPE_STAGES`), the same words in the same order."""
    name = None if epi is None else epi.name
    key = (kind, TT, R, NW, KC, bool(norm), name, int(max_registers), int(stage_batch), int(gshift),
           bool(flat), bool(prefetch), int(pipe))
    if key in _fast_cache:
        return _fast_cache[key]
    NORM = bool(norm)
    SB = int(stage_batch)
    GS = int(gshift)
    FLAT = bool(flat)
    PF = bool(prefetch)
    PIPE = int(pipe)
    assert PIPE == 0 or (PIPE >= 2 and FLAT and TT == 1 and kind.startswith("q")), (pipe, flat, TT, kind)
    PS = max(PIPE, 1)
    RING = (NW, PS, R, 32) if PIPE else (1, 1, 1, 1)    # (no shared memory without the pipeline)
    wait_pipe = cp_async_wait(PIPE - 1 if PIPE else 0)
    assert SB >= 1 and not (NORM and SB > 1), (norm, stage_batch)
    assert not PF or (FLAT and kind.startswith("q") and 3 * R <= 32), (prefetch, flat, kind, R)
    PAIR = isinstance(epi, Epilogue)
    TAIL = isinstance(epi, RowTail)
    rows_of = epi.rows if PAIR else _no_rows
    store = epi.store if PAIR else _no_store
    tail_run = epi.run if TAIL else _no_tail
    RP = R // 2            # pairs per warp (pair mode)
    assert not PAIR or R % 2 == 0, R
    NJ = TT * NORM_NW
    assert not TAIL or (TT == 1 and NW * 32 >= TAIL_THREADS), (TT, NW)
    prologue = _make_norm_prologue(TT, NW)
    E = WORD_ELEMS[kind]
    NT = NW * 32
    NWC = KC // E          # words per staged chunk
    XW = NWC + 1           # padded row: staging writes of consecutive threads hit distinct banks
    EM1 = E - 1
    LOG2E = E.bit_length() - 1
    quant = kind.startswith("q")
    decode = _make_decoder(kind)
    assert KC % (32 * 32) == 0
    QB = QUANT_BITS.get(kind, 0)
    QS = in_place_elems(kind) if quant else 1
    EH = E // 2

    assert NT % E == 0     # a thread stages elements of one place in the word: tid % E

    @cuda.jit(device=True)
    def x_factor(tid):
        """2^-(bits * in_place_pos(kind, tid % E)): the factor of every x element this thread
        stages (exact, a power of two; 1 for float kinds)."""
        if not quant:
            return float32(1.0)
        return as_float(uint32(127 - QB * (((tid & EM1) % EH) % QS)) << uint32(23))

    @cuda.jit(device=True)
    def stage_x(xs, x, nw, invs, t0, c0, cw, T, tid):
        """Copy x[t0:t0+TT, c0*E:(c0+cw)*E] into xs (word-transposed), normed as
        ``(x * invs[tt]) * nw`` when NORM and times `x_factor` (quantized kinds: the power of two
        of the element's place in its word); rows past T read as 0."""
        n_el = cw * E
        base = c0 * E
        f = x_factor(tid)
        for tt in range(TT):
            t = t0 + tt
            if t < T:
                if NORM:
                    inv = invs[tt]
                    for rem in range(tid, n_el, NT):
                        k = base + rem
                        xs[tt, rem & EM1, rem >> LOG2E] = ((x[t, k] * inv) * nw[k]) * f
                elif SB > 1:
                    # SB loads per thread in flight together, then their stores
                    vals = cuda.local.array(SB, float32)
                    for r0 in range(tid, n_el, NT * SB):
                        for u in range(SB):
                            rem = r0 + u * NT
                            if rem < n_el:
                                vals[u] = x[t, base + rem]
                        for u in range(SB):
                            rem = r0 + u * NT
                            if rem < n_el:
                                xs[tt, rem & EM1, rem >> LOG2E] = vals[u] * f
                else:
                    for rem in range(tid, n_el, NT):
                        xs[tt, rem & EM1, rem >> LOG2E] = x[t, base + rem] * f
            else:
                for rem in range(tid, n_el, NT):
                    xs[tt, rem & EM1, rem >> LOG2E] = float32(0.0)

    @cuda.jit(device=True)
    def request_step(ring, qw, scales, zeros, qo, go, warp, lane, j, ni, ugw):
        """The weight-word pipeline's request of the lane's step j (when it has one): its R words
        into ring slot j % PIPE by cp.async, their scales and zeros into L1; then the thread's
        group of copies is closed (an empty group past the lane's last step)."""
        if j < ni:
            wj = uint32(lane + 32 * j)
            gj = (wj >> uint32(GS)) if GS >= 0 else wj // ugw
            for r in range(R):
                cp_async(ring, ((warp * PS + j % PS) * R + r) * 32 + lane, qw, qo[r] + wj)
                l1_prefetch(scales, go[r] + gj)
                l1_prefetch(zeros, go[r] + gj)
        cp_async_commit()

    @cuda.jit(device=True)
    def setup_rows(nrow, ep, unit, N):
        """The warp's weight rows: n0 .. n0 + R - 1 (clamped to N - 1: rows past N are computed on
        row N - 1 and never stored, so the warp stays converged for the butterfly), or in pair
        mode the rows of pairs unit*RP .. unit*RP + RP - 1 (clamped to the last pair)."""
        for j in range(R):
            nrow[j] = row_of(ep, unit, j, N)

    @cuda.jit(device=True)
    def row_of(ep, unit, j, N):
        """Row j of the warp's rows (`setup_rows`; j may be a run-time value: the prefetch)."""
        if PAIR:
            na, nb = rows_of(ep, min(unit * RP + j // 2, N // 2 - 1), N)
            return na if j % 2 == 0 else nb
        return min(unit * R + j, N - 1)

    @cuda.jit(device=True)
    def finish(out, acc, scratch, warp, lane, unit, t0, N, T, accumulate, ep):
        """Butterfly-reduce every accumulator of the warp and store it (optionally added), or in
        pair mode hand each pair's two totals to the epilogue."""
        for tt in range(TT):
            t = t0 + tt
            if PAIR:
                for j in range(RP):
                    va = warp_sum(acc[tt, 2 * j], scratch, warp, lane)
                    vb = warp_sum(acc[tt, 2 * j + 1], scratch, warp, lane)
                    p = unit * RP + j
                    if lane == (tt * RP + j) % 32 and t < T and p < N // 2:
                        store(ep, out, t, p, va, vb, N)
            else:
                for r in range(R):
                    v = warp_sum(acc[tt, r], scratch, warp, lane)
                    n = unit * R + r
                    # Every lane holds the total; spread the stores over lanes.
                    if lane == (tt * R + r) % 32 and t < T and n < N:
                        if accumulate:
                            v = out[t, n] + v
                        out[t, n] = v

    @cuda.jit(device=True)
    def row_tail(ep, out, flag, tid, warp, lane, scratch, part):
        """The row tail (`_common.RowTail`, one-row launches): every block counts its arrival
        once its outputs are stored; the last one runs the tail on the finished row and clears
        the counter ``ep[0][0]`` (the attention combine's fences, docs/KERNELS.md)."""
        # Release: this thread's stores of out (finish) visible device-wide before the barrier,
        # and so before the arrival is counted.
        cuda.threadfence()
        cuda.syncthreads()
        if tid == 0:
            last = cuda.atomic.add(ep[0], 0, 1) == cuda.gridDim.x * cuda.gridDim.y - 1
            if last:
                cuda.threadfence()     # acquire: the other blocks' counts seen, their rows after
            flag[0] = 1 if last else 0
        # flag must be stored before the block reads it.
        cuda.syncthreads()
        if flag[0] != 0:
            # every reading thread fences too (the row is read through its own loads)
            cuda.threadfence()
            tail_run(ep, out, tid, warp, lane, scratch, part)
            if tid == 0:
                ep[0][0] = 0

    # (the simulator's jit takes no register cap)
    opts = {"max_registers": int(max_registers)} if max_registers and not SIM else {}

    if quant:
        @jit_kernel(**opts)
        def kernel(out, x, nw, eps, qw, scales, zeros, N, nwords, G, gw, accumulate, ep):
            grid_dep_wait()
            T = x.shape[0]
            tid = cuda.threadIdx.x
            warp = tid // 32
            lane = tid % 32
            unit = cuda.blockIdx.x * NW + warp
            t0 = cuda.blockIdx.y * TT
            xs = cuda.shared.array((TT, E, XW), float32)
            scratch = cuda.shared.array((NW, 32), float32)
            invs = cuda.shared.array(TT, float32)
            part = cuda.shared.array(NJ, float32)
            acc = cuda.local.array((TT, R), float32)
            wv = cuda.local.array(E, float32)
            nrow = cuda.local.array(R, int32)
            setup_rows(nrow, ep, unit, N)
            # FLAT: row starts in the flat weight, scale and zero arrays, once (32-bit: the
            # launcher checks the sizes), so a load's address is an add and a wide shift-add.
            qo = cuda.local.array(R, uint32)
            go = cuda.local.array(R, uint32)
            for r in range(R):
                qo[r] = uint32(nrow[r]) * uint32(nwords)
                go[r] = uint32(nrow[r]) * uint32(G)
            if PF and lane < 3 * R:
                # lanes j, R + j, 2R + j: the codes, scales, zeros of the warp's row j on their
                # way into L2 (the row computed again, not read from nrow: a run-time index into
                # the row arrays would put them in local memory)
                n = uint32(row_of(ep, unit, lane % R, N))
                part_kind = lane // R
                if part_kind == 0:
                    l2_prefetch(qw, n * uint32(nwords), nwords)
                elif part_kind == 1:
                    l2_prefetch(scales, n * uint32(G), G)
                else:
                    l2_prefetch(zeros, n * uint32(G), G)
            ugw = uint32(gw)
            ring = cuda.shared.array(RING, uint64)
            ni = (nwords - lane + 31) // 32        # the lane's words: lane, lane + 32, ...
            if PIPE:
                # the lane's first PIPE - 1 steps of words on their way into its ring slots, and
                # their scales and zeros into L1, before the prologue and the staging
                for st in range(PIPE - 1):
                    request_step(ring, qw, scales, zeros, qo, go, warp, lane, st, ni, ugw)
            if NORM:
                # invs becomes visible at the first chunk's barrier below.
                prologue(x, t0, T, eps, invs, part, scratch, tid, warp, lane)
            for tt in range(TT):
                for r in range(R):
                    acc[tt, r] = float32(0.0)
            # 0x4B000000 as a run-time value (the grid is 2-D: blockIdx.z is 0): with both the
            # element mask and the magic as immediates ptxas emits an AND and an OR per element;
            # with the magic in a register it fuses them into one LOP3 (SASS: 140 instead of 268
            # LOP3 per 8-row step).
            magic = _MAGIC | uint32(cuda.blockIdx.z)
            for c0 in range(0, nwords, NWC):
                cw = min(NWC, nwords - c0)
                # The previous chunk's reads of xs must be done before it is overwritten.
                cuda.syncthreads()
                stage_x(xs, x, nw, invs, t0, c0, cw, T, tid)
                # The staged chunk must be visible to every warp before the dot products.
                cuda.syncthreads()
                for wl in range(lane, cw, 32):
                    w = uint32(c0 + wl)
                    g = (w >> uint32(GS)) if GS >= 0 else w // ugw
                    step = (c0 + wl) >> 5              # the lane's step
                    if PIPE:
                        # step + PIPE - 1 requested, then this step waited for (its group of copies)
                        request_step(ring, qw, scales, zeros, qo, go, warp, lane, step + PIPE - 1, ni, ugw)
                        wait_pipe()
                    for r in range(R):
                        if PIPE or FLAT:
                            word = ring[warp, step % PS, r, lane] if PIPE else qw[qo[r] + w]
                            s = float32(scales[go[r] + g])
                            z = float32(zeros[go[r] + g])
                        else:
                            n = nrow[r]
                            word = qw[n, w]
                            s = float32(scales[n, g])
                            z = float32(zeros[n, g])
                        decode(word, wv, z, magic)
                        for tt in range(TT):
                            p = float32(0.0)
                            for i in range(E):
                                p = cuda.fma(wv[i], xs[tt, i, wl], p)
                            acc[tt, r] = cuda.fma(s, p, acc[tt, r])
            finish(out, acc, scratch, warp, lane, unit, t0, N, T, accumulate, ep)
            if TAIL:
                row_tail(ep, out, cuda.shared.array(1, int32), tid, warp, lane, scratch, part)
    else:
        @jit_kernel(**opts)
        def kernel(out, x, nw, eps, qw, N, nwords, accumulate, ep):
            grid_dep_wait()
            T = x.shape[0]
            tid = cuda.threadIdx.x
            warp = tid // 32
            lane = tid % 32
            unit = cuda.blockIdx.x * NW + warp
            t0 = cuda.blockIdx.y * TT
            xs = cuda.shared.array((TT, E, XW), float32)
            scratch = cuda.shared.array((NW, 32), float32)
            invs = cuda.shared.array(TT, float32)
            part = cuda.shared.array(NJ, float32)
            if NORM:
                # invs becomes visible at the first chunk's barrier below.
                prologue(x, t0, T, eps, invs, part, scratch, tid, warp, lane)
            acc = cuda.local.array((TT, R), float32)
            wv = cuda.local.array(E, float32)
            nrow = cuda.local.array(R, int32)
            setup_rows(nrow, ep, unit, N)
            for tt in range(TT):
                for r in range(R):
                    acc[tt, r] = float32(0.0)
            qo = cuda.local.array(R, uint32)
            for r in range(R):
                qo[r] = uint32(nrow[r]) * uint32(nwords)
            for c0 in range(0, nwords, NWC):
                cw = min(NWC, nwords - c0)
                # The previous chunk's reads of xs must be done before it is overwritten.
                cuda.syncthreads()
                stage_x(xs, x, nw, invs, t0, c0, cw, T, tid)
                # The staged chunk must be visible to every warp before the dot products.
                cuda.syncthreads()
                for wl in range(lane, cw, 32):
                    w = uint32(c0 + wl)
                    for r in range(R):
                        word = qw[qo[r] + w] if FLAT else qw[nrow[r], w]
                        decode(word, wv, float32(0.0))
                        for tt in range(TT):
                            p = float32(0.0)
                            for i in range(E):
                                p = cuda.fma(wv[i], xs[tt, i, wl], p)
                            acc[tt, r] = acc[tt, r] + p
            finish(out, acc, scratch, warp, lane, unit, t0, N, T, accumulate, ep)
            if TAIL:
                row_tail(ep, out, cuda.shared.array(1, int32), tid, warp, lane, scratch, part)

    _fast_cache[key] = kernel
    return kernel


#: Weight words in flight per lane of a one-row quantized launch (`pipe_for`; 0: off): the lane's
#: next steps' words come into shared memory by cp.async, its next steps' scales and zeros into
#: L1, while it decodes the current step (the first steps' before the norm prologue and the x
#: staging). Loads only: the order of the arithmetic is the plain kernel's.
PIPE_STAGES = 0


#: Static shared memory a block may use (bytes).
SMEM_LIMIT = 48 * 1024


def pipe_for(kind: str, T: int, cfg=None) -> int:
    """Stages of the weight-word pipeline of a launch (`_make_fast`'s `pipe`) with block
    configuration `cfg` = (TT, R, NW, KC): PIPE_STAGES for one-row (flat) launches of quantized
    weights, fewer where the ring and the staged x would not fit SMEM_LIMIT (0 below 2 stages),
    else 0."""
    if not (PIPE_STAGES and T == 1 and flat_for(T) and kind.startswith("q")):
        return 0
    S = PIPE_STAGES
    if cfg is not None:
        TT, R, NW, KC = cfg
        E = WORD_ELEMS[kind]
        fixed = 4 * TT * E * (KC // E + 1) + 4 * NW * 32 + 1024       # xs, scratch, the rest
        while S >= 2 and fixed + 8 * NW * S * R * 32 > SMEM_LIMIT:
            S -= 1
    return S if S >= 2 else 0


# ----------------------------------------------------------------------------- simple kernels
_simple_cache = {}


def _make_simple(quant, norm=False, epi=None):
    """Build the simple kernel (one warp per (t, n), or per (t, pair) with an epilogue) for
    quantized or float weights; `norm` compiles in the fused-RMSNorm prologue (every block has a
    single token row t)."""
    name = None if epi is None else epi.name
    key = (bool(quant), bool(norm), name)
    if key in _simple_cache:
        return _simple_cache[key]
    NORM = bool(norm)
    PAIR = epi is not None
    rows_of = epi.rows if PAIR else _no_rows
    pair_store = epi.store if PAIR else _no_store
    prologue = _make_norm_prologue(1, SIMPLE_WARPS)

    @cuda.jit(device=True)
    def setup(x, nw, eps, invs, part, scratch, tid, warp, lane):
        """(t, inv) of this block: the token row and, when NORM, its inverse RMS."""
        t = cuda.blockIdx.y
        inv = float32(1.0)
        if NORM:
            prologue(x, t, x.shape[0], eps, invs, part, scratch, tid, warp, lane)
            # invs[0] was written by thread 0.
            cuda.syncthreads()
            inv = invs[0]
        return t, inv

    @cuda.jit(device=True)
    def xval(x, nw, inv, t, k):
        if NORM:
            return (x[t, k] * inv) * nw[k]
        return x[t, k]

    if quant:
        @cuda.jit(device=True)
        def weight(w, scales, zeros, bits, group, n, k):
            """Element (n, k) of a packed qB matrix: (q - zero) * scale of its group."""
            per = 8 // bits
            b = int32(w[n, k // per])
            v = (b >> ((k % per) * bits)) & ((1 << bits) - 1)
            g = k // group
            return (float32(v) - float32(zeros[n, g])) * float32(scales[n, g])
    else:
        @cuda.jit(device=True)
        def weight(w, scales, zeros, bits, group, n, k):
            """Element (n, k) of an f32 / f16 matrix (scales, zeros, bits, group unused)."""
            return float32(w[n, k])

    @cuda.jit(device=True)
    def row_dot(x, nw, inv, t, w, scales, zeros, bits, group, n, lane, scratch, warp):
        """Row n of W times the (normed) row t of x: lane l takes k = l, l+32, ..., then the
        butterfly."""
        acc = float32(0.0)
        for k in range(lane, x.shape[1], 32):
            acc = cuda.fma(weight(w, scales, zeros, bits, group, n, k), xval(x, nw, inv, t, k), acc)
        return warp_sum(acc, scratch, warp, lane)

    @jit_kernel
    def kernel(out, x, nw, eps, w, scales, zeros, bits, group, accumulate, ep):
        grid_dep_wait()
        N = w.shape[0]
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        scratch = cuda.shared.array((SIMPLE_WARPS, 32), float32)
        invs = cuda.shared.array(1, float32)
        part = cuda.shared.array(NORM_NW, float32)
        t, inv = setup(x, nw, eps, invs, part, scratch, tid, warp, lane)
        unit = cuda.blockIdx.x * SIMPLE_WARPS + warp
        if PAIR:
            P = N // 2
            na, nb = rows_of(ep, min(unit, P - 1), N)
            va = row_dot(x, nw, inv, t, w, scales, zeros, bits, group, na, lane, scratch, warp)
            vb = row_dot(x, nw, inv, t, w, scales, zeros, bits, group, nb, lane, scratch, warp)
            if lane == 0 and unit < P and t < x.shape[0]:
                pair_store(ep, out, t, unit, va, vb, N)
        else:
            acc = row_dot(x, nw, inv, t, w, scales, zeros, bits, group, min(unit, N - 1), lane,
                          scratch, warp)
            if lane == 0 and unit < N and t < x.shape[0]:
                if accumulate:
                    acc = out[t, unit] + acc
                out[t, unit] = acc

    _simple_cache[key] = kernel
    return kernel


# ----------------------------------------------------------------------------- launcher
def weight_kind(w, K: int) -> str:
    """Storage kind ("f32", "f16", "q8", "q4", "q2") of weight array `w` for in_features K."""
    dt = np.dtype(w.dtype)
    if dt == np.float32:
        return "f32"
    if dt == np.float16:
        return "f16"
    if dt == np.uint8 and w.ndim == 2 and K > 0 and (w.shape[1] * 8) % K == 0:
        bits = w.shape[1] * 8 // K
        if bits in QBITS:
            return QBITS[bits]
    raise BackendError(
        f"matmul: cannot infer weight storage from dtype {dt.name} and shape {tuple(w.shape)} "
        f"for in_features={K} (expected float32/float16 (N, K) or uint8 (N, K*B/8), B in 8, 4, 2)")


def uses_fast_path(kind: str, K: int, group_size: int, w=None) -> bool:
    """True when `matmul` will use the fast (8-byte word) kernel for this weight."""
    E = WORD_ELEMS[kind]
    if K % E:
        return False
    if kind.startswith("q") and group_size % E:
        return False
    if w is not None and device_pointer(w) % 8:
        return False
    return True


def epilogue_args(op: str, epilogue, accumulate, out, T: int):
    """(N, ep): the weight rows a launch computes and the `ep` kernel argument, after checking a
    pair `epilogue` against the launch (an `Epilogue`, no accumulate, `out` as wide as it writes,
    its row count) or a row tail (a `RowTail`: one row, `out` as wide as its row, none of its
    arrays `out`); without one, N is out's width and ep the placeholder."""
    if epilogue is None:
        return out.shape[1], NO_EPILOGUE_ARGS
    if isinstance(epilogue, RowTail):
        if T != 1:
            raise BackendError(f"{op}: the {epilogue.name!r} row tail runs on one-row launches, "
                               f"got {T} rows")
        if out.shape[1] != epilogue.cols:
            raise BackendError(f"{op}: out has {out.shape[1]} columns; the {epilogue.name!r} "
                               f"row tail was made for rows of {epilogue.cols}")
        if any(a is out or device_pointer(a) == device_pointer(out) != 0 for a in epilogue.distinct):
            raise BackendError(f"{op}: the {epilogue.name!r} row tail's own row must not be out")
        return out.shape[1], epilogue.args
    if not isinstance(epilogue, Epilogue):
        raise BackendError(f"{op}: epilogue must be an Epilogue or a RowTail, got "
                           f"{type(epilogue).__name__}")
    if accumulate:
        raise BackendError(f"{op}: accumulate=True cannot be combined with the "
                           f"{epilogue.name!r} epilogue (it stores through the epilogue)")
    N = int(epilogue.n_rows)
    if out.shape[1] != epilogue.out_cols:
        raise BackendError(f"{op}: out has {out.shape[1]} columns; the {epilogue.name!r} "
                           f"epilogue writes {epilogue.out_cols}")
    if epilogue.t_rows >= 0 and T != epilogue.t_rows:
        raise BackendError(f"{op}: a launch of {T} rows with the {epilogue.name!r} epilogue "
                           f"made for {epilogue.t_rows} rows (its q_out / tree tables)")
    if N <= 0 or N % 2:
        raise BackendError(f"{op}: the {epilogue.name!r} epilogue needs an even, positive "
                           f"number of weight rows, got {N}")
    return N, epilogue.args


def norm_args(op: str, norm_w, eps, K: int):
    """The fused norm's checked eps (float32): `norm_w` float32 (K,) with a valid `eps`, or 0 when
    there is no norm (`norm_w` None)."""
    if norm_w is None:
        return np.float32(0.0)
    check_array(op, "norm_w", norm_w, np.float32, 1, (K,))
    return check_eps(op, eps)


def matmul(out, x, w, scales=None, zeros=None, accumulate=False, stream=0, norm_w=None, eps=0.0,
           epilogue=None):
    """``out[t, n] = sum_k x[t, k] * W[n, k]`` (``+=`` when accumulate), for t < T, n < N.

    The storage is inferred: float32 or float16 `w` of shape (N, K), or uint8 `w` of shape
    (N, K*B/8) with B in 8, 4, 2 together with `scales` float16 (N, G) and `zeros` uint8 (N, G),
    group_size = K / G. `out` must not alias `x`. Launches asynchronously on `stream`; T == 0 is a
    no-op.

    With `norm_w` (float32 (K,)) the product uses the RMS-normed rows instead of x:
    ``x[t] / sqrt(mean(x[t]^2) + eps) * norm_w`` (fused, see module doc); `eps` is a model
    constant (Python float).

    With `epilogue` (an `Epilogue`, e.g. `swiglu.glu_epilogue` or `rope.qkv_epilogue`) the rows
    are computed in the epilogue's pairs and stored through it: `out` is then (T,
    epilogue.out_cols), N = epilogue.n_rows and accumulate must be False (module doc). With a
    `RowTail` (`rmsnorm.rmsnorm_tail`, `norm_add.norm_add_tail`; T == 1, a weight the fast
    kernel takes: `uses_fast_path`) the launch's last block then runs the tail's op on out's row."""
    op = "matmul"
    check_array(op, "x", x, np.float32, 2)
    T, K = x.shape
    check_array(op, "out", out, np.float32, 2, (T, None))
    N, ep = epilogue_args(op, epilogue, accumulate, out, T)
    if K == 0 or N == 0:
        raise BackendError(f"{op}: empty dimension (in_features={K}, out_features={N})")
    if w is None:
        raise BackendError(f"{op}: w is required")
    kind = weight_kind(w, K)
    if kind in ("f32", "f16"):
        check_array(op, "w", w, w.dtype, 2, (N, K))
        if scales is not None or zeros is not None:
            raise BackendError(f"{op}: scales/zeros given for an unquantized {kind} weight")
        group = 0
    else:
        bits = QUANT_BITS[kind]
        check_array(op, "w", w, np.uint8, 2, (N, K * bits // 8))
        check_array(op, "scales", scales, np.float16, 2, (N, None))
        G = scales.shape[1]
        check_array(op, "zeros", zeros, np.uint8, 2, (N, G))
        if G == 0 or K % G:
            raise BackendError(f"{op}: in_features={K} is not a whole number of the {G} groups "
                               f"given by scales {tuple(scales.shape)}")
        group = K // G
    norm = norm_w is not None
    eps = norm_args(op, norm_w, eps, K)
    if device_pointer(out) == device_pointer(x) != 0:
        raise BackendError(f"{op}: out must not alias x")
    if T == 0:
        return
    acc_flag = 1 if accumulate else 0
    # Without a norm the kernel's norm_w parameter is unused: pass a view (no allocation).
    nw = norm_w if norm else x[0]
    pair = isinstance(epilogue, Epilogue)
    tail = isinstance(epilogue, RowTail)

    if tail and not uses_fast_path(kind, K, group, w):
        raise BackendError(f"{op}: the {epilogue.name!r} row tail needs the fast kernel "
                           f"({kind}, in_features={K}, group {group}: not served)")
    if uses_fast_path(kind, K, group, w):
        TT, R, NW, KC = config_for(kind, T, N, pair, K)
        flat = flat_for(T)
        grid = (cdiv(N // 2, NW * R // 2) if pair else cdiv(N, NW * R), cdiv(T, TT))
        kern = _make_fast(kind, TT, R, NW, KC, norm, epilogue, max_registers_for(T, N, K),
                          stage_batch_for(T, N, norm), group_shift_for(kind, group, pair), flat,
                          prefetch_for(kind, T, grid[0]), pipe_for(kind, T, (TT, R, NW, KC)))
        E = WORD_ELEMS[kind]
        nwords = K // E
        if N * nwords >= 1 << 32:
            raise BackendError(f"{op}: a weight of {N} x {nwords} 8-byte words is too large "
                               f"(the kernel addresses it with 32-bit offsets: below 2^32 words)")
        qw = w.view(np.uint64)
        if kind.startswith("q"):
            if flat:      # flat views, no copies
                qw, scales, zeros = qw.reshape(N * nwords), scales.reshape(N * G), zeros.reshape(N * G)
            kern[grid, NW * 32, stream](out, x, nw, eps, qw, scales, zeros, N, nwords, G, group // E,
                                        acc_flag, ep)
        else:
            if flat:
                qw = qw.reshape(N * nwords)
            kern[grid, NW * 32, stream](out, x, nw, eps, qw, N, nwords, acc_flag, ep)
        return

    grid = (cdiv(N // 2 if pair else N, SIMPLE_WARPS), T)
    if kind.startswith("q"):
        _make_simple(True, norm, epilogue)[grid, SIMPLE_WARPS * 32, stream](
            out, x, nw, eps, w, scales, zeros, QUANT_BITS[kind], group, acc_flag, ep)
    else:
        # float weights: the scales / zeros / bits / group parameters are unused; w stands in
        _make_simple(False, norm, epilogue)[grid, SIMPLE_WARPS * 32, stream](
            out, x, nw, eps, w, w, w, 0, 0, acc_flag, ep)


def ptx_signatures(epilogues=(), tails=()):
    """(name, python function, signature) triples the launcher compiles, for PTX compile tests;
    `epilogues` adds the pair variants of the norm-fused kernels for each given `Epilogue`,
    `tails` the one-row variants of the plain kernels for each given `RowTail`."""
    sigs = []
    f32_2 = "float32[:, ::1]"
    head = f"{f32_2}, {f32_2}, float32[::1], float32"      # out, x, norm_w, eps
    variants = ([(norm, None) for norm in (False, True)] + [(True, e) for e in epilogues]
                + [(False, t) for t in tails])
    for norm, epi in variants:
        pair = isinstance(epi, Epilogue)
        tag = ("_norm" if norm else "") + (f"_{epi.name}" if epi is not None else "")
        es = NO_EPILOGUE_SIG if epi is None else epi.sig
        for kind in WORD_ELEMS:
            # (T, N, K, prefetch, pipe): every one-row configuration, GEMV_CONFIG also with the
            # prefetch and (like GEMV_LONG_CONFIG) with the weight-word pipeline
            for T, n, kk, pf, pp in ((1, 0, 0, False, 0), (1, 0, 0, True, 0), (1, 0, 0, False, 2),
                                     (1, WIDE_N, 0, False, 0), (1, XWIDE_N, 0, False, 0),
                                     (1, WIDE_N, 2 * LONG_K, False, 0), (1, WIDE_N, 2 * LONG_K, False, 2),
                                     # many rows: each FEW_CONFIGS entry, and GEMM_CONFIG
                                     (2, 0, 0, False, 0), (FEW_SMALL_T + 1, 0, 0, False, 0),
                                     (2, FEW_N + 1, 0, False, 0), (FEW_T + 1, 0, 0, False, 0)):
                if (pf or pp) and not kind.startswith("q") or T > 1 and isinstance(epi, RowTail):
                    continue
                cfg = config_for(kind, T, n, pair, kk)
                # (group 128, the presets' group size, for the group-index shift)
                flat = flat_for(T)
                k = _make_fast(kind, *cfg, norm, epi, 0, stage_batch_for(T, n, norm),
                               group_shift_for(kind, 128, pair), flat, pf, pp)
                a = "[::1]" if flat else "[:, ::1]"
                if kind.startswith("q"):
                    sig = (f"void({head}, uint64{a}, float16{a}, uint8{a}, int64, int64, "
                           f"int64, int64, int64, {es})")
                else:
                    sig = f"void({head}, uint64{a}, int64, int64, int64, {es})"
                pft = ("_prefetch" if pf else "") + (f"_pipe{pp}" if pp else "")
                sigs.append((f"matmul_fast{tag}{pft}_{kind}_{'_'.join(map(str, cfg))}", k.py_func, sig))
        if isinstance(epi, RowTail):
            continue          # (the fast kernel only)
        sigs.append((f"matmul_simple{tag}_q", _make_simple(True, norm, epi).py_func,
                     f"void({head}, uint8[:, ::1], float16[:, ::1], uint8[:, ::1], int64, int64, int64, {es})"))
        for wt in ("float32", "float16"):
            sigs.append((f"matmul_simple{tag}_{wt}", _make_simple(False, norm, epi).py_func,
                         f"void({head}, {wt}[:, ::1], {wt}[:, ::1], {wt}[:, ::1], int64, int64, int64, {es})"))
    return sigs
