"""What the model family's optional features cost at decode: the same preset with q/k/v biases
(Qwen2-style imports), a scaled embedding, and both, against the plain preset, one process.

For each variant: a random-weight model of --preset (tinyloop.cli.synth) with the overrides,
greedy decode of --new-tokens after a --prompt-len random prompt at L = --loops, median ms/token
over --repeats runs after a warm-up (graph capture), and prefill ms. Prints a table, writes JSON
(--json). ``python -m bench.family_bench --backend cpu --preset small`` is a CPU run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

from bench.decode_bench import _commit, _median, log

VARIANTS = {"plain": {}, "qkv_bias": {"qkv_bias": True}, "embed_scale": {"embed_scale": 8.0},
            "qkv_bias+embed_scale": {"qkv_bias": True, "embed_scale": 8.0}}


def bench_variant(path: str, backend: str, prompt, new: int, loops: int, repeats: int) -> dict:
    import tinyloop as tl
    m = tl.load_model(path, max_seq_len=len(prompt) + new + 8, backend=backend)
    try:
        cfg = tl.GenerateConfig(max_tokens=new, loops=loops)
        tl.generate(m, prompt, tl.GenerateConfig(max_tokens=4, loops=loops))     # compile, capture
        dec, pre, out = [], [], None
        for _ in range(repeats):
            st = tl.GenerateStats()
            out = tl.generate(m, prompt, cfg, stats=st)
            pre.append(st.prefill_ms)
            dec.append(st.decode_ms / max(1, st.tokens_emitted - 1))
        return {"decode_ms_per_token": _median(dec), "prefill_ms": _median(pre),
                "tokens": out[len(prompt):len(prompt) + 8]}
    finally:
        tl.free_model(m)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--preset", default="360m")
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from tinyloop.cli.synth import synth_model
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, over in VARIANTS.items():
            path = os.path.join(tmp, f"{name}.tinyloop")
            t = time.perf_counter()
            cfg = synth_model(args.preset, path, seed=0, **over)
            log(f"{name}: wrote {args.preset} in {time.perf_counter() - t:.1f} s")
            prompt = [int(i) for i in np.random.default_rng(0).integers(0, cfg.vocab_size, args.prompt_len)]
            rows[name] = bench_variant(path, args.backend, prompt, args.new_tokens, args.loops, args.repeats)
            os.unlink(path)
    base = rows["plain"]["decode_ms_per_token"]
    print(f"{'variant':<22} {'ms/token':>9} {'x plain':>8} {'prefill ms':>11}")
    for name, r in rows.items():
        print(f"{name:<22} {r['decode_ms_per_token']:>9.3f} {r['decode_ms_per_token'] / base:>8.3f} "
              f"{r['prefill_ms']:>11.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": _commit(), "date": time.strftime("%Y-%m-%d"), "backend": args.backend,
                       "preset": args.preset, "loops": args.loops, "prompt_len": args.prompt_len,
                       "new_tokens": args.new_tokens, "repeats": args.repeats, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
