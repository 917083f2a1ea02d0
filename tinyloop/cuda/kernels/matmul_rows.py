"""The many-row quantized matmul (lockstep lanes, verify and tree rows): ``out[t, n] (+)= sum_k
x[t, k] * W[n, k]`` for 2 <= T rows, with exactly the fast kernel's sums (kernels/matmul.py).

Same storage and reduction order as `matmul`'s fast kernel, so row t of a launch is bit for bit
the one-row GEMV of row t: output (t, n) is one warp's; lane l visits the 8-byte words
w = l, l+32, ... in order, forms ``p = fma(w_{E-1}, x_{E-1}, ... fma(w_0, x_0, 0))`` per word
(``w_i = q_i - zero`` in place under the magic exponent, x carrying 2^-(bits*pos)) and
``acc = fma(scale, p, acc)``; the 32 lane sums are combined by the xor butterfly 16, 8, 4, 2, 1.

What differs is where the work goes, for many rows:

* **Staging once** (`stage`): x is written once per launch into a workspace buffer ``xw``, laid
  out (token group, word, element, TT) and already multiplied by each element's in-place factor
  (and, with a fused norm, normed in the rmsnorm kernel's order: ``((x * inv) * norm_w) * f``,
  the bits the fast kernel stages). The fast kernel instead stages x into shared memory in every
  block, TT rows at a time, with a barrier per chunk (and the norm prologue in every block).
* **Register blocking** (`rows kernel`): a warp owns R weight rows and TT token rows; for each
  word it loads the R words (with scales and zeros), then walks the E elements in order: TT x
  values (one 8-byte load per two tokens, contiguous per lane), each decoded weight element
  feeding TT fmas, each x value R rows. No shared memory, no barrier in the loop.
* **Transposed butterfly**: the R*TT lane sums are reduced together: at offset o (16, 8, 4, 2,
  1) each lane keeps half of its values and sends the other half, adding its partner's copy of
  the values it keeps. Every value meets the same partner at the same offset as in
  `_common.warp_sum`, own + partner (float addition is commutative), so each total has the
  butterfly's bits, in 31 shuffles for 32 values instead of 5 per value; lane l ends with
  value ``l >> (5 - log2(R*TT))`` and stores it.

Pair epilogues (`_common.Epilogue`) are supported as in the fast kernel: a warp's R rows are R/2
pairs; after the reduction the lane holding row 2j of a pair fetches row 2j+1's total (one xor
shuffle) and hands both to the epilogue's store.

Which launches use it is the launcher's rule (`matmul.rows_path`); this module only builds and
launches. Quantized storage only (q8, q4, q2); float weights keep the fast kernel.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, uint32

from ...errors import BackendError
from ...model.arch import QUANT_BITS
from ._cache import jit_kernel
from ._common import SIM, as_float, cdiv, check_array, shfl_xor
from ._pdl import grid_dep_wait
from .matmul import (NO_EPILOGUE_ARGS, NO_EPILOGUE_SIG, WORD_ELEMS, _MAGIC, _SH32, _TWO23, _U32_MASK,
                     _no_rows, _no_store, in_place_elems, in_place_pos)
from .rmsnorm import NT as NORM_NT
from .rmsnorm import row_inv_rms

#: (TT token rows, R weight rows per warp, NW warps per block). R * TT must be a power of two of
#: at most 32 (the transposed butterfly), TT even (x is loaded two tokens at a time).
ROWS_CONFIG = (8, 4, 4)
#: Fewer rows than TT: the token group shrinks to the rows (even, at least 2), R grows to keep
#: R * TT values per lane.
ROWS_SMALL = {2: (2, 8, 4), 4: (4, 4, 4)}


def rows_config(T: int, pair: bool = False):
    """(TT, R, NW) for a launch of T rows."""
    TT, R, NW = ROWS_SMALL.get(T, ROWS_CONFIG) if T < ROWS_CONFIG[0] else ROWS_CONFIG
    if T < TT:
        TT = max(2, 1 << (T - 1).bit_length())
    assert not pair or R % 2 == 0
    return TT, R, NW


def staged_floats(T: int, K: int) -> int:
    """Floats of the staging buffer a launch of T rows and K inputs needs."""
    TT = rows_config(T)[0]
    return cdiv(T, TT) * TT * K


# ----------------------------------------------------------------------------- staging
_stage_cache = {}


def _make_stage(kind, TT, norm):
    """The staging kernel: one block of the rmsnorm kernel's NT threads per padded token row t;
    ``xw[((t // TT * nwords + w) * E + i) * TT + t % TT] = x'[t, w * E + i] * 2^-(bits * pos(i))``
    with x' = x or, when `norm`, ``(x * inv) * norm_w`` (inv in rmsnorm's order); rows t >= T
    are zeros."""
    key = (kind, TT, bool(norm))
    if key in _stage_cache:
        return _stage_cache[key]
    NORM = bool(norm)
    E = WORD_ELEMS[kind]
    EM1 = E - 1
    LOG2E = E.bit_length() - 1
    EH = E // 2
    QB = QUANT_BITS[kind]
    QS = in_place_elems(kind)

    @jit_kernel
    def stage(xw, x, nw, eps, T):
        grid_dep_wait()
        t = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        K = x.shape[1]
        nwords = K >> LOG2E
        inv = float32(1.0)
        if NORM and t < T:
            # the block is the rmsnorm kernel's (NT threads): its inverse RMS, in its order
            inv = row_inv_rms(x, t, eps)
        base = uint32(t // TT) * uint32(nwords) * uint32(E * TT) + uint32(t % TT)
        for k in range(tid, K, NORM_NT):
            i = k & EM1
            v = float32(0.0)
            if t < T:
                f = as_float(uint32(127 - QB * ((i % EH) % QS)) << uint32(23))
                if NORM:
                    v = ((x[t, k] * inv) * nw[k]) * f
                else:
                    v = x[t, k] * f
            xw[base + uint32(k) * uint32(TT)] = v

    _stage_cache[key] = stage
    return stage


# ----------------------------------------------------------------------------- rows kernel
_rows_cache = {}


def _make_word(kind, TT, R):
    """Generated device function ``word(acc, xw, xo, qw, scales, zeros, qo, go, uw, g, magic)``:
    one word of the R rows (offsets qo, go) against TT staged tokens (8-byte index xo), folded
    into ``acc[r * TT + t]`` (straight-line source, so every index is a constant and acc stays
    in registers; forced inline into the kernel)."""
    bits = QUANT_BITS[kind]
    E = WORD_ELEMS[kind]
    EH = E // 2
    S = in_place_elems(kind)
    L = ["def word(acc, xw, xo, qw, scales, zeros, qo, go, uw, g, magic):"]
    a = L.append
    for r in range(R):
        a(f"    wd{r} = qw[qo[{r}] + uw]")
        a(f"    s{r} = float32(scales[go[{r}] + g])")
        a(f"    z{r} = float32(zeros[go[{r}] + g])")
    for r in range(R):
        for p in range(S):
            a(f"    c{r}_{p} = cuda.fma(z{r}, float32({float(2 ** (bits * p))!r}), _TWO23)")
        a(f"    h{r}_0 = uint32(wd{r} & _U32_MASK)")
        a(f"    h{r}_1 = uint32(wd{r} >> _SH32)")
        for j in range(1, -(-EH // S)):
            a(f"    h{r}_0s{j} = uint32(h{r}_0 >> uint32({bits * S * j}))")
            a(f"    h{r}_1s{j} = uint32(h{r}_1 >> uint32({bits * S * j}))")
        for t in range(TT):
            a(f"    p{r}_{t} = float32(0.0)")
    for i in range(E):
        half, e = divmod(i, EH)
        j, p = e // S, in_place_pos(kind, e)
        m = ((1 << bits) - 1) << (bits * p)
        for t2 in range(TT // 2):
            a(f"    xx = xw[xo + uint32({i * TT // 2 + t2})]")
            a(f"    x{2 * t2} = as_float(uint32(xx & _U32_MASK))")
            a(f"    x{2 * t2 + 1} = as_float(uint32(xx >> _SH32))")
        for r in range(R):
            src = f"h{r}_{half}" if j == 0 else f"h{r}_{half}s{j}"
            a(f"    wv = as_float(({src} & uint32({m})) | magic) - c{r}_{p}")
            for t in range(TT):
                a(f"    p{r}_{t} = cuda.fma(wv, x{t}, p{r}_{t})")
    for r in range(R):
        for t in range(TT):
            a(f"    acc[{r * TT + t}] = cuda.fma(s{r}, p{r}_{t}, acc[{r * TT + t}])")
    return _compile(L, "word")


def _make_fold(M):
    """Generated device function ``fold(acc, scratch, warp, lane)``: the transposed butterfly of
    the M lane sums acc[0:M] (module doc); lane l's return value is the total of value
    ``l >> (5 - log2 M)``."""
    L = ["def fold(acc, scratch, warp, lane):"]
    a = L.append
    vals = [f"acc[{v}]" for v in range(M)]
    left = M
    for step, o in enumerate((16, 8, 4, 2, 1)):
        if left > 1:
            h = left // 2
            a(f"    up = (lane & {o}) != 0")
            nxt = []
            for j in range(h):
                a(f"    sd = {vals[j]} if up else {vals[j + h]}")
                a(f"    kp = {vals[j + h]} if up else {vals[j]}")
                a(f"    b{step}_{j} = kp + shfl_xor(sd, {o}, scratch, warp, lane)")
                nxt.append(f"b{step}_{j}")
            vals, left = nxt, h
        else:
            a(f"    {vals[0]} = {vals[0]} + shfl_xor({vals[0]}, {o}, scratch, warp, lane)")
    a(f"    return {vals[0]}")
    return _compile(L, "fold")


def _compile(lines, name):
    ns = {"cuda": cuda, "float32": float32, "uint32": uint32, "as_float": as_float, "_TWO23": _TWO23,
          "_U32_MASK": _U32_MASK, "_SH32": _SH32, "shfl_xor": shfl_xor}
    exec("\n".join(line for line in lines if line), ns)
    # (the simulator's jit takes no forceinline)
    return cuda.jit(device=True, **({} if SIM else {"forceinline": True}))(ns[name])


_rows_cache = {}


def _make_rows(kind, TT, R, NW, gshift, epi=None):
    """The register-blocked kernel for one storage kind and (TT, R, NW) (module doc); `gshift` >= 0
    takes a word's group index as ``w >> gshift``, else ``w // gw``; `epi` compiles in a pair
    epilogue."""
    name = None if epi is None else epi.name
    key = (kind, TT, R, NW, int(gshift), name)
    if key in _rows_cache:
        return _rows_cache[key]
    PAIR = epi is not None
    M = R * TT
    assert TT % 2 == 0 and M & (M - 1) == 0 and M <= 32 and (not PAIR or R % 2 == 0), (TT, R, PAIR)
    RP = R // 2
    X2 = uint32(WORD_ELEMS[kind] * TT // 2)       # 8-byte x loads per word
    SHIFT = 5 - (M.bit_length() - 1)
    LOW = (1 << SHIFT) - 1
    PARTNER = TT << SHIFT
    GS = int(gshift)
    word = _make_word(kind, TT, R)
    fold = _make_fold(M)
    rows_of = epi.rows if PAIR else _no_rows
    store = epi.store if PAIR else _no_store

    @cuda.jit(device=True)
    def row_of(ep, unit, j, N):
        """Row j of the warp's R rows (clamped: rows past N repeat the last one, never stored), or
        in pair mode row j % 2 of pair unit * R/2 + j // 2."""
        if PAIR:
            na, nb = rows_of(ep, min(unit * RP + j // 2, N // 2 - 1), N)
            return na if j % 2 == 0 else nb
        return min(unit * R + j, N - 1)

    @jit_kernel
    def kernel(out, xw, qw, scales, zeros, N, nwords, G, gw, T, accumulate, ep):
        grid_dep_wait()
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        unit = cuda.blockIdx.x * NW + warp
        tg = cuda.blockIdx.y
        scratch = cuda.shared.array((NW, 32), float32)
        acc = cuda.local.array(M, float32)
        qo = cuda.local.array(R, uint32)
        go = cuda.local.array(R, uint32)
        for j in range(R):
            n = uint32(row_of(ep, unit, j, N))
            qo[j] = n * uint32(nwords)
            go[j] = n * uint32(G)
        for j in range(M):
            acc[j] = float32(0.0)
        # 0x4B000000 as a run-time value, so ptxas fuses mask and or into one LOP3 (matmul.py)
        magic = _MAGIC | uint32(cuda.blockIdx.z)
        ugw = uint32(gw)
        xbase = uint32(tg) * uint32(nwords) * X2
        for w in range(lane, nwords, 32):
            uw = uint32(w)
            g = (uw >> uint32(GS)) if GS >= 0 else uw // ugw
            word(acc, xw, xbase + uw * X2, qw, scales, zeros, qo, go, uw, g, magic)
        tot = fold(acc, scratch, warp, lane)
        v = lane >> SHIFT
        r = v // TT
        t = tg * TT + v % TT
        if PAIR:
            # the odd row of the pair: value v + TT, held by lane ^ (TT << SHIFT)
            other = shfl_xor(tot, PARTNER, scratch, warp, lane)
            pr = unit * RP + r // 2
            if (lane & LOW) == 0 and r % 2 == 0 and t < T and pr < N // 2:
                store(ep, out, t, pr, tot, other, N)
        else:
            n = unit * R + r
            if (lane & LOW) == 0 and t < T and n < N:
                if accumulate:
                    tot = out[t, n] + tot
                out[t, n] = tot

    _rows_cache[key] = kernel
    return kernel


def matmul_rows(out, x, qw, scales, zeros, kind, group, xw, accumulate=False, stream=0, norm_w=None,
                eps=0.0, epilogue=None):
    """Launch staging and the rows kernel for arguments `matmul.matmul` has checked (`kind` a
    quantized storage, `group` its group size, N from the epilogue or out); `xw` is a float32
    workspace buffer of at least `staged_floats(T, K)` elements."""
    T, K = x.shape
    pair = epilogue is not None
    N = int(epilogue.n_rows) if pair else out.shape[1]
    TT, R, NW = rows_config(T, pair)
    need = staged_floats(T, K)
    check_array("matmul", "xw", xw, np.float32, 1)
    if xw.shape[0] < need:
        raise BackendError(f"matmul: the staging buffer holds {xw.shape[0]} floats; {T} rows of "
                           f"{K} inputs need {need}")
    E = WORD_ELEMS[kind]
    nwords = K // E
    G = scales.shape[1]
    gw = group // E
    gshift = gw.bit_length() - 1 if gw & (gw - 1) == 0 else -1
    norm = norm_w is not None
    nw = norm_w if norm else x[0]
    ntg = cdiv(T, TT)
    xs = xw[:need]
    _make_stage(kind, TT, norm)[ntg * TT, NORM_NT, stream](xs, x, nw, np.float32(eps), T)
    kern = _make_rows(kind, TT, R, NW, gshift, epilogue)
    grid = (cdiv(N // 2, NW * R // 2) if pair else cdiv(N, NW * R), ntg)
    ep = epilogue.args if pair else NO_EPILOGUE_ARGS
    kern[grid, NW * 32, stream](out, xs.view(np.uint64), qw.view(np.uint64).reshape(N * nwords),
                                scales.reshape(N * G), zeros.reshape(N * G), N, nwords, G, gw, T,
                                1 if accumulate else 0, ep)


def ptx_signatures(epilogues=()):
    """(name, python function, signature) of the staging and rows kernels for PTX compile tests:
    q4 at every token-group size, plain and with each epilogue; q8 and q2 plain, full groups."""
    sigs = []
    f32_2 = "float32[:, ::1]"
    cases = [("q4", T, epi) for T in (2, 4, ROWS_CONFIG[0]) for epi in (None,) + tuple(epilogues)]
    cases += [(kind, ROWS_CONFIG[0], None) for kind in ("q8", "q2")]
    for kind, T, epi in cases:
        TT, R, NW = rows_config(T, epi is not None)
        if epi is None:
            for norm in (False, True):
                sigs.append((f"matmul_rows_stage{'_norm' if norm else ''}_{kind}_{TT}",
                             _make_stage(kind, TT, norm).py_func,
                             f"void(float32[::1], {f32_2}, float32[::1], float32, int64)"))
        k = _make_rows(kind, TT, R, NW, 3, epi)
        es = NO_EPILOGUE_SIG if epi is None else epi.sig
        tag = "" if epi is None else f"_{epi.name}"
        sigs.append((f"matmul_rows{tag}_{kind}_{TT}_{R}_{NW}", k.py_func,
                     f"void({f32_2}, uint64[::1], uint64[::1], float16[::1], uint8[::1], int64, "
                     f"int64, int64, int64, int64, int64, {es})"))
    return sigs


__all__ = ["ROWS_CONFIG", "rows_config", "staged_floats", "matmul_rows", "ptx_signatures", "SIM"]
