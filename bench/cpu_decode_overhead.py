"""CPU decode step time and what is spent outside the numeric kernels (the demo model by default).

    python -m bench.cpu_decode_overhead [--loops 1,4] [--repeats 5] [--new-tokens 64] [--split]
                                        [--ab PAIRS] [--python-only]

Per loop count: ms per decoded token (greedy, a 12-token prompt, `--new-tokens` tokens, numba
kernels warm; the first token, from prefill, excluded) for `--repeats` requests in one process,
median and min, of wall time and of the thread's CPU time (which leaves out the time other
processes held the core). With --split, one more request runs with every numba kernel of tinyloop.cpu.ops
wrapped in a timer: the kernels' own time per token (numba dispatch included) and the rest, the
Python work around them (the wrapper's own cost is measured and taken off).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tinyloop as tl  # noqa: E402

KERNELS = ("matmul", "matmul_rowwise", "rmsnorm", "norm_add", "embed", "swiglu", "add", "rope", "argmax",
           "attention_fp32", "attention_fp16", "attention_int8", "attention_int4")


def per_token(m, prompt, cfg) -> tuple:
    """(wall ms, CPU ms of this thread) per decoded token, the first token (prefill) excluded. The
    CPU time leaves out the time other processes held the core: on a shared machine it moves less."""
    n, t0, c0 = 0, 0.0, 0.0
    for n, _ in enumerate(tl.generate_iter(m, prompt, cfg)):
        if n == 0:
            t0, c0 = time.perf_counter(), time.thread_time()
    return (time.perf_counter() - t0) * 1e3 / n, (time.thread_time() - c0) * 1e3 / n


def split(m, prompt, cfg) -> tuple:
    """(kernel ms per token, calls per token, wrapper ms per token) of one decode, timed inside."""
    from tinyloop.cpu import kv_codecs, ops
    from tinyloop.runtime import engine
    acc = [0.0, 0, False]
    clock = time.perf_counter

    def wrap(fn):
        def timed(*a):
            if not acc[2]:
                return fn(*a)
            t = clock()
            r = fn(*a)
            acc[0] += clock() - t
            acc[1] += 1
            return r
        return timed

    saved_ops = {n: getattr(ops, n) for n in KERNELS if hasattr(ops, n)}
    saved_codecs = {c: c.__dict__["attention"] for c in vars(kv_codecs).values()
                    if isinstance(c, type) and "attention" in c.__dict__ and c.__dict__["attention"] is not None}
    start = engine.Session.start

    def started(self):
        start(self)
        acc[2] = True

    try:
        for n, fn in saved_ops.items():
            setattr(ops, n, wrap(fn))
        for c, sm in saved_codecs.items():
            c.attention = staticmethod(wrap(sm.__func__))
        engine.Session.start = started
        st = tl.GenerateStats()
        tl.generate(m, prompt, cfg, stats=st)
        acc[2] = False
    finally:
        for n, fn in saved_ops.items():
            setattr(ops, n, fn)
        for c, sm in saved_codecs.items():
            c.attention = sm
        engine.Session.start = start
    n = st.tokens_emitted - 1
    # the wrapper's own cost per call: two clock reads and the extra Python frame
    noop = wrap(lambda *a: None)
    acc_calls, acc_t = acc[1], acc[0]
    acc[2] = True
    t = clock()
    for _ in range(20000):
        noop(1, 2, 3, 4, 5, 6)
    per_call = (clock() - t) / 20000
    acc[2] = False
    return acc_t * 1e3 / n, acc_calls / n, per_call * acc_calls * 1e3 / n, st.decode_ms / n


def ab(m, prompt, cfg, pairs: int) -> str:
    be = m.backend
    if not hasattr(be, "_direct"):
        return "      ab: this CPU backend has no direct composites"
    direct, gen, saved = [], [], []
    try:
        for _ in range(pairs):
            be._direct = False
            gen.append(per_token(m, prompt, cfg)[0])
            be._direct = True
            direct.append(per_token(m, prompt, cfg)[0])
            saved.append(gen[-1] - direct[-1])
    finally:
        be._direct = True
    g, d, s = statistics.median(gen), statistics.median(direct), statistics.median(saved)
    return (f"      ab: generic {g:.3f} direct {d:.3f} ms/token (medians of {pairs}); paired saving "
            f"{s * 1e3:.0f} us ({s / g * 100:.1f} %), faster in {sum(x > 0 for x in saved)}/{pairs} pairs")


def stub_kernels() -> None:
    """Every kernel of tinyloop.cpu.ops (and the built-in codecs' attention) a Python no-op."""
    from tinyloop.cpu import kv_codecs, ops

    def nop(*a):
        return None
    for n in KERNELS:
        if hasattr(ops, n):
            setattr(ops, n, nop)
    ops.argmax = lambda row: 5
    for c in vars(kv_codecs).values():
        if isinstance(c, type) and c.__dict__.get("attention") is not None:
            c.attention = staticmethod(nop)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="demo")
    ap.add_argument("--loops", default="1,4")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=12)
    ap.add_argument("--split", action="store_true")
    ap.add_argument("--ab", type=int, default=0, metavar="PAIRS")
    ap.add_argument("--python-only", action="store_true")
    args = ap.parse_args()
    m = tl.load_model(args.model, backend="cpu", max_seq_len=args.prompt_len + args.new_tokens + 8)
    prompt = [(7 * i + 3) % m.vocab_size for i in range(args.prompt_len)]
    try:
        for L in (int(x) for x in args.loops.split(",")):
            cfg = tl.GenerateConfig(max_tokens=args.new_tokens, loops=L)
            tl.generate(m, prompt, cfg)                       # compile / warm
            if args.python_only:
                stub_kernels()
            wall, cpu = zip(*(per_token(m, prompt, cfg) for _ in range(args.repeats)))
            k, unit = (1e3, "us") if args.python_only else (1.0, "ms")
            wall, cpu = [w * k for w in wall], [c * k for c in cpu]
            line = (f"L={L:<3} decode {unit}/token{' (Python only)' if args.python_only else ''}: wall median "
                    f"{statistics.median(wall):.3f} min {min(wall):.3f}, CPU median {statistics.median(cpu):.3f} "
                    f"min {min(cpu):.3f}  (wall {' '.join(f'{r:.3f}' for r in wall)})")
            if args.split:
                k, calls, wrapper, whole = split(m, prompt, cfg)
                rest = whole - wrapper - k
                line += (f"\n      split: kernels {k:.3f} ms/token ({calls:.0f} calls), outside the kernels "
                         f"{rest:.3f} ms ({rest / (rest + k) * 100:.1f} %; wrapper {wrapper:.3f} ms taken off)")
            if args.ab:
                line += "\n" + ab(m, prompt, cfg, args.ab)
            print(line, flush=True)
    finally:
        tl.free_model(m)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
