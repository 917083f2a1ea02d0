"""The CUDA backend on the exact integer matmul (TINYLOOP_CUDA_EXACT=1, kernels/matmul_exact.py;
marker gpu): q4 weights take it, logits stay within the float64 reference's tolerance, greedy
tokens equal the CPU backend's on the demo model, fused equals unfused, and every decode path
(lockstep lanes, speculative and tree verify rows, chunked prefill, prefix reuse, warm start)
gives plain greedy decoding's tokens: one-row launches (dp4a) and many-row launches (tensor
cores) give the same bits by construction."""

from __future__ import annotations

import os

import numpy as np
import pytest

import tinyloop as tl
from tinyloop.model.reference import reference_logits

from conftest import check_decode_modes, logical_weights, real_gpu, write_tiny

pytestmark = pytest.mark.gpu

if not real_gpu():
    pytest.skip("no CUDA GPU", allow_module_level=True)

TEXTS = ["def fibonacci(n):", "import os\n\n\ndef main():", "class Stack:\n    def push(self, x):",
         "for i in range(10):", "    return self._"]


def _load(path, exact="1", fuse="1", **kw):
    """A CUDA model loaded with TINYLOOP_CUDA_EXACT / TINYLOOP_CUDA_FUSE set (read at construction)."""
    old = {k: os.environ.get(k) for k in ("TINYLOOP_CUDA_EXACT", "TINYLOOP_CUDA_FUSE")}
    os.environ.update(TINYLOOP_CUDA_EXACT=exact, TINYLOOP_CUDA_FUSE=fuse)
    try:
        return tl.load_model(path, backend="cuda", **kw)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def demo():
    cpu = tl.load_model(None, backend="cpu", max_seq_len=256)
    gpu = _load(None, max_seq_len=256)
    yield cpu, gpu
    tl.free_model(cpu)
    tl.free_model(gpu)


def test_switch_selects_the_exact_kernels(demo):
    from tinyloop.cuda.kernels import matmul_exact as mx
    _, gpu = demo
    assert gpu.backend.exact
    off = _load(None, exact="0", max_seq_len=64)
    try:
        assert not off.backend.exact
    finally:
        tl.free_model(off)
    blk = gpu.weights.loop[0]
    assert mx.supports(blk.wqkv.w, blk.wqkv.scales, gpu.cfg.d_model)


def test_demo_tokens_equal_cpu_and_every_decode_path(demo):
    cpu, gpu = demo
    for text in TEXTS:
        ids = gpu.tokenizer.encode(text)
        for loops in (1, 4, 8):
            cfg = tl.GenerateConfig(max_tokens=32, loops=loops)
            assert tl.generate(gpu, ids, cfg) == tl.generate(cpu, ids, cfg), (text, loops)
    check_decode_modes(gpu, gpu.tokenizer.encode(TEXTS[2]), loops=4)


def test_lanes_equal_generate_and_cpu(demo):
    cpu, gpu = demo
    prompts = [gpu.tokenizer.encode(t) for t in TEXTS + ["A", "x"]]
    cfg = tl.GenerateConfig(max_tokens=24, loops=4)
    out = tl.generate_batch(gpu, prompts, cfg)
    assert out == [tl.generate(gpu, p, cfg) for p in prompts]
    assert out == tl.generate_batch(cpu, prompts, cfg)


def test_fused_equals_unfused_and_chunked_prefill(demo):
    _, gpu = demo
    unfused = _load(None, fuse="0", max_seq_len=256)
    chunked = _load(None, max_seq_len=256, prefill_chunk=5)
    try:
        for text in TEXTS[:3]:
            ids = gpu.tokenizer.encode(text)
            cfg = tl.GenerateConfig(max_tokens=24, loops=4)
            want = tl.generate(gpu, ids, cfg)
            assert tl.generate(unfused, ids, cfg) == want
            assert tl.generate(chunked, ids, cfg) == want
            # the same numerics on every path: the scored logits are equal bit for bit
            np.testing.assert_array_equal(tl.score(unfused, ids, loops=4), tl.score(gpu, ids, loops=4))
    finally:
        tl.free_model(unfused)
        tl.free_model(chunked)


@pytest.mark.parametrize("loops", [1, 3])
def test_q4_logits_match_reference(tmp_path, loops):
    path = tmp_path / "q4.tinyloop"
    write_tiny(path, seed=5, quant="q4", group_size=32)
    gpu = _load(str(path), max_seq_len=128)
    try:
        W = logical_weights(path)
        for p in ([3, 17, 42, 8, 91, 23, 11, 60, 2, 77], [5], list(range(1, 40))):
            ref = reference_logits(gpu.cfg, W, p, loops)
            got = tl.score(gpu, p, loops=loops, cache_mode="fp32")
            assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4
    finally:
        tl.free_model(gpu)
