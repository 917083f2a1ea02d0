"""Grammar-constrained decoding: what a JSON-schema grammar costs per token.

On one model and backend (default: the demo model; --backend cuda or cpu), greedy decoding of the
same prompts four ways, in one process: plain (the argmax stays on the device); plain with the
logits read to the host every token (a no-op processor that is not argmax-invariant); under a
JSON-schema grammar with the mask applied on the host (the backend's token_masks capability
switched off: the logits row comes to the host every token); and under the same grammar with the
mask applied where the logits live (token_masks: the mask goes up, the masked argmax id comes back,
the next step is queued before it does). Reports decode ms/token (median over prompts and
repeats), the device-mask grammar's overhead against plain, and the mask computation alone (ms per
token, llguidance on the generated tokens, off the decode loop) to say where the remaining cost
goes. Prints a table, writes JSON.

    python bench/grammar_bench.py --backend cuda --json grammar.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.decode_bench import _commit, _median, bench_model, gpu_name, log  # noqa: E402
from tinyloop.progress import bar  # noqa: E402
from tinyloop.runtime.grammar import ll_vocab  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 6},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "active"],
    "additionalProperties": False,
}
PROMPTS = ["person = ", "user = ", "record = ", "profile = "]


def host_logits_processor():
    """A processor that changes nothing but is not argmax-invariant: the logits come to the host
    every token, as under a grammar."""
    from tinyloop import LogitProcessor, Stage, hookimpl

    class HostLogits(LogitProcessor):
        name = "bench_host_logits"
        stage = Stage.MASK
        argmax_invariant = False
        active = False

        @classmethod
        def from_config(cls, config):
            return cls() if cls.active else None

        def clone(self):
            return HostLogits()

    class Plugin:
        @hookimpl
        def tinyloop_processors(self):
            return [HostLogits]
    return HostLogits, Plugin()


def decode_ms(model, prompts, cfg, repeats, what) -> tuple:
    import tinyloop as tl
    per, toks = [], 0
    for _ in bar(range(repeats), what, unit="run"):
        for p in prompts:
            st = tl.GenerateStats()
            tl.generate(model, p, cfg, stats=st)
            if st.tokens_emitted > 1:
                per.append(st.decode_ms / (st.tokens_emitted - 1))
                toks += st.tokens_emitted
    return _median(per), toks


def mask_ms(model, grammar, outputs) -> float:
    """llguidance alone: compute the mask and consume the token, per generated token."""
    total, n = 0.0, 0
    for out in outputs:
        m = grammar.matcher(model.tokenizer, model.cfg.vocab_size, model.cfg.eos_id)
        n_ids, _ = ll_vocab(model.cfg.vocab_size, model.cfg.eos_id)
        words = np.zeros(((n_ids + 31) // 32,), np.int32)
        for t in out:
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
            total += time.perf_counter() - t0
            n += 1
            if not m.consume_token(int(t)):
                break
    return 1e3 * total / max(1, n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu", choices=("cpu", "cuda"), help="backend to run on")
    ap.add_argument("--model", help=".tinyloop file (default: the demo model)")
    ap.add_argument("--loops", type=int, default=4, help="loop depth")
    ap.add_argument("--max-tokens", type=int, default=96, help="tokens per request")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs over the prompts (median)")
    ap.add_argument("--json", help="write the results to this JSON file")
    args = ap.parse_args(argv)

    import tinyloop as tl
    from tinyloop.models import demo_model_path
    from tinyloop.runtime.plugins import get_plugin_manager
    picked = bench_model(args.backend, args.model or demo_model_path(), "")
    if picked is None:
        print("error: --backend cuda needs a CUDA GPU", file=sys.stderr)
        return 2
    path, _ = picked
    model = tl.load_model(path, max_seq_len=512, backend=args.backend)
    grammar = tl.Grammar.json_schema(SCHEMA)
    prompts = [model.tokenizer.encode(p) for p in PROMPTS]
    base = tl.GenerateConfig(max_tokens=args.max_tokens, loops=args.loops)
    gcfg = base.replace(grammar=grammar)
    HostLogits, plugin = host_logits_processor()
    try:
        for c in (base, gcfg):
            tl.generate(model, prompts[0], c)                    # compile, warm, capture
        plain, _ = decode_ms(model, prompts, base, args.repeats, "plain")
        with get_plugin_manager().registered(plugin, name="bench-host-logits"):
            HostLogits.active = True
            host, _ = decode_ms(model, prompts, base, args.repeats, "host logits")
            HostLogits.active = False
        constrained, _ = decode_ms(model, prompts, gcfg, args.repeats, "json schema")
        supports = model.backend.supports
        model.backend.supports = lambda c: c != "token_masks" and supports(c)
        try:
            tl.generate(model, prompts[0], gcfg)
            host_mask, _ = decode_ms(model, prompts, gcfg, args.repeats, "json schema, host mask")
        finally:
            del model.backend.supports
        outputs = [tl.generate(model, p, gcfg)[len(p):] for p in prompts]
        valid = 0
        for out in outputs:
            text = model.tokenizer.decode([t for t in out if t != model.cfg.eos_id])
            try:
                json.loads(text)
                valid += 1
            except ValueError:
                pass
        mask = mask_ms(model, grammar, outputs)
    finally:
        tl.free_model(model)
    res = {"date": time.strftime("%Y-%m-%d"), "commit": _commit(), "backend": args.backend,
           "gpu": gpu_name() if args.backend == "cuda" else None, "host": platform.node(),
           "model": os.path.basename(path), "loops": args.loops, "max_tokens": args.max_tokens,
           "plain_ms": plain, "host_logits_ms": host, "grammar_host_mask_ms": host_mask,
           "grammar_ms": constrained, "mask_ms": mask,
           "overhead_vs_plain": constrained / plain - 1, "host_mask_overhead_vs_plain": host_mask / plain - 1,
           "valid_json": f"{valid}/{len(outputs)}"}
    log(f"grammar {constrained:.3f} ms/token vs plain {plain:.3f}")
    print(f"\nTinyLoop grammar decoding  {res['date']}  {res['gpu'] or 'cpu'}  commit {res['commit']}  "
          f"model {res['model']}  L={args.loops}")
    print(f"{'plain':>10}{'host logits':>13}{'schema, host mask':>19}{'vs plain':>10}{'schema, device mask':>21}"
          f"{'vs plain':>10}{'mask alone':>12}{'valid JSON':>12}")
    print(f"{plain:>10.3f}{host:>13.3f}{host_mask:>19.3f}{res['host_mask_overhead_vs_plain']:>+10.1%}"
          f"{constrained:>21.3f}{res['overhead_vs_plain']:>+10.1%}{mask:>12.3f}{res['valid_json']:>12}"
          f"   (ms/token)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
