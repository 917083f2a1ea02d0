"""Edges of beam search and of the scoring APIs, as a demanding user meets them.

Beam search: an exhaustive enumeration of every continuation on a five-token model (beam_size at
and beyond the number of candidates, EOS inside beams), a textbook reference over the model's own
logits with window and quantized caches, the lanes a search holds, what a stream callback sees,
and the knobs / reuse modes refused before any work. Scoring: every function against the float64
oracle and a re-implementation over tl.score at the loop and length edges, ids of every integer
dtype, typed errors naming the value, a sliding-window model, and the escalation's working state
under the live handle cap."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import tinyloop as tl
from tinyloop import GenerateConfig, GenerateStats, StopReason
from tinyloop.model.arch import ModelConfig, TensorQuant
from tinyloop.model.format import write_model
from tinyloop.model.reference import reference_logits

from conftest import TINY, logical_weights, random_weights, write_tiny

P = [3, 17, 42, 8, 91, 23, 11, 60, 2, 77]


def lsm(z):
    z = np.asarray(z, np.float64)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def textbook_beam(lp_of, V, K, N, alpha, ends=lambda toks: False):
    """Beam search as the docs define it, written out plainly: each step every live hypothesis is
    extended by every token; all extensions are ranked by log_prob / max(1, len) ** alpha (ties:
    lower token, then the parent's rank); walking the ranking, an extension a stop rule ends is
    finished, the others continue (or finish at max_tokens) until K have been taken. The answer is
    the best finished hypothesis, the earliest finished among equal scores."""
    live, done = [((), 0.0)], []
    for n in range(1, N + 1):
        ranked = sorted(((-(lp + step[t]) / max(1, n) ** alpha, t, rank, lp + step[t])
                         for rank, (toks, lp) in enumerate(live)
                         for step in [lp_of(toks)] for t in range(V)))
        nxt, taken = [], 0
        for neg, t, rank, lp in ranked:
            toks = live[rank][0] + (t,)
            if ends(toks):
                done.append((-neg, toks))
                continue
            taken += 1
            (done.append((-neg, toks)) if n == N else nxt.append((toks, lp)))
            if taken == K:
                break
        live = nxt
        if not live:
            break
    best = max(range(len(done)), key=lambda i: (done[i][0], -i))
    return list(done[best][1])


def memo_lp(fn):
    memo = {}

    def f(toks):
        if toks not in memo:
            memo[toks] = lsm(fn(toks))
        return memo[toks]
    return f


def count_allocs(model, monkeypatch):
    calls = []
    real = model.backend.alloc_cache
    monkeypatch.setattr(model.backend, "alloc_cache", lambda *a: calls.append(a) or real(*a))
    return calls


# =============================================================================== models
@pytest.fixture(scope="module")
def flat_path(tmp_path_factory):
    """The tiny model with small embeddings: flat logits, so beams differ from greedy."""
    path = tmp_path_factory.mktemp("edges") / "flat.tinyloop"
    cfg = ModelConfig(**TINY)
    w = random_weights(cfg, 0)
    w["embed"] = (w["embed"] * 0.25).astype(np.float32)
    write_model(str(path), cfg, w, default_quant=TensorQuant("f16", 0))
    return path


@pytest.fixture(scope="module")
def flat(flat_path):
    m = tl.load_model(str(flat_path), max_seq_len=40, backend="cpu", prefill_chunk=8)
    m.W = logical_weights(flat_path)
    yield m
    tl.free_model(m)


@pytest.fixture(scope="module", params=[None, 2], ids=["no_eos", "eos2"])
def five(request, tmp_path_factory):
    """A model with a five-token vocabulary, so every continuation can be enumerated."""
    path = tmp_path_factory.mktemp("five") / "v5.tinyloop"
    write_tiny(path, seed=4, vocab_size=5, eos_id=request.param)
    m = tl.load_model(str(path), max_seq_len=16, backend="cpu")
    yield m, request.param
    tl.free_model(m)


# =============================================================================== beam search
@pytest.mark.parametrize("alpha", [0.0, 1.0, 2.0, -1.0])
@pytest.mark.parametrize("N,K", [(2, 5), (2, 64), (3, 25), (3, 64)])
def test_beam_equals_exhaustive_enumeration_when_beams_cover_every_prefix(five, monkeypatch, alpha, N, K):
    """With beam_size >= V ** (N - 1) no prefix is ever dropped, so beam search must return the
    best of ALL continuations: every sequence of N tokens, and every shorter one that ends on EOS
    (score log_prob / len ** length_penalty). The search holds one cache per beam that can exist:
    min(beam_size, V ** (N - 1)), not beam_size."""
    m, eos = five
    p = [1, 3, 0]
    V = m.vocab_size
    lp = memo_lp(lambda toks: tl.score_last_token(m, p + list(toks)))
    best = None
    for n in range(1, N + 1):
        for seq in itertools.product(range(V), repeat=n):
            if eos is not None and eos in seq[:-1]:
                continue                             # ended earlier
            if n < N and (eos is None or seq[-1] != eos):
                continue                             # neither ended nor at max_tokens
            total = sum(lp(seq[:i])[t] for i, t in enumerate(seq))
            score = total / max(1, n) ** alpha
            if best is None or score > best[0]:
                best = (score, list(seq))
    calls = count_allocs(m, monkeypatch)
    st = GenerateStats()
    base = tl.vram_usage_bytes(m)
    out = tl.generate(m, p, GenerateConfig(max_tokens=N, beam_size=K, length_penalty=alpha), stats=st)
    assert out[len(p):] == best[1]
    assert len(calls) == min(K, V ** (N - 1))
    gen = out[len(p):]
    assert st.tokens_emitted == len(gen) and st.decoder == "beam" and st.loops_used == m.cfg.default_loops
    assert st.stop_reason == (StopReason.EOS if eos is not None and gen[-1] == eos else StopReason.MAX_TOKENS)
    assert st.loop_iters_run % m.cfg.default_loops == 0 and st.beams_finished >= 1
    assert tl.vram_usage_bytes(m) == base                       # every lane released


def test_beam_max_tokens_one_is_greedy_for_any_beam_size(flat, monkeypatch):
    g = tl.generate(flat, P, GenerateConfig(max_tokens=1))
    for K in (2, 5, 97, 256):
        calls = count_allocs(flat, monkeypatch)
        assert tl.generate(flat, P, GenerateConfig(max_tokens=1, beam_size=K)) == g
        assert len(calls) == 1


@pytest.mark.parametrize("case", ["window8", "int8", "int4", "loops1_fp32", "loops8_fp32"])
def test_beam_matches_a_textbook_reference_with_every_cache(flat, case):
    """Beams over window rings and quantized caches (compat.yaml: single ok) rank by the logits
    that cache gives; the reference reads them through tl.score_decoded (the decode steps, window
    included) or tl.score_last_token (same cache mode)."""
    kw = dict(window8=dict(cache_window=8), int8=dict(cache_mode="int8"), int4=dict(cache_mode="int4"),
              loops1_fp32=dict(loops=1, cache_mode="fp32"), loops8_fp32=dict(loops=8, cache_mode="fp32"))[case]
    if "cache_window" in kw:
        lp = memo_lp(lambda toks: tl.score_decoded(flat, P + list(toks), GenerateConfig(**kw))[-1])
    else:
        lp = memo_lp(lambda toks: tl.score_last_token(flat, P + list(toks), loops=kw.get("loops"),
                                                      cache_mode=kw["cache_mode"]))
    for K, alpha, N in [(3, 1.0, 7), (2, 0.0, 5), (4, 2.0, 5)]:
        out = tl.generate(flat, P, GenerateConfig(max_tokens=N, beam_size=K, length_penalty=alpha, **kw))
        assert out[len(P):] == textbook_beam(lp, flat.vocab_size, K, N, alpha), (K, alpha)


def test_beam_stream_sees_only_the_finished_search(flat):
    """Tokens reach on_token after the search: at the first callback every forward has run (the
    stats' loop work is final), positions count from the prompt, and the callback's stop ends the
    returned list right there."""
    cfg = GenerateConfig(max_tokens=6, beam_size=3, length_penalty=0.5)
    st = GenerateStats()
    seen = []
    full = tl.generate_stream(flat, P, cfg, stats=st,
                              on_token=lambda t, pos: seen.append((t, pos, st.loop_iters_run, st.beams_finished)))
    assert [s[:2] for s in seen] == [(t, len(P) + i) for i, t in enumerate(full[len(P):])]
    assert {s[2] for s in seen} == {st.loop_iters_run} and seen[0][3] == st.beams_finished >= 3
    cut = tl.generate_stream(flat, P, cfg, stats=st, on_token=lambda t, pos: pos < len(P) + 2)
    assert cut == full[:len(P) + 3] and st.stop_reason == StopReason.CALLBACK_ABORT and st.tokens_emitted == 3


@pytest.mark.parametrize("bad, match", [
    (dict(sample_seed=7), "sample_seed=7 is set, but decoder 'beam' ignores it"),
    (dict(top_k=5), "top_k=5 is set, but decoder 'beam' ignores it"),
    (dict(top_p=0.5), "top_p=0.5 is set, but decoder 'beam' ignores it"),
    (dict(temperature=0.5), "beam_search and sampling cannot be combined"),
])
def test_beam_sampling_knobs_are_refused_before_work(flat, monkeypatch, bad, match):
    calls = count_allocs(flat, monkeypatch)
    with pytest.raises(tl.IncompatibleModesError, match=match):
        tl.generate(flat, P, GenerateConfig(max_tokens=3, beam_size=2, **bad))
    with pytest.raises(tl.IncompatibleModesError, match=match):
        tl.generate_iter(flat, P, GenerateConfig(max_tokens=3, beam_size=2, **bad))
    assert calls == []
    # a temperature at or below 0.01 is greedy's 0: accepted, the same beams
    assert (tl.generate(flat, P, GenerateConfig(max_tokens=3, beam_size=2, temperature=0.005))
            == tl.generate(flat, P, GenerateConfig(max_tokens=3, beam_size=2)))


def test_beam_with_prefix_reuse_or_warm_start_is_refused_before_work(flat, monkeypatch):
    pc = tl.build_prefix_cache(flat, P[:5])
    pool = tl.create_prefix_pool(2)
    tl.register_prefix(pool, flat, P[:5])
    h = tl.build_resume_handle(flat, P, 2)
    try:
        calls = count_allocs(flat, monkeypatch)
        beam = GenerateConfig(max_tokens=3, beam_size=2)
        for call, ctx in [(lambda: tl.generate_from_prefix_cache(flat, pc, P[5:], beam), "prefix_reuse"),
                          (lambda: tl.generate_with_pool(flat, pool, P, beam), "prefix_reuse"),
                          (lambda: tl.resume_generate(h, 3, beam), "warm_start")]:
            with pytest.raises(tl.IncompatibleModesError, match=rf"beam_search \(beam_size=2\) is rejected in {ctx}"):
                call()
        assert calls == []
    finally:
        tl.free_prefix_cache(pc)
        tl.free_prefix_pool(pool)
        tl.free_resume_handle(h)


# =============================================================================== scoring
def _ids(n, seed=0, V=97):
    return [int(t) for t in np.random.default_rng(seed).integers(0, V, n)]


@pytest.mark.parametrize("T", [1, 40], ids=["one_token", "max_seq_len"])
@pytest.mark.parametrize("L", [1, 8], ids=["loops1", "max_loops"])
def test_scoring_at_the_edges_against_the_oracle(flat, T, L):
    """One token and max_seq_len tokens (five prefill chunks), depth 1 and max_loops: score is the
    float64 oracle's logits, score_last_token its last row, score_decoded and the lens' last depth
    score itself bit for bit; shapes and dtypes as documented."""
    ids = _ids(T, T + L)
    S = tl.score(flat, ids, loops=L, cache_mode="fp32")
    assert S.shape == (T, 97) and S.dtype == np.float32
    np.testing.assert_allclose(S, reference_logits(flat.cfg, flat.W, ids, L), rtol=1e-4, atol=1e-4)
    last = tl.score_last_token(flat, ids, loops=L, cache_mode="fp32")
    assert last.shape == (97,) and last.dtype == np.float32 and np.array_equal(last, S[-1])
    dec = tl.score_decoded(flat, ids, GenerateConfig(loops=L, cache_mode="fp32"))
    assert dec.dtype == np.float32 and np.array_equal(dec, S)
    lens = tl.score_logit_lens(flat, ids, loops=L, cache_mode="fp32")
    assert lens.shape == (L, T, 97) and lens.dtype == np.float32 and np.array_equal(lens[-1], S)
    assert np.array_equal(lens[0], tl.score(flat, ids, loops=1, cache_mode="fp32"))
    top = tl.score_logit_lens(flat, ids, loops=L, top_k=97)
    assert top.ids.shape == (L, T, 97) and top.ids.dtype == np.int64 and top.logprobs.dtype == np.float32
    assert (np.sort(top.ids, -1) == np.arange(97)).all()          # top_k = vocab: a permutation


@pytest.mark.parametrize("L", [1, 2, 8])
def test_uncertainty_is_its_definition_over_score(flat, L):
    """Every field of score_with_uncertainty recomputed from tl.score at each depth."""
    ids = _ids(23, L)
    u = tl.score_with_uncertainty(flat, ids, loops=L)
    S = [tl.score(flat, ids, loops=d) for d in range(1, L + 1)]
    lp = [lsm(s) for s in S]
    p = np.exp(lp[-1])
    assert u.loops == L and np.array_equal(u.logits, S[-1])
    np.testing.assert_allclose(u.entropy, -(p * lp[-1]).sum(-1), rtol=1e-5, atol=1e-6)
    ps = np.sort(p, -1)
    np.testing.assert_allclose(u.margin, ps[:, -1] - ps[:, -2], rtol=1e-5, atol=1e-6)
    am = np.array([s.argmax(-1) for s in S])
    assert u.argmax.shape == (L, 23) and np.array_equal(u.argmax, am)
    settled = [min(d for d in range(1, L + 1) if (am[d - 1:, t] == am[-1, t]).all()) for t in range(23)]
    assert u.settled_depth.tolist() == settled
    kl = np.array([(p * (lp[-1] - lp[d])).sum(-1) for d in range(L)])
    assert u.kl_to_final.shape == (L, 23)
    np.testing.assert_allclose(u.kl_to_final, np.maximum(kl, 0), rtol=1e-4, atol=1e-6)
    assert not u.kl_to_final[-1].any() and (u.kl_to_final >= 0).all()


def test_escalation_at_the_extreme_depths_and_thresholds(flat):
    ids = _ids(40, 9)
    lo, hi = 1, flat.cfg.max_loops
    low, high = tl.score(flat, ids, loops=lo), tl.score(flat, ids, loops=hi)
    every = tl.score_with_consistency_escalation(flat, ids, lo, hi, "entropy", 0.0)   # entropy > 0 everywhere
    assert every.escalated.all() and np.array_equal(every.logits, high)
    assert every.loop_work == hi * 40 and every.saved == 0.0 and (every.depth == hi).all()
    none = tl.score_with_consistency_escalation(flat, ids, lo, hi, "margin", 0.0)      # margin < 0 never
    assert not none.escalated.any() and np.array_equal(none.logits, low)
    assert none.loop_work == lo * 40 and math.isclose(none.saved, 1 - lo / hi)
    one = tl.score_with_consistency_escalation(flat, ids[:1], hi - 1, hi, "disagreement")
    want = tl.score(flat, ids[:1], loops=hi - 1).argmax() != tl.score(flat, ids[:1], loops=hi - 2).argmax()
    assert one.escalated.tolist() == [bool(want)]
    assert np.array_equal(one.logits, tl.score(flat, ids[:1], loops=int(one.depth[0])))


def test_scoring_is_deterministic(flat):
    ids = _ids(33, 5)
    for f in (lambda: tl.score(flat, ids, loops=3), lambda: tl.score_logit_lens(flat, ids, loops=3),
              lambda: tl.score_with_uncertainty(flat, ids, loops=3).kl_to_final,
              lambda: tl.score_with_consistency_escalation(flat, ids, 2, 5, "entropy", 2.5).logits):
        a, b = f(), f()
        assert np.array_equal(a, b)


def _scorers(model):
    return {
        "score": lambda ids: tl.score(model, ids, loops=2),
        "score_last_token": lambda ids: tl.score_last_token(model, ids, loops=2),
        "score_decoded": lambda ids: tl.score_decoded(model, ids, GenerateConfig(loops=2)),
        "score_logit_lens": lambda ids: tl.score_logit_lens(model, ids, loops=2),
        "score_with_uncertainty": lambda ids: tl.score_with_uncertainty(model, ids, loops=2).logits,
        "score_with_consistency_escalation":
            lambda ids: tl.score_with_consistency_escalation(model, ids, 1, 3, "entropy", 2.0).logits,
    }


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                                   np.uint64, np.intp, np.uintp])
def test_ids_of_every_integer_dtype(flat, dtype):
    ids = _ids(12, 3, V=97)
    for name, f in _scorers(flat).items():
        assert np.array_equal(f(np.array(ids, dtype)), f(ids)), name


@pytest.mark.parametrize("bad, match", [
    ([4, None, 5], r"tokens\[1\]=None is not a token id"),
    ([4, 5, 2.5], r"tokens\[2\]=2\.5 is not a token id"),
    ([4, "a"], r"tokens\[1\]='a' is not a token id"),
    ([4, np.float32(3)], r"tokens\[1\]=np\.float32\(3\.0\) is not a token id"),
    ([4, 2 ** 70], r"tokens\[1\]=1180591620717411303424 is outside the vocabulary \[0, 97\)"),
    ([4, -2 ** 70], r"tokens\[1\]=-1180591620717411303424 is outside the vocabulary \[0, 97\)"),
])
def test_a_bad_id_in_a_list_is_named(flat, monkeypatch, bad, match):
    """A list holding something that is not a token id names it and its index (it said 'got
    dtype object with shape (2,)'), before any work, in every scoring call."""
    calls = count_allocs(flat, monkeypatch)
    for name, f in _scorers(flat).items():
        with pytest.raises(tl.InvalidInputError, match=match):
            f(bad)
    assert calls == []


@pytest.mark.parametrize("loops, match", [
    (0, r"loops=0 is outside the allowed range \[1, 8\] \(model.max_loops\)"),
    (9, r"loops=9 is outside the allowed range \[1, 8\]"),
    (2.0, r"loops=2.0 must be an integer in \[1, 8\]"),
    (np.bool_(True), r"loops=np.True_ must be an integer in \[1, 8\]"),
])
def test_score_loops_errors_name_the_models_range(flat, loops, match):
    """score and score_last_token say what the model allows, as the rest of the family does (score
    said 'outside the allowed range >= 1' for 0 and gave no range for 2.0)."""
    for f in (tl.score, tl.score_last_token, tl.score_logit_lens, tl.score_with_uncertainty):
        with pytest.raises(tl.ConfigError, match=match):
            f(flat, [1, 2], loops=loops)


@pytest.mark.parametrize("depths, match", [
    ([1.0], r"depths holds 1\.0, not a loop depth \(an integer in \[1, 3\]\)"),
    ([2, True], r"depths holds True, not a loop depth"),
    ([np.bool_(True)], r"depths holds np\.True_, not a loop depth"),
    (np.array([1.0, 2.0]), r"depths holds 1\.0, not a loop depth"),
])
def test_lens_depths_of_the_wrong_type_are_not_called_out_of_range(flat, depths, match):
    with pytest.raises(tl.ConfigError, match=match) as ei:
        tl.score_logit_lens(flat, [1, 2, 3], loops=3, depths=depths)
    assert "outside the allowed range" not in str(ei.value)


def test_scoring_a_sliding_window_model_past_its_window(tmp_path):
    """Past the model's sliding_window the scoring calls refuse (they keep no window cache) with
    advice they can follow: not 'set cache_window' (they take none) and not 'tokens + max_tokens'
    (they take no max_tokens); score_decoded with the window cache is the windowed path."""
    write_tiny(tmp_path / "sw.tinyloop", seed=1, sliding_window=16)
    m = tl.load_model(str(tmp_path / "sw.tinyloop"), max_seq_len=48, backend="cpu")
    try:
        ids = _ids(40, 2)
        base = tl.vram_usage_bytes(m)
        for name, f in _scorers(m).items():
            if name == "score_decoded":
                continue
            with pytest.raises(tl.IncompatibleModesError, match=r"tokens spans 40 positions, past the model's "
                                                                  r"sliding_window=16") as ei:
                f(ids)
            msg = str(ei.value)
            assert "set cache_window" not in msg and "max_tokens" not in msg, name
            assert "score_decoded" in msg and "cache_window=16" in msg, name
        assert tl.vram_usage_bytes(m) == base
        dec = tl.score_decoded(m, ids, GenerateConfig(cache_window=16))
        assert dec.shape == (40, 97)
        assert np.array_equal(dec[:16], tl.score(m, ids[:16]))      # inside the window: the same logits
    finally:
        tl.free_model(m)


def test_escalation_leaves_the_users_handles_alone(flat):
    """score_with_consistency_escalation's low pass is working state of the call, freed before it
    returns: under a live handle cap that fits only the user's own resume handle it must neither
    evict that handle nor fail for lack of room (it evicted the handle, then raised
    HandleBudgetError about 'growing a resume handle' the user never built)."""
    ids = _ids(10, 4)
    h = tl.build_resume_handle(flat, ids, 2)
    try:
        want = tl.score_with_consistency_escalation(flat, ids, 1, 3, "entropy", 0.0)
        tl.set_handle_bytes_cap(tl.live_handle_bytes() + 10)
        base = tl.vram_usage_bytes(flat)
        got = tl.score_with_consistency_escalation(flat, ids, 1, 3, "entropy", 0.0)
        assert np.array_equal(got.logits, want.logits) and got.escalated.all()
        assert h.alive and [r["kind"] for r in tl.live_handles(flat)] == ["ResumeHandle"]
        assert tl.vram_usage_bytes(flat) == base
        tl.set_handle_bytes_cap(None)            # the handle still serves (growing it needs room)
        assert tl.resume_generate(h, 3, GenerateConfig(max_tokens=2)) == \
            tl.generate(flat, ids, GenerateConfig(max_tokens=2, loops=3))
    finally:
        tl.set_handle_bytes_cap(None)
        tl.free_resume_handle(h)
