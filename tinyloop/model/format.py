"""The ``.tinyloop`` model file: writer, header reader and loader.

Byte layout (all integers little-endian; docs/FORMAT.md is the normative description)::

    0   8 bytes   magic b"TINYLOOP"
    8   u32       format version (1)
    12  u32       reserved, 0
    16  u64       header_len
    24  header_len bytes of UTF-8 JSON: {"config", "quant", "tokenizer", "metadata"}
        tensor table: u32 n_tensors, then per tensor
            u16 name_len, name (UTF-8), u8 dtype code, u8 ndim (1..4), ndim x u64 dims,
            u64 offset (relative to the data start), u64 nbytes
        zero padding up to the next multiple of 64: the data start
        tensor data, in table order, each tensor at a 64-byte-aligned offset, zero padding between
        tensors, the file ending exactly at the end of the last tensor

Every malformed, truncated or inconsistent file raises :class:`ModelFormatError` whose message
says what is wrong; nothing is allocated according to a size the file declares before that size
has been checked against the file's actual size.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
import tempfile
import threading
from collections import abc
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np

from .arch import ModelConfig, TensorQuant, is_matrix, required_tensors
from ..errors import ConfigError, ModelFormatError, ModelFreedError, OutOfMemoryError
from .quant import dequantize_tensor, quantize_tensor
from .tokenizer import SPECIAL_TOKENS

MAGIC = b"TINYLOOP"
VERSION = 1
#: Alignment of the data start and of every tensor, in bytes.
ALIGN = 64
#: Largest JSON header accepted (a 50k-token BPE tokenizer takes a few MiB).
MAX_HEADER_BYTES = 64 << 20
#: Largest tensor count accepted in the table.
MAX_TENSORS = 1 << 20
#: Longest tensor name accepted, in UTF-8 bytes.
MAX_NAME_BYTES = 1024
MAX_NDIM = 4

#: dtype code (u8 in the table) -> dtype name.
DTYPE_CODES = {0: "f32", 1: "f16", 2: "u8", 3: "i32"}
#: dtype name -> numpy dtype as stored (little-endian).
NP_DTYPES = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2"), "u8": np.dtype("u1"), "i32": np.dtype("<i4")}
_CODE_OF = {name: code for code, name in DTYPE_CODES.items()}
HEADER_KEYS = ("config", "quant", "tokenizer", "metadata")
TOKENIZER_KEYS = ("type", "vocab", "merges")

_PREFIX = struct.Struct("<IIQ")  # version, reserved, header_len (after the 8-byte magic)
_U8x2 = struct.Struct("<BB")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64x2 = struct.Struct("<QQ")
#: Smallest table entry: 1-byte name, dtype, ndim, one dim, offset, nbytes.
_MIN_ENTRY_BYTES = _U16.size + 1 + _U8x2.size + 8 + _U64x2.size
#: Elements checked per step when validating tensor data.
_CHECK_CHUNK = 1 << 22
_F32 = TensorQuant("f32")


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class TensorEntry:
    """One row of the tensor table."""

    name: str
    """Physical tensor name (``embed``, ``loop.0.wq.q``, ...)."""
    dtype: str
    """One of f32, f16, u8, i32."""
    shape: Tuple[int, ...]
    offset: int
    """Byte offset relative to :attr:`ModelHeader.data_offset`."""
    nbytes: int


@dataclass(frozen=True)
class ModelHeader:
    """Everything in a model file except the tensor data, fully validated."""

    version: int
    config: ModelConfig
    quant: Dict[str, TensorQuant]
    """Logical tensor name -> storage, in :func:`required_tensors` order."""
    tokenizer: Optional[dict]
    """None, {"type": "bpe", "vocab": {token: id}, "merges": ["a b", ...]} or {"type": "hf", "json": ...}
    (either optionally with "chat_template")."""
    metadata: dict
    tensors: List[TensorEntry]
    """The tensor table, in file order."""
    data_offset: int
    """Absolute file offset of the tensor data (a multiple of 64)."""
    file_size: int


# --------------------------------------------------------------------------- header contents
def _physical_layout(config: ModelConfig, quant: Mapping[str, TensorQuant]) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
    """Physical tensors (name -> (dtype, shape)) in file order; ConfigError for an invalid quant."""
    layout: Dict[str, Tuple[str, Tuple[int, ...]]] = {}
    for name, shape in required_tensors(config).items():
        tq = quant[name]
        if not is_matrix(name) and tq.type not in ("f32", "f16"):
            raise ConfigError(f"{name} is a norm vector and must be stored as f32 or f16, not {tq.type}")
        layout.update(tq.physical(name, shape))
    return layout


#: What an embedded tokenizer of either type may carry besides its own keys.
TOKENIZER_EXTRAS = ("chat_template", "special_tokens")


def _check_chat_template(tok: dict) -> None:
    t = tok.get("chat_template")
    if t is not None and (not isinstance(t, str) or not t.strip()):
        raise ConfigError("tokenizer 'chat_template' must be the non-empty text of a Jinja template")
    sp = tok.get("special_tokens")
    if sp is not None and (not isinstance(sp, dict) or set(sp) - set(SPECIAL_TOKENS)
                           or not all(isinstance(v, str) and v for v in sp.values())):
        raise ConfigError(f"tokenizer 'special_tokens' must map some of {', '.join(SPECIAL_TOKENS)} to "
                          f"non-empty token texts")


def _check_tokenizer(tok, vocab_size: int) -> Optional[dict]:
    """Validate a tokenizer entry; raises ConfigError naming the bad part."""
    if tok is None:
        return None
    if not isinstance(tok, dict):
        raise ConfigError(f"tokenizer must be null or an object, got {type(tok).__name__}")
    if tok.get("type") == "hf":
        # a Hugging Face tokenizer.json kept verbatim; the tokenizers library parses it when the
        # model is loaded (tinyloop.model.tokenizer.HFTokenizer), so only its form is checked here
        keys = sorted(tok, key=str)
        if not {"json", "type"} <= set(keys) <= {"json", "type", *TOKENIZER_EXTRAS}:
            raise ConfigError(f"tokenizer keys are {keys}; an 'hf' tokenizer has 'json', 'type' and "
                              f"optionally 'chat_template', 'special_tokens'")
        if not isinstance(tok["json"], str) or not tok["json"].lstrip().startswith("{"):
            raise ConfigError("tokenizer 'json' must be the text of a tokenizer.json object")
        _check_chat_template(tok)
        return tok
    keys = set(tok) - set(TOKENIZER_EXTRAS)
    if sorted(keys, key=str) != sorted(TOKENIZER_KEYS):
        raise ConfigError(f"tokenizer keys are {sorted(tok, key=str)}; expected {sorted(TOKENIZER_KEYS)} and "
                          f"optionally 'chat_template', 'special_tokens'")
    _check_chat_template(tok)
    if tok["type"] != "bpe":
        raise ConfigError(f"tokenizer type {tok['type']!r} is not supported; 'bpe' and 'hf' are")
    vocab, merges = tok["vocab"], tok["merges"]
    if not isinstance(vocab, dict) or not vocab:
        raise ConfigError("tokenizer vocab must be a non-empty object mapping token -> id")
    owner: Dict[int, str] = {}
    for token, tid in vocab.items():
        if not isinstance(token, str) or not token:
            raise ConfigError(f"tokenizer vocab has an invalid token {token!r}; tokens are non-empty strings")
        if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < vocab_size:
            raise ConfigError(f"tokenizer vocab entry {token!r}: id {tid!r} is not an integer in "
                              f"[0, {vocab_size - 1}] (vocab_size={vocab_size})")
        if tid in owner:
            raise ConfigError(f"tokenizer vocab id {tid} is used by both {owner[tid]!r} and {token!r}")
        owner[tid] = token
    if not isinstance(merges, list):
        raise ConfigError(f"tokenizer merges must be a list of \"a b\" strings, got {type(merges).__name__}")
    for i, merge in enumerate(merges):
        parts = merge.split(" ") if isinstance(merge, str) else None
        if parts is None or len(parts) != 2 or not all(parts):
            raise ConfigError(f"tokenizer merge #{i} {merge!r} is not a string \"a b\" of two tokens")
        for part in parts:
            if part not in vocab:
                raise ConfigError(f"tokenizer merge #{i} {merge!r}: token {part!r} is not in the vocab")
    return tok


def _quant_from_json(config: ModelConfig, quant) -> Dict[str, TensorQuant]:
    required = required_tensors(config)
    if not isinstance(quant, dict):
        raise ConfigError(f"quant must be an object mapping tensor name -> storage, got {type(quant).__name__}")
    unknown = [n for n in quant if n not in required]
    if unknown:
        raise ConfigError(f"quant names unknown tensor(s) {_names(unknown)}")
    missing = [n for n in required if n not in quant]
    if missing:
        raise ConfigError(f"quant is missing tensor(s) {_names(missing)}")
    out = {}
    for name in required:
        try:
            out[name] = TensorQuant.from_dict(quant[name])
        except ConfigError as e:
            raise ConfigError(f"quant[{name!r}]: {e}") from None
    return out


def _names(names: List[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _unique_object(pairs):
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {key!r}")
        obj[key] = value
    return obj


def _parse_header(raw: bytes):
    """JSON header bytes -> (config, quant, tokenizer, metadata, physical layout)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ModelFormatError(f"header is not valid UTF-8: {e.reason} at byte {e.start}") from None
    try:
        obj = json.loads(text, object_pairs_hook=_unique_object, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise ModelFormatError(f"header is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ModelFormatError(f"header must be a JSON object, got {type(obj).__name__}")
    if sorted(obj) != sorted(HEADER_KEYS):
        raise ModelFormatError(f"header keys are {sorted(obj)}; expected exactly {sorted(HEADER_KEYS)}")
    try:
        config = ModelConfig.from_dict(obj["config"])
        quant = _quant_from_json(config, obj["quant"])
        layout = _physical_layout(config, quant)
        tokenizer = _check_tokenizer(obj["tokenizer"], config.vocab_size)
    except ConfigError as e:
        raise ModelFormatError(f"header: {e}") from None
    except OverflowError as e:  # ModelConfig's float() of an integer too large for a float
        raise ModelFormatError(f"header: config value out of range: {e}") from None
    if not isinstance(obj["metadata"], dict):
        raise ModelFormatError(f"header metadata must be a JSON object, got {type(obj['metadata']).__name__}")
    return config, quant, tokenizer, obj["metadata"], layout


# --------------------------------------------------------------------------- reading
class _Reader:
    """Sequential reads that never pass the end of the file."""

    def __init__(self, f, size: int):
        self.f, self.size, self.pos = f, size, 0

    def take(self, n: int, what: str) -> bytes:
        if n > self.size - self.pos:
            raise ModelFormatError(f"file is truncated: {what} needs {n} bytes at offset {self.pos}, "
                                   f"but the file is {self.size} bytes long")
        data = self.f.read(n)
        if len(data) != n:
            raise ModelFormatError(f"file shrank while reading {what} at offset {self.pos}")
        self.pos += n
        return data

    def unpack(self, st: struct.Struct, what: str) -> tuple:
        return st.unpack(self.take(st.size, what))


def _read_entry(r: _Reader, index: int) -> TensorEntry:
    where = f"tensor table entry #{index}"
    (name_len,) = r.unpack(_U16, f"{where} name length")
    if not 1 <= name_len <= MAX_NAME_BYTES:
        raise ModelFormatError(f"{where}: name length {name_len} is outside [1, {MAX_NAME_BYTES}]")
    raw = r.take(name_len, f"{where} name")
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ModelFormatError(f"{where}: name {raw!r} is not valid UTF-8") from None
    where = f"tensor {name!r}"
    code, ndim = r.unpack(_U8x2, f"{where} dtype and ndim")
    if code not in DTYPE_CODES:
        raise ModelFormatError(f"{where}: dtype code {code} is not one of {DTYPE_CODES}")
    if not 1 <= ndim <= MAX_NDIM:
        raise ModelFormatError(f"{where}: ndim={ndim} is outside [1, {MAX_NDIM}]")
    shape = r.unpack(struct.Struct(f"<{ndim}Q"), f"{where} dims")
    offset, nbytes = r.unpack(_U64x2, f"{where} offset and size")
    dtype = DTYPE_CODES[code]
    size = NP_DTYPES[dtype].itemsize
    for dim in shape:
        if dim == 0:
            raise ModelFormatError(f"{where}: shape {shape} has a zero dimension")
        size *= dim
        if size > r.size:  # also bounds the product, so nothing sized by the file can overflow
            raise ModelFormatError(f"{where}: shape {shape} of {dtype} needs more bytes than the whole "
                                   f"file ({r.size})")
    if nbytes != size:
        raise ModelFormatError(f"{where}: nbytes={nbytes} but shape {shape} of {dtype} needs {size}")
    return TensorEntry(name, dtype, shape, offset, nbytes)


def _check_table(entries: List[TensorEntry], layout: Dict[str, Tuple[str, Tuple[int, ...]]],
                 data_offset: int, file_size: int) -> None:
    """Tensor identities against the header's layout, then placement within the file."""
    order = {name: i for i, name in enumerate(layout)}
    seen = set()
    prev: Optional[TensorEntry] = None
    free = 0  # first offset (relative to the data start) the next tensor may use
    for e in entries:
        if e.name not in order:
            raise ModelFormatError(f"unknown tensor {e.name!r}: the config and quant in the header do not use it")
        if e.name in seen:
            raise ModelFormatError(f"tensor {e.name!r} appears twice in the table")
        if prev is not None and order[e.name] < order[prev.name]:
            raise ModelFormatError(f"tensor {e.name!r} is out of order: it must come before {prev.name!r}")
        seen.add(e.name)
        dtype, shape = layout[e.name]
        if e.dtype != dtype:
            raise ModelFormatError(f"tensor {e.name!r} is {e.dtype}, but its quantization needs {dtype}")
        if e.shape != shape:
            raise ModelFormatError(f"tensor {e.name!r} has shape {e.shape}, but the config needs {shape}")
        if e.offset % ALIGN:
            raise ModelFormatError(f"tensor {e.name!r}: offset {e.offset} is not a multiple of {ALIGN}")
        if e.offset < free:
            raise ModelFormatError(f"tensor {e.name!r} at offset {e.offset} overlaps the previous tensor "
                                   f"{prev.name!r}, which ends at {prev.offset + prev.nbytes}")
        end = data_offset + e.offset + e.nbytes
        if end > file_size:
            raise ModelFormatError(f"tensor {e.name!r} (file bytes {data_offset + e.offset}..{end}) extends "
                                   f"past the end of the file ({file_size} bytes): truncated or bad offset")
        if e.offset > free:
            raise ModelFormatError(f"tensor {e.name!r} at offset {e.offset} leaves a gap after the previous "
                                   f"tensor; expected offset {free}")
        free = _align(e.offset + e.nbytes)
        prev = e
    missing = [n for n in layout if n not in seen]
    if missing:
        raise ModelFormatError(f"missing tensor(s) {_names(missing)}")
    end = data_offset + prev.offset + prev.nbytes
    if file_size != end:
        raise ModelFormatError(f"{file_size - end} trailing bytes after the last tensor {prev.name!r} "
                               f"(which ends at byte {end})")


def _read_header(f, path) -> ModelHeader:
    size = os.fstat(f.fileno()).st_size
    r = _Reader(f, size)
    magic = r.take(len(MAGIC), "magic")
    if magic != MAGIC:
        raise ModelFormatError(f"{os.fspath(path)!r} is not a TinyLoop model: magic is {magic!r}, expected {MAGIC!r}")
    version, reserved, header_len = r.unpack(_PREFIX, "file prefix")
    if version != VERSION:
        raise ModelFormatError(f"unsupported format version {version}; this build reads version {VERSION}")
    if reserved != 0:
        raise ModelFormatError(f"reserved prefix field is {reserved:#x}; must be 0")
    if header_len > MAX_HEADER_BYTES:
        raise ModelFormatError(f"header_len={header_len} exceeds the limit of {MAX_HEADER_BYTES} bytes")
    config, quant, tokenizer, metadata, layout = _parse_header(r.take(header_len, "JSON header"))
    (n,) = r.unpack(_U32, "tensor count")
    if n > MAX_TENSORS:
        raise ModelFormatError(f"tensor count {n} exceeds the limit of {MAX_TENSORS}")
    if n * _MIN_ENTRY_BYTES > size - r.pos:
        raise ModelFormatError(f"file is truncated or the tensor count is wrong: {n} entries need at least "
                               f"{n * _MIN_ENTRY_BYTES} bytes, but only {size - r.pos} remain")
    entries = [_read_entry(r, i) for i in range(n)]
    data_offset = _align(r.pos)
    if r.take(data_offset - r.pos, "padding before the tensor data").strip(b"\0"):
        raise ModelFormatError(f"padding between the tensor table and the data start ({data_offset}) is not zero")
    _check_table(entries, layout, data_offset, size)
    return ModelHeader(version=version, config=config, quant=quant, tokenizer=tokenizer, metadata=metadata,
                       tensors=entries, data_offset=data_offset, file_size=size)


def _open(path):
    """The file `path` names, opened for reading: a str or os.PathLike naming a regular file (an
    int is never taken for a file descriptor; a FIFO, directory or device is refused before it is
    opened, so nothing blocks)."""
    if isinstance(path, bool) or not isinstance(path, (str, os.PathLike)):
        raise ModelFormatError(f"model path {path!r} must be a str or os.PathLike, not {type(path).__name__}")
    name = os.fspath(path)
    try:
        st = os.stat(name)
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"cannot open model file {name!r}: {getattr(e, 'strerror', None) or e}") from e
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise ModelFormatError(f"model file {name!r} is {kind}")
    try:
        # non-blocking: a FIFO swapped in after the stat must not block the open
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise ModelFormatError(f"cannot open model file {name!r}: {e.strerror or e}") from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ModelFormatError(f"model file {name!r} is not a regular file")
    return os.fdopen(fd, "rb")


def _name_file(exc: ModelFormatError, path) -> None:
    """Put the file's name before a reader error whose message does not name it, so that every
    caller (load_model, inspect, the CLI) says which file is malformed."""
    name = os.fspath(path)
    msg = str(exc)
    if repr(name) not in msg:
        exc.args = (f"model file {name!r}: {msg}",)


def read_header(path) -> ModelHeader:
    """Read and validate a model file's prefix, JSON header and tensor table (never the tensor data).

    Checks everything that does not need the data: magic, version, header contents, table
    entries against the config and quantization, and the placement of every tensor within the
    file. Raises ModelFormatError describing the first problem found (its message names the file).
    """
    with _open(path) as f:
        try:
            return _read_header(f, path)
        except ModelFormatError as exc:
            _name_file(exc, path)
            raise


# --------------------------------------------------------------------------- data checks
def _first_bad(a: np.ndarray, ok, what: str, name: str) -> None:
    """Raise ModelFormatError at the first element of ``a`` where ``ok`` is false, chunk by chunk."""
    flat = a.reshape(-1)
    for start in range(0, flat.size, _CHECK_CHUNK):
        good = ok(flat[start:start + _CHECK_CHUNK])
        if not good.all():
            i = start + int(np.argmin(good))
            idx = tuple(int(k) for k in np.unravel_index(i, a.shape))
            raise ModelFormatError(f"tensor {name!r}: value {flat[i].item()!r} at index {idx} {what}")


class _Tensors(abc.Mapping):
    """Physical tensor name -> a read-only ndarray, read from the open file on each access (never a
    memory map: a file truncated under a map kills the process with SIGBUS when a page past the new
    end is touched, while a read past it is just short) and checked as it is read: a file changed
    after opening gives a ModelFormatError, never values that were not validated."""

    def __init__(self, model_file: "ModelFile", f, header: ModelHeader):
        self._owner, self._f, self._header = model_file, f, header
        self._lock = threading.Lock()        # one seek + read at a time
        self._entries = {e.name: e for e in header.tensors}
        self._scales = {name + ".scales" for name, tq in header.quant.items() if tq.bits}
        self._zero_limit = {name + ".zeros": 1 << tq.bits for name, tq in header.quant.items() if tq.bits}

    def _read(self, start: int, n: int, what: str) -> np.ndarray:
        try:
            buf = np.empty(n, np.uint8)
        except MemoryError:
            raise OutOfMemoryError(f"cannot allocate {n} bytes to read {what} of {self._owner.path!r}") from None
        got = 0
        with self._lock, memoryview(buf) as view:
            if self._owner.closed:
                raise ModelFreedError(f"model file {self._owner.path!r} is closed")
            try:
                self._f.seek(start)
                while got < n:
                    k = self._f.readinto(view[got:])
                    if not k:
                        raise ModelFormatError(f"{self._owner.path!r} changed after it was opened: {what} "
                                               f"(file bytes {start}..{start + n}) ends past the end of the "
                                               f"file, which is truncated")
                    got += k
            except OSError as e:
                raise ModelFormatError(f"cannot read {what} of {self._owner.path!r}: {e.strerror or e}") from None
        return buf

    def __getitem__(self, name: str) -> np.ndarray:
        e = self._entries[name]
        a = self._read(self._header.data_offset + e.offset, e.nbytes, f"tensor {name!r}")
        a = a.view(NP_DTYPES[e.dtype]).reshape(e.shape)
        a.flags.writeable = False
        if e.dtype in ("f32", "f16"):
            _first_bad(a, np.isfinite, "is not finite", name)
        if name in self._scales:
            _first_bad(a, lambda c: c > 0, "is not a positive scale", name)
        if name in self._zero_limit:
            limit = self._zero_limit[name]
            _first_bad(a, lambda c: c < limit, f"is not a valid zero point (must be < {limit})", name)
        return a

    def __contains__(self, name) -> bool:     # (Mapping's would read the tensor)
        return name in self._entries

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def check_all(self) -> None:
        """Every tensor (read one at a time, none kept) and the padding between tensors."""
        entries = self._header.tensors
        for e, nxt in zip(entries, entries[1:]):
            start, stop = self._header.data_offset + e.offset + e.nbytes, self._header.data_offset + nxt.offset
            if self._read(start, stop - start, f"the padding after tensor {e.name!r}").any():
                raise ModelFormatError(f"padding between tensors {e.name!r} and {nxt.name!r} is not zero")
        for e in entries:
            self[e.name]


# --------------------------------------------------------------------------- loading
class ModelFile:
    """An open, validated model file. Its tensors are read from the file when asked for (each a
    read-only array of its own, validated as it is read), so nothing of the file stays mapped.

    Use as a context manager or call :meth:`close`. Arrays taken from :attr:`tensors` (and from
    :meth:`logical`) stay valid after closing.
    """

    def __init__(self, path, header: ModelHeader, f):
        self.path = os.fspath(path)
        self._header = header
        self._f = f
        self._tensors: Optional[_Tensors] = _Tensors(self, f, header)
        self._shapes = required_tensors(header.config)

    @property
    def header(self) -> ModelHeader:
        """The validated header (available after close too)."""
        return self._header

    @property
    def closed(self) -> bool:
        return self._f is None

    @property
    def tensors(self) -> Mapping[str, np.ndarray]:
        """Physical tensor name -> read-only ndarray, in file order (each access reads the tensor
        from the file and checks it again: take what is needed once)."""
        if self._tensors is None:
            raise ModelFreedError(f"model file {self.path!r} is closed")
        return self._tensors

    def logical(self, name: str) -> np.ndarray:
        """Logical tensor ``name`` dequantized to float32 (an f32 tensor: the array as read)."""
        tensors = self.tensors
        if name not in self._shapes:
            raise ConfigError(f"unknown logical tensor {name!r}; this model has {_names(list(self._shapes))}")
        return dequantize_tensor(name, tensors, self._header.quant[name], self._shapes[name])

    def close(self) -> None:
        """Close the file. Idempotent. Arrays handed out are copies and stay valid."""
        if self._f is None:
            return
        lock = self._tensors._lock
        with lock:
            f, self._f, self._tensors = self._f, None, None
            f.close()

    def __enter__(self) -> "ModelFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self._header.tensors)} tensors"
        return f"<ModelFile {self.path!r} {state}>"


def open_model(path) -> ModelFile:
    """Open and fully validate a model file; the file stays open and tensors are read from it when
    asked for (never memory-mapped: a file truncated while it is in use is a ModelFormatError).

    Beyond :func:`read_header`, checks the data: padding between tensors is zero, every f32/f16
    tensor (weights, norms, scales) is finite, scales are positive and zero points are below
    2**bits; :attr:`ModelFile.tensors` checks each tensor again as it reads it. Raises
    ModelFormatError naming the file (nothing is left open when it does).
    """
    f = _open(path)
    try:
        header = _read_header(f, path)
        size = os.fstat(f.fileno()).st_size
        if size != header.file_size:
            raise ModelFormatError(f"file changed size while opening ({header.file_size} -> {size} bytes)")
        m = ModelFile(path, header, f)
        m.tensors.check_all()
        return m
    except BaseException as exc:
        f.close()
        if isinstance(exc, ModelFormatError):
            _name_file(exc, path)
        raise


# --------------------------------------------------------------------------- writing
def _encode_header(config: ModelConfig, quant: Dict[str, TensorQuant], tokenizer, metadata) -> bytes:
    header = {"config": config.to_dict(), "quant": {n: tq.to_dict() for n, tq in quant.items()},
              "tokenizer": tokenizer, "metadata": metadata}
    try:
        raw = json.dumps(header, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
    except (TypeError, ValueError, RecursionError) as e:
        raise ConfigError(f"tokenizer and metadata must be plain JSON (no NaN/inf): {e}") from None
    if len(raw) > MAX_HEADER_BYTES:
        raise ConfigError(f"header is {len(raw)} bytes; the limit is {MAX_HEADER_BYTES}")
    return raw


def _resolve_quant(config: ModelConfig, quant, default_quant) -> Dict[str, TensorQuant]:
    required = required_tensors(config)
    quant = dict(quant or {})
    for name, tq in quant.items():
        if name not in required:
            raise ConfigError(f"quant names unknown tensor {name!r}")
        if not isinstance(tq, TensorQuant):
            raise ConfigError(f"quant[{name!r}] must be a TensorQuant, got {type(tq).__name__}")
    default = TensorQuant("f16") if default_quant is None else default_quant
    if not isinstance(default, TensorQuant):
        raise ConfigError(f"default_quant must be a TensorQuant, got {type(default).__name__}")
    return {name: quant.get(name, default if is_matrix(name) else _F32) for name in required}


def _check_weights(config: ModelConfig, weights) -> None:
    if not isinstance(weights, Mapping):
        raise ConfigError(f"weights must be a mapping name -> ndarray, got {type(weights).__name__}")
    required = required_tensors(config)
    unknown = [n for n in weights if n not in required]
    if unknown:
        raise ModelFormatError(f"weights include unknown tensor(s) {_names(unknown)}")
    missing = [n for n in required if n not in weights]
    if missing:
        raise ModelFormatError(f"weights are missing tensor(s) {_names(missing)}")
    for name, shape in required.items():
        w = weights[name]
        if not isinstance(w, np.ndarray) or w.dtype.kind not in "fiu":
            raise ModelFormatError(f"weight {name!r} must be a real numeric ndarray, got "
                                   f"{getattr(w, 'dtype', type(w).__name__)}")
        if w.shape != shape:
            raise ModelFormatError(f"weight {name!r} has shape {w.shape}, but the config needs {shape}")
        if w.dtype.kind == "f":
            _first_bad(w, np.isfinite, "is not finite", name)


def write_model(path, config: ModelConfig, weights: Mapping[str, np.ndarray],
                quant: Optional[Mapping[str, TensorQuant]] = None, default_quant: Optional[TensorQuant] = None,
                tokenizer: Optional[dict] = None, metadata: Optional[dict] = None) -> None:
    """Write a model file atomically (a temporary file in the same directory, then os.replace).

    ``weights`` maps every logical tensor of :func:`required_tensors` to a float array of its
    shape. ``quant`` chooses storage per tensor; matrices not listed use ``default_quant``
    (default f16), norms not listed use f32 (norms may only be f32 or f16). Raises ConfigError
    for bad arguments (an empty path included), quantization or tokenizer, ModelFormatError for a
    path that is a directory or in a missing folder (checked before any weight is read) and for a
    missing, unknown, misshapen or non-finite weight; all of these are checked before anything is written. A
    ConfigError while quantizing (a group range too large for float16 scales, f16 overflow)
    leaves no file behind.
    """
    if not isinstance(config, ModelConfig):
        raise ConfigError(f"config must be a ModelConfig, got {type(config).__name__}")
    resolved = _resolve_quant(config, quant, default_quant)
    layout = _physical_layout(config, resolved)
    tokenizer = _check_tokenizer(tokenizer, config.vocab_size)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict):
        raise ConfigError(f"metadata must be a dict, got {type(metadata).__name__}")
    header = _encode_header(config, resolved, tokenizer, metadata)
    # the destination before the weights are read (a lazy mapping generates them): no work for a
    # path that cannot be written
    if isinstance(path, bool) or not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"model path {path!r} must be a str or os.PathLike, not {type(path).__name__}")
    path = os.fspath(path)
    if not isinstance(path, str) or not path or "\0" in path:
        raise ConfigError(f"cannot write model file {path!r}: the path must be a non-empty file path "
                          f"without NUL bytes")
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ModelFormatError(f"cannot write model file {path!r}: it is a directory")
    if not os.path.isdir(folder):
        raise ModelFormatError(f"cannot write model file {path!r}: the folder {folder!r} does not exist")
    _check_weights(config, weights)

    table = [_U32.pack(len(layout))]
    offset = 0
    for name, (dtype, shape) in layout.items():
        raw = name.encode("utf-8")
        nbytes = math.prod(shape) * NP_DTYPES[dtype].itemsize
        table += [_U16.pack(len(raw)), raw, _U8x2.pack(_CODE_OF[dtype], len(shape)),
                  struct.pack(f"<{len(shape)}Q", *shape), _U64x2.pack(offset, nbytes)]
        offset = _align(offset + nbytes)
    head = MAGIC + _PREFIX.pack(VERSION, 0, len(header)) + header + b"".join(table)
    head += b"\0" * (_align(len(head)) - len(head))

    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tinyloop.tmp", dir=folder)
    except OSError as exc:
        raise ModelFormatError(f"cannot write model file {path!r}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(head)
            written = 0
            for name, tq in resolved.items():
                for phys, part in quantize_tensor(name, weights[name], tq).items():
                    data = np.ascontiguousarray(part, dtype=NP_DTYPES[layout[phys][0]])
                    f.write(b"\0" * (_align(written) - written))
                    f.write(memoryview(data).cast("B"))
                    written = _align(written) + data.nbytes
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


__all__ = ["MAGIC", "VERSION", "ALIGN", "MAX_HEADER_BYTES", "MAX_TENSORS", "MAX_NAME_BYTES", "DTYPE_CODES",
           "TensorEntry", "ModelHeader", "ModelFile", "read_header", "open_model", "write_model"]
