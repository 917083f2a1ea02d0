"""Launch matmul shapes a few times each, outside any graph, for an external profiler.

    ncu -k regex:matmul --launch-skip 2 --launch-count 1 --section SpeedOfLight \\
        python bench/matmul_probe.py --shapes 2048x2048,11264x2048 --rows 1

Each shape is an INT4 (group 128, random) weight `N x K` applied to `--rows` rows of x, with the
fused RMSNorm when `--norm` is given (as the decode path launches the q|k|v and gate|up matmuls).
"""

from __future__ import annotations

import argparse

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="2048x2048,3072x2048,11264x2048,2048x5632,16384x4096")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--launches", type=int, default=4)
    ap.add_argument("--quant", default="q4")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--norm", action="store_true")
    args = ap.parse_args(argv)

    from numba import cuda

    from tinyloop.core.arch import TensorQuant
    from tinyloop.core.quant import quantize
    from tinyloop.cuda.kernels import matmul as k_matmul

    rng = np.random.default_rng(0)
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
