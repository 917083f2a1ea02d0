"""The auto decoder and tinyloop.calibrate: plain vs speculative chosen by measurement, cached per
depth, exact tokens either way, fallbacks for modes speculative decoding rejects."""

from __future__ import annotations

import pytest

import tinyloop as tl
from tinyloop.plugins.decoders import autotune

from conftest import write_tiny


@pytest.fixture()
def model(tmp_path):
    path = tmp_path / "m.tinyloop"
    write_tiny(path, seed=2, quant="q4", group_size=32)
    m = tl.load_model(str(path), max_seq_len=128, backend="cpu")
    yield m
    tl.free_model(m)


def test_calibrate_measures_every_candidate_and_caches(model, prompt):
    choice = tl.calibrate(model, loops=6, prompts=[prompt, prompt[:4]], max_tokens=12, min_speedup=1.0)
    assert model.decoder_choices[6] is choice
    assert choice.loops == 6
    rows = choice.results
    assert rows[0]["decoder"] == "greedy" and rows[0]["tokens_per_s"] > 0
    assert len(rows) == 1 + len(autotune.default_candidates(6))
    assert all(r["exact"] for r in rows)                       # speculative greedy is exact
    assert {r["decoder"] for r in rows} == {"greedy", "speculative", "tree_speculative"}
    best = max(rows, key=lambda r: r["tokens_per_s"])
    if choice.decoder == "greedy":
        assert best["decoder"] == "greedy"
    else:
        assert choice.config is not None and choice.speedup >= 1.0
        assert best["decoder"] == choice.decoder and best["draft_loops"] == choice.config.draft_loops
    assert choice.to_dict()["loops"] == 6


def test_threshold_keeps_plain_decoding(model, prompt):
    choice = tl.calibrate(model, loops=4, prompts=[prompt], max_tokens=8, min_speedup=1e9)
    assert choice.decoder == "greedy" and choice.config is None and choice.speedup == 1.0


@pytest.mark.parametrize("winner", ["speculative", "tree_speculative", "greedy"])
def test_auto_hands_requests_to_the_winner(model, prompt, monkeypatch, winner):
    cfgs = {"speculative": tl.SpeculativeConfig(draft_loops=2, verify_loops=5, draft_ahead=3),
            "tree_speculative": tl.TreeSpeculativeConfig(draft_loops=2, verify_loops=5, draft_ahead=2, K_branches=2),
            "greedy": None}
    model.decoder_choices[5] = autotune.DecoderChoice(5, winner, cfgs[winner], 2.0 if cfgs[winner] else 1.0)
    ref = tl.generate(model, prompt, tl.GenerateConfig(max_tokens=20, loops=5))
    st = tl.GenerateStats()
    out = tl.generate_stream(model, prompt, tl.GenerateConfig(max_tokens=20, loops=5, decoder="auto"), stats=st)
    assert out == ref
    assert (st.verify_forwards > 0) == (winner != "greedy")
    # sampling requests go to speculative sampling (reproducible per seed) or plain sampling
    scfg = tl.GenerateConfig(max_tokens=12, loops=5, decoder="auto", temperature=0.8, sample_seed=3)
    a = tl.generate(model, prompt, scfg)
    assert a == tl.generate(model, prompt, scfg) and len(a) == len(prompt) + 12
    # modes speculative decoding rejects keep their ordinary decoder
    st = tl.GenerateStats()
    rp = tl.GenerateConfig(max_tokens=10, loops=5, decoder="auto", repetition_penalty=1.3)
    assert tl.generate_stream(model, prompt, rp, stats=st) == tl.generate(
        model, prompt, tl.GenerateConfig(max_tokens=10, loops=5, repetition_penalty=1.3))
    assert st.verify_forwards == 0
    beam = tl.GenerateConfig(max_tokens=6, loops=5, decoder="auto", beam_size=2)
    assert tl.generate(model, prompt, beam) == tl.generate(model, prompt, tl.GenerateConfig(
        max_tokens=6, loops=5, beam_size=2))
    batch = tl.generate_batch(model, [prompt, prompt[:3]], tl.GenerateConfig(max_tokens=8, loops=5, decoder="auto"))
    assert batch[0] == ref[:len(prompt) + 8]


def test_auto_calibrates_on_first_use(model, prompt, monkeypatch):
    calls = []
    real = autotune.calibrate

    def spy(m, loops, **kw):
        calls.append(loops)
        return real(m, loops, prompts=[prompt[:5]], max_tokens=6, **kw)
    monkeypatch.setattr("tinyloop.plugins.decoders.auto.calibrate", spy)
    cfg = tl.GenerateConfig(max_tokens=10, decoder="auto")
    out = tl.generate(model, prompt, cfg)
    assert out == tl.generate(model, prompt, tl.GenerateConfig(max_tokens=10))
    tl.generate(model, prompt, cfg)
    assert calls == [model.cfg.default_loops]                  # cached after the first request


@pytest.mark.parametrize("kw,match", [
    (dict(min_speedup=0), "min_speedup=0"),
    (dict(max_tokens=1), "max_tokens=1"),
    (dict(prompts=[]), "at least one prompt"),
    (dict(loops=99), "loops=99"),
    (dict(candidates=[tl.SpeculativeConfig(draft_loops=1, verify_loops=3)]), "verify_loops=4"),
])
def test_calibrate_errors(model, kw, match):
    with pytest.raises(tl.TinyLoopError, match=match):
        tl.calibrate(model, **{"loops": 4, **kw})


@pytest.mark.parametrize("max_seq_len", [3, 8, 24])
def test_auto_decoder_fits_a_short_max_seq_len(max_seq_len):
    """decoder="auto" calibrates within the model's own limits (its built-in prompts cut to fit),
    or decodes plainly where no calibration run fits: a valid request is never refused."""
    m = tl.load_model("demo", backend="cpu", max_seq_len=max_seq_len)
    try:
        cfg = tl.GenerateConfig(max_tokens=2)
        st = tl.GenerateStats()
        out = tl.generate(m, [5], tl.GenerateConfig(max_tokens=2, decoder="auto"), stats=st)
        assert out == tl.generate(m, [5], cfg) and st.decoder in ("greedy", "speculative", "tree_speculative")
    finally:
        tl.free_model(m)


def test_calibrate_rejects_bad_thresholds(tiny_model):
    for bad in (float("nan"), float("inf"), 0, -1.0, "2", True):
        with pytest.raises(tl.ConfigError, match="min_speedup"):
            tl.calibrate(tiny_model, min_speedup=bad)
