"""The scoring family (tinyloop/analysis/scoring.py, docs/SCORING.md): logit lens, uncertainty and
consistency escalation against score and the float64 oracle; typed errors for bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest

import tinyloop as tl
from tinyloop.model.reference import reference_logits

from conftest import logical_weights, write_tiny

VARIANTS = [dict(), dict(n_post=0, loop_inject="none", n_loop=1)]


@pytest.fixture(scope="module", params=VARIANTS, ids=["inject_post", "plain"])
def sm(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("scoring") / "m.tinyloop"
    write_tiny(path, seed=3, **request.param)
    m = tl.load_model(str(path), max_seq_len=96, backend="cpu", prefill_chunk=8)
    m.W = logical_weights(path)
    yield m
    tl.free_model(m)


def _ids(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 97, n)]


def test_lens_rows_equal_score_and_the_oracle(sm):
    ids = _ids(21, 1)
    lens = tl.score_logit_lens(sm, ids, loops=6, cache_mode="fp32")
    assert lens.shape == (6, 21, 97) and lens.dtype == np.float32
    for d in range(1, 7):
        assert np.array_equal(lens[d - 1], tl.score(sm, ids, loops=d, cache_mode="fp32")), d
        ref = reference_logits(sm.cfg, sm.W, ids, d)
        np.testing.assert_allclose(lens[d - 1], ref, rtol=1e-4, atol=1e-4)
    sub = tl.score_logit_lens(sm, ids, loops=6, depths=[5, 2], cache_mode="fp32")
    assert np.array_equal(sub, lens[[1, 4]])
    assert np.array_equal(tl.score_logit_lens(sm, ids, loops=6, depths=np.array([2, 5]), cache_mode="fp32"), sub)
    assert np.array_equal(tl.score_logit_lens(sm, ids, loops=3)[-1], tl.score(sm, ids, loops=3))


def test_lens_top_k(sm):
    ids = _ids(17, 2)
    full = tl.score_logit_lens(sm, ids, loops=4)
    top = tl.score_logit_lens(sm, ids, loops=4, top_k=3)
    assert top.depths == [1, 2, 3, 4] and top.ids.shape == (4, 17, 3) and top.logprobs.shape == (4, 17, 3)
    z = full.astype(np.float64)
    lp = z - z.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    assert np.array_equal(top.ids[..., 0], full.argmax(-1))
    np.testing.assert_allclose(top.logprobs, np.take_along_axis(lp, top.ids, -1), rtol=1e-5, atol=1e-6)
    assert (np.diff(top.logprobs, axis=-1) <= 0).all()


def test_uncertainty_definitions(sm):
    ids = _ids(19, 3)
    L = 5
    u = tl.score_with_uncertainty(sm, ids, loops=L, cache_mode="fp32")
    lens = tl.score_logit_lens(sm, ids, loops=L, cache_mode="fp32")
    assert np.array_equal(u.logits, tl.score(sm, ids, loops=L, cache_mode="fp32"))
    ref = reference_logits(sm.cfg, sm.W, ids, L)
    p = np.exp(ref - ref.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(u.entropy, -(p * np.log(p)).sum(-1), rtol=1e-4, atol=1e-5)
    ps = np.sort(p, -1)
    np.testing.assert_allclose(u.margin, ps[:, -1] - ps[:, -2], rtol=1e-4, atol=1e-5)
    am = lens.argmax(-1)
    assert np.array_equal(u.argmax, am)
    for t in range(len(ids)):
        d = u.settled_depth[t]
        assert (am[d - 1:, t] == am[-1, t]).all() and (d == 1 or am[d - 2, t] != am[-1, t])
    lps = [np.log(np.exp(z - z.max(-1, keepdims=True)) / np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))
           for z in lens.astype(np.float64)]
    for d in range(L):
        want = (np.exp(lps[-1]) * (lps[-1] - lps[d])).sum(-1)
        np.testing.assert_allclose(u.kl_to_final[d], want, rtol=1e-4, atol=1e-6)
    assert not u.kl_to_final[-1].any()


@pytest.mark.parametrize("criterion, threshold", [("entropy", 1.5), ("margin", 0.5), ("disagreement", None),
                                                  ("entropy", 0.0), ("entropy", 1e9)])
def test_escalation_is_exact_per_position(sm, criterion, threshold):
    ids = _ids(30, 4)
    lo, hi = 2, 6
    r = tl.score_with_consistency_escalation(sm, ids, lo, hi, criterion, threshold)
    low, high = tl.score(sm, ids, loops=lo), tl.score(sm, ids, loops=hi)
    u = tl.score_with_uncertainty(sm, ids, loops=lo)
    if criterion == "entropy":
        want = u.entropy > threshold
    elif criterion == "margin":
        want = u.margin < threshold
    else:
        want = u.argmax[lo - 1] != u.argmax[lo - 2]
    assert np.array_equal(r.escalated, want)
    assert np.array_equal(r.depth, np.where(want, hi, lo))
    for t in range(len(ids)):                                  # bit for bit, position by position
        assert np.array_equal(r.logits[t], (high if want[t] else low)[t]), t
    ref = {L: reference_logits(sm.cfg, sm.W, ids, L, kv_round=np.float16) for L in (lo, hi)}
    for t in range(len(ids)):                                  # and the float64 oracle at that depth
        np.testing.assert_allclose(r.logits[t], ref[int(r.depth[t])][t], rtol=2e-3, atol=2e-3)
    last = int(np.nonzero(want)[0][-1]) + 1 if want.any() else 0
    assert r.loop_work == lo * len(ids) + (hi - lo) * last
    assert math.isclose(r.saved, 1 - r.loop_work / (hi * len(ids)))
    if threshold == 1e9:
        assert not want.any() and math.isclose(r.saved, 1 - lo / hi)


def test_scoring_leaves_no_memory_behind(sm):
    base = tl.vram_usage_bytes(sm)
    tl.score_with_consistency_escalation(sm, _ids(12), 1, 4, "entropy", 0.0)
    tl.score_logit_lens(sm, _ids(12), loops=3)
    assert tl.vram_usage_bytes(sm) == base and tl.live_handles(sm) == []


@pytest.mark.parametrize("call, exc, match", [
    (lambda m: tl.score_logit_lens(m, _ids(5), loops=3, depths=[0]), tl.ConfigError, r"depths holds 0"),
    (lambda m: tl.score_logit_lens(m, _ids(5), loops=3, depths=[4]), tl.ConfigError, r"depths holds 4"),
    (lambda m: tl.score_logit_lens(m, _ids(5), loops=3, depths=[]), tl.ConfigError, "non-empty"),
    (lambda m: tl.score_logit_lens(m, _ids(5), loops=3, depths=[2, 2]), tl.ConfigError, "twice"),
    (lambda m: tl.score_logit_lens(m, _ids(5), loops=3, depths="12"), tl.ConfigError, "depths="),
    (lambda m: tl.score_logit_lens(m, _ids(5), top_k=0), tl.ConfigError, "top_k=0"),
    (lambda m: tl.score_logit_lens(m, _ids(5), top_k=98), tl.ConfigError, "top_k=98"),
    (lambda m: tl.score_logit_lens(m, _ids(5), top_k=2.0), tl.ConfigError, "top_k=2.0"),
    (lambda m: tl.score_logit_lens(m, _ids(5), loops=9), tl.ConfigError, "loops=9"),
    (lambda m: tl.score_logit_lens(m, []), tl.InvalidInputError, "tokens_len=0"),
    (lambda m: tl.score_logit_lens("m", [1]), tl.InvalidInputError, "model must be"),
    (lambda m: tl.score_with_uncertainty(m, [1, 200]), tl.InvalidInputError, "vocabulary"),
    (lambda m: tl.score_with_consistency_escalation(m, _ids(5), 4, 4, "entropy", 1.0), tl.ConfigError,
     "loops_low=4 must be below"),
    (lambda m: tl.score_with_consistency_escalation(m, _ids(5), 2, 4, "vibes", 1.0), tl.ConfigError,
     "criterion='vibes'"),
    (lambda m: tl.score_with_consistency_escalation(m, _ids(5), 2, 4, "entropy", float("nan")), tl.ConfigError,
     "threshold=nan"),
    (lambda m: tl.score_with_consistency_escalation(m, _ids(5), 2, 4, "margin", None), tl.ConfigError,
     "threshold=None"),
    (lambda m: tl.score_with_consistency_escalation(m, _ids(5), 2, 4, "margin", -1), tl.ConfigError,
     "threshold=-1"),
    (lambda m: tl.score_with_consistency_escalation(m, _ids(5), 2, 4, "disagreement", 0.5), tl.ConfigError,
     "takes no threshold"),
    (lambda m: tl.score_with_consistency_escalation(m, _ids(5), 1, 4, "disagreement"), tl.ConfigError,
     "loops_low >= 2"),
    (lambda m: tl.score_with_consistency_escalation(m, _ids(5), 2, 99, "entropy", 1.0), tl.ConfigError,
     "loops=99"),
])
def test_bad_input(sm, call, exc, match):
    base = tl.vram_usage_bytes(sm)
    with pytest.raises(exc, match=match):
        call(sm)
    assert tl.vram_usage_bytes(sm) == base


# =============================================================================== pictures
def test_lens_command_writes_pictures(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from tinyloop.cli.main import main
    out = tmp_path / "lens.png"
    assert main(["lens", "--text", "import os\nimport sys", "--loops", "3", "--backend", "cpu", "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    unc = tmp_path / "u.svg"
    assert main(["lens", "--text", "def f(x):", "--uncertainty", "--backend", "cpu", "-o", str(unc)]) == 0
    assert b"<svg" in unc.read_bytes()[:400]


@pytest.mark.parametrize("argv, match", [
    (["--text", "x", "-o", "lens.jpg"], "must end in .png"),
    (["--text", "", "-o", "lens.png"], "--text is empty"),
    (["--text", "x " * 300, "-o", "lens.png"], "at most 256"),
    (["--text", "x", "--loops", "99", "-o", "lens.png"], "loops=99"),
])
def test_lens_command_errors(tmp_path, capsys, monkeypatch, argv, match):
    pytest.importorskip("matplotlib")
    from tinyloop.cli.main import main
    monkeypatch.chdir(tmp_path)
    assert main(["lens", "--backend", "cpu"] + argv) == 2
    assert match in capsys.readouterr().err.strip().splitlines()[-1]


def test_missing_matplotlib_is_a_typed_error_naming_the_extra(monkeypatch):
    import builtins
    from tinyloop.analysis import plots
    real = builtins.__import__

    def no_mpl(name, *a, **kw):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("no matplotlib")
        return real(name, *a, **kw)
    monkeypatch.setattr(builtins, "__import__", no_mpl)
    with pytest.raises(tl.ConfigError, match=r"pip install tinyloop\[plot\]"):
        plots._pyplot()
