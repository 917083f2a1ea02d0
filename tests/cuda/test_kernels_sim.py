"""CUDA kernels against naive numpy references, plus batch-invariance checks (row t of a T-row
launch must be bit-identical to the same row launched alone).

Run under the CUDA simulator in its own process (the variable must be set before numba is
imported)::

    NUMBA_ENABLE_CUDASIM=1 python -m pytest -m cudasim tests/cuda -q

or on a real GPU with ``python -m pytest -m cudasim tests/cuda -q``. Shapes are tiny because the
simulator runs every CUDA thread as a Python thread; they are chosen to reach edge paths
(partial tiles, several chunks, both matmul kernels, GQA ratios, ties).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numba
import numpy as np
import pytest

pytestmark = pytest.mark.cudasim

from numba import cuda  # noqa: E402

if not numba.config.ENABLE_CUDASIM and not cuda.is_available():
    pytest.skip("needs NUMBA_ENABLE_CUDASIM=1 (set before numba is imported) or a CUDA GPU",
                allow_module_level=True)

from tinyloop.model.arch import QUANT_BITS  # noqa: E402
from tinyloop.errors import BackendError  # noqa: E402
from tinyloop.model.quant import unpack  # noqa: E402
from tinyloop.cuda import kv_codecs  # noqa: E402
from tinyloop.cuda.kernels import (accept, add, argmax, attention, cache_move, embed, kv_store, matmul,  # noqa: E402
                                   rmsnorm, rope, sample, swiglu, token_mask)
from tinyloop.plugins.caches.codecs import FP16Codec, FP32Codec, INT4Codec, INT8Codec  # noqa: E402
from tinyloop.plugins.decoders.spec_session import DraftTree  # noqa: E402


# =============================================================================== references
def pack_q(q, bits):
    """uint8 (N, K) values < 2**bits -> packed uint8 (N, K*bits/8), element k in byte k*bits//8
    at bit offset (k % (8/bits))*bits."""
    per = 8 // bits
    out = np.zeros((q.shape[0], q.shape[1] // per), np.uint8)
    for j in range(per):
        out |= (q[:, j::per].astype(np.uint8) << (j * bits)).astype(np.uint8)
    return out


def make_weight(rng, kind, N, K, group=0):
    """(device-ready arrays dict, dense float64 W) for one storage kind."""
    if kind == "f32":
        w = rng.standard_normal((N, K)).astype(np.float32)
        return {"w": w}, w.astype(np.float64)
    if kind == "f16":
        w = rng.standard_normal((N, K)).astype(np.float16)
        return {"w": w}, w.astype(np.float64)
    bits = QUANT_BITS[kind]
    G = K // group
    q = rng.integers(0, 2 ** bits, (N, K)).astype(np.uint8)
    s = (rng.random((N, G)) * 0.2 + 0.01).astype(np.float16)
    z = rng.integers(0, 2 ** bits, (N, G)).astype(np.uint8)
    W = (q.astype(np.float64) - np.repeat(z, group, 1)) * np.repeat(s.astype(np.float64), group, 1)
    return {"w": pack_q(q, bits), "scales": s, "zeros": z}, W


def ref_rmsnorm(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(axis=1, keepdims=True) + eps) * w


def model_inv_rms(row, eps):
    """The row kernels' inverse RMS, operation for operation (rmsnorm.py): thread i of 256 takes
    ``ss = fma(x, x, ss)`` over k = i, i + 256, ... ascending (`fma32`: the GPU's fma, or the
    simulator's); each warp's 32 partials go through
    the xor butterfly (offsets 16, 8, 4, 2, 1); the 8 warp totals are added in warp order;
    ``1 / sqrt(ss / D + eps)`` in float32."""
    D = row.shape[0]
    part = np.zeros(256, np.float32)
    for i in range(256):
        ss = np.float32(0.0)
        for k in range(i, D, 256):
            ss = fma32(row[k], row[k], ss)
        part[i] = ss
    totals = []
    for w in range(8):
        v = list(part[32 * w:32 * w + 32])
        for o in (16, 8, 4, 2, 1):
            v = [np.float32(v[i] + v[i + o]) for i in range(o)]
        totals.append(v[0])
    tot = totals[0]
    for v in totals[1:]:
        tot = np.float32(tot + v)
    return np.float32(np.float32(1.0) / np.sqrt(np.float32(tot / np.float32(D)) + np.float32(eps)))


def model_rmsnorm(x, w, eps):
    """rmsnorm's outputs bit for bit: ``(x * inv) * w`` in float32 with `model_inv_rms`."""
    out = np.empty_like(x)
    for t in range(x.shape[0]):
        out[t] = (x[t] * model_inv_rms(x[t], eps)) * w
    return out


def ref_rope(x, p0, inv_freq):
    """Half-split RoPE on (T, heads*hd) with float32 angles, like the kernel."""
    half = inv_freq.shape[0]
    hd = 2 * half
    T = x.shape[0]
    out = x.astype(np.float64).copy()
    for t in range(T):
        a = (np.float32(p0 + t) * inv_freq).astype(np.float32).astype(np.float64)
        c, s = np.cos(a), np.sin(a)
        for h in range(x.shape[1] // hd):
            x0 = x[t, h * hd:h * hd + half].astype(np.float64)
            x1 = x[t, h * hd + half:(h + 1) * hd].astype(np.float64)
            out[t, h * hd:h * hd + half] = x0 * c - x1 * s
            out[t, h * hd + half:(h + 1) * hd] = x1 * c + x0 * s
    return out


def ref_attention(q, kc, vc, layer, p0, H, Hk, hd, window=0):
    """Causal attention of rows at positions p0 + t over cache slots 0 .. p0 + t, or with
    window > 0 over positions max(0, p - window + 1) .. p of a ring (position j in slot j % S)."""
    T = q.shape[0]
    S = kc.shape[1]
    out = np.zeros((T, H * hd))
    g = H // Hk
    for t in range(T):
        p = p0 + t
        slots = [j % S for j in range(max(0, p - window + 1), p + 1)] if window else list(range(p + 1))
        for h in range(H):
            kv = h // g
            K = kc[layer, slots, kv, :].astype(np.float64)
            V = vc[layer, slots, kv, :].astype(np.float64)
            s = K @ q[t, h * hd:(h + 1) * hd].astype(np.float64) / math.sqrt(hd)
            e = np.exp(s - s.max())
            out[t, h * hd:(h + 1) * hd] = (e / e.sum()) @ V
    return out


def ref_swiglu(g, u):
    g = g.astype(np.float64)
    return g / (1.0 + np.exp(-g)) * u


def ref_argmax(row):
    ok = ~np.isnan(row)
    if not ok.any():
        return 0
    return int(np.flatnonzero(row == row[ok].max())[0])


def close(got, ref, rtol):
    """Max abs error within rtol of the reference's largest magnitude (and no NaN)."""
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape
    assert not np.isnan(got).any()
    scale = max(1.0, float(np.abs(ref).max()))
    err = float(np.abs(got - ref).max())
    assert err <= rtol * scale, f"max abs error {err:.3g} > {rtol:g} * {scale:.3g}"


D = cuda.to_device


def host(a):
    return a.copy_to_host()


# =============================================================================== matmul
MATMUL_CASES = [
    # kind, N, K, group, expected fast path
    ("q4", 13, 64, 16, True),
    ("q4", 7, 96, 48, True),      # 3 words per group: group index by division, not a shift
    ("q4", 9, 48, 8, False),      # group 8 < 16 elements per word: simple kernel
    ("q8", 12, 40, 8, True),
    ("q2", 10, 64, 32, True),
    ("q2", 6, 32, 16, False),     # group 16 < 32 elements per word: simple kernel
    ("f16", 11, 36, 0, True),
    ("f16", 5, 37, 0, False),     # odd K: simple kernel
    ("f32", 9, 34, 0, True),
    ("f32", 7, 33, 0, False),
]


@pytest.mark.parametrize("kind,N,K,group,fast", MATMUL_CASES)
def test_matmul_reference_and_batch_invariance(kind, N, K, group, fast):
    assert matmul.uses_fast_path(kind, K, group) == fast
    # T = 5: one full tile of 4 rows and a partial one; the last row alone (T == 1 uses the GEMV
    # configuration)
    _check_rows_alone(np.random.default_rng(N * 1000 + K), kind, N, K, group, 5, [4])


def _check_rows_alone(rng, kind, N, K, group, T, rows):
    """A T-row product against the float64 reference, and each of `rows` launched alone giving the
    same bits as in the T-row launch (batch invariance)."""
    arrays, W = make_weight(rng, kind, N, K, group)
    x = rng.standard_normal((T, K)).astype(np.float32)
    dev = {k: D(v) for k, v in arrays.items()}
    out = D(np.full((T, N), np.nan, np.float32))
    matmul.matmul(out, D(x), dev["w"], dev.get("scales"), dev.get("zeros"))
    got = host(out)
    close(got, x.astype(np.float64) @ W.T, 1e-5 * math.sqrt(K))
    for t in rows:
        o1 = D(np.full((1, N), np.nan, np.float32))
        matmul.matmul(o1, D(x[t:t + 1]), dev["w"], dev.get("scales"), dev.get("zeros"))
        assert np.array_equal(host(o1)[0], got[t])


def fma32(a, b, c):
    """`cuda.fma` on float32: rounded once (to nearest, ties to even) from the exact value on the
    GPU; the simulator's fma is a float32 multiply, then an add."""
    if numba.config.ENABLE_CUDASIM:
        return np.float32(np.float32(a) * np.float32(b)) + np.float32(c)
    v = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    r = np.float32(float(v))
    best = None
    for cand in (np.nextafter(r, np.float32(-np.inf)), r, np.nextafter(r, np.float32(np.inf))):
        d = abs(Fraction(float(cand)) - v)
        key = (d, int(cand.view(np.uint32)) & 1)          # nearer, then even mantissa
        if best is None or key < best[0]:
            best = (key, cand)
    return np.float32(best[1])


def emulate_fast_matmul(kind, x, arrays, group):
    """out[t, n] as the fast kernel defines it (module doc, 'Reduction order'): lane l of the warp
    visits words l, l+32, ...; per word p = fma chain over its elements of (q - zero) * x, then
    acc = fma(scale, p, acc) (floats: acc + p); the 32 lane sums by the xor butterfly."""
    E = matmul.WORD_ELEMS[kind]
    T, K = x.shape
    if kind in ("f32", "f16"):
        W = arrays["w"].astype(np.float32)
        S = np.ones((W.shape[0], 1), np.float32)
    else:
        q = unpack(arrays["w"], QUANT_BITS[kind], K).astype(np.float32)
        z = np.repeat(arrays["zeros"].astype(np.float32), group, 1)
        W = q - z                                           # exact: small integers
        S = arrays["scales"].astype(np.float32)
    N = W.shape[0]
    out = np.zeros((T, N), np.float32)
    for t in range(T):
        for n in range(N):
            lanes = []
            for lane in range(32):
                acc = np.float32(0.0)
                for w in range(lane, K // E, 32):
                    p = np.float32(0.0)
                    for i in range(E):
                        k = w * E + i
                        p = fma32(W[n, k], x[t, k], p)
                    if kind in ("f32", "f16"):
                        acc = np.float32(acc + p)
                    else:
                        acc = fma32(S[n, (w * E) // group], p, acc)
                lanes.append(acc)
            for off in (16, 8, 4, 2, 1):
                lanes = [np.float32(lanes[l] + lanes[l ^ off]) for l in range(32)]
            out[t, n] = lanes[0]
    return out


@pytest.mark.parametrize("kind,N,K,group,zmax", [
    ("q4", 3, 1056, 32, 16), ("q4", 2, 64, 16, 256), ("q8", 3, 40, 8, 256), ("q2", 2, 96, 32, 4),
    ("f16", 2, 36, 0, 0)])
def test_matmul_fast_kernel_bits_equal_its_defined_order(kind, N, K, group, zmax):
    """The fast kernel's outputs are EXACTLY the documented reduction over (q - zero) * x: the
    in-place decode (weights scaled by 2^(bits*p), staged x by 2^-(bits*p)) changes no bit. x
    spans many binades (above 2^-100), zeros up to 255, K = 1056 gives lanes 1 or 2 words (q4)."""
    assert matmul.uses_fast_path(kind, K, group)
    rng = np.random.default_rng(K + N)
    arrays, _ = make_weight(rng, kind, N, K, group)
    if zmax > 2 ** QUANT_BITS.get(kind, 0):
        arrays["zeros"] = rng.integers(0, zmax, arrays["zeros"].shape).astype(np.uint8)
    x = (rng.standard_normal((2, K)) * np.exp2(rng.integers(-60, 60, (2, K)))).astype(np.float32)
    dev = {k: D(v) for k, v in arrays.items()}
    for T in (1, 2):
        out = D(np.full((T, N), np.nan, np.float32))
        matmul.matmul(out, D(x[:T]), dev["w"], dev.get("scales"), dev.get("zeros"))
        want = emulate_fast_matmul(kind, x[:T], arrays, group)
        assert np.array_equal(host(out), want), (host(out) - want)


@pytest.mark.parametrize("xwide", [False, True])
@pytest.mark.parametrize("kind,N,K,group", [("q4", 21, 128, 32), ("q2", 10, 64, 32), ("f16", 11, 36, 0)])
def test_matmul_wide_gemv_config_is_batch_invariant(monkeypatch, kind, N, K, group, xwide):
    """The one-row launch of a wide weight (N >= WIDE_N, or N >= XWIDE_N with its register cap;
    lowered here so tiny shapes reach them) uses GEMV_WIDE_CONFIG / GEMV_XWIDE_CONFIG: still the
    same bits as the row inside a multi-row launch."""
    monkeypatch.setattr(matmul, "WIDE_N", 8)
    monkeypatch.setattr(matmul, "XWIDE_N", 8 if xwide else 1 << 30)
    want = matmul.GEMV_XWIDE_CONFIG if xwide else matmul.GEMV_WIDE_CONFIG
    assert matmul.config_for(kind, 1, N)[2:] == want[2:]
    assert (matmul.max_registers_for(1, N) > 0) == xwide and matmul.max_registers_for(2, N) == 0
    _check_rows_alone(np.random.default_rng(N + K), kind, N, K, group, 3, range(3))


@pytest.mark.parametrize("batch", [2, 8])
def test_matmul_batched_staging_is_batch_invariant(monkeypatch, batch):
    """A plain one-row GEMV stages x `stage_batch_for` elements per thread at a time (K = 1600:
    6.25 elements per thread, so whole and partial batches): the reference, and the same bits as
    the row inside a 2-row launch, whose staging loop is the plain one."""
    monkeypatch.setattr(matmul, "STAGE_BATCH", batch)
    assert matmul.stage_batch_for(1, 5, False) == batch
    assert matmul.stage_batch_for(1, 5, True) == matmul.stage_batch_for(2, 5, False) == 1
    _check_rows_alone(np.random.default_rng(batch), "q4", 5, 1600, 64, 2, range(2))


@pytest.mark.parametrize("kind,N,K,group", [("q4", 5, 1600, 32), ("q8", 4, 520, 8)])
def test_matmul_prefetching_gemv_is_batch_invariant(monkeypatch, kind, N, K, group):
    """A one-row launch with few blocks asks L2 for its rows first (a hint: a no-op under the
    simulator, the bits are checked on the GPU): the reference, and the same bits as the row
    inside a multi-row launch (never prefetching). The rule is shape-only."""
    cap = matmul.PREFETCH_BLOCKS
    assert matmul.prefetch_for(kind, 1, 1) and matmul.prefetch_for(kind, 1, cap)
    assert not matmul.prefetch_for(kind, 1, cap + 1)
    assert not matmul.prefetch_for(kind, 2, 1) and not matmul.prefetch_for("f16", 1, 1)
    # the launcher asks by its grid: GEMV_CONFIG's 16 rows a block, plain or in swiglu pairs
    asked = []

    class Stop(Exception):
        pass

    def spy(*args):
        asked.append(args[11])     # (kind, TT, R, NW, KC, norm, epi, regs, batch, shift, flat, prefetch, pipe)
        raise Stop
    monkeypatch.setattr(matmul, "_make_fast", spy)
    arrays, _ = make_weight(np.random.default_rng(0), "q4", 2 * cap * 16 + 2, 64, 32)
    dev = {k: D(v) for k, v in arrays.items()}
    x = D(np.zeros((1, 64), np.float32))
    for n, epi in ((cap * 16, None), (cap * 16 + 1, None), (cap * 16, True), (cap * 16 + 2, True)):
        w, sc, z = (dev[k][:n] for k in ("w", "scales", "zeros"))
        kw = {"epilogue": swiglu.glu_epilogue(n // 2)} if epi else {}
        with pytest.raises(Stop):
            matmul.matmul(D(np.zeros((1, n // 2 if epi else n), np.float32)), x, w, sc, z, **kw)
    assert asked == [True, False, True, False]
    monkeypatch.undo()
    _check_rows_alone(np.random.default_rng(N + K), kind, N, K, group, 3, range(3))


@pytest.mark.parametrize("kind,N,K,group", [("q4", 21, 1600, 32), ("q8", 10, 520, 8)])
def test_matmul_long_gemv_config_is_batch_invariant(monkeypatch, kind, N, K, group):
    """Wide one-row launches with K > LONG_K (lowered here) use GEMV_LONG_CONFIG, without the
    XWIDE register cap: the reference and the same bits as the row inside a multi-row launch."""
    monkeypatch.setattr(matmul, "WIDE_N", 8)
    monkeypatch.setattr(matmul, "XWIDE_N", 8)
    monkeypatch.setattr(matmul, "LONG_K", K - 1)
    assert matmul.config_for(kind, 1, N, False, K)[2:] == matmul.GEMV_LONG_CONFIG[2:]
    assert matmul.config_for(kind, 1, N, False, K - 1)[2:] == matmul.GEMV_XWIDE_CONFIG[2:]
    assert matmul.max_registers_for(1, N, K) == 0 and matmul.max_registers_for(1, N, K - 1) > 0
    _check_rows_alone(np.random.default_rng(N + K), kind, N, K, group, 3, range(3))


@pytest.mark.parametrize("stages,kind,N,K,group", [(2, "q4", 21, 4160, 32), (3, "q8", 10, 520, 8),
                                                    (4, "q2", 9, 2112, 64)])
def test_matmul_pipelined_gemv_is_batch_invariant(monkeypatch, stages, kind, N, K, group):
    """One-row launches with the weight-word pipeline (words through shared memory by cp.async,
    scales and zeros asked into L1; under the simulator the copy is immediate): the reference,
    the same bits as the row inside a multi-row launch (never pipelined), with x staged in two
    chunks (KC lowered), and with the fused norm and a pair epilogue (SwiGLU) too."""
    monkeypatch.setattr(matmul, "PIPE_STAGES", stages)
    monkeypatch.setattr(matmul, "GEMV_CONFIG", (1, 2, 4, 2048))
    assert matmul.pipe_for(kind, 1) == stages and matmul.pipe_for(kind, 2) == 0
    assert matmul.pipe_for("f16", 1) == 0
    # fewer stages where the ring and the staged x would not fit a block's shared memory
    assert matmul.pipe_for("q4", 1, (1, 2, 16, 6144)) == 2
    assert matmul.pipe_for("q4", 1, (1, 2, 8, 4096)) == stages
    _check_rows_alone(np.random.default_rng(N + K + stages), kind, N, K, group, 3, range(3))
    rng = np.random.default_rng(stages)
    arrays, _ = make_weight(rng, kind, 2 * N, K, group)
    dev = {k: D(v) for k, v in arrays.items()}
    x = rng.standard_normal((2, K)).astype(np.float32)
    nw = D((0.01 * rng.standard_normal(K)).astype(np.float32))    # small: silu's exp stays in range
    for epi in (None, swiglu.glu_epilogue(N)):
        cols = N if epi is not None else 2 * N
        both = D(np.full((2, cols), np.nan, np.float32))
        matmul.matmul(both, D(x), dev["w"], dev["scales"], dev["zeros"], norm_w=nw, eps=1e-5, epilogue=epi)
        one = D(np.full((1, cols), np.nan, np.float32))
        matmul.matmul(one, D(x[1:]), dev["w"], dev["scales"], dev["zeros"], norm_w=nw, eps=1e-5, epilogue=epi)
        assert np.array_equal(host(one)[0], host(both)[1])


@pytest.mark.parametrize("few", [(1, 1, 8, 4096), (1, 2, 8, 4096), (2, 4, 4, 1024)])
@pytest.mark.parametrize("kind,N,K,group", [("q4", 21, 1600, 32), ("f16", 11, 36, 0)])
def test_matmul_few_rows_config_is_batch_invariant(monkeypatch, few, kind, N, K, group):
    """Launches of 2 .. FEW_T rows of a small weight use FEW_CONFIGS, larger ones GEMM_CONFIG: every
    row of a FEW launch is the reference and the same bits as the row alone (one-row config) and
    inside a launch of more rows (GEMM_CONFIG)."""
    monkeypatch.setattr(matmul, "FEW_CONFIGS", dict.fromkeys(matmul.FEW_CONFIGS, few))
    monkeypatch.setattr(matmul, "FEW_T", 3)
    assert matmul.config_for(kind, 3, N, False, K)[::2] == few[::2]
    assert matmul.config_for(kind, 4, N, False, K)[::2] == matmul.GEMM_CONFIG[::2]
    monkeypatch.setattr(matmul, "FEW_NK", N * K - 1)
    assert matmul.config_for(kind, 3, N, False, K)[::2] == matmul.GEMM_CONFIG[::2]
    monkeypatch.setattr(matmul, "FEW_NK", N * K)
    rng = np.random.default_rng(N + K)
    _check_rows_alone(rng, kind, N, K, group, 3, range(3))
    arrays, _ = make_weight(np.random.default_rng(N + K), kind, N, K, group)
    dev = {k: D(v) for k, v in arrays.items()}
    x = np.random.default_rng(7).standard_normal((5, K)).astype(np.float32)
    outs = []
    for T in (3, 5):
        o = D(np.full((T, N), np.nan, np.float32))
        matmul.matmul(o, D(x[:T]), dev["w"], dev.get("scales"), dev.get("zeros"))
        outs.append(host(o))
    assert np.array_equal(outs[0], outs[1][:3])


def test_few_rows_rule():
    """The few-row table is keyed by (T <= FEW_SMALL_T, N <= FEW_N) inside 2 <= T <= FEW_T and
    N * K <= FEW_NK; everything else with T > 1 is GEMM_CONFIG."""
    f, cfg = matmul.FEW_CONFIGS, matmul.config_for
    n_small, n_big, k = matmul.FEW_N, matmul.FEW_N + 64, 384
    assert cfg("f16", 2, n_small, False, k) == f[(True, True)]
    assert cfg("f16", matmul.FEW_SMALL_T, n_big, False, k) == f[(True, False)]
    assert cfg("f16", matmul.FEW_SMALL_T + 1, n_small, False, k) == f[(False, True)]
    assert cfg("f16", matmul.FEW_T, n_big, False, k) == f[(False, False)] == matmul.GEMM_CONFIG
    assert cfg("f16", matmul.FEW_T + 1, n_small, False, k) == matmul.GEMM_CONFIG
    assert cfg("f16", 2, matmul.FEW_NK // 512 + 1, False, 512) == matmul.GEMM_CONFIG
    assert cfg("f16", 2, n_small, True, k)[1] % 2 == 0          # pairs: whole pairs per warp


def test_flat_addressing_rule(monkeypatch):
    """One-row launches address the weight as flat arrays, whatever its width; many-row launches
    use 2-D indexing. (The batch-invariance tests above compare the two addressings bit for bit: a
    row alone is flat, inside a multi-row launch 2-D, also for the wide configurations.)"""
    assert matmul.flat_for(1)
    assert not matmul.flat_for(2) and not matmul.flat_for(64)


def test_group_shift_rule():
    """The group index is a compiled-in shift for power-of-two words per group, without a pair
    epilogue, on quantized kinds; otherwise a division (-1)."""
    assert matmul.group_shift_for("q4", 128, False) == 3
    assert matmul.group_shift_for("q2", 32, False) == 0
    assert matmul.group_shift_for("q8", 128, False) == 4
    assert matmul.group_shift_for("q4", 48, False) == -1
    assert matmul.group_shift_for("q4", 128, True) == -1
    assert matmul.group_shift_for("f16", 0, False) == -1


def test_matmul_accumulate_and_chunks():
    """K spanning several staged chunks (T > 1: KC=1024 -> 2 chunks; T == 1: one chunk) with the
    residual add fused."""
    rng = np.random.default_rng(7)
    N, K, group = 5, 1536, 64
    arrays, W = make_weight(rng, "q4", N, K, group)
    dev = {k: D(v) for k, v in arrays.items()}
    T = 2
    x = rng.standard_normal((T, K)).astype(np.float32)
    base = rng.standard_normal((T, N)).astype(np.float32)
    out = D(base.copy())
    matmul.matmul(out, D(x), dev["w"], dev["scales"], dev["zeros"], accumulate=True)
    got = host(out)
    close(got, base + x.astype(np.float64) @ W.T, 1e-4)
    o1 = D(base[1:2].copy())
    matmul.matmul(o1, D(x[1:2]), dev["w"], dev["scales"], dev["zeros"], accumulate=True)
    assert np.array_equal(host(o1)[0], got[1])


def test_matmul_argument_errors():
    x = D(np.zeros((2, 16), np.float32))
    out = D(np.zeros((2, 4), np.float32))
    with pytest.raises(BackendError, match="device array"):
        matmul.matmul(out, np.zeros((2, 16), np.float32), D(np.zeros((4, 16), np.float32)))
    with pytest.raises(BackendError, match="shape"):
        matmul.matmul(out, x, D(np.zeros((5, 16), np.float32)))
    with pytest.raises(BackendError, match="infer"):
        matmul.matmul(out, x, D(np.zeros((4, 5), np.uint8)))
    with pytest.raises(BackendError, match="scales"):
        matmul.matmul(out, x, D(np.zeros((4, 8), np.uint8)))
    with pytest.raises(BackendError, match="dtype"):
        matmul.matmul(D(np.zeros((2, 4), np.float64)), x, D(np.zeros((4, 16), np.float32)))


# =============================================================================== fused-norm matmul
NORM_CASES = [
    # kind, N, K, group (all fast-path shapes; the simple kernel is forced by monkeypatching).
    # N <= 4: one simple-kernel block per row (the simulator's cost is per block).
    ("f32", 4, 34, 0),
    ("f16", 4, 36, 0),
    ("q8", 4, 40, 8),
    ("q4", 3, 320, 32),     # K > 256: several terms per rmsnorm partial; a warp past N
    ("q2", 4, 64, 32),
]


def norm_inputs(rng, T, K):
    # rows of different scales, so a wrong (shared or mis-ordered) inverse RMS shows
    x = (rng.standard_normal((T, K)) * (1.0 + np.arange(T)[:, None])).astype(np.float32)
    nw = (1.0 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    return x, nw


def run_norm(out_host, x, dev, nw, eps, accumulate=False):
    out = D(out_host.copy())
    matmul.matmul(out, D(x), dev["w"], dev.get("scales"), dev.get("zeros"), accumulate=accumulate,
                  norm_w=D(nw), eps=eps)
    return host(out)


def run_unfused(out_host, x, dev, nw, eps, accumulate=False):
    h = D(np.zeros(x.shape, np.float32))
    rmsnorm.rmsnorm(h, D(x), D(nw), eps)
    out = D(out_host.copy())
    matmul.matmul(out, h, dev["w"], dev.get("scales"), dev.get("zeros"), accumulate=accumulate)
    return host(out)


@pytest.mark.parametrize("path", ["fast", "simple"])
@pytest.mark.parametrize("kind,N,K,group", NORM_CASES)
def test_matmul_fused_norm_reference(kind, N, K, group, path, monkeypatch):
    """Each storage kind through both kernels against float64 rmsnorm + product. The prologue
    reproduces rmsnorm's summation order, so the result also equals rmsnorm followed by the plain
    matmul bit for bit. The fast kernel runs one row (GEMV configuration; the GEMM configuration
    is in the next test, the simulator is slow on it); the simple kernel two rows, plus batch
    invariance."""
    rng = np.random.default_rng(N * 100 + K)
    arrays, W = make_weight(rng, kind, N, K, group)
    assert matmul.uses_fast_path(kind, K, group)
    if path == "simple":
        monkeypatch.setattr(matmul, "uses_fast_path", lambda *a, **k: False)
    dev = {k: D(v) for k, v in arrays.items()}
    T, eps = (1 if path == "fast" else 2), 1e-5
    x, nw = norm_inputs(rng, T, K)
    blank = np.full((T, N), np.nan, np.float32)
    got = run_norm(blank, x, dev, nw, eps)
    close(got, ref_rmsnorm(x, nw, eps) @ W.T, 1e-5 * math.sqrt(K))
    assert np.array_equal(run_unfused(blank, x, dev, nw, eps), got)
    if T > 1:
        assert np.array_equal(run_norm(blank[:1], x[T - 1:], dev, nw, eps)[0], got[T - 1])


@pytest.mark.parametrize("kind,N,K,group,unfused", [
    ("q4", 5, 1536, 64, True),   # several staged chunks (KC = 1024 for T > 1)
    ("f32", 6, 34, 0, False),
])
def test_matmul_fused_norm_gemm_batch_invariance(kind, N, K, group, unfused):
    """Fast kernel, GEMM configuration (T > 1) with the residual add fused: reference, row t of
    the 2-row launch == the row alone (GEMV configuration), and == rmsnorm + matmul."""
    rng = np.random.default_rng(11)
    arrays, W = make_weight(rng, kind, N, K, group)
    dev = {k: D(v) for k, v in arrays.items()}
    T, eps = 2, 1e-6
    x, nw = norm_inputs(rng, T, K)
    base = rng.standard_normal((T, N)).astype(np.float32)
    got = run_norm(base, x, dev, nw, eps, accumulate=True)
    close(got, base + ref_rmsnorm(x, nw, eps) @ W.T, 1e-5 * math.sqrt(K))
    assert np.array_equal(run_norm(base[1:], x[1:], dev, nw, eps, accumulate=True)[0], got[1])
    if unfused:
        assert np.array_equal(run_unfused(base, x, dev, nw, eps, accumulate=True), got)


def test_matmul_fused_norm_argument_errors():
    x = D(np.zeros((2, 16), np.float32))
    out = D(np.zeros((2, 4), np.float32))
    w = D(np.zeros((4, 16), np.float32))
    with pytest.raises(BackendError, match="norm_w"):
        matmul.matmul(out, x, w, norm_w=D(np.ones(15, np.float32)), eps=1e-5)
    with pytest.raises(BackendError, match="norm_w"):
        matmul.matmul(out, x, w, norm_w=np.ones(16, np.float32), eps=1e-5)
    with pytest.raises(BackendError, match="eps"):
        matmul.matmul(out, x, w, norm_w=D(np.ones(16, np.float32)), eps=-1.0)


# =============================================================================== norm, add, swiglu
def test_rmsnorm():
    rng = np.random.default_rng(1)
    T, Dm = 3, 300
    x = rng.standard_normal((T, Dm)).astype(np.float32)
    w = rng.standard_normal(Dm).astype(np.float32)
    out = D(np.full((T, Dm), np.nan, np.float32))
    rmsnorm.rmsnorm(out, D(x), D(w), 1e-5)
    got = host(out)
    close(got, ref_rmsnorm(x, w, 1e-5), 1e-5)
    o1 = D(np.zeros((1, Dm), np.float32))
    rmsnorm.rmsnorm(o1, D(x[2:3]), D(w), 1e-5)
    assert np.array_equal(host(o1)[0], got[2])
    # In place.
    xd = D(x)
    rmsnorm.rmsnorm(xd, xd, D(w), 1e-5)
    assert np.array_equal(host(xd), got)


def check_row_norms_bits(Dm, T):
    """rmsnorm (out of place and in place) and norm_add of T random rows of Dm elements equal the
    operation-for-operation model of their order (`model_rmsnorm`), bit for bit."""
    from tinyloop.cuda.kernels import norm_add
    rng = np.random.default_rng(Dm)
    x = (rng.standard_normal((T, Dm)) * np.exp(rng.standard_normal((T, Dm)))).astype(np.float32)
    y = (3 * rng.standard_normal((T, Dm))).astype(np.float32)
    w = rng.standard_normal(Dm).astype(np.float32)
    want = model_rmsnorm(x, w, 1e-6)
    out = D(np.full((T, Dm), np.nan, np.float32))
    rmsnorm.rmsnorm(out, D(x), D(w), 1e-6)
    assert np.array_equal(host(out), want)
    xd = D(x)
    rmsnorm.rmsnorm(xd, xd, D(w), 1e-6)
    assert np.array_equal(host(xd), want)
    xd = D(x)
    norm_add.norm_add(xd, D(y), D(w), 1e-6)
    term = np.stack([(y[t] * model_inv_rms(y[t], 1e-6)) * w for t in range(T)])
    assert np.array_equal(host(xd), x + term)


@pytest.mark.parametrize("regs", [True, False])
@pytest.mark.parametrize("Dm", [300, 8192, 8500])
def test_row_norms_bits(Dm, regs, monkeypatch):
    """rmsnorm and norm_add equal the operation-for-operation model of their order, in both forms
    (the register form: one pass up to 8192 elements, chunks above; the loop form), in place as
    well."""
    monkeypatch.setattr(rmsnorm, "REGS_T", 128 if regs else 0)
    check_row_norms_bits(Dm, 1)


ROW_TAIL_CASES = [
    # kind, N (the row), K, group, long: GEMV_LONG_CONFIG's 16-warp blocks, TAIL_CHUNK, launches
    ("q4", 300, 128, 32, False, 1, 1),     # rows of more than 256: two chunks for some threads
    ("f16", 70, 36, 0, False, 8, 2),       # the counter cleared for the next launch
    ("q4", 40, 1600, 32, True, 8, 1),
]


@pytest.mark.parametrize("kind,N,K,group,long,chunk,reps", ROW_TAIL_CASES)
def test_matmul_row_tails_equal_matmul_then_norm(monkeypatch, kind, N, K, group, long, chunk, reps):
    """A one-row matmul with the rmsnorm row tail (accumulating, the sandwich block) leaves the
    bits of the matmul followed by rmsnorm in place, and with the norm_add row tail (the sublayer
    block) those of the matmul followed by norm_add, in blocks of 8 and of 16 warps, the tail's
    values requested 8 or 1 at a time (one or several chunks a thread); the arrival counter is
    zero after every launch, so the next launch (a graph replay) counts from zero."""
    from tinyloop.cuda.kernels import norm_add
    monkeypatch.setattr(rmsnorm, "TAIL_CHUNK", chunk)
    if long:
        monkeypatch.setattr(matmul, "WIDE_N", 8)
        monkeypatch.setattr(matmul, "XWIDE_N", 8)
        monkeypatch.setattr(matmul, "LONG_K", K - 1)
        assert matmul.config_for(kind, 1, N, False, K) == matmul.GEMV_LONG_CONFIG
    rng = np.random.default_rng(N + K + chunk)
    arrays, _ = make_weight(rng, kind, N, K, group)
    dev = {k: D(v) for k, v in arrays.items()}
    wa = (dev["w"], dev.get("scales"), dev.get("zeros"))
    src = D(rng.standard_normal((1, K)).astype(np.float32))
    x0 = (2 * rng.standard_normal((1, N))).astype(np.float32)
    nw = D(rng.standard_normal(N).astype(np.float32))
    counter = D(np.zeros(1, np.int32))
    for _ in range(reps):
        # sandwich: x = rmsnorm(x + W @ src) * nw
        want = D(x0)
        matmul.matmul(want, src, *wa, accumulate=True)
        rmsnorm.rmsnorm(want, want, nw, 1e-6)
        got = D(x0)
        matmul.matmul(got, src, *wa, accumulate=True, epilogue=rmsnorm.rmsnorm_tail(nw, 1e-6, counter))
        assert np.array_equal(host(got), host(want)) and host(counter)[0] == 0
        # sublayer: y = W @ src; x += rmsnorm(y) * nw
        yw, xw = D(np.zeros((1, N), np.float32)), D(x0)
        matmul.matmul(yw, src, *wa)
        norm_add.norm_add(xw, yw, nw, 1e-6)
        yg, xg = D(np.full((1, N), np.nan, np.float32)), D(x0)
        matmul.matmul(yg, src, *wa, epilogue=norm_add.norm_add_tail(xg, nw, 1e-6, counter))
        assert np.array_equal(host(yg), host(yw)) and np.array_equal(host(xg), host(xw))
        assert host(counter)[0] == 0


def test_row_tail_rule():
    """The backend's shape rule for row tails: rows a tail thread covers in one chunk."""
    assert rmsnorm.TAIL_ROW_MAX == rmsnorm.NT * rmsnorm.TAIL_CHUNK == 2048
    assert rmsnorm.tail_pays(1) and rmsnorm.tail_pays(2048)
    assert not rmsnorm.tail_pays(2049) and not rmsnorm.tail_pays(5280) and not rmsnorm.tail_pays(0)


def test_matmul_row_tail_argument_errors():
    """Row tails refuse many-row launches, rows of another width, the tail's own row as out,
    weights the fast kernel does not take, and bad tail arguments, before any launch."""
    from tinyloop.cuda.kernels import norm_add
    rng = np.random.default_rng(3)
    arrays, _ = make_weight(rng, "q4", 20, 64, 16)
    w, sc, z = (D(arrays[k]) for k in ("w", "scales", "zeros"))
    c = D(np.zeros(1, np.int32))
    nw = D(np.ones(20, np.float32))
    x2 = D(np.zeros((2, 64), np.float32))
    with pytest.raises(BackendError, match="one-row"):
        matmul.matmul(D(np.zeros((2, 20), np.float32)), x2, w, sc, z, epilogue=rmsnorm.rmsnorm_tail(nw, 1e-6, c))
    x1 = D(np.zeros((1, 64), np.float32))
    with pytest.raises(BackendError, match="rows of 21"):
        matmul.matmul(D(np.zeros((1, 20), np.float32)), x1, w, sc, z,
                      epilogue=rmsnorm.rmsnorm_tail(D(np.ones(21, np.float32)), 1e-6, c))
    out = D(np.zeros((1, 20), np.float32))
    with pytest.raises(BackendError, match="must not be out"):
        matmul.matmul(out, x1, w, sc, z, epilogue=norm_add.norm_add_tail(out, nw, 1e-6, c))
    a9, _ = make_weight(rng, "q4", 20, 48, 8)      # group 8: the simple kernel
    with pytest.raises(BackendError, match="fast kernel"):
        matmul.matmul(out, D(np.zeros((1, 48), np.float32)), D(a9["w"]), D(a9["scales"]), D(a9["zeros"]),
                      epilogue=rmsnorm.rmsnorm_tail(nw, 1e-6, c))
    with pytest.raises(BackendError, match="eps"):
        rmsnorm.rmsnorm_tail(nw, -1.0, c)
    with pytest.raises(BackendError, match="counter"):
        rmsnorm.rmsnorm_tail(nw, 1e-6, D(np.zeros(1, np.float32)))
    with pytest.raises(BackendError, match="w"):
        norm_add.norm_add_tail(out, D(np.ones(19, np.float32)), 1e-6, c)
    with pytest.raises(BackendError, match="x"):
        norm_add.norm_add_tail(D(np.zeros((2, 20), np.float32)), nw, 1e-6, c)
    assert host(c)[0] == 0


def test_norm_add():
    """x += rmsnorm(y) * w against float64, == rmsnorm into a scratch row then add (bit for
    bit), one row alone == the row in a launch of three."""
    from tinyloop.cuda.kernels import norm_add
    rng = np.random.default_rng(4)
    T, Dm = 3, 300
    x = rng.standard_normal((T, Dm)).astype(np.float32)
    y = (3 * rng.standard_normal((T, Dm))).astype(np.float32)
    w = rng.standard_normal(Dm).astype(np.float32)
    xd = D(x)
    norm_add.norm_add(xd, D(y), D(w), 1e-5)
    got = host(xd)
    close(got, x + ref_rmsnorm(y, w, 1e-5), 1e-5)
    h = D(np.zeros((T, Dm), np.float32))
    rmsnorm.rmsnorm(h, D(y), D(w), 1e-5)
    two = D(x)
    add.add(two, h)
    assert np.array_equal(host(two), got)
    x1 = D(x[1:2])
    norm_add.norm_add(x1, D(y[1:2]), D(w), 1e-5)
    assert np.array_equal(host(x1)[0], got[1])
    with pytest.raises(BackendError, match="shape"):
        norm_add.norm_add(xd, D(y[:2]), D(w), 1e-5)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # simulator exp(100)
def test_advance_position():
    from tinyloop.cuda.kernels import position
    pos = D(np.array([41], np.int32))
    position.advance_position(pos)
    position.advance_position(pos, 3)
    assert host(pos).tolist() == [45]
    rows = D(np.array([5, 0, 9, 7], np.int32))
    position.advance_rows(rows, 3)
    position.advance_rows(rows, 0)
    assert host(rows).tolist() == [6, 1, 10, 7]
    with pytest.raises(BackendError):
        position.advance_rows(rows, 5)


@pytest.mark.parametrize("k, agree", [(1, 0), (1, 1), (4, 0), (4, 2), (4, 4), (8, 8), (64, 63), (64, 64)])
def test_accept_equals_reference(k, agree):
    """The device acceptance of a greedy k-draft chain: the longest agreeing prefix n, the record,
    the next token toks[n] and position p + n + 1, as accept_reference (the host's rule); a chain
    moves no slot (every move column a self-move)."""
    rng = np.random.default_rng(k * 100 + agree)
    toks = rng.integers(0, 50, k + 3).astype(np.int32)
    ids = np.concatenate([[7], toks[:k], [1, 2]]).astype(np.int32)
    if agree < k:
        ids[1 + agree] = toks[agree] + 1                     # the first disagreement
    rows = ids.copy()
    rows[1 + agree + 1:] = rng.integers(0, 50, rows.shape[0] - agree - 2)   # later rows are arbitrary
    want_rec, want_tok, want_pos, want_moves = accept.accept_reference(rows, toks, 37, k)
    assert want_rec[0] == agree and want_moves == []
    tok, pos = D(np.array([-1], np.int32)), D(np.array([37], np.int32))
    rec = D(np.full(accept.record_size(k) + 2, -5, np.int32))
    moves = D(np.full((2, k + 1), -3, np.int32))
    accept.accept(D(rows), D(toks), tok, pos, rec, moves, k)
    got = host(rec)
    assert got[:accept.record_size(k)].tolist() == want_rec.tolist()
    assert got[accept.record_size(k):].tolist() == [-5, -5]           # nothing written past the record
    assert host(tok).tolist() == [want_tok] and host(pos).tolist() == [want_pos]
    assert host(moves)[:, :k].tolist() == [[37] * k, [37] * k] and host(moves)[:, k].tolist() == [-3, -3]


def _walk_tree(K, Dp, toks, path):
    """Node tokens of a K-ary tree of depth Dp whose greedy walk follows `path` (child ranks, one
    per level, then a miss): every child off the path gets a token the verify row does not want."""
    N = accept.tree_size(K, Dp)
    ids = (toks[:N] + 1 + np.arange(N)) % 1000 + 1000            # no child matches by default
    node = 0
    for rank in path:
        child = node * K + 1 + rank
        ids[child] = toks[node]
        for other in range(node * K + 1 + rank + 1, node * K + K + 1):
            ids[other] = toks[node]                              # a later sibling with the same token loses
        node = child
    return ids.astype(np.int32)


@pytest.mark.parametrize("K, Dp, path", [(2, 2, []), (2, 2, [0]), (2, 2, [1, 1]), (2, 2, [0, 1]),
                                         (3, 3, [2, 0, 1]), (3, 3, [1]), (2, 5, [1, 0, 1, 1, 0])])
def test_accept_tree_equals_reference(K, Dp, path):
    """A K-ary draft tree: the greedy walk (the first child holding the verify argmax), its length,
    the next token, the position, the record and the slot moves of the accepted nodes off their
    depth's slot (then self-moves), as accept_reference."""
    N = accept.tree_size(K, Dp)
    rng = np.random.default_rng(K * 10 + Dp + len(path))
    toks = rng.integers(0, 500, N).astype(np.int32)
    ids = _walk_tree(K, Dp, toks, path)
    want_rec, want_tok, want_pos, want_moves = accept.accept_reference(ids, toks, 20, Dp, K)
    assert want_rec[0] == len(path)
    tok, pos = D(np.array([-1], np.int32)), D(np.array([20], np.int32))
    rec = D(np.full(accept.record_size(Dp, K), -5, np.int32))
    moves = D(np.full((2, Dp), -3, np.int32))
    accept.accept(D(ids), D(toks), tok, pos, rec, moves, Dp, K)
    assert host(rec).tolist() == want_rec.tolist()
    assert host(tok).tolist() == [want_tok] and host(pos).tolist() == [want_pos]
    m = host(moves)
    assert [tuple(c) for c in m.T[:len(want_moves)].tolist()] == want_moves
    assert m[:, len(want_moves):].tolist() == [[20] * (Dp - len(want_moves))] * 2


def test_accept_refuses_bad_arguments():
    z = D(np.zeros(10, np.int32))
    one = D(np.zeros(1, np.int32))
    mv = D(np.zeros((2, 4), np.int32))
    with pytest.raises(BackendError, match="k=0"):
        accept.accept(z, z, one, one, z, mv, 0)
    with pytest.raises(BackendError, match="branches=0"):
        accept.accept(z, z, one, one, z, mv, 2, 0)
    with pytest.raises(BackendError, match="rec has 10 entries"):
        accept.accept(z, z, one, one, z, mv, 4)
    with pytest.raises(BackendError, match="toks"):
        accept.accept(z, D(np.zeros(2, np.int32)), one, one, D(np.zeros(12, np.int32)), mv, 4)
    with pytest.raises(BackendError, match="int32"):
        accept.accept(z, z, D(np.zeros(1, np.int64)), one, z, mv, 2)
    with pytest.raises(BackendError, match="device array"):
        accept.accept(z, z, one, np.zeros(1, np.int32), z, mv, 2)
    with pytest.raises(BackendError, match="moves has 1 columns"):
        accept.accept(z, z, one, one, z, D(np.zeros((2, 1), np.int32)), 2)
    with pytest.raises(BackendError, match="nodes, over"):
        accept.accept(z, z, one, one, z, mv, 12, 2)


@pytest.mark.parametrize("seed", [0, 2 ** 64 - 1])
def test_init_state_equals_scalar_definition(seed):
    """The random initial state kernel against the scalar host definition, element by element
    (tinyloop.model.init_state.state_element), causal rows and draft-tree rows."""
    from tinyloop.cuda.kernels import init_state
    from tinyloop.model.init_state import seed_key, state_element
    T, d, scale = 3, 5, 0.37
    key = seed_key(seed)
    x = D(np.full((T, d), np.nan, np.float32))
    init_state.init_state(x, D(np.array([6], np.int32)), seed, scale)
    want = [[state_element(key, p * d + i, scale) for i in range(d)] for p in (6, 7, 8)]
    assert np.array_equal(host(x), np.array(want, np.float32))
    depth, path = np.array([0, 1, 1], np.int32), np.array([[0, 0], [0, 1], [0, 2]], np.int32)
    init_state.init_state(x, D(np.array([2], np.int32)), seed, scale, depth=D(depth), path=D(path))
    want = [[state_element(key, p * d + i, scale) for i in range(d)] for p in (2, 3, 3)]
    assert np.array_equal(host(x), np.array(want, np.float32))
    for bad in (dict(seed=-1), dict(seed=2 ** 64), dict(seed=True), dict(scale=0.0), dict(scale=float("nan"))):
        args = {"seed": seed, "scale": scale, **bad}
        with pytest.raises(BackendError):
            init_state.init_state(x, D(np.array([0], np.int32)), args["seed"], args["scale"])


def test_add_and_swiglu():
    rng = np.random.default_rng(2)
    T, F = 3, 70
    a = rng.standard_normal((T, F)).astype(np.float32)
    b = rng.standard_normal((T, F)).astype(np.float32)
    ad = D(a)
    add.add(ad, D(b))
    assert np.array_equal(host(ad), a + b)
    g = (rng.standard_normal((T, F)) * 4).astype(np.float32)
    g[0, :3] = [-100.0, 100.0, 0.0]
    u = rng.standard_normal((T, F)).astype(np.float32)
    out = D(np.full((T, F), np.nan, np.float32))
    swiglu.swiglu(out, D(g), D(u))
    got = host(out)
    close(got, ref_swiglu(g, u), 1e-6)
    out2 = D(np.full((T, F), np.nan, np.float32))
    swiglu.swiglu_fused(out2, D(np.concatenate([g, u], axis=1)))
    assert np.array_equal(host(out2), got)
    with pytest.raises(BackendError, match="shape"):
        swiglu.swiglu_fused(out2, D(np.zeros((T, 2 * F + 1), np.float32)))


# =============================================================================== token mask
def ref_token_mask(row, words):
    """Naive reference: token i is allowed when bit i % 32 of words[i // 32] is set."""
    out = row.copy()
    for i in range(len(row)):
        if not (int(words[i // 32]) >> (i % 32)) & 1:
            out[i] = -np.inf
    return out


@pytest.mark.parametrize("V", [1, 31, 32, 33, 300])
def test_token_mask(V):
    """Forbidden tokens become -inf, allowed ones keep their bits (NaN, inf, -0.0 included), bit
    31 (the sign bit of an int32 word) included; extra words are ignored; too few words, or the
    wrong dtype, are a BackendError."""
    rng = np.random.default_rng(V)
    row = rng.standard_normal(V).astype(np.float32)
    row[:min(V, 3)] = [np.nan, np.inf, -0.0][:min(V, 3)]
    n = -(-V // 32)
    for words in (rng.integers(-2 ** 31, 2 ** 31, n + 1, dtype=np.int64).astype(np.int32),
                  np.full(n, -1, np.int32), np.zeros(n, np.int32),
                  np.full(n, np.int32(-2 ** 31), np.int32)):
        d = D(row)
        token_mask.mask_logits(d, D(words))
        assert np.array_equal(host(d).view(np.uint32), ref_token_mask(row, words).view(np.uint32))
    if V > 32:
        with pytest.raises(BackendError, match="fewer than the vocabulary"):
            token_mask.mask_logits(D(row), D(np.zeros(n - 1, np.int32)))
    with pytest.raises(BackendError, match="dtype"):
        token_mask.mask_logits(D(row), D(np.zeros(n, np.uint8)))


# =============================================================================== embed
@pytest.mark.parametrize("kind,group", [("f32", 0), ("f16", 0), ("q8", 8), ("q4", 16),
                                        ("q2", 8)])
def test_embed(kind, group):
    rng = np.random.default_rng(3)
    Vv, Dm = 11, 48
    arrays, W = make_weight(rng, kind, Vv, Dm, group)
    ids = np.array([3, 0, 10, 3], np.int32)
    out = D(np.full((4, Dm), np.nan, np.float32))
    embed.embed(out, D(ids), D(arrays["w"]),
                *(D(arrays[k]) for k in ("scales", "zeros") if k in arrays))
    got = host(out)
    # Dequantization is exact up to one float32 rounding of (q - z) * s.
    close(got, W[ids], 1e-6)
    assert np.array_equal(got[0], got[3])


# =============================================================================== matmul epilogues
EPI_CASES = [("q4", 64, 16, "fast"), ("q4", 48, 8, "simple"), ("f32", 34, 0, "fast")]


def _epi_weight(rng, kind, N, K, group):
    arrays, W = make_weight(rng, kind, N, K, group)
    return {k: D(v) for k, v in arrays.items()}, W


@pytest.mark.parametrize("kind,K,group,path", EPI_CASES)
def test_matmul_glu_epilogue_equals_matmul_then_swiglu(kind, K, group, path):
    """gate|up matmul with the SwiGLU epilogue (norm fused) == the matmul into (T, 2F) followed by
    swiglu_fused, bit for bit; rows alone == rows in the launch; close to float64."""
    rng = np.random.default_rng(K + 3)
    F, T, eps = 5, 3, 1e-5        # F odd: the last warp's second pair is past the end
    dev, W = _epi_weight(rng, kind, 2 * F, K, group)
    assert matmul.uses_fast_path(kind, K, group) == (path == "fast")
    x, nw = norm_inputs(rng, T, K)
    gu = D(np.zeros((T, 2 * F), np.float32))
    matmul.matmul(gu, D(x), dev["w"], dev.get("scales"), dev.get("zeros"), norm_w=D(nw), eps=eps)
    ref = D(np.zeros((T, F), np.float32))
    swiglu.swiglu_fused(ref, gu)
    out = D(np.full((T, F), np.nan, np.float32))
    matmul.matmul(out, D(x), dev["w"], dev.get("scales"), dev.get("zeros"), norm_w=D(nw), eps=eps,
                  epilogue=swiglu.glu_epilogue(F))
    got = host(out)
    assert np.array_equal(got, host(ref))
    h = ref_rmsnorm(x, nw, eps) @ W.T
    close(got, ref_swiglu(h[:, :F], h[:, F:]), 1e-4)
    o1 = D(np.full((1, F), np.nan, np.float32))
    matmul.matmul(o1, D(x[2:]), dev["w"], dev.get("scales"), dev.get("zeros"), norm_w=D(nw), eps=eps,
                  epilogue=swiglu.glu_epilogue(F))
    assert np.array_equal(host(o1)[0], got[2])


def _qkv_case(rng, kind, K, group, H, Hk, hd, T, cdt, S):
    N = (H + 2 * Hk) * hd
    dev, W = _epi_weight(rng, kind, N, K, group)
    x, nw = norm_inputs(rng, T, K)
    base_k = rng.standard_normal((2, S, Hk, hd)).astype(cdt)
    base_v = rng.standard_normal((2, S, Hk, hd)).astype(cdt)
    return dev, x, nw, base_k, base_v


@pytest.mark.parametrize("kind,K,group,path", EPI_CASES)
@pytest.mark.parametrize("cdt,tree", [(np.float16, False), (np.float32, True)])
def test_matmul_qkv_epilogue_equals_matmul_then_rope_kv_append(kind, K, group, path, cdt, tree):
    """q|k|v matmul with the RoPE + KV-append epilogue (norm fused) == the matmul into the (T, N)
    buffer followed by rope_kv_append_qkv: the same rotated q and the same cache contents, bit for
    bit, causal and over a draft tree's layout; a causal row alone == the row in the launch."""
    rng = np.random.default_rng(K + (7 if tree else 5))
    H, Hk, hd, p0, layer, eps = 2, 1, 8, 3, 1, 1e-5
    if tree:
        t, depth, path_t = _tree_tables(2, 1)      # 3 nodes: root and two children
        T = t.n_nodes
    else:
        T, depth, path_t = 3, None, None
    S = p0 + T + 2
    dev, x, nw, base_k, base_v = _qkv_case(rng, kind, K, group, H, Hk, hd, T, cdt, S)
    cs = D(rope.rope_table(hd, 10000.0, S + rope.POSITION_MARGIN))
    pos = D(np.array([p0], np.int32))
    args = (dev["w"], dev.get("scales"), dev.get("zeros"))
    qkv = D(np.zeros((T, (H + 2 * Hk) * hd), np.float32))
    matmul.matmul(qkv, D(x), *args, norm_w=D(nw), eps=eps)
    kc, vc = D(base_k), D(base_v)
    q_ref = D(np.zeros((T, H * hd), np.float32))
    rope.rope_kv_append_qkv(qkv, q_ref, kc, vc, layer, pos, cs, depth=depth, path=path_t)
    kc2, vc2 = D(base_k), D(base_v)
    q_out = D(np.full((T, H * hd), np.nan, np.float32))
    ep = rope.qkv_epilogue(q_out, kc2, vc2, layer, pos, cs, depth=depth, path=path_t)
    matmul.matmul(q_out, D(x), *args, norm_w=D(nw), eps=eps, epilogue=ep)
    assert np.array_equal(host(q_out), host(q_ref))
    assert np.array_equal(host(kc2), host(kc)) and np.array_equal(host(vc2), host(vc))
    if not tree:
        kc3, vc3 = D(base_k), D(base_v)
        q1 = D(np.full((1, H * hd), np.nan, np.float32))
        pos1 = D(np.array([p0 + 2], np.int32))
        matmul.matmul(q1, D(x[2:]), *args, norm_w=D(nw), eps=eps,
                      epilogue=rope.qkv_epilogue(q1, kc3, vc3, layer, pos1, cs))
        assert np.array_equal(host(q1)[0], host(q_out)[2])
        assert np.array_equal(host(kc3)[layer, p0 + 2], host(kc)[layer, p0 + 2])
        assert np.array_equal(host(vc3)[layer, p0 + 2], host(vc)[layer, p0 + 2])


def test_matmul_epilogue_argument_errors():
    rng = np.random.default_rng(2)
    dev, _ = _epi_weight(rng, "f32", 6, 16, 0)
    x = D(np.zeros((2, 16), np.float32))
    with pytest.raises(BackendError, match="accumulate"):
        matmul.matmul(D(np.zeros((2, 3), np.float32)), x, dev["w"], accumulate=True,
                      epilogue=swiglu.glu_epilogue(3))
    with pytest.raises(BackendError, match="out has 6 columns"):
        matmul.matmul(D(np.zeros((2, 6), np.float32)), x, dev["w"], epilogue=swiglu.glu_epilogue(3))
    with pytest.raises(BackendError, match="shape"):    # weight of 6 rows, epilogue for 8
        matmul.matmul(D(np.zeros((2, 4), np.float32)), x, dev["w"], epilogue=swiglu.glu_epilogue(4))
    with pytest.raises(BackendError, match="Epilogue"):
        matmul.matmul(D(np.zeros((2, 3), np.float32)), x, dev["w"], epilogue=("glu", 3))
    with pytest.raises(BackendError, match="F=0"):
        swiglu.glu_epilogue(0)
    cs = D(rope.rope_table(8, 10000.0, 4 + rope.POSITION_MARGIN))
    kc = D(np.zeros((1, 4, 1, 8), np.float16))
    with pytest.raises(BackendError, match="layer"):
        rope.qkv_epilogue(D(np.zeros((2, 16), np.float32)), kc, kc, 1, D(np.zeros(1, np.int32)), cs)
    with pytest.raises(BackendError, match="positions"):
        rope.qkv_epilogue(D(np.zeros((2, 16), np.float32)), kc, kc, 0, D(np.zeros(1, np.int32)),
                          D(rope.rope_table(8, 10000.0, 5)))
    # an epilogue made for 1 row (its q_out / tree tables) used in a 2-row launch
    q1 = D(np.zeros((1, 16), np.float32))
    ep = rope.qkv_epilogue(q1, kc, kc, 0, D(np.zeros(1, np.int32)), cs)
    wqkv = D(np.zeros((32, 16), np.float32))
    with pytest.raises(BackendError, match="made for 1 rows"):
        matmul.matmul(D(np.zeros((2, 16), np.float32)), x, wqkv, epilogue=ep)


# =============================================================================== rope
def test_rope_and_kv_append():
    rng = np.random.default_rng(4)
    T, H, Hk, hd, p0 = 3, 4, 2, 8, 5
    inv = rope.inv_freq(hd, 10000.0)
    cs = D(rope.rope_table(hd, 10000.0, 12 + rope.POSITION_MARGIN))
    q = rng.standard_normal((T, H * hd)).astype(np.float32)
    k = rng.standard_normal((T, Hk * hd)).astype(np.float32)
    v = rng.standard_normal((T, Hk * hd)).astype(np.float32)
    pos = D(np.array([p0], np.int32))
    qd, kd = D(q), D(k)
    rope.rope(qd, kd, pos, cs)
    gq, gk = host(qd), host(kd)
    close(gq, ref_rope(q, p0, inv), 1e-6)
    close(gk, ref_rope(k, p0, inv), 1e-6)
    # Batch invariance: row 2 alone at position p0 + 2.
    q1, k1 = D(q[2:3]), D(k[2:3])
    rope.rope(q1, k1, D(np.array([p0 + 2], np.int32)), cs)
    assert np.array_equal(host(q1)[0], gq[2]) and np.array_equal(host(k1)[0], gk[2])

    for cdt in (np.float16, np.float32):
        L, S = 3, 12
        kc = D(np.zeros((L, S, Hk, hd), cdt))
        vc = D(np.zeros((L, S, Hk, hd), cdt))
        qd, kd = D(q), D(k)
        rope.rope_kv_append(qd, kd, D(v), kc, vc, 1, pos, cs)
        assert np.array_equal(host(qd), gq) and np.array_equal(host(kd), gk)
        hk, hv = host(kc), host(vc)
        assert np.array_equal(hk[1, p0:p0 + T], gk.reshape(T, Hk, hd).astype(cdt))
        assert np.array_equal(hv[1, p0:p0 + T], v.reshape(T, Hk, hd).astype(cdt))
        hk[1, p0:p0 + T] = 0
        hv[1, p0:p0 + T] = 0
        assert not hk.any() and not hv.any()
    with pytest.raises(BackendError, match="layer"):
        rope.rope_kv_append(qd, kd, D(v), kc, vc, 3, pos, cs)


def test_rope_kv_append_qkv_matches_separate_buffers():
    rng = np.random.default_rng(9)
    T, H, Hk, hd, p0 = 3, 4, 2, 8, 2
    cs = D(rope.rope_table(hd, 10000.0, 8 + rope.POSITION_MARGIN))
    q = rng.standard_normal((T, H * hd)).astype(np.float32)
    k = rng.standard_normal((T, Hk * hd)).astype(np.float32)
    v = rng.standard_normal((T, Hk * hd)).astype(np.float32)
    pos = D(np.array([p0], np.int32))
    for cdt in (np.float16, np.float32):
        L, S = 2, 8
        kc, vc = D(np.zeros((L, S, Hk, hd), cdt)), D(np.zeros((L, S, Hk, hd), cdt))
        qd = D(q)
        rope.rope_kv_append(qd, D(k), D(v), kc, vc, 1, pos, cs)
        kc2, vc2 = D(np.zeros((L, S, Hk, hd), cdt)), D(np.zeros((L, S, Hk, hd), cdt))
        qkv = D(np.concatenate([q, k, v], axis=1))
        q_out = D(np.full((T, H * hd), np.nan, np.float32))
        rope.rope_kv_append_qkv(qkv, q_out, kc2, vc2, 1, pos, cs)
        assert np.array_equal(host(q_out), host(qd))
        assert np.array_equal(host(kc2), host(kc)) and np.array_equal(host(vc2), host(vc))
        # q and v columns of qkv are left as they were (k is rotated in place).
        hq = host(qkv)
        assert np.array_equal(hq[:, :H * hd], q) and np.array_equal(hq[:, (H + Hk) * hd:], v)
    with pytest.raises(BackendError, match="qkv"):
        rope.rope_kv_append_qkv(D(np.zeros((T, (H + Hk) * hd), np.float32)), q_out, kc2, vc2, 1,
                                pos, cs)
    with pytest.raises(BackendError, match="layer"):
        rope.rope_kv_append_qkv(qkv, q_out, kc2, vc2, 2, pos, cs)


@cuda.jit
def _old_formula_kernel(out, inv_freq):
    """The angle and cos/sin the rope kernels evaluated per thread before the table (float64
    math.cos/sin of the float32 angle, rounded): out[p, i] = (cos, sin)."""
    half = inv_freq.shape[0]
    for idx in range(cuda.grid(1), out.shape[0] * half, cuda.gridsize(1)):
        p = idx // half
        i = idx - p * half
        a = numba.float32(p) * inv_freq[i]
        out[p, i, 0] = numba.float32(math.cos(numba.float64(a)))
        out[p, i, 1] = numba.float32(math.sin(numba.float64(a)))


@cuda.jit
def _old_rope_kernel(x, pos, inv_freq):
    """The pre-table rope kernel's arithmetic on one (T, heads * hd) array, in place."""
    half = inv_freq.shape[0]
    hd = 2 * half
    heads = x.shape[1] // hd
    for idx in range(cuda.grid(1), x.shape[0] * heads * half, cuda.gridsize(1)):
        t = idx // (heads * half)
        r = idx - t * heads * half
        i = r % half
        col = (r // half) * hd + i
        a = numba.float32(pos[0] + t) * inv_freq[i]
        c = numba.float32(math.cos(numba.float64(a)))
        s = numba.float32(math.sin(numba.float64(a)))
        x0 = x[t, col]
        x1 = x[t, col + half]
        x[t, col] = x0 * c - x1 * s
        x[t, col + half] = x1 * c + x0 * s


def old_formula_table(hd, theta, P):
    """The old per-thread formula evaluated on the device for positions 0 .. P-1."""
    out = D(np.zeros((P, hd // 2, 2), np.float32))
    _old_formula_kernel[8, 64](out, D(rope.inv_freq(hd, theta)))
    return host(out)


@pytest.mark.parametrize("hd,theta,P", [(8, 10000.0, 300), (128, 500000.0, 40), (6, 1e6, 77)])
def test_rope_table_equals_old_formula(hd, theta, P):
    """rope_table holds, bit for bit, float32(cos/sin(float64(float32(p) * inv_freq[i]))): the
    numpy formula, the same formula on Python scalars, and the old kernels' device formula."""
    cs = rope.rope_table(hd, theta, P)
    assert cs.dtype == np.float32 and cs.shape == (P, hd // 2, 2)
    inv = rope.inv_freq(hd, theta)
    a = (np.arange(P, dtype=np.float32)[:, None] * inv[None, :]).astype(np.float32)
    assert np.array_equal(cs[:, :, 0], np.cos(a.astype(np.float64)).astype(np.float32))
    assert np.array_equal(cs[:, :, 1], np.sin(a.astype(np.float64)).astype(np.float32))
    for p in (0, 1, P // 2, P - 1):
        for i in range(hd // 2):
            ang = float(np.float32(p) * inv[i])
            assert cs[p, i, 0] == np.float32(math.cos(ang)) and cs[p, i, 1] == np.float32(math.sin(ang))
    assert np.array_equal(cs, old_formula_table(hd, theta, P))


def test_rope_table_gives_the_old_kernels_bits():
    """rope / rope_kv_append with the table write exactly the bits of the pre-table kernel."""
    rng = np.random.default_rng(21)
    T, H, Hk, hd, p0, theta = 5, 3, 1, 8, 37, 10000.0
    q = rng.standard_normal((T, H * hd)).astype(np.float32)
    k = rng.standard_normal((T, Hk * hd)).astype(np.float32)
    pos = D(np.array([p0], np.int32))
    inv = D(rope.inv_freq(hd, theta))
    want_q, want_k = D(q), D(k)
    _old_rope_kernel[4, 64](want_q, pos, inv)
    _old_rope_kernel[4, 64](want_k, pos, inv)
    want_q, want_k = host(want_q), host(want_k)
    S = p0 + T
    cs = D(rope.rope_table(hd, theta, S + rope.POSITION_MARGIN))
    qd, kd = D(q), D(k)
    rope.rope(qd, kd, pos, cs)
    assert np.array_equal(host(qd), want_q) and np.array_equal(host(kd), want_k)
    kc, vc = D(np.zeros((1, S, Hk, hd), np.float32)), D(np.zeros((1, S, Hk, hd), np.float32))
    qd, kd = D(q), D(k)
    rope.rope_kv_append(qd, kd, D(k), kc, vc, 0, pos, cs)
    assert np.array_equal(host(qd), want_q) and np.array_equal(host(kd), want_k)
    assert np.array_equal(host(kc)[0, p0:], want_k.reshape(T, Hk, hd))
    if numba.config.ENABLE_CUDASIM:
        # the simulator evaluates float32 expressions as written (no fma contraction), so the
        # rotation is the numpy float32 arithmetic of the old formula
        tab = rope.rope_table(hd, theta, S)[p0:, None, :, :]      # (T, 1, half, 2)
        c, sn = tab[..., 0], tab[..., 1]
        x = q.reshape(T, H, hd)
        x0, x1 = x[:, :, :hd // 2], x[:, :, hd // 2:]
        ref = np.concatenate([x0 * c - x1 * sn, x1 * c + x0 * sn], axis=2).reshape(T, H * hd)
        assert ref.dtype == np.float32 and np.array_equal(want_q, ref)


def test_rope_table_argument_errors():
    rng = np.random.default_rng(22)
    T, H, Hk, hd, S = 2, 2, 1, 4, 6
    q = D(rng.standard_normal((T, H * hd)).astype(np.float32))
    k = D(rng.standard_normal((T, Hk * hd)).astype(np.float32))
    v = D(rng.standard_normal((T, Hk * hd)).astype(np.float32))
    qkv = D(rng.standard_normal((T, (H + 2 * Hk) * hd)).astype(np.float32))
    q_out = D(np.zeros((T, H * hd), np.float32))
    kc, vc = D(np.zeros((1, S, Hk, hd), np.float32)), D(np.zeros((1, S, Hk, hd), np.float32))
    pos = D(np.array([0], np.int32))
    table = rope.rope_table(hd, 10000.0, S + rope.POSITION_MARGIN)
    rope.rope_kv_append(q, k, v, kc, vc, 0, pos, D(table))         # exactly large enough
    rope.rope_kv_append_qkv(qkv, q_out, kc, vc, 0, pos, D(table))
    short = D(table[:S + rope.POSITION_MARGIN - 1])
    with pytest.raises(BackendError, match=f"covers {S + rope.POSITION_MARGIN - 1} positions.*cache of {S} slots"):
        rope.rope_kv_append(q, k, v, kc, vc, 0, pos, short)
    with pytest.raises(BackendError, match="covers"):
        rope.rope_kv_append_qkv(qkv, q_out, kc, vc, 0, pos, short)
    with pytest.raises(BackendError, match=f"covers 1 positions.*{T} rows"):
        rope.rope(q, k, pos, D(table[:1]))
    bad = [(D(table.astype(np.float64)), "dtype float64"),                   # wrong dtype
           (D(np.ascontiguousarray(table[:, :, 0])), "3-D"),                  # cos only, 2-D
           (D(np.zeros((S + 65, hd // 2, 3), np.float32)), "shape"),          # not (cos, sin) pairs
           (D(rope.rope_table(2 * hd, 10000.0, S + 65)), "head_dim=8|k_cache has shape"),  # other hd
           (D(np.zeros((S + 65, 0, 2), np.float32)), "one pair"),
           (table, "device array")]                                          # host array
    for cs, msg in bad:
        for launch in (lambda: rope.rope(q, k, pos, cs),
                       lambda: rope.rope_kv_append(q, k, v, kc, vc, 0, pos, cs),
                       lambda: rope.rope_kv_append_qkv(qkv, q_out, kc, vc, 0, pos, cs)):
            with pytest.raises(BackendError, match=msg):
                launch()
    for n in (0, -1, 2.0, True):
        with pytest.raises(BackendError, match="n_positions"):
            rope.rope_table(hd, 10000.0, n)


# =============================================================================== attention
def att_ws(T, H, hd):
    """A split workspace for T rows of H heads: partials NaN-filled (every record read must have
    been written by the launch), counters zeroed once, as a caller allocates them."""
    return (D(np.full(attention.workspace_shape(T, H, hd), np.nan, np.float32)),
            D(np.zeros(attention.counter_shape(T, H), np.int32)))


CK, Z = attention.CK, attention.Z


@pytest.mark.parametrize("T,H,Hk,hd,p0,cdt", [
    (3, 4, 2, 8, 4, np.float32),           # GQA 2:1; rows shorter than a chunk (empty splits)
    (2, 2, 1, 6, CK * Z + 1, np.float16),  # MQA; Z + 1 chunks, the last partial: split 0 takes two
    (1, 2, 2, 4, 0, np.float32),           # MHA, a single slot
])
def test_attention(T, H, Hk, hd, p0, cdt):
    rng = np.random.default_rng(5)
    L, S, layer = 2, p0 + T + 2, 1
    kc = rng.standard_normal((L, S, Hk, hd)).astype(cdt)
    vc = rng.standard_normal((L, S, Hk, hd)).astype(cdt)
    q = rng.standard_normal((T, H * hd)).astype(np.float32)
    kd, vd = D(kc), D(vc)
    work, cnt = att_ws(T, H, hd)
    out = D(np.full((T, H * hd), np.nan, np.float32))
    attention.attention(out, D(q), kd, vd, layer, D(np.array([p0], np.int32)), work, cnt)
    got = host(out)
    close(got, ref_attention(q, kc, vc, layer, p0, H, Hk, hd), 1e-5)
    assert not host(cnt).any()                    # the last block of each (row, head) reset it
    # batch invariance: the last row alone, through a workspace of a different size
    t = T - 1
    w1, c1 = att_ws(1, H, hd)
    o1 = D(np.zeros((1, H * hd), np.float32))
    attention.attention(o1, D(q[t:t + 1]), kd, vd, layer, D(np.array([p0 + t], np.int32)), w1, c1)
    assert np.array_equal(host(o1)[0], got[t])


def test_attention_repeat_launch_reuses_workspace():
    """Two launches through the same workspace (as graph replays do) give the same bits: the
    counters the first launch counted up are back at zero for the second."""
    rng = np.random.default_rng(6)
    T, H, Hk, hd, p0 = 1, 1, 1, 4, CK * Z      # Z chunks + 1 key: split 0 takes two chunks
    kc = D(rng.standard_normal((1, p0 + T, Hk, hd)).astype(np.float32))
    vc = D(rng.standard_normal((1, p0 + T, Hk, hd)).astype(np.float32))
    q, pos = D(rng.standard_normal((T, H * hd)).astype(np.float32)), D(np.array([p0], np.int32))
    work, cnt = att_ws(T, H, hd)
    o1, o2 = (D(np.full((T, H * hd), np.nan, np.float32)) for _ in range(2))
    attention.attention(o1, q, kc, vc, 0, pos, work, cnt)
    attention.attention(o2, q, kc, vc, 0, pos, work, cnt)
    assert not np.isnan(host(o1)).any()
    assert np.array_equal(host(o1), host(o2))
    assert not host(cnt).any()


def test_attention_argument_errors():
    T, H, Hk, hd = 2, 2, 1, 4
    kc = D(np.zeros((1, 4, Hk, hd), np.float32))
    q, out, pos = D(np.zeros((T, H * hd), np.float32)), D(np.zeros((T, H * hd), np.float32)), D(np.zeros(1, np.int32))
    work, cnt = att_ws(T, H, hd)
    need_w, need_c = attention.workspace_shape(T, H, hd)[0], attention.counter_shape(T, H)[0]
    assert (need_w, need_c) == (T * H * Z * (hd + 2), T * H)
    with pytest.raises(BackendError, match=f"work has {need_w - 1} elements.*at least {need_w}"):
        attention.attention(out, q, kc, kc, 0, pos, work[:need_w - 1], cnt)
    with pytest.raises(BackendError, match=f"counter has {need_c - 1} elements.*at least {need_c}"):
        attention.attention(out, q, kc, kc, 0, pos, work, cnt[:need_c - 1])
    with pytest.raises(BackendError, match="work has dtype int32"):
        attention.attention(out, q, kc, kc, 0, pos, cnt, cnt)
    with pytest.raises(BackendError, match="counter has dtype float32"):
        attention.attention(out, q, kc, kc, 0, pos, work, work)
    with pytest.raises(BackendError, match="work must be a device array"):
        attention.attention(out, q, kc, kc, 0, pos, np.zeros(need_w, np.float32), cnt)
    with pytest.raises(BackendError, match="counter must be 1-D"):
        attention.attention(out, q, kc, kc, 0, pos, work, D(np.zeros((T, H), np.int32)))


def _tree_tables(K, depth):
    t = DraftTree(K, depth)
    return t, D(t.depth), D(t.path)


@pytest.mark.parametrize("cdt,p0,H,Hk", [(np.float32, 5, 4, 2), (np.float16, CK * Z + 1, 2, 1)])
def test_tree_rope_kv_append_and_attention(cdt, p0, H, Hk):
    """A tree launch equals, row by row and bit for bit, the causal launch of the row's own path
    (its ancestors' K/V laid out in consecutive slots after the context). The float16 case has a
    context of more than Z chunks, so the rows' keys span several splits (fewer heads: the
    simulator's cost grows with the chunks)."""
    rng = np.random.default_rng(11)
    hd, layer = 8, 1
    tree, dd, dp = _tree_tables(2, 2)             # 7 nodes: root, 2 children, 4 grandchildren
    N = tree.n_nodes
    inv = rope.inv_freq(hd, 10000.0)
    q = rng.standard_normal((N, H * hd)).astype(np.float32)
    k = rng.standard_normal((N, Hk * hd)).astype(np.float32)
    v = rng.standard_normal((N, Hk * hd)).astype(np.float32)
    L, S = 2, p0 + N + 1
    cs = D(rope.rope_table(hd, 10000.0, S + rope.POSITION_MARGIN))
    ctx_k = rng.standard_normal((L, S, Hk, hd)).astype(cdt)
    ctx_v = rng.standard_normal((L, S, Hk, hd)).astype(cdt)
    ctx_k[:, p0:] = 0
    ctx_v[:, p0:] = 0
    kc, vc = D(ctx_k), D(ctx_v)
    qd, kd = D(q), D(k)
    pos = D(np.array([p0], np.int32))
    rope.rope_kv_append(qd, kd, D(v), kc, vc, layer, pos, cs, depth=dd, path=dp)
    out = D(np.full((N, H * hd), np.nan, np.float32))
    work, cnt = att_ws(N, H, hd)
    attention.attention(out, qd, kc, vc, layer, pos, work, cnt, depth=dd, path=dp)
    got, hk, hv = host(out), host(kc), host(vc)
    gq = host(qd)
    for node in range(N):
        d = int(tree.depth[node])
        path = [int(x) for x in tree.path[node, :d + 1]]
        # RoPE at position p0 + depth; K/V in slot p0 + node
        close(gq[node:node + 1], ref_rope(q[node:node + 1], p0 + d, inv), 1e-6)
        assert np.array_equal(hv[layer, p0 + node], v[node].reshape(Hk, hd).astype(cdt))
        # the causal twin: context, then the path's K/V in consecutive slots
        ck, cv = ctx_k.copy(), ctx_v.copy()
        for i, n in enumerate(path):
            ck[layer, p0 + i] = hk[layer, p0 + n]
            cv[layer, p0 + i] = hv[layer, p0 + n]
        o1 = D(np.zeros((1, H * hd), np.float32))
        attention.attention(o1, D(gq[node:node + 1]), D(ck), D(cv), layer, D(np.array([p0 + d], np.int32)),
                            work, cnt)
        assert np.array_equal(host(o1)[0], got[node]), node
        close(got[node:node + 1], ref_attention(gq[node:node + 1], ck, cv, layer, p0 + d, H, Hk, hd), 1e-5)
    # a launch over one level (tables offset to its first node) gives the same rows
    o2 = D(np.zeros((4, H * hd), np.float32))
    attention.attention(o2, D(gq[3:7]), kc, vc, layer, pos, work, cnt, depth=dd[3:], path=dp[3:])
    assert np.array_equal(host(o2), got[3:7])


def test_move_slots_sequential():
    rng = np.random.default_rng(12)
    for cdt in (np.float16, np.float32):
        kc = rng.standard_normal((3, 10, 2, 4)).astype(cdt)
        vc = rng.standard_normal((3, 10, 2, 4)).astype(cdt)
        moves = [(7, 5), (5, 6), (9, 7)]         # move 2 reads slot 5 after move 1 wrote it
        want_k, want_v = kc.copy(), vc.copy()
        for s_, d_ in moves:
            want_k[:, d_] = want_k[:, s_]
            want_v[:, d_] = want_v[:, s_]
        buf = np.zeros((2, 6), np.int32)
        buf[:, :3] = np.array(moves, np.int32).T
        kd, vd = D(kc), D(vc)
        cache_move.move_slots(kd, vd, D(buf), 3)
        assert np.array_equal(host(kd), want_k) and np.array_equal(host(vd), want_v)
    with pytest.raises(BackendError, match="n_moves=7"):
        cache_move.move_slots(kd, vd, D(buf), 7)


# =============================================================================== argmax
def ref_topk(row, k):
    order = sorted((i for i in range(len(row)) if not np.isnan(row[i])), key=lambda i: (-row[i], i))
    return order[:k]


def test_topk():
    rng = np.random.default_rng(13)
    logits = rng.standard_normal((4, 300)).astype(np.float32)
    logits[1, [3, 40, 41, 200]] = 9.0                 # ties: lowest index first
    logits[2, :] = np.float32(1.5)                    # all equal
    logits[3, [0, 5]] = np.nan
    for K in (1, 3, 5):
        out = D(np.full((4, K), -1, np.int32))
        argmax.topk(out, D(logits))
        got = host(out).tolist()
        assert got == [ref_topk(r, K) for r in logits]
    with pytest.raises(BackendError, match="K=301"):
        argmax.topk(D(np.zeros((4, 301), np.int32)), D(logits))


def test_argmax_ties_nan_inf():
    rows = np.array([
        [1.0, 5.0, 5.0, -2.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        [np.nan, -1.0, np.nan, -1.0, -3.0, -5.0, -9.0, -1.0, -7.0, -8.0],
        [-np.inf] * 10,
        [np.nan] * 10,
    ], np.float32)
    big = np.random.default_rng(6).standard_normal((1, 10)).astype(np.float32)
    logits = np.concatenate([rows, big])
    out = D(np.full(5, -7, np.int32))
    argmax.argmax(out, D(logits))
    assert host(out).tolist() == [1, 1, 0, 0, ref_argmax(big[0])]
    wide = np.random.default_rng(8).standard_normal((2, 1000)).astype(np.float32)
    wide[1, 777] = wide[1, 900] = 50.0
    out = D(np.zeros(2, np.int32))
    argmax.argmax(out, D(wide))
    assert host(out).tolist() == [ref_argmax(wide[0]), 777]


def argmax_ws(T):
    sv, si, sc = argmax.work_shapes(T)
    return (D(np.full(sv, np.nan, np.float32)), D(np.full(si, -5, np.int32)), D(np.zeros(sc, np.int32)))


def test_split_argmax_equals_one_block():
    """The split argmax (SPLIT blocks per row, last-block merge) picks what the one-block kernel
    picks: ties to the lowest index across slice borders, NaN never, all -inf -> the first index,
    all NaN -> 0; repeated launches through one workspace (the counters return to zero)."""
    rng = np.random.default_rng(21)
    V = 1000                       # 4 slices of 250 under the simulator, 2 scan steps each
    rows = rng.standard_normal((6, V)).astype(np.float32)
    rows[1, [249, 250, 999]] = 7.0                   # tie across a slice border
    rows[2, :] = -np.inf
    rows[3, :] = np.nan
    rows[4, ::2] = np.nan
    rows[4, 501] = np.inf
    rows[5, :] = np.float32(2.5)                     # all equal
    work = argmax_ws(6)
    for rep in range(2):
        out = D(np.full(6, -7, np.int32))
        argmax.argmax(out, D(rows), work=work)
        assert host(out).tolist() == [ref_argmax(rows[0]), 249, 0, 0, 501, 0], rep
        assert not host(work[2]).any()
    one = D(np.full(6, -7, np.int32))
    argmax.argmax(one, D(rows))
    assert host(one).tolist() == host(out).tolist()
    # a row alone == the row in the 6-row launch; V smaller than the slices
    o1 = D(np.zeros(1, np.int32))
    argmax.argmax(o1, D(rows[1:2]), work=argmax_ws(1))
    assert host(o1).tolist() == [249]
    small = np.array([[0.5, 3.0, -1.0]], np.float32)
    argmax.argmax(o1, D(small), work=argmax_ws(1))
    assert host(o1).tolist() == [1]


def test_split_argmax_argument_errors():
    logits = D(np.zeros((3, 50), np.float32))
    out = D(np.zeros(3, np.int32))
    with pytest.raises(BackendError, match="cand_v has"):
        argmax.argmax(out, logits, work=argmax_ws(2))
    with pytest.raises(BackendError, match="work must be"):
        argmax.argmax(out, logits, work=argmax_ws(3)[:2])
    cv, ci, cnt = argmax_ws(3)
    with pytest.raises(BackendError, match="work must be"):
        argmax.argmax(out, logits, work=cv)
    with pytest.raises(BackendError, match="counter"):
        argmax.argmax(out, logits, work=(cv, ci, D(np.zeros(3, np.float32))))


# =============================================================================== sample
def sample_work():
    return tuple(D(np.zeros(n, np.int32)) for (n,) in sample.work_shapes())


def device_sample(logits, temp, top_k, top_p, utab, pos, T, base, work=None):
    """The device sampler's token for one row (fresh work arrays unless given)."""
    work = work or sample_work()
    out = D(np.full(1, -1, np.int32))
    sample.sample(out, D(np.asarray(logits, np.float32)), D(np.array([temp, top_p], np.float64)),
                  D(np.array([top_k, base], np.int32)), D(np.asarray(utab, np.float64)),
                  D(np.array([pos], np.int32)), T, work)
    return int(host(out)[0])


SAMPLE_CASES = [
    # temperature, top_k, top_p, V, logits kind
    (0.8, 50, 1.0, 300, "normal"),
    (1.3, 300, 1.0, 300, "normal"),      # top_k = V: every token a candidate
    (0.7, 5, 1.0, 300, "ties"),          # ties at the top and at the threshold
    (1.0, 40, 0.6, 300, "normal"),       # top-k then top-p
    (0.9, 12, 0.8, 300, "specials"),     # -inf, NaN, -0.0 / +0.0
    (1.0, 1, 1.0, 300, "normal"),        # top-k 1 = greedy on z
    (1.0, 3, 0.01, 300, "normal"),       # top-p small keeps one
    (0.6, 20, 0.95, 1500, "flat"),       # > CAP keys in the threshold bin: the exact select
    (1.1, 1024, 1.0, 1500, "normal"),    # KMAX candidates
    (0.9, 200, 0.9, 3000, "normal"),     # whole histogram chunks and eight-load gather rounds
]


def _sample_logits(kind, V, rng):
    logits = (rng.standard_normal(V) * 2).astype(np.float32)
    if kind == "ties":
        logits[[10, 20, 30, 40]] = logits.max() + 1.0       # four-way tie at the top
        logits[100:140] = np.float32(0.25)                   # a tie straddling the k-th place
    elif kind == "specials":
        # the largest logits are zeros of both signs (equal: ties by index), then -inf and NaN
        logits = (-np.abs(logits) - 0.5).astype(np.float32)
        logits[:12] = np.float32(-0.0)
        logits[80], logits[81] = np.float32(0.0), np.float32(-0.0)
        logits[[50, 60]] = -np.inf
        logits[70] = np.nan
    elif kind == "flat":
        logits[:] = np.float32(1.0)
        logits[::7] = np.float32(1.0 + 2 ** -20)            # same top-12-bit bin, distinct keys
    return logits


@pytest.mark.parametrize("temp,top_k,top_p,V,kind", SAMPLE_CASES)
def test_sample_equals_host_sampler(temp, top_k, top_p, V, kind):
    """The device draw is sample_token's for the uniform number at pos + T - base."""
    from tinyloop.runtime.sampling import sample_token
    rng = np.random.default_rng(V + top_k)
    logits = _sample_logits(kind, V, rng)
    host_logits = np.where(np.isnan(logits), -np.inf, logits).astype(np.float32)
    utab = rng.random(8)
    work = sample_work()
    for pos, T, base in ((9, 1, 7), (4, 3, 5), (0, 1, 1)):           # index 3, 2, 0
        idx = pos + T - base
        got = device_sample(logits, temp, top_k, top_p, utab, pos, T, base, work=work)
        # NaN ranks below -inf on the device as in numpy's sort; with fewer than k finite
        # logits the hosts' NaN arithmetic differs, so compare where NaN cannot be drawn
        want = sample_token(host_logits if kind == "specials" else logits, temp, top_k, top_p, utab[idx])
        assert got == want, (pos, T, base)
        # the launch left the histogram, its ticket and the gather's counters zero for the next one
        assert not host(work[0]).any() and host(work[1])[0] == 0 and not host(work[3]).any()


def test_sample_many_draws_follow_the_host():
    """Over many uniforms and rows, every device token equals the host sampler's."""
    from tinyloop.runtime.sampling import sample_token
    rng = np.random.default_rng(3)
    work = sample_work()
    for r in range(6):
        logits = (rng.standard_normal(400) * 3).astype(np.float32)
        utab = rng.random(5)
        for i in range(5):
            assert device_sample(logits, 0.9, 30, 0.9, utab, i, 1, 1, work=work) == \
                sample_token(logits, 0.9, 30, 0.9, utab[i]), (r, i)


_SORT_CAP = sample.CAP
_SORT_SCR = sample.SCR
_SORT_NT = sample.NT


@cuda.jit
def _sort_probe(vals, m):
    tid = cuda.threadIdx.x
    comp = cuda.shared.array(_SORT_CAP, numba.uint64)
    scr = cuda.shared.array(_SORT_SCR, numba.uint64)
    for j in range(tid, m, _SORT_NT):
        comp[j] = vals[j]
    cuda.syncthreads()
    sample._pad_sort(comp, m, scr, tid)
    for j in range(tid, m, _SORT_NT):
        vals[j] = comp[j]


@pytest.mark.parametrize("m", [1, 5, 63, 64, 65, 200, 513, sample.CAP])
def test_sample_sort_orders_candidates(m):
    """The pick kernel's sort (register stages by warp shuffles, the rest through shared memory)
    puts any m <= CAP keys in descending order: high bits set, duplicates, zeros included."""
    rng = np.random.default_rng(m)
    vals = rng.integers(0, 2 ** 63, m, dtype=np.uint64) * np.uint64(2) + rng.integers(0, 2, m).astype(np.uint64)
    vals[rng.integers(0, m, max(1, m // 8))] = vals[0]          # duplicates
    vals[rng.integers(0, m, max(1, m // 16))] = np.uint64(0)    # zeros, as the padding
    d = D(vals)
    _sort_probe[1, _SORT_NT](d, m)
    np.testing.assert_array_equal(host(d), np.sort(vals)[::-1])


def test_sample_launcher_rejects_bad_arguments():
    logits = D(np.zeros(16, np.float32))
    good = dict(out=D(np.zeros(1, np.int32)), logits=logits, params=D(np.array([1.0, 1.0])),
                iparams=D(np.array([4, 0], np.int32)), utab=D(np.zeros(3)), pos=D(np.zeros(1, np.int32)),
                T=1, work=sample_work())
    for key, bad, match in (("params", D(np.ones(2, np.float32)), "params has dtype"),
                            ("iparams", D(np.zeros(3, np.int32)), "iparams has shape"),
                            ("utab", D(np.zeros(0)), "no uniform"),
                            ("T", 0, "T=0"), ("T", True, "T=True"),
                            ("work", (1, 2), "work must be"),
                            ("logits", D(np.zeros(0, np.float32)), "empty vocabulary"),
                            ("out", np.zeros(1, np.int32), "device array")):
        with pytest.raises(BackendError, match=match):
            sample.sample(**{**good, key: bad})


# =============================================================================== KV codecs and rings
#: codec name -> (the format's numpy reference, the CUDA implementation)
CODECS = {"fp32": (FP32Codec, kv_codecs.FP32), "fp16": (FP16Codec, kv_codecs.FP16),
          "int8": (INT8Codec, kv_codecs.INT8), "int4": (INT4Codec, kv_codecs.INT4)}


def encoded_cache(codec, x):
    """Device Rows holding float32 rows x (L, S, Hkv, hd) as `codec` stores them, and the float32
    rows the attention kernel must read back (codec.decode)."""
    data, scale, zero = codec.encode(x)
    rows = kv_codecs.Rows(D(data), None if scale is None else D(scale), None if zero is None else D(zero))
    return rows, codec.decode(data, scale, zero)


def empty_rows(codec, L, S, Hk, hd):
    return kv_codecs.Rows(D(np.zeros((L, S, Hk, codec.data_cols(hd)), codec.data_dtype)),
                          D(np.zeros((L, S, Hk), np.float32)) if codec.has_scale else None,
                          D(np.zeros((L, S, Hk), np.float32)) if codec.has_zero else None)


def host_rows(rows):
    return tuple(None if a is None else host(a) for a in rows)


def store_inputs(rng, name, T, Hk, hd):
    """float32 rows (T, Hk, hd) over many binades, with the special rows of the codecs: an
    all-zero row, a constant row and a row whose scaled values are exact halves (rint ties to
    even: the step is exactly 1 there)."""
    x = (rng.standard_normal((T, Hk, hd)) * np.exp2(rng.integers(-8, 8, (T, Hk, 1)))).astype(np.float32)
    x[1, 0] = 0.0
    x[1, Hk - 1, :] = np.float32(0.75) if Hk > 1 else x[1, Hk - 1]
    tie = np.resize(np.array([2.5, -3.5, 0.5, -0.5, 1.5, 6.5], np.float32), hd)
    if name == "int8":
        tie[0] = 127.0                        # amax 127: inv = 1
    else:
        tie = np.abs(tie)
        tie[0], tie[1] = 0.0, 15.0            # range 15 from 0: inv = 1
    x[2, 0] = tie
    return x


def _store_layout(layout, T_default=3):
    """(T, p0, window, depth, path, slots) of the three placements kv_store supports (S = 8)."""
    if layout == "linear":
        return T_default, 2, 0, None, None, [2, 3, 4]
    if layout == "ring":                      # positions 14, 15, 16 in a ring of 8: slots 6, 7, 0
        return T_default, 14, 5, None, None, [6, 7, 0]
    tree, dd, dp = _tree_tables(2, 1)         # root and two children at positions 3, 4, 4
    return tree.n_nodes, 3, 0, dd, dp, [3 + int(tree.path[t, tree.depth[t]]) for t in range(tree.n_nodes)]


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("layout", ["linear", "ring", "tree"])
def test_kv_store_equals_codec_encode(name, layout):
    """kv_store writes exactly codec.encode's codes, scales and zero points at the rows' slots
    (linear, ring p % S, tree path), K and V, and nothing else; hd = 68 gives lanes 0 and 1 a
    second dim pair."""
    codec, impl = CODECS[name]
    rng = np.random.default_rng(31)
    L, S, Hk, hd, layer = 2, 8, 2, 68, 1
    T, p0, window, depth, path, slots = _store_layout(layout)
    k = store_inputs(rng, name, T, Hk, hd)
    v = store_inputs(rng, name, T, Hk, hd)[::-1].copy()     # the special rows in other places
    kr, vr = empty_rows(codec, L, S, Hk, hd), empty_rows(codec, L, S, Hk, hd)
    kv_store.kv_store(D(k.reshape(T, Hk * hd)), D(v.reshape(T, Hk * hd)), kr, vr, layer,
                      D(np.array([p0], np.int32)), impl, depth=depth, path=path, window=window)
    for x, rows in ((k, kr), (v, vr)):
        data, scale, zero = codec.encode(x)
        got = host_rows(rows)
        want = host_rows(empty_rows(codec, L, S, Hk, hd))
        for t, sl in enumerate(slots):
            want[0][layer, sl] = data[t]
            want[1][layer, sl] = scale[t]
            if codec.has_zero:
                want[2][layer, sl] = zero[t]
        assert np.array_equal(got[0], want[0])
        assert np.array_equal(got[1].view(np.uint32), want[1].view(np.uint32))
        if codec.has_zero:
            assert np.array_equal(got[2], want[2])
        else:
            assert rows.zero is None
        # the special rows read back exactly (zero and constant rows) or within half a step
        back = codec.decode(got[0][layer, slots], got[1][layer, slots],
                            None if got[2] is None else got[2][layer, slots])
        assert np.array_equal(back[1, 0], x[1, 0])
        step = got[1][layer, slots][..., None].astype(np.float64)
        assert np.all(np.abs(back - x) <= 0.5 * step * (1 + 1e-5) + 4e-7 * np.abs(x).max())


def test_kv_store_row_alone_equals_row_in_launch():
    """A row's codes depend only on its own values: row 2 stored alone == row 2 of the 3-row
    launch (batch invariance of the store)."""
    codec, impl = CODECS["int4"]
    rng = np.random.default_rng(32)
    L, S, Hk, hd = 1, 8, 1, 8
    x = store_inputs(rng, "int4", 3, Hk, hd).reshape(3, Hk * hd)
    a, b = empty_rows(codec, L, S, Hk, hd), empty_rows(codec, L, S, Hk, hd)
    kv_store.kv_store(D(x), D(x), a, a, 0, D(np.array([0], np.int32)), impl)
    kv_store.kv_store(D(x[2:]), D(x[2:]), b, b, 0, D(np.array([2], np.int32)), impl)
    for ga, gb in zip(host_rows(a), host_rows(b)):
        assert np.array_equal(ga[0, 2], gb[0, 2])


@pytest.mark.parametrize("name", ["fp32", "fp16", "int8", "int4"])
def test_attention_over_codec_cache(name):
    """Attention over each codec's storage against the naive attention over the decoded rows
    (codec.decode); Z + 1 chunks, so one split takes two; the last row alone gives the row's bits;
    the codec inferred from the data dtype is the same kernel."""
    codec, impl = CODECS[name]
    rng = np.random.default_rng(33)
    T, H, Hk, hd, p0 = 2, 2, 1, 8, CK * Z + 1
    L, S, layer = 2, p0 + T + 1, 1
    kr, K = encoded_cache(codec, rng.standard_normal((L, S, Hk, hd)).astype(np.float32))
    vr, V = encoded_cache(codec, rng.standard_normal((L, S, Hk, hd)).astype(np.float32))
    q = rng.standard_normal((T, H * hd)).astype(np.float32)
    work, cnt = att_ws(T, H, hd)
    out = D(np.full((T, H * hd), np.nan, np.float32))
    attention.attention(out, D(q), kr, vr, layer, D(np.array([p0], np.int32)), work, cnt, codec=impl)
    got = host(out)
    close(got, ref_attention(q, K, V, layer, p0, H, Hk, hd), 1e-5)
    o1 = D(np.zeros((1, H * hd), np.float32))
    attention.attention(o1, D(q[1:]), kr, vr, layer, D(np.array([p0 + 1], np.int32)), work, cnt)
    assert np.array_equal(host(o1)[0], got[1])


@pytest.mark.parametrize("name", ["fp16", "int8", "int4"])
@pytest.mark.parametrize("p0", [2, 40])
def test_attention_ring(name, p0):
    """A ring of S = 16 slots with a window of W = 11 (2 chunks: both splits busy): rows at
    positions p0 .. p0 + 2 attend to their last W positions, read at slot j % S, in position order
    — at the start of a sequence (the window clipped at 0) and far past the ring's size (the
    ring holding positions 27 .. 42, written in order). Each row launched alone gives the same
    bits as in the 3-row launch."""
    codec, impl = CODECS[name]
    rng = np.random.default_rng(34 + p0)
    T, H, Hk, hd, W, S, L, layer = 3, 2, 1, 8, 11, 16, 1, 0
    xk = np.zeros((L, S, Hk, hd), np.float32)
    xv = np.zeros((L, S, Hk, hd), np.float32)
    for j in range(p0 + T):                   # every position written at j % S, later ones last
        xk[layer, j % S] = rng.standard_normal((Hk, hd))
        xv[layer, j % S] = rng.standard_normal((Hk, hd))
    kr, K = encoded_cache(codec, xk)
    vr, V = encoded_cache(codec, xv)
    q = rng.standard_normal((T, H * hd)).astype(np.float32)
    work, cnt = att_ws(T, H, hd)
    out = D(np.full((T, H * hd), np.nan, np.float32))
    attention.attention(out, D(q), kr, vr, layer, D(np.array([p0], np.int32)), work, cnt, codec=impl,
                        window=W)
    got = host(out)
    close(got, ref_attention(q, K, V, layer, p0, H, Hk, hd, window=W), 1e-5)
    assert not host(cnt).any()
    for t in range(T):
        o1 = D(np.zeros((1, H * hd), np.float32))
        attention.attention(o1, D(q[t:t + 1]), kr, vr, layer, D(np.array([p0 + t], np.int32)), work, cnt,
                            codec=impl, window=W)
        assert np.array_equal(host(o1)[0], got[t]), t


@pytest.mark.parametrize("name,layout", [("fp16", "causal"), ("int4", "causal"), ("int8", "ring"),
                                         ("fp32", "tree")])
def test_attention_rows_form_equals_split_blocks(monkeypatch, name, layout):
    """The rows form (ROWS_T rows and more: one block per (row, head) running the Z splits in
    turn, combined in registers) gives the split blocks' bits: causal rows of Z + 1 chunks (split
    0 takes two), a wrapped ring, draft-tree rows."""
    codec, impl = CODECS[name]
    rng = np.random.default_rng(36)
    T, H, Hk, hd, p0 = 3, 2, 1, 8, CK * Z + 1
    W = 11 if layout == "ring" else 0
    S = 16 if layout == "ring" else p0 + T + 1
    kr, _ = encoded_cache(codec, rng.standard_normal((1, S, Hk, hd)).astype(np.float32))
    vr, _ = encoded_cache(codec, rng.standard_normal((1, S, Hk, hd)).astype(np.float32))
    q = D(rng.standard_normal((T, H * hd)).astype(np.float32))
    pos = D(np.array([p0 + 20 if layout == "ring" else p0], np.int32))
    tree = {}
    if layout == "tree":                     # root, then two siblings at depth 1
        tree = dict(depth=D(np.array([0, 1, 1], np.int32)), path=D(np.array([[0, 0], [0, 1], [0, 2]], np.int32)))
    work, cnt = att_ws(T, H, hd)
    outs = []
    for rows_t in (1 << 30, 1):
        monkeypatch.setattr(attention, "ROWS_T", rows_t)
        out = D(np.full((T, H * hd), np.nan, np.float32))
        attention.attention(out, q, kr, vr, 0, pos, work, cnt, codec=impl, window=W, **tree)
        outs.append(host(out))
    assert not np.isnan(outs[0]).any()
    assert np.array_equal(outs[0], outs[1])
    assert not host(cnt).any()


def test_attention_ring_without_wrap_equals_linear():
    """Before anything wraps (positions < S) and with a window covering them, the ring kernel
    reduces the same keys in the same order as the linear one: the same bits."""
    rng = np.random.default_rng(35)
    T, H, Hk, hd, S, p0 = 2, 2, 1, 8, 24, CK + 3
    kc = D(rng.standard_normal((1, S, Hk, hd)).astype(np.float16))
    vc = D(rng.standard_normal((1, S, Hk, hd)).astype(np.float16))
    q, pos = D(rng.standard_normal((T, H * hd)).astype(np.float32)), D(np.array([p0], np.int32))
    work, cnt = att_ws(T, H, hd)
    lin, ring = (D(np.zeros((T, H * hd), np.float32)) for _ in range(2))
    attention.attention(lin, q, kc, vc, 0, pos, work, cnt)
    attention.attention(ring, q, kc, vc, 0, pos, work, cnt, window=S)
    assert np.array_equal(host(lin), host(ring))


@pytest.mark.parametrize("cdt", [np.float16, np.float32])
def test_rope_kv_append_ring_slots(cdt):
    """A ring: rows at positions 14, 15, 16 (absolute: RoPE uses them) land in slots 6, 7, 0 of 8;
    nothing else is written. Tree rows cannot be stored in a ring."""
    rng = np.random.default_rng(36)
    T, H, Hk, hd, p0, S, W = 3, 2, 1, 8, 14, 8, 5
    inv = rope.inv_freq(hd, 10000.0)
    cs = D(rope.rope_table(hd, 10000.0, S + rope.POSITION_MARGIN))
    q = rng.standard_normal((T, H * hd)).astype(np.float32)
    k = rng.standard_normal((T, Hk * hd)).astype(np.float32)
    v = rng.standard_normal((T, Hk * hd)).astype(np.float32)
    pos = D(np.array([p0], np.int32))
    kc, vc = D(np.zeros((2, S, Hk, hd), cdt)), D(np.zeros((2, S, Hk, hd), cdt))
    qd, kd = D(q), D(k)
    rope.rope_kv_append(qd, kd, D(v), kc, vc, 1, pos, cs, window=W)
    gk = host(kd)
    close(host(qd), ref_rope(q, p0, inv), 1e-6)
    close(gk, ref_rope(k, p0, inv), 1e-6)
    hk, hv = host(kc), host(vc)
    slots = [6, 7, 0]
    assert np.array_equal(hk[1, slots], gk.reshape(T, Hk, hd).astype(cdt))
    assert np.array_equal(hv[1, slots], v.reshape(T, Hk, hd).astype(cdt))
    hk[1, slots] = 0
    hv[1, slots] = 0
    assert not hk.any() and not hv.any()
    _, dd, dp = _tree_tables(1, 2)
    with pytest.raises(BackendError, match="tree.*ring"):
        rope.rope_kv_append(qd, kd, D(v), kc, vc, 1, pos, cs, window=W, depth=dd, path=dp)
    with pytest.raises(BackendError, match="window=9"):
        rope.rope_kv_append(qd, kd, D(v), kc, vc, 1, pos, cs, window=9)


def test_qkv_epilogue_ring_equals_rope_kv_append_qkv():
    """The fused q|k|v epilogue into a ring: the same rotated q and cache contents as the matmul
    followed by rope_kv_append_qkv with the same window, rows at slots p % S."""
    kind, K, group, _ = EPI_CASES[0]
    rng = np.random.default_rng(37)
    H, Hk, hd, p0, layer, eps, T, S, W = 2, 1, 8, 13, 1, 1e-5, 3, 8, 6
    dev, x, nw, base_k, base_v = _qkv_case(rng, kind, K, group, H, Hk, hd, T, np.float16, S)
    cs = D(rope.rope_table(hd, 10000.0, S + rope.POSITION_MARGIN))
    pos = D(np.array([p0], np.int32))
    args = (dev["w"], dev.get("scales"), dev.get("zeros"))
    qkv = D(np.zeros((T, (H + 2 * Hk) * hd), np.float32))
    matmul.matmul(qkv, D(x), *args, norm_w=D(nw), eps=eps)
    kc, vc = D(base_k), D(base_v)
    q_ref = D(np.zeros((T, H * hd), np.float32))
    rope.rope_kv_append_qkv(qkv, q_ref, kc, vc, layer, pos, cs, window=W)
    kc2, vc2 = D(base_k), D(base_v)
    q_out = D(np.full((T, H * hd), np.nan, np.float32))
    matmul.matmul(q_out, D(x), *args, norm_w=D(nw), eps=eps,
                  epilogue=rope.qkv_epilogue(q_out, kc2, vc2, layer, pos, cs, window=W))
    assert np.array_equal(host(q_out), host(q_ref))
    assert np.array_equal(host(kc2), host(kc)) and np.array_equal(host(vc2), host(vc))
    hq = host(qkv)
    slots = [(p0 + t) % S for t in range(T)]
    assert np.array_equal(host(kc2)[layer, slots], hq[:, H * hd:(H + Hk) * hd].reshape(T, Hk, hd).astype(np.float16))
    assert np.array_equal(host(vc2)[layer, slots], hq[:, (H + Hk) * hd:].reshape(T, Hk, hd).astype(np.float16))


@pytest.mark.parametrize("kind,K,group,path", EPI_CASES[:2])
@pytest.mark.parametrize("tree", [False, True])
def test_qkv_stage_epilogue_then_kv_store(kind, K, group, path, tree):
    """The staging epilogue of a quantized cache: q_out gets the rotated q, k_stage / v_stage the
    rotated k and the v rows, bit for bit what the matmul + rope_kv_append_qkv leave (and what
    `rope` on separate buffers gives, the unfused path); kv_store then stores encode's codes."""
    rng = np.random.default_rng(K + (9 if tree else 8))
    H, Hk, hd, p0, layer, eps = 2, 1, 8, 3, 0, 1e-5
    if tree:
        t_, depth, path_t = _tree_tables(2, 1)
        T = t_.n_nodes
        slots = [p0 + int(t_.path[t, t_.depth[t]]) for t in range(T)]
    else:
        T, depth, path_t = 3, None, None
        slots = [p0 + t for t in range(T)]
    S = p0 + T + 2
    dev, x, nw, base_k, base_v = _qkv_case(rng, kind, K, group, H, Hk, hd, T, np.float32, S)
    cs = D(rope.rope_table(hd, 10000.0, S + rope.POSITION_MARGIN))
    pos = D(np.array([p0], np.int32))
    args = (dev["w"], dev.get("scales"), dev.get("zeros"))
    qkv = D(np.zeros((T, (H + 2 * Hk) * hd), np.float32))
    matmul.matmul(qkv, D(x), *args, norm_w=D(nw), eps=eps)
    raw = host(qkv)
    q_ref = D(np.zeros((T, H * hd), np.float32))
    rope.rope_kv_append_qkv(qkv, q_ref, D(base_k), D(base_v), layer, pos, cs, depth=depth, path=path_t)
    hq = host(qkv)                                  # k columns rotated in place
    q_out = D(np.full((T, H * hd), np.nan, np.float32))
    ks, vs = (D(np.full((T, Hk * hd), np.nan, np.float32)) for _ in range(2))
    matmul.matmul(q_out, D(x), *args, norm_w=D(nw), eps=eps,
                  epilogue=rope.qkv_stage_epilogue(q_out, ks, vs, pos, cs, depth=depth, path=path_t))
    assert np.array_equal(host(q_out), host(q_ref))
    assert np.array_equal(host(ks), hq[:, H * hd:(H + Hk) * hd])
    assert np.array_equal(host(vs), hq[:, (H + Hk) * hd:])
    # the unfused path: rope in place on separate q / k buffers (tree-aware positions)
    qd, kd = D(np.ascontiguousarray(raw[:, :H * hd])), D(np.ascontiguousarray(raw[:, H * hd:(H + Hk) * hd]))
    rope.rope(qd, kd, pos, cs, depth=depth, path=path_t)
    assert np.array_equal(host(qd), host(q_out)) and np.array_equal(host(kd), host(ks))
    codec, impl = CODECS["int8"]
    kr, vr = empty_rows(codec, 1, S, Hk, hd), empty_rows(codec, 1, S, Hk, hd)
    kv_store.kv_store(ks, vs, kr, vr, layer, pos, impl, depth=depth, path=path_t)
    data, scale, _ = codec.encode(host(ks).reshape(T, Hk, hd))
    assert np.array_equal(host(kr.data)[layer, slots], data)
    assert np.array_equal(host(kr.scale)[layer, slots], scale)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_move_slots_moves_scales_and_zeros(name):
    codec, _ = CODECS[name]
    rng = np.random.default_rng(38)
    L, S, Hk, hd = 2, 10, 2, 8
    rows = [encoded_cache(codec, rng.standard_normal((L, S, Hk, hd)).astype(np.float32))[0] for _ in range(2)]
    before = [host_rows(r) for r in rows]
    moves = [(7, 5), (5, 6), (9, 7)]
    buf = np.zeros((2, 4), np.int32)
    buf[:, :3] = np.array(moves, np.int32).T
    kr, vr = rows
    cache_move.move_slots(kr.data, vr.data, D(buf), 3, k_scale=kr.scale, v_scale=vr.scale, k_zero=kr.zero,
                          v_zero=vr.zero)
    for r, b in zip(rows, before):
        for got, want in zip(host_rows(r), b):
            if want is None:
                continue
            want = want.copy()
            for s_, d_ in moves:
                want[:, d_] = want[:, s_]
            assert np.array_equal(got, want)


def test_kv_codec_argument_errors():
    T, H, Hk, hd, S = 2, 2, 1, 8, 6
    q, out, pos = (D(np.zeros((T, H * hd), np.float32)), D(np.zeros((T, H * hd), np.float32)),
                   D(np.zeros(1, np.int32)))
    work, cnt = att_ws(T, H, hd)
    _, dd, dp = _tree_tables(1, 1)
    i8 = empty_rows(INT8Codec, 1, S, Hk, hd)
    f16 = D(np.zeros((1, S, Hk, hd), np.float16))
    stage = D(np.zeros((T, Hk * hd), np.float32))
    with pytest.raises(BackendError, match="not a quantized KV codec"):
        kv_store.kv_store(stage, stage, f16, f16, 0, pos, kv_codecs.FP16)
    with pytest.raises(BackendError, match="tree.*ring"):
        kv_store.kv_store(stage, stage, i8, i8, 0, pos, kv_codecs.INT8, window=3, depth=dd, path=dp)
    with pytest.raises(BackendError, match="k_scale is required"):
        kv_store.kv_store(stage, stage, kv_codecs.Rows(i8.data), i8, 0, pos, kv_codecs.INT8)
    with pytest.raises(BackendError, match="k_data has dtype"):
        kv_store.kv_store(stage, stage, i8, i8, 0, pos, kv_codecs.INT4)
    with pytest.raises(BackendError, match="window=7"):
        attention.attention(out, q, f16, f16, 0, pos, work, cnt, window=7)
    with pytest.raises(BackendError, match="tree.*ring"):
        attention.attention(out, q, f16, f16, 0, pos, work, cnt, window=3, depth=dd, path=dp)
    with pytest.raises(BackendError, match="k_scale given for the fp16 codec"):
        attention.attention(out, q, kv_codecs.Rows(f16, i8.scale), f16, 0, pos, work, cnt)
    with pytest.raises(BackendError, match="k_scale is required"):
        attention.attention(out, q, kv_codecs.Rows(i8.data), i8, 0, pos, work, cnt)
    with pytest.raises(BackendError, match="zero points given without scales"):
        cache_move.move_slots(i8.data, i8.data, D(np.zeros((2, 1), np.int32)), 1, k_zero=i8.scale)


# =============================================================================== early exit
from tinyloop.cuda.kernels import exit_probe, kv_layer_copy  # noqa: E402
from tinyloop.runtime.early_exit import GATE_CDF, STATISTICS, gate_cdf, gate_log_survival, is_stable  # noqa: E402


@pytest.mark.parametrize("stat", sorted(exit_probe.MODES))
def test_exit_probe_against_the_numpy_statistics(stat):
    """exit_probe's statistic, stability count and exit depth against the numpy references of
    tinyloop.runtime.early_exit (rows longer than the block, a tie for argmax; gate_cdf's running
    log-survival over the probes), the row stashed as the next probe's previous one."""
    check_exit_probe(stat, 77)


def check_exit_probe(stat, n):
    """The body of the test above for rows of n values (also run on a GPU at the block sizes the
    launcher picks there: tests/cuda/test_kernels_gpu.py)."""
    rng = np.random.default_rng(7)
    rows = [rng.standard_normal(n).astype(np.float32) * 3 for _ in range(4)]
    rows[2] = rows[1] + np.float32(0.01) * rng.standard_normal(n).astype(np.float32)   # a nearly stable step
    rows[3] = rows[2].copy()
    rows[3][5] = rows[3].max() + 1                               # argmax moves
    gw = (rng.standard_normal(n) * 0.1).astype(np.float32)
    gb = np.array([-0.7], np.float32)
    gate = (cuda.to_device(gw), cuda.to_device(gb))
    state = cuda.to_device(np.zeros(2, np.int32))
    acc = cuda.to_device(np.full(1, 5.0))
    prev = cuda.to_device(np.zeros(n + 3, np.float32))
    no = cuda.to_device(np.zeros(1, np.uint64))
    threshold = {"rel_l2": 0.05, "top2_margin": 0.5, "kl": 0.01, "argmax_change": 0.5, "gate_cdf": 0.6}[stat]
    exit_probe.reset(state, acc)
    assert acc.copy_to_host()[0] == 0.0
    run, at, log_survival = 0, 0, 0.0
    for depth, r in enumerate(rows, start=1):
        exit_probe.probe(cuda.to_device(r), prev, state, stat, threshold, 2, depth, depth > 1, no, 1, gate=gate,
                         acc=acc)
        got = state.copy_to_host()
        if depth > 1:
            if stat == GATE_CDF:
                log_survival += gate_log_survival(r.astype(np.float64), gw, float(gb[0]))
                value = gate_cdf(log_survival)
                np.testing.assert_allclose(acc.copy_to_host()[0], log_survival, rtol=1e-12)
            else:
                value = STATISTICS[stat][0](r.astype(np.float64), rows[depth - 2].astype(np.float64))
            run = run + 1 if is_stable(stat, value, threshold) else 0
            if run >= 2 and not at:
                at = depth
        assert list(got) == [run, at], f"depth {depth}: {list(got)} != {[run, at]}"
        np.testing.assert_array_equal(prev.copy_to_host()[:n], r)
    if stat == GATE_CDF and n == 77:
        assert at == 3          # the gate's probability passes the threshold within the rows
    exit_probe.reset(state, acc)
    assert list(state.copy_to_host()) == [0, 0] and acc.copy_to_host()[0] == 0.0
    with pytest.raises(BackendError, match="unknown statistic"):
        exit_probe.probe(cuda.to_device(rows[0]), prev, state, "cosine", 0.1, 1, 1, True, no, 1, acc=acc)
    with pytest.raises(BackendError, match="fewer than the row"):
        exit_probe.probe(cuda.to_device(np.zeros(n + 9, np.float32)), prev, state, stat, 0.1, 1, 1, True, no, 1,
                         gate=gate, acc=acc)
    with pytest.raises(BackendError, match="gate_cdf needs"):
        exit_probe.probe(cuda.to_device(rows[0]), prev, state, GATE_CDF, 0.1, 1, 1, True, no, 1, acc=acc)


@pytest.mark.parametrize("stat", ["rel_l2", "gate_cdf"])
def test_exit_probe_fresh_equals_reset(stat):
    """A step's first probe with `fresh` starts from a cleared state and running sum whatever the
    buffers hold (a captured guarded step launches no reset): a reference probe leaves [0, 0] and
    0.0; a comparing one records what it would after `reset` (the running sum is gate_cdf's only)."""
    rng = np.random.default_rng(11)
    n = 40
    row = rng.standard_normal(n).astype(np.float32)
    gw = (rng.standard_normal(n) * 0.5).astype(np.float32)
    gate = (cuda.to_device(gw), cuda.to_device(np.array([3.0], np.float32)))
    no = cuda.to_device(np.zeros(1, np.uint64))
    results = []
    for fresh in (False, True):
        state = cuda.to_device(np.array([5, 3], np.int32))
        acc = cuda.to_device(np.full(1, -7.0))
        prev = cuda.to_device(np.zeros(n, np.float32))
        if not fresh:
            exit_probe.reset(state, acc)
        exit_probe.probe(cuda.to_device(row), prev, state, stat, 0.5, 1, 1, False, no, 1, gate=gate, acc=acc,
                         fresh=fresh)
        assert list(state.copy_to_host()) == [0, 0] and acc.copy_to_host()[0] == 0.0
        state = cuda.to_device(np.array([5, 3], np.int32))
        acc = cuda.to_device(np.full(1, -7.0))
        if not fresh:
            exit_probe.reset(state, acc)
        exit_probe.probe(cuda.to_device(row * 1.001), prev, state, stat, 0.5, 1, 2, True, no, 1, gate=gate,
                         acc=acc, fresh=fresh)
        results.append((list(state.copy_to_host()), float(acc.copy_to_host()[0]) if stat == GATE_CDF else None))
    assert results[0] == results[1] and results[1][0] == [1, 2]


@pytest.mark.parametrize("ring", [False, True])
def test_kv_layer_copy(ring):
    """copy_layers_at and copy_from_exit against numpy: the slot of the device position in the
    destination layers gets the source layer's row, nothing else changes; no exit copies nothing."""
    rng = np.random.default_rng(3)
    L, S, H, C = 7, 5, 2, 4
    codes = rng.integers(-100, 100, (L, S, H, C)).astype(np.int8)
    scale = rng.standard_normal((L, S, H)).astype(np.float32)
    pos_value = 12 if ring else 3
    slot = pos_value % S if ring else pos_value
    pos = cuda.to_device(np.array([pos_value], np.int32))
    a, sc = cuda.to_device(codes), cuda.to_device(scale)
    kv_layer_copy.copy_layers_at(a, pos, ring, 1, range(3, 7, 2))
    kv_layer_copy.copy_layers_at(sc, pos, ring, 1, range(3, 7, 2))
    want_a, want_s = codes.copy(), scale.copy()
    for dst in (3, 5):
        want_a[dst, slot] = codes[1, slot]
        want_s[dst, slot] = scale[1, slot]
    np.testing.assert_array_equal(a.copy_to_host(), want_a)
    np.testing.assert_array_equal(sc.copy_to_host(), want_s)
    # copy_from_exit: loop layers start at local layer 1, n_loop 2, loops 3; exit at depth 1
    state = cuda.to_device(np.array([0, 0], np.int32))
    before = a.copy_to_host()
    kv_layer_copy.copy_from_exit(a, pos, ring, state, 1, 2, 3)
    np.testing.assert_array_equal(a.copy_to_host(), before)           # no exit: nothing copied
    state = cuda.to_device(np.array([1, 1], np.int32))
    kv_layer_copy.copy_from_exit(a, pos, ring, state, 1, 2, 3)
    want = before.copy()
    for j in range(2):
        for i in (1, 2):
            want[1 + i * 2 + j, slot] = before[1 + j, slot]
    np.testing.assert_array_equal(a.copy_to_host(), want)
    with pytest.raises(BackendError, match="outside"):
        kv_layer_copy.copy_layers_at(a, pos, ring, 0, range(5, 9))


@pytest.mark.skipif(not numba.config.ENABLE_CUDASIM, reason="a property of the simulator's shared arrays")
def test_simulator_threads_of_a_block_share_one_array():
    """Every thread of a block gets the same shared array, even when the interpreter switches
    threads between the lookup and the creation of the array (tests/sim_fast.py creates it with
    one atomic setdefault; a get-then-set gave two early threads two arrays now and then, which
    made a row-tail test fail once in a CI run). With a tiny switch interval about every second
    run of this test failed with the old lookup."""
    import sys

    @cuda.jit
    def kernel(out):
        a = cuda.shared.array(128, numba.int32)
        b = cuda.shared.array(128, numba.int32)
        c = cuda.shared.array(128, numba.int32)
        d = cuda.shared.array(128, numba.int32)
        t = cuda.threadIdx.x
        a[t] = t + 1
        b[t] = t + 2
        c[t] = t + 3
        d[t] = t + 4
        cuda.syncthreads()
        u = (t + 1) % 128
        out[cuda.blockIdx.x, t] = a[u] + b[u] + c[u] + d[u]

    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    want = np.tile(4 * ((np.arange(128) + 1) % 128) + 10, (16, 1))
    try:
        for _ in range(12):
            out = cuda.to_device(np.zeros((16, 128), np.int32))
            kernel[16, 128](out)
            assert np.array_equal(out.copy_to_host(), want)
    finally:
        sys.setswitchinterval(before)
