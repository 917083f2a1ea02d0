"""The ``auto`` decoder (GenerateConfig(decoder="auto")): plain or self-speculative decoding,
whichever is faster for this checkpoint on this backend (the spec's pattern 5).

On the first request at a loop depth it runs tinyloop.core.autotune.calibrate (plain greedy vs a
small grid of chain and tree speculative configurations on a few prompts; speculative must win by
1.3x) and caches the choice on the model; ``tinyloop.core.autotune.calibrate(model, loops, ...)``
runs it up front with your own prompts and threshold. Every request is then handed to the winner:
greedy requests to the greedy or speculative decoder, sampling requests to the sampling decoder or
to speculative sampling (same distribution as plain sampling). Requests whose modes speculative
decoding rejects (repetition penalty, beams, ...) and batched requests with a speculative winner
keep their ordinary decoder. At temperature 0 the tokens are exactly those of plain decoding
either way; only the speed differs.
"""

from __future__ import annotations

import dataclasses

from ...core.autotune import calibrate
from ...core.compat import check_request
from ...core.config import GenerateConfig
from ...core.decoding import Decoder
from ...core.engine import resolve_loops
from ...core.errors import TinyLoopError
from ...core.hookspecs import hookimpl
from ...core.plugins import get_plugin_manager


class AutoDecoder(Decoder):
    name = "auto"
    contexts = frozenset({"single", "batched"})

    @classmethod
    def resolve(cls, model, config: GenerateConfig, context: str):
        plain = dataclasses.replace(config, decoder=None)
        fallback = (get_plugin_manager().decoder_for(plain).name, plain)
        if context != "single":
            return fallback
        loops = resolve_loops(model, config.loops)
        choice = model.decoder_choices.get(loops) or calibrate(model, loops)
        if choice.config is None:
            return fallback
        spec = dataclasses.replace(
            choice.config, max_tokens=config.max_tokens, temperature=config.temperature, seed=config.sample_seed,
            top_k=config.top_k, top_p=config.top_p, stop_sequences=config.stop_sequences,
            cache_mode=config.cache_mode)
        try:
            check_request(choice.decoder, plain)
        except TinyLoopError:
            return fallback
        return choice.decoder, spec

    def decode(self, session):      # never reached: resolve() always hands the request on
        raise TinyLoopError("the auto decoder only resolves to another decoder")


@hookimpl
def tinyloop_decoders():
    return [AutoDecoder]
