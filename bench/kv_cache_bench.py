"""KV cache modes side by side: bytes per token and decode speed at a long context.

For each cache mode (fp32, fp16, int8, int4 by default) and, optionally, a sliding window, on one
backend and one model (default: the `360m` synth preset on CUDA; the demo model on the CPU):
KV bytes per token (all layers at the request's depth, K and V), the cache's allocated bytes, and
decode ms/token of greedy decoding from a prompt of --context - --new-tokens tokens, so the last
tokens attend over about --context positions. Every mode runs in the same process on the same
weights and prompt; the ratios are against fp16 (the default mode). Prints a table, writes JSON.

    python bench/kv_cache_bench.py --backend cuda --preset 360m --context 2048 --json out.json
    python bench/kv_cache_bench.py --backend cpu --context 512
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


def kv_bytes_per_token(model, loops: int, mode: str) -> int:
    """K and V bytes one position takes over every cache layer of a request at `loops`."""
    from tinyloop.runtime.plugins import get_plugin_manager
    pm = get_plugin_manager()
    cfg = model.cfg
    cm = pm.cache_modes()[mode]
    groups = [("pre", cfg.n_pre), ("post", cfg.n_post), ("loop", loops * cfg.n_loop)]
    return sum(2 * n * cfg.n_kv_heads * pm.codec(cm.group_codec(g)).row_bytes(cfg.head_dim)
               for g, n in groups)


def cache_bytes(model, n_positions: int, loops: int, mode: str, window: int) -> int:
    """Bytes of the K/V storage a plain request of `n_positions` positions allocates (before a
    backend rounds its slots up): the spec the session builds."""
    import tinyloop as tl
    from tinyloop.runtime.cache import build_spec, linear_slots
    from tinyloop.runtime.plugins import get_plugin_manager
    pm = get_plugin_manager()
    sm = pm.slot_map_for(tl.GenerateConfig(cache_window=window))
    slots = (sm.slot_map(n_positions, sm.launch_rows(model.ws.rows)) if sm is not None
             else linear_slots(n_positions))
    spec = build_spec(model.cfg, loops, pm.cache_modes()[mode], slots)
    return spec.nbytes(model.cfg.n_kv_heads, model.cfg.head_dim, pm.kv_codecs())


def run_mode(model, prompt, new: int, loops: int, mode: str, window: int, repeats: int) -> dict:
    import tinyloop as tl

    cfg = tl.GenerateConfig(max_tokens=new, loops=loops, cache_mode=mode, cache_window=window)
    tl.generate(model, prompt, cfg.replace(max_tokens=4))            # compile, warm, capture
    dec, pre, toks = [], [], None
    for _ in bar(range(repeats), f"{mode} window {window}", unit="run"):
        st = tl.GenerateStats()
        toks = list(tl.generate_iter(model, prompt, cfg, stats=st))
        dec.append(st.decode_ms / max(1, st.tokens_emitted - 1))
        pre.append(st.prefill_ms)
    return {"cache_mode": mode, "window": window, "decode_ms_per_token": _median(dec),
            "prefill_ms": _median(pre), "kv_bytes_per_token": kv_bytes_per_token(model, loops, mode),
            "cache_bytes": cache_bytes(model, len(prompt) + new, loops, mode, window), "tokens": toks}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cuda", choices=("cpu", "cuda"))
    ap.add_argument("--model", help=".tinyloop file (default: --preset on cuda, the demo model on cpu)")
    ap.add_argument("--preset", default="360m")
    ap.add_argument("--modes", default="fp32,fp16,int8,int4")
    ap.add_argument("--window", type=int, default=0, help="also run every mode with this cache_window")
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    import tinyloop as tl
    picked = bench_model(args.backend, args.model, args.preset)
    if picked is None:
        print("error: --backend cuda needs a CUDA GPU", file=sys.stderr)
        return 2
    path, tmp = picked
    model = tl.load_model(path, max_seq_len=args.context + 8, backend=args.backend)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(1, model.cfg.vocab_size, args.context - args.new_tokens)]
    modes = [m for m in args.modes.split(",") if m]
    windows = [0] + ([args.window] if args.window else [])
    rows = []
    try:
        for w in windows:
            for mode in modes:
                r = run_mode(model, prompt, args.new_tokens, args.loops, mode, w, args.repeats)
                rows.append(r)
                log(f"{mode} window={w}: {r['decode_ms_per_token']:.3f} ms/token")
    finally:
        tl.free_model(model)
        if tmp is not None:
            tmp.cleanup()
    gpu = gpu_name() if args.backend == "cuda" else None
    res = {"date": time.strftime("%Y-%m-%d"), "commit": _commit(), "backend": args.backend, "gpu": gpu,
           "host": platform.node(), "model": os.path.basename(path), "loops": args.loops,
           "context": args.context, "new_tokens": args.new_tokens, "rows": rows}
    print(f"\nTinyLoop KV cache modes  {res['date']}  {gpu or 'cpu'}  commit {res['commit']}")
    print(f"model {res['model']}  L={args.loops}  context {args.context}  new {args.new_tokens}\n")
    print(f"{'mode':<6}{'window':>7}{'KV B/token':>12}{'cache MiB':>11}{'decode ms/tok':>15}{'vs fp16':>9}"
          f"{'same tokens as fp16':>21}")
    for r in rows:
        ref = next((x for x in rows if x["cache_mode"] == "fp16" and x["window"] == r["window"]), None)
        ratio = ref["decode_ms_per_token"] / r["decode_ms_per_token"] if ref else float("nan")
        same = "" if ref is None else f"{sum(a == b for a, b in zip(r['tokens'], ref['tokens']))}/{len(ref['tokens'])}"
        r["speed_vs_fp16"] = ratio
        print(f"{r['cache_mode']:<6}{r['window']:>7}{r['kv_bytes_per_token']:>12}{r['cache_bytes'] / 2**20:>11.2f}"
              f"{r['decode_ms_per_token']:>15.3f}{ratio:>9.2f}{same:>21}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
