"""Engine behaviour: decode-path identity, stop policy, stats, sampling, validation, lifecycle."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tinyloop as tl
from tinyloop import GenerateConfig, GenerateStats, StopReason


def greedy(model, prompt, n=12, **kw):
    return tl.generate(model, prompt, GenerateConfig(max_tokens=n, **kw))


# ------------------------------------------------------------------ identity across decode paths
@pytest.mark.parametrize("loops", [1, 3, 8])
def test_greedy_identical_with_and_without_kv_cache(tiny_model, prompt, monkeypatch, loops):
    cached = greedy(tiny_model, prompt, loops=loops)
    monkeypatch.setenv("TINYLOOP_DISABLE_KV_CACHE", "1")
    uncached = greedy(tiny_model, prompt, loops=loops)
    assert cached == uncached
    assert len(cached) == len(prompt) + 12


def test_generate_stream_and_iter_agree(tiny_model, prompt):
    cfg = GenerateConfig(max_tokens=10)
    a = tl.generate(tiny_model, prompt, cfg)
    seen = []
    b = tl.generate_stream(tiny_model, prompt, cfg, on_token=lambda t, p: seen.append((t, p)) or True)
    c = prompt + list(tl.generate_iter(tiny_model, prompt, cfg))
    assert a == b == c
    assert [t for t, _ in seen] == a[len(prompt):]
    assert [p for _, p in seen] == list(range(len(prompt), len(a)))


def test_prefill_chunk_does_not_change_tokens(tiny_path, tiny_model, prompt):
    """Batch invariance: a prefill in 3-row chunks gives the tokens of one 10-row launch."""
    m = tl.load_model(str(tiny_path), max_seq_len=128, backend="cpu", prefill_chunk=3)
    try:
        assert greedy(m, prompt) == greedy(tiny_model, prompt)
        assert np.array_equal(tl.score(m, prompt), tl.score(tiny_model, prompt))
    finally:
        tl.free_model(m)


def test_generate_batch_equals_generate(tiny_model, prompt):
    prompts = [prompt, prompt[:3], [1]]
    cfg = GenerateConfig(max_tokens=6)
    stats = []
    assert tl.generate_batch(tiny_model, prompts, cfg, stats=stats) == \
        [tl.generate(tiny_model, p, cfg) for p in prompts]
    assert len(stats) == 3 and all(s.tokens_emitted >= 1 for s in stats)


# ------------------------------------------------------------------ stop policy and stats
def test_stats_filled(tiny_model, prompt):
    st = GenerateStats()
    out = tl.generate_stream(tiny_model, prompt, GenerateConfig(max_tokens=7, loops=2), stats=st)
    assert st.tokens_emitted == len(out) - len(prompt)
    assert st.stop_reason in (StopReason.MAX_TOKENS, StopReason.EOS)
    assert st.loops_used == 2
    assert st.prefill_ms > 0 and st.first_token_ms >= st.prefill_ms and st.decode_ms >= 0
    assert st.loop_iters_run == 2 * st.tokens_emitted  # prefill + one forward per further token


def test_callback_abort_keeps_last_token(tiny_model, prompt):
    st = GenerateStats()
    out = tl.generate_stream(tiny_model, prompt, GenerateConfig(max_tokens=20),
                             on_token=lambda t, p: p < len(prompt) + 2, stats=st)
    assert len(out) == len(prompt) + 3
    assert st.stop_reason == StopReason.CALLBACK_ABORT
    assert out == greedy(tiny_model, prompt, n=3)


def test_stop_sequence_tail_match_included(tiny_model, prompt):
    ref = greedy(tiny_model, prompt, n=12)[len(prompt):]
    stop = ref[3:5]
    first = next(i for i in range(len(ref) - 1) if ref[i:i + 2] == stop)
    st = GenerateStats()
    out = tl.generate_stream(tiny_model, prompt, GenerateConfig(max_tokens=12, stop_sequences=[[96, 96, 96], stop]),
                             stats=st)
    assert out[len(prompt):] == ref[:first + 2]
    assert st.stop_reason == StopReason.STOP_SEQUENCE


def test_eos_stops(tmp_path, prompt):
    m0 = tl.load_model(str(_write(tmp_path, "a", eos_id=None)), max_seq_len=64, backend="cpu")
    ref = greedy(m0, prompt, n=8)[len(prompt):]
    tl.free_model(m0)
    eos = ref[2]
    m = tl.load_model(str(_write(tmp_path, "b", eos_id=eos)), max_seq_len=64, backend="cpu")
    try:
        st = GenerateStats()
        out = tl.generate_stream(m, prompt, GenerateConfig(max_tokens=8), stats=st)
        assert out[len(prompt):] == ref[:ref.index(eos) + 1]
        assert st.stop_reason == StopReason.EOS
    finally:
        tl.free_model(m)


def _write(tmp_path, name, **kw):
    from conftest import write_tiny
    p = tmp_path / f"{name}.tinyloop"
    write_tiny(p, **kw)
    return p


def test_max_tokens_zero_returns_prompt(tiny_model, prompt):
    st = GenerateStats()
    assert tl.generate_stream(tiny_model, prompt, GenerateConfig(max_tokens=0), stats=st) == prompt
    assert st.stop_reason == StopReason.MAX_TOKENS and st.tokens_emitted == 0


def test_loops_change_output(tiny_model, prompt):
    assert greedy(tiny_model, prompt, loops=1) != greedy(tiny_model, prompt, loops=8)


# ------------------------------------------------------------------ sampling and processors
def test_sampling_is_deterministic_per_seed(tiny_model, prompt):
    cfg = GenerateConfig(max_tokens=16, temperature=1.2, top_k=50, top_p=0.95, sample_seed=7)
    a = tl.generate(tiny_model, prompt, cfg)
    assert a == tl.generate(tiny_model, prompt, cfg)
    others = {tuple(tl.generate(tiny_model, prompt, cfg.replace(sample_seed=s))) for s in range(1, 6)}
    assert len(others | {tuple(a)}) > 1


def test_top_k_one_is_greedy(tiny_model, prompt):
    assert tl.generate(tiny_model, prompt, GenerateConfig(max_tokens=8, temperature=1.0, top_k=1)) == \
        greedy(tiny_model, prompt, n=8)


def test_sample_token_matches_definition():
    from tinyloop.runtime.sampling import sample_token
    logits = np.array([1.0, 3.0, 2.0, 3.0, -1.0], np.float32)
    # top_k=2 keeps the two 3.0 logits (ids 1 and 3, ties by lower id), equal probability
    assert sample_token(logits, 1.0, 2, 1.0, 0.49) == 1
    assert sample_token(logits, 1.0, 2, 1.0, 0.51) == 3
    # top_p small keeps only the most likely token
    assert sample_token(logits, 1.0, 5, 0.1, 0.99) == 1
    # full distribution: empirical frequencies follow softmax
    rng = np.random.default_rng(0)
    counts = np.bincount([sample_token(logits, 1.0, 5, 1.0, rng.random()) for _ in range(4000)], minlength=5)
    p = np.exp(logits - logits.max()); p /= p.sum()
    assert np.allclose(counts / 4000, p, atol=0.03)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([-np.inf, -2.0, -1.0, 0.0, 0.5, 1.0, 3.0, np.nan]), min_size=1,
                max_size=40),
       st.integers(1, 45))
def test_top_order_equals_full_sort(vals, k):
    """The partition-based top-k order is the full sort's prefix, ties by lower id, -inf and NaN
    included (NaN falls back to the full sort)."""
    from tinyloop.runtime.sampling import top_order
    z = np.array(vals, np.float64)
    want = np.lexsort((np.arange(z.size), -z))[:k]
    assert np.array_equal(top_order(z, k), want)


def _definition_filtered(logits, temperature, top_k, top_p):
    """sampling_probs' steps written plainly: sort every id, cut, renormalise."""
    z = np.asarray(logits, np.float64) / temperature
    order = np.lexsort((np.arange(z.size), -z))[:min(top_k, z.size)]
    p = np.exp(z[order] - z[order[0]])
    w = np.cumsum(p)                    # the cut: step 4 of sample_token, on the running sums
    p /= p.sum()
    if top_p < 1.0:
        c = np.cumsum(p)
        keep = min(int(np.searchsorted(w, top_p * w[-1], side="left")) + 1, len(c))
        order, p = order[:keep], p[:keep] / c[keep - 1]
    return order, p


def _definition_draw(logits, temperature, top_k, top_p, u):
    """sample_token's steps 1-5 (tinyloop.runtime.sampling) written plainly, loop by loop."""
    z = np.asarray(logits, np.float64) / temperature
    order = np.lexsort((np.arange(z.size), -z))[:min(top_k, z.size)]
    c, run = [], 0.0
    for j in order:
        run += float(np.exp(z[j] - z[order[0]]))
        c.append(run)
    n = len(c)
    if top_p < 1.0:
        n = next((j + 1 for j in range(len(c)) if c[j] >= top_p * c[-1]), len(c))
    r = u * c[n - 1]
    return int(order[next((j for j in range(n) if c[j] > r), n - 1)])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([-np.inf, -2.0, -1.0, 0.0, 0.5, 1.0, 3.0]), min_size=1, max_size=40)
       .filter(lambda v: max(v) > -np.inf),
       st.integers(1, 45), st.sampled_from([1.0, 0.95, 0.5, 0.1]), st.floats(0.0, 0.999999),
       st.sampled_from([0.7, 1.0, 1.3]))
def test_sampler_equals_its_definition(vals, k, top_p, u, temperature):
    """sample_token (top-k by partition, ids ranked only as far as needed) gives the token of the
    plain definition, and sampling_probs its probabilities bit for bit; the two agree on the
    kept set."""
    from tinyloop.runtime.sampling import sample_token, sampling_probs
    logits = np.array(vals, np.float32)
    assert sample_token(logits, temperature, k, top_p, u) == _definition_draw(logits, temperature, k, top_p, u)
    order, p = _definition_filtered(logits, temperature, k, top_p)
    probs = np.zeros(logits.size)
    probs[order] = p
    assert np.array_equal(sampling_probs(logits, temperature, k, top_p), probs)
    assert probs[sample_token(logits, temperature, k, top_p, u)] > 0


def test_repetition_penalty_hf_convention(tiny_model, prompt):
    from tinyloop.runtime.plugins import get_plugin_manager
    cls = get_plugin_manager().processors()["repetition_penalty"]
    p = cls.from_config(GenerateConfig(repetition_penalty=2.0))
    p.reset([1, 2])
    p.accept(4)
    logits = np.array([1.0, 2.0, -2.0, 3.0, -4.0], np.float32)
    p.apply(logits)
    assert logits.tolist() == [1.0, 1.0, -4.0, 3.0, -8.0]
    assert cls.from_config(GenerateConfig()) is None
    # in the engine: a strong penalty changes greedy output
    assert greedy(tiny_model, prompt, repetition_penalty=5.0) != greedy(tiny_model, prompt)


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize("kw,match", [
    (dict(temperature=-0.5), "temperature=-0.5"),
    (dict(temperature=0.7, top_k=0), "top_k=0"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(max_tokens=-1), "max_tokens=-1"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(loops=0), "loops=0"),
    (dict(stop_sequences=[[]]), "stop_sequences"),
    (dict(sample_seed=-1), "sample_seed=-1"),
])
def test_config_validation(kw, match):
    with pytest.raises(tl.ConfigError, match=match):
        GenerateConfig(**kw)


def test_top_k_validated_only_while_sampling(tiny_model, prompt):
    assert GenerateConfig(top_k=0).top_k == 0
    # but a greedy request that sets it asks for something the greedy decoder would ignore
    with pytest.raises(tl.IncompatibleModesError, match="top_k=0 is set, but decoder 'greedy' ignores it"):
        tl.generate(tiny_model, prompt, GenerateConfig(top_k=0))


@pytest.mark.parametrize("prompt_,kw,match", [
    ([], {}, "prompt_len=0"),
    ([1, 97], {}, r"prompt\[1\]=97 is outside the vocabulary \[0, 97\)"),
    ([-1], {}, r"prompt\[0\]=-1"),
    ([1] * 100, dict(max_tokens=29), "exceeds max_seq_len=128"),
    ([1], dict(stop_sequences=[[200]]), "stop_sequences"),
    (b"text", {}, "not bytes"),
    ([[1, 2]], {}, "flat sequence"),
])
def test_request_validation_before_work(tiny_model, monkeypatch, prompt_, kw, match):
    calls = []
    monkeypatch.setattr(tiny_model.backend, "alloc_cache", lambda *a: calls.append(a))
    with pytest.raises(tl.InvalidInputError, match=match):
        tl.generate(tiny_model, prompt_, GenerateConfig(**kw))
    # a text prompt on a model without a usable tokenizer (97 ids, none embedded)
    with pytest.raises(tl.TokenizerError, match="configure a tokenizer"):
        tl.generate(tiny_model, "text", GenerateConfig())
    assert calls == []


def test_out_of_range_is_one_class_whatever_sets_the_range(tiny_model, monkeypatch):
    """loops=9 (range from the model) and loops=0 (range from the config) are both ConfigError."""
    calls = []
    monkeypatch.setattr(tiny_model.backend, "alloc_cache", lambda *a: calls.append(a))
    with pytest.raises(tl.ConfigError, match=r"loops=9 is outside the allowed range \[1, 8\]"):
        tl.generate(tiny_model, [1], GenerateConfig(loops=9))
    with pytest.raises(tl.ConfigError, match="loops=0"):
        GenerateConfig(loops=0)
    assert calls == []


def test_load_model_errors(tiny_path, tmp_path):
    with pytest.raises(tl.ConfigError, match="max_seq_len=0"):
        tl.load_model(str(tiny_path), max_seq_len=0)
    with pytest.raises(tl.ConfigError, match="backend='tpu'"):
        tl.load_model(str(tiny_path), backend="tpu")
    with pytest.raises(tl.ModelFormatError):
        tl.load_model(str(tmp_path / "missing.tinyloop"))


def test_cuda_backend_without_gpu_is_typed_error(tiny_path, monkeypatch):
    from tinyloop.plugins.backends import CUDAEntry
    monkeypatch.setattr(CUDAEntry, "available", classmethod(lambda cls, **kw: (False, "no CUDA GPU is available")))
    with pytest.raises(tl.BackendError, match="no CUDA GPU"):
        tl.load_model(str(tiny_path), backend="cuda")


# ------------------------------------------------------------------ lifecycle
def test_free_model_and_memory(tiny_path, prompt):
    m = tl.load_model(str(tiny_path), max_seq_len=64, backend="cpu")
    held = tl.vram_usage_bytes(m)
    assert held > sum(a.nbytes for a in (m.ws.x, m.ws.logits))
    tl.free_model(m)
    tl.free_model(m)  # idempotent
    with pytest.raises(tl.ModelFreedError):
        tl.generate(m, prompt)
    with pytest.raises(tl.ModelFreedError):
        tl.vram_usage_bytes(m)


def test_live_cache_counted_while_generating(tiny_model, prompt):
    base = tl.vram_usage_bytes(tiny_model)
    it = tl.generate_iter(tiny_model, prompt, GenerateConfig(max_tokens=5))
    next(it)
    assert tl.vram_usage_bytes(tiny_model) > base
    it.close()
    assert tl.vram_usage_bytes(tiny_model) == base


def test_model_not_reentrant(tiny_model, prompt):
    it = tl.generate_iter(tiny_model, prompt, GenerateConfig(max_tokens=5))
    next(it)
    with pytest.raises(tl.ModelBusyError):
        tl.generate(tiny_model, prompt)
    it.close()
    assert len(tl.generate(tiny_model, prompt, GenerateConfig(max_tokens=2))) == len(prompt) + 2


def test_concurrent_threads_are_serialised_or_refused(tiny_model, prompt):
    results, errors = [], []

    def work():
        try:
            results.append(greedy(tiny_model, prompt, n=4))
        except tl.ModelBusyError as e:
            errors.append(e)
    ts = [threading.Thread(target=work) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(results) + len(errors) == 4 and results
    assert all(r == results[0] for r in results)
