"""Decode benchmark: tinyloop vs PyTorch on the same looped model with the same weights, one GPU.

For the `360m` synth preset (INT4 weights, batch 1, L = 8, 128-token prompt, 128 new tokens):
tinyloop prefill ms and decode ms/token (graph-captured steps); PyTorch with the same weights:
INT4 weight-only (tinygemm `_weight_int4pack_mm`, group 128, bf16 activations and KV cache; the
weights re-quantized on tinyloop's own grids and every packed matrix checked against its
dequantized reference; bench/torch_int4.py) with the decode step in a CUDA graph, plain and through
torch.compile; fp16 with the dequantized weights, eager and with a CUDA graph over a static KV
cache (plain, with q|k|v and gate|up fused into one matmul each, and that through torch.compile);
the ratios, the headline one against the fastest PyTorch form measured in the run; graph nodes
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
from typing import Dict, List, Optional

import numpy as np

from tinyloop.progress import bar


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


def gpu_name() -> str:
    """The current CUDA device's name."""
    from numba import cuda
    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


def bench_model(backend: str, model: Optional[str], preset: str):
    """(path, tmp) of the model a benchmark runs: `model` when given, else the synth `preset` on
    CUDA (written to a temporary folder, `tmp`, to clean up) or the demo model on the CPU. None
    when CUDA is asked for without a GPU (the caller reports it)."""
    from tinyloop.plugins.backends import CUDAEntry
    from tinyloop.models import demo_model_path
    if backend == "cuda" and not CUDAEntry.available()[0]:
        return None
    if model:
        return model, None
    if backend == "cuda":
        from tinyloop.cli.synth import synth_model
        tmp = tempfile.TemporaryDirectory()
        path = os.path.join(tmp.name, f"{preset}.tinyloop")
        synth_model(preset, path, seed=0)
        return path, tmp
    return demo_model_path(), None


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
            for _ in bar(range(repeats), f"tinyloop L={L}", unit="run"):
                st = run(L, new, **sampling)
                pre.append(st.prefill_ms)
                dec.append(st.decode_ms / max(1, st.tokens_emitted - 1))
            return {"loops": L, "prefill_ms": _median(pre), "decode_ms_per_token": _median(dec),
                    "tokens_per_s": 1e3 / _median(dec)}

        main = measure(loops)
        out.update(main)
        # seeded sampling: drawn on the device (only the token id crosses, steps queued ahead),
        # and on the host from the copied logits (TINYLOOP_DEVICE_SAMPLING=0), same tokens
        smp = dict(temperature=0.8, top_k=50, top_p=0.95, sample_seed=0)
        out["sampling"] = dict(measure(loops, **smp), **smp)
        log(f"tinyloop sampling L={loops}: {out['sampling']['decode_ms_per_token']:.3f} ms/token")
        wide = dict(temperature=1.0, top_k=1024, top_p=1.0, sample_seed=0)
        out["sampling_k1024"] = dict(measure(loops, **wide), **wide)
        os.environ["TINYLOOP_DEVICE_SAMPLING"] = "0"
        try:
            out["sampling_host"] = dict(measure(loops, **smp), **smp)
        finally:
            del os.environ["TINYLOOP_DEVICE_SAMPLING"]
        log(f"tinyloop host sampling L={loops}: {out['sampling_host']['decode_ms_per_token']:.3f} ms/token")
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
def _timed_ms(fn) -> float:
    import torch
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e)


def graph_kernels(replay, reset, n: int = 8, top: int = 12) -> dict:
    """Device time per kernel name (CUPTI through torch.profiler) of ``n`` replays of a captured
    decode step after ``reset()``: {"total_us_per_token", "kernels": [(name, us/token, launches
    per token)] for the ``top`` largest}."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    reset()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            replay()
        torch.cuda.synchronize()
    per: Dict[str, list] = {}
    for ev in prof.events():
        if ev.device_type.name != "CUDA":
            continue
        rec = per.setdefault(ev.name[:90], [0.0, 0])
        rec[0] += ev.device_time_total
        rec[1] += 1
    rows = sorted(per.items(), key=lambda kv: -kv[1][0])
    return {"total_us_per_token": sum(v[0] for v in per.values()) / n,
            "kernels": [(k, v[0] / n, v[1] / n) for k, v in rows[:top]]}


def graph_decode_ms(step, tok, pos, reset, new: int, repeats: int, kernels: Optional[dict] = None) -> float:
    """ms/token of a CUDA graph over one decode step (``step(tok, pos) -> logits``; static cache,
    token and position on the device, argmax and position advance inside the graph), replayed
    new - 1 times back to back after ``reset()`` (prefill, position to the prompt length); warmed
    up (and, for a compiled step, compiled) on a side stream first; median of ``repeats`` rounds
    after a warm-up round. With ``kernels`` (a dict) the device time per kernel of the captured
    step goes there too (:func:`graph_kernels`)."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(tok, pos)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        logits = step(tok, pos)
        tok.copy_(logits.argmax(-1))
        pos.add_(1)

    def graph_decode():
        for _ in range(new - 1):
            g.replay()
    dec = []
    for r in range(repeats + 1):
        reset()
        d_ms = _timed_ms(graph_decode)
        if r:                                             # the first round warms up
            dec.append(d_ms / (new - 1))
    if kernels is not None:
        kernels.update(graph_kernels(g.replay, reset))
    return _median(dec)


def _compile(fn, mode: str):
    """torch.compile without its own CUDA graphs (the caller captures one: mode="reduce-overhead"
    skips graphs for a step that mutates the KV cache it closes over)."""
    import torch
    return torch.compile(fn, fullgraph=True, dynamic=False, mode=None if mode == "default" else mode)


def bench_torch(path: str, prompt: List[int], new: int, loops: int, repeats: int,
                logical=None, compile_mode: str = "default") -> dict:
    import torch

    from tinyloop.torch_model import LoopedLM

    if logical is None:
        from bench.torch_int4 import load_logical
        logical = load_logical(path)
    from tinyloop.model.format import read_header
    cfg = read_header(path).config
    weights = {n: torch.from_numpy(np.ascontiguousarray(a)).half() for n, a in logical.items()}
    model = LoopedLM.from_logical(cfg, weights).half().cuda().eval()
    del weights
    model.allocate_cache(batch_size=1, max_seq_len=len(prompt) + new + 8)
    ids = torch.tensor([prompt], dtype=torch.long, device="cuda")
    T = len(prompt)
    res = {"dtype": "float16", "torch": torch.__version__}

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
            p_ms = _timed_ms(lambda: tok.copy_(model.prefill(ids, loops)[0, -1:].argmax(-1)))
            pos.fill_(T)
            d_ms = _timed_ms(eager_decode)
            if r:                                         # the first round warms up
                pre.append(p_ms)
                dec.append(d_ms / (new - 1))
        res["prefill_ms"] = _median(pre)
        res["eager_decode_ms_per_token"] = _median(dec)
        log(f"torch eager: {res['eager_decode_ms_per_token']:.3f} ms/token")

        def reset():
            model.prefill(ids, loops)
            pos.fill_(T)

        def graph_ms_per_token() -> float:
            return graph_decode_ms(lambda t, p: model.decode_one(t, p, loops), tok, pos, reset, new, repeats)

        res["graph_decode_ms_per_token"] = graph_ms_per_token()
        log(f"torch graph: {res['graph_decode_ms_per_token']:.3f} ms/token")
        # the same with q|k|v and gate|up as one matmul each (a tighter baseline)
        model.fuse_projections()
        res["graph_fused_decode_ms_per_token"] = graph_ms_per_token()
        log(f"torch graph, fused projections: {res['graph_fused_decode_ms_per_token']:.3f} ms/token")
        if compile_mode != "none":
            # the fused step through torch.compile (inductor fuses the elementwise work), in a graph
            t0 = time.perf_counter()
            res["compile_mode"] = compile_mode
            try:
                step = _compile(model.decode_one, compile_mode)
                res["compiled_graph_decode_ms_per_token"] = graph_decode_ms(
                    lambda t, p: step(t, p, loops), tok, pos, reset, new, repeats)
            except Exception as exc:                      # the uncompiled rows stand
                import traceback
                traceback.print_exc()
                res["compile_error"] = f"{type(exc).__name__}: {exc}"
                log(f"torch compile row failed: {res['compile_error']}")
        if "compiled_graph_decode_ms_per_token" in res:
            res["compile_and_measure_s"] = time.perf_counter() - t0
            log(f"torch compile ({compile_mode}) + graph, fused projections: "
                f"{res['compiled_graph_decode_ms_per_token']:.3f} ms/token "
                f"({res['compile_and_measure_s']:.0f}s with compilation)")
    model.free_cache()
    model = None                                          # the closures above hold it too
    torch.cuda.empty_cache()
    return res


def bench_torch_int4(path: str, prompt: List[int], new: int, loops: int, repeats: int,
                     logical=None, compile_mode: str = "default", profile: bool = False,
                     variants=None, prepared: Optional[dict] = None, compile_scope: str = "step") -> dict:
    """INT4 weight-only PyTorch (tinygemm, group 128, bf16 activations and KV cache): the same
    logical weights quantized for torch (bench/torch_int4.py; every packed matrix checked against
    its dequantized reference), the decode step in a CUDA graph, plain and through torch.compile
    (per-layer KV caches with SDPA, the same with attention in plain ops, and one shared cache tensor
    as torch_model keeps it). ``profile``: the device time per kernel of each compiled step too;
    ``variants``: the result keys of the compiled rows to run (None: all three).

    ``prepared``: a dict shared between calls for one file (several depths): the tinygemm packing
    and the dense bf16 model are built on the first call and reused, not rebuilt per depth (the
    caller frees it: :func:`free_prepared`). ``compile_scope``: "step" compiles the whole decode
    step (one graph of every layer: its compile time grows with the depth), "blocks" compiles the
    block function once per distinct block and leaves the trunk around it (embedding, loop
    injection, norms between recurrences, head) as eager ops; either way the step is captured in
    one CUDA graph."""
    if compile_scope not in ("step", "blocks"):
        raise ValueError(f"compile_scope={compile_scope!r} is not 'step' or 'blocks'")
    import torch

    from bench import torch_int4 as q4
    from tinyloop.model.format import read_header
    from tinyloop.torch_model import LoopedLM, rope_tables

    cfg = read_header(path).config
    group = q4.pick_group(cfg)
    res = {"dtype": "bfloat16", "weights": f"int4 group {group} (tinygemm, _weight_int4pack_mm)",
           "torch": torch.__version__, "compile_scope": compile_scope}
    prep = {} if prepared is None else prepared
    if "model" not in prep:
        if logical is None:
            logical = q4.load_logical(path)
        prep["blocks"], prep["head"], prep["check"] = q4.timed_quantize(logical, cfg, q4.load_grids(path, group),
                                                                       group)
        # the dense bf16 model supplies embedding, norms, RoPE tables, the cache and the prefill
        model = LoopedLM.from_logical(cfg, logical).to(torch.bfloat16).cuda().eval()
        cos, sin = rope_tables(cfg.head_dim, cfg.rope_theta, model.max_seq_len, device="cuda")
        model.rope_cos, model.rope_sin = cos, sin         # keep the tables in float32
        prep["model"] = model
    blocks, head, check, model = prep["blocks"], prep["head"], prep["check"], prep["model"]
    res["matmul_check"] = {k: v for k, v in check.items() if k != "per_matrix"}
    log(f"torch int4: quantized in {check['quantize_s']:.1f}s (grids: {', '.join(check['grids'])}); "
        f"matmul max rel err "
        f"{check['max_rel_err_vs_quantized']:.2e} vs the quantized matrix, "
        f"{check['max_rel_err_vs_logical']:.2e} vs the logical weights ({check['rows']} rows per matrix)")
    model.allocate_cache(batch_size=1, max_seq_len=len(prompt) + new + 8)
    ids = torch.tensor([prompt], dtype=torch.long, device="cuda")
    T = len(prompt)
    n_layers = cfg.n_layers(loops)
    caches = q4.layer_caches(model, n_layers)
    step = q4.make_int4_step(model, blocks, head, loops, caches=caches)

    with torch.no_grad():
        tok = torch.zeros(1, dtype=torch.long, device="cuda")
        pos = torch.zeros(1, dtype=torch.long, device="cuda")

        def reset():
            model.prefill(ids, loops)
            for i in range(n_layers):                     # the prompt's K/V into the per-layer caches
                caches[0][i].copy_(model.k_cache[i])
                caches[1][i].copy_(model.v_cache[i])
            pos.fill_(T)

        # the int4 step against the dense bf16 step at the first decode position
        tok.copy_(model.prefill(ids, loops)[0, -1:].argmax(-1))
        reset()
        ref = model.decode_one(tok, pos, loops).float()
        got = step(tok, pos).float()
        res["logits_vs_bf16"] = {"rel_err": q4.rel_err(got.cpu().numpy(), ref.cpu().numpy()),
                                 "same_argmax": bool((got.argmax(-1) == ref.argmax(-1)).all())}
        log(f"torch int4 step logits vs dense bf16: max rel err {res['logits_vs_bf16']['rel_err']:.2e}, "
            f"same argmax {res['logits_vs_bf16']['same_argmax']}")

        res["graph_decode_ms_per_token"] = graph_decode_ms(step, tok, pos, reset, new, repeats)
        log(f"torch int4 graph (eager ops): {res['graph_decode_ms_per_token']:.3f} ms/token")
        if compile_mode != "none":
            res["compile_mode"] = compile_mode
            whole = compile_scope == "step"
            rows = (  # key, step, what
                ("compiled_graph_decode_ms_per_token",
                 step if whole else q4.make_int4_step(model, blocks, head, loops, caches=caches, compile_blocks=True),
                 "per-layer KV caches, SDPA" + ("" if whole else ", each block compiled")),
                ("compiled_ops_attention_graph_decode_ms_per_token",
                 q4.make_int4_step(model, blocks, head, loops, caches=caches, attention="ops"),
                 "per-layer KV caches, attention in plain ops"),
                ("compiled_shared_cache_graph_decode_ms_per_token",
                 q4.make_int4_step(model, blocks, head, loops),
                 "one KV cache tensor sliced per layer (as torch_model), SDPA"))
            rows = [r for r in rows if variants is None or r[0] in variants]
            for key, fn, what in rows:
                t0 = time.perf_counter()
                kern = {} if profile else None
                try:
                    fn = _compile(fn, compile_mode) if whole or key != "compiled_graph_decode_ms_per_token" else fn
                    res[key] = graph_decode_ms(fn, tok, pos, reset, new, repeats, kern)
                except Exception as exc:                  # the other int4 rows stand
                    import traceback
                    traceback.print_exc()
                    res.setdefault("compile_errors", {})[key] = f"{type(exc).__name__}: {exc}"
                    log(f"torch int4 compile row ({what}) failed: {res['compile_errors'][key]}")
                    continue
                log(f"torch int4 compile ({compile_mode}) + graph, {what}: {res[key]:.3f} ms/token "
                    f"({time.perf_counter() - t0:.0f}s with compilation)")
                if kern:
                    res.setdefault("kernels", {})[key] = kern
                    log(f"  device time {kern['total_us_per_token']:.1f} us/token; largest kernels (us/token, "
                        f"launches/token):")
                    for name, us, cnt in kern["kernels"]:
                        log(f"    {us:8.1f} {cnt:5.1f}  {name}")
    model.free_cache()
    model = blocks = head = step = caches = variants = None
    if prepared is None:
        free_prepared(prep)
    torch.cuda.empty_cache()
    return res


def free_prepared(prepared: dict) -> None:
    """Drop what :func:`bench_torch_int4` built into ``prepared`` (packed weights, dense model)."""
    import torch
    prepared.clear()
    torch.cuda.empty_cache()


#: (result section, key, table label, full name) of every PyTorch decode row, in table order
TORCH_ROWS = (
    ("torch", "eager_decode_ms_per_token", "torch fp16 eager", "PyTorch fp16 eager"),
    ("torch", "graph_decode_ms_per_token", "torch fp16 CUDA graph", "PyTorch fp16 CUDA graph"),
    ("torch", "graph_fused_decode_ms_per_token", "  fused q|k|v, gate|up",
     "PyTorch fp16 CUDA graph, fused q|k|v and gate|up"),
    ("torch", "compiled_graph_decode_ms_per_token", "  fused + torch.compile",
     "PyTorch fp16 torch.compile + CUDA graph, fused q|k|v and gate|up"),
    ("torch_int4", "graph_decode_ms_per_token", "torch int4 CUDA graph",
     "PyTorch INT4 weight-only (tinygemm) bf16 CUDA graph"),
    ("torch_int4", "compiled_shared_cache_graph_decode_ms_per_token", "  + compile, one cache tensor",
     "PyTorch INT4 weight-only (tinygemm) bf16 torch.compile + CUDA graph, one KV cache tensor"),
    ("torch_int4", "compiled_graph_decode_ms_per_token", "  + compile, per-layer KV",
     "PyTorch INT4 weight-only (tinygemm) bf16 torch.compile + CUDA graph"),
    ("torch_int4", "compiled_ops_attention_graph_decode_ms_per_token", "  + compile, per-layer, ops attn",
     "PyTorch INT4 weight-only (tinygemm) bf16 torch.compile + CUDA graph, attention in plain ops"),
)


def torch_rows(res: dict) -> List[tuple]:
    """(section, key, table label, full name, ms/token) of the PyTorch rows measured in res."""
    return [(sec, key, label, name, float(res[sec][key])) for sec, key, label, name in TORCH_ROWS
            if isinstance(res.get(sec), dict) and isinstance(res[sec].get(key), (int, float))]


def strongest_torch(res: dict):
    """The fastest PyTorch decode form measured in res: {"name", "key", "ms_per_token"}, or None."""
    rows = torch_rows(res)
    if not rows:
        return None
    sec, key, _, name, ms = min(rows, key=lambda r: r[4])
    return {"name": name, "key": f"{sec}.{key}", "ms_per_token": ms}


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
    ap.add_argument("--preset", default="360m", help="synthesized model shape when --model is not given (default 360m)")
    ap.add_argument("--loops", type=int, default=8, help="loop depth L of the timed decode (default 8)")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens before the timed decode (default 128)")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens decoded per timed run (default 128)")
    ap.add_argument("--sweep", default="1,2,4,8,16",
                    help="comma-separated loop depths of the tinyloop-only depth sweep (default 1,2,4,8,16)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per row; the median is reported (default 3)")
    ap.add_argument("--skip-torch", action="store_true", help="leave out every PyTorch row")
    ap.add_argument("--skip-torch-int4", action="store_true",
                    help="leave out the INT4 weight-only PyTorch rows (tinygemm)")
    ap.add_argument("--torch-compile-mode", default="default",
                    choices=("default", "max-autotune-no-cudagraphs", "none"),
                    help="torch.compile mode of the compiled PyTorch rows (captured in a CUDA graph by the "
                         "bench; 'none' leaves those rows out)")
    ap.add_argument("--torch-profile", action="store_true",
                    help="also the device time per kernel of each compiled INT4 PyTorch step (torch.profiler)")
    ap.add_argument("--skip-matmul", action="store_true", help="leave out the INT4 matmul bandwidth table")
    ap.add_argument("--json", help="write the results here")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tinyloop bench", description=__doc__.splitlines()[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


def _check_arguments(args) -> Optional[str]:
    """The first bad number among the arguments, as an error message (None: all good)."""
    for flag, value in (("--loops", args.loops), ("--prompt-len", args.prompt_len),
                        ("--new-tokens", args.new_tokens), ("--repeats", args.repeats)):
        if value < 1:
            return f"{flag}={value} must be at least 1"
    try:
        sweep = [int(x) for x in args.sweep.split(",") if x.strip()]
    except ValueError:
        return f"--sweep={args.sweep!r} must be comma-separated loop depths (integers)"
    if any(L < 1 for L in sweep):
        return f"--sweep={args.sweep!r}: every loop depth must be at least 1"
    return None


def run(args) -> int:
    from tinyloop.plugins.backends import CUDAEntry
    problem = _check_arguments(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
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

    res = {"date": time.strftime("%Y-%m-%d"), "commit": _commit(), "gpu": gpu_name(),
           "host": platform.node(), "model": os.path.basename(path), "preset": args.preset if not args.model else None,
           "config": cfg.to_dict(), "batch": 1, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}

    def save():                                           # after every section: a run cut short keeps its rows
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(res, fh, indent=2)

    res["tinyloop"] = bench_tinyloop(path, prompt, args.new_tokens, args.loops, sweep, args.repeats)
    save()
    if not args.skip_torch:
        try:
            import importlib
            importlib.import_module("torch")
        except ImportError as exc:
            res["torch"] = {"error": f"PyTorch not available: {exc}"}
        else:
            from bench.torch_int4 import load_logical
            logical = load_logical(path)                  # the same dequantized tensors for every row
            mode = args.torch_compile_mode
            if not args.skip_torch_int4:                  # first: the strongest PyTorch form
                try:
                    res["torch_int4"] = bench_torch_int4(path, prompt, args.new_tokens, args.loops,
                                                         args.repeats, logical=logical, compile_mode=mode,
                                                         profile=args.torch_profile)
                except Exception as exc:                  # the other rows stand; the reason is recorded
                    import traceback
                    traceback.print_exc()
                    res["torch_int4"] = {"error": f"{type(exc).__name__}: {exc}"}
                    log(f"torch int4 row failed: {res['torch_int4']['error']}")
                save()
            res["torch"] = bench_torch(path, prompt, args.new_tokens, args.loops, args.repeats,
                                       logical=logical, compile_mode=mode)
            save()
            del logical
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
    print(f"{'engine':<34}{'prefill ms':>12}{'decode ms/tok':>15}{'tok/s':>10}")
    print(f"{'tinyloop (numba, graphs)':<34}{tlr['prefill_ms']:>12.2f}{tlr['decode_ms_per_token']:>15.3f}"
          f"{tlr['tokens_per_s']:>10.1f}")
    for key, label in (("sampling", "  sampling T0.8 k50 p0.95"), ("sampling_k1024", "  sampling T1 k1024"),
                       ("sampling_host", "  same, drawn on the host")):
        if key in tlr:
            smp = tlr[key]
            print(f"{label:<34}{smp['prefill_ms']:>12.2f}{smp['decode_ms_per_token']:>15.3f}"
                  f"{smp['tokens_per_s']:>10.1f}  ({smp['decode_ms_per_token'] / tlr['decode_ms_per_token']:.3f}x greedy)")
    rows = torch_rows(res)
    for sec, k, label, _, ms in rows:
        pre = th["prefill_ms"] if (sec, k) == ("torch", "eager_decode_ms_per_token") else float("nan")
        print(f"{label:<34}{pre:>12.2f}{ms:>15.3f}{1e3 / ms:>10.1f}")
    for sec in ("torch", "torch_int4"):
        for what in ("error", "compile_error", "compile_errors"):
            if what in res.get(sec, {}):
                print(f"  ({sec} {what.replace('_', ' ')}: {res[sec][what]})")
    if "matmul_check" in res.get("torch_int4", {}):
        mc = res["torch_int4"]["matmul_check"]
        print(f"  int4 matmul check: max rel err {mc['max_rel_err_vs_quantized']:.2e} vs the quantized "
              f"matrix, {mc['max_rel_err_vs_logical']:.2e} vs tinyloop's logical weights")
    if rows:
        dec = tlr["decode_ms_per_token"]
        best = res["strongest_torch"] = strongest_torch(res)
        res["ratios"] = {"vs_strongest_torch": best["ms_per_token"] / dec}
        if "eager_decode_ms_per_token" in th:
            best_graph = min(th["graph_decode_ms_per_token"], th["graph_fused_decode_ms_per_token"])
            res["ratios"].update({"vs_torch_eager": th["eager_decode_ms_per_token"] / dec,
                                  "vs_torch_graph": th["graph_decode_ms_per_token"] / dec,
                                  "vs_torch_graph_best": best_graph / dec,
                                  "prefill_vs_torch": th["prefill_ms"] / tlr["prefill_ms"]})
        print(f"\nHEADLINE: tinyloop decode is {res['ratios']['vs_strongest_torch']:.2f}x the speed of the "
              f"strongest PyTorch form measured in this run, {best['name']} ({best['ms_per_token']:.3f} "
              f"ms/token vs tinyloop {dec:.3f})")
        if "vs_torch_eager" in res["ratios"]:
            r = res["ratios"]
            print(f"(vs torch fp16 eager {r['vs_torch_eager']:.2f}x, vs the unfused fp16 CUDA graph "
                  f"{r['vs_torch_graph']:.2f}x, the fused fp16 graph {r['vs_torch_graph_best']:.2f}x; "
                  f"prefill {r['prefill_vs_torch']:.2f}x)")
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
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
