"""Shared fixtures: small looped models written through the real writer."""

from __future__ import annotations

import numpy as np
import pytest

from tinyloop.model.arch import ModelConfig, TensorQuant, required_tensors
from tinyloop.model.format import open_model, write_model

TINY = dict(vocab_size=97, d_model=64, n_heads=4, n_kv_heads=2, d_ff=96, n_pre=1, n_loop=2, n_post=1,
            default_loops=3, max_loops=8, loop_inject="add", eos_id=None)


def pytest_configure(config):
    import numba
    if numba.config.ENABLE_CUDASIM:
        import sim_fast
        sim_fast.install()      # the simulator's barriers and shared arrays, without its overheads


def real_gpu() -> bool:
    """A real CUDA GPU (not numba's simulator, which the tests/cuda runners use)."""
    try:
        import numba
        from numba import cuda
        return not numba.config.ENABLE_CUDASIM and cuda.is_available()
    except Exception:
        return False


def random_weights(cfg: ModelConfig, seed: int = 0, std: float = 0.15) -> dict:
    """Seeded weights with peaky logits (embeddings ~N(0,1)) so greedy choices are not near-ties."""
    rng = np.random.default_rng(seed)
    w = {}
    for name, shape in required_tensors(cfg).items():
        if len(shape) == 1:
            w[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif name in ("embed", "head"):
            w[name] = rng.standard_normal(shape).astype(np.float32)
        else:
            w[name] = (std * rng.standard_normal(shape)).astype(np.float32)
    return w


def write_tiny(path, seed: int = 0, quant: str = "f16", group_size: int = 0, **overrides) -> ModelConfig:
    cfg = ModelConfig(**{**TINY, **overrides})
    write_model(str(path), cfg, random_weights(cfg, seed),
                default_quant=TensorQuant(quant, group_size))
    return cfg


def logical_weights(path) -> dict:
    with open_model(str(path)) as mf:
        return {n: np.array(mf.logical(n)) for n in required_tensors(mf.header.config)}


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    p = tmp_path_factory.mktemp("models") / "tiny.tinyloop"
    write_tiny(p)
    return p


@pytest.fixture(scope="session")
def tiny_model(tiny_path):
    import tinyloop as tl
    m = tl.load_model(str(tiny_path), max_seq_len=128, backend="cpu")
    yield m
    tl.free_model(m)


@pytest.fixture
def prompt():
    return [3, 17, 42, 8, 91, 23, 11, 60, 2, 77]


@pytest.fixture(scope="module", params=[dict(), dict(n_post=0, loop_inject="none", n_loop=1)])
def spec_model(request, tmp_path_factory):
    """A small q4 model on the CPU for the speculative decoders: with post blocks and loop
    injection, and without either (one loop layer)."""
    import tinyloop as tl
    path = tmp_path_factory.mktemp("spec") / "m.tinyloop"
    write_tiny(path, seed=2, quant="q4", group_size=32, **request.param)
    m = tl.load_model(str(path), max_seq_len=160, backend="cpu")
    yield m
    tl.free_model(m)


@pytest.fixture(scope="module")
def demo_pair():
    """The demo model on the CPU and on the CUDA backend (GPU test modules; max_seq_len 256)."""
    import tinyloop as tl
    cpu = tl.load_model(None, backend="cpu", max_seq_len=256)
    gpu = tl.load_model(None, backend="cuda", max_seq_len=256)
    yield cpu, gpu
    tl.free_model(cpu)
    tl.free_model(gpu)


def check_decode_modes(model, prompt, loops: int = 4, draft: int = 2, tokens: int = 12) -> None:
    """Every cache mode, chain and tree speculation, lockstep lanes, warm start, prefix reuse and
    early exit (both K/V policies) run on `model`, and the exact ones give plain greedy
    decoding's tokens."""
    import tinyloop as tl
    plain = tl.generate(model, prompt, tl.GenerateConfig(max_tokens=tokens, loops=loops))
    short = tl.generate(model, prompt[:5], tl.GenerateConfig(max_tokens=tokens, loops=loops))
    lanes = tl.generate_batch(model, [prompt, prompt[:5]], tl.GenerateConfig(max_tokens=tokens, loops=loops))
    assert [list(x) for x in lanes] == [list(plain), list(short)]
    for mode in ("fp32", "fp16", "int8", "int4"):
        out = tl.generate(model, prompt, tl.GenerateConfig(max_tokens=tokens, loops=loops, cache_mode=mode))
        assert len(out) == len(prompt) + tokens
    spec = tl.SpeculativeConfig(max_tokens=tokens, draft_loops=draft, verify_loops=loops, draft_ahead=3)
    assert tl.generate_speculative(model, prompt, spec) == plain
    tree = tl.TreeSpeculativeConfig(max_tokens=tokens, draft_loops=draft, verify_loops=loops)
    assert tl.generate_tree_speculative(model, prompt, tree) == plain
    handle = tl.build_resume_handle(model, prompt, draft)
    try:
        assert tl.resume_generate(handle, loops, tl.GenerateConfig(max_tokens=tokens)) == plain
    finally:
        tl.free_resume_handle(handle)
    pc = tl.build_prefix_cache(model, prompt[:8], loops=loops)
    try:
        got = tl.generate_from_prefix_cache(model, pc, prompt[8:], tl.GenerateConfig(max_tokens=tokens, loops=loops))
        assert got == plain
    finally:
        tl.free_prefix_cache(pc)
    for kv in ("copy_last", "recompute"):
        st = tl.GenerateStats()
        ee = tl.GenerateConfig(max_tokens=tokens, loops=loops, early_exit_patience=1, early_exit_min_L=1,
                               early_exit_criterion="hidden_l2", early_exit_threshold=0.5, early_exit_kv=kv)
        out = tl.generate(model, prompt, ee, stats=st)
        assert len(out) == len(prompt) + tokens and 1 <= st.loops_used <= loops
        assert len(st.token_loops) == tokens
