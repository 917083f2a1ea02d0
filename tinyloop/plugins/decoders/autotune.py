"""Choosing the faster decoder for a checkpoint (the spec's pattern 5: "benchmark before committing
to speculative"): time plain greedy decoding against chain and tree self-speculative decoding on a
few prompts, on this model and backend, and keep the winner.

``calibrate(model, loops)`` (``tinyloop.calibrate``) runs the benchmark and caches the result on
the model (one entry per loop depth); the ``auto`` decoder plugin (GenerateConfig(decoder="auto"),
auto.py beside this file) calls it on its first request at a depth and then hands every request to
the winner. Greedy self-speculative decoding
is exact (the same tokens as plain decoding), so the choice changes speed only — each candidate's
output is checked against plain decoding during calibration, and a candidate that differs is
discarded (and reported) rather than used.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Sequence

import numpy as np

from ...progress import bar
from ...runtime.config import GenerateConfig, GenerateStats, SpeculativeConfig, TreeSpeculativeConfig, numpy_int
from ...runtime.engine import Plan, _as_ids, check_call, generate_stream, resolve_loops
from ...errors import ConfigError, TinyLoopError
from .spec_session import speculative_request

#: Texts the default calibration prompts are made from (with the model's tokenizer, if it has one).
DEFAULT_TEXTS = ("def main():\n", "The quick brown fox", "import os\nimport sys\n\n",
                 "class Node:\n    def __init__(self, value):", "Once upon a time, ")
#: The spec's fallback rule: speculative is used only when it is at least this much faster.
DEFAULT_MIN_SPEEDUP = 1.3


@dataclass
class DecoderChoice:
    """The outcome of :func:`calibrate` for one loop depth."""

    loops: int
    decoder: str
    """"greedy" (plain decoding), "speculative" or "tree_speculative"."""
    config: Optional[SpeculativeConfig]
    """The winning speculative configuration (its max_tokens / sampling fields are per request)."""
    speedup: float
    """Winner's decode tokens/s over plain decoding's (1.0 when plain won)."""
    results: List[dict] = field(default_factory=list)
    """Every candidate: decoder, its knobs, decode tokens/s, exact (output equal to plain)."""

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["config"] = None if self.config is None else dataclasses.asdict(self.config)
        return d


def default_candidates(loops: int) -> List[SpeculativeConfig]:
    """A small grid: chain drafts at a quarter and half the depth (and 1), 2-6 tokens ahead; trees of
    2 branches, 2-3 deep."""
    if loops < 2:
        return []
    depths = sorted({1, max(1, loops // 4), max(1, loops // 2)} - {loops})
    out: List[SpeculativeConfig] = []
    for Ld in depths:
        for ahead in (2, 4, 6):
            out.append(SpeculativeConfig(draft_loops=Ld, verify_loops=loops, draft_ahead=ahead))
    for D in (2, 3):
        out.append(TreeSpeculativeConfig(draft_loops=depths[-1] if len(depths) > 1 else 1, verify_loops=loops,
                                         draft_ahead=D, K_branches=2))
    return out


def _knobs(config: SpeculativeConfig) -> str:
    """A candidate's draft knobs, for messages."""
    out = f"{_decoder_name(config)}: draft_loops={config.draft_loops}, draft_ahead={config.draft_ahead}"
    return out + (f", K_branches={config.K_branches}" if isinstance(config, TreeSpeculativeConfig) else "")


def _decoder_name(config: SpeculativeConfig) -> str:
    """The decoder plugin that runs a speculative configuration."""
    return "tree_speculative" if isinstance(config, TreeSpeculativeConfig) else "speculative"


def _default_prompts(model) -> List[List[int]]:
    try:
        tok = model.tokenizer
        prompts = [tok.encode(t) for t in DEFAULT_TEXTS]
        if all(0 < len(p) and all(0 <= i < model.vocab_size for i in p) for p in prompts):
            return prompts
    except Exception:
        pass
    V = model.vocab_size
    return [[(7 * i + 13 * j + 1) % V for j in range(6 + i)] for i in range(len(DEFAULT_TEXTS))]


#: New tokens per calibration run when calibrate() is not told (less where max_seq_len is short).
DEFAULT_MAX_TOKENS = 32


def calibrate(model, loops: Optional[int] = None, prompts: Optional[Sequence[Sequence[int]]] = None,
              max_tokens: Optional[int] = None, min_speedup: float = DEFAULT_MIN_SPEEDUP,
              candidates: Optional[Sequence[SpeculativeConfig]] = None) -> DecoderChoice:
    """Benchmark plain greedy decoding against each speculative candidate at `loops` (default: the
    model's default depth) on `prompts` (default: a few generic prompts), `max_tokens` new tokens
    each, and cache the choice on the model. Speculative wins only when its decode tokens/s beat
    plain's by `min_speedup`. Every candidate is warmed up on every prompt (kernels, graphs) before
    timing. Candidates are timed greedily (their temperature and sampling knobs are dropped) and
    checked on the model before any work: a default one the model cannot run (a draft or tree
    larger than its prefill_chunk, speculation refused by TINYLOOP_DISABLE_KV_CACHE) is left out,
    a given one is the error of its request, naming it."""
    check_call(model)
    model._check_live()
    L = resolve_loops(model, int(loops) if numpy_int(loops) else loops)
    if (isinstance(min_speedup, bool) or not isinstance(min_speedup, (int, float))
            or not 0 < min_speedup < float("inf")):
        raise ConfigError(f"min_speedup={min_speedup!r} must be a finite number > 0")
    if prompts is None:
        # the built-in prompts, cut to fit the model's own limits (half of max_seq_len at most)
        keep = max(1, model.max_seq_len // 2)
        prompts = [p[-keep:] for p in _default_prompts(model)]
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ConfigError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    for i, p in enumerate(prompts):
        if isinstance(p, (int, np.integer)):
            raise ConfigError(f"prompts[{i}]={p!r} is a token id, not a prompt: prompts is a list of prompts "
                              f"(token-id lists or texts), e.g. [[5, 6, 7]]")
    # each prompt as generate takes it: token ids, or a text encoded with the model's tokenizer
    prompts = [_as_ids(p, f"prompts[{i}]", model) for i, p in enumerate(prompts)]
    if not prompts:
        raise ConfigError("calibrate needs at least one prompt")
    room = model.max_seq_len - max(len(p) for p in prompts)
    if max_tokens is None:
        max_tokens = min(DEFAULT_MAX_TOKENS, room)
        if max_tokens < 2:
            raise ConfigError(f"max_seq_len={model.max_seq_len} leaves no room for a calibration run "
                              f"(prompts of {model.max_seq_len - room} tokens + at least 2 new ones)")
    if numpy_int(max_tokens):
        max_tokens = int(max_tokens)         # a numpy integer is an integer (np.bool_ is not one)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 2:
        raise ConfigError(f"max_tokens={max_tokens!r} must be an integer >= 2 for a calibration run")
    if candidates is not None and (isinstance(candidates, (str, bytes, SpeculativeConfig))
                                   or not isinstance(candidates, Iterable)
                                   or (isinstance(candidates, np.ndarray) and candidates.ndim == 0)):
        raise ConfigError(f"candidates must be a list of SpeculativeConfig / TreeSpeculativeConfig (or None for "
                          f"the defaults), got {type(candidates).__name__} {candidates!r:.80}")
    try:
        cands = default_candidates(L) if candidates is None else list(candidates)
    except Exception as exc:            # a caller's iterable whose iteration fails
        raise ConfigError(f"candidates must be a list of SpeculativeConfig / TreeSpeculativeConfig: reading the "
                          f"{type(candidates).__name__} given failed ({type(exc).__name__}: {exc})") from None
    for c in cands:
        if not isinstance(c, SpeculativeConfig) or c.verify_loops != L:
            raise ConfigError(f"calibration candidates must be SpeculativeConfig / TreeSpeculativeConfig with "
                              f"verify_loops={L}, got {c!r}")
    # every candidate as it is timed (greedy, this max_tokens), checked on this model before any
    # work: a default one the model cannot run (a draft longer than its prefill_chunk, speculation
    # refused by the environment) is left out; a given one is an error naming it
    timed_cands = []
    for i, c in enumerate(cands):
        c = dataclasses.replace(c, max_tokens=max_tokens, temperature=0.0, **dict(SpeculativeConfig._SAMPLING_KNOBS))
        try:
            plan = Plan(model, speculative_request(c, isinstance(c, TreeSpeculativeConfig)), "single")
            plan.delegate()
        except TinyLoopError as exc:
            if candidates is None:
                continue
            raise type(exc)(f"calibration candidate {i} ({_knobs(c)}) does not run on this model: {exc}") from None
        timed_cands.append(c)

    def timed(run):
        for p in prompts:                    # warm-up: compile kernels, capture graphs (per cache size)
            run(p)
        outs, tokens, ms = [], 0, 0.0
        for p in prompts:
            st = GenerateStats()
            outs.append(run(p, st))
            tokens += max(0, st.tokens_emitted - 1)
            ms += st.decode_ms
        return outs, (tokens / (ms / 1e3) if ms > 0 else 0.0)

    base_cfg = GenerateConfig(max_tokens=max_tokens, loops=L)
    ref, base_rate = timed(lambda p, st=None: generate_stream(model, p, base_cfg, stats=st))
    results = [{"decoder": "greedy", "loops": L, "tokens_per_s": base_rate, "exact": True}]
    best, best_rate = None, base_rate
    for c in bar(timed_cands, "calibrate", total=len(timed_cands), unit="candidate"):
        tree = isinstance(c, TreeSpeculativeConfig)
        req = speculative_request(c, tree)
        outs, rate = timed(lambda p, st=None, req=req: generate_stream(model, p, req, stats=st))
        exact = outs == ref
        row = {"decoder": _decoder_name(c), "draft_loops": c.draft_loops,
               "draft_ahead": c.draft_ahead, "tokens_per_s": rate, "exact": exact}
        if tree:
            row["K_branches"] = c.K_branches
        results.append(row)
        if exact and rate > best_rate:
            best, best_rate = c, rate
    speedup = best_rate / base_rate if base_rate > 0 else 1.0
    if best is None or speedup < min_speedup:
        choice = DecoderChoice(L, "greedy", None, 1.0, results)
    else:
        choice = DecoderChoice(L, _decoder_name(best), best, speedup, results)
    model.decoder_choices[L] = choice
    return choice
