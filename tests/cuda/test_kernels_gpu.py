"""CUDA kernels on a real GPU at realistic sizes: accuracy against float64 references,
batch invariance (every row of a T-row launch bit-identical to the row launched alone), a q4 GEMV
2048 x 2048 accuracy check, and CUDA-graph capture/replay with the position advanced on the device.

    python -m pytest -m gpu tests/cuda/test_kernels_gpu.py -q -s

With TINYLOOP_BENCH=1 it also times the matmul kernels (graph replay through PyTorch when it is
installed, else CUDA events around many launches) and prints a table.
"""

from __future__ import annotations

import os

import numba
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from numba import cuda  # noqa: E402

if numba.config.ENABLE_CUDASIM or not cuda.is_available():
    pytest.skip("needs a real CUDA GPU (and NUMBA_ENABLE_CUDASIM unset)", allow_module_level=True)

from tinyloop.cuda.kernels import (add, argmax, attention, embed, kv_store, matmul, rmsnorm,  # noqa: E402
                                   rope, sample, swiglu)

import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for the shared references
from test_kernels_sim import test_exit_probe_fresh_equals_reset as check_exit_probe_fresh  # noqa: E402
from test_kernels_sim import (CODECS, argmax_ws, att_ws, check_exit_probe, close, empty_rows,  # noqa: E402
                              encoded_cache, make_weight, old_formula_table, ref_attention, ref_rmsnorm, ref_rope,
                              sample_work, store_inputs)

D = cuda.to_device


def host(a):
    return a.copy_to_host()


def rel_err(got, ref):
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert not np.isnan(got).any()
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def rows_alone(launch, T):
    """Run launch(t) for each row t alone and stack the single-row outputs."""
    return np.stack([launch(t) for t in range(T)])


# =============================================================================== matmul
@pytest.mark.parametrize("kind,group", [("q4", 128), ("q4", 32), ("q8", 64), ("q2", 64),
                                        ("f16", 0), ("f32", 0), ("q4", 8)])
@pytest.mark.parametrize("N,K", [(2048, 2048), (1000, 5632)])
def test_matmul_gpu(kind, group, N, K):
    rng = np.random.default_rng(N + K)
    arrays, W = make_weight(rng, kind, N, K, group)
    dev = {k: D(v) for k, v in arrays.items()}
    T = 7
    x = rng.standard_normal((T, K)).astype(np.float32)
    out = D(np.full((T, N), np.nan, np.float32))
    matmul.matmul(out, D(x), dev["w"], dev.get("scales"), dev.get("zeros"))
    got = host(out)
    assert rel_err(got, x.astype(np.float64) @ W.T) < 1e-5

    def one(t):
        o = D(np.full((1, N), np.nan, np.float32))
        matmul.matmul(o, D(x[t:t + 1]), dev["w"], dev.get("scales"), dev.get("zeros"))
        return host(o)[0]
    assert np.array_equal(rows_alone(one, T), got)


@pytest.mark.parametrize("stages", [0, 2, 4])
@pytest.mark.parametrize("kind,group,N,K", [("q4", 32, 1000, 5280), ("q4", 128, 3000, 2048),
                                              ("q4", 32, 600, 17920), ("q8", 8, 777, 520), ("q2", 64, 513, 1536)])
def test_matmul_prefetch_gpu(monkeypatch, kind, group, N, K, stages):
    """One-row launches that prefetch their rows into L2 (PREFETCH_BLOCKS raised so every launch
    does; rows and scale rows not 16-byte aligned included): plain, norm-fused and with the
    swiglu pair epilogue, every row alone equals the same row of a multi-row launch (which never
    prefetches), and the plain product meets the float64 reference. With `stages`, the one-row
    launches also run the weight-word pipeline (cp.async into shared memory)."""
    monkeypatch.setattr(matmul, "PREFETCH_BLOCKS", 1 << 20)
    monkeypatch.setattr(matmul, "PIPE_STAGES", stages)
    rng = np.random.default_rng(N + K)
    arrays, W = make_weight(rng, kind, N - N % 2, K, group)
    N -= N % 2
    dev = {k: D(v) for k, v in arrays.items()}
    T = 5
    x = rng.standard_normal((T, K)).astype(np.float32)
    nw = D((1.0 + 0.1 * rng.standard_normal(K)).astype(np.float32))
    for extra, cols in (({}, N), ({"norm_w": nw, "eps": 1e-6}, N),
                        ({"norm_w": nw, "eps": 1e-6, "epilogue": swiglu.glu_epilogue(N // 2)}, N // 2)):
        out = D(np.full((T, cols), np.nan, np.float32))
        matmul.matmul(out, D(x), dev["w"], dev.get("scales"), dev.get("zeros"), **extra)
        got = host(out)
        if not extra:
            assert rel_err(got, x.astype(np.float64) @ W.T) < 1e-5

        def one(t):
            o = D(np.full((1, cols), np.nan, np.float32))
            matmul.matmul(o, D(x[t:t + 1]), dev["w"], dev.get("scales"), dev.get("zeros"), **extra)
            return host(o)[0]
        assert np.array_equal(rows_alone(one, T), got)


def test_q4_gemv_2048_accuracy():
    rng = np.random.default_rng(2048)
    arrays, W = make_weight(rng, "q4", 2048, 2048, 128)
    dev = {k: D(v) for k, v in arrays.items()}
    x = rng.standard_normal((1, 2048)).astype(np.float32)
    base = rng.standard_normal((1, 2048)).astype(np.float32)
    out = D(base.copy())
    matmul.matmul(out, D(x), dev["w"], dev["scales"], dev["zeros"], accumulate=True)
    ref = base.astype(np.float64) + x.astype(np.float64) @ W.T
    assert rel_err(host(out), ref) < 1e-6
    assert matmul.uses_fast_path("q4", 2048, 128, dev["w"])


def test_matmul_prefill_rows_match_decode():
    """A 64-row prefill against 64 decode launches (GEMM vs GEMV configurations)."""
    rng = np.random.default_rng(64)
    arrays, W = make_weight(rng, "q4", 512, 2048, 64)
    dev = {k: D(v) for k, v in arrays.items()}
    T = 64
    x = rng.standard_normal((T, 2048)).astype(np.float32)
    out = D(np.zeros((T, 512), np.float32))
    matmul.matmul(out, D(x), dev["w"], dev["scales"], dev["zeros"])
    got = host(out)

    def one(t):
        o = D(np.zeros((1, 512), np.float32))
        matmul.matmul(o, D(x[t:t + 1]), dev["w"], dev["scales"], dev["zeros"])
        return host(o)[0]
    assert np.array_equal(rows_alone(one, T), got)


@pytest.mark.parametrize("kind,group", [("q4", 128), ("q8", 64), ("q2", 64), ("f16", 0), ("f32", 0),
                                        ("q4", 8)])
def test_matmul_fused_norm_gpu(kind, group):
    """Fused RMSNorm at realistic sizes: float64 reference, a 64-row prefill against 64 one-row
    launches, and equality with rmsnorm + plain matmul (the prologue reproduces rmsnorm's
    summation order; q4 group 8 takes the simple kernel)."""
    rng = np.random.default_rng(4096)
    N, K, T, eps = 768, 2048, 64, 1e-6
    arrays, W = make_weight(rng, kind, N, K, group)
    dev = {k: D(v) for k, v in arrays.items()}
    x = (rng.standard_normal((T, K)) * (1.0 + np.arange(T)[:, None] / 8)).astype(np.float32)
    nw = D((1.0 + 0.1 * rng.standard_normal(K)).astype(np.float32))
    out = D(np.full((T, N), np.nan, np.float32))
    matmul.matmul(out, D(x), dev["w"], dev.get("scales"), dev.get("zeros"), norm_w=nw, eps=eps)
    got = host(out)
    assert rel_err(got, ref_rmsnorm(x, host(nw), eps) @ W.T) < 1e-5

    def one(t):
        o = D(np.full((1, N), np.nan, np.float32))
        matmul.matmul(o, D(x[t:t + 1]), dev["w"], dev.get("scales"), dev.get("zeros"), norm_w=nw, eps=eps)
        return host(o)[0]
    assert np.array_equal(rows_alone(one, T), got)
    h = D(np.zeros((T, K), np.float32))
    rmsnorm.rmsnorm(h, D(x), nw, eps)
    plain = D(np.full((T, N), np.nan, np.float32))
    matmul.matmul(plain, h, dev["w"], dev.get("scales"), dev.get("zeros"))
    assert np.array_equal(host(plain), got)


# =============================================================================== others
def test_norm_add_gpu():
    """x += rmsnorm(y) * w: float64 reference, == rmsnorm then add bit for bit, rows alone."""
    from tinyloop.cuda.kernels import norm_add
    rng = np.random.default_rng(7)
    T, Dm = 9, 5280
    x = rng.standard_normal((T, Dm)).astype(np.float32)
    y = (3 * rng.standard_normal((T, Dm))).astype(np.float32)
    w = rng.standard_normal(Dm).astype(np.float32)
    xd = D(x)
    norm_add.norm_add(xd, D(y), D(w), 1e-6)
    got = host(xd)
    close(got, x + ref_rmsnorm(y, w, 1e-6), 1e-5)
    h = D(np.zeros((T, Dm), np.float32))
    rmsnorm.rmsnorm(h, D(y), D(w), 1e-6)
    two = D(x)
    add.add(two, h)
    assert np.array_equal(host(two), got)

    def one(t):
        o = D(x[t:t + 1])
        norm_add.norm_add(o, D(y[t:t + 1]), D(w), 1e-6)
        return host(o)[0]
    assert np.array_equal(rows_alone(one, T), got)


@pytest.mark.parametrize("regs", [True, False])
@pytest.mark.parametrize("Dm", [384, 2048, 5280, 8192, 9000])
def test_row_norms_bits_gpu(Dm, regs, monkeypatch):
    """rmsnorm and norm_add on the GPU equal the operation-for-operation model of their order
    (register form, one pass or chunks, and the loop form), in place as well."""
    from test_kernels_sim import check_row_norms_bits
    monkeypatch.setattr(rmsnorm, "REGS_T", 128 if regs else 0)
    check_row_norms_bits(Dm, 2)


def test_rmsnorm_add_swiglu_embed_gpu():
    rng = np.random.default_rng(1)
    T, Dm = 9, 4096
    x = rng.standard_normal((T, Dm)).astype(np.float32)
    w = rng.standard_normal(Dm).astype(np.float32)
    out = D(np.zeros((T, Dm), np.float32))
    rmsnorm.rmsnorm(out, D(x), D(w), 1e-6)
    got = host(out)
    close(got, ref_rmsnorm(x, w, 1e-6), 1e-5)

    def one(t):
        o = D(np.zeros((1, Dm), np.float32))
        rmsnorm.rmsnorm(o, D(x[t:t + 1]), D(w), 1e-6)
        return host(o)[0]
    assert np.array_equal(rows_alone(one, T), got)

    y = rng.standard_normal((T, Dm)).astype(np.float32)
    xd = D(x)
    add.add(xd, D(y))
    assert np.array_equal(host(xd), x + y)

    gu = rng.standard_normal((T, 2 * Dm)).astype(np.float32) * 5
    o = D(np.zeros((T, Dm), np.float32))
    swiglu.swiglu_fused(o, D(gu))
    g = gu[:, :Dm].astype(np.float64)
    close(host(o), g / (1 + np.exp(-g)) * gu[:, Dm:], 1e-6)

    arrays, W = make_weight(rng, "q4", 32000, 2048, 64)
    ids = rng.integers(0, 32000, 17).astype(np.int32)
    o = D(np.zeros((17, 2048), np.float32))
    embed.embed(o, D(ids), *(D(arrays[k]) for k in ("w", "scales", "zeros")))
    close(host(o), W[ids], 1e-6)


@pytest.mark.parametrize("cdt", [np.float16, np.float32])
def test_attention_rows_form_equals_split_blocks_gpu(monkeypatch, cdt):
    """A prefill-sized launch (100 rows over up to 1100 keys, 16 heads of 128, GQA 4:1) in the rows
    form gives the split blocks' bits, and against the float64 reference."""
    rng = np.random.default_rng(3)
    T, H, Hk, hd, S, p0 = 100, 16, 4, 128, 1200, 1000
    kc_h = rng.standard_normal((1, S, Hk, hd)).astype(cdt)
    vc_h = rng.standard_normal((1, S, Hk, hd)).astype(cdt)
    q = rng.standard_normal((T, H * hd)).astype(np.float32)
    kc, vc, qd, pos = D(kc_h), D(vc_h), D(q), D(np.array([p0], np.int32))
    work, cnt = att_ws(T, H, hd)
    outs = []
    for rows_t in (1 << 30, 1):
        monkeypatch.setattr(attention, "ROWS_T", rows_t)
        out = D(np.full((T, H * hd), np.nan, np.float32))
        attention.attention(out, qd, kc, vc, 0, pos, work, cnt)
        outs.append(host(out))
    assert np.array_equal(outs[0], outs[1])
    assert rel_err(outs[1], ref_attention(q, kc_h, vc_h, 0, p0, H, Hk, hd)) < 1e-5


def test_rope_attention_long_context_gpu():
    rng = np.random.default_rng(2)
    T, H, Hk, hd, L, S, layer = 4, 16, 4, 128, 3, 8192, 2
    p0 = S - T
    inv = rope.inv_freq(hd, 500000.0)
    q = rng.standard_normal((T, H * hd)).astype(np.float32)
    k = rng.standard_normal((T, Hk * hd)).astype(np.float32)
    v = rng.standard_normal((T, Hk * hd)).astype(np.float32)
    kc_h = rng.standard_normal((L, S, Hk, hd)).astype(np.float16)
    vc_h = rng.standard_normal((L, S, Hk, hd)).astype(np.float16)
    kc, vc = D(kc_h), D(vc_h)
    pos = D(np.array([p0], np.int32))
    qd, kd = D(q), D(k)
    cs = D(rope.rope_table(hd, 500000.0, S + rope.POSITION_MARGIN))
    rope.rope_kv_append(qd, kd, D(v), kc, vc, layer, pos, cs)
    gq = host(qd)
    close(gq, ref_rope(q, p0, inv), 1e-5)
    kc_h[layer, p0:] = host(kc)[layer, p0:]
    vc_h[layer, p0:] = host(vc)[layer, p0:]
    out = D(np.zeros((T, H * hd), np.float32))
    work, cnt = att_ws(T, H, hd)
    attention.attention(out, qd, kc, vc, layer, pos, work, cnt)
    got = host(out)
    assert rel_err(got, ref_attention(gq, kc_h, vc_h, layer, p0, H, Hk, hd)) < 1e-5
    assert not host(cnt).any()

    def one(t):   # the same workspace, launch after launch (the counters reset themselves)
        o = D(np.zeros((1, H * hd), np.float32))
        attention.attention(o, D(gq[t:t + 1]), kc, vc, layer, D(np.array([p0 + t], np.int32)), work, cnt)
        return host(o)[0]
    assert np.array_equal(rows_alone(one, T), got)


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("window", [0, 40])
def test_kv_store_equals_encode_gpu(name, window):
    """kv_store on the GPU (libdevice rintf, IEEE divisions, shuffle butterflies) stores exactly
    codec.encode's codes, scales and zeros: 64 rows x 8 kv heads of 128 with zero, constant and
    exact-half rows; a ring wraps the launch (positions 90 .. 153 in 128 slots)."""
    codec, impl = CODECS[name]
    rng = np.random.default_rng(41)
    T, Hk, hd, L, S, layer, p0 = 64, 8, 128, 2, 128, 1, 90 if window else 40
    slots = [(p0 + t) % S for t in range(T)]
    x = store_inputs(rng, name, T, Hk, hd)
    y = store_inputs(rng, name, T, Hk, hd)[::-1].copy()
    kr, vr = empty_rows(codec, L, S, Hk, hd), empty_rows(codec, L, S, Hk, hd)
    kv_store.kv_store(D(x.reshape(T, Hk * hd)), D(y.reshape(T, Hk * hd)), kr, vr, layer,
                      D(np.array([p0], np.int32)), impl, window=window)
    for src, rows in ((x, kr), (y, vr)):
        data, scale, zero = codec.encode(src)
        assert np.array_equal(host(rows.data)[layer, slots], data)
        assert np.array_equal(host(rows.scale)[layer, slots].view(np.uint32), scale.view(np.uint32))
        if zero is not None:
            assert np.array_equal(host(rows.zero)[layer, slots], zero)


@pytest.mark.parametrize("name", ["fp16", "int8", "int4"])
@pytest.mark.parametrize("window", [0, 1000])
def test_attention_codecs_long_context_gpu(name, window):
    """Attention over each codec's storage at hd 128 (4 dims per lane), against float64 attention
    over the decoded rows: 4096 keys linear, or a ring of 1104 slots with a window of 1000 at
    positions far past it; rows alone == rows in the launch."""
    codec, impl = CODECS[name]
    rng = np.random.default_rng(42)
    T, H, Hk, hd, L, layer = 4, 16, 4, 128, 2, 1
    S, p0 = (1104, 5000) if window else (4096, 4096 - T)
    kr, K = encoded_cache(codec, rng.standard_normal((L, S, Hk, hd)).astype(np.float32))
    vr, V = encoded_cache(codec, rng.standard_normal((L, S, Hk, hd)).astype(np.float32))
    q = rng.standard_normal((T, H * hd)).astype(np.float32)
    out = D(np.zeros((T, H * hd), np.float32))
    work, cnt = att_ws(T, H, hd)
    attention.attention(out, D(q), kr, vr, layer, D(np.array([p0], np.int32)), work, cnt, codec=impl,
                        window=window)
    got = host(out)
    assert rel_err(got, ref_attention(q, K, V, layer, p0, H, Hk, hd, window=window)) < 1e-5
    assert not host(cnt).any()

    def one(t):
        o = D(np.zeros((1, H * hd), np.float32))
        attention.attention(o, D(q[t:t + 1]), kr, vr, layer, D(np.array([p0 + t], np.int32)), work, cnt,
                            codec=impl, window=window)
        return host(o)[0]
    assert np.array_equal(rows_alone(one, T), got)


@pytest.mark.parametrize("hd,theta,P", [(64, 10000.0, 4096 + 65), (128, 500000.0, 8192 + 65),
                                        (64, 100000.0, 32768 + 65)])
def test_rope_table_matches_device_formula_gpu(hd, theta, P):
    """The host table (numpy float64 cos/sin) equals, bit for bit, what the pre-table kernels
    computed per thread with libdevice's float64 cos/sin, so decoding is unchanged."""
    got = rope.rope_table(hd, theta, P)
    want = old_formula_table(hd, theta, P)
    bad = np.argwhere(got != want)
    assert bad.size == 0, f"{len(bad)} entries differ, first (p, i, cos/sin) = {bad[:5].tolist()}"


def test_argmax_sample_large_vocab_gpu():
    rng = np.random.default_rng(3)
    Vv = 151936
    logits = (rng.standard_normal((3, Vv)) * 3).astype(np.float32)
    logits[1, [5, 150000]] = 99.0
    want = [int(np.argmax(logits[0])), 5, int(np.argmax(logits[2]))]
    out = D(np.zeros(3, np.int32))
    argmax.argmax(out, D(logits))
    assert host(out).tolist() == want
    work = argmax_ws(3)
    for _ in range(3):                   # the split kernel, repeatedly through one workspace
        out = D(np.zeros(3, np.int32))
        argmax.argmax(out, D(logits), work=work)
        assert host(out).tolist() == want
    assert not host(work[2]).any()
    from tinyloop.runtime.sampling import sample_token
    row = logits[0]
    utab = rng.random(4)
    work = sample_work()
    for temp, k, p in [(1.0, 50, 1.0), (0.7, 1, 1.0), (1.0, 1024, 0.9), (0.8, 40, 0.95), (2.0, 1000, 1.0),
                       (0.3, 200, 0.5)]:
        for i in range(4):
            o = D(np.full(1, -1, np.int32))
            sample.sample(o, D(row), D(np.array([temp, p], np.float64)), D(np.array([k, 10], np.int32)),
                          D(utab), D(np.array([9 + i], np.int32)), 1, work)
            assert int(host(o)[0]) == sample_token(row, temp, k, p, utab[i]), (temp, k, p, i)
    # many equal logits: more than CAP keys at the threshold's bin, the exact select
    flat = np.ones(Vv, np.float32)
    flat[::3] = np.float32(1.0 + 2 ** -20)
    for k in (7, 1024):
        o = D(np.full(1, -1, np.int32))
        sample.sample(o, D(flat), D(np.array([1.0, 1.0], np.float64)), D(np.array([k, 0], np.int32)),
                      D(utab), D(np.array([0], np.int32)), 1, work)
        assert int(host(o)[0]) == sample_token(flat, 1.0, k, 1.0, utab[1]), k
    assert not host(work[0]).any() and host(work[1])[0] == 0


# =============================================================================== graph capture
@pytest.mark.parametrize("n", [77, 384, 4096, 50304])
@pytest.mark.parametrize("stat", ["rel_l2", "top2_margin", "kl", "argmax_change", "gate_cdf"])
def test_exit_probe_gpu(stat, n):
    """The early-exit probe against the numpy statistics with the GPU's warp reductions, at both
    block sizes (128 threads up to 8192 values, 1024 above)."""
    check_exit_probe(stat, n)
    if n == 77 and stat in ("rel_l2", "gate_cdf"):
        check_exit_probe_fresh(stat)


def test_graph_capture_replay():
    """A decode step captured once replays correctly while pos changes on the device (nothing but
    device arrays changes between replays; the draw's uniform number follows pos)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    rng = np.random.default_rng(4)
    H, Hk, hd, L, S, d = 4, 2, 64, 1, 64, 256
    cs = D(rope.rope_table(hd, 10000.0, S + rope.POSITION_MARGIN))
    arrays, W = make_weight(rng, "q4", H * hd, d, 64)
    wq = {k: D(v) for k, v in arrays.items()}
    x = D(rng.standard_normal((1, d)).astype(np.float32))
    kc = D(np.zeros((L, S, Hk, hd), np.float16))
    vc = D(np.zeros((L, S, Hk, hd), np.float16))
    q = D(np.zeros((1, H * hd), np.float32))
    k_src = rng.standard_normal((1, Hk * hd)).astype(np.float32)
    kb, vb = D(k_src), D(k_src)
    out = D(np.zeros((1, H * hd), np.float32))
    pos = D(np.array([0], np.int32))
    logits = D(rng.standard_normal(1000).astype(np.float32))
    params = D(np.array([1.0, 1.0], np.float64))
    iparams = D(np.array([50, 0], np.int32))
    utab = rng.random(3)
    swork = sample_work()
    tok = D(np.zeros(1, np.int32))
    work, cnt = att_ws(1, H, hd)
    D_utab = D(utab)

    def step(stream):
        matmul.matmul(q, x, wq["w"], wq["scales"], wq["zeros"], stream=stream)
        rope.rope_kv_append(q, kb, vb, kc, vc, 0, pos, cs, stream=stream)
        attention.attention(out, q, kc, vc, 0, pos, work, cnt, stream=stream)
        sample.sample(tok, logits, params, iparams, D_utab, pos, 1, swork, stream=stream)

    step(0)  # compile and load every kernel before capture
    cuda.synchronize()
    pos.copy_to_device(np.array([0], np.int32))
    kc.copy_to_device(np.zeros((L, S, Hk, hd), np.float16))
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        step(cuda.external_stream(s.cuda_stream))
    tokens = []
    for p in range(3):
        pos.copy_to_device(np.array([p], np.int32))
        kb.copy_to_device(k_src)  # rope rotated kb in place last replay
        g.replay()
        torch.cuda.synchronize()
        tokens.append(int(host(tok)[0]))
        assert not np.isnan(host(out)).any()
        assert np.abs(host(kc)[0, p]).sum() > 0
        # the replayed attention (split counters reset by the previous replay) == an eager launch
        o2, (w2, c2) = D(np.zeros((1, H * hd), np.float32)), att_ws(1, H, hd)
        attention.attention(o2, q, kc, vc, 0, pos, w2, c2)
        assert np.array_equal(host(o2), host(out))
    # the draw reads uniform pos + 1 - 0, clamped into the 3-entry table
    from tinyloop.runtime.sampling import sample_token
    assert tokens == [sample_token(host(logits), 1.0, 50, 1.0, utab[min(p + 1, 2)]) for p in range(3)]


# =============================================================================== benchmark
def _timer():
    try:
        import torch
        if torch.cuda.is_available():
            return torch
    except Exception:
        pass
    return None


def _time_us(fn, reps=200):
    """Median-free simple timing: graph replay of `reps` launches via PyTorch if present, else
    events around `reps` direct launches (then launch overhead dominates small kernels)."""
    torch = _timer()
    fn(0)
    cuda.synchronize()
    if torch is not None:
        s = torch.cuda.Stream()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            ns = cuda.external_stream(s.cuda_stream)
            for _ in range(reps):
                fn(ns)
        g.replay()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            e0 = torch.cuda.Event(enable_timing=True)
            e1 = torch.cuda.Event(enable_timing=True)
            e0.record()
            g.replay()
            e1.record()
            torch.cuda.synchronize()
            best = min(best, e0.elapsed_time(e1) * 1e3 / reps)
        return best
    e0, e1 = cuda.event(), cuda.event()
    e0.record()
    for _ in range(reps):
        fn(0)
    e1.record()
    e1.synchronize()
    return cuda.event_elapsed_time(e0, e1) * 1e3 / reps


@pytest.mark.skipif(not os.environ.get("TINYLOOP_BENCH"), reason="set TINYLOOP_BENCH=1 to time")
def test_bench_other_kernels():
    rng = np.random.default_rng(10)
    H, Hk, hd, S = 16, 4, 128, 8192
    kc = D(rng.standard_normal((1, S, Hk, hd)).astype(np.float16))
    vc = D(rng.standard_normal((1, S, Hk, hd)).astype(np.float16))
    res = []
    work, cnt = att_ws(1, H, hd)
    for ctx in (128, 1024, 8191):
        q = D(rng.standard_normal((1, H * hd)).astype(np.float32))
        o = D(np.zeros((1, H * hd), np.float32))
        pos = D(np.array([ctx - 1], np.int32))
        res.append((f"attention T=1 ctx={ctx}",
                    _time_us(lambda st: attention.attention(o, q, kc, vc, 0, pos, work, cnt, stream=st),
                             reps=20)))
        print(res[-1], flush=True)
    x = D(rng.standard_normal((1, 2048)).astype(np.float32))
    w = D(rng.standard_normal(2048).astype(np.float32))
    res.append(("rmsnorm 1x2048", _time_us(lambda st: rmsnorm.rmsnorm(x, x, w, 1e-5, stream=st))))
    lg = D(rng.standard_normal(151936).astype(np.float32))
    lg2 = D(rng.standard_normal((1, 151936)).astype(np.float32))
    tok = D(np.zeros(1, np.int32))
    res.append(("argmax V=151936", _time_us(lambda st: argmax.argmax(tok, lg2, stream=st), 50)))
    aw = argmax_ws(1)
    res.append(("argmax split V=151936", _time_us(lambda st: argmax.argmax(tok, lg2, stream=st, work=aw), 50)))
    sw, ut, ps = sample_work(), D(rng.random(8)), D(np.zeros(1, np.int32))
    for name, temp, k, p in (("sample top-k 50", 1.0, 50, 1.0), ("sample top-k 50 top-p 0.95", 0.8, 50, 0.95),
                             ("sample top-k 1024", 1.0, 1024, 1.0)):
        pf, pi = D(np.array([temp, p], np.float64)), D(np.array([k, 0], np.int32))
        res.append((name, _time_us(lambda st: sample.sample(tok, lg, pf, pi, ut, ps, 1, sw, stream=st), 20)))
    print()
    for name, us in res:
        print(f"{name:28s} {us:9.2f} us", flush=True)
