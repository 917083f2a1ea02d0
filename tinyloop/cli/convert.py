"""``tinyloop convert``: turn a safetensors checkpoint of the model family into a .tinyloop file.

The checkpoint's tensor names must be the logical names of :mod:`tinyloop.model.arch` (``embed``,
``pre.0.wq``, ``loop.0.w_down``, ``final_norm``, ``head`` ...) and the config JSON's keys the
:class:`~tinyloop.model.arch.ModelConfig` fields; see docs/CONVERT.md. A checkpoint that does not fit
the family is refused with the reason (every missing / unexpected / misshaped tensor is named).

Reading: tensor headers are parsed from the safetensors header (8-byte little-endian length + JSON)
before any data is read, so every structural problem is reported up front. Tensors are read from
the file's bytes (never memory-mapped: a shard truncated under a map kills the process with SIGBUS
when a page past its new end is touched), F32/F16/F64 as little-endian arrays and BF16 (which numpy
cannot represent) as uint16 widened exactly to float32 (``bits << 16``). Tensors are loaded one at a
time while the output is written, and written to a temporary file that replaces the output only on
success.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import stat
import struct
import sys
from typing import Dict, Iterator, List, Mapping, Optional, Tuple

import numpy as np

from ..progress import bar
from ..model.arch import QUANT_TYPES, ModelConfig, TensorQuant, required_tensors
from ..errors import ConfigError, ModelFormatError, TinyLoopError
from ..model.presets import check_quant_shapes, make_quant

FLOAT_DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
ALL_DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                   "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
MAX_HEADER = 100 << 20
_VERIFY_CHUNK = 1 << 22
#: how each float dtype's bytes are read (BF16: its bits, widened to float32 after)
_READ_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "BF16": "<u2"}


class TensorInfo:
    __slots__ = ("name", "file", "dtype", "shape", "start", "end")

    def __init__(self, name, file, dtype, shape, start, end):
        self.name, self.file, self.dtype, self.shape = name, file, dtype, tuple(shape)
        self.start, self.end = start, end


def _open_regular(path: str):
    """`path` opened for binary reading if it is a regular file (ModelFormatError otherwise): opened
    non-blocking, so a FIFO is refused instead of blocking the open and every read."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ModelFormatError(f"{path}: not a safetensors file (not a regular file)")
    return os.fdopen(fd, "rb")


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def read_safetensors_header(path: str) -> Tuple[Dict[str, TensorInfo], dict]:
    """Parse a safetensors file's header: ({name: TensorInfo (absolute byte range)}, __metadata__).
    Checked as the safetensors library checks it (dims and offsets are non-negative integers, each
    byte range fits its dtype and shape, the tensors tile the data exactly to the end of the file),
    since the tensors are read here (CheckpointWeights) rather than by the library."""
    try:
        with _open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) < 8:
                raise ModelFormatError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER or 8 + n > size:
                raise ModelFormatError(f"{path}: not a safetensors file (header length {n} is "
                                       f"impossible for a {size}-byte file)")
            text = f.read(n)
    except OSError as e:
        raise ModelFormatError(f"{path}: cannot read: {e}") from None
    try:
        header = json.loads(text.decode("utf-8"))
    except (ValueError, RecursionError) as e:   # (UnicodeDecodeError, JSONDecodeError, int digits)
        raise ModelFormatError(f"{path}: not a safetensors file (header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise ModelFormatError(f"{path}: not a safetensors file (header is not a JSON object)")
    base = 8 + n
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ModelFormatError(f"{path}: __metadata__ must be an object of strings, got {meta!r:.80}")
    out: Dict[str, TensorInfo] = {}
    for name, e in header.items():
        try:
            dtype, shape, (b, end) = e["dtype"], list(e["shape"]), e["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ModelFormatError(f"{path}: malformed header entry for tensor {name!r}") from None
        if not isinstance(dtype, str) or not all(_is_count(v) for v in shape + [b, end]):
            raise ModelFormatError(f"{path}: malformed header entry for tensor {name!r}: dtype {dtype!r} "
                                   f"must be a name, shape {shape!r} and data_offsets {[b, end]!r} "
                                   f"non-negative integers")
        count = 1
        for s in shape:
            count *= s
        item = ALL_DTYPE_SIZES.get(dtype)
        if end < b or base + end > size or (item is not None and end - b != count * item):
            raise ModelFormatError(f"{path}: tensor {name!r} has an inconsistent byte range "
                                   f"[{b}, {end}) for {dtype} {shape} (file is truncated?)")
        out[name] = TensorInfo(name, path, dtype, shape, base + b, base + end)
    pos = base
    for info in sorted(out.values(), key=lambda i: (i.start, i.end)):
        if info.start != pos:
            raise ModelFormatError(f"{path}: tensor {info.name!r} starts at data offset {info.start - base}, "
                                   f"expected {pos - base}: tensors overlap or leave a gap")
        pos = info.end
    if pos != size:
        raise ModelFormatError(f"{path}: {size - pos} bytes after the last tensor's data (the header does "
                               f"not cover the file)")
    return out, meta


def index_checkpoint(path: str) -> Dict[str, TensorInfo]:
    """{tensor name: TensorInfo} of a .safetensors file or a directory of *.safetensors shards."""
    path = os.fspath(path)
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise ModelFormatError(f"checkpoint directory {path!r} contains no *.safetensors files")
    elif os.path.isfile(path):
        files = [path]
    elif os.path.exists(path):
        raise ModelFormatError(f"checkpoint {path!r} is not a regular file or a directory")
    else:
        raise ModelFormatError(f"checkpoint {path!r} does not exist")
    return _index_files(files)


def _index_files(files: List[str]) -> Dict[str, TensorInfo]:
    index: Dict[str, TensorInfo] = {}
    for f in files:
        tensors, _ = read_safetensors_header(f)
        for name, info in tensors.items():
            if name in index:
                raise ModelFormatError(f"tensor {name!r} appears in two shards: "
                                       f"{index[name].file} and {f}")
            index[name] = info
    return index


def check_fits_family(cfg: ModelConfig, index: Mapping[str, TensorInfo]) -> None:
    """Refuse a checkpoint whose tensors do not match `cfg`: names every missing, unexpected,
    misshaped or non-float tensor."""
    want = required_tensors(cfg)
    problems: List[str] = []
    missing = [n for n in want if n not in index]
    unexpected = sorted(n for n in index if n not in want)
    if missing:
        problems.append(f"missing tensor(s): {_list(missing)}")
    if unexpected:
        hint = ""
        if "head" in unexpected and cfg.tied_embeddings:
            hint = " ('head' is present but the config says tied_embeddings=true)"
        problems.append(f"unexpected tensor(s) not in this model family/config: "
                        f"{_list(unexpected)}{hint}")
    for name, shape in want.items():
        info = index.get(name)
        if info is None:
            continue
        if info.dtype not in FLOAT_DTYPES:
            problems.append(f"{name}: dtype {info.dtype} is not a float type "
                            f"(allowed: {sorted(FLOAT_DTYPES)})")
        elif info.shape != tuple(shape):
            problems.append(f"{name}: wrong shape, expected {tuple(shape)}, got {info.shape}")
    if problems:
        raise ModelFormatError("checkpoint does not fit the model family: " + "; ".join(problems))


def _list(names: List[str], limit: int = 12) -> str:
    s = ", ".join(names[:limit])
    return s + (f" and {len(names) - limit} more" if len(names) > limit else "")


class CheckpointWeights(Mapping):
    """Lazy {logical name: float32 array} over an indexed checkpoint. Loading a tensor with a
    non-finite value raises ModelFormatError (and records it in ``.error``)."""

    def __init__(self, index: Mapping[str, TensorInfo], names, derived=None) -> None:
        self.index = index
        self.derived = dict(derived or {})   # logical name -> (TensorInfo or None, fn)
        self.names = list(names)
        self._nameset = frozenset(self.names)
        self.error: Optional[Exception] = None

    def load(self, name: str) -> np.ndarray:
        if name in self.derived:
            info, fn = self.derived[name]
            a = fn(None if info is None else self._read(info, name))
            return np.ascontiguousarray(a, dtype=np.float32)
        return self._read(self.index[name], name)

    def _read(self, info: TensorInfo, name: str) -> np.ndarray:
        """The float32 array of checkpoint tensor `info` (ModelFormatError when unreadable or
        not finite; `name` is the logical tensor it is read for)."""
        if info.dtype not in _READ_DTYPES:      # (the callers refuse these before any read)
            raise ModelFormatError(f"{info.file}: tensor {info.name!r} of dtype {info.dtype} is not a float tensor")
        n = info.end - info.start
        try:        # read, never mapped; the file may have changed since it was indexed
            with _open_regular(info.file) as f:
                f.seek(info.start)
                data = f.read(n)
        except OSError as e:
            raise ModelFormatError(f"{info.file}: cannot read tensor {name!r}: {e.strerror or e}") from None
        if len(data) != n:
            raise ModelFormatError(f"{info.file}: cannot read tensor {name!r}: the file ends before its "
                                   f"bytes {info.start}..{info.end} (changed since it was indexed?)")
        a = np.frombuffer(data, dtype=_READ_DTYPES[info.dtype]).reshape(info.shape)
        if info.dtype == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        else:
            a = a.astype(np.float32)
        if a.size and not np.isfinite(a).all():
            bad = int(a.size - np.count_nonzero(np.isfinite(a)))
            err = ModelFormatError(f"{info.file}: {name}: contains {bad} non-finite value(s) (NaN/Inf); "
                                   f"the checkpoint is corrupt or was saved mid-divergence")
            self.error = err
            raise err
        return a

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._nameset:
            raise KeyError(name)
        return self.load(name)

    def __contains__(self, name) -> bool:  # Mapping's default would load the tensor
        return name in self._nameset

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def tensor_type(name: str) -> str:
    """Summary group of a logical tensor: embed, head, final_norm, or the block tensor's kind."""
    return name.rsplit(".", 1)[-1]


def parse_metadata(items: Optional[List[str]]) -> Dict[str, str]:
    out: Dict[str, str] = {}
    for it in items or []:
        key, sep, value = it.partition("=")
        if not sep or not key:
            raise ConfigError(f"--metadata {it!r} must be KEY=VALUE")
        out[key] = value
    return out


def load_config(path: str) -> ModelConfig:
    from ..model.hf_import import read_json
    d = read_json(path, "config", error=ConfigError)
    try:
        return ModelConfig.from_dict(d)
    except ConfigError as e:
        raise ConfigError(f"config {path!r}: {e}") from None


def convert(checkpoint: str, config: str, output: str, *, quant: str = "q4",
            group_size: int = 128, embed_quant: Optional[str] = None,
            head_quant: Optional[str] = None, tokenizer_dir: Optional[str] = None,
            metadata: Optional[Dict[str, str]] = None) -> dict:
    """Convert and verify; returns the summary dict (also what ``convert`` prints)."""
    cfg = load_config(config)
    index = index_checkpoint(checkpoint)
    _check_output(output, sorted({i.file for i in index.values()}) + [os.fspath(config)])
    check_fits_family(cfg, index)
    tok = None
    if tokenizer_dir:
        from ..model.tokenizer import load_tokenizer_dir
        tok = _embedded_tokenizer(load_tokenizer_dir(tokenizer_dir), cfg, f"tokenizer {tokenizer_dir!r}")
    return _write(cfg, index, checkpoint, output, quant, group_size, embed_quant, head_quant, tok,
                  metadata, {})


def convert_hf(model_dir: str, output: str, *, loop_layers=None, loops: Optional[int] = None,
               max_loops: Optional[int] = None, init_scale: Optional[float] = None,
               init_seed: Optional[int] = None, quant: str = "q4", group_size: int = 128,
               embed_quant: Optional[str] = None, head_quant: Optional[str] = None,
               tokenizer_dir: Optional[str] = None, metadata: Optional[Dict[str, str]] = None) -> dict:
    """Convert a Hugging Face model directory (tinyloop.model.hf_import: config.json, safetensors
    shards, tokenizer.json) and verify; returns the summary dict. `tokenizer_dir` overrides the
    directory's own tokenizer files; init_scale / init_seed select Huginn's seeded random
    initial loop state (docs/CONVERT.md)."""
    from ..model.hf_import import find_tokenizer, plan_hf

    if not isinstance(model_dir, (str, os.PathLike)):
        raise ConfigError(f"model_dir must be a path, got {type(model_dir).__name__}")
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise ModelFormatError(f"model directory {model_dir!r} does not exist or is not a directory")
    index, inputs = index_hf_dir(model_dir)
    inputs += [os.path.join(model_dir, f) for f in os.listdir(model_dir)
               if f.endswith((".json", ".txt", ".model"))]
    _check_output(output, inputs)
    plan = plan_hf(model_dir, index, loop_layers=loop_layers, loops=loops, max_loops=max_loops,
                   init_scale=init_scale, init_seed=init_seed)
    cfg = plan.config
    tok = None
    tok_dir = tokenizer_dir or (model_dir if find_tokenizer(model_dir) else None)
    if tok_dir:
        from ..model.tokenizer import load_tokenizer_dir
        tok = _embedded_tokenizer(load_tokenizer_dir(tok_dir), cfg, f"tokenizer in {tok_dir!r}")
    else:
        plan.notes.append("no tokenizer.json (or vocab.json + merges.txt) found: none embedded")
    for copy, first in plan.tied_copies:
        _check_same_bytes(index[copy], index[first])
    if cfg.tied_embeddings and "lm_head.weight" in index and plan.names.get("embed") == "model.embed_tokens.weight":
        _check_same_bytes(index["lm_head.weight"], index["model.embed_tokens.weight"],
                          "tie_word_embeddings is true but the stored head is another matrix (transformers 5 "
                          "then runs the stored head, transformers 4 the embedding): set tie_word_embeddings "
                          "to say which")
    logical = {name: index[hf] for name, hf in plan.names.items()}
    derived = {name: (None if src is None else index[src], fn) for name, (src, fn) in plan.derived.items()}
    _check_float(list(logical.values()) + [i for i, _ in derived.values() if i is not None]
                 + [index[c] for c, _ in plan.tied_copies], f"{plan.architecture} checkpoint {model_dir!r}")
    meta = {"source_architecture": plan.architecture}
    meta.update(metadata or {})
    return _write(cfg, logical, model_dir, output, quant, group_size, embed_quant, head_quant, tok,
                  meta, {"architecture": plan.architecture, "notes": plan.notes}, derived,
                  tensors=len(index))


def _embedded_tokenizer(t, cfg: ModelConfig, what: str) -> dict:
    if t.vocab_size > cfg.vocab_size:
        raise ConfigError(f"{what} has ids up to {t.vocab_size - 1}, but the model's vocab_size is "
                          f"{cfg.vocab_size}")
    return t.to_embedded()


def index_hf_dir(model_dir: str) -> Tuple[Dict[str, TensorInfo], List[str]]:
    """({tensor name: TensorInfo}, the files read) of a Hugging Face model directory, choosing
    the shards as transformers does: ``model.safetensors`` when present, else the shards
    ``model.safetensors.index.json`` names (every tensor it maps must be found; other
    ``*.safetensors`` files beside them, such as an original-format ``consolidated.safetensors``,
    are not read), else every ``*.safetensors`` file of the directory."""
    from ..model.hf_import import read_json
    single = os.path.join(model_dir, "model.safetensors")
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(single) or not os.path.isfile(index_path):
        index = index_checkpoint(single if os.path.isfile(single) else model_dir)
        return index, sorted({info.file for info in index.values()})
    weight_map = read_json(index_path, "shard index").get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelFormatError(f"{index_path}: has no weight_map object of tensor name -> shard file")
    bad = sorted({v for v in weight_map.values() if os.path.basename(v) != v or v in ("", ".", "..")})
    if bad:
        raise ModelFormatError(f"{index_path}: shard names must be file names in the directory, "
                               f"got {_list(bad)}")
    shards = sorted({os.path.join(model_dir, v) for v in weight_map.values()})
    gone = [f for f in shards if not os.path.isfile(f)]
    present = [f for f in shards if os.path.isfile(f)]
    if not present:
        raise ModelFormatError(f"{index_path}: none of its shard files exists: {_list(gone)}")
    index = _index_files(present)
    absent = sorted(n for n in weight_map if n not in index)
    if absent:
        names = sorted({os.path.basename(weight_map[n]) for n in absent})
        raise ModelFormatError(f"{index_path} lists tensor(s) no shard holds: {_list(absent)} (missing "
                               f"shard file(s)? {_list(names)})")
    return index, present + [index_path]


def _check_float(infos, what: str) -> None:
    """Every tensor a conversion reads is of a float dtype (ModelFormatError listing the others)."""
    bad = sorted({f"{i.name}: dtype {i.dtype}" for i in infos if i.dtype not in FLOAT_DTYPES})
    if bad:
        raise ModelFormatError(f"{what}: tensor(s) of a non-float dtype (allowed: "
                               f"{sorted(FLOAT_DTYPES)}): {_list(bad)}")


def _check_output(output: str, inputs: List[str]) -> str:
    """The absolute output path, refused (ConfigError) when it is a directory or one of the
    conversion's own input files, before any work."""
    if not isinstance(output, (str, os.PathLike)):
        raise ConfigError(f"output must be a path, got {type(output).__name__}")
    out_abs = os.path.abspath(os.fspath(output))
    if os.path.isdir(out_abs):
        raise ConfigError(f"output {os.fspath(output)!r} is a directory: give a file path such as "
                          f"{os.path.join(os.fspath(output), 'model.tinyloop')!r}")
    if not os.path.isdir(os.path.dirname(out_abs)):
        raise ConfigError(f"output {os.fspath(output)!r}: the folder {os.path.dirname(out_abs)!r} does not exist")
    if os.path.exists(out_abs):
        for f in inputs:
            if os.path.exists(f) and os.path.samefile(f, out_abs):
                raise ConfigError(f"output {os.fspath(output)!r} is one of the conversion's input "
                                  f"files ({f}): give another path")
    return out_abs


def _check_same_bytes(a: TensorInfo, b: TensorInfo, why: str = "the loop layers are not weight-tied copies "
                      "(check --loop-layers / --loops)") -> None:
    """Weight-tied loop copies are stored bit-identical (ModelFormatError otherwise, saying `why`)."""
    n = a.end - a.start
    if n != b.end - b.start:
        raise ModelFormatError(f"{a.name} differs from {b.name}: {why}")
    with open(a.file, "rb") as fa, open(b.file, "rb") as fb:
        fa.seek(a.start)
        fb.seek(b.start)
        for off in range(0, n, _VERIFY_CHUNK):
            k = min(_VERIFY_CHUNK, n - off)
            if fa.read(k) != fb.read(k):
                raise ModelFormatError(f"{a.name} differs from {b.name}: {why}")


def _write(cfg: ModelConfig, index: Mapping[str, TensorInfo], checkpoint: str, output: str,
           quant: str, group_size: int, embed_quant, head_quant, tok, metadata, extra: dict,
           derived=None, tensors: Optional[int] = None) -> dict:
    """Write `cfg` with the tensors of `index` (logical name -> TensorInfo) and `derived`
    (logical name -> (TensorInfo or None, function of its array)) to `output` through a
    temporary file, re-read and verify it; returns the summary."""
    from ..model.format import open_model, write_model

    tq = make_quant(cfg, quant, group_size, embed_quant, head_quant)
    check_quant_shapes(cfg, tq)
    meta = {"source_checkpoint": os.path.basename(os.path.normpath(checkpoint))}
    meta.update(metadata or {})
    out_abs = os.path.abspath(os.fspath(output))      # checked by the callers (_check_output)
    d, base = os.path.split(out_abs)
    tmp = os.path.join(d, f".{base}.{os.getpid()}.partial")
    weights = CheckpointWeights(index, required_tensors(cfg), derived)
    try:
        try:
            write_model(tmp, cfg, weights, quant=tq, tokenizer=tok, metadata=meta)
        except Exception:
            if weights.error is not None:  # report the checkpoint problem, not the writer's wrapper
                raise weights.error from None
            raise
        summary = _verify(open_model, tmp, cfg, weights, tq)
        os.replace(tmp, out_abs)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    summary.update(output=output, file_size=os.path.getsize(out_abs),
                   checkpoint=checkpoint, tensors=len(index) if tensors is None else tensors, **extra)
    return summary


def _verify(open_model, path: str, cfg: ModelConfig, weights: CheckpointWeights,
            tq: Mapping[str, TensorQuant]) -> dict:
    """Reopen the written file and compare every dequantized tensor with the original."""
    groups: Dict[str, dict] = {}
    with open_model(path) as m:
        names = list(required_tensors(cfg))
        for name in bar(names, "verify", total=len(names), unit="tensor"):
            orig = weights.load(name)
            got = np.asarray(m.logical(name), dtype=np.float32)
            if got.shape != orig.shape:
                raise ModelFormatError(f"{name}: written tensor has shape {got.shape}, "
                                       f"expected {orig.shape}")
            t = tq[name]
            key = tensor_type(name)
            g = groups.setdefault(key, {"quant": set(), "tensors": 0, "sq_diff": 0.0, "sq_orig": 0.0,
                                        "max_diff": 0.0, "max_orig": 0.0})
            g["quant"].add(t.type if not t.bits else f"{t.type}/g{t.group_size}")
            g["tensors"] += 1
            flat_o, flat_g = orig.reshape(-1), got.reshape(-1)
            for i in range(0, flat_o.size, _VERIFY_CHUNK):  # bounded float64 temporaries
                o = flat_o[i:i + _VERIFY_CHUNK].astype(np.float64)
                diff = flat_g[i:i + _VERIFY_CHUNK].astype(np.float64) - o
                g["sq_diff"] += float(np.dot(diff, diff))
                g["sq_orig"] += float(np.dot(o, o))
                g["max_diff"] = max(g["max_diff"], float(np.max(np.abs(diff))))
                g["max_orig"] = max(g["max_orig"], float(np.max(np.abs(o))))
            del orig, got, flat_o, flat_g
    errors = {}
    for key, g in groups.items():
        errors[key] = {
            "quant": ",".join(sorted(g["quant"])), "tensors": g["tensors"],
            "max_rel": g["max_diff"] / g["max_orig"] if g["max_orig"] else 0.0,
            "rms_rel": math.sqrt(g["sq_diff"] / g["sq_orig"]) if g["sq_orig"] else 0.0,
        }
    from ..analysis.memory import parameter_count
    return {"parameters": parameter_count(cfg), "f32_bytes": 4 * parameter_count(cfg),
            "quant_error": errors}


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "convert", help="convert a safetensors checkpoint to a .tinyloop file",
        description="Convert a safetensors checkpoint to a .tinyloop file: a Hugging Face model "
                    "directory (--hf: Llama, Mistral, Qwen2), or tensors under the model family's "
                    "logical names with a ModelConfig JSON (--checkpoint + --config); see "
                    "docs/CONVERT.md.")
    p.add_argument("--hf", default=None, metavar="DIR",
                   help="a Hugging Face model directory (config.json, *.safetensors, tokenizer.json)")
    p.add_argument("--checkpoint", default=None,
                   help="a .safetensors file or a directory of *.safetensors shards (logical names)")
    p.add_argument("--config", default=None, help="model config JSON (keys = ModelConfig fields)")
    p.add_argument("--loop-layers", default=None, metavar="A:B",
                   help="with --hf: layers A..B-1 are the shared loop block (default: the last layer, run once)")
    p.add_argument("--loops", type=int, default=None,
                   help="with --hf: the default depth; for a Llama-family checkpoint also how many "
                        "times in a row it stores the loop block (weight-tied copies, checked; "
                        "default 1); Huginn / Ouro: default their mean_recurrence / total_ut_steps")
    p.add_argument("--max-loops", type=int, default=None,
                   help="with --hf: the deepest loop count a request may ask for (default: --loops)")
    p.add_argument("--init-scale", type=float, default=None, metavar="S",
                   help="with --hf, Huginn: start the loop from the seeded random state of the "
                        "reference code's init_scale S (default 0: from zeros)")
    p.add_argument("--init-seed", type=int, default=None, metavar="N",
                   help="with --hf, Huginn: the random initial state's seed, in [0, 2**64) (default 0)")
    p.add_argument("-o", "--output", required=True, help="output .tinyloop file")
    p.add_argument("--quant", choices=QUANT_TYPES, default="q4",
                   help="storage of the block matrices (default q4)")
    p.add_argument("--group-size", type=int, default=128,
                   help="quantization group size along in_features (default 128)")
    p.add_argument("--embed-quant", choices=QUANT_TYPES, default=None,
                   help="storage of embed (default: --quant)")
    p.add_argument("--head-quant", choices=QUANT_TYPES, default=None,
                   help="storage of head (default: --quant; ignored with tied embeddings)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory (tokenizer.json, or vocab.json + merges.txt) to embed "
                        "in the file (with --hf: instead of the model directory's own)")
    p.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE",
                   help="metadata entries to store in the file")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    try:
        for flag, value in (("--output", args.output), ("--tokenizer", args.tokenizer)):
            if value is not None and not value:     # (an unset shell variable: not "not given")
                raise ConfigError(f"{flag} '' is empty: give a path")
        meta = parse_metadata(args.metadata)
        common = dict(quant=args.quant, group_size=args.group_size, embed_quant=args.embed_quant,
                      head_quant=args.head_quant, tokenizer_dir=args.tokenizer, metadata=meta)
        if args.hf is not None:
            if args.checkpoint is not None or args.config is not None:
                raise ConfigError("--hf reads the checkpoint and config from its directory: give "
                                  "either --hf DIR or --checkpoint + --config")
            s = convert_hf(args.hf, args.output, loop_layers=args.loop_layers, loops=args.loops,
                           max_loops=args.max_loops, init_scale=args.init_scale,
                           init_seed=args.init_seed, **common)
        else:
            if args.checkpoint is None or args.config is None:
                raise ConfigError("give --hf DIR, or both --checkpoint and --config")
            hf_only = [f for f, v in (("--loop-layers", args.loop_layers), ("--loops", args.loops),
                                      ("--max-loops", args.max_loops), ("--init-scale", args.init_scale),
                                      ("--init-seed", args.init_seed)) if v is not None]
            if hf_only:
                raise ConfigError(f"{', '.join(hf_only)} apply to --hf only (the config JSON sets "
                                  f"the loop structure)")
            s = convert(args.checkpoint, args.config, args.output, **common)
    except (TinyLoopError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from ..analysis.memory import format_bytes
    print(f"converted {s['checkpoint']} -> {s['output']}"
          + (f" ({s['architecture']})" if s.get("architecture") else ""))
    for note in s.get("notes", ()):
        print(f"  note: {note}")
    print(f"  parameters: {s['parameters']:,}")
    print(f"  file size:  {format_bytes(s['file_size'])} (float32 would be "
          f"{format_bytes(s['f32_bytes'])})")
    print("  quantization error, dequantized vs original (max_rel = max|err| / max|w|, "
          "rms_rel = ||err|| / ||w||):")
    print(f"    {'tensor':<12} {'storage':<10} {'count':>5} {'max_rel':>10} {'rms_rel':>10}")
    for key, e in s["quant_error"].items():
        print(f"    {key:<12} {e['quant']:<10} {e['tensors']:>5} {e['max_rel']:>10.2e} "
              f"{e['rms_rel']:>10.2e}")
    return 0
