"""Held-out perplexity of the PyTorch checkpoint BEFORE conversion, with exactly the windowing of
``tinyloop ppl`` (non-overlapping windows of --window tokens; token i of a window is predicted from
tokens 0..i-1 of the same window), so MODEL_CARD.md can set the two side by side.

    python tools/eval_torch_ppl.py --checkpoint build/demo_model/model.safetensors \
        --config build/demo_model/config.json --tokenizer build/demo --text data/heldout_eval.txt \
        --loops 1,2,4,8,12,16 --window 256 --max-windows 100
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    import torch
    from safetensors.numpy import load_file

    from tinyloop.model.arch import ModelConfig
    from tinyloop.model.tokenizer import BPETokenizer
    from tinyloop.torch_model import LoopedLM

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--loops", default="1,2,4,8,12,16")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--max-windows", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    cfg = ModelConfig.from_dict(json.loads(Path(args.config).read_text()))
    weights = {k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in load_file(args.checkpoint).items()}
    model = LoopedLM.from_logical(cfg, weights).eval()
    ids = np.asarray(BPETokenizer.from_dir(args.tokenizer).encode(Path(args.text).read_text("utf-8")))
    n_win = len(ids) // args.window
    if args.max_windows:
        n_win = min(n_win, args.max_windows)
    results = []
    print(f"{'loops':>5} {'ppl':>10} {'nll':>8} {'tokens':>8}")
    for L in [int(x) for x in args.loops.split(",")]:
        nll, count = 0.0, 0
        with torch.no_grad():
            for w in range(n_win):
                chunk = torch.from_numpy(ids[w * args.window:(w + 1) * args.window]).long()[None]
                logits = model(chunk, loops=L)[0].double()
                lp = torch.log_softmax(logits[:-1], dim=-1)
                nll -= float(lp[torch.arange(args.window - 1), chunk[0, 1:]].sum())
                count += args.window - 1
        r = {"loops": L, "ppl": math.exp(nll / count), "nll": nll / count, "tokens": count, "windows": n_win}
        results.append(r)
        print(f"{L:>5} {r['ppl']:>10.3f} {r['nll']:>8.4f} {count:>8}")
        sys.stdout.flush()
    if args.json:
        Path(args.json).write_text(json.dumps({"checkpoint": args.checkpoint, "window": args.window,
                                               "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
