"""The many-row matmul (kernels/matmul_rows.py: staging + register-blocked kernel) against the fast
kernel's many-row launch (kernels/matmul.py), on the 360m shapes, each timed inside a captured
graph in the same process, and checked bit for bit against the fast kernel's output.

    python bench/matmul_rows_bench.py [--rows 2,4,8,16,32] [--configs 8x4x4,4x8x4] [--json out.json]

A config is TT x R x NW (token rows per group, weight rows per warp, warps per block); launches of
fewer rows than TT use the kernel's own small-T rule.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: name -> (N, K): the 360m preset's q4 g128 weights (q|k|v, wo, gate|up, down, head)
SHAPES = {"6144x2048": (6144, 2048), "2048x2048": (2048, 2048), "11264x2048": (11264, 2048),
          "2048x5632": (2048, 5632), "50304x2048": (50304, 2048)}


def parse_configs(text: str):
    out = []
    for c in text.split(","):
        parts = c.split("x")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise SystemExit(f"--configs: {c!r} is not TTxRxNW")
        TT, R, NW = (int(p) for p in parts)
        if TT % 2 or TT * R > 32 or (TT * R) & (TT * R - 1) or NW < 1:
            raise SystemExit(f"--configs: {c!r}: TT must be even and TT * R a power of two <= 32")
        out.append((TT, R, NW))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="2,4,8,16,32")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--configs", default="8x4x4,8x4x8,8x2x4,4x8x4")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated names of {list(SHAPES)}")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = [int(t) for t in args.rows.split(",")]
    if any(not 2 <= t <= 32 for t in rows):
        ap.error("--rows: each row count must be in [2, 32] (the many-row kernel's range)")
    names = args.shapes.split(",")
    for n in names:
        if n not in SHAPES:
            ap.error(f"--shapes: unknown shape {n!r}; choose from {list(SHAPES)}")
    cfgs = parse_configs(args.configs)
    from numba import cuda

    from bench.decode_bench import graph_time_ms
    from tinyloop.cuda.kernels import matmul as km
    from tinyloop.cuda.kernels import matmul_rows as mr
    from tinyloop.model.arch import TensorQuant
    from tinyloop.model.quant import quantize
    stream = cuda.stream()
    rng = np.random.default_rng(0)
    results = []
    saved = (km.ROWS_ENABLED, mr.ROWS_CONFIG, dict(mr.ROWS_SMALL))
    try:
        for name in names:
            N, K = SHAPES[name]
            w = rng.standard_normal((N, K), dtype=np.float32) * 0.02
            parts = quantize(w, TensorQuant("q4", 128))
            q, s, z = (cuda.to_device(parts[k]) for k in ("q", "scales", "zeros"))
            for T in rows:
                x = cuda.to_device(rng.standard_normal((T, K), dtype=np.float32))
                out = cuda.device_array((T, N), np.float32)
                xw = cuda.device_array(mr.staged_floats(32, K), np.float32)

                def run(buf):
                    def fn():
                        for _ in range(args.reps):
                            km.matmul(out, x, q, s, z, stream=stream, xw=buf)
                    return graph_time_ms(stream, fn, args.reps) * 1e3

                km.ROWS_ENABLED = False
                us0 = run(None)
                ref = out.copy_to_host()
                results.append({"shape": name, "T": T, "kernel": "fast", "config": list(km.config_for("q4", T, N)),
                                "us": us0})
                print(f"{name:12} T={T:<3} fast {km.config_for('q4', T, N)}: {us0:7.1f} us", flush=True)
                km.ROWS_ENABLED = True
                for cfg in cfgs:
                    mr.ROWS_CONFIG = cfg
                    mr.ROWS_SMALL.clear()
                    used = mr.rows_config(T)
                    out.copy_to_device(np.zeros((T, N), np.float32))
                    us = run(xw)
                    got = out.copy_to_host()
                    same = bool(np.array_equal(got, ref))
                    results.append({"shape": name, "T": T, "kernel": "rows", "config": list(cfg), "used": list(used),
                                    "us": us, "speedup": us0 / us, "identical": same})
                    print(f"{name:12} T={T:<3} rows {cfg} used {used}: {us:7.1f} us  x{us0 / us:5.2f}  "
                          f"identical={same}", flush=True)
    finally:
        km.ROWS_ENABLED, mr.ROWS_CONFIG = saved[0], saved[1]
        mr.ROWS_SMALL.clear()
        mr.ROWS_SMALL.update(saved[2])
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
