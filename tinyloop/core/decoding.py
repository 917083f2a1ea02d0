"""Decoder plugins and the session they drive.

A decoder is a generator of tokens over a :class:`DecodeSession` that the engine hands it. The
engine owns everything else: validation, the compat check, cache allocation, processors'
``accept``, the stop policy (EOS, stop sequences, callback abort, max_tokens) and statistics. When
the engine stops consuming, it closes the generator; decoders hold no resources of their own.

DecodeSession (implemented by tinyloop.core.engine.Session):

* ``start()``          prefill the prompt; next-token logits become pending.
* ``logits()``         the pending logits row after the processor chain (float32, host; valid until
                       the next advance).
* ``greedy()``         argmax of the processed pending logits (on the device when every processor
                       is argmax-invariant, so only a token id crosses to the host).
                       ``greedy(ahead=True)`` promises that the next call is ``advance(that token)``
                       (or nothing): the engine may then queue that token's decode step before the
                       token reaches the host (``logits()`` before the advance raises).
* ``advance(token)``   append `token` at the next position and run the decode forward.
* ``config``           the request's GenerateConfig; ``vocab_size``; ``eos_id`` (None: no EOS);
                       ``position`` (tokens so far).

Several decode states (lanes), for decoders that follow more than one sequence (beam search):

* ``fork_pool(n)``          hold n lanes; their caches are allocated here, up front, and released
                            with the session. Lane 0 is the one start() prefills.
* ``copy_state(dst, src)``  lane dst becomes a copy of lane src (KV cache, tokens, position).
* ``advance(token, lane)``, ``logits(lane)``, ``greedy(lane)``  as above on one lane. The forward
                            workspace is shared: only the lane started or advanced last has pending
                            logits (reading another lane's raises PluginError).
* ``lane_tokens(lane)``     a copy of a lane's tokens (prompt + generated).

The engine's stop policy applies to the tokens a decoder yields, whatever it explored before.
"""

from __future__ import annotations

from typing import ClassVar, FrozenSet, Iterator, Mapping, Optional


class Decoder:
    """Base class of decoder plugins."""

    name: ClassVar[str] = ""
    """Unique plugin name; GenerateConfig.decoder selects it explicitly."""
    mode: ClassVar[Optional[str]] = None
    """Row of configs/compat.yaml this decoder provides (None for decoders outside the matrix)."""
    compat: ClassVar[Mapping[str, str]] = {}
    """Declared compat cells; must equal the YAML row when `mode` is set."""
    contexts: ClassVar[FrozenSet[str]] = frozenset({"single", "batched"})
    """Decode contexts the decoder can run in (checked for decoders outside the matrix)."""

    @classmethod
    def matches(cls, config) -> bool:
        """True when this decoder is the automatic choice for `config` (built-ins only)."""
        return False

    # A decoder may also define ``resolve(model, config, context) -> (name, decoder_config) | None``
    # (a classmethod): called once per request after validation, it may hand the request to the
    # registered decoder `name`, built from `decoder_config` (the request's GenerateConfig, or a
    # SpeculativeConfig / TreeSpeculativeConfig, which also selects the speculative session).
    # The engine's stop policy still follows the request's GenerateConfig.

    def __init__(self, config):
        self.config = config

    def decode(self, session) -> Iterator[int]:
        """Yield tokens one at a time, calling session.advance(token) before producing the next."""
        raise NotImplementedError
