"""Early exit (tinyloop.runtime.early_exit, tinyloop.plugins.exits): per-token depth against the
float64 oracle with the same depths and K/V policy, the probe schedule as a property, cached vs
uncached and guarded vs host probes, prefix reuse, stats, and bad input before any work."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import tinyloop as tl
from tinyloop.analysis.loopgain import HELDOUT_TEXT
from tinyloop.model.reference import reference_logits_exit
from tinyloop.models import model_path
from tinyloop.runtime.early_exit import STATISTICS, ExitCriterion, ExitStep
from tinyloop.runtime.plugins import get_plugin_manager

from conftest import logical_weights, write_tiny

CRITERIA = [("hidden_l2", dict(early_exit_threshold=0.35)), ("kl", dict(early_exit_threshold=0.05)),
            ("argmax", {}), ("logit_margin", dict(early_exit_logit_margin=2.0))]


def exit_cfg(criterion="kl", kv="copy_last", **kw):
    extra = dict(CRITERIA)[criterion]
    return tl.GenerateConfig(early_exit_patience=kw.pop("patience", 1), early_exit_criterion=criterion,
                             early_exit_kv=kv, **{**extra, **kw})


@pytest.fixture(scope="module")
def demo():
    m = tl.load_model(None, max_seq_len=256, backend="cpu")
    yield m
    tl.free_model(m)


@pytest.fixture(scope="module")
def text_ids(demo):
    text = HELDOUT_TEXT.read_text(encoding="utf-8")[:4000]
    return demo.tokenizer.encode(text)


@pytest.fixture(scope="module", params=["tiny", "flat"])
def small(request, tmp_path_factory):
    """Tiny models: n_loop 2 with input injection, and n_loop 1 without post blocks or injection."""
    path = tmp_path_factory.mktemp("exit") / f"{request.param}.tinyloop"
    over = {} if request.param == "tiny" else dict(n_post=0, loop_inject="none", n_loop=1)
    write_tiny(path, seed=3, quant="f32", **over, default_loops=5, max_loops=8)
    m = tl.load_model(str(path), max_seq_len=64, backend="cpu")
    yield m, logical_weights(path)
    tl.free_model(m)


# ------------------------------------------------------------------ against the oracle
def _check_oracle(m, W, ids, cfg, loops):
    st_ = tl.GenerateStats()
    got = tl.score_decoded(m, ids, dataclasses.replace(cfg, cache_mode="fp32", loops=loops), stats=st_)
    depths = st_.token_loops
    assert len(depths) == len(ids) and depths[0] == loops and all(1 <= d <= loops for d in depths)
    ref = reference_logits_exit(m.cfg, W, ids, depths, loops, cfg.early_exit_kv)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < 2e-5, f"logits differ from the oracle at these depths by {err:.2e} (depths {depths})"
    return depths


@pytest.mark.parametrize("criterion", [c for c, _ in CRITERIA])
@pytest.mark.parametrize("kv", ["copy_last", "recompute"])
def test_decoded_logits_equal_the_oracle_at_the_same_depths(demo, text_ids, criterion, kv):
    """Every position's logits equal the float64 oracle's when each position leaves the loop where
    the probes said and the skipped iterations hold the policy's K/V (demo model: n_loop 2, input
    injection), and tokens do exit early."""
    depths = _check_oracle(demo, logical_weights(model_path(None)), text_ids[:40], exit_cfg(criterion, kv), 4)
    assert min(depths) < 4


@pytest.mark.parametrize("kv", ["copy_last", "recompute"])
def test_small_models_against_the_oracle(small, kv):
    m, W = small
    rng = np.random.default_rng(1)
    ids = [int(t) for t in rng.integers(0, m.cfg.vocab_size, 24)]
    depths = _check_oracle(m, W, ids, exit_cfg("hidden_l2", kv, early_exit_threshold=0.6, early_exit_min_L=1,
                                              early_exit_peek_every=2), 5)
    assert set(depths) <= {1, 3, 5}                 # probes at 1 and 3 (peek 2) below loops 5


def test_statistics_against_naive_formulas():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(50), rng.standard_normal(50)
    rel, _ = STATISTICS["rel_l2"]
    assert rel(a, b) == pytest.approx(np.sqrt(((a - b) ** 2).sum()) / np.sqrt((a * a).sum()))
    assert rel(np.zeros(3), np.zeros(3)) == 0.0
    p, q = np.exp(a) / np.exp(a).sum(), np.exp(b) / np.exp(b).sum()
    assert STATISTICS["kl"][0](a, b) == pytest.approx(float((p * np.log(p / q)).sum()))
    assert STATISTICS["kl"][0](a, a) == pytest.approx(0.0, abs=1e-12)
    s = np.sort(a)
    assert STATISTICS["top2_margin"][0](a, None) == pytest.approx(s[-1] - s[-2])
    tie = np.array([1.0, 3.0, 3.0])
    assert STATISTICS["argmax_change"][0](tie, np.array([0.0, 3.0, 2.0])) == 0.0   # ties -> lowest id
    assert STATISTICS["argmax_change"][0](tie, np.array([0.0, 0.0, 4.0])) == 1.0


# ------------------------------------------------------------------ the probe schedule
class Scripted(ExitCriterion):
    """A third-party criterion of its own (no device statistic): stable or not as the script says."""

    name = "scripted"
    compat = dict(get_plugin_manager().exit_criteria()["kl"].compat)
    reads = "hidden"
    default_threshold = 1.0
    script: list = []
    calls = 0

    def statistic(self, cur, prev):
        assert prev is not None and cur.shape == prev.shape
        Scripted.calls += 1
        return 0.0 if Scripted.script.pop(0) else 2.0


class _Plugin:
    @tl.hookimpl
    def tinyloop_exit_criteria(self):
        return [Scripted]


def expected_depth(script, L, min_L, peek, patience):
    run = 0
    for d in range(min_L, L, peek):
        run = run + 1 if script.pop(0) else 0
        if run >= patience:
            return d
    return L


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(L=st.integers(2, 7), data=st.data())
def test_probe_schedule(small, L, data):
    """Probes at min_L, min_L + peek, ... below loops; exit after `patience` consecutive stable
    probes at the last one's depth; never beyond loops (a pure-Python model of the spec)."""
    m, _ = small
    min_L = data.draw(st.integers(1, L - 1))
    peek = data.draw(st.integers(1, 3))
    patience = data.draw(st.integers(1, min(3, len(range(min_L, L, peek)))))
    n = 5
    script = data.draw(st.lists(st.booleans(), min_size=n * L, max_size=n * L))
    model = list(script)
    want = [L] + [expected_depth(model, L, min_L, peek, patience) for _ in range(n - 1)]
    pm = get_plugin_manager()
    with pm.registered(_Plugin()):
        Scripted.script, Scripted.calls = list(script), 0
        cfg = tl.GenerateConfig(loops=L, early_exit_patience=patience, early_exit_min_L=min_L,
                                early_exit_peek_every=peek, early_exit_criterion="scripted")
        st_ = tl.GenerateStats()
        tl.score_decoded(m, [1, 2, 3, 4, 5], cfg, stats=st_)
    assert st_.token_loops == want
    assert Scripted.calls == st_.exit_probes == len(script) - len(model)


# ------------------------------------------------------------------ paths that must agree
@pytest.mark.parametrize("kv", ["copy_last", "recompute"])
def test_cached_uncached_guarded_and_host_probes_agree(demo, kv, monkeypatch):
    """Greedy tokens and depths are the same through the guarded steps (CPU capability), the host
    probes (the capability narrowed away) and the uncached reference path."""
    p = demo.tokenizer.encode("The little dog")
    cfg = exit_cfg("kl", kv, max_tokens=24)
    ref_st = tl.GenerateStats()
    want = tl.generate(demo, p, cfg, stats=ref_st)
    assert min(ref_st.token_loops) < 4
    runs = {}
    monkeypatch.setenv("TINYLOOP_DISABLE_KV_CACHE", "1")
    runs["uncached"] = tl.GenerateStats()
    assert tl.generate(demo, p, cfg, stats=runs["uncached"]) == want
    monkeypatch.delenv("TINYLOOP_DISABLE_KV_CACHE")
    caps = demo.backend.capabilities
    monkeypatch.setattr(type(demo.backend), "capabilities", property(lambda self: caps - {"guarded_steps"}))
    runs["host"] = tl.GenerateStats()
    assert tl.generate(demo, p, cfg, stats=runs["host"]) == want
    for name, s in runs.items():
        assert s.token_loops == ref_st.token_loops, name
        assert s.exit_probes == ref_st.exit_probes, name


def test_prefix_reuse_and_sampling(demo):
    p = demo.tokenizer.encode("Once upon a time, a cat")
    cfg = exit_cfg("hidden_l2", max_tokens=16)
    want = tl.generate(demo, p, cfg)
    pc = tl.build_prefix_cache(demo, p[:5])
    try:
        assert tl.generate_from_prefix_cache(demo, pc, p[5:], cfg) == want
    finally:
        tl.free_prefix_cache(pc)
    smp = dataclasses.replace(cfg, temperature=0.9, top_k=20, sample_seed=7)
    a, b = tl.GenerateStats(), tl.GenerateStats()
    assert tl.generate(demo, p, smp, stats=a) == tl.generate(demo, p, smp, stats=b)
    assert a.token_loops == b.token_loops


def test_stats_reach_a_streaming_consumer(demo):
    st_ = tl.GenerateStats()
    seen = []

    def on_token(tok, pos):
        seen.append(len(st_.token_loops))
        return True
    out = tl.generate_stream(demo, demo.tokenizer.encode("Hello"), exit_cfg("argmax", max_tokens=12),
                             on_token=on_token, stats=st_)
    assert seen == list(range(1, st_.tokens_emitted + 1))
    assert len(st_.token_loops) == st_.tokens_emitted == len(out) - 1
    assert st_.loops_used == pytest.approx(np.mean(st_.token_loops)) and st_.loops_used < 4
    assert st_.exit_probes > 0
    plain = tl.GenerateStats()
    tl.generate(demo, [5, 6], tl.GenerateConfig(max_tokens=3), stats=plain)
    assert plain.token_loops == [] and plain.loops_used == 4 and plain.exit_probes == 0


# ------------------------------------------------------------------ bad input
BAD = [
    (dict(early_exit_patience=1, early_exit_threshold=-0.1), tl.ConfigError, "early_exit_threshold"),
    (dict(early_exit_patience=1, early_exit_threshold="x"), tl.ConfigError, "early_exit_threshold"),
    (dict(early_exit_patience=1, early_exit_min_L=4), tl.ConfigError, "early_exit_min_L=4"),
    (dict(early_exit_patience=1, early_exit_min_L=9), tl.ConfigError, "early_exit_min_L=9"),
    (dict(early_exit_patience=1, early_exit_peek_every=0), tl.ConfigError, "early_exit_peek_every"),
    (dict(early_exit_patience=-1), tl.ConfigError, "early_exit_patience"),
    (dict(early_exit_patience=1.5), tl.ConfigError, "early_exit_patience"),
    (dict(early_exit_patience=1, early_exit_criterion="bogus"), tl.PluginError, "bogus"),
    (dict(early_exit_patience=1, early_exit_criterion=3), tl.ConfigError, "early_exit_criterion"),
    (dict(early_exit_patience=1, early_exit_kv="skip"), tl.ConfigError, "early_exit_kv='skip'"),
    (dict(early_exit_patience=1, early_exit_kv=None), tl.ConfigError, "early_exit_kv"),
    (dict(early_exit_patience=1, early_exit_criterion="argmax", early_exit_threshold=0.2), tl.ConfigError,
     "takes no threshold"),
    (dict(early_exit_patience=1, early_exit_criterion="logit_margin", early_exit_threshold=0.2), tl.ConfigError,
     "early_exit_logit_margin"),
    (dict(early_exit_patience=1, early_exit_criterion="kl", early_exit_logit_margin=2.0),
     tl.IncompatibleModesError, "logit_margin"),
    (dict(early_exit_min_L=3), tl.IncompatibleModesError, "early_exit_min_L"),      # without patience
    (dict(early_exit_kv="recompute"), tl.IncompatibleModesError, "early_exit_kv"),
    (dict(early_exit_patience=1, beam_size=2), tl.IncompatibleModesError, "adaptive depth"),
    (dict(early_exit_patience=1, decoder="speculative", options={"draft_loops": 1, "verify_loops": 4}),
     tl.IncompatibleModesError, "speculative"),
]


@pytest.mark.parametrize("kw,exc,match", BAD)
def test_bad_input_is_refused_before_any_work(demo, monkeypatch, kw, exc, match):
    calls = []
    monkeypatch.setattr(demo.backend, "alloc_cache", lambda *a: calls.append(a))
    with pytest.raises(exc, match=match):
        tl.generate(demo, [5, 6, 7], tl.GenerateConfig(max_tokens=4, **kw))
    assert calls == []


def test_rejected_entry_points(demo, monkeypatch):
    handle = tl.build_resume_handle(demo, [5, 6, 7], 2)
    calls = []
    monkeypatch.setattr(demo.backend, "alloc_cache", lambda *a: calls.append(a))
    cfg = exit_cfg("kl", max_tokens=4)
    with pytest.raises(tl.IncompatibleModesError, match="batched"):
        tl.generate_batch(demo, [[5, 6], [7]], cfg)
    try:
        with pytest.raises(tl.IncompatibleModesError, match="warm_start"):
            tl.resume_generate(handle, 4, cfg)
    finally:
        tl.free_resume_handle(handle)
    assert calls == []


def test_copy_last_needs_its_capability(demo, monkeypatch):
    caps = demo.backend.capabilities
    monkeypatch.setattr(type(demo.backend), "capabilities", property(lambda self: caps - {"kv_layer_copy"}))
    with pytest.raises(tl.BackendError, match="kv_layer_copy"):
        tl.generate(demo, [5, 6], exit_cfg("kl", max_tokens=2))
    assert tl.generate(demo, [5, 6], exit_cfg("kl", "recompute", max_tokens=2))


# ------------------------------------------------------------------ the greedy look-ahead
class _ChainingCPU:
    """A CPU backend with DeviceChaining's calls (the argmax taken at begin_read_argmax, the token
    handed over as the next step's ids), so the look-ahead path of Session.greedy runs on the CPU."""

    def __init__(self, be):
        self.be, self.tok = be, np.zeros(1, np.int32)

    def begin_read_argmax(self, ws):
        self.tok[0] = self.be.read_argmax(ws)

    def finish_read_argmax(self, ws):
        return int(self.tok[0])

    def device_token(self, ws):
        return self.tok


def test_look_ahead_reads_each_depth_after_the_fact(demo, monkeypatch):
    """With the look-ahead (the next guarded step queued before the token is read back), every
    token's depth, the probes and the iterations run equal the plain path's."""
    p = demo.tokenizer.encode("The little dog")
    cfg = exit_cfg("kl", max_tokens=20)
    want = tl.GenerateStats()
    out = tl.generate(demo, p, cfg, stats=want)
    be = demo.backend
    fake = _ChainingCPU(be)
    for name in ("begin_read_argmax", "finish_read_argmax", "device_token"):
        monkeypatch.setattr(be, name, getattr(fake, name), raising=False)
    caps = be.capabilities
    monkeypatch.setattr(type(be), "capabilities", property(lambda self: caps | {"device_chaining"}))
    queued = []
    real = ExitStep.queue
    monkeypatch.setattr(ExitStep, "queue", lambda self, ids, pos: (queued.append(1), real(self, ids, pos)))
    got = tl.GenerateStats()
    assert tl.generate(demo, p, cfg, stats=got) == out
    assert len(queued) == 19                    # every step but the prefill's was queued ahead
    assert got.token_loops == want.token_loops
    assert got.exit_probes == want.exit_probes and got.loop_iters_run == want.loop_iters_run


@pytest.mark.parametrize("args,kw,exc,match", [
    (([],), {}, tl.InvalidInputError, "tokens_len=0"),
    (([1.5, 2.0],), {}, tl.InvalidInputError, "integer token ids"),
    (([5, 99999],), {}, tl.InvalidInputError, "outside the vocabulary"),
    (([5, 6], "fp16"), {}, tl.ConfigError, "config must be a GenerateConfig"),
    (([5, 6],), dict(stats=[]), tl.InvalidInputError, "stats must be a GenerateStats"),
    (([5, 6], tl.GenerateConfig(temperature=0.9)), {}, tl.IncompatibleModesError, "temperature"),
    (([5, 6], tl.GenerateConfig(stop_sequences=[[5]])), {}, tl.IncompatibleModesError, "stop_sequences"),
    (([5, 6], tl.GenerateConfig(repetition_penalty=1.3)), {}, tl.IncompatibleModesError, "repetition"),
    (([5] * 300,), {}, tl.InvalidInputError, "max_seq_len"),
])
def test_score_decoded_bad_input(demo, monkeypatch, args, kw, exc, match):
    calls = []
    monkeypatch.setattr(demo.backend, "alloc_cache", lambda *a: calls.append(a))
    with pytest.raises(exc, match=match):
        tl.score_decoded(demo, *args, **kw)
    assert calls == []
