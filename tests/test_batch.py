"""Lockstep batched decoding (tinyloop.runtime.lockstep): generate_batch decodes its prompts together,
every lane's tokens equal to generate of its prompt; per-lane seeds, stops, grammars and stats; the
batching contract's typed errors before any allocation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tinyloop as tl
from tinyloop.runtime import lockstep
from tinyloop.runtime.engine import DISABLE_KV_CACHE_ENV


@pytest.fixture(scope="module")
def demo():
    m = tl.load_model("demo", max_seq_len=256, backend="cpu")
    yield m
    tl.free_model(m)


TEXTS = ["Once upon a time", "The cat", "Hello there, my friend, how are", "A", "Once upon a time"]


@pytest.fixture(scope="module")
def prompts(demo):
    return [demo.tokenizer.encode(t) for t in TEXTS]


def singles(model, prompts, cfg):
    """generate of each prompt with the config lane i of a one-config batch gets."""
    return [tl.generate(model, p, dataclasses.replace(cfg, sample_seed=tl.lane_seed(cfg.sample_seed, i))
                        if cfg.sampling else cfg) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("cache_mode", ["fp16", "fp32", "int8", "int4"])
@pytest.mark.parametrize("loops", [1, 4])
def test_greedy_lanes_equal_generate(demo, prompts, cache_mode, loops):
    cfg = tl.GenerateConfig(max_tokens=12, loops=loops, cache_mode=cache_mode)
    stats = []
    out = tl.generate_batch(demo, prompts, cfg, stats=stats)
    assert out == singles(demo, prompts, cfg)
    assert [s.batch_lanes for s in stats] == [len(prompts)] * len(prompts)
    for p, o, s in zip(prompts, out, stats):
        assert s.tokens_emitted == len(o) - len(p) == 12
        assert s.stop_reason == tl.StopReason.MAX_TOKENS
        assert s.loops_used == loops and s.decoder == "greedy"
        assert s.loop_iters_run == loops * (len(p) + 11)   # every prompt row and every fed token once


def test_processors_and_stops_per_lane(demo, prompts):
    stop = (demo.tokenizer.encode(" the")[0],)
    for extra in (dict(repetition_penalty=1.3), dict(stop_sequences=(stop,))):
        cfg = tl.GenerateConfig(max_tokens=16, **extra)
        stats = []
        assert tl.generate_batch(demo, prompts, cfg, stats=stats) == singles(demo, prompts, cfg)
    assert {s.stop_reason for s in stats} == {tl.StopReason.STOP_SEQUENCE, tl.StopReason.MAX_TOKENS}
    # one config per lane: each lane its own stop sequences
    cfgs = [tl.GenerateConfig(max_tokens=16, stop_sequences=(stop,) if i % 2 else ()) for i in range(len(prompts))]
    out = tl.generate_batch(demo, prompts, cfgs)
    assert out == [tl.generate(demo, p, c) for p, c in zip(prompts, cfgs)]


def test_grammar_per_lane(demo, prompts):
    g = tl.Grammar.regex("[0-9]+")
    grammars = [g, None, {"regex": "[a-z ]+"}, None, g]
    cfg = tl.GenerateConfig(max_tokens=10, loops=3)
    out = tl.generate_batch(demo, prompts, cfg, grammars=grammars)
    assert out == [tl.generate(demo, p, dataclasses.replace(cfg, grammar=gr)) for p, gr in zip(prompts, grammars)]


def test_sampling_lanes_have_their_own_seeds(demo, prompts):
    cfg = tl.GenerateConfig(max_tokens=16, temperature=0.9, top_k=40, top_p=0.95, sample_seed=11)
    out = tl.generate_batch(demo, prompts, cfg)
    assert out == singles(demo, prompts, cfg)
    assert out[0] == tl.generate(demo, prompts[0], cfg)          # lane 0 samples with the seed itself
    assert out[0] != out[4]                                      # equal prompts, different streams
    assert tl.generate_batch(demo, prompts, cfg) == out          # reproducible
    # the caller asks for equal samples by giving the lanes their seeds
    same = tl.generate_batch(demo, [prompts[0]] * 3, [cfg] * 3)
    assert same == [tl.generate(demo, prompts[0], cfg)] * 3


def test_lane_seed_derivation():
    assert tl.lane_seed(5, 0) == 5
    assert tl.lane_seed(5, 1) == int(np.random.SeedSequence(5, spawn_key=(1,)).generate_state(1, np.uint64)[0])
    seeds = {tl.lane_seed(5, i) for i in range(64)} | {tl.lane_seed(6, i) for i in range(64)}
    assert len(seeds) == 128
    assert all(0 <= s < 2 ** 64 for s in seeds)
    assert tl.lane_seed(2 ** 64 - 1, 3) == tl.lane_seed(np.uint64(2 ** 64 - 1), np.int64(3))
    for seed, lane, match in ((-1, 1, "seed=-1"), (2 ** 64, 1, "seed="), ("5", 1, "seed='5'"), (1.0, 1, "seed=1.0"),
                              (True, 1, "seed=True"), (5, -1, "lane=-1"), (5, 1.5, "lane=1.5"), (5, None, "lane=None")):
        with pytest.raises(tl.InvalidInputError, match=match):
            tl.lane_seed(seed, lane)


def test_keep_in_place_equals_compacting(demo, prompts, monkeypatch):
    stop = (demo.tokenizer.encode(" the")[0],)
    cfg = tl.GenerateConfig(max_tokens=16, stop_sequences=(stop,))
    compacted = tl.generate_batch(demo, prompts, cfg)
    monkeypatch.setattr(lockstep.LockstepBatch, "compact", False)
    assert tl.generate_batch(demo, prompts, cfg) == compacted


def test_more_prompts_than_workspace_rows(tmp_path):
    m = tl.load_model("demo", max_seq_len=64, backend="cpu", prefill_chunk=2)   # 2 rows per launch
    try:
        ps = [[5, 6, 7], [8], [9, 10, 11, 12, 13], [14, 15], [16]]
        cfg = tl.GenerateConfig(max_tokens=6)
        stats = []
        assert tl.generate_batch(m, ps, cfg, stats=stats) == [tl.generate(m, p, cfg) for p in ps]
        assert [s.batch_lanes for s in stats] == [2, 2, 2, 2, 1]
        assert m._live_cache_bytes == 0
    finally:
        tl.free_model(m)


def test_sequential_where_lockstep_does_not_apply(demo, prompts, monkeypatch):
    """The uncached reference path and decoders without pick decode one prompt after another."""
    cfg = tl.GenerateConfig(max_tokens=6)
    want = singles(demo, prompts, cfg)
    monkeypatch.setenv(DISABLE_KV_CACHE_ENV, "1")
    stats = []
    assert tl.generate_batch(demo, prompts, cfg, stats=stats) == want
    assert [s.batch_lanes for s in stats] == [0] * len(prompts)


def test_max_tokens_zero(demo, prompts):
    stats = []
    assert tl.generate_batch(demo, prompts, tl.GenerateConfig(max_tokens=0), stats=stats) == prompts
    assert all(s.stop_reason == tl.StopReason.MAX_TOKENS and s.tokens_emitted == 0 for s in stats)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lens=st.lists(st.integers(1, 12), min_size=1, max_size=5), seed=st.integers(0, 2 ** 16),
       max_tokens=st.integers(1, 6))
def test_property_lanes_equal_generate(demo, lens, seed, max_tokens):
    rng = np.random.default_rng(seed)
    ps = [[int(t) for t in rng.integers(0, demo.vocab_size, n)] for n in lens]
    cfg = tl.GenerateConfig(max_tokens=max_tokens, loops=int(rng.integers(1, 5)))
    assert tl.generate_batch(demo, ps, cfg) == [tl.generate(demo, p, cfg) for p in ps]


# --------------------------------------------------------------------------- bad input
BAD = [
    (lambda m: tl.generate_batch(m, []), tl.InvalidInputError, "non-empty"),
    (lambda m: tl.generate_batch(m, "abc"), tl.InvalidInputError, "non-empty"),
    (lambda m: tl.generate_batch(m, [[1, 2], []]), tl.InvalidInputError, r"prompts\[1\]_len=0"),
    (lambda m: tl.generate_batch(m, [[1], [1] * 250], tl.GenerateConfig(max_tokens=10)), tl.InvalidInputError,
     r"prompts\[1\]_len \(250\) \+ max_tokens \(10\)"),
    (lambda m: tl.generate_batch(m, [[1], [99999]]), tl.InvalidInputError, r"prompts\[1\]\[0\]=99999"),
    (lambda m: tl.generate_batch(m, [[1], [2]], [tl.GenerateConfig()]), tl.InvalidInputError,
     "1 GenerateConfigs for 2 prompts"),
    (lambda m: tl.generate_batch(m, [[1], [2]], [tl.GenerateConfig(), {"max_tokens": 3}]), tl.ConfigError,
     r"config\[1\] must be a GenerateConfig"),
    (lambda m: tl.generate_batch(m, [[1], [2]], {"max_tokens": 3}), tl.ConfigError, "config must be"),
    (lambda m: tl.generate_batch(m, [[1], [2]], [tl.GenerateConfig(), tl.GenerateConfig(temperature=0.5)]),
     tl.IncompatibleModesError, r"config\[1\]\.temperature=0\.5 differs"),
    (lambda m: tl.generate_batch(m, [[1], [2]], [tl.GenerateConfig(loops=2), tl.GenerateConfig(loops=3)]),
     tl.IncompatibleModesError, r"config\[1\]\.loops=3 differs"),
    (lambda m: tl.generate_batch(m, [[1], [2]], [tl.GenerateConfig(), tl.GenerateConfig(repetition_penalty=1.2)]),
     tl.IncompatibleModesError, "repetition_penalty"),
    (lambda m: tl.generate_batch(m, [[1], [2]], tl.GenerateConfig(cache_window=8)), tl.IncompatibleModesError,
     "cache_window"),
    (lambda m: tl.generate_batch(m, [[1], [2]], tl.GenerateConfig(beam_size=2)), tl.IncompatibleModesError,
     "beam"),
    (lambda m: tl.generate_batch(m, [[1], [2]], tl.GenerateConfig(early_exit_patience=1)),
     tl.IncompatibleModesError, "early_exit"),
    (lambda m: tl.generate_batch(m, [[1], [2]], grammars=[None]), tl.InvalidInputError, "one grammar"),
    (lambda m: tl.generate_batch(m, [[1], [2]], stats={}), tl.InvalidInputError, "stats must be a list"),
    (lambda m: tl.generate_batch(object(), [[1]]), tl.InvalidInputError, "model must be"),
]


@pytest.mark.parametrize("call,exc,match", BAD)
def test_bad_input_is_refused_before_any_allocation(demo, call, exc, match):
    before = tl.vram_usage_bytes(demo)
    with pytest.raises(exc, match=match):
        call(demo)
    assert tl.vram_usage_bytes(demo) == before and demo._live_cache_bytes == 0


def test_lanes_slot_map_checks():
    from tinyloop.runtime.cache import SlotMap
    sm = SlotMap(30, lanes=3)
    assert sm.lane_slots == 10 and sm.slot(4, lane=2) == 24
    with pytest.raises(tl.PluginError):
        sm.slot(10, lane=0)
    with pytest.raises(tl.PluginError):
        sm.slot(0, lane=3)
    for bad in (dict(n_slots=30, lanes=-1), dict(n_slots=30, window=4, lanes=2), dict(n_slots=2, lanes=3)):
        with pytest.raises(tl.ConfigError):
            SlotMap(**bad)


def test_free_model_during_a_batch_ends_it_and_releases_the_model():
    """free_model called while a batch runs (here from a lane's pick) ends the batch after that step
    with ModelFreedError, releases its cache, and then the model."""
    from tinyloop.runtime.decoding import Decoder
    from tinyloop.runtime.hookspecs import hookimpl
    from tinyloop.runtime.plugins import get_plugin_manager

    m = tl.load_model("demo", max_seq_len=64, backend="cpu")

    class Freeing(Decoder):
        name = "freeing_greedy"
        lockstep = True

        def decode(self, session):
            raise AssertionError("a lockstep batch calls pick")

        def pick(self, lane):
            tl.free_model(m)
            return lane.greedy()

    class Plugin:
        @hookimpl
        def tinyloop_decoders(self):
            return [Freeing]

    with get_plugin_manager().registered(Plugin(), name="freeing-test"):
        with pytest.raises(tl.ModelFreedError, match="while this batch ran"):
            tl.generate_batch(m, [[5, 6], [7]], tl.GenerateConfig(max_tokens=8, decoder="freeing_greedy"))
    assert m._freed and m._live_cache_bytes == 0
    with pytest.raises(tl.ModelFreedError):
        tl.generate(m, [5])

