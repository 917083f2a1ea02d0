"""The sampling algorithm, written once for every backend.

Order: temperature -> top-k -> top-p -> draw. `sample_token`, exactly (the CUDA backend's
on-device sampler, tinyloop/cuda/kernels/sample.py, runs the same operations):

1. z = float64(logits) / temperature (float64 division).
2. top-k: keep the k = min(top_k, vocab) largest z, ordered by descending z and, among equal
   values, ascending token id (a strict total order).
3. weights w_j = exp(z_j - z_0) (z_0 the largest) and their running sums c_j = w_0 + ... + w_j,
   accumulated sequentially in float64 in that order (``np.cumsum``). Where z_0 is +inf (a
   float32 overflow) the weights are their limit instead: 1 for the +inf tokens, 0 for the rest.
   (Host rule only: the CUDA kernel, used only without logit processors, does not apply it.)
4. top-p: if top_p < 1, keep the first n candidates, n = 1 + the first j with
   c_j >= top_p * c_(k-1) (k if none); otherwise n = k.
5. draw: with u uniform in [0, 1), the first candidate j < n with c_j > u * c_(n-1) (n - 1 if
   rounding leaves none).

`sampling_probs` gives the same distribution as explicit probabilities (softmax over the kept
tokens, renormalised after the top-p cut), for the speculative decoders' accept / reject tests. Its
top-p cut is step 4's, on the same running sums c_j, so it keeps exactly the candidates
sample_token can draw (a cut on the normalised sums would round differently: on ten tied tokens
with top_p 0.8, 0.1 + ... + 0.1 stays below 0.8 after eight terms while c_7 = 8 = 0.8 * 10).
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


def _ranked(logits: np.ndarray, temperature: float, top_k: int):
    """Steps 1-2: (z, order, zs) with z = logits / temperature (float64), zs the kept values in
    descending order and order their ids when a top-k cut ranked them (None when every token is
    kept: the values alone are sorted, and the ids are found only as far as a caller needs them,
    see `_ids`; tied ids have equal values, so nothing computed from zs depends on it)."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    n = z.shape[0]
    k = min(int(top_k), n)
    if k < n:
        order = top_order(z, k)
        zs = z[order]
    else:
        order, zs = None, -np.sort(-z)
    if zs[0] == np.inf:
        # a +inf logit (a float32 overflow) would make every weight exp(inf - inf) = NaN: take
        # the softmax's limit instead, the +inf tokens sharing the mass (the first is greedy's)
        return _ranked(np.where(z == np.inf, 0.0, -np.inf), 1.0, top_k)
    return z, order, zs


def _kept(logits: np.ndarray, temperature: float, top_k: int, top_p: float):
    """sampling_probs' steps: (z, zmax, norms, order, p) with z, order as `_ranked` gives them
    and p the kept tokens' renormalised probabilities in descending order,
    ``p = exp(z - zmax) / norms[0] (/ norms[1] after a top-p cut)``."""
    z, order, zs = _ranked(logits, temperature, top_k)
    w = np.exp(zs - zs[0])
    norms = [w.sum()]
    p = w / norms[0]
    if top_p < 1.0:
        cw = np.cumsum(w)                   # sample_token's c_j: the cut is its step 4, exactly
        keep = min(int(np.searchsorted(cw, top_p * cw[-1], side="left")) + 1, len(cw))
        c = np.cumsum(p)
        norms.append(c[keep - 1])
        p = p[:keep] / norms[1]
        if order is not None:
            order = order[:keep]
    return z, zs[0], norms, order, p


def _ids(z: np.ndarray, order, m: int) -> np.ndarray:
    """The first m kept ids in descending order (ties by lower id)."""
    return order[:m] if order is not None else top_order(z, m)


def sample_token(logits: np.ndarray, temperature: float, top_k: int, top_p: float, u: float) -> int:
    """One token from `logits` by the algorithm above (steps 1-5), given the uniform draw `u`.
    Without a top-k cut (top_k >= vocab) the values alone are sorted and ids are ranked only as
    far as the draw reaches (`_ids`): tied ids have equal values, so the weights are the same."""
    z, order, zs = _ranked(logits, temperature, top_k)
    c = np.cumsum(np.exp(zs - zs[0]))
    m = c.shape[0]
    if top_p < 1.0:
        m = min(int(np.searchsorted(c, top_p * c[-1], side="left")) + 1, m)
    i = min(int(np.searchsorted(c[:m], u * c[m - 1], side="right")), m - 1)
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


def uniforms(seed: int, n: int) -> np.ndarray:
    """A sampling request's uniform numbers: generated token i is drawn with entry i (float64,
    the first n numbers of PCG64(seed); the same as n successive `uniform` calls on
    ``np.random.Generator(np.random.PCG64(seed))``)."""
    return np.random.Generator(np.random.PCG64(seed)).random(n)


def request_uniforms(config) -> np.ndarray:
    """The uniform numbers of a request (a GenerateConfig): `uniforms` of its sample_seed, one per
    token it may generate (at least one)."""
    return uniforms(config.sample_seed, max(1, config.max_tokens))


def uniform_at(table: np.ndarray, i: int) -> float:
    """The uniform number of generated token i (the last one past the table's end)."""
    return float(table[min(i, table.shape[0] - 1)])
