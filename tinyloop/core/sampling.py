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


def top_order(z: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k largest entries of z, by descending z and, among equal values, ascending id
    (= ``np.lexsort((arange(n), -z))[:k]``). For k < n the k-th largest value is found by a
    partition (linear time) and only the k kept ids are sorted: entries above it, then entries
    equal to it by ascending id until there are k."""
    n = z.shape[0]
    if k >= n or np.isnan(z).any():
        return np.lexsort((np.arange(n), -z))[:k]
    kth = np.partition(z, n - k)[n - k]
    above = np.flatnonzero(z > kth)                     # fewer than k: kth is the k-th largest
    ties = np.flatnonzero(z == kth)[:k - above.size]    # at least k - above.size of them
    kept = np.concatenate((above, ties))
    return kept[np.lexsort((kept, -z[kept]))]


def _filtered(logits: np.ndarray, temperature: float, top_k: int, top_p: float):
    """Steps 1-4: the kept token ids in descending order and their renormalised probabilities."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    n = z.shape[0]
    k = min(int(top_k), n)
    order = top_order(z, k)                             # descending z, ties by lower id
    p = np.exp(z[order] - z[order[0]])
    p /= p.sum()
    if top_p < 1.0:
        c = np.cumsum(p)
        keep = int(np.searchsorted(c, top_p, side="left")) + 1
        order, p = order[:keep], p[:keep] / c[min(keep, len(c)) - 1]
    return order, p


def sample_token(logits: np.ndarray, temperature: float, top_k: int, top_p: float, u: float) -> int:
    """One token from `logits` by the algorithm above, given the uniform draw `u`."""
    order, p = _filtered(logits, temperature, top_k, top_p)
    c = np.cumsum(p)
    i = int(np.searchsorted(c, u * c[-1], side="right"))
    return int(order[min(i, len(order) - 1)])


def sampling_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The full distribution (float64, vocab-sized) that sample_token draws from."""
    order, p = _filtered(logits, temperature, top_k, top_p)
    out = np.zeros(np.asarray(logits).shape[0], np.float64)
    out[order] = p
    return out


def draw(probs: np.ndarray, u: float) -> int:
    """Inverse-CDF draw from a probability vector (lowest id first)."""
    c = np.cumsum(probs)
    i = int(np.searchsorted(c, u * c[-1], side="right"))
    return min(i, len(c) - 1)


def uniform(rng: np.random.Generator) -> float:
    """The uniform draw of one sampling step."""
    return float(rng.random())
