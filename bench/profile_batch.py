"""Per-kernel GPU time of one lockstep batch step (CUPTI through torch.profiler).

Synthesizes a preset (default `360m`), decodes N random prompts with generate_batch on the CUDA
backend and records the device kernels of the lockstep steps: per kernel, the device
microseconds and launches per step, for each N of ``--lanes``. The step part is the difference
between a batch of 1 + n new tokens and one of 1 (the prefill and the first step are in both).
Writes JSON with ``--json``.

    python bench/profile_batch.py --lanes 1,8,32 --loops 8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

import numpy as np

from bench.profile_decode import short_name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="360m")
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--lanes", default="1,8,32")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    lanes = [int(x) for x in args.lanes.split(",") if x]
    if not lanes or min(lanes) < 1 or min(args.loops, args.prompt_len, args.tokens) < 1:
        ap.error("--lanes, --loops, --prompt-len and --tokens must be at least 1")

    import torch
    from torch.profiler import ProfilerActivity, profile

    import tinyloop as tl
    from tinyloop.cli.synth import synth_model
    from tinyloop.model.format import read_header

    tmp = tempfile.TemporaryDirectory()
    path = os.path.join(tmp.name, f"{args.preset}.tinyloop")
    synth_model(args.preset, path, seed=0)
    cfg = read_header(path).config
    rng = np.random.default_rng(0)
    m = tl.load_model(path, max_seq_len=args.prompt_len + args.tokens + 16, backend="cuda",
                      prefill_chunk=max(512, max(lanes)))
    out = {"preset": args.preset, "loops": args.loops, "prompt_len": args.prompt_len, "tokens": args.tokens,
           "date": time.strftime("%Y-%m-%d"), "lanes": {}}
    for n in lanes:
        prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, args.prompt_len)] for _ in range(n)]

        def kernels(new):
            per = defaultdict(lambda: [0.0, 0])
            tl.generate_batch(m, prompts, tl.GenerateConfig(max_tokens=new, loops=args.loops))   # warm
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                tl.generate_batch(m, prompts, tl.GenerateConfig(max_tokens=new, loops=args.loops))
                torch.cuda.synchronize()
            for ev in prof.events():
                if ev.device_type.name == "CUDA":
                    rec = per[short_name(ev.name)]
                    rec[0] += ev.device_time_total
                    rec[1] += 1
            return per
        base, full = kernels(1), kernels(1 + args.tokens)
        per = {k: [v[0] - base.get(k, [0.0, 0])[0], v[1] - base.get(k, [0.0, 0])[1]] for k, v in full.items()}
        per = {k: v for k, v in per.items() if v[1] > 0}
        rows = sorted(per.items(), key=lambda kv: -kv[1][0])
        total = sum(v[0] for v in per.values())
        st = []
        t = time.perf_counter()
        tl.generate_batch(m, prompts, tl.GenerateConfig(max_tokens=1 + args.tokens, loops=args.loops), stats=st)
        wall = ((time.perf_counter() - t) * 1e3 - st[0].prefill_ms) / args.tokens
        print(f"\nN={n} lanes, {args.preset} L={args.loops} prompt {args.prompt_len}: wall {wall:.3f} ms/step, "
              f"device {total / args.tokens / 1e3:.3f} ms/step")
        print(f"{'kernel':<52}{'us/step':>10}{'launches/step':>15}{'share':>8}")
        krows = []
        for k, (us, cnt) in rows[:14]:
            print(f"{k[:52]:<52}{us / args.tokens:>10.1f}{cnt / args.tokens:>15.1f}{100 * us / total:>7.1f}%")
            krows.append({"kernel": k, "us_per_step": us / args.tokens, "launches_per_step": cnt / args.tokens})
        out["lanes"][str(n)] = {"wall_ms_per_step": wall, "device_us_per_step": total / args.tokens,
                                "kernels": krows}
    tl.free_model(m)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
