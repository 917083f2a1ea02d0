"""The ``auto`` decoder (GenerateConfig(decoder="auto")): plain or self-speculative decoding,
whichever is faster for this checkpoint on this backend (the spec's pattern 5).

On the first request at a loop depth it runs autotune.calibrate (plain greedy vs a small grid of
chain and tree speculative configurations on a few prompts; speculative must win by 1.3x) and
caches the choice on the model; ``tinyloop.calibrate(model, loops, ...)`` runs it up front with
your own prompts and threshold. Every request is then handed to the winner:
greedy requests to the greedy or speculative decoder, sampling requests to the sampling decoder or
to speculative sampling (same distribution as plain sampling). Requests whose modes speculative
decoding rejects (repetition penalty, beams, ...) and batched requests with a speculative winner
keep their ordinary decoder. At temperature 0 the tokens are exactly those of plain decoding
either way; only the speed differs.
"""

from __future__ import annotations

import dataclasses

from ...runtime.compat import check_request
from ...runtime.config import GenerateConfig
from ...runtime.decoding import Decoder
from ...runtime.engine import Plan, resolve_loops
from ...errors import ConfigError, TinyLoopError
from ...runtime.hookspecs import hookimpl
from ...runtime.plugins import get_plugin_manager
from .autotune import DecoderChoice, calibrate
from .spec_session import options_of


class AutoDecoder(Decoder):
    name = "auto"
    contexts = frozenset({"single", "batched"})
    # every field: the request is handed on, and the decoder it goes to is checked for its own
    honours = frozenset(f.name for f in dataclasses.fields(GenerateConfig))

    @classmethod
    def resolve(cls, model, config: GenerateConfig, context: str):
        plain = config.replace(decoder=None)
        pm = get_plugin_manager()
        fallback = plain.replace(decoder=pm.decoder_for(plain).name)
        if context != "single":
            return fallback
        loops = resolve_loops(model, config.loops)
        choice = model.decoder_choices.get(loops)
        if choice is None:
            try:
                choice = calibrate(model, loops)
            except ConfigError:
                # the model's limits leave no room to measure: decode plainly, and remember it (a
                # calibration that cannot run is not tried again on every request)
                choice = model.decoder_choices[loops] = DecoderChoice(loops, "greedy", None, 1.0)
        if choice.config is None:
            return fallback
        target = pm.decoders()[choice.decoder]
        try:
            check_request(target.compat_context or context, plain)
            request = plain.replace(decoder=choice.decoder, loops=loops, options=options_of(choice.config))
            # every check of the winner's request (its decoder's own, the environment's: e.g.
            # TINYLOOP_DISABLE_KV_CACHE refuses speculation), before any work
            Plan(model, request, context)
        except TinyLoopError:
            return fallback
        return request

    def decode(self, session):      # never reached: resolve() always hands the request on
        raise TinyLoopError("the auto decoder only resolves to another decoder")


@hookimpl
def tinyloop_decoders():
    return [AutoDecoder]
