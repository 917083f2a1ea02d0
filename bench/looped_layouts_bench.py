"""Decode cost of the public looped layouts at their real shapes: Huginn-0125 (d 5280, 55 heads,
prelude 2 / core 4 / coda 2, vocab 65 536, sandwich blocks, the loop-input adapter, the
after-loop norm) and Ouro-1.4B (d 2048, 16 heads, 24 layers all looped, sublayer-output norms,
the per-step norm, the exit gate), random weights at q4, one process.

For each layout and depth: greedy decode of --new-tokens after a --prompt-len random prompt,
median ms/token over --repeats runs after a warm-up (graph capture), prefill ms, and the weights'
bytes on the device; with --torch, the strongest PyTorch form of the same structure at each
depth in the same process: tinyloop.torch_model's layout with every matrix on the INT4 tinygemm
kernel (bench/torch_int4.py: bf16 activations, the group size tinygemm allows for the shape),
the decode step under torch.compile and captured in a CUDA graph (bench/decode_bench.py's
per-layer-cache SDPA row; --torch-compile blocks compiles each distinct block once instead of
the whole step, whose compile time grows with the depth: Huginn at r = 32 is 132 blocks). Prints
a table, writes JSON (--json).

Writing Huginn's 2.12 GB random file takes minutes; --model-dir DIR keeps each layout's file
there and reuses it on the next run when its header is the one this bench would write (e.g.
``--model-dir out/bench_models``, ignored by git, so one depth per call on a warm device machine
reuses the first call's file).
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

#: layout -> (ModelConfig overrides of the 360m preset, group size, depths)
LAYOUTS = {
    "huginn-0125": (dict(vocab_size=65536, d_model=5280, n_heads=55, n_kv_heads=55, d_ff=17920, n_pre=2,
                         n_loop=4, n_post=2, default_loops=32, max_loops=64, head_dim=0, rope_theta=50000.0,
                         tied_embeddings=True, qkv_bias=True, embed_scale=72.66, block_norm="sandwich",
                         loop_inject="adapter", loop_init="zeros", loop_norm="after", norm_eps=1e-6),
                    32, (4, 8, 16, 32)),     # tinygemm needs 32 for d 5280: both sides on one grid
    "ouro-1.4b": (dict(vocab_size=49152, d_model=2048, n_heads=16, n_kv_heads=16, d_ff=5632, n_pre=0,
                       n_loop=24, n_post=0, default_loops=4, max_loops=8, head_dim=0, tied_embeddings=True,
                       loop_inject="none", block_norm="sublayer", loop_norm="every", head_norm=False,
                       exit_gate=True, norm_eps=1e-6),
                  128, (1, 2, 4)),
}


TORCH_ROW = "compiled_graph_decode_ms_per_token"


def bench_torch(path: str, prompt, new: int, depths, repeats: int, scope: str = "step", into=None,
                on_row=None) -> dict:
    """The compiled INT4 PyTorch step at each depth (decode_bench.bench_torch_int4): the weights
    are packed for tinygemm once and reused at every depth; ``scope`` is its compile_scope. Rows go
    into ``into`` (a new dict by default) as they are measured, ``on_row()`` called after each."""
    from bench.decode_bench import bench_torch_int4, free_prepared
    out = {} if into is None else into
    prepared = {}
    try:
        for L in depths:
            r = bench_torch_int4(path, prompt, new, L, repeats, variants=(TORCH_ROW,), prepared=prepared,
                                 compile_scope=scope)
            out[L] = {k: r.get(k) for k in (TORCH_ROW, "graph_decode_ms_per_token", "weights", "logits_vs_bf16",
                                            "compile_errors", "compile_scope")}
            log(f"  torch L={L}: {r.get(TORCH_ROW)} ms/token")
            if on_row is not None:
                on_row()
    finally:
        free_prepared(prepared)
    return out


def bench_layout(path: str, backend: str, prompt, new: int, depths, repeats: int) -> dict:
    import tinyloop as tl
    m = tl.load_model(path, max_seq_len=len(prompt) + new + 8, backend=backend)
    try:
        out = {"weights_bytes": int(m.weights.nbytes), "depths": {}}
        for L in depths:
            cfg = tl.GenerateConfig(max_tokens=new, loops=L)
            tl.generate(m, prompt, tl.GenerateConfig(max_tokens=4, loops=L))      # compile, capture
            dec, pre = [], []
            for _ in range(repeats):
                st = tl.GenerateStats()
                tl.generate(m, prompt, cfg, stats=st)
                pre.append(st.prefill_ms)
                dec.append(st.decode_ms / max(1, st.tokens_emitted - 1))
            out["depths"][L] = {"decode_ms_per_token": _median(dec), "prefill_ms": _median(pre)}
            log(f"  L={L}: {out['depths'][L]['decode_ms_per_token']:.3f} ms/token")
        return out
    finally:
        tl.free_model(m)


def _reusable(path: str, over: dict, group: int):
    """The config of the model file at `path` when it is the one synth_model would write for this
    layout (same config, q4 at `group` for the block matrices), else None."""
    from tinyloop.errors import TinyLoopError
    from tinyloop.model.arch import ModelConfig
    from tinyloop.model.format import open_model
    from tinyloop.model.presets import get_preset
    if not os.path.exists(path):
        return None
    want = ModelConfig.from_dict({**get_preset("360m").config, **over})
    try:
        with open_model(path) as mf:
            q = mf.header.quant["loop.0.wq"]
            ok = mf.header.config == want and (q.type, q.group_size) == ("q4", group)
    except (TinyLoopError, OSError, KeyError):
        ok = False
    return want if ok else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {list(LAYOUTS)}")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--depths", default=None, help="comma-separated depths (default: each layout's own)")
    ap.add_argument("--torch", action="store_true", help="also the compiled INT4 PyTorch form at each depth")
    ap.add_argument("--torch-compile", default="step", choices=("step", "blocks"),
                    help="what torch.compile sees: the whole step (compile time grows with the depth) or "
                         "each block once (the trunk between blocks stays eager ops); both run in a CUDA graph")
    ap.add_argument("--json", default=None)
    ap.add_argument("--model-dir", default=None,
                    help="keep the synthesized model files here and reuse matching ones (default: a temp dir)")
    args = ap.parse_args(argv)
    names = [n for n in args.layouts.split(",") if n]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layout(s) {unknown}; choose from {list(LAYOUTS)}")
    from tinyloop.cli.synth import synth_model
    rows = {}

    def dump():           # after every stage, so a run cut off by a time limit keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"commit": _commit(), "date": time.strftime("%Y-%m-%d"), "backend": args.backend,
                           "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats,
                           "rows": rows}, f, indent=1)
    if args.model_dir:
        os.makedirs(args.model_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            over, group, depths = LAYOUTS[name]
            if args.depths:
                depths = tuple(int(v) for v in args.depths.split(","))
            path = os.path.join(args.model_dir or tmp, f"{name}.tinyloop")
            cfg = _reusable(path, over, group) if args.model_dir else None
            if cfg is None:
                t = time.perf_counter()
                cfg = synth_model("360m", path, seed=0, quant="q4", group_size=group, **over)
                log(f"{name}: wrote {os.path.getsize(path) / 1e9:.2f} GB in {time.perf_counter() - t:.1f} s")
            else:
                log(f"{name}: reusing {path}")
            prompt = [int(i) for i in np.random.default_rng(0).integers(0, cfg.vocab_size, args.prompt_len)]
            rows[name] = bench_layout(path, args.backend, prompt, args.new_tokens, depths, args.repeats)
            rows[name]["group_size"] = group
            dump()
            if args.torch:
                rows[name]["torch"] = {}
                bench_torch(path, prompt, args.new_tokens, depths, args.repeats, args.torch_compile,
                            into=rows[name]["torch"], on_row=dump)
            if not args.model_dir:
                os.unlink(path)
    print(f"{'layout':<14} {'L':>4} {'ms/token':>9} {'torch ms':>9} {'x torch':>8} {'prefill ms':>11} "
          f"{'weights GB':>11}")
    for name, r in rows.items():
        for L, d in r["depths"].items():
            t = (r.get("torch") or {}).get(L, {}).get(TORCH_ROW)
            ts, ratio = (f"{t:.3f}", f"{t / d['decode_ms_per_token']:.2f}") if t else ("-", "-")
            print(f"{name:<14} {L:>4} {d['decode_ms_per_token']:>9.3f} {ts:>9} {ratio:>8} "
                  f"{d['prefill_ms']:>11.1f} {r['weights_bytes'] / 1e9:>11.2f}")
    dump()
    return 0


if __name__ == "__main__":
    sys.exit(main())
