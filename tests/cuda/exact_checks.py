"""Checks shared by the exact matmul's simulator and GPU tests (tests/cuda/test_matmul_exact_*.py):
a launch with the fused RMS norm equals rmsnorm followed by the plain product, and a launch with
the SwiGLU pair epilogue equals the product followed by swiglu_fused, bit for bit."""

from __future__ import annotations

import numpy as np
from numba import cuda

from tinyloop.cuda.kernels import matmul_exact as mx
from tinyloop.cuda.kernels import rmsnorm, swiglu
from tinyloop.model.exact_matmul import exact_matmul

D = cuda.to_device


def check_norm_and_glu(x, parts, codes, q, s, z, stage, seed=8):
    """`stage`: the staging buffers for x's rows (or () for a one-row launch)."""
    T, K = x.shape
    N = codes.shape[0]
    nw = D(np.random.default_rng(seed).uniform(0.5, 1.5, K).astype(np.float32))
    xn = D(np.zeros((T, K), np.float32))
    rmsnorm.rmsnorm(xn, D(x), nw, 1e-5)
    out = D(np.zeros((T, N), np.float32))
    mx.matmul_exact(out, D(x), q, s, z, *stage, norm_w=nw, eps=1e-5)
    np.testing.assert_array_equal(out.copy_to_host(),
                                  exact_matmul(xn.copy_to_host(), codes, parts["scales"], parts["zeros"]))
    h = D(np.zeros((T, N // 2), np.float32))
    mx.matmul_exact(h, D(x), q, s, z, *stage, epilogue=swiglu.glu_epilogue(N // 2))
    want = D(np.zeros((T, N // 2), np.float32))
    swiglu.swiglu_fused(want, D(exact_matmul(x, codes, parts["scales"], parts["zeros"])))
    np.testing.assert_array_equal(h.copy_to_host(), want.copy_to_host())
