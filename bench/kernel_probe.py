"""Launch CUDA kernels a few times each, outside any graph, for an external profiler.

    ncu -k regex:kernel -c 4 --section SpeedOfLight \\
        python bench/kernel_probe.py matmul --shapes 2048x2048,11264x2048 --rows 1
    ncu -k regex:kernel -c 2 --section WarpStateStats python bench/kernel_probe.py attention --ctx 192

matmul: each shape is an INT4 (group 128, random) weight `N x K` applied to `--rows` rows of x, with
the fused RMSNorm when `--norm` is given (as the decode path launches the q|k|v and gate|up
matmuls). attention: `--rows` query rows at the end of a `--ctx`-slot float16 cache of `--heads`
heads of width `--head-dim`.
"""

from __future__ import annotations

import argparse

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("op", choices=("matmul", "attention"))
    ap.add_argument("--ctx", type=int, default=192)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--shapes", default="2048x2048,3072x2048,11264x2048,2048x5632,16384x4096")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--launches", type=int, default=4)
    ap.add_argument("--quant", default="q4")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--norm", action="store_true")
    args = ap.parse_args(argv)
    for name in ("ctx", "heads", "head_dim", "rows", "launches", "group"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")

    from numba import cuda

    from tinyloop.model.arch import TensorQuant
    from tinyloop.model.quant import quantize
    from tinyloop.cuda.kernels import matmul as k_matmul

    rng = np.random.default_rng(0)
    if args.op == "attention":
        from tinyloop.cuda.kernels import attention
        H, hd, T = args.heads, args.head_dim, args.rows
        S = args.ctx + T
        kc = cuda.to_device(rng.standard_normal((1, S, H, hd)).astype(np.float16))
        vc = cuda.to_device(rng.standard_normal((1, S, H, hd)).astype(np.float16))
        q = cuda.to_device(rng.standard_normal((T, H * hd)).astype(np.float32))
        out = cuda.device_array((T, H * hd), np.float32)
        pos = cuda.to_device(np.array([args.ctx], np.int32))
        work = cuda.device_array(attention.workspace_shape(T, H, hd), np.float32)
        cnt = cuda.to_device(np.zeros(attention.counter_shape(T, H), np.int32))
        for _ in range(args.launches):
            attention.attention(out, q, kc, vc, 0, pos, work, cnt)
        cuda.synchronize()
        print(f"attention ctx {args.ctx}: {args.launches} launches of {T} row(s)")
        return 0
    for shape in args.shapes.split(","):
        N, K = (int(v) for v in shape.split("x"))
        w = rng.standard_normal((N, K), dtype=np.float32) * 0.02
        parts = quantize(w, TensorQuant(args.quant, args.group))
        q, s, z = (cuda.to_device(parts[k]) for k in ("q", "scales", "zeros"))
        x = cuda.to_device(rng.standard_normal((args.rows, K), dtype=np.float32))
        nw = cuda.to_device(np.ones(K, np.float32)) if args.norm else None
        out = cuda.device_array((args.rows, N), np.float32)
        for _ in range(args.launches):
            k_matmul.matmul(out, x, q, s, z, norm_w=nw, eps=1e-6 if args.norm else 0.0)
        cuda.synchronize()
        print(f"{shape}: {args.launches} launches of {args.rows} row(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
