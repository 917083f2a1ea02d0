"""The rest of the scoring family: logit lens, uncertainty, consistency escalation (docs/SCORING.md).

A shared loop block makes "the model's prediction after k iterations" well defined: the logits at
depth k are those of ``score(model, ids, loops=k)`` (post blocks, final norm and head applied to the
residual after iteration k). All three functions get every depth they need from ONE pass over the
loop (prefix once, then one iteration at a time, the post blocks of each requested depth writing
their own cache layers), chunked by the model's prefill_chunk like ``score``:

* :func:`score_logit_lens` the logits at each requested depth (or their top-k);
* :func:`score_with_uncertainty` final logits plus entropy, top-1 / top-2 probability margin, the
  depth from which the argmax settles, and the KL of each depth to the final one;
* :func:`score_with_consistency_escalation` score at loops_low, re-score the positions an
  uncertainty criterion flags at loops_high by warm start (tinyloop.runtime.reuse: the first
  loops_low iterations are not recomputed), with an exactness statement: every position's logits
  equal ``score(model, ids, loops=depth[t])[t]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import numpy as np

from ..errors import ConfigError
from ..runtime.config import GenerateConfig, GenerateStats, plain_number
from ..runtime.engine import (Model, Plan, Session, _locked, check_call, resolve_loops, score_window_hint,
                              validate_request)
from ..runtime.processors import ProcessorChain
from ..runtime import reuse

#: Criteria of score_with_consistency_escalation: a position fails (is escalated) when
#: entropy > threshold (nats), margin < threshold (top-1 minus top-2 probability), or, for
#: "disagreement", when the argmax at loops_low differs from the argmax at loops_low - 1 (threshold
#: unused: it must be None).
CRITERIA = ("entropy", "margin", "disagreement")


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    m = z.max(axis=-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis=-1, keepdims=True))


def _depths(loops: int, depths) -> List[int]:
    if depths is None:
        return list(range(1, loops + 1))
    if isinstance(depths, np.ndarray) and depths.ndim == 1:
        depths = depths.tolist()
    if isinstance(depths, (str, bytes)) or not isinstance(depths, Sequence) or not depths:
        raise ConfigError(f"depths={depths!r} must be a non-empty list of loop depths in [1, {loops}] (or None: all)")
    out = []
    for d in depths:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
            raise ConfigError(f"depths holds {d!r}, not a loop depth (an integer in [1, {loops}])")
        if not 1 <= d <= loops:
            raise ConfigError(f"depths holds {d!r}, outside the allowed range [1, {loops}] (loops={loops})")
        if int(d) in out:
            raise ConfigError(f"depths holds {int(d)} twice")
        out.append(int(d))
    return sorted(out)


def depth_pass(model: Model, tokens, loops: Optional[int], depths, cache_mode: str,
               on_block: Callable[[int, int, np.ndarray], None],
               on_residual: Optional[Callable[[int, int, np.ndarray], None]] = None):
    """One pass to max(depths): on_block(depth, row0, logits (T, V) host float32) for every requested
    depth of every chunk, depths in increasing order within a chunk; with `on_residual`, also
    on_residual(k, row0, residual (T, d_model) host float32) for k = 0 (entering the loop) and after
    every iteration k. Returns (ids, loops, depths). Holds the model lock (ModelBusyError if busy)."""
    check_call(model)
    model._check_live()
    L = resolve_loops(model, loops)
    ds = _depths(L, depths)
    config = GenerateConfig(max_tokens=0, loops=L, cache_mode=cache_mode)
    plan = Plan(model, config, "single")
    ids = validate_request(model, tokens, config, what="tokens",
                           window_hint=score_window_hint(model))
    # the post blocks of each requested depth write their own layer group (depth L: the post group)
    parts = {d: ("post" if d == L else f"post@{d}") for d in ds}
    lock = _locked(model)
    try:
        s = Session(model, ids, plan, ProcessorChain([]), GenerateStats(),
                    extra_groups=tuple(p for p in parts.values() if p != "post"))
        try:
            be, fwd, ws = model.backend, model.fwd, model.ws
            for a in range(0, len(ids), ws.rows):
                T = min(ws.rows, len(ids) - a)
                pos = be.positions(a)
                fwd.prefix(be.set_ids(ws, ids[a:a + T]), pos, T, s.cache)
                if on_residual is not None:
                    on_residual(0, a, be.rows_to_host(ws.x, T))
                for k in range(ds[-1]):
                    fwd.run_loop_iters_range(pos, T, s.cache, k, k + 1)
                    if on_residual is not None:
                        on_residual(k + 1, a, be.rows_to_host(ws.x, T))
                    if k + 1 in parts:
                        be.copy(ws.snap_x, ws.x, T)        # the post blocks overwrite x
                        fwd.suffix(pos, T, s.cache, part=parts[k + 1])
                        fwd.logits(0, T)
                        on_block(k + 1, a, np.asarray(be.logits_block_to_host(ws, T), np.float32))
                        be.copy(ws.x, ws.snap_x, T)
        finally:
            s.close()
    finally:
        lock.release()
    return ids, L, ds


# --------------------------------------------------------------------------- logit lens
@dataclass
class LensTopK:
    """score_logit_lens with top_k: per requested depth and position the k most likely ids (best
    first, ties to the lower id) and their log-probabilities."""

    depths: List[int]
    ids: np.ndarray          # (len(depths), T, k) int64
    logprobs: np.ndarray     # (len(depths), T, k) float32


def _topk(logits: np.ndarray, k: int):
    order = np.argsort(-logits, axis=-1, kind="stable")[:, :k]      # stable: ties to the lower id
    lp = _log_softmax(logits)
    return order, np.take_along_axis(lp, order, axis=-1).astype(np.float32)


def score_logit_lens(model: Model, tokens: Sequence[int], loops: Optional[int] = None, depths=None,
                     top_k: Optional[int] = None, cache_mode: str = "fp16"):
    """The logit lens: the logits at each of `depths` (default every depth 1 .. loops; loops None:
    the model's default) for every position, from one pass of the loop. Row d equals
    ``score(model, tokens, loops=d)``; the row at depth loops equals ``score(model, tokens, loops)``.

    Returns float32 (len(depths), T, vocab), or with `top_k` a :class:`LensTopK` (k ids and
    log-probabilities per depth and position: memory depths x T x k instead of x vocab)."""
    check_call(model)
    V = model.cfg.vocab_size
    top_k = plain_number(top_k)                      # np.int64(3) is 3
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)):
        raise ConfigError(f"top_k={top_k!r} must be an integer in [1, {V}] (the vocabulary), or None")
    if top_k is not None and not 1 <= top_k <= V:
        raise ConfigError(f"top_k={top_k!r} is outside the allowed range [1, {V}] (the vocabulary), or None")
    L = resolve_loops(model, loops)
    ds = _depths(L, depths)
    T = len(validate_request(model, tokens, GenerateConfig(max_tokens=0, loops=L), what="tokens",
                             window_hint=score_window_hint(model)))
    index = {d: i for i, d in enumerate(ds)}
    if top_k is None:
        out = np.empty((len(ds), T, V), np.float32)

        def keep(d, a, z):
            out[index[d], a:a + len(z)] = z
        depth_pass(model, tokens, L, ds, cache_mode, keep)
        return out
    ids_out = np.empty((len(ds), T, top_k), np.int64)
    lp_out = np.empty((len(ds), T, top_k), np.float32)

    def keep_top(d, a, z):
        i, lp = _topk(z, top_k)
        ids_out[index[d], a:a + len(z)] = i
        lp_out[index[d], a:a + len(z)] = lp
    depth_pass(model, tokens, L, ds, cache_mode, keep_top)
    return LensTopK(ds, ids_out, lp_out)


# --------------------------------------------------------------------------- uncertainty
@dataclass
class Uncertainty:
    """score_with_uncertainty's result (T positions, depths 1 .. loops):

    * ``logits`` (T, vocab) float32: the final logits (= score at loops);
    * ``entropy`` (T,): entropy of softmax(logits) in nats;
    * ``margin`` (T,): top-1 minus top-2 probability;
    * ``settled_depth`` (T,) int: the smallest depth d such that the argmax at every depth
      d .. loops equals the final argmax (1: settled from the first iteration; loops: only the last
      depth has it);
    * ``argmax`` (loops, T) int: the argmax at each depth;
    * ``kl_to_final`` (loops, T): KL(p_loops || p_d) in nats per depth (row loops - 1 is 0)."""

    loops: int
    logits: np.ndarray
    entropy: np.ndarray
    margin: np.ndarray
    settled_depth: np.ndarray
    argmax: np.ndarray
    kl_to_final: np.ndarray


def _entropy_margin(z: np.ndarray):
    lp = _log_softmax(z)
    p = np.exp(lp)
    ent = -(p * lp).sum(axis=-1)
    top2 = np.sort(p, axis=-1)[:, -2:] if p.shape[-1] > 1 else np.concatenate([np.zeros_like(p), p], -1)
    return ent, top2[:, 1] - top2[:, 0]


def score_with_uncertainty(model: Model, tokens: Sequence[int], loops: Optional[int] = None,
                           cache_mode: str = "fp16") -> Uncertainty:
    """Final logits at `loops` plus per-position uncertainty (see :class:`Uncertainty`), from one
    pass of the loop. Host memory: the final logits plus one chunk's logits at every depth."""
    check_call(model)
    L = resolve_loops(model, loops)
    T = len(validate_request(model, tokens, GenerateConfig(max_tokens=0, loops=L), what="tokens",
                             window_hint=score_window_hint(model)))
    V = model.cfg.vocab_size
    logits = np.empty((T, V), np.float32)
    argmax = np.empty((L, T), np.int64)
    kl = np.empty((L, T), np.float64)
    chunk: dict = {}

    def keep(d, a, z):
        argmax[d - 1, a:a + len(z)] = np.argmax(z, axis=-1)
        chunk[d] = _log_softmax(z)
        if d == L:                                   # the chunk's last depth: compare every depth with it
            logits[a:a + len(z)] = z
            final = chunk[L]
            pf = np.exp(final)
            for dd, lp in chunk.items():
                kl[dd - 1, a:a + len(z)] = (pf * (final - lp)).sum(axis=-1)
            chunk.clear()
    depth_pass(model, tokens, L, None, cache_mode, keep)
    ent, margin = _entropy_margin(logits)
    settled = np.full(T, L, np.int64)
    same = argmax == argmax[L - 1][None, :]
    for d in range(L - 1, 0, -1):                   # walk down while the argmax still agrees
        ok = same[d - 1] & (settled == d + 1)
        settled[ok] = d
    return Uncertainty(L, logits, ent.astype(np.float32), margin.astype(np.float32), settled, argmax,
                       np.maximum(kl, 0.0).astype(np.float32))


# --------------------------------------------------------------------------- escalation
@dataclass
class Escalation:
    """score_with_consistency_escalation's result: ``logits`` (T, vocab) float32, ``depth`` (T,)
    int (loops_low or loops_high: ``logits[t] == score(model, ids, loops=depth[t])[t]``),
    ``escalated`` (T,) bool, ``loop_work`` (row-iterations of the loop run) and ``saved`` (the
    fraction of loop work saved vs scoring everything at loops_high)."""

    loops_low: int
    loops_high: int
    logits: np.ndarray
    depth: np.ndarray
    escalated: np.ndarray
    loop_work: int
    saved: float


def score_with_consistency_escalation(model: Model, tokens: Sequence[int], loops_low: int, loops_high: int,
                                      criterion: str = "entropy", threshold: Optional[float] = None,
                                      cache_mode: str = "fp16") -> Escalation:
    """Score at loops_low; the positions that fail `criterion` (:data:`CRITERIA`) are re-scored at
    loops_high by warm start from the loops_low state: iterations loops_low .. loops_high - 1 run
    over positions 0 .. (the last failing position) only, from the kept loops_low residual, so the
    first loops_low iterations are never recomputed and positions after the last failing one never
    run the deep iterations. Every position's logits equal ``score(model, tokens,
    loops=depth[t])[t]`` bit for bit (an escalated position attends to the loops_high state of
    every earlier position, which is why the deep iterations run over all of them).

    `threshold` has no default value: criteria "entropy" (nats) and "margin" (a probability) need
    one (None is a ConfigError saying so); "disagreement" takes none (it must stay None)."""
    check_call(model)
    try:
        lo = resolve_loops(model, loops_low)
    except ConfigError as exc:          # named as this call's argument
        raise ConfigError(f"loops_low: {exc}") from None
    try:
        hi = resolve_loops(model, loops_high)
    except ConfigError as exc:
        raise ConfigError(f"loops_high: {exc}") from None
    if lo >= hi:
        raise ConfigError(f"loops_low={lo} must be below loops_high={hi}")
    if not isinstance(criterion, str) or criterion not in CRITERIA:
        raise ConfigError(f"criterion={criterion!r} is not one of {', '.join(CRITERIA)}")
    if criterion == "disagreement":
        if threshold is not None:
            raise ConfigError(f"criterion 'disagreement' takes no threshold (got {threshold!r}): it compares "
                              f"the argmax at loops_low with the argmax at loops_low - 1")
        if lo < 2:
            raise ConfigError(f"criterion 'disagreement' needs loops_low >= 2 (it compares depths loops_low - 1 "
                              f"and loops_low), got {lo}")
    else:
        if threshold is None:       # no default: what counts as uncertain depends on the model and the task
            unit = "nats: a position fails when its entropy exceeds it" if criterion == "entropy" else \
                   "a probability: a position fails when its top-1 minus top-2 probability is below it"
            raise ConfigError(f"threshold=None: criterion {criterion!r} needs a threshold (a number >= 0, {unit}); "
                              f"pass threshold=..., or criterion='disagreement', which takes none")
        threshold = plain_number(threshold)          # np.float32(0.5) is 0.5
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
            raise ConfigError(f"threshold={threshold!r} must be a finite number for criterion {criterion!r}")
        if threshold < 0:
            raise ConfigError(f"threshold={threshold!r} must be >= 0 ({criterion} is never negative)")
    config = GenerateConfig(max_tokens=0, loops=hi, cache_mode=cache_mode)
    ids = validate_request(model, tokens, config, what="tokens",
                           window_hint=score_window_hint(model))
    Plan(model, config, "single", reuse="warm_start")           # compat and backend capability
    P = len(ids)
    first = lo - 1 if criterion == "disagreement" else lo
    # the model is held from before the handle is built until after it is freed: no other request
    # can take it in between, so the cleanup cannot fail (ModelBusyError) and hide the first error
    lock = _locked(model)
    try:
        # the call's working state, not kept state: outside the live handle cap (it evicts nothing)
        h = reuse._build_resume_handle(model, ids, first, GenerateConfig(max_tokens=0, cache_mode=cache_mode),
                                       kept=False, held=lock)
        try:
            prev = _handle_logits(model, h, first, P) if criterion == "disagreement" else None
            if first < lo:
                h.upgrade(lo)
            low = _handle_logits(model, h, lo, P)
            if criterion == "entropy":
                fail = _entropy_margin(low)[0] > threshold
            elif criterion == "margin":
                fail = _entropy_margin(low)[1] < threshold
            else:
                fail = np.argmax(low, axis=-1) != np.argmax(prev, axis=-1)
            logits = low
            work = lo * P
            if fail.any():
                last = int(np.nonzero(fail)[0][-1]) + 1          # rows 0 .. last - 1 run deep
                high = _escalate(model, h, lo, hi, last)
                logits = low.copy()
                logits[:last][fail[:last]] = high[fail[:last]]
                work += (hi - lo) * last
        finally:
            h._drop("freed")                          # (free_resume_handle, under the lock this call holds)
    finally:
        lock.release()
    depth = np.where(fail, hi, lo).astype(np.int64)
    return Escalation(lo, hi, logits, depth, fail, int(work), 1.0 - work / (hi * P))


def _handle_logits(model: Model, h, depth: int, n: int) -> np.ndarray:
    """Logits (n, V) at `depth` from the handle's kept residual (post blocks rerun into its cache:
    the same K/V the handle holds for that depth)."""
    out = h.run_rows(depth, depth, n, post=True, logits=True)
    h.post_depth = depth
    return out


def _escalate(model: Model, h, lo: int, hi: int, n: int) -> np.ndarray:
    """Iterations lo .. hi - 1 over positions 0 .. n - 1 from the handle's loops_low residual, then
    the post blocks and the head: logits (n, V) at loops_high. The handle's loops_low state stays
    as it was except the post layers (its cache grows to hi iterations)."""
    h.reserve(hi)
    out = h.run_rows(lo, hi, n, post=True, logits=True)
    h.post_depth = -1                                # partial: no depth's post layers are whole
    return out
