"""Lockstep batched decoding on the CUDA backend (marker gpu): every lane's tokens equal generate of
its prompt on the GPU and the CPU backend's lanes, with the lanes step captured as a graph."""

from __future__ import annotations

import dataclasses

import pytest

import tinyloop as tl

from conftest import real_gpu

pytestmark = pytest.mark.gpu

if not real_gpu():
    pytest.skip("no CUDA GPU", allow_module_level=True)

TEXTS = ["Once upon a time", "The cat", "Hello there, my friend, how are", "A", "Once upon a time",
         "In the morning the", "x", "She said that"]


@pytest.mark.parametrize("cache_mode", ["fp16", "fp32", "int8", "int4"])
def test_greedy_lanes_equal_generate_and_cpu(demo_pair, cache_mode):
    cpu, gpu = demo_pair
    prompts = [gpu.tokenizer.encode(t) for t in TEXTS]
    cfg = tl.GenerateConfig(max_tokens=24, loops=4, cache_mode=cache_mode)
    before = gpu.backend.graph_launches
    stats = []
    out = tl.generate_batch(gpu, prompts, cfg, stats=stats)
    assert all(s.batch_lanes == len(prompts) for s in stats)
    assert gpu.backend.graph_launches - before >= 20          # the lanes steps replay a captured graph
    assert out == [tl.generate(gpu, p, cfg) for p in prompts]
    assert out == tl.generate_batch(cpu, prompts, cfg)


def test_sampling_and_stop_lanes(demo_pair):
    cpu, gpu = demo_pair
    prompts = [gpu.tokenizer.encode(t) for t in TEXTS]
    stop = (gpu.tokenizer.encode(" the")[0],)
    cfg = tl.GenerateConfig(max_tokens=20, temperature=0.8, top_k=30, sample_seed=3, stop_sequences=(stop,))
    out = tl.generate_batch(gpu, prompts, cfg)
    assert out == [tl.generate(gpu, p, dataclasses.replace(cfg, sample_seed=tl.lane_seed(3, i)))
                   for i, p in enumerate(prompts)]


def test_grammar_lanes(demo_pair):
    pytest.importorskip("llguidance")            # the grammar extra
    cpu, gpu = demo_pair
    prompts = [gpu.tokenizer.encode(t) for t in TEXTS]
    g = tl.Grammar.regex("[0-9]+")
    grammars = [g if i % 2 else None for i in range(len(prompts))]
    gcfg = tl.GenerateConfig(max_tokens=12, repetition_penalty=1.2)
    out = tl.generate_batch(gpu, prompts, gcfg, grammars=grammars)
    assert out == [tl.generate(gpu, p, dataclasses.replace(gcfg, grammar=gr)) for p, gr in zip(prompts, grammars)]
    assert out == tl.generate_batch(cpu, prompts, gcfg, grammars=grammars)


def test_many_lanes_and_long_prompts(demo_pair):
    cpu, gpu = demo_pair
    prompts = [[(7 * i + j) % gpu.vocab_size for j in range(1 + (13 * i) % 90)] for i in range(40)]
    cfg = tl.GenerateConfig(max_tokens=16, loops=2)
    assert tl.generate_batch(gpu, prompts, cfg) == [tl.generate(gpu, p, cfg) for p in prompts]
