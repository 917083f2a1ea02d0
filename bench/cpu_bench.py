"""CPU decode benchmark through the public API: prefill time and decode tokens/s per loop count.

    python bench/cpu_bench.py MODEL.tinyloop [--loops 1,4] [--new-tokens 64] [--json out.json]

With no model, the `tiny` and `360m` presets are synthesized into a temporary directory and the
shipped demo model is measured too. Decode tokens/s exclude the first token (it comes from prefill).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tinyloop as tl  # noqa: E402
from tinyloop.progress import bar  # noqa: E402


def measure(path: str, loops, prompt_len: int, new: int) -> list:
    t = time.perf_counter()
    m = tl.load_model(path, max_seq_len=prompt_len + new + 8, backend="cpu")
    load_s = time.perf_counter() - t
    prompt = [(7 * i + 3) % m.vocab_size for i in range(prompt_len)]
    tl.generate(m, prompt[:8], tl.GenerateConfig(max_tokens=2, loops=1))    # compile
    rows = []
    try:
        for L in bar(loops, "loops", unit="depth"):
            st = tl.GenerateStats()
            tl.generate_stream(m, prompt, tl.GenerateConfig(max_tokens=new, loops=L), stats=st)
            rate = (st.tokens_emitted - 1) / (st.decode_ms / 1e3) if st.decode_ms > 0 else float("nan")
            rows.append({"model": os.path.basename(path), "loops": L, "load_s": load_s,
                         "prefill_ms": st.prefill_ms, "decode_tokens_per_s": rate})
    finally:
        tl.free_model(m)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--loops", default=None)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args()
    jobs = []
    tmp = None
    if args.model:
        jobs.append((args.model, args.loops or "1,4"))
    else:
        from tinyloop.cli.synth import synth_model
        from tinyloop.models import demo_model_path
        tmp = tempfile.TemporaryDirectory()
        for preset, loops in (("tiny", "1,4"), ("360m", "1,8")):
            p = os.path.join(tmp.name, f"{preset}.tinyloop")
            synth_model(preset, p)
            jobs.append((p, args.loops or loops))
        jobs.append((demo_model_path(), args.loops or "1,4,8"))
    rows = []
    for path, loops in jobs:
        rows += measure(path, [int(x) for x in loops.split(",")], args.prompt_len, args.new_tokens)
    print(f"{'model':<22}{'L':>4}{'prefill ms':>12}{'decode tok/s':>14}   ({os.cpu_count()} cores)")
    for r in rows:
        print(f"{r['model']:<22}{r['loops']:>4}{r['prefill_ms']:>12.0f}{r['decode_tokens_per_s']:>14.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(),
                                               "prompt_len": args.prompt_len, "rows": rows}, indent=2))
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
