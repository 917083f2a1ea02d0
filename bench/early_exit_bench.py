"""Early-exit benchmark: quality against compute for fixed depths and every exit criterion.

For one model and backend: held-out perplexity (data/heldout_eval.txt, teacher-forced through the
decode steps, tinyloop.analysis.evaluate.decoded_perplexity; fixed depths through
tinyloop.analysis.evaluate.perplexity, which gives the same logits) and decode speed (greedy,
median ms/token over prompts) for fixed L = 1..8 and for each criterion over a sweep of
thresholds at the model's default depth. Reports the mean loop iterations per token, the
iteration saving (1 - mean / L), the wall-clock saving against fixed L in the same run and their
ratio; draws the quality/compute Pareto curve as a PNG (matplotlib) and writes JSON.

    python -m bench.early_exit_bench --backend cpu --json docs/bench_cpu_early_exit.json \\
        --plot docs/early_exit_cpu.png
    python -m bench.early_exit_bench --backend cuda             # the demo model on the GPU
    python -m bench.early_exit_bench --backend cuda --preset 360m --windows 2
    python -m bench.early_exit_bench --oracle-only          # the bound below, on the CPU

--oracle adds a bound no probing criterion can beat on this model: each token exits at the
smallest depth d whose next-token distribution is within KL(p_d || p_L) < tau of the full depth's
(known here because every depth is scored), for a sweep of tau. It sees the distribution the
token would end with, which a probe cannot, and it ignores what exiting does to later tokens'
K/V (each depth's logits come from a forward at that fixed depth), so a real criterion does no
better than this curve.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

from bench.decode_bench import _commit, _median, bench_model, gpu_name, log

#: (criterion, config field of its threshold, thresholds) swept at the default depth.
SWEEPS = [
    ("hidden_l2", "early_exit_threshold", [0.2, 0.3, 0.4, 0.45, 0.5]),
    ("kl", "early_exit_threshold", [0.01, 0.03, 0.05, 0.075, 0.1, 0.2]),
    ("logit_margin", "early_exit_logit_margin", [1.0, 2.0, 4.0, 8.0]),
    ("argmax", None, [None]),
    ("gate", "early_exit_threshold", [0.5, 0.7, 0.8, 0.9, 0.95]),     # models with a learned exit gate only
]
#: Settings a criterion needs beside the bench's patience 1, min_L 2, peek_every 1.
CRITERION_KW = {"gate": {"early_exit_min_L": 1}}
PROMPTS = ["Once upon a time", "The little dog ran", "She opened the door and", "In the morning the sun"]


def _decode_ms(tl, m, prompts, cfg, repeats: int, depths=None) -> float:
    """Median greedy decode ms/token over `prompts` (after one warm-up run each); each timed run's
    mean depth (GenerateStats.loops_used) appended to `depths` when given."""
    out = []
    for p in prompts:
        tl.generate(m, p, cfg.replace(max_tokens=8))
        for _ in range(repeats):
            st = tl.GenerateStats()
            tl.generate(m, p, cfg, stats=st)
            out.append(st.decode_ms / max(1, st.tokens_emitted - 1))
            if depths is not None:
                depths.append(st.loops_used)
    return _median(out)


def run(backend: str, model, preset: str, window: int, windows: int, new: int, repeats: int,
        kv_policies, fixed, criteria=None) -> dict:
    import tinyloop as tl
    from tinyloop.analysis.evaluate import decoded_perplexity, perplexity
    from tinyloop.analysis.loopgain import HELDOUT_TEXT
    where = bench_model(backend, model, preset)
    if where is None:
        raise SystemExit("--backend cuda: no GPU here")
    path, tmp = where
    m = tl.load_model(path, max_seq_len=max(window, 64 + new) + 8, backend=backend)
    try:
        L0 = m.cfg.default_loops
        ids = m.tokenizer.encode(HELDOUT_TEXT.read_text(encoding="utf-8")[:window * windows * 8])
        prompts = [m.tokenizer.encode(p) for p in PROMPTS]
        base = tl.GenerateConfig(max_tokens=new)
        rows = []
        for L in fixed:
            t = time.perf_counter()
            ppl = perplexity(m, ids, loops=L, window=window, max_windows=windows)["ppl"]
            ms = _decode_ms(tl, m, prompts, base.replace(loops=L), repeats)
            rows.append({"kind": "fixed", "loops": L, "mean_loops": float(L), "ppl": ppl, "ms_per_token": ms})
            log(f"fixed L={L}: ppl {ppl:.3f}, {ms:.3f} ms/token ({time.perf_counter() - t:.0f} s)")
        fixed_ms = {r["loops"]: r["ms_per_token"] for r in rows}
        fixed_ppl = {r["loops"]: r["ppl"] for r in rows}
        for kv in kv_policies:
            for crit, field, values in SWEEPS:
                if (criteria is not None and crit not in criteria) or (crit == "gate" and not m.cfg.exit_gate):
                    continue
                for v in values:
                    kw = dict(CRITERION_KW.get(crit, {}))
                    if field is not None:
                        kw[field] = v
                    cfg = base.replace(loops=L0, early_exit_patience=1, early_exit_criterion=crit, early_exit_kv=kv,
                                       **kw)
                    t = time.perf_counter()
                    r = decoded_perplexity(m, ids, cfg, window=window, max_windows=windows)
                    ms = _decode_ms(tl, m, prompts, cfg, repeats)
                    iters_saved = 1 - r["mean_loops"] / L0
                    wall_saved = 1 - ms / fixed_ms[L0] if L0 in fixed_ms else None
                    rows.append({"kind": "exit", "criterion": crit, "threshold": v, "kv": kv, "loops": L0,
                                 "mean_loops": r["mean_loops"], "ppl": r["ppl"], "ms_per_token": ms,
                                 "iters_saved": iters_saved, "wall_saved": wall_saved,
                                 "ppl_loss": r["ppl"] / fixed_ppl[L0] - 1 if L0 in fixed_ppl else None,
                                 "probes_per_token": r["probes"] / r["tokens"]})
                    log(f"{crit} {v} {kv}: ppl {r['ppl']:.3f}, mean L {r['mean_loops']:.3f}, {ms:.3f} ms/token "
                        f"({time.perf_counter() - t:.0f} s)")
        out = {"date": time.strftime("%Y-%m-%d"), "commit": _commit(), "backend": m.backend_name,
               "device": gpu_name() if backend == "cuda" else platform.processor() or platform.machine(),
               "model": model or (preset if backend == "cuda" else "demo"), "default_loops": L0,
               "window": window, "windows": windows, "scored_tokens": windows * (window - 1),
               "new_tokens": new, "rows": rows,
               "guarded_graphs": bool(getattr(m.backend, "guarded_graphs", False))}
    finally:
        tl.free_model(m)
        if tmp is not None:
            tmp.cleanup()
    return out


def table(res: dict) -> str:
    L0 = res["default_loops"]
    lines = [f"{res['model']} on {res['backend']} ({res['device']}), commit {res['commit']}, default L = {L0}",
             f"{'config':34s} {'mean L':>7s} {'ppl':>8s} {'ppl +%':>7s} {'ms/tok':>7s} {'iters -%':>8s} "
             f"{'wall -%':>8s} {'wall/iters':>10s}"]
    base = {r["loops"]: r for r in res["rows"] if r["kind"] == "fixed"}
    for r in res["rows"]:
        if r["kind"] == "fixed":
            name = f"fixed L={r['loops']}"
            ref = base.get(L0)
            iters = 1 - r["loops"] / L0
            wall = 1 - r["ms_per_token"] / ref["ms_per_token"] if ref else float("nan")
            loss = r["ppl"] / ref["ppl"] - 1 if ref else float("nan")
        else:
            name = f"{r['criterion']} {r['threshold']} {r['kv']}"
            iters, wall, loss = r["iters_saved"], r["wall_saved"] or float("nan"), r["ppl_loss"] or float("nan")
        ratio = wall / iters if iters > 1e-9 else float("nan")
        lines.append(f"{name:34s} {r['mean_loops']:7.3f} {r['ppl']:8.3f} {100 * loss:7.2f} {r['ms_per_token']:7.3f} "
                     f"{100 * iters:8.1f} {100 * wall:8.1f} {ratio:10.2f}")
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    from tinyloop.analysis.plots import _pyplot
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    fx = [r for r in res["rows"] if r["kind"] == "fixed"]
    ax.plot([r["mean_loops"] for r in fx], [r["ppl"] for r in fx], "k-o", label="fixed depth L")
    for r in fx:
        ax.annotate(f"L={r['loops']}", (r["mean_loops"], r["ppl"]), textcoords="offset points", xytext=(4, 4),
                    fontsize=7)
    marks = {"hidden_l2": "s", "kl": "^", "logit_margin": "D", "argmax": "v", "gate": "o"}
    for kv in sorted({r["kv"] for r in res["rows"] if r["kind"] == "exit"}):
        for crit, mk in marks.items():
            pts = [r for r in res["rows"] if r["kind"] == "exit" and r["criterion"] == crit and r["kv"] == kv]
            if pts:
                ax.plot([r["mean_loops"] for r in pts], [r["ppl"] for r in pts], marker=mk,
                        linestyle="--" if kv == "copy_last" else ":", label=f"{crit} ({kv})")
    ax.set_xlabel("loop iterations per token (mean)")
    ax.set_ylabel("held-out perplexity")
    lo = min(r["ppl"] for r in res["rows"])
    ax.set_ylim(lo * 0.98, lo * 1.25)
    ax.set_title(f"Early exit: quality vs compute ({res['model']}, {res['backend']}, default L={res['default_loops']})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


#: KL thresholds of the --oracle sweep.
ORACLE_TAUS = [0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.05, 0.1, 0.2]


def oracle_bound(m, ids, window: int, windows: int, L: int, taus=ORACLE_TAUS) -> list:
    """The --oracle curve (module docstring): rows of {tau, mean_loops, iters_saved, ppl, ppl_vs_L}."""
    import math
    import numpy as np
    import tinyloop as tl
    n = min(len(ids) // window, windows)
    logp = {}
    for d in range(1, L + 1):
        rows = []
        for w in range(n):
            chunk = ids[w * window:(w + 1) * window]
            lg = tl.score(m, chunk, loops=d, cache_mode="fp16").astype(np.float64)[:-1]   # as perplexity()
            top = lg.max(axis=1, keepdims=True)
            rows.append(lg - (top + np.log(np.exp(lg - top).sum(axis=1, keepdims=True))))
        logp[d] = np.concatenate(rows)
    target = np.concatenate([np.asarray(ids[w * window + 1:(w + 1) * window]) for w in range(n)])
    nll = np.stack([-logp[d][np.arange(len(target)), target] for d in range(1, L + 1)], axis=1)
    kl = [(np.exp(logp[d]) * (logp[d] - logp[L])).sum(axis=1) for d in range(1, L)]
    base = nll[:, L - 1].mean()
    out = []
    for tau in taus:
        depth = np.full(len(target), L)
        for d in range(L - 1, 0, -1):           # the smallest depth within tau of the full one
            depth = np.where(kl[d - 1] < tau, d, depth)
        loss = nll[np.arange(len(target)), depth - 1].mean()
        out.append({"kind": "oracle", "tau": tau, "mean_loops": float(depth.mean()),
                    "iters_saved": 1 - float(depth.mean()) / L, "ppl": math.exp(loss),
                    "ppl_vs_L": math.exp(loss - base) - 1})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model", default=None, help="a .tinyloop file (default: demo; 360m preset with --preset)")
    ap.add_argument("--preset", default="demo", help="with --backend cuda and no --model: a synth preset, or demo")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--new", type=int, default=64, help="tokens per timed generation")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--kv", default="copy_last,recompute", help="K/V policies to sweep (comma-separated)")
    ap.add_argument("--fixed", default="1,2,3,4,5,6,7,8", help="fixed depths")
    ap.add_argument("--criteria", default=None,
                    help="criteria to sweep (comma-separated; default all; gate only on a model with an exit gate)")
    ap.add_argument("--oracle", action="store_true", help="also the bound of the module docstring")
    ap.add_argument("--oracle-only", action="store_true", help="only that bound (no sweep, no timing)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    a = ap.parse_args(argv)
    model = a.model
    if model is None and a.preset == "demo":
        from tinyloop.models import demo_model_path
        model = demo_model_path()
    if a.oracle_only:
        res = {"backend": a.backend, "model": a.model or a.preset, "rows": []}
    else:
        res = run(a.backend, model, a.preset, a.window, a.windows, a.new, a.repeats,
                  [k for k in a.kv.split(",") if k], [int(x) for x in a.fixed.split(",") if x],
                  None if a.criteria is None else [c for c in a.criteria.split(",") if c])
    if a.model is None:
        res["model"] = a.preset
    if a.oracle or a.oracle_only:
        res["oracle"] = _oracle(a, model)
        print("oracle (exit at the smallest depth within KL tau of the full depth's distribution):")
        for r in res["oracle"]:
            print(f"  tau {r['tau']:<6g} mean depth {r['mean_loops']:.3f}  iterations saved "
                  f"{100 * r['iters_saved']:5.1f} %  ppl {r['ppl']:.3f} ({100 * r['ppl_vs_L']:+.2f} %)")
    if res["rows"]:
        print(table(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    if a.plot:
        plot(res, a.plot)
    return 0


def _oracle(a, model) -> list:
    import tinyloop as tl
    from tinyloop.analysis.loopgain import HELDOUT_TEXT
    where = bench_model(a.backend, model, a.preset)
    if where is None:
        raise SystemExit("--backend cuda: no GPU here")
    path, tmp = where
    m = tl.load_model(path, max_seq_len=a.window + 8, backend=a.backend)
    try:
        ids = m.tokenizer.encode(HELDOUT_TEXT.read_text(encoding="utf-8")[:a.window * a.windows * 8])
        return oracle_bound(m, ids, a.window, a.windows, m.cfg.default_loops)
    finally:
        tl.free_model(m)
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
