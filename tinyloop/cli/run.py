"""``tinyloop run CFG.yaml``: load a model, tokenize prompts, decode, stream to the terminal.

The YAML maps onto tinyloop.runtime.config.RunConfig (unknown keys are errors naming the key); its
``generate`` section onto GenerateConfig (a decoder's own settings under ``options``). Relative
paths are relative to the YAML file. Every mode streams through generate_iter (a ``speculative:``
section becomes the request of the speculative decoder plugin, as tl.generate_speculative does).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from ..runtime.config import GenerateStats, RunConfig, load_run_config, read_text
from ..runtime.engine import (Plan, encode_text, free_model, generate_batch, generate_iter, load_model,
                              resolve_loops)
from ..runtime import reuse
from ..errors import ConfigError
from ..runtime.plugins import get_plugin_manager
from ..models import SHIPPED, demo_model_path
from ..models import model_path as shipped_model_path
from ..plugins.decoders.spec_session import speculative_request


def _resolve(base: Path, p: Optional[str]) -> Optional[str]:
    if not p:
        return p
    q = Path(os.path.expanduser(p))
    return str(q if q.is_absolute() else base / q)


def read_prompts(cfg: RunConfig, base: Path) -> List[str]:
    """Inline prompts followed by those of prompts_file (one per line, or JSONL {"prompt": ...})."""
    prompts = list(cfg.prompts)
    if cfg.prompts_file:
        path = _resolve(base, cfg.prompts_file)
        text = read_text(path, "prompts_file")
        if text.startswith("\ufeff"):       # a UTF-8 byte order mark (Windows editors) is not prompt text
            text = text[1:]
        # lines end at "\n" (or "\r\n") only: str.splitlines would also split at form feeds,
        # U+2028, NEL, ..., which are characters of a prompt (and raw inside JSONL strings)
        for n, line in enumerate(text.split("\n"), 1):
            line = line[:-1] if line.endswith("\r") else line
            if not line.strip():
                continue
            if path.endswith(".jsonl"):
                try:
                    obj = json.loads(line)
                    prompt = obj["prompt"]
                except (ValueError, KeyError, TypeError, IndexError, RecursionError):
                    raise ConfigError(f"{path}:{n}: expected a JSON object with a \"prompt\" string") from None
                if not isinstance(prompt, str):
                    raise ConfigError(f"{path}:{n}: \"prompt\" must be a string, got "
                                      f"{json.dumps(prompt)[:60]}")
                prompts.append(prompt)
            else:
                prompts.append(line.replace("\\n", "\n"))
    if not prompts:
        raise ConfigError("the run config gives no prompts (set prompts or prompts_file)")
    return prompts


def _check_writable(path: str, what: str, inputs: Sequence[Optional[str]] = ()) -> None:
    """ConfigError, before any work, unless `path` can be written as a file that is none of the
    command's `inputs` (writing it would destroy the input)."""
    if not path:
        raise ConfigError(f"{what} '' is empty: give a file path")
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{what} {path!r} is a directory; give a file path")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError(f"{what} {path!r}: the folder {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ConfigError(f"{what} {path!r} is not writable")
    for f in inputs:
        try:
            same = bool(f) and p.exists() and os.path.samefile(f, p)
        except (OSError, ValueError):
            same = False
        if same:
            raise ConfigError(f"{what} {path!r} is one of the command's input files ({f}): give another path")


def _check_nonempty(value: Optional[str], flag: str) -> None:
    """A flag given as '' (an unset shell variable) is refused rather than read as 'not given'."""
    if value is not None and not value:
        raise ConfigError(f"{flag} '' is empty: give a path (or leave the option out)")


def _write_output(path: str, text: str) -> None:
    """Write `text` to `path` whole or not at all: a regular (or new) file is written to a temporary
    file beside it that replaces it when complete, so a Ctrl-C or a full disk part way leaves no
    truncated output looking finished; anything else (a FIFO, /dev/stdout) is written in place."""
    if os.path.exists(path) and not os.path.isfile(path):
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
        return
    d, base = os.path.split(os.path.abspath(path))
    tmp = os.path.join(d, f".{base}.{os.getpid()}.partial")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _print_stats(st: GenerateStats, label: str = "") -> None:
    rate = (f"{(st.tokens_emitted - 1) / (st.decode_ms / 1e3):.1f} tok/s"
            if st.tokens_emitted > 1 and st.decode_ms > 0 else "n/a")
    spec = (f", accepted {st.accepted_tokens}/{st.drafted_tokens} drafts, "
            f"{st.mean_accepted_length:.2f} tokens per verify" if st.verify_forwards else "")
    kept = f", {st.reused_tokens} prompt tokens reused" if st.reused_tokens else ""
    if st.token_loops:
        kept += (f", mean depth {st.loops_used:.2f} loop iterations per token (early exit, "
                 f"{st.exit_probes} probes)")
    if st.batch_lanes:
        kept += f", decoded in a lockstep batch of {st.batch_lanes} lanes"
    if st.warm_start_iters_saved:
        kept += f", warm start spared {st.warm_start_iters_saved} row-iterations of the loop"
    print(f"[tinyloop] {label}{st.tokens_emitted} tokens, stop {st.stop_reason.value}, prefill "
          f"{st.prefill_ms:.1f} ms{kept}, decode {rate}{spec}", file=sys.stderr)


class _Server:
    """How the prompts of a run are served: ``server(ids)`` lists (label, call) pairs, each call
    ``call(stats) -> token iterator``: one plain request; one request through the run's prefix
    pool (``prefix:``); or one request per depth of ``resume:`` from a handle built once per prompt.
    Every model-dependent setting is checked when the server is made, before any decoding."""

    def __init__(self, cfg: RunConfig, model, request, prefix_ids) -> None:
        self.cfg, self.model, self.request = cfg, model, request
        self.pool = None
        self._handle = None
        if cfg.resume is not None:
            r = cfg.resume
            for d in (r.loops_used,) + r.depths:       # every depth checked before any prefill
                Plan(model, dataclasses.replace(request, loops=resolve_loops(model, d)), "single",
                     reuse="warm_start")
        if cfg.prefix is not None:
            # the request's depth as its decoder runs it (speculative: the verify depth), checked as a
            # prefix-reuse request before anything is prefilled
            depth = Plan(model, request, "single", reuse="prefix_reuse").loops
            self.pool = reuse.create_prefix_pool(1)
            reuse.register_prefix(self.pool, model, prefix_ids, loops=depth, cache_mode=request.cache_mode)
            print(f"[tinyloop] prefix of {len(prefix_ids)} tokens registered in a prefix pool", file=sys.stderr)

    def __call__(self, ids):
        cfg, model, request = self.cfg, self.model, self.request
        if cfg.resume is not None:
            self._release()
            self._handle = reuse.build_resume_handle(model, ids, cfg.resume.loops_used, request)
            h = self._handle
            return [(f"[L={d}] ", lambda st, d=d: reuse.resume_generate_iter(h, d, request, stats=st))
                    for d in cfg.resume.depths]
        if self.pool is not None:
            return [("", lambda st: reuse.generate_with_pool_iter(model, self.pool, ids, request, stats=st))]
        return [("", lambda st: generate_iter(model, ids, request, st))]

    def _release(self) -> None:
        if self._handle is not None and self._handle.alive:
            reuse.free_resume_handle(self._handle)
        self._handle = None

    def close(self) -> None:
        self._release()
        if self.pool is not None:
            reuse.free_prefix_pool(self.pool)
            self.pool = None



def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("run", help="decode the prompts of a YAML run config",
                              description="Run a YAML-configured generation job.")
    p.add_argument("config", help="run config (YAML): see configs/demo.yaml")
    p.add_argument("--backend", choices=get_plugin_manager().backend_names(), help="override the config's backend")
    p.add_argument("--no-stream", action="store_true", help="print each completion when it is done")
    p.add_argument("--output-jsonl", help="override the config's output_jsonl")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="tokenizer directory (tokenizer.json, or vocab.json + merges.txt); overrides the "
                        "config's tokenizer")
    return p


def run(args) -> int:
    cfg = load_run_config(args.config)
    over = {}
    if args.backend:
        over["backend"] = args.backend
    if args.no_stream:
        over["stream"] = False
    if args.output_jsonl is not None:
        if not args.output_jsonl:
            raise ConfigError("--output-jsonl '' is empty: give a file path (or leave the option out to use "
                              "the config's output_jsonl)")
        over["output_jsonl"] = args.output_jsonl
    cfg = dataclasses.replace(cfg, **over)
    _check_nonempty(args.tokenizer, "--tokenizer")
    base = Path(args.config).resolve().parent
    prompts = read_prompts(cfg, base)
    # a shipped model's name ("demo", "demo-exit") names it here as in load_model and inspect
    model_path = (shipped_model_path(cfg.model) if cfg.model in SHIPPED else
                  _resolve(base, cfg.model) if cfg.model else demo_model_path())
    out_path = None
    if cfg.output_jsonl:
        out_path = _resolve(base, cfg.output_jsonl) if not args.output_jsonl else args.output_jsonl
        _check_writable(out_path, "output_jsonl",
                        inputs=(args.config, _resolve(base, cfg.prompts_file), model_path))
    tokenizer_dir = args.tokenizer or _resolve(base, cfg.tokenizer)
    # (a malformed file's ModelFormatError names the file itself: tinyloop.model.format.open_model)
    model = load_model(model_path, max_seq_len=cfg.max_seq_len, backend=cfg.backend,
                       prefill_chunk=cfg.prefill_chunk, tokenizer=tokenizer_dir or None)
    try:
        tok = model.tokenizer
        head = encode_text(model, cfg.prefix or "")         # BOS, then the shared scaffold
        encoded = [head + tok.encode(p) for p in prompts]
        eos = model.cfg.eos_ids
        records = []
        out = sys.stdout
        request = (cfg.generate if cfg.speculative is None else
                   speculative_request(cfg.speculative, tree=cfg.mode == "tree_speculative"))
        if cfg.speculative is not None:
            depth = f"draft loops {cfg.speculative.draft_loops}, verify loops {cfg.speculative.verify_loops}"
        else:
            depth = f"loops={cfg.generate.loops or model.cfg.default_loops}"
            if cfg.resume is not None:      # the depths come from resume: (generate.loops is refused there)
                depth = (f"warm start from loops={cfg.resume.loops_used} to depths "
                         f"{', '.join(map(str, cfg.resume.depths))}")
            if cfg.generate.decoder:
                o = cfg.generate.options
                opts = "".join(f", {k}={v}" for k, v in (dataclasses.asdict(o) if dataclasses.is_dataclass(o)
                                                         else dict(o)).items())
                depth = (f"decoder {cfg.generate.decoder}{opts}" if opts and cfg.resume is None else
                         f"decoder {cfg.generate.decoder}{opts}, {depth}")
        print(f"[tinyloop] {Path(model_path).name} on {model.backend_name}, {depth}, tokenizer {tok.name}",
              file=sys.stderr)
        if cfg.mode == "batch":
            if cfg.stream:
                print("[tinyloop] mode batch does not stream: each completion is printed when the batch is "
                      "done (set stream: false to silence this)", file=sys.stderr)
            stats_list: List[GenerateStats] = []
            results = generate_batch(model, encoded, cfg.generate, stats=stats_list)
            for prompt, ids, res, st in zip(prompts, encoded, results, stats_list):
                gen = [t for t in res[len(ids):] if t not in eos]
                text = tok.decode(gen, continuation=True)
                out.write(prompt + text + "\n")
                out.flush()
                _print_stats(st)
                out.write("\n")
                records.append((prompt, ids, res[len(ids):], text, st))
        else:
            serve = _Server(cfg, model, request, head)
            try:
                for prompt, ids in zip(prompts, encoded):
                    for label, call in serve(ids):
                        st = GenerateStats()
                        dec = tok.stream_decoder(continuation=True)
                        gen: List[int] = []
                        tokens = call(st)               # validated here, before any echo
                        if cfg.stream:
                            out.write(label + prompt)
                            out.flush()
                        try:
                            for t in tokens:
                                gen.append(t)
                                if cfg.stream and t not in eos:
                                    out.write(dec.push(t))
                                    out.flush()
                        finally:
                            if cfg.stream:          # end the echoed line, so an error starts on its own line
                                out.write(dec.flush() + "\n")
                                out.flush()
                        text = tok.decode([t for t in gen if t not in eos], continuation=True)
                        if not cfg.stream:
                            out.write(label + prompt + text + "\n")
                            out.flush()
                        _print_stats(st, label)
                        out.write("\n")
                        records.append((prompt, ids, gen, text, st))
            finally:
                serve.close()
        if out_path:
            lines = "".join(json.dumps({"prompt": prompt, "completion": text, "prompt_ids": ids,
                                        "output_ids": gen, "stats": st.to_dict()}) + "\n"
                            for prompt, ids, gen, text, st in records)
            try:
                _write_output(out_path, lines)
            except OSError as exc:
                raise ConfigError(f"cannot write output_jsonl {out_path!r}: {exc.strerror or exc}") from None
    finally:
        free_model(model)
    return 0
