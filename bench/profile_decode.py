"""Per-kernel GPU time of one decoded token (CUPTI through torch.profiler).

Synthesizes a preset (default `360m`), runs a prompt through the CUDA backend, then records the
device kernels of `--tokens` graph-replayed decode steps with `torch.profiler` (CUPTI sees the
kernels of numba's graphs too) and prints, per kernel, the device microseconds per token and the
launches per token, plus the wall time per token of the same steps. Writes JSON with `--json`.
With `--by-block`, also each block's kernels (pre blocks, every loop iteration, post blocks) in
launch order, averaged over the steps: a loop iteration whose weights come from L2 against the
first one of the token, which follows the head and the pre blocks through L2.

    python bench/profile_decode.py --loops 8 [--by-block] --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

import numpy as np


def short_name(name: str) -> str:
    """`module.function` from a numba kernel symbol (`_ZN8tinyloop4cuda7kernels6matmul10_make_fast
    12_3clocals_3e6kernelB2v8...` -> `matmul._make_fast.kernel`); other names unchanged."""
    if not name.startswith("_ZN"):
        return name
    i, words = 3, []
    while i < len(name) and name[i].isdigit():
        j = i
        while name[j].isdigit():
            j += 1
        n = int(name[i:j])
        words.append(name[j:j + n])
        i = j + n
    words = [w for w in words if w not in ("tinyloop", "cuda", "kernels", "_3clocals_3e")]
    return ".".join(words) or name


def block_labels(cfg, loops: int) -> list:
    """Names of the blocks a token runs through, in order: pre0.., loop<iteration>.<layer>, post0.."""
    return ([f"pre{i}" for i in range(cfg.n_pre)]
            + [f"loop{it}.{j}" for it in range(loops) for j in range(cfg.n_loop)]
            + [f"post{i}" for i in range(cfg.n_post)])


def split_blocks(names, n_blocks: int):
    """(lead, kb): a decode step's kernel names (launch order) are `lead` kernels (embedding), then
    n_blocks blocks of kb kernels with the same names in every block, then the rest (final norm,
    head, argmax, position), the repetition going no further on either side. None when no such
    split exists."""
    S = len(names)
    for lead in range(0, 4):
        if n_blocks < 1 or S - lead < n_blocks:
            break
        for kb in range((S - lead) // n_blocks, 0, -1):
            first = names[lead:lead + kb]
            end = lead + n_blocks * kb
            # the repetition must not continue on either side (else the blocks are misaligned or
            # there are more than n_blocks of them)
            if (all(names[lead + b * kb:lead + (b + 1) * kb] == first for b in range(1, n_blocks))
                    and (lead == 0 or names[lead - 1] != names[lead - 1 + kb])
                    and (end >= S or names[end] != names[end - kb])):
                return lead, kb
    return None


def per_block(steps, labels):
    """Mean device time (us) per block and per kernel slot of a block, over decode steps.

    `steps`: one list per decoded token of (kernel name, us) in launch order, all of one shape.
    Returns {"lead": .., "kb": .., "blocks": [{"block": label, "us": total, "kernels_us": [...]}]}
    or None when the steps do not split into len(labels) equal blocks."""
    if not steps or any(len(s) != len(steps[0]) for s in steps):
        return None
    split = split_blocks([n for n, _ in steps[0]], len(labels))
    if split is None:
        return None
    lead, kb = split
    mean = np.mean(np.array([[us for _, us in s] for s in steps], np.float64), axis=0)
    blocks = []
    for b, label in enumerate(labels):
        ks = mean[lead + b * kb:lead + (b + 1) * kb]
        blocks.append({"block": label, "us": float(ks.sum()), "kernels_us": [float(v) for v in ks]})
    names = [short_name(n) for n, _ in steps[0][lead:lead + kb]]
    return {"lead": lead, "kb": kb, "kernels": names, "blocks": blocks}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="360m")
    ap.add_argument("--layout", default="",
                    help="profile a looped layout of bench/looped_layouts_bench.py (huginn-0125, ouro-1.4b) "
                         "at its real widths instead of --preset")
    ap.add_argument("--layers", default="",
                    help="with --layout: n_pre,n_loop,n_post replacing the layout's own (fewer layers: a "
                         "smaller file to write; the per-layer kernels are the same)")
    ap.add_argument("--model-file", default="",
                    help="with --layout: write the synthesized file here, or reuse it when it exists (a "
                         "second profile of the same model, e.g. with TINYLOOP_CUDA_EXACT=1)")
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", default="")
    ap.add_argument("--by-block", action="store_true",
                    help="also the device time of every block of the step (pre, each loop iteration, "
                         "post), kernel by kernel: whether the loop block's weights stay in L2 shows "
                         "as iteration 0 against iterations 1..L-1")
    args = ap.parse_args(argv)
    for name in ("loops", "prompt_len", "tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")

    import torch
    from torch.profiler import ProfilerActivity, profile

    import tinyloop as tl
    from tinyloop.cli.synth import synth_model
    from tinyloop.model.format import read_header

    tmp = tempfile.TemporaryDirectory()
    path = args.model_file or os.path.join(tmp.name, f"{args.layout or args.preset}.tinyloop")
    if args.layout and args.model_file and os.path.exists(path):
        print(f"reusing {path}", flush=True)
    elif args.layout:
        from bench.looped_layouts_bench import LAYOUTS
        if args.layout not in LAYOUTS:
            ap.error(f"--layout {args.layout!r}: choose from {list(LAYOUTS)}")
        over, group, _ = LAYOUTS[args.layout]
        over = dict(over)
        if args.layers:
            try:
                n_pre, n_loop, n_post = (int(v) for v in args.layers.split(","))
            except ValueError:
                ap.error(f"--layers {args.layers!r}: expected three integers n_pre,n_loop,n_post")
            over.update(n_pre=n_pre, n_loop=n_loop, n_post=n_post)
        t0 = time.perf_counter()
        synth_model("360m", path, seed=0, quant="q4", group_size=group, **over)
        print(f"wrote {args.layout} ({os.path.getsize(path) / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f} s",
              flush=True)
    else:
        synth_model(args.preset, path, seed=0)
    cfg = read_header(path).config
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, cfg.vocab_size, args.prompt_len)]
    m = tl.load_model(path, max_seq_len=args.prompt_len + 2 * args.tokens + 16, backend="cuda")
    gc = tl.GenerateConfig(max_tokens=args.tokens, loops=args.loops)
    tl.generate(m, prompt, tl.GenerateConfig(max_tokens=8, loops=args.loops))     # compile + capture
    st = tl.GenerateStats()
    tl.generate_stream(m, prompt, gc, stats=st)
    wall = st.decode_ms / max(1, st.tokens_emitted - 1)

    def kernels(n_new):
        """Device time (us) and launches per kernel name of one generate_stream call, and the
        kernels (not copies) in launch order as (name, us)."""
        per = defaultdict(lambda: [0.0, 0])
        order = []
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            tl.generate_stream(m, prompt, tl.GenerateConfig(max_tokens=n_new, loops=args.loops))
            torch.cuda.synchronize()
        for ev in prof.events():
            if ev.device_type.name != "CUDA":
                continue
            rec = per[short_name(ev.name)]
            rec[0] += ev.device_time_total
            rec[1] += 1
            if args.by_block and not ev.name.startswith(("Memcpy", "Memset")):
                order.append((ev.time_range.start, ev.name, ev.device_time_total))
        order.sort(key=lambda e: e[0])
        return per, [(n, us) for _, n, us in order]

    # The decode part is the difference between a run of 1 + n tokens and a run of 1 token (the
    # prefill and the first token are in both).
    base, _ = kernels(1)
    full, ordered = kernels(1 + args.tokens)
    n_tok = args.tokens
    per = {k: [v[0] - base.get(k, [0.0, 0])[0], v[1] - base.get(k, [0.0, 0])[1]] for k, v in full.items()}
    per = {k: v for k, v in per.items() if v[1] > 0}
    rows = sorted(per.items(), key=lambda kv: -kv[1][0])
    total = sum(v[0] for v in per.values())
    print(f"\n{args.layout or args.preset} L={args.loops} prompt {args.prompt_len}: {n_tok} decoded tokens, "
          f"wall {wall:.3f} ms/token (unprofiled run)")
    print(f"{'kernel':<52}{'us/token':>10}{'launches/token':>16}{'share':>8}")
    out_rows = []
    for k, (us, cnt) in rows:
        print(f"{k[:52]:<52}{us / n_tok:>10.2f}{cnt / n_tok:>16.2f}{100 * us / total:>7.1f}%")
        out_rows.append({"kernel": k, "us_per_token": us / n_tok, "launches_per_token": cnt / n_tok})
    print(f"{'total device time':<52}{total / n_tok:>10.2f}")
    blocks = None
    if args.by_block:
        S = sum(v[1] for k, v in per.items() if not k.startswith(("Memcpy", "Memset"))) // n_tok
        tail = ordered[len(ordered) - n_tok * S:] if S > 0 else []
        steps = [tail[i * S:(i + 1) * S] for i in range(n_tok)] if S > 0 else []
        blocks = per_block(steps, block_labels(cfg, args.loops))
        if blocks is None:
            print("\nper block: the decode steps do not split into equal blocks")
        else:
            print(f"\nper block (mean over {n_tok} steps; {blocks['lead']} kernel(s) before the "
                  f"blocks, {blocks['kb']} per block), us:")
            print("kernels of a block: " + ", ".join(f"{i}: {n}" for i, n in enumerate(blocks["kernels"])))
            for b in blocks["blocks"]:
                print(f"{b['block']:<12}{b['us']:>9.2f}   " + " ".join(f"{v:7.2f}" for v in b["kernels_us"]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"preset": args.layout or args.preset, "layers": args.layers, "loops": args.loops,
                       "prompt_len": args.prompt_len, "tokens": n_tok, "wall_ms_per_token": wall,
                       "device_us_per_token": total / n_tok, "kernels": out_rows, "blocks": blocks,
                       "date": time.strftime("%Y-%m-%d")}, fh, indent=2)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
