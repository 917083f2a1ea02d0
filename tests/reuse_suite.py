"""Cache reuse (prefix caches, prefix pools, warm start) against plain generate, on any backend.

The backend's test file provides the fixture ``load`` (path, **load_model kwargs) -> Model on its
backend, and imports this module's tests (tests/test_reuse.py: CPU; tests/test_reuse_gpu.py: the
GPU). Models are loaded with prefill_chunk=8 so prompts span several prefill launches, and the
reuse boundaries fall inside, at and across them.
"""

from __future__ import annotations

import dataclasses
import gc
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tinyloop as tl
from tinyloop.runtime.compat import CompatWarning

from conftest import write_tiny

MODES = ["fp16", "fp32", "int8", "int4"]
#: (model variant id, write_tiny overrides): post blocks and loop injection, and neither
VARIANTS = [("inject_post", dict()), ("plain", dict(n_post=0, loop_inject="none", n_loop=1))]


@pytest.fixture(scope="module", params=VARIANTS, ids=[v for v, _ in VARIANTS])
def model_path(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("reuse") / f"{request.param[0]}.tinyloop"
    write_tiny(path, seed=5, quant="q4", group_size=32, **request.param[1])
    return path


@pytest.fixture(scope="module")
def rm(model_path, load):
    m = load(model_path, max_seq_len=160, prefill_chunk=8)
    yield m
    tl.free_model(m)


@pytest.fixture(autouse=True)
def _no_cap():
    tl.set_handle_bytes_cap(None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompatWarning)
        yield
    tl.set_handle_bytes_cap(None)


def _prompt(n, seed=0, vocab=97):
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


def held(m):
    """vram_usage_bytes without the caches a backend keeps as spares for later requests (the CUDA
    backend keeps released request caches; they come and go with plain requests)."""
    return tl.vram_usage_bytes(m) - sum(c.nbytes for c in getattr(m.backend, "_spares", ()))


def cfg(**kw):
    return tl.GenerateConfig(**{"max_tokens": 12, **kw})


# =============================================================================== prefix caches
@pytest.mark.parametrize("mode", MODES)
def test_prefix_cache_equals_generate(rm, mode):
    """Every split (inside, at and across prefill chunks; an empty suffix) and every cache mode:
    the tokens of generate(prefix + suffix)."""
    p = _prompt(27, 1)
    for n_prefix in (1, 7, 8, 9, 16, 26, 27):
        pc = tl.build_prefix_cache(rm, p[:n_prefix], cache_mode=mode)
        try:
            for c in (cfg(cache_mode=mode), cfg(cache_mode=mode, loops=pc.loops)):
                st_ = tl.GenerateStats()
                got = tl.generate_from_prefix_cache(rm, pc, p[n_prefix:], c, stats=st_)
                assert got == tl.generate(rm, p, c), (mode, n_prefix)
                assert st_.reused_tokens == min(n_prefix, len(p) - 1)
        finally:
            tl.free_prefix_cache(pc)


@pytest.mark.parametrize("loops", [1, 2, 5])
def test_prefix_cache_at_other_depths_and_decoders(rm, loops):
    """Sampling (seeded), repetition penalty and the speculative decoders from a prefix cache: the
    same tokens as the same request without it."""
    p = _prompt(21, 2)
    pc = tl.build_prefix_cache(rm, p[:13], loops=loops)
    try:
        reqs = [cfg(loops=loops), cfg(loops=loops, temperature=0.9, sample_seed=7, top_k=20),
                cfg(loops=loops, repetition_penalty=1.3)]
        if loops >= 2:
            reqs += [cfg(loops=loops, decoder="speculative", options=dict(draft_loops=1, draft_ahead=3)),
                     cfg(loops=loops, decoder="tree_speculative",
                         options=dict(draft_loops=1, draft_ahead=2, K_branches=2))]
        for c in reqs:
            assert tl.generate_from_prefix_cache(rm, pc, p[13:], c) == tl.generate(rm, p, c), c
    finally:
        tl.free_prefix_cache(pc)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(2, 40), cut=st.integers(1, 40), mode=st.sampled_from(MODES), loops=st.integers(1, 4),
       seed=st.integers(0, 1000))
def test_prefix_cache_property(rm, n, cut, mode, loops, seed):
    p = _prompt(n, seed)
    cut = min(cut, n)
    pc = tl.build_prefix_cache(rm, p[:cut], loops=loops, cache_mode=mode)
    try:
        c = cfg(max_tokens=6, loops=loops, cache_mode=mode)
        assert tl.generate_from_prefix_cache(rm, pc, p[cut:], c) == tl.generate(rm, p, c)
    finally:
        tl.free_prefix_cache(pc)


def test_prefix_cache_settings_must_match(rm):
    p = _prompt(12, 3)
    pc = tl.build_prefix_cache(rm, p[:6], loops=2, cache_mode="int8")
    try:
        with pytest.raises(tl.ConfigError, match="loops=3 differs"):
            tl.generate_from_prefix_cache(rm, pc, p[6:], cfg(loops=3, cache_mode="int8"))
        with pytest.raises(tl.ConfigError, match="cache_mode='fp16' differs"):
            tl.generate_from_prefix_cache(rm, pc, p[6:], cfg())
        with pytest.raises(tl.ConfigError, match="depth"):      # the decoder's depth is not the cache's
            tl.generate_from_prefix_cache(rm, pc, p[6:], cfg(cache_mode="int8", decoder="speculative",
                                                              options=dict(draft_loops=1, verify_loops=3)))
        with pytest.raises(tl.IncompatibleModesError, match="beam_search.*prefix_reuse"):
            tl.generate_from_prefix_cache(rm, pc, p[6:], cfg(cache_mode="int8", beam_size=2))
        with pytest.raises(tl.IncompatibleModesError, match="cache_window.*prefix_reuse"):
            tl.generate_from_prefix_cache(rm, pc, p[6:], cfg(cache_mode="int8", cache_window=8))
    finally:
        tl.free_prefix_cache(pc)


# =============================================================================== pools
def test_pool_reuses_the_longest_registered_prefix(rm):
    p = _prompt(30, 4)
    pool = tl.create_prefix_pool(4)
    try:
        short = tl.register_prefix(pool, rm, p[:5])
        long_ = tl.register_prefix(pool, rm, p[:17])
        assert tl.register_prefix(pool, rm, p[:5]) is short         # not rebuilt
        other = _prompt(30, 99)
        cases = [(p, 17), (p[:17], 16), (p[:10], 5), (p[:5], 4), (other, 0), (p[:3] + other[:9], 0)]
        for q, want in cases:
            st_ = tl.GenerateStats()
            assert tl.generate_with_pool(rm, pool, q, cfg(), stats=st_) == tl.generate(rm, q, cfg())
            assert st_.reused_tokens == want, (len(q), want)
        s = pool.stats()
        assert (s["hits"], s["misses"], s["evictions"], s["entries"]) == (4, 2, 0, 2)
        assert s["reused_tokens"] == 17 + 16 + 5 + 4
        assert s["bytes"] == short.nbytes + long_.nbytes > 0
        # another depth is another key: a request at loops=2 does not reuse the default-depth entries
        st_ = tl.GenerateStats()
        assert tl.generate_with_pool(rm, pool, p, cfg(loops=2), stats=st_) == tl.generate(rm, p, cfg(loops=2))
        assert st_.reused_tokens == 0
        tl.register_prefix(pool, rm, p[:9], loops=2)
        assert tl.generate_with_pool(rm, pool, p, cfg(loops=2), stats=st_) == tl.generate(rm, p, cfg(loops=2))
        assert st_.reused_tokens == 9
    finally:
        tl.free_prefix_pool(pool)


def test_pool_lru_eviction_on_entries_and_bytes(rm):
    p = _prompt(40, 5)
    pool = tl.create_prefix_pool(2)
    try:
        a = tl.register_prefix(pool, rm, p[:4])
        b = tl.register_prefix(pool, rm, p[:8])
        tl.generate_with_pool(rm, pool, p[:6], cfg())                 # a hit on a: b is now the LRU
        c = tl.register_prefix(pool, rm, p[:12])
        assert not b.alive and a.alive and c.alive
        assert pool.stats()["evictions"] == 1 and pool.stats()["entries"] == 2
        with pytest.raises(tl.HandleFreedError, match="evicted"):
            tl.generate_from_prefix_cache(rm, b, [], cfg())
        st_ = tl.GenerateStats()
        assert tl.generate_with_pool(rm, pool, p[:10], cfg(), stats=st_) == tl.generate(rm, p[:10], cfg())
        assert st_.reused_tokens == 4                                  # p[:8] is gone, p[:4] serves
    finally:
        tl.free_prefix_pool(pool)
    one = tl.build_prefix_cache(rm, p[:10])
    budget = one.nbytes * 2 + one.nbytes // 2
    tl.free_prefix_cache(one)
    pool = tl.create_prefix_pool(10, max_bytes=budget)
    try:
        # each entry takes at least one's bytes (a backend may round slots up: then exactly as many)
        entries = [tl.register_prefix(pool, rm, p[:10 + i]) for i in range(3)]
        assert pool.nbytes <= budget and not entries[0].alive and entries[2].alive
    finally:
        tl.free_prefix_pool(pool)
    small = tl.create_prefix_pool(10, max_bytes=budget // 3)
    base = held(rm)
    with pytest.raises(tl.HandleBudgetError, match="max_bytes"):
        tl.register_prefix(small, rm, p[:10])
    assert held(rm) == base and small.stats()["entries"] == 0
    tl.free_prefix_pool(small)


def test_pool_user_free_of_an_entry_leaves_the_pool(rm):
    p = _prompt(12, 6)
    pool = tl.create_prefix_pool(3)
    e = tl.register_prefix(pool, rm, p[:6])
    tl.free_prefix_cache(e)
    assert pool.stats()["entries"] == 0 and pool.stats()["evictions"] == 0
    st_ = tl.GenerateStats()
    assert tl.generate_with_pool(rm, pool, p, cfg(), stats=st_) == tl.generate(rm, p, cfg())
    assert st_.reused_tokens == 0
    tl.free_prefix_pool(pool)
    with pytest.raises(tl.HandleFreedError):
        tl.free_prefix_pool(pool)
    with pytest.raises(tl.HandleFreedError):
        tl.generate_with_pool(rm, pool, p, cfg())


# =============================================================================== warm start
@pytest.mark.parametrize("mode", MODES)
def test_resume_is_bit_exact_to_a_fresh_request(rm, mode):
    p = _prompt(29, 7)
    for used, new in [(1, 3), (2, 5), (3, 8), (4, 4)]:
        h = tl.build_resume_handle(rm, p, used, cfg(cache_mode=mode))
        try:
            st_ = tl.GenerateStats()
            got = tl.resume_generate(h, new, cfg(cache_mode=mode), stats=st_)
            assert got == tl.generate(rm, p, cfg(cache_mode=mode, loops=new)), (mode, used, new)
            assert st_.reused_tokens == len(p) - 1 and st_.warm_start_iters_saved == used * (len(p) - 1)
            assert st_.loops_used == new
        finally:
            tl.free_resume_handle(h)


def test_repeated_upgrades_and_depths_in_between(rm):
    p = _prompt(25, 8)
    h = tl.build_resume_handle(rm, p, 1)
    try:
        for L in (1, 2, 4, 8, 3, 6, 8, 1):
            c = cfg(loops=L) if L % 2 else cfg()
            st_ = tl.GenerateStats()
            assert tl.resume_generate(h, L, c, stats=st_) == tl.generate(rm, p, cfg(loops=L)), L
        assert h.depths == [1, 2, 3, 4, 6, 8]
    finally:
        tl.free_resume_handle(h)
    h = tl.build_resume_handle(rm, p, 3)
    try:
        with pytest.raises(tl.ConfigError, match="loops_new=2 is below the handle's shallowest kept depth 3"):
            tl.resume_generate(h, 2)
        with pytest.raises(tl.ConfigError, match="loops=5 differs"):
            tl.resume_generate(h, 4, cfg(loops=5))
    finally:
        tl.free_resume_handle(h)


def test_resume_with_other_decoders(rm):
    p = _prompt(19, 9)
    h = tl.build_resume_handle(rm, p, 2)
    try:
        for c in [cfg(temperature=0.8, sample_seed=3), cfg(repetition_penalty=1.2),
                  cfg(decoder="speculative", options=dict(draft_loops=2, draft_ahead=3)),
                  cfg(decoder="tree_speculative", options=dict(draft_loops=1, draft_ahead=2, K_branches=2))]:
            L = 5
            assert tl.resume_generate(h, L, c) == tl.generate(rm, p, dataclasses.replace(c, loops=L)), c
    finally:
        tl.free_resume_handle(h)


def test_warm_start_refusals(rm):
    p = _prompt(10, 10)
    with pytest.raises(tl.IncompatibleModesError, match="cache_window.*warm_start"):
        tl.build_resume_handle(rm, p, 2, cfg(cache_window=8))
    with pytest.raises(tl.IncompatibleModesError, match="beam_search.*warm_start"):
        tl.build_resume_handle(rm, p, 2, cfg(beam_size=2))
    h = tl.build_resume_handle(rm, p, 2)
    try:
        with pytest.raises(tl.IncompatibleModesError, match="beam_search.*warm_start"):
            tl.resume_generate(h, 4, cfg(beam_size=2))
        with pytest.raises(tl.ConfigError, match="cache_mode='int4' differs"):
            tl.resume_generate(h, 4, cfg(cache_mode="int4"))
        with pytest.raises(tl.InvalidInputError, match="max_seq_len"):
            tl.resume_generate(h, 4, cfg(max_tokens=155))
    finally:
        tl.free_resume_handle(h)


# =============================================================================== ownership, accounting
def test_memory_accounting_returns_to_baseline(rm):
    base = held(rm)
    live = tl.live_handle_bytes()
    p = _prompt(30, 11)
    pc = tl.build_prefix_cache(rm, p[:20])
    assert held(rm) == base + pc.nbytes and tl.live_handle_bytes() == live + pc.nbytes
    h = tl.build_resume_handle(rm, p, 1)
    n0 = h.nbytes
    tl.resume_generate(h, 6, cfg())
    assert h.nbytes > n0 and held(rm) == base + pc.nbytes + h.nbytes
    pool = tl.create_prefix_pool(2)
    tl.register_prefix(pool, rm, p[:9])
    assert held(rm) == base + pc.nbytes + h.nbytes + pool.nbytes
    recs = tl.live_handles(rm)
    assert [(r["kind"], r["tokens"], r["in_pool"]) for r in recs] == [
        ("PrefixCache", 20, False), ("ResumeHandle", 30, False), ("PrefixCache", 9, True)]
    assert recs[1]["depths"] == [1, 6] and sum(r["bytes"] for r in recs) == held(rm) - base
    tl.free_prefix_cache(pc)
    tl.free_resume_handle(h)
    tl.free_prefix_pool(pool)
    assert held(rm) == base and tl.live_handle_bytes() == live
    # a handle nobody holds is collected and uncharged
    tl.build_prefix_cache(rm, p[:20])
    gc.collect()
    assert held(rm) == base and tl.live_handle_bytes() == live


def test_double_free_use_after_free_and_another_model(rm, model_path, load):
    p = _prompt(12, 12)
    pc = tl.build_prefix_cache(rm, p[:6])
    h = tl.build_resume_handle(rm, p, 2)
    other = load(model_path, max_seq_len=160, prefill_chunk=8)
    try:
        with pytest.raises(tl.InvalidInputError, match="another Model"):
            tl.generate_from_prefix_cache(other, pc, p[6:])
        pool = tl.create_prefix_pool(2)
        tl.register_prefix(pool, rm, p[:4])
        with pytest.raises(tl.InvalidInputError, match="another Model"):
            tl.generate_with_pool(other, pool, p)
        with pytest.raises(tl.InvalidInputError, match="another Model"):
            tl.register_prefix(pool, other, p[:4])
        tl.free_prefix_pool(pool)
    finally:
        tl.free_model(other)
    tl.free_prefix_cache(pc)
    tl.free_resume_handle(h)
    for call in (lambda: tl.free_prefix_cache(pc), lambda: tl.free_resume_handle(h),
                 lambda: tl.generate_from_prefix_cache(rm, pc, p[6:]), lambda: tl.resume_generate(h, 3)):
        with pytest.raises(tl.HandleFreedError):
            call()
    # handles of a freed model end with it; freeing them afterwards is a no-op
    m2 = load(model_path, max_seq_len=160, prefill_chunk=8)
    pc2 = tl.build_prefix_cache(m2, p[:6])
    h2 = tl.build_resume_handle(m2, p, 2)
    tl.free_model(m2)
    assert not pc2.alive and not h2.alive
    with pytest.raises(tl.HandleFreedError, match="released with its model"):
        tl.resume_generate(h2, 3)
    tl.free_prefix_cache(pc2)
    tl.free_resume_handle(h2)
    # a pool whose model was freed (its entries with it) serves the next model
    m3 = load(model_path, max_seq_len=160, prefill_chunk=8)
    pool = tl.create_prefix_pool(2)
    tl.register_prefix(pool, m3, p[:4])
    tl.free_model(m3)
    assert pool.stats()["entries"] == 0
    tl.register_prefix(pool, rm, p[:4])
    st_ = tl.GenerateStats()
    assert tl.generate_with_pool(rm, pool, p, cfg(), stats=st_) == tl.generate(rm, p, cfg())
    assert st_.reused_tokens == 4
    tl.free_prefix_pool(pool)


def test_live_handle_cap_evicts_least_recently_used(rm):
    p = _prompt(30, 13)
    base = held(rm)
    a = tl.build_prefix_cache(rm, p[:10])
    b = tl.build_prefix_cache(rm, p[:10], loops=2)
    tl.generate_from_prefix_cache(rm, a, p[10:])                     # a is now the most recent
    tl.set_handle_bytes_cap(tl.live_handle_bytes() + a.nbytes // 2)
    c = tl.build_prefix_cache(rm, p[:10], loops=3)                    # evicts b (the LRU)
    assert a.alive and not b.alive and c.alive
    with pytest.raises(tl.HandleFreedError, match="evicted"):
        tl.generate_from_prefix_cache(rm, b, p[10:], cfg(loops=2))
    before = held(rm)
    with pytest.raises(tl.HandleBudgetError, match="cap"):
        tl.build_resume_handle(rm, _prompt(150, 1), 8)                 # larger than the whole cap
    assert held(rm) == before
    tl.set_handle_bytes_cap(None)
    tl.free_prefix_cache(a)
    tl.free_prefix_cache(c)
    assert held(rm) == base


BAD = [
    (lambda m, p: tl.build_prefix_cache(m, []), tl.InvalidInputError, "empty"),
    (lambda m, p: tl.build_prefix_cache(m, list(range(10)) * 17), tl.InvalidInputError, "max_seq_len"),
    (lambda m, p: tl.build_prefix_cache(m, [1, 500]), tl.InvalidInputError, "vocabulary"),
    (lambda m, p: tl.build_prefix_cache(m, 3.5), tl.InvalidInputError, "token ids"),
    (lambda m, p: tl.build_prefix_cache(m, p, loops=0), tl.ConfigError, "loops=0"),
    (lambda m, p: tl.build_prefix_cache(m, p, loops=99), tl.ConfigError, "loops=99"),
    (lambda m, p: tl.build_prefix_cache(m, p, loops=True), tl.ConfigError, "loops=True"),
    (lambda m, p: tl.build_prefix_cache(m, p, cache_mode="int3"), tl.TinyLoopError, "int3"),
    (lambda m, p: tl.build_prefix_cache(m, p, cache_mode=8), tl.ConfigError, "cache_mode"),
    (lambda m, p: tl.build_prefix_cache("model", p), tl.InvalidInputError, "model must be"),
    (lambda m, p: tl.generate_from_prefix_cache(m, "pc", p), tl.InvalidInputError, "PrefixCache"),
    (lambda m, p: tl.create_prefix_pool(0), tl.ConfigError, "capacity=0"),
    (lambda m, p: tl.create_prefix_pool(-2), tl.ConfigError, "capacity=-2"),
    (lambda m, p: tl.create_prefix_pool(True), tl.ConfigError, "capacity=True"),
    (lambda m, p: tl.create_prefix_pool("4"), tl.ConfigError, "capacity='4'"),
    (lambda m, p: tl.create_prefix_pool(4, max_bytes=0), tl.ConfigError, "max_bytes=0"),
    (lambda m, p: tl.register_prefix("pool", m, p), tl.InvalidInputError, "PrefixPool"),
    (lambda m, p: tl.generate_with_pool(m, None, p), tl.InvalidInputError, "PrefixPool"),
    (lambda m, p: tl.build_resume_handle(m, p, 0), tl.ConfigError, "loops=0"),
    (lambda m, p: tl.build_resume_handle(m, p, 9), tl.ConfigError, "loops=9"),
    (lambda m, p: tl.build_resume_handle(m, p, "2"), tl.ConfigError, "loops_used='2'"),
    (lambda m, p: tl.build_resume_handle(m, p, 2, cfg(loops=3)), tl.ConfigError, "differs"),
    (lambda m, p: tl.build_resume_handle(m, p, 2, {"loops": 2}), tl.ConfigError, "config must be"),
    (lambda m, p: tl.resume_generate("h", 3), tl.InvalidInputError, "ResumeHandle"),
    (lambda m, p: tl.set_handle_bytes_cap(0), tl.ConfigError, "max_bytes=0"),
    (lambda m, p: tl.set_handle_bytes_cap("1"), tl.ConfigError, "max_bytes='1'"),
    (lambda m, p: tl.free_prefix_cache(None), tl.InvalidInputError, "PrefixCache"),
    (lambda m, p: tl.free_resume_handle(1), tl.InvalidInputError, "ResumeHandle"),
    (lambda m, p: tl.free_prefix_pool([]), tl.InvalidInputError, "PrefixPool"),
]


@pytest.mark.parametrize("i", range(len(BAD)))
def test_bad_input_is_a_typed_error_before_any_allocation(rm, i, monkeypatch):
    call, exc, match = BAD[i]
    allocations = []
    for name in ("alloc_cache", "alloc_kept_cache", "alloc_rows"):
        real = getattr(rm.backend, name)
        monkeypatch.setattr(rm.backend, name, lambda *a, _r=real: allocations.append(a) or _r(*a))
    base = tl.vram_usage_bytes(rm)
    with pytest.raises(exc, match=match):
        call(rm, _prompt(10, 14))
    assert allocations == [] and tl.vram_usage_bytes(rm) == base


def test_resume_errors_leave_the_handle_usable(rm):
    p = _prompt(14, 15)
    h = tl.build_resume_handle(rm, p, 2)
    try:
        n = h.nbytes
        for bad in (lambda: tl.resume_generate(h, 0), lambda: tl.resume_generate(h, 4, cfg(max_tokens=-1)),
                    lambda: tl.resume_generate(h, 4, "cfg"), lambda: tl.resume_generate(h, 4, stats=3),
                    lambda: tl.resume_generate(h, 4, on_token=5)):
            with pytest.raises(tl.TinyLoopError):
                bad()
        assert h.nbytes == n and h.depths == [2]
        assert tl.resume_generate(h, 4, cfg()) == tl.generate(rm, p, cfg(loops=4))
    finally:
        tl.free_resume_handle(h)


def test_suffix_errors_name_the_suffix(rm):
    pc = tl.build_prefix_cache(rm, _prompt(5, 16))
    try:
        base = held(rm)
        with pytest.raises(tl.InvalidInputError, match=r"suffix_ids\[1\]=500 is outside the vocabulary"):
            tl.generate_from_prefix_cache(rm, pc, [1, 500])
        with pytest.raises(tl.InvalidInputError, match="suffix_ids must be"):
            tl.generate_from_prefix_cache(rm, pc, None)
        assert held(rm) == base
    finally:
        tl.free_prefix_cache(pc)
