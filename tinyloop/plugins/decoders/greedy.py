"""Greedy decoding: the argmax of the processed logits at every step."""

from __future__ import annotations

from ...runtime.config import GREEDY_TEMPERATURE
from ...runtime.decoding import Decoder
from ...runtime.hookspecs import hookimpl
from .. import ALL_CONTEXTS_OK


class GreedyDecoder(Decoder):
    name = "greedy"
    mode = "greedy"
    compat = ALL_CONTEXTS_OK
    adaptive_depth = True               # its steps are Session.advance: early exit applies
    honours = frozenset()               # the engine's fields and the processors' only
    lockstep = True
    picks_argmax = True                 # pick() is lane.greedy(): the batch may queue ahead

    @classmethod
    def matches(cls, config) -> bool:
        return config.temperature <= GREEDY_TEMPERATURE and config.beam_size < 2

    def decode(self, session):
        session.start()
        while True:
            # ahead: this decoder always advances with the token it yields, so the engine may
            # queue that token's decode step before reading the token back
            token = session.greedy(ahead=True)
            yield token
            session.advance(token)

    def pick(self, lane):
        return lane.greedy()


@hookimpl
def tinyloop_decoders():
    return [GreedyDecoder]
