"""``tinyloop ppl MODEL --text FILE``: held-out perplexity at one or more loop counts."""

from __future__ import annotations

import argparse
import json
import math
import sys

from ..runtime.config import GenerateConfig
from ..runtime.engine import Plan, encode_text, free_model, load_model, resolve_loops
from ..errors import ConfigError
from ..runtime.config import read_text
from ..runtime.plugins import get_plugin_manager
from .run import _check_nonempty, _check_writable, _write_output
from ..analysis.evaluate import perplexity


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("ppl", help="held-out perplexity of a text file at several loop counts",
                              description="Held-out perplexity of a UTF-8 text file: the text is tokenized, split into "
                                          "non-overlapping windows, and every token after a window's first is scored "
                                          "from the tokens before it, at each loop count and KV cache mode asked for.")
    p.add_argument("model", help=".tinyloop file")
    p.add_argument("--text", required=True, help="UTF-8 text file to score")
    p.add_argument("--loops", default="", help="comma-separated loop counts (default: the model's default)")
    p.add_argument("--window", type=int, default=256, help="tokens per scored window (default 256)")
    p.add_argument("--max-windows", type=int, default=None, help="score at most this many windows")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: embedded)")
    p.add_argument("--backend", default="auto", choices=get_plugin_manager().backend_names(),
                   help="where to run (default auto: CUDA when a GPU is present, else CPU)")
    p.add_argument("--cache-mode", default="fp16",
                   help="KV cache mode(s), comma-separated (fp16, fp32, int8, int4, ...; default fp16)")
    p.add_argument("--json", default=None, help="write the results as JSON to this file")
    return p


def run(args) -> int:
    if args.window < 2:
        raise ConfigError(f"--window={args.window} must be at least 2 (tokens per scored window)")
    if args.max_windows is not None and args.max_windows < 1:
        raise ConfigError(f"--max-windows={args.max_windows} must be at least 1")
    _check_nonempty(args.tokenizer, "--tokenizer")
    if args.json is not None:
        _check_writable(args.json, "--json", inputs=(args.model, args.text))
    text = read_text(args.text, "--text")
    try:
        loops = [int(x) for x in args.loops.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--loops={args.loops!r} must be comma-separated integers") from None
    if args.loops.strip() and not loops:
        # given but naming no depth (",,"): not the model's default silently
        raise ConfigError(f"--loops={args.loops!r} names no loop count; leave it out for the model's default")
    model = load_model(args.model, max_seq_len=max(args.window, 2), backend=args.backend,
                       tokenizer=args.tokenizer or None)
    try:
        ids = encode_text(model, text)      # after the model's BOS id, as every text entry point does
        results = []
        modes = [m.strip() for m in args.cache_mode.split(",") if m.strip()]
        if not modes:
            raise ConfigError(f"--cache-mode={args.cache_mode!r} names no cache mode")
        for L in loops or [None]:       # every depth and cache mode is checked before the first window
            for mode in modes:
                Plan(model, GenerateConfig(max_tokens=0, loops=resolve_loops(model, L), cache_mode=mode), "single")
        print(f"{'loops':>5} {'cache':>6} {'ppl':>10} {'nll':>8} {'tokens':>8}")
        for L in loops or [None]:
            for mode in modes:
                r = perplexity(model, ids, loops=L, window=args.window, max_windows=args.max_windows,
                               cache_mode=mode)
                results.append(r)
                print(f"{r['loops']:>5} {mode:>6} {r['ppl']:>10.3f} {r['nll']:>8.4f} {r['tokens']:>8}")
                sys.stdout.flush()
        if args.json:
            finite = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()}
                      for r in results]        # strict JSON: a ppl past the float range is null
            _write_output(args.json, json.dumps({"model": args.model, "text": args.text,
                                                 "window": args.window, "results": finite}, indent=2))
    finally:
        free_model(model)
    return 0
