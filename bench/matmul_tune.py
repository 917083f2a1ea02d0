"""Tune the CUDA matmul's block configuration: time the fast kernel for several (TT, R, NW, KC)
choices on the model shapes, one row (decode GEMV) and many rows (prefill / verify GEMM), each
inside a captured graph, and check every configuration gives bit-identical outputs (the
configuration must never change the reduction order).

    python bench/matmul_tune.py [--shapes 360m,demo] [--rows 1,16,128] [--few] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GEMV = [(1, 2, 8, 4096), (1, 1, 8, 4096), (1, 4, 8, 4096), (1, 2, 4, 4096), (1, 4, 4, 4096), (1, 8, 4, 4096),
        (1, 8, 8, 4096), (1, 2, 16, 4096), (1, 4, 8, 2048)]
GEMM = [(2, 8, 4, 1024), (4, 4, 4, 1024), (8, 2, 4, 1024), (16, 1, 4, 1024), (8, 2, 8, 1024), (4, 4, 8, 1024),
        (8, 1, 8, 1024)]
#: --few: launches of a few rows (tree levels, verify rows, small lockstep batches) on small weights
FEW = [(2, 8, 4, 1024), (2, 2, 8, 4096), (2, 1, 8, 4096), (2, 2, 4, 4096), (2, 4, 4, 1024), (1, 2, 8, 4096),
       (1, 1, 8, 4096), (4, 1, 8, 4096), (4, 2, 8, 4096)]
#: shape sets: name -> (N, K, storage, group size)
SHAPE_SETS = {
    "360m": {"2048x2048": (2048, 2048, "q4", 128), "6144x2048 (q|k|v)": (6144, 2048, "q4", 128),
             "11264x2048 (gate|up)": (11264, 2048, "q4", 128), "2048x5632": (2048, 5632, "q4", 128),
             "16384x4096": (16384, 4096, "q4", 128)},
    "demo": {"640x384 (q|k|v)": (640, 384, "q4", 64), "384x384 (wo)": (384, 384, "q4", 64),
             "2048x384 (gate|up)": (2048, 384, "q4", 64), "384x1024 (down)": (384, 1024, "q4", 64),
             "4096x384 (head, f16)": (4096, 384, "f16", 0)},
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16,128")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--flat", choices=("rule", "on", "off"), default="rule",
                    help="weight addressing of the one-row launches: the launcher's flat_for rule "
                         "(default), or flat / 2-D for every shape")
    ap.add_argument("--shapes", default="360m", help=f"comma-separated shape sets of {list(SHAPE_SETS)}")
    ap.add_argument("--few", action="store_true",
                    help="T > 1 candidates for few-row launches on small weights (FEW) instead of GEMM")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    shapes = {}
    for name in args.shapes.split(","):
        if name not in SHAPE_SETS:
            ap.error(f"unknown shape set {name!r}; choose from {list(SHAPE_SETS)}")
        shapes.update(SHAPE_SETS[name])
    from numba import cuda

    from tinyloop.model.arch import TensorQuant
    from tinyloop.model.quant import quantize
    from bench.decode_bench import graph_time_ms
    from tinyloop.cuda.kernels import matmul as km

    stream = cuda.stream()
    rng = np.random.default_rng(0)

    def time_graph(fn) -> float:
        return graph_time_ms(stream, fn, args.reps) * 1e3      # us per launch

    rows = []
    base = (km.GEMV_CONFIG, km.GEMV_WIDE_CONFIG, km.GEMV_XWIDE_CONFIG, km.GEMV_LONG_CONFIG, km.GEMM_CONFIG,
            dict(km.FEW_CONFIGS))
    rule = km.flat_for
    if args.flat != "rule":
        km.flat_for = lambda T: T == 1 and args.flat == "on"
    try:
        for name, (N, K, kind, group) in shapes.items():
            w = rng.standard_normal((N, K), dtype=np.float32) * 0.02
            if kind == "f16":
                q, s, z = cuda.to_device(w.astype(np.float16)), None, None
                nbytes = int(q.nbytes)
            else:
                parts = quantize(w, TensorQuant(kind, group))
                q, s, z = (cuda.to_device(parts[k]) for k in ("q", "scales", "zeros"))
                nbytes = int(q.nbytes + s.nbytes + z.nbytes)
            for T in [int(t) for t in args.rows.split(",")]:
                x = cuda.to_device(rng.standard_normal((T, K), dtype=np.float32))
                out = cuda.device_array((T, N), np.float32)
                ref = None
                for cfg in (GEMV if T == 1 else FEW if args.few else GEMM):
                    if T == 1:
                        # (weights of N >= XWIDE_N also get its register cap)
                        km.GEMV_CONFIG = km.GEMV_WIDE_CONFIG = km.GEMV_XWIDE_CONFIG = km.GEMV_LONG_CONFIG = cfg
                    else:
                        km.GEMM_CONFIG = cfg
                        km.FEW_CONFIGS = dict.fromkeys(base[5], cfg)
                    used = km.config_for(kind, T, N, False, K)

                    def fn():
                        for _ in range(args.reps):
                            km.matmul(out, x, q, s, z, stream=stream)
                    us = time_graph(fn)
                    got = out.copy_to_host()
                    same = True if ref is None else bool(np.array_equal(got, ref))
                    ref = got if ref is None else ref
                    row = {"shape": name, "T": T, "config": list(cfg), "used": list(used),
                           "flat": bool(km.flat_for(T)), "us": us,
                           "GB_per_s": nbytes / (us * 1e-6) / 1e9, "identical": same}
                    rows.append(row)
                    print(f"{name:22} T={T:<4} cfg={cfg} used={used}: {us:8.1f} us {row['GB_per_s']:6.0f} GB/s "
                          f"identical={same}", flush=True)
    finally:
        (km.GEMV_CONFIG, km.GEMV_WIDE_CONFIG, km.GEMV_XWIDE_CONFIG, km.GEMV_LONG_CONFIG, km.GEMM_CONFIG,
         km.FEW_CONFIGS) = base
        km.flat_for = rule
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
