"""Edges of the scoring APIs, the sampler, the repetition penalty and the stop rules: numpy scalars
where Python numbers are taken, float knobs bounded so the logits stay finite, the stream callback's
numpy bools, the speculative decoders' explicit distribution equal to the sampler's, and the decode
loop against a plain re-implementation over score_last_token."""

from __future__ import annotations

import numpy as np
import pytest

import tinyloop as tl
from tinyloop import GenerateConfig, GenerateStats, StopReason
from tinyloop.runtime.sampling import _ranked, sample_token, sampling_probs, uniforms


def _ids(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 97, n)]


# =============================================================================== numpy scalars
def test_generate_config_takes_numpy_scalars_as_plain_numbers(tiny_model, prompt):
    """Values computed with numpy (np.int64 counts, np.float32 knobs, an np.uint64 seed) mean what
    the Python numbers they hold mean: stored as int / float, equal (and hashing equal) to the
    plain config, and decoding the same tokens."""
    np_cfg = GenerateConfig(max_tokens=np.int64(6), loops=np.int32(2), temperature=np.float32(0.75),
                            top_k=np.int64(20), top_p=np.float64(0.9), repetition_penalty=np.float32(1.25),
                            sample_seed=np.uint64(2 ** 64 - 1), cache_window=np.int16(0))
    plain = GenerateConfig(max_tokens=6, loops=2, temperature=float(np.float32(0.75)), top_k=20, top_p=0.9,
                           repetition_penalty=1.25, sample_seed=2 ** 64 - 1)
    assert np_cfg == plain and hash(np_cfg) == hash(plain)
    for name in ("max_tokens", "loops", "top_k", "sample_seed", "cache_window"):
        assert type(getattr(np_cfg, name)) is int, name
    for name in ("temperature", "top_p", "repetition_penalty"):
        assert type(getattr(np_cfg, name)) is float, name
    assert tl.generate(tiny_model, prompt, np_cfg) == tl.generate(tiny_model, prompt, plain)
    beam = GenerateConfig(max_tokens=3, beam_size=np.int64(2), length_penalty=np.float32(0.5))
    assert type(beam.beam_size) is int and type(beam.length_penalty) is float
    # a numpy bool is still not a count
    with pytest.raises(tl.ConfigError, match="max_tokens must be an integer"):
        GenerateConfig(max_tokens=np.bool_(True))
    with pytest.raises(tl.ConfigError, match="temperature must be a finite number"):
        GenerateConfig(temperature=np.float32("nan"))


def test_stop_sequences_take_numpy_ids_and_arrays(tiny_model, prompt):
    want = ((5, 6), (7,))
    assert GenerateConfig(stop_sequences=[[np.int64(5), np.int32(6)], [np.uint8(7)]]).stop_sequences == want
    assert GenerateConfig(stop_sequences=[np.array([5, 6]), np.array([7])]).stop_sequences == want
    assert GenerateConfig(stop_sequences=np.array([[5, 6], [7, 8]])).stop_sequences == ((5, 6), (7, 8))
    for s in GenerateConfig(stop_sequences=[np.array([5, 6])]).stop_sequences:
        assert all(type(t) is int for t in s)
    for bad, match in [([[np.bool_(True)]], r"stop_sequences\[0\] holds"), ([np.array([1.5])], r"stop_sequences\[0\]"),
                       ([np.array([], np.int64)], r"stop_sequences\[0\] must be a non-empty"),
                       (np.array([5, 6]), "stop_sequences must be a list of token-id lists"),
                       ([np.array([[1, 2]])], r"stop_sequences\[0\]"), ([[np.int64(-1)]], "integers >= 0")]:
        with pytest.raises(tl.ConfigError, match=match):
            GenerateConfig(stop_sequences=bad)
    # the request stops exactly as with the plain list
    g = tl.generate(tiny_model, prompt, GenerateConfig(max_tokens=8))[len(prompt):]
    st = GenerateStats()
    out = tl.generate(tiny_model, prompt, GenerateConfig(max_tokens=8, stop_sequences=[np.array(g[1:3])]), stats=st)
    assert out[len(prompt):] == g[:3] and st.stop_reason == StopReason.STOP_SEQUENCE and st.tokens_emitted == 3


def test_scoring_takes_numpy_loops_top_k_and_threshold(tiny_model):
    ids = _ids(11, 4)
    S = tl.score(tiny_model, ids, loops=2)
    assert np.array_equal(tl.score(tiny_model, ids, loops=np.int64(2)), S)
    assert np.array_equal(tl.score_last_token(tiny_model, ids, loops=np.int32(2)), S[-1])
    lens = tl.score_logit_lens(tiny_model, ids, loops=np.int64(3), top_k=np.int64(4))
    assert lens.ids.shape == (3, 11, 4)
    assert np.array_equal(lens.ids[1, :, 0], S.argmax(-1))
    u = tl.score_with_uncertainty(tiny_model, ids, loops=np.uint8(2))
    assert u.loops == 2 and type(u.loops) is int and np.array_equal(u.logits, S)
    e = tl.score_with_consistency_escalation(tiny_model, ids, np.int64(2), np.int64(4), "entropy", np.float32(0.5))
    ref = tl.score_with_consistency_escalation(tiny_model, ids, 2, 4, "entropy", float(np.float32(0.5)))
    assert np.array_equal(e.logits, ref.logits) and np.array_equal(e.depth, ref.depth)
    # numpy bools are not depths, and a wrong type is not reported as a range error
    with pytest.raises(tl.ConfigError, match="loops"):
        tl.score(tiny_model, ids, loops=np.bool_(True))
    with pytest.raises(tl.ConfigError, match="top_k=2.0"):
        tl.score_logit_lens(tiny_model, ids, top_k=np.float64(2.0))


# =============================================================================== repetition penalty
@pytest.mark.parametrize("value", [1e-300, 1e-40, 1e-7])
def test_repetition_penalty_small_enough_to_overflow_is_refused(value):
    """A penalty below 1 divides positive logits by it: below 1/MAX_PENALTY the float32 logits
    overflow to inf (1e-300 even rounds to a float32 0, a division by zero) and the sampler draws
    from NaN weights. Refused like the upper bound, naming the range."""
    with pytest.raises(tl.ConfigError, match=r"repetition_penalty=.* outside the allowed range \[1e-06, 1e\+06\]"):
        GenerateConfig(repetition_penalty=value)


def test_repetition_penalty_at_its_bounds_keeps_logits_finite(tiny_model, prompt):
    from tinyloop.runtime.plugins import get_plugin_manager
    cls = get_plugin_manager().processors()["repetition_penalty"]
    for value in (1e-6, 1e6):
        p = cls.from_config(GenerateConfig(repetition_penalty=value))
        p.reset(list(range(97)))
        logits = tl.score_last_token(tiny_model, prompt).copy()
        p.apply(logits)
        assert np.isfinite(logits).all()
        out = tl.generate(tiny_model, prompt, GenerateConfig(max_tokens=4, temperature=0.9, repetition_penalty=value))
        assert len(out) == len(prompt) + 4


def _simulate(model, prompt, cfg):
    """The decode state machine written plainly over score_last_token: penalty (HF sign rule, on
    every id of the prompt and the output so far) -> temperature -> top-k -> top-p -> draw with
    uniform number i of the request for generated token i; stop rules checked after each token."""
    out, us = [], uniforms(cfg.sample_seed, cfg.max_tokens)
    for i in range(cfg.max_tokens):
        z = tl.score_last_token(model, prompt + out, loops=cfg.loops).astype(np.float32)
        seen = sorted(set(prompt + out))
        v = z[seen]
        pen = np.float32(cfg.repetition_penalty)
        z[seen] = np.where(v < 0, v * pen, v / pen)
        out.append(sample_token(z, cfg.temperature, cfg.top_k, cfg.top_p, us[i]) if cfg.sampling
                   else int(np.argmax(z)))
        if any(tuple(out[-len(s):]) == s for s in cfg.stop_sequences if len(s) <= len(out)):
            return out, StopReason.STOP_SEQUENCE
    return out, StopReason.MAX_TOKENS


@pytest.mark.parametrize("kw", [dict(repetition_penalty=0.5), dict(repetition_penalty=1.7),
                                dict(repetition_penalty=1.4, temperature=1.1, top_k=12, top_p=0.8, sample_seed=5),
                                dict(temperature=0.8, top_k=97, top_p=0.6, sample_seed=2, loops=5)])
def test_decode_equals_a_plain_simulation_over_score(tiny_model, prompt, kw):
    cfg = GenerateConfig(max_tokens=10, **kw)
    st = GenerateStats()
    got = tl.generate(tiny_model, prompt, cfg, stats=st)[len(prompt):]
    want, reason = _simulate(tiny_model, prompt, cfg)
    assert got == want and st.stop_reason == reason and st.tokens_emitted == len(want)
    # a stop sequence taken from the output ends it there, included, with its reason
    cut = cfg.replace(stop_sequences=[tuple(want[3:5])])
    want2, reason2 = _simulate(tiny_model, prompt, cut)
    got2 = tl.generate(tiny_model, prompt, cut, stats=st)[len(prompt):]
    assert got2 == want2 and reason2 == StopReason.STOP_SEQUENCE == st.stop_reason
    assert st.tokens_emitted == len(want2) <= 5


# =============================================================================== stream callback
@pytest.mark.parametrize("abort", [False, np.False_])
def test_callback_returning_a_numpy_false_aborts(tiny_model, prompt, abort):
    """on_token's result compared with numpy values is an np.bool_: np.False_ aborts like False
    (the token is kept, stop_reason CALLBACK_ABORT); None and np.True_ go on."""
    limit = np.int64(len(prompt) + 1)
    st = GenerateStats()
    out = tl.generate_stream(tiny_model, prompt, GenerateConfig(max_tokens=6),
                             on_token=lambda t, pos: abort if pos >= limit else pos < limit, stats=st)
    assert len(out) == len(prompt) + 2 and st.stop_reason == StopReason.CALLBACK_ABORT and st.tokens_emitted == 2
    out = tl.generate_stream(tiny_model, prompt, GenerateConfig(max_tokens=3),
                             on_token=lambda t, pos: None if pos % 2 else np.True_, stats=st)
    assert len(out) == len(prompt) + 3 and st.stop_reason == StopReason.MAX_TOKENS


# =============================================================================== sampler
def _reachable(logits, temperature, k, top_p):
    """The ids sample_token can return: the first n of the ranking, n found by a draw near 1."""
    z, order, zs = _ranked(logits, temperature, k)
    ranked = np.lexsort((np.arange(z.size), -z))[:len(zs)]
    last = sample_token(logits, temperature, k, top_p, np.nextafter(1.0, 0.0))
    n = int(np.flatnonzero(ranked == last)[0]) + 1
    return set(ranked[:n].tolist())


@pytest.mark.parametrize("n,top_p", [(10, 0.8), (10, 0.9), (12, 0.5), (15, 0.4), (20, 0.4)])
def test_explicit_distribution_keeps_the_samplers_nucleus_on_ties(n, top_p):
    """sampling_probs (the speculative decoders' accept / reject distribution) is documented as the
    distribution sample_token draws from: on n tied tokens the two must cut top-p at the same
    place (cumulative probabilities summed as 0.1 + 0.1 + ... round differently from j / n)."""
    z = np.zeros(n, np.float32)
    kept = set(np.flatnonzero(sampling_probs(z, 1.0, 50, top_p)).tolist())
    assert kept == _reachable(z, 1.0, 50, top_p)
    assert kept == set(range(len(kept)))


def test_explicit_distribution_equals_the_sampler_at_top_p_boundaries():
    rng = np.random.default_rng(7)
    for _ in range(400):
        V = int(rng.integers(2, 24))
        logits = (rng.standard_normal(V) * rng.choice([0.1, 1.0, 4.0])).astype(np.float32)
        if rng.random() < 0.4:
            logits = np.round(logits)
        k, T = int(rng.integers(1, V + 3)), float(rng.choice([0.5, 1.0, 1.3]))
        z, order, zs = _ranked(logits, T, k)
        c = np.cumsum(np.exp(zs - zs[0]))
        top_p = min(float(c[int(rng.integers(0, len(c)))] / c[-1]), 0.9999)     # on a boundary
        probs = sampling_probs(logits, T, k, top_p)
        kept = set(np.flatnonzero(probs).tolist())
        assert kept == _reachable(logits, T, k, top_p), (logits, k, T, top_p)
        assert abs(probs.sum() - 1.0) < 1e-12
