"""Lockstep batch benchmark: generate_batch over N lanes against N sequential requests and against
PyTorch at batch N, the same weights, one process.

For each N (default 1, 2, 4, 8, 16, 32; N distinct random prompts of --prompt-len tokens, greedy,
--new-tokens each, L = --loops):

* tinyloop lockstep: ``generate_batch`` wall time, aggregate tokens/s (every lane's tokens over the
  whole call, prefill included), decode ms per lockstep step and decode tokens/s (after the first
  token); with --keep-in-place also the same with stopped lanes kept in the launch;
* tinyloop sequential: the N prompts through ``generate`` one after another;
* PyTorch (CUDA only): INT4 weight-only (tinygemm ``_weight_int4pack_mm``, bf16, group 128, the
  weights re-quantized on tinyloop's grids; bench/torch_int4.py) under torch.compile with the
  decode step of the whole batch captured in a CUDA graph (bench/decode_bench.graph_decode_ms),
  batch N rows at one position (equal prompt lengths): decode ms per step and tokens/s.

Prints a table, writes JSON (--json). ``python -m bench.batch_bench --backend cpu --preset demo
--lanes 1,2,4,8`` is the CPU run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import List

import numpy as np

from bench.decode_bench import _commit, _compile, _median, graph_decode_ms, log


def _prompts(cfg, n: int, length: int, seed: int = 0) -> List[List[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, cfg.vocab_size, length)] for _ in range(n)]


def bench_tinyloop(model, prompts, new: int, loops: int, repeats: int, keep_in_place: bool) -> dict:
    """Lockstep and sequential rows of one N (medians of `repeats` runs after a warm-up run)."""
    import tinyloop as tl
    from tinyloop.runtime import lockstep

    cfg = tl.GenerateConfig(max_tokens=new, loops=loops)
    N = len(prompts)

    def lockstep_run():
        stats: list = []
        t = time.perf_counter()
        out = tl.generate_batch(model, prompts, cfg, stats=stats)
        wall = (time.perf_counter() - t) * 1e3
        toks = sum(s.tokens_emitted for s in stats)
        steps = max(s.tokens_emitted for s in stats) - 1
        first = stats[0].prefill_ms                       # prefill + the first lockstep step
        return out, {"wall_ms": wall, "tokens": toks, "prefill_ms": first,
                     "tok_per_s": toks / wall * 1e3,
                     "ms_per_step": (wall - first) / max(1, steps),
                     "decode_tok_per_s": (toks - N) / max(1e-9, wall - first) * 1e3,
                     "batch_lanes": stats[0].batch_lanes}

    def rows(fn):
        runs = [fn()[1] for _ in range(repeats + 1)][1:]
        return {k: (_median([r[k] for r in runs]) if isinstance(runs[0][k], float) else runs[0][k]) for k in runs[0]}

    res = {"lockstep": rows(lockstep_run)}
    if keep_in_place:
        old = lockstep.LockstepBatch.compact
        lockstep.LockstepBatch.compact = False
        try:
            res["lockstep_keep_in_place"] = rows(lockstep_run)
        finally:
            lockstep.LockstepBatch.compact = old

    def sequential_run():
        t = time.perf_counter()
        outs, toks = [], 0
        for p in prompts:
            st = tl.GenerateStats()
            outs.append(tl.generate(model, p, cfg, stats=st))
            toks += st.tokens_emitted
        wall = (time.perf_counter() - t) * 1e3
        return outs, {"wall_ms": wall, "tokens": toks, "tok_per_s": toks / wall * 1e3}

    seq_out = sequential_run()[0]
    res["sequential"] = rows(sequential_run)
    res["tokens_equal_sequential"] = lockstep_run()[0] == seq_out
    return res


def bench_torch_batch(path: str, prompts, new: int, loops: int, repeats: int, logical) -> dict:
    """PyTorch INT4 compiled + CUDA graph at batch len(prompts) (equal prompt lengths)."""
    import torch

    from bench import torch_int4 as q4
    from tinyloop.model.format import read_header
    from tinyloop.torch_model import LoopedLM, rope_tables

    cfg = read_header(path).config
    blocks, head, _ = q4.timed_quantize(logical, cfg, q4.load_grids(path))
    model = LoopedLM.from_logical(cfg, logical).to(torch.bfloat16).cuda().eval()
    cos, sin = rope_tables(cfg.head_dim, cfg.rope_theta, model.max_seq_len, device="cuda")
    model.rope_cos, model.rope_sin = cos, sin
    N, T = len(prompts), len(prompts[0])
    model.allocate_cache(batch_size=N, max_seq_len=T + new + 8)
    ids = torch.tensor(prompts, dtype=torch.long, device="cuda")
    n_layers = cfg.n_layers(loops)
    caches = q4.layer_caches(model, n_layers)
    step = q4.make_int4_step(model, blocks, head, loops, caches=caches)
    with torch.no_grad():
        tok = torch.zeros(N, dtype=torch.long, device="cuda")
        pos = torch.zeros(1, dtype=torch.long, device="cuda")

        def reset():
            tok.copy_(model.prefill(ids, loops)[:, -1].argmax(-1))
            for i in range(n_layers):
                caches[0][i].copy_(model.k_cache[i])
                caches[1][i].copy_(model.v_cache[i])
            pos.fill_(T)
        t0 = time.perf_counter()
        ms = graph_decode_ms(_compile(step, "default"), tok, pos, reset, new, repeats)
        compile_s = time.perf_counter() - t0
    model.free_cache()
    torch.cuda.empty_cache()
    return {"ms_per_step": ms, "tok_per_s": N / ms * 1e3, "compile_and_time_s": compile_s,
            "form": "int4 tinygemm, bf16, torch.compile, step in a CUDA graph"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench.batch_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--model", help=".tinyloop file (default: synthesize --preset; 'demo' is the shipped model)")
    ap.add_argument("--preset", default="360m", help="synthesized shape when --model is not given (default 360m)")
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--lanes", default="1,2,4,8,16,32", help="comma-separated batch sizes N")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per row after a warm-up (median)")
    ap.add_argument("--keep-in-place", action="store_true", help="also time stopped lanes kept in the launch")
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    import tinyloop as tl
    from tinyloop.model.format import read_header

    lanes = [int(x) for x in args.lanes.split(",") if x]
    if not lanes or min(lanes) < 1:
        print(f"error: --lanes {args.lanes!r} must list batch sizes >= 1", file=sys.stderr)
        return 2
    tmp = None
    path = args.model
    if path == "demo" or (not path and args.preset == "demo"):
        from tinyloop.models import model_path
        path = str(model_path("demo"))
    elif not path:
        from tinyloop.cli.synth import synth_model
        tmp = tempfile.TemporaryDirectory()
        path = os.path.join(tmp.name, f"{args.preset}.tinyloop")
        synth_model(args.preset, path, seed=0)
    cfg = read_header(path).config
    res = {"date": time.strftime("%Y-%m-%d"), "commit": _commit(), "backend": args.backend,
           "model": os.path.basename(path), "loops": args.loops, "prompt_len": args.prompt_len,
           "new_tokens": args.new_tokens, "rows": {}}
    if args.backend == "cuda":
        from bench.decode_bench import gpu_name
        res["gpu"] = gpu_name()
    else:
        res["cpu_threads"] = os.cpu_count()

    def save():
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(res, fh, indent=2)

    model = tl.load_model(path, max_seq_len=args.prompt_len + args.new_tokens + 8, backend=args.backend,
                          prefill_chunk=max(512, max(lanes)))
    try:
        for n in lanes:
            ps = _prompts(cfg, n, args.prompt_len)
            row = bench_tinyloop(model, ps, args.new_tokens, args.loops, args.repeats, args.keep_in_place)
            res["rows"][str(n)] = row
            log(f"N={n}: lockstep {row['lockstep']['tok_per_s']:.0f} tok/s ({row['lockstep']['ms_per_step']:.3f} "
                f"ms/step), sequential {row['sequential']['tok_per_s']:.0f} tok/s, tokens equal "
                f"{row['tokens_equal_sequential']}")
            save()
    finally:
        tl.free_model(model)
    if args.backend == "cuda" and not args.skip_torch:
        from bench.torch_int4 import load_logical
        logical = load_logical(path)
        for n in lanes:
            try:
                res["rows"][str(n)]["torch_int4"] = bench_torch_batch(
                    path, _prompts(cfg, n, args.prompt_len), args.new_tokens, args.loops, args.repeats, logical)
                log(f"N={n}: torch int4 {res['rows'][str(n)]['torch_int4']['tok_per_s']:.0f} tok/s")
            except Exception as exc:            # the other rows stand
                res["rows"][str(n)]["torch_int4"] = {"error": f"{type(exc).__name__}: {exc}"}
                log(f"N={n}: torch int4 failed: {exc}")
            save()
    base = res["rows"][str(lanes[0])]["lockstep"]["tok_per_s"] if lanes[0] == 1 else None
    print(f"\nLockstep batch, {res['model']} on {res.get('gpu', 'cpu')} ({args.backend}), L={args.loops}, "
          f"{args.prompt_len}-token prompts, {args.new_tokens} new tokens, commit {res['commit']}")
    head = f"{'N':>3} {'lockstep tok/s':>15} {'ms/step':>8} {'x N=1':>6} {'sequential tok/s':>17}"
    if args.keep_in_place:
        head += f" {'in-place tok/s':>15}"
    if args.backend == "cuda" and not args.skip_torch:
        head += f" {'torch int4 tok/s':>17} {'torch ms/step':>14} {'vs torch':>9}"
    print(head)
    for n in lanes:
        r = res["rows"][str(n)]
        ls = r["lockstep"]
        line = (f"{n:>3} {ls['tok_per_s']:>15.0f} {ls['ms_per_step']:>8.3f} "
                f"{(ls['tok_per_s'] / base if base else float('nan')):>6.2f} {r['sequential']['tok_per_s']:>17.0f}")
        if args.keep_in_place:
            line += f" {r['lockstep_keep_in_place']['tok_per_s']:>15.0f}"
        t = r.get("torch_int4")
        if t is not None:
            if "error" in t:
                line += f" {'error':>17}"
            else:
                line += (f" {t['tok_per_s']:>17.0f} {t['ms_per_step']:>14.3f} "
                         f"{t['ms_per_step'] / ls['ms_per_step']:>8.2f}x")
        print(line)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
