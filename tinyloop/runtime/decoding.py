"""Decoder plugins and the session they drive.

A decoder is a generator of tokens over a :class:`DecodeSession` that the engine hands it. The
engine owns everything else: validation, the compat check, cache allocation, processors'
``accept``, the stop rules (tinyloop.runtime.stopping: EOS, stop sequences, max_tokens, callback
abort, plugins' own) and statistics. When the engine stops consuming, it closes the generator;
decoders hold no resources of their own.

What a decoder class declares (all class attributes, read once per request):

* ``name`` / ``matches(config)``  how it is selected (GenerateConfig.decoder, or automatically).
* ``options_class``  a frozen dataclass of its own settings, parsed from GenerateConfig.options
  (:func:`parse_options`; unknown keys and bad values are errors before any work). None: the
  decoder takes no options.
* ``session_class``  the session it drives: a subclass of tinyloop.runtime.engine.Session, or any
  factory ``(model, prompt, plan, chain, stats) -> session``; None: the engine's Session.
* ``honours``  the GenerateConfig fields it reads besides the engine's own (:data:`ENGINE_FIELDS`,
  and :data:`PROCESSOR_FIELDS` when ``applies_processors``). A request that sets any other field
  (GenerateConfig.requested_fields) is an IncompatibleModesError naming the field and the decoder.
* ``applies_processors``  False when the decoder's tokens do not come through the processor chain
  (beam search, speculative verify): a request with active processors is refused before work.
* ``compat_context``  the configs/compat.yaml column its requests are checked against
  (speculative, tree_speculative); None: the entry point's (single, batched).
* ``validate(model, config, options)`` / ``depth(config, options)``  model-dependent checks, and
  the loop depth the session runs at (GenerateConfig.loops unless the options say otherwise).
* ``resolve(model, config, context)``  a decoder may hand a request to another one (the auto
  decoder), returning the new GenerateConfig.

DecodeSession (implemented by tinyloop.runtime.engine.Session): see :class:`DecodeSession`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, FrozenSet, Iterator, List, Mapping, Optional, Protocol, Tuple

import numpy as np

from .config import GenerateConfig
from ..errors import ConfigError, IncompatibleModesError

#: GenerateConfig fields every decoder honours: the engine applies them whatever the decoder
#: (cache allocation and layout, the loop depth, the stop rules, plugin selection).
ENGINE_FIELDS = frozenset({"max_tokens", "loops", "stop_sequences", "cache_mode", "cache_window",
                           "decoder", "options"})
#: Fields the logit processors read: honoured by every decoder whose tokens come through the
#: processor chain (``applies_processors``).
PROCESSOR_FIELDS = frozenset({"repetition_penalty", "grammar"})
#: The early-exit knobs (tinyloop.runtime.early_exit): the engine's one-token steps apply them, so
#: they are honoured by decoders whose forwards are those steps (``adaptive_depth``).
EXIT_FIELDS = frozenset({"early_exit_patience", "early_exit_min_L", "early_exit_peek_every",
                         "early_exit_logit_margin", "early_exit_criterion", "early_exit_threshold",
                         "early_exit_kv"})
#: The sampling knobs.
SAMPLING_FIELDS = frozenset({"temperature", "top_k", "top_p", "sample_seed"})


class DecodeSession(Protocol):
    """What a decoder may call on the session the engine hands it (tinyloop.runtime.engine.Session;
    a decoder's ``session_class`` adds its own operations on top).

    Several decode states (lanes) exist for decoders that follow more than one sequence (beam
    search): ``fork_pool(n)`` first, then ``lane=`` on advance / logits / greedy. The forward
    workspace is shared: only the lane started or advanced last has pending logits."""

    config: GenerateConfig
    """The request's configuration."""
    options: Any
    """The decoder's parsed options (an instance of its options_class), None without."""
    vocab_size: int
    """Logits per row."""
    eos_id: Optional[int]
    """The model's EOS id (None: no EOS)."""
    eos_ids: Tuple[int, ...]
    """Every id that ends a sequence: eos_id, then the model's extra_eos_ids (empty: no EOS)."""
    position: int
    """Tokens of the lane in use whose K/V are in the cache."""
    stoppers: Any
    """The request's per-sequence stop rules (a tinyloop.runtime.stopping.StopperChain, reset with the
    prompt). The engine applies them to what the decoder yields; a decoder that explores candidate
    sequences checks *clones* of it (``clone().check(tokens)``), never the chain itself."""

    def start(self) -> None:
        """Prefill the prompt; the next-token logits become pending."""

    def logits(self, lane: int = 0):
        """The pending logits row after the processor chain (float32, host; valid until the next
        advance)."""

    def greedy(self, lane: int = 0, ahead: bool = False) -> int:
        """Argmax of the processed pending logits (on the device when every processor is
        argmax-invariant, so only a token id crosses to the host). ``ahead=True`` promises that
        the next call is ``advance(that token)`` (or nothing): the engine may then queue that
        token's decode step before the token reaches the host."""

    def sample(self, lane: int = 0, ahead: bool = False) -> int:
        """The token tinyloop.runtime.sampling.sample_token draws from the processed pending logits
        with the request's temperature / top_k / top_p and the uniform number of this generated
        token in the request's stream (``sampling.uniforms(sample_seed, max_tokens)``); on a
        backend with device_sampling the draw runs where the logits live. ``ahead`` as greedy()."""

    def advance(self, token: int, lane: int = 0) -> None:
        """Append `token` at the next position and run the decode forward."""

    def fork_pool(self, n: int) -> None:
        """Hold n lanes; their caches are allocated here, up front, and released with the session."""

    def copy_state(self, dst: int, src: int) -> None:
        """Lane dst becomes a copy of lane src (KV cache, tokens, position)."""

    def lane_tokens(self, lane: int = 0) -> List[int]:
        """A copy of a lane's tokens (prompt + generated)."""


class Decoder:
    """Base class of decoder plugins (see the module docstring for what a subclass declares)."""

    name: ClassVar[str] = ""
    """Unique plugin name; GenerateConfig.decoder selects it explicitly."""
    mode: ClassVar[Optional[str]] = None
    """Row of configs/compat.yaml this decoder provides (None for decoders outside the matrix)."""
    compat: ClassVar[Mapping[str, str]] = {}
    """Declared compat cells; must equal the YAML row when `mode` is set."""
    contexts: ClassVar[FrozenSet[str]] = frozenset({"single", "batched"})
    """Entry-point contexts the decoder can run in (checked for decoders outside the matrix)."""
    compat_context: ClassVar[Optional[str]] = None
    """The compat.yaml column its requests are checked against; None: the entry point's context."""
    options_class: ClassVar[Optional[type]] = None
    """Frozen dataclass of the decoder's own settings (GenerateConfig.options); None: none."""
    session_class: ClassVar[Optional[Any]] = None
    """The session the decoder drives (an engine Session subclass or a factory with its
    signature); None: the engine's Session."""
    honours: ClassVar[FrozenSet[str]] = frozenset()
    """GenerateConfig fields the decoder reads, besides ENGINE_FIELDS (and PROCESSOR_FIELDS when
    applies_processors)."""
    applies_processors: ClassVar[bool] = True
    """The decoder's tokens come through the processor chain (session.logits() / greedy())."""
    adaptive_depth: ClassVar[bool] = False
    """The decoder advances one token at a time through the engine Session's steps (start /
    advance), so the engine's per-token early exit applies: it honours EXIT_FIELDS while early
    exit is on (early_exit_patience > 0; without it the other exit knobs would do nothing)."""
    lockstep: ClassVar[bool] = False
    """The decoder picks each token from its sequence's pending logits alone (:meth:`pick`), so
    generate_batch can decode its prompts in lockstep (tinyloop.runtime.lockstep); a decoder
    without it runs the prompts of a batch one after another through :meth:`decode`."""
    picks_argmax: ClassVar[bool] = False
    """(``lockstep`` decoders) ``pick(lane)`` is ``lane.greedy()``: a lockstep batch whose lanes'
    chains leave the argmax alone may then queue the next step on the device's argmax before the
    picks are read (the lockstep twin of ``greedy(ahead=True)``)."""
    emits_after_search: ClassVar[bool] = False
    """The decoder yields its tokens only once its whole search has run (beam search): the
    request's ``decode_ms`` then counts the search, from the end of the prefill, where it would
    otherwise count from the first token yielded."""
    requires: ClassVar[FrozenSet[str]] = frozenset()
    """Optional backend capabilities (tinyloop.runtime.backend.CAPABILITIES) the decoder cannot run
    without; a request on a backend that lacks one is a BackendError before any allocation. A
    decoder that can run without a capability asks ``model.backend.supports(name)`` instead and
    falls back (its ``resolve`` or its session)."""

    @classmethod
    def matches(cls, config) -> bool:
        """True when this decoder is the automatic choice for `config` (built-ins only)."""
        return False

    @classmethod
    def honoured(cls, config) -> FrozenSet[str]:
        """Every GenerateConfig field this decoder honours for `config` (override when that
        depends on the request, e.g. sampling knobs only while sampling)."""
        return (ENGINE_FIELDS | cls.honours | (PROCESSOR_FIELDS if cls.applies_processors else frozenset())
                | (EXIT_FIELDS if cls.adaptive_depth and config.early_exit_patience > 0 else frozenset()))

    @classmethod
    def validate(cls, model, config, options) -> None:
        """Checks of the request that need the decoder's own rules or the model, before any
        allocation; raise a TinyLoopError subclass naming the value and what is allowed."""

    @classmethod
    def depth(cls, config, options) -> Optional[int]:
        """The loop depth the request decodes at (None: the model's default_loops)."""
        return config.loops

    @classmethod
    def resolve(cls, model, config, context: str) -> Optional[GenerateConfig]:
        """Hand the request to another decoder: return the GenerateConfig to run instead (its
        ``decoder`` names a registered decoder, which is then checked like a request of its own;
        one hand-over per request), or None to decode it here. Called once, after validation."""
        return None

    def __init__(self, config, options=None):
        self.config = config
        """The request's GenerateConfig."""
        self.options = options
        """The parsed options (an instance of options_class), None for decoders without."""

    def decode(self, session) -> Iterator[int]:
        """Yield tokens one at a time, calling session.advance(token) before producing the next."""
        raise NotImplementedError

    def pick(self, lane) -> int:
        """(``lockstep`` decoders) The next token of one lane of a lockstep batch from its pending
        step: `lane` is a tinyloop.runtime.lockstep.LaneView (``logits()``, ``greedy()``,
        ``config``, ``index``). Called once per step per running lane, on this lane's own decoder
        instance, in the order of decode(): it must pick what decode() would yield for the same
        logits. A StopRequest ends the lane with its reason."""
        raise NotImplementedError(f"decoder {self.name!r} does not decode in lockstep")


def is_token(tok, vocab_size: int) -> bool:
    """`tok` is a token id a decoder may produce: an int (numpy ints too, bools not) in
    [0, vocab_size)."""
    return (not isinstance(tok, (bool, np.bool_)) and isinstance(tok, (int, np.integer))
            and 0 <= int(tok) < vocab_size)


def raised_by_plugin_code(exc: BaseException) -> bool:
    """Whether `exc`, caught around a call of a decoder's ``decode`` / ``pick``, was raised by
    that plugin's own code: no frame of a tinyloop module (the engine, a backend, a built-in
    decoder) lies between the catching frame and the raise. An error tinyloop raised under the
    decoder (a MemoryError of a forward, a backend failure) is not the plugin's."""
    tb = exc.__traceback__
    tb = tb.tb_next if tb is not None else None        # (the catching frame itself)
    while tb is not None:
        module = tb.tb_frame.f_globals.get("__name__", "")
        if module == "tinyloop" or module.startswith("tinyloop."):
            return False
        tb = tb.tb_next
    return True


# --------------------------------------------------------------------------- per-request checks
def parse_options(decoder: type, raw: Any, registry: Mapping[str, type]) -> Any:
    """GenerateConfig.options parsed into ``decoder.options_class`` (None when it has none).

    Unknown keys are a ConfigError naming the key and the decoder; a key or an options object
    of another registered decoder, and options for a decoder that takes none, are an
    IncompatibleModesError; field validation errors are the options class's ConfigError."""
    cls = decoder.options_class
    if dataclasses.is_dataclass(raw) and not isinstance(raw, type):
        if cls is not None and type(raw) is cls:
            return raw
        theirs = [n for n, d in registry.items() if d.options_class is not None and type(raw) is d.options_class]
        whose = f" (the options of decoder {theirs[0]!r})" if theirs else ""
        wants = f"a {cls.__name__} or a mapping" if cls is not None else "none"
        raise IncompatibleModesError(f"options={raw!r}{whose} do not belong to decoder {decoder.name!r}, "
                                     f"which takes {wants}")
    if not raw:
        return cls() if cls is not None else None
    if cls is None:
        raise IncompatibleModesError(f"decoder {decoder.name!r} takes no options, got options={dict(raw)!r}")
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key in names:
            continue
        others = sorted(n for n, d in registry.items() if d is not decoder and d.options_class is not None
                        and key in {f.name for f in dataclasses.fields(d.options_class)})
        if others:
            raise IncompatibleModesError(f"options key {key!r} is an option of decoder {others[0]!r}, not of "
                                         f"decoder {decoder.name!r} (which takes: {', '.join(names)})")
        raise ConfigError(f"unknown key {key!r} in options of decoder {decoder.name!r}; allowed keys: "
                          f"{', '.join(names)}")
    try:
        return cls(**dict(raw))
    except ConfigError as exc:
        raise ConfigError(f"options of decoder {decoder.name!r}: {exc}") from None
    except TypeError as exc:
        raise ConfigError(f"options of decoder {decoder.name!r}: {exc}") from None


def check_honoured(decoder: type, config) -> None:
    """IncompatibleModesError for the first field `config` sets that `decoder` would ignore."""
    honoured = decoder.honoured(config)
    for name in config.requested_fields():
        if name not in honoured:
            own = sorted(honoured - ENGINE_FIELDS)
            default = GenerateConfig.__dataclass_fields__[name].default
            if name in EXIT_FIELDS and decoder.adaptive_depth and not config.early_exit_patience:
                raise IncompatibleModesError(
                    f"{name}={getattr(config, name)!r} is set, but early exit is off "
                    f"(early_exit_patience=0): set early_exit_patience > 0 to decode with early exit, "
                    f"or leave {name} at its default ({default!r})")
            raise IncompatibleModesError(
                f"{name}={getattr(config, name)!r} is set, but decoder {decoder.name!r} ignores it "
                f"(it honours {', '.join(own) if own else 'no fields'} besides the engine's "
                f"{', '.join(sorted(ENGINE_FIELDS))}); leave {name} at its default ({default!r}) or "
                f"choose a decoder that uses it")
