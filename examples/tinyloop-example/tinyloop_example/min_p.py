"""A decoder plugin with its own options: min-p sampling (keep the tokens whose probability is at
least ``min_p`` times the most likely token's, renormalise, draw; Nguyen et al. 2024, "Turning Up
the Heat: Min-p Sampling for Creative and Coherent LLM Outputs").

Selected with ``GenerateConfig(decoder="min_p", temperature=0.8, options={"min_p": 0.1})``. It
honours temperature and sample_seed (besides the engine's own fields); setting top_k or top_p for
it is an error, since it would ignore them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import tinyloop as tl
from tinyloop.runtime.config import GREEDY_TEMPERATURE, check_float


@dataclass(frozen=True)
class MinPOptions:
    """Options of the min_p decoder (GenerateConfig.options)."""

    min_p: float = 0.05
    """Keep tokens with probability >= min_p * (the top token's probability); in (0, 1]."""

    def __post_init__(self) -> None:
        v = check_float("min_p", self.min_p)
        if not 0.0 < v <= 1.0:
            raise tl.ConfigError(f"min_p={self.min_p} is outside the allowed range (0, 1]")
        object.__setattr__(self, "min_p", v)


def min_p_probs(logits: np.ndarray, temperature: float, min_p: float) -> np.ndarray:
    """The min-p distribution over the vocabulary (float64), from one row of logits."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    p[p < min_p * p.max()] = 0.0
    return p / p.sum()


class MinPDecoder(tl.Decoder):
    name = "min_p"
    contexts = frozenset({"single", "batched"})
    options_class = MinPOptions
    honours = frozenset({"temperature", "sample_seed"})

    def decode(self, session):
        c, opts = self.config, self.options
        rng = np.random.Generator(np.random.PCG64(c.sample_seed))
        session.start()
        while True:
            logits = session.logits()
            if c.temperature <= GREEDY_TEMPERATURE:
                token = int(np.argmax(logits))
            else:
                p = min_p_probs(logits, c.temperature, opts.min_p)
                token = int(rng.choice(p.shape[0], p=p))
            yield token
            session.advance(token)
