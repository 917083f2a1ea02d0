"""Edge cases of the decode modes and the scoring family found by an audit: bad input to the
perplexity helpers and to calibrate (the auto decoder's benchmark) is a typed error naming the
value, never a raw Python exception or a silently truncated token id."""

from __future__ import annotations

import numpy as np
import pytest

import tinyloop as tl
from tinyloop.analysis.evaluate import decoded_perplexity, perplexity


@pytest.fixture(scope="module")
def demo():
    m = tl.load_model("demo", max_seq_len=64, backend="cpu")
    yield m
    tl.free_model(m)


@pytest.fixture(scope="module")
def ids(demo):
    return demo.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")


# --------------------------------------------------------------------------- perplexity
@pytest.mark.parametrize("fn", [perplexity, decoded_perplexity])
def test_perplexity_refuses_non_integer_ids(demo, ids, fn):
    # floats were truncated to ints (1.5 -> 1) and bools taken as 0 / 1, silently
    with pytest.raises(tl.InvalidInputError, match="integer token ids"):
        fn(demo, [float(t) + 0.5 for t in ids], window=8)
    with pytest.raises(tl.InvalidInputError, match="bool"):
        fn(demo, [True] + ids, window=8)
    with pytest.raises(tl.InvalidInputError, match="integer token ids"):
        fn(demo, np.array([float("nan")] * 16), window=8)


@pytest.mark.parametrize("fn", [perplexity, decoded_perplexity])
def test_perplexity_of_text_is_the_perplexity_of_its_ids(demo, fn):
    # a str was a raw ValueError (int('...')); like score, text is encoded with the model's tokenizer
    text = "import os\nimport sys\n\ndef main():\n    return 0\n"
    depth = dict(loops=2) if fn is perplexity else dict(config=tl.GenerateConfig(loops=2))
    got = fn(demo, text, window=8, **depth)
    want = fn(demo, tl.runtime.engine.encode_text(demo, text), window=8, **depth)
    assert got == want and got["windows"] >= 1


@pytest.mark.parametrize("fn", [perplexity, decoded_perplexity])
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_perplexity_max_windows_is_checked(demo, ids, fn, bad):
    # 1.5 was a raw TypeError, True was used as 1 (and reported as windows=True), 0 / -1 were
    # reported as "N tokens do not fill one window"
    with pytest.raises(tl.TinyLoopError, match=r"max_windows="):
        fn(demo, ids, window=8, max_windows=bad)


def test_perplexity_still_scores_ids(demo, ids):
    r = perplexity(demo, ids, window=8, max_windows=2, loops=2)
    assert r["windows"] == 2 and r["tokens"] == 14
    logits = tl.score(demo, ids[:8], loops=2).astype(np.float64)
    lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    nll0 = float(np.sum(lse[:-1] - logits[np.arange(7), ids[1:8]]))
    logits = tl.score(demo, ids[8:16], loops=2).astype(np.float64)
    lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    nll1 = float(np.sum(lse[:-1] - logits[np.arange(7), ids[9:16]]))
    assert r["nll"] == pytest.approx((nll0 + nll1) / 14, rel=1e-12)


# --------------------------------------------------------------------------- calibrate
@pytest.mark.parametrize("kw,match", [
    (dict(prompts=[5, 6, 7]), r"prompts\[0\]"),                 # a flat id list: raw TypeError before
    (dict(prompts=[[5, 6], 7]), r"prompts\[1\]"),
    (dict(candidates=5), "candidates"),                          # raw TypeError before
])
def test_calibrate_bad_arguments_are_typed(demo, kw, match):
    with pytest.raises(tl.TinyLoopError, match=match):
        tl.calibrate(demo, 2, max_tokens=2, **kw)
    assert 2 not in demo.decoder_choices


def test_calibrate_takes_text_prompts_like_generate(demo):
    # a str prompt was split into characters (an error about dtype <U1)
    choice = tl.calibrate(demo, 2, prompts=["def f(x):"], max_tokens=2, candidates=[
        tl.SpeculativeConfig(draft_loops=1, verify_loops=2, draft_ahead=2)])
    assert choice.loops == 2 and all(r["exact"] for r in choice.results)
    demo.decoder_choices.clear()


# --------------------------------------------------------------------------- beam search statistics
def test_beam_decode_time_counts_the_search(demo, ids):
    st = tl.GenerateStats()
    tl.generate(demo, ids[:6], tl.GenerateConfig(max_tokens=8, loops=2, beam_size=4), stats=st)
    search_ms = st.first_token_ms - st.prefill_ms          # the beam's decode steps all run before token 1
    assert search_ms > 0
    assert st.decode_ms >= 0.5 * search_ms
