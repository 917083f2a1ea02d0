"""The engine: model lifecycle, request validation, the decode session and the stop loop.

Canonical decode state machine (generate / generate_stream / generate_iter):

1. Validate the request (ids, lengths, loops) and check it against configs/compat.yaml; resolve
   the decoder (its options, session and honoured fields), cache mode and processors
   (:class:`Plan`). Nothing is allocated before this passes.
2. Allocate a KV cache for prompt_len + max_tokens slots at the request's loop depth (the
   decoder's session may ask for more: ``extra_slots`` / ``extra_groups``).
3. The decoder drives the session: prefill, then per token: processors (penalty, mask) -> pick ->
   emit -> stop rules -> advance the cache with a one-token forward.
4. Stop rules, asked after each emitted token (tinyloop.runtime.stopping gives their order: the
   consumer's callback, EOS, stop sequences, plugins' own rules, max_tokens). The emitted token
   that triggers a stop is included in the output; a consumer that stops reading early is
   CALLBACK_ABORT.
5. The cache is released on every path.

Seams for decoder plugins (public, documented; nothing else in here is for other modules):
:class:`Plan` (what the session is built from), :class:`Session` (the base of a decoder's own
session: its constructor's ``extra_groups`` / ``extra_slots`` and the attributes it documents).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import threading
import time
import weakref
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..model.arch import ModelConfig
from .backend import Backend
from .cache import build_spec, linear_slots
from .compat import check_request
from .config import GenerateConfig, GenerateStats, StopReason, env_switch, numpy_int
from ..errors import (BackendError, ConfigError, IncompatibleModesError, InvalidInputError, ModelBusyError,
                      ModelFreedError, PluginError, TinyLoopError, TokenizerError)
from ..model.format import open_model
from ..model.tokenizer import Tokenizer, resolve_tokenizer
from ..models import model_path
from .forward import Forward
from .decoding import check_honoured, is_token, parse_options, raised_by_plugin_code
from .early_exit import ExitStep, resolve_exit
from .lockstep import LockstepBatch, lane_seed
from .plugins import get_plugin_manager
from .processors import ProcessorChain
from .sampling import request_uniforms, sample_token, uniform_at
from .stopping import CallbackStopper, Stopper, StopperChain, StopRequest

DEFAULT_PREFILL_CHUNK = 512
#: Environment switch: recompute the whole sequence for every token (the uncached reference path).
DISABLE_KV_CACHE_ENV = "TINYLOOP_DISABLE_KV_CACHE"


def kv_cache_disabled() -> bool:
    """TINYLOOP_DISABLE_KV_CACHE is set (to anything but "" or "0")."""
    return os.environ.get(DISABLE_KV_CACHE_ENV, "") not in ("", "0")


class Model:
    """A loaded .tinyloop model on one backend. Not reentrant: a second concurrent call raises
    ModelBusyError. Release with free_model().

    The backend takes a copy of every tensor it uses and the file is closed once loading ends, so
    the model never reads its file again: rewriting or truncating it later cannot affect it."""

    def __init__(self, path, max_seq_len: int, backend: str, prefill_chunk: int, tokenizer=None):
        path = model_path(path)
        # numpy integers are integers (np.bool_, like bool, is not one)
        max_seq_len = int(max_seq_len) if numpy_int(max_seq_len) else max_seq_len
        prefill_chunk = int(prefill_chunk) if numpy_int(prefill_chunk) else prefill_chunk
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int):
            raise ConfigError(f"max_seq_len must be an integer in [1, 1048576], got {max_seq_len!r}")
        if not 1 <= max_seq_len <= 1 << 20:
            raise ConfigError(f"max_seq_len={max_seq_len!r} is outside the allowed range [1, 1048576]")
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 0:
            what = "" if isinstance(prefill_chunk, int) and not isinstance(prefill_chunk, bool) else " an integer"
            raise ConfigError(f"prefill_chunk must be{what} >= 0 (0 = automatic), got {prefill_chunk!r}")
        if not (tokenizer is None or isinstance(tokenizer, Tokenizer)
                or (isinstance(tokenizer, str) and tokenizer)):
            raise ConfigError(f"tokenizer={tokenizer!r} must be None (the documented precedence), a tokenizer "
                              f"directory (vocab.json + merges.txt) or a tinyloop Tokenizer")
        entry = get_plugin_manager().backend_entry(backend)
        backend_cls = entry.load_class()
        self.path = path
        self.max_seq_len = max_seq_len
        self.file = open_model(path)
        self._lock = threading.Lock()
        self._freed = False
        self._free_pending = False          # free_model called while a request held the lock
        self._live_cache_bytes = 0
        self._live_handle_bytes = 0         # prefix caches, pool entries, resume handles (runtime.reuse)
        self._handles = weakref.WeakSet()   # ... themselves: released with the model
        self._tokenizer = None
        self.decoder_choices = {}           # loop depth -> the auto decoder's calibration (its own record)
        try:
            self.header = self.file.header
            self.cfg: ModelConfig = self.header.config
            if tokenizer is not None:
                self._tokenizer = self._resolve_tokenizer(tokenizer)
            self.backend: Backend = backend_cls(self.cfg, max_seq_len)
            if self.cfg.qkv_bias and type(self.backend).add_bias is Backend.add_bias:
                raise BackendError(f"the model has q/k/v biases (qkv_bias) and the {self.backend.name} "
                                   f"backend has no add_bias op to apply them")
            for init, op in (("zeros", "zero"), ("random", "init_state")):
                if self.cfg.loop_init == init and getattr(type(self.backend), op) is getattr(Backend, op):
                    raise BackendError(f"the model starts its loop from {init} (loop_init) and the "
                                       f"{self.backend.name} backend has no {op} op")
            self.weights = self.backend.load_weights(self.file)
            # the exit gate's (weight, bias) on the host, for the "gate" exit criterion
            self.exit_gate = ((np.array(self.file.logical("exit_gate"), np.float64),
                               float(self.file.logical("exit_gate_bias")[0])) if self.cfg.exit_gate else None)
            self.file.close()               # the backend holds copies (Backend.load_weights)
            rows = min(max_seq_len, prefill_chunk or DEFAULT_PREFILL_CHUNK)
            self.ws = self.backend.alloc_workspace(rows)
            self.fwd = Forward(self.cfg, self.backend, self.weights, self.ws)
        except BaseException:
            self._release()
            raise

    def _resolve_tokenizer(self, tokenizer=None) -> Tokenizer:
        if isinstance(tokenizer, Tokenizer):
            if tokenizer.vocab_size > self.cfg.vocab_size:
                raise TokenizerError(f"tokenizer {tokenizer!r} has ids up to {tokenizer.vocab_size - 1}, but the "
                                     f"model's vocab_size is {self.cfg.vocab_size}")
            return tokenizer
        return resolve_tokenizer(self.header.tokenizer, tokenizer, self.cfg.vocab_size)

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer: the one given to load_model, else by precedence
        TINYLOOP_TOKENIZER_DIR > the tokenizer embedded in the file > raw bytes (resolved on first
        use, then kept). ``model.tokenizer.encode(text)`` / ``.decode(ids)``."""
        if self._tokenizer is None:
            self._tokenizer = self._resolve_tokenizer()
        return self._tokenizer

    @property
    def backend_name(self) -> str:
        return self.backend.name

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def _release(self) -> None:
        for handle in list(getattr(self, "_handles", ())):
            handle._drop("released with its model (free_model)")
        # the weights and buffers go now, not with the last reference to this object (a caller's
        # list, a closed server that a framework cache keeps): every entry point refuses it anyway
        self.fwd = self.ws = self.weights = None
        be = getattr(self, "backend", None)
        if be is not None:
            be.free()
        self.file.close()
        self._freed = True

    def _check_live(self) -> None:
        if self._freed or self._free_pending:
            raise ModelFreedError(f"model {self.path!r} was freed; load it again")

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        free_model(self)


def load_model(path=None, max_seq_len: int = 2048, backend: str = "auto", prefill_chunk: int = 0,
               tokenizer=None) -> Model:
    """Load a .tinyloop file onto a backend ("auto" picks CUDA when a GPU is present, else CPU).

    `path` None or "demo" loads the shipped demo model. prefill_chunk bounds the rows of one
    forward launch (0 = min(max_seq_len, 512)); it sizes the activation buffer pool, which is
    allocated here once. `tokenizer`: a directory (vocab.json + merges.txt) or a Tokenizer to use
    for text prompts; None resolves ``model.tokenizer`` by the documented precedence."""
    return Model(path, max_seq_len, backend, prefill_chunk, tokenizer)


def free_model(model: Model) -> None:
    """Release the model's backend memory and file. Idempotent.

    While a request runs on the model (from another thread, from inside its on_token callback, or
    an unfinished generate_iter), the release is deferred: the request ends at its next token with
    ModelFreedError, frees its cache, and the model is released as it lets go (a generator that is
    never resumed lets go when it is closed or collected). Nothing is freed under a running op."""
    check_call(model)
    if model._freed:
        return
    # marked before the lock is tried: a request that lets go of the model after a failed try
    # sees the mark (_let_go) and releases the model, so the free is never lost in between
    model._free_pending = True
    if model._lock.acquire(blocking=False):
        _let_go(model)


def vram_usage_bytes(model: Model) -> int:
    """Bytes the model holds on its backend: weights + buffer pool + live KV caches + the kept
    state of its prefix caches, pool entries and resume handles (tinyloop.runtime.reuse)."""
    check_call(model)
    model._check_live()
    return model.backend.memory_bytes() + model._live_cache_bytes + model._live_handle_bytes


# --------------------------------------------------------------------------- validation
def encode_text(model: Model, text: str, start: bool = True) -> List[int]:
    """Token ids of a text prompt: ``model.tokenizer.encode(text)``, after the model's BOS id when
    it has one and the text starts a sequence (`start`; a continuation, such as the suffix after a
    prefix cache, gets none) and does not begin with the BOS token itself (a chat rendered by
    apply_chat_template(..., tokenize=False) writes it: one BOS, not two). The convention of
    `tinyloop run`, of transformers' tokenizers and of OpenAI-compatible servers; token-id prompts
    are always used as given."""
    ids = model.tokenizer.encode(text)
    bos = model.cfg.bos_id
    return [bos] + ids if start and bos is not None and ids[:1] != [bos] else ids


def _as_ids(tokens: Any, what: str, model: Optional[Model] = None, start: bool = True) -> List[int]:
    if isinstance(tokens, str) and model is not None:
        return encode_text(model, tokens, start)
    if isinstance(tokens, (str, bytes, bytearray)):
        raise InvalidInputError(f"{what} must be text (str) or a sequence of token ids, not "
                                f"{type(tokens).__name__}")
    try:
        arr = np.asarray(tokens)
    except Exception:
        raise InvalidInputError(f"{what} must be a sequence of integer token ids") from None
    listed = not isinstance(tokens, np.ndarray)
    if arr.ndim == 0 and listed:
        # not a sequence at all (numpy wrapped it whole): a generator, iterator, set, dict, number
        hint = ("; an iterator is read only once: pass list(...) of it" if isinstance(tokens, Iterator) else
                "; a set has no order" if isinstance(tokens, (set, frozenset)) else "")
        text = "text (str) or " if model is not None else ""
        raise InvalidInputError(f"{what} must be {text}a list / tuple / numpy array of token ids, got "
                                f"{type(tokens).__name__}{hint}")
    mixed = arr.size and arr.dtype.kind not in "iu"     # numpy made the list float or object
    if arr.ndim == 1 and listed:
        # name the element that is not a token id: a bool (numpy turns [5, True] into integers, and
        # it is refused as an all-bool list is) or what made the array float or object
        for i, t in enumerate(tokens):
            if isinstance(t, (bool, np.bool_)):
                raise InvalidInputError(f"{what}[{i}]={t!r} is a bool, not a token id (an integer)")
            if not mixed:
                continue
            if not isinstance(t, (int, np.integer)):
                raise InvalidInputError(f"{what}[{i}]={t!r} is not a token id: {what} must be a flat sequence "
                                        f"of integer token ids")
            if not -(1 << 63) <= t < (1 << 63):                 # beyond int64: beyond any vocabulary
                V = f"[0, {model.cfg.vocab_size})" if model is not None else "of the model"
                raise InvalidInputError(f"{what}[{i}]={t} is outside the vocabulary {V}")
        if mixed:
            return [int(t) for t in tokens]             # integers numpy mixed into floats (uint64, int)
    if arr.ndim != 1 or mixed:
        raise InvalidInputError(f"{what} must be a flat sequence of integer token ids, got dtype "
                                f"{arr.dtype} with shape {arr.shape}")
    return [int(t) for t in arr]


def check_vocab(model: Model, ids: Sequence[int], what: str) -> None:
    """Every id of `ids` (named `what` in the error) is inside the model's vocabulary."""
    V = model.cfg.vocab_size
    for i, t in enumerate(ids):
        if not 0 <= t < V:
            raise InvalidInputError(f"{what}[{i}]={t} is outside the vocabulary [0, {V})")


def check_model_window(model: Model, n: int, cache_window: int, what: str, hint: str = "") -> None:
    """A sequence of `n` positions fits a model with its own sliding window (ModelConfig
    .sliding_window = W) only within W, or under a window cache of at most W positions (which
    applies the model's span exactly); otherwise full causal attention would be wrong. `hint`
    replaces the error's advice (a path that takes no window cache says what to do instead)."""
    W = model.cfg.sliding_window
    if W and n > W and not 0 < cache_window <= W:
        hint = hint or (f"set cache_window={W} (or less) to decode it" if cache_window >= 0 else
                        "this path keeps no window cache")
        raise IncompatibleModesError(
            f"{what} spans {n} positions, past the model's sliding_window={W} (it attends to the "
            f"last {W} positions only); {hint}")


def validate_request(model: Model, prompt: Any, config: GenerateConfig, what: str = "prompt",
                     window_hint: str = "") -> List[int]:
    """Model-dependent checks of one request; returns the prompt as a list of ints. `window_hint`:
    the advice of check_model_window's error where the path takes no window cache."""
    ids = _as_ids(prompt, what, model)
    V = model.cfg.vocab_size
    if len(ids) < 1:
        raise InvalidInputError(f"{what}_len=0: a prompt needs at least 1 token")
    check_vocab(model, ids, what)
    if len(ids) + config.max_tokens > model.max_seq_len:
        raise InvalidInputError(
            f"{what}_len ({len(ids)}) + max_tokens ({config.max_tokens}) = {len(ids) + config.max_tokens} "
            f"exceeds max_seq_len={model.max_seq_len}")
    check_model_window(model, len(ids) + config.max_tokens, config.cache_window,
                       f"{what} + max_tokens" if config.max_tokens else what, window_hint)
    resolve_loops(model, config.loops)
    for i, seq in enumerate(config.stop_sequences):
        for t in seq:
            if t >= V:
                raise InvalidInputError(f"stop_sequences[{i}] holds {t}, outside the vocabulary [0, {V})")
    return ids


def resolve_loops(model: Model, loops: Optional[int]) -> int:
    L = model.cfg.default_loops if loops is None else loops
    if numpy_int(L):
        L = int(L)                      # a numpy integer is an integer (np.bool_ is not one)
    if isinstance(L, bool) or not isinstance(L, int):
        raise ConfigError(f"loops={L!r} must be an integer in [1, {model.cfg.max_loops}] (model.max_loops)")
    if not 1 <= L <= model.cfg.max_loops:
        # a config value out of range is a ConfigError wherever the range comes from (the model here)
        raise ConfigError(f"loops={L!r} is outside the allowed range [1, {model.cfg.max_loops}] "
                          f"(model.max_loops)")
    return L


class Plan:
    """Everything one request needs, resolved before any work: the seam between the engine and a
    decoder's session, which is built from it.

    Attributes a session may read: ``model``; ``context`` (the entry point's: single, batched);
    ``config`` (the request's GenerateConfig, after any hand-over by ``Decoder.resolve``);
    ``decoder_cls`` and ``options`` (its parsed options, None for decoders without); ``loops``
    (the loop depth the cache is laid out for); ``cache_mode`` (the CacheMode class) and
    ``slot_mode`` (the slot-map plugin instance, None: linear).

    Checks, in order (each raises a TinyLoopError subclass): the decoder is registered; the
    request against its compat column (the decoder's ``compat_context`` or the entry point's);
    the decoder runs in this entry point; its options parse; every field the request sets is one
    the decoder honours; no processor is active under a decoder that does not apply them; the
    decoder's own ``validate``; the cache mode, codecs and slot map; the loop depth."""

    def __init__(self, model: Model, config: GenerateConfig, context: str, reuse: Optional[str] = None):
        model._check_live()
        self.model, self.context = model, context
        #: milliseconds the entry point spent on the request before decoding (checks, this plan, a
        #: grammar's compile): GenerateStats.first_token_ms counts from the call's entry (set_up)
        self.setup_ms = 0.0
        #: the compat column of the state the request starts from (prefix_reuse, warm_start), checked
        #: besides the decoder's; `seed` fills the cache from that state (Session.start)
        self.reuse, self.seed = reuse, None
        self._resolve(config)

    def _resolve(self, config: GenerateConfig) -> None:
        model, context = self.model, self.context
        pm = get_plugin_manager().snapshot()     # the request runs with the plugins it is checked against
        dec = pm.decoder_for(config)
        # the decoder's column and the kept state's, both before any `partial` warning
        check_request((dec.compat_context or context,) + ((self.reuse,) if self.reuse is not None else ()),
                      config)
        if self.reuse is not None:
            if not model.backend.supports("cache_reuse"):
                raise BackendError(f"{self.reuse} needs the backend capability 'cache_reuse', which the "
                                   f"{model.backend.name} backend does not provide")
            if kv_cache_disabled():
                raise IncompatibleModesError(
                    f"{DISABLE_KV_CACHE_ENV}={os.environ[DISABLE_KV_CACHE_ENV]!r} asks for the uncached "
                    f"reference path, which recomputes every position; {self.reuse} starts from kept cache "
                    f"state (unset it, or call generate for the reference)")
        if dec.mode is None and context not in dec.contexts:
            raise PluginError(f"decoder {dec.name!r} does not run in {context} decoding "
                              f"(it declares {sorted(dec.contexts)})")
        options = parse_options(dec, config.options, pm.decoders())
        check_honoured(dec, config)
        processors = pm.processors_for(config)
        for proc in processors:
            proc.prepare(model)                 # model-dependent checks (a grammar's tokenizer), no allocation
        if not dec.applies_processors:
            active = [p.name for p in processors]
            if active:
                raise PluginError(f"decoder {dec.name!r} does not run logit processors (active: {active}); "
                                  f"its tokens do not come through the processor chain, so they would be "
                                  f"silently skipped")
        missing = sorted(set(dec.requires) - model.backend.capabilities)
        if missing:
            raise BackendError(f"decoder {dec.name!r} needs the backend capabilities {missing}, which the "
                               f"{model.backend.name} backend does not provide (it has "
                               f"{sorted(model.backend.capabilities)})")
        dec.validate(model, config, options)
        self.cache_mode = pm.cache_mode_for(config)
        self.slot_mode = pm.slot_map_for(config)
        self._check_codecs(model, pm)
        self.loops = resolve_loops(model, dec.depth(config, options))
        #: the request's early exit (tinyloop.runtime.early_exit.ExitPlan), None without
        self.exit = resolve_exit(model, config, self.loops, pm.exit_criteria())
        self.config, self.decoder_cls, self.options = config, dec, options
        self.session_factory = dec.session_class or Session
        self._pm = pm

    def cache_spec(self, loops: int, slots, extra_groups: Tuple[str, ...] = ()):
        """The spec of a cache of this request (`loops` iterations, slot map `slots`): its cache
        mode's groups, allocated with the KV codec classes the request resolved (``codecs``)."""
        return build_spec(self.model.cfg, loops, self.cache_mode, slots, extra_groups, self.codecs)

    def _check_codecs(self, model: Model, pm) -> None:
        """Every layer group's codec is registered and implemented by the model's backend, and the
        slot map fits the model (before anything is allocated)."""
        #: the request's KVCodec classes by name (its caches are allocated with these: CacheSpec.codecs)
        self.codecs = {}
        for group in ("pre", "post", "draft_post", "loop"):
            codec = pm.codec(self.cache_mode.group_codec(group))
            codec.impl(model.backend.codec_key)
            self.codecs[codec.name] = codec
        if self.slot_mode is not None:
            self.slot_mode.validate(model.max_seq_len)

    def delegate(self) -> None:
        """Let a resolving decoder (Decoder.resolve) hand the request to another decoder; call after
        the request is validated. The new request is checked like one of its own."""
        target = self.decoder_cls.resolve(self.model, self.config, self.context)
        if target is None:
            return
        if not isinstance(target, GenerateConfig):
            raise PluginError(f"decoder {self.decoder_cls.name!r}.resolve returned {target!r}, not a GenerateConfig")
        decs = get_plugin_manager().decoders()
        if target.decoder not in decs:
            raise PluginError(f"decoder {self.decoder_cls.name!r} delegated to {target.decoder!r}, which is not "
                              f"registered")
        self._resolve(target)

    def new_processors(self) -> ProcessorChain:
        """A fresh processor chain for one sequence of this request (prepared for the model)."""
        chain = ProcessorChain(self._pm.processors_for(self.config))
        chain.prepare(self.model)
        return chain

    def new_stoppers(self, prompt: Sequence[int], chain: ProcessorChain,
                     consumer: Sequence[Stopper] = ()) -> StopperChain:
        """The stop rules of one sequence: the registered ones the request needs and the
        consumer's (reset here with `prompt`), and the processors of `chain` that are also
        stoppers (reset with the chain)."""
        rules = self._pm.stoppers_for(self.config, self.model.cfg) + list(consumer)
        for r in rules:
            r.reset(prompt)
        return StopperChain(rules + [p for p in chain.processors if isinstance(p, Stopper)])

    def new_decoder(self):
        """The decoder instance for one sequence."""
        return self.decoder_cls(self.config, self.options)




# --------------------------------------------------------------------------- session
def _nbytes(cache) -> int:
    return int(getattr(cache, "nbytes", 0))


class Session:
    """The decode session a decoder drives (tinyloop.runtime.decoding.DecodeSession).

    Lanes: a session holds one decode state (lane 0) unless a decoder asks for more with
    fork_pool(n). Each lane has its own KV cache, token list and position; the lane in use keeps its
    state in ``cache`` / ``tokens`` / ``position`` (what ``_run`` reads), the others are parked.
    The workspace is shared, so the pending logits are those of the lane started or advanced last.

    Subclassing (a decoder's ``session_class``): the constructor is called as
    ``cls(model, prompt, plan, chain, stats)``; a subclass passes ``extra_groups`` (cache layer
    groups of n_post layers besides pre | post | loop, e.g. a draft's post blocks) and
    ``extra_slots`` (positions past prompt + max_tokens) up. It may use ``model`` (its
    ``backend``, ``fwd`` and ``ws``), ``plan``, ``options``, ``loops``, ``cache`` (the lane in
    use's), ``tokens``, ``position``, ``stats`` and ``chain``, and must leave the position at the
    number of tokens whose K/V are final."""

    def __init__(self, model: Model, prompt: List[int], plan: Plan, chain: ProcessorChain,
                 stats: GenerateStats, extra_groups: tuple = (), extra_slots: int = 0):
        self.model, self.config, self.loops = model, plan.config, plan.loops
        self.plan, self.options = plan, plan.options
        self.stoppers = StopperChain([])        # the engine sets the request's per-sequence rules
        self.vocab_size = model.cfg.vocab_size
        self.eos_id = model.cfg.eos_id
        self.eos_ids = model.cfg.eos_ids
        self.tokens = list(prompt)
        self.position = 0                       # tokens whose K/V are in the cache
        self.chain = chain
        self.stats = stats
        self.uncached = kv_cache_disabled()
        n_positions = len(prompt) + plan.config.max_tokens + extra_slots
        # rows per forward launch: the workspace's, or fewer where the slot map asks (a window)
        self.launch_rows = model.ws.rows
        if plan.slot_mode is not None:
            self.launch_rows = plan.slot_mode.launch_rows(model.ws.rows)
            slots = plan.slot_mode.slot_map(n_positions, max(self.launch_rows, extra_slots))
        else:
            slots = linear_slots(n_positions)
        self.spec = plan.cache_spec(self.loops, slots, extra_groups)
        self.cache = model.backend.alloc_cache(self.spec)
        model._live_cache_bytes += self.cache_bytes
        self._buf = np.zeros(self.vocab_size, np.float32)
        self._prompt_len = len(prompt)
        self._lane = 0                          # the lane whose state is in cache/tokens/position
        self._parked: List[Optional[list]] = [None]   # [cache, tokens, position] of the other lanes
        self._logits_lane: Optional[int] = 0    # the lane whose logits are pending (None: stale)
        # greedy(ahead=True): the token returned whose decode step already runs (None: none)
        self._ahead: Optional[int] = None
        self._lookahead = env_switch("TINYLOOP_LOOKAHEAD")
        # what does not change during a request, asked once instead of at every token: may a
        # greedy(ahead=True) step be queued before its token is read (device chaining), may a
        # draw run on the device (None: not asked yet)
        self._chains_ahead = (self._lookahead and model.backend.supports("device_chaining")
                              and not self.uncached)
        self._draws_on_device: Optional[bool] = None
        # sample(): the request's uniform numbers (made at the first draw), and whether the token
        # slot behind each forward holds the device's draw instead of the argmax
        self._uniforms: Optional[np.ndarray] = None
        self._device_draw = False
        #: early exit: the step runner, the depth each decoded position ran (position -> depth,
        #: replayed by the uncached path) and the depth behind the pending logits
        self._exit = ExitStep(self, plan.exit) if getattr(plan, "exit", None) is not None else None
        self._depths = {}
        self.logits_depth = self.loops

    def close(self) -> None:
        """Hand every lane's cache back to the backend (idempotent)."""
        self._settle()
        caches = [self.cache] + [p[0] for p in self._parked if p is not None]
        self.cache = None
        for p in self._parked:
            if p is not None:
                p[0] = None
        for c in caches:
            if c is not None:
                self.model._live_cache_bytes -= _nbytes(c)
                self.model.backend.release_cache(c)

    # ------------------------------------------------------------------ lanes
    @property
    def lanes(self) -> int:
        """Decode states this session holds (1 until fork_pool)."""
        return len(self._parked)

    def fork_pool(self, n: int) -> None:
        """Hold n lanes in all: allocate the caches of lanes ``lanes .. n-1`` now, before decoding
        (counted in vram_usage_bytes, released by close()). A new lane holds the prompt with nothing
        cached; copy_state fills it from another lane."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PluginError(f"fork_pool(n={n!r}): n must be an integer >= 1")
        if self.cache is None:
            raise PluginError("fork_pool on a closed session")
        self._settle()
        spec = self.cache.spec        # a reused cache may hold more slots: lanes match it
        while len(self._parked) < n:
            cache = self.model.backend.alloc_cache(spec)
            self.model._live_cache_bytes += _nbytes(cache)
            self._parked.append([cache, self.tokens[:self._prompt_len], 0])

    def _check_lane(self, lane: int) -> None:
        if isinstance(lane, bool) or not isinstance(lane, (int, np.integer)) or not 0 <= lane < len(self._parked):
            raise PluginError(f"lane={lane!r} is outside the session's lanes [0, {len(self._parked)}) "
                              f"(fork_pool(n) adds lanes)")

    def _select(self, lane: int) -> None:
        """Make `lane` the one whose state _run reads and writes."""
        self._check_lane(lane)
        self._parked[self._lane] = [self.cache, self.tokens, self.position]
        self.cache, self.tokens, self.position = self._parked[lane]
        self._parked[lane] = None
        self._lane = int(lane)

    def _state(self, lane: int) -> list:
        if lane == self._lane:
            return [self.cache, self.tokens, self.position]
        return self._parked[lane]

    def lane_tokens(self, lane: int = 0) -> List[int]:
        """A copy of lane `lane`'s tokens (prompt + generated)."""
        self._check_lane(lane)
        return list(self._state(lane)[1])

    def copy_state(self, dst: int, src: int) -> None:
        """Make lane `dst` a copy of lane `src`: its KV cache (every layer, the cached slots), token
        list and position. `dst`'s pending logits, if any, become stale."""
        self._settle()
        self._check_lane(dst)
        self._check_lane(src)
        if dst == src:
            return
        dcache = self._state(dst)[0]
        scache, stokens, spos = self._state(src)
        self.model.backend.copy_cache(dcache, scache, spos)
        if dst == self._lane:
            self.tokens, self.position = list(stokens), spos
        else:
            self._parked[dst][1:] = [list(stokens), spos]
        if self._logits_lane == dst:
            self._logits_lane = None

    def _check_pending(self, lane: int) -> None:
        if lane != self._logits_lane:
            whose = "stale" if self._logits_lane is None else f"lane {self._logits_lane}'s"
            raise PluginError(f"the pending logits are not lane {lane}'s (they are {whose}); read a "
                              f"lane's logits right after start() or advance(token, lane)")

    def _run(self, start: int, stop: int) -> None:
        """Forward tokens[start:stop] in chunks; the last row's logits (and their argmax, started on
        the device) are pending in ws.logits[0]. A one-token step is a fixed op sequence that the
        backend may capture once and replay (positions and ids live in backend buffers)."""
        be, ws = self.model.backend, self.model.ws
        rows = self.launch_rows
        # early exit: prompt positions run at full depth, generated ones through the exit step
        plain = stop if self._exit is None else min(stop, max(start, self._prompt_len))
        for a in range(start, plain, rows):
            T = min(rows, plain - a)
            b = a
            for n in be.row_pieces(T):
                ids = be.set_ids(ws, self.tokens[b:b + n])
                pos = be.positions(b)
                last = b + n == stop
                if n == 1 and last:
                    self._one_token_step(ids, pos)
                else:
                    self._rows_forward(ids, pos, n, last)
                b += n
            self.stats.loop_iters_run += self.loops
            self.logits_depth = self.loops
        for p in range(plain, stop):
            # the last position probes; earlier ones (the uncached path) replay their recorded depth
            depth = self._exit.step(be.set_ids(ws, self.tokens[p:p + 1]), be.positions(p),
                                    forced=None if p == stop - 1 else self._depths[p])
            self._depths[p] = depth
            self.stats.loop_iters_run += depth
            self.logits_depth = depth
        self.position = stop

    def _rows_forward(self, ids, pos, n: int, last: bool) -> None:
        """The forward of n prompt rows at `pos` (backend buffers), with the last row's logits and
        token choice when they end the prompt: a fixed op sequence per (n, loops, cache, last), which
        the backend may capture once and replay."""
        fwd = self.model.fwd

        def rows_forward(ids=ids, pos=pos):
            fwd.forward(ids, pos, n, self.cache, self.loops)
            if last:
                fwd.logits(n - 1, 1)
                self._launch_pick(pos, n)
        key = ("rows", n, self.loops, self.cache, last, last and self._device_draw)
        self.model.backend.replay(key, rows_forward, step=False)

    def _launch_pick(self, pos, T: int) -> None:
        """Queue the token choice behind the pending logits (row 0 of a T-row launch at `pos`):
        the argmax, or the device's draw once sample() turned it on."""
        be = self.model.backend
        if self._device_draw:
            be.launch_sample(self.model.ws, pos, T)
        else:
            be.launch_argmax(self.model.ws)

    def _one_token_step(self, ids, pos) -> None:
        """The decode step of one token (ids and pos: backend buffers), captured once per (loops,
        cache, token choice) and replayed: forward, logits, argmax (or draw) started, position
        advanced on the device."""
        be, fwd = self.model.backend, self.model.fwd

        def one_token_step(ids=ids, pos=pos):
            fwd.forward(ids, pos, 1, self.cache, self.loops)
            fwd.logits(0, 1)
            self._launch_pick(pos, 1)
            be.advance_position(pos)
        be.replay(("sample_step" if self._device_draw else "step", self.loops, self.cache), one_token_step)

    def _settle(self) -> None:
        """Drop a look-ahead step nobody advanced into: its K/V sit past `position` (overwritten
        when that slot is next decoded), the device position is the backend's to re-upload (its
        mirror knows the value moved), and the pending logits are the look-ahead's, so stale."""
        if self._ahead is not None:
            self._ahead = None
            self._logits_lane = None
            if self._exit is not None:
                self._exit.pending = False      # the dropped step's depth is never read

    def start(self) -> None:
        """Prefill the prompt of the lane in use (lane 0 unless a lane was advanced before). A
        request that starts from kept state (``plan.seed``: a prefix cache, a resume handle) has
        the seed copy the first positions' K/V into the cache; only the rest is computed."""
        t = time.perf_counter()
        reused = 0
        if self.plan.seed is not None:
            reused = self.plan.seed.fill(self)
            self.stats.reused_tokens = reused
        self._run(reused, len(self.tokens))
        self._logits_lane = self._lane
        self.stats.prefill_ms = (time.perf_counter() - t) * 1e3

    def advance(self, token: int, lane: int = 0) -> None:
        if self._ahead is not None:
            if lane == self._lane and int(token) == self._ahead:
                # greedy(ahead=True) already started this step: only the host state catches up
                self._ahead = None
                self.tokens.append(int(token))
                self.position = len(self.tokens)
                if self._exit is None:          # an early-exit step's depth is counted once read
                    self.stats.loop_iters_run += self.loops
                self._logits_lane = self._lane
                return
            self._settle()
        if lane != self._lane:
            self._select(lane)
        self.tokens.append(int(token))
        self._run(0 if self.uncached else self.position, len(self.tokens))
        self._logits_lane = self._lane

    def logits(self, lane: int = 0) -> np.ndarray:
        if self._ahead is not None:
            raise PluginError("logits() after greedy(ahead=True): the pending logits are the next "
                              "step's; a decoder that reads logits must not ask for look-ahead")
        self._check_pending(lane)
        self._resolve_depth()
        np.copyto(self._buf, self.model.backend.logits_to_host(self.model.ws, 0))
        self.chain.apply(self._buf)
        return self._buf

    def greedy(self, lane: int = 0, ahead: bool = False) -> int:
        """The greedy token of the pending logits. With `ahead` the caller promises that its next
        call is advance(that token, lane) or nothing (the engine may stop): where the backend keeps
        the argmax on the device, the decode step of that token is queued before the token is read
        back, so the device never waits for the host between steps (the step is dropped, unseen,
        if the promise is not kept). A chain whose only argmax-changing members are masks
        (ProcessorChain.maskable) takes the same path on a backend with token_masks: the mask goes
        to the device, the masked argmax is read back."""
        if self._ahead is not None and lane == self._lane:
            return self._ahead
        self._check_pending(lane)
        be, ws = self.model.backend, self.model.ws
        if not self.chain.argmax_invariant:
            if not (self.chain.maskable and be.supports("token_masks")):
                return int(np.argmax(self.logits(lane)))
            # only masks change the argmax: apply them where the logits live (a StopRequest from
            # a mask comes before anything is queued)
            be.launch_masked_argmax(ws, self.chain.allowed_words())
        elif self._device_draw:
            # the token slot holds the device's draw: take the argmax now, and queue no sampling
            # step ahead of it
            be.launch_argmax(ws)
            ahead = False
        return self._take_token(lane, ahead)

    def sample(self, lane: int = 0, ahead: bool = False) -> int:
        """The token tinyloop.runtime.sampling.sample_token draws from the processed pending logits
        with the request's temperature, top_k and top_p and uniform number i of the request's
        stream (``sampling.uniforms(sample_seed, max_tokens)``) for its i-th generated token.
        Where the backend has device_sampling, the chain is empty, early exit is off and top_k
        fits the device draw, the draw runs where the logits live and only the token crosses
        (``TINYLOOP_DEVICE_SAMPLING=0``: always on the host); `ahead` then means what it means for
        greedy(): the next step is queued before the token is read."""
        if self._ahead is not None and lane == self._lane:
            return self._ahead
        self._check_pending(lane)
        c = self.config
        if self._uniforms is None:
            self._uniforms = request_uniforms(c)
        be, ws = self.model.backend, self.model.ws
        if not (self._device_draw or self._device_draw_ok(lane)):
            u = uniform_at(self._uniforms, len(self.tokens) - self._prompt_len)
            return sample_token(self.logits(lane), c.temperature, c.top_k, c.top_p, u)
        if not self._device_draw:
            # the first device draw of the request: load it, then draw for the pending logits,
            # which were computed with their argmax; every later forward draws as it finishes
            be.load_sampler(ws, c.temperature, c.top_k, c.top_p, self._uniforms, self._prompt_len)
            self._device_draw = True
            be.launch_sample(ws, be.positions(len(self.tokens) - 1), 1)
        return self._take_token(lane, ahead)

    def _device_draw_ok(self, lane: int) -> bool:
        be, c = self.model.backend, self.config
        if self._draws_on_device is None:
            self._draws_on_device = be.supports("device_sampling") and env_switch("TINYLOOP_DEVICE_SAMPLING")
        return (self._draws_on_device and len(self.chain) == 0
                and self._exit is None and self.lanes == 1 and lane == self._lane
                and min(c.top_k, self.vocab_size) <= be.sample_kmax and 0.0 < c.temperature <= 1e200)

    def _take_token(self, lane: int, ahead: bool) -> int:
        """Read the token the device chose for the pending logits (argmax or draw); with `ahead`
        (and a backend that chains on the device) queue its decode step first."""
        be, ws = self.model.backend, self.model.ws
        generated = len(self.tokens) - self._prompt_len + 1      # counting the token read now
        exit_ = self._exit
        if not (ahead and self._chains_ahead
                and (exit_ is None or exit_.guarded()) and lane == self._lane
                and generated < self.config.max_tokens):
            self._resolve_depth()
            return be.read_argmax(ws)
        # early exit: the depth of the step behind these logits is copied out before the next
        # step is queued (which resets it), and lands with the token
        pending = exit_ is not None and exit_.begin_pending()
        be.begin_read_argmax(ws)
        if exit_ is None:
            self._one_token_step(be.device_token(ws), be.positions(len(self.tokens)))
        else:
            exit_.queue(be.device_token(ws), be.positions(len(self.tokens)))
        self._ahead = be.finish_read_argmax(ws)
        if pending:
            self._record_depth(exit_.account(be.queued_exit_depth()))
        self._logits_lane = None
        return self._ahead

    def _record_depth(self, depth: int) -> None:
        """Early exit: the depth of the step of the last advanced token, read after the fact."""
        self._depths[len(self.tokens) - 1] = depth
        self.stats.loop_iters_run += depth
        self.logits_depth = depth

    def _resolve_depth(self) -> None:
        """Early exit: wait for a queued step's depth before its logits are used."""
        if self._exit is not None:
            depth = self._exit.read_pending()
            if depth is not None:
                self._record_depth(depth)

    @property
    def cache_bytes(self) -> int:
        """Bytes of the lane in use's cache (all lanes: vram_usage_bytes)."""
        return _nbytes(self.cache)


def _clear_stats(stats: GenerateStats) -> None:
    """Every field of `stats` back to its default: a GenerateStats describes one call, also when
    the caller passes the same object again (the counters and token_loops would add up). Lists are
    replaced by new ones, so a list the caller kept from the earlier call keeps that call's values."""
    for f in dataclasses.fields(stats):
        setattr(stats, f.name, f.default_factory() if f.default_factory is not dataclasses.MISSING
                else f.default)


def _decode(model: Model, prompt: List[int], plan: Plan, stats: GenerateStats,
            consumer: Sequence[Stopper] = ()) -> Iterator[int]:
    """The stop loop around a decoder; the caller has validated everything and holds the lock.
    `consumer`: the entry point's own stop rules (generate_stream's callback)."""
    config = plan.config
    t0 = time.perf_counter()
    _clear_stats(stats)
    stats.loops_used = plan.loops
    stats.decoder = plan.decoder_cls.name
    if config.max_tokens == 0:
        stats.stop_reason = StopReason.MAX_TOKENS
        return
    chain = plan.new_processors()
    chain.reset(prompt)
    stoppers = plan.new_stoppers(prompt, chain, consumer)
    out: List[int] = []
    V = model.cfg.vocab_size
    t_first = None
    session = plan.session_factory(model, prompt, plan, chain, stats)
    session.stoppers = stoppers.per_sequence_rules()
    gen = None
    try:
        gen = plan.new_decoder().decode(session)
        for tok in _until_stop_request(gen, stats, plan.decoder_cls.name):
            if not is_token(tok, V):
                raise PluginError(f"decoder {plan.decoder_cls.name!r} produced {tok!r}, not a token id in "
                                  f"[0, {V})")
            tok = int(tok)
            out.append(tok)
            if session._exit is not None:
                stats.token_loops.append(session.logits_depth)
            chain.accept(tok)
            stats.tokens_emitted = len(out)
            if t_first is None:
                t_first = time.perf_counter()
                stats.first_token_ms = plan.setup_ms + (t_first - t0) * 1e3   # from the call's entry
            reason = stoppers.check(out)
            if model._free_pending:
                stats.stop_reason = StopReason.CALLBACK_ABORT
                raise ModelFreedError(f"free_model({model.path!r}) was called while this request ran: the "
                                      f"request ended after {len(out)} tokens and the model is released")
            if reason is not None:
                stats.stop_reason = reason
            yield tok
            if reason is not None:
                break
        else:
            stats.stop_reason = stats.stop_reason or StopReason.MAX_TOKENS
    finally:
        if gen is not None:
            gen.close()
        if stats.stop_reason is None:
            stats.stop_reason = StopReason.CALLBACK_ABORT
        if t_first is not None:
            if plan.decoder_cls.emits_after_search:    # the search ran before the first token
                stats.decode_ms = max(0.0, (time.perf_counter() - t0) * 1e3 - stats.prefill_ms)
            else:
                stats.decode_ms = (time.perf_counter() - t_first) * 1e3
        session.close()
        if stats.token_loops:
            stats.loops_used = sum(stats.token_loops) / len(stats.token_loops)
        stats.finalize()
        model.backend.report(stats)


def _until_stop_request(tokens: Iterator[int], stats: GenerateStats, decoder: str = "") -> Iterator[int]:
    """The decoder's tokens until it (or a processor it ran) raises StopRequest: that ends the
    request with the request's reason. Anything else its own code raises but a TinyLoopError is
    a PluginError naming the decoder (what tinyloop raises under it comes out as it is)."""
    while True:
        try:
            tok = next(tokens)
        except StopIteration:
            return
        except StopRequest as stop:
            stats.stop_reason = stop.reason
            return
        except TinyLoopError:
            raise
        except Exception as exc:
            if not raised_by_plugin_code(exc):      # the engine's own failure under the decoder
                raise
            raise PluginError(f"decoder {decoder!r}: decode(session) raised {type(exc).__name__}: {exc}") from exc
        yield tok


class _RequestLock:
    """The model's lock held by one request; release() also carries out a free_model that was
    deferred while the request ran."""

    def __init__(self, model: Model):
        self.model = model

    def release(self) -> None:
        _let_go(self.model)


def _let_go(model: Model) -> None:
    """Release the model's lock (held by the caller), carrying out a free_model that marked the
    model meanwhile. Looked at again once the lock is released: a free_model whose try of the lock
    failed just before that marked the model after the first look, and nobody else would see it."""
    try:
        if model._free_pending and not model._freed:
            model._release()
    finally:
        model._lock.release()
    if model._free_pending and not model._freed and model._lock.acquire(blocking=False):
        try:
            if not model._freed:
                model._release()
        finally:
            model._lock.release()


def _locked(model: Model) -> _RequestLock:
    model._check_live()
    if not model._lock.acquire(blocking=False):
        raise ModelBusyError(f"model {model.path!r} is already running a request; models are not "
                             f"reentrant (use one model per worker or a lock)")
    if model._freed or model._free_pending:
        _let_go(model)                  # a free_model that found the lock taken by this call
        raise ModelFreedError(f"model {model.path!r} was freed; load it again")
    return _RequestLock(model)


def check_call(model: Any, config: Any = None, stats: Any = None, on_token: Any = None,
               config_cls: type = GenerateConfig) -> None:
    """The argument types every public entry point shares (InvalidInputError / ConfigError naming
    the argument), checked before any work."""
    if not isinstance(model, Model):
        raise InvalidInputError(f"model must be a Model from tinyloop.load_model, got {type(model).__name__} "
                                f"{model!r:.80}")
    if config is not None and not isinstance(config, config_cls):
        raise ConfigError(f"config must be a {config_cls.__name__} (or None for the defaults), got "
                          f"{type(config).__name__} {config!r:.80}")
    if stats is not None and not isinstance(stats, GenerateStats):
        raise InvalidInputError(f"stats must be a GenerateStats (or None), got {type(stats).__name__}")
    if on_token is not None and not callable(on_token):
        raise InvalidInputError(f"on_token must be a callable on_token(token, position) -> bool (or None), "
                                f"got {type(on_token).__name__}")
    if on_token is not None:
        # a callable that cannot take (token, position) would fail after the prefill, inside the loop
        try:
            # the callable itself, not what a decorator wrapped (functools.wraps sets __wrapped__):
            # it is the callable that is called
            sig = inspect.signature(on_token, follow_wrapped=False)
        except (TypeError, ValueError):     # no signature to read (some builtins): it is called as given
            sig = None
        if sig is not None:
            try:
                sig.bind(0, 0)
            except TypeError as exc:
                name = getattr(on_token, "__qualname__", type(on_token).__name__)
                raise InvalidInputError(f"on_token must be callable as on_token(token, position), but "
                                        f"{name}{sig} cannot take those two arguments ({exc})") from None


def set_up(plan: Plan, t_entry: float) -> Plan:
    """Record on `plan` the time its entry point has spent since `t_entry` (its call's entry, a
    time.perf_counter()) on the request's set-up: the spec's first_token_ms runs "from call entry
    to first token emitted", so _decode adds it. A generate_iter consumer's wait before its first
    next() is not set-up and is not counted."""
    plan.setup_ms = (time.perf_counter() - t_entry) * 1e3
    return plan


def _prepare(model: Model, prompt: Sequence[int], config: Optional[GenerateConfig], context: str,
             stats: Any = None, on_token: Any = None):
    """Every check of a single request, before any work: (validated ids, plan)."""
    t_entry = time.perf_counter()
    check_call(model, config, stats, on_token)
    config = config or GenerateConfig()
    plan = Plan(model, config, context)
    ids = validate_request(model, prompt, config)
    plan.delegate()
    return ids, set_up(plan, t_entry)


def generate_iter(model: Model, prompt: Sequence[int], config: Optional[GenerateConfig] = None,
                  stats: Optional[GenerateStats] = None) -> Iterator[int]:
    """Yield generated token ids one at a time (the prompt is not repeated).

    Validation and the compat check run immediately, before the first ``next()``; closing the
    generator early stops decoding (stop_reason CALLBACK_ABORT) and frees the cache."""
    ids, plan = _prepare(model, prompt, config, "single", stats)
    stats = stats if stats is not None else GenerateStats()
    return _iter_locked(model, ids, plan, stats)


def _iter_locked(model, ids, plan, stats, consumer=()):
    lock = _locked(model)
    try:
        yield from _decode(model, ids, plan, stats, consumer)
    finally:
        lock.release()


def generate_stream(model: Model, prompt: Sequence[int], config: Optional[GenerateConfig] = None,
                    on_token: Optional[Callable[[int, int], Any]] = None,
                    stats: Optional[GenerateStats] = None) -> List[int]:
    """Decode with a per-token callback ``on_token(token, position) -> bool``; returning False aborts
    after that token (it is still included; stop_reason CALLBACK_ABORT). Returns prompt +
    generated tokens; fills `stats`."""
    ids, plan = _prepare(model, prompt, config, "single", stats, on_token)
    stats = stats if stats is not None else GenerateStats()
    consumer = [CallbackStopper(on_token)] if on_token is not None else []
    return ids + list(_iter_locked(model, ids, plan, stats, consumer))


def generate(model: Model, prompt: Sequence[int], config: Optional[GenerateConfig] = None,
             stats: Optional[GenerateStats] = None) -> List[int]:
    """Blocking decode; returns prompt + generated tokens (a str prompt is encoded with
    model.tokenizer); fills `stats` when given."""
    return generate_stream(model, prompt, config, stats=stats)


#: GenerateConfig fields that may differ between the lanes of one generate_batch call (the spec's
#: "Batching and Integration" contract: per-lane stop sequences and grammars; the seed, so that
#: equal prompts can sample differently); every other field is shared by the batch.
PER_LANE_FIELDS = frozenset({"stop_sequences", "grammar", "sample_seed"})


def _batch_prompts(prompts: Any) -> list:
    """The prompts of a generate_batch call as a list: a sequence of prompts, a 2-D integer numpy
    array (one prompt per row) or a 1-D object array of prompts. A flat list of token ids is one
    prompt, not a batch: refused with that hint."""
    what = "prompts must be a non-empty list of prompts (token-id lists or text)"
    if isinstance(prompts, np.ndarray):
        if prompts.ndim == 2 or (prompts.ndim == 1 and prompts.dtype == object):
            prompts = list(prompts)
        elif prompts.ndim == 1:
            raise InvalidInputError(f"{what}; a 1-D array of {prompts.dtype} is one prompt: pass [prompt] to "
                                    f"decode it as a batch of one (or call generate)")
        else:
            raise InvalidInputError(f"{what}; a numpy array of prompts holds one prompt per row (2-D), got "
                                    f"shape {prompts.shape}")
    if isinstance(prompts, (str, bytes, bytearray)) or not isinstance(prompts, Sequence):
        raise InvalidInputError(f"{what}, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise InvalidInputError(f"{what}, got an empty {type(prompts).__name__}")
    if all(isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_)) for t in prompts):
        raise InvalidInputError(f"{what}; these are token ids ([{prompts[0]!r}, ...]), one prompt: pass [prompt] "
                                f"to decode it as a batch of one (or call generate)")
    return list(prompts)


def _shared_value(model: Model, config: GenerateConfig, name: str) -> Any:
    """Shared field `name` of a lane's config as the batch runs it: a value that means the field's
    default (a greedy temperature, beam_size 1) is the default, loops None the model's default
    depth, decoder None the automatic choice. Equal here means the lanes decode alike."""
    value = getattr(config, name)
    same = GenerateConfig._AS_DEFAULT.get(name)
    if same is not None and same(value):
        return GenerateConfig.__dataclass_fields__[name].default
    if name == "loops" and value is None:
        return model.cfg.default_loops
    if name == "decoder" and value is None:
        try:
            return get_plugin_manager().decoder_for(config).name
        except TinyLoopError:
            return None                 # the lane's own Plan says what is wrong
    return value


def _lane_configs(model: Model, prompts, config, grammars) -> List[GenerateConfig]:
    """One GenerateConfig per prompt: `config` itself (one per lane, sharing every field outside
    PER_LANE_FIELDS, compared by what they mean: _shared_value), or the one config with lane i's
    sample_seed derived (lockstep.lane_seed) when it samples; `grammars` then gives each lane's
    grammar (a config that sets one as well is refused: one of the two would be dropped)."""
    n = len(prompts)
    per_lane = isinstance(config, (list, tuple))
    if per_lane:
        if len(config) != n:
            raise InvalidInputError(f"config holds {len(config)} GenerateConfigs for {n} prompts: give one "
                                    f"GenerateConfig for every lane, or a single one")
        for i, c in enumerate(config):
            if not isinstance(c, GenerateConfig):
                raise ConfigError(f"config[{i}] must be a GenerateConfig, got {type(c).__name__} {c!r:.80}")
        first = config[0]
        shared = [f.name for f in dataclasses.fields(GenerateConfig) if f.name not in PER_LANE_FIELDS]
        first_values = [_shared_value(model, first, name) for name in shared]
        for i, c in enumerate(config[1:], 1):
            if c == first:
                continue
            for name, want in zip(shared, first_values):
                if _shared_value(model, c, name) != want:
                    raise IncompatibleModesError(
                        f"config[{i}].{name}={getattr(c, name)!r} differs from config[0].{name}="
                        f"{getattr(first, name)!r}: the lanes of a batch share every field but "
                        f"{', '.join(sorted(PER_LANE_FIELDS))} (the spec's batching contract: per-lane "
                        f"divergent settings are not batched); call generate per prompt instead")
        configs = list(config)
    else:
        if config is not None and not isinstance(config, GenerateConfig):
            raise ConfigError(f"config must be a GenerateConfig, a list of one GenerateConfig per prompt, or "
                              f"None, got {type(config).__name__} {config!r:.80}")
        config = config or GenerateConfig()
        if config.sampling:
            configs = [dataclasses.replace(config, sample_seed=lane_seed(config.sample_seed, i)) for i in range(n)]
        else:
            configs = [config] * n
    if grammars is not None:
        if isinstance(grammars, (str, bytes)) or not isinstance(grammars, Sequence) or len(grammars) != n:
            raise InvalidInputError(f"grammars must be a list with one grammar (or None) per prompt: {n} "
                                    f"prompts, got {grammars!r:.80}")
        for i, c in enumerate(configs):
            if c.grammar is not None:
                where = f"config[{i}].grammar" if per_lane else "config.grammar"
                raise InvalidInputError(
                    f"{where} is set and grammars= gives every lane's grammar as well (grammars[{i}]="
                    f"{grammars[i]!r:.60}): one of them would be dropped; give the grammars in one place "
                    f"(grammars=[...], None for an unconstrained lane, or each lane's config)")
        out = []
        for i, (c, g) in enumerate(zip(configs, grammars)):
            try:
                out.append(dataclasses.replace(c, grammar=g))
            except ConfigError as exc:
                raise ConfigError(f"grammars[{i}]: {exc}") from None
        configs = out
    return configs


def _lane_error(exc: TinyLoopError, label: str) -> TinyLoopError:
    """`exc` with its lane named in front (the same type; `exc` itself when the type cannot be
    built from a message)."""
    try:
        return type(exc)(f"{label}: {exc}")
    except Exception:
        return exc


def generate_batch(model: Model, prompts: Sequence[Sequence[int]], config=None,
                   stats: Optional[List[GenerateStats]] = None,
                   grammars: Optional[Sequence[Any]] = None) -> List[List[int]]:
    """Decode several prompts; returns one prompt + continuation list per prompt (the C++ API's
    flat concatenation, split per lane).

    `prompts`: a list of prompts (token-id sequences or text), or a 2-D integer numpy array with
    one prompt per row. `config`: one GenerateConfig for every lane (a sampling one gives lane i the
    seed ``tinyloop.lane_seed(sample_seed, i)``), or a list of one GenerateConfig per prompt that
    share every field but stop_sequences, grammar and sample_seed (used as given; fields are
    compared by meaning: loops None equals the model's default depth, temperature 0 equals 0.005).
    `grammars`, if given, holds one grammar per prompt (a tinyloop.Grammar, a grammar mapping, or
    None for an unconstrained lane); the configs then set none. `stats`, if given, is a list whose
    contents are replaced by one GenerateStats per prompt. Everything is validated before any work;
    an error of one lane's own settings names the lane.

    On a backend with the ``lanes`` capability and a decoder that picks in lockstep (greedy,
    sampling) the prompts decode together, one launch per op per step (tinyloop.runtime.lockstep;
    up to the workspace's rows of lanes per batch, more prompts run as further batches); otherwise
    one after another. Each lane's tokens are those of ``generate`` of its prompt with its config."""
    check_call(model)
    if stats is not None and not isinstance(stats, list):
        raise InvalidInputError(f"stats must be a list (it receives one GenerateStats per prompt) or None, got "
                                f"{type(stats).__name__}")
    prompts = _batch_prompts(prompts)
    configs = _lane_configs(model, prompts, config, grammars)
    per_lane = isinstance(config, (list, tuple)), grammars is not None
    W = model.cfg.sliding_window
    hint = (f"generate_batch keeps no window cache (cache_window is rejected in batched decoding): keep "
            f"prompt + max_tokens within {W}, or decode this prompt with generate and cache_window={W}")
    plans, all_ids = [], []
    for i, (p, c) in enumerate(zip(prompts, configs)):
        try:
            plans.append(Plan(model, c, "batched"))
            all_ids.append(validate_request(model, p, c, what=f"prompts[{i}]", window_hint=hint))
        except TinyLoopError as exc:
            if not any(per_lane) or str(exc).startswith(f"prompts[{i}]"):
                raise
            label = (f"lane {i} (config[{i}])" if per_lane == (True, False) else
                     f"lane {i} (grammars[{i}])" if per_lane == (False, True) else
                     f"lane {i} (config[{i}], grammars[{i}])")
            raise _lane_error(exc, label) from None
    for plan in plans:
        plan.delegate()
    lanes_ok = (model.backend.supports("lanes") and not kv_cache_disabled()
                and all(p.decoder_cls.lockstep and p.decoder_cls is plans[0].decoder_cls and p.exit is None
                        and p.slot_mode is None and p.seed is None for p in plans))
    out_stats = [GenerateStats() for _ in prompts]
    results = []
    lock = _locked(model)
    try:
        if lanes_ok:
            group = model.ws.rows
            for a in range(0, len(all_ids), group):
                batch = LockstepBatch(model, all_ids[a:a + group], plans[a:a + group], out_stats[a:a + group],
                                      first_index=a)
                try:
                    gen = batch.run()
                finally:
                    batch.close()
                results.extend(ids + g for ids, g in zip(all_ids[a:a + group], gen))
        else:
            for ids, plan, st in zip(all_ids, plans, out_stats):
                results.append(ids + list(_decode(model, ids, plan, st)))
    finally:
        lock.release()
    if stats is not None:
        stats[:] = out_stats
    return results


# --------------------------------------------------------------------------- scoring
def score_window_hint(model: Model) -> str:
    """check_model_window's advice for the scoring calls, which keep no window cache (and take no
    cache_window): what they can do instead past the model's sliding_window."""
    W = model.cfg.sliding_window
    return (f"scoring keeps no window cache: score at most {W} tokens per call, or use score_decoded with "
            f"GenerateConfig(cache_window={W}) (the logits as windowed decoding computes them)")


@contextlib.contextmanager
def _scoring(model: Model, tokens: Sequence[int], loops: Optional[int], cache_mode: str):
    """Validated ids and a live session (cache allocated, model locked) for a scoring call."""
    check_call(model)
    model._check_live()
    loops = resolve_loops(model, loops)              # errors name the model's range, as the family's do
    cfg = GenerateConfig(max_tokens=0, loops=loops, cache_mode=cache_mode)
    plan = Plan(model, cfg, "single")
    ids = validate_request(model, tokens, cfg, what="tokens", window_hint=score_window_hint(model))
    lock = _locked(model)
    try:
        s = Session(model, ids, plan, ProcessorChain([]), GenerateStats())
        try:
            yield ids, s
        finally:
            s.close()
    finally:
        lock.release()


def score(model: Model, tokens: Sequence[int], loops: Optional[int] = None,
          cache_mode: str = "fp16") -> np.ndarray:
    """Logits (T, vocab_size) float32 for every position of `tokens` at `loops` iterations."""
    with _scoring(model, tokens, loops, cache_mode) as (ids, s):
        out = np.empty((len(ids), model.cfg.vocab_size), np.float32)
        be, ws = model.backend, model.ws
        for a in range(0, len(ids), ws.rows):
            T = min(ws.rows, len(ids) - a)
            model.fwd.forward(be.set_ids(ws, ids[a:a + T]), be.positions(a), T, s.cache, s.loops)
            model.fwd.logits(0, T)
            out[a:a + T] = be.logits_block_to_host(ws, T)
    return out


def score_decoded(model: Model, tokens: Sequence[int], config: Optional[GenerateConfig] = None,
                  stats: Optional[GenerateStats] = None) -> np.ndarray:
    """Logits (T, vocab_size) float32 of every position of `tokens` as decoding computes them:
    position 0 from the prefill of tokens[:1], every later one from the one-token decode step of
    that token, so the request's decode-step settings apply (early exit: each position runs the
    depth its probes choose; ``stats.token_loops`` gets the depth behind each row). Teacher
    forcing: the steps advance the given tokens, not predicted ones. `config` takes the
    GenerateConfig fields of the cache and the steps (loops, cache_mode, early_exit_*); its
    max_tokens is ignored (every position is scored); a decoder other than greedy, or a sampling
    or beam setting, is an IncompatibleModesError (no token is chosen). `stats` gets the decoder
    whose steps ran ("greedy"), stop_reason MAX_TOKENS once every position is scored, prefill_ms
    and decode_ms (the steps), loops_used, loop_iters_run and the early-exit fields;
    tokens_emitted stays 0 (teacher forcing emits nothing)."""
    check_call(model, config, stats)
    config = config or GenerateConfig()
    # the steps are greedy decoding's (Session.advance) with the given tokens: a decoder choice or
    # a knob only another decoder reads (sampling, beam search) would be ignored, so it is refused
    # in score_decoded's own terms (not as a greedy request: the caller never chose greedy)
    greedy = get_plugin_manager().decoders().get("greedy")       # (unregistered: Plan says so below)
    steps = greedy.honoured(dataclasses.replace(config, decoder="greedy")) if greedy else None
    ignored = [] if steps is None else (["decoder"] if config.decoder not in (None, "greedy") else []) + \
        [n for n in config.requested_fields() if n not in steps or n == "options"]
    if ignored:
        raise IncompatibleModesError(
            f"score_decoded scores the given tokens through the decode steps (teacher forcing: no token is "
            f"chosen) and would ignore {', '.join(f'{n}={getattr(config, n)!r}' for n in ignored)}: it takes "
            f"decoder None or 'greedy' (no sampling or beam search setting) and the step settings loops, "
            f"cache_mode, cache_window and early_exit_* (these with early_exit_patience > 0)")
    ids = _as_ids(tokens, "tokens", model)
    if len(ids) < 1:
        raise InvalidInputError("tokens_len=0: scoring needs at least 1 token")
    cfg = dataclasses.replace(config, max_tokens=len(ids) - 1, decoder="greedy")
    plan = Plan(model, cfg, "single")
    active = [p.name for p in plan.new_processors().processors]
    if active or cfg.stop_sequences:
        raise IncompatibleModesError(f"score_decoded returns the raw logits of every position: "
                                     f"{'processors ' + str(active) if active else 'stop_sequences'} would not "
                                     f"apply (score without them)")
    validate_request(model, ids[:1], cfg, what="tokens")
    check_vocab(model, ids, "tokens")
    stats = stats if stats is not None else GenerateStats()
    out = np.empty((len(ids), model.cfg.vocab_size), np.float32)
    lock = _locked(model)
    try:
        _clear_stats(stats)
        stats.decoder = plan.decoder_cls.name          # the steps that ran (as generate records them)
        s = Session(model, ids[:1], plan, ProcessorChain([]), stats)
        try:
            s.start()
            t_steps = time.perf_counter()
            for t in range(len(ids)):
                if t:
                    s.advance(ids[t])
                out[t] = model.backend.logits_to_host(model.ws, 0)
                if s._exit is not None:
                    stats.token_loops.append(s.logits_depth)
            stats.decode_ms = (time.perf_counter() - t_steps) * 1e3
            stats.stop_reason = StopReason.MAX_TOKENS      # every position scored (no token emitted)
        finally:
            if stats.stop_reason is None:                  # ended by an error
                stats.stop_reason = StopReason.CALLBACK_ABORT
            s.close()
    finally:
        lock.release()
    if stats.token_loops:
        stats.loops_used = sum(stats.token_loops) / len(stats.token_loops)
    else:
        stats.loops_used = plan.loops
    return out


def score_last_token(model: Model, tokens: Sequence[int], loops: Optional[int] = None,
                     cache_mode: str = "fp16") -> np.ndarray:
    """Logits (vocab_size,) float32 of the last position only."""
    with _scoring(model, tokens, loops, cache_mode) as (_, s):
        s.start()
        return np.array(model.backend.logits_to_host(model.ws, 0), np.float32)
