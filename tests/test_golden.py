"""Golden test: a fixed tiny model written through the real writer + a fixed prompt -> exact greedy
token ids. Weights come from an integer hash (no RNG whose stream could change between numpy
versions); the top-1/top-2 logit margins along these outputs are >= 0.017, three orders of magnitude
above float32 noise."""

from __future__ import annotations

import numpy as np
import pytest

import tinyloop as tl
from tinyloop.model.arch import ModelConfig, TensorQuant, required_tensors
from tinyloop.model.format import write_model

CFG = ModelConfig(vocab_size=97, d_model=64, n_heads=4, n_kv_heads=2, d_ff=96, n_pre=1, n_loop=2, n_post=1,
                  default_loops=3, max_loops=8, loop_inject="add")
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
GOLDEN = {   # smallest top-1 / top-2 logit margin along each output in the comment
    1: [44, 66, 86, 41, 86, 41, 86, 41, 86, 93, 74, 93, 86, 93, 86, 93],   # 0.052
    3: [44, 66, 86, 67, 31, 52, 86, 52, 86, 93, 86, 93, 87, 41, 3, 93],    # 0.039
    8: [44, 66, 86, 67, 31, 52, 86, 52, 86, 93, 86, 93, 87, 55, 31, 93],   # 0.017
}


def hashed(shape, salt: int, scale: float) -> np.ndarray:
    """Deterministic pseudo-random values in [-scale*sqrt(3), scale*sqrt(3)) (unit-variance uniform)."""
    n = int(np.prod(shape))
    x = (np.arange(n, dtype=np.uint64) * np.uint64(2654435761) + np.uint64(salt * 40503 + 12345)) \
        % np.uint64(1 << 32)
    x = (x * np.uint64(2246822519) + np.uint64(salt)) % np.uint64(1 << 32)
    u = x.astype(np.float64) / float(1 << 32)
    return ((u - 0.5) * np.sqrt(12.0) * scale).reshape(shape).astype(np.float32)


def golden_weights():
    out = {}
    for i, (name, shape) in enumerate(required_tensors(CFG).items()):
        if len(shape) == 1:
            out[name] = 1.0 + hashed(shape, i, 0.1)
        else:
            out[name] = hashed(shape, i, 1.0 if name in ("embed", "head") else 0.35)
    return out


@pytest.fixture(scope="module")
def golden_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("golden") / "golden.tinyloop"
    write_model(str(path), CFG, golden_weights(), default_quant=TensorQuant("q4", 32))
    m = tl.load_model(str(path), max_seq_len=64, backend="cpu")
    yield m
    tl.free_model(m)


@pytest.mark.parametrize("loops", sorted(GOLDEN))
def test_golden_greedy_tokens(golden_model, loops):
    out = tl.generate(golden_model, PROMPT, tl.GenerateConfig(max_tokens=16, loops=loops))
    assert out[len(PROMPT):] == GOLDEN[loops]
