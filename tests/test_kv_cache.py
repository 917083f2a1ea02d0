"""The KV cache as a spec: codecs (fp32, fp16, int8, int4) against their numpy reference and the
float64 oracle, the sliding-window ring against the oracle with attention masked to the last W
positions, and the typed errors of bad cache settings (CPU backend; the CUDA backend runs the same
checks in tests/test_cuda_backend.py and tests/cuda/)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import arrays

import tinyloop as tl
from tinyloop.runtime.cache import CacheMode, KVCodec, SlotMap, build_spec
from tinyloop.runtime.compat import CompatWarning
from tinyloop.runtime.hookspecs import hookimpl
from tinyloop.runtime.plugins import get_plugin_manager
from tinyloop.model.reference import reference_logits
from tinyloop.plugins.caches.codecs import FP16Codec, FP32Codec, INT4Codec, INT8Codec

from conftest import logical_weights, write_tiny

CODECS = {"fp32": FP32Codec, "fp16": FP16Codec, "int8": INT8Codec, "int4": INT4Codec}
IDS = [3, 17, 42, 8, 91, 23, 11, 60, 2, 77] * 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv") / "tiny.tinyloop"
    cfg = write_tiny(path)
    m = tl.load_model(str(path), max_seq_len=128, backend="cpu")
    yield m, cfg, logical_weights(path), path
    tl.free_model(m)


# ----------------------------------------------------------------------------- codecs
rows = arrays(np.float32, st.tuples(st.integers(1, 4), st.sampled_from([2, 8, 64])),
              elements=st.floats(-1e4, 1e4, width=32))


@settings(max_examples=60, deadline=None)
@given(rows)
def test_int8_codes_and_error_bound(x):
    q, scale, zero = INT8Codec.encode(x)
    assert zero is None and q.dtype == np.int8 and scale.dtype == np.float32
    assert q.min() >= -127 and q.max() <= 127
    amax = np.abs(x).max(axis=-1)
    assert np.array_equal(scale, (amax / np.float32(127)).astype(np.float32))
    err = np.abs(INT8Codec.decode(q, scale, None).astype(np.float64) - x)
    assert np.all(err <= scale[:, None].astype(np.float64) * 0.5 * (1 + 1e-5) + 1e-30)


@settings(max_examples=60, deadline=None)
@given(rows)
def test_int4_codes_and_error_bound(x):
    packed, scale, zero = INT4Codec.encode(x)
    assert packed.dtype == np.uint8 and packed.shape[-1] == x.shape[-1] // 2
    q = INT4Codec.unpack(packed)
    assert q.max() <= 15
    assert np.array_equal(zero, x.min(axis=-1))
    err = np.abs(INT4Codec.decode(packed, scale, zero).astype(np.float64) - x)
    # half a step of rounding, plus float32 rounding of q * scale + lo at the row's magnitude
    mag = np.abs(x).max(axis=-1, keepdims=True).astype(np.float64)
    assert np.all(err <= scale[:, None] * 0.5 * (1 + 1e-5) + 4e-7 * mag + 1e-30)


@pytest.mark.parametrize("codec", [INT8Codec, INT4Codec])
def test_zero_and_constant_rows_are_exact(codec):
    x = np.zeros((2, 8), np.float32)
    x[1] = 3.25
    if codec is INT8Codec:
        x[1] = 0.0
    assert np.array_equal(codec.roundtrip(x), x)


def test_row_bytes():
    assert [CODECS[n].row_bytes(64) for n in ("fp32", "fp16", "int8", "int4")] == [256, 128, 68, 40]


def test_spec_layout_keeps_loop_layers_last():
    from tinyloop.model.arch import ModelConfig
    c = ModelConfig(vocab_size=97, d_model=64, n_heads=4, n_kv_heads=2, d_ff=96, n_pre=2, n_loop=3,
                    n_post=1, default_loops=3, max_loops=8)
    modes = get_plugin_manager().cache_modes()
    spec = build_spec(c, 4, modes["int8"], SlotMap(16), ("draft_post",))
    assert [g.name for g in spec.groups] == ["pre", "post", "draft_post", "loop"]
    assert spec.n_layers == 2 + 1 + 1 + 12 and spec.loops == 4
    assert spec.layer("pre", 1) == 1 and spec.layer("post", 0) == 2 and spec.layer("draft_post", 0) == 3
    assert spec.layer("loop", 2, iteration=3) == 4 + 3 * 3 + 2
    grown = spec.with_loops(6)
    # growing the loop iterations moves no other layer
    for part, i in (("pre", 0), ("pre", 1), ("post", 0), ("draft_post", 0)):
        assert grown.layer(part, i) == spec.layer(part, i)
    assert grown.layer("loop", 0, iteration=5) == spec.layer("loop", 0, iteration=0) + 15
    assert spec.group_of(spec.layer("loop", 1, iteration=2)) == (3, 7)
    assert spec.nbytes(2, 16, {"int8": INT8Codec}) == 2 * 16 * 16 * 2 * INT8Codec.row_bytes(16)


# ----------------------------------------------------------------------------- vs the oracle
@pytest.mark.parametrize("mode", ["fp32", "fp16", "int8", "int4"])
@pytest.mark.parametrize("loops", [1, 3, 8])
def test_logits_match_the_quantizing_oracle(tiny, mode, loops):
    """Each cache mode against the float64 reference that stores K/V through the same codec; the
    quantized modes are far from the exact oracle, so the check tells the codecs apart."""
    m, cfg, W, _ = tiny
    got = tl.score(m, IDS, loops=loops, cache_mode=mode)
    ref = reference_logits(cfg, W, IDS, loops, kv_codec=CODECS[mode])
    tol = {"fp32": 1e-5, "fp16": 5e-4, "int8": 1e-3, "int4": 1e-3}[mode]
    assert np.abs(got - ref).max() / np.abs(ref).max() < tol
    if mode in ("int8", "int4"):
        exact = reference_logits(cfg, W, IDS, loops)
        assert np.abs(got - exact).max() / np.abs(exact).max() > 10 * tol


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_cache_is_batch_invariant(tiny, mode):
    """Prefill in one launch, in chunks of 3 rows, and uncached give the same tokens."""
    m, _, _, path = tiny
    cfg = tl.GenerateConfig(max_tokens=12, loops=3, cache_mode=mode)
    ref = tl.generate(m, IDS[:17], cfg)
    with tl.load_model(str(path), max_seq_len=128, backend="cpu", prefill_chunk=3) as m3:
        assert tl.generate(m3, IDS[:17], cfg) == ref
    assert tl.score(m, IDS[:17], loops=3, cache_mode=mode)[-1].argmax() == ref[17]


def _oracle_check(cfg, W, seq, n_prompt, loops, window, codec=FP32Codec, margin=1e-3):
    """Each generated token is the argmax of the masked oracle's logits at the previous position,
    wherever the oracle's top-2 margin there is clear (checked up to the first near-tie)."""
    ref = reference_logits(cfg, W, seq[:-1], loops, kv_codec=codec, window=window)
    checked = 0
    for i in range(n_prompt - 1, len(seq) - 1):
        row = ref[i]
        top2 = np.sort(row)[-2:]
        if top2[1] - top2[0] < margin:
            break
        assert int(row.argmax()) == seq[i + 1], (i, window)
        checked += 1
    return checked


@pytest.mark.parametrize("window", [1, 5, 8, 40])
@pytest.mark.parametrize("n_prompt", [3, 8, 21])
def test_window_matches_masked_oracle(tiny, window, n_prompt):
    m, cfg, W, path = tiny
    prompt = IDS[:n_prompt]
    gen = tl.GenerateConfig(max_tokens=20, loops=3, cache_mode="fp32", cache_window=window)
    seq = tl.generate(m, prompt, gen)
    assert _oracle_check(cfg, W, seq, n_prompt, 3, window) >= 5
    # chunked prefill (4 rows a launch) and the uncached path give the same tokens
    with tl.load_model(str(path), max_seq_len=128, backend="cpu", prefill_chunk=4) as m4:
        assert tl.generate(m4, prompt, gen) == seq


def test_window_covering_everything_equals_no_window(tiny):
    m, _, _, _ = tiny
    a = tl.generate(m, IDS[:9], tl.GenerateConfig(max_tokens=16, cache_window=128))
    assert a == tl.generate(m, IDS[:9], tl.GenerateConfig(max_tokens=16))


def test_window_uncached_path(tiny, monkeypatch):
    m, _, _, _ = tiny
    cfg = tl.GenerateConfig(max_tokens=12, loops=2, cache_window=6, cache_mode="int8")
    ref = tl.generate(m, IDS[:10], cfg)
    monkeypatch.setenv("TINYLOOP_DISABLE_KV_CACHE", "1")
    assert tl.generate(m, IDS[:10], cfg) == ref


def test_window_memory_is_bounded_by_the_window(tiny):
    """The ring's size does not depend on max_tokens, and generation runs past W."""
    m, _, _, _ = tiny
    seen = {}
    for n in (20, 100):
        it = tl.generate_iter(m, IDS[:4], tl.GenerateConfig(max_tokens=n, cache_window=8))
        toks = []
        for t in it:
            toks.append(t)
            seen.setdefault(n, tl.vram_usage_bytes(m))
        assert len(toks) == n
    assert seen[20] == seen[100]


def test_window_speculative_equals_plain_windowed_greedy(spec_model):
    prompt = [3, 17, 42, 8, 91, 23, 11, 60, 2, 77]
    ref = tl.generate(spec_model, prompt, tl.GenerateConfig(max_tokens=24, loops=4, cache_window=6))
    with pytest.warns(CompatWarning, match="cache_window in speculative decoding is partial"):
        got = tl.generate_speculative(spec_model, prompt, tl.SpeculativeConfig(
            max_tokens=24, draft_loops=2, verify_loops=4, draft_ahead=3, cache_window=6))
    assert got == ref


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_speculative_and_beam_run_exactly(spec_model, mode):
    prompt = [3, 17, 42, 8, 91, 23, 11, 60, 2, 77]
    ref = tl.generate(spec_model, prompt, tl.GenerateConfig(max_tokens=16, loops=4, cache_mode=mode))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompatWarning)     # int4 x speculative is partial
        got = tl.generate_speculative(spec_model, prompt, tl.SpeculativeConfig(
            max_tokens=16, draft_loops=2, verify_loops=4, draft_ahead=3, cache_mode=mode))
    assert got == ref
    beam = tl.GenerateConfig(max_tokens=8, loops=2, beam_size=3, cache_mode=mode)
    assert tl.generate(spec_model, prompt, beam) == tl.generate(spec_model, prompt, beam)


# ----------------------------------------------------------------------------- bad input
def test_bad_cache_settings_are_typed_errors_before_allocation(tiny):
    m, _, _, _ = tiny
    before = tl.vram_usage_bytes(m)
    with pytest.raises(tl.ConfigError, match="cache_window"):
        tl.GenerateConfig(cache_window=-1)
    with pytest.raises(tl.ConfigError, match="cache_window"):
        tl.GenerateConfig(cache_window=1.5)
    with pytest.raises(tl.ConfigError, match=r"cache_window=129 exceeds the model's max_seq_len=128"):
        tl.generate(m, IDS[:4], tl.GenerateConfig(max_tokens=4, cache_window=129))
    with pytest.raises(tl.PluginError, match="cache_mode='int3' is not registered"):
        tl.generate(m, IDS[:4], tl.GenerateConfig(max_tokens=4, cache_mode="int3"))
    with pytest.raises(tl.IncompatibleModesError, match="cache_window"):
        tl.generate_batch(m, [IDS[:4]], tl.GenerateConfig(max_tokens=4, cache_window=8))
    with pytest.raises(tl.IncompatibleModesError, match="cache_window"):
        tl.generate_tree_speculative(m, IDS[:4], tl.TreeSpeculativeConfig(max_tokens=4, verify_loops=3,
                                                                           cache_window=8))
    assert tl.vram_usage_bytes(m) == before


class _NoCodecMode(CacheMode):
    name = "needs_missing_codec"
    codec = "e5m2"


class _CPULessCodec(KVCodec):
    name = "gpu_only"
    backend_impls = {"cuda": "nowhere:X"}


class _GpuOnlyMode(CacheMode):
    name = "gpu_only_mode"
    codec = "gpu_only"


class _Plugin:
    @hookimpl
    def tinyloop_cache_modes(self):
        return [_NoCodecMode, _GpuOnlyMode]

    @hookimpl
    def tinyloop_kv_codecs(self):
        return [_CPULessCodec]


def test_unknown_codec_and_missing_backend_impl(tiny):
    m, _, _, _ = tiny
    pm = get_plugin_manager()
    plugin = _Plugin()
    pm.register(plugin, name="test-kv-codecs")
    try:
        before = tl.vram_usage_bytes(m)
        with pytest.raises(tl.PluginError, match="KV codec 'e5m2' is not registered"):
            tl.generate(m, IDS[:4], tl.GenerateConfig(max_tokens=4, cache_mode="needs_missing_codec"))
        with pytest.raises(tl.PluginError, match="no implementation for the cpu backend"):
            tl.generate(m, IDS[:4], tl.GenerateConfig(max_tokens=4, cache_mode="gpu_only_mode"))
        assert tl.vram_usage_bytes(m) == before
    finally:
        pm.unregister(plugin)
