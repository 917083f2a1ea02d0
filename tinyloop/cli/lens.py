"""``tinyloop lens FILE --text "..." -o lens.png``: the logit lens as a picture (depth x token), or
with ``--uncertainty`` the per-token entropy / settled-depth strip (matplotlib: tinyloop[plot])."""

from __future__ import annotations

import argparse
import os
import sys

from ..analysis import plots
from ..analysis.scoring import score_logit_lens, score_with_uncertainty
from ..errors import ConfigError
from ..runtime.engine import free_model, load_model
from ..runtime.plugins import get_plugin_manager
from .run import _check_writable

MAX_TOKENS = 256


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("lens", help="draw the logit lens (or the uncertainty strip) of a text",
                              description="Score a text at every loop depth in one pass and draw, per input "
                                          "token, what each depth predicts next (docs/SCORING.md).")
    p.add_argument("model", nargs="?", default="demo", help=".tinyloop file (default: the demo model)")
    p.add_argument("--text", required=True, help="the text to score (at most 256 tokens are drawn)")
    p.add_argument("--loops", type=int, default=None, help="deepest depth drawn (default: the model's default)")
    p.add_argument("--uncertainty", action="store_true",
                   help="draw the entropy / settled-depth strip instead of the lens heatmap")
    p.add_argument("--backend", default="auto", choices=get_plugin_manager().backend_names(),
                   help="where to run (default auto)")
    p.add_argument("-o", "--output", required=True, help="image file to write (.png, .svg or .pdf)")
    return p


def run(args) -> int:
    # (a suffix of a file name: matplotlib saves "-o .png" as ".png.png")
    if os.path.splitext(os.path.basename(args.output))[1].lower() not in (".png", ".svg", ".pdf"):
        raise ConfigError(f"--output {args.output!r} must end in .png, .svg or .pdf (after a file name)")
    _check_writable(args.output, "--output")
    plots._pyplot()                                    # the extra is there before any work
    if not args.text:
        raise ConfigError("--text is empty: give the text to score")
    model = load_model(args.model, max_seq_len=MAX_TOKENS + 1, backend=args.backend)
    try:
        tok = model.tokenizer
        ids = tok.encode(args.text)
        if len(ids) > MAX_TOKENS:
            raise ConfigError(f"--text is {len(ids)} tokens; the picture takes at most {MAX_TOKENS}")
        inputs = [tok.decode([t]) for t in ids]
        if args.uncertainty:
            u = score_with_uncertainty(model, ids, loops=args.loops)
            plots.draw_uncertainty(args.output, u.entropy, u.settled_depth, u.loops, inputs)
        else:
            lens = score_logit_lens(model, ids, loops=args.loops)
            depths = list(range(1, lens.shape[0] + 1))
            plots.draw_lens(args.output, lens, depths, inputs, lambda t: tok.decode([t]))
    finally:
        free_model(model)
    print(f"[tinyloop] wrote {args.output}", file=sys.stderr)
    return 0
