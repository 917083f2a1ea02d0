"""Loop gain (tinyloop.analysis.loopgain, ``tinyloop inspect --measure``): per-iteration residuals against
the float64 oracle, logits at every depth bit-identical to tl.score, the statistics, and the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

import tinyloop as tl
from tinyloop.cli.main import main as cli_main
from tinyloop.cli.synth import synth_model
from tinyloop.errors import InvalidInputError, ModelBusyError
from tinyloop.analysis.loopgain import (default_max_loops, format_table, measure_loop_gain,
                                    sample_token_ids, trace_loop)
from tinyloop.model.reference import reference_logits, reference_loop_residuals
from tinyloop.model.tokenizer import byte_to_unicode

from conftest import logical_weights, write_tiny

IDS = [int(t) for t in np.random.default_rng(7).integers(0, 97, 37)]


def rel_err(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module", params=["add", "none"])
def tiny(request, tmp_path_factory):
    """(path, cfg, model) with a small prefill chunk so that a trace is split into several launches."""
    path = tmp_path_factory.mktemp("lg") / f"tiny_{request.param}.tinyloop"
    cfg = write_tiny(path, seed=2, loop_inject=request.param)
    m = tl.load_model(str(path), max_seq_len=64, backend="cpu", prefill_chunk=16)
    yield path, cfg, m
    tl.free_model(m)


@pytest.mark.parametrize("cache_mode,kv_round,tol", [("fp32", None, 1e-4), ("fp16", np.float16, 2e-3)])
def test_residuals_match_float64_reference(tiny, cache_mode, kv_round, tol):
    path, cfg, m = tiny
    W = logical_weights(path)
    res, logits = trace_loop(m, IDS, 6, cache_mode=cache_mode)
    assert res.shape == (7, len(IDS), cfg.d_model) and logits.shape == (6, len(IDS), cfg.vocab_size)
    ref = reference_loop_residuals(cfg, W, IDS, 6, kv_round=kv_round)
    for k in range(7):
        assert rel_err(res[k], ref[k]) < tol, k
    for L in (1, 6):
        assert rel_err(logits[L - 1], reference_logits(cfg, W, IDS, L, kv_round=kv_round)) < tol


def test_reference_residuals_end_where_reference_hidden_continues(tiny):
    path, cfg, _ = tiny
    W = logical_weights(path)
    from tinyloop.model.reference import reference_hidden
    no_post = cfg.__class__(**{**cfg.to_dict(), "n_post": 0})
    assert np.array_equal(reference_loop_residuals(cfg, W, IDS, 3)[-1], reference_hidden(no_post, W, IDS, 3))


@pytest.mark.parametrize("cache_mode", ["fp16", "fp32"])
def test_logits_at_every_depth_equal_score(tiny, cache_mode):
    _, _, m = tiny
    _, logits = trace_loop(m, IDS, 8, cache_mode=cache_mode)       # 8 = max_loops
    for L in range(1, 9):
        assert np.array_equal(logits[L - 1], tl.score(m, IDS, loops=L, cache_mode=cache_mode)), L


def test_measure_statistics(tiny):
    _, cfg, m = tiny
    r = measure_loop_gain(m, IDS, window=16, max_windows=4)
    Lmax = default_max_loops(cfg)
    assert Lmax == min(2 * cfg.default_loops, cfg.max_loops) == r["max_loops"] == 6
    assert r["windows"] == 2 and r["window"] == 16 and r["positions"] == 32   # 37 ids: 2 whole windows
    its = r["iterations"]
    assert [it["k"] for it in its] == list(range(Lmax + 1))
    assert its[0]["step"] is None and its[-1]["beta"] is None
    betas = [it["beta"] for it in its[1:-1]]
    assert all(np.isfinite(b) and b > 0 for b in betas)
    assert all(np.isfinite(it["dir_beta"]) and it["dir_beta"] > 0 for it in its[1:-1])
    assert r["beta_mean"] == pytest.approx(np.mean(betas))
    assert r["beta_geomean"] == pytest.approx((its[-1]["step"] / its[1]["step"]) ** (1 / (Lmax - 1)))
    assert r["regime"] == ("contracting" if r["beta_mean"] < 1 else "diverging")

    # the step sizes, recomputed from the traces: mean over positions of the per-position L2 norm
    traces = [trace_loop(m, IDS[w * 16:(w + 1) * 16], Lmax) for w in range(2)]
    diffs = np.concatenate([np.diff(res.astype(np.float64), axis=0) for res, _ in traces], axis=1)
    steps = np.linalg.norm(diffs, axis=2).mean(axis=1)
    assert [it["step"] for it in its[1:]] == pytest.approx(list(steps), rel=1e-12)

    d = r["depths"]
    assert [x["loops"] for x in d] == list(range(1, Lmax + 1))
    assert d[-1]["top1"] == 1.0 and d[-1]["kl"] == pytest.approx(0, abs=1e-12) and d[-1]["tv"] == \
        pytest.approx(0, abs=1e-12)
    for x in d:
        assert 0 <= x["top1"] <= 1 and x["kl"] >= -1e-12 and 0 <= x["tv"] <= 1 and np.isfinite(x["nll"])
    # top-1 agreement at depth 1, recomputed
    agree = np.mean(np.concatenate([np.argmax(lg[0], 1) == np.argmax(lg[-1], 1) for _, lg in traces]))
    assert d[0]["top1"] == pytest.approx(agree)
    json.dumps(r)
    assert any("beta mean" in line for line in format_table(r))


def test_measure_short_ids_and_validation(tiny):
    _, _, m = tiny
    r = measure_loop_gain(m, IDS[:5], max_loops=2)
    assert r["windows"] == 1 and r["positions"] == 5 and r["max_loops"] == 2
    r1 = measure_loop_gain(m, IDS[:5], max_loops=1)
    assert r1["beta_mean"] is None and r1["iterations"][1]["beta"] is None
    with pytest.raises(tl.ConfigError, match="loops=9"):
        measure_loop_gain(m, IDS, max_loops=9)
    with pytest.raises(InvalidInputError):
        measure_loop_gain(m, [3, 200])
    assert measure_loop_gain(m, IDS, window=1000)["window"] == 37   # clamped to max_seq_len, one window


def test_trace_respects_the_model_lock(tiny):
    _, _, m = tiny
    with m._lock:
        with pytest.raises(ModelBusyError):
            trace_loop(m, IDS, 2)
    assert m._live_cache_bytes == 0
    trace_loop(m, IDS, 2)                          # the lock was not taken over
    assert not m._lock.locked()


def test_sample_ids_without_tokenizer_are_seeded_random(tiny):
    _, cfg, m = tiny
    a, src = sample_token_ids(m, n_tokens=50)
    assert a == sample_token_ids(m, n_tokens=50)[0] and len(a) == 50 and "random" in src
    assert all(0 <= t < cfg.vocab_size for t in a)


# ------------------------------------------------------------------------------ CLI and tl.inspect
def run_cli(capsys, *argv):
    rc = cli_main(["inspect", *[str(a) for a in argv]])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_measure_json_and_text(tiny, capsys):
    path = tiny[0]
    rc, out, err = run_cli(capsys, path, "--measure", "--json", "--loops-max", "4", "--window", "16",
                           "--max-windows", "2")
    assert rc == 0, err
    d = json.loads(out)
    lg = d["loop_gain"]
    assert lg["max_loops"] == 4 and lg["windows"] == 2 and lg["window"] == 16 and lg["backend"] == "cpu"
    assert lg["sample"].startswith("32 random token ids")
    assert np.isfinite(lg["beta_mean"]) and lg["beta_mean"] > 0
    assert d["config"]["loop_inject"] == lg["loop_inject"]
    rc, out, err = run_cli(capsys, path, "--measure", "--loops-max", "3", "--window", "16", "--max-windows", "1")
    assert rc == 0, err
    for word in ("loop gain (cpu", "beta_k", "beta mean", "top1@3", "KL"):
        assert word in out
    rc, out, _ = run_cli(capsys, path)
    assert rc == 0 and "loop gain" not in out


def test_cli_measure_errors(tiny, tmp_path, capsys):
    path = tiny[0]
    rc, _, err = run_cli(capsys, path, "--measure", "--loops-max", "99")
    assert rc == 2 and "--loops-max=99" in err
    rc, _, err = run_cli(capsys, path, "--loops-max", "3")
    assert rc == 2 and "--measure" in err
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x\n")
    rc, _, err = run_cli(capsys, path, "--measure", "--text", text)        # vocab 97, no tokenizer
    assert rc == 2 and "tokenizer" in err
    rc, _, err = run_cli(capsys, path, "--measure", "--text", tmp_path / "missing.txt")
    assert rc == 2 and err.startswith("error: ")


def test_cli_measure_text_with_embedded_tokenizer(tmp_path, capsys):
    alphabet = byte_to_unicode()
    tok = {"type": "bpe", "vocab": {alphabet[b]: b for b in range(256)}, "merges": []}
    path = tmp_path / "tok.tinyloop"
    synth_model("tiny", path, tokenizer=tok)
    text = tmp_path / "t.txt"
    text.write_text("import os\n\nprint(os.getcwd())\n")      # no merges: one token per byte
    rc, out, err = run_cli(capsys, path, "--measure", "--json", "--text", text, "--loops-max", "3")
    assert rc == 0, err
    lg = json.loads(out)["loop_gain"]
    assert lg["sample"] == str(text) and lg["positions"] == len(text.read_bytes()) and lg["windows"] == 1


def test_tl_inspect_measure(tiny):
    path, cfg, _ = tiny
    d = tl.inspect(str(path), measure=True)
    assert d["loop_gain"]["max_loops"] == default_max_loops(cfg)
    assert "loop_gain" not in tl.inspect(str(path))
