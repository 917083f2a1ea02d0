"""The device sampler alone (kernels/sample.py: histogram + pick) inside captured graphs, against
the split argmax greedy decoding runs in its place, and optionally against another version of
sample.py on the same launches; every drawn token checked against the host sampler.

    python -m bench.sample_bench [--vocab 49152,151936] [--top-k 1,50,256,1024]
        [--baseline old/sample.py] [--json out.json]

Logits are Gaussian with standard deviation `--scale` (a trained LM's head output is in this
range); the uniform number of each launch is read on the device, as in decoding. Prints µs per
sample launch pair, per histogram kernel and per pick kernel launched alone (and per argmax), and
writes JSON with `--json`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def _ints(ap, text: str, flag: str) -> list:
    try:
        vals = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        ap.error(f"{flag} {text!r}: not a comma-separated list of integers")
    if not vals or min(vals) < 1:
        ap.error(f"{flag} {text!r}: must be at least one integer, each >= 1")
    return vals


def _parts(mod):
    """(hist_launch, pick_launch) of a sample.py version: its own, or for a version from before
    they existed (one pick block, work = (hist, ticket, plan)) the same launches spelled out."""
    if hasattr(mod, "pick_launch"):
        return mod.hist_launch, mod.pick_launch

    def hist_launch(logits, iparams, work, stream):
        nb = (logits.shape[0] + mod.CHUNK - 1) // mod.CHUNK
        mod._hist_kernel[nb, mod.HIST_NT, stream](logits, iparams, *work[:3])

    def pick_launch(out, logits, params, iparams, utab, pos, T, work, stream):
        mod._pick_kernel[1, mod.NT, stream](out, logits, params, iparams, utab, pos, T, work[2])

    return hist_launch, pick_launch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", default="49152,151936", help="vocabulary sizes (comma-separated)")
    ap.add_argument("--top-k", default="1,50,256,1024", help="top-k values (at most the sampler's KMAX)")
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--scale", type=float, default=2.5, help="standard deviation of the logits")
    ap.add_argument("--reps", type=int, default=50, help="launches per captured graph")
    ap.add_argument("--baseline", help="another version of kernels/sample.py to time on the same launches")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    vocabs = _ints(ap, args.vocab, "--vocab")
    top_ks = _ints(ap, args.top_k, "--top-k")
    for flag, ok in (("--top-p", 0.0 < args.top_p <= 1.0), ("--temperature", args.temperature > 0.0),
                     ("--scale", args.scale > 0.0), ("--reps", args.reps >= 1)):
        if not ok:
            ap.error(f"{flag} {getattr(args, flag[2:].replace('-', '_'))!r}: must be in (0, 1] for "
                     "--top-p, > 0 for --temperature and --scale, at least 1 for --reps")
    if args.baseline and not Path(args.baseline).is_file():
        ap.error(f"--baseline {args.baseline!r}: no such file")
    from tinyloop.cuda.kernels import sample as ksample
    if max(top_ks) > ksample.KMAX:
        ap.error(f"--top-k {args.top_k!r}: must be at most {ksample.KMAX} (the device sampler's KMAX)")
    from numba import cuda

    from bench.decode_bench import graph_time_ms
    from bench.exact_matmul_bench import _load_baseline
    from tinyloop.cuda.kernels import argmax as kargmax
    from tinyloop.runtime.sampling import sample_token
    versions = {"new": ksample}
    if args.baseline:
        versions["base"] = _load_baseline(args.baseline, "sample")
    stream = cuda.stream()
    rng = np.random.default_rng(0)
    rows = []
    mismatches = 0
    for V in vocabs:
        host_logits = (rng.standard_normal(V) * args.scale).astype(np.float32)
        logits = cuda.to_device(host_logits)
        utab_h = rng.random(args.reps + 1)
        utab = cuda.to_device(utab_h)
        out = cuda.device_array(1, np.int32)
        amax_out = cuda.device_array(1, np.int32)
        awork = tuple(cuda.to_device(np.zeros(n, dt)) for n, dt in
                      zip((s[0] for s in kargmax.work_shapes(1)), (np.float32, np.int32, np.int32)))
        logits2 = logits.reshape(1, V)

        def greedy():
            for _ in range(args.reps):
                kargmax.argmax(amax_out, logits2, stream=stream, work=awork)

        us_argmax = graph_time_ms(stream, greedy, args.reps) * 1e3
        for k in top_ks:
            row = {"vocab": V, "top_k": k, "top_p": args.top_p, "temperature": args.temperature,
                   "argmax_us": us_argmax}
            for name, mod in versions.items():
                work = tuple(cuda.to_device(np.zeros(s, np.int32)) for s in mod.work_shapes())
                params = cuda.to_device(np.array([args.temperature, args.top_p], np.float64))
                iparams = cuda.to_device(np.array([k, 0], np.int32))
                pos = cuda.to_device(np.zeros(1, np.int32))
                # each launch draws with its own uniform: utab[pos + T - base] for T = 1..reps
                drawn = []
                for t in range(1, 4):
                    mod.sample(out, logits, params, iparams, utab, pos, t, work, stream=stream)
                    stream.synchronize()
                    drawn.append(int(out.copy_to_host()[0]))
                want = [sample_token(host_logits, args.temperature, k, args.top_p, utab_h[t]) for t in range(1, 4)]
                ok = drawn == want
                mismatches += not ok

                def draw(mod=mod, params=params, iparams=iparams, pos=pos, work=work):
                    for _ in range(args.reps):
                        mod.sample(out, logits, params, iparams, utab, pos, 1, work, stream=stream)

                row[f"{name}_us"] = graph_time_ms(stream, draw, args.reps) * 1e3
                hist_launch, pick_launch = _parts(mod)

                def hist_only(iparams=iparams, work=work, hist_launch=hist_launch):
                    for _ in range(args.reps):      # each launch leaves its counters zero
                        hist_launch(logits, iparams, work, stream)

                def pick_only(params=params, iparams=iparams, pos=pos, work=work, pick_launch=pick_launch):
                    for _ in range(args.reps):      # the plan of the last histogram, read only
                        pick_launch(out, logits, params, iparams, utab, pos, 1, work, stream)

                row[f"{name}_hist_us"] = graph_time_ms(stream, hist_only, args.reps) * 1e3
                row[f"{name}_pick_us"] = graph_time_ms(stream, pick_only, args.reps) * 1e3
                row[f"{name}_equals_host"] = ok
            rows.append(row)
    cols = list(versions)
    head = ("| V | top-k | argmax µs | "
            + " | ".join(f"sample {c} µs (hist / pick alone)" for c in cols) + " | tokens = host |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        print(f"| {r['vocab']} | {r['top_k']} | {r['argmax_us']:.2f} | "
              + " | ".join(f"{r[c + '_us']:.2f} ({r[c + '_hist_us']:.2f} / {r[c + '_pick_us']:.2f})"
                           for c in cols) + " | "
              + ("yes" if all(r[c + "_equals_host"] for c in cols) else "NO") + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "args": vars(args)}, indent=1))
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
