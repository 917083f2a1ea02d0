"""Edges of the KV-cache modes, windows and cache reuse on the CPU backend (the shipped demo model):
numpy integers where an int is asked for, typed errors that name the value, a resume handle's build
config honoured, a refused pool registration that leaves the pool as it was, directly constructed
handle classes, and a few exactness checks the suites do not make (early exit from a prefix cache,
quantized windows against the masked quantizing oracle, prompts at max_seq_len)."""

from __future__ import annotations

import numpy as np
import pytest

import tinyloop as tl

from conftest import logical_weights, write_tiny
from reuse_suite import _no_cap  # noqa: F401  (autouse: no handle-bytes cap, CompatWarning quiet)

G = tl.GenerateConfig


@pytest.fixture(scope="module")
def m():
    model = tl.load_model("demo", backend="cpu", max_seq_len=64, prefill_chunk=8)
    yield model
    tl.free_model(model)




def _prompt(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(1, 4096, n)]


def _no_alloc(model, monkeypatch):
    """A list that records every backend allocation made from now on."""
    seen = []
    for name in ("alloc_cache", "alloc_kept_cache", "alloc_rows"):
        real = getattr(model.backend, name)
        monkeypatch.setattr(model.backend, name, lambda *a, _r=real: seen.append(a) or _r(*a))
    return seen


# ----------------------------------------------------------------------------- numpy integers
def test_numpy_integers_work_where_an_int_is_asked_for(m):
    p = _prompt(20, 1)
    pc = tl.build_prefix_cache(m, p[:9], loops=np.int64(2))
    try:
        assert type(pc.loops) is int and pc.loops == 2
        c = G(max_tokens=6, loops=2)
        assert tl.generate_from_prefix_cache(m, pc, p[9:], c) == tl.generate(m, p, c)
    finally:
        tl.free_prefix_cache(pc)
    pool = tl.create_prefix_pool(np.int64(2), max_bytes=np.int32(1 << 30))
    try:
        assert type(pool.capacity) is int and type(pool.max_bytes) is int
        e = tl.register_prefix(pool, m, p[:7], loops=np.int32(3))
        assert e.loops == 3
        st = tl.GenerateStats()
        assert tl.generate_with_pool(m, pool, p, G(max_tokens=6, loops=3), stats=st) == \
            tl.generate(m, p, G(max_tokens=6, loops=3))
        assert st.reused_tokens == 7
    finally:
        tl.free_prefix_pool(pool)
    h = tl.build_resume_handle(m, p, np.int64(1))
    try:
        assert type(h.loops_used) is int
        assert tl.resume_generate(h, np.int16(3), G(max_tokens=6)) == tl.generate(m, p, G(max_tokens=6, loops=3))
        assert h.depths == [1, 3] and all(type(d) is int for d in h.depths)
    finally:
        tl.free_resume_handle(h)
    tl.set_handle_bytes_cap(np.int64(1 << 40))
    c = G(max_tokens=6, cache_window=np.int64(4))
    assert type(c.cache_window) is int and c.cache_window == 4
    assert tl.generate(m, p, c) == tl.generate(m, p, G(max_tokens=6, cache_window=4))


@pytest.mark.parametrize("call, match", [
    (lambda m, p: tl.build_prefix_cache(m, p, loops=2.0), r"loops=2\.0 must be an integer"),
    (lambda m, p: tl.build_prefix_cache(m, p, loops="2"), r"loops='2' must be an integer"),
    (lambda m, p: tl.build_prefix_cache(m, p, loops=np.bool_(True)), r"loops=.*True.* must be an integer"),
    (lambda m, p: tl.register_prefix(tl.create_prefix_pool(1), m, p, loops=1.5), r"loops=1\.5 must be an integer"),
    (lambda m, p: tl.build_resume_handle(m, p, np.float64(2.0)), r"loops_used=.*2\.0.* must be an integer"),
    (lambda m, p: tl.create_prefix_pool(np.float32(2)), r"capacity=.* must be an integer"),
    (lambda m, p: G(cache_window=np.float64(4)), r"cache_window must be an integer"),
    (lambda m, p: G(cache_window=np.bool_(True)), r"cache_window must be an integer"),
])
def test_non_integers_are_named_as_such(m, monkeypatch, call, match):
    seen = _no_alloc(m, monkeypatch)
    base = tl.vram_usage_bytes(m)
    with pytest.raises(tl.ConfigError, match=match):
        call(m, _prompt(6, 2))
    assert seen == [] and tl.vram_usage_bytes(m) == base


@pytest.mark.parametrize("bad, match", [
    (None, r"loops_new=None must be an integer in \[1, 16\]"),
    (3.0, r"loops_new=3\.0 must be an integer in \[1, 16\]"),
    (True, r"loops_new=True must be an integer in \[1, 16\]"),
    (17, r"loops_new=17 is outside the allowed range \[1, 16\]"),
])
def test_resume_depth_errors_name_loops_new(m, monkeypatch, bad, match):
    p = _prompt(10, 3)
    h = tl.build_resume_handle(m, p, 4)
    try:
        n = h.nbytes
        seen = _no_alloc(m, monkeypatch)
        with pytest.raises(tl.ConfigError, match=match):
            tl.resume_generate(h, bad, G(max_tokens=4))
        with pytest.raises(tl.ConfigError, match=match):
            tl.resume_generate_iter(h, bad, G(max_tokens=4))
        assert seen == [] and h.nbytes == n and h.depths == [4]
    finally:
        tl.free_resume_handle(h)


# ----------------------------------------------------------------------------- resume handle's build config
def test_resume_handle_serves_the_config_it_was_built_with(m):
    """build_resume_handle's config is "the settings the handle will serve": resume_generate
    without a config decodes with them (cache mode, max_tokens, sampling), not with the defaults."""
    p = _prompt(14, 4)
    built = G(max_tokens=5, cache_mode="int8", temperature=0.8, top_k=20, sample_seed=11)
    h = tl.build_resume_handle(m, p, 2, built)
    try:
        for L in (2, 5):
            got = tl.resume_generate(h, L)
            assert got == tl.generate(m, p, built.replace(loops=L)), L
            assert len(got) == len(p) + 5
            assert [*p, *tl.resume_generate_iter(h, L)] == got
        # an explicit config still wins (its cache mode must be the handle's)
        assert tl.resume_generate(h, 3, G(max_tokens=3, cache_mode="int8")) == \
            tl.generate(m, p, G(max_tokens=3, cache_mode="int8", loops=3))
    finally:
        tl.free_resume_handle(h)


def test_resume_build_config_is_checked_against_the_prompt(m, monkeypatch):
    """The build config is checked as a request now: a max_tokens that can never fit the prompt is
    refused before any prefill, not at every resume."""
    p = _prompt(40, 5)
    seen = _no_alloc(m, monkeypatch)
    base = tl.live_handle_bytes()
    with pytest.raises(tl.InvalidInputError, match=r"max_tokens \(30\).*exceeds max_seq_len=64"):
        tl.build_resume_handle(m, p, 2, G(max_tokens=30))
    assert seen == [] and tl.live_handle_bytes() == base


# ----------------------------------------------------------------------------- pools and the handle cap
def test_a_refused_registration_leaves_the_pool_as_it_was(m):
    p = _prompt(40, 6)
    pool = tl.create_prefix_pool(1)
    try:
        a = tl.register_prefix(pool, m, p[:10])
        tl.set_handle_bytes_cap(a.nbytes + 10)
        with pytest.raises(tl.HandleBudgetError, match="live handle cap"):
            tl.register_prefix(pool, m, p[:20])            # can never fit the cap
        assert a.alive
        s = pool.stats()
        assert (s["entries"], s["evictions"]) == (1, 0)
        st = tl.GenerateStats()
        assert tl.generate_with_pool(m, pool, p[:16], G(max_tokens=4), stats=st) == \
            tl.generate(m, p[:16], G(max_tokens=4))
        assert st.reused_tokens == 10
    finally:
        tl.set_handle_bytes_cap(None)
        tl.free_prefix_pool(pool)


# ----------------------------------------------------------------------------- the handle classes themselves
def test_directly_constructed_handles_are_typed_errors(m):
    p = _prompt(12, 7)
    with pytest.raises(tl.ConfigError, match="capacity=-1"):
        tl.PrefixPool(-1, None)
    with pytest.raises(tl.ConfigError, match="max_bytes=0"):
        tl.PrefixPool(2, 0)
    with pytest.raises(tl.InvalidInputError, match="model must be a Model"):
        tl.PrefixCache("model", p, 4, "fp16")
    with pytest.raises(tl.InvalidInputError, match="model must be a Model"):
        tl.ResumeHandle(None, p, 4, "fp16")
    pc = tl.PrefixCache(m, p, 4, "fp16")
    h = tl.ResumeHandle(m, p, 4, "fp16")
    assert not pc.alive and not h.alive
    with pytest.raises(tl.InvalidInputError, match="build_prefix_cache"):
        tl.generate_from_prefix_cache(m, pc, [1], G(max_tokens=2))
    with pytest.raises(tl.InvalidInputError, match="build_resume_handle"):
        tl.resume_generate(h, 5, G(max_tokens=2))
    with pytest.raises(tl.InvalidInputError, match="build_prefix_cache"):
        tl.free_prefix_cache(pc)
    with pytest.raises(tl.InvalidInputError, match="build_resume_handle"):
        tl.free_resume_handle(h)
    assert tl.live_handles(m) == []


# ----------------------------------------------------------------------------- exactness edges
def test_prompts_at_max_seq_len_and_one_token_prompts(m):
    full = _prompt(64, 8)
    pc = tl.build_prefix_cache(m, full)
    h = tl.build_resume_handle(m, full, 1)
    try:
        assert tl.generate_from_prefix_cache(m, pc, [], G(max_tokens=0)) == full
        assert tl.resume_generate(h, 3, G(max_tokens=0)) == full
        with pytest.raises(tl.InvalidInputError, match="max_seq_len=64"):
            tl.generate_from_prefix_cache(m, pc, [], G(max_tokens=1))
        with pytest.raises(tl.InvalidInputError, match="max_seq_len=64"):
            tl.resume_generate(h, 3, G(max_tokens=1))
    finally:
        tl.free_prefix_cache(pc)
        tl.free_resume_handle(h)
    one = [77]
    pc = tl.build_prefix_cache(m, one, loops=3)
    h = tl.build_resume_handle(m, one, 1)
    try:
        c = G(max_tokens=6, loops=3)
        # the same handle twice, and two handles interleaved
        for _ in range(2):
            assert tl.generate_from_prefix_cache(m, pc, [], c) == tl.generate(m, one, c)
            assert tl.resume_generate(h, 3, G(max_tokens=6)) == tl.generate(m, one, c)
        assert tl.generate_from_prefix_cache(m, pc, [5, 6], c) == tl.generate(m, one + [5, 6], c)
    finally:
        tl.free_prefix_cache(pc)
        tl.free_resume_handle(h)


def test_early_exit_from_a_prefix_cache_equals_plain_early_exit(m):
    """compat.yaml: early exit is ok with prefix reuse; the per-token depths and tokens match."""
    p = _prompt(24, 9)
    pc = tl.build_prefix_cache(m, p[:15], loops=8)
    try:
        for c in (G(max_tokens=10, loops=8, early_exit_patience=1),
                  G(max_tokens=10, loops=8, early_exit_patience=1, early_exit_kv="recompute")):
            a, b = tl.GenerateStats(), tl.GenerateStats()
            assert tl.generate_from_prefix_cache(m, pc, p[15:], c, stats=a) == tl.generate(m, p, c, stats=b)
            assert a.token_loops == b.token_loops and a.reused_tokens == 15
    finally:
        tl.free_prefix_cache(pc)


@pytest.mark.parametrize("mode", ["fp16", "int8", "int4"])
def test_quantized_windows_match_the_masked_quantizing_oracle(tmp_path, mode):
    """README: the window works with every cache mode. Each generated token is the argmax of the
    float64 oracle that stores K/V through the same codec and masks attention to the window."""
    from tinyloop.model.reference import reference_logits
    from tinyloop.plugins.caches.codecs import FP16Codec, INT4Codec, INT8Codec
    codec = {"fp16": FP16Codec, "int8": INT8Codec, "int4": INT4Codec}[mode]
    path = tmp_path / "tiny.tinyloop"
    cfg = write_tiny(path)
    W = logical_weights(path)
    ids = [3, 17, 42, 8, 91, 23, 11, 60, 2, 77] * 2
    with tl.load_model(str(path), max_seq_len=64, backend="cpu", prefill_chunk=3) as model:
        for window in (1, 4, 7):
            seq = tl.generate(model, ids, G(max_tokens=10, loops=3, cache_mode=mode, cache_window=window))
            ref = reference_logits(cfg, W, seq[:-1], 3, kv_codec=codec, window=window)
            checked = 0
            for i in range(len(ids) - 1, len(seq) - 1):
                top2 = np.sort(ref[i])[-2:]
                if top2[1] - top2[0] < 1e-3:
                    break
                assert int(ref[i].argmax()) == seq[i + 1], (mode, window, i)
                checked += 1
            assert checked >= 3, (mode, window)


# ----------------------------------------------------------------------------- the CLI
def test_run_header_names_the_resume_depths(tmp_path, capsys):
    """A `resume:` run decodes at its depths; the header used to announce the model's default depth
    (loops=4), at which nothing was decoded."""
    from tinyloop.cli.main import main
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text('model: ""\nbackend: cpu\nmax_seq_len: 64\nstream: false\nprompts: ["def f(x):"]\n'
                   'generate: {max_tokens: 2}\nresume: {loops_used: 2, depths: [3, 5]}\n')
    assert main(["run", str(cfg)]) == 0
    head = capsys.readouterr().err.splitlines()[0]
    assert "warm start from loops=2 to depths 3, 5" in head and "loops=4" not in head, head


def test_an_upgrade_cut_short_leaves_the_handle_exact(m, monkeypatch):
    """An error in the middle of recomputing the post blocks at a new depth (an interrupt, memory)
    used to leave the post layers half of the new depth while the handle still said they held the
    old one: the next request at the old depth copied them and decoded other tokens."""
    p = _prompt(20, 1)                                   # 3 prefill chunks of 8 rows
    h = tl.build_resume_handle(m, p, 1)
    try:
        real, calls = m.fwd.suffix, []

        def failing_suffix(*a, **k):
            calls.append(1)
            if len(calls) == 3:                          # rows 0..15 done at the new depth, 16.. not
                raise KeyboardInterrupt
            return real(*a, **k)
        monkeypatch.setattr(m.fwd, "suffix", failing_suffix)
        with pytest.raises(KeyboardInterrupt):
            tl.resume_generate(h, 6, G(max_tokens=4))
        monkeypatch.setattr(m.fwd, "suffix", real)
        for L in (1, 6, 1):
            assert tl.resume_generate(h, L, G(max_tokens=16)) == tl.generate(m, p, G(max_tokens=16, loops=L)), L
    finally:
        tl.free_resume_handle(h)
