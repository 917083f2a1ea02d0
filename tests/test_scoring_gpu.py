"""The scoring family on the CUDA backend (marker gpu): the same results as the CPU within fp32
tolerance, and escalation bit-exact to the CUDA backend's own score at each position's depth."""

from __future__ import annotations

import numpy as np
import pytest

import tinyloop as tl

from conftest import real_gpu, write_tiny

pytestmark = pytest.mark.gpu

if not real_gpu():
    pytest.skip("no CUDA GPU", allow_module_level=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("scoring_gpu") / "m.tinyloop"
    write_tiny(path, seed=3)
    cpu = tl.load_model(str(path), max_seq_len=96, backend="cpu", prefill_chunk=8)
    gpu = tl.load_model(str(path), max_seq_len=96, backend="cuda", prefill_chunk=8)
    yield cpu, gpu
    tl.free_model(cpu)
    tl.free_model(gpu)


def _ids(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 97, n)]


def test_lens_and_uncertainty_match_the_cpu(pair):
    cpu, gpu = pair
    ids = _ids(27, 5)
    a = tl.score_logit_lens(cpu, ids, loops=6, cache_mode="fp32")
    b = tl.score_logit_lens(gpu, ids, loops=6, cache_mode="fp32")
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)
    for d in (1, 6):
        assert np.array_equal(b[d - 1], tl.score(gpu, ids, loops=d, cache_mode="fp32"))
    ua, ub = tl.score_with_uncertainty(cpu, ids, loops=5), tl.score_with_uncertainty(gpu, ids, loops=5)
    np.testing.assert_allclose(ub.entropy, ua.entropy, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(ub.kl_to_final, ua.kl_to_final, rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("criterion, threshold", [("entropy", 1.5), ("disagreement", None)])
def test_escalation_exact_on_the_gpu(pair, criterion, threshold):
    _, gpu = pair
    ids = _ids(30, 6)
    r = tl.score_with_consistency_escalation(gpu, ids, 2, 6, criterion, threshold)
    low, high = tl.score(gpu, ids, loops=2), tl.score(gpu, ids, loops=6)
    for t in range(len(ids)):
        assert np.array_equal(r.logits[t], (high if r.escalated[t] else low)[t]), t
