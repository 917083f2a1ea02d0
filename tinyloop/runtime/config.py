"""Request configurations (frozen dataclasses, validated on construction) and the YAML run config.

Every field has a docstring; every validation error quotes the value and the allowed range. YAML is
parsed into these classes here and nowhere else; an unknown key is an error naming the key.
"""

from __future__ import annotations

import dataclasses
import json
import functools
import inspect
import math
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, Mapping, Optional, Sequence, Tuple, Type, TypeVar

import numpy as np

from ..errors import ConfigError


def env_switch(name: str) -> bool:
    """An on-by-default environment switch (TINYLOOP_LOOKAHEAD, TINYLOOP_CUDA_GRAPHS, ...): off
    for "0", "false" or "no"."""
    return os.environ.get(name, "1") not in ("0", "false", "no")

#: Temperatures at or below this are greedy argmax (spec: "0.0 (or <= 0.01) means greedy").
GREEDY_TEMPERATURE = 0.01
MAX_SEED = (1 << 64) - 1

T = TypeVar("T")


# --------------------------------------------------------------------------- field validators
# Public: plugin option classes (Decoder.options_class) validate their fields with these, so every
# config error in the project reads the same way.
def check_int(name: str, v: Any, lo: int, hi: Optional[int] = None) -> None:
    """ConfigError unless `v` is an int (not a bool) in [lo, hi] (hi None: no upper bound)."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{name} must be an integer, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ConfigError(f"{name}={v} is outside the allowed range {rng}")


def check_float(name: str, v: Any) -> float:
    """`v` as a float; ConfigError unless it is a finite int or float (not a bool)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
        raise ConfigError(f"{name} must be a finite number, got {v!r}")
    return float(v)


def check_bool(name: str, v: Any) -> None:
    """ConfigError unless `v` is True or False."""
    if not isinstance(v, bool):
        raise ConfigError(f"{name} must be true or false, got {v!r}")


_int, _float = check_int, check_float

#: Upper bounds of the counts that size memory or work, checked when a config is made (before any
#: allocation); the model's own limits (max_seq_len, vocab, loops) are checked per request.
MAX_TOKENS = 1 << 20
MAX_BEAM = 256
MAX_WINDOW = 1 << 20
#: Float knobs are bounded so no arithmetic on them overflows float32 (penalties divide logits).
MAX_PENALTY = 1e6
#: repetition_penalty's lower bound: a penalty below 1 divides positive logits by it, so below
#: 1 / MAX_PENALTY float32 logits overflow to inf (and 1e-300 rounds to a float32 zero).
MIN_REPETITION_PENALTY = 1.0 / MAX_PENALTY
MAX_LENGTH_PENALTY = 10.0
#: GenerateConfig.early_exit_kv: what the skipped loop iterations of an exited token store.
EXIT_KV_POLICIES = ("copy_last", "recompute")


def typed_init(cls):
    """Make a config dataclass's constructor raise ConfigError (naming the allowed fields) for an
    unknown keyword or too many positional arguments, instead of Python's TypeError."""
    init = cls.__init__
    sig = inspect.signature(init)
    names = [n for n in sig.parameters if n != "self"]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        try:
            sig.bind(self, *args, **kwargs)
        except TypeError as exc:
            unknown = [k for k in kwargs if k not in names]
            what = (f"unknown field {unknown[0]!r}" if unknown else str(exc))
            raise ConfigError(f"{cls.__name__}: {what}; allowed fields: {', '.join(names)}") from None
        init(self, *args, **kwargs)
    cls.__init__ = __init__
    return cls


def numpy_int(v: Any) -> bool:
    """`v` is a numpy integer scalar. numpy counts np.timedelta64 (a duration) among its integers
    (np.signedinteger); it is no count, and int() of one fails or gives a unit-dependent number."""
    return isinstance(v, np.integer) and not isinstance(v, np.timedelta64)


def plain_number(v: Any) -> Any:
    """A numpy integer or floating scalar as the Python int / float it holds (numpy's bool is left
    as it is, so it is refused where a number is expected, like bool; np.timedelta64 too, a
    duration: numpy_int); anything else unchanged."""
    if numpy_int(v):
        return int(v)
    if isinstance(v, np.floating):
        return float(v)
    return v


def _stop_sequences(v: Any) -> Tuple[Tuple[int, ...], ...]:
    if v is None:
        return ()
    if isinstance(v, np.ndarray) and v.ndim == 2:
        v = list(v)                                 # one stop sequence per row
    if isinstance(v, (str, bytes)) or not isinstance(v, Sequence):
        raise ConfigError(f"stop_sequences must be a list of token-id lists, got {v!r}")
    out = []
    for i, seq in enumerate(v):
        if isinstance(seq, np.ndarray) and seq.ndim == 1:
            seq = seq.tolist() if seq.dtype.kind in "iu" else list(seq)
        if isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence) or len(seq) == 0:
            raise ConfigError(f"stop_sequences[{i}] must be a non-empty list of token ids, got {seq!r}")
        for t in seq:
            if isinstance(t, bool) or not isinstance(plain_number(t), int) or plain_number(t) < 0:
                raise ConfigError(f"stop_sequences[{i}] holds {t!r}; token ids are integers >= 0")
        out.append(tuple(int(plain_number(t)) for t in seq))
    return tuple(out)


def _check_sampling(cfg) -> None:
    """Validate and normalise cfg.temperature / top_k / top_p (a frozen dataclass)."""
    t = _float("temperature", cfg.temperature)
    if t < 0:
        raise ConfigError(f"temperature={cfg.temperature} must be >= 0")
    object.__setattr__(cfg, "temperature", t)
    _int("top_k", cfg.top_k, -(1 << 62))
    if t > GREEDY_TEMPERATURE and cfg.top_k < 1:
        raise ConfigError(f"top_k={cfg.top_k} must be >= 1 while sampling (temperature={t})")
    p = _float("top_p", cfg.top_p)
    if not 0.0 < p <= 1.0:
        raise ConfigError(f"top_p={cfg.top_p} is outside the allowed range (0, 1]")
    object.__setattr__(cfg, "top_p", p)


class FrozenOptions(dict):
    """A read-only dict: GenerateConfig.options once validated (a frozen config stays frozen)."""

    def _read_only(self, *args, **kwargs):
        raise TypeError("GenerateConfig.options is read-only; use config.replace(options={...})")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _read_only  # type: ignore

    def __reduce__(self):
        return (type(self), (dict(self),))


def _options(v: Any) -> Any:
    """GenerateConfig.options: a mapping with string keys (frozen here), or an instance of a
    decoder's options dataclass (kept as it is). Parsed into the decoder's class by the engine."""
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return v
    if v is None:
        return FrozenOptions()
    if not isinstance(v, Mapping):
        raise ConfigError(f"options must be a mapping of the decoder's option names to values (or an "
                          f"instance of its options class), got {v!r}")
    for key in v:
        if not isinstance(key, str):
            raise ConfigError(f"options keys must be option names (strings), got {key!r}")
    return FrozenOptions(v)


@typed_init
@dataclass(frozen=True)
class GenerateConfig:
    """Decode configuration shared by generate, generate_stream, generate_iter and generate_batch.

    Fields follow the original spec's GenerateConfig; ``cache_mode``, ``decoder`` and ``options``
    are the Python runtime's plugin selectors. A field the chosen decoder does not use must stay at
    its default (see :meth:`requested_fields` and docs/ARCHITECTURE.md, "Honoured fields").
    """

    max_tokens: int = 64
    """Upper bound on emitted tokens (prompt excluded). prompt_len + max_tokens <= max_seq_len."""
    loops: Optional[int] = None
    """Loop depth L in [1, model.max_loops]; None means the model's default_loops."""
    temperature: float = 0.0
    """Softmax temperature, >= 0. At or below 0.01 decoding is greedy argmax."""
    top_k: int = 50
    """Keep the k most likely tokens before sampling; >= 1 when sampling (validated only then). A
    sampling knob: set on a greedy request it is an error (the decoder would ignore it)."""
    top_p: float = 1.0
    """Nucleus threshold in (0, 1], applied after top_k; 1.0 disables. A sampling knob."""
    cache_window: int = 0
    """Sliding-window cap on the KV cache; 0 means unlimited."""
    repetition_penalty: float = 1.0
    """HF-convention penalty in [1e-6, 1e6] on tokens already in the prompt or output (a positive
    logit divided by it, a negative one multiplied); 1.0 disables."""
    stop_sequences: Tuple[Tuple[int, ...], ...] = ()
    """Token-id sequences that end decoding when they match the tail of the output (included)."""
    beam_size: int = 0
    """0 or 1: ordinary decoding; >= 2: deterministic beam search."""
    length_penalty: float = 1.0
    """Beam search only (elsewhere an error): beams rank by log_prob / max(1, len) ** length_penalty,
    len the beam's generated tokens (its EOS / stop-sequence token included, the prompt not)."""
    early_exit_patience: int = 0
    """0 disables adaptive-depth early exit; > 0 exits after that many stable probes past min_L."""
    early_exit_min_L: int = 2
    """First loop iteration at which early exit may probe (>= 1, and below the request's loops)."""
    early_exit_peek_every: int = 1
    """Probe cadence past early_exit_min_L (>= 1)."""
    early_exit_logit_margin: float = 0.0
    """> 0 switches early exit from hidden-state L2 stability to logit-margin stability: a probe is
    stable when the head logits' top-1 minus top-2 is at least this margin."""
    early_exit_criterion: str = ""
    """The exit-criterion plugin (tinyloop.runtime.early_exit; built in: hidden_l2, logit_margin,
    kl, argmax, gate). "" is the spec's choice: logit_margin when early_exit_logit_margin > 0, else
    hidden_l2."""
    early_exit_threshold: float = 0.0
    """The criterion's threshold (> 0); 0 uses the criterion's documented default. logit_margin
    takes its margin from early_exit_logit_margin, argmax takes none."""
    early_exit_kv: str = "copy_last"
    """K/V of the loop iterations an exited token skipped: copy_last (the K/V of the last iteration
    it ran, for the same loop layer) or recompute (each skipped layer's K/V projected from the
    exited state)."""
    sample_seed: int = 0
    """RNG seed for sampling in [0, 2**64 - 1]; same seed + config + model -> same tokens. A
    sampling knob (an error on greedy and beam requests)."""
    grammar: Any = None
    """Constrained decoding: a tinyloop.Grammar (Grammar.lark / regex / json_schema / json), or a
    one-key mapping {lark: text | regex: pattern | json_schema: schema | json: {}} turned into one
    (the JSON kinds with an optional whitespace: flexible | compact | spaced beside the key);
    None: unconstrained. Needs the llguidance extra (pip install tinyloop[grammar])."""
    cache_mode: str = "fp16"
    """KV-cache storage mode: the name of a registered cache-mode plugin (fp16, fp32, ...)."""
    decoder: Optional[str] = None
    """Name of a registered decoder plugin; None picks the built-in one the settings imply."""
    options: Mapping[str, Any] = field(default_factory=FrozenOptions, hash=False)
    """The decoder's own settings: a mapping parsed into the chosen decoder's options class
    (Decoder.options_class) before any work, or an instance of that class. Empty: the decoder's
    defaults; non-empty for a decoder without options is an error."""

    #: Values that mean the same as a field's default (the spec's "temperature <= 0.01 is greedy";
    #: beam_size 0 and 1 are both ordinary decoding).
    _AS_DEFAULT: ClassVar[Dict[str, Any]] = {
        "temperature": lambda v: v <= GREEDY_TEMPERATURE,
        "beam_size": lambda v: v <= 1,
    }

    #: The numeric fields: a numpy scalar given for one is stored as the Python number it holds.
    _NUMERIC: ClassVar[Tuple[str, ...]] = (
        "max_tokens", "loops", "temperature", "top_k", "top_p", "cache_window", "repetition_penalty", "beam_size",
        "length_penalty", "early_exit_patience", "early_exit_min_L", "early_exit_peek_every",
        "early_exit_logit_margin", "early_exit_threshold", "sample_seed")

    def __post_init__(self) -> None:
        for name in self._NUMERIC:
            object.__setattr__(self, name, plain_number(getattr(self, name)))
        _int("max_tokens", self.max_tokens, 0, MAX_TOKENS)
        if self.loops is not None:
            _int("loops", self.loops, 1)
        _check_sampling(self)
        _int("cache_window", self.cache_window, 0, MAX_WINDOW)
        rp = _float("repetition_penalty", self.repetition_penalty)
        if not MIN_REPETITION_PENALTY <= rp <= MAX_PENALTY:
            raise ConfigError(f"repetition_penalty={self.repetition_penalty} is outside the allowed range "
                              f"[{MIN_REPETITION_PENALTY:g}, {MAX_PENALTY:g}] (1.0 disables it)")
        object.__setattr__(self, "repetition_penalty", rp)
        object.__setattr__(self, "stop_sequences", _stop_sequences(self.stop_sequences))
        _int("beam_size", self.beam_size, 0, MAX_BEAM)
        lp = _float("length_penalty", self.length_penalty)
        if abs(lp) > MAX_LENGTH_PENALTY:
            raise ConfigError(f"length_penalty={self.length_penalty} is outside the allowed range "
                              f"[{-MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}]")
        object.__setattr__(self, "length_penalty", lp)
        _int("early_exit_patience", self.early_exit_patience, 0, MAX_TOKENS)
        _int("early_exit_min_L", self.early_exit_min_L, 1, MAX_TOKENS)
        _int("early_exit_peek_every", self.early_exit_peek_every, 1, MAX_TOKENS)
        m = _float("early_exit_logit_margin", self.early_exit_logit_margin)
        if not 0 <= m <= MAX_PENALTY:
            raise ConfigError(f"early_exit_logit_margin={m} is outside the allowed range [0, {MAX_PENALTY:g}]")
        object.__setattr__(self, "early_exit_logit_margin", m)
        if not isinstance(self.early_exit_criterion, str):
            raise ConfigError(f"early_exit_criterion must be a plugin name or \"\", got {self.early_exit_criterion!r}")
        th = _float("early_exit_threshold", self.early_exit_threshold)
        if not 0 <= th <= MAX_PENALTY:
            raise ConfigError(f"early_exit_threshold={th} is outside the allowed range [0, {MAX_PENALTY:g}] "
                              f"(0: the criterion's default)")
        object.__setattr__(self, "early_exit_threshold", th)
        if not isinstance(self.early_exit_kv, str) or self.early_exit_kv not in EXIT_KV_POLICIES:
            raise ConfigError(f"early_exit_kv={self.early_exit_kv!r} is not one of {', '.join(EXIT_KV_POLICIES)}")
        _int("sample_seed", self.sample_seed, 0, MAX_SEED)
        if not isinstance(self.cache_mode, str) or not self.cache_mode:
            raise ConfigError(f"cache_mode must be a plugin name, got {self.cache_mode!r}")
        if self.grammar is not None:
            from .grammar import Grammar
            if isinstance(self.grammar, Mapping):
                object.__setattr__(self, "grammar", Grammar.from_mapping(dict(self.grammar)))
            elif not isinstance(self.grammar, Grammar):
                raise ConfigError(f"grammar must be a tinyloop.Grammar (Grammar.lark / regex / json_schema / json) "
                                  f"or a mapping such as {{'regex': '[0-9]+'}}, got {type(self.grammar).__name__} "
                                  f"{self.grammar!r:.60}")
        if self.decoder is not None and (not isinstance(self.decoder, str) or not self.decoder):
            raise ConfigError(f"decoder must be a plugin name or None, got {self.decoder!r}")
        object.__setattr__(self, "options", _options(self.options))

    @property
    def sampling(self) -> bool:
        """True when tokens are drawn stochastically (temperature above the greedy threshold)."""
        return self.temperature > GREEDY_TEMPERATURE

    def requested_fields(self) -> Tuple[str, ...]:
        """Names of the fields that ask for something: set to a value whose meaning differs from
        the default's (temperature <= 0.01 reads as the default 0.0, beam_size 1 as 0; empty
        options as none). The engine checks each against what the chosen decoder honours."""
        out = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            same = self._AS_DEFAULT.get(f.name)
            if (same(v) if same is not None else v == default):
                continue
            out.append(f.name)
        return tuple(out)

    def replace(self, **changes) -> "GenerateConfig":
        return dataclasses.replace(self, **changes)


@typed_init
@dataclass(frozen=True)
class SpeculativeConfig:
    """Chain self-speculative decoding: draft at draft_loops, verify at verify_loops."""

    max_tokens: int = 64
    """Total emission cap (prompt excluded)."""
    draft_loops: int = 2
    """Cheap draft-pass loop depth (>= 1, < verify_loops)."""
    verify_loops: int = 8
    """Verify-pass loop depth, in [2, model.max_loops] (the draft depth is below it)."""
    draft_ahead: int = 4
    """Tokens drafted per verify cycle (>= 1)."""
    temperature: float = 0.0
    """0 (or <= 0.01) = greedy acceptance (exact); above = speculative sampling, whose output
    distribution equals plain sampling at verify_loops with the same temperature/top_k/top_p."""
    seed: int = 0
    """RNG seed for stochastic mode. A sampling knob: set on a greedy config (temperature <= 0.01)
    it is an error, as GenerateConfig.sample_seed on a greedy request (it would be ignored)."""
    top_k: int = 50
    """Speculative sampling: keep the k most likely tokens (as GenerateConfig.top_k). A sampling
    knob (an error on a greedy config)."""
    top_p: float = 1.0
    """Speculative sampling: nucleus threshold in (0, 1] (as GenerateConfig.top_p). A sampling
    knob (an error on a greedy config)."""
    verify_resume: bool = True
    """Verify resumes each drafted position from the residual the draft left after draft_loops
    iterations and runs only iterations draft_loops..verify_loops-1 (same tokens either way)."""
    stop_sequences: Tuple[Tuple[int, ...], ...] = ()
    """Token-id sequences that end decoding when they match the tail of the output (included)."""
    cache_mode: str = "fp16"
    """KV-cache storage mode (a registered cache-mode plugin)."""
    cache_window: int = 0
    """Sliding-window cap on the KV cache (as GenerateConfig.cache_window); 0 means unlimited.
    Chain speculation only (trees are rejected)."""

    #: The numeric fields: a numpy scalar given for one is stored as the Python number it holds.
    _NUMERIC: ClassVar[Tuple[str, ...]] = ("max_tokens", "draft_loops", "verify_loops", "draft_ahead",
                                           "temperature", "seed", "top_k", "top_p", "cache_window")
    #: The knobs only speculative sampling uses, with their defaults: set on a greedy config they
    #: would be ignored, so they are refused (as GenerateConfig's sampling knobs on a greedy request).
    _SAMPLING_KNOBS: ClassVar[Tuple[Tuple[str, Any], ...]] = (("seed", 0), ("top_k", 50), ("top_p", 1.0))

    def __post_init__(self) -> None:
        for name in self._NUMERIC:
            object.__setattr__(self, name, plain_number(getattr(self, name)))
        _int("max_tokens", self.max_tokens, 0, MAX_TOKENS)
        _int("cache_window", self.cache_window, 0, MAX_WINDOW)
        if not isinstance(self.cache_mode, str) or not self.cache_mode:
            raise ConfigError(f"cache_mode must be a plugin name, got {self.cache_mode!r}")
        if not isinstance(self.verify_resume, bool):
            raise ConfigError(f"verify_resume must be true or false, got {self.verify_resume!r}")
        object.__setattr__(self, "stop_sequences", _stop_sequences(self.stop_sequences))
        # a verify depth of 1 leaves no draft depth below it (draft_loops < verify_loops)
        _int("verify_loops", self.verify_loops, 2)
        _int("draft_loops", self.draft_loops, 1, self.verify_loops - 1)
        _int("draft_ahead", self.draft_ahead, 1, 64)
        _check_sampling(self)
        _int("seed", self.seed, 0, MAX_SEED)
        if self.temperature <= GREEDY_TEMPERATURE:
            for name, default in self._SAMPLING_KNOBS:
                v = getattr(self, name)
                if v != default:
                    raise ConfigError(f"{name}={v} is a speculative-sampling knob, but temperature={self.temperature} "
                                      f"is greedy (<= {GREEDY_TEMPERATURE}) and would ignore it: set temperature "
                                      f"above {GREEDY_TEMPERATURE} to sample, or leave {name} at its default "
                                      f"{default}")


@typed_init
@dataclass(frozen=True)
class TreeSpeculativeConfig(SpeculativeConfig):
    """Tree self-speculative decoding: K_branches candidates per draft step, depth draft_ahead."""

    K_branches: int = 2
    """Candidates kept per draft step (>= 1)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "K_branches", plain_number(self.K_branches))
        _int("K_branches", self.K_branches, 1, 16)


#: RunConfig.mode values.
RUN_MODES = ("generate", "batch", "speculative", "tree_speculative")


class StopReason(str):
    """Why a generation ended: a name. The built-in reasons are class attributes (``EOS``,
    ``STOP_SEQUENCE``, ``MAX_TOKENS``, ``CALLBACK_ABORT``, ``GRAMMAR_DEAD_END``: the grammar allows no
    token; ``GRAMMAR_COMPLETE``: the grammar is complete on a model without an EOS id; ``GRAMMAR_ERROR``:
    the grammar engine gave up, e.g. at one of llguidance's size limits, with a RuntimeWarning
    carrying its message); a plugin's stopper
    (tinyloop.runtime.stopping.Stopper) may end a request with its own, ``StopReason("MY_RULE")``.
    One object per name (``StopReason("EOS") is StopReason.EOS``); a reason compares equal to its
    name and ``.value`` / ``.name`` give the name, as the former enum did."""

    __slots__ = ()
    _known: ClassVar[Dict[str, "StopReason"]] = {}

    def __new__(cls, name: Any) -> "StopReason":
        if isinstance(name, StopReason):
            return name
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError(f"a stop reason is a name (a Python identifier such as 'MY_RULE'), got {name!r}")
        known = cls._known.get(name)
        if known is None:
            known = cls._known[name] = str.__new__(cls, name)
        return known

    @property
    def value(self) -> str:
        return str.__str__(self)

    @property
    def name(self) -> str:
        return str.__str__(self)

    def __str__(self) -> str:
        return str.__str__(self)

    def __repr__(self) -> str:
        return f"StopReason({str.__str__(self)!r})"

    def __reduce__(self):
        return (StopReason, (str.__str__(self),))

    EOS: ClassVar["StopReason"]
    STOP_SEQUENCE: ClassVar["StopReason"]
    MAX_TOKENS: ClassVar["StopReason"]
    CALLBACK_ABORT: ClassVar["StopReason"]
    GRAMMAR_DEAD_END: ClassVar["StopReason"]
    GRAMMAR_COMPLETE: ClassVar["StopReason"]
    GRAMMAR_ERROR: ClassVar["StopReason"]


for _name in ("EOS", "STOP_SEQUENCE", "MAX_TOKENS", "CALLBACK_ABORT", "GRAMMAR_DEAD_END", "GRAMMAR_COMPLETE",
              "GRAMMAR_ERROR"):
    setattr(StopReason, _name, StopReason(_name))
del _name


@typed_init
@dataclass
class GenerateStats:
    """Per-call statistics, filled by generate_stream / generate_iter when passed in."""

    prefill_ms: float = 0.0
    """Wall-clock time of the prefill (prompt -> first-token logits ready)."""
    first_token_ms: float = 0.0
    """Wall-clock time from call entry to the first emitted token: the request's set-up (checks,
    plan, a grammar's compile) included. A generate_iter consumer's wait before its first
    ``next()`` is not counted; a generate_batch lane counts from the start of its batch's decode."""
    decode_ms: float = 0.0
    """Wall-clock time of the decode loop after the first token (a decoder that emits its tokens
    only after its search, beam, counts the search: from the end of the prefill)."""
    tokens_emitted: int = 0
    """Tokens emitted (prompt excluded)."""
    stop_reason: Optional[StopReason] = None
    """Why decoding ended."""
    loops_used: float = 0
    """Effective loop depth used: the request's depth (an int), or with early exit the mean of
    ``token_loops`` (a float)."""
    token_loops: list = dataclasses.field(default_factory=list)
    """Early exit: the loop iterations of the forward whose logits chose each emitted token (the
    first token's is the prompt's, at full depth); appended before the token reaches the caller,
    so a streaming consumer holding these stats reads ``token_loops[-1]``. Empty otherwise."""
    exit_probes: int = 0
    """Early exit: criterion evaluations over all decode steps."""
    decoder: str = ""
    """The decoder that ran: the one the request named or the automatic choice, after any
    hand-over (e.g. tree_speculative on a backend without tree ops runs speculative)."""
    loop_iters_run: int = 0
    """Shared-block loop iterations executed over all forwards (prefill rows counted once per chunk;
    a generate_batch lane, whose prompt rows share launches with other lanes', counts its prompt
    once per row)."""
    drafted_tokens: int = 0
    """Speculative: tokens drafted at draft_loops."""
    accepted_tokens: int = 0
    """Speculative: drafted tokens the verify pass accepted, counted per cycle (a stop or max_tokens
    that ends the request inside a cycle's accepted drafts does not take them back: tokens_emitted
    counts what the caller got)."""
    verify_forwards: int = 0
    """Speculative: verify passes (one per draft cycle)."""
    acceptance_rate: float = 0.0
    """Speculative: accepted_tokens / drafted_tokens."""
    mean_accepted_length: float = 0.0
    """Speculative: tokens emitted per verify pass (accepted drafts + the bonus token)."""
    full_depth_forwards_saved: int = 0
    """Speculative: full-depth decode forwards plain decoding would have run, minus verify passes."""
    beams_finished: int = 0
    """Beam search: beams that ended (EOS, stop sequence or max_tokens) before the search stopped."""
    reused_tokens: int = 0
    """Prefix reuse / warm start: prompt positions whose K/V were copied from kept state instead of
    computed (tinyloop.runtime.reuse)."""
    warm_start_iters_saved: int = 0
    """Warm start: loop iterations x prompt rows the handle's kept residual spared this request
    (a fresh request at this depth would have run them)."""
    batch_lanes: int = 0
    """generate_batch: the lanes of the lockstep batch this prompt decoded in (its own included);
    0 when it decoded alone (any other entry point, or a batch decoded one prompt after another)."""

    _FLOATS: ClassVar[Tuple[str, ...]] = ("prefill_ms", "first_token_ms", "decode_ms", "loops_used", "acceptance_rate",
                                          "mean_accepted_length")

    def __post_init__(self) -> None:
        """The fields a caller may set (a run resets them all) hold what a run writes there."""
        for f in dataclasses.fields(self):
            name, v = f.name, plain_number(getattr(self, f.name))
            if name == "stop_reason":
                if v is not None:
                    try:
                        v = StopReason(v)
                    except ConfigError as exc:
                        raise ConfigError(f"stop_reason: {exc}") from None
            elif name == "token_loops":
                if not isinstance(v, list):
                    raise ConfigError(f"token_loops must be a list (of loop depths), got {type(v).__name__}")
            elif name == "decoder":
                if not isinstance(v, str):
                    raise ConfigError(f"decoder must be a decoder name (str), got {v!r:.40}")
            elif isinstance(v, bool) or not isinstance(v, (int, float) if name in self._FLOATS else int):
                raise ConfigError(f"{name} must be {'a number' if name in self._FLOATS else 'an integer'}, "
                                  f"got {v!r:.40}")
            object.__setattr__(self, name, v)

    def finalize(self) -> None:
        """Derive the ratio fields from the counters once a call has ended."""
        if self.verify_forwards:
            self.acceptance_rate = self.accepted_tokens / max(1, self.drafted_tokens)
            after_first = max(0, self.tokens_emitted - 1)
            self.mean_accepted_length = after_first / self.verify_forwards
            self.full_depth_forwards_saved = after_first - self.verify_forwards

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["stop_reason"] = None if self.stop_reason is None else str.__str__(self.stop_reason)
        return d


# --------------------------------------------------------------------------- mapping -> dataclass
def from_mapping(cls: Type[T], data: Mapping[str, Any], where: str) -> T:
    """Build dataclass `cls` from a mapping; unknown keys are a ConfigError naming them."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a mapping, got {type(data).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            raise ConfigError(f"unknown key {key!r} in {where}; allowed keys: {', '.join(names)}")
    try:
        return cls(**dict(data))
    except TypeError as exc:  # e.g. a missing required field
        raise ConfigError(f"{where}: {exc}") from None


@typed_init
@dataclass(frozen=True)
class ResumeConfig:
    """A run's ``resume:`` section: every prompt is prefilled once at ``loops_used`` into a resume
    handle, then decoded at each of ``depths`` from it (warm start; tinyloop.runtime.reuse)."""

    loops_used: int = 1
    """The depth the handle is built at, in [1, model.max_loops]."""
    depths: Tuple[int, ...] = ()
    """The depths each prompt is served at, in order, each in [loops_used, model.max_loops]."""

    def __post_init__(self) -> None:
        _int("loops_used", self.loops_used, 1, 1 << 20)
        if isinstance(self.depths, (str, bytes)) or not isinstance(self.depths, (list, tuple)) or not self.depths:
            raise ConfigError(f"resume depths must be a non-empty list of loop depths, got {self.depths!r}")
        for d in self.depths:
            _int("resume depth", d, self.loops_used, 1 << 20)
        object.__setattr__(self, "depths", tuple(self.depths))


@typed_init
@dataclass(frozen=True)
class RunConfig:
    """A YAML-configured run (``python -m tinyloop run CFG.yaml``)."""

    model: str = ""
    """Path of the .tinyloop file (relative paths are relative to the YAML file), or the name of a
    shipped model as load_model takes it ("demo", "demo-exit"). Empty: the embedded demo model."""
    backend: str = "auto"
    """auto, or a registered backend (built in: cpu, cuda; the ``tinyloop_backends`` hook)."""
    max_seq_len: int = 2048
    """Longest sequence (prompt + output) the loaded model serves."""
    prefill_chunk: int = 0
    """Rows per prefill launch (bounds activation memory); 0 = min(max_seq_len, 512)."""
    tokenizer: Optional[str] = None
    """Directory with tokenizer.json, or vocab.json + merges.txt; None uses TINYLOOP_TOKENIZER_DIR, then the model's
    embedded tokenizer, then raw bytes."""
    prompts: Tuple[str, ...] = ()
    """Prompts given inline."""
    prompts_file: Optional[str] = None
    """A text file with one prompt per line (blank lines skipped; the two characters \\n in a line
    stand for a newline, so a line can hold a multi-line prompt), or a .jsonl file of
    {"prompt": ...} objects (any text, as JSON writes it)."""
    mode: str = "generate"
    """generate (one prompt after another), batch (generate_batch over all prompts), speculative
    (generate_speculative per prompt, with the `speculative` section) or tree_speculative
    (generate_tree_speculative; the `speculative` section then also takes K_branches). A decoder
    with options also runs in mode generate: ``generate: {decoder: speculative, options: {...}}``."""
    stream: bool = True
    """Print tokens to the terminal as they are produced."""
    output_jsonl: Optional[str] = None
    """Write one JSON object per prompt (prompt, completion, token ids, stats) to this file."""
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    """Decode settings (GenerateConfig fields)."""
    speculative: Optional[SpeculativeConfig] = None
    """mode: speculative / tree_speculative only: SpeculativeConfig fields (draft_loops, verify_loops,
    draft_ahead, ...; K_branches for trees)."""
    prefix: Optional[str] = None
    """A shared prefix (a system prompt) put before every prompt: prefilled once into a prefix pool
    at the run's depth and cache mode, and reused by every request (generate_with_pool). Modes
    generate, speculative and tree_speculative."""
    resume: Optional[ResumeConfig] = None
    """Warm start: ``{loops_used: L, depths: [...]}``: each prompt is prefilled at L once, then
    decoded at every listed depth from the kept state (resume_generate). Mode generate, without
    generate.loops (the depths give it) and without a prefix."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str):
            raise ConfigError(f"model must be a file path, got {self.model!r}")
        for name in ("model", "tokenizer", "prompts_file", "output_jsonl"):
            v = getattr(self, name)
            if name != "model" and isinstance(v, os.PathLike):     # a pathlib.Path is a path (held as text)
                v = os.fspath(v)
                object.__setattr__(self, name, v)
            if v is not None and not isinstance(v, str):
                raise ConfigError(f"{name} must be a path (text), got {v!r}")
            if v is not None and "\0" in v:
                raise ConfigError(f"{name}={v!r} holds a NUL byte, which no path can contain")
        if self.output_jsonl == "":
            raise ConfigError("output_jsonl '' is empty: give a file path, or leave output_jsonl out to write "
                              "no results file")
        from .plugins import get_plugin_manager
        get_plugin_manager().check_backend_name(self.backend)
        _int("max_seq_len", self.max_seq_len, 1, 1 << 20)
        _int("prefill_chunk", self.prefill_chunk, 0, 1 << 20)
        if isinstance(self.prompts, str) or not isinstance(self.prompts, (list, tuple)):
            raise ConfigError(f"prompts must be a list of strings, got {self.prompts!r}")
        for p in self.prompts:
            if not isinstance(p, str):
                raise ConfigError(f"prompts must be strings, got {p!r}")
        object.__setattr__(self, "prompts", tuple(self.prompts))
        if not isinstance(self.mode, str) or self.mode not in RUN_MODES:
            raise ConfigError(f"mode={self.mode!r} is not one of {', '.join(RUN_MODES)}")
        spec_mode = self.mode in ("speculative", "tree_speculative")
        cls = TreeSpeculativeConfig if self.mode == "tree_speculative" else SpeculativeConfig
        if isinstance(self.speculative, Mapping):
            object.__setattr__(self, "speculative", from_mapping(cls, self.speculative, "speculative"))
        elif self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ConfigError(f"speculative must be a mapping of {cls.__name__} fields, got {self.speculative!r}")
        elif spec_mode and isinstance(self.speculative, SpeculativeConfig) and (
                isinstance(self.speculative, TreeSpeculativeConfig) != (cls is TreeSpeculativeConfig)):
            raise ConfigError(f"mode: {self.mode} takes a {cls.__name__} as its `speculative:` section, got "
                              f"{type(self.speculative).__name__}")
        if spec_mode and self.speculative is None:
            raise ConfigError(f"mode: {self.mode} needs a `speculative:` section (draft_loops, verify_loops, ...)")
        if not spec_mode and self.speculative is not None:
            raise ConfigError(f"a `speculative:` section is only used with mode: speculative or tree_speculative "
                              f"(mode is {self.mode!r})")
        if not isinstance(self.stream, bool):
            raise ConfigError(f"stream must be true or false, got {self.stream!r}")
        if isinstance(self.generate, Mapping):
            object.__setattr__(self, "generate",
                               from_mapping(GenerateConfig, self.generate, "generate"))
        elif not isinstance(self.generate, GenerateConfig):
            raise ConfigError(f"generate must be a mapping of GenerateConfig fields, got {self.generate!r}")
        if self.prefix is not None and (not isinstance(self.prefix, str) or not self.prefix):
            raise ConfigError(f"prefix must be a non-empty string (the text put before every prompt), got "
                              f"{self.prefix!r}")
        if self.prefix is not None and self.mode == "batch":
            raise ConfigError("prefix: is served through a prefix pool one request at a time; mode batch does not "
                              "use it (use mode generate)")
        if isinstance(self.resume, Mapping):
            object.__setattr__(self, "resume", from_mapping(ResumeConfig, self.resume, "resume"))
        elif self.resume is not None and not isinstance(self.resume, ResumeConfig):
            raise ConfigError(f"resume must be a mapping with loops_used and depths, got {self.resume!r}")
        if self.resume is not None:
            if self.mode != "generate":
                raise ConfigError(f"resume: runs in mode generate (mode is {self.mode!r}); a decoder with "
                                  f"options goes in generate: {{decoder: ..., options: {{...}}}}")
            if self.generate.loops is not None:
                raise ConfigError(f"resume: gives the depths; generate.loops={self.generate.loops} would be "
                                  f"ignored (remove it)")
            if self.prefix is not None:
                raise ConfigError("prefix: and resume: are separate reuse patterns (a prefix shared by many "
                                  "prompts, one prompt at several depths); use one of them")
        if spec_mode and self.generate.requested_fields():
            raise ConfigError(f"mode: {self.mode} takes its settings from the `speculative:` section; the "
                              f"`generate:` section would be ignored (it sets "
                              f"{', '.join(self.generate.requested_fields())}). Use mode: generate with "
                              f"generate: {{decoder: {self.mode}, options: {{...}}}} to combine them")


def read_text(path: str, what: str) -> str:
    """The UTF-8 text of the file `path` (`what` names it in errors): a ConfigError for a file that
    cannot be read or is not UTF-8."""
    try:
        with open(path, "r", encoding="utf-8") as fh:
            return fh.read()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path!r} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except ValueError as exc:           # a NUL byte in the path
        raise ConfigError(f"cannot read {what} {path!r}: {exc}") from None


def load_run_config(path: str) -> RunConfig:
    """Parse a YAML run config; errors name the file and the bad key or value."""
    import yaml

    text = read_text(path, "config")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        what = " ".join(str(exc).split())           # one line
        raise ConfigError(f"{path} is not valid YAML: {what}") from None
    except RecursionError:
        raise ConfigError(f"{path}: the YAML is nested too deeply to read") from None
    except ValueError as exc:           # a value PyYAML cannot build (2001-13-01, 5000-digit numbers)
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    try:
        _grammar_files(data, os.path.dirname(os.path.abspath(path)))
        return from_mapping(RunConfig, data, "run config")
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def _grammar_files(data: Any, base: str) -> None:
    """In a run config's ``generate: {grammar: ...}``, ``lark: FILE`` and ``json_schema: FILE`` name
    files (relative to the YAML file): read them in place (a json_schema may also be given inline
    as a mapping; ``regex`` is always inline)."""
    gen = data.get("generate") if isinstance(data, Mapping) else None
    g = gen.get("grammar") if isinstance(gen, Mapping) else None
    if not isinstance(g, Mapping):
        return
    from .grammar import KINDS
    kinds = [k for k in g if k in KINDS]
    if len(kinds) != 1:
        return                              # Grammar.from_mapping says what is wrong
    kind = kinds[0]
    value = g[kind]
    if kind not in ("lark", "json_schema") or not isinstance(value, str):
        return
    path = value if os.path.isabs(value) else os.path.join(base, value)
    text = read_text(path, f"grammar {kind} file")
    if kind == "json_schema":
        try:
            value = json.loads(text)
        except (ValueError, RecursionError) as exc:    # (JSONDecodeError, int digits, nesting)
            raise ConfigError(f"grammar json_schema file {path!r} is not JSON: {exc}") from None
    else:
        value = text
    gen = dict(gen)
    gen["grammar"] = {**g, kind: value}                 # an optional whitespace key stays beside it
    data["generate"] = gen
