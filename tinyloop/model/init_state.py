"""The loop's seeded random initial state (ModelConfig.loop_init "random"), defined exactly.

A model with loop_init "random" starts its loop from a state drawn from the file's seed
(``loop_init_seed``) and scale (``loop_init_scale``, the state's standard deviation). The draw
is a pure function of (seed, absolute position, channel), so the row of position p is the same
whichever launch computes it: prefill or decode, cached or uncached, chunked, a draft tree's
node, a batch lane, a reused prefix, the CPU or the CUDA backend, the float64 oracle or the
PyTorch reference. Every one of them reproduces this module bit for bit.

For position p and channel i of a d_model-wide state, with n = p * d_model + i::

    m0  = mix(seed + G)                                  (uint64 arithmetic, wrapping)
    h_k = mix(m0 + (6 n + k) * G)                        k = 0 .. 5
    S   = sum_k (h_k & 0xFFFFFFFF) + (h_k >> 32)         twelve uint32 words, an exact integer
    g   = (2 S + 12 - 12 * 2^32) * 2^-33                 exact in float64
    x[p, i] = float32(g * float64(scale))

G = 0x9E3779B97F4A7C15 and ``mix`` is the splitmix64 finalizer (a counter hash: the state of
position p never depends on how many positions were drawn before). Each 32-bit word is a
uniform (w + 1/2) / 2^32 on (0, 1), so g is the sum of twelve uniforms minus 6 (Irwin-Hall):
mean 0, variance 1 (to 2^-64), bounded in [-6, 6], close to a standard normal. Integer
arithmetic makes it exact on every backend, which a Box-Muller transform (libm's log and cos
differ in the last bit between numpy and the device) would not be.

Huginn-0125's published code draws a truncated normal (cut at 3 standard deviations) from the
framework's generator for every forward call; here the draw is fixed per position so that
decoding is reproducible and the cached and uncached paths agree (docs/CONVERT.md).
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError

G = 0x9E3779B97F4A7C15
C1 = 0xBF58476D1CE4E5B9
C2 = 0x94D049BB133111EB
MASK64 = (1 << 64) - 1
#: 12 * 2^32 - 12: the offset that centres the twelve words' sum (see the module doc)
OFFSET = 12 * 2 ** 32 - 12
#: hash draws per state element (two 32-bit words each)
DRAWS = 6


def mix(z: int) -> int:
    """The splitmix64 finalizer on a Python integer (uint64 wrap-around)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * C1) & MASK64
    z = ((z ^ (z >> 27)) * C2) & MASK64
    return z ^ (z >> 31)


def seed_key(seed: int) -> int:
    """m0 = mix(seed + G): the per-model key every element's hashes start from."""
    return mix((int(seed) + G) & MASK64)


def state_element(key: int, n: int, scale: float) -> float:
    """One element, element index n = position * d_model + channel, as a Python float (the
    float32 value): the scalar definition the vectorized `random_state` and the kernels match."""
    s = 0
    for k in range(DRAWS):
        h = mix((key + (DRAWS * n + k) * G) & MASK64)
        s += (h & 0xFFFFFFFF) + (h >> 32)
    g = float(2 * s - OFFSET) * 2.0 ** -33
    return float(np.float32(g * float(scale)))


def _mix_np(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(C1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(C2)
    return z ^ (z >> np.uint64(31))


def random_state(seed: int, scale: float, positions, d_model: int) -> np.ndarray:
    """float32 (len(positions), d_model): the initial state of the rows at these absolute
    positions (non-negative integers), exactly as the module doc defines it. ConfigError for a
    seed outside [0, 2**64), a scale outside (0, 1e6), a d_model below 1 or positions that are
    not non-negative integers."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2 ** 64:
        raise ConfigError(f"random_state: seed={seed!r} must be an integer in [0, 2**64)")
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.floating)) or not 0 < scale < 1e6:
        raise ConfigError(f"random_state: scale={scale!r} must be a finite number in (0, 1e6)")
    if isinstance(d_model, (bool, np.bool_)) or not isinstance(d_model, (int, np.integer)) or d_model < 1:
        raise ConfigError(f"random_state: d_model={d_model!r} must be an integer >= 1")
    pos = np.asarray(positions).reshape(-1)
    if pos.size and pos.dtype.kind not in "iu":
        raise ConfigError(f"random_state: positions must be integers, got dtype {pos.dtype}")
    pos = pos.astype(np.int64)
    if pos.size and int(pos.min()) < 0:
        raise ConfigError(f"random_state: positions must be >= 0, got {int(pos.min())}")
    n = (pos.astype(np.uint64)[:, None] * np.uint64(d_model)
         + np.arange(d_model, dtype=np.uint64)[None, :])
    key = np.uint64(seed_key(seed))
    s = np.zeros(n.shape, np.uint64)
    with np.errstate(over="ignore"):
        base = n * np.uint64(DRAWS)
        for k in range(DRAWS):
            h = _mix_np(key + (base + np.uint64(k)) * np.uint64(G))
            s += (h & np.uint64(0xFFFFFFFF)) + (h >> np.uint64(32))
    g = (2 * s.astype(np.int64) - OFFSET).astype(np.float64) * 2.0 ** -33
    return (g * float(scale)).astype(np.float32)
