"""Scoring and perplexity against an independent computation from transformers' own forward
(docs/SCORING.md, "Perplexity"): tiny random Llama (with a BOS id), Qwen2 (without) and Mistral
(sliding window 6) checkpoints written by ``save_pretrained``, converted with ``convert_hf`` at
f32 (one layer: L = 1) and loaded on the CPU. The oracle is log_softmax of transformers' fp32
logits with shifted labels; windows, BOS and token counts are recomputed here from the definition,
not from tinyloop's code. Edge cases of ``tinyloop ppl`` must be typed errors or documented
results, never tracebacks. Needs torch and transformers; skipped without them."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tinyloop as tl  # noqa: E402
from tinyloop.analysis.evaluate import decoded_perplexity, perplexity  # noqa: E402
from tinyloop.cli.convert import convert_hf  # noqa: E402
from tinyloop.cli.main import main  # noqa: E402

from test_hf_import import _make, _save  # noqa: E402

W = 6                                            # Mistral's sliding window
BOS = 1                                          # Llama's BOS id (Qwen2 and Mistral have none)
TEXT = "def add(a, b):\n    return a + b  # a text longer than every window below\n"
MODES = ("fp32", "fp16", "int8", "int4")


def _lsm(z) -> np.ndarray:
    z = np.asarray(z, np.float64)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def _hf_logprobs(ref, ids) -> np.ndarray:
    """log_softmax of transformers' fp32 logits: row t is the distribution of ids[t + 1]."""
    with torch.no_grad():
        return _lsm(ref(torch.tensor([ids])).logits[0].double().numpy())


def _hf_nll(ref, ids) -> np.ndarray:
    """Per-token NLL of ids[1:] (labels shifted by one), as transformers' loss computes it."""
    lp = _hf_logprobs(ref, ids)
    return -lp[np.arange(len(ids) - 1), ids[1:]]


def _text_ids(text: str, bos) -> list:
    """The text as the converted models' byte tokenizer encodes it, after BOS when there is one."""
    return ([bos] if bos is not None else []) + list(text.encode("utf-8"))


def _ref_ppl(ref, ids, window, max_windows=None):
    """Perplexity by the documented definition: non-overlapping windows of `window` tokens from
    the start, each scored alone, every token after a window's first predicted from the tokens
    before it in that window; a tail shorter than a window is not scored."""
    n = len(ids) // window if max_windows is None else min(len(ids) // window, max_windows)
    nll = np.concatenate([_hf_nll(ref, ids[w * window:(w + 1) * window]) for w in range(n)])
    return math.exp(nll.mean()), nll.mean(), len(nll), n


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_scoring")
    out = {}
    for i, (kind, over) in enumerate((("llama", dict(bos_token_id=BOS)), ("qwen2", {}),
                                      ("mistral", dict(sliding_window=W)))):
        m = _make(kind, seed=10 + i, num_hidden_layers=1, **over)
        path = str(root / f"{kind}.tinyloop")
        convert_hf(_save(m, root / kind), path, quant="f32")
        model = tl.load_model(path, backend="cpu", max_seq_len=128)
        out[kind] = (m, model, path)
    yield out
    for _, model, _ in out.values():
        tl.free_model(model)


@pytest.fixture(scope="module")
def hot(tmp_path_factory):
    """A checkpoint whose logits are huge (head scaled by 200): mean NLL far beyond log(float max)."""
    root = tmp_path_factory.mktemp("hf_hot")
    m = _make("llama", seed=2, num_hidden_layers=1)
    with torch.no_grad():
        m.lm_head.weight.mul_(200.0)
    path = str(root / "hot.tinyloop")
    convert_hf(_save(m, root / "hot"), path, quant="f32")
    return path


# ---------------------------------------------------------------- per-token log-probabilities
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_token_logprobs_equal_transformers(hf, kind):
    ref, model, _ = hf[kind]
    assert (model.cfg.n_pre, model.cfg.n_loop, model.cfg.n_post, model.cfg.default_loops) == (0, 1, 0, 1)
    ids = [int(t) for t in np.random.default_rng(1).integers(0, 320, 40)]
    short = ids[:W] if kind == "mistral" else ids           # score keeps no window cache
    want = _hf_logprobs(ref, short)
    got = tl.score(model, short, cache_mode="fp32")
    tol = 1e-4 * np.abs(want).max()
    assert np.abs(_lsm(got) - want).max() <= tol
    nll = -_lsm(got)[np.arange(len(short) - 1), short[1:]]
    np.testing.assert_allclose(nll, _hf_nll(ref, short), atol=tol, rtol=0)
    if kind == "mistral":                                   # past the window: the windowed decode steps
        dec = tl.score_decoded(model, ids, tl.GenerateConfig(cache_mode="fp32", cache_window=W))
        assert np.abs(_lsm(dec) - _hf_logprobs(ref, ids)).max() <= tol


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_scoring_calls_agree_bit_for_bit_in_every_cache_mode(hf, kind):
    """score_decoded equals score at a fixed depth (docs/ARCHITECTURE.md), score_last_token its last
    row and the lens' last depth score itself, in every cache mode, chunked or not; fp32 is the
    exact mode (relative error < 1e-4 against transformers)."""
    ref, model, path = hf[kind]
    ids = [int(t) for t in np.random.default_rng(2).integers(0, 320, 21)]
    chunked = tl.load_model(path, backend="cpu", max_seq_len=128, prefill_chunk=4)
    try:
        for mode in MODES:
            s = tl.score(model, ids, cache_mode=mode)
            assert np.array_equal(tl.score(chunked, ids, cache_mode=mode), s), mode
            assert np.array_equal(tl.score_decoded(model, ids, tl.GenerateConfig(cache_mode=mode)), s), mode
            assert np.array_equal(tl.score_last_token(model, ids, cache_mode=mode), s[-1]), mode
            assert np.array_equal(tl.score_logit_lens(model, ids, cache_mode=mode)[-1], s), mode
    finally:
        tl.free_model(chunked)
    want = _hf_logprobs(ref, ids)
    assert np.abs(_lsm(tl.score(model, ids, cache_mode="fp32")) - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_text_is_scored_after_bos_so_its_first_token_is_predicted(hf, kind):
    """Row t of score predicts token t + 1; nothing predicts the first id. A str starts a sequence:
    with a BOS id the text's first token is predicted from BOS, without one it is context only."""
    ref, model, _ = hf[kind]
    bos = BOS if kind == "llama" else None
    assert model.cfg.bos_id == bos
    ids = _text_ids("hello", bos)
    got = tl.score(model, "hello", cache_mode="fp32")
    assert got.shape == (len(ids), 320)
    want = _hf_logprobs(ref, ids)
    assert np.abs(_lsm(got) - want).max() <= 1e-4 * np.abs(want).max()
    assert np.array_equal(tl.score(model, ids, cache_mode="fp32"), got)


# ---------------------------------------------------------------------------------- perplexity
@pytest.mark.parametrize("kind, window, max_windows", [("llama", 8, None), ("llama", 16, 2), ("qwen2", 8, None),
                                                       ("mistral", W, None), ("llama", 2, None)])
def test_ppl_cli_and_python_equal_the_definition_over_transformers(hf, tmp_path, capsys, kind, window, max_windows):
    """`tinyloop ppl` and perplexity() over a text longer than the window (and than Mistral's
    sliding window) equal the perplexity recomputed from transformers' logits; the --json fields
    mean what docs/SCORING.md says; the CLI encodes the file as the Python API encodes a text."""
    ref, model, path = hf[kind]
    bos = BOS if kind == "llama" else None
    src = tmp_path / "text.txt"
    src.write_bytes(TEXT.encode("utf-8"))
    ids = _text_ids(TEXT, bos)
    assert len(ids) > 3 * window
    ppl, nll, tokens, windows = _ref_ppl(ref, ids, window, max_windows)
    out = tmp_path / "ppl.json"
    argv = ["ppl", path, "--text", str(src), "--window", str(window), "--backend", "cpu",
            "--cache-mode", "fp32,fp16", "--json", str(out)]
    if max_windows:
        argv += ["--max-windows", str(max_windows)]
    assert main(argv) == 0
    rep = json.loads(out.read_text())
    assert (rep["model"], rep["text"], rep["window"]) == (path, str(src), window)
    assert [r["cache_mode"] for r in rep["results"]] == ["fp32", "fp16"]
    for r in rep["results"]:
        assert (r["tokens"], r["windows"], r["loops"]) == (tokens, windows, 1)
        assert math.isclose(r["ppl"], math.exp(r["nll"]), rel_tol=1e-12)
    r = rep["results"][0]
    assert math.isclose(r["nll"], nll, rel_tol=1e-5), (r["nll"], nll)
    assert math.isclose(r["ppl"], ppl, rel_tol=1e-4 * max(1.0, nll)), (r["ppl"], ppl)
    py = perplexity(model, TEXT, window=window, max_windows=max_windows, cache_mode="fp32")
    assert math.isclose(py["nll"], r["nll"], rel_tol=1e-12) and py["tokens"] == tokens
    printed = capsys.readouterr().out.splitlines()
    assert printed[1].split() == ["1", "fp32", f"{r['ppl']:.3f}", f"{r['nll']:.4f}", str(tokens)]


def test_decoded_perplexity_with_the_window_cache_equals_transformers_sliding_window(hf):
    """Past a sliding window the windowed decode steps are the way (score refuses): windows of 15
    tokens under Mistral's window of 6 equal transformers' sliding-window forward."""
    ref, model, _ = hf["mistral"]
    ids = _text_ids(TEXT, None)
    ppl, nll, tokens, windows = _ref_ppl(ref, ids, 15)
    got = decoded_perplexity(model, ids, tl.GenerateConfig(cache_mode="fp32", cache_window=W), window=15)
    assert (got["tokens"], got["windows"]) == (tokens, windows)
    assert math.isclose(got["nll"], nll, rel_tol=1e-5)


def test_a_window_past_the_sliding_window_is_refused_naming_the_window(hf, tmp_path, capsys):
    _, model, path = hf["mistral"]
    with pytest.raises(tl.IncompatibleModesError, match=r"window=8 .*sliding_window=6.*decoded_perplexity"):
        perplexity(model, _text_ids(TEXT, None), window=8)
    src = tmp_path / "t.txt"
    src.write_text(TEXT)
    assert main(["ppl", path, "--text", str(src), "--backend", "cpu"]) == 2       # default --window 256
    err = capsys.readouterr().err
    assert "window=256" in err and "--window 6" in err


def test_perplexity_too_large_for_a_float_is_inf_never_a_traceback(hot, tmp_path, capsys):
    """exp(nll) past the float range: ppl is inf (nll stays the finite mean), and --json stays
    strict JSON (a non-finite number is written as null)."""
    model = tl.load_model(hot, backend="cpu", max_seq_len=16)
    try:
        r = perplexity(model, list(TEXT.encode()), window=8, cache_mode="fp32")
    finally:
        tl.free_model(model)
    assert r["nll"] > 710 and math.isfinite(r["nll"]) and r["ppl"] == math.inf
    src, out = tmp_path / "t.txt", tmp_path / "o.json"
    src.write_text(TEXT)
    assert main(["ppl", hot, "--text", str(src), "--window", "8", "--backend", "cpu", "--json", str(out)]) == 0
    text = out.read_text()
    rep = json.loads(text, parse_constant=lambda c: pytest.fail(f"--json wrote {c}, which is not JSON"))
    assert rep["results"][0]["ppl"] is None and rep["results"][0]["nll"] > 710
    assert "inf" in capsys.readouterr().out


# -------------------------------------------------------------------------------- CLI edge cases
@pytest.mark.parametrize("content, argv, want", [
    (b"", [], "1 tokens do not fill one window of 8"),                # the BOS id alone
    (b"a", [], "2 tokens do not fill one window of 8"),             # BOS + 1 byte
    (b"a", ["--window", "2"], 1),                                    # the byte, predicted from BOS
    (b"", ["--window", "2"], "1 tokens do not fill one window of 2"),  # BOS alone
    (b"ab", ["--window", "1"], "--window=1 must be at least 2"),
    (b"abc", ["--window", "64"], "4 tokens do not fill one window of 64"),
    (b"\xff\xfeab", [], "is not UTF-8"),
    (b"x" * 20000, ["--window", "64", "--max-windows", "2"], 2 * 63),  # one very long line
    (b"ab", ["--max-windows", "0"], "--max-windows=0"),
])
def test_ppl_cli_edges_are_typed(hf, tmp_path, capsys, content, argv, want):
    """A typed error (exit 2, one line naming the problem) or the documented count of scored
    tokens; never a traceback."""
    _, _, path = hf["llama"]
    src = tmp_path / "t.txt"
    src.write_bytes(content)
    rc = main(["ppl", path, "--text", str(src), "--backend", "cpu", "--window", "8"] + argv)
    cap = capsys.readouterr()
    if isinstance(want, str):
        assert rc == 2 and want in cap.err, cap.err
    else:
        assert rc == 0, cap.err
        assert cap.out.splitlines()[-1].split()[-1] == str(want)
