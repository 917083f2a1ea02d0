"""Held-out perplexity, computed by the runtime itself (tinyloop ppl)."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from ..runtime.engine import Model, score
from ..errors import InvalidInputError
from ..progress import bar


def perplexity(model: Model, ids: Sequence[int], loops: Optional[int] = None, window: int = 256,
               max_windows: Optional[int] = None, cache_mode: str = "fp16") -> dict:
    """Perplexity of `ids` split into non-overlapping windows of `window` tokens; inside a window
    token i is predicted from tokens 0..i-1 (the first token of each window is context only), with
    K/V stored in `cache_mode` (fp32, fp16, int8, int4, ...).

    Returns {"ppl", "nll", "tokens", "windows", "loops", "cache_mode"}."""
    if isinstance(window, bool) or not isinstance(window, int) or not 2 <= window <= model.max_seq_len:
        raise InvalidInputError(f"window={window!r} is outside the allowed range [2, {model.max_seq_len}]")
    ids = np.asarray(ids, dtype=np.int64)
    n_win = len(ids) // window
    if max_windows is not None:
        n_win = min(n_win, max_windows)
    if n_win < 1:
        raise InvalidInputError(f"{len(ids)} tokens do not fill one window of {window}")
    nll = 0.0
    count = 0
    for w in bar(range(n_win), f"ppl L={loops if loops is not None else model.cfg.default_loops} {cache_mode}",
                 unit="window"):
        chunk = ids[w * window:(w + 1) * window]
        logits = score(model, chunk, loops=loops, cache_mode=cache_mode).astype(np.float64)
        m = logits.max(axis=1, keepdims=True)
        lse = (m[:, 0] + np.log(np.exp(logits - m).sum(axis=1)))[:-1]
        nll += float(np.sum(lse - logits[np.arange(window - 1), chunk[1:]]))
        count += window - 1
    return {"ppl": math.exp(nll / count), "nll": nll / count, "tokens": count, "windows": n_win,
            "loops": loops if loops is not None else model.cfg.default_loops, "cache_mode": cache_mode}
