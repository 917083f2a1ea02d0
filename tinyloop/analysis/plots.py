"""Pictures of the scoring family (matplotlib: the optional extra ``tinyloop[plot]``).

* :func:`draw_lens`: the logit lens as a heatmap, depth (rows, 1 at the top) x position (columns);
  the colour is the probability each depth gives to the FINAL depth's prediction at that position,
  the cell text the top token at that depth.
* :func:`draw_uncertainty`: per position the entropy of the final prediction (bars) and the depth
  from which its argmax is settled (line), the x axis labelled with the input tokens.
"""

from __future__ import annotations

from typing import List, Sequence

import numpy as np

from ..errors import ConfigError

INSTALL_HINT = "plots need matplotlib: pip install tinyloop[plot]"


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(INSTALL_HINT) from None
    return plt


def _short(s: str, n: int = 6) -> str:
    s = s.replace("\n", "\\n").replace("\t", "\\t").replace(" ", "\u2423")
    return s if len(s) <= n else s[:n - 1] + "~"


def draw_lens(path: str, lens: np.ndarray, depths: Sequence[int], inputs: List[str], decode,
              title: str = "") -> None:
    """Write the logit-lens heatmap of `lens` (len(depths), T, vocab) to `path` (PNG, SVG or PDF by
    suffix): column t is input token `inputs[t]`, each cell's text the decoded (`decode(id) ->
    str`) top token of that depth, its colour the probability that depth gives to the last depth's
    prediction."""
    plt = _pyplot()
    z = lens.astype(np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    final = np.argmax(z[-1], axis=-1)
    prob_final = p[:, np.arange(z.shape[1]), final]
    top = np.argmax(z, axis=-1)
    D, T = prob_final.shape
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * T + 2), max(2.5, 0.45 * D + 1.5)))
    im = ax.imshow(prob_final, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0)
    for d in range(D):
        for t in range(T):
            ax.text(t, d, _short(decode(int(top[d, t]))), ha="center", va="center", fontsize=6,
                    color="white" if prob_final[d, t] < 0.6 else "black")
    ax.set_yticks(range(D), [str(d) for d in depths])
    ax.set_ylabel("loop depth")
    ax.set_xticks(range(T), [_short(s) for s in inputs], rotation=90, fontsize=7)
    ax.set_xlabel("input token (each cell is the prediction of the next one)")
    fig.colorbar(im, ax=ax, label="p(final depth's prediction)")
    ax.set_title(title or "logit lens")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def draw_uncertainty(path: str, entropy: np.ndarray, settled: np.ndarray, loops: int, inputs: List[str],
                     title: str = "") -> None:
    """Write the per-position entropy (bars, nats) and settled depth (line) strip to `path`."""
    plt = _pyplot()
    T = len(entropy)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * T + 2), 3.2))
    ax.bar(range(T), entropy, color="tab:blue", alpha=0.7, label="entropy (nats)")
    ax.set_ylabel("entropy of the final prediction (nats)")
    ax2 = ax.twinx()
    ax2.plot(range(T), settled, color="tab:red", marker="o", ms=3, label="settled depth")
    ax2.set_ylim(0.5, loops + 0.5)
    ax2.set_ylabel("depth the argmax settles at")
    ax.set_xticks(range(T), [_short(s) for s in inputs], rotation=90, fontsize=7)
    ax.set_title(title or "uncertainty per position")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
