"""Cache reuse: warm start to a deeper loop, prefix reuse and a prefix-pool workload.

All timings are time to first token (call entry to the first token read back, so the device has
finished) of max_tokens=1 requests, medians over --repeats, every side in the same process on the
same weights (default: the `360m` synth preset on CUDA; the demo model on the CPU):

* **warm start** (--prompt-len, --used -> --new): a fresh request at L_new; resume_generate at
  L_new from a handle built at L_used (build not counted: it is the earlier, shallower request);
  the saving vs the ideal L_used / L_new of the loop work, and vs the ideal of the whole forward
  (pre blocks and L_used iterations skipped, post blocks and head recomputed). Also the tiered
  pattern build + resume(L_used) + resume(L_new) vs fresh(L_used) + fresh(L_new), and the tokens of
  resume(L_new) against the fresh request (16 tokens).
* **prefix reuse** (--prefix-len + --suffix-len): generate(prefix + suffix) vs
  generate_from_prefix_cache(pc, suffix).
* **pool** (--scaffolds, --requests, --share): requests that are a registered scaffold plus a
  suffix with probability --share, else fresh tokens of the same length; generate_with_pool vs
  generate on the same request stream: hit rate and mean time to first token.

Prints a table, writes JSON (--json).

    python bench/reuse_bench.py --backend cuda --json reuse.json
    python bench/reuse_bench.py --backend cpu --prompt-len 256 --prefix-len 512 --requests 60
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.decode_bench import _commit, _median, bench_model, gpu_name, log  # noqa: E402
from tinyloop.progress import bar  # noqa: E402


def ttft(fn) -> float:
    """Time to first token (ms) of one max_tokens=1 request run by fn(stats)."""
    import tinyloop as tl
    st = tl.GenerateStats()
    fn(st)
    return st.first_token_ms


def warm_start(model, prompt, used: int, new: int, repeats: int) -> dict:
    import tinyloop as tl
    one = tl.GenerateConfig(max_tokens=1)
    fresh = {L: [] for L in (used, new)}
    resumed, build, tier_resume_used = [], [], []
    for L in (used, new):                                          # compile, warm, capture
        tl.generate(model, prompt, one.replace(loops=L))
    for _ in bar(range(repeats), f"warm start {used}->{new}", unit="run"):
        for L in (used, new):
            fresh[L].append(ttft(lambda st, L=L: tl.generate(model, prompt, one.replace(loops=L), stats=st)))
        t = time.perf_counter()
        h = tl.build_resume_handle(model, prompt, used)
        model.backend.rows_to_host(model.ws.x, 1)                   # waits for the device
        build.append((time.perf_counter() - t) * 1e3)
        tier_resume_used.append(ttft(lambda st: tl.resume_generate(h, used, one, stats=st)))
        resumed.append(ttft(lambda st: tl.resume_generate(h, new, one, stats=st)))
        tl.free_resume_handle(h)
    h = tl.build_resume_handle(model, prompt, used)
    cfg16 = tl.GenerateConfig(max_tokens=16)
    same = tl.resume_generate(h, new, cfg16) == tl.generate(model, prompt, cfg16.replace(loops=new))
    tl.free_resume_handle(h)
    c = model.cfg
    t_fresh, t_res = _median(fresh[new]), _median(resumed)
    saving = 1.0 - t_res / t_fresh
    ideal_loop = used / new
    ideal_forward = (c.n_pre + used * c.n_loop) / (c.n_pre + new * c.n_loop + c.n_post)
    tier_reuse = _median(build) + _median(tier_resume_used) + t_res
    tier_fresh = _median(fresh[used]) + t_fresh
    return {"prompt_len": len(prompt), "used": used, "new": new, "fresh_used_ms": _median(fresh[used]),
            "fresh_new_ms": t_fresh, "resume_new_ms": t_res, "build_ms": _median(build),
            "resume_used_ms": _median(tier_resume_used), "saving": saving, "ideal_loop_saving": ideal_loop,
            "fraction_of_loop_ideal": saving / ideal_loop, "ideal_forward_saving": ideal_forward,
            "fraction_of_forward_ideal": saving / ideal_forward, "tier_reuse_ms": tier_reuse,
            "tier_fresh_ms": tier_fresh, "same_tokens": bool(same)}


def prefix_reuse(model, prefix, suffix, repeats: int) -> dict:
    import tinyloop as tl
    one = tl.GenerateConfig(max_tokens=1)
    pc = tl.build_prefix_cache(model, prefix)
    try:
        tl.generate(model, prefix + suffix, one)
        tl.generate_from_prefix_cache(model, pc, suffix, one)
        plain, reused = [], []
        for _ in bar(range(repeats), "prefix reuse", unit="run"):
            plain.append(ttft(lambda st: tl.generate(model, prefix + suffix, one, stats=st)))
            reused.append(ttft(lambda st: tl.generate_from_prefix_cache(model, pc, suffix, one, stats=st)))
        cfg16 = tl.GenerateConfig(max_tokens=16)
        same = tl.generate_from_prefix_cache(model, pc, suffix, cfg16) == tl.generate(model, prefix + suffix, cfg16)
        nbytes = pc.nbytes
    finally:
        tl.free_prefix_cache(pc)
    return {"prefix_len": len(prefix), "suffix_len": len(suffix), "plain_ms": _median(plain),
            "reused_ms": _median(reused), "speedup": _median(plain) / _median(reused), "prefix_cache_bytes": nbytes,
            "same_tokens": bool(same)}


def pool_workload(model, n_scaffolds: int, scaffold_len: int, suffix_len: int, n_requests: int,
                  share: float, seed: int) -> dict:
    import tinyloop as tl
    rng = np.random.default_rng(seed)
    V = model.cfg.vocab_size
    scaffolds = [[int(t) for t in rng.integers(1, V, scaffold_len)] for _ in range(n_scaffolds)]
    reqs = []
    for _ in range(n_requests):
        suffix = [int(t) for t in rng.integers(1, V, suffix_len)]
        if rng.random() < share:
            reqs.append(scaffolds[int(rng.integers(n_scaffolds))] + suffix)
        else:
            reqs.append([int(t) for t in rng.integers(1, V, scaffold_len)] + suffix)
    one = tl.GenerateConfig(max_tokens=1)
    pool = tl.create_prefix_pool(n_scaffolds)
    try:
        t = time.perf_counter()
        for s in scaffolds:
            tl.register_prefix(pool, model, s)
        model.backend.rows_to_host(model.ws.x, 1)
        register_ms = (time.perf_counter() - t) * 1e3
        tl.generate(model, reqs[0], one)
        tl.generate_with_pool(model, pool, reqs[0], one)
        base = pool.stats()
        plain, pooled = [], []
        for r in bar(reqs, "pool workload", unit="req"):
            plain.append(ttft(lambda st: tl.generate(model, r, one, stats=st)))
            pooled.append(ttft(lambda st: tl.generate_with_pool(model, pool, r, one, stats=st)))
        s = pool.stats()
        hits, misses = s["hits"] - base["hits"], s["misses"] - base["misses"]
    finally:
        tl.free_prefix_pool(pool)
    return {"scaffolds": n_scaffolds, "scaffold_len": scaffold_len, "suffix_len": suffix_len,
            "requests": n_requests, "share": share, "hit_rate": hits / max(1, hits + misses),
            "register_ms": register_ms, "plain_mean_ms": float(np.mean(plain)),
            "pool_mean_ms": float(np.mean(pooled)), "speedup": float(np.mean(plain) / np.mean(pooled))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cuda", choices=("cpu", "cuda"), help="backend to run on")
    ap.add_argument("--model", help=".tinyloop file (default: --preset on cuda, the demo model on cpu)")
    ap.add_argument("--preset", default="360m", help="synth preset on cuda when --model is not given")
    ap.add_argument("--prompt-len", type=int, default=512, help="warm start: prompt tokens")
    ap.add_argument("--used", type=int, default=4, help="warm start: the handle's build depth L_used")
    ap.add_argument("--new", type=int, default=16, help="warm start: the deeper depth L_new")
    ap.add_argument("--prefix-len", type=int, default=1024, help="prefix reuse: shared prefix tokens")
    ap.add_argument("--suffix-len", type=int, default=32, help="prefix reuse and pool: suffix tokens")
    ap.add_argument("--scaffolds", type=int, default=8, help="pool: registered scaffolds")
    ap.add_argument("--scaffold-len", type=int, default=256, help="pool: tokens per scaffold")
    ap.add_argument("--requests", type=int, default=200, help="pool: requests in the stream")
    ap.add_argument("--share", type=float, default=0.7, help="pool: fraction of requests on a scaffold")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (median)")
    ap.add_argument("--json", help="write the results to this JSON file")
    args = ap.parse_args(argv)

    import tinyloop as tl
    picked = bench_model(args.backend, args.model, args.preset)
    if picked is None:
        print("error: --backend cuda needs a CUDA GPU", file=sys.stderr)
        return 2
    path, tmp = picked
    need = max(args.prompt_len, args.prefix_len + args.suffix_len, args.scaffold_len + args.suffix_len) + 20
    model = tl.load_model(path, max_seq_len=need, backend=args.backend)
    rng = np.random.default_rng(0)
    V = model.cfg.vocab_size
    if args.new > model.cfg.max_loops:
        print(f"error: --new {args.new} exceeds the model's max_loops {model.cfg.max_loops}", file=sys.stderr)
        return 2
    try:
        prompt = [int(t) for t in rng.integers(1, V, args.prompt_len)]
        ws = warm_start(model, prompt, args.used, args.new, args.repeats)
        log(f"warm start: {ws['saving']:.1%} saved ({ws['fraction_of_loop_ideal']:.0%} of the loop ideal)")
        prefix = [int(t) for t in rng.integers(1, V, args.prefix_len)]
        suffix = [int(t) for t in rng.integers(1, V, args.suffix_len)]
        pr = prefix_reuse(model, prefix, suffix, args.repeats)
        log(f"prefix reuse: {pr['speedup']:.2f}x")
        pw = pool_workload(model, args.scaffolds, args.scaffold_len, args.suffix_len, args.requests,
                           args.share, seed=1)
    finally:
        tl.free_model(model)
        if tmp is not None:
            tmp.cleanup()
    gpu = gpu_name() if args.backend == "cuda" else None
    res = {"date": time.strftime("%Y-%m-%d"), "commit": _commit(), "backend": args.backend, "gpu": gpu,
           "host": platform.node(), "model": os.path.basename(path), "warm_start": ws, "prefix_reuse": pr,
           "pool": pw}
    print(f"\nTinyLoop cache reuse  {res['date']}  {gpu or 'cpu'}  commit {res['commit']}  model {res['model']}")
    print(f"\nwarm start, {ws['prompt_len']}-token prompt, time to first token (ms)")
    print(f"{'fresh L=%d' % ws['used']:>14}{'fresh L=%d' % ws['new']:>14}{'resume ->%d' % ws['new']:>14}"
          f"{'saved':>9}{'loop ideal':>12}{'of ideal':>10}{'fwd ideal':>11}{'of ideal':>10}{'same':>6}")
    print(f"{ws['fresh_used_ms']:>14.2f}{ws['fresh_new_ms']:>14.2f}{ws['resume_new_ms']:>14.2f}{ws['saving']:>9.1%}"
          f"{ws['ideal_loop_saving']:>12.1%}{ws['fraction_of_loop_ideal']:>10.0%}{ws['ideal_forward_saving']:>11.1%}"
          f"{ws['fraction_of_forward_ideal']:>10.0%}{str(ws['same_tokens']):>6}")
    print(f"tiered (build + resume {ws['used']} + resume {ws['new']}) {ws['tier_reuse_ms']:.2f} ms vs fresh "
          f"{ws['used']} + fresh {ws['new']} {ws['tier_fresh_ms']:.2f} ms (build {ws['build_ms']:.2f} ms)")
    print(f"\nprefix reuse, {pr['prefix_len']} + {pr['suffix_len']} tokens: generate {pr['plain_ms']:.2f} ms, "
          f"from the prefix cache {pr['reused_ms']:.2f} ms ({pr['speedup']:.2f}x, same tokens {pr['same_tokens']}, "
          f"cache {pr['prefix_cache_bytes'] / 2**20:.1f} MiB)")
    print(f"\npool, {pw['scaffolds']} scaffolds x {pw['scaffold_len']} tokens + {pw['suffix_len']}, {pw['requests']} "
          f"requests, share {pw['share']:.0%}: hit rate {pw['hit_rate']:.1%}, mean TTFT {pw['pool_mean_ms']:.2f} ms "
          f"vs {pw['plain_mean_ms']:.2f} ms without ({pw['speedup']:.2f}x)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
