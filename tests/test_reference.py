"""CPU backend logits against the float64 reference forward (the oracle)."""

from __future__ import annotations

import numpy as np
import pytest

import tinyloop as tl
from tinyloop.model.arch import ModelConfig
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


#: the seeded random initial state (loop_init "random"; tinyloop.model.init_state)
RANDOM_INIT = dict(loop_inject="adapter", loop_init="random", loop_init_scale=0.9, loop_init_seed=2 ** 64 - 1)


@pytest.mark.parametrize("overrides", [
    RANDOM_INIT,
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


def test_random_initial_state_decodes_exactly(tmp_path, prompt):
    """loop_init "random" (its logits against the oracle: test_family_variants_match_reference):
    the header round-trips, the state differs from a zero start, and cached greedy decoding after
    a chunked prefill equals the argmax chain of whole-sequence scoring (the draw follows the
    absolute position, whatever launch computes it)."""
    from tinyloop.model.format import open_model
    path = tmp_path / "m.tinyloop"
    cfg = write_tiny(path, seed=5, quant="q4", group_size=32, **RANDOM_INIT)
    with open_model(str(path)) as mf:
        assert mf.header.config == cfg
    W = logical_weights(path)
    m = tl.load_model(str(path), max_seq_len=48, backend="cpu", prefill_chunk=3)
    try:
        zeros = ModelConfig(**{**cfg.to_dict(), "loop_init": "zeros", "loop_init_scale": 0.0, "loop_init_seed": 0})
        assert rel_err(reference_logits(zeros, W, prompt, 2), reference_logits(cfg, W, prompt, 2)) > 1e-3
        ids = list(prompt)
        for _ in range(6):
            ids.append(int(np.argmax(tl.score(m, ids, loops=2)[-1])))
        assert list(tl.generate(m, prompt, tl.GenerateConfig(max_tokens=6, loops=2))) == ids
    finally:
        tl.free_model(m)


@pytest.mark.parametrize("kw, match", [
    (dict(loop_init="random", loop_inject="adapter"), "needs loop_init_scale > 0"),
    (dict(RANDOM_INIT, loop_init_scale=-1.0), "loop_init_scale=-1.0 must be"),
    (dict(RANDOM_INIT, loop_init_scale=float("nan")), "loop_init_scale=nan"),
    (dict(RANDOM_INIT, loop_init_scale=float("inf")), "loop_init_scale=inf"),
    (dict(RANDOM_INIT, loop_init_scale="1"), "loop_init_scale='1'"),
    (dict(RANDOM_INIT, loop_init_scale=True), "loop_init_scale=True"),
    (dict(RANDOM_INIT, loop_inject="add"), "needs loop_inject='adapter'"),
    (dict(loop_init_scale=0.5), "apply to loop_init='random' only"),
    (dict(loop_init="zeros", loop_inject="adapter", loop_init_seed=3), "apply to loop_init='random' only"),
    (dict(RANDOM_INIT, loop_init_seed=-1), "loop_init_seed=-1 is outside"),
    (dict(RANDOM_INIT, loop_init_seed=2 ** 64), "loop_init_seed=18446744073709551616 is outside"),
    (dict(RANDOM_INIT, loop_init_seed=1.0), "loop_init_seed must be an integer"),
    (dict(RANDOM_INIT, loop_init_seed=True), "loop_init_seed must be an integer"),
    (dict(loop_init="gaussian"), "loop_init='gaussian' is not one of"),
])
def test_random_initial_state_bad_config(kw, match):
    from conftest import TINY
    from tinyloop.errors import ConfigError
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**{**TINY, **kw})


def test_random_state_draw_properties():
    """The draw: vectorized equals the scalar definition; mean 0 and unit variance; bounded by 6
    standard deviations; distinct per position, channel and seed."""
    from tinyloop.model.init_state import random_state, seed_key, state_element
    d = 16
    got = random_state(7, 2.0, [0, 3, 2 ** 40], d)
    key = seed_key(7)
    assert all(got[j, i] == np.float32(state_element(key, p * d + i, 2.0))
               for j, p in enumerate((0, 3, 2 ** 40)) for i in range(d))
    big = random_state(1, 1.0, np.arange(4096), 64).astype(np.float64)
    assert abs(big.mean()) < 0.01 and abs(big.std() - 1.0) < 0.01 and np.abs(big).max() <= 6.0
    assert len(np.unique(big)) > 0.99 * big.size
    assert not np.array_equal(random_state(1, 1.0, [5], d), random_state(2, 1.0, [5], d))
    from tinyloop.errors import ConfigError
    with pytest.raises(ConfigError, match="positions must be >= 0"):
        random_state(1, 1.0, [-1], d)
    for args, match in (((1, 1.0, [1.5], d), "positions must be integers"), ((-1, 1.0, [0], d), "seed=-1"),
                        ((2 ** 64, 1.0, [0], d), "seed="), ((True, 1.0, [0], d), "seed=True"),
                        ((1, 0.0, [0], d), "scale=0.0"), ((1, float("nan"), [0], d), "scale=nan"),
                        ((1, "1", [0], d), "scale='1'"), ((1, 1.0, [0], 0), "d_model=0")):
        with pytest.raises(ConfigError, match=match):
            random_state(*args)
    assert random_state(1, 1.0, [], d).shape == (0, d)
