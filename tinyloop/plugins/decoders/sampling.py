"""Stochastic sampling: temperature -> top-k -> top-p -> draw (tinyloop.runtime.sampling), seeded."""

from __future__ import annotations

from ...runtime.config import GREEDY_TEMPERATURE
from ...runtime.decoding import SAMPLING_FIELDS, Decoder
from ...errors import IncompatibleModesError
from ...runtime.hookspecs import hookimpl
from ...runtime.sampling import request_uniforms, sample_token, uniform_at
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
        self._uniforms = None           # pick(): the request's uniform numbers, drawn in order
        self._drawn = 0

    def decode(self, session):
        session.start()
        while True:
            # ahead: the token is always advanced with, so the session may queue its step before
            # the token is read (with the draw on the device, only the id crosses)
            token = session.sample(ahead=True)
            yield token
            session.advance(token)

    def pick(self, lane):
        c = self.config
        if self._uniforms is None:
            self._uniforms = request_uniforms(c)
        u = uniform_at(self._uniforms, self._drawn)
        self._drawn += 1
        return sample_token(lane.logits(), c.temperature, c.top_k, c.top_p, u)


@hookimpl
def tinyloop_decoders():
    return [SamplingDecoder]
