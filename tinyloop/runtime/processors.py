"""Logit processors and the chain that runs them.

Processing order, written once (the chain sorts processors by ``stage``):

1. ``Stage.PENALTY`` - history-based rescaling (repetition penalty), on raw logits.
2. ``Stage.MASK``    - constraint masks (grammar). A mask that would leave nothing allowed ends
   the request through the stop rules instead: the processor also derives from
   tinyloop.runtime.stopping.Stopper and returns GRAMMAR_DEAD_END (or a reason of its own) from
   ``check`` once its ``accept`` has seen the token that leads there.
3. The decoder's own selection, which is not a processor: greedy argmax, or
   temperature -> top-k -> top-p -> draw for sampling.

Interface (after llama.cpp's sampler chain): ``prepare(model)`` once per instance (model-dependent
setup and checks, before any allocation), ``reset(prompt)`` before decoding, ``apply(logits)``
in place, ``accept(token)`` only for tokens really emitted, ``clone()`` for forked sequences. A
processor that never changes which token is the argmax sets ``argmax_invariant`` so greedy paths
can skip it and keep the argmax on the device. A processor whose ``apply`` only forbids tokens
(sets them to -inf, leaves the others' bits alone) sets ``mask_only`` and gives the allowed set as
packed words from ``allowed_words()``: greedy paths then apply it where the logits live (the
backend capability ``token_masks``) instead of copying the logits row to the host.
"""

from __future__ import annotations

import enum
from typing import ClassVar, List, Mapping, Optional, Sequence

import numpy as np

from ..errors import PluginError
from .stopping import plugin_call


class Stage(enum.IntEnum):
    """Where a processor runs in the chain (see the module docstring)."""

    PENALTY = 10
    MASK = 20


class LogitProcessor:
    """Base class of processor plugins."""

    name: ClassVar[str] = ""
    """Unique plugin name."""
    mode: ClassVar[Optional[str]] = None
    """Row of configs/compat.yaml this processor provides."""
    compat: ClassVar[Mapping[str, str]] = {}
    """Declared compat cells; must equal the YAML row."""
    stage: ClassVar[Stage] = Stage.PENALTY
    """Where the processor runs in the chain."""
    argmax_invariant: ClassVar[bool] = False
    """True when apply() never changes the argmax (greedy paths may skip it)."""
    mask_only: ClassVar[bool] = False
    """True when apply() only sets forbidden tokens to -inf and allowed_words() gives that set."""

    @classmethod
    def from_config(cls, config) -> Optional["LogitProcessor"]:
        """An instance when `config` enables this processor, else None."""
        return None

    def prepare(self, model) -> None:
        """Model-dependent setup and checks (the model's tokenizer, vocabulary, EOS id), called on
        every instance before it is used and once at request validation, before any allocation:
        raise a TinyLoopError for a request this model cannot serve."""

    def reset(self, prompt: Sequence[int]) -> None:
        """Start a new sequence whose prompt is `prompt`."""

    def apply(self, logits: np.ndarray) -> None:
        """Transform one row of float32 logits in place (a processor that finds nothing allowed
        raises tinyloop.runtime.stopping.StopRequest with its reason)."""

    def accept(self, token: int) -> None:
        """Record a token that was really emitted."""

    def allowed_words(self) -> np.ndarray:
        """(``mask_only`` processors) The tokens apply() would leave as they are, for the pending
        step: an int32 array of ceil(vocab / 32) or more words, bit (i % 32) of word i // 32 set
        for an allowed token i; raises the StopRequest apply() would raise. A fresh array or one
        the processor keeps: the caller does not keep it past the step."""
        raise NotImplementedError(f"processor {self.name} offers no token mask")

    def clone(self) -> "LogitProcessor":
        """An independent copy with the same state."""
        raise NotImplementedError(f"processor {self.name} cannot be cloned")


def _call(p: LogitProcessor, hook: str, fn, *args):
    """A member's hook while decoding (stopping.plugin_call, naming the processor)."""
    return plugin_call(f"processor {p.name!r}", hook, fn, *args)


class ProcessorChain(LogitProcessor):
    """The chain is itself a processor: it applies its members in stage order. A member that
    raises while decoding (anything but a TinyLoopError or StopRequest) or returns what its hook
    does not is a PluginError naming it."""

    name = "chain"

    def __init__(self, processors: Sequence[LogitProcessor]):
        self.processors: List[LogitProcessor] = sorted(processors, key=lambda p: int(p.stage))

    @property
    def argmax_invariant(self) -> bool:  # type: ignore[override]
        return all(p.argmax_invariant for p in self.processors)

    @property
    def maskable(self) -> bool:
        """Every member leaves the argmax alone or is a mask: a greedy step needs only
        allowed_words() (and none of the logits on the host)."""
        return all(p.argmax_invariant or p.mask_only for p in self.processors)

    def allowed_words(self) -> Optional[np.ndarray]:
        """The intersection of the masks' allowed sets (None: no member masks)."""
        out = None
        for p in self.processors:
            if p.mask_only:
                w = _call(p, "allowed_words()", p.allowed_words)
                if not (isinstance(w, np.ndarray) and w.ndim == 1 and w.dtype == np.int32):
                    raise PluginError(f"processor {p.name!r}: allowed_words() returned {type(w).__name__} "
                                      f"{getattr(w, 'dtype', '')}, not a 1-D int32 numpy array of mask words")
                if out is None:
                    out = w
                else:
                    n = min(len(out), len(w))
                    out = out[:n] & w[:n]
        return out

    def __len__(self) -> int:
        return len(self.processors)

    def prepare(self, model) -> None:
        for p in self.processors:
            p.prepare(model)

    def reset(self, prompt: Sequence[int]) -> None:
        for p in self.processors:
            _call(p, "reset(prompt)", p.reset, prompt)

    def apply(self, logits: np.ndarray) -> None:
        for p in self.processors:
            r = _call(p, "apply(logits)", p.apply, logits)
            if r is not None and r is not logits:
                raise PluginError(f"processor {p.name!r}: apply(logits) returned {type(r).__name__}, which would be "
                                  f"dropped: it must change the row in place (and return None)")

    def accept(self, token: int) -> None:
        for p in self.processors:
            _call(p, "accept(token)", p.accept, token)

    def clone(self) -> "ProcessorChain":
        return ProcessorChain([p.clone() for p in self.processors])
