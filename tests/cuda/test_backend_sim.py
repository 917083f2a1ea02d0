"""The CUDA backend's fused decode path on a very small model, end to end under the CUDA
simulator (or a GPU): fused logits against the CPU backend and against the unfused composites
(``TINYLOOP_CUDA_FUSE=0``), with one block that takes the concatenated q|k|v and gate|up weights
and one whose tensors differ in storage (the per-tensor fallback).

    NUMBA_ENABLE_CUDASIM=1 python -m pytest -m cudasim tests/cuda -q

One-token launches only: the simulator runs every CUDA thread as a Python thread, so this model is
as small as the kernels allow (about a minute).
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

pytestmark = pytest.mark.cudasim

from numba import cuda  # noqa: E402

if not numba.config.ENABLE_CUDASIM and not cuda.is_available():
    pytest.skip("needs NUMBA_ENABLE_CUDASIM=1 (set before numba is imported) or a CUDA GPU",
                allow_module_level=True)

import tinyloop as tl  # noqa: E402
from tinyloop.core.arch import ModelConfig, TensorQuant  # noqa: E402
from tinyloop.core.format import open_model, write_model  # noqa: E402

from conftest import TINY, random_weights  # noqa: E402

SMALL = dict(TINY, vocab_size=32, d_model=32, n_heads=2, n_kv_heads=1, d_ff=16, n_pre=1, n_loop=1,
             n_post=0, default_loops=1)


@pytest.fixture(scope="module")
def small_path(tmp_path_factory):
    cfg = ModelConfig(**SMALL)
    path = tmp_path_factory.mktemp("sim") / "small.tinyloop"
    # pre.0: wk and w_up stored differently from their group -> separate (norm-fused) matmuls
    mixed = {"pre.0.wk": TensorQuant("q8", 16), "pre.0.w_up": TensorQuant("f16")}
    write_model(str(path), cfg, random_weights(cfg, seed=5), quant=mixed,
                default_quant=TensorQuant("q4", 16))
    return path


def test_fused_logits_match_cpu_and_unfused(small_path, monkeypatch):
    monkeypatch.delenv("TINYLOOP_CUDA_FUSE", raising=False)
    cpu = tl.load_model(str(small_path), max_seq_len=8, backend="cpu")
    fused = tl.load_model(str(small_path), max_seq_len=8, backend="cuda")
    monkeypatch.setenv("TINYLOOP_CUDA_FUSE", "0")
    unfused = tl.load_model(str(small_path), max_seq_len=8, backend="cuda")
    try:
        assert fused.backend.fuse and not unfused.backend.fuse
        pre, loop = fused.weights.pre[0], fused.weights.loop[0]
        assert pre.wqkv is None and pre.wgu is None
        assert loop.wqkv is not None and loop.wgu is not None
        # one resident copy: the weights' bytes are the file's (norms are stored as f32)
        with open_model(str(small_path)) as mf:
            assert fused.weights.nbytes == sum(int(a.nbytes) for a in mf.tensors.values())
        assert loop.wq.owner is loop.wqkv and loop.w_up.owner is loop.wgu

        p = [3]
        ref = tl.score(cpu, p, loops=1, cache_mode="fp32")
        got = tl.score(fused, p, loops=1, cache_mode="fp32")
        assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-5
        # The fused norm reproduces rmsnorm's summation order and the concatenated weights give
        # every output row the same reduction: the two paths agree bit for bit here.
        assert np.array_equal(tl.score(unfused, p, loops=1, cache_mode="fp32"), got)
    finally:
        for m in (cpu, fused, unfused):
            tl.free_model(m)


@pytest.mark.slow
def test_device_chained_tree_cycle_matches_cpu(small_path):
    """The tree cycle as the CUDA backend runs it (token ids chained on the device: each level's
    top-K written straight into the next level's id rows, one read-back per cycle) gives the
    tokens of plain greedy decoding, as on the CPU. Slow under the simulator (multi-row launches):
    marked slow, so tools/run_tests.sh leaves it out of the CI simulator run; run it with
    ``NUMBA_ENABLE_CUDASIM=1 pytest -m cudasim tests/cuda/test_backend_sim.py -k tree``."""
    cpu = tl.load_model(str(small_path), max_seq_len=16, backend="cpu")
    gpu = tl.load_model(str(small_path), max_seq_len=16, backend="cuda")
    try:
        assert gpu.backend.chains_on_device and not cpu.backend.chains_on_device
        p = [3]
        ref = tl.generate(cpu, p, tl.GenerateConfig(max_tokens=3, loops=2, cache_mode="fp32"))
        tree = tl.TreeSpeculativeConfig(max_tokens=3, draft_loops=1, verify_loops=2, draft_ahead=1,
                                        K_branches=2, cache_mode="fp32")
        st = tl.GenerateStats()
        assert tl.generate_tree_speculative(gpu, p, tree, stats=st) == ref
        assert st.verify_forwards >= 1 and st.drafted_tokens == 2 * st.verify_forwards
    finally:
        tl.free_model(cpu)
        tl.free_model(gpu)


def test_rope_table_covers_every_cache_and_is_counted():
    """The backend's cos/sin table covers the largest cache a session can ask for (prompt +
    max_tokens <= max_seq_len, plus <= 65 chain-draft or <= max_seq_len tree slots, rounded to a
    power of two) plus the launchers' POSITION_MARGIN, holds rope_table's values, and is counted
    in memory_bytes."""
    from tinyloop.cuda.backend import CUDABackend, round_slots
    from tinyloop.cuda.kernels import rope
    cfg = ModelConfig(**SMALL)
    for max_seq_len in (8, 100, 2048):
        be = CUDABackend(cfg, max_seq_len)
        try:
            P = be.rope_table.shape[0]
            for request in (max_seq_len + 65, 2 * max_seq_len):
                assert P >= round_slots(request) + rope.POSITION_MARGIN
            assert be.memory_bytes() == be.rope_table.nbytes
            assert np.array_equal(be.rope_table.copy_to_host(),
                                  rope.rope_table(cfg.head_dim, cfg.rope_theta, P))
        finally:
            be.free()


def test_split_counters_are_zeroed_with_each_request_cache():
    """The split kernels' arrival counters start at zero and every cache a request takes (new or a
    kept spare) zeroes them again: a launch that failed part-way cannot poison later requests."""
    from tinyloop.cuda.backend import CUDABackend
    be = CUDABackend(ModelConfig(**SMALL), 64)
    try:
        ws = be.alloc_workspace(4)
        counters = (ws.att_count, ws.amax_work[2])
        assert not any(c.copy_to_host().any() for c in counters)
        for _ in range(2):                       # a new cache, then the released one reused
            for c in counters:
                c.copy_to_device(np.full(c.shape, 3, np.int32))
            cache = be.alloc_cache(2, 16, "fp16")
            be.stream.synchronize()
            assert not any(c.copy_to_host().any() for c in counters)
            be.release_cache(cache)
    finally:
        be.free()


def test_greedy_lookahead_matches_plain_greedy(small_path, monkeypatch):
    """greedy(ahead=True) queues the decode step of the token it returns before reading the token
    back (the argmax stays on the device). Tokens and stats equal plain greedy decoding; a step
    nobody advances into (a stop sequence ends the request) is dropped without a trace for the
    next request; the last token of max_tokens is not looked ahead."""
    monkeypatch.delenv("TINYLOOP_LOOKAHEAD", raising=False)
    m = tl.load_model(str(small_path), max_seq_len=8, backend="cuda")
    try:
        calls = []
        begin = m.backend.begin_read_argmax
        monkeypatch.setattr(m.backend, "begin_read_argmax", lambda ws: (calls.append(1), begin(ws)))
        cfg = tl.GenerateConfig(max_tokens=3, loops=1)
        st_a = tl.GenerateStats()
        a = tl.generate_stream(m, [3], cfg, stats=st_a)
        assert len(calls) == 2                  # generated tokens 1 and 2; not the last
        stop = tl.GenerateConfig(max_tokens=3, loops=1, stop_sequences=[[a[1]]])
        st_b = tl.GenerateStats()
        b = tl.generate_stream(m, [3], stop, stats=st_b)
        assert b == a[:2] and st_b.stop_reason == tl.StopReason.STOP_SEQUENCE
        assert len(calls) == 3 and st_b.loop_iters_run == 1   # the dropped step is not counted
        monkeypatch.setenv("TINYLOOP_LOOKAHEAD", "0")
        st_c = tl.GenerateStats()
        c = tl.generate_stream(m, [3], cfg, stats=st_c)
        assert len(calls) == 3 and c == a and st_c.loop_iters_run == st_a.loop_iters_run
        monkeypatch.setenv("TINYLOOP_LOOKAHEAD", "1")
        assert tl.generate(m, [3], cfg) == a and len(calls) == 5
    finally:
        tl.free_model(m)
