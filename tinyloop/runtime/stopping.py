"""Stop rules: one interface that the decode loop consults after every emitted token.

Order, written once (the chain sorts stoppers by ``order``; the first reason returned wins):

1. ``StopOrder.CONSUMER`` - the consumer's stream callback (generate_stream's ``on_token``)
   returned False: CALLBACK_ABORT (:class:`CallbackStopper`, built by the engine).
2. ``StopOrder.EOS``      - the token is the model's EOS id: EOS.
3. ``StopOrder.SEQUENCE`` - a stop sequence ends the output: STOP_SEQUENCE.
4. ``StopOrder.PLUGIN``   - plugins' own rules, processors that are also stoppers included: their
   own reasons (GRAMMAR_DEAD_END is one; no built-in plugin returns it).
5. ``StopOrder.LENGTH``   - max_tokens tokens emitted: MAX_TOKENS.

Rules 2, 3 and 5 are ordinary plugins (tinyloop.plugins.stoppers, hook ``tinyloop_stoppers``).
The token that triggers a stop is part of the output. A consumer that stops reading
(generate_iter closed early) is recorded as CALLBACK_ABORT as well: that is not a check but the
generator being closed.

Interface (like the processors'): ``from_config(config, model_config)`` builds an instance when
the request needs it, ``reset(prompt)`` before decoding, ``check(output_tokens)`` after each
token, ``clone()`` for forked sequences. ``check`` sees the whole output so far (prompt
excluded) and is called exactly once per appended token, in order, so a stopper may keep
incremental state. Decoders that explore candidate sequences (beam search) check clones of
``session.stoppers``, the per-sequence rules (every rule but the consumer's).
"""

from __future__ import annotations

import copy
import enum
from typing import Any, Callable, ClassVar, List, Optional, Sequence

import numpy as np

from .config import StopReason
from ..errors import PluginError, TinyLoopError


class StopRequest(Exception):
    """Raised by a processor (or a decoder) when the request cannot go on, e.g. a grammar mask
    that allows no token: the engine ends the request with ``reason`` (no token is emitted for the
    step that raised it)."""

    def __init__(self, reason) -> None:
        super().__init__(str(reason))
        self.reason = StopReason(reason)


def plugin_call(label: str, hook: str, fn, *args, passes=(TinyLoopError, StopRequest)):
    """``fn(*args)``, a plugin's hook called while decoding: what it raises is a PluginError naming
    `label` and `hook`, but the `passes` exceptions (tinyloop's own errors, and StopRequest, which
    ends the request) come out as they are."""
    try:
        return fn(*args)
    except passes:
        raise
    except Exception as exc:
        raise PluginError(f"{label}: {hook} raised {type(exc).__name__}: {exc}") from exc


class StopOrder(enum.IntEnum):
    """Where a stopper runs in the chain (see the module docstring)."""

    CONSUMER = 10
    EOS = 20
    SEQUENCE = 30
    PLUGIN = 50
    LENGTH = 90


class Stopper:
    """Base class of stopper plugins (hook ``tinyloop_stoppers``). A LogitProcessor that also
    derives from Stopper is consulted as one after its ``accept`` (and is reset once, as a
    processor)."""

    name: ClassVar[str] = ""
    """Unique plugin name."""
    order: ClassVar[int] = StopOrder.PLUGIN
    """Where the stopper runs in the chain (StopOrder)."""
    per_sequence: ClassVar[bool] = True
    """False for a rule about the request's consumer rather than a token sequence (the stream
    callback): decoders that explore candidate sequences never consult it."""
    ending_tokens: Optional[int] = None
    """At most how many different tokens can end one sequence at one step (EOS: 1; n stop
    sequences: n; max_tokens: 0, it ends by length). Beam search widens its candidate walk by the
    chain's total; None: no bound known, so beam search ranks every token."""

    @classmethod
    def from_config(cls, config, model_config) -> Optional["Stopper"]:
        """An instance when the request (a GenerateConfig) needs this rule, else None;
        `model_config` is the model's ModelConfig (eos_id, vocab_size, ...)."""
        return None

    def reset(self, prompt: Sequence[int]) -> None:
        """Start a new sequence whose prompt is `prompt`."""

    def check(self, output_tokens: Sequence[int]) -> Optional[StopReason]:
        """The reason to stop after the last of `output_tokens` (the output so far, prompt
        excluded), or None to go on."""
        return None

    def clone(self) -> "Stopper":
        """An independent copy with the same state (a shallow copy unless overridden)."""
        return copy.copy(self)


class StopperChain(Stopper):
    """The chain is itself a stopper: it asks its members in ``order`` and returns the first
    reason."""

    name = "chain"

    def __init__(self, stoppers: Sequence[Stopper]):
        self.stoppers: List[Stopper] = sorted(stoppers, key=lambda s: int(s.order))

    def __len__(self) -> int:
        return len(self.stoppers)

    @property
    def ending_tokens(self) -> Optional[int]:  # type: ignore[override]
        total = 0
        for s in self.stoppers:
            if s.ending_tokens is None:
                return None
            total += s.ending_tokens
        return total

    def reset(self, prompt: Sequence[int]) -> None:
        for s in self.stoppers:
            s.reset(prompt)

    def check(self, output_tokens: Sequence[int]) -> Optional[StopReason]:
        for s in self.stoppers:
            if isinstance(s, CallbackStopper):          # the consumer's own code: its error is its own
                reason = s.check(output_tokens)
            else:
                reason = plugin_call(f"stopper {s.name!r}", "check(output_tokens)", s.check, output_tokens)
            if reason is not None:
                if not isinstance(reason, StopReason):
                    raise PluginError(f"stopper {s.name!r} returned {reason!r}, not a StopReason "
                                      f"(use StopReason('YOUR_REASON') for a reason of its own)")
                return reason
        return None

    def clone(self) -> "StopperChain":
        return StopperChain([s.clone() for s in self.stoppers])

    def per_sequence_rules(self) -> "StopperChain":
        """A chain of the same member objects without the consumer's rules."""
        return StopperChain([s for s in self.stoppers if s.per_sequence])


class CallbackStopper(Stopper):
    """generate_stream's ``on_token(token, position)``: returning False (Python's or numpy's, the
    result of a comparison with a numpy value) ends the request with CALLBACK_ABORT after that
    token; anything else (True, None, ...) goes on. Built by the engine from the entry point's
    argument (it is not a registered plugin: no config carries a callback)."""

    name = "callback"
    order = StopOrder.CONSUMER
    per_sequence = False
    ending_tokens = 0

    def __init__(self, on_token: Callable[[int, int], Any]):
        self.on_token = on_token
        self._prompt_len = 0

    def reset(self, prompt: Sequence[int]) -> None:
        self._prompt_len = len(prompt)

    def check(self, output_tokens: Sequence[int]) -> Optional[StopReason]:
        n = len(output_tokens)
        go_on = self.on_token(output_tokens[-1], self._prompt_len + n - 1)
        if go_on is False or (isinstance(go_on, np.bool_) and not go_on):
            return StopReason.CALLBACK_ABORT
        return None
