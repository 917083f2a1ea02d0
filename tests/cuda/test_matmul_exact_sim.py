"""The exact matmul's kernels (kernels/matmul_exact.py) under the CUDA simulator (or on a GPU):
bit for bit the numpy reference of tinyloop/model/exact_matmul.py. The one-row dp4a kernel
(`_make_gemv`) for every supported group size, partial warp steps, a fused norm, accumulation and a
pair epilogue; the narrow and wide tensor-core kernels through the simulator's twin of the mma
(kernels/_mma.py) on small shapes, including groups at the extremes of the float64 group terms'
range. tests/cuda/test_matmul_exact_gpu.py checks all of them against the same reference on a GPU.

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
from tinyloop.errors import BackendError  # noqa: E402
from tinyloop.model.arch import TensorQuant  # noqa: E402
from tinyloop.model.exact_matmul import exact_matmul  # noqa: E402
from tinyloop.model.quant import quantize, unpack  # noqa: E402

from exact_checks import check_norm_and_glu  # noqa: E402

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
    check_norm_and_glu(x, parts, codes, q, s, z, ())


def test_which_launches_need_staging():
    assert not mx.gemv_fits(2048, 96)              # not a power of two: the mma kernel serves it
    assert not mx.gemv_fits(4096, 512)             # a group longer than a warp's staging
    assert not mx.gemv_fits(17920, 128)            # x's limbs do not fit a block's shared memory
    assert mx.needs_staging(2, 2048, 128, 64) and mx.needs_staging(1, 2048, 96, 64)
    assert not mx.needs_staging(1, 8192, 128, 2048) and mx.needs_staging(1, 8192, 128, 8192)   # 4 rows a warp: too much shared memory
    parts, codes, (q, s, z) = weight(16, 192, 96)
    with pytest.raises(BackendError, match="staging buffers"):
        mx.matmul_exact(D(np.zeros((1, 16), np.float32)), D(row(192)), q, s, z)


def staging(T, K, group):
    ls, ss, es = mx.staging_shapes(T, K, group)
    return D(np.zeros(ls, np.uint8)), D(np.zeros(ss, np.int64)), D(np.zeros(es, np.int32))


# the narrow kernel: 4- and 8-byte lane words (groups 96 / 64), one and two token tiles, two
# chunks; one token tile with a warp per group (the default) and with a warp per chunk
@pytest.mark.parametrize("N,K,group,T", [(20, 192, 96, 3), (16, 1024, 64, 9), (24, 1088, 32, 2)])
@pytest.mark.parametrize("per_group", [True, False])
def test_tensor_core_kernel_equals_reference(monkeypatch, N, K, group, T, per_group):
    monkeypatch.setattr(mx, "MMA_PER_GROUP", per_group)
    parts, codes, (q, s, z) = weight(N, K, group, seed=T)
    x = np.concatenate([row(K, seed=T + i) for i in range(T)])
    out = D(np.full((T, N), np.nan, np.float32))
    mx.matmul_exact(out, D(x), q, s, z, *staging(T, K, group))
    np.testing.assert_array_equal(out.copy_to_host(), exact_matmul(x, codes, parts["scales"], parts["zeros"]))


def test_tensor_core_kernel_norm_and_glu():
    """A warp per group with the fused norm and the SwiGLU pair epilogue: equal to the unfused
    forms (rmsnorm, then the product; the product, then swiglu_fused)."""
    N, K, group, T = 32, 256, 64, 3
    parts, codes, (q, s, z) = weight(N, K, group, seed=9)
    x = np.concatenate([row(K, seed=30 + i) for i in range(T)])
    x[:, :64] += 1.0                               # keep the RMS norm's input away from zero
    check_norm_and_glu(x, parts, codes, q, s, z, staging(T, K, group), seed=10)


def test_wide_tensor_core_kernel_equals_reference(monkeypatch):
    monkeypatch.setattr(mx, "MMA_WIDE_T", 2)        # take the wide kernel on a small launch
    monkeypatch.setattr(mx, "MMA_WIDE_BLOCKS", 1)
    N, K, group, T = 72, 128, 64, 34               # 5 row tiles over 2 blocks of 4 warps; 2 token blocks
    parts, codes, (q, s, z) = weight(N, K, group, seed=11)
    x = np.concatenate([row(K, seed=20 + i) for i in range(T)])
    base = np.random.default_rng(12).standard_normal((T, N)).astype(np.float32)
    out = D(base)
    mx.matmul_exact(out, D(x), q, s, z, *staging(T, K, group), accumulate=True)
    np.testing.assert_array_equal(out.copy_to_host(),
                                  exact_matmul(x, codes, parts["scales"], parts["zeros"], out=base.copy()))


def test_group_terms_exact_at_the_extremes():
    """Every term at its largest: x just below a power of two everywhere (X = +-(2^XBITS - 8)),
    |q - z| = 15 in every element (codes 15 with zero 0, or codes 0 with zero 15), the largest
    float16 significand, groups of 256 (|V * sm| near 2^50), as well as subnormal scales and
    mixed signs: the one-row and tensor-core kernels equal the int64 reference."""
    N, K, group = 16, 512, 256
    G = K // group
    rng = np.random.default_rng(3)
    high = rng.random((N, G)) < 0.5
    codes = np.repeat(np.where(high, 15, 0), group, axis=1).astype(np.uint8)
    q = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    zeros = np.where(high, 0, 15).astype(np.uint8)
    scales = np.full((N, G), 65504.0, np.float16)
    scales[::4] = np.float16(2.0 ** -24 * 1023)      # subnormal scales too
    assert (unpack(q, 4, K) == codes).all()
    top = np.nextafter(np.float32(1.0), np.float32(0.0))
    for T in (1, 3):
        x = np.full((T, K), top, np.float32)
        if T > 1:
            x[1] = -top
            x[2] = np.where(rng.random(K) < 0.5, -top, top)
        out = D(np.full((T, N), np.nan, np.float32))
        mx.matmul_exact(out, D(x), D(q), D(scales), D(zeros), *staging(T, K, group))
        np.testing.assert_array_equal(out.copy_to_host(), exact_matmul(x, codes, scales, zeros))


def test_groups_past_the_exact_range_are_refused():
    parts, codes, (q, s, z) = weight(8, 4096, 4096)
    assert not mx.supports(q, s, 4096)
    with pytest.raises(BackendError, match="at most 2048"):
        mx.matmul_exact(D(np.zeros((2, 8), np.float32)), D(np.zeros((2, 4096), np.float32)), q, s, z,
                        *staging(2, 4096, 2048))
