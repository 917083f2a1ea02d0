"""A/B of the CUDA matmul's launch rules in whole-model decode, one process: the rules as they are
against a baseline with GEMV_LONG_CONFIG and the L2 prefetch switched off (the launcher before
them), alternating fresh model loads (each captures its own graphs with the rules of the moment).
Greedy tokens must be identical between the two: the rules never change the reduction order.

    python -m bench.matmul_rules_ab --models 360m,ouro-1.4b,huginn-0125 --loops 8,4,4+8 [--json F]

(--loops: one depth list per model, depths joined by +.)

Models are the 360m preset or the layouts of bench/looped_layouts_bench.py, random q4 weights.
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


def baseline_rules(km) -> dict:
    """Module constants that restore the launcher as it was before GEMV_LONG_CONFIG and the prefetch."""
    return {"LONG_K": 1 << 40, "PREFETCH_BLOCKS": 0}


def run_variant(path: str, km, consts: dict, prompt, new: int, loops: int, repeats: int, backend: str = "cuda"):
    import tinyloop as tl
    saved = {k: getattr(km, k) for k in consts}
    for k, v in consts.items():
        setattr(km, k, v)
    try:
        m = tl.load_model(path, max_seq_len=len(prompt) + new + 8, backend=backend)
        try:
            cfg = tl.GenerateConfig(max_tokens=new, loops=loops)
            tl.generate(m, prompt, tl.GenerateConfig(max_tokens=4, loops=loops))
            times, toks = [], None
            for _ in range(repeats):
                st = tl.GenerateStats()
                toks = list(tl.generate(m, prompt, cfg, stats=st))
                times.append(st.decode_ms / max(1, st.tokens_emitted - 1))
            return _median(times), toks
        finally:
            tl.free_model(m)
    finally:
        for k, v in saved.items():
            setattr(km, k, v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="360m")
    ap.add_argument("--backend", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke run only")
    ap.add_argument("--loops", default="8")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="new/baseline alternations per model")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from bench.looped_layouts_bench import LAYOUTS
    from tinyloop.cli.synth import synth_model
    from tinyloop.cuda.kernels import matmul as km

    names = args.models.split(",")
    loops = [[int(d) for d in v.split("+")] for v in args.loops.split(",")]
    if len(loops) == 1:
        loops *= len(names)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, depths in zip(names, loops):
            path = os.path.join(tmp, f"{name}.tinyloop")
            t = time.perf_counter()
            if name in LAYOUTS:
                over, group, _ = LAYOUTS[name]
                cfg = synth_model("360m", path, seed=0, quant="q4", group_size=group, **over)
            else:
                cfg = synth_model(name, path, seed=0, quant="q4")
            log(f"{name}: wrote {os.path.getsize(path) / 1e9:.2f} GB in {time.perf_counter() - t:.1f} s")
            prompt = [int(i) for i in np.random.default_rng(0).integers(0, cfg.vocab_size, args.prompt_len)]
            for L in depths:
                res = {"new": [], "baseline": []}
                toks = {}
                for _ in range(args.rounds):
                    for variant, consts in (("new", {}), ("baseline", baseline_rules(km))):
                        ms, tk = run_variant(path, km, consts, prompt, args.new_tokens, L, args.repeats,
                                             args.backend)
                        res[variant].append(ms)
                        toks.setdefault(variant, tk)
                        log(f"  {name} L={L} {variant}: {ms:.3f} ms/token")
                same = toks["new"] == toks["baseline"]
                rows.append({"model": name, "loops": L, "new_ms": min(res["new"]),
                             "baseline_ms": min(res["baseline"]), "runs": res, "tokens_identical": same})
            os.unlink(path)
    print(f"{'model':<14} {'L':>3} {'baseline ms':>12} {'new ms':>9} {'ratio':>7} tokens")
    for r in rows:
        print(f"{r['model']:<14} {r['loops']:>3} {r['baseline_ms']:>12.3f} {r['new_ms']:>9.3f} "
              f"{r['new_ms'] / r['baseline_ms']:>7.3f} {'identical' if r['tokens_identical'] else 'DIFFER'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": _commit(), "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
