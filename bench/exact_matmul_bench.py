"""The exact integer tensor-core matmul (kernels/matmul_exact.py) against the fast fp32 kernel
(kernels/matmul.py) on the 360m q4 shapes: bits checked against the numpy reference
(tinyloop/model/exact_matmul.py) for plain, accumulating, norm-fused and SwiGLU-epilogue launches,
error of both against float64, time of both inside captured graphs, same process. One-row
launches take the exact matmul's dp4a kernel: `--gemv-r` times it for several rows per warp
(GEMV_R), plain and with the fused RMS norm (the decode step's form for q|k|v, gate|up and the
head); `--mma-nw` times the tensor-core kernel at T > 1 for several MMA_MAX_NW. Launches of at least
MMA_WIDE_T rows take the wide tensor-core kernel where it fills MMA_WIDE_BLOCKS blocks; each such
launch is also timed on both tensor-core kernels (same bits).

`--baseline FILE` also times the same launches through another version of the kernels file (for
example `git show HEAD~1:tinyloop/cuda/kernels/matmul_exact.py > /tmp/old.py`), loaded as a module
of the same package, and checks its bits against the current kernels': an A/B in one process.

    python bench/exact_matmul_bench.py [--rows 1,2,8,32,128] [--gemv-r 1,2,4] [--mma-nw 4,8,12]
        [--baseline old_matmul_exact.py] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"6144x2048": (6144, 2048), "2048x2048": (2048, 2048), "11264x2048": (11264, 2048),
          "2048x5632": (2048, 5632), "50304x2048": (50304, 2048)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,8,32,128")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--gemv-r", default="", help="rows per warp of the one-row kernel to time at T = 1")
    ap.add_argument("--mma-nw", default="",
                    help="most warps per tensor-core block (MMA_MAX_NW) to time at T > 1")
    ap.add_argument("--baseline", help="another version of kernels/matmul_exact.py to time on the same launches")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = [int(t) for t in args.rows.split(",")]
    if args.baseline and not Path(args.baseline).is_file():
        ap.error(f"--baseline {args.baseline!r}: no such file")
    base_mx = _load_baseline(args.baseline) if args.baseline else None
    from numba import cuda

    from bench.decode_bench import graph_time_ms
    from tinyloop.cuda.kernels import matmul as km
    from tinyloop.cuda.kernels import matmul_exact as mx
    from tinyloop.cuda.kernels import rmsnorm as krms
    from tinyloop.cuda.kernels import swiglu as ksw
    from tinyloop.model.arch import TensorQuant
    from tinyloop.model.exact_matmul import exact_matmul
    from tinyloop.model.quant import dequantize, quantize, unpack
    stream = cuda.stream()
    rng = np.random.default_rng(0)
    results = []
    checks = []
    for name in args.shapes.split(","):
        N, K = SHAPES[name]
        w = rng.standard_normal((N, K), dtype=np.float32) * 0.02
        tq = TensorQuant("q4", 128)
        parts = quantize(w, tq)
        codes = unpack(parts["q"], 4, K)
        q, s, z = (cuda.to_device(parts[k]) for k in ("q", "scales", "zeros"))
        for T in rows:
            ls, ss, es = mx.staging_shapes(T, K, 128)
            limbs = cuda.to_device(np.zeros(ls, np.uint8))
            sx = cuda.to_device(np.zeros(ss, np.int64))
            ex = cuda.to_device(np.zeros(es, np.int32))
            xh = rng.standard_normal((T, K), dtype=np.float32)
            xh[:, ::97] *= 30.0
            x = cuda.to_device(xh)
            out = cuda.device_array((T, N), np.float32)

            def fast():
                for _ in range(args.reps):
                    km.matmul(out, x, q, s, z, stream=stream)

            def exact():
                for _ in range(args.reps):
                    mx.matmul_exact(out, x, q, s, z, limbs, sx, ex, stream=stream)
            def baseline():
                for _ in range(args.reps):
                    base_mx.matmul_exact(out, x, q, s, z, limbs, sx, ex, stream=stream)
            us_base = got_base = None
            if base_mx is not None:
                us_base = graph_time_ms(stream, baseline, args.reps) * 1e3
                got_base = out.copy_to_host()
            us_fast = graph_time_ms(stream, fast, args.reps) * 1e3
            got_fast = out.copy_to_host()
            us_exact = graph_time_ms(stream, exact, args.reps) * 1e3
            got = out.copy_to_host()
            if T <= 32 or (N <= 11264 and T <= 128):
                want = exact_matmul(xh, codes, parts["scales"], parts["zeros"])
                same = bool(np.array_equal(got, want))
            else:
                same = None
            ref64 = xh.astype(np.float64) @ dequantize(parts, tq, (N, K)).astype(np.float64).T
            sc = np.abs(ref64).max()
            r = {"shape": name, "T": T, "fast_us": us_fast, "exact_us": us_exact, "speedup": us_fast / us_exact,
                 "bit_exact_vs_reference": same, "err_fast": float(np.abs(got_fast - ref64).max() / sc),
                 "err_exact": float(np.abs(got - ref64).max() / sc)}
            results.append(r)
            print(f"{name:11} T={T:<4} fast {us_fast:8.1f} us  exact {us_exact:8.1f} us  x{us_fast / us_exact:5.2f}  "
                  f"bits={same}  err fast {r['err_fast']:.1e} exact {r['err_exact']:.1e}", flush=True)
            if us_base is not None:
                r["baseline_us"] = us_base
                r["baseline_same_bits"] = bool(np.array_equal(got_base, got))
                print(f"   baseline kernels {us_base:8.1f} us (same bits {r['baseline_same_bits']}); current x"
                      f"{us_base / us_exact:5.2f}", flush=True)
            if T >= mx.MMA_WIDE_T:
                # the same launch on each tensor-core kernel (the launcher picks one by its block rule)
                wide_t, wide_b = mx.MMA_WIDE_T, mx.MMA_WIDE_BLOCKS
                try:
                    mx.MMA_WIDE_T = 1 << 30
                    r["exact_narrow_us"] = graph_time_ms(stream, exact, args.reps) * 1e3
                    r["narrow_same_bits"] = bool(np.array_equal(out.copy_to_host(), got))
                    mx.MMA_WIDE_T, mx.MMA_WIDE_BLOCKS = wide_t, 1
                    r["exact_wide_us"] = graph_time_ms(stream, exact, args.reps) * 1e3
                    r["wide_same_bits"] = bool(np.array_equal(out.copy_to_host(), got))
                finally:
                    mx.MMA_WIDE_T, mx.MMA_WIDE_BLOCKS = wide_t, wide_b
                print(f"   narrow mma kernel {r['exact_narrow_us']:8.1f} us, wide {r['exact_wide_us']:8.1f} us "
                      f"(same bits {r['narrow_same_bits']} {r['wide_same_bits']}); wide x"
                      f"{r['exact_narrow_us'] / r['exact_wide_us']:5.2f}", flush=True)
            if 1 < T <= 8:
                # one token tile: the form the launcher's rule did not pick (a warp per group or
                # a warp per chunk), forced on the same launch
                rule = mx.per_group
                picked = rule(T, s.shape[1], -(-N // 16))
                try:
                    mx.per_group = lambda *a, _f=not picked: _f
                    r["exact_other_form_us"] = graph_time_ms(stream, exact, args.reps) * 1e3
                    r["other_form_same_bits"] = bool(np.array_equal(out.copy_to_host(), got))
                finally:
                    mx.per_group = rule
                r["form"] = "group" if picked else "chunk"
                print(f"   launcher's form: warp per {r['form']}; warp per {'chunk' if picked else 'group'}: "
                      f"{r['exact_other_form_us']:8.1f} us (same bits {r['other_form_same_bits']})", flush=True)
            if T > 1 and args.mma_nw:
                default_nw = mx.MMA_MAX_NW
                for nwv in (int(v) for v in args.mma_nw.split(",")):
                    mx.MMA_MAX_NW = nwv
                    r[f"exact_nw{nwv}_us"] = graph_time_ms(stream, exact, args.reps) * 1e3
                    ok = bool(np.array_equal(out.copy_to_host(), got))
                    print(f"   mma MMA_MAX_NW={nwv}: {r[f'exact_nw{nwv}_us']:7.1f} us (same bits {ok})", flush=True)
                mx.MMA_MAX_NW = default_nw
            if T == 1 and args.gemv_r:
                nw1 = cuda.to_device(rng.uniform(0.5, 1.5, K).astype(np.float32))

                def fast_norm():
                    for _ in range(args.reps):
                        km.matmul(out, x, q, s, z, stream=stream, norm_w=nw1, eps=1e-5)
                r["fast_norm_us"] = graph_time_ms(stream, fast_norm, args.reps) * 1e3
                default_r = (mx.GEMV_R, mx.GEMV_WIDE_R)
                for R in (int(v) for v in args.gemv_r.split(",")):
                    mx.GEMV_R = mx.GEMV_WIDE_R = R

                    def exact_norm():
                        for _ in range(args.reps):
                            mx.matmul_exact(out, x, q, s, z, limbs, sx, ex, norm_w=nw1, eps=1e-5, stream=stream)
                    r[f"exact_r{R}_us"] = graph_time_ms(stream, exact, args.reps) * 1e3
                    ok = bool(np.array_equal(out.copy_to_host(), got))
                    r[f"exact_norm_r{R}_us"] = graph_time_ms(stream, exact_norm, args.reps) * 1e3
                    print(f"   gemv R={R}: plain {r[f'exact_r{R}_us']:7.1f} us (same bits {ok})  norm-fused "
                          f"{r[f'exact_norm_r{R}_us']:7.1f} us against fast norm-fused {r['fast_norm_us']:7.1f}",
                          flush=True)
                mx.GEMV_R, mx.GEMV_WIDE_R = default_r
            if T in (1, 8) and name in ("2048x2048", "11264x2048"):
                # accumulate, fused norm, SwiGLU epilogue: each against its unfused equivalent
                base = rng.standard_normal((T, N), dtype=np.float32)
                out.copy_to_device(base)
                mx.matmul_exact(out, x, q, s, z, limbs, sx, ex, accumulate=True, stream=stream)
                acc = exact_matmul(xh, codes, parts["scales"], parts["zeros"], out=base.copy())
                ok_acc = bool(np.array_equal(out.copy_to_host(), acc))
                nw = cuda.to_device(rng.uniform(0.5, 1.5, K).astype(np.float32))
                xn = cuda.device_array((T, K), np.float32)
                krms.rmsnorm(xn, x, nw, 1e-5, stream=stream)
                mx.matmul_exact(out, x, q, s, z, limbs, sx, ex, norm_w=nw, eps=1e-5, stream=stream)
                want_n = exact_matmul(xn.copy_to_host(), codes, parts["scales"], parts["zeros"])
                ok_norm = bool(np.array_equal(out.copy_to_host(), want_n))
                ok_glu = None
                if N % 2 == 0:
                    F = N // 2
                    h = cuda.device_array((T, F), np.float32)
                    mx.matmul_exact(h, x, q, s, z, limbs, sx, ex, epilogue=ksw.glu_epilogue(F), stream=stream)
                    full = cuda.to_device(exact_matmul(xh, codes, parts["scales"], parts["zeros"]))
                    h2 = cuda.device_array((T, F), np.float32)
                    ksw.swiglu_fused(h2, full, stream=stream)
                    ok_glu = bool(np.array_equal(h.copy_to_host(), h2.copy_to_host()))
                checks.append({"shape": name, "T": T, "accumulate": ok_acc, "norm": ok_norm, "glu": ok_glu})
                print(f"   checks: accumulate={ok_acc} norm={ok_norm} glu={ok_glu}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": results, "checks": checks}, indent=2))
    return 0


def _load_baseline(path: str, name: str = "matmul_exact"):
    """The kernels file at `path` as a module of tinyloop.cuda.kernels (its relative imports resolve
    there), beside the current module `name`."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"tinyloop.cuda.kernels._baseline_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


if __name__ == "__main__":
    raise SystemExit(main())
