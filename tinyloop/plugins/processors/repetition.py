"""Repetition penalty, HuggingFace convention (Keskar et al. 2019, CTRL): for every token id already
in the prompt or the output, a positive logit is divided by the penalty and a negative one
multiplied by it."""

from __future__ import annotations

import numpy as np

from ...runtime.hookspecs import hookimpl
from ...runtime.processors import LogitProcessor, Stage


class RepetitionPenalty(LogitProcessor):
    name = "repetition_penalty"
    mode = "repetition_penalty"
    compat = {"single": "ok", "batched": "ok", "speculative": "rejected", "tree_speculative": "rejected",
              "prefix_reuse": "ok", "warm_start": "ok"}
    stage = Stage.PENALTY
    argmax_invariant = False

    def __init__(self, penalty: float):
        self.penalty = np.float32(penalty)
        self.seen = np.zeros(0, np.int64)
        self._set = set()

    @classmethod
    def from_config(cls, config):
        return cls(config.repetition_penalty) if config.repetition_penalty != 1.0 else None

    def reset(self, prompt):
        self._set = set(int(t) for t in prompt)
        self.seen = np.fromiter(sorted(self._set), np.int64, len(self._set))

    def apply(self, logits):
        v = logits[self.seen]
        logits[self.seen] = np.where(v > 0, v / self.penalty, v * self.penalty)

    def accept(self, token):
        if token not in self._set:
            self._set.add(token)
            self.seen = np.append(self.seen, np.int64(token))

    def clone(self):
        c = RepetitionPenalty(float(self.penalty))
        c._set, c.seen = set(self._set), self.seen.copy()
        return c


@hookimpl
def tinyloop_processors():
    return [RepetitionPenalty]
