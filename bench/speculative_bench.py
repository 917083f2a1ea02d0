"""Speculative decoding benchmark: plain greedy vs chain and tree self-speculative decoding on one
model, one device, in one run.

    python bench/speculative_bench.py [--model FILE | --preset 360m] [--backend cuda|cpu]
        [--verify-loops 4] [--draft-loops 1,2,3] [--draft-ahead 2,4,6]
        [--tree-k 2,3] [--tree-depth 2,3] [--no-resume-grid] [--new-tokens 128] [--json out.json]

Wall-clock decode tokens/s (first token excluded, median of --repeats after a warm-up that also
captures the graphs), acceptance rate and tokens per verify pass; chain configurations with and
without verify-resume, trees (K_branches x depth) with it.

--cost-model (CUDA; chain configurations): the speed the measured step costs predict for the
measured acceptance, and the ratio of the wall-clock rate to it. Each captured graph launch is
timed on the device by CUDA events recorded on the backend's stream just before and after it
(GraphTimer). The draft step (c_draft) and the verify pass (c_verify: the last draft's tail and
the resumed verify rows) are timed in the host-loop form of the same decoder (the backend's
device_chaining withheld, so every draft step and the verify are launches of their own, with the
same ops); the prediction is tokens_per_verify / (draft_ahead * c_draft + c_verify). The device
time of the chained cycle as the decoder runs it (one graph: drafts, verify, acceptance) is
reported beside it (c_cycle), and so is what the wall clock spends beyond it per cycle. Tree
configurations report their cycle's device time (one graph) against the wall clock per cycle,
and the device time of its parts launched alone in the host-loop form (each draft level, the
leaves' tail, the verify over every node).
Every speculative output is checked to
equal plain greedy decoding at verify_loops. Default model: the shipped demo model, on prompts of
Python code; with --preset, a synthesized model (random weights) on fixed token prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tinyloop as tl  # noqa: E402
from tinyloop.progress import bar  # noqa: E402

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\nimport sys\n\n\ndef main():",
           "    def __repr__(self):\n        return", "for i, line in enumerate(lines):"]


def rate(st: tl.GenerateStats) -> float:
    return (st.tokens_emitted - 1) / (st.decode_ms / 1e3) if st.decode_ms > 0 else float("nan")


def _ints(s: str):
    return [int(x) for x in s.split(",") if x.strip()]


class GraphTimer:
    """Device milliseconds of every captured graph launch of a CUDA backend, by the kind of step
    (the first element of its graph key), from CUDA events recorded on the backend's stream just
    before and after the launch. Replays that capture or run eagerly are timed too: warm up first."""

    def __init__(self, backend):
        self.be, self.events = backend, []

    def __enter__(self):
        from numba import cuda
        be, orig = self.be, self.be.replay

        def replay(key, fn):
            e0, e1 = cuda.event(), cuda.event()
            e0.record(be.stream)
            orig(key, fn)
            e1.record(be.stream)
            self.events.append((key, e0, e1))
        be.replay = replay                  # an instance attribute: the class's method is restored on exit
        return self

    def __exit__(self, *exc):
        del self.be.replay

    def mean_ms(self, kind: str, where=None) -> float:
        """Mean device ms of the launches whose graph key starts with `kind` (and, given, for
        which where(key) holds)."""
        self.be.stream.synchronize()
        t = [e0.elapsed_time(e1) for k, e0, e1 in self.events if k[0] == kind and (where is None or where(k))]
        return float(np.mean(t)) if t else float("nan")


def _host_loop_steps(m, prompts, fn, cfg) -> GraphTimer:
    """The graph launches of the host-loop form of a speculative decoder (the backend's
    device_chaining withheld: every draft step or level, the tail and the verify launched alone),
    timed after a warm-up that captures them."""
    be = m.backend
    supports = be.supports
    be.supports = lambda c: c not in ("device_chaining", "device_acceptance") and supports(c)
    try:
        for ids in prompts:
            fn(m, ids, cfg)
        with GraphTimer(be) as steps:
            for ids in prompts:
                fn(m, ids, cfg)
    finally:
        del be.supports
    return steps


def cost_model(m, prompts, cfg, tokens_per_verify: float, measured: float) -> dict:
    """The chain configuration's step costs on the device and the rate they predict (see the module
    docstring); `measured`: its wall-clock tokens/s."""
    with GraphTimer(m.backend) as cyc:
        for ids in prompts:
            tl.generate_speculative(m, ids, cfg)
    steps = _host_loop_steps(m, prompts, tl.generate_speculative, cfg)
    k = cfg.draft_ahead
    c_draft = steps.mean_ms("draft")
    c_verify = (steps.mean_ms("tail") + steps.mean_ms("verify")) if cfg.verify_resume else steps.mean_ms("verify-full")
    predicted = tokens_per_verify / (k * c_draft + c_verify) * 1e3
    return {"c_draft_ms": c_draft, "c_verify_ms": c_verify, "c_cycle_ms": cyc.mean_ms("cycle"),
            "wall_cycle_ms": tokens_per_verify / measured * 1e3, "predicted_tokens_per_s": predicted,
            "of_cost_model": measured / predicted}


def tree_cost(m, prompts, cfg, tokens_per_verify: float, measured: float) -> dict:
    """A tree configuration's cycle on the device (one graph: the levels' drafts, the verify, the
    acceptance) against the wall clock per cycle, and the rate the device time alone allows."""
    with GraphTimer(m.backend) as cyc:
        for ids in prompts:
            tl.generate_tree_speculative(m, ids, cfg)
    c = cyc.mean_ms("tree-cycle")
    steps = _host_loop_steps(m, prompts, tl.generate_tree_speculative, cfg)
    return {"c_cycle_ms": c, "wall_cycle_ms": tokens_per_verify / measured * 1e3,
            "device_bound_tokens_per_s": tokens_per_verify / c * 1e3,
            # the parts, launched alone: each draft level (K^d rows), the leaves' tail, the verify
            "c_levels_ms": [steps.mean_ms("tree-draft", lambda k, d=d: k[4] == d) for d in range(cfg.draft_ahead)],
            "c_tail_ms": steps.mean_ms("tree-tail"), "c_verify_ms": steps.mean_ms("tree-verify")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--preset", help="synthesize this preset (e.g. 360m) instead of the demo model")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--verify-loops", default="4")
    ap.add_argument("--draft-loops", default="1,2,3")
    ap.add_argument("--draft-ahead", default="2,4,6")
    ap.add_argument("--tree-k", default="2,3")
    ap.add_argument("--tree-depth", default="2,3")
    ap.add_argument("--no-resume-grid", action="store_true", help="chain configurations with verify-resume only")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--calibrate", action="store_true",
                    help="also run tinyloop.calibrate (the auto decoder's choice) at each verify depth")
    ap.add_argument("--cost-model", action="store_true",
                    help="CUDA: time the draft step, the verify pass and the chained cycle on the device and "
                         "report the wall-clock rate against the rate they predict (chain configurations)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from tinyloop.models import demo_model_path
    tmp = None
    if args.preset:
        from tinyloop.cli.synth import synth_model
        tmp = tempfile.TemporaryDirectory()
        path = os.path.join(tmp.name, f"{args.preset}.tinyloop")
        synth_model(args.preset, path, seed=0)
    else:
        path = args.model or demo_model_path()
    m = tl.load_model(path, max_seq_len=512, backend=args.backend)
    if args.cost_model and not m.backend.supports("device_chaining"):
        tl.free_model(m)
        raise SystemExit(f"--cost-model times captured graphs: it needs the cuda backend, not {m.backend_name!r}")
    if args.preset:
        rng = np.random.default_rng(0)
        prompts = [[int(t) for t in rng.integers(1, m.vocab_size, 16)] for _ in range(args.prompts)]
    else:
        from tinyloop.model.tokenizer import resolve_tokenizer
        tok = resolve_tokenizer(m.header.tokenizer, None, m.vocab_size)
        prompts = [tok.encode(p) for p in PROMPTS[:args.prompts]]
    rows = []

    def measure(fn, cfg, refs):
        rates, acc, mal, exact = [], [], [], True
        for ids in bar(prompts, "prompts", unit="prompt"):
            fn(m, ids, cfg)                                  # warm-up and graph capture
            r = []
            for _ in range(args.repeats):
                st = tl.GenerateStats()
                out = fn(m, ids, cfg, stats=st)
                exact &= out == refs[tuple(ids)]
                r.append(rate(st))
            rates.append(np.median(r))
            acc.append(st.acceptance_rate)
            mal.append(st.mean_accepted_length)
        return float(np.mean(rates)), float(np.mean(acc)), float(np.mean(mal)), bool(exact)

    try:
        for Lv in _ints(args.verify_loops):
            def plain(ids, st=None):
                return tl.generate_stream(m, ids, tl.GenerateConfig(max_tokens=args.new_tokens, loops=Lv), stats=st)

            refs, base = {}, []
            for ids in prompts:
                refs[tuple(ids)] = plain(ids)
                r = []
                for _ in range(args.repeats):
                    st = tl.GenerateStats()
                    plain(ids, st)
                    r.append(rate(st))
                base.append(np.median(r))
            base_rate = float(np.mean(base))
            rows.append({"verify_loops": Lv, "mode": "plain", "tokens_per_s": base_rate})
            print(f"L={Lv} plain greedy: {base_rate:.1f} tok/s", flush=True)
            grid = []
            for Ld in [x for x in _ints(args.draft_loops) if x < Lv]:
                for K in _ints(args.draft_ahead):
                    for resume in ((True,) if args.no_resume_grid else (True, False)):
                        grid.append(("speculative", tl.SpeculativeConfig(
                            max_tokens=args.new_tokens, draft_loops=Ld, verify_loops=Lv, draft_ahead=K,
                            verify_resume=resume)))
                for Kb in _ints(args.tree_k):
                    for D in _ints(args.tree_depth):
                        grid.append(("tree", tl.TreeSpeculativeConfig(
                            max_tokens=args.new_tokens, draft_loops=Ld, verify_loops=Lv, draft_ahead=D,
                            K_branches=Kb)))
            for mode, cfg in grid:
                fn = tl.generate_tree_speculative if mode == "tree" else tl.generate_speculative
                tps, acc, mal, exact = measure(fn, cfg, refs)
                row = {"verify_loops": Lv, "mode": mode, "draft_loops": cfg.draft_loops,
                       "draft_ahead": cfg.draft_ahead, "verify_resume": cfg.verify_resume, "tokens_per_s": tps,
                       "speedup": tps / base_rate, "acceptance_rate": acc, "tokens_per_verify": mal,
                       "exact": exact}
                if mode == "tree":
                    row["K_branches"] = cfg.K_branches
                    if args.cost_model:
                        row.update(tree_cost(m, prompts, cfg, mal, tps))
                        levels = ", ".join(f"{t:.4f}" for t in row["c_levels_ms"])
                        print(f"    tree cycle on the device {row['c_cycle_ms']:.4f} ms (wall "
                              f"{row['wall_cycle_ms']:.4f}): the device alone allows "
                              f"{row['device_bound_tokens_per_s']:.1f} tok/s; alone: levels {levels} ms, "
                              f"tail {row['c_tail_ms']:.4f}, verify {row['c_verify_ms']:.4f}", flush=True)
                elif args.cost_model:
                    row.update(cost_model(m, prompts, cfg, mal, tps))
                    print(f"    cost model: draft {row['c_draft_ms']:.4f} ms, verify {row['c_verify_ms']:.4f} ms, "
                          f"cycle on the device {row['c_cycle_ms']:.4f} ms (wall {row['wall_cycle_ms']:.4f}): "
                          f"predicted {row['predicted_tokens_per_s']:.1f} tok/s, measured / predicted "
                          f"{row['of_cost_model']:.3f}", flush=True)
                rows.append(row)
                kb = f" Kb={cfg.K_branches}" if mode == "tree" else ""
                print(f"L={Lv} {mode:11} Ld={cfg.draft_loops} ahead={cfg.draft_ahead}{kb} "
                      f"resume={cfg.verify_resume!s:5}: {tps:8.1f} tok/s x{tps / base_rate:.2f} accept {acc:.2f} "
                      f"tok/verify {mal:.2f} exact {exact}", flush=True)
            if args.calibrate:
                t0 = time.perf_counter()
                choice = tl.calibrate(m, Lv, prompts=prompts[:3])
                rows.append({"verify_loops": Lv, "mode": "auto", "choice": choice.to_dict(),
                             "calibration_s": time.perf_counter() - t0})
                print(f"L={Lv} auto: {choice.decoder} x{choice.speedup:.2f} {choice.config} "
                      f"(calibrated in {time.perf_counter() - t0:.1f}s)", flush=True)
    finally:
        backend = m.backend_name
        tl.free_model(m)
        if tmp is not None:
            tmp.cleanup()
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "backend": backend,
                                               "model": args.preset or Path(path).name,
                                               "new_tokens": args.new_tokens, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
