"""Decode benchmark: tinyloop vs PyTorch on the same looped model with the same weights, one GPU.

For the `360m` synth preset (INT4 weights, batch 1, L = 8, 128-token prompt, 128 new tokens):
tinyloop prefill ms and decode ms/token (graph-captured steps); PyTorch fp16 with the same
dequantized weights, eager and with a CUDA graph over a static KV cache (plain, and with q|k|v and
gate|up fused into one matmul each); the ratios; graph nodes
(kernel launches) per decoded token; tokens/s for L in 1, 2, 4, 8, 16; and a matmul
microbenchmark (INT4 16384x4096 and the model's own shapes, timed inside captured graphs) in GB/s
next to a device-to-device copy measured in the same run. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

import numpy as np


def _median(xs):
    return float(np.median(np.asarray(xs, dtype=np.float64)))


def _commit() -> str:
    """The checkout's short commit; TINYLOOP_COMMIT overrides it (for runs on a copy of the tree
    whose git metadata is not the checkout's)."""
    if os.environ.get("TINYLOOP_COMMIT"):
        return os.environ["TINYLOOP_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- tinyloop
def bench_tinyloop(path: str, prompt: List[int], new: int, loops: int, sweep: List[int], repeats: int) -> dict:
    import tinyloop as tl

    t = time.perf_counter()
    m = tl.load_model(path, max_seq_len=len(prompt) + new + 8, backend="cuda")
    out = {"load_s": time.perf_counter() - t, "backend": m.backend_name}
    try:
        def run(L: int, n: int, **sampling):
            st = tl.GenerateStats()
            tl.generate_stream(m, prompt, tl.GenerateConfig(max_tokens=n, loops=L, **sampling), stats=st)
            return st

        def measure(L: int, **sampling) -> dict:
            run(L, 4, **sampling)                         # compile, warm, capture the step graph
            pre, dec = [], []
            for _ in range(repeats):
                st = run(L, new, **sampling)
                pre.append(st.prefill_ms)
                dec.append(st.decode_ms / max(1, st.tokens_emitted - 1))
            return {"loops": L, "prefill_ms": _median(pre), "decode_ms_per_token": _median(dec),
                    "tokens_per_s": 1e3 / _median(dec)}

        main = measure(loops)
        out.update(main)
        # seeded sampling (the logits come to the host, where the sampler runs)
        smp = dict(temperature=0.8, top_k=50, top_p=0.95, sample_seed=0)
        out["sampling"] = dict(measure(loops, **smp), **smp)
        log(f"tinyloop sampling L={loops}: {out['sampling']['decode_ms_per_token']:.3f} ms/token")
        out["graph_nodes_per_token"] = m.backend.step_nodes
        out["vram_bytes"] = tl.vram_usage_bytes(m)
        out["sweep"] = []
        for L in sweep:
            r = main if L == loops else measure(L)
            out["sweep"].append({"loops": L, "decode_ms_per_token": r["decode_ms_per_token"],
                                 "tokens_per_s": r["tokens_per_s"]})
            log(f"tinyloop L={L}: {r['decode_ms_per_token']:.3f} ms/token")
    finally:
        tl.free_model(m)
    return out


# --------------------------------------------------------------------------- PyTorch
def bench_torch(path: str, prompt: List[int], new: int, loops: int, repeats: int) -> dict:
    import torch

    from tinyloop.model.format import open_model
    from tinyloop.torch_model import LoopedLM

    with open_model(path) as mf:
        cfg = mf.header.config
        weights = {n: torch.from_numpy(np.ascontiguousarray(mf.logical(n))).half() for n in mf.header.quant}
    model = LoopedLM.from_logical(cfg, weights).half().cuda().eval()
    model.allocate_cache(batch_size=1, max_seq_len=len(prompt) + new + 8)
    ids = torch.tensor([prompt], dtype=torch.long, device="cuda")
    T = len(prompt)
    res = {"dtype": "float16", "torch": torch.__version__}

    def timed(fn):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e)

    with torch.no_grad():
        tok = torch.zeros(1, dtype=torch.long, device="cuda")
        pos = torch.zeros(1, dtype=torch.long, device="cuda")

        def eager_decode():
            for _ in range(new - 1):
                logits = model.decode_one(tok, pos, loops)
                tok.copy_(logits.argmax(-1))
                pos.add_(1)

        pre, dec = [], []
        for r in range(repeats + 1):
            p_ms = timed(lambda: tok.copy_(model.prefill(ids, loops)[0, -1:].argmax(-1)))
            pos.fill_(T)
            d_ms = timed(eager_decode)
            if r:                                         # the first round warms up
                pre.append(p_ms)
                dec.append(d_ms / (new - 1))
        res["prefill_ms"] = _median(pre)
        res["eager_decode_ms_per_token"] = _median(dec)
        log(f"torch eager: {res['eager_decode_ms_per_token']:.3f} ms/token")

        def graph_ms_per_token() -> float:
            """A CUDA graph over one decode step (static cache; token and position live on the
            device), replayed new - 1 times back to back."""
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    model.decode_one(tok, pos, loops)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                logits = model.decode_one(tok, pos, loops)
                tok.copy_(logits.argmax(-1))
                pos.add_(1)

            def graph_decode():
                for _ in range(new - 1):
                    g.replay()
            dec = []
            for r in range(repeats + 1):
                model.prefill(ids, loops)
                pos.fill_(T)
                d_ms = timed(graph_decode)
                if r:
                    dec.append(d_ms / (new - 1))
            return _median(dec)

        res["graph_decode_ms_per_token"] = graph_ms_per_token()
        log(f"torch graph: {res['graph_decode_ms_per_token']:.3f} ms/token")
        # the same with q|k|v and gate|up as one matmul each (a tighter baseline)
        model.fuse_projections()
        res["graph_fused_decode_ms_per_token"] = graph_ms_per_token()
        log(f"torch graph, fused projections: {res['graph_fused_decode_ms_per_token']:.3f} ms/token")
    model.free_cache()
    torch.cuda.empty_cache()
    return res


# --------------------------------------------------------------------------- matmul + copy
def graph_time_ms(stream, fn, n_inner: int) -> float:
    """ms per inner op of `fn` (n_inner ops on `stream`) replayed as one captured graph: compiled by
    a first eager call, captured, then the best of 5 timed replays."""
    from numba import cuda

    from tinyloop.cuda.graphs import Graph
    fn()
    stream.synchronize()
    g = Graph(stream, fn)
    g.launch()
    stream.synchronize()
    best = float("inf")
    for _ in range(5):
        e0, e1 = cuda.event(), cuda.event()
        e0.record(stream)
        g.launch()
        e1.record(stream)
        e1.synchronize()
        best = min(best, cuda.event_elapsed_time(e0, e1) / n_inner)
    return best


def bench_matmul(shapes: Dict[str, tuple], group: int, reps: int = 50) -> dict:
    from numba import cuda

    from tinyloop.model.arch import TensorQuant
    from tinyloop.model.quant import quantize
    from tinyloop.cuda.kernels import matmul as k_matmul

    stream = cuda.stream()
    rng = np.random.default_rng(0)

    def time_graph(fn, n_inner: int) -> float:
        return graph_time_ms(stream, fn, n_inner)

    results = {}
    for name, (N, K, copies) in shapes.items():
        w = (rng.standard_normal((N, K), dtype=np.float32) * 0.02)
        parts = quantize(w, TensorQuant("q4", group))
        mats = [tuple(cuda.to_device(parts[k]) for k in ("q", "scales", "zeros")) for _ in range(copies)]
        nbytes = sum(int(a.nbytes) for a in mats[0])
        x = cuda.to_device(rng.standard_normal((1, K), dtype=np.float32))
        out = cuda.device_array((1, N), np.float32)

        def fn():
            for i in range(reps):
                q, s, z = mats[i % copies]
                k_matmul.matmul(out, x, q, s, z, stream=stream)
        ms = time_graph(fn, reps)
        where = "L2-resident (same weights every launch)" if copies == 1 else \
            f"{copies} rotating copies ({copies * nbytes / 2**20:.0f} MiB > L2)"
        results[name] = {"N": N, "K": K, "weight_bytes": nbytes, "us": ms * 1e3,
                         "GB_per_s": nbytes / (ms * 1e-3) / 1e9, "where": where}
        log(f"matmul {name}: {ms * 1e3:.1f} us, {results[name]['GB_per_s']:.0f} GB/s ({where})")

    n = 1 << 28                                            # 1 GiB of float32
    src = cuda.device_array(n, np.float32)
    dst = cuda.device_array(n, np.float32)
    ms = time_graph(lambda: dst.copy_to_device(src, stream=stream), 1)
    results["copy_1GiB"] = {"bytes_moved": 2 * src.nbytes, "us": ms * 1e3,
                            "GB_per_s": 2 * src.nbytes / (ms * 1e-3) / 1e9,
                            "where": "device-to-device copy, read + write bytes"}
    log(f"copy: {results['copy_1GiB']['GB_per_s']:.0f} GB/s (read + write)")
    return results


# --------------------------------------------------------------------------- main
def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", help=".tinyloop file (default: synthesize --preset)")
    ap.add_argument("--preset", default="360m")
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--sweep", default="1,2,4,8,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--skip-matmul", action="store_true")
    ap.add_argument("--json", help="write the results here")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tinyloop bench", description=__doc__.splitlines()[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


def run(args) -> int:
    from tinyloop.plugins.backends import CUDAEntry
    if not CUDAEntry.available()[0]:
        print("error: the benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    from numba import cuda

    path = args.model
    tmp = None
    if not path:
        from tinyloop.cli.synth import synth_model
        tmp = tempfile.TemporaryDirectory()
        path = os.path.join(tmp.name, f"{args.preset}.tinyloop")
        t = time.perf_counter()
        synth_model(args.preset, path, seed=0)
        log(f"synthesized preset {args.preset} in {time.perf_counter() - t:.1f}s")
    from tinyloop.model.format import read_header
    cfg = read_header(path).config
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, cfg.vocab_size, args.prompt_len)]
    sweep = [int(x) for x in args.sweep.split(",") if x]

    res = {"date": time.strftime("%Y-%m-%d"), "commit": _commit(), "gpu": cuda.get_current_device().name.decode()
           if isinstance(cuda.get_current_device().name, bytes) else str(cuda.get_current_device().name),
           "host": platform.node(), "model": os.path.basename(path), "preset": args.preset if not args.model else None,
           "config": cfg.to_dict(), "batch": 1, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
    res["tinyloop"] = bench_tinyloop(path, prompt, args.new_tokens, args.loops, sweep, args.repeats)
    if not args.skip_torch:
        try:
            res["torch"] = bench_torch(path, prompt, args.new_tokens, args.loops, args.repeats)
        except ImportError as exc:
            res["torch"] = {"error": f"PyTorch not available: {exc}"}
    if not args.skip_matmul:
        d, ff, g = cfg.d_model, cfg.d_ff, 128
        res["matmul"] = bench_matmul({
            "int4 16384x4096 (HBM)": (16384, 4096, 4),
            "int4 16384x4096 (L2)": (16384, 4096, 1),
            f"wq {cfg.q_dim}x{d}": (cfg.q_dim, d, 1),
            f"w_gate {ff}x{d}": (ff, d, 1),
            f"w_down {d}x{ff}": (d, ff, 1),
            f"head {cfg.vocab_size}x{d}": (cfg.vocab_size, d, 1),
        }, g)
    if tmp is not None:
        tmp.cleanup()

    tlr, th = res["tinyloop"], res.get("torch", {})
    print(f"\nTinyLoop decode benchmark  {res['date']}  {res['gpu']}  commit {res['commit']}")
    print(f"model {res['model']}  batch 1  L={args.loops}  prompt {args.prompt_len}  new {args.new_tokens}\n")
    print(f"{'engine':<28}{'prefill ms':>12}{'decode ms/tok':>15}{'tok/s':>10}")
    print(f"{'tinyloop (numba, graphs)':<28}{tlr['prefill_ms']:>12.2f}{tlr['decode_ms_per_token']:>15.3f}"
          f"{tlr['tokens_per_s']:>10.1f}")
    if "sampling" in tlr:
        smp = tlr["sampling"]
        print(f"{'  sampling T0.8 k50 p0.95':<28}{smp['prefill_ms']:>12.2f}"
              f"{smp['decode_ms_per_token']:>15.3f}{smp['tokens_per_s']:>10.1f}")
    if "eager_decode_ms_per_token" in th:
        for k, label in (("eager_decode_ms_per_token", "torch fp16 eager"),
                         ("graph_decode_ms_per_token", "torch fp16 CUDA graph"),
                         ("graph_fused_decode_ms_per_token", "  fused q|k|v, gate|up")):
            pre = th["prefill_ms"] if k.startswith("eager") else float("nan")
            print(f"{label:<28}{pre:>12.2f}{th[k]:>15.3f}{1e3 / th[k]:>10.1f}")
        best_graph = min(th["graph_decode_ms_per_token"], th["graph_fused_decode_ms_per_token"])
        res["ratios"] = {"vs_torch_eager": th["eager_decode_ms_per_token"] / tlr["decode_ms_per_token"],
                         "vs_torch_graph": th["graph_decode_ms_per_token"] / tlr["decode_ms_per_token"],
                         "vs_torch_graph_best": best_graph / tlr["decode_ms_per_token"],
                         "prefill_vs_torch": th["prefill_ms"] / tlr["prefill_ms"]}
        print(f"\nspeedup vs torch eager {res['ratios']['vs_torch_eager']:.2f}x, vs torch CUDA graph "
              f"{res['ratios']['vs_torch_graph']:.2f}x (the faster torch graph: "
              f"{res['ratios']['vs_torch_graph_best']:.2f}x), prefill {res['ratios']['prefill_vs_torch']:.2f}x")
    print(f"graph nodes (kernel launches) per decoded token: {tlr['graph_nodes_per_token']}")
    print("\nloops  ms/token  tokens/s")
    for r in tlr["sweep"]:
        print(f"{r['loops']:>5}  {r['decode_ms_per_token']:>8.3f}  {r['tokens_per_s']:>8.1f}")
    if "matmul" in res:
        print(f"\n{'matmul (T=1, in a graph)':<36}{'us':>9}{'GB/s':>9}  where")
        for name, r in res["matmul"].items():
            print(f"{name:<36}{r['us']:>9.1f}{r['GB_per_s']:>9.0f}  {r['where']}")
        cp = res["matmul"]["copy_1GiB"]["GB_per_s"]
        hb = res["matmul"]["int4 16384x4096 (HBM)"]["GB_per_s"]
        res["int4_vs_copy"] = hb / cp
        print(f"INT4 16384x4096 from HBM at {100 * hb / cp:.0f}% of the copy bandwidth")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
