"""Tokenizers: GPT-2-style byte-level BPE (through the optional ``tokenizers`` library) and a raw-byte
fallback, plus :func:`resolve_tokenizer`, which picks the tokenizer a model uses.

Every tokenizer maps text to token ids and back, and offers an incremental decoder
(:meth:`Tokenizer.stream_decoder`) for streaming generation: ``push(token_id)`` returns only text
that is complete, holding back the bytes of a UTF-8 character split over several tokens until the
character is whole; ``flush()`` returns what is left, with U+FFFD for bytes that never became a
valid character. Concatenating every ``push`` result and ``flush()`` equals ``decode(ids)``.

Ids that have no token (ids past a BPE vocabulary, or >= 256 for :class:`ByteTokenizer`) decode
to nothing (""), matching the ``tokenizers`` library, which skips unknown ids. Negative ids are an
error.

Embedded form (stored in a model file's header and produced by :meth:`BPETokenizer.to_embedded`)::

    {"type": "bpe", "vocab": {token: id, ...}, "merges": ["a b", ...]}

with tokens written in GPT-2's byte-to-unicode alphabet (a space is "Ġ"), exactly as in a GPT-2
``vocab.json`` / ``merges.txt`` pair.
"""

from __future__ import annotations

import codecs
import json
import os
from functools import lru_cache
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from ..errors import TokenizerError

#: Environment variable naming a tokenizer directory (vocab.json + merges.txt).
TOKENIZER_ENV = "TINYLOOP_TOKENIZER_DIR"

_INSTALL_HINT = "the BPE tokenizer needs the 'tokenizers' package: pip install tinyloop[tokenizer]"


def _require_tokenizers():
    """Import the optional ``tokenizers`` library, or raise TokenizerError with the install hint."""
    try:
        from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise TokenizerError(f"{_INSTALL_HINT} ({e})") from None
    return HFTokenizer, models, pre_tokenizers, decoders


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


def _check_ids(ids: Iterable[int]) -> List[int]:
    out = []
    for i in ids:
        try:
            v = int(i)
        except (TypeError, ValueError):
            raise TokenizerError(f"token id {i!r} is not an integer") from None
        if v < 0 or v != i:
            raise TokenizerError(f"token id {i!r} is not a non-negative integer")
        out.append(v)
    return out


class StreamDecoder:
    """Incremental detokenizer. ``push(id)`` returns the text completed by that token ("" while a
    multi-byte character is still incomplete); ``flush()`` returns the remainder (incomplete bytes
    become U+FFFD) and resets the decoder."""

    def __init__(self, tokenizer: "Tokenizer") -> None:
        self._tok = tokenizer
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        (tid,) = _check_ids([token_id])
        return self._dec.decode(self._tok.token_bytes(tid), final=False)

    def flush(self) -> str:
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out


class Tokenizer:
    """Tokenizer protocol. Subclasses implement :meth:`encode` and :meth:`token_bytes`; ``decode``
    defaults to joining token bytes and decoding them as UTF-8 with replacement."""

    name: str = "tokenizer"

    @property
    def vocab_size(self) -> int:
        """One more than the largest id this tokenizer can produce or decode."""
        raise NotImplementedError

    def encode(self, text: str) -> List[int]:
        raise NotImplementedError

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token (b"" for ids without a token)."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        ids = _check_ids(ids)
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)

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
        try:
            return list(text.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise TokenizerError(f"text is not encodable as UTF-8: {e}") from None

    def token_bytes(self, token_id: int) -> bytes:
        if token_id < 0:
            raise TokenizerError(f"token id {token_id} is negative")
        return bytes((token_id,)) if token_id < 256 else b""


class BPETokenizer(Tokenizer):
    """GPT-2-style byte-level BPE: ``tokenizers`` BPE model + ByteLevel pre-tokenizer
    (add_prefix_space=False) + ByteLevel decoder. Build with :meth:`from_dir`, :meth:`from_embedded`
    or the constructor (vocab {token: id}, merges [(a, b), ...])."""

    def __init__(self, vocab: Dict[str, int], merges: Sequence[Tuple[str, str]],
                 name: str = "bpe") -> None:
        vocab, merges = _validate_bpe(vocab, merges, name)
        HFTokenizer, models, pre_tokenizers, decoders = _require_tokenizers()
        try:
            tok = HFTokenizer(models.BPE(vocab=dict(vocab), merges=list(merges)))
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
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
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
        """Build from the embedded dict form {"type": "bpe", "vocab": {...}, "merges": ["a b", ...]}."""
        if not isinstance(d, dict):
            raise TokenizerError(f"embedded tokenizer must be a mapping, got {type(d).__name__}")
        if d.get("type") != "bpe":
            raise TokenizerError(f"embedded tokenizer type {d.get('type')!r} is not supported "
                                 f"(only 'bpe')")
        unknown = sorted(set(d) - {"type", "vocab", "merges"})
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
        return cls(d["vocab"], merges, name="bpe:embedded")

    def to_embedded(self) -> dict:
        return {"type": "bpe", "vocab": dict(self._vocab),
                "merges": [f"{a} {b}" for a, b in self._merges]}

    # ------------------------------------------------------------------ protocol
    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str) -> List[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"encode() needs a str, got {type(text).__name__}")
        if self._missing_bytes:
            try:
                raw = text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise TokenizerError(f"text is not encodable as UTF-8: {e}") from None
            bad = self._missing_bytes.intersection(raw)
            if bad:
                raise TokenizerError(
                    f"{self.name}: the vocabulary has no token for byte(s) "
                    f"{sorted(hex(b) for b in bad)} in the text; it cannot encode it losslessly")
        try:
            return list(self._tok.encode(text, add_special_tokens=False).ids)
        except Exception as e:
            raise TokenizerError(f"{self.name}: encode failed: {e}") from None

    def decode(self, ids: Sequence[int]) -> str:
        ids = _check_ids(ids)
        try:
            return self._tok.decode(ids, skip_special_tokens=False)
        except Exception as e:
            raise TokenizerError(f"{self.name}: decode failed: {e}") from None

    def token_bytes(self, token_id: int) -> bytes:
        if token_id < 0:
            raise TokenizerError(f"token id {token_id} is negative")
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
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise TokenizerError(f"{name}: vocab id of {t!r} must be a non-negative integer, got {i!r}")
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


def resolve_tokenizer(model_header_tokenizer: Optional[dict], tokenizer_dir: Optional[str],
                      vocab_size: int) -> Tokenizer:
    """The tokenizer for a model with `vocab_size` ids. Precedence: explicit `tokenizer_dir` >
    environment ``TINYLOOP_TOKENIZER_DIR`` > tokenizer embedded in the model file > :class:`ByteTokenizer`
    (only when nothing is configured). A configured tokenizer that fails to load raises
    TokenizerError, never falls back. A tokenizer whose ids reach past `vocab_size` is an error."""
    if tokenizer_dir:
        tok: Tokenizer = BPETokenizer.from_dir(tokenizer_dir)
        source = f"tokenizer directory {tokenizer_dir!r}"
    elif os.environ.get(TOKENIZER_ENV):
        env_dir = os.environ[TOKENIZER_ENV]
        try:
            tok = BPETokenizer.from_dir(env_dir)
        except TokenizerError as e:
            raise TokenizerError(f"{TOKENIZER_ENV}={env_dir!r}: {e}") from None
        source = f"{TOKENIZER_ENV}={env_dir!r}"
    elif model_header_tokenizer is not None:
        try:
            tok = BPETokenizer.from_embedded(model_header_tokenizer)
        except TokenizerError as e:
            raise TokenizerError(f"the tokenizer embedded in the model file is invalid: {e}") from None
        source = "the tokenizer embedded in the model file"
    else:
        return ByteTokenizer(vocab_size)
    if tok.vocab_size > vocab_size:
        raise TokenizerError(f"{source} has ids up to {tok.vocab_size - 1}, but the model's "
                             f"vocab_size is {vocab_size}")
    return tok
