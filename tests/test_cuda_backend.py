"""The CUDA backend end to end (marker gpu: run on a machine with a GPU).

CUDA logits match the float64 reference within fp32 tolerance; greedy tokens equal the CPU
backend's; graphs on/off, prefill chunking, the uncached path and the three generate forms give
identical tokens on the GPU. The fused decode path (norm in the matmul, q|k|v and gate|up as one
matmul each) gives the same greedy tokens as the unfused composites (TINYLOOP_CUDA_FUSE=0).

KV cache spec: int8 / int4 caches against the quantizing float64 oracle and the CPU backend's
tokens (a quantized code can flip where CPU and GPU values differ in the last bit, so tokens may
differ only after a near-tie of the oracle's logits); sliding-window rings, wrapping, against the
CPU and the masked oracle."""

from __future__ import annotations

import os

import numpy as np
import pytest

import tinyloop as tl
from tinyloop.runtime.cache import CacheSpec, LayerGroup, SlotMap
from tinyloop.model.reference import reference_logits
from tinyloop.plugins.caches.codecs import FP16Codec, FP32Codec, INT4Codec, INT8Codec

from conftest import logical_weights, write_tiny

pytestmark = pytest.mark.gpu


def _gpu():
    try:
        from numba import cuda
        return cuda.is_available()
    except Exception:
        return False


if not _gpu():
    pytest.skip("no CUDA GPU", allow_module_level=True)


@pytest.fixture(scope="module", params=[("f16", 0), ("q4", 32), ("q8", 16), ("q2", 32)])
def pair(request, tmp_path_factory):
    quant, group = request.param
    path = tmp_path_factory.mktemp("gpu") / f"{quant}.tinyloop"
    write_tiny(path, seed=5, quant=quant, group_size=group)
    cpu = tl.load_model(str(path), max_seq_len=128, backend="cpu")
    gpu = tl.load_model(str(path), max_seq_len=128, backend="cuda")
    yield path, cpu, gpu
    tl.free_model(cpu)
    tl.free_model(gpu)


PROMPTS = [[3, 17, 42, 8, 91, 23, 11, 60, 2, 77], [5], list(range(1, 40))]


@pytest.mark.parametrize("loops", [1, 2, 8])
def test_cuda_logits_match_reference(pair, loops):
    path, _, gpu = pair
    W = logical_weights(path)
    for p in PROMPTS:
        ref = reference_logits(gpu.cfg, W, p, loops)
        got = tl.score(gpu, p, loops=loops, cache_mode="fp32")
        assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4


@pytest.mark.parametrize("loops", [1, 3, 8])
@pytest.mark.parametrize("cache_mode", ["fp16", "fp32"])
def test_greedy_tokens_equal_cpu(pair, loops, cache_mode):
    _, cpu, gpu = pair
    for p in PROMPTS:
        cfg = tl.GenerateConfig(max_tokens=24, loops=loops, cache_mode=cache_mode)
        assert tl.generate(gpu, p, cfg) == tl.generate(cpu, p, cfg)


@pytest.mark.parametrize("cache_mode", ["fp16", "int4"])
def test_long_prompt_rows_form_equals_chunks_and_cpu(pair, cache_mode):
    """A 100-token prompt in one chunk (attention's rows form: ROWS_T rows and more) gives the
    tokens of 8-row chunks (the split blocks) bit for bit, and the CPU's up to a near-tie of the
    float64 oracle (as test_quantized_cache_greedy_tokens_equal_cpu)."""
    path, cpu, gpu = pair
    p = [(7 * i + 3) % 96 + 1 for i in range(100)]
    cfg = tl.GenerateConfig(max_tokens=12, loops=3, cache_mode=cache_mode)
    whole = tl.load_model(str(path), max_seq_len=128, backend="cuda", prefill_chunk=128)
    chunked = tl.load_model(str(path), max_seq_len=128, backend="cuda", prefill_chunk=8)
    try:
        got = tl.generate(whole, p, cfg)
        assert got == tl.generate(chunked, p, cfg)
        _agree(path, gpu.cfg, got, tl.generate(cpu, p, cfg), len(p), 3, cache_mode)
    finally:
        tl.free_model(whole)
        tl.free_model(chunked)


def test_decode_paths_identical_on_gpu(pair, monkeypatch):
    path, _, gpu = pair
    p = PROMPTS[0]
    cfg = tl.GenerateConfig(max_tokens=20, loops=3)
    base = tl.generate(gpu, p, cfg)
    assert tl.generate(gpu, p, cfg) == base                       # replayed graph
    assert tl.generate_stream(gpu, p, cfg, on_token=lambda t, q: True) == base
    assert p + list(tl.generate_iter(gpu, p, cfg)) == base
    chunked = tl.load_model(str(path), max_seq_len=128, backend="cuda", prefill_chunk=3)
    try:
        assert tl.generate(chunked, p, cfg) == base
    finally:
        tl.free_model(chunked)
    monkeypatch.setenv("TINYLOOP_LOOKAHEAD", "0")        # each token read back before its step
    assert tl.generate(gpu, p, cfg) == base
    monkeypatch.delenv("TINYLOOP_LOOKAHEAD")
    monkeypatch.setenv("TINYLOOP_DISABLE_KV_CACHE", "1")
    assert tl.generate(gpu, p, cfg) == base
    monkeypatch.delenv("TINYLOOP_DISABLE_KV_CACHE")
    monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "0")
    eager = tl.load_model(str(path), max_seq_len=128, backend="cuda")
    try:
        assert not eager.backend.use_graphs
        assert tl.generate(eager, p, cfg) == base
    finally:
        tl.free_model(eager)


def _load_cuda(path, fuse: str):
    """A CUDA model loaded with TINYLOOP_CUDA_FUSE=fuse (read by the backend at construction)."""
    old = os.environ.get("TINYLOOP_CUDA_FUSE")
    os.environ["TINYLOOP_CUDA_FUSE"] = fuse
    try:
        return tl.load_model(str(path), max_seq_len=128, backend="cuda")
    finally:
        if old is None:
            del os.environ["TINYLOOP_CUDA_FUSE"]
        else:
            os.environ["TINYLOOP_CUDA_FUSE"] = old


@pytest.fixture(scope="module")
def unfused(pair):
    m = _load_cuda(pair[0], "0")
    assert not m.backend.fuse
    yield m
    tl.free_model(m)


@pytest.mark.parametrize("loops", [1, 3, 8])
def test_fused_and_unfused_match_reference_and_each_other(pair, unfused, loops):
    path, _, gpu = pair
    assert gpu.backend.fuse
    assert all(b.wqkv is not None and b.wgu is not None
               for b in gpu.weights.pre + gpu.weights.loop + gpu.weights.post)
    W = logical_weights(path)
    for p in PROMPTS:
        ref = reference_logits(gpu.cfg, W, p, loops)
        got = tl.score(gpu, p, loops=loops, cache_mode="fp32")
        base = tl.score(unfused, p, loops=loops, cache_mode="fp32")
        scale = np.abs(ref).max()
        assert np.abs(got - ref).max() / scale < 1e-4
        assert np.abs(base - ref).max() / scale < 1e-4
        assert np.abs(got - base).max() / scale < 1e-5
        for cache_mode in ("fp16", "fp32"):
            cfg = tl.GenerateConfig(max_tokens=24, loops=loops, cache_mode=cache_mode)
            assert tl.generate(gpu, p, cfg) == tl.generate(unfused, p, cfg)


def test_fusion_removes_launches(pair):
    """Captured decode step: 7 nodes fewer per block (12 -> 5 launches: norms, q|k|v, gate|up,
    RoPE + KV append and SwiGLU fused into two matmuls) and 1 fewer for the final norm."""
    counts = {}
    for fuse in ("1", "0"):
        m = _load_cuda(pair[0], fuse)
        try:
            tl.generate(m, PROMPTS[0], tl.GenerateConfig(max_tokens=6, loops=2))
            counts[fuse] = m.backend.step_nodes
        finally:
            tl.free_model(m)
    cfg = pair[2].cfg
    blocks = cfg.n_pre + 2 * cfg.n_loop + cfg.n_post
    assert counts["1"] > 0
    assert counts["0"] - counts["1"] == 7 * blocks + 1


def test_graph_is_replayed(pair):
    _, _, gpu = pair
    before = gpu.backend.graph_launches
    tl.generate(gpu, PROMPTS[0], tl.GenerateConfig(max_tokens=10, loops=2))
    assert gpu.backend.graph_launches - before >= 8
    assert gpu.backend.step_nodes > 0


def test_programmatic_edges_same_tokens(pair, monkeypatch):
    """On compute capability >= 9.0 the captured step's kernel -> kernel edges are programmatic
    (kernels/_pdl.py; edges from or to a copy node stay default); TINYLOOP_CUDA_PDL=0 keeps default
    edges. Greedy tokens are the same either way, and the same as eager launches."""
    from tinyloop.cuda.kernels import _pdl
    _, _, gpu = pair
    cfg = tl.GenerateConfig(max_tokens=24, loops=3)
    base = tl.generate(gpu, PROMPTS[1], cfg)
    if _pdl.enabled():
        assert gpu.backend.pdl
        assert 0 < gpu.backend.step_programmatic_edges <= gpu.backend.step_nodes - 1
    monkeypatch.setenv("TINYLOOP_CUDA_PDL", "0")
    plain = tl.load_model(str(pair[0]), max_seq_len=128, backend="cuda")
    try:
        assert not plain.backend.pdl
        assert tl.generate(plain, PROMPTS[1], cfg) == base
        assert plain.backend.step_nodes == gpu.backend.step_nodes
        assert plain.backend.step_programmatic_edges == 0
    finally:
        tl.free_model(plain)
    monkeypatch.setattr(gpu.backend, "use_graphs", False)
    assert tl.generate(gpu, PROMPTS[1], cfg) == base


def test_sampling_same_seed_same_tokens_on_gpu(pair):
    _, _, gpu = pair
    cfg = tl.GenerateConfig(max_tokens=16, temperature=0.9, top_k=20, top_p=0.9, sample_seed=11)
    a = tl.generate(gpu, PROMPTS[0], cfg)
    assert a == tl.generate(gpu, PROMPTS[0], cfg)


SAMPLING_KNOBS = [dict(temperature=0.9, top_k=20, top_p=0.9, sample_seed=11),
                  dict(temperature=1.5, top_k=50, sample_seed=3),
                  dict(temperature=3.0, top_k=1024, top_p=0.97, sample_seed=8),
                  dict(temperature=0.5, top_k=1, sample_seed=2)]


@pytest.mark.parametrize("knobs", SAMPLING_KNOBS)
def test_device_sampling_equals_the_host_draw(pair, knobs, monkeypatch):
    """The on-device draw (captured sampling steps queued ahead) gives the tokens of the host draw
    from the same logits (TINYLOOP_DEVICE_SAMPLING=0) and, where the logits agree as closely as
    greedy needs, the CPU backend's; graphs off, the uncached path and a second request give the
    same; a processor (repetition penalty) keeps the host draw."""
    monkeypatch.delenv("TINYLOOP_DEVICE_SAMPLING", raising=False)
    _, cpu, gpu = pair
    loads = []          # one per request that draws on the device (later draws replay a graph)
    load = gpu.backend.load_sampler
    monkeypatch.setattr(gpu.backend, "load_sampler", lambda *a: (loads.append(1), load(*a)))
    for p in PROMPTS:
        cfg = tl.GenerateConfig(max_tokens=24, loops=3, **knobs)
        got = tl.generate(gpu, p, cfg)
        assert len(loads) == 1 and any(k[0] == "sample_step" for k in gpu.backend._graphs)
        monkeypatch.setenv("TINYLOOP_DEVICE_SAMPLING", "0")
        assert tl.generate(gpu, p, cfg) == got and len(loads) == 1
        monkeypatch.delenv("TINYLOOP_DEVICE_SAMPLING")
        assert tl.generate(gpu, p, cfg) == got
        assert tl.generate(cpu, p, cfg) == got
        loads.clear()
    cfg = tl.GenerateConfig(max_tokens=12, loops=3, **knobs)
    want = tl.generate(cpu, PROMPTS[0], cfg)
    monkeypatch.setenv("TINYLOOP_DISABLE_KV_CACHE", "1")
    assert tl.generate(gpu, PROMPTS[0], cfg) == want
    monkeypatch.delenv("TINYLOOP_DISABLE_KV_CACHE")
    loads.clear()
    pen = tl.GenerateConfig(max_tokens=12, loops=3, repetition_penalty=1.3, **knobs)
    assert tl.generate(gpu, PROMPTS[0], pen) == tl.generate(cpu, PROMPTS[0], pen) and not loads
    monkeypatch.setattr(gpu.backend, "use_graphs", False)
    assert tl.generate(gpu, PROMPTS[0], cfg) == want and len(loads) == 1


def test_device_sampling_stop_sequence_drops_the_queued_step(pair):
    """A stop sequence ends a device-sampled request with a step already queued ahead; the tokens
    equal the CPU's, and the next request draws its own stream from the start."""
    _, cpu, gpu = pair
    cfg = tl.GenerateConfig(max_tokens=16, loops=2, temperature=1.2, top_k=40, sample_seed=5)
    n = len(PROMPTS[0])
    got = tl.generate(gpu, PROMPTS[0], cfg)
    gen = got[n:]
    stop = tl.GenerateConfig(max_tokens=16, loops=2, temperature=1.2, top_k=40, sample_seed=5,
                             stop_sequences=[[gen[5]]])
    cut = got[:n + gen.index(gen[5]) + 1]
    assert tl.generate(gpu, PROMPTS[0], stop) == cut == tl.generate(cpu, PROMPTS[0], stop)
    assert tl.generate(gpu, PROMPTS[0], cfg) == got


def test_vram_usage_counts_weights_pool_and_cache(pair):
    _, _, gpu = pair
    held = tl.vram_usage_bytes(gpu)
    assert held >= gpu.weights.nbytes
    it = tl.generate_iter(gpu, PROMPTS[0], tl.GenerateConfig(max_tokens=4))
    next(it)
    assert tl.vram_usage_bytes(gpu) >= held
    it.close()


def test_demo_model_tokens_equal_cpu():
    from tinyloop.models import demo_model_path
    from tinyloop.model.tokenizer import resolve_tokenizer
    cpu = tl.load_model(demo_model_path(), max_seq_len=256, backend="cpu")
    gpu = tl.load_model(demo_model_path(), max_seq_len=256, backend="cuda")
    try:
        tok = resolve_tokenizer(cpu.header.tokenizer, None, cpu.vocab_size)
        prompts = ["def fibonacci(n):", "import os\n\n\ndef main():", "class Stack:\n    def push(self, x):",
                   "for i in range(10):", "    return self._"]
        for text in prompts:
            ids = tok.encode(text)
            for loops in (1, 4, 8):
                cfg = tl.GenerateConfig(max_tokens=32, loops=loops)
                assert tl.generate(gpu, ids, cfg) == tl.generate(cpu, ids, cfg), (text, loops)
    finally:
        tl.free_model(cpu)
        tl.free_model(gpu)


def test_demo_model_fused_tokens_equal_unfused():
    from tinyloop.models import demo_model_path
    from tinyloop.model.tokenizer import resolve_tokenizer
    fused = _load_cuda(demo_model_path(), "1")
    unfused = _load_cuda(demo_model_path(), "0")
    try:
        tok = resolve_tokenizer(fused.header.tokenizer, None, fused.vocab_size)
        for text in ("def fibonacci(n):", "class Stack:\n    def push(self, x):", "import os\n"):
            ids = tok.encode(text)
            for loops in (1, 4, 8):
                cfg = tl.GenerateConfig(max_tokens=32, loops=loops)
                assert tl.generate(fused, ids, cfg) == tl.generate(unfused, ids, cfg), (text, loops)
    finally:
        tl.free_model(fused)
        tl.free_model(unfused)


def test_oom_is_typed_and_releases(tmp_path):
    path = tmp_path / "m.tinyloop"
    write_tiny(path)
    m = tl.load_model(str(path), max_seq_len=64, backend="cuda")
    try:
        with pytest.raises(tl.OutOfMemoryError):
            m.backend.alloc_cache(CacheSpec((LayerGroup("loop", 1 << 20, "fp32"),), SlotMap(1 << 16), 1))
        assert len(tl.generate(m, [1, 2], tl.GenerateConfig(max_tokens=2))) == 4
    finally:
        tl.free_model(m)


def test_speculative_exact_on_gpu(pair):
    _, cpu, gpu = pair
    p = PROMPTS[0]
    for verify_loops in (3, 6):
        ref = tl.generate(gpu, p, tl.GenerateConfig(max_tokens=24, loops=verify_loops))
        for draft_loops in range(1, verify_loops):
            for draft_ahead in (1, 2, 4, 8):
                for resume in (True, False):
                    cfg = tl.SpeculativeConfig(max_tokens=24, draft_loops=draft_loops, verify_loops=verify_loops,
                                               draft_ahead=draft_ahead, verify_resume=resume)
                    assert tl.generate_speculative(gpu, p, cfg) == ref, (draft_loops, draft_ahead, resume)
    cfg = tl.SpeculativeConfig(max_tokens=24, draft_loops=2, verify_loops=6, draft_ahead=4)
    assert tl.generate_speculative(gpu, p, cfg) == tl.generate_speculative(cpu, p, cfg)
    # a greedy draft cycle (k drafts, the tail and the verify) is one graph launch once captured
    st = tl.GenerateStats()
    before = gpu.backend.graph_launches
    tl.generate_speculative(gpu, p, cfg, stats=st)
    assert gpu.backend.graph_launches - before == st.verify_forwards


def test_speculative_cycles_queued_ahead_on_gpu(pair, monkeypatch):
    """The chain decoder's cycle look-ahead: each greedy cycle's acceptance is decided on the device
    and the next cycle queued before the host reads the record (the two record slots alternate);
    the tokens are plain greedy decoding's, also when a stop sequence drops a queued cycle, with
    the look-ahead off (one slot, the same tokens and launches), and a broken promise (a commit that
    is not the device's acceptance) is a PluginError."""
    from tinyloop.plugins.decoders.spec_session import speculative_request
    from tinyloop.runtime.engine import Plan
    _, _, gpu = pair
    be = gpu.backend
    reads = []
    finish = be.finish_read_cycle
    monkeypatch.setattr(be, "finish_read_cycle", lambda ws, k, slot, branches=1: reads.append(slot) or finish(
        ws, k, slot, branches))
    for p in PROMPTS:
        ref = tl.generate(gpu, p, tl.GenerateConfig(max_tokens=40, loops=6))
        for k in (1, 4, 8):
            cfg = tl.SpeculativeConfig(max_tokens=40, draft_loops=2, verify_loops=6, draft_ahead=k)
            assert tl.generate_speculative(gpu, p, cfg) == ref, (p, k)      # captures the cycle's graph
            reads.clear()
            st = tl.GenerateStats()
            before = be.graph_launches
            assert tl.generate_speculative(gpu, p, cfg, stats=st) == ref, (p, k)
            # one graph per cycle (and a one-token prompt's prefill step), none queued in vain
            assert len(reads) == st.verify_forwards == be.graph_launches - before - (len(p) == 1)
            assert set(reads) == {0, 1}
            stop = ref[len(p) + 12:len(p) + 14]
            want = tl.generate(gpu, p, tl.GenerateConfig(max_tokens=40, loops=6, stop_sequences=[stop]))
            cut = tl.SpeculativeConfig(max_tokens=40, draft_loops=2, verify_loops=6, draft_ahead=k,
                                       stop_sequences=[stop])
            assert tl.generate_speculative(gpu, p, cut) == want
            assert tl.generate_speculative(gpu, p, cfg) == ref
    monkeypatch.setenv("TINYLOOP_LOOKAHEAD", "0")
    reads.clear()
    cfg = tl.SpeculativeConfig(max_tokens=40, draft_loops=2, verify_loops=6, draft_ahead=4)
    assert tl.generate_speculative(gpu, PROMPTS[0], cfg) == tl.generate(gpu, PROMPTS[0], tl.GenerateConfig(
        max_tokens=40, loops=6))
    assert set(reads) == {0}
    monkeypatch.delenv("TINYLOOP_LOOKAHEAD")
    plan = Plan(gpu, speculative_request(cfg, tree=False), "single")
    plan.delegate()
    chain = plan.new_processors()
    chain.reset(PROMPTS[0])
    sess = plan.session_factory(gpu, list(PROMPTS[0]), plan, chain, tl.GenerateStats())
    try:
        sess.start()
        drafts, verified = sess.draft_cycle(sess.greedy(), 4, ahead=True)
        n = next((i for i in range(4) if drafts[i] != verified[i]), 4)
        with pytest.raises(tl.PluginError, match="promise"):
            sess.commit(n - 1 if n else n + 1)
    finally:
        sess.close()
    assert tl.generate_speculative(gpu, PROMPTS[0], cfg) == tl.generate(gpu, PROMPTS[0], tl.GenerateConfig(
        max_tokens=40, loops=6))


def test_speculative_demo_model_exact_on_gpu():
    from tinyloop.models import demo_model_path
    from tinyloop.model.tokenizer import resolve_tokenizer
    gpu = tl.load_model(demo_model_path(), max_seq_len=256, backend="cuda")
    try:
        tok = resolve_tokenizer(gpu.header.tokenizer, None, gpu.vocab_size)
        for text in ("def fibonacci(n):", "class Stack:\n    def push(self, x):", "import os\n"):
            ids = tok.encode(text)
            for verify_loops in (4, 8):
                ref = tl.generate(gpu, ids, tl.GenerateConfig(max_tokens=48, loops=verify_loops))
                for draft_loops, draft_ahead in ((1, 3), (2, 4), (3, 8)):
                    cfg = tl.SpeculativeConfig(max_tokens=48, draft_loops=draft_loops, verify_loops=verify_loops,
                                               draft_ahead=draft_ahead)
                    assert tl.generate_speculative(gpu, ids, cfg) == ref
    finally:
        tl.free_model(gpu)


def test_tree_speculative_exact_on_gpu(pair, monkeypatch):
    _, cpu, gpu = pair
    p = PROMPTS[0]
    for verify_loops in (3, 6):
        ref = tl.generate(gpu, p, tl.GenerateConfig(max_tokens=24, loops=verify_loops))
        for K in (1, 2, 3, 4):
            for D in (1, 2, 3):
                for draft_loops, resume in ((1, True), (verify_loops - 1, True), (2, False)):
                    cfg = tl.TreeSpeculativeConfig(max_tokens=24, draft_loops=draft_loops, verify_loops=verify_loops,
                                                   draft_ahead=D, K_branches=K, verify_resume=resume)
                    assert tl.generate_tree_speculative(gpu, p, cfg) == ref, (K, D, draft_loops, resume)
    cfg = tl.TreeSpeculativeConfig(max_tokens=24, draft_loops=2, verify_loops=6, draft_ahead=3, K_branches=3)
    st_gpu, st_cpu = tl.GenerateStats(), tl.GenerateStats()
    assert tl.generate_tree_speculative(gpu, p, cfg, stats=st_gpu) == tl.generate_tree_speculative(
        cpu, p, cfg, stats=st_cpu)
    monkeypatch.setattr(gpu.backend, "use_graphs", False)
    assert tl.generate_tree_speculative(gpu, p, cfg) == tl.generate(cpu, p, tl.GenerateConfig(max_tokens=24, loops=6))


def test_tree_cycles_queued_ahead_on_gpu(pair, monkeypatch):
    """The tree decoder's cycle look-ahead: the greedy walk is decided on the device, the accepted
    path's cache slots are compacted there (every cache codec: codes, scales and zero points move),
    and the next cycle is queued before the host reads the record; the tokens are plain greedy
    decoding's, with a stop sequence dropping a queued cycle, and with the look-ahead off."""
    _, _, gpu = pair
    be = gpu.backend
    reads, moved = [], []
    finish, move = be.finish_read_cycle, be.move_cache_slots
    monkeypatch.setattr(be, "finish_read_cycle", lambda ws, k, slot, branches=1: reads.append(slot) or finish(
        ws, k, slot, branches))
    monkeypatch.setattr(be, "move_cache_slots", lambda cache, moves: moved.append(moves) or move(cache, moves))
    for p in PROMPTS:
        for cache_mode in ("fp16", "fp32", "int8", "int4"):
            ref = tl.generate(gpu, p, tl.GenerateConfig(max_tokens=40, loops=6, cache_mode=cache_mode))
            for K, D in ((2, 2), (3, 3), (4, 1), (1, 3)):
                cfg = tl.TreeSpeculativeConfig(max_tokens=40, draft_loops=2, verify_loops=6, draft_ahead=D,
                                               K_branches=K, cache_mode=cache_mode)
                reads.clear()
                st = tl.GenerateStats()
                assert tl.generate_tree_speculative(gpu, p, cfg, stats=st) == ref, (p, cache_mode, K, D)
                assert len(reads) == st.verify_forwards and set(reads) == {0, 1}
                assert not moved                                 # the device compacted every path
            stop = ref[len(p) + 9:len(p) + 11]
            want = tl.generate(gpu, p, tl.GenerateConfig(max_tokens=40, loops=6, cache_mode=cache_mode,
                                                         stop_sequences=[stop]))
            cut = tl.TreeSpeculativeConfig(max_tokens=40, draft_loops=2, verify_loops=6, draft_ahead=2, K_branches=2,
                                           cache_mode=cache_mode, stop_sequences=[stop])
            assert tl.generate_tree_speculative(gpu, p, cut) == want
    monkeypatch.setenv("TINYLOOP_LOOKAHEAD", "0")
    reads.clear()
    cfg = tl.TreeSpeculativeConfig(max_tokens=40, draft_loops=2, verify_loops=6, draft_ahead=2, K_branches=2)
    assert tl.generate_tree_speculative(gpu, PROMPTS[0], cfg) == tl.generate(gpu, PROMPTS[0], tl.GenerateConfig(
        max_tokens=40, loops=6))
    assert set(reads) == {0} and not moved


def test_tree_speculative_demo_model_exact_on_gpu():
    from tinyloop.models import demo_model_path
    from tinyloop.model.tokenizer import resolve_tokenizer
    gpu = tl.load_model(demo_model_path(), max_seq_len=256, backend="cuda")
    try:
        tok = resolve_tokenizer(gpu.header.tokenizer, None, gpu.vocab_size)
        texts = ("def fibonacci(n):", "class Stack:\n    def push(self, x):", "import os\n",
                 "for i in range(10):\n    ", "    return self._", "if __name__ == '__main__':\n")
        for text in texts:
            ids = tok.encode(text)
            for verify_loops in (4, 8):
                ref = tl.generate(gpu, ids, tl.GenerateConfig(max_tokens=48, loops=verify_loops))
                for K, D, draft_loops in ((1, 4, 2), (2, 2, 2), (3, 3, 1), (4, 2, 3)):
                    cfg = tl.TreeSpeculativeConfig(max_tokens=48, draft_loops=draft_loops, verify_loops=verify_loops,
                                                   draft_ahead=D, K_branches=K)
                    assert tl.generate_tree_speculative(gpu, ids, cfg) == ref, (text, K, D, draft_loops)
    finally:
        tl.free_model(gpu)


def test_speculative_and_tree_sampling_on_gpu(pair):
    """Speculative and tree sampling run on the GPU, are reproducible per seed, and draw from the
    verify depth's distribution: with top_k=1 that is its argmax, so the tokens equal greedy's."""
    _, cpu, gpu = pair
    p = PROMPTS[0]
    for cfg in (tl.SpeculativeConfig(max_tokens=16, draft_loops=1, verify_loops=4, draft_ahead=3, temperature=0.9,
                                     seed=3),
                tl.TreeSpeculativeConfig(max_tokens=16, draft_loops=1, verify_loops=4, draft_ahead=2, K_branches=2,
                                         temperature=0.9, seed=3)):
        fn = tl.generate_tree_speculative if isinstance(cfg, tl.TreeSpeculativeConfig) else tl.generate_speculative
        a = fn(gpu, p, cfg)
        assert a == fn(gpu, p, cfg) and len(a) == len(p) + 16
    ref = tl.generate(gpu, p, tl.GenerateConfig(max_tokens=16, loops=4))
    for fn, cfg in ((tl.generate_speculative, tl.SpeculativeConfig(
            max_tokens=16, draft_loops=1, verify_loops=4, draft_ahead=3, temperature=0.9, top_k=1, seed=3)),
            (tl.generate_tree_speculative, tl.TreeSpeculativeConfig(
                max_tokens=16, draft_loops=1, verify_loops=4, draft_ahead=2, K_branches=2, temperature=0.9, top_k=1,
                seed=3))):
        assert fn(gpu, p, cfg) == ref


# ----------------------------------------------------------------------------- the KV cache spec
CODECS = {"fp32": FP32Codec, "fp16": FP16Codec, "int8": INT8Codec, "int4": INT4Codec}


def _agree(path, cfg, got, want, n_prompt, loops, cache_mode, window=0, margin=1e-2):
    """got == want, or they part at a step where the float64 oracle (with the cache's codec and
    window) has a near-tie at the top (relative top-2 margin below `margin`): a quantized code may
    flip where the two backends' values differ in the last bit."""
    if got == want:
        return
    assert len(got) == len(want)
    i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    assert i >= n_prompt
    ref = reference_logits(cfg, logical_weights(path), want[:i], loops, kv_codec=CODECS[cache_mode],
                           window=window)[-1]
    top2 = np.sort(ref)[-2:]
    assert top2[1] - top2[0] < margin * np.abs(ref).max(), (i, got, want)


@pytest.mark.parametrize("cache_mode", ["int8", "int4"])
@pytest.mark.parametrize("loops", [1, 3, 8])
def test_quantized_cache_logits_match_the_quantizing_oracle(pair, loops, cache_mode):
    """int8 / int4 caches against the float64 oracle that stores K/V through the same codec (the
    CPU backend's tolerance, tests/test_kv_cache.py), and against the CPU backend."""
    path, cpu, gpu = pair
    W = logical_weights(path)
    for p in PROMPTS:
        ref = reference_logits(gpu.cfg, W, p, loops, kv_codec=CODECS[cache_mode])
        got = tl.score(gpu, p, loops=loops, cache_mode=cache_mode)
        scale = np.abs(ref).max()
        assert np.abs(got - ref).max() / scale < 1e-3
        assert np.abs(got - tl.score(cpu, p, loops=loops, cache_mode=cache_mode)).max() / scale < 1e-3


@pytest.mark.parametrize("cache_mode", ["int8", "int4"])
@pytest.mark.parametrize("loops", [1, 3, 8])
def test_quantized_cache_greedy_tokens_equal_cpu(pair, loops, cache_mode):
    path, cpu, gpu = pair
    for p in PROMPTS:
        cfg = tl.GenerateConfig(max_tokens=24, loops=loops, cache_mode=cache_mode)
        _agree(path, gpu.cfg, tl.generate(gpu, p, cfg), tl.generate(cpu, p, cfg), len(p), loops, cache_mode)


@pytest.mark.parametrize("cache_mode", ["int8", "int4"])
def test_quantized_cache_fused_unfused_graphs_and_chunks(pair, unfused, cache_mode, monkeypatch):
    """A quantized cache through the staging epilogue + kv_store (fused) and through rope +
    kv_store (unfused), captured or eager, chunked prefill: the same tokens."""
    path, _, gpu = pair
    p = PROMPTS[2]
    cfg = tl.GenerateConfig(max_tokens=24, loops=3, cache_mode=cache_mode)
    base = tl.generate(gpu, p, cfg)
    assert tl.generate(gpu, p, cfg) == base                       # replayed graph
    _agree(path, gpu.cfg, tl.generate(unfused, p, cfg), base, len(p), 3, cache_mode)
    chunked = tl.load_model(str(path), max_seq_len=128, backend="cuda", prefill_chunk=3)
    try:
        assert tl.generate(chunked, p, cfg) == base               # kv_store is batch-invariant
    finally:
        tl.free_model(chunked)
    monkeypatch.setattr(gpu.backend, "use_graphs", False)
    assert tl.generate(gpu, p, cfg) == base


def test_quantized_cache_adds_one_launch_per_block(pair):
    """The int8 decode step: one kv_store launch per executed block more than fp16's (each counted
    on a fresh model, so the step is captured by this request)."""
    nodes = {}
    for mode in ("fp16", "int8"):
        m = tl.load_model(str(pair[0]), max_seq_len=128, backend="cuda")
        try:
            tl.generate(m, PROMPTS[0], tl.GenerateConfig(max_tokens=6, loops=2, cache_mode=mode))
            nodes[mode] = m.backend.step_nodes
        finally:
            tl.free_model(m)
    cfg = pair[2].cfg
    assert nodes["fp16"] > 0
    assert nodes["int8"] - nodes["fp16"] == cfg.n_pre + 2 * cfg.n_loop + cfg.n_post


@pytest.fixture
def small_rings(monkeypatch):
    """Rings of exactly the slots the session asks for (the backend's rounding off for rings), so a
    short generation wraps them."""
    from tinyloop.cuda import backend as cb
    real = cb.round_slots
    monkeypatch.setattr(cb, "round_slots", lambda n, window=0: n if window else real(n))


@pytest.mark.parametrize("window", [1, 5, 16])
@pytest.mark.parametrize("cache_mode", ["fp16", "fp32", "int8", "int4"])
def test_window_generation_equals_cpu_and_masked_oracle(pair, small_rings, window, cache_mode):
    """Sliding-window rings (W + launch rows - 1 slots, wrapping many times over 24 tokens): the
    CPU backend's tokens, and the masked oracle's argmax wherever its margin is clear; chunked
    prefill gives the same tokens."""
    path, cpu, gpu = pair
    W = logical_weights(path)
    for p in PROMPTS:
        cfg = tl.GenerateConfig(max_tokens=24, loops=3, cache_mode=cache_mode, cache_window=window)
        got = tl.generate(gpu, p, cfg)
        _agree(path, gpu.cfg, got, tl.generate(cpu, p, cfg), len(p), 3, cache_mode, window)
        ref = reference_logits(gpu.cfg, W, got[:-1], 3, kv_codec=CODECS[cache_mode], window=window)
        for i in range(len(p) - 1, len(got) - 1):
            top2 = np.sort(ref[i])[-2:]
            if top2[1] - top2[0] < 1e-3 * np.abs(ref[i]).max():
                break
            assert int(ref[i].argmax()) == got[i + 1], (i, window)
    chunked = tl.load_model(str(path), max_seq_len=128, backend="cuda", prefill_chunk=3)
    try:
        cfg = tl.GenerateConfig(max_tokens=24, loops=3, cache_mode=cache_mode, cache_window=window)
        assert tl.generate(chunked, PROMPTS[2], cfg) == tl.generate(gpu, PROMPTS[2], cfg)
    finally:
        tl.free_model(chunked)


def test_window_speculative_on_gpu(pair, small_rings):
    """Speculative decoding over a ring (verify launches of draft_ahead + 1 rows): the tokens of
    plain windowed greedy decoding."""
    import warnings
    from tinyloop.runtime.compat import CompatWarning
    _, _, gpu = pair
    p = PROMPTS[0]
    ref = tl.generate(gpu, p, tl.GenerateConfig(max_tokens=24, loops=4, cache_window=6))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompatWarning)
        got = tl.generate_speculative(gpu, p, tl.SpeculativeConfig(
            max_tokens=24, draft_loops=2, verify_loops=4, draft_ahead=3, cache_window=6))
    assert got == ref
