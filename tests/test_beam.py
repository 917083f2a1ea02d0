"""Beam search (GenerateConfig.beam_size >= 2): the decoder plugin against a brute-force float64
reference over tl.score_last_token logits, the engine's lanes (fork_pool / copy_state), the stop
policy, memory accounting and the compat rules."""

from __future__ import annotations

import zlib
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tinyloop as tl
from tinyloop import GenerateConfig, GenerateStats, StopReason
from tinyloop.model.arch import ModelConfig, TensorQuant
from tinyloop.runtime.engine import Plan, Session
from tinyloop.model.format import write_model
from tinyloop.runtime.processors import ProcessorChain
from tinyloop.runtime.stopping import StopperChain
from tinyloop.plugins.decoders.beam import BeamSearchDecoder

from conftest import TINY, random_weights

PROMPTS = [[3, 17, 42, 8, 91, 23, 11, 60, 2, 77], [5], [40, 41, 42, 43]]


# =============================================================================== reference
def ref_log_softmax(logits):
    x = np.asarray(logits, np.float64)
    z = x - x.max()
    return z - np.log(np.exp(z).sum())


def reference_beam(next_logits, V, K, N, alpha, eos=None, stops=()):
    """Brute force: every live beam expanded by all V tokens, the full candidate list sorted by
    (score desc, token asc, parent asc), walked until K beams continue; no early stop (it never
    changes the result). Returns (generated tokens, score) of the best finished beam (the first
    finished among equal scores)."""
    K = max(1, K)

    def ended(toks):
        return (eos is not None and toks[-1] == eos) or \
            any(len(s) <= len(toks) and tuple(toks[-len(s):]) == tuple(s) for s in stops)

    live = [((), 0.0)]
    finished = []
    for n in range(1, N + 1):
        d = float(max(1, n)) ** alpha
        cands = []
        for b, (toks, lp_sum) in enumerate(live):
            lp = ref_log_softmax(next_logits(toks))
            for t in range(V):
                total = lp_sum + lp[t]
                cands.append((-(total / d), t, b, total))
        cands.sort()
        nxt, kept = [], 0
        for neg, t, b, total in cands:
            toks = live[b][0] + (t,)
            if ended(toks):
                finished.append((-neg, toks))
                continue
            kept += 1
            if n == N:
                finished.append((-neg, toks))
            else:
                nxt.append((toks, total))
            if kept == K:
                break
        live = nxt
        if not live:
            break
    i = min(range(len(finished)), key=lambda j: (-finished[j][0], j))
    return list(finished[i][1]), finished[i][0]


def model_logits(model, prompt, loops=None, cache_mode="fp16"):
    memo = {}

    def f(toks):
        if toks not in memo:
            memo[toks] = tl.score_last_token(model, prompt + list(toks), loops=loops, cache_mode=cache_mode)
        return memo[toks]
    return f


def beam(model, prompt, stats=None, **kw):
    return tl.generate_stream(model, prompt, GenerateConfig(**kw), stats=stats)


# =============================================================================== models
def write_flat(path, seed=0, scale=0.25, **overrides):
    """A tiny model with flat logits (small embeddings), so beams disagree with greedy."""
    cfg = ModelConfig(**{**TINY, **overrides})
    w = random_weights(cfg, seed)
    w["embed"] = (w["embed"] * scale).astype(np.float32)
    write_model(str(path), cfg, w, default_quant=TensorQuant("f16", 0))
    return cfg


@pytest.fixture(scope="module")
def flat_path(tmp_path_factory):
    p = tmp_path_factory.mktemp("beam") / "flat.tinyloop"
    write_flat(p)
    return p


@pytest.fixture(scope="module")
def flat(flat_path):
    m = tl.load_model(str(flat_path), max_seq_len=96, backend="cpu")
    yield m
    tl.free_model(m)


# =============================================================================== against the reference
@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("alpha", [0.0, 1.0, 2.0])
def test_matches_reference(flat, K, alpha):
    for p in PROMPTS:
        st_ = GenerateStats()
        out = beam(flat, p, st_, max_tokens=6, beam_size=K, length_penalty=alpha)
        want, _ = reference_beam(model_logits(flat, p), flat.vocab_size, K, 6, alpha)
        assert out == p + want
        assert st_.stop_reason == StopReason.MAX_TOKENS and st_.tokens_emitted == 6
        assert K <= st_.beams_finished


def test_beam_differs_from_greedy_somewhere(flat):
    """The parameter grid above is not vacuous: beams change the output on this model."""
    diffs = 0
    for p in PROMPTS:
        g = tl.generate(flat, p, GenerateConfig(max_tokens=6))
        for K in (2, 4):
            diffs += beam(flat, p, max_tokens=6, beam_size=K) != g
    assert diffs > 0


def test_loops_and_fp32_cache(flat):
    p = PROMPTS[0]
    for loops, cache_mode in [(1, "fp32"), (5, "fp32"), (2, "fp16")]:
        out = beam(flat, p, max_tokens=5, beam_size=3, loops=loops, cache_mode=cache_mode, length_penalty=0.5)
        want, _ = reference_beam(model_logits(flat, p, loops, cache_mode), flat.vocab_size, 3, 5, 0.5)
        assert out == p + want


def test_exhaustive_when_every_token_is_a_beam(flat):
    """beam_size = vocab with max_tokens=2 searches every sequence: with length_penalty=0 the output
    is the highest-total-logprob sequence of all V**2 (ties: lower first token, then lower second)."""
    p, V = PROMPTS[2], flat.vocab_size
    lp1 = ref_log_softmax(tl.score_last_token(flat, p))
    best = None
    for t1 in range(V):
        lp2 = ref_log_softmax(tl.score_last_token(flat, p + [t1]))
        tot = lp1[t1] + lp2
        t2 = int(np.argmax(tot))
        if best is None or tot[t2] > best[0]:
            best = (tot[t2], t1, t2)
    out = beam(flat, p, max_tokens=2, beam_size=V, length_penalty=0.0)
    assert out == p + [best[1], best[2]]


def beam_of_one(model, prompt, max_tokens):
    """The beam search algorithm with one beam, on an engine session (a request cannot ask for it:
    beam_size 0 or 1 means ordinary decoding, and decoder='beam' with it is refused)."""
    cfg = GenerateConfig(max_tokens=max_tokens, length_penalty=0.0)
    s = _session(model, prompt, max_tokens)
    s.stoppers = request_stoppers(cfg, model.cfg, prompt)
    try:
        return list(prompt) + list(BeamSearchDecoder(cfg).decode(s))
    finally:
        s.close()


def test_beam_of_one_is_greedy(tmp_path, flat):
    """Beam search with one beam and length_penalty 0 is greedy decoding, EOS included."""
    for p in PROMPTS:
        g = tl.generate(flat, p, GenerateConfig(max_tokens=8))
        assert beam_of_one(flat, p, 8) == g
    p = PROMPTS[0]
    eos = tl.generate(flat, p, GenerateConfig(max_tokens=8))[len(p) + 3]
    path = tmp_path / "eos.tinyloop"
    write_flat(path, eos_id=eos)
    m = tl.load_model(str(path), max_seq_len=96, backend="cpu")
    try:
        g = tl.generate(m, p, GenerateConfig(max_tokens=8))
        assert g[-1] == eos
        assert beam_of_one(m, p, 8) == g
    finally:
        tl.free_model(m)


@pytest.mark.parametrize("beam_size", [0, 1])
def test_beam_decoder_needs_two_beams(flat, monkeypatch, beam_size):
    """decoder='beam' with beam_size 0 or 1 (ordinary decoding) contradicts itself: refused before work."""
    calls = []
    monkeypatch.setattr(flat.backend, "alloc_cache", lambda *a: calls.append(a))
    with pytest.raises(tl.IncompatibleModesError, match=rf"beam_size={beam_size} asks for ordinary decoding"):
        tl.generate(flat, PROMPTS[0], GenerateConfig(decoder="beam", beam_size=beam_size))
    assert calls == []


def test_uncached_path_and_prefill_chunk_agree(flat_path, flat, monkeypatch):
    p = PROMPTS[0]
    cfg = dict(max_tokens=6, beam_size=3, length_penalty=1.0)
    a = beam(flat, p, **cfg)
    m = tl.load_model(str(flat_path), max_seq_len=96, backend="cpu", prefill_chunk=3)
    try:
        assert beam(m, p, **cfg) == a
    finally:
        tl.free_model(m)
    monkeypatch.setenv("TINYLOOP_DISABLE_KV_CACHE", "1")
    assert beam(flat, p, **cfg) == a


def test_deterministic(flat):
    p = PROMPTS[0]
    runs = {tuple(beam(flat, p, max_tokens=7, beam_size=4, length_penalty=1.0)) for _ in range(3)}
    assert len(runs) == 1


# =============================================================================== stop policy
@pytest.fixture(scope="module")
def eos_model(tmp_path_factory, flat):
    """The flat model with eos_id set to a token that the beams meet early."""
    p = PROMPTS[0]
    out = beam(flat, p, max_tokens=6, beam_size=3)[len(p):]
    eos = out[2]
    path = tmp_path_factory.mktemp("beam_eos") / "eos.tinyloop"
    write_flat(path, eos_id=eos)
    m = tl.load_model(str(path), max_seq_len=96, backend="cpu")
    yield m, eos
    tl.free_model(m)


@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("alpha", [0.0, 1.0, 2.0])
def test_eos_ends_beams(eos_model, K, alpha):
    m, eos = eos_model
    for p in PROMPTS:
        st_ = GenerateStats()
        out = beam(m, p, st_, max_tokens=8, beam_size=K, length_penalty=alpha)
        want, _ = reference_beam(model_logits(m, p), m.vocab_size, K, 8, alpha, eos=eos)
        assert out == p + want
        gen = out[len(p):]
        assert eos not in gen[:-1]
        if gen[-1] == eos:
            assert st_.stop_reason == StopReason.EOS
        else:
            assert st_.stop_reason == StopReason.MAX_TOKENS and len(gen) == 8
    # the EOS is reached by at least one configuration (the test is not vacuous)
    p = PROMPTS[0]
    assert beam(m, p, max_tokens=8, beam_size=3, length_penalty=0.0)[-1] == eos


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_stop_sequences_end_beams(flat, alpha):
    p = PROMPTS[0]
    free = beam(flat, p, max_tokens=6, beam_size=3, length_penalty=alpha)[len(p):]
    stops = [[96, 95, 94], free[1:3], [free[3]]]
    st_ = GenerateStats()
    out = beam(flat, p, st_, max_tokens=6, beam_size=3, length_penalty=alpha, stop_sequences=stops)
    want, _ = reference_beam(model_logits(flat, p), flat.vocab_size, 3, 6, alpha, stops=stops)
    assert out == p + want
    gen = out[len(p):]
    hit = [any(tuple(gen[:i][-len(s):]) == tuple(s) for s in stops if len(s) <= i) for i in range(1, len(gen) + 1)]
    assert not any(hit[:-1])
    assert st_.stop_reason == (StopReason.STOP_SEQUENCE if hit[-1] else StopReason.MAX_TOKENS)
    assert hit[-1] and len(gen) < 6     # the stop sequence taken from the free run ends the beam early


def test_max_tokens_zero_and_one(flat, monkeypatch):
    p = PROMPTS[0]
    calls = []
    real = flat.backend.alloc_cache
    monkeypatch.setattr(flat.backend, "alloc_cache", lambda *a: calls.append(a) or real(*a))
    st_ = GenerateStats()
    assert beam(flat, p, st_, max_tokens=0, beam_size=3) == p
    assert st_.stop_reason == StopReason.MAX_TOKENS and st_.tokens_emitted == 0 and calls == []
    st_ = GenerateStats()
    one = beam(flat, p, st_, max_tokens=1, beam_size=3)
    assert len(calls) == 1          # max_tokens=1 needs no second lane
    assert one == tl.generate(flat, p, GenerateConfig(max_tokens=1))
    assert st_.stop_reason == StopReason.MAX_TOKENS and st_.tokens_emitted == 1


def test_stream_callback_and_iter(flat):
    p = PROMPTS[0]
    cfg = GenerateConfig(max_tokens=6, beam_size=3)
    full = tl.generate(flat, p, cfg)
    seen = []
    assert tl.generate_stream(flat, p, cfg, on_token=lambda t, pos: seen.append((t, pos)) or True) == full
    assert seen == [(t, len(p) + i) for i, t in enumerate(full[len(p):])]
    assert p + list(tl.generate_iter(flat, p, cfg)) == full
    st_ = GenerateStats()
    out = tl.generate_stream(flat, p, cfg, on_token=lambda t, pos: pos < len(p) + 1, stats=st_)
    assert out == full[:len(p) + 2] and st_.stop_reason == StopReason.CALLBACK_ABORT


# =============================================================================== memory and errors
def test_memory_returns_to_base(flat):
    p = PROMPTS[0]
    base = tl.vram_usage_bytes(flat)
    beam(flat, p, max_tokens=6, beam_size=4)
    assert tl.vram_usage_bytes(flat) == base
    it = tl.generate_iter(flat, p, GenerateConfig(max_tokens=6, beam_size=4))
    next(it)
    from tinyloop.runtime.cache import build_spec, linear_slots
    from tinyloop.runtime.plugins import get_plugin_manager
    spec = build_spec(flat.cfg, flat.cfg.default_loops, get_plugin_manager().cache_modes()["fp16"],
                      linear_slots(len(p) + 6))
    one_cache = flat.backend.alloc_cache(spec).nbytes
    assert tl.vram_usage_bytes(flat) == base + 4 * one_cache     # four lanes held while decoding
    it.close()
    assert tl.vram_usage_bytes(flat) == base
    out = tl.generate_stream(flat, p, GenerateConfig(max_tokens=6, beam_size=4), on_token=lambda t, pos: False)
    assert len(out) == len(p) + 1
    assert tl.vram_usage_bytes(flat) == base


@pytest.mark.parametrize("call,exc,match", [
    (lambda m, p: tl.generate(m, p, GenerateConfig(beam_size=2, temperature=0.8)),
     tl.IncompatibleModesError, "beam_search and sampling cannot be combined"),
    (lambda m, p: tl.generate(m, p, GenerateConfig(beam_size=2, repetition_penalty=1.3)),
     tl.IncompatibleModesError, "beam_search and repetition_penalty"),
    (lambda m, p: tl.generate_batch(m, [p, p], GenerateConfig(beam_size=3)),
     tl.IncompatibleModesError, r"beam_search \(beam_size=3\) is rejected in batched decoding"),
    (lambda m, p: tl.generate(m, p, GenerateConfig(beam_size=2, early_exit_patience=2)),
     tl.IncompatibleModesError, "per-token adaptive depth does not compose with beams"),
])
def test_rejected_before_any_allocation(flat, monkeypatch, call, exc, match):
    calls = []
    monkeypatch.setattr(flat.backend, "alloc_cache", lambda *a: calls.append(a))
    with pytest.raises(exc, match=match):
        call(flat, PROMPTS[0])
    assert calls == []


def test_beam_is_the_automatic_decoder():
    from tinyloop.runtime.plugins import get_plugin_manager
    pm = get_plugin_manager()
    assert pm.decoder_for(GenerateConfig(beam_size=2)) is BeamSearchDecoder
    assert pm.decoder_for(GenerateConfig(beam_size=1)).name == "greedy"


def test_processors_are_refused_not_ignored(flat, prompt):
    """A processor under beam search (only reachable through a third-party plugin) is an error."""
    from tinyloop.runtime.plugins import get_plugin_manager
    from tinyloop.runtime.hookspecs import hookimpl
    from tinyloop.runtime.processors import LogitProcessor

    class Shift(LogitProcessor):
        name = "test_shift"

        @classmethod
        def from_config(cls, config):
            return cls() if config.beam_size >= 2 else None

    class P:
        @hookimpl
        def tinyloop_processors(self):
            return [Shift]
    pm = get_plugin_manager()
    plugin = P()
    pm.register(plugin, name="beam_test_processor")
    try:
        base = tl.vram_usage_bytes(flat)
        with pytest.raises(tl.PluginError, match=r"logit processors \(active: \['test_shift'\]\)"):
            tl.generate(flat, prompt, GenerateConfig(max_tokens=3, beam_size=2))
        assert tl.vram_usage_bytes(flat) == base
    finally:
        pm.unregister(plugin)


# =============================================================================== engine lanes
def _session(model, prompt, max_tokens, cache_mode="fp16"):
    cfg = GenerateConfig(max_tokens=max_tokens, cache_mode=cache_mode)
    plan = Plan(model, cfg, "single")
    return Session(model, list(prompt), plan, ProcessorChain([]), GenerateStats())


@pytest.mark.parametrize("cache_mode", ["fp16", "fp32"])
def test_session_lanes_fork_and_copy(flat, cache_mode):
    p = PROMPTS[0]
    base = tl.vram_usage_bytes(flat)
    s = _session(flat, p, 6, cache_mode)
    try:
        one = s.cache_bytes
        s.fork_pool(3)
        assert s.lanes == 3 and tl.vram_usage_bytes(flat) == base + 3 * one
        s.start()
        s.advance(5, lane=0)
        s.copy_state(2, 0)
        assert s.lane_tokens(2) == p + [5] and s.lane_tokens(1) == p
        s.advance(7, lane=2)
        got2 = s.logits(2).copy()
        with pytest.raises(tl.PluginError, match="not lane 0's"):
            s.logits(0)
        s.advance(9, lane=0)
        got0 = s.logits(0).copy()
        s.advance(11, lane=1)                  # a fresh lane prefills its prompt on first use
        got1 = s.logits(1).copy()
        s.copy_state(1, 1)
        s.copy_state(1, 2)                     # the pending lane's logits become stale
        with pytest.raises(tl.PluginError, match="stale"):
            s.logits(1)
        with pytest.raises(tl.PluginError, match=r"lane=3 is outside"):
            s.advance(1, lane=3)
        with pytest.raises(tl.PluginError, match="lane=-1"):
            s.copy_state(-1, 0)
    finally:
        s.close()
        s.close()
    assert tl.vram_usage_bytes(flat) == base
    assert np.array_equal(got2, tl.score_last_token(flat, p + [5, 7], cache_mode=cache_mode))
    assert np.array_equal(got0, tl.score_last_token(flat, p + [5, 9], cache_mode=cache_mode))
    assert np.array_equal(got1, tl.score_last_token(flat, p + [11], cache_mode=cache_mode))


def test_copy_cache_backend_op(flat):
    from tinyloop.runtime.cache import build_spec, linear_slots
    from tinyloop.runtime.plugins import get_plugin_manager
    be, modes = flat.backend, get_plugin_manager().cache_modes()

    def spec(slots, mode="fp32"):
        return build_spec(flat.cfg, 1, modes[mode], linear_slots(slots))
    a = be.alloc_cache(spec(5))
    b = be.alloc_cache(spec(5))
    for st in a.storages():
        st.data[:] = np.arange(st.data.size, dtype=np.float32).reshape(st.data.shape)
    be.copy_cache(b, a, 3)
    for sa, sb in zip(a.storages(), b.storages()):
        assert np.array_equal(sb.data[:, :3], sa.data[:, :3]) and not sb.data[:, 3:].any()
    with pytest.raises(tl.BackendError, match="does not fit"):
        be.copy_cache(be.alloc_cache(spec(6)), a, 3)
    with pytest.raises(tl.BackendError, match="does not fit"):
        be.copy_cache(be.alloc_cache(spec(5, "fp16")), a, 3)


# =============================================================================== tie-breaking
def request_stoppers(config, model_config, prompt):
    """The request's per-sequence stop rules, as the engine hands them to a session."""
    from tinyloop.runtime.plugins import get_plugin_manager
    chain = StopperChain(get_plugin_manager().stoppers_for(config, model_config))
    chain.reset(prompt)
    return chain


class ScriptedSession:
    """A DecodeSession whose logits are a function of each lane's tokens (small integers, so ties
    are everywhere); lanes are plain token lists, so a lane mix-up changes the logits."""

    def __init__(self, prompt, config, V, f, eos=None):
        self.config, self.vocab_size, self.eos_id, self.f = config, V, eos, f
        self.stoppers = request_stoppers(config, SimpleNamespace(eos_id=eos, vocab_size=V), prompt)
        self.chain = ProcessorChain([])
        self.stats = GenerateStats()
        self.prompt = list(prompt)
        self._lanes = [list(prompt)]
        self._pending = None
        self.forwards = 0

    @property
    def lanes(self):
        return len(self._lanes)

    def fork_pool(self, n):
        while len(self._lanes) < n:
            self._lanes.append(list(self.prompt))

    def start(self):
        self._pending = 0

    def advance(self, token, lane=0):
        self._lanes[lane].append(int(token))
        self._pending = lane
        self.forwards += 1

    def copy_state(self, dst, src):
        self._lanes[dst] = list(self._lanes[src])
        if self._pending == dst:
            self._pending = None

    def logits(self, lane=0):
        assert lane == self._pending
        return self.f(tuple(self._lanes[lane][len(self.prompt):]))


def tie_logits(V, seed, levels):
    def f(toks):
        h = zlib.crc32(np.asarray((seed,) + toks, np.int64).tobytes())
        return np.random.default_rng(h).integers(0, levels, V).astype(np.float32)
    return f


@settings(max_examples=300, deadline=None)
@given(V=st.integers(2, 6), K=st.integers(1, 5), N=st.integers(1, 6),
       alpha=st.sampled_from([0.0, 0.5, 1.0, 2.0, -1.0]), seed=st.integers(0, 10 ** 6),
       levels=st.integers(1, 3), eos=st.one_of(st.none(), st.integers(0, 5)),
       stops=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=2), max_size=2))
def test_tie_breaking_matches_reference(V, K, N, alpha, seed, levels, eos, stops):
    eos = None if eos is None or eos >= V else eos
    stops = [s for s in stops if max(s) < V]
    f = tie_logits(V, seed, levels)
    cfg = GenerateConfig(max_tokens=N, beam_size=K, length_penalty=alpha, stop_sequences=stops)
    s = ScriptedSession([1, 2], cfg, V, f, eos=eos)
    got = list(BeamSearchDecoder(cfg).decode(s))
    want, _ = reference_beam(f, V, K, N, alpha, eos=eos, stops=[tuple(x) for x in stops])
    assert got == want


def test_tie_breaking_rules():
    """All logits equal: every candidate ties, so the lowest token ids win at every step."""
    V = 4
    cfg = GenerateConfig(max_tokens=3, beam_size=2, length_penalty=1.0)
    s = ScriptedSession([0], cfg, V, lambda toks: np.zeros(V, np.float32))
    assert list(BeamSearchDecoder(cfg).decode(s)) == [0, 0, 0]
    # uniform logits, length_penalty 1: every finished beam scores exactly log(1/V) (2*x/2 == x),
    # so the EOS beam that finished first (step 1) wins over the equal ones of step 2
    cfg = GenerateConfig(max_tokens=2, beam_size=2, length_penalty=1.0)
    s = ScriptedSession([0], cfg, V, lambda toks: np.zeros(V, np.float32), eos=0)
    assert list(BeamSearchDecoder(cfg).decode(s)) == [0]
    assert s.stats.beams_finished == 5      # (0,) then (1,0), (2,0), (1,1), (2,1)
    # a parent's rank breaks ties between equal (score, token) candidates
    cfg = GenerateConfig(max_tokens=2, beam_size=2, length_penalty=0.0)
    s = ScriptedSession([0], cfg, V, lambda toks: np.zeros(V, np.float32), eos=None)
    assert list(BeamSearchDecoder(cfg).decode(s)) == [0, 0]


def test_early_stop_saves_forwards():
    """When finished beams beat every live bound the search stops before max_tokens."""
    V = 5

    def f(toks):
        row = np.zeros(V, np.float32)
        row[0] = 20.0        # EOS (id 0) is near-certain everywhere
        return row
    cfg = GenerateConfig(max_tokens=20, beam_size=2, length_penalty=0.0)
    s = ScriptedSession([1], cfg, V, f, eos=0)
    assert list(BeamSearchDecoder(cfg).decode(s)) == [0]
    assert s.forwards <= 2 and s.stats.beams_finished >= 2


def test_bound_lets_a_growing_beam_win():
    """length_penalty > 0: a live beam's score can still rise as it grows (log_prob / n**2 with a
    near-certain continuation), so finished beams must not stop the search before max_tokens
    allows it. Here the beam of forty 1s beats every EOS-terminated beam."""
    def f(toks):
        p = [0.99, 0.01] if not toks else [0.001, 0.999]
        return np.log(np.array(p)).astype(np.float32)
    cfg = GenerateConfig(max_tokens=40, beam_size=2, length_penalty=2.0)
    s = ScriptedSession([1], cfg, 2, f, eos=0)
    got = list(BeamSearchDecoder(cfg).decode(s))
    assert got == [1] * 40
    assert got == reference_beam(f, 2, 2, 40, 2.0, eos=0)[0]


def test_log_probs_are_float64():
    """Two beams whose totals differ by 1e-13 (below float32 resolution) rank by that difference."""
    def f(toks):
        if not toks:
            return np.zeros(2, np.float32)
        return np.array([0.0, -30.0 if toks == (0,) else -1e4], np.float32)
    cfg = GenerateConfig(max_tokens=2, beam_size=2, length_penalty=0.0)
    s = ScriptedSession([1], cfg, 2, f)
    assert list(BeamSearchDecoder(cfg).decode(s)) == [1, 0]


def test_log_softmax_special_values():
    from tinyloop.plugins.decoders.beam import log_softmax
    lp = log_softmax(np.array([0.0, np.nan, 0.0], np.float32))
    assert lp[1] == -np.inf and np.allclose(lp[[0, 2]], np.log(0.5))
    lp = log_softmax(np.array([np.inf, 1.0, np.inf], np.float32))
    assert lp.tolist() == [-np.log(2), -np.inf, -np.log(2)]
    assert np.allclose(log_softmax(np.full(4, -np.inf, np.float32)), np.log(0.25))
    assert np.allclose(log_softmax(np.array([1.0, 2.0, 3.0])), ref_log_softmax([1.0, 2.0, 3.0]))


# =============================================================================== CUDA (marker gpu)
def _gpu():
    try:
        from numba import cuda
        import numba
        return not numba.config.ENABLE_CUDASIM and cuda.is_available()
    except Exception:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu(), reason="no CUDA GPU")
@pytest.mark.parametrize("graphs", ["1", "0"])
def test_beam_on_gpu(tmp_path, flat_path, monkeypatch, graphs):
    """Lanes on the CUDA backend: copy_cache (device-to-device), one captured step graph per lane,
    positions re-uploaded when the lane changes. The output equals the reference over the GPU's own
    logits, and the CPU's on the peaky model; a repeated request takes no more memory (the lanes'
    caches are kept as spares and reused)."""
    from conftest import write_tiny
    monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", graphs)
    peaky = tmp_path / "peaky.tinyloop"
    write_tiny(peaky, seed=5)
    for path in (flat_path, peaky):
        gpu = tl.load_model(str(path), max_seq_len=96, backend="cuda")
        cpu = tl.load_model(str(path), max_seq_len=96, backend="cpu")
        try:
            assert gpu.backend.use_graphs == (graphs == "1")
            for p in PROMPTS:
                for K, alpha, cache_mode in [(2, 1.0, "fp16"), (4, 0.0, "fp32"), (3, 2.0, "fp16")]:
                    cfg = GenerateConfig(max_tokens=8, beam_size=K, length_penalty=alpha, cache_mode=cache_mode)
                    tl.generate(gpu, p, GenerateConfig(max_tokens=8, cache_mode=cache_mode))
                    launches = gpu.backend.graph_launches
                    out = tl.generate(gpu, p, cfg)
                    after_beam = tl.vram_usage_bytes(gpu)
                    assert out == tl.generate(gpu, p, cfg)
                    assert tl.vram_usage_bytes(gpu) == after_beam     # released lanes are reused, no growth
                    want, _ = reference_beam(model_logits(gpu, p, None, cache_mode), gpu.vocab_size, K, 8, alpha)
                    assert out == p + want
                    if path == peaky:
                        assert out == tl.generate(cpu, p, cfg)
                    if graphs == "1":
                        assert gpu.backend.graph_launches > launches
        finally:
            tl.free_model(gpu)
            tl.free_model(cpu)
