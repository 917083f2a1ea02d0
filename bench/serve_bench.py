"""The HTTP server under load: throughput and time to first token at several client counts, and the
overhead of the HTTP path against calling generate_stream in-process.

A live uvicorn server (tinyloop.serve) on 127.0.0.1 over the model (default: the demo model;
--preset 360m for the synth preset on the GPU) in this process; the HTTP clients run in separate
processes (--same-process: threads of this one, which then share the GIL with the server), then
* in-process: generate_stream over the same prompts, greedy, ms/token after the first token;
* HTTP, one client: the same requests streamed over SSE, ms/token from the first chunk to the
  last as the client sees them (tokens counted from the final chunk's stats), and the overhead
  against in-process;
* HTTP, C concurrent clients (C in --clients): aggregate tokens/s, p50 / p99 time to first token
  (queueing included: one worker serves one request at a time).
Prints a table, writes JSON.

    python bench/serve_bench.py --backend cpu --json serve.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing
import os
import platform
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.decode_bench import _commit, bench_model, gpu_name, log  # noqa: E402

PROMPTS = ["The loop", "def ", "value = ", "Once upon a time"]


def start_server(cfg):
    import uvicorn
    from tinyloop.serve import create_app
    app = create_app(cfg)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return app, server, thread, f"http://127.0.0.1:{port}"


_LOCAL = threading.local()


def _client():
    """One keep-alive httpx client per client thread, as a real client holds (a fresh client per
    request costs ~25 ms of TLS-context setup on the client side alone)."""
    import httpx
    if getattr(_LOCAL, "client", None) is None:
        _LOCAL.client = httpx.Client(timeout=600)
    return _LOCAL.client


def stream_once(url, name, prompt, max_tokens, loops):
    """(time to first chunk s, chunk arrival times, tokens generated) of one streamed request."""
    body = {"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "loops": loops}
    t0 = time.perf_counter()
    arrivals, n = [], 0
    with _client().stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                msg = json.loads(line[6:])
                c = msg["choices"][0] if msg.get("choices") else {}
                if c and not c.get("tinyloop"):          # one chunk per token
                    arrivals.append(time.perf_counter())
                if c.get("tinyloop"):
                    n = c["tinyloop"]["completion_tokens"]
    return (arrivals[0] - t0 if arrivals else float("nan")), arrivals, n


def clients(n: int, same_process: bool):
    """An executor of n HTTP clients: processes (spawned; each with its own keep-alive client) or
    threads of this process."""
    if same_process:
        return cf.ThreadPoolExecutor(n)
    return cf.ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"))


def _warm(url) -> int:
    return _client().get(url + "/health").status_code


def in_process_ms(model, prompts, max_tokens, loops, repeats):
    import tinyloop as tl
    per = []
    for _ in range(repeats):
        for p in prompts:
            st = tl.GenerateStats()
            tl.generate_stream(model, p, tl.GenerateConfig(max_tokens=max_tokens, loops=loops),
                               on_token=lambda t, pos: True, stats=st)
            if st.tokens_emitted > 1:
                per.append(st.decode_ms / (st.tokens_emitted - 1))
    return float(np.median(per))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--model", help=".tinyloop file (default: the demo model)")
    ap.add_argument("--preset", default="", help="a synth preset instead of --model (e.g. 360m)")
    ap.add_argument("--loops", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--clients", default="1,4,16", help="comma-separated concurrent client counts")
    ap.add_argument("--requests", type=int, default=16, help="requests per client count")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--same-process", action="store_true",
                    help="run the clients as threads of the server's process (default: separate processes)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)

    from tinyloop.models import demo_model_path
    from tinyloop.serve import ServeConfig
    picked = bench_model(args.backend, args.model or ("" if args.preset else demo_model_path()), args.preset)
    if picked is None:
        print("error: --backend cuda needs a CUDA GPU", file=sys.stderr)
        return 2
    path, _ = picked
    cfg = ServeConfig(model=path, backend=args.backend, max_seq_len=512, queue_size=max(64, args.requests))
    app, server, thread, url = start_server(cfg)
    served = app.state.served
    model, name = served.model, served.name
    try:
        for p in PROMPTS:                                     # compile, capture, warm
            stream_once(url, name, p, 8, args.loops)
        inproc = in_process_ms(model, PROMPTS, args.max_tokens, args.loops, args.repeats)
        gaps = []
        with clients(1, args.same_process) as ex:
            for _ in range(args.repeats):
                for p in PROMPTS:
                    # the first chunk carries the first token; the final stats chunk the count
                    _, arr, n = ex.submit(stream_once, url, name, p, args.max_tokens, args.loops).result()
                    if len(arr) > 2 and n > 1:
                        gaps.append(1e3 * (arr[-1] - arr[0]) / (n - 1))
        http_ms = float(np.median(gaps))
        rows = []
        for c in [int(x) for x in args.clients.split(",")]:
            with clients(c, args.same_process) as ex:
                list(ex.map(_warm, [url] * c))                  # the client processes are up
                t0 = time.perf_counter()
                futs = [ex.submit(stream_once, url, name, PROMPTS[i % len(PROMPTS)], args.max_tokens, args.loops)
                        for i in range(args.requests)]
                res = [f.result() for f in futs]
                wall = time.perf_counter() - t0
            ttft = np.array([r[0] for r in res]) * 1e3
            toks = sum(r[2] for r in res)
            rows.append({"clients": c, "requests": args.requests, "tokens_per_s": toks / wall,
                         "ttft_p50_ms": float(np.percentile(ttft, 50)), "ttft_p99_ms": float(np.percentile(ttft, 99))})
            log(f"{c} clients: {toks / wall:.0f} tokens/s")
    finally:
        server.should_exit = True
        thread.join(30)
        served.close()
    res = {"date": time.strftime("%Y-%m-%d"), "commit": _commit(), "backend": args.backend,
           "gpu": gpu_name() if args.backend == "cuda" else None, "host": platform.node(),
           "model": os.path.basename(path), "loops": args.loops, "max_tokens": args.max_tokens,
           "in_process_ms_per_token": inproc, "http_ms_per_token": http_ms,
           "http_overhead": http_ms / inproc - 1, "clients_in": "threads" if args.same_process else "processes",
           "load": rows}
    print(f"\nTinyLoop HTTP server  {res['date']}  {res['gpu'] or 'cpu'}  commit {res['commit']}  "
          f"model {res['model']}  L={args.loops}  {args.max_tokens} tokens")
    print(f"in-process {inproc:.3f} ms/token   HTTP stream {http_ms:.3f} ms/token   overhead "
          f"{res['http_overhead']:+.1%}")
    print(f"{'clients':>8}{'tokens/s':>10}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}")
    for r in rows:
        print(f"{r['clients']:>8}{r['tokens_per_s']:>10.0f}{r['ttft_p50_ms']:>13.1f}{r['ttft_p99_ms']:>13.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
