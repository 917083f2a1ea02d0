"""Speculative decoding benchmark: plain greedy vs chain self-speculative on one model, one device.

    python bench/speculative_bench.py [--model FILE] [--backend cuda|cpu] [--verify-loops 4]
        [--draft-loops 1,2,3] [--draft-ahead 2,4,6] [--new-tokens 128] [--json out.json]

Wall-clock decode tokens/s (first token excluded, median of --repeats after a warm-up that also
captures the graphs), acceptance rate and tokens per verify pass, with and without verify-resume.
Every speculative output is checked to equal plain greedy decoding at verify_loops.
Default model: the shipped demo model, on prompts of Python code.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tinyloop as tl  # noqa: E402

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\nimport sys\n\n\ndef main():",
           "    def __repr__(self):\n        return", "for i, line in enumerate(lines):"]


def rate(st: tl.GenerateStats) -> float:
    return (st.tokens_emitted - 1) / (st.decode_ms / 1e3) if st.decode_ms > 0 else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--verify-loops", default="4")
    ap.add_argument("--draft-loops", default="1,2,3")
    ap.add_argument("--draft-ahead", default="2,4,6")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from tinyloop.core.models import demo_model_path
    from tinyloop.core.tokenizer import resolve_tokenizer
    path = args.model or demo_model_path()
    m = tl.load_model(path, max_seq_len=512, backend=args.backend)
    tok = resolve_tokenizer(m.header.tokenizer, None, m.vocab_size)
    prompts = [tok.encode(p) for p in PROMPTS]
    rows = []
    try:
        for Lv in [int(x) for x in args.verify_loops.split(",")]:
            def plain(ids):
                st = tl.GenerateStats()
                out = tl.generate_stream(m, ids, tl.GenerateConfig(max_tokens=args.new_tokens, loops=Lv), stats=st)
                return out, st

            refs = {}
            base = []
            for ids in prompts:
                refs[tuple(ids)] = plain(ids)[0]
                base.append(np.median([rate(plain(ids)[1]) for _ in range(args.repeats)]))
            base_rate = float(np.mean(base))
            rows.append({"verify_loops": Lv, "mode": "plain", "tokens_per_s": base_rate})
            print(f"L={Lv} plain greedy: {base_rate:.1f} tok/s", flush=True)
            for Ld in [int(x) for x in args.draft_loops.split(",") if int(x) < Lv]:
                for K in [int(x) for x in args.draft_ahead.split(",")]:
                    for resume in (True, False):
                        cfg = tl.SpeculativeConfig(max_tokens=args.new_tokens, draft_loops=Ld, verify_loops=Lv,
                                                   draft_ahead=K, verify_resume=resume)
                        rates, acc, mal, exact = [], [], [], True
                        for ids in prompts:
                            tl.generate_speculative(m, ids, cfg)        # warm-up and graph capture
                            r = []
                            for _ in range(args.repeats):
                                st = tl.GenerateStats()
                                out = tl.generate_speculative(m, ids, cfg, stats=st)
                                exact &= out == refs[tuple(ids)]
                                r.append(rate(st))
                            rates.append(np.median(r))
                            acc.append(st.acceptance_rate)
                            mal.append(st.mean_accepted_length)
                        row = {"verify_loops": Lv, "mode": "speculative", "draft_loops": Ld, "draft_ahead": K,
                               "verify_resume": resume, "tokens_per_s": float(np.mean(rates)),
                               "speedup": float(np.mean(rates)) / base_rate, "acceptance_rate": float(np.mean(acc)),
                               "tokens_per_verify": float(np.mean(mal)), "exact": bool(exact)}
                        rows.append(row)
                        print(f"L={Lv} Ld={Ld} K={K} resume={resume!s:5}: {row['tokens_per_s']:8.1f} tok/s "
                              f"x{row['speedup']:.2f} accept {row['acceptance_rate']:.2f} "
                              f"tok/verify {row['tokens_per_verify']:.2f} exact {exact}", flush=True)
    finally:
        backend = m.backend_name
        tl.free_model(m)
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "backend": backend,
                                               "model": Path(path).name, "new_tokens": args.new_tokens,
                                               "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
