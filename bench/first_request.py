"""Time to the first token of the first request in a fresh process (issue: "first request").

Each run is a new Python process that imports tinyloop, loads the model on the CUDA backend and
decodes: the times from the process's start to the import, to load_model's return, to the first
token of the first request (kernel JIT compilation and module loading happen here), to that
request's end (the decode step's capture as a CUDA graph happens at its second step), and a
second request of the same shape (everything compiled and captured). Run it twice or more to see
whether anything persists between processes (numba's on-disk cache, the driver's PTX cache).

    python -m bench.first_request --preset 360m --runs 2 --json docs/bench_first_request.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from .decode_bench import _commit, bench_model, log

_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import tinyloop as tl
t_import = time.perf_counter()
path, loops, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
m = tl.load_model(path, max_seq_len=256, backend="cuda")
t_load = time.perf_counter()
prompt = list(range(1, 17))
cfg = tl.GenerateConfig(max_tokens=new, loops=loops)
it = tl.generate_iter(m, prompt, cfg)
next(it)
t_first = time.perf_counter()
for _ in it:
    pass
t_done = time.perf_counter()
tl.generate(m, prompt, cfg)
t_second = time.perf_counter()
print(json.dumps({"import_s": t_import - t0, "load_s": t_load - t_import, "first_token_s": t_first - t_load,
                  "first_request_s": t_done - t_load, "start_to_first_token_s": t_first - t0,
                  "second_request_s": t_second - t_done}))
"""


def run_once(path: str, loops: int, new: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, path, str(loops), str(new)], capture_output=True,
                         text=True, env=dict(os.environ))
    if out.returncode != 0:
        raise RuntimeError(f"child failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help=".tinyloop file (default: synthesize --preset)")
    ap.add_argument("--preset", default="360m")
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--runs", type=int, default=2, help="fresh processes, one after another (default 2)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.loops < 1 or args.new_tokens < 2:
        ap.error("--runs and --loops must be >= 1, --new-tokens >= 2")
    got = bench_model("cuda", args.model, args.preset)
    if got is None:
        print("no CUDA GPU: nothing to measure", file=sys.stderr)
        return 1
    path, tmp = got
    try:
        runs = []
        for i in range(args.runs):
            r = run_once(path, args.loops, args.new_tokens)
            runs.append(r)
            log(f"run {i + 1}: {r}")
    finally:
        if tmp is not None:
            tmp.cleanup()
    res = {"commit": _commit(), "model": os.path.basename(path), "loops": args.loops,
           "new_tokens": args.new_tokens, "runs": runs}
    print(f"\nfirst request, fresh process each run (model {res['model']}, L={args.loops}, "
          f"{args.new_tokens} tokens, commit {res['commit']})")
    print(f"{'run':>4}{'import s':>10}{'load s':>9}{'1st token s':>13}{'1st request s':>15}{'2nd request s':>15}")
    for i, r in enumerate(runs):
        print(f"{i + 1:>4}{r['import_s']:>10.2f}{r['load_s']:>9.2f}{r['first_token_s']:>13.2f}"
              f"{r['first_request_s']:>15.2f}{r['second_request_s']:>15.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
