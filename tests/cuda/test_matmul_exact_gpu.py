"""The exact integer tensor-core matmul (kernels/matmul_exact.py) on a real GPU: bit for bit the
numpy reference (tinyloop/model/exact_matmul.py) for any row count, with a fused norm, when
accumulating and through a pair epilogue; every row of a T-row launch equal to the row alone.

    python -m pytest -m gpu tests/cuda/test_matmul_exact_gpu.py -q
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from numba import cuda  # noqa: E402

if numba.config.ENABLE_CUDASIM or not cuda.is_available():
    pytest.skip("needs a real CUDA GPU (and NUMBA_ENABLE_CUDASIM unset)", allow_module_level=True)

from tinyloop.cuda.kernels import matmul_exact as mx  # noqa: E402
from tinyloop.errors import BackendError  # noqa: E402
from tinyloop.model.arch import TensorQuant  # noqa: E402
from tinyloop.model.exact_matmul import exact_matmul  # noqa: E402
from tinyloop.model.quant import quantize, unpack  # noqa: E402

from exact_checks import check_norm_and_glu  # noqa: E402

D = cuda.to_device


@pytest.fixture(autouse=True)
def wide_from_64_rows(monkeypatch):
    # every launch of MMA_WIDE_T rows and more takes the wide kernel here, however few blocks
    # it fills (the launcher's block rule would keep these small weights on the narrow one)
    monkeypatch.setattr(mx, "MMA_WIDE_BLOCKS", 1)


def weight(N, K, group, seed=0):
    rng = np.random.default_rng(seed)
    parts = quantize(rng.standard_normal((N, K), dtype=np.float32) * 0.05, TensorQuant("q4", group))
    return parts, unpack(parts["q"], 4, K), tuple(D(parts[k]) for k in ("q", "scales", "zeros"))


def staging(T, K, group):
    ls, ss, es = mx.staging_shapes(T, K, group)
    return D(np.zeros(ls, np.uint8)), D(np.zeros(ss, np.int64)), D(np.zeros(es, np.int32))


def inputs(T, K, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, K), dtype=np.float32)
    x[:, rng.integers(0, K, 5)] *= 50.0
    if T > 1:
        x[1, :] *= 1e-30                       # a row of tiny values
    return x


# group sizes whose lane words are 8-byte loads (64, 128, 256) and 4-byte ones (32, 96); more
# chunks than a block has warps (16384: 32 chunks over 11 warps)
@pytest.mark.parametrize("N,K,group", [(64, 256, 64), (48, 1024, 128), (32, 2560, 32), (16, 5632, 128),
                                       (40, 960, 96), (24, 2048, 256), (20, 16384, 128)])
# from MMA_WIDE_T rows on, the wide kernel (64, 70, 130; N = 20: fewer row tiles than its warps)
@pytest.mark.parametrize("T", [1, 3, 8, 9, 33, 64, 70, 130])
def test_equals_reference_bit_for_bit(N, K, group, T):
    parts, codes, (q, s, z) = weight(N, K, group)
    x = inputs(T, K)
    out = D(np.full((T, N), np.nan, np.float32))
    mx.matmul_exact(out, D(x), q, s, z, *staging(T, K, group))
    np.testing.assert_array_equal(out.copy_to_host(), exact_matmul(x, codes, parts["scales"], parts["zeros"]))


def test_rows_alone_equal_rows_in_a_launch():
    N, K, group = 96, 1024, 64
    parts, codes, (q, s, z) = weight(N, K, group, seed=3)
    x = inputs(100, K, seed=4)
    full = D(np.zeros((100, N), np.float32))
    mx.matmul_exact(full, D(x), q, s, z, *staging(100, K, group))      # the wide kernel
    full = full.copy_to_host()
    part = D(np.zeros((40, N), np.float32))
    mx.matmul_exact(part, D(x[:40]), q, s, z, *staging(40, K, group))   # the narrow one
    np.testing.assert_array_equal(part.copy_to_host(), full[:40])
    for t in (0, 1, 17, 39, 99):
        one = D(np.zeros((1, N), np.float32))
        mx.matmul_exact(one, D(x[t:t + 1]), q, s, z, *staging(1, K, group))
        np.testing.assert_array_equal(one.copy_to_host()[0], full[t])


@pytest.mark.parametrize("T", [1, 8, 20, 70])
def test_accumulate_norm_and_glu_epilogue(T):
    N, K, group = 64, 512, 128
    parts, codes, (q, s, z) = weight(N, K, group, seed=5)
    x = inputs(T, K, seed=6)
    base = np.random.default_rng(7).standard_normal((T, N)).astype(np.float32)
    out = D(base)
    mx.matmul_exact(out, D(x), q, s, z, *staging(T, K, group), accumulate=True)
    np.testing.assert_array_equal(out.copy_to_host(),
                                  exact_matmul(x, codes, parts["scales"], parts["zeros"], out=base.copy()))
    check_norm_and_glu(x, parts, codes, q, s, z, staging(T, K, group))


def test_refuses_what_it_cannot_do():
    parts, codes, (q, s, z) = weight(16, 96, 48)           # group 48: not a multiple of 32
    x = D(inputs(2, 96))
    with pytest.raises(BackendError, match="multiple of 32"):
        mx.matmul_exact(D(np.zeros((2, 16), np.float32)), x, q, s, z, *staging(2, 96, 48))
    parts, codes, (q, s, z) = weight(16, 256, 64)
    with pytest.raises(BackendError, match="staging buffers"):
        mx.matmul_exact(D(np.zeros((2, 16), np.float32)), D(inputs(2, 256)), q, s, z, *staging(2, 128, 64))
