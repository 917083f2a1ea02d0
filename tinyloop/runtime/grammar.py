"""Grammars for constrained decoding, compiled by llguidance (the optional extra tinyloop[grammar]).

``Grammar.lark(text)``, ``Grammar.regex(pattern)``, ``Grammar.json_schema(schema)`` and
``Grammar.json()`` describe what the output must be; construction validates the grammar (an invalid
one is a ConfigError quoting llguidance's message). A Grammar is immutable and reusable: it is
compiled once per tokenizer (:meth:`Grammar.matcher`, cached) into a matcher template, and every
sequence of every request gets its own copy of the template's state.

Tokenizers: llguidance sees the model's tokenizer as the bytes of every token id
(``Tokenizer.token_bytes``: the embedded byte-level BPE, a tokenizer directory, or raw bytes) and
the model's EOS id; a model without an EOS id gets a virtual one past its vocabulary, so that "the
grammar is complete" stays expressible (the mask then allows only that id, and the request ends
with GRAMMAR_COMPLETE).
"""

from __future__ import annotations

import itertools
import json
import threading
import weakref
from typing import Any, Dict, Optional, Tuple

from ..errors import ConfigError

INSTALL_HINT = "grammar-constrained decoding needs llguidance: pip install tinyloop[grammar]"


def _one_line(msg: Any) -> str:
    """llguidance's (multi-line, caret-annotated) message on one line."""
    return " ".join(str(msg).split())
KINDS = ("lark", "regex", "json_schema", "json")
#: The JSON kinds' whitespace between tokens (llguidance's JSON options): "flexible" any JSON
#: whitespace, as the JSON grammar allows (llguidance's default; runs of spaces and newlines
#: included, which a small model can fill until max_tokens); "compact" none at all
#: (``{"a":1,"b":[1,2]}``); "spaced" exactly Python's json.dumps separators (``{"a": 1, "b": [1, 2]}``).
#: A schema's own "x-guidance" whitespace settings stay under "flexible" (the default) and are
#: overridden by an explicit "compact" or "spaced".
WHITESPACE = {"flexible": None,
              "compact": {"whitespace_flexible": False, "whitespace_pattern": None, "item_separator": ",",
                          "key_separator": ":"},
              "spaced": {"whitespace_flexible": False, "whitespace_pattern": None, "item_separator": ", ",
                         "key_separator": ": "}}


def llguidance():
    """The llguidance module (ConfigError naming the extra when it is not installed)."""
    try:
        import llguidance as llg
    except ImportError:
        raise ConfigError(INSTALL_HINT) from None
    return llg


class _TokenizerView:
    """What llguidance's LLTokenizer reads from a tokenizer (its TokenizerWrapper protocol): the
    bytes of every id, the EOS and BOS ids, and an encoder."""

    def __init__(self, tokenizer, vocab_size: int, eos_id: int) -> None:
        n = tokenizer.vocab_size
        self.tokens = [tokenizer.token_bytes(i) for i in range(n)] + [b""] * (vocab_size - n)
        self.eos_token_id = eos_id
        self.bos_token_id = None
        self.special_token_ids = [eos_id]
        self.is_tokenizer_wrapper = True
        # weak: the cache below is keyed weakly by the tokenizer, and its value (llguidance's
        # tokenizer, which holds this view) must not keep the key alive
        self._tok = weakref.ref(tokenizer)

    def __call__(self, s) -> list:
        tok = self._tok()
        if tok is None:
            raise RuntimeError("the tokenizer of this llguidance tokenizer was freed")
        if isinstance(s, bytes):
            s = s.decode("utf-8", errors="replace")
        return list(tok.encode(s))


_LLTOK_LOCK = threading.Lock()
#: tokenizer -> {(ids, EOS): (serial, llguidance tokenizer)}; the serial, never reused, keys the
#: grammars' compiled templates (an id() of a freed llguidance tokenizer could be reused)
_LLTOKS: "weakref.WeakKeyDictionary[Any, Dict[Tuple[int, int], Tuple[int, Any]]]" = weakref.WeakKeyDictionary()
_SERIALS = itertools.count()
#: serials whose tokenizer is alive (bounded by the live tokenizers: a freed one's serial leaves as
#: its tokenizer goes); the grammars drop their templates of any other serial
_LIVE: set = set()


def ll_vocab(vocab_size: int, eos_id: Optional[int]) -> Tuple[int, int]:
    """(ids llguidance sees, its EOS id): the model's vocabulary and EOS, or for a model without
    an EOS id one more id, the virtual EOS vocab_size."""
    return (vocab_size, eos_id) if eos_id is not None else (vocab_size + 1, vocab_size)


def _ll_entry(tokenizer, vocab_size: int, eos_id: Optional[int]) -> Tuple[int, Any]:
    """(serial, the llguidance tokenizer for `tokenizer` with the model's vocabulary and EOS
    (ll_vocab)): built once per (tokenizer, vocab, EOS) and cached as long as the tokenizer lives."""
    llg = llguidance()
    n, eos = ll_vocab(vocab_size, eos_id)
    with _LLTOK_LOCK:
        per = _LLTOKS.setdefault(tokenizer, {})
        entry = per.get((n, eos))
        if entry is None:
            view = _TokenizerView(tokenizer, n, eos)
            try:
                lt = llg.LLTokenizer(llg.TokenizerWrapper(view), n_vocab=n, eos_token=eos)
            except Exception as exc:          # llguidance's own message, typed
                raise ConfigError(f"llguidance cannot use the tokenizer {tokenizer!r}: {_one_line(exc)}") from None
            entry = per[(n, eos)] = (next(_SERIALS), lt)
            _LIVE.add(entry[0])
            weakref.finalize(tokenizer, _LIVE.discard, entry[0])
    return entry


class Grammar:
    """A constraint on the generated text (GenerateConfig.grammar). Build with the class methods;
    ``kind`` and ``source`` say what it was built from."""

    __slots__ = ("kind", "source", "whitespace", "_ll", "_templates", "_lock", "__weakref__")

    def __init__(self, kind: str, source: Any, ll_grammar: str, whitespace: Optional[str] = None) -> None:
        self.kind, self.source, self._ll = kind, source, ll_grammar
        self.whitespace = whitespace            # the JSON kinds' WHITESPACE style; None for the others
        self._templates: Dict[int, Any] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        src = self.source if isinstance(self.source, str) else json.dumps(self.source, sort_keys=True)
        ws = f", whitespace={self.whitespace!r}" if self.whitespace not in (None, "flexible") else ""
        if self.kind == "json":
            return f"Grammar.json({ws[2:]})"
        return f"Grammar.{self.kind}({src[:60]!r}{'...' if len(src) > 60 else ''}{ws})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Grammar) and (self.kind, self._ll) == (other.kind, other._ll)

    def __hash__(self) -> int:
        return hash((self.kind, self._ll))

    def __reduce__(self):
        return (_rebuild, (self.kind, self.source) + ((self.whitespace,) if self.whitespace is not None else ()))

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _json_options(whitespace: Any) -> Optional[dict]:
        """llguidance's JSON options for a WHITESPACE style (ConfigError naming the allowed ones)."""
        if not isinstance(whitespace, str) or whitespace not in WHITESPACE:
            raise ConfigError(f"whitespace={whitespace!r} is not one of {', '.join(WHITESPACE)}")
        return WHITESPACE[whitespace]

    @classmethod
    def _make(cls, kind: str, source: Any, ll_grammar: str, whitespace: Optional[str] = None) -> "Grammar":
        llg = llguidance()
        try:
            is_error, msgs = llg.LLMatcher.validate_grammar_with_warnings(ll_grammar)
        except Exception as exc:
            raise ConfigError(f"invalid {kind} grammar: {_one_line(exc)}") from None
        if is_error:
            raise ConfigError(f"invalid {kind} grammar: {_one_line(msgs[0]) if msgs else 'rejected by llguidance'}")
        return cls(kind, source, ll_grammar, whitespace)

    @classmethod
    def lark(cls, text: str) -> "Grammar":
        """A Lark grammar (llguidance's dialect: ``start: ...``; regexes, %json, lexemes)."""
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"a Lark grammar must be non-empty text, got {text!r:.80}")
        return cls._make("lark", text, llguidance().LLMatcher.grammar_from_lark(text))

    @classmethod
    def regex(cls, pattern: str) -> "Grammar":
        """The output must match `pattern` as a whole (a Rust-regex dialect; no lookaround)."""
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"a regex must be a non-empty string, got {pattern!r:.80}")
        return cls._make("regex", pattern, llguidance().LLMatcher.grammar_from_regex(pattern))

    @classmethod
    def json_schema(cls, schema: Any, whitespace: str = "flexible") -> "Grammar":
        """The output must be JSON valid under `schema` (a dict, or its JSON text), with the
        `whitespace` style between its tokens (WHITESPACE: flexible, compact or spaced)."""
        options = cls._json_options(whitespace)
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"the JSON schema is not valid JSON: {_one_line(exc)}") from None
        if not isinstance(schema, (dict, bool)):
            raise ConfigError(f"a JSON schema must be an object (a dict or its JSON text), got "
                              f"{type(schema).__name__}")
        schema = _plain_json(schema)
        if schema is False:                   # llguidance applies a whitespace style to objects only
            raise ConfigError("invalid json_schema grammar: Unsatisfiable schema: schema is false")
        try:
            ll = llguidance().LLMatcher.grammar_from_json_schema({} if schema is True else schema,
                                                                 overrides=options)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"invalid JSON schema: {_one_line(exc)}") from None
        return cls._make("json_schema", schema, ll, whitespace)

    @classmethod
    def json(cls, whitespace: str = "flexible") -> "Grammar":
        """Any JSON value, with the `whitespace` style between its tokens (as json_schema)."""
        options = cls._json_options(whitespace)
        return cls._make("json", {}, llguidance().LLMatcher.grammar_from_json_schema({}, overrides=options),
                         whitespace)

    @classmethod
    def from_mapping(cls, data: Any, where: str = "grammar") -> "Grammar":
        """A Grammar from a mapping with one kind key {lark: text | regex: pattern | json_schema:
        schema | json: anything}, and for the JSON kinds an optional ``whitespace: flexible |
        compact | spaced`` beside it (run configs; file paths are resolved by the config loader)."""
        kinds = [k for k in data if k in KINDS] if isinstance(data, dict) else []
        others = [k for k in data if k not in KINDS] if isinstance(data, dict) else []
        if len(kinds) != 1 or others not in ([], ["whitespace"]):
            raise ConfigError(f"{where} must be a mapping with exactly one of {', '.join(KINDS)} (and for "
                              f"json_schema / json an optional whitespace), got {data!r:.80}")
        kind = kinds[0]
        if others and kind not in ("json_schema", "json"):
            raise ConfigError(f"{where}: whitespace applies to json_schema and json grammars, not {kind}")
        return _rebuild(kind, data[kind], *(data[k] for k in others))

    # ------------------------------------------------------------------ per tokenizer
    def matcher(self, tokenizer, vocab_size: int, eos_id: Optional[int]):
        """A fresh llguidance matcher of this grammar for the model's tokenizer (copied from a
        template compiled once per tokenizer). ConfigError when the grammar cannot be compiled for
        this tokenizer (llguidance's message)."""
        vocab_size, eos_id = _matcher_arguments(tokenizer, vocab_size, eos_id)
        serial, lt = _ll_entry(tokenizer, vocab_size, eos_id)
        with self._lock:
            for gone in [s for s in self._templates if s not in _LIVE]:   # templates of freed tokenizers
                del self._templates[gone]
            tpl = self._templates.get(serial)
            if tpl is None:
                llg = llguidance()
                tpl = llg.LLMatcher(lt, self._ll, log_level=0)
                if tpl.is_error():
                    raise ConfigError(f"the {self.kind} grammar cannot be used with tokenizer {tokenizer!r}: "
                                      f"{_one_line(tpl.get_error())}")
                self._templates[serial] = tpl
        return tpl.deep_copy()


def _matcher_arguments(tokenizer: Any, vocab_size: Any, eos_id: Any) -> Tuple[int, Optional[int]]:
    """Grammar.matcher's arguments checked (ConfigError naming the one that is wrong): a tinyloop
    Tokenizer, the model's vocabulary size (at least the tokenizer's) and its EOS id (None or an id
    inside the vocabulary); numpy integers as the ints they hold."""
    from ..model.tokenizer import Tokenizer
    from .config import numpy_int
    if not isinstance(tokenizer, Tokenizer):
        raise ConfigError(f"tokenizer must be a tinyloop Tokenizer (model.tokenizer), got "
                          f"{type(tokenizer).__name__} {tokenizer!r:.40}")
    V = int(vocab_size) if numpy_int(vocab_size) else vocab_size
    if isinstance(V, bool) or not isinstance(V, int) or not 1 <= V < 1 << 31:
        raise ConfigError(f"vocab_size={vocab_size!r:.40} must be an integer in [1, {(1 << 31) - 1}] (the model's)")
    if tokenizer.vocab_size > V:
        raise ConfigError(f"vocab_size={V} is below the tokenizer's {tokenizer.vocab_size} ids")
    eos = int(eos_id) if numpy_int(eos_id) else eos_id
    if eos is not None and (isinstance(eos, bool) or not isinstance(eos, int) or not 0 <= eos < V):
        raise ConfigError(f"eos_id={eos_id!r:.40} must be None or a token id in [0, {V})")
    return V, eos


def _numpy_value(value: Any) -> Any:
    """json.dumps' ``default``: a numpy scalar or array as the Python value it holds."""
    tolist = getattr(value, "tolist", None)
    if tolist is not None and type(value).__module__ == "numpy":
        return tolist()
    raise TypeError(f"{type(value).__name__} {value!r:.40}")


def _plain_json(schema: Any) -> Any:
    """`schema` as plain JSON data (dicts with string keys, lists, str, int, float, bool, None;
    numpy values as the numbers they hold), or a ConfigError: llguidance turns NaN and Infinity
    into null (a {"const": Infinity} grammar writes null) and crashes the process on a dict that
    contains itself."""
    try:
        return json.loads(json.dumps(schema, allow_nan=False, default=_numpy_value))
    except (ValueError, TypeError, RecursionError) as exc:
        raise ConfigError(f"the JSON schema is not valid JSON data: {_one_line(exc)} (JSON has no NaN "
                          f"or Infinity, and a schema cannot contain itself: use $defs and $ref)") from None


def _rebuild(kind: str, source: Any, *whitespace: str) -> Grammar:
    """The Grammar of `kind` from its source (Grammar.json takes none), a JSON kind's whitespace
    style when one is given."""
    return Grammar.json(*whitespace) if kind == "json" else getattr(Grammar, kind)(source, *whitespace)
