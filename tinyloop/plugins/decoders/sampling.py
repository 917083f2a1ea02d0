"""Stochastic sampling: temperature -> top-k -> top-p -> draw (tinyloop.runtime.sampling), seeded."""

from __future__ import annotations

import numpy as np

from ...runtime.config import GREEDY_TEMPERATURE
from ...runtime.decoding import SAMPLING_FIELDS, Decoder
from ...errors import IncompatibleModesError
from ...runtime.hookspecs import hookimpl
from ...runtime.sampling import sample_token, uniform
from .. import ALL_CONTEXTS_OK


class SamplingDecoder(Decoder):
    name = "sampling"
    mode = "sampling"
    compat = ALL_CONTEXTS_OK
    adaptive_depth = True               # its steps are Session.advance: early exit applies
    honours = SAMPLING_FIELDS
    lockstep = True

    @classmethod
    def matches(cls, config) -> bool:
        return config.temperature > GREEDY_TEMPERATURE and config.beam_size < 2

    @classmethod
    def validate(cls, model, config, options) -> None:
        if not config.sampling:
            raise IncompatibleModesError(f"temperature={config.temperature} asks for greedy decoding "
                                         f"(<= {GREEDY_TEMPERATURE}), but decoder 'sampling' was chosen; "
                                         f"sampling needs temperature > {GREEDY_TEMPERATURE}")

    def __init__(self, config, options=None):
        super().__init__(config, options)
        self._rng = np.random.Generator(np.random.PCG64(config.sample_seed))

    def decode(self, session):
        session.start()
        while True:
            token = self._draw(session.logits())
            yield token
            session.advance(token)

    def pick(self, lane):
        return self._draw(lane.logits())

    def _draw(self, logits) -> int:
        c = self.config
        return sample_token(logits, c.temperature, c.top_k, c.top_p, uniform(self._rng))


@hookimpl
def tinyloop_decoders():
    return [SamplingDecoder]
