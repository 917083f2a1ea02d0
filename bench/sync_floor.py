"""What a dependent phase boundary costs on the GPU: a kernel boundary in a captured graph against a
grid-wide barrier inside one persistent kernel.

A decode step is a chain of ~54 dependent kernels, most of them a few microseconds long. This probe
measures the floor of such a chain with the work taken out: PHASES phases, each a grid of BLOCKS
blocks of 256 threads in which every thread reads one value written by another block in the
previous phase and writes one value (so phase p + 1 really depends on phase p), run

* as PHASES kernel launches captured in one CUDA graph (what the backend does now), and
* as one kernel of PHASES phases separated by a grid barrier (a per-phase arrival counter: each
  block's thread 0 fences, adds 1, and spins until all blocks arrived; the grids are 1, 2 and 4
  blocks of 256 threads per SM, which are co-resident on any sm_70+ GPU),

each replayed REPEATS times inside one graph launch and timed with CUDA events. Prints a table of
microseconds per phase and writes JSON with `--json`.

    python bench/sync_floor.py --phases 50 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def build(nt: int):
    from numba import cuda, int32

    @cuda.jit
    def phase(buf, p, nblocks):
        # thread i of block b reads what block (b + 1) % nblocks wrote in the previous phase
        b = cuda.blockIdx.x
        i = cuda.threadIdx.x
        src = ((b + 1) % nblocks) * nt + i
        dst = b * nt + i
        prev = (p & 1) * nblocks * nt
        nxt = ((p + 1) & 1) * nblocks * nt
        buf[nxt + dst] = buf[prev + src] + 1.0

    @cuda.jit
    def persistent(buf, bar, phases, nblocks):
        b = cuda.blockIdx.x
        i = cuda.threadIdx.x
        src = ((b + 1) % nblocks) * nt + i
        dst = b * nt + i
        for p in range(phases):
            prev = (p & 1) * nblocks * nt
            nxt = ((p + 1) & 1) * nblocks * nt
            buf[nxt + dst] = buf[prev + src] + 1.0
            if p + 1 < phases:
                # grid barrier p: every block's writes are visible before any block reads them
                cuda.threadfence()
                cuda.syncthreads()
                if i == 0:
                    cuda.atomic.add(bar, p, int32(1))
                    while cuda.atomic.add(bar, p, int32(0)) < nblocks:
                        pass
                cuda.syncthreads()
                cuda.threadfence()

    @cuda.jit
    def zero(bar):
        j = cuda.grid(1)
        if j < bar.shape[0]:
            bar[j] = 0

    return phase, persistent, zero


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phases", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=20, help="chains per graph launch")
    ap.add_argument("--trials", type=int, default=5, help="graph launches timed (best taken)")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    for name in ("phases", "repeats", "trials"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}={getattr(args, name)} must be at least 1")

    from numba import cuda

    if not cuda.is_available():
        print("error: sync_floor needs a CUDA GPU", file=sys.stderr)
        return 2
    from tinyloop.cuda.graphs import Graph
    from tinyloop.cuda.kernels._common import cdiv

    nt = 256
    phase, persistent, zero = build(nt)
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    stream = cuda.stream()
    rows = []

    def timed(fn):
        fn()                              # compile and load before capture
        stream.synchronize()
        g = Graph(stream, lambda: [fn() for _ in range(args.repeats)])
        best = float("inf")
        for _ in range(args.trials):
            a, b = cuda.event(), cuda.event()
            a.record(stream)
            g.launch()
            b.record(stream)
            b.synchronize()
            best = min(best, cuda.event_elapsed_time(a, b) * 1e3)
        return best / (args.repeats * args.phases), g.nodes

    for per_sm in (1, 2, 4):
        nb = sms * per_sm
        buf = cuda.to_device(np.zeros(2 * nb * nt, np.float32), stream=stream)
        bar = cuda.to_device(np.zeros(args.phases, np.int32), stream=stream)

        def chain():
            for p in range(args.phases):
                phase[nb, nt, stream](buf, p, nb)

        def fused():
            zero[cdiv(args.phases, 128), 128, stream](bar)
            persistent[nb, nt, stream](buf, bar, args.phases, nb)

        us_k, nodes_k = timed(chain)
        us_b, nodes_b = timed(fused)
        rows.append({"blocks": nb, "blocks_per_sm": per_sm, "kernel_boundary_us": us_k,
                     "grid_barrier_us": us_b, "graph_nodes_chain": nodes_k,
                     "graph_nodes_persistent": nodes_b})

    dev = cuda.get_current_device().name
    dev = dev.decode() if isinstance(dev, bytes) else dev
    print(f"\n{dev}: {args.phases} dependent phases of 256-thread blocks, "
          f"{args.repeats} chains per graph launch, best of {args.trials}")
    print(f"{'blocks':>8}{'per SM':>8}{'kernel boundary us':>20}{'grid barrier us':>18}")
    for r in rows:
        print(f"{r['blocks']:>8}{r['blocks_per_sm']:>8}{r['kernel_boundary_us']:>20.2f}"
              f"{r['grid_barrier_us']:>18.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": dev, "phases": args.phases, "repeats": args.repeats,
                       "rows": rows, "date": time.strftime("%Y-%m-%d")}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
