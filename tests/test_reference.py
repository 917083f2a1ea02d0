"""CPU backend logits against the float64 reference forward (the oracle)."""

from __future__ import annotations

import numpy as np
import pytest

import tinyloop as tl
from tinyloop.model.reference import reference_logits

from conftest import logical_weights, write_tiny


def rel_err(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("loops", [1, 2, 8])
def test_cpu_logits_match_float64_reference(tiny_path, tiny_model, prompt, loops):
    W = logical_weights(tiny_path)
    ref = reference_logits(tiny_model.cfg, W, prompt, loops)
    got = tl.score(tiny_model, prompt, loops=loops, cache_mode="fp32")
    assert rel_err(got, ref) < 1e-4


@pytest.mark.parametrize("loops", [1, 8])
def test_fp16_cache_matches_reference_with_half_kv(tiny_path, tiny_model, prompt, loops):
    W = logical_weights(tiny_path)
    ref = reference_logits(tiny_model.cfg, W, prompt, loops, kv_round=np.float16)
    got = tl.score(tiny_model, prompt, loops=loops, cache_mode="fp16")
    assert rel_err(got, ref) < 2e-3


@pytest.mark.parametrize("overrides", [
    dict(tied_embeddings=True, loop_inject="none"),
    dict(n_pre=0, n_post=0, n_loop=1, n_kv_heads=4),
    dict(n_heads=8, n_kv_heads=1, head_dim=12, n_post=2),
])
@pytest.mark.parametrize("quant,group", [("f32", 0), ("q4", 32), ("q8", 16), ("q2", 32)])
def test_family_variants_match_reference(tmp_path, prompt, overrides, quant, group):
    path = tmp_path / "m.tinyloop"
    cfg = write_tiny(path, seed=3, quant=quant, group_size=group, **overrides)
    W = logical_weights(path)
    m = tl.load_model(str(path), max_seq_len=32, backend="cpu", prefill_chunk=4)
    try:
        for loops in (1, 3):
            ref = reference_logits(cfg, W, prompt, loops)
            assert rel_err(tl.score(m, prompt, loops=loops, cache_mode="fp32"), ref) < 1e-4
    finally:
        tl.free_model(m)


def test_score_last_token_is_last_row(tiny_model, prompt):
    full = tl.score(tiny_model, prompt, loops=2)
    last = tl.score_last_token(tiny_model, prompt, loops=2)
    assert np.array_equal(full[-1], last)
