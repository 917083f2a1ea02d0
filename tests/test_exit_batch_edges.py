"""Edges of early exit and lockstep batching a demanding user meets: a GenerateStats passed to a
second call describes that call alone, bool token ids are refused like other non-ids, the run
config names the shipped exit-trained model as load_model does, and the early-exit host path's
replay keys name the op sequence they stand for (a graph backend replays what it captured)."""

from __future__ import annotations

import pytest

import tinyloop as tl
from tinyloop.cli.main import main


@pytest.fixture(scope="module")
def demo():
    m = tl.load_model("demo", max_seq_len=64, backend="cpu")
    yield m
    tl.free_model(m)


def exit_cfg(**kw):
    return tl.GenerateConfig(early_exit_patience=1, early_exit_criterion="kl", early_exit_threshold=0.05, **kw)


# ------------------------------------------------------------------ stats describe one call
def test_a_reused_stats_object_describes_only_the_last_call(demo):
    p = [5, 6, 7]
    st = tl.GenerateStats()
    tl.generate(demo, p, exit_cfg(max_tokens=6), stats=st)
    assert len(st.token_loops) == st.tokens_emitted == 6 and st.exit_probes > 0
    # the same object, a fixed-depth request: no depths, no probes of the earlier call
    fresh = tl.GenerateStats()
    tl.generate(demo, p, tl.GenerateConfig(max_tokens=3), stats=fresh)
    tl.generate(demo, p, tl.GenerateConfig(max_tokens=3), stats=st)
    assert st.token_loops == [] and st.exit_probes == 0 and st.loops_used == 4
    assert st.loop_iters_run == fresh.loop_iters_run
    # ... and an early-exit request again: one depth per emitted token, their mean
    once = tl.GenerateStats()
    tl.generate(demo, p, exit_cfg(max_tokens=5), stats=once)
    tl.generate(demo, p, exit_cfg(max_tokens=5), stats=st)
    assert st.token_loops == once.token_loops and len(st.token_loops) == st.tokens_emitted == 5
    assert st.loops_used == once.loops_used and st.exit_probes == once.exit_probes
    assert st.loop_iters_run == once.loop_iters_run


def test_score_decoded_with_a_reused_stats_object(demo):
    ids = [5, 6, 7, 8, 9, 10]
    once, st = tl.GenerateStats(), tl.GenerateStats()
    tl.score_decoded(demo, ids, exit_cfg(), stats=once)
    tl.score_decoded(demo, ids, exit_cfg(), stats=st)
    tl.score_decoded(demo, ids, exit_cfg(), stats=st)
    assert st.token_loops == once.token_loops and len(st.token_loops) == len(ids)
    assert st.loops_used == once.loops_used and st.exit_probes == once.exit_probes


# ------------------------------------------------------------------ bools are not token ids
@pytest.mark.parametrize("call,match", [
    (lambda m: tl.generate_batch(m, [[5, 6], [7, True]], tl.GenerateConfig(max_tokens=2)), r"prompts\[1\]\[1\]=True"),
    (lambda m: tl.generate(m, [False, 5], tl.GenerateConfig(max_tokens=2)), r"prompt\[0\]=False"),
    (lambda m: tl.score_decoded(m, [5, True]), r"tokens\[1\]=True"),
])
def test_bool_token_ids_are_refused(demo, call, match):
    with pytest.raises(tl.InvalidInputError, match=match):
        call(demo)
    assert demo._live_cache_bytes == 0


# ------------------------------------------------------------------ the run config names shipped models
def test_run_config_takes_the_shipped_exit_model_by_name(tmp_path, capsys):
    cfg = tmp_path / "gate.yaml"
    cfg.write_text("model: demo-exit\nbackend: cpu\nmax_seq_len: 32\nprompts: [\"def f(x):\"]\nstream: false\n"
                   "generate: {max_tokens: 3, early_exit_patience: 1, early_exit_min_L: 1, "
                   "early_exit_criterion: gate, early_exit_threshold: 0.9}\n")
    assert main(["run", str(cfg)]) == 0
    err = capsys.readouterr().err
    assert "demo-exit.tinyloop on cpu" in err and "early exit" in err


# ------------------------------------------------------------------ replay keys name their ops
def test_host_probe_replay_keys_name_the_kv_policy(demo, monkeypatch):
    """Backend.replay captures `fn` under `key` on first use and replays that capture afterwards, and
    a graph backend hands a released cache (its graphs kept) to the next request of the same spec.
    So one key must always stand for one op sequence: the early-exit host path's K/V fill of
    copy_last and of recompute must not share a key on the same cache."""
    be = demo.backend
    caps = be.capabilities
    monkeypatch.setattr(type(be), "capabilities", property(lambda self: caps - {"guarded_steps"}))
    spares = {}
    real_alloc, real_replay = be.alloc_cache, be.replay

    def alloc_cache(spec):
        return spares.pop(spec, None) or real_alloc(spec)

    def release_cache(cache):
        spares[cache.spec] = cache

    codes = {}

    def replay(key, fn, step=True):
        codes.setdefault(key, set()).add(fn.__code__)
        real_replay(key, fn, step=step)
    monkeypatch.setattr(be, "alloc_cache", alloc_cache)
    monkeypatch.setattr(be, "release_cache", release_cache)
    monkeypatch.setattr(be, "replay", replay)
    p = demo.tokenizer.encode("The little dog")
    depths = []
    for kv in ("copy_last", "recompute"):
        st = tl.GenerateStats()
        tl.generate(demo, p, exit_cfg(max_tokens=12, early_exit_kv=kv), stats=st)
        depths.append(min(st.token_loops))
    assert max(depths) < 4                          # both requests exited early, so both filled K/V
    shared = {k: v for k, v in codes.items() if len(v) > 1}
    assert not shared, f"replay keys standing for more than one op sequence: {list(shared)}"


# ------------------------------------------------------------------ a patience no schedule reaches
@pytest.mark.parametrize("patience, min_L, peek, loops", [(3, 2, 1, 4), (2, 1, 3, 4), (2, 3, 1, 4)])
def test_unreachable_patience_is_refused(demo, patience, min_L, peek, loops):
    """Probes at min_L, min_L + peek, ... below loops: a patience above their count could never
    exit (the knob would be silently ignored), so it is refused before any work."""
    cfg = tl.GenerateConfig(max_tokens=3, loops=loops, early_exit_patience=patience, early_exit_min_L=min_L,
                            early_exit_peek_every=peek, early_exit_criterion="kl", early_exit_threshold=0.05)
    with pytest.raises(tl.ConfigError, match=f"early_exit_patience={patience} can never be reached"):
        tl.generate(demo, [5, 6, 7], cfg)


def test_a_kept_token_loops_list_keeps_its_call(demo):
    st = tl.GenerateStats()
    tl.generate(demo, [5, 6, 7], exit_cfg(max_tokens=4), stats=st)
    kept = st.token_loops
    assert len(kept) == 4
    tl.generate(demo, [5, 6, 7], tl.GenerateConfig(max_tokens=2), stats=st)
    assert len(kept) == 4 and st.token_loops == []


# ------------------------------------------------------------------ a stopped lane's own timing
def test_a_lane_that_stops_early_reports_its_own_decode_time(demo, monkeypatch):
    """decode_ms of a lane that stopped ends at its stop, not at the batch's last step. The clock
    advances one second per lockstep step, so the comparison is exact, not a timing."""
    from tinyloop.runtime import lockstep
    now = [0.0]
    step = lockstep.LockstepBatch._step

    def ticking_step(self, running):
        now[0] += 1.0
        return step(self, running)
    monkeypatch.setattr(lockstep.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(lockstep.LockstepBatch, "_step", ticking_step)
    p = [5, 6, 7]
    want = tl.generate(demo, p, tl.GenerateConfig(max_tokens=2))
    stop = [want[len(p) + 1]]                      # lane 0 stops at its second token
    cfgs = [tl.GenerateConfig(max_tokens=12, stop_sequences=[stop]), tl.GenerateConfig(max_tokens=12)]
    st = []
    out = tl.generate_batch(demo, [p, p], cfgs, stats=st)
    assert len(out[0]) < len(out[1])
    assert 0 < st[0].decode_ms < st[1].decode_ms and st[0].decode_ms <= 2000.0
