"""The model family's optional features (q/k/v biases, a scaled embedding, the model's own sliding
window, Llama 3.1's RoPE scaling and end-of-turn ids: what Hugging Face imports of Qwen2, Mistral
and Llama 3 turn on) on the CUDA backend (marker gpu):
greedy tokens equal the CPU backend's on every decode path that runs them."""

from __future__ import annotations

import numpy as np
import pytest

import tinyloop as tl

from conftest import logical_weights, real_gpu, write_tiny
from tinyloop.model.reference import reference_logits

pytestmark = pytest.mark.gpu

if not real_gpu():
    pytest.skip("no CUDA GPU", allow_module_level=True)

PROMPTS = [[3, 17, 42, 8, 91, 23], [5, 6], [60, 2, 77, 11, 13, 14, 15, 16, 40]]


@pytest.fixture(scope="module", params=[dict(qkv_bias=True, embed_scale=1.5),
                                        dict(qkv_bias=True, sliding_window=12, loop_inject="none"),
                                        dict(block_norm="sandwich", loop_inject="adapter", loop_init="zeros",
                                             loop_norm="after", embed_scale=2.0, qkv_bias=True),
                                        dict(block_norm="sandwich", loop_inject="adapter", loop_init="random",
                                             loop_init_scale=0.5, loop_init_seed=2 ** 63 + 7, loop_norm="after"),
                                        dict(block_norm="sublayer", loop_norm="every", head_norm=False,
                                             exit_gate=True, n_pre=0, n_post=0),
                                        dict(rope_scaling="llama3", rope_factor=8.0, rope_original_max_positions=24,
                                             rope_theta=500000.0, extra_eos_ids=(7, 9), eos_id=5)],
                ids=["bias_scale", "bias_window", "huginn_layout", "huginn_random", "ouro_layout", "llama31"])
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("family") / "m.tinyloop"
    cfg = write_tiny(path, seed=21, quant="q4", group_size=32, **request.param)
    cpu = tl.load_model(str(path), backend="cpu", max_seq_len=128)
    gpu = tl.load_model(str(path), backend="cuda", max_seq_len=128)
    yield cfg, path, cpu, gpu
    tl.free_model(cpu)
    tl.free_model(gpu)


def _window(cfg):
    return cfg.sliding_window


@pytest.mark.parametrize("cache_mode", ["fp32", "fp16", "int8"])
def test_greedy_tokens_equal_cpu(pair, cache_mode):
    cfg, _, cpu, gpu = pair
    c = tl.GenerateConfig(max_tokens=20, loops=3, cache_mode=cache_mode, cache_window=_window(cfg))
    for p in PROMPTS:
        assert tl.generate(gpu, p, c) == tl.generate(cpu, p, c)


def test_score_matches_the_oracle(pair):
    cfg, path, _, gpu = pair
    ids = PROMPTS[2]
    got = tl.score(gpu, ids, loops=2, cache_mode="fp32")
    ref = reference_logits(cfg, logical_weights(path), ids, 2)
    assert np.abs(got - ref).max() <= 2e-3 * np.abs(ref).max()


def test_batch_sampling_and_speculative_equal_cpu(pair):
    cfg, _, cpu, gpu = pair
    if cfg.sliding_window:
        pytest.skip("lockstep batches and trees refuse a window cache (compat.yaml)")
    c = tl.GenerateConfig(max_tokens=16, loops=3)
    assert tl.generate_batch(gpu, PROMPTS, c) == tl.generate_batch(cpu, PROMPTS, c)
    s = tl.GenerateConfig(max_tokens=16, loops=3, temperature=0.8, sample_seed=5)
    assert tl.generate(gpu, PROMPTS[0], s) == tl.generate(cpu, PROMPTS[0], s)
    spec = tl.GenerateConfig(max_tokens=16, loops=3, decoder="speculative")
    assert tl.generate(gpu, PROMPTS[0], spec) == tl.generate(cpu, PROMPTS[0], c)


def test_gate_exit_equals_cpu(pair):
    """The learned exit gate (Ouro's criterion): tokens and per-token depths equal the CPU's."""
    cfg, _, cpu, gpu = pair
    if not cfg.exit_gate:
        pytest.skip("the model has no exit gate")
    c = tl.GenerateConfig(max_tokens=16, loops=4, early_exit_patience=1, early_exit_min_L=1,
                          early_exit_criterion="gate", early_exit_threshold=0.4, early_exit_kv="recompute")
    for p in PROMPTS:
        a, b = tl.GenerateStats(), tl.GenerateStats()
        assert tl.generate(gpu, p, c, stats=a) == tl.generate(cpu, p, c, stats=b)
        assert a.token_loops == b.token_loops
