"""Edge cases of the KV-cache modes and windows on the CPU backend.

* the int8 / int4 codecs on rows a demanding user (or a diverging model) produces: ranges that
  overflow float32, values at +-FLT_MAX, +-inf and NaN, constant and tiny rows, each against a
  float64 model of the documented format written here (tinyloop/plugins/caches/codecs.py), and
  the CUDA kv_store kernel agreeing with the numpy reference on those rows (numba's simulator);
* every cache knob's bad values (types, ranges, numpy scalars) as typed errors before any work;
* windows smaller / equal / larger than the prompt, many ring wrap-arounds, windows over
  quantized caches, against the float64 oracle masked to the window (tinyloop.model.reference);
* max_seq_len boundaries, memory accounting per mode and window, and the compositions
  configs/compat.yaml allows (speculative, batch, prefix reuse, warm start) or rejects.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import arrays

import tinyloop as tl
from tinyloop.model.reference import reference_logits
from tinyloop.plugins.caches.codecs import FP32Codec, INT4Codec, INT8Codec
from tinyloop.runtime.compat import CompatWarning
from tinyloop.runtime.config import MAX_WINDOW
from tinyloop.runtime.plugins import get_plugin_manager

from conftest import logical_weights, write_tiny

ROOT = Path(__file__).resolve().parents[1]
F32 = np.float32
FMAX = float(np.finfo(np.float32).max)


def _encode(codec, x):
    """codec.encode with every numpy warning an error (the reference must not overflow or cast NaN)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with np.errstate(over="raise", invalid="raise", divide="raise", under="ignore"):
            return codec.encode(np.asarray(x, F32))


def _roundtrip(codec, x):
    data, scale, zero = _encode(codec, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with np.errstate(over="raise", invalid="raise", divide="raise", under="ignore"):
            return codec.decode(data, scale, zero), (data, scale, zero)


# ============================================================================ codecs: float64 model
def _int4_model(x):
    """float64 model of the documented int4 format for one finite row: (zero, step, grid top). A
    row whose range fits float32 is the ordinary grid lo .. hi; a wider one the widest grid the
    format reads back without overflow (15 steps of FLT_MAX / 15) centred on the row."""
    x = np.clip(np.asarray(x, np.float64), -FMAX, FMAX)
    lo, hi = x.min(), x.max()
    if hi - lo <= FMAX:
        return lo, (hi - lo) / 15, hi
    step = FMAX / 15
    z = (lo + hi) / 2 - 7.5 * step
    return z, step, z + 15 * step


WIDE_ROWS = [
    [-3e38, 3e38, 0.0, 1.0, -1.0, 2e38, -2e38, 5.0],
    [-FMAX, FMAX, 0.0, 0.0, FMAX, -FMAX, 1e37, -1e37],
    [-1.8e38, 1.7e38, 1e38, -1e38, 0.0, 3.0, 1.69e38, -1.79e38],
    [-2e37, FMAX, 3e38, 1e38, 0.0, 0.0, 0.0, 0.0],           # lo small: the span still overflows
    [-FMAX, 2e37, -3e38, 0.0, 0.0, 0.0, 0.0, -1.0],
]


@pytest.mark.parametrize("row", WIDE_ROWS)
def test_int4_row_wider_than_float_max_reads_back_finite_and_saturates(row):
    """The known defect: max - min overflows float32, and the int4 codec stored scale = inf and
    read the row back as NaN. Now the row keeps the widest grid the format decodes (centred on
    it): every value within it is within half a step, values beyond saturate to the end codes,
    order and the signs of the extremes are kept, nothing is NaN or inf."""
    x = np.array([row], F32)
    back, (data, scale, zero) = _roundtrip(INT4Codec, x)
    assert np.all(np.isfinite(back)) and np.isfinite(scale).all() and np.isfinite(zero).all()
    z, step, top = _int4_model(x[0])
    assert abs(float(scale[0]) - step) <= 1e-6 * step
    assert abs(float(zero[0]) - z) <= 1e-6 * FMAX
    want = np.clip(x[0].astype(np.float64), z, top)
    assert np.all(np.abs(back[0] - want) <= 0.5 * step * (1 + 1e-5) + 1e-6 * FMAX)
    order = np.argsort(x[0], kind="stable")
    assert np.all(np.diff(back[0][order].astype(np.float64)) >= 0)              # monotone
    assert back[0][np.argmax(x[0])] > 0 > back[0][np.argmin(x[0])]             # signs of the ends
    # the rows beside it in the same call are untouched by it
    both = np.concatenate([x, np.array([[0.5, -0.25, 3.0, 1.0, 2.0, 0.0, -4.0, 8.0]], F32)])
    assert np.array_equal(_encode(INT4Codec, both)[0][1], _encode(INT4Codec, both[1:])[0][0])


def test_int8_at_float_max_reads_back_finite():
    """127 * (FLT_MAX / 127) rounds past FLT_MAX: a row holding +-FLT_MAX read back +-inf."""
    x = np.array([[FMAX, -FMAX, 0.0, 1e38, -3e38, 5.0, 2e37, -1.0]], F32)
    back, (q, scale, _) = _roundtrip(INT8Codec, x)
    assert np.all(np.isfinite(back)) and q[0, 0] == 127 and q[0, 1] == -127
    step = FMAX / 127
    assert abs(float(scale[0]) - step) <= 1e-6 * step
    assert np.all(np.abs(back.astype(np.float64) - x) <= 0.5 * step * (1 + 1e-5) + 1e-6 * FMAX)
    # below FLT_MAX the scale is amax / 127 exactly, as before
    y = np.nextafter(F32(FMAX), F32(0)) * np.ones((1, 4), F32)
    assert _encode(INT8Codec, y)[1][0] == y[0, 0] / F32(127)


@pytest.mark.parametrize("codec", [INT8Codec, INT4Codec])
def test_infinities_are_stored_as_float_max(codec):
    """+-inf stores what +-FLT_MAX stores (the values saturate; the rest of the row keeps the
    grid those give), and reads back finite."""
    rows = np.array([[np.inf, 1.0, -2.0, 0.5, 0.0, 3.0, -1.0, 2.0],
                     [-np.inf, 1.0, -2.0, 0.5, 0.0, 3.0, -1.0, 2.0],
                     [np.inf, -np.inf, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
                     [np.inf] * 8, [-np.inf] * 8], F32)
    got = _encode(codec, rows)
    want = _encode(codec, np.clip(rows, -FMAX, FMAX))
    for g, w in zip(got, want):
        if w is not None:
            assert np.array_equal(g, w)
    back, _ = _roundtrip(codec, rows)
    assert np.all(np.isfinite(back))
    assert np.all(back[3] > 1e38) and np.all(back[4] < -1e38)


@pytest.mark.parametrize("codec", [INT8Codec, INT4Codec])
def test_nan_row_reads_back_nan_and_spares_its_neighbours(codec):
    """A row holding a NaN has no finite encoding: it reads back all NaN (as a float cache would
    carry the NaN on), with codes 0 (no undefined float->int cast), and the other rows of the
    call are stored as if alone."""
    rows = np.array([[np.nan, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0],
                     [0.5, -1.5, 2.25, 0.0, 1.0, -3.0, 7.0, 0.125],
                     [np.nan] * 8], F32)
    back, (data, scale, zero) = _roundtrip(codec, rows)
    assert np.isnan(back[0]).all() and np.isnan(back[2]).all()
    assert not np.any(data[[0, 2]])
    alone = _encode(codec, rows[1:2])
    assert np.array_equal(data[1], alone[0][0]) and scale[1] == alone[1][0]
    assert np.array_equal(back[1], codec.decode(*alone)[0])


CONSTANTS = [0.0, 1.0, -3.25, 1e-30, -1e-40, 2.0 ** -126, 7e37, -2e38, FMAX, -FMAX, 123456.789]


def test_int4_constant_rows_are_exact():
    x = np.array([[c] * 8 for c in CONSTANTS], F32)
    back, (data, scale, zero) = _roundtrip(INT4Codec, x)
    assert np.array_equal(back, x) and not data.any() and not scale.any()


def test_int8_tiny_and_zero_rows():
    """amax below 2**-120 stores codes 0 (127 / amax would overflow): the row reads back as 0,
    within amax of it; an all-zero row is exact."""
    x = np.array([[0.0] * 8, [1e-37, -2e-37, 0, 0, 0, 0, 0, 3e-38], [1e-45] * 8], F32)
    back, (q, scale, _) = _roundtrip(INT8Codec, x)
    assert not q.any() and np.array_equal(back, np.zeros_like(x))


def _float32_formula(codec, x):
    """The documented float32 formulas for ordinary finite rows, written out independently: what
    the codecs stored before the edge-case fixes (greedy tokens depend on these bits)."""
    x = np.asarray(x, F32)
    if codec is INT8Codec:
        amax = np.abs(x).max(-1)
        inv = np.array([F32(127) / a if a >= 2.0 ** -120 else F32(0) for a in amax.ravel()], F32).reshape(amax.shape)
        q = np.clip(np.rint(x * inv[..., None]), -127, 127).astype(np.int8)
        return q, (amax / F32(127)).astype(F32), None
    lo = x.min(-1)
    r = (x.max(-1) - lo).astype(F32)
    inv = np.array([F32(15) / v if v >= 2.0 ** -120 else F32(0) for v in r.ravel()], F32).reshape(r.shape)
    q = np.clip(np.rint((x - lo[..., None]) * inv[..., None]), 0, 15).astype(np.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8), (r / F32(15)).astype(F32), lo


@pytest.mark.parametrize("codec", [INT8Codec, INT4Codec])
def test_ordinary_rows_store_the_same_bits_as_before(codec):
    """Rows over many binades (tiny, huge but within range, ties of rint) store exactly the
    float32 formula's codes, scales and zero points."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((64, 2, 16)) * np.exp2(rng.integers(-60, 60, (64, 2, 1)))).astype(F32)
    x[0, 0] = np.resize(np.array([2.5, -3.5, 0.5, 127.0], F32), 16)
    x[1, 0] = np.resize(np.array([0.0, 15.0, 7.5, 0.5], F32), 16)
    x[2, 1] = 1e38 * np.resize(np.array([1, -1, 0.5], F32), 16)                 # range 2e38: fits
    got, want = _encode(codec, x), _float32_formula(codec, x)
    for g, w in zip(got, want):
        if w is not None:
            assert np.array_equal(g.view(np.uint8), np.asarray(w).view(np.uint8))


@pytest.mark.parametrize("codec", [INT8Codec, INT4Codec])
def test_roundtrip_error_bound_against_float64(codec):
    """|decode(encode(x)) - x| <= half a step (+ float32 rounding of the read-back), the step of
    the float64 model, over magnitudes from 1e-30 to 1e37."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((200, 16)) * np.exp2(rng.integers(-100, 124, (200, 1)))).astype(F32)
    back, _ = _roundtrip(codec, x)
    x64 = x.astype(np.float64)
    if codec is INT8Codec:
        step = np.abs(x64).max(-1, keepdims=True) / 127
    else:
        step = (x64.max(-1, keepdims=True) - x64.min(-1, keepdims=True)) / 15
    mag = np.abs(x64).max(-1, keepdims=True)
    assert np.all(np.abs(back - x64) <= 0.5 * step * (1 + 1e-5) + 4e-7 * mag)


any_rows = arrays(np.float32, st.tuples(st.integers(1, 3), st.sampled_from([2, 8, 16])),
                  elements=st.one_of(st.floats(width=32, allow_nan=True, allow_infinity=True),
                                     st.sampled_from([FMAX, -FMAX, 3e38, -3e38, 0.0, 1e-45])))


@settings(max_examples=150, deadline=None)
@given(any_rows)
def test_any_float32_rows_round_trip_as_documented(x):
    """Any float32 rows, specials included: no numpy warning, a NaN row reads back all NaN and
    every other row finite, monotone in x, and within half a step of x (+-inf as +-FLT_MAX; a row
    wider than FLT_MAX: of x clipped to its grid) by the float64 model."""
    for codec in (INT8Codec, INT4Codec):
        back, _ = _roundtrip(codec, x)
        for row, b in zip(x, back):
            if np.isnan(row).any():
                assert np.isnan(b).all()
                continue
            assert np.isfinite(b).all()
            xc = np.clip(row.astype(np.float64), -FMAX, FMAX)
            order = np.argsort(xc, kind="stable")
            assert np.all(np.diff(b[order].astype(np.float64)) >= 0)
            mag = np.abs(xc).max()
            if codec is INT8Codec:
                want, step = xc, mag / 127
            else:
                z, step, top = _int4_model(xc)
                want = np.clip(xc, z, top)
            assert np.all(np.abs(b - want) <= 0.5 * step * (1 + 1e-5) + 4e-7 * mag + 1e-30), (codec.name, row, b)


# ============================================================================ the CUDA codec agrees
def _edge_rows(hd):
    """(T, 1, hd) float32 rows of every edge kind, then two ordinary ones."""
    rows = [WIDE_ROWS[0], WIDE_ROWS[1], WIDE_ROWS[3],
            [FMAX, -FMAX, 0.0, 1e38, -3e38, 5.0, 2e37, -1.0],
            [np.inf, 1.0, -2.0, 0.5, 0.0, 3.0, -1.0, 2.0],
            [np.inf, -np.inf, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
            [np.nan, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0],
            [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, np.nan],
            [-2e38] * 8, [0.0] * 8, [1e-37, -2e-37, 0, 0, 0, 0, 0, 3e-38],
            [2.5, -3.5, 0.5, 127.0, 0.0, 15.0, 7.5, -0.5],
            [0.3, -1.7, 2.2, 0.01, -0.9, 5.5, 1.25, -4.0]]
    return np.array([np.resize(np.array(r, F32), hd) for r in rows], F32)[:, None, :]


def kv_store_edge_check(hd=8):
    """kv_store (the CUDA backend's quantized store: a real GPU, or numba's simulator) against the
    numpy reference on the edge rows: the same codes, scales and zero points (NaN where the
    reference has NaN)."""
    from numba import cuda
    from tinyloop.cuda import kv_codecs
    from tinyloop.cuda.kernels import kv_store
    x = _edge_rows(hd)
    T = x.shape[0]
    for codec, impl in ((INT8Codec, kv_codecs.INT8), (INT4Codec, kv_codecs.INT4)):
        def rows():
            return kv_codecs.Rows(cuda.to_device(np.zeros((1, T, 1, codec.data_cols(hd)), codec.data_dtype)),
                                  cuda.to_device(np.zeros((1, T, 1), F32)),
                                  cuda.to_device(np.zeros((1, T, 1), F32)) if codec.has_zero else None)
        kr, vr = rows(), rows()
        k = cuda.to_device(x.reshape(T, hd))
        v = cuda.to_device(np.ascontiguousarray(x[::-1]).reshape(T, hd))
        kv_store.kv_store(k, v, kr, vr, 0, cuda.to_device(np.array([0], np.int32)), impl)
        for src, got_rows in ((x, kr), (np.ascontiguousarray(x[::-1]), vr)):
            want = _encode(codec, src)
            got = [None if a is None else a.copy_to_host()[0] for a in got_rows]
            assert np.array_equal(got[0], want[0]), (codec.name, got[0], want[0])
            for g, w in zip(got[1:], want[1:]):
                if w is not None:
                    assert np.array_equal(g, w, equal_nan=True), (codec.name, g, w)


@pytest.mark.cudasim
def test_cuda_kv_store_edge_rows_equal_the_reference():
    import numba
    from numba import cuda
    if not numba.config.ENABLE_CUDASIM and not cuda.is_available():
        pytest.skip("needs NUMBA_ENABLE_CUDASIM=1 (set before numba is imported) or a CUDA GPU")
    kv_store_edge_check(8)
    kv_store_edge_check(68)            # lanes 0 and 1 hold a second dim pair


def test_cuda_kv_store_edge_rows_under_the_simulator():
    """The same check in a child process under numba's CUDA simulator (the main suite's process
    has numba without it), so the CUDA codec's agreement is checked wherever the suite runs."""
    code = ("import sys; sys.path.insert(0, 'tests'); import test_kv_cache_edges as t; "
            "t.kv_store_edge_check(8); print('ok')")
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


# ============================================================================ end to end: CPU backend
SEQ = 128
IDS = [3, 17, 42, 8, 91, 23, 11, 60, 2, 77, 5, 64, 31, 88, 14, 50]
CODECS = {"fp32": None, "int8": INT8Codec, "int4": INT4Codec}
#: bytes of one stored K or V row of head_dim values, per mode (written out, not asked of the codecs)
ROW_BYTES = {"fp32": lambda hd: 4 * hd, "fp16": lambda hd: 2 * hd, "int8": lambda hd: hd + 4,
             "int4": lambda hd: hd // 2 + 8}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv_edges") / "tiny.tinyloop"
    cfg = write_tiny(path)
    m = tl.load_model(str(path), max_seq_len=SEQ, backend="cpu")
    yield m, cfg, logical_weights(path), path
    tl.free_model(m)


def _oracle_agrees(cfg, W, seq, n_prompt, loops, window, codec, rel=2e-3):
    """Every generated token is the argmax of the float64 oracle's logits (K/V through `codec`,
    attention masked to the last `window` positions) at the position before it, wherever the
    oracle's top-2 margin is clear of the quantizing tolerance. The oracle reads the generated
    sequence (teacher forcing), so each position is checked on its own. Returns (checked, total)."""
    ref = reference_logits(cfg, W, seq[:-1], loops, kv_codec=codec or FP32Codec, window=window)
    checked = 0
    for i in range(n_prompt - 1, len(seq) - 1):
        row = ref[i]
        top2 = np.sort(row)[-2:]
        if top2[1] - top2[0] < rel * np.abs(row).max():
            continue
        assert int(row.argmax()) == seq[i + 1], (i, window)
        checked += 1
    return checked, len(seq) - n_prompt


# ---------------------------------------------------------------------------- knob validation
BAD_WINDOWS = [True, np.bool_(True), 2.0, np.float64(3.0), "4", None, 1.5, [4], -1, np.int64(-3), MAX_WINDOW + 1]
BAD_MODES = [None, 3, np.int64(1), b"int8", "", ["int8"], 8.0]


@pytest.mark.parametrize("cls", [tl.GenerateConfig, tl.SpeculativeConfig, tl.TreeSpeculativeConfig])
def test_bad_cache_knob_types_and_ranges_are_config_errors(cls):
    for v in BAD_WINDOWS:
        with pytest.raises(tl.ConfigError, match="cache_window") as e:
            cls(cache_window=v)
        assert repr(v) in str(e.value) or str(v) in str(e.value)
    for v in BAD_MODES:
        with pytest.raises(tl.ConfigError, match="cache_mode") as e:
            cls(cache_mode=v)
        assert repr(v) in str(e.value)
    # numpy integers are integers, stored as the Python int they hold
    for v in (np.int64(5), np.uint16(5), np.int8(5)):
        c = cls(cache_window=v)
        assert c.cache_window == 5 and type(c.cache_window) is int
    assert cls(cache_window=np.int32(0)).cache_window == 0


def test_bad_cache_requests_fail_before_any_work_and_leak_nothing(tiny):
    """Each entry point refuses an unregistered cache mode (PluginError naming it and the
    registered ones) and a window past max_seq_len (ConfigError naming both) before allocating,
    and the model is free for the next request."""
    m = tiny[0]
    before, handles = tl.vram_usage_bytes(m), len(tl.live_handles())
    pool = tl.create_prefix_pool(2)
    calls = {
        "generate": lambda c: tl.generate(m, IDS[:4], c),
        "generate_iter": lambda c: tl.generate_iter(m, IDS[:4], c),
        "generate_stream": lambda c: tl.generate_stream(m, IDS[:4], c, on_token=lambda t, p: True),
        "generate_batch": lambda c: tl.generate_batch(m, [IDS[:4], IDS[:2]], c.replace(cache_window=0)
                                                      if c.cache_window else c),
        "speculative": lambda c: tl.generate_speculative(m, IDS[:4], tl.SpeculativeConfig(
            max_tokens=4, verify_loops=3, cache_mode=c.cache_mode, cache_window=c.cache_window)),
    }
    for name, call in calls.items():
        for mode in ("int3", "INT8", "int8 "):
            with pytest.raises(tl.PluginError, match=rf"cache_mode={mode!r} is not registered.*int4"):
                call(tl.GenerateConfig(max_tokens=4, cache_mode=mode))
        if name != "generate_batch":
            with pytest.raises(tl.ConfigError, match=rf"cache_window={SEQ + 1} exceeds the model's max_seq_len={SEQ}"):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", CompatWarning)     # a window is partial in speculation
                    call(tl.GenerateConfig(max_tokens=4, cache_window=SEQ + 1))
    for bad, err in (("int3", tl.PluginError), (None, tl.ConfigError), (4, tl.ConfigError)):
        with pytest.raises(err, match="cache_mode"):
            tl.score(m, IDS[:4], cache_mode=bad)
        with pytest.raises(err, match="cache_mode"):
            tl.build_prefix_cache(m, IDS[:4], loops=2, cache_mode=bad)
        with pytest.raises(err, match="cache_mode"):
            tl.register_prefix(pool, m, IDS[:4], loops=2, cache_mode=bad)
    assert tl.vram_usage_bytes(m) == before and len(tl.live_handles()) == handles
    assert pool.stats()["entries"] == 0 and pool.stats()["bytes"] == 0
    tl.free_prefix_pool(pool)
    assert len(tl.generate(m, IDS[:4], tl.GenerateConfig(max_tokens=3, cache_mode="int4"))) == 7


@pytest.mark.parametrize("mode", ["fp16", "int8", "int4"])
def test_reuse_and_resume_with_a_window_are_rejected(tiny, mode):
    """compat.yaml rejects windows for prefix reuse and warm start: IncompatibleModesError naming
    the rule, nothing allocated, and the kept state still serves a plain request exactly."""
    m = tiny[0]
    pc = tl.build_prefix_cache(m, IDS[:8], loops=3, cache_mode=mode)
    handle = tl.build_resume_handle(m, IDS[:8], 2, tl.GenerateConfig(max_tokens=4, cache_mode=mode))
    pool = tl.create_prefix_pool(2)
    tl.register_prefix(pool, m, IDS[:8], loops=3, cache_mode=mode)
    try:
        before = tl.vram_usage_bytes(m)
        win = tl.GenerateConfig(max_tokens=4, cache_mode=mode, cache_window=4)
        for call in (lambda: tl.generate_from_prefix_cache(m, pc, IDS[8:10], win),
                     lambda: tl.generate_with_pool(m, pool, IDS[:10], win.replace(loops=3)),
                     lambda: tl.resume_generate(handle, 4, win),
                     lambda: tl.build_resume_handle(m, IDS[:8], 2, win)):
            with pytest.raises(tl.IncompatibleModesError, match="cache_window.*(prefix_reuse|warm_start)"):
                call()
        assert tl.vram_usage_bytes(m) == before
        plain = tl.GenerateConfig(max_tokens=4, cache_mode=mode)
        assert (tl.generate_from_prefix_cache(m, pc, IDS[8:10], plain)
                == tl.generate(m, IDS[:10], plain.replace(loops=3)))
        assert tl.resume_generate(handle, 4, plain) == tl.generate(m, IDS[:8], plain.replace(loops=4))
    finally:
        tl.free_prefix_cache(pc)
        tl.free_resume_handle(handle)
        tl.free_prefix_pool(pool)


# ---------------------------------------------------------------------------- windows vs the oracle
@pytest.mark.parametrize("mode", ["fp32", "int8", "int4"])
@pytest.mark.parametrize("window", [1, 7, 8, 9, SEQ])
def test_window_around_the_prompt_length_matches_the_masked_oracle(tiny, mode, window):
    """Windows smaller than, one below, equal to, one past and far past an 8-token prompt, over
    each storage mode, against the oracle that stores K/V through the same codec and attends to
    the last W positions; chunked prefill (3 rows a launch) and the uncached path agree."""
    m, cfg, W, path = tiny
    n = 8
    gen = tl.GenerateConfig(max_tokens=24, loops=3, cache_mode=mode, cache_window=window)
    seq = tl.generate(m, IDS[:n], gen)
    checked, total = _oracle_agrees(cfg, W, seq, n, 3, window, CODECS[mode])
    assert checked >= total * 0.7
    with tl.load_model(str(path), max_seq_len=SEQ, backend="cpu", prefill_chunk=3) as m3:
        assert tl.generate(m3, IDS[:n], gen) == seq
    if window == SEQ:
        assert seq == tl.generate(m, IDS[:n], gen.replace(cache_window=0))


@pytest.mark.parametrize("mode,window", [("int4", 3), ("int8", 1), ("fp32", 5)])
def test_ring_wraps_many_times_up_to_max_seq_len(tiny, mode, window, monkeypatch):
    """prompt + max_tokens exactly at max_seq_len with a small window: the ring (W + W - 1 slots)
    wraps ~25-100 times; every token agrees with the masked oracle where it is decisive, and the
    uncached path (every position recomputed under the window) gives the same tokens."""
    m, cfg, W, _ = tiny
    n = 5
    gen = tl.GenerateConfig(max_tokens=SEQ - n, loops=2, cache_mode=mode, cache_window=window)
    seq = tl.generate(m, IDS[:n], gen)
    assert len(seq) == SEQ
    checked, total = _oracle_agrees(cfg, W, seq, n, 2, window, CODECS[mode])
    assert checked >= total * 0.7
    monkeypatch.setenv("TINYLOOP_DISABLE_KV_CACHE", "1")
    assert tl.generate(m, IDS[:n], gen) == seq


def test_window_streams_and_iterates_the_same_tokens(tiny):
    m = tiny[0]
    gen = tl.GenerateConfig(max_tokens=40, loops=3, cache_mode="int4", cache_window=4)
    seq = tl.generate(m, IDS[:6], gen)
    got = []
    stats = tl.GenerateStats()
    tl.generate_stream(m, IDS[:6], gen, on_token=lambda t, p: got.append((t, p)) or True, stats=stats)
    assert [t for t, _ in got] == seq[6:] and [p for _, p in got] == list(range(6, 46))
    assert list(tl.generate_iter(m, IDS[:6], gen)) == seq[6:]
    assert stats.tokens_emitted == 40 and stats.stop_reason == tl.StopReason.MAX_TOKENS


# ---------------------------------------------------------------------------- max_seq_len boundaries
@pytest.mark.parametrize("mode", ["fp32", "fp16", "int8", "int4"])
@pytest.mark.parametrize("window", [0, 4])
def test_prompt_plus_max_tokens_at_and_past_max_seq_len(tiny, mode, window):
    m = tiny[0]
    before = tl.vram_usage_bytes(m)
    n = 10
    gen = tl.GenerateConfig(max_tokens=SEQ - n, loops=2, cache_mode=mode, cache_window=window)
    assert len(tl.generate(m, IDS[:n], gen)) == SEQ
    over = gen.replace(max_tokens=SEQ - n + 1)
    msg = rf"prompt_len \({n}\) \+ max_tokens \({SEQ - n + 1}\) = {SEQ + 1} exceeds max_seq_len={SEQ}"
    with pytest.raises(tl.InvalidInputError, match=msg):
        tl.generate(m, IDS[:n], over)
    with pytest.raises(tl.InvalidInputError, match=msg):
        tl.generate_iter(m, IDS[:n], over)
    with pytest.raises(tl.InvalidInputError, match="exceeds max_seq_len"):
        tl.generate(m, (IDS * 9)[:SEQ + 1], gen.replace(max_tokens=0))
    assert len(tl.generate(m, (IDS * 9)[:SEQ], gen.replace(max_tokens=0))) == SEQ
    assert tl.vram_usage_bytes(m) == before


# ---------------------------------------------------------------------------- memory accounting
@pytest.mark.parametrize("mode", ["fp32", "fp16", "int8", "int4"])
def test_cache_bytes_reported_per_mode_and_window(tiny, mode):
    """vram_usage_bytes while a request decodes = the bytes of its K and V storage, computed here
    from the model's shape: (n_pre + n_post + loops * n_loop) layers x slots x n_kv_heads rows of
    the mode's row size, slots = prompt + max_tokens, or W + min(W, workspace rows) - 1 for a ring
    (at most the positions); back to the baseline afterwards. inspect() reports the same bytes for a
    full-length request."""
    m, cfg, _, path = tiny
    hd, loops = cfg.d_model // cfg.n_heads, 3
    layers = cfg.n_pre + cfg.n_post + loops * cfg.n_loop
    rows = m.ws.rows
    base = tl.vram_usage_bytes(m)
    for window, n, max_tokens in ((0, 6, 30), (1, 6, 60), (5, 6, 60), (7, 3, 2), (SEQ, 6, 30)):
        it = tl.generate_iter(m, IDS[:n], tl.GenerateConfig(max_tokens=max_tokens, loops=loops, cache_mode=mode,
                                                            cache_window=window))
        next(it)
        live = tl.vram_usage_bytes(m) - base
        it.close()
        slots = n + max_tokens
        if window:
            slots = min(slots, window + min(window, rows) - 1)
        assert live == 2 * layers * slots * cfg.n_kv_heads * ROW_BYTES[mode](hd), (window, n, max_tokens)
        assert tl.vram_usage_bytes(m) == base
    est = tl.inspect(str(path), max_seq_len=SEQ, loops=loops)["memory"]["backends"]["cpu"]["cache_modes"][mode]
    assert est["kv_cache_bytes"] == 2 * layers * SEQ * cfg.n_kv_heads * ROW_BYTES[mode](hd)
    # a speculative session: the draft's post layers and draft_ahead + 1 slots more (a ring: the
    # verify launch's rows)
    da = 4
    for window, slots in ((0, 6 + 20 + da + 1), (3, 3 + (da + 1) - 1)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CompatWarning)      # window / int4 x speculative: partial
            it = tl.generate_iter(m, IDS[:6], tl.GenerateConfig(
                max_tokens=20, cache_mode=mode, cache_window=window, decoder="speculative",
                options={"draft_loops": 1, "verify_loops": loops, "draft_ahead": da}))
            next(it)
        live = tl.vram_usage_bytes(m) - base
        it.close()
        assert live == 2 * (layers + cfg.n_post) * slots * cfg.n_kv_heads * ROW_BYTES[mode](hd), window
    # a prefix cache: its prompt's slots, counted until freed
    pc = tl.build_prefix_cache(m, IDS[:9], loops=loops, cache_mode=mode)
    want = 2 * layers * 9 * cfg.n_kv_heads * ROW_BYTES[mode](hd)
    assert tl.vram_usage_bytes(m) - base == want == pc.nbytes
    assert [h["bytes"] for h in tl.live_handles(m)] == [want]
    tl.free_prefix_cache(pc)
    assert tl.vram_usage_bytes(m) == base


# ---------------------------------------------------------------------------- compositions
@pytest.mark.parametrize("mode", ["fp16", "int8", "int4"])
def test_speculative_with_window_and_quantized_cache_equals_plain(tiny, mode):
    """Chain speculation over a window (compat: partial, a CompatWarning) and a quantized cache
    gives plain windowed greedy's tokens, for draft_ahead below, at and past the window."""
    m = tiny[0]
    for window, da in ((2, 1), (3, 3), (3, 6)):
        ref = tl.generate(m, IDS[:7], tl.GenerateConfig(max_tokens=30, loops=4, cache_mode=mode, cache_window=window))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = tl.generate_speculative(m, IDS[:7], tl.SpeculativeConfig(
                max_tokens=30, draft_loops=2, verify_loops=4, draft_ahead=da, cache_mode=mode, cache_window=window))
        assert got == ref, (window, da)
        partial = sorted(str(w.message).split(" in ")[0] for w in seen if issubclass(w.category, CompatWarning))
        assert partial == (["mode cache_window", "mode int4_cache"] if mode == "int4" else ["mode cache_window"])


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_batch_equals_generate_and_window_batch_is_rejected(tiny, mode):
    m = tiny[0]
    prompts = [IDS[:3], IDS[2:13], IDS[5:6]]
    cfg = tl.GenerateConfig(max_tokens=12, loops=3, cache_mode=mode)
    assert tl.generate_batch(m, prompts, cfg) == [tl.generate(m, p, cfg) for p in prompts]
    before = tl.vram_usage_bytes(m)
    with pytest.raises(tl.IncompatibleModesError, match="cache_window.*batched"):
        tl.generate_batch(m, prompts, cfg.replace(cache_window=4))
    with pytest.raises(tl.IncompatibleModesError, match="cache_window.*tree_speculative"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CompatWarning)       # int4 x tree: partial
            tl.generate_tree_speculative(m, IDS[:4], tl.TreeSpeculativeConfig(
                max_tokens=4, verify_loops=3, cache_mode=mode, cache_window=4))
    assert tl.vram_usage_bytes(m) == before


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_prefix_reuse_at_max_seq_len_is_exact(tiny, mode):
    m = tiny[0]
    pc = tl.build_prefix_cache(m, IDS[:12], loops=2, cache_mode=mode)
    try:
        cfg = tl.GenerateConfig(max_tokens=SEQ - 14, cache_mode=mode)
        got = tl.generate_from_prefix_cache(m, pc, IDS[12:14], cfg)
        assert len(got) == SEQ and got == tl.generate(m, IDS[:14], cfg.replace(loops=2))
        with pytest.raises(tl.ConfigError, match="cache_mode='fp16' differs"):
            tl.generate_from_prefix_cache(m, pc, IDS[12:14], cfg.replace(cache_mode="fp16"))
    finally:
        tl.free_prefix_cache(pc)


def test_window_slot_map_never_holds_fewer_slots_than_its_window():
    """Backends refuse a ring of fewer slots than its window (the CUDA kernels check window <= S,
    and round only the slots: a request shorter than its window, e.g. cache_window=300 over 25
    positions, failed with a BackendError there). A window that covers every position of the
    request is the linear map (attention over all positions either way, same keys, same order);
    a longer request gets a ring of at least W slots."""
    pm = get_plugin_manager()
    for W in (1, 2, 5, 8, 300):
        mode = pm.slot_map_for(tl.GenerateConfig(cache_window=W))
        for positions in sorted({1, 2, max(1, W - 1), W, W + 1, 3 * W + 7}):
            for rows in (1, 3, 512):
                sm = mode.slot_map(positions, mode.launch_rows(rows))
                if positions <= W:
                    assert not sm.ring and sm.n_slots == positions, (W, positions, rows, sm)
                else:
                    assert sm.ring and sm.window == W, (W, positions, rows, sm)
                    assert W <= sm.n_slots == min(positions, W + min(W, rows) - 1), (W, positions, rows, sm)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_window_over_quantized_cache_with_every_single_decoder(tiny, mode, monkeypatch):
    """Beam search, seeded sampling, repetition penalty and early exit (recompute) over a ring
    of a quantized cache: chunked prefill (2 rows a launch) and the uncached path give the same
    tokens as the cached request."""
    m, _, _, path = tiny
    base = tl.GenerateConfig(max_tokens=20, loops=3, cache_mode=mode, cache_window=3)
    cfgs = [base.replace(beam_size=3), base.replace(temperature=0.8, top_k=20, sample_seed=9),
            base.replace(repetition_penalty=1.3),
            base.replace(loops=4, cache_window=2, early_exit_patience=1, early_exit_min_L=1,
                         early_exit_kv="recompute")]
    want = [tl.generate(m, IDS[:9], c) for c in cfgs]
    assert all(len(w) == 29 for w in want)
    with tl.load_model(str(path), max_seq_len=SEQ, backend="cpu", prefill_chunk=2) as m2:
        assert [tl.generate(m2, IDS[:9], c) for c in cfgs] == want
    monkeypatch.setenv("TINYLOOP_DISABLE_KV_CACHE", "1")
    assert [tl.generate(m, IDS[:9], c) for c in cfgs] == want
