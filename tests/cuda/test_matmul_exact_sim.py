"""The exact matmul's one-row dp4a kernel (kernels/matmul_exact.py, `_make_gemv`) under the CUDA
simulator (or on a GPU): bit for bit the numpy reference of tinyloop/model/exact_matmul.py for
every supported group size, partial warp steps, a fused norm, accumulation and a pair epilogue.
The tensor-core kernel has no simulator twin; tests/cuda/test_matmul_exact_gpu.py checks both
kernels against the same reference on a GPU.

    NUMBA_ENABLE_CUDASIM=1 python -m pytest -m cudasim tests/cuda/test_matmul_exact_sim.py -q
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

from tinyloop.cuda.kernels import matmul_exact as mx  # noqa: E402
from tinyloop.cuda.kernels import rmsnorm, swiglu  # noqa: E402
from tinyloop.errors import BackendError  # noqa: E402
from tinyloop.model.arch import TensorQuant  # noqa: E402
from tinyloop.model.exact_matmul import exact_matmul  # noqa: E402
from tinyloop.model.quant import quantize, unpack  # noqa: E402

D = cuda.to_device


def weight(N, K, group, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((N, K), dtype=np.float32) * 0.05
    parts = quantize(w, TensorQuant("q4", group))
    return parts, unpack(parts["q"], 4, K), tuple(D(parts[k]) for k in ("q", "scales", "zeros"))


def row(K, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, K), dtype=np.float32)
    x[0, rng.integers(0, K, 3)] *= 50.0            # groups with a large element
    x[0, :32] *= 1e-30                             # a group of tiny values
    x[0, 32:64] = 0.0                              # and an all-zero group (K >= 64)
    return x


@pytest.mark.parametrize("N,K,group", [(20, 64, 32), (24, 1536, 64), (18, 1024, 256), (16, 1280, 128)])
def test_one_row_kernel_equals_reference(N, K, group):
    assert mx.gemv_fits(K, group) and not mx.needs_staging(1, K, group, N)
    parts, codes, (q, s, z) = weight(N, K, group)
    x = row(K)
    out = D(np.full((1, N), np.nan, np.float32))
    mx.matmul_exact(out, D(x), q, s, z)
    np.testing.assert_array_equal(out.copy_to_host(), exact_matmul(x, codes, parts["scales"], parts["zeros"]))


def test_one_row_norm_accumulate_and_glu():
    N, K, group = 20, 1088, 32                    # two warp steps, the second partial
    parts, codes, (q, s, z) = weight(N, K, group, seed=5)
    x = row(K, seed=6)
    x[0, :64] += 1.0                               # keep the RMS norm's input away from zero
    base = np.random.default_rng(7).standard_normal((1, N)).astype(np.float32)
    out = D(base)
    mx.matmul_exact(out, D(x), q, s, z, accumulate=True)
    np.testing.assert_array_equal(out.copy_to_host(),
                                  exact_matmul(x, codes, parts["scales"], parts["zeros"], out=base.copy()))
    nw = D(np.random.default_rng(8).uniform(0.5, 1.5, K).astype(np.float32))
    xn = D(np.zeros((1, K), np.float32))
    rmsnorm.rmsnorm(xn, D(x), nw, 1e-5)
    mx.matmul_exact(out, D(x), q, s, z, norm_w=nw, eps=1e-5)
    np.testing.assert_array_equal(out.copy_to_host(),
                                  exact_matmul(xn.copy_to_host(), codes, parts["scales"], parts["zeros"]))
    h = D(np.zeros((1, N // 2), np.float32))
    mx.matmul_exact(h, D(x), q, s, z, epilogue=swiglu.glu_epilogue(N // 2))
    want = D(np.zeros((1, N // 2), np.float32))
    swiglu.swiglu_fused(want, D(exact_matmul(x, codes, parts["scales"], parts["zeros"])))
    np.testing.assert_array_equal(h.copy_to_host(), want.copy_to_host())


def test_which_launches_need_staging():
    assert not mx.gemv_fits(2048, 96)              # not a power of two: the mma kernel serves it
    assert not mx.gemv_fits(4096, 512)             # a group longer than a warp's staging
    assert not mx.gemv_fits(17920, 128)            # x's limbs do not fit a block's shared memory
    assert mx.needs_staging(2, 2048, 128, 64) and mx.needs_staging(1, 2048, 96, 64)
    assert not mx.needs_staging(1, 8192, 128, 2048) and mx.needs_staging(1, 8192, 128, 8192)   # 4 rows a warp: too much shared memory
    parts, codes, (q, s, z) = weight(16, 192, 96)
    with pytest.raises(BackendError, match="staging buffers"):
        mx.matmul_exact(D(np.zeros((1, 16), np.float32)), D(row(192)), q, s, z)
