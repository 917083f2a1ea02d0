"""Grammar-constrained decoding: the mask stage of the processor chain, driven by llguidance
(tinyloop.runtime.grammar; the optional extra tinyloop[grammar]).

Per sequence the processor holds its own llguidance matcher (a copy of the grammar's template for
the model's tokenizer). ``accept`` feeds the matcher only tokens really emitted and at once starts
computing the NEXT mask: on a worker thread (llguidance releases the GIL while it computes) when
masks take long enough for that to pay, so the mask is ready by the time the forward of the next
token has produced its logits; inline when they are cheaper than the hand-over (INLINE_MASK_S, a
running mean per sequence). The processor is ``mask_only``: ``allowed_words`` hands the packed mask
as llguidance wrote it to greedy paths, which apply it where the logits live (the backend
capability token_masks); ``apply`` sets every token the grammar forbids to -inf on a host row
(sampling, processors that need the logits). EOS is allowed exactly when the grammar accepts, and
so are the model's extra_eos_ids (llguidance sees them as tokens with bytes, but they end the sequence)
(llguidance also offers EOS where no token can go on; the processor takes it away then, which is a
dead end). Ends: a mask that allows nothing ends the request with GRAMMAR_DEAD_END (raised as a
StopRequest from ``allowed_words`` / ``apply``, or from ``check`` when the matcher has entered its
error state); for a model without an EOS id, a complete grammar (only the virtual EOS allowed) ends
it with GRAMMAR_COMPLETE, at max_tokens too (``check`` looks at the next mask there, ahead of
MAX_TOKENS, which would say the output was cut). When llguidance itself failed (its error state
with a message other than its "no extension" dead end: a size limit met as the text grows, a
tokenizer that raised) the end is GRAMMAR_ERROR, with llguidance's message as a RuntimeWarning.
"""

from __future__ import annotations

import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np

from ...runtime.config import StopReason
from ...runtime.grammar import ll_vocab
from ...runtime.hookspecs import hookimpl
from ...runtime.processors import LogitProcessor, Stage
from ...runtime.stopping import StopOrder, Stopper, StopRequest

#: Workers computing masks (one mask job per live grammar sequence at a time).
_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tinyloop-grammar")
#: A mask that takes less than this (seconds, running mean) is computed inline: handing it to the
#: worker and back costs ~20-40 us of Python, more than such a mask saves by overlapping.
INLINE_MASK_S = 60e-6


class _Done:
    """A finished mask job (the inline path), with the Future interface apply() reads."""

    __slots__ = ("value",)

    def __init__(self, value) -> None:
        self.value = value

    def result(self):
        return self.value


class GrammarMask(LogitProcessor, Stopper):
    name = "grammar"
    mode = "grammar"
    compat = {"single": "ok", "batched": "ok", "speculative": "rejected", "tree_speculative": "rejected",
              "prefix_reuse": "ok", "warm_start": "ok"}
    stage = Stage.MASK
    order = StopOrder.PLUGIN
    argmax_invariant = False
    mask_only = True
    ending_tokens = None

    def __init__(self, grammar, max_tokens: Optional[int] = None) -> None:
        self.grammar = grammar
        self.max_tokens = max_tokens          # the request's: a complete grammar at it is no cut
        self.matcher = None
        self._future = None
        self._words = None
        self._V = 0                           # the model's vocabulary
        self._eos = 0                         # the EOS id llguidance uses (== _V: a virtual one)
        self._extra_eos = ()                  # the model's extra_eos_ids (they end a sequence too)
        self._mask_s = 0.0                    # running mean of the mask computation time
        self._error = False                   # the matcher refused a token: the StopReason, else False

    @classmethod
    def from_config(cls, config):
        return cls(config.grammar, config.max_tokens) if config.grammar is not None else None

    def prepare(self, model) -> None:
        """Compile (once per tokenizer) and take this sequence's matcher: a ConfigError for a
        grammar the tokenizer cannot express, before any allocation."""
        c = model.cfg
        self.matcher = self.grammar.matcher(model.tokenizer, c.vocab_size, c.eos_id)
        n, self._eos = ll_vocab(c.vocab_size, c.eos_id)
        self._V = c.vocab_size
        self._extra_eos = tuple(int(t) for t in getattr(c, "extra_eos_ids", ()) if 0 <= t < c.vocab_size)
        self._words = np.zeros((1, (n + 31) // 32), np.int32)     # written by llguidance

    def _compute(self) -> np.ndarray:
        t = time.perf_counter()
        w = self._words
        self.matcher.unsafe_compute_mask_ptr(w.ctypes.data, w.nbytes)      # releases the GIL
        self._mask_s = 0.8 * self._mask_s + 0.2 * (time.perf_counter() - t)
        return w[0]

    def _start(self) -> None:
        """Start the next mask: on the worker when masks are slow enough for the overlap with the
        forward to pay, else right here."""
        if self._mask_s < INLINE_MASK_S:
            self._future = _Done(self._compute())
        else:
            self._future = _POOL.submit(self._compute)

    def reset(self, prompt) -> None:
        if self._future is not None:
            self._future.result()
        self.matcher.reset()
        self._error = False
        self._start()

    def allowed_words(self) -> np.ndarray:
        words = self._future.result()
        bits = words.view(np.uint32)
        e, V = self._eos, self._V
        eos_bit = np.uint32(1 << (e & 31))
        accepting = None
        if bits[e >> 5] & eos_bit:
            accepting = self.matcher.is_accepting()
            if not accepting:
                bits[e >> 5] &= ~eos_bit     # llguidance offers EOS where nothing else can go on: a dead end
        for x in self._extra_eos:            # llguidance sees them as ordinary tokens (their bytes), but
            xb = np.uint32(1 << (x & 31))    # they end the sequence: only where the grammar accepts
            if bits[x >> 5] & xb:
                if accepting is None:
                    accepting = self.matcher.is_accepting()
                if not accepting:
                    bits[x >> 5] &= ~xb
        full, rest = divmod(V, 32)
        if not (bits[:full].any() or (rest and bits[full] & np.uint32((1 << rest) - 1))):
            if e == V and bits[e >> 5] & eos_bit:      # only the virtual EOS: the grammar is complete
                raise StopRequest(StopReason.GRAMMAR_COMPLETE)
            raise StopRequest(self._dead_end())
        return words

    def apply(self, logits: np.ndarray) -> None:
        within = np.unpackbits(self.allowed_words().view(np.uint8), count=self._V, bitorder="little")
        logits[within == 0] = -np.inf

    def accept(self, token: int) -> None:
        if self._future is not None:
            self._future.result()            # the mask job of this step has finished with the matcher
        self._error = not self.matcher.consume_token(int(token))
        if self._error:
            self._error = self._dead_end()
        else:
            self._start()

    def _dead_end(self) -> StopReason:
        """Why no token can follow: the grammar allows none (GRAMMAR_DEAD_END), or llguidance is in
        its error state (GRAMMAR_ERROR, e.g. a size limit such as a regex's huge repeat count,
        met lazily as the text grows; its message goes out as a RuntimeWarning)."""
        if not self.matcher.is_error():
            return StopReason.GRAMMAR_DEAD_END
        msg = (self.matcher.get_error() or "").strip().splitlines()
        if not msg or msg[0].startswith("NoExtension"):    # llguidance's own name for "no token fits"
            return StopReason.GRAMMAR_DEAD_END
        warnings.warn(f"the grammar engine (llguidance) stopped this request: {msg[0]}",
                      RuntimeWarning, stacklevel=2)
        return StopReason.GRAMMAR_ERROR

    def check(self, output_tokens) -> Optional[StopReason]:
        # touches the matcher only once the next mask job has finished with it (llguidance objects
        # are not shareable across threads while in use)
        if self._error:
            return self._error
        if (self._eos == self._V and self.max_tokens is not None and self._future is not None
                and len(output_tokens) >= self.max_tokens):
            # no EOS id: GRAMMAR_COMPLETE is the only sign of a finished output, which the next
            # step's mask would give; at max_tokens there is no next step, so look at it now
            # (ahead of MAX_TOKENS, which would say the output was cut)
            bits = self._future.result().view(np.uint32)
            V = self._V
            full, rest = divmod(V, 32)
            others = bits[:full].any() or (rest and bits[full] & np.uint32((1 << rest) - 1))
            if bits[V >> 5] & np.uint32(1 << (V & 31)) and not others and self.matcher.is_accepting():
                return StopReason.GRAMMAR_COMPLETE
        return None

    def clone(self) -> "GrammarMask":
        if self._future is not None:
            self._future.result()
        c = GrammarMask(self.grammar, self.max_tokens)
        c.matcher = self.matcher.deep_copy()
        c._V, c._eos, c._extra_eos = self._V, self._eos, self._extra_eos
        c._words = np.zeros_like(self._words)
        c._mask_s, c._error = self._mask_s, self._error
        c._start()
        return c


@hookimpl
def tinyloop_processors():
    return [GrammarMask]
