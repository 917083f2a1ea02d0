"""Chain self-speculative decoding: exact greedy tokens for every draft depth, draft length and
verify-resume setting; statistics; typed errors before work."""

from __future__ import annotations

import pytest

import tinyloop as tl
from tinyloop import SpeculativeConfig

from conftest import write_tiny


@pytest.fixture(scope="module")
def model(spec_model):
    return spec_model


@pytest.mark.parametrize("verify_loops", [3, 6])
@pytest.mark.parametrize("resume", [True, False])
def test_exact_greedy_for_every_draft_setting(model, prompt, verify_loops, resume):
    ref = tl.generate(model, prompt, tl.GenerateConfig(max_tokens=24, loops=verify_loops))
    for draft_loops in range(1, verify_loops):
        for draft_ahead in range(1, 9):
            cfg = SpeculativeConfig(max_tokens=24, draft_loops=draft_loops, verify_loops=verify_loops,
                                    draft_ahead=draft_ahead, verify_resume=resume)
            assert tl.generate_speculative(model, prompt, cfg) == ref, (draft_loops, draft_ahead)


def test_fp32_cache_and_short_outputs(model, prompt):
    for n in (0, 1, 2, 5):
        ref = tl.generate(model, prompt, tl.GenerateConfig(max_tokens=n, loops=4, cache_mode="fp32"))
        out = tl.generate_speculative(model, prompt, SpeculativeConfig(max_tokens=n, draft_loops=2, verify_loops=4,
                                                                       draft_ahead=4, cache_mode="fp32"))
        assert out == ref


def test_stats(model, prompt):
    st = tl.GenerateStats()
    cfg = SpeculativeConfig(max_tokens=30, draft_loops=2, verify_loops=5, draft_ahead=4)
    out = tl.generate_speculative(model, prompt, cfg, stats=st)
    assert st.tokens_emitted == len(out) - len(prompt) == 30
    assert st.verify_forwards >= 1 and st.drafted_tokens == 4 * st.verify_forwards
    assert 0 <= st.accepted_tokens <= st.drafted_tokens
    assert st.acceptance_rate == pytest.approx(st.accepted_tokens / st.drafted_tokens)
    assert 1.0 <= st.mean_accepted_length <= 5.0
    assert st.full_depth_forwards_saved == st.tokens_emitted - 1 - st.verify_forwards
    assert st.stop_reason == tl.StopReason.MAX_TOKENS and st.loops_used == 5


def test_stop_sequence(model, prompt):
    ref = tl.generate(model, prompt, tl.GenerateConfig(max_tokens=20, loops=4))[len(prompt):]
    stop = ref[5:7]
    first = next(i for i in range(len(ref) - 1) if ref[i:i + 2] == stop)
    out = tl.generate_speculative(model, prompt, SpeculativeConfig(max_tokens=20, draft_loops=1, verify_loops=4,
                                                                   draft_ahead=6, stop_sequences=[stop]))
    assert out[len(prompt):] == ref[:first + 2]


def test_demo_model_exact(prompt):
    from tinyloop.models import demo_model_path
    from tinyloop.model.tokenizer import resolve_tokenizer
    m = tl.load_model(demo_model_path(), max_seq_len=256, backend="cpu")
    try:
        tok = resolve_tokenizer(m.header.tokenizer, None, m.vocab_size)
        for text in ("def fibonacci(n):", "class Stack:\n    def push(self, x):", "import os\n"):
            ids = tok.encode(text)
            ref = tl.generate(m, ids, tl.GenerateConfig(max_tokens=40, loops=4))
            for draft_loops, draft_ahead in ((1, 3), (2, 4), (3, 8)):
                st = tl.GenerateStats()
                out = tl.generate_speculative(m, ids, SpeculativeConfig(max_tokens=40, draft_loops=draft_loops,
                                                                        verify_loops=4, draft_ahead=draft_ahead),
                                              stats=st)
                assert out == ref
                assert st.acceptance_rate > 0.2
    finally:
        tl.free_model(m)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(draft_loops=4, verify_loops=4), tl.ConfigError, r"draft_loops=4 is outside the allowed range \[1, 3\]"),
    (dict(verify_loops=9), tl.ConfigError, "verify_loops=9"),
    (dict(draft_ahead=0), tl.ConfigError, "draft_ahead=0"),
    (dict(temperature=0.9, top_k=0), tl.ConfigError, "top_k=0"),
    (dict(temperature=0.9, top_p=0.0), tl.ConfigError, "top_p=0.0"),
    (dict(cache_mode="int3"), tl.PluginError, "cache_mode=.int3. is not registered"),
    (dict(verify_resume="yes"), tl.ConfigError, "verify_resume"),
])
def test_errors_before_work(model, prompt, monkeypatch, kw, exc, match):
    calls = []
    monkeypatch.setattr(model.backend, "alloc_cache", lambda *a: calls.append(a))
    with pytest.raises(exc, match=match):
        tl.generate_speculative(model, prompt, SpeculativeConfig(**{"verify_loops": 4, **kw}))
    assert calls == []


def test_draft_ahead_must_fit_the_pool(tmp_path, prompt):
    path = tmp_path / "m.tinyloop"
    write_tiny(path)
    m = tl.load_model(str(path), max_seq_len=64, backend="cpu", prefill_chunk=4)
    try:
        with pytest.raises(tl.ConfigError, match="draft_ahead=4 needs 5 rows"):
            tl.generate_speculative(m, prompt, SpeculativeConfig(draft_ahead=4, verify_loops=4))
    finally:
        tl.free_model(m)


# ------------------------------------------------------------------ speculative sampling
def _chi2_critical(df: int) -> float:
    """Chi-square critical value at p = 0.001 (Wilson-Hilferty approximation)."""
    z = 3.090
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def _exact_marginals(m, prompt, loops, temperature, top_k, top_p):
    """Distributions of generated tokens 1 and 2 under plain sampling at `loops`, by enumeration."""
    import numpy as np
    from tinyloop.runtime.sampling import sampling_probs

    def probs(ids):
        return sampling_probs(tl.score_last_token(m, ids, loops=loops), temperature, top_k, top_p)
    p0 = probs(prompt)
    p1 = np.zeros_like(p0)
    p2 = np.zeros_like(p0)
    for a in np.nonzero(p0)[0]:
        pa = probs(prompt + [int(a)])
        p1 += p0[a] * pa
        for b in np.nonzero(pa)[0]:
            p2 += p0[a] * pa[b] * probs(prompt + [int(a), int(b)])
    return p1, p2


def _chi2(counts, probs):
    import numpy as np
    n = counts.sum()
    exp = probs * n
    big = exp >= 5
    obs_b = np.append(counts[big], counts[~big].sum())
    exp_b = np.append(exp[big], exp[~big].sum())
    keep = exp_b > 0
    stat = float((((obs_b - exp_b) ** 2)[keep] / exp_b[keep]).sum())
    return stat, int(keep.sum()) - 1


@pytest.mark.slow
def test_speculative_sampling_matches_plain_sampling_distribution(tmp_path):
    """Chi-square: tokens 2 and 3 of speculative sampling (drafted at L=1, verified at L=4) follow the
    exact distribution of plain sampling at L=4, computed by enumeration."""
    import numpy as np
    path = tmp_path / "v16.tinyloop"
    write_tiny(path, seed=4, vocab_size=16, d_model=32, d_ff=64)
    m = tl.load_model(str(path), max_seq_len=32, backend="cpu")
    try:
        prompt = [1, 5, 9]
        T, K, P = 1.3, 8, 0.9
        p1, p2 = _exact_marginals(m, prompt, 4, T, K, P)
        c1 = np.zeros(16)
        c2 = np.zeros(16)
        st = tl.GenerateStats()
        n = 1500
        for seed in range(n):
            cfg = SpeculativeConfig(max_tokens=3, draft_loops=1, verify_loops=4, draft_ahead=3, temperature=T,
                                    top_k=K, top_p=P, seed=seed)
            out = tl.generate_speculative(m, prompt, cfg, stats=st)[len(prompt):]
            c1[out[1]] += 1
            c2[out[2]] += 1
        for counts, probs in ((c1, p1), (c2, p2)):
            stat, df = _chi2(counts, probs)
            assert stat < _chi2_critical(df), (stat, df)
        assert 0.0 < st.acceptance_rate < 1.0       # both the accept and the resample paths ran
    finally:
        tl.free_model(m)


def test_speculative_sampling_deterministic_per_seed(model, prompt):
    cfg = SpeculativeConfig(max_tokens=20, draft_loops=1, verify_loops=4, draft_ahead=3, temperature=0.8, seed=5)
    a = tl.generate_speculative(model, prompt, cfg)
    assert a == tl.generate_speculative(model, prompt, cfg)
    assert len(a) == len(prompt) + 20
    others = {tuple(tl.generate_speculative(model, prompt, SpeculativeConfig(
        max_tokens=20, draft_loops=1, verify_loops=4, draft_ahead=3, temperature=0.8, seed=s))) for s in range(4)}
    assert len(others) > 1


def test_disable_kv_cache_is_refused_by_speculative_decoders(spec_model, monkeypatch):
    """TINYLOOP_DISABLE_KV_CACHE asks for the uncached path, which speculative decoding has not:
    a typed error naming the variable, for chain and tree, before any allocation."""
    m = spec_model
    monkeypatch.setenv("TINYLOOP_DISABLE_KV_CACHE", "1")
    calls = []
    monkeypatch.setattr(m.backend, "alloc_cache", lambda *a: calls.append(a))
    for fn, cfg in ((tl.generate_speculative, tl.SpeculativeConfig(max_tokens=3, draft_loops=1, verify_loops=2)),
                    (tl.generate_tree_speculative, tl.TreeSpeculativeConfig(max_tokens=3, draft_loops=1,
                                                                            verify_loops=2))):
        with pytest.raises(tl.IncompatibleModesError, match="TINYLOOP_DISABLE_KV_CACHE='1'"):
            fn(m, [1, 2, 3], cfg)
    assert calls == []
