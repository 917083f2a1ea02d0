"""Edges of self-speculative decoding, the auto decoder, the model lifecycle and run configs: exact
greedy tokens where a cycle is cut (max_tokens, EOS, stop sequences, a stream callback, the end of
max_seq_len); calibration that skips candidates the model cannot run; numpy integers taken as
integers; knobs a request would ignore refused; typed errors before any work."""

from __future__ import annotations

import random

import numpy as np
import pytest

import tinyloop as tl
from tinyloop.cli.main import main
from tinyloop.plugins.decoders import autotune
from tinyloop.runtime.config import load_run_config

from conftest import write_tiny


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory):
    """A weak model over 13 tokens with an EOS id: EOS and repeated tails come often, inside drafts."""
    path = tmp_path_factory.mktemp("edges") / "eos.tinyloop"
    write_tiny(path, seed=5, quant="q4", group_size=32, vocab_size=13, eos_id=3)
    m = tl.load_model(str(path), max_seq_len=40, backend="cpu")
    yield m
    tl.free_model(m)


@pytest.fixture()
def tiny(tiny_path):
    m = tl.load_model(str(tiny_path), max_seq_len=64, backend="cpu")
    yield m
    tl.free_model(m)


def _tree_fits(m, K, D):
    return sum(K ** d for d in range(D + 1)) <= m.ws.rows


# ------------------------------------------------------------------ exactness where a cycle is cut
def test_chain_and_tree_equal_plain_greedy_where_cycles_are_cut(eos_model):
    """Random prompts (up to the end of max_seq_len), depths, draft lengths, trees, stop sequences:
    the tokens, their count and the stop reason are plain greedy decoding's at the verify depth."""
    m, rng = eos_model, random.Random(0)
    reasons = set()
    for _ in range(120):
        L = rng.randint(2, 6)
        Ld, ahead, K = rng.randint(1, L - 1), rng.randint(1, 8), rng.randint(1, 3)
        plen = rng.randint(1, 30)
        prompt = [rng.randrange(13) for _ in range(plen)]
        mt = rng.randint(1, m.max_seq_len - plen)
        stops = [[rng.randrange(13), rng.randrange(13)]] if rng.random() < 0.3 else []
        resume = rng.random() < 0.7
        ref_st = tl.GenerateStats()
        ref = tl.generate(m, prompt, tl.GenerateConfig(max_tokens=mt, loops=L, stop_sequences=stops), stats=ref_st)
        reasons.add(ref_st.stop_reason)
        st = tl.GenerateStats()
        out = tl.generate_speculative(m, prompt, tl.SpeculativeConfig(
            max_tokens=mt, draft_loops=Ld, verify_loops=L, draft_ahead=ahead, stop_sequences=stops,
            verify_resume=resume), stats=st)
        assert (out, st.stop_reason, st.tokens_emitted) == (ref, ref_st.stop_reason, ref_st.tokens_emitted)
        D = min(ahead, 3)
        if _tree_fits(m, K, D):
            out = tl.generate_tree_speculative(m, prompt, tl.TreeSpeculativeConfig(
                max_tokens=mt, draft_loops=Ld, verify_loops=L, draft_ahead=D, K_branches=K, stop_sequences=stops,
                verify_resume=resume), stats=st)
            assert (out, st.stop_reason, st.tokens_emitted) == (ref, ref_st.stop_reason, ref_st.tokens_emitted)
    assert {tl.StopReason.EOS, tl.StopReason.MAX_TOKENS} <= reasons


@pytest.mark.parametrize("decoder,options", [("speculative", {"draft_loops": 1, "draft_ahead": 6}),
                                             ("tree_speculative", {"draft_loops": 2, "draft_ahead": 2,
                                                                   "K_branches": 3})])
def test_stream_callback_sees_every_token_once_and_stops_exactly(eos_model, decoder, options):
    m = eos_model
    prompt = [1, 5, 7, 2, 9]
    ref = tl.generate(m, prompt, tl.GenerateConfig(max_tokens=30, loops=4))[len(prompt):]
    cfg = tl.GenerateConfig(max_tokens=30, loops=4, decoder=decoder, options=options)
    for abort_at in range(len(ref)):
        seen = []

        def cb(tok, pos):
            seen.append((tok, pos))
            return len(seen) - 1 != abort_at
        st = tl.GenerateStats()
        out = tl.generate_stream(m, prompt, cfg, on_token=cb, stats=st)
        assert out[len(prompt):] == [t for t, _ in seen] == ref[:abort_at + 1]
        assert [p for _, p in seen] == [len(prompt) + i for i in range(abort_at + 1)]
        assert st.tokens_emitted == abort_at + 1
        if abort_at + 1 < len(ref) or st.stop_reason == tl.StopReason.CALLBACK_ABORT:
            assert st.stop_reason == tl.StopReason.CALLBACK_ABORT


# ------------------------------------------------------------------ calibration and the auto decoder
def test_calibrate_skips_default_candidates_that_do_not_fit_the_pool(tiny_path, prompt):
    """A model loaded with a small prefill_chunk cannot verify long drafts or big trees: calibrate
    measures the candidates that fit instead of failing on the first that does not."""
    m = tl.load_model(str(tiny_path), max_seq_len=64, backend="cpu", prefill_chunk=4)
    try:
        choice = tl.calibrate(m, 4, prompts=[prompt[:4]], max_tokens=4, min_speedup=1e9)
        spec = [r for r in choice.results if r["decoder"] != "greedy"]
        assert spec and all(r["exact"] for r in spec)
        for r in spec:
            if r["decoder"] == "speculative":
                assert r["draft_ahead"] + 1 <= 4
            else:
                assert _tree_fits(m, r["K_branches"], r["draft_ahead"])
        assert m.decoder_choices[4] is choice
    finally:
        tl.free_model(m)


def test_calibrate_refuses_a_given_candidate_that_does_not_fit_before_any_work(tiny_path, prompt, monkeypatch):
    m = tl.load_model(str(tiny_path), max_seq_len=64, backend="cpu", prefill_chunk=4)
    try:
        calls = []
        monkeypatch.setattr(m.backend, "alloc_cache", lambda *a: calls.append(a))
        with pytest.raises(tl.ConfigError, match="draft_ahead=6"):
            tl.calibrate(m, 4, prompts=[prompt[:4]], max_tokens=4,
                         candidates=[tl.SpeculativeConfig(verify_loops=4, draft_loops=1, draft_ahead=2),
                                     tl.SpeculativeConfig(verify_loops=4, draft_loops=1, draft_ahead=6)])
        assert calls == []
    finally:
        tl.free_model(m)


def test_calibrate_takes_sampling_candidates(tiny, prompt):
    """Candidates are timed greedily: their sampling knobs are dropped along with the temperature."""
    c = tl.SpeculativeConfig(verify_loops=4, draft_loops=1, draft_ahead=2, temperature=0.7, seed=3, top_k=5)
    choice = tl.calibrate(tiny, 4, prompts=[prompt[:4]], max_tokens=4, candidates=[c], min_speedup=1e9)
    assert [r["decoder"] for r in choice.results] == ["greedy", "speculative"]


def test_auto_decodes_plainly_where_speculation_is_refused(tiny, prompt, monkeypatch):
    """TINYLOOP_DISABLE_KV_CACHE (the uncached reference path) is refused by the speculative decoders;
    decoder="auto" then decodes plainly instead of refusing a valid request, also with a
    speculative winner chosen before."""
    ref = tl.generate(tiny, prompt, tl.GenerateConfig(max_tokens=4, loops=4))
    monkeypatch.setenv("TINYLOOP_DISABLE_KV_CACHE", "1")
    monkeypatch.setattr(autotune, "DEFAULT_TEXTS", autotune.DEFAULT_TEXTS[:1])
    monkeypatch.setattr(autotune, "DEFAULT_MAX_TOKENS", 4)
    st = tl.GenerateStats()
    auto = tl.GenerateConfig(max_tokens=4, loops=4, decoder="auto")
    assert tl.generate(tiny, prompt, auto, stats=st) == ref and st.decoder == "greedy"
    tiny.decoder_choices[4] = autotune.DecoderChoice(
        4, "speculative", tl.SpeculativeConfig(verify_loops=4, draft_loops=1, draft_ahead=2), 2.0)
    assert tl.generate(tiny, prompt, auto, stats=st) == ref and st.decoder == "greedy"


def test_auto_does_not_recalibrate_where_calibration_cannot_run(monkeypatch):
    calls = []
    real = autotune.calibrate

    def spy(m, loops, **kw):
        calls.append(loops)
        return real(m, loops, **kw)
    monkeypatch.setattr("tinyloop.plugins.decoders.auto.calibrate", spy)
    m = tl.load_model("demo", backend="cpu", max_seq_len=3)
    try:
        cfg = tl.GenerateConfig(max_tokens=2, decoder="auto")
        ref = tl.generate(m, [5], tl.GenerateConfig(max_tokens=2))
        assert tl.generate(m, [5], cfg) == ref and tl.generate(m, [5], cfg) == ref
        assert calls == [m.cfg.default_loops]
    finally:
        tl.free_model(m)


# ------------------------------------------------------------------ argument types and ranges
def test_numpy_integers_are_integers(tiny, prompt):
    i64, i32 = np.int64, np.int32
    spec = tl.SpeculativeConfig(max_tokens=i64(6), draft_loops=i32(1), verify_loops=i64(4), draft_ahead=i64(3),
                                stop_sequences=[[i64(5), i32(6)]], cache_window=i64(0))
    assert spec == tl.SpeculativeConfig(max_tokens=6, draft_loops=1, verify_loops=4, draft_ahead=3,
                                        stop_sequences=[[5, 6]])
    assert all(type(v) is int for v in (spec.max_tokens, spec.draft_loops, spec.verify_loops, spec.draft_ahead))
    tree = tl.TreeSpeculativeConfig(max_tokens=i64(6), verify_loops=i64(4), K_branches=np.uint8(3))
    assert type(tree.K_branches) is int and tree.K_branches == 3
    gen = tl.GenerateConfig(max_tokens=i64(6), loops=i32(4), stop_sequences=[np.array([5, 6])])
    assert (type(gen.max_tokens), type(gen.loops), gen.stop_sequences) == (int, int, ((5, 6),))
    opts = tl.SpeculativeOptions(draft_loops=i64(1), draft_ahead=i32(3))
    assert type(opts.draft_loops) is int and type(opts.draft_ahead) is int
    ref = tl.generate(tiny, prompt, tl.GenerateConfig(max_tokens=6, loops=4))
    assert tl.generate_speculative(tiny, prompt, spec) == ref
    assert tl.generate(tiny, prompt, gen.replace(stop_sequences=(), decoder="speculative", options=opts)) == ref
    # bools (numpy's too) and floats are still not counts
    for bad in (True, np.bool_(True), 3.0, np.float64(3.0)):
        with pytest.raises(tl.ConfigError, match="draft_ahead must be an integer"):
            tl.SpeculativeConfig(draft_ahead=bad)


def test_load_model_and_calibrate_take_numpy_integers(tiny_path, prompt):
    m = tl.load_model(str(tiny_path), max_seq_len=np.int64(48), backend="cpu", prefill_chunk=np.int32(8))
    try:
        assert (m.max_seq_len, m.ws.rows) == (48, 8) and type(m.max_seq_len) is int
        choice = tl.calibrate(m, np.int64(4), prompts=[prompt[:4]], max_tokens=np.int64(3), min_speedup=1e9,
                              candidates=[tl.SpeculativeConfig(verify_loops=4, draft_loops=1, draft_ahead=2)])
        assert choice.loops == 4 and type(choice.loops) is int
    finally:
        tl.free_model(m)


@pytest.mark.parametrize("kw,match", [
    (dict(max_seq_len=64.0), r"max_seq_len must be an integer in \[1, 1048576\], got 64.0"),
    (dict(max_seq_len="64"), "max_seq_len must be an integer.*got .64."),
    (dict(max_seq_len=np.bool_(True)), "max_seq_len must be an integer"),
    (dict(max_seq_len=0), r"max_seq_len=0 is outside the allowed range \[1, 1048576\]"),
    (dict(prefill_chunk=2.0), "prefill_chunk must be an integer"),
])
def test_load_model_count_errors_say_what_is_wrong(tiny_path, kw, match):
    with pytest.raises(tl.ConfigError, match=match):
        tl.load_model(str(tiny_path), backend="cpu", **kw)


@pytest.mark.parametrize("make", [
    lambda: tl.SpeculativeConfig(verify_loops=1, draft_loops=1),
    lambda: tl.TreeSpeculativeConfig(verify_loops=1, draft_loops=1),
    lambda: tl.SpeculativeOptions(verify_loops=1, draft_loops=1),
])
def test_a_verify_depth_of_one_is_refused_where_it_is_set(make):
    """Speculation needs draft_loops < verify_loops, so verify_loops=1 leaves no draft depth: the
    error names verify_loops (not an empty draft_loops range), when the config is made."""
    with pytest.raises(tl.ConfigError, match=r"verify_loops=1 is outside the allowed range >= 2"):
        make()


@pytest.mark.parametrize("cls", [tl.SpeculativeConfig, tl.TreeSpeculativeConfig])
@pytest.mark.parametrize("field,value", [("seed", 5), ("top_k", 3), ("top_k", 0), ("top_p", 0.5)])
def test_sampling_knobs_of_a_greedy_speculative_config_are_refused(cls, field, value):
    """Greedy speculation (temperature <= 0.01) uses no seed, top_k or top_p: setting one is an
    error naming it (as GenerateConfig's sampling knobs on a greedy request), not silently ignored."""
    with pytest.raises(tl.ConfigError, match=f"{field}={value}"):
        cls(**{field: value})
    with pytest.raises(tl.ConfigError, match=f"{field}={value}"):
        cls(temperature=0.005, **{field: value})
    if value:
        assert getattr(cls(temperature=0.7, **{field: value}), field) == value     # sampling uses it


def test_run_config_sampling_knob_on_greedy_speculation_names_the_key(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("prompts: [x]\nmode: tree_speculative\nspeculative: {max_tokens: 4, top_k: 3}\n")
    with pytest.raises(tl.ConfigError, match="top_k=3"):
        load_run_config(str(p))


def test_run_config_speculative_section_matches_the_mode():
    with pytest.raises(tl.ConfigError, match="mode: speculative .*SpeculativeConfig.*TreeSpeculativeConfig"):
        tl.RunConfig(prompts=["x"], mode="speculative", speculative=tl.TreeSpeculativeConfig())
    with pytest.raises(tl.ConfigError, match="mode: tree_speculative .*TreeSpeculativeConfig.*got SpeculativeConfig"):
        tl.RunConfig(prompts=["x"], mode="tree_speculative", speculative=tl.SpeculativeConfig())
    cfg = tl.RunConfig(prompts=["x"], mode="tree_speculative", speculative=tl.TreeSpeculativeConfig(K_branches=3))
    assert cfg.speculative.K_branches == 3


@pytest.mark.parametrize("text,match", [
    ("prompts: [x]\nmode: speculative\nspeculative: {verify_loops: 1, draft_loops: 1}\n", "verify_loops=1"),
    ("prompts: [x]\nmode: speculative\nspeculative: {max_tokens: 4, seed: 9}\n", "seed=9"),
])
def test_cli_run_reports_a_bad_speculative_section_in_one_line(tmp_path, capsys, text, match):
    p = tmp_path / "run.yaml"
    p.write_text(text)
    assert main(["run", str(p)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and match in err[0] and "Traceback" not in err[0]


# ------------------------------------------------------------------ lifecycle
def test_chat_template_on_a_freed_model_is_model_freed_error(tiny_path):
    m = tl.load_model(str(tiny_path), max_seq_len=32, backend="cpu")
    tl.free_model(m)
    with pytest.raises(tl.ModelFreedError):
        tl.apply_chat_template(m, [{"role": "user", "content": "hi"}])


def test_speculative_requests_are_not_reentrant_and_free_is_deferred(tiny, prompt):
    """From inside a speculative request's callback: another request on the model (speculative,
    tree, auto, calibrate) is ModelBusyError; free_model is deferred and ends the request with
    ModelFreedError after that token, cache released; the model is then freed."""
    nested = {
        "speculative": lambda: tl.generate_speculative(tiny, prompt,
                                                       tl.SpeculativeConfig(max_tokens=2, verify_loops=4)),
        "tree": lambda: tl.generate_tree_speculative(tiny, prompt, tl.TreeSpeculativeConfig(max_tokens=2,
                                                                                            verify_loops=4)),
        "auto": lambda: tl.generate(tiny, prompt, tl.GenerateConfig(max_tokens=2, decoder="auto")),
        "calibrate": lambda: tl.calibrate(tiny, 4, prompts=[prompt[:3]], max_tokens=2),
    }
    seen, busy = [], []

    def cb(tok, pos):
        seen.append(tok)
        if len(seen) == 1:
            for name, call in nested.items():
                with pytest.raises(tl.ModelBusyError):
                    call()
                busy.append(name)
            tl.free_model(tiny)
        return True
    st = tl.GenerateStats()
    cfg = tl.GenerateConfig(max_tokens=12, loops=4, decoder="tree_speculative", options={"draft_loops": 1})
    with pytest.raises(tl.ModelFreedError, match="free_model"):
        tl.generate_stream(tiny, prompt, cfg, on_token=cb, stats=st)
    assert busy == list(nested) and len(seen) == 1 and st.stop_reason == tl.StopReason.CALLBACK_ABORT
    assert tiny._freed and tiny._live_cache_bytes == 0
    for call in nested.values():
        with pytest.raises(tl.ModelFreedError):
            call()
    with pytest.raises(tl.ModelFreedError):
        tl.vram_usage_bytes(tiny)
    tl.free_model(tiny)                          # idempotent
