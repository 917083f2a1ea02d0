"""Tokenizers: GPT-2-style byte-level BPE and Hugging Face ``tokenizer.json`` tokenizers (both
through the optional ``tokenizers`` library), a raw-byte fallback, and :func:`resolve_tokenizer`,
which picks the tokenizer a model uses.

Every tokenizer maps text to token ids and back, and offers an incremental decoder
(:meth:`Tokenizer.stream_decoder`) for streaming generation: ``push(token_id)`` returns only text
that is complete, holding back the bytes of a UTF-8 character split over several tokens until the
character is whole; ``flush()`` returns what is left, with U+FFFD for bytes that never became a
valid character. Concatenating every ``push`` result and ``flush()`` equals ``decode(ids)``.

Text is ``token_bytes`` joined and decoded as UTF-8 with replacement, then, for a tokenizer whose
``strip_leading_spaces`` is n > 0 (SentencePiece-style tokenizers, see below), with up to n " "
removed from the very start of the text; the stream decoder removes the same spaces at the start
of its stream (whatever tokens come first: special tokens and partial characters emit "" and do
not end the leading run). Note that this makes ``decode(completion_ids)`` drop the space between a
prompt and its completion, as the ``tokenizers`` library does; a caller streaming a continuation
can use ``StreamDecoder(tokenizer, strip_leading_spaces=0)``.

Ids that have no token (ids past a vocabulary, gaps in it, or >= 256 for :class:`ByteTokenizer`)
decode to nothing (""), matching the ``tokenizers`` library, which skips unknown ids (whatever their
size: ids past 2**32 - 1 too, which the library itself cannot take). A token id is an integer >= 0
(Python's or numpy's); a negative id, a bool, a float (even 1.0), a str, or ``decode`` of something
that is not a sequence of ids (None, a number, a str, bytes) is a TokenizerError. ``encode`` takes
Unicode text: a str holding a lone surrogate (U+D800..U+DFFF, e.g. a pair written as two escapes)
is a TokenizerError naming it and its index.

Embedded forms (stored in a model file's header, produced by ``to_embedded()`` and read back by
:func:`tokenizer_from_embedded`, which dispatches on ``type``)::

    {"type": "bpe", "vocab": {token: id, ...}, "merges": ["a b", ...]}     # BPETokenizer
    {"type": "hf", "json": "<the tokenizer.json text>"}                    # HFTokenizer

For "bpe", tokens are written in GPT-2's byte-to-unicode alphabet (a space is "Ġ"), exactly as in a
GPT-2 ``vocab.json`` / ``merges.txt`` pair.

:class:`HFTokenizer` (a ``tokenizer.json``: Llama-2/3, Mistral, Qwen2, GPT-2, ...) encodes with the
library (``encode(text, add_special_tokens=False)``: the runtime adds BOS itself; padding and
truncation configured in the file are switched off; added tokens written in the text are matched,
as the library does). Its ``token_bytes`` are derived from the file's decoder, so that streaming
and grammar masks (llguidance reads ``token_bytes`` of every id) see exact bytes:

* ByteLevel (the decoder is ByteLevel; with no decoder, a ByteLevel pre-tokenizer): a token whose
  every character is in GPT-2's byte alphabet is those bytes (:func:`unicode_to_byte`); any other
  token is its own UTF-8, whole (the library's ByteLevel decoder keeps such a token verbatim).
* SentencePiece style (a decoder made of Replace (string patterns), ByteFallback, Fuse, Strip and
  Metaspace, as Llama-2/Mistral/Gemma write it; with no decoder, a Metaspace pre-tokenizer): the
  decoder's Replace patterns are applied in order (Metaspace: its replacement char -> " "); then a
  token ``<0xNN>`` is the single byte NN when the decoder has ByteFallback or the model has
  ``byte_fallback``; any other token is its UTF-8. ``strip_leading_spaces`` is the ``start`` of a
  final ``Strip(" ", start, 0)`` after Fuse, or 1 for a Metaspace decoder whose prepend_scheme is
  not "never".
* Anything else (WordPiece, BPE with a word suffix/prefix, CTC, a Regex Replace, an order of
  decoder steps whose effect is not per token, ...) is refused with TokenizerError, not guessed.
* Added tokens: ``special: true`` -> b"" (as ``decode(..., skip_special_tokens=True)``); the others
  go through the same rule as model tokens (the library runs their content through the decoder).

Where this differs from the library's ``decode(ids, skip_special_tokens=True)`` (tests document
each): a run of ``<0xNN>`` tokens that is not valid UTF-8 gives one U+FFFD per token there (and the
run's valid bytes are lost), here Python's UTF-8 replacement (one U+FFFD per maximal invalid
subsequence); a Metaspace decoder drops every replacement char of the first token, here one leading
space; a model with byte_fallback but a decoder without ByteFallback prints ``<0xNN>`` there, the
byte here; with no decoder the library joins tokens with " ". ``transformers``' decode may also
apply ``clean_up_tokenization_spaces`` (" ." -> "."), which is not a property of the tokens.
"""

from __future__ import annotations

import codecs
import json
import operator
import os
import re
from functools import lru_cache
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import TokenizerError
from .arch import MAX_DIM

#: Largest vocabulary (one more than the largest token id) a tokenizer may have: the largest
#: vocab_size a model may have (ModelConfig), so a file's ids never size a table past it.
MAX_VOCAB = 4 * MAX_DIM

#: Environment variable naming a tokenizer directory (tokenizer.json, or vocab.json + merges.txt).
TOKENIZER_ENV = "TINYLOOP_TOKENIZER_DIR"

#: The ``type`` values of the embedded forms :func:`tokenizer_from_embedded` accepts.
EMBEDDED_TYPES = ("bpe", "hf")

_INSTALL_HINT = ("the BPE and tokenizer.json tokenizers need the 'tokenizers' package: "
                 "pip install tinyloop[tokenizer]")


def _require_tokenizers():
    """Import the optional ``tokenizers`` library, or raise TokenizerError with the install hint."""
    try:
        from tokenizers import Tokenizer as LibTokenizer, decoders, models, pre_tokenizers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise TokenizerError(f"{_INSTALL_HINT} ({e})") from None
    return LibTokenizer, models, pre_tokenizers, decoders


@lru_cache(maxsize=1)
def byte_to_unicode() -> Dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map (the ByteLevel alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@lru_cache(maxsize=1)
def unicode_to_byte() -> Dict[str, int]:
    return {c: b for b, c in byte_to_unicode().items()}


def _check_id(i) -> int:
    """`i` as a token id: an integer >= 0 (Python's or numpy's; not a bool, a float or a str)."""
    try:
        v = None if isinstance(i, (bool, np.timedelta64)) else operator.index(i)
    except Exception:                       # TypeError, or what a caller's own __index__ raised
        v = None
    if v is None or v < 0:
        raise TokenizerError(f"token id {i!r} is not a token id: token ids are integers >= 0")
    return v


def _check_ids(ids: Iterable[int]) -> List[int]:
    if (isinstance(ids, (str, bytes, bytearray)) or not hasattr(ids, "__iter__")
            or (isinstance(ids, np.ndarray) and ids.ndim == 0)):
        raise TokenizerError(f"decode needs a sequence of token ids (integers >= 0), got "
                             f"{type(ids).__name__} {ids!r:.40}")
    try:
        items = list(ids)
    except Exception as exc:                # a caller's object whose iteration fails
        raise TokenizerError(f"decode needs a sequence of token ids (integers >= 0); reading the "
                             f"{type(ids).__name__} given failed: {type(exc).__name__}: {exc}") from None
    return [_check_id(i) for i in items]


def _check_continuation(continuation: Any) -> bool:
    if not isinstance(continuation, (bool, np.bool_)):
        raise TokenizerError(f"continuation must be True or False, got {continuation!r:.40}")
    return bool(continuation)


def _utf8(text: str, name: str) -> bytes:
    """`text` as UTF-8, or TokenizerError naming the lone surrogate that makes it no Unicode text."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = text[e.start]
        raise TokenizerError(f"{name}: encode failed: the text holds a lone surrogate {c!r} (U+{ord(c):04X}) "
                             f"at index {e.start}; text must be Unicode without surrogate code points "
                             f"(U+D800..U+DFFF)") from None


def _strip_spaces(text: str, n: int) -> str:
    """`text` without up to `n` leading " "."""
    k = 0
    while k < n and k < len(text) and text[k] == " ":
        k += 1
    return text[k:]


class StreamDecoder:
    """Incremental detokenizer. ``push(id)`` returns the text completed by that token ("" while a
    multi-byte character is still incomplete); ``flush()`` returns the remainder (incomplete bytes
    become U+FFFD) and resets the decoder. Up to `strip_leading_spaces` " " are dropped from the
    start of the stream (default: the tokenizer's ``strip_leading_spaces``, as its ``decode``
    does; pass 0 to stream a continuation of earlier text)."""

    def __init__(self, tokenizer: "Tokenizer", strip_leading_spaces: Optional[int] = None) -> None:
        self._tok = tokenizer
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        n = getattr(tokenizer, "strip_leading_spaces", 0) if strip_leading_spaces is None \
            else strip_leading_spaces
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise TokenizerError(f"strip_leading_spaces must be a non-negative integer, got {n!r}")
        self._strip = n
        self._left = n          # leading spaces still to drop; 0 once a non-space char was emitted

    def _emit(self, text: str) -> str:
        if self._left and text:
            stripped = _strip_spaces(text, self._left)
            removed = len(text) - len(stripped)
            # a non-space char (or the n-th space) ends the leading run for good
            self._left = 0 if stripped else self._left - removed
            return stripped
        return text

    def push(self, token_id: int) -> str:
        tid = _check_id(token_id)
        return self._emit(self._dec.decode(self._tok.token_bytes(tid), final=False))

    def flush(self) -> str:
        out = self._emit(self._dec.decode(b"", final=True))
        self._dec.reset()
        self._left = self._strip
        return out


class Tokenizer:
    """Tokenizer protocol. Subclasses implement :meth:`encode` and :meth:`token_bytes`; ``decode``
    defaults to joining token bytes and decoding them as UTF-8 with replacement."""

    name: str = "tokenizer"
    #: How many leading " " ``decode`` (and the stream decoder) drop from the start of the text.
    strip_leading_spaces: int = 0
    #: The model's chat template (Jinja text, tinyloop.apply_chat_template), None without one.
    chat_template: Optional[str] = None
    #: The checkpoint's special-token texts a chat template names (``bos_token``, ``eos_token``,
    #: ``pad_token``, ``unk_token``: tokenizer_config.json's), empty when the directory gave none.
    special_tokens: Dict[str, str] = {}

    def token_text(self, token_id: int) -> str:
        """The token's text as a chat template names it (an added token's content, e.g.
        "<|begin_of_text|>"); this default decodes its bytes."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    @property
    def vocab_size(self) -> int:
        """One more than the largest id this tokenizer can produce or decode."""
        raise NotImplementedError

    def encode(self, text: str) -> List[int]:
        raise NotImplementedError

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token (b"" for ids without a token)."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int], continuation: bool = False) -> str:
        """The text of `ids`. ``continuation=True``: the text they add after a prompt (a
        completion), so the tokenizer's leading-space strip, which only a text's start gets,
        does not apply."""
        ids = _check_ids(ids)
        continuation = _check_continuation(continuation)
        text = b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")
        if self.strip_leading_spaces and not continuation:
            return _strip_spaces(text, self.strip_leading_spaces)
        return text

    def stream_decoder(self, continuation: bool = False) -> StreamDecoder:
        """An incremental decoder; ``continuation=True`` for a completion streamed after its
        prompt (as :meth:`decode`)."""
        return StreamDecoder(self, 0 if _check_continuation(continuation) else None)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} vocab_size={self.vocab_size}>"


class ByteTokenizer(Tokenizer):
    """Raw-byte fallback: a token id is a UTF-8 byte value (0..255). Needs a model vocab of at least
    256. Ids >= 256 have no byte and decode to "" (they are skipped, not replaced by a marker)."""

    name = "bytes"

    def __init__(self, model_vocab_size: int = 256) -> None:
        if model_vocab_size < 256:
            raise TokenizerError(
                f"the byte-level fallback tokenizer needs vocab_size >= 256, the model has "
                f"{model_vocab_size}; configure a tokenizer (--tokenizer DIR or {TOKENIZER_ENV})")
        self.model_vocab_size = model_vocab_size

    @property
    def vocab_size(self) -> int:
        return 256

    def encode(self, text: str) -> List[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"encode() needs a str, got {type(text).__name__}")
        return list(_utf8(text, self.name))

    def token_bytes(self, token_id: int) -> bytes:
        token_id = _check_id(token_id)
        return bytes((token_id,)) if token_id < 256 else b""


class BPETokenizer(Tokenizer):
    """GPT-2-style byte-level BPE: ``tokenizers`` BPE model + ByteLevel pre-tokenizer
    (add_prefix_space=False) + ByteLevel decoder. Build with :meth:`from_dir`, :meth:`from_embedded`
    or the constructor (vocab {token: id}, merges [(a, b), ...]).

    A vocab/merges pair has no special tokens: a token such as "<|endoftext|>" written in the text
    is encoded as ordinary text (transformers' GPT2TokenizerFast over the same files matches
    "<|endoftext|>" as its special token by default), and ``decode`` gives every id's text, EOS
    included (as transformers' ``decode`` does by default, skip_special_tokens=False);
    stream_text / generate_text leave the model's EOS out."""

    def __init__(self, vocab: Dict[str, int], merges: Sequence[Tuple[str, str]],
                 name: str = "bpe") -> None:
        vocab, merges = _validate_bpe(vocab, merges, name)
        LibTokenizer, models, pre_tokenizers, decoders = _require_tokenizers()
        try:
            tok = LibTokenizer(models.BPE(vocab=dict(vocab), merges=list(merges)))
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
        except Exception as e:
            raise TokenizerError(f"{name}: cannot build the BPE tokenizer: {e}") from None
        self._tok = tok
        self._vocab = vocab
        self._merges = merges
        self.name = name
        self._vocab_size = max(vocab.values()) + 1
        u2b = unicode_to_byte()
        tb: List[bytes] = [b""] * self._vocab_size
        for t, i in vocab.items():
            if all(c in u2b for c in t):
                tb[i] = bytes(u2b[c] for c in t)
            else:  # the ByteLevel decoder keeps a token with a char outside the alphabet verbatim
                tb[i] = t.encode("utf-8")
        self._token_bytes = tb
        b2u = byte_to_unicode()
        self._missing_bytes = frozenset(b for b in range(256) if b2u[b] not in vocab)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dir(cls, path: str) -> "BPETokenizer":
        """Load a GPT-2 format tokenizer directory: ``vocab.json`` ({token: id}) and ``merges.txt``
        (optional ``#version`` first line, then one "a b" merge per line)."""
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise TokenizerError(f"tokenizer directory {path!r} does not exist or is not a directory")
        vpath = os.path.join(path, "vocab.json")
        mpath = os.path.join(path, "merges.txt")
        for p in (vpath, mpath):
            if not os.path.isfile(p):
                raise TokenizerError(f"tokenizer directory {path!r} has no {os.path.basename(p)} "
                                     f"(expected vocab.json and merges.txt, GPT-2 format)")
        try:
            with open(vpath, "r", encoding="utf-8") as f:
                vocab = json.load(f)
        except (ValueError, RecursionError) as e:     # (JSONDecodeError, UnicodeDecodeError, int digits)
            raise TokenizerError(f"{vpath}: not valid JSON: {e}") from None
        except OSError as e:
            raise TokenizerError(f"{vpath}: cannot read: {e}") from None
        try:
            with open(mpath, "r", encoding="utf-8") as f:
                lines = f.read().split("\n")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{mpath}: cannot read: {e}") from None
        merges = []
        for n, line in enumerate(lines, 1):
            line = line.rstrip("\r")
            if not line or (n == 1 and line.startswith("#version")):
                continue
            parts = line.split(" ")
            if len(parts) != 2 or not parts[0] or not parts[1]:
                raise TokenizerError(f"{mpath}:{n}: a merge must be two tokens separated by one "
                                     f"space, got {line!r}")
            merges.append((parts[0], parts[1]))
        return cls(vocab, merges, name=f"bpe:{path}")

    @classmethod
    def from_embedded(cls, d: dict) -> "BPETokenizer":
        """Build from the embedded dict form {"type": "bpe", "vocab": {...}, "merges": ["a b", ...]}
        (optionally "chat_template": the Jinja text of the model's chat template)."""
        if not isinstance(d, dict):
            raise TokenizerError(f"embedded tokenizer must be a mapping, got {type(d).__name__}")
        if d.get("type") != "bpe":
            raise TokenizerError(f"embedded tokenizer type {d.get('type')!r} is not supported "
                                 f"(only 'bpe')")
        unknown = sorted(set(d) - {"type", "vocab", "merges", "chat_template", "special_tokens"}, key=str)
        if unknown:
            raise TokenizerError(f"embedded tokenizer has unknown key(s) {unknown}")
        if "vocab" not in d or "merges" not in d:
            raise TokenizerError("embedded tokenizer needs both 'vocab' and 'merges'")
        raw = d["merges"]
        if not isinstance(raw, list):
            raise TokenizerError("embedded tokenizer 'merges' must be a list of \"a b\" strings")
        merges = []
        for n, m in enumerate(raw):
            if isinstance(m, str):
                parts = m.split(" ")
            elif isinstance(m, (list, tuple)):
                parts = list(m)
            else:
                parts = []
            if len(parts) != 2 or not all(isinstance(p, str) and p for p in parts):
                raise TokenizerError(f"embedded tokenizer merge #{n} must be \"a b\", got {m!r}")
            merges.append((parts[0], parts[1]))
        tok = cls(d["vocab"], merges, name="bpe:embedded")
        _embedded_extras(tok, d)
        return tok

    def to_embedded(self) -> dict:
        return _with_extras(self, {"type": "bpe", "vocab": dict(self._vocab),
                                   "merges": [f"{a} {b}" for a, b in self._merges]})

    # ------------------------------------------------------------------ protocol
    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str) -> List[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"encode() needs a str, got {type(text).__name__}")
        raw = _utf8(text, self.name)
        if self._missing_bytes:
            bad = self._missing_bytes.intersection(raw)
            if bad:
                raise TokenizerError(
                    f"{self.name}: the vocabulary has no token for byte(s) "
                    f"{sorted(hex(b) for b in bad)} in the text; it cannot encode it losslessly")
        try:
            return list(self._tok.encode(text, add_special_tokens=False).ids)
        except Exception as e:
            raise TokenizerError(f"{self.name}: encode failed: {e}") from None

    def decode(self, ids: Sequence[int], continuation: bool = False) -> str:
        # ids without a token decode to nothing (the library skips those it can take, and takes
        # no id past 2**32 - 1)
        ids = [i for i in _check_ids(ids) if i < self._vocab_size]
        _check_continuation(continuation)
        try:
            return self._tok.decode(ids, skip_special_tokens=False)
        except Exception as e:
            raise TokenizerError(f"{self.name}: decode failed: {e}") from None

    def token_bytes(self, token_id: int) -> bytes:
        token_id = _check_id(token_id)
        return self._token_bytes[token_id] if token_id < self._vocab_size else b""


def _validate_bpe(vocab, merges, name: str) -> Tuple[Dict[str, int], List[Tuple[str, str]]]:
    """Check a vocab/merges pair before handing it to ``tokenizers`` (which panics on a merge whose
    result is missing from the vocabulary)."""
    if not isinstance(vocab, dict) or not vocab:
        raise TokenizerError(f"{name}: vocab must be a non-empty mapping {{token: id}}")
    seen: Dict[int, str] = {}
    for t, i in vocab.items():
        if not isinstance(t, str) or not t:
            raise TokenizerError(f"{name}: vocab token {t!r} must be a non-empty string")
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < MAX_VOCAB:
            raise TokenizerError(f"{name}: vocab id of {t!r} must be a non-negative integer below {MAX_VOCAB} "
                                 f"(a model's largest vocabulary), got {i!r}")
        if i in seen:
            raise TokenizerError(f"{name}: tokens {seen[i]!r} and {t!r} share id {i}")
        seen[i] = t
    out = []
    for n, m in enumerate(merges):
        a, b = m
        for part in (a, b, a + b):
            if part not in vocab:
                raise TokenizerError(f"{name}: merge #{n} {a!r} {b!r} uses {part!r}, which is not "
                                     f"in the vocabulary")
        out.append((a, b))
    return dict(vocab), out


# ------------------------------------------------------------------------- tokenizer.json
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SEQUENCE_KEYS = ("decoders", "pretokenizers")
_SP_DECODERS = ("Replace", "ByteFallback", "Fuse", "Strip", "Metaspace")


def _steps(component: Any, what: str, name: str) -> List[dict]:
    """A decoder / pre-tokenizer JSON object as the flat list of its steps (Sequences unrolled)."""
    if component is None:
        return []
    if not isinstance(component, dict):
        raise TokenizerError(f"{name}: the {what} must be an object or null, got {component!r:.80}")
    if component.get("type") == "Sequence":
        for key in _SEQUENCE_KEYS:
            if isinstance(component.get(key), list):
                return [s for c in component[key] for s in _steps(c, what, name)]
        raise TokenizerError(f"{name}: the {what} Sequence has no list of steps")
    return [component]


class _ByteRule:
    """How the tokens of one tokenizer.json become bytes (see the module docstring)."""

    def __init__(self, kind: str, replacements: Sequence[Tuple[str, str]] = (),
                 byte_tokens: bool = False, strip: int = 0) -> None:
        self.kind = kind                    # "byte_level" or "sentencepiece"
        self.replacements = list(replacements)
        self.byte_tokens = byte_tokens
        self.strip = strip

    def __call__(self, token: str) -> bytes:
        if self.kind == "byte_level":
            u2b = unicode_to_byte()
            if all(c in u2b for c in token):
                return bytes(u2b[c] for c in token)
            return token.encode("utf-8")
        for pattern, content in self.replacements:
            token = token.replace(pattern, content)
        if self.byte_tokens:
            m = _BYTE_TOKEN.fullmatch(token)
            if m:
                return bytes((int(m.group(1), 16),))
        return token.encode("utf-8")


def _byte_rule(spec: dict, name: str) -> _ByteRule:
    """The byte rule of a (canonical, as re-serialized by the library) tokenizer.json, or
    TokenizerError for a layout whose token bytes cannot be derived exactly."""
    model = spec.get("model") if isinstance(spec.get("model"), dict) else {}
    mtype = model.get("type")
    if mtype == "WordPiece":
        raise TokenizerError(f"{name}: unsupported tokenizer model WordPiece (its decoder joins "
                             f"word pieces; token bytes are not defined per token)")
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise TokenizerError(f"{name}: unsupported tokenizer model {mtype} with {key}="
                                 f"{model[key]!r} (token bytes are not defined per token)")
    dec = _steps(spec.get("decoder"), "decoder", name)
    types = [d.get("type") for d in dec]
    if not dec:
        pre = [p.get("type") for p in _steps(spec.get("pre_tokenizer"), "pre_tokenizer", name)]
        if "ByteLevel" in pre:
            return _ByteRule("byte_level")
        if "Metaspace" in pre:
            ms = _steps(spec.get("pre_tokenizer"), "pre_tokenizer", name)[pre.index("Metaspace")]
            return _ByteRule("sentencepiece", [(ms.get("replacement", "\u2581"), " ")],
                             byte_tokens=bool(model.get("byte_fallback")),
                             strip=0 if ms.get("prepend_scheme") == "never" else 1)
        raise TokenizerError(f"{name}: unsupported tokenizer: no decoder, and the pre-tokenizer "
                             f"{pre or None} is neither ByteLevel nor Metaspace")
    unsupported = f"{name}: unsupported tokenizer decoder {types}"
    if "ByteLevel" in types:
        if types != ["ByteLevel"]:
            raise TokenizerError(f"{unsupported}: ByteLevel combined with other steps")
        return _ByteRule("byte_level")
    bad = [t for t in types if t not in _SP_DECODERS]
    if bad:
        raise TokenizerError(f"{unsupported}: {bad[0]} is not supported (supported: ByteLevel, or "
                             f"SentencePiece style {', '.join(_SP_DECODERS)})")
    if not {"Replace", "ByteFallback", "Metaspace"} & set(types):
        raise TokenizerError(f"{unsupported}: neither ByteLevel nor SentencePiece style "
                             f"(no Replace, ByteFallback or Metaspace)")
    for t in ("ByteFallback", "Fuse", "Strip", "Metaspace"):
        if types.count(t) > 1:
            raise TokenizerError(f"{unsupported}: {t} appears more than once")
    if "Metaspace" in types and "Strip" in types:
        raise TokenizerError(f"{unsupported}: Metaspace combined with Strip")
    per_token = [i for i, t in enumerate(types) if t in ("Replace", "Metaspace")]
    if "ByteFallback" in types and per_token and max(per_token) > types.index("ByteFallback"):
        raise TokenizerError(f"{unsupported}: a replacement after ByteFallback would also rewrite "
                             f"the bytes it produces")
    if "Fuse" in types and max(i for i, t in enumerate(types) if t != "Strip") > types.index("Fuse"):
        raise TokenizerError(f"{unsupported}: steps after Fuse apply to the whole text, not per token")
    replacements: List[Tuple[str, str]] = []
    strip = 0
    for d in dec:
        t = d["type"]
        if t == "Replace":
            pattern, content = d.get("pattern"), d.get("content")
            if not (isinstance(pattern, dict) and isinstance(pattern.get("String"), str)
                    and pattern["String"] and isinstance(content, str)):
                raise TokenizerError(f"{unsupported}: Replace with pattern {pattern!r} (only a "
                                     f"non-empty String pattern is supported, not a Regex)")
            replacements.append((pattern["String"], content))
        elif t == "Metaspace":
            replacements.append((d.get("replacement", "\u2581"), " "))
            strip = 0 if d.get("prepend_scheme") == "never" else 1
        elif t == "Strip":
            start, stop = d.get("start", 0), d.get("stop", 0)
            if types[-1] != "Strip" or "Fuse" not in types:
                raise TokenizerError(f"{unsupported}: Strip before Fuse strips every token")
            if d.get("content") != " " or stop or not isinstance(start, int) or start < 0:
                raise TokenizerError(f"{unsupported}: Strip(content={d.get('content')!r}, "
                                     f"start={start!r}, stop={stop!r}) (only Strip(' ', n, 0) is)")
            strip = start
    return _ByteRule("sentencepiece", replacements,
                     byte_tokens="ByteFallback" in types or bool(model.get("byte_fallback")),
                     strip=strip)


def _library_call(name: str, what: str, fn):
    """``fn()``, a call into ``tokenizers``, with its errors (and Rust panics, which are
    BaseException) turned into TokenizerError."""
    try:
        return fn()
    except (KeyboardInterrupt, SystemExit):  # pragma: no cover
        raise
    except BaseException as e:  # noqa: B036 - pyo3's PanicException derives from BaseException
        msg = " ".join(str(e).split()) or type(e).__name__
        raise TokenizerError(f"{name}: {what}: {msg}") from None


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json`` (any layout whose decoder is ByteLevel or SentencePiece
    style; see the module docstring). The ``tokenizers`` library encodes; decoding is the byte
    rule derived from the file. Build with :meth:`from_file`, :meth:`from_json`,
    :meth:`from_embedded` or the constructor (the tokenizer.json text).

    Besides the protocol: ``kind`` ("byte_level" or "sentencepiece": the byte rule in use),
    ``special_ids`` (the ids of added tokens with ``special: true``, whose bytes are b"") and
    ``strip_leading_spaces``."""

    def __init__(self, tokenizer_json: str, name: str = "hf") -> None:
        if not isinstance(tokenizer_json, str):
            raise TokenizerError(f"{name}: a tokenizer.json must be given as text (str), got "
                                 f"{type(tokenizer_json).__name__}")
        try:
            spec = json.loads(tokenizer_json)
        except ValueError as e:             # JSONDecodeError, or a number past Python's digit limit
            raise TokenizerError(f"{name}: not valid JSON: {e}") from None
        except RecursionError:
            raise TokenizerError(f"{name}: not valid JSON: nested too deeply") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
            raise TokenizerError(f"{name}: not a tokenizer.json (expected a JSON object with a "
                                 f"'model' object)")
        LibTokenizer = _require_tokenizers()[0]
        tok = _library_call(name, "the tokenizers library refuses it",
                            lambda: LibTokenizer.from_str(tokenizer_json))
        tok.no_truncation()
        tok.no_padding()
        # the library's own serialization: legacy fields (add_prefix_space, ...) in canonical form
        canonical = json.loads(_library_call(name, "cannot re-serialize it", lambda: tok.to_str()))
        rule = _byte_rule(canonical, name)
        vocab = _library_call(name, "cannot read the vocabulary",
                              lambda: tok.get_vocab(with_added_tokens=False))
        added = _library_call(name, "cannot read the added tokens",
                              lambda: tok.get_added_tokens_decoder())
        ids = list(vocab.values()) + list(added)
        if not ids:
            raise TokenizerError(f"{name}: the vocabulary is empty")
        size = max(ids) + 1
        if size > MAX_VOCAB:                # (the table below has one entry per id up to the largest)
            token = added[size - 1].content if size - 1 in added else \
                next(t for t, i in vocab.items() if i == size - 1)
            raise TokenizerError(f"{name}: token {token!r} has id {size - 1}, past the largest vocabulary "
                                 f"a model can have ({MAX_VOCAB} ids)")
        table: List[bytes] = [b""] * size
        for token, i in vocab.items():
            table[i] = rule(token)
        special = set()
        for i, at in added.items():         # added tokens take precedence, as in the library
            if at.special:
                table[i] = b""
                special.add(i)
            else:
                table[i] = rule(at.content)
        self._tok = tok
        self._json = tokenizer_json
        self._rule = rule
        self._token_bytes = table
        self._vocab_size = size
        self.name = name
        self.kind = rule.kind
        self.special_ids = frozenset(special)
        self.strip_leading_spaces = rule.strip

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_json(cls, text: str, name: str = "hf") -> "HFTokenizer":
        """Build from the text of a tokenizer.json; `name` is used in messages and ``repr``."""
        return cls(text, name=name)

    @classmethod
    def from_file(cls, path: str) -> "HFTokenizer":
        """Load a ``tokenizer.json`` file."""
        path = os.fspath(path)
        if os.path.isdir(path):
            raise TokenizerError(f"{path!r} is a directory, not a tokenizer.json file "
                                 f"(load_tokenizer_dir loads a directory)")
        if not os.path.isfile(path):
            raise TokenizerError(f"tokenizer file {path!r} does not exist")
        try:
            with open(path, "r", encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError as e:
            raise TokenizerError(f"{path}: not UTF-8 text: {e}") from None
        except OSError as e:
            raise TokenizerError(f"{path}: cannot read: {e}") from None
        return cls(text, name=f"hf:{path}")

    @classmethod
    def from_embedded(cls, d: dict) -> "HFTokenizer":
        """Build from the embedded dict form {"type": "hf", "json": "<tokenizer.json text>"}
        (optionally "chat_template": the Jinja text of the model's chat template)."""
        if not isinstance(d, dict):
            raise TokenizerError(f"embedded tokenizer must be a mapping, got {type(d).__name__}")
        if d.get("type") != "hf":
            raise TokenizerError(f"embedded tokenizer type {d.get('type')!r} is not 'hf'")
        unknown = sorted(set(d) - {"type", "json", "chat_template", "special_tokens"}, key=str)
        if unknown:
            raise TokenizerError(f"embedded tokenizer has unknown key(s) {unknown} (expected "
                                 f"'type', 'json' and optionally 'chat_template', 'special_tokens')")
        if not isinstance(d.get("json"), str):
            raise TokenizerError("embedded 'hf' tokenizer needs 'json': the tokenizer.json text")
        tok = cls(d["json"], name="hf:embedded")
        _embedded_extras(tok, d)
        return tok

    def to_embedded(self) -> dict:
        return _with_extras(self, {"type": "hf", "json": self._json})

    def token_text(self, token_id: int) -> str:
        token_id = _check_id(token_id)
        text = self._tok.id_to_token(token_id) if token_id < self._vocab_size else None
        return self.token_bytes(token_id).decode("utf-8", errors="replace") if text is None else text

    # ------------------------------------------------------------------ protocol
    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str) -> List[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"encode() needs a str, got {type(text).__name__}")
        _utf8(text, self.name)
        enc = _library_call(self.name, "encode failed",
                            lambda: self._tok.encode(text, add_special_tokens=False))
        return list(enc.ids)

    def token_bytes(self, token_id: int) -> bytes:
        token_id = _check_id(token_id)
        return self._token_bytes[token_id] if token_id < self._vocab_size else b""


def tokenizer_from_embedded(d: dict) -> Tokenizer:
    """The tokenizer of an embedded form (a model header's ``tokenizer``), by its ``type``:
    "bpe" -> :class:`BPETokenizer`, "hf" -> :class:`HFTokenizer`."""
    if not isinstance(d, dict):
        raise TokenizerError(f"embedded tokenizer must be a mapping, got {type(d).__name__}")
    kind = d.get("type")
    if kind == "bpe":
        return BPETokenizer.from_embedded(d)
    if kind == "hf":
        return HFTokenizer.from_embedded(d)
    raise TokenizerError(f"embedded tokenizer type {kind!r} is not supported (allowed: "
                         f"{', '.join(repr(t) for t in EMBEDDED_TYPES)})")


#: The special-token texts a chat template may name, as tokenizer_config.json spells them.
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _embedded_extras(tok: Tokenizer, d: dict) -> None:
    """The optional keys every embedded form may carry: "chat_template" (its Jinja text) and
    "special_tokens" ({"bos_token": text, ...}, a subset of SPECIAL_TOKENS)."""
    tok.chat_template = _check_template(d.get("chat_template"), "embedded 'chat_template'")
    tok.special_tokens = _check_special(d.get("special_tokens"), "embedded 'special_tokens'")


def _with_extras(tok: Tokenizer, out: dict) -> dict:
    if tok.chat_template is not None:
        out["chat_template"] = tok.chat_template
    if tok.special_tokens:
        out["special_tokens"] = dict(tok.special_tokens)
    return out


def _check_special(v, what: str) -> Dict[str, str]:
    if v is None:
        return {}
    if (not isinstance(v, dict) or set(v) - set(SPECIAL_TOKENS)
            or not all(isinstance(t, str) and t for t in v.values())):
        raise TokenizerError(f"{what} must map some of {', '.join(SPECIAL_TOKENS)} to non-empty token texts, "
                             f"got {v!r:.120}")
    return dict(v)


def read_special_tokens(path: str) -> Dict[str, str]:
    """The special-token texts of a Hugging Face tokenizer directory that a chat template names
    (SPECIAL_TOKENS): tokenizer_config.json's, else special_tokens_map.json's; a value is the
    token's text or an AddedToken mapping with its "content". Empty when neither file has them."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        f = os.path.join(path, name)
        if not os.path.isfile(f):
            continue
        try:
            with open(f, "r", encoding="utf-8") as fh:
                d = json.load(fh)
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
            raise TokenizerError(f"{f}: not a readable JSON file: {e}") from None
        out = {}
        for key in SPECIAL_TOKENS:
            v = d.get(key) if isinstance(d, dict) else None
            if isinstance(v, dict):
                v = v.get("content")
            if isinstance(v, str) and v:
                out[key] = v
        if out:
            return out
    return {}


def _check_template(t, what: str) -> Optional[str]:
    if t is not None and (not isinstance(t, str) or not t.strip()):
        raise TokenizerError(f"{what} must be the non-empty text of a Jinja template, got {type(t).__name__}")
    return t


def read_chat_template(path: str) -> Optional[str]:
    """The chat template of a Hugging Face tokenizer directory: ``chat_template.jinja``, else
    ``tokenizer_config.json``'s ``chat_template`` (a text, or a list of named templates, of which
    the one named "default"); None when it has none."""
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        try:
            with open(jinja, "r", encoding="utf-8") as f:
                return _check_template(f.read(), jinja)
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{jinja}: cannot read: {e}") from None
    cfg = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(cfg):
        return None
    try:
        with open(cfg, "r", encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise TokenizerError(f"{cfg}: not a readable JSON file: {e}") from None
    t = d.get("chat_template") if isinstance(d, dict) else None
    if isinstance(t, list):
        named = {x.get("name"): x.get("template") for x in t
                 if isinstance(x, dict) and isinstance(x.get("name"), str)}
        if "default" not in named:
            raise TokenizerError(f"{cfg}: chat_template lists templates {sorted(map(str, named))} but none "
                                 f"named 'default'")
        t = named["default"]
    return _check_template(t, f"{cfg}: chat_template")


def load_tokenizer_dir(path: str) -> Tokenizer:
    """Load a tokenizer directory: ``tokenizer.json`` (:class:`HFTokenizer`) when it has one, else
    GPT-2's ``vocab.json`` + ``merges.txt`` (:class:`BPETokenizer`); either with the directory's
    chat template when it has one (:func:`read_chat_template`) and its special-token texts
    (:func:`read_special_tokens`)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise TokenizerError(f"tokenizer directory {path!r} does not exist or is not a directory")
    tj = os.path.join(path, "tokenizer.json")
    if os.path.isfile(tj):
        tok = HFTokenizer.from_file(tj)
        tok.chat_template = read_chat_template(path)
        tok.special_tokens = read_special_tokens(path)
        return tok
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("vocab.json", "merges.txt")):
        raise TokenizerError(f"tokenizer directory {path!r} has no tokenizer.json (Hugging Face) "
                             f"and no vocab.json + merges.txt (GPT-2)")
    tok = BPETokenizer.from_dir(path)
    tok.chat_template = read_chat_template(path)
    tok.special_tokens = read_special_tokens(path)
    return tok


def resolve_tokenizer(model_header_tokenizer: Optional[dict], tokenizer_dir: Optional[str],
                      vocab_size: int) -> Tokenizer:
    """The tokenizer for a model with `vocab_size` ids. Precedence: explicit `tokenizer_dir` >
    environment ``TINYLOOP_TOKENIZER_DIR`` > tokenizer embedded in the model file > :class:`ByteTokenizer`
    (only when nothing is configured). A configured tokenizer that fails to load raises
    TokenizerError, never falls back. A tokenizer whose ids reach past `vocab_size` is an error."""
    if tokenizer_dir:
        tok: Tokenizer = load_tokenizer_dir(tokenizer_dir)
        source = f"tokenizer directory {tokenizer_dir!r}"
    elif os.environ.get(TOKENIZER_ENV):
        env_dir = os.environ[TOKENIZER_ENV]
        try:
            tok = load_tokenizer_dir(env_dir)
        except TokenizerError as e:
            raise TokenizerError(f"{TOKENIZER_ENV}={env_dir!r}: {e}") from None
        source = f"{TOKENIZER_ENV}={env_dir!r}"
    elif model_header_tokenizer is not None:
        try:
            tok = tokenizer_from_embedded(model_header_tokenizer)
        except TokenizerError as e:
            raise TokenizerError(f"the tokenizer embedded in the model file is invalid: {e}") from None
        source = "the tokenizer embedded in the model file"
    else:
        return ByteTokenizer(vocab_size)
    if tok.vocab_size > vocab_size:
        raise TokenizerError(f"{source} has ids up to {tok.vocab_size - 1}, but the model's "
                             f"vocab_size is {vocab_size}")
    return tok
