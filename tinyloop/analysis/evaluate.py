"""Held-out perplexity, computed by the runtime itself (tinyloop ppl)."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from ..runtime.config import GenerateConfig, GenerateStats
from ..runtime.engine import Model, _as_ids, check_call, score, score_decoded
from ..errors import IncompatibleModesError, InvalidInputError
from ..progress import bar


def _windows(model: Model, ids, window, max_windows, scored: bool = False):
    """(ids as int64, number of whole windows to score), checked. `ids` is what score takes: token
    ids (integers, not floats or bools) or a text (encoded as score encodes it). `scored`: the
    windows go through score, which keeps no window cache (at most sliding_window tokens)."""
    if isinstance(window, bool) or not isinstance(window, int) or not 2 <= window <= model.max_seq_len:
        raise InvalidInputError(f"window={window!r} is outside the allowed range [2, {model.max_seq_len}]")
    W = model.cfg.sliding_window
    if scored and W and window > W:
        raise IncompatibleModesError(
            f"window={window} is past the model's sliding_window={W}: perplexity scores each window with "
            f"score, which keeps no window cache; take window <= {W} (tinyloop ppl --window {W}), or "
            f"decoded_perplexity with GenerateConfig(cache_window={W}) for longer windows")
    if max_windows is not None and (isinstance(max_windows, bool) or not isinstance(max_windows, int)
                                    or max_windows < 1):
        raise InvalidInputError(f"max_windows={max_windows!r} must be an integer >= 1, or None for every window")
    ids = np.asarray(_as_ids(ids, "ids", model), dtype=np.int64)
    n_win = len(ids) // window
    if max_windows is not None:
        n_win = min(n_win, max_windows)
    if n_win < 1:
        raise InvalidInputError(f"{len(ids)} tokens do not fill one window of {window}")
    return ids, n_win


def _exp(nll: float) -> float:
    """exp(mean NLL): inf past the float range (mean NLL > ~709.78 nats) instead of OverflowError."""
    try:
        return math.exp(nll)
    except OverflowError:
        return math.inf


def _window_nll(logits: np.ndarray, chunk: np.ndarray) -> float:
    """Summed NLL of chunk[1:] under the float64 logits of chunk[:-1]."""
    m = logits.max(axis=1, keepdims=True)
    lse = (m[:, 0] + np.log(np.exp(logits - m).sum(axis=1)))[:-1]
    return float(np.sum(lse - logits[np.arange(len(chunk) - 1), chunk[1:]]))


def perplexity(model: Model, ids: Sequence[int], loops: Optional[int] = None, window: int = 256,
               max_windows: Optional[int] = None, cache_mode: str = "fp16") -> dict:
    """Perplexity of `ids` split into non-overlapping windows of `window` tokens; inside a window
    token i is predicted from tokens 0..i-1 (the first token of each window is context only), with
    K/V stored in `cache_mode` (fp32, fp16, int8, int4, ...). A text is encoded after the model's
    BOS id (as score encodes it); a tail shorter than a window is not scored; "ppl" is inf where
    exp(nll) is past the float range; a window above the model's sliding_window is refused
    (docs/SCORING.md, "Per-token scores and perplexity").

    Returns {"ppl", "nll", "tokens", "windows", "loops", "cache_mode"}."""
    ids, n_win = _windows(model, ids, window, max_windows, scored=True)
    nll = 0.0
    count = 0
    for w in bar(range(n_win), f"ppl L={loops if loops is not None else model.cfg.default_loops} {cache_mode}",
                 unit="window"):
        chunk = ids[w * window:(w + 1) * window]
        logits = score(model, chunk, loops=loops, cache_mode=cache_mode).astype(np.float64)
        nll += _window_nll(logits, chunk)
        count += window - 1
    return {"ppl": _exp(nll / count), "nll": nll / count, "tokens": count, "windows": n_win,
            "loops": loops if loops is not None else model.cfg.default_loops, "cache_mode": cache_mode}


def decoded_perplexity(model: Model, ids: Sequence[int], config: Optional[GenerateConfig] = None,
                       window: int = 256, max_windows: Optional[int] = None) -> dict:
    """Perplexity of `ids` as decoding computes the logits (tinyloop.score_decoded: one decode
    step per position, teacher-forced), so per-step settings such as early exit apply; windows as
    :func:`perplexity`. Besides {"ppl", "nll", "tokens", "windows", "loops"} it returns
    "mean_loops" (the mean depth behind the scored predictions) and "probes" (exit criterion
    evaluations)."""
    check_call(model, config)
    config = config or GenerateConfig()
    ids, n_win = _windows(model, ids, window, max_windows)
    nll, count, depth_sum, probes = 0.0, 0, 0.0, 0
    loops = config.loops if config.loops is not None else model.cfg.default_loops
    for w in bar(range(n_win), "decoded ppl", unit="window"):
        chunk = ids[w * window:(w + 1) * window]
        st = GenerateStats()
        logits = score_decoded(model, [int(t) for t in chunk], config, stats=st).astype(np.float64)
        nll += _window_nll(logits, chunk)
        count += window - 1
        depths = st.token_loops[:-1] if st.token_loops else [loops] * (window - 1)
        depth_sum += float(sum(depths))
        probes += st.exit_probes
    return {"ppl": _exp(nll / count), "nll": nll / count, "tokens": count, "windows": n_win, "loops": loops,
            "mean_loops": depth_sum / count, "probes": probes}
