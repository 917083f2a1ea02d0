"""One-row INT4 GEMVs streamed from HBM: the fast kernel's block configurations, with and without
the L2 prefetch of each warp's rows, on the shapes of looped checkpoints, against tinygemm.

Each shape gets enough copies of a random q4 weight (codes, fp16 scales, uint8 zeros) to exceed
`--hbm-mb` MB, and the timed graph cycles through them, so every launch reads its weight from HBM
(L2 is ~60 MB on the H200), as in a model whose loop block does not fit in L2 (Huginn-0125's
four 5280-wide layers are ~1 GB at q4). Every candidate's output is compared bit for bit with the
launcher's current choice: a configuration or a prefetch never changes the reduction order.

    python -m bench.gemv_stream [--shapes huginn,ouro,360m] [--prefetch 0,1] [--torch] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: (name, N, K, group): the one-row matmuls of a decode step.
SHAPE_SETS = {
    "huginn": [("huginn q|k|v", 15840, 5280, 32), ("huginn wo", 5280, 5280, 32),
               ("huginn gate|up", 35840, 5280, 32), ("huginn down", 5280, 17920, 32),
               ("huginn adapter", 5280, 10560, 32), ("huginn head", 65536, 5280, 32)],
    "ouro": [("ouro q|k|v", 6144, 2048, 128), ("ouro wo", 2048, 2048, 128),
             ("ouro gate|up", 11264, 2048, 128), ("ouro down", 2048, 5632, 128),
             ("ouro head", 49152, 2048, 128)],
    "360m": [("360m q|k|v", 3072, 1024, 128), ("360m gate|up", 8192, 1024, 128),
             ("360m down", 1024, 4096, 128), ("360m head", 50304, 1024, 128)],
}
#: (TT, R, NW, KC) candidates for one row.
CONFIGS = [(1, 2, 8, 4096), (1, 4, 8, 4096), (1, 8, 8, 4096), (1, 2, 8, 6144), (1, 4, 8, 6144),
           (1, 8, 4, 6144), (1, 2, 16, 6144), (1, 4, 16, 6144)]


def parse_shapes(spec: str):
    out = []
    for part in spec.split(","):
        if part in SHAPE_SETS:
            out += SHAPE_SETS[part]
        else:          # NxK:group
            nk, g = part.split(":")
            n, k = (int(v) for v in nk.split("x"))
            out.append((part, n, k, int(g)))
    return out


def random_q4(rng, N: int, K: int, group: int):
    """Random q4 parts as tinyloop stores them (codes packed two per byte, fp16 scales, zeros)."""
    q = rng.integers(0, 256, (N, K // 2), dtype=np.uint8)
    s = (rng.random((N, K // group), dtype=np.float32) * 0.01 + 0.001).astype(np.float16)
    z = rng.integers(0, 16, (N, K // group), dtype=np.uint8)
    return q, s, z


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="huginn,ouro")
    ap.add_argument("--prefetch", default="0,1", help="0 (off), 1 (on) or both")
    ap.add_argument("--configs", default="", help="TT-R-NW-KC;... (default: the built-in list)")
    ap.add_argument("--pipe", default="0", help="weight-word pipeline stages to try (matmul.PIPE_STAGES; "
                                                "0: off), e.g. 0,2,4")
    ap.add_argument("--hbm-mb", type=int, default=256)
    ap.add_argument("--max-copies", type=int, default=64)
    ap.add_argument("--reps", type=int, default=48)
    ap.add_argument("--torch", action="store_true", help="also time tinygemm on the same shapes")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from numba import cuda

    from bench.decode_bench import graph_time_ms
    from tinyloop.cuda.kernels import matmul as km

    configs = ([tuple(int(v) for v in c.split("-")) for c in args.configs.split(";")]
               if args.configs else CONFIGS)
    pfs = [bool(int(v)) for v in args.prefetch.split(",")]
    try:
        pipes = [int(v) for v in args.pipe.split(",")]
    except ValueError:
        ap.error(f"--pipe {args.pipe!r}: expected comma-separated stage counts (0, or 2 and more)")
    if any(p < 0 or p == 1 for p in pipes):
        ap.error(f"--pipe {args.pipe!r}: a stage count is 0 (off) or at least 2")
    stages0 = km.PIPE_STAGES
    stream = cuda.stream()
    rng = np.random.default_rng(0)
    saved = (km.config_for, km.prefetch_for, km.max_registers_for)
    rows = []
    try:
        for name, N, K, group in parse_shapes(args.shapes):
            q, s, z = random_q4(rng, N, K, group)
            nbytes = q.nbytes + s.nbytes + z.nbytes
            copies = max(1, min(args.max_copies, -(-args.hbm_mb * (1 << 20) // nbytes)))
            dev = [tuple(cuda.to_device(a) for a in (q, s, z)) for _ in range(copies)]
            x = cuda.to_device(rng.standard_normal((1, K), dtype=np.float32))
            out = cuda.device_array((1, N), np.float32)

            def fn():
                for i in range(args.reps):
                    dq, ds, dz = dev[i % copies]
                    km.matmul(out, x, dq, ds, dz, stream=stream)

            km.config_for, km.prefetch_for, km.max_registers_for = saved
            cfg0 = km.config_for("q4", 1, N, False, K)
            rule = (cfg0, km.prefetch_for("q4", 1, -(-N // (cfg0[1] * cfg0[2]))))
            us0 = graph_time_ms(stream, fn, args.reps) * 1e3
            ref = out.copy_to_host()
            base = {"shape": name, "N": N, "K": K, "group": group, "MB": nbytes / 2 ** 20,
                    "copies": copies}
            rows.append({**base, "config": "rule", "used": list(rule[0]), "prefetch": rule[1],
                         "us": us0, "GB_per_s": nbytes / us0 / 1e3, "identical": True})
            print(f"{name:16} {N}x{K} g{group} {nbytes / 2**20:6.1f} MB x{copies}: rule "
                  f"{rule} {us0:8.1f} us {nbytes / us0 / 1e3:6.0f} GB/s", flush=True)
            for cfg in configs:
                for u in pfs:
                    km.config_for = lambda kind, T, n=0, pair=False, k=0, _c=cfg: (
                        _c if T == 1 else saved[0](kind, T, n, pair, k))
                    km.prefetch_for = lambda kind, T, blocks, _u=u: _u and T == 1
                    km.max_registers_for = lambda T, n, k=0: 0
                    for pp in pipes:
                        km.PIPE_STAGES = pp
                        st = km.pipe_for("q4", 1, cfg)
                        if pp and not st:
                            continue
                        try:
                            us = graph_time_ms(stream, fn, args.reps) * 1e3
                        except Exception as e:        # (a configuration that cannot compile or launch)
                            print(f"  {cfg} pf{int(u)} pipe{st}: failed: {type(e).__name__}: {e}", flush=True)
                            continue
                        finally:
                            km.PIPE_STAGES = stages0
                        same = bool(np.array_equal(out.copy_to_host(), ref))
                        rows.append({**base, "config": list(cfg), "used": list(cfg), "prefetch": u, "pipe": st,
                                     "us": us, "GB_per_s": nbytes / us / 1e3, "identical": same})
                        print(f"  {cfg} pf{int(u)} pipe{st}: {us:8.1f} us {nbytes / us / 1e3:6.0f} GB/s "
                              f"identical={same}", flush=True)
            km.config_for, km.prefetch_for, km.max_registers_for = saved
            if args.torch:
                rows.append({**base, **torch_row(q, s, z, group, copies, args.reps)})
                r = rows[-1]
                print(f"  tinygemm: {r['us']:8.1f} us {nbytes / r['us'] / 1e3:6.0f} GB/s", flush=True)
            del dev
    finally:
        km.config_for, km.prefetch_for, km.max_registers_for = saved
        km.PIPE_STAGES = stages0
    print("\nbest per shape (us, GB/s of codes + scales + zeros):")
    for name in dict.fromkeys(r["shape"] for r in rows):
        mine = [r for r in rows if r["shape"] == name and r["config"] != "tinygemm" and r["identical"]]
        best = min(mine, key=lambda r: r["us"])
        rule = next(r for r in mine if r["config"] == "rule")
        tg = [r for r in rows if r["shape"] == name and r["config"] == "tinygemm"]
        tgs = f"  tinygemm {tg[0]['us']:.1f}" if tg else ""
        print(f"{name:16} rule {rule['us']:7.1f} ({rule['GB_per_s']:.0f})  best {best['us']:7.1f} "
              f"({best['GB_per_s']:.0f}) {best['used']} pf{int(best['prefetch'])} pipe{best.get('pipe', 0)}{tgs}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=2))
    return 0


def torch_row(q, s, z, group, copies, reps) -> dict:
    """tinygemm (`_weight_int4pack_mm`, bf16) on the same codes, cycling `copies` packed copies."""
    import torch

    from bench.imma_probe import torch_graph_us
    from bench.torch_int4 import to_tinygemm
    N = q.shape[0]
    codes = np.empty((N, q.shape[1] * 2), np.uint8)
    codes[:, 0::2] = q & 15
    codes[:, 1::2] = q >> 4
    w0 = to_tinygemm(codes, s.astype(np.float32), z.astype(np.float32))
    ws = [w0] + [(w0[0].clone(), w0[1].clone(), w0[2]) for _ in range(copies - 1)]
    x = torch.randn(1, codes.shape[1], device="cuda", dtype=torch.bfloat16)

    def fn(i):
        p, sz, g = ws[i % copies]
        torch.ops.aten._weight_int4pack_mm(x, p, g, sz)
    us = torch_graph_us(fn, reps)
    del ws
    torch.cuda.empty_cache()
    return {"config": "tinygemm", "used": [], "prefetch": False, "us": us,
            "GB_per_s": (q.nbytes + s.nbytes + z.nbytes) / us / 1e3, "identical": False}


if __name__ == "__main__":
    raise SystemExit(main())
