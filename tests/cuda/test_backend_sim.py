"""The CUDA backend's fused decode path on a very small model, end to end under the CUDA
simulator (or a GPU): fused logits against the CPU backend and against the unfused composites
(``TINYLOOP_CUDA_FUSE=0``), with one block that takes the concatenated q|k|v and gate|up weights
and one whose tensors differ in storage (the per-tensor fallback).

    NUMBA_ENABLE_CUDASIM=1 python -m pytest -m cudasim tests/cuda -q

The KV cache as a spec (alloc_cache(spec)): storage per layer group and codec, spare reuse, the
typed refusal of codecs without a CUDA implementation, copies and slot moves of every storage
array; int8 / int4 / ring caches through the fused and unfused paths.

One-token launches only (apart from the short prompts of the codec tests): the simulator runs
every CUDA thread as a Python thread, so this model is as small as the kernels allow.
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
from tinyloop.model.arch import ModelConfig, TensorQuant  # noqa: E402
from tinyloop.runtime.backend import TreeRows  # noqa: E402
from tinyloop.runtime.cache import CacheSpec, KVCodec, LayerGroup, SlotMap  # noqa: E402
from tinyloop.errors import BackendError, PluginError  # noqa: E402
from tinyloop.model.format import open_model, write_model  # noqa: E402
from tinyloop.runtime.plugins import get_plugin_manager  # noqa: E402

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


@pytest.fixture
def small_pair(small_path):
    """The small model on the CPU and on the CUDA backend (max_seq_len 16)."""
    cpu = tl.load_model(str(small_path), max_seq_len=16, backend="cpu")
    gpu = tl.load_model(str(small_path), max_seq_len=16, backend="cuda")
    yield cpu, gpu
    tl.free_model(cpu)
    tl.free_model(gpu)


@pytest.mark.slow
def test_device_chained_tree_cycle_matches_cpu(small_pair):
    """The tree cycle as the CUDA backend runs it (token ids chained on the device: each level's
    top-K written straight into the next level's id rows, one read-back per cycle) gives the
    tokens of plain greedy decoding, as on the CPU. Slow under the simulator (multi-row launches):
    marked slow, so tools/run_tests.sh leaves it out of the CI simulator run; run it with
    ``NUMBA_ENABLE_CUDASIM=1 pytest -m cudasim tests/cuda/test_backend_sim.py -k tree``."""
    cpu, gpu = small_pair
    assert gpu.backend.supports("device_chaining") and not cpu.backend.supports("device_chaining")
    p = [3]
    ref = tl.generate(cpu, p, tl.GenerateConfig(max_tokens=3, loops=2, cache_mode="fp32"))
    tree = tl.TreeSpeculativeConfig(max_tokens=3, draft_loops=1, verify_loops=2, draft_ahead=1,
                                    K_branches=2, cache_mode="fp32")
    st = tl.GenerateStats()
    assert tl.generate_tree_speculative(gpu, p, tree, stats=st) == ref
    assert st.verify_forwards >= 1 and st.drafted_tokens == 2 * st.verify_forwards


@pytest.mark.slow
def test_chain_cycles_queued_ahead_match_cpu(small_pair, monkeypatch):
    """The chain and tree decoders on the CUDA backend with the cycle look-ahead (each cycle's
    acceptance decided on the device, a tree's path compacted there, and the next cycle queued
    before the host reads it) give plain greedy decoding's tokens, as on the CPU, with and without
    the look-ahead (TINYLOOP_LOOKAHEAD=0).
    Slow under the simulator (~8 minutes: multi-row launches); run it with
    ``NUMBA_ENABLE_CUDASIM=1 pytest -m cudasim tests/cuda/test_backend_sim.py -k ahead``."""
    cpu, gpu = small_pair
    assert gpu.backend.supports("device_acceptance") and not cpu.backend.supports("device_acceptance")
    p = [3]
    ref = tl.generate(cpu, p, tl.GenerateConfig(max_tokens=6, loops=2, cache_mode="fp32"))
    spec = tl.SpeculativeConfig(max_tokens=6, draft_loops=1, verify_loops=2, draft_ahead=1, cache_mode="fp32")
    st = tl.GenerateStats()
    assert tl.generate_speculative(gpu, p, spec, stats=st) == ref
    assert st.verify_forwards >= 2 and st.drafted_tokens == st.verify_forwards
    tree = tl.TreeSpeculativeConfig(max_tokens=6, draft_loops=1, verify_loops=2, draft_ahead=1, K_branches=2,
                                    cache_mode="fp32")
    assert tl.generate_tree_speculative(gpu, p, tree) == ref
    monkeypatch.setenv("TINYLOOP_LOOKAHEAD", "0")
    assert tl.generate_speculative(gpu, p, spec) == ref
    assert tl.generate_tree_speculative(gpu, p, tree) == ref


@pytest.mark.slow
def test_lockstep_batch_with_device_chaining_matches_cpu(small_path):
    """generate_batch on the CUDA backend (lanes as tree rows, the greedy look-ahead chaining each
    step's argmax rows into the next step's ids and advancing the lanes' positions on the device)
    gives every lane the tokens of generate on the CPU; a lane that stops early (max_tokens is
    shared, so by a stop sequence) drops out of the launch; the lanes' prompt rows are packed
    into binary pieces as with graphs (3 rows = 2 + 1). Slow under the simulator; run it with
    ``NUMBA_ENABLE_CUDASIM=1 pytest -m cudasim tests/cuda/test_backend_sim.py -k lockstep``."""
    cpu = tl.load_model(str(small_path), max_seq_len=12, backend="cpu")
    gpu = tl.load_model(str(small_path), max_seq_len=12, backend="cuda")
    gpu.backend.split_rows = True
    try:
        prompts = [[3, 4], [5], [6, 7, 8]]
        cfg = tl.GenerateConfig(max_tokens=4, loops=1, cache_mode="fp32")
        want = [tl.generate(cpu, p, cfg) for p in prompts]
        stats = []
        assert tl.generate_batch(gpu, prompts, cfg, stats=stats) == want
        assert [s.batch_lanes for s in stats] == [3, 3, 3]
        stop = tl.GenerateConfig(max_tokens=4, loops=1, cache_mode="fp32", stop_sequences=((want[1][2],),))
        assert tl.generate_batch(gpu, prompts, stop) == [tl.generate(cpu, p, stop) for p in prompts]
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


def test_positions_are_checked_against_the_rope_table():
    """A ring's positions pass its slots, so the backend checks each uploaded position against its
    RoPE table (the launchers can only check a linear cache's slots)."""
    from tinyloop.cuda.backend import CUDABackend
    from tinyloop.cuda.kernels import rope
    be = CUDABackend(ModelConfig(**SMALL), 8)
    try:
        last = be.rope_table.shape[0] - rope.POSITION_MARGIN
        assert be.positions(last - 1) is be.pos
        for bad in (last, -1):
            with pytest.raises(BackendError, match=f"position {bad} is outside"):
                be.positions(bad)
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
            cache = be.alloc_cache(_spec({"pre": ("fp16", 1), "loop": ("fp16", 1)}, 16))
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


def test_sampling_draws_on_the_device(small_path, monkeypatch):
    """Sampling on the CUDA backend draws where the logits live (load_sampler once, then one draw
    per forward, the steps queued ahead like greedy ones): the tokens equal the same backend's
    host draw (TINYLOOP_DEVICE_SAMPLING=0: the same logits) and the CPU backend's. (More knobs,
    seeds, stops and processors: tests/test_cuda_backend.py on a GPU; the simulator is slow.)"""
    monkeypatch.delenv("TINYLOOP_LOOKAHEAD", raising=False)
    monkeypatch.delenv("TINYLOOP_DEVICE_SAMPLING", raising=False)
    cpu = tl.load_model(str(small_path), max_seq_len=8, backend="cpu")
    m = tl.load_model(str(small_path), max_seq_len=8, backend="cuda")
    try:
        loads, draws, ahead = [], [], []
        load, draw, begin = m.backend.load_sampler, m.backend.launch_sample, m.backend.begin_read_argmax
        monkeypatch.setattr(m.backend, "load_sampler", lambda *a: (loads.append(a[4].shape[0]), load(*a)))
        monkeypatch.setattr(m.backend, "launch_sample", lambda *a: (draws.append(1), draw(*a)))
        monkeypatch.setattr(m.backend, "begin_read_argmax", lambda ws: (ahead.append(1), begin(ws)))
        cfg = tl.GenerateConfig(max_tokens=3, loops=1, temperature=2.5, top_k=24, top_p=0.9, sample_seed=4)
        got = tl.generate(m, [3, 7], cfg)
        assert loads == [3] and len(draws) == 3 and len(ahead) == 2   # the last token not ahead
        monkeypatch.setenv("TINYLOOP_DEVICE_SAMPLING", "0")
        assert tl.generate(m, [3, 7], cfg) == got and len(draws) == 3
        assert tl.generate(cpu, [3, 7], cfg) == got
    finally:
        tl.free_model(m)
        tl.free_model(cpu)


class NoMultipleOfLast(tl.LogitProcessor):
    """A stateful mask (as a grammar is): after token t, tokens u with (u + t) % 3 == 0 are
    forbidden. ``mask_only``: greedy paths apply allowed_words where the logits live."""

    name = "test_no_multiple_of_last"
    stage = tl.Stage.MASK
    mask_only = True
    on = False

    @classmethod
    def from_config(cls, config):
        return cls() if cls.on else None

    def prepare(self, model):
        self.V = model.cfg.vocab_size

    def reset(self, prompt):
        self.last = prompt[-1]

    def accept(self, token):
        self.last = token

    def allowed_words(self):
        ok = (np.arange(self.V) + self.last) % 3 != 0
        return np.packbits(np.pad(ok, (0, -self.V % 32)), bitorder="little").view(np.int32)

    def apply(self, logits):
        logits[(np.arange(self.V) + self.last) % 3 == 0] = -np.inf

    def clone(self):
        c = NoMultipleOfLast()
        c.V, c.last = self.V, self.last
        return c


class _MaskPlugin:
    @tl.hookimpl
    def tinyloop_processors(self):
        return [NoMultipleOfLast]


def test_masked_greedy_stays_on_the_device(small_path, monkeypatch):
    """A mask-only processor (a grammar's kind) keeps greedy decoding on the device path: the mask
    goes up (launch_masked_argmax), the decode step is still queued ahead of the token's read-back,
    and the tokens equal the CPU backend's and the host path's (logits copied and masked on the host)."""
    monkeypatch.delenv("TINYLOOP_LOOKAHEAD", raising=False)
    pm = get_plugin_manager()
    plugin = _MaskPlugin()
    pm.register(plugin)
    monkeypatch.setattr(NoMultipleOfLast, "on", True)
    cpu = tl.load_model(str(small_path), max_seq_len=8, backend="cpu")
    m = tl.load_model(str(small_path), max_seq_len=8, backend="cuda")
    try:
        cfg = tl.GenerateConfig(max_tokens=3, loops=1)
        want = tl.generate(cpu, [3, 7], cfg)
        for a, b in zip(want[1:], want[2:]):
            assert (a + b) % 3 != 0
        calls = []
        begin, mask = m.backend.begin_read_argmax, m.backend.launch_masked_argmax
        monkeypatch.setattr(m.backend, "begin_read_argmax", lambda ws: (calls.append("ahead"), begin(ws)))
        monkeypatch.setattr(m.backend, "launch_masked_argmax", lambda ws, w: (calls.append("mask"), mask(ws, w)))
        assert tl.generate(m, [3, 7], cfg) == want       # the host path's tokens: tests/test_grammar.py
        assert calls.count("mask") == 3 and calls.count("ahead") == 2
    finally:
        pm.unregister(plugin)
        tl.free_model(m)
        tl.free_model(cpu)


# ----------------------------------------------------------------------------- the cache spec
def _spec(groups, n_slots, window=0, n_loop=1):
    """A CacheSpec of {name: (codec, n_layers)} groups (in the given order)."""
    return CacheSpec(tuple(LayerGroup(n, k, c) for n, (c, k) in groups.items()),
                     SlotMap(n_slots, window), n_loop)


MIXED = {"pre": ("fp16", 1), "post": ("int8", 1), "loop": ("int4", 2)}


def test_alloc_cache_lays_out_the_spec_and_reuses_spares():
    from tinyloop.cuda.backend import CUDABackend
    cfg = ModelConfig(**SMALL)
    be = CUDABackend(cfg, 64)
    try:
        base = be.memory_bytes()
        spec = _spec(MIXED, 20)
        c = be.alloc_cache(spec)
        assert c.n_slots == c.spec.n_slots == 128 and c.spec.groups == spec.groups
        assert c.spec.slots == SlotMap(128, 0)
        Hk, hd = cfg.n_kv_heads, cfg.head_dim
        want = {"fp16": (np.float16, hd, False, False), "int8": (np.int8, hd, True, False),
                "int4": (np.uint8, hd // 2, True, True)}
        for g, lg in zip(c.groups, spec.groups):
            dt, cols, has_s, has_z = want[lg.codec]
            for rows in (g.k, g.v):
                assert rows.data.dtype == dt and rows.data.shape == (lg.n_layers, 128, Hk, cols)
                assert (rows.scale is not None) == has_s and (rows.zero is not None) == has_z
                for a in rows.arrays:
                    assert not a.copy_to_host().any()
                if has_s:
                    assert rows.scale.shape == (lg.n_layers, 128, Hk) and rows.scale.dtype == np.float32
        codecs = get_plugin_manager().kv_codecs()
        assert c.nbytes == c.spec.nbytes(Hk, hd, codecs)
        # global layers resolve to (group, layer in the group)
        assert c.group(0)[0].name == "pre" and c.group(3) == (c.groups[2], 1)
        for a in c.arrays:
            a.copy_to_device(np.ones(a.shape, a.dtype))
        be.release_cache(c)
        assert be.memory_bytes() == base + c.nbytes
        again = be.alloc_cache(_spec(MIXED, 100))
        assert again is c and not any(a.copy_to_host().any() for a in c.arrays)
        be.release_cache(c)
        # another window, another codec layout or more slots than the spare has: a new cache
        ring = be.alloc_cache(_spec(MIXED, 20, window=8))
        assert ring is not c and ring.window == 8 and ring.spec.slots == SlotMap(128, 8)
        assert be.alloc_cache(_spec({**MIXED, "post": ("fp32", 1)}, 20)) is not c
        assert be.alloc_cache(_spec(MIXED, 129)) is not c
        big_ring = be.alloc_cache(_spec(MIXED, 200, window=150))
        assert big_ring.n_slots == 256          # a ring rounds to a multiple of 128 only
    finally:
        be.free()


def test_alloc_cache_refuses_codecs_without_a_cuda_implementation(monkeypatch):
    """An unknown codec, one without a cuda implementation and one whose implementation stores
    another format: PluginError before anything is allocated."""
    from tinyloop.cuda import backend as cb

    class CPUOnly(KVCodec):
        name = "cpu_only"
        backend_impls = {"cpu": "tinyloop.cpu.kv_codecs:FP32"}

    class Mislabelled(KVCodec):
        name = "mislabelled"
        data_dtype = "float16"
        backend_impls = {"cuda": "tinyloop.cuda.kv_codecs:INT8"}

    class Missing(KVCodec):
        name = "missing"
        backend_impls = {"cuda": "tinyloop.cuda.kv_codecs:NOPE"}

    extra = {c.name: c for c in (CPUOnly, Mislabelled, Missing)}
    real = cb._codec_class
    monkeypatch.setattr(cb, "_codec_class", lambda name: extra[name] if name in extra else real(name))
    be = cb.CUDABackend(ModelConfig(**SMALL), 64)
    try:
        def no_alloc(*a, **k):
            raise AssertionError("allocated before the codecs were resolved")
        monkeypatch.setattr(be, "_empty", no_alloc)
        for codec, msg in (("nope", "'nope' is not registered"),
                           ("cpu_only", "no implementation for the cuda backend"),
                           ("mislabelled", "does not store its format"),
                           ("missing", "cannot import its cuda implementation")):
            with pytest.raises(PluginError, match=msg):
                be.alloc_cache(_spec({"pre": ("fp16", 1), "loop": (codec, 1)}, 16))
    finally:
        be.free()


def test_copy_cache_and_move_slots_cover_scales_and_zeros():
    from tinyloop.cuda.backend import CUDABackend
    be = CUDABackend(ModelConfig(**SMALL), 64)
    try:
        be.alloc_workspace(4)
        rng = np.random.default_rng(3)
        a = be.alloc_cache(_spec(MIXED, 16))
        b = be.alloc_cache(_spec(MIXED, 16))
        for arr in a.arrays:
            arr.copy_to_device((rng.standard_normal(arr.shape) * 50).astype(arr.dtype))
        be.copy_cache(b, a, 5)
        for x, y in zip(a.arrays, b.arrays):
            assert np.array_equal(x.copy_to_host(), y.copy_to_host())
        before = [x.copy_to_host() for x in a.arrays]
        moves = [(7, 5), (5, 6)]
        be.move_cache_slots(a, moves)
        for x, want in zip(a.arrays, before):
            for s_, d_ in moves:
                want[:, d_] = want[:, s_]
            assert np.array_equal(x.copy_to_host(), want)
        with pytest.raises(BackendError, match="copy_cache"):
            be.copy_cache(be.alloc_cache(_spec({**MIXED, "loop": ("int8", 2)}, 16)), a, 5)
        with pytest.raises(BackendError, match="copy_cache"):
            be.copy_cache(be.alloc_cache(_spec(MIXED, 16, window=4)), a, 5)
    finally:
        be.free()


def test_tree_rows_are_refused_on_a_ring(small_path):
    m = tl.load_model(str(small_path), max_seq_len=8, backend="cuda")
    try:
        be = m.backend
        cache = be.alloc_cache(_spec({"pre": ("int8", 1), "loop": ("int8", 1)}, 8, window=4))
        depth, path = be.tree_layout(np.zeros(1, np.int32), np.zeros((1, 1), np.int32))
        rows = TreeRows(be.positions(0), depth, path)
        with pytest.raises(BackendError, match="sliding-window"):
            be.attn_half(m.ws, m.weights.loop[0], cache, 1, rows, 1)
        be.release_cache(cache)
    finally:
        tl.free_model(m)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_cache_fused_equals_unfused_and_cpu(small_path, monkeypatch, mode):
    """A quantized cache through the fused path (staging epilogue + kv_store) and the unfused one
    (three matmuls, rope, kv_store): the same logits bit for bit; and the CPU backend's within
    the quantizing tolerance (a code may flip where CPU and GPU k differ in the last bit)."""
    monkeypatch.delenv("TINYLOOP_CUDA_FUSE", raising=False)
    cpu = tl.load_model(str(small_path), max_seq_len=8, backend="cpu")
    fused = tl.load_model(str(small_path), max_seq_len=8, backend="cuda")
    monkeypatch.setenv("TINYLOOP_CUDA_FUSE", "0")
    unfused = tl.load_model(str(small_path), max_seq_len=8, backend="cuda")
    try:
        p = [3, 7]
        got = tl.score(fused, p, loops=1, cache_mode=mode)
        assert np.array_equal(tl.score(unfused, p, loops=1, cache_mode=mode), got)
        ref = tl.score(cpu, p, loops=1, cache_mode=mode)
        assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-3
    finally:
        for m in (cpu, fused, unfused):
            tl.free_model(m)


def test_window_generation_matches_cpu(small_path, monkeypatch):
    """A ring of the size the session asks for (window 2, one-row launches: 2 slots; the backend's
    rounding switched off so the ring wraps within a few tokens) through decode steps past the
    window: the CPU's tokens."""
    from tinyloop.cuda import backend as cb
    real = cb.round_slots
    monkeypatch.setattr(cb, "round_slots", lambda n, window=0: n if window else real(n))
    cpu = tl.load_model(str(small_path), max_seq_len=8, backend="cpu")
    gpu = tl.load_model(str(small_path), max_seq_len=8, backend="cuda", prefill_chunk=1)
    try:
        cfg = tl.GenerateConfig(max_tokens=3, loops=1, cache_window=2, cache_mode="int8")
        seen = []
        alloc = gpu.backend.alloc_cache
        monkeypatch.setattr(gpu.backend, "alloc_cache", lambda spec: seen.append(alloc(spec)) or seen[-1])
        assert tl.generate(gpu, [3, 5], cfg) == tl.generate(cpu, [3, 5], cfg)
        assert seen and seen[0].spec.slots == SlotMap(2, 2)
    finally:
        tl.free_model(cpu)
        tl.free_model(gpu)


def test_prompt_rows_in_power_of_two_pieces(small_path, monkeypatch):
    """A prompt chunk launched as binary pieces (`row_pieces`: what the backend does with graphs, so
    that a few captured forwards serve every prompt length; 7 rows = 4 + 2 + 1) gives the tokens of
    the unsplit chunk and of the CPU (kept small: the simulator is slow at multi-row launches)."""
    cpu = tl.load_model(str(small_path), max_seq_len=8, backend="cpu")
    whole = tl.load_model(str(small_path), max_seq_len=8, backend="cuda")
    split = tl.load_model(str(small_path), max_seq_len=8, backend="cuda")
    try:
        split.backend.split_rows = True
        assert whole.backend.row_pieces(7) == [7] and split.backend.row_pieces(7) == [4, 2, 1]
        assert split.backend.row_pieces(8) == [8] and split.backend.row_pieces(1) == [1]
        seen = []
        pieces = split.backend.row_pieces
        monkeypatch.setattr(split.backend, "row_pieces", lambda T: seen.append(T) or pieces(T))
        cfg = tl.GenerateConfig(max_tokens=2, loops=1, cache_mode="fp32")
        prompt = [3, 1, 4]
        want = tl.generate(cpu, prompt, cfg)
        assert tl.generate(whole, prompt, cfg) == want
        assert tl.generate(split, prompt, cfg) == want
        assert seen == [3]
    finally:
        for m in (cpu, whole, split):
            tl.free_model(m)


def test_memory_estimate_equals_held_memory(small_path):
    """On CUDA too, inspect's estimate is what the model holds: weights + workspace at load, plus
    the KV cache of a request of max_seq_len tokens (CUDA rounds a cache to a power of two >= 128
    slots, so a one-token request already allocates the max_seq_len cache here: the simulator
    runs it quickly)."""
    from tinyloop.analysis.memory import estimate_memory
    for max_seq_len, chunk in ((16, 0), (24, 8)):
        m = tl.load_model(str(small_path), max_seq_len=max_seq_len, backend="cuda", prefill_chunk=chunk)
        try:
            est = estimate_memory(m.header, max_seq_len, kv_bytes_per_element=4.0, backend="cuda",
                                  prefill_chunk=chunk)
            assert tl.vram_usage_bytes(m) == est["weights_bytes"] + est["scratch_bytes"], est
            seen = []
            assert m.backend.cache_slots(max_seq_len) == m.backend.cache_slots(2) == 128
            tl.generate_stream(m, [1], tl.GenerateConfig(max_tokens=1, cache_mode="fp32"),
                               on_token=lambda t, p: seen.append(tl.vram_usage_bytes(m)) or True)
            assert seen[0] == est["total_bytes"], (seen[0], est)
        finally:
            tl.free_model(m)


# ----------------------------------------------------------------------------- early exit
@pytest.mark.parametrize("criterion,threshold,kv", [("kl", 0.05, "recompute"), ("argmax", 0.0, "copy_last")])
def test_early_exit_matches_the_cpu(small_path, criterion, threshold, kv):
    """Early exit through the CUDA backend's guarded steps (the simulator reads the probes' flag
    between stretches): the exit_probe and kv_layer_copy kernels give the CPU's depths and tokens."""
    cpu = tl.load_model(str(small_path), max_seq_len=10, backend="cpu")
    m = tl.load_model(str(small_path), max_seq_len=10, backend="cuda")
    try:
        assert m.backend.supports("guarded_steps") and m.backend.supports("kv_layer_copy")
        cfg = tl.GenerateConfig(max_tokens=3, loops=3, early_exit_patience=1, early_exit_min_L=1,
                                early_exit_criterion=criterion, early_exit_threshold=threshold, early_exit_kv=kv)
        want, got = tl.GenerateStats(), tl.GenerateStats()
        assert tl.generate(m, [3, 7, 1], cfg, stats=got) == tl.generate(cpu, [3, 7, 1], cfg, stats=want)
        assert got.token_loops == want.token_loops and got.exit_probes == want.exit_probes
    finally:
        tl.free_model(m)
        tl.free_model(cpu)


EXACT = dict(TINY, vocab_size=32, d_model=32, n_heads=2, n_kv_heads=1, d_ff=32, n_pre=1, n_loop=1,
             n_post=0, default_loops=2)


def test_exact_kernels_end_to_end_match_cpu(tmp_path, monkeypatch):
    """TINYLOOP_CUDA_EXACT=1 on a model whose q4 weights (group 32) all take the exact kernels: the
    one-row dp4a kernel for decode steps, the staging kernel and the tensor-core kernel (the
    simulator's twin of the mma) for a two-token prompt's rows and for lockstep lanes. Logits
    within 1e-5 of the CPU backend's, greedy tokens equal to the CPU's, and two lanes decoded in
    lockstep (two-row launches: the tensor-core kernel) equal to each prompt's own generate (one-row
    launches: the dp4a kernel)."""
    cfg = ModelConfig(**EXACT)
    path = tmp_path / "exact.tinyloop"
    write_model(str(path), cfg, random_weights(cfg, seed=7), default_quant=TensorQuant("q4", 32))
    cpu = tl.load_model(str(path), max_seq_len=8, backend="cpu")
    monkeypatch.setenv("TINYLOOP_CUDA_EXACT", "1")
    gpu = tl.load_model(str(path), max_seq_len=8, backend="cuda")
    try:
        from tinyloop.cuda.kernels import matmul_exact as mx
        blk = gpu.weights.loop[0]
        assert gpu.backend.exact and mx.supports(blk.wqkv.w, blk.wqkv.scales, cfg.d_model)
        for p in ([3], [3, 4]):
            ref = tl.score(cpu, p, loops=2, cache_mode="fp32")
            got = tl.score(gpu, p, loops=2, cache_mode="fp32")
            assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-5
        gc = tl.GenerateConfig(max_tokens=3, loops=2, cache_mode="fp32")
        want = tl.generate(cpu, [3, 4], gc)
        assert tl.generate(gpu, [3, 4], gc) == want
        assert tl.generate_batch(gpu, [[3, 4], [5]], gc) == [want, tl.generate(gpu, [5], gc)]
    finally:
        tl.free_model(cpu)
        tl.free_model(gpu)
