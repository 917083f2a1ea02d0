"""The built-in stop rules: EOS, stop sequences and max_tokens (tinyloop.runtime.stopping gives
their order). Registered like any third-party stopper."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

from ...runtime.config import StopReason
from ...runtime.hookspecs import hookimpl
from ...runtime.stopping import StopOrder, Stopper


def tail_match(out: Sequence[int], seqs) -> bool:
    """True when one of the token sequences `seqs` ends `out` (the stop-sequence rule)."""
    for s in seqs:
        n = len(s)
        if n <= len(out) and tuple(out[-n:]) == s:
            return True
    return False


class EOSStopper(Stopper):
    """The model's end-of-sequence ids end the sequence: eos_id and the extra_eos_ids (models
    without an EOS id have no such rule)."""

    name = "eos"
    order = StopOrder.EOS

    def __init__(self, eos_ids: Sequence[int]):
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        self.ending_tokens = len(self.eos_ids)

    @classmethod
    def from_config(cls, config, model_config):
        eos = getattr(model_config, "eos_ids", None)
        if eos is None:                     # a model config of its own, without the extra ids
            eos = () if getattr(model_config, "eos_id", None) is None else (model_config.eos_id,)
        return cls(eos) if eos else None

    def check(self, output_tokens):
        return StopReason.EOS if output_tokens[-1] in self.eos_ids else None


class StopSequenceStopper(Stopper):
    """GenerateConfig.stop_sequences: a sequence matching the tail of the output ends it."""

    name = "stop_sequences"
    order = StopOrder.SEQUENCE

    def __init__(self, sequences: Tuple[Tuple[int, ...], ...]):
        self.sequences = tuple(sequences)
        self.ending_tokens = len(self.sequences)      # each sequence ends on one token

    @classmethod
    def from_config(cls, config, model_config):
        return cls(config.stop_sequences) if config.stop_sequences else None

    def check(self, output_tokens):
        return StopReason.STOP_SEQUENCE if tail_match(output_tokens, self.sequences) else None


class MaxTokensStopper(Stopper):
    """GenerateConfig.max_tokens: the request ends once that many tokens are out."""

    name = "max_tokens"
    order = StopOrder.LENGTH
    ending_tokens = 0          # it ends a sequence by its length, whatever the token

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens

    @classmethod
    def from_config(cls, config, model_config) -> Optional["MaxTokensStopper"]:
        return cls(config.max_tokens)

    def check(self, output_tokens):
        return StopReason.MAX_TOKENS if len(output_tokens) >= self.max_tokens else None


@hookimpl
def tinyloop_stoppers():
    return [EOSStopper, StopSequenceStopper, MaxTokensStopper]
