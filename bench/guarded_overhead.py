"""What a guarded early-exit step costs on the GPU, part by part (issue 18's wall-clock goal).

For one model at its default depth L (default: demo-exit): greedy decode ms/token at fixed depths
1..L, then guarded steps whose criterion never exits (hidden_l2 with a threshold of 1e-12) with
1..L-1 probe intervals (min_L = L-1 .. 1) — the fixed cost of the guarded step and the cost of
each probe interval (a probe kernel and an IF conditional node) — and real exits (gate 0.9 where
the model has a gate, hidden_l2 0.4), each under every graph layout asked for:

* ``flat``: the head and tail as nodes of the step's graph (the default),
* ``child``: the head and tail as child graph nodes (TINYLOOP_CUDA_GUARDED_FLAT=0, the layout
  before flat),
* ``noif``: flat, and the stretches too as plain nodes (no conditional node; measurement only, for
  the never-exit rows: it isolates what the IF nodes cost).

Then a CUPTI profile (torch.profiler) of the never-exit step with the most probes: device time per
kernel per token against the wall time, so what is kernels and what is graph structure shows.

    python -m bench.guarded_overhead [--model PATH] [--layouts flat,child,noif] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

from bench.decode_bench import _commit, gpu_name, log
from bench.early_exit_bench import _decode_ms
from bench.profile_decode import short_name

PROMPTS = ["Once upon a time", "The little dog ran", "She opened the door and"]
NEVER = 1e-12


def _ms(tl, m, prompts, cfg, repeats: int):
    """(median greedy ms/token, mean depth) over the prompts, after a warm-up each."""
    depths = []
    ms = _decode_ms(tl, m, prompts, cfg, repeats, depths)
    return ms, sum(depths) / len(depths)


def _configs(tl, m, new: int):
    L = m.cfg.default_loops
    base = tl.GenerateConfig(max_tokens=new, loops=L)
    ex = dict(early_exit_patience=1, early_exit_kv="copy_last")
    rows = []
    for k in range(1, L):            # k probe intervals: probes at L-k .. L-1
        rows.append((f"never-exit, {k} probe interval(s)", "never", k,
                     base.replace(early_exit_criterion="hidden_l2", early_exit_threshold=NEVER,
                                  early_exit_min_L=L - k, **ex)))
    if m.cfg.exit_gate:
        rows.append(("gate 0.9", "exit", L - 1, base.replace(early_exit_criterion="gate", early_exit_threshold=0.9,
                                                             early_exit_min_L=1, **ex)))
    rows.append(("hidden_l2 0.4", "exit", L - 2, base.replace(early_exit_criterion="hidden_l2",
                                                              early_exit_threshold=0.4, early_exit_min_L=2, **ex)))
    return rows


def _load(tl, path, layout: str, max_seq: int):
    from tinyloop.cuda import graphs
    os.environ["TINYLOOP_CUDA_GUARDED_FLAT"] = "0" if layout == "child" else "1"
    graphs.GuardedGraph.unconditional = layout == "noif"
    return tl.load_model(path, max_seq_len=max_seq, backend="cuda")


def _profile(tl, m, prompt, cfg, n_tok: int) -> dict:
    """Device µs per token per kernel name of `n_tok` decode steps (a run of 1 + n_tok tokens
    minus a run of 1), and the unprofiled wall ms/token of the same config."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    def kernels(n_new):
        per = defaultdict(float)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            tl.generate(m, prompt, cfg.replace(max_tokens=n_new))
            torch.cuda.synchronize()
        for ev in prof.events():
            if ev.device_type.name == "CUDA":
                per[short_name(ev.name)] += ev.device_time_total
        return per
    tl.generate(m, prompt, cfg.replace(max_tokens=8))
    base = kernels(1)
    full = kernels(1 + n_tok)
    per = {k: (v - base.get(k, 0.0)) / n_tok for k, v in full.items()}
    per = {k: v for k, v in sorted(per.items(), key=lambda kv: -kv[1]) if v > 0.01}
    return {"kernels_us_per_token": per, "device_us_per_token": sum(per.values())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a .tinyloop file (default: the shipped demo-exit)")
    ap.add_argument("--layouts", default="flat,child,noif")
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile-tokens", type=int, default=32, help="0: no CUPTI profile")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    layouts = [x for x in a.layouts.split(",") if x]
    bad = [x for x in layouts if x not in ("flat", "child", "noif")]
    if bad or not layouts:
        ap.error(f"--layouts: unknown {bad or layouts}; known: flat, child, noif")
    for name, lo in (("new", 2), ("repeats", 1), ("profile_tokens", 0)):
        if getattr(a, name) < lo:
            ap.error(f"--{name.replace('_', '-')}={getattr(a, name)} must be at least {lo}")
    import tinyloop as tl
    from tinyloop.models import model_path
    from tinyloop.plugins.backends import CUDAEntry
    if not CUDAEntry.available()[0]:
        raise SystemExit("no GPU here")
    path = a.model or str(model_path("demo-exit"))
    max_seq = a.new + 64
    rows, fixed, profiles = [], {}, {}
    env = os.environ.get("TINYLOOP_CUDA_GUARDED_FLAT")
    try:
        _run_layouts(tl, a, path, layouts, max_seq, rows, fixed, profiles)
    finally:
        from tinyloop.cuda import graphs
        graphs.GuardedGraph.unconditional = False
        if env is None:
            os.environ.pop("TINYLOOP_CUDA_GUARDED_FLAT", None)
        else:
            os.environ["TINYLOOP_CUDA_GUARDED_FLAT"] = env
    _report(a, path, rows, fixed, profiles)
    return 0


def _run_layouts(tl, a, path, layouts, max_seq, rows, fixed, profiles) -> None:
    for layout in layouts:
        m = _load(tl, path, layout, max_seq)
        try:
            L = m.cfg.default_loops
            prompts = [m.tokenizer.encode(p) for p in PROMPTS]
            if not fixed:
                for d in range(1, L + 1):
                    fixed[d] = _ms(tl, m, prompts, tl.GenerateConfig(max_tokens=a.new, loops=d), a.repeats)[0]
                    log(f"fixed L={d}: {fixed[d]:.4f} ms/token")
            for name, kind, k, cfg in _configs(tl, m, a.new):
                if layout == "noif" and kind != "never":
                    continue
                ms, depth = _ms(tl, m, prompts, cfg, a.repeats)
                rows.append({"layout": layout, "config": name, "kind": kind, "intervals": k, "ms_per_token": ms,
                             "mean_depth": depth})
                log(f"{layout} {name}: {ms:.4f} ms/token, mean depth {depth:.3f}")
            if a.profile_tokens > 0:
                cfg = _configs(tl, m, a.new)[L - 2][3]
                try:
                    profiles[layout] = _profile(tl, m, prompts[0], cfg, a.profile_tokens)
                    profiles[layout]["wall_ms_per_token"] = _ms(tl, m, prompts[:1], cfg, 1)[0]
                except ImportError:
                    log("no torch: no CUPTI profile")
        finally:
            tl.free_model(m)


def _report(a, path, rows, fixed, profiles) -> None:
    L = max(fixed)
    print("\nfixed depth, ms/token: " + ", ".join(f"L={d} {v:.4f}" for d, v in fixed.items()))
    per_iter = (fixed[L] - fixed[1]) / (L - 1) if L > 1 else 0.0
    print(f"one loop iteration: {1000 * per_iter:.1f} us; outside the loop: {1000 * (fixed[1] - per_iter):.1f} us")
    print(f"\n{'layout':<7}{'config':<34}{'ms/token':>10}{'depth':>8}{'over fixed line us':>20}")
    for r in rows:
        line = fixed[1] + per_iter * (r["mean_depth"] - 1)
        r["over_fixed_line_us"] = 1000 * (r["ms_per_token"] - line)
        if r["kind"] == "exit":
            r["iters_saved"] = 1 - r["mean_depth"] / L
            r["wall_saved"] = 1 - r["ms_per_token"] / fixed[L]
            r["ratio"] = r["wall_saved"] / r["iters_saved"] if r["iters_saved"] > 0 else None
        extra = f"  ratio {r['ratio']:.2f}" if r.get("ratio") is not None else ""
        print(f"{r['layout']:<7}{r['config']:<34}{r['ms_per_token']:>10.4f}{r['mean_depth']:>8.3f}"
              f"{r['over_fixed_line_us']:>20.1f}{extra}")
    for layout, p in profiles.items():
        print(f"\nprofile ({layout}, never-exit, {L - 1} probe intervals): device "
              f"{p['device_us_per_token']:.1f} us/token, wall {1000 * p['wall_ms_per_token']:.1f} us/token")
        for k, v in list(p["kernels_us_per_token"].items())[:14]:
            print(f"  {k[:60]:<60}{v:>8.2f}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"date": time.strftime("%Y-%m-%d"), "commit": _commit(), "device": gpu_name(),
                       "model": os.path.basename(path), "fixed_ms": fixed, "rows": rows, "profiles": profiles},
                      fh, indent=2)


if __name__ == "__main__":
    sys.exit(main())
