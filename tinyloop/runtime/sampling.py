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


def _kept(logits: np.ndarray, temperature: float, top_k: int, top_p: float):
    """Steps 1-4: (z, zmax, norms, order, p) with z = logits / temperature (float64), p the kept
    tokens' renormalised probabilities in descending order, ``p = exp(z - zmax) / norms[0]
    (/ norms[1] after a top-p cut)``, and order their ids when a top-k cut ranked them (None
    when every token is ranked: the ids are then found only as far as a caller needs them, see
    `_ids`). Without a top-k cut the values alone are sorted, which gives the same p, bit for
    bit, as sorting the ids would: tied ids have equal values."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    n = z.shape[0]
    k = min(int(top_k), n)
    if k < n:
        order = top_order(z, k)
        zs = z[order]
    else:
        order = None
        zs = -np.sort(-z)
    p = np.exp(zs - zs[0])
    norms = [p.sum()]
    p /= norms[0]
    if top_p < 1.0:
        c = np.cumsum(p)
        keep = int(np.searchsorted(c, top_p, side="left")) + 1
        norms.append(c[min(keep, len(c)) - 1])
        p = p[:keep] / norms[1]
        if order is not None:
            order = order[:keep]
    return z, zs[0], norms, order, p


def _ids(z: np.ndarray, order, m: int) -> np.ndarray:
    """The first m kept ids in descending order (ties by lower id)."""
    return order[:m] if order is not None else top_order(z, m)


def sample_token(logits: np.ndarray, temperature: float, top_k: int, top_p: float, u: float) -> int:
    """One token from `logits` by the algorithm above, given the uniform draw `u`."""
    z, _, _, order, p = _kept(logits, temperature, top_k, top_p)
    c = np.cumsum(p)
    i = min(int(np.searchsorted(c, u * c[-1], side="right")), len(p) - 1)
    return int(_ids(z, order, i + 1)[i])


def sampling_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The full distribution (float64, vocab-sized) that sample_token draws from."""
    z, zmax, norms, order, p = _kept(logits, temperature, top_k, top_p)
    n = z.shape[0]
    if order is not None or len(p) < n:
        out = np.zeros(n, np.float64)
        out[_ids(z, order, len(p))] = p
        return out
    # every token kept: the same operations on each value in id order give the same bits
    out = np.exp(z - zmax)
    for d in norms:
        out /= d
    return out


def draw(probs: np.ndarray, u: float) -> int:
    """Inverse-CDF draw from a probability vector (lowest id first)."""
    c = np.cumsum(probs)
    i = int(np.searchsorted(c, u * c[-1], side="right"))
    return min(i, len(c) - 1)


def uniform(rng: np.random.Generator) -> float:
    """The uniform draw of one sampling step."""
    return float(rng.random())
