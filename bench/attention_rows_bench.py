"""Attention of a prefill chunk: the split blocks against the rows form (kernels/attention.py),
same launch, same process, times inside captured graphs, bits compared.

A chunk of T rows at positions p0 .. p0 + T - 1 over an fp16 cache (the 360m preset's heads: 16
of 128, no GQA), for several T and p0; the split blocks run grid (T, H, Z) with the last-block
combine, the rows form grid (T, H) with the Z splits in turn (`attention.ROWS_T` picks between
them in the launcher).

    python bench/attention_rows_bench.py [--rows 8,32,64,128,1024] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="8,16,32,64,128,256,1024")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = [int(t) for t in args.rows.split(",") if t]
    if not rows or min(rows) < 1 or args.reps < 1:
        ap.error("--rows and --reps must be at least 1")
    if args.kv_heads < 1 or args.heads < 1 or args.heads % args.kv_heads:
        ap.error(f"--heads={args.heads} must be a positive multiple of --kv-heads={args.kv_heads}")
    if args.head_dim < 2 or args.head_dim % 2 or args.head_dim > 256:
        ap.error(f"--head-dim={args.head_dim} must be even, from 2 to 256")
    from numba import cuda

    from bench.decode_bench import gpu_name, graph_time_ms
    from tinyloop.cuda.kernels import attention as att
    H, Hk, hd = args.heads, args.kv_heads, args.head_dim
    stream = cuda.stream()
    rng = np.random.default_rng(0)
    res = {"gpu": gpu_name(), "heads": H, "kv_heads": Hk, "head_dim": hd, "rows": []}
    default_t = att.ROWS_T
    print(f"{'T':>5} {'p0':>5} {'split us':>10} {'rows us':>10} {'rows x':>7}  same bits")
    for T in rows:
        for p0 in sorted({0, 512}):
            S = p0 + T + 1
            kc = cuda.to_device(rng.standard_normal((1, S, Hk, hd)).astype(np.float16))
            vc = cuda.to_device(rng.standard_normal((1, S, Hk, hd)).astype(np.float16))
            q = cuda.to_device(rng.standard_normal((T, H * hd)).astype(np.float32))
            pos = cuda.to_device(np.array([p0], np.int32))
            work = cuda.to_device(np.zeros(att.workspace_shape(T, H, hd), np.float32))
            cnt = cuda.to_device(np.zeros(att.counter_shape(T, H), np.int32))
            out = cuda.device_array((T, H * hd), np.float32)
            times, outs = {}, {}
            for form, rows_t in (("split", 1 << 30), ("rows", 1)):
                att.ROWS_T = rows_t
                try:
                    def launch():
                        for _ in range(args.reps):
                            att.attention(out, q, kc, vc, 0, pos, work, cnt, stream=stream)
                    times[form] = graph_time_ms(stream, launch, args.reps) * 1e3
                    outs[form] = out.copy_to_host()
                finally:
                    att.ROWS_T = default_t
            same = bool(np.array_equal(outs["split"], outs["rows"]))
            r = {"T": T, "p0": p0, "split_us": times["split"], "rows_us": times["rows"],
                 "speedup": times["split"] / times["rows"], "same_bits": same}
            res["rows"].append(r)
            print(f"{T:>5} {p0:>5} {times['split']:>10.1f} {times['rows']:>10.1f} {r['speedup']:>7.2f}  {same}",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
