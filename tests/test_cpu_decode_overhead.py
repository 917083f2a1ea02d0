"""The CPU decode step without its Python overhead (docs/BENCHMARKS.md "CPU decode overhead"):
the CPU backend's composites (attn_half, mlp_half, final_logits) call the kernels directly for a
position int on a linear cache, with per-layer and per-block lookups made once, and the session
asks the backend's capabilities once per request. These pin that nothing but the time changed:
tokens and logits equal the generic composites' bit for bit (and greedy equals the argmax chain of
``score``), every fallback still takes the generic path, and the engine's stats, processors and
stop rules still apply."""

from __future__ import annotations

import numpy as np
import pytest

import tinyloop as tl
from tinyloop.cpu.backend import CPUBackend
from tinyloop.runtime.plugins import get_plugin_manager

from conftest import write_tiny

PROMPTS = ([5], [3, 17, 42, 8], [(7 * i + 3) % 4096 for i in range(20)])


@pytest.fixture(scope="module")
def demo():
    m = tl.load_model("demo", backend="cpu", max_seq_len=96)
    yield m
    tl.free_model(m)


def _bits(a):
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def _both(m, fn):
    """fn() with the direct composites, then with the generic ones (the code before the change)."""
    assert m.backend._direct, "the demo model on the CPU takes the direct composites"
    got = fn()
    m.backend._direct = False
    try:
        ref = fn()
    finally:
        m.backend._direct = True
    return got, ref


@pytest.mark.parametrize("loops", [1, 4, 7])
def test_greedy_is_the_argmax_chain_of_score(demo, loops):
    """Greedy tokens of several prompts: token t+1 is the argmax of score()'s logits at t (a prefill
    of the whole sequence), and the decode steps' logits (score_decoded) equal score's bit for bit."""
    for p in PROMPTS:
        out = tl.generate(demo, p, tl.GenerateConfig(max_tokens=12, loops=loops))
        logits = tl.score(demo, out, loops=loops)
        assert out[len(p):] == [int(np.argmax(logits[t])) for t in range(len(p) - 1, len(out) - 1)]
        decoded = tl.score_decoded(demo, out, tl.GenerateConfig(loops=loops))
        assert np.array_equal(_bits(decoded), _bits(logits))


@pytest.mark.parametrize("cache_mode", ["fp16", "fp32", "int8", "int4"])
def test_direct_composites_equal_the_generic_ones(demo, cache_mode):
    """Tokens and every position's decode-step logits, direct against generic, in each cache mode."""
    for p in PROMPTS[1:]:
        for loops in (1, 3):
            cfg = tl.GenerateConfig(max_tokens=10, loops=loops, cache_mode=cache_mode)
            got, ref = _both(demo, lambda: tl.generate(demo, p, cfg))
            assert got == ref
            got, ref = _both(demo, lambda: tl.score_decoded(demo, got, cfg))
            assert np.array_equal(_bits(got), _bits(ref))
            got, ref = _both(demo, lambda: tl.score(demo, p, loops=loops, cache_mode=cache_mode))
            assert np.array_equal(_bits(got), _bits(ref))


def test_other_decode_modes_unchanged(demo):
    """Sampling with a repetition penalty (the demo job's settings), beam search, a sliding-window
    cache (a ring: the generic ops), early exit and lockstep lanes (tree positions: generic)."""
    p = PROMPTS[1]
    cfgs = [tl.GenerateConfig(max_tokens=12, temperature=0.7, top_p=0.9, sample_seed=1, repetition_penalty=1.1),
            tl.GenerateConfig(max_tokens=8, beam_size=3),
            tl.GenerateConfig(max_tokens=12, cache_window=8),
            tl.GenerateConfig(max_tokens=12, loops=6, early_exit_patience=1, early_exit_criterion="argmax")]
    for cfg in cfgs:
        got, ref = _both(demo, lambda: tl.generate(demo, p, cfg))
        assert got == ref, cfg
    got, ref = _both(demo, lambda: tl.generate_batch(demo, list(PROMPTS), tl.GenerateConfig(max_tokens=6)))
    assert got == ref


def test_stats_processors_and_stop_rules_still_apply(demo):
    p = PROMPTS[2]
    st = tl.GenerateStats()
    out = tl.generate(demo, p, tl.GenerateConfig(max_tokens=9, loops=3), stats=st)
    assert st.tokens_emitted == 9 == len(out) - len(p)
    assert st.stop_reason == tl.StopReason.MAX_TOKENS
    assert st.loops_used == 3 and st.decoder == "greedy"
    assert st.loop_iters_run == 3 * (1 + 8)          # the prefill's forward and 8 decode steps
    assert st.prefill_ms > 0 and st.decode_ms > 0 and st.first_token_ms > 0
    gen = out[len(p):]
    # a stop sequence ends the output at its first match (included)
    st = tl.GenerateStats()
    cut = tl.generate(demo, p, tl.GenerateConfig(max_tokens=9, loops=3, stop_sequences=((gen[3],),)), stats=st)
    assert cut[len(p):] == gen[:gen.index(gen[3]) + 1] and st.stop_reason == tl.StopReason.STOP_SEQUENCE
    # the consumer's callback aborts after its token
    seen = []
    cb = tl.generate_stream(demo, p, tl.GenerateConfig(max_tokens=9, loops=3),
                            on_token=lambda t, pos: seen.append((t, pos)) or len(seen) < 4)
    assert cb[len(p):] == gen[:4] and seen == [(t, len(p) + i) for i, t in enumerate(gen[:4])]
    # a repetition penalty is applied at every step: the greedy chain of the penalised logits
    pen, p = 1.5, PROMPTS[1]
    cfg = tl.GenerateConfig(max_tokens=8, loops=3, repetition_penalty=pen)
    out = tl.generate(demo, p, cfg)
    assert out != tl.generate(demo, p, tl.GenerateConfig(max_tokens=8, loops=3))    # it changes tokens here
    logits = tl.score(demo, out, loops=3)
    for t in range(len(p) - 1, len(out) - 1):
        row = logits[t].copy()
        seen_ids = np.array(sorted(set(out[:t + 1])))
        v = row[seen_ids]
        row[seen_ids] = np.where(v > 0, v / np.float32(pen), v * np.float32(pen))
        assert out[t + 1] == int(np.argmax(row))


def test_eos_ends_the_request(tmp_path):
    """The EOS rule still ends a request on the direct path: the same tiny model with its eos_id
    set to the third greedy token stops there (included), with stop reason EOS."""
    write_tiny(tmp_path / "a.tinyloop")
    with tl.load_model(str(tmp_path / "a.tinyloop"), backend="cpu", max_seq_len=64) as m:
        assert m.backend._direct
        gen = tl.generate(m, [3, 17, 42, 8], tl.GenerateConfig(max_tokens=10))[4:]
    eos = gen[2]
    write_tiny(tmp_path / "b.tinyloop", eos_id=eos)
    with tl.load_model(str(tmp_path / "b.tinyloop"), backend="cpu", max_seq_len=64) as m:
        st = tl.GenerateStats()
        out = tl.generate(m, [3, 17, 42, 8], tl.GenerateConfig(max_tokens=10), stats=st)
    assert out[4:] == gen[:gen.index(eos) + 1] and st.stop_reason == tl.StopReason.EOS


class CountingCPU(CPUBackend):
    """A subclass with a primitive of its own: the composites must call it (the generic ones)."""

    name = "counting-cpu"
    calls = 0

    def matmul(self, x, W, out, T, accumulate=False):
        CountingCPU.calls += 1
        super().matmul(x, W, out, T, accumulate)


def test_a_subclass_overriding_a_primitive_gets_the_generic_composites(demo):
    cfg = demo.cfg
    be = CountingCPU(cfg, 64)
    assert not be._direct and CPUBackend(cfg, 64)._direct


def test_models_the_direct_path_does_not_serve(tmp_path):
    """Biases and sandwich blocks take the generic composites (and still decode as before)."""
    for i, over in enumerate((dict(qkv_bias=True), dict(block_norm="sandwich"), dict())):
        path = tmp_path / f"m{i}.tinyloop"
        write_tiny(path, **over)
        m = tl.load_model(str(path), backend="cpu", max_seq_len=64)
        try:
            assert m.backend._direct == (not over)
            out = tl.generate(m, [3, 17, 42, 8], tl.GenerateConfig(max_tokens=8))
            logits = tl.score(m, out)
            assert out[4:] == [int(np.argmax(logits[t])) for t in range(3, len(out) - 1)]
            if not over:                  # N and K not multiples of the block lanes: the tiny model
                m.backend._direct = False
                assert tl.generate(m, [3, 17, 42, 8], tl.GenerateConfig(max_tokens=8)) == out
        finally:
            tl.free_model(m)


@pytest.mark.parametrize("name", ["fp32", "fp16", "int8", "int4"])
def test_row_writers_store_what_store_stores(name):
    """A codec's row writer (made once per cache layer) leaves the codes, scales and zeros its
    store leaves; a subclass with a store of its own gets a writer that calls it."""
    codec = get_plugin_manager().codec(name)
    impl = codec.impl("cpu")
    n_kv, D, layers, slots = 2, 16, 3, 10
    rows = np.random.default_rng(0).standard_normal((4, n_kv * D)).astype(np.float32)
    a, b = impl.alloc(codec, layers, slots, n_kv, D), impl.alloc(codec, layers, slots, n_kv, D)
    impl.store(codec, a, 1, slice(3, 7), rows.reshape(4, n_kv, D))
    impl.row_writer(codec, b, 1, n_kv, D)(slice(3, 7), rows)
    for x, y in zip(a.arrays, b.arrays):
        assert x.dtype == y.dtype and np.array_equal(x, y)

    stored = []

    class Own(type(impl)):
        def store(self, codec, st, layer, slots, r):
            stored.append((layer, slots, r.shape))

    Own().row_writer(codec, b, 2, n_kv, D)(slice(0, 2), rows[:2])
    assert stored == [(2, slice(0, 2), (2, n_kv, D))]


def test_layer_kv_is_made_once_and_not_for_a_ring(demo):
    from tinyloop.runtime.cache import SlotMap, build_spec, linear_slots
    mode = get_plugin_manager().cache_mode_for(tl.GenerateConfig())
    be = demo.backend
    cache = be.alloc_cache(build_spec(demo.cfg, 2, mode, linear_slots(16)))
    kv = cache.layer_kv(3)
    assert kv is cache.layer_kv(3) and kv[4] == cache.spec.group_of(3)[1]
    ring = be.alloc_cache(build_spec(demo.cfg, 2, mode, SlotMap(n_slots=8, window=8)))
    assert ring.layer_kv(3) is None


def test_lookahead_off_gives_the_same_tokens(demo, monkeypatch):
    """The session asks for device chaining once per request; the CPU has none, so switching the
    look-ahead off changes nothing."""
    cfg = tl.GenerateConfig(max_tokens=10, loops=2)
    out = tl.generate(demo, PROMPTS[1], cfg)
    monkeypatch.setenv("TINYLOOP_LOOKAHEAD", "0")
    assert tl.generate(demo, PROMPTS[1], cfg) == out
