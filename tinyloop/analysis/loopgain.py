"""Loop gain ("beta") of a checkpoint: how fast the shared loop block converges.

Speculative decoding (a shallow draft verified at full depth) and early exit pay when the residual
stops moving after a few loop iterations. For token ids split into windows (positions 0 .. W-1 of
each window, scored like ``tl.score`` on that window):

* ``h_k`` is the residual after loop iteration k, k = 1 .. L_max; ``h_0`` is the residual entering
  the loop (after the pre blocks). With ``loop_inject == "add"`` the step h_{k-1} -> h_k includes the
  injection added before iteration k, i.e. it is one application of the map the loop iterates.
* ``s_k`` (step size), k = 1 .. L_max, is the L2 norm over d_model of ``h_k[t] - h_{k-1}[t]``,
  averaged (arithmetic mean, equal weight) over every position t of every window.
* ``beta_k = s_{k+1} / s_k``, k = 1 .. L_max - 1; ``beta_mean`` is their arithmetic mean and
  ``beta_geomean = (s_{L_max} / s_1) ** (1 / (L_max - 1))`` their geometric mean. beta < 1: the loop
  contracts (the residual settles; shallow drafts agree with deep verifies); beta > 1: it diverges.
* ``dir_step`` / ``dir_beta``: the same on the residual's direction, ``u_k = h_k / |h_k|`` (the final
  norm is scale-invariant, so the head sees the direction). A loop whose residual keeps growing by a
  near-constant vector (beta ~ 1) can still converge in direction (dir_beta < 1).
* For each depth L = 1 .. L_max, the next-token distribution p_L = softmax(logits at L) at every
  position is compared with p_{L_max}: ``top1`` = fraction of positions whose argmax agrees (the
  greedy speculative acceptance rate per token), ``kl`` = mean KL(p_{L_max} || p_L) in nats,
  ``tv`` = mean total variation distance (1 - tv is the per-token acceptance probability of
  speculative sampling at temperature 1), ``nll`` = mean next-token loss on the ids themselves.

The measurement runs on the model's own backend through :class:`~tinyloop.runtime.forward.Forward`
(prefix, then one ``run_loop_iters_range(k, k + 1)`` at a time, residual copied to the host after
each iteration, post blocks + head at every depth) and is exact with respect to the engine: the
logits at depth L equal ``tl.score(model, ids, loops=L, cache_mode=...)``. The post blocks of each
depth write their own cache layers (placed after the L_max loop iterations), so one pass serves
every depth and windows longer than the workspace are chunked exactly as ``score`` chunks them.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..model.arch import ModelConfig
from ..runtime.config import GenerateConfig
from ..runtime.engine import Model, resolve_loops, validate_request
from .scoring import depth_pass
from ..errors import InvalidInputError

#: committed held-out text of the demo model (present in a repository checkout, not in a wheel)
HELDOUT_TEXT = Path(__file__).resolve().parents[2] / "data" / "heldout_eval.txt"
RANDOM_SEED = 0

#: sample text when no text is given and the repository's held-out file is not there
SNIPPET = '''\
import os
import sys
from collections import defaultdict


class Counter:
    """Count hashable items."""

    def __init__(self, items=None):
        self.counts = defaultdict(int)
        if items is not None:
            self.update(items)

    def update(self, items):
        for item in items:
            self.counts[item] += 1

    def most_common(self, n=None):
        pairs = sorted(self.counts.items(), key=lambda kv: kv[1], reverse=True)
        return pairs if n is None else pairs[:n]

    def __len__(self):
        return len(self.counts)

    def __repr__(self):
        return f"{type(self).__name__}({dict(self.counts)!r})"


def read_words(path, encoding="utf-8"):
    """Yield the words of a text file, one at a time."""
    with open(path, encoding=encoding) as f:
        for line in f:
            for word in line.split():
                yield word.strip(".,;:!?").lower()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: count.py FILE...", file=sys.stderr)
        return 2
    counter = Counter()
    for path in argv:
        if not os.path.exists(path):
            print(f"{path}: no such file", file=sys.stderr)
            continue
        counter.update(read_words(path))
    for word, n in counter.most_common(10):
        print(f"{n:>6} {word}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''


def default_max_loops(cfg: ModelConfig) -> int:
    """The deepest depth measured by default: 2 x default_loops, capped by the model's max_loops."""
    return min(2 * cfg.default_loops, cfg.max_loops)


def trace_loop(model: Model, token_ids: Sequence[int], max_loops: Optional[int] = None,
               cache_mode: str = "fp16") -> Tuple[np.ndarray, np.ndarray]:
    """One pass over `token_ids` (positions 0 .. T-1) to depth L_max = `max_loops` (default
    :func:`default_max_loops`). Returns host float32 arrays

    * residuals (L_max + 1, T, d_model): [0] enters the loop, [k] follows loop iteration k;
    * logits (L_max, T, vocab_size): [L - 1] are the logits at depth L, equal to
      ``score(model, token_ids, loops=L, cache_mode=cache_mode)``.

    Holds the model lock (ModelBusyError if it is busy). Host memory: L_max * T * vocab floats.
    The pass is tinyloop.analysis.scoring's depth_pass at every depth."""
    model._check_live()
    c = model.cfg
    Lmax = default_max_loops(c) if max_loops is None else max_loops
    T_all = len(validate_request(model, token_ids, GenerateConfig(max_tokens=0, loops=resolve_loops(model, Lmax)),
                                 what="tokens"))
    residuals = np.empty((Lmax + 1, T_all, c.d_model), np.float32)
    logits = np.empty((Lmax, T_all, c.vocab_size), np.float32)

    def keep_logits(d, a, z):
        logits[d - 1, a:a + len(z)] = z

    def keep_residual(k, a, x):
        residuals[k, a:a + len(x)] = x
    depth_pass(model, token_ids, Lmax, None, cache_mode, keep_logits, keep_residual)
    return residuals, logits


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    m = z.max(axis=1, keepdims=True)
    return z - (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))


def _windows(ids: np.ndarray, window: int, max_windows: int) -> List[np.ndarray]:
    n = len(ids) // window
    if n == 0:
        return [ids]                 # shorter than one window: one window of everything
    return [ids[w * window:(w + 1) * window] for w in range(min(n, max_windows))]


def measure_loop_gain(model: Model, token_ids: Sequence[int], max_loops: Optional[int] = None,
                      window: int = 256, max_windows: int = 4, cache_mode: str = "fp16") -> dict:
    """Loop gain of `model` on `token_ids` (see the module docstring for every definition).

    The ids are split into non-overlapping windows of `window` tokens (clamped to the model's
    max_seq_len; ids shorter than one window form one window), at most `max_windows` of them, each
    traced by :func:`trace_loop` to depth `max_loops` (default min(2 * default_loops, max_loops)).
    Returns a JSON-serializable dict: ``iterations`` (per k: step s_k, mean residual norm |h_k|,
    beta_k), ``beta_mean``, ``beta_geomean``, ``regime``, and ``depths`` (per L: top1, kl, tv, nll
    against depth max_loops)."""
    model._check_live()
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise InvalidInputError(f"window={window!r} must be an integer >= 1")
    if isinstance(max_windows, bool) or not isinstance(max_windows, int) or max_windows < 1:
        raise InvalidInputError(f"max_windows={max_windows!r} must be an integer >= 1")
    window = min(window, model.max_seq_len)
    c = model.cfg
    Lmax = resolve_loops(model, default_max_loops(c) if max_loops is None else max_loops)
    arr = np.asarray(token_ids)
    if arr.ndim != 1 or len(arr) < 1:
        raise InvalidInputError("token_ids must be a non-empty flat sequence of token ids")
    wins = _windows(arr, window, max_windows)

    step_sum = np.zeros(Lmax + 1)         # [k]: sum over positions of |h_k - h_{k-1}|, k >= 1
    dir_sum = np.zeros(Lmax + 1)          # [k]: sum over positions of |u_k - u_{k-1}|, u = h / |h|
    norm_sum = np.zeros(Lmax + 1)         # [k]: sum over positions of |h_k|
    top1 = np.zeros(Lmax)
    kl = np.zeros(Lmax)
    tv = np.zeros(Lmax)
    nll = np.zeros(Lmax)
    n_pos = n_pred = 0
    for w in wins:
        res, logits = trace_loop(model, w, Lmax, cache_mode)
        res = res.astype(np.float64)
        norms = np.linalg.norm(res, axis=2)
        norm_sum += norms.sum(axis=1)
        step_sum[1:] += np.linalg.norm(np.diff(res, axis=0), axis=2).sum(axis=1)
        unit = res / np.maximum(norms, 1e-30)[:, :, None]
        dir_sum[1:] += np.linalg.norm(np.diff(unit, axis=0), axis=2).sum(axis=1)
        T = len(w)
        ref_lp = _log_softmax(logits[Lmax - 1])
        ref_p = np.exp(ref_lp)
        ref_top = np.argmax(logits[Lmax - 1], axis=1)
        nxt = np.asarray(w[1:], dtype=np.int64)
        for L in range(1, Lmax + 1):
            lp = _log_softmax(logits[L - 1])
            top1[L - 1] += float(np.sum(np.argmax(logits[L - 1], axis=1) == ref_top))
            kl[L - 1] += float(np.sum(ref_p * (ref_lp - lp)))
            tv[L - 1] += float(0.5 * np.abs(ref_p - np.exp(lp)).sum())
            nll[L - 1] -= float(lp[np.arange(T - 1), nxt].sum())
        n_pos += T
        n_pred += T - 1
    steps, dsteps, norms = step_sum / n_pos, dir_sum / n_pos, norm_sum / n_pos

    def gains(s):
        b = [float(s[k + 1] / s[k]) if s[k] > 0 else math.inf for k in range(1, Lmax)]
        mean = float(np.mean(b)) if b else None
        geo = float((s[Lmax] / s[1]) ** (1.0 / (Lmax - 1))) if b and s[1] > 0 else None
        return b, mean, geo
    betas, beta_mean, beta_geo = gains(steps)
    dbetas, dbeta_mean, dbeta_geo = gains(dsteps)
    iterations = [{"k": k, "step": float(steps[k]) if k else None, "norm": float(norms[k]),
                   "beta": betas[k - 1] if 1 <= k < Lmax else None,
                   "dir_step": float(dsteps[k]) if k else None,
                   "dir_beta": dbetas[k - 1] if 1 <= k < Lmax else None} for k in range(Lmax + 1)]
    regime = None if beta_mean is None else ("contracting" if beta_mean < 1 else "diverging")
    depths = [{"loops": L, "top1": top1[L - 1] / n_pos, "kl": kl[L - 1] / n_pos, "tv": tv[L - 1] / n_pos,
               "nll": nll[L - 1] / n_pred if n_pred else None} for L in range(1, Lmax + 1)]
    return {"backend": model.backend_name, "cache_mode": cache_mode, "max_loops": Lmax,
            "default_loops": c.default_loops, "loop_inject": c.loop_inject, "window": len(wins[0]),
            "windows": len(wins), "positions": n_pos, "iterations": iterations,
            "beta_mean": beta_mean, "beta_geomean": beta_geo, "regime": regime,
            "dir_beta_mean": dbeta_mean, "dir_beta_geomean": dbeta_geo, "depths": depths}


def sample_token_ids(model: Model, text: Optional[str] = None, n_tokens: int = 1024,
                     seed: int = RANDOM_SEED) -> Tuple[List[int], str]:
    """Token ids to measure on, and where they came from. With `text`: the model's tokenizer
    (:func:`~tinyloop.model.tokenizer.resolve_tokenizer`, no directory override) on it. Without: when
    a tokenizer is configured (embedded, or TINYLOOP_TOKENIZER_DIR), the repository's
    data/heldout_eval.txt if present, else a fixed Python snippet; with no tokenizer configured
    (byte fallback), `n_tokens` uniformly random ids from a generator seeded with `seed`."""
    from ..model.tokenizer import TOKENIZER_ENV, resolve_tokenizer
    configured = model.header.tokenizer is not None or bool(os.environ.get(TOKENIZER_ENV))
    if text is None and not configured:
        rng = np.random.default_rng(seed)
        return [int(t) for t in rng.integers(0, model.vocab_size, n_tokens)], \
            f"{n_tokens} random token ids (seed {seed}; no tokenizer configured)"
    if text is None:
        if HELDOUT_TEXT.is_file():
            text, source = HELDOUT_TEXT.read_text(encoding="utf-8"), "data/heldout_eval.txt"
        else:
            text, source = SNIPPET, "built-in Python snippet"
    else:
        source = "given text"
    tok = resolve_tokenizer(model.header.tokenizer, None, model.vocab_size)
    ids = tok.encode(text)
    if not ids:
        raise InvalidInputError(f"the sample text ({source}) encodes to no tokens")
    return ids, source


def measure_file(path: str, text: Optional[str] = None, max_loops: Optional[int] = None,
                 window: int = 256, max_windows: int = 4, cache_mode: str = "fp16",
                 text_label: Optional[str] = None) -> dict:
    """Load the model file on the CPU backend, pick sample ids (:func:`sample_token_ids`) and
    return :func:`measure_loop_gain` plus ``sample`` (where the ids came from)."""
    from ..runtime.engine import free_model, load_model
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise InvalidInputError(f"window={window!r} must be an integer >= 1")
    model = load_model(path, max_seq_len=window, backend="cpu")
    try:
        ids, source = sample_token_ids(model, text, n_tokens=window * max_windows)
        r = measure_loop_gain(model, ids, max_loops, window, max_windows, cache_mode)
    finally:
        free_model(model)
    r["sample"] = text_label if (text is not None and text_label) else source
    return r


def format_table(r: dict) -> List[str]:
    """The measurement as text lines (inspect's --measure output)."""
    out = [f"loop gain ({r['backend']}, kv {r['cache_mode']}, {r['windows']} window(s) x {r['window']} "
           f"tokens of {r['sample'] if 'sample' in r else 'the given ids'}, depths 1..{r['max_loops']}):"]
    out.append(f"  {'k':>3} {'step s_k':>10} {'|h_k|':>10} {'beta_k':>8} {'dir step':>9} {'dir beta':>9}")
    for it in r["iterations"]:
        f = lambda v, spec: "" if v is None else format(v, spec)  # noqa: E731
        out.append(f"  {it['k']:>3} {f(it['step'], '.4g'):>10} {it['norm']:>10.4g} {f(it['beta'], '.3f'):>8} "
                   f"{f(it['dir_step'], '.4f'):>9} {f(it['dir_beta'], '.3f'):>9}")
    if r["beta_mean"] is None:
        out.append("  beta: needs depths >= 2")
    else:
        out.append(f"  beta mean {r['beta_mean']:.3f} (geometric {r['beta_geomean']:.3f}): {r['regime']}; "
                   f"direction beta mean {r['dir_beta_mean']:.3f} (geometric {r['dir_beta_geomean']:.3f})")
    out.append(f"  {'L':>3} {'top1@' + str(r['max_loops']):>8} {'KL':>9} {'TV':>7} {'nll':>7}")
    for d in r["depths"]:
        nll = "" if d["nll"] is None else f"{d['nll']:.4f}"
        out.append(f"  {d['loops']:>3} {d['top1']:>8.3f} {d['kl']:>9.4f} {d['tv']:>7.3f} {nll:>7}")
    return out
