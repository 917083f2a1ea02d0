"""The sampling path against an outside implementation: Hugging Face transformers' logits
processors (RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
TopPLogitsWarper), applied in the order the spec and tinyloop.runtime.sampling document
(repetition penalty -> temperature -> top-k -> top-p -> draw; transformers applies its processors
in the order of the list, built here in that order). TinyLoop has no min_p knob, so MinPLogitsWarper
is not compared.

What is compared: the repetition penalty's float32 logits bit for bit; the set of tokens
``sampling_probs`` gives a positive probability (= the tokens ``sample_token`` can draw) and
their probabilities; the seeded draw's reproducibility; empirical frequencies of the draw (fixed
seeds, so deterministic) against the filtered distribution, on the bare sampler and through the
engine.

Documented differences (TinyLoop's definition is checked, not forced equal to transformers'):

* top-k ties: TopKLogitsWarper keeps every token equal to the k-th largest value (more than k
  where they tie); TinyLoop keeps exactly k = min(top_k, V), equal values by ascending id. With
  the ties broken in TinyLoop's order the two agree.
* top-p ties at the boundary: transformers orders equal values by torch.sort (not stable), so
  which of several tied tokens crosses the threshold is unspecified; TinyLoop keeps the lower ids.
  The kept probabilities (as a multiset) agree.
* top-p rounding: both keep the token that crosses the threshold (and at least one token, HF's
  min_tokens_to_keep=1). TinyLoop cuts on the unnormalised running sums in descending order
  (c_j >= top_p * c_total); transformers on the normalised ascending cumsum (<= 1 - top_p). Where
  the mass hits the threshold exactly they round differently: ten tied tokens at top_p 0.8 keep 8
  in TinyLoop (the exact answer) and 9 in transformers (1 - 0.8 rounds below 0.2).
* precision: TinyLoop divides by the temperature in float64; transformers in the scores' dtype
  (float32 in generate). The reference here runs the warpers on float64 copies of the float32 rows.
* temperature <= 0.01 is greedy in TinyLoop (spec); TemperatureLogitsWarper takes any t > 0.
* a +inf logit: transformers' softmax gives NaN (torch.multinomial then raises); TinyLoop puts the
  mass on the +inf tokens (equally), the limit of the softmax and the token greedy picks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tinyloop as tl  # noqa: E402
from tinyloop import GenerateConfig  # noqa: E402
from tinyloop.plugins.processors.repetition import RepetitionPenalty  # noqa: E402
from tinyloop.runtime.sampling import sample_token, sampling_probs, uniforms  # noqa: E402

from transformers import (RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,  # noqa: E402
                          TopKLogitsWarper, TopPLogitsWarper)

_IDS = torch.zeros((1, 1), dtype=torch.long)    # the warpers ignore input_ids


def hf_penalty(z32: np.ndarray, penalty: float, history) -> np.ndarray:
    """RepetitionPenaltyLogitsProcessor on one float32 row (history: prompt + output ids)."""
    proc = RepetitionPenaltyLogitsProcessor(penalty)
    return proc(torch.tensor([list(history)]), torch.tensor(z32[None].copy()))[0].numpy()


def hf_probs(z, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """temperature -> top-k -> top-p (transformers' warpers, float64), then softmax."""
    s = torch.tensor(np.asarray(z, np.float64)[None].copy())
    s = TemperatureLogitsWarper(temperature)(_IDS, s)
    s = TopKLogitsWarper(top_k)(_IDS, s)
    if top_p < 1.0:
        s = TopPLogitsWarper(top_p)(_IDS, s)
    return torch.softmax(s, -1)[0].numpy()


def tl_probs(z, temperature, top_k, top_p, penalty=1.0, history=()):
    """TinyLoop's chain on one row: the repetition-penalty processor, then sampling_probs."""
    z = np.array(z, np.float32)
    if penalty != 1.0:
        p = RepetitionPenalty(penalty)
        p.reset(list(history))
        p.apply(z)
    return sampling_probs(z, temperature, top_k, top_p)


def break_ties(z, scale: float = 1e-9) -> np.ndarray:
    """z (float64) with equal finite values pushed apart in TinyLoop's order (ascending id first):
    the j-th repeat of a value is lowered by j * scale * max(1, |value|)."""
    z = np.asarray(z, np.float64)
    order = np.lexsort((np.arange(z.size), -z))
    vals = z[order]
    new_run = np.ones(z.size, bool)
    new_run[1:] = vals[1:] != vals[:-1]
    starts = np.maximum.accumulate(np.where(new_run, np.arange(z.size), 0))
    rank = np.arange(z.size) - starts
    out = z.copy()
    fin = np.isfinite(vals)
    out[order[fin]] = vals[fin] - rank[fin] * scale * np.maximum(1.0, np.abs(vals[fin]))
    return out


def near_top_p_threshold(z, temperature, top_k, top_p, tol=1e-7) -> bool:
    """A kept running sum within `tol` of the top-p threshold: the two cuts may round apart."""
    if top_p >= 1.0:
        return False
    zz = np.asarray(z, np.float64) / temperature
    order = np.lexsort((np.arange(zz.size), -zz))[:min(top_k, zz.size)]
    w = np.exp(zz[order] - zz[order[0]])
    return bool(np.any(np.abs(np.cumsum(w) / w.sum() - top_p) < tol))


def _random_row(rng, V, kind):
    if kind == 0:
        z = rng.normal(0, 3, V)
    elif kind == 1:                                     # huge / tiny magnitudes
        z = rng.normal(0, 1, V) * 10.0 ** rng.integers(-6, 4)
    elif kind == 2:                                     # -inf entries (at least one finite)
        z = rng.normal(0, 3, V)
        z[rng.random(V) < 0.5] = -np.inf
        z[rng.integers(V)] = rng.normal()
    elif kind == 3:                                     # near float32's range
        z = rng.normal(0, 1, V) * 3e37
    else:                                               # nearly flat
        z = rng.normal(0, 1e-7, V)
    return z.astype(np.float32)


# ============================================================================ repetition penalty
def test_repetition_penalty_equals_transformers_bit_for_bit():
    """HF convention on float32 rows: ids repeated in the prompt and the output are penalised once,
    negative logits multiplied, positive divided, 0 / -0 / -inf kept; penalties below and above 1."""
    rng = np.random.default_rng(11)
    for trial in range(300):
        V = int(rng.choice([2, 7, 100, 5000]))
        z = (rng.normal(0, 1, V) * 10.0 ** rng.integers(-30, 30)).astype(np.float32)
        z[rng.random(V) < 0.1] = -np.inf
        z[rng.random(V) < 0.1] = 0.0
        z[rng.random(V) < 0.05] = -0.0
        penalty = float(rng.choice([1e-6, 0.5, 0.9, 1.3, 2.0, 1e6, rng.uniform(1e-6, 10)]))
        prompt = rng.integers(0, V, int(rng.integers(1, 30))).tolist()
        out = rng.integers(0, V, int(rng.integers(0, 10))).tolist()
        proc = RepetitionPenalty(penalty)
        proc.reset(prompt)
        for t in out:
            proc.accept(int(t))
        got = z.copy()
        proc.apply(got)
        want = hf_penalty(z, penalty, prompt + out)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (trial, penalty)


# ============================================================================ filtered distribution
def test_filtered_distribution_equals_transformers_on_random_rows():
    """Rows without ties at a cut (continuous values, -inf entries, huge and tiny magnitudes, V from
    2 to 50k, top_k above V, top_p 1.0 down to the smallest double, temperatures near the greedy
    bound and large): the tokens with positive probability are the same set and their
    probabilities agree; every draw lands in that set. Rows whose cumulative mass sits within 1e-7
    of top_p are left to the rounding test below."""
    rng = np.random.default_rng(5)
    checked = 0
    for trial in range(400):
        V = int(rng.choice([2, 3, 5, 10, 100, 1000, 50000]))
        z = _random_row(rng, V, int(rng.integers(0, 5)))
        T = float(rng.choice([0.0101, 0.02, 0.3, 0.7, 1.0, 1.5, 10.0, 1e4, 1e30]))
        k = int(rng.choice([1, 2, 3, 5, 50, V, V + 10, 1 << 40]))
        p = float(rng.choice([1.0, 0.99, 0.9, 0.5, 0.1, 1e-9, 5e-324]))
        if near_top_p_threshold(z, T, k, p):
            continue
        got, want = sampling_probs(z, T, k, p), hf_probs(z, T, k, p)
        ctx = (trial, V, T, k, p)
        assert np.array_equal(np.flatnonzero(got > 0), np.flatnonzero(want > 0)), ctx
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-300, err_msg=str(ctx))
        assert math.isclose(got.sum(), 1.0, rel_tol=1e-9)
        for u in (0.0, 0.25, 0.5, 0.999, 1 - 2 ** -53):
            assert got[sample_token(z, T, k, p, u)] > 0, ctx + (u,)
        checked += 1
    assert checked > 300


def test_composite_chain_equals_transformers_processor_list():
    """penalty -> temperature -> top-k -> top-p: TinyLoop's processor + sampler against the HF list
    [RepetitionPenalty, Temperature, TopK, TopP], with repeated ids and negative logits."""
    rng = np.random.default_rng(9)
    for trial in range(150):
        V = int(rng.choice([5, 64, 1000]))
        z = (rng.normal(0, 4, V)).astype(np.float32)
        hist = rng.integers(0, V, 20).tolist()
        hist += hist[:5]                                # repeats
        pen = float(rng.choice([0.7, 1.2, 2.5]))
        T, k, p = float(rng.choice([0.5, 1.0, 2.0])), int(rng.choice([3, 40, V + 1])), float(rng.choice([1.0, 0.9, 0.6]))
        zp = hf_penalty(z, pen, hist)
        if near_top_p_threshold(zp, T, k, p):
            continue
        got, want = tl_probs(z, T, k, p, pen, hist), hf_probs(zp, T, k, p)
        assert np.array_equal(np.flatnonzero(got > 0), np.flatnonzero(want > 0)), trial
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-300)


# ============================================================================ documented differences
@pytest.mark.parametrize("T,k,p", [(1.0, 2, 1.0), (0.7, 5, 1.0), (1.3, 50, 0.9), (1.0, 110, 0.5), (2.0, 3, 0.3)])
def test_ties_keep_the_lower_ids_and_agree_with_transformers_once_broken(T, k, p):
    """Small integer logits, many ties at the top-k and top-p boundaries. TinyLoop keeps exactly
    min(k, V) top-k candidates, ties by ascending id (HF's TopK keeps all ties, so it may keep more);
    with the ties broken in TinyLoop's order HF keeps the same tokens with the same
    probabilities, and without breaking them the kept probabilities agree as a multiset when
    TopK kept no extra tie."""
    rng = np.random.default_rng(int(k * 10 + T * 100))
    for trial in range(40):
        V = int(rng.choice([3, 10, 100]))
        z = rng.integers(-3, 3, V).astype(np.float32)
        if near_top_p_threshold(z, T, k, p):
            continue
        got = sampling_probs(z, T, k, p)
        kept = np.flatnonzero(got > 0)
        # exactly min(k, V) top-k candidates (all finite here), the lower id first among equals
        order = np.lexsort((np.arange(V), -z.astype(np.float64)))
        assert set(kept) <= set(order[:min(k, V)])
        assert set(kept) == set(order[:len(kept)])
        if p == 1.0:
            assert len(kept) == min(k, V)
        hf_tied = hf_probs(z, T, k, p)
        assert np.count_nonzero(hf_tied) >= len(kept)
        if p == 1.0:                # HF's TopK keeps every token equal to the k-th value
            kth = np.sort(z)[::-1][min(k, V) - 1]
            assert np.count_nonzero(hf_tied) == np.count_nonzero(z >= kth)
        elif np.count_nonzero(hf_probs(z, T, k, 1.0)) == min(k, V):
            np.testing.assert_allclose(np.sort(got[got > 0]), np.sort(hf_tied[hf_tied > 0]), rtol=1e-9)
        want = hf_probs(break_ties(z), T, k, p)
        assert np.array_equal(kept, np.flatnonzero(want > 0)), trial
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-300)


def test_top_p_exact_threshold_keeps_the_crossing_token_as_documented():
    """The cut is 'keep candidates up to the first j with c_j >= top_p * c_total' (inclusive; at
    least one). Ten tied tokens at top_p 0.8 keep exactly 8 (0.8 of the mass, reached exactly);
    transformers keeps 9 there (its 1 - 0.8 rounds below 0.2), a rounding difference documented
    above, not a defect. Where the threshold is not hit exactly both keep the crossing token."""
    z = np.zeros(10, np.float32)
    got = sampling_probs(z, 1.0, 50, 0.8)
    assert np.array_equal(np.flatnonzero(got), np.arange(8))
    np.testing.assert_allclose(got[:8], 1 / 8)
    assert np.count_nonzero(hf_probs(z, 1.0, 50, 0.8)) in (8, 9)
    # [0.5, 0.3, 0.2]: top_p 0.6 keeps two (0.5 < 0.6 <= 0.8), top_p 0.5 keeps one (hit exactly)
    z = np.log(np.array([0.5, 0.3, 0.2])).astype(np.float32)
    for p, n in [(0.6, 2), (0.5, 1), (0.81, 3), (1e-300, 1), (5e-324, 1)]:
        got = sampling_probs(z, 1.0, 3, p)
        assert np.count_nonzero(got) == n == np.count_nonzero(hf_probs(z, 1.0, 3, p)), p
    # the draws follow the cut: never past it
    for u in np.linspace(0, 1 - 2 ** -53, 101):
        assert sample_token(z, 1.0, 3, 0.6, float(u)) in (0, 1)


def test_positive_infinite_logit_takes_all_the_mass():
    """A +inf logit (a float32 overflow: e.g. repetition_penalty 1e-6, the allowed bound, on a
    logit above 3.4e32) is the certain token in the limit of the softmax, and greedy's argmax. The
    sampler computed exp(inf - inf) = NaN weights, and its draw fell through to the LAST candidate
    (the least likely of the top-k) for every u; sampling_probs was all NaN. transformers gives NaN
    here (torch.multinomial then raises): the reference is the limit."""
    z = np.array([np.inf, 1.0, 0.0, -np.inf], np.float32)
    for k, p in [(4, 1.0), (3, 1.0), (2, 0.9), (1, 1.0)]:
        probs = sampling_probs(z, 1.0, k, p)
        assert np.array_equal(probs, [1.0, 0.0, 0.0, 0.0]), (k, p, probs)
        assert {sample_token(z, 1.0, k, p, u) for u in (0.0, 0.3, 0.7, 1 - 2 ** -53)} == {0}
    # two +inf tokens share the mass equally (ties by id, as everywhere), at any temperature
    z = np.array([2.0, np.inf, -5.0, np.inf], np.float32)
    for T in (0.02, 1.0, 50.0):
        assert np.array_equal(sampling_probs(z, T, 4, 1.0), [0.0, 0.5, 0.0, 0.5])
        assert sample_token(z, T, 4, 1.0, 0.2) == 1 and sample_token(z, T, 4, 1.0, 0.7) == 3
        assert sampling_probs(z, T, 4, 0.5)[1] == 1.0 and sample_token(z, T, 4, 0.5, 0.9) == 1
    # reached through the repetition penalty's allowed range
    row = np.array([1e33, 5.0, -2.0], np.float32)
    proc = RepetitionPenalty(1e-6)
    proc.reset([0])
    with np.errstate(over="ignore"):
        proc.apply(row)
    assert row[0] == np.inf
    assert sample_token(row, 1.0, 3, 1.0, 0.5) == 0 == int(np.argmax(row))


# ============================================================================ seeded draws
def test_seeded_draws_are_reproducible(tiny_model, prompt):
    """The uniforms are PCG64(seed)'s stream, the draw a pure function of (logits, knobs, u), and a
    seeded request gives the same tokens every time."""
    g = np.random.Generator(np.random.PCG64(42))
    assert np.array_equal(uniforms(42, 7), [g.random() for _ in range(7)])
    z = np.random.default_rng(0).normal(0, 2, 300).astype(np.float32)
    us = uniforms(3, 200)
    a = [sample_token(z, 0.9, 40, 0.9, float(u)) for u in us]
    assert a == [sample_token(z.copy(), 0.9, 40, 0.9, float(u)) for u in us]
    cfg = GenerateConfig(max_tokens=12, temperature=1.1, top_k=30, top_p=0.9, repetition_penalty=1.3, sample_seed=9)
    first = tl.generate(tiny_model, prompt, cfg)
    assert tl.generate(tiny_model, prompt, cfg) == first
    assert len({tuple(tl.generate(tiny_model, prompt, cfg.replace(sample_seed=s))) for s in range(6)}) > 1


def _chi2(counts: np.ndarray, probs: np.ndarray) -> tuple:
    """(statistic, degrees of freedom) over the tokens with positive probability; draws anywhere
    else fail the caller's check first."""
    kept = probs > 0
    n = counts.sum()
    e = probs[kept] * n
    return float(((counts[kept] - e) ** 2 / e).sum()), int(kept.sum()) - 1


#: the 99.9% quantiles of chi-square(df), df = 1..10
_CHI2_999 = (10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59)


def _chi2_bound(df: int) -> float:
    """The 99.9% quantile of chi-square(df): with the fixed seeds below the statistic is a fixed
    number; this says how far from its expectation (df) it may be."""
    return _CHI2_999[df - 1]


@pytest.mark.parametrize("T,k,p", [(1.0, 6, 1.0), (0.8, 4, 1.0), (1.5, 6, 0.7), (0.6, 3, 0.95)])
def test_empirical_frequencies_match_the_filtered_distribution(T, k, p):
    """20000 draws (uniforms of a fixed seed) over a fixed V=6 row: no draw outside the kept set,
    and the chi-square statistic against sampling_probs (= transformers' result) within bound."""
    z = np.array([1.2, 0.3, 1.2, -0.5, 2.0, -np.inf], np.float32)
    probs = sampling_probs(z, T, k, p)
    np.testing.assert_allclose(probs, hf_probs(break_ties(z), T, k, p), rtol=1e-6, atol=1e-300)
    draws = np.array([sample_token(z, T, k, p, float(u)) for u in uniforms(2024, 20000)])
    counts = np.bincount(draws, minlength=z.size)
    assert np.all(counts[probs == 0] == 0)
    stat, df = _chi2(counts, probs)
    if df > 0:
        assert stat < _chi2_bound(df), (stat, df)


def test_engine_first_token_frequencies_match_transformers(tiny_model, prompt):
    """Through generate: the first sampled token over 1500 seeds, with a repetition penalty on
    the prompt's ids, against transformers' chain on score_last_token's row."""
    cfg = GenerateConfig(max_tokens=1, temperature=2.5, top_k=8, top_p=0.95, repetition_penalty=1.8)
    z = np.asarray(tl.score_last_token(tiny_model, prompt), np.float32)
    want = hf_probs(hf_penalty(z, 1.8, prompt), 2.5, 8, 0.95)
    np.testing.assert_allclose(tl_probs(z, 2.5, 8, 0.95, 1.8, prompt), want, rtol=1e-9, atol=1e-300)
    assert np.count_nonzero(want) >= 3
    n = 1500
    first = [tl.generate(tiny_model, prompt, cfg.replace(sample_seed=s))[-1] for s in range(n)]
    counts = np.bincount(first, minlength=z.size)
    assert np.all(counts[want == 0] == 0)
    # only tokens expected >= 5 times enter the statistic; the rest are pooled
    e = want * n
    big = e >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(e[big], e[~big].sum())
    m = exp > 0
    stat = float(((obs[m] - exp[m]) ** 2 / exp[m]).sum())
    assert stat < _chi2_bound(int(m.sum()) - 1), stat
