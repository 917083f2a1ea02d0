"""Differential property test of the public entry points: hypothesis draws a random valid request
(prompt, GenerateConfig over the knobs that compose per configs/compat.yaml) and checks that every
entry point that should give the same tokens does:

1. generate vs generate_stream (the on_token tokens and positions) vs generate_iter vs
   generate_text, and a str prompt vs its ids (the byte tokenizer's round trip);
2. GenerateStats: tokens_emitted, stop_reason (EOS / STOP_SEQUENCE / MAX_TOKENS, and that nothing
   earlier would have stopped), loops_used, the prompt kept in front of the output;
3. generate_batch with one lane, and with the prompt twice (greedy: both lanes equal generate;
   sampling: lane i follows tl.lane_seed);
4. build_prefix_cache + generate_from_prefix_cache at a random split of the prompt, and
   create_prefix_pool / register_prefix / generate_with_pool;
5. greedy generate vs generate_speculative / generate_tree_speculative at the verify depth.

Where compat.yaml rejects the combination (a cache window in batched / prefix reuse / tree
contexts, repetition penalty with speculation), the entry point must raise the typed error before
any work: vram_usage_bytes unchanged and the model still usable.

tests/test_compat.py draws mode combinations per context and checks run-or-reject only; here the
outputs of the entry points are compared with each other.
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import tinyloop as tl
from tinyloop.errors import IncompatibleModesError
from tinyloop.runtime.compat import CompatWarning

MAX_SEQ = 64
#: TINYLOOP_PROPERTY_SCALE=k runs k times the examples (as tests/test_family_properties.py).
SCALE = max(1, int(os.environ.get("TINYLOOP_PROPERTY_SCALE", "1") or 1))
SETTINGS = dict(deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])


@pytest.fixture(scope="module", params=[dict(), dict(quant="q4", group_size=32, n_post=0, loop_inject="none",
                                                      n_loop=1, seed=2)], ids=["f16", "q4-nopost"])
def model(request, tmp_path_factory):
    """300 ids (the byte tokenizer serves the text entry points), EOS = an id the random weights
    pick often under greedy decoding, so EOS stops happen in the drawn examples; f16 weights with
    post blocks and loop injection, and q4 weights with neither (one loop layer)."""
    from conftest import write_tiny
    path = tmp_path_factory.mktemp("differential") / "m.tinyloop"
    write_tiny(path, vocab_size=300, eos_id=34, **request.param)
    m = tl.load_model(str(path), max_seq_len=MAX_SEQ, backend="cpu")
    yield m
    tl.free_model(m)


# =============================================================================== strategies
@st.composite
def requests(draw, vocab: int = 300, max_loops: int = 8):
    prompt = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12))
    knobs = dict(max_tokens=draw(st.integers(0, 8)), loops=draw(st.integers(1, max_loops)),
                 cache_mode=draw(st.sampled_from(["fp16", "fp32", "int8", "int4"])),
                 cache_window=draw(st.sampled_from([0, 0, 0, 1, 3, 4, 8, 32])),
                 repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.3, 0.8])))
    if draw(st.booleans()):
        knobs.update(temperature=draw(st.sampled_from([0.3, 0.8, 1.5])),
                     top_k=draw(st.sampled_from([1, 5, 50, vocab])),
                     top_p=draw(st.sampled_from([0.3, 0.9, 1.0])),
                     sample_seed=draw(st.integers(0, 2 ** 32)))
    return prompt, tl.GenerateConfig(**knobs)


def with_stops(data, cfg: tl.GenerateConfig, continuation, prompt=()) -> tl.GenerateConfig:
    """Stop sequences drawn partly from the unconstrained continuation, so they fire, and partly
    spanning the prompt's end (the output alone is matched: those must not fire early)."""
    seqs = []
    for _ in range(data.draw(st.integers(0, 2), label="n_stops")):
        if continuation and prompt and data.draw(st.booleans(), label="stop_across_prompt"):
            n = data.draw(st.integers(1, min(2, len(prompt))), label="stop_prompt_part")
            seqs.append(tuple(prompt[len(prompt) - n:]) + (continuation[0],))
        elif continuation and data.draw(st.booleans(), label="stop_from_output"):
            i = data.draw(st.integers(0, len(continuation) - 1), label="stop_at")
            n = data.draw(st.integers(1, min(2, i + 1)), label="stop_len")
            seqs.append(tuple(continuation[i + 1 - n:i + 1]))
        else:
            seqs.append(tuple(data.draw(st.lists(st.integers(0, 299), min_size=1, max_size=2), label="stop")))
    return dataclasses.replace(cfg, stop_sequences=tuple(seqs))


def greedy(cfg: tl.GenerateConfig) -> bool:
    return cfg.temperature <= 0.01


# =============================================================================== helpers
def expected_stop(model, cfg: tl.GenerateConfig, gen) -> None:
    """`gen` (the continuation) ends exactly where the stop rules say, and no earlier."""
    eos = set(model.cfg.eos_ids)
    seqs = [tuple(s) for s in cfg.stop_sequences]

    def reason(out):
        if out and out[-1] in eos:
            return tl.StopReason.EOS
        if any(len(out) >= len(s) and tuple(out[len(out) - len(s):]) == s for s in seqs):
            return tl.StopReason.STOP_SEQUENCE
        return None

    for k in range(1, len(gen)):
        assert reason(gen[:k]) is None, f"should have stopped after {k} tokens: {gen}"
    got = reason(gen) if gen else None
    return got if got is not None else tl.StopReason.MAX_TOKENS


def check_stats(model, cfg, prompt, out, stats) -> None:
    gen = out[len(prompt):]
    assert out[:len(prompt)] == list(prompt)
    assert all(0 <= t < model.vocab_size for t in gen)
    assert len(gen) <= cfg.max_tokens
    assert stats.tokens_emitted == len(gen)
    want = expected_stop(model, cfg, gen)
    if want == tl.StopReason.MAX_TOKENS:
        assert len(gen) == cfg.max_tokens
    assert stats.stop_reason == want, (stats.stop_reason, want, gen, cfg.stop_sequences)
    assert stats.loops_used == cfg.loops
    event(f"stop {want}")


def rejected_before_work(model, call, exc=IncompatibleModesError) -> None:
    before = tl.vram_usage_bytes(model)
    with pytest.raises(exc) as info:
        call()
    assert "compat.yaml" in str(info.value), str(info.value)
    assert tl.vram_usage_bytes(model) == before


def run_plain(model, prompt, cfg):
    stats = tl.GenerateStats()
    out = tl.generate(model, prompt, cfg, stats=stats)
    return out, stats


# =============================================================================== properties
@settings(max_examples=40 * SCALE, **SETTINGS)
@given(req=requests(), data=st.data())
def test_single_entry_points_agree(model, req, data):
    prompt, cfg = req
    base, _ = run_plain(model, prompt, dataclasses.replace(cfg))
    cfg = with_stops(data, cfg, base[len(prompt):], prompt)
    out, stats = run_plain(model, prompt, cfg)
    check_stats(model, cfg, prompt, out, stats)
    gen = out[len(prompt):]
    # a stop rule only truncates: the tokens before the stop are the unconstrained ones
    assert gen == base[len(prompt):len(prompt) + len(gen)]

    seen = []
    sst = tl.GenerateStats()
    streamed = tl.generate_stream(model, prompt, cfg, on_token=lambda t, p: seen.append((t, p)) or True,
                                  stats=sst)
    assert streamed == out
    assert seen == [(t, len(prompt) + i) for i, t in enumerate(gen)]   # position: index in prompt + output
    assert sst.tokens_emitted == stats.tokens_emitted and sst.stop_reason == stats.stop_reason

    if gen:                              # on_token returning False ends the request after that token
        j = data.draw(st.integers(0, len(gen) - 1), label="abort_at")
        ast = tl.GenerateStats()
        cut = tl.generate_stream(model, prompt, cfg, on_token=lambda t, p: p - len(prompt) < j, stats=ast)
        assert cut == out[:len(prompt) + j + 1]
        assert ast.tokens_emitted == j + 1 and ast.stop_reason == tl.StopReason.CALLBACK_ABORT
        it = tl.generate_iter(model, prompt, cfg, stats=(ast := tl.GenerateStats()))
        assert [next(it) for _ in range(j + 1)] == gen[:j + 1]
        it.close()                       # a consumer closing the generator early: CALLBACK_ABORT too
        if j + 1 < len(gen):
            assert ast.stop_reason == tl.StopReason.CALLBACK_ABORT and ast.tokens_emitted == j + 1

    ist = tl.GenerateStats()
    assert list(tl.generate_iter(model, prompt, cfg, stats=ist)) == gen
    assert ist.tokens_emitted == stats.tokens_emitted and ist.stop_reason == stats.stop_reason

    tok = model.tokenizer
    text = tl.generate_text(model, prompt, cfg)
    assert text == tok.decode([t for t in gen if t not in model.cfg.eos_ids])
    if all(t < 128 for t in prompt):          # ASCII ids: the text prompt encodes back to them
        assert tok.encode(tok.decode(prompt)) == prompt
        assert tl.generate(model, tok.decode(prompt), cfg) == out


@settings(max_examples=30 * SCALE, **SETTINGS)
@given(req=requests(), data=st.data())
def test_batch_lanes_agree_with_generate(model, req, data):
    prompt, cfg = req
    base, _ = run_plain(model, prompt, cfg)
    cfg = with_stops(data, cfg, base[len(prompt):], prompt)
    if cfg.cache_window > 0:            # compat.yaml: cache_window x batched is rejected
        rejected_before_work(model, lambda: tl.generate_batch(model, [prompt, prompt], cfg))
        rejected_before_work(model, lambda: tl.generate_batch(model, [prompt], cfg))
        assert tl.generate(model, prompt, cfg)[:len(prompt)] == prompt
        return
    out, stats = run_plain(model, prompt, cfg)
    lane_stats = []
    one = tl.generate_batch(model, [prompt], cfg, stats=lane_stats)
    assert one == [out]
    assert lane_stats[0].tokens_emitted == stats.tokens_emitted
    assert lane_stats[0].stop_reason == stats.stop_reason
    two = tl.generate_batch(model, [prompt, list(prompt)], cfg, stats=lane_stats)
    assert two[0] == out
    if greedy(cfg):
        assert two[1] == out
    else:
        lane1 = dataclasses.replace(cfg, sample_seed=tl.lane_seed(cfg.sample_seed, 1))
        assert two[1] == tl.generate(model, prompt, lane1)
    for o, s in zip(two, lane_stats):
        check_stats(model, cfg, prompt, o, s)
        assert s.batch_lanes in (0, 2)
    other = data.draw(st.lists(st.integers(0, 299), min_size=1, max_size=12), label="other_prompt")
    mixed = tl.generate_batch(model, [other, prompt], cfg)   # lanes of different lengths
    assert mixed[0] == tl.generate(model, other, cfg)
    lane1 = cfg if greedy(cfg) else dataclasses.replace(cfg, sample_seed=tl.lane_seed(cfg.sample_seed, 1))
    assert mixed[1] == tl.generate(model, prompt, lane1)
    if all(t < 128 for t in prompt):      # a str prompt per lane, encoded like generate's
        text = model.tokenizer.decode(prompt)
        assert tl.generate_batch(model, [text], cfg) == [out]


@settings(max_examples=30 * SCALE, **SETTINGS)
@given(req=requests(), data=st.data())
def test_prefix_reuse_agrees_with_generate(model, req, data):
    prompt, cfg = req
    base, _ = run_plain(model, prompt, cfg)
    cfg = with_stops(data, cfg, base[len(prompt):], prompt)
    k = data.draw(st.integers(1, len(prompt)), label="split")
    if cfg.cache_window > 0:            # compat.yaml: cache_window x prefix_reuse is rejected
        pc = tl.build_prefix_cache(model, prompt[:k], loops=cfg.loops, cache_mode=cfg.cache_mode)
        try:
            rejected_before_work(model, lambda: tl.generate_from_prefix_cache(model, pc, prompt[k:], cfg))
        finally:
            tl.free_prefix_cache(pc)
        pool = tl.create_prefix_pool(2)
        try:
            tl.register_prefix(pool, model, prompt[:k], loops=cfg.loops, cache_mode=cfg.cache_mode)
            rejected_before_work(model, lambda: tl.generate_with_pool(model, pool, prompt, cfg))
        finally:
            tl.free_prefix_pool(pool)
        assert tl.generate(model, prompt, cfg)[:len(prompt)] == prompt      # the model is still usable
        return
    out, stats = run_plain(model, prompt, cfg)
    pc = tl.build_prefix_cache(model, prompt[:k], loops=cfg.loops, cache_mode=cfg.cache_mode)
    try:
        pst = tl.GenerateStats()
        seen = []
        got = tl.generate_from_prefix_cache(model, pc, prompt[k:], cfg, stats=pst,
                                            on_token=lambda t, p: seen.append((t, p)) or True)
        assert got == out
        # on_token positions are positions of the whole sequence (prefix + suffix), as generate_stream's
        assert seen == [(t, len(prompt) + i) for i, t in enumerate(out[len(prompt):])]
        assert list(tl.generate_from_prefix_cache_iter(model, pc, prompt[k:], cfg)) == out[len(prompt):]
        check_stats(model, cfg, prompt, out, pst)
        # max_tokens 0 returns the prompt without any forward (nothing is computed or copied)
        assert pst.reused_tokens == (min(k, len(prompt) - 1) if cfg.max_tokens else 0)
    finally:
        tl.free_prefix_cache(pc)
    pool = tl.create_prefix_pool(2)
    try:
        tl.register_prefix(pool, model, prompt[:k], loops=cfg.loops, cache_mode=cfg.cache_mode)
        wst = tl.GenerateStats()
        seen = []
        assert tl.generate_with_pool(model, pool, prompt, cfg, stats=wst,
                                     on_token=lambda t, p: seen.append((t, p)) or True) == out
        assert seen == [(t, len(prompt) + i) for i, t in enumerate(out[len(prompt):])]
        assert list(tl.generate_with_pool_iter(model, pool, prompt, cfg)) == out[len(prompt):]
        check_stats(model, cfg, prompt, out, wst)
        assert wst.reused_tokens == (min(k, len(prompt) - 1) if cfg.max_tokens else 0)
    finally:
        tl.free_prefix_pool(pool)


@settings(max_examples=20 * SCALE, **SETTINGS)
@given(req=requests(), data=st.data())
def test_speculative_spellings_agree_when_sampling(model, req, data):
    """generate_speculative / generate_tree_speculative and generate(decoder=...) with the same
    settings are the same request (docs/ARCHITECTURE.md, "Decoder plugins"): same tokens, same stats."""
    prompt, cfg = req
    if greedy(cfg):
        cfg = dataclasses.replace(cfg, temperature=0.8, sample_seed=7)
    loops = max(2, cfg.loops)
    draft = data.draw(st.integers(1, loops - 1), label="draft_loops")
    ahead = data.draw(st.integers(1, 3), label="draft_ahead")
    for name, cls, extra in (("speculative", tl.SpeculativeConfig, {}),
                             ("tree_speculative", tl.TreeSpeculativeConfig, {"K_branches": 2})):
        window = 0 if name == "tree_speculative" else cfg.cache_window
        sc = cls(max_tokens=cfg.max_tokens, draft_loops=draft, verify_loops=loops, draft_ahead=ahead,
                 temperature=cfg.temperature, seed=cfg.sample_seed, top_k=cfg.top_k, top_p=cfg.top_p,
                 cache_mode=cfg.cache_mode, cache_window=window, **extra)
        gc = tl.GenerateConfig(decoder=name, loops=loops, max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                               sample_seed=cfg.sample_seed, top_k=cfg.top_k, top_p=cfg.top_p,
                               cache_mode=cfg.cache_mode, cache_window=window,
                               options=dict(draft_loops=draft, verify_loops=loops, draft_ahead=ahead, **extra))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CompatWarning)
            a, b = tl.GenerateStats(), tl.GenerateStats()
            out = tl.generate_speculative(model, prompt, sc, stats=a) if name == "speculative" else \
                tl.generate_tree_speculative(model, prompt, sc, stats=a)
            assert tl.generate(model, prompt, gc, stats=b) == out
            assert list(tl.generate_iter(model, prompt, gc)) == out[len(prompt):]
        check_stats(model, gc, prompt, out, a)
        assert (a.tokens_emitted, a.stop_reason, a.drafted_tokens, a.accepted_tokens, a.verify_forwards) == \
            (b.tokens_emitted, b.stop_reason, b.drafted_tokens, b.accepted_tokens, b.verify_forwards)


@settings(max_examples=30 * SCALE, **SETTINGS)
@given(req=requests(), data=st.data())
def test_speculative_equals_greedy_generate(model, req, data):
    prompt, cfg = req
    # speculation needs a draft depth below the verify depth (verify_loops >= 2)
    cfg = dataclasses.replace(cfg, temperature=0.0, top_k=50, top_p=1.0, sample_seed=0, loops=max(2, cfg.loops))
    base, _ = run_plain(model, prompt, cfg)
    cfg = with_stops(data, cfg, base[len(prompt):], prompt)
    draft = data.draw(st.integers(1, cfg.loops - 1), label="draft_loops")
    ahead = data.draw(st.integers(1, 4), label="draft_ahead")
    spec = dict(max_tokens=cfg.max_tokens, draft_loops=draft, verify_loops=cfg.loops, draft_ahead=ahead,
                stop_sequences=cfg.stop_sequences, cache_mode=cfg.cache_mode, cache_window=cfg.cache_window)
    if cfg.repetition_penalty != 1.0:   # compat.yaml: repetition_penalty x speculative is rejected
        spec_cfg = tl.GenerateConfig(decoder="speculative", loops=cfg.loops,
                                     repetition_penalty=cfg.repetition_penalty,
                                     options=dict(draft_loops=draft, verify_loops=cfg.loops, draft_ahead=ahead))
        rejected_before_work(model, lambda: tl.generate(model, prompt, spec_cfg))
        cfg = dataclasses.replace(cfg, repetition_penalty=1.0)   # then compare without it
    out, stats = run_plain(model, prompt, cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompatWarning)
        sst = tl.GenerateStats()
        assert tl.generate_speculative(model, prompt, tl.SpeculativeConfig(**spec), stats=sst) == out
        check_stats(model, cfg, prompt, out, sst)
        # a draft tree fits the verify pass's rows (the workspace: at most max_seq_len)
        tree = tl.TreeSpeculativeConfig(**dict(spec, draft_ahead=min(ahead, 3)),
                                        K_branches=data.draw(st.integers(1, 3), label="K"))
        if cfg.cache_window > 0:        # compat.yaml: cache_window x tree_speculative is rejected
            rejected_before_work(model, lambda: tl.generate_tree_speculative(model, prompt, tree))
        else:
            tst = tl.GenerateStats()
            assert tl.generate_tree_speculative(model, prompt, tree, stats=tst) == out
            check_stats(model, cfg, prompt, out, tst)
