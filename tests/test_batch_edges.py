"""Edges of lockstep batching (generate_batch) a demanding user meets: equivalent settings are not
"divergent", a lane's own config error names the lane, a grammar is never silently dropped, a reused
stats list describes the last call, numpy batches of prompts, the batch's own window hint; and
per-lane stats against generate's for lanes that stop at different times."""

from __future__ import annotations

import numpy as np
import pytest

import tinyloop as tl
from conftest import write_tiny


@pytest.fixture(scope="module")
def demo():
    m = tl.load_model("demo", max_seq_len=96, backend="cpu")
    yield m
    tl.free_model(m)


G = tl.GenerateConfig


def _no_alloc(m):
    assert m._live_cache_bytes == 0


# ------------------------------------------------------------------ equivalent shared settings
@pytest.mark.parametrize("a,b", [
    (dict(), dict(loops=4)),                       # None is the model's default_loops (4)
    (dict(temperature=0.0), dict(temperature=0.005)),   # both greedy (<= 0.01)
    (dict(), dict(beam_size=1)),                   # 0 and 1 are both ordinary decoding
    (dict(), dict(decoder="greedy")),              # the automatic choice, named
])
def test_equivalent_shared_settings_are_not_divergent(demo, a, b):
    ps = [[5, 6, 7], [8]]
    cfgs = [G(max_tokens=4, **a), G(max_tokens=4, **b)]
    st = []
    assert tl.generate_batch(demo, ps, cfgs, stats=st) == [tl.generate(demo, p, c) for p, c in zip(ps, cfgs)]
    assert [s.batch_lanes for s in st] == [2, 2]


def test_really_divergent_settings_are_still_refused(demo):
    with pytest.raises(tl.IncompatibleModesError, match=r"config\[1\]\.loops=3 differs"):
        tl.generate_batch(demo, [[5], [6]], [G(max_tokens=2), G(max_tokens=2, loops=3)])
    with pytest.raises(tl.IncompatibleModesError, match=r"config\[1\]\.temperature=0\.5 differs"):
        tl.generate_batch(demo, [[5], [6]], [G(max_tokens=2, temperature=0.005), G(max_tokens=2, temperature=0.5)])
    _no_alloc(demo)


# ------------------------------------------------------------------ a lane's own error names the lane
@pytest.mark.parametrize("bad,exc,match", [
    (G(max_tokens=2, stop_sequences=[[99999]]), tl.InvalidInputError, r"lane 2\b.*stop_sequences\[0\] holds 99999"),
    (G(max_tokens=2, sample_seed=7), tl.IncompatibleModesError, r"lane 2\b.*sample_seed=7"),
])
def test_a_lane_config_error_names_the_lane(demo, bad, exc, match):
    cfgs = [G(max_tokens=2), G(max_tokens=2), bad]
    with pytest.raises(exc, match=match):
        tl.generate_batch(demo, [[5], [6], [7]], cfgs)
    _no_alloc(demo)


# ------------------------------------------------------------------ grammars= never drops a grammar
@pytest.mark.parametrize("config", [
    G(max_tokens=3, grammar={"regex": "[0-9]+"}),
    [G(max_tokens=3, grammar={"regex": "[0-9]+"}), G(max_tokens=3)],
])
def test_grammars_with_a_config_grammar_is_refused(demo, config):
    pytest.importorskip("llguidance")
    with pytest.raises(tl.InvalidInputError, match=r"grammar.*grammars="):
        tl.generate_batch(demo, [[5], [6]], config, grammars=[None, None])
    _no_alloc(demo)


# ------------------------------------------------------------------ a reused stats list
def test_a_reused_stats_list_describes_the_last_call(demo):
    st = []
    tl.generate_batch(demo, [[5], [6], [7]], G(max_tokens=3), stats=st)
    first = list(st)
    assert len(st) == 3
    tl.generate_batch(demo, [[5, 6], [7]], G(max_tokens=2), stats=st)
    assert len(st) == 2 and [s.tokens_emitted for s in st] == [2, 2]
    assert all(s is not f for s in st for f in first)
    assert [s.tokens_emitted for s in first] == [3, 3, 3]      # the earlier call's objects keep its values


# ------------------------------------------------------------------ numpy batches of prompts
def test_a_2d_numpy_array_is_a_batch_of_equal_length_prompts(demo):
    arr = np.array([[5, 6, 7], [8, 9, 10]], dtype=np.int32)
    cfg = G(max_tokens=3)
    assert tl.generate_batch(demo, arr, cfg) == [tl.generate(demo, list(r), cfg) for r in arr]
    ragged = np.empty(2, dtype=object)
    ragged[0], ragged[1] = np.array([5, 6]), [7]
    assert tl.generate_batch(demo, ragged, cfg) == [tl.generate(demo, [5, 6], cfg), tl.generate(demo, [7], cfg)]


@pytest.mark.parametrize("prompts,match", [
    (np.array([5, 6, 7]), r"one prompt.*\[prompt\]"),
    ([5, 6, 7], r"one prompt.*\[prompt\]"),
    (np.zeros((2, 0), dtype=np.int64), r"prompts\[0\]_len=0"),
    (np.zeros((2, 2, 2), dtype=np.int64), r"shape \(2, 2, 2\)"),
    (np.array([[1.0, 2.0]]), r"float64"),
    ((p for p in [[5]]), r"got generator"),
])
def test_bad_batches_of_prompts_say_what_is_wrong(demo, prompts, match):
    with pytest.raises(tl.InvalidInputError, match=match):
        tl.generate_batch(demo, prompts, G(max_tokens=2))
    _no_alloc(demo)


# ------------------------------------------------------------------ a sliding-window model in a batch
def test_the_window_hint_of_a_batch_does_not_suggest_cache_window(tmp_path):
    write_tiny(tmp_path / "sw.tinyloop", sliding_window=8)
    m = tl.load_model(str(tmp_path / "sw.tinyloop"), max_seq_len=64, backend="cpu")
    try:
        with pytest.raises(tl.IncompatibleModesError, match=r"sliding_window=8") as ei:
            tl.generate_batch(m, [[1, 2], [3, 4, 5, 6, 7, 8, 9]], G(max_tokens=4))
        assert "set cache_window" not in str(ei.value)
        assert "prompts[1]" in str(ei.value)
        ps = [[1, 2], [3, 4, 5]]                    # inside the window: decodes as generate does
        assert tl.generate_batch(m, ps, G(max_tokens=4)) == [tl.generate(m, p, G(max_tokens=4)) for p in ps]
    finally:
        tl.free_model(m)


# ------------------------------------------------------------------ per-lane stats, lanes stopping apart
def test_lanes_stopping_at_different_times_have_generates_stats(demo):
    """EOS (a finished grammar), a stop sequence, max_tokens, a one-token prompt, a long prompt and
    a duplicated prompt in one batch: each lane's tokens, stop reason, count and depth are those of
    generate of its prompt."""
    pytest.importorskip("llguidance")
    tok = demo.tokenizer
    long = tok.encode("Once upon a time there was a little girl who lived in a village near the forest")
    ps = [tok.encode("The answer is"), [tok.encode("x")[0]], long, long, tok.encode("The cat")]
    base = G(max_tokens=16, loops=3)
    free = tl.generate(demo, ps[4], base)[len(ps[4]):]
    cfgs = [base.replace(grammar={"regex": "[0-9]{2}"}), base, base, base, base.replace(stop_sequences=[free[3:5]])]
    st = []
    out = tl.generate_batch(demo, ps, cfgs, stats=st)
    reasons = []
    for p, c, o, s in zip(ps, cfgs, out, st):
        one = tl.GenerateStats()
        assert o == tl.generate(demo, p, c, stats=one)
        assert (s.tokens_emitted, s.stop_reason, s.loops_used, s.decoder) == \
               (one.tokens_emitted, one.stop_reason, one.loops_used, one.decoder)
        assert s.tokens_emitted == len(o) - len(p) and s.batch_lanes == len(ps)
        reasons.append(s.stop_reason)
    assert reasons[0] == tl.StopReason.EOS and reasons[4] == tl.StopReason.STOP_SEQUENCE
    assert reasons[1] == tl.StopReason.MAX_TOKENS and out[2] == out[3]


# ------------------------------------------------------------------ timing fields in their order
@pytest.mark.parametrize("cfg", [G(max_tokens=3), G(max_tokens=3, temperature=0.9, sample_seed=2)])
def test_a_lanes_prefill_ends_before_its_first_token(demo, cfg):
    """prefill_ms (prompt -> first-token logits) is measured before first_token_ms (call entry ->
    first emitted token), as in generate: an order, not a timing."""
    st = []
    tl.generate_batch(demo, [[5, 6, 7], [8], [9, 10]], cfg, stats=st)
    for s in st:
        assert 0 < s.prefill_ms <= s.first_token_ms


# ------------------------------------------------------------------ a lane's index is its prompt's
def _lockstep_plugin(name, pick):
    from tinyloop.runtime.decoding import Decoder
    from tinyloop.runtime.hookspecs import hookimpl

    class Recording(Decoder):
        lockstep = True

        def decode(self, session):
            raise AssertionError("a lockstep batch calls pick")
    Recording.name = name
    Recording.pick = lambda self, lane: pick(lane)

    class Plugin:
        @hookimpl
        def tinyloop_decoders(self):
            return [Recording]
    return Plugin()


def test_lane_index_is_the_prompts_index_past_the_first_lockstep_group():
    """More prompts than the workspace's rows run as several lockstep batches; LaneView.index (and
    a plugin error) still name the lane's place among the call's prompts."""
    from tinyloop.runtime.plugins import get_plugin_manager
    m = tl.load_model("demo", max_seq_len=64, backend="cpu", prefill_chunk=2)   # 2 lanes per batch
    seen = set()

    def pick(lane):
        seen.add(lane.index)
        return lane.greedy() if lane.index != 3 else -1
    try:
        with get_plugin_manager().registered(_lockstep_plugin("index_greedy", pick), name="index-test"):
            with pytest.raises(tl.PluginError, match=r"picked -1 for lane 3\b"):
                tl.generate_batch(m, [[5], [6], [7], [8], [9]], G(max_tokens=2, decoder="index_greedy"))
        assert seen == {0, 1, 2, 3}
        assert m._live_cache_bytes == 0
    finally:
        tl.free_model(m)


def test_max_tokens_zero_allocates_no_lane_cache(demo, monkeypatch):
    """Nothing to decode, nothing allocated (generate allocates nothing either): a batch of long
    prompts at max_tokens=0 cannot fail for memory."""
    def no_alloc(spec):
        raise AssertionError("a cache was allocated for max_tokens=0")
    monkeypatch.setattr(demo.backend, "alloc_cache", no_alloc)
    st = []
    ps = [[5] * 90, [6]]
    assert tl.generate_batch(demo, ps, G(max_tokens=0), stats=st) == ps
    assert [(s.tokens_emitted, s.stop_reason, s.loops_used) for s in st] == [(0, tl.StopReason.MAX_TOKENS, 4)] * 2
    assert tl.generate(demo, ps[1], G(max_tokens=0)) == ps[1]
