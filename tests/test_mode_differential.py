"""Differential property tests of the decode modes tests/test_entry_point_differential.py does not
draw (it owns the fixtures and helpers reused here):

1. early exit (every built-in criterion; gate on a model with an exit gate): generate vs
   generate_stream vs generate_iter give the same tokens and per-token depths (stats.token_loops,
   read by the streaming consumer as each token arrives), the uncached reference path
   (TINYLOOP_DISABLE_KV_CACHE=1) too, and prefix reuse (prefix cache, prefix pool) equals plain
   early exit; the contexts compat.yaml rejects (batched, speculative, warm start; beams by a
   pair rule) raise the typed error before any work;
2. warm start: resume_generate / resume_generate_iter at any depth >= the handle's build depth
   equal a fresh generate at that depth (docs/ARCHITECTURE.md, "Cache reuse": bit-exact), in any
   order of depths; a shallower depth is a ConfigError; a cache window is rejected before work;
3. grammars (regex, JSON schema): generate vs generate_stream vs generate_iter vs a one-lane
   generate_batch(grammars=[g]) vs prefix cache / pool vs warm start give the same tokens, and an
   output that ends with EOS / GRAMMAR_COMPLETE satisfies the grammar (re.fullmatch, jsonschema).
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import tinyloop as tl
from tinyloop.errors import ConfigError
from tinyloop.runtime.compat import CompatWarning

from test_entry_point_differential import (MAX_SEQ, SCALE, SETTINGS, expected_stop, model,  # noqa: F401
                                           rejected_before_work, requests, with_stops)

#: thresholds at which the tiny random models exit at mixed depths (tests/test_early_exit.py's)
CRITERIA = {"hidden_l2": dict(early_exit_threshold=0.35), "kl": dict(early_exit_threshold=0.05),
            "argmax": {}, "logit_margin": dict(early_exit_logit_margin=2.0), "": {}}


@pytest.fixture(scope="module")
def gate_model(tmp_path_factory):
    """The differential model's shape with a learned exit gate (the gate criterion needs one)."""
    from conftest import write_tiny
    path = tmp_path_factory.mktemp("mode_differential") / "gate.tinyloop"
    write_tiny(path, vocab_size=300, eos_id=34, exit_gate=True, seed=5)
    m = tl.load_model(str(path), max_seq_len=MAX_SEQ, backend="cpu")
    yield m
    tl.free_model(m)


# =============================================================================== early exit
@st.composite
def exit_knobs(draw, gate: bool = False):
    if gate:                                    # gate needs every iteration probed
        knobs = dict(early_exit_criterion="gate", early_exit_min_L=1, early_exit_peek_every=1,
                     early_exit_threshold=draw(st.sampled_from([0.0, 0.3, 0.5, 0.9])))
    else:
        crit = draw(st.sampled_from(sorted(CRITERIA)))
        knobs = dict(CRITERIA[crit], early_exit_criterion=crit, early_exit_min_L=draw(st.integers(1, 3)),
                     early_exit_peek_every=draw(st.integers(1, 2)))
    knobs.update(early_exit_patience=draw(st.integers(1, 2)),
                 early_exit_kv=draw(st.sampled_from(["copy_last", "recompute"])))
    return knobs


def _exit_run(call):
    """Tokens and the depth each streamed token reports as it arrives (token_loops[-1])."""
    stats, seen = tl.GenerateStats(), []
    out = call(stats, lambda t, p: seen.append((t, p, stats.token_loops[-1])) or True)
    return out, stats, seen


def _same_exit_stats(a, b, what):
    assert (a.tokens_emitted, a.stop_reason) == (b.tokens_emitted, b.stop_reason), what
    assert a.token_loops == b.token_loops, what
    assert a.exit_probes == b.exit_probes, what


def check_exit_paths(m, req, knobs, data):
    prompt, cfg = req
    # a patience the probes below `loops` can never reach is a ConfigError (resolve_exit)
    need = knobs["early_exit_min_L"] + 1 + (knobs["early_exit_patience"] - 1) * knobs["early_exit_peek_every"]
    cfg = dataclasses.replace(cfg, loops=max(cfg.loops, need), max_tokens=max(cfg.max_tokens, 3), **knobs)
    base = tl.generate(m, prompt, cfg)
    cfg = with_stops(data, cfg, base[len(prompt):], prompt)
    stats = tl.GenerateStats()
    out = tl.generate(m, prompt, cfg, stats=stats)
    gen = out[len(prompt):]
    assert out[:len(prompt)] == list(prompt)
    assert stats.stop_reason == expected_stop(m, cfg, gen)
    assert stats.tokens_emitted == len(gen) == len(stats.token_loops)
    assert all(1 <= d <= cfg.loops for d in stats.token_loops)
    if gen:
        assert stats.token_loops[0] == cfg.loops          # the prefill runs at full depth
        assert stats.loops_used == pytest.approx(sum(stats.token_loops) / len(gen))
        event("exited early" if min(stats.token_loops) < cfg.loops else "full depth")

    sout, sst, seen = _exit_run(lambda s, cb: tl.generate_stream(m, prompt, cfg, on_token=cb, stats=s))
    assert sout == out
    assert seen == [(t, len(prompt) + i, d) for i, (t, d) in enumerate(zip(gen, stats.token_loops))]
    _same_exit_stats(sst, stats, "generate_stream")
    ist = tl.GenerateStats()
    assert list(tl.generate_iter(m, prompt, cfg, stats=ist)) == gen
    _same_exit_stats(ist, stats, "generate_iter")

    with pytest.MonkeyPatch.context() as mp:               # the uncached reference path
        mp.setenv("TINYLOOP_DISABLE_KV_CACHE", "1")
        ust = tl.GenerateStats()
        assert tl.generate(m, prompt, cfg, stats=ust) == out
        _same_exit_stats(ust, stats, "uncached")

    k = data.draw(st.integers(1, len(prompt)), label="split")
    pc = tl.build_prefix_cache(m, prompt[:k], loops=cfg.loops, cache_mode=cfg.cache_mode)
    pool = tl.create_prefix_pool(2)
    try:
        tl.register_prefix(pool, m, prompt[:k], loops=cfg.loops, cache_mode=cfg.cache_mode)
        if cfg.cache_window > 0:                           # compat.yaml: cache_window x prefix_reuse
            rejected_before_work(m, lambda: tl.generate_from_prefix_cache(m, pc, prompt[k:], cfg))
            rejected_before_work(m, lambda: tl.generate_with_pool(m, pool, prompt, cfg))
        else:
            pout, pst, pseen = _exit_run(
                lambda s, cb: tl.generate_from_prefix_cache(m, pc, prompt[k:], cfg, stats=s, on_token=cb))
            assert pout == out and pseen == seen
            _same_exit_stats(pst, stats, "prefix cache")
            wout, wst, wseen = _exit_run(lambda s, cb: tl.generate_with_pool(m, pool, prompt, cfg, stats=s,
                                                                              on_token=cb))
            assert wout == out and wseen == seen
            _same_exit_stats(wst, stats, "prefix pool")
            assert list(tl.generate_from_prefix_cache_iter(m, pc, prompt[k:], cfg)) == gen
            assert list(tl.generate_with_pool_iter(m, pool, prompt, cfg)) == gen
    finally:
        tl.free_prefix_cache(pc)
        tl.free_prefix_pool(pool)
    return prompt, cfg, out


@settings(max_examples=30 * SCALE, **SETTINGS)
@given(req=requests(), knobs=exit_knobs(), data=st.data())
def test_early_exit_paths_agree(model, req, knobs, data):
    prompt, cfg, out = check_exit_paths(model, req, knobs, data)
    # the contexts compat.yaml rejects with early exit: typed error before any work, model usable
    if cfg.cache_window == 0:
        rejected_before_work(model, lambda: tl.generate_batch(model, [prompt], cfg))
    rejected_before_work(model, lambda: tl.build_resume_handle(model, prompt, cfg.loops, cfg))
    plain = dataclasses.replace(cfg, early_exit_patience=0, early_exit_min_L=2, early_exit_peek_every=1,
                                early_exit_criterion="", early_exit_threshold=0.0, early_exit_logit_margin=0.0,
                                early_exit_kv="copy_last")
    h = tl.build_resume_handle(model, prompt, 1, dataclasses.replace(plain, loops=1, cache_window=0))
    try:
        rejected_before_work(model, lambda: tl.resume_generate(h, cfg.loops, dataclasses.replace(cfg, cache_window=0)))
    finally:
        tl.free_resume_handle(h)
    if cfg.repetition_penalty == 1.0:                      # (that pair has its own rejection)
        spec = dataclasses.replace(cfg, decoder="speculative",
                                   options=dict(draft_loops=1, verify_loops=cfg.loops, draft_ahead=2))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CompatWarning)
            rejected_before_work(model, lambda: tl.generate(model, prompt, spec))
    if cfg.temperature <= 0.01 and cfg.repetition_penalty == 1.0 and cfg.cache_window == 0:
        beams = dataclasses.replace(cfg, beam_size=2)
        rejected_before_work(model, lambda: tl.generate(model, prompt, beams))
    assert tl.generate(model, prompt, cfg) == out          # still usable, same answer


@settings(max_examples=25 * SCALE, **SETTINGS)
@given(req=requests(), knobs=exit_knobs(gate=True), data=st.data())
def test_gate_exit_paths_agree(gate_model, req, knobs, data):
    check_exit_paths(gate_model, req, knobs, data)


# =============================================================================== warm start
@settings(max_examples=25 * SCALE, **SETTINGS)
@given(req=requests(), data=st.data())
def test_warm_start_equals_fresh_generate(model, req, data):
    prompt, cfg = req
    top = model.cfg.max_loops
    base_L = data.draw(st.integers(1, top), label="loops_used")
    if cfg.cache_window > 0:                # compat.yaml: cache_window x warm_start is rejected
        rejected_before_work(model, lambda: tl.build_resume_handle(
            model, prompt, base_L, dataclasses.replace(cfg, loops=base_L)))
        cfg = dataclasses.replace(cfg, cache_window=0)
    cfg = with_stops(data, cfg, tl.generate(model, prompt, cfg)[len(prompt):], prompt)
    h = tl.build_resume_handle(model, prompt, base_L, dataclasses.replace(cfg, loops=base_L))
    try:
        depths = data.draw(st.lists(st.integers(1, top), min_size=1, max_size=3), label="depths")
        for L in depths:
            at = dataclasses.replace(cfg, loops=L)
            if L < base_L:                  # its residual never existed
                with pytest.raises(ConfigError):
                    tl.resume_generate(h, L, at)
                continue
            want_st = tl.GenerateStats()
            want = tl.generate(model, prompt, at, stats=want_st)
            rst, seen = tl.GenerateStats(), []
            assert tl.resume_generate(h, L, at, stats=rst, on_token=lambda t, p: seen.append((t, p)) or True) == want
            assert seen == [(t, len(prompt) + i) for i, t in enumerate(want[len(prompt):])]
            assert (rst.tokens_emitted, rst.stop_reason, rst.loops_used) == \
                (want_st.tokens_emitted, want_st.stop_reason, want_st.loops_used)
            assert list(tl.resume_generate_iter(h, L, at)) == want[len(prompt):]
            # config None: the build config at depth L
            assert tl.resume_generate(h, L) == want
            event("upgraded" if L > base_L else "same depth")
    finally:
        tl.free_resume_handle(h)


# =============================================================================== grammars
REGEXES = ["[a-c]{1,4}x?", "(ab|ba)+", "[0-9]{2,3}", "a|bc|def", "x[0-9]*y", "(cat|dog)s?", "[a-z]{0,3}!"]
# the differential model's EOS is the byte '"' (id 34): no JSON strings, so no objects either
SCHEMAS = st.one_of(
    st.builds(lambda lo, w: {"type": "integer", "minimum": lo, "maximum": lo + w},
              st.integers(-20, 50), st.integers(0, 200)),
    st.just({"type": "boolean"}),
    st.builds(lambda xs: {"enum": xs}, st.lists(st.sampled_from([1, 2, 30, None, True, False]),
                                                min_size=1, max_size=4, unique=True)),
    st.builds(lambda n: {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                         "maxItems": n}, st.integers(0, 3)),
)


@st.composite
def grammars(draw):
    if draw(st.booleans()):
        pattern = draw(st.sampled_from(REGEXES))
        return tl.Grammar.regex(pattern), ("regex", pattern)
    schema = draw(SCHEMAS)
    ws = draw(st.sampled_from(["flexible", "compact", "spaced"]))
    return tl.Grammar.json_schema(schema, whitespace=ws), ("json", schema)


def check_grammar_output(m, g, spec, cfg, out, prompt, stats):
    gen = out[len(prompt):]
    eos = set(m.cfg.eos_ids)
    finished = stats.stop_reason in (tl.StopReason.EOS, tl.StopReason.GRAMMAR_COMPLETE)
    event(f"grammar stop {stats.stop_reason}")
    body = [t for t in gen if t not in eos]
    assert len(body) >= len(gen) - 1 and (not gen[:-1] or not (set(gen[:-1]) & eos))
    mt = g.matcher(m.tokenizer, m.cfg.vocab_size, m.cfg.eos_id)
    assert mt.validate_tokens(body) == len(body)          # every emitted token is allowed
    if not finished:
        return
    text = m.tokenizer.decode(body)
    kind, what = spec
    if kind == "regex":
        assert re.fullmatch(what, text), (what, text)
    else:
        jsonschema = pytest.importorskip("jsonschema")
        jsonschema.validate(json.loads(text), what)


@settings(max_examples=25 * SCALE, **SETTINGS)
@given(req=requests(), gram=grammars(), data=st.data())
def test_grammar_paths_agree(model, req, gram, data):
    pytest.importorskip("llguidance")
    prompt, cfg = req
    g, spec = gram
    cfg = dataclasses.replace(cfg, cache_window=0, max_tokens=max(cfg.max_tokens, 4) + 4)
    gcfg = dataclasses.replace(cfg, grammar=g)
    stats = tl.GenerateStats()
    out = tl.generate(model, prompt, gcfg, stats=stats)
    assert out[:len(prompt)] == list(prompt)
    check_grammar_output(model, g, spec, gcfg, out, prompt, stats)
    gen = out[len(prompt):]

    def same(st_, what):
        assert (st_.tokens_emitted, st_.stop_reason) == (stats.tokens_emitted, stats.stop_reason), what

    sst, seen = tl.GenerateStats(), []
    assert tl.generate_stream(model, prompt, gcfg, on_token=lambda t, p: seen.append(t) or True, stats=sst) == out
    assert seen == gen
    same(sst, "generate_stream")
    ist = tl.GenerateStats()
    assert list(tl.generate_iter(model, prompt, gcfg, stats=ist)) == gen
    same(ist, "generate_iter")
    bst = []
    assert tl.generate_batch(model, [prompt], cfg, grammars=[g], stats=bst) == [out]
    same(bst[0], "generate_batch")
    assert tl.generate_batch(model, [prompt], gcfg) == [out]   # the grammar in the config instead

    k = data.draw(st.integers(1, len(prompt)), label="split")
    pc = tl.build_prefix_cache(model, prompt[:k], loops=cfg.loops, cache_mode=cfg.cache_mode)
    pool = tl.create_prefix_pool(2)
    try:
        pst = tl.GenerateStats()
        assert tl.generate_from_prefix_cache(model, pc, prompt[k:], gcfg, stats=pst) == out
        same(pst, "prefix cache")
        tl.register_prefix(pool, model, prompt[:k], loops=cfg.loops, cache_mode=cfg.cache_mode)
        wst = tl.GenerateStats()
        assert tl.generate_with_pool(model, pool, prompt, gcfg, stats=wst) == out
        same(wst, "prefix pool")
    finally:
        tl.free_prefix_cache(pc)
        tl.free_prefix_pool(pool)

    base_L = data.draw(st.integers(1, cfg.loops), label="loops_used")   # compat.yaml: grammar x warm_start ok
    h = tl.build_resume_handle(model, prompt, base_L, dataclasses.replace(gcfg, loops=base_L))
    try:
        rst = tl.GenerateStats()
        assert tl.resume_generate(h, cfg.loops, gcfg, stats=rst) == out
        same(rst, "warm start")
    finally:
        tl.free_resume_handle(h)
