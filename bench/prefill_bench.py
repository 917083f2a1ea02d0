"""Time to first token on the CUDA backend against eager PyTorch bf16, same weights, same process.

Synthesizes a preset (default `360m`) and, for each prompt length, times tinyloop's first token
(`GenerateStats.first_token_ms`: prefill, logits, token choice) with the fast kernels and with the
exact integer kernels (TINYLOOP_CUDA_EXACT=1: tensor cores for every launch of more than one
row), and PyTorch's eager bf16 prefill of the same model (tinyloop/torch_model.py) plus its
argmax. tinyloop's first request of a length runs eagerly, the second captures the prompt's
forward pieces (binary pieces of the chunk, `CUDABackend.row_pieces`), later ones replay them:
the table gives the first run and the median of the replays.

    python -m bench.prefill_bench --prompt-lens 128,1024 --loops 8 --repeats 5 [--profile] --json out.json
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

from bench.decode_bench import _commit, _median, _timed_ms, gpu_name, log  # noqa: E402


def kernel_times(fn) -> dict:
    """Device microseconds per kernel name (CUPTI through torch.profiler, which sees numba's
    kernels and graph replays too) of one call of fn, largest first."""
    from collections import defaultdict

    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.profile_decode import short_name
    per = defaultdict(float)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            per[short_name(ev.name)] += ev.device_time_total
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def tinyloop_ttft(path: str, prompt: list, loops: int, repeats: int, exact: bool, prof: bool = False) -> dict:
    import tinyloop as tl
    old = os.environ.get("TINYLOOP_CUDA_EXACT")
    os.environ["TINYLOOP_CUDA_EXACT"] = "1" if exact else "0"
    try:
        m = tl.load_model(path, max_seq_len=len(prompt) + 16, backend="cuda", prefill_chunk=len(prompt))
    finally:
        if old is None:
            del os.environ["TINYLOOP_CUDA_EXACT"]
        else:
            os.environ["TINYLOOP_CUDA_EXACT"] = old
    try:
        runs, toks = [], []
        for _ in range(repeats + 2):
            st = tl.GenerateStats()
            toks.append(tl.generate(m, prompt, tl.GenerateConfig(max_tokens=1, loops=loops), stats=st))
            runs.append(st.first_token_ms)
        res = {"exact": bool(m.backend.exact), "first_run_ms": runs[0], "capture_run_ms": runs[1],
               "ttft_ms": _median(runs[2:]), "runs_ms": runs, "pieces": m.backend.row_pieces(len(prompt)),
               "token": toks[-1], "same_token_every_run": all(t == toks[0] for t in toks)}
        if prof:
            res["kernel_us"] = kernel_times(
                lambda: tl.generate(m, prompt, tl.GenerateConfig(max_tokens=1, loops=loops)))
        return res
    finally:
        tl.free_model(m)


def torch_ttft(path: str, prompt: list, loops: int, repeats: int) -> dict:
    import torch

    from bench.torch_int4 import load_logical
    from tinyloop.model.format import read_header
    from tinyloop.torch_model import LoopedLM
    cfg = read_header(path).config
    weights = {n: torch.from_numpy(np.ascontiguousarray(a)).to(torch.bfloat16) for n, a in load_logical(path).items()}
    model = LoopedLM.from_logical(cfg, weights).to(torch.bfloat16).cuda().eval()
    del weights
    model.allocate_cache(batch_size=1, max_seq_len=len(prompt) + 16)
    ids = torch.tensor([prompt], dtype=torch.long, device="cuda")
    tok = torch.zeros(1, dtype=torch.long, device="cuda")
    with torch.no_grad():
        runs = [_timed_ms(lambda: tok.copy_(model.prefill(ids, loops)[0, -1:].argmax(-1)))
                for _ in range(repeats + 2)]
    res = {"dtype": "bfloat16", "torch": torch.__version__, "first_run_ms": runs[0], "ttft_ms": _median(runs[2:]),
           "runs_ms": runs, "token": int(tok.item())}
    del model
    torch.cuda.empty_cache()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="360m")
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--prompt-lens", default="128,1024")
    ap.add_argument("--repeats", type=int, default=5, help="timed replays per row (median)")
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="also the device time per kernel of one replayed first token (torch.profiler)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    lens = [int(v) for v in args.prompt_lens.split(",") if v]
    if not lens or min(lens) < 1 or args.loops < 1 or args.repeats < 1:
        ap.error("--prompt-lens, --loops and --repeats must be at least 1")
    from tinyloop.cli.synth import synth_model
    from tinyloop.model.format import read_header
    tmp = tempfile.TemporaryDirectory()
    path = os.path.join(tmp.name, f"{args.preset}.tinyloop")
    synth_model(args.preset, path, seed=0)
    vocab = read_header(path).config.vocab_size
    rng = np.random.default_rng(0)
    res = {"date": time.strftime("%Y-%m-%d"), "commit": _commit(), "gpu": gpu_name(), "preset": args.preset,
           "loops": args.loops, "rows": []}
    for n in lens:
        prompt = [int(t) for t in rng.integers(0, vocab, n)]
        row = {"prompt_len": n}
        for exact in (False, True):
            r = row["exact" if exact else "fast"] = tinyloop_ttft(path, prompt, args.loops, args.repeats, exact,
                                                                  args.profile)
            log(f"prompt {n}: tinyloop {'exact' if exact else 'fast'} ttft {r['ttft_ms']:.2f} ms")
            for k, us in list(r.get("kernel_us", {}).items())[:8]:
                log(f"    {k[:60]:<60} {us / 1e3:8.3f} ms")
        if not args.skip_torch:
            row["torch_eager_bf16"] = torch_ttft(path, prompt, args.loops, args.repeats)
            log(f"prompt {n}: torch {row['torch_eager_bf16']['ttft_ms']:.2f} ms")
        res["rows"].append(row)
    print(f"\nTime to first token, {res['gpu']}, {args.preset}, L = {args.loops}, commit {res['commit']} "
          f"(ms; first run eager / median of {args.repeats} replays)")
    print(f"{'prompt':>7} {'fast first':>11} {'fast':>8} {'exact first':>12} {'exact':>8} {'torch bf16':>11}")
    for row in res["rows"]:
        f, e = row["fast"], row["exact"]
        t = row.get("torch_eager_bf16", {}).get("ttft_ms", float("nan"))
        print(f"{row['prompt_len']:>7} {f['first_run_ms']:>11.2f} {f['ttft_ms']:>8.2f} {e['first_run_ms']:>12.2f} "
              f"{e['ttft_ms']:>8.2f} {t:>11.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
