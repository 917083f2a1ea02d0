"""``tinyloop inspect FILE``: print tinyloop.inspect() (header only, no weight is read) as text or
JSON. ``--measure`` also loads the model on the CPU and measures its loop gain
(tinyloop.analysis.loopgain), added as "loop_gain"."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import TinyLoopError
from ..analysis.inspect import inspect
from ..analysis.memory import format_bytes


def _print_text(d: dict, out) -> None:
    cfg, arch = d["config"], d["architecture"]
    w = lambda s="": print(s, file=out)  # noqa: E731
    w(f"file: {d['file']}  ({format_bytes(d['file_size'])}, format version {d['version']})")
    if d["metadata"]:
        w("metadata:")
        for k, v in sorted(d["metadata"].items()):
            w(f"  {k}: {v}")
    w("architecture:")
    w(f"  vocab {cfg['vocab_size']}, d_model {cfg['d_model']}, heads {cfg['n_heads']} "
      f"(kv {cfg['n_kv_heads']}, head_dim {arch['head_dim']}), d_ff {cfg['d_ff']}")
    w(f"  blocks: pre {cfg['n_pre']} + loop {cfg['n_loop']} x L + post {cfg['n_post']}; "
      f"L default {cfg['default_loops']}, max {cfg['max_loops']} "
      f"(layers {arch['layers_at_default_loops']} .. {arch['layers_at_max_loops']})")
    w(f"  tied embeddings: {cfg['tied_embeddings']}, loop inject: {cfg['loop_inject']}, "
      f"rope_theta {cfg['rope_theta']:g}, norm_eps {cfg['norm_eps']:g}, "
      f"bos {cfg['bos_id']}, eos {cfg['eos_id']}"
      + (f" (and {', '.join(map(str, cfg['extra_eos_ids']))})" if cfg.get("extra_eos_ids") else ""))
    extras = [name for name, on in (("qkv_bias", cfg.get("qkv_bias")),
                                    (f"embed_scale {cfg.get('embed_scale', 1.0):g}", cfg.get("embed_scale", 1.0) != 1.0),
                                    (f"sliding_window {cfg.get('sliding_window', 0)}", cfg.get("sliding_window", 0)),
                                    (f"block_norm {cfg.get('block_norm')}", cfg.get("block_norm", "pre") != "pre"),
                                    (f"loop_init {cfg.get('loop_init')}", cfg.get("loop_init", "pre") != "pre"),
                                    (f"loop_norm {cfg.get('loop_norm')}", cfg.get("loop_norm", "none") != "none"),
                                    ("no head norm", not cfg.get("head_norm", True)),
                                    ("exit_gate", cfg.get("exit_gate", False)),
                                    (f"rope_scaling {cfg.get('rope_scaling')} x{cfg.get('rope_factor', 1.0):g}"
                                     + (f" (original context {cfg.get('rope_original_max_positions')})"
                                        if cfg.get("rope_scaling") == "llama3" else ""),
                                     cfg.get("rope_scaling", "none") != "none"))
              if on]
    if extras:
        w("  family features: " + ", ".join(extras))
    parts = ", ".join(f"{k} {v:,}" for k, v in d["parameters_by_part"].items())
    w(f"parameters: {d['parameters']:,}  ({parts})")
    t = d["tensors"]
    w(f"tensors: {t['count']} physical, {format_bytes(t['bytes'])}")
    w("  by dtype: " + ", ".join(f"{k} x{v['count']} ({format_bytes(v['bytes'])})"
                                 for k, v in sorted(t["by_dtype"].items())))
    w("  by quantization: " + ", ".join(
        f"{k} x{t['logical_by_quant'][k]} ({format_bytes(v)})"
        for k, v in sorted(t["bytes_by_quant"].items())))
    w("  largest:")
    for e in t["largest"]:
        w(f"    {e['name']:<24} {e['dtype']:<4} {str(tuple(e['shape'])):<16} {format_bytes(e['bytes'])}")
    tok = d["tokenizer"]
    if tok["embedded"] and tok["type"] == "hf":
        w(f"tokenizer: embedded tokenizer.json ({tok['model']}), {tok['tokens']} tokens "
          f"(ids < {tok['vocab_size']}), {tok['merges']} merges"
          + (", with a chat template" if tok.get("chat_template") else ""))
    elif tok["embedded"]:
        w(f"tokenizer: embedded {tok['type']}, {tok['tokens']} tokens (ids < {tok['vocab_size']}), "
          f"{tok['merges']} merges")
    else:
        w("tokenizer: none embedded (byte fallback unless --tokenizer / TINYLOOP_TOKENIZER_DIR)")
    m = d["memory"]
    w(f"memory estimate (max_seq_len {m['max_seq_len']}, loops {m['loops']}, batch 1):")
    for backend, b in m["backends"].items():
        w(f"  {backend} ({b['note']}):")
        for mode, e in b["cache_modes"].items():
            w(f"    kv {mode:<6} total {format_bytes(e['total_bytes']):>11}  = weights "
              f"{format_bytes(e['weights_bytes'])} + kv {format_bytes(e['kv_cache_bytes'])} + "
              f"scratch {format_bytes(e['scratch_bytes'])}")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("inspect", help="describe a .tinyloop model file (header only)",
                              description="Describe a .tinyloop file without reading its weights.")
    p.add_argument("file", help=".tinyloop model file")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--max-seq-len", type=int, default=2048,
                   help="sequence length for the memory estimate (default 2048)")
    p.add_argument("--loops", type=int, default=None,
                   help="loop count for the memory estimate (default: the model's default_loops)")
    m = p.add_argument_group("loop gain (--measure loads the model on the CPU and runs it)")
    m.add_argument("--measure", action="store_true",
                   help="measure the loop gain: per-iteration residual step sizes, beta = s_(k+1)/s_k, "
                        "and top-1 agreement / KL of each depth against the deepest")
    m.add_argument("--text", default=None,
                   help="UTF-8 text to measure on, tokenized with the model's tokenizer (default: "
                        "data/heldout_eval.txt or a built-in snippet; random seeded ids without a "
                        "tokenizer)")
    m.add_argument("--loops-max", type=int, default=None,
                   help="deepest depth measured (default: min(2 x default_loops, max_loops))")
    m.add_argument("--window", type=int, default=256, help="tokens per measured window (default 256)")
    m.add_argument("--max-windows", type=int, default=4, help="windows measured (default 4)")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    try:
        d = inspect(args.file, args.max_seq_len, args.loops)
        if args.measure:
            from ..analysis.loopgain import measure_file
            from ..runtime.config import read_text
            top = d["config"]["max_loops"]
            if args.loops_max is not None and not 1 <= args.loops_max <= top:
                raise TinyLoopError(f"--loops-max={args.loops_max} must be in [1, {top}] (the model's max_loops)")
            text = None if args.text is None else read_text(args.text, "--text")
            d["loop_gain"] = measure_file(args.file, text, args.loops_max, args.window, args.max_windows,
                                          text_label=args.text)
        elif args.text is not None or args.loops_max is not None:
            raise TinyLoopError("--text and --loops-max need --measure")
    except (TinyLoopError, OSError, UnicodeDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(d, sys.stdout, indent=2, sort_keys=False)
        sys.stdout.write("\n")
    else:
        _print_text(d, sys.stdout)
        if "loop_gain" in d:
            from ..analysis.loopgain import format_table
            for line in format_table(d["loop_gain"]):
                print(line)
    return 0
