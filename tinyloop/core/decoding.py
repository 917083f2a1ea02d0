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
* ``advance(token)``   append `token` at the next position and run the decode forward.
* ``config``           the request's GenerateConfig; ``vocab_size``; ``position`` (tokens so far).
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

    def __init__(self, config):
        self.config = config

    def decode(self, session) -> Iterator[int]:
        """Yield tokens one at a time, calling session.advance(token) before producing the next."""
        raise NotImplementedError
