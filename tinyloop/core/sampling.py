"""The sampling algorithm, written once for every backend.

Order: temperature -> top-k -> top-p -> draw.

1. z = logits / temperature (float64).
2. top-k: keep the k largest z; ties at the k-th value are broken by lower token id.
3. softmax over the kept tokens (max-subtracted).
4. top-p: walk the kept tokens by descending probability (ties by lower id) and keep the shortest
   prefix whose cumulative probability reaches top_p (at least one token); renormalise.
5. draw: with u uniform in [0, 1), the first token in that order whose cumulative probability
   exceeds u * total.
"""

from __future__ import annotations

import numpy as np


def sample_token(logits: np.ndarray, temperature: float, top_k: int, top_p: float, u: float) -> int:
    """One token from `logits` by the algorithm above, given the uniform draw `u`."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    n = z.shape[0]
    k = min(int(top_k), n)
    order = np.lexsort((np.arange(n), -z))[:k]         # descending z, ties by lower id
    p = np.exp(z[order] - z[order[0]])
    p /= p.sum()
    if top_p < 1.0:
        c = np.cumsum(p)
        keep = int(np.searchsorted(c, top_p, side="left")) + 1
        order, p = order[:keep], p[:keep]
    c = np.cumsum(p)
    i = int(np.searchsorted(c, u * c[-1], side="right"))
    return int(order[min(i, len(order) - 1)])


def uniform(rng: np.random.Generator) -> float:
    """The uniform draw of one sampling step."""
    return float(rng.random())
