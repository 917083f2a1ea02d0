"""The .tinyloop file format (tinyloop.model.format): round trips and one test per malformed-file class.

Malformed files are made by parsing a valid file with an independent reader of the documented
layout (docs/FORMAT.md), changing one thing, and serializing it again.
"""

import copy
import gc
import json
import os
import struct
from dataclasses import dataclass, field
from typing import List

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinyloop.model.arch import ModelConfig, TensorQuant, is_matrix, required_tensors
from tinyloop.errors import ConfigError, ModelFormatError, ModelFreedError
from tinyloop.model.format import ModelFile, open_model, read_header, write_model
from tinyloop.model.quant import dequantize_tensor, quantize_tensor

# --------------------------------------------------------------------------- fixtures
CFG = ModelConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, n_pre=1, n_loop=1, n_post=1,
                  eos_id=1)
CFG_TIED = ModelConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, n_pre=0, n_loop=1, n_post=1,
                       tied_embeddings=True, loop_inject="add", max_loops=4, default_loops=2)
QUANT = {
    "embed": TensorQuant("q8", 32), "head": TensorQuant("q4", 32),
    "pre.0.wq": TensorQuant("q4", 16), "pre.0.wk": TensorQuant("q2", 8), "pre.0.wv": TensorQuant("q8", 8),
    "pre.0.wo": TensorQuant("f32"), "pre.0.w_up": TensorQuant("f16"), "pre.0.w_down": TensorQuant("q2", 64),
    "loop.0.attn_norm": TensorQuant("f16"), "final_norm": TensorQuant("f16"),
}
DEFAULT = TensorQuant("q4", 8)
_base = [chr(ord("a") + i) for i in range(26)] + [str(i) for i in range(9)] + ["é"]
_pairs = [(_base[i], _base[i + 1]) for i in range(28)]
TOKENIZER = {"type": "bpe", "vocab": {t: i for i, t in enumerate(_base + [a + b for a, b in _pairs])},
             "merges": [f"{a} {b}" for a, b in _pairs]}
METADATA = {"name": "tiny", "nested": {"list": [1, 2.5, None, "é"], "flag": True}}


def make_weights(cfg, seed=0):
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in required_tensors(cfg).items()}


def resolved_quant(cfg, quant, default):
    return {n: quant.get(n, default if is_matrix(n) else TensorQuant("f32")) for n in required_tensors(cfg)}


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    """Bytes of the main valid file: untied, mixed quantization, tokenizer and metadata."""
    path = tmp_path_factory.mktemp("valid") / "m.tinyloop"
    write_model(path, CFG, make_weights(CFG), QUANT, DEFAULT, TOKENIZER, METADATA)
    return path.read_bytes()


def _fds():
    """{fd: what it refers to} for this process's open descriptors."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:          # the descriptor listdir itself used, closed by now
            pass
    return out


def _model_file(target: str, directory) -> bool:
    return target.endswith(".tinyloop") or str(directory) in target


def _mapped(directory):
    with open("/proc/self/maps") as f:
        return [line for line in f if str(directory) in line]


@pytest.fixture(scope="module", autouse=True)
def collect_earlier_garbage():
    """Garbage left by earlier tests (in other files) must not close its descriptors mid-test: one
    full collection before this file's tests (a collection per test cost ~4 s each in the whole
    suite, whose heap holds torch and ray). This file's own tests leave no such garbage: no_leaks
    checks each of them without the collector."""
    gc.collect()


@pytest.fixture(autouse=True)
def no_leaks(tmp_path):
    """Every test must leave no file descriptor open and nothing under tmp_path mapped, without
    help from the garbage collector (closing must be deterministic)."""
    # Only model files count: libraries may open and close unrelated descriptors meanwhile.
    before = _fds()
    yield
    opened = {fd: t for fd, t in _fds().items() if before.get(fd) != t and _model_file(t, tmp_path)}
    assert opened == {}
    assert _mapped(tmp_path) == []


# --------------------------------------------------------------------------- raw file editing
@dataclass
class Entry:
    name: bytes
    code: int
    dims: List[int]
    offset: int
    nbytes: int


@dataclass
class Raw:
    """A model file taken apart: prefix fields, header bytes, table entries and tensor bytes."""

    magic: bytes
    version: int
    reserved: int
    header: bytes
    entries: List[Entry]
    blobs: List[bytes]
    n_tensors: int = None
    gaps: List[bytes] = field(default_factory=list)
    tail: bytes = b""

    @property
    def meta(self):
        return json.loads(self.header)

    @meta.setter
    def meta(self, obj):
        self.header = json.dumps(obj).encode()

    def index(self, name):
        return [e.name for e in self.entries].index(name.encode())

    def relayout(self):
        """Sequential 64-aligned offsets and nbytes = blob size, as the writer makes them."""
        offset = 0
        for e, blob in zip(self.entries, self.blobs):
            e.offset, e.nbytes = offset, len(blob)
            offset = -(-(offset + len(blob)) // 64) * 64
        return self

    def build(self) -> bytes:
        table = struct.pack("<I", len(self.entries) if self.n_tensors is None else self.n_tensors)
        for e in self.entries:
            table += struct.pack("<H", len(e.name)) + e.name + struct.pack("<BB", e.code, len(e.dims))
            table += struct.pack(f"<{len(e.dims)}Q", *e.dims) + struct.pack("<QQ", e.offset, e.nbytes)
        out = self.magic + struct.pack("<IIQ", self.version, self.reserved, len(self.header)) + self.header + table
        out += b"\0" * (-len(out) % 64)
        data = bytearray(max((e.offset + len(b) for e, b in zip(self.entries, self.blobs) if b), default=0))
        for i, (e, blob) in enumerate(zip(self.entries, self.blobs)):
            data[e.offset:e.offset + len(blob)] = blob
            if i < len(self.gaps) and self.gaps[i]:
                end = e.offset + len(blob)
                data[end:end + len(self.gaps[i])] = self.gaps[i]
        return out + bytes(data) + self.tail


def parse(data: bytes) -> Raw:
    """Independent reader of the documented layout (assumes a valid file)."""
    magic, version, reserved, header_len = struct.unpack_from("<8sIIQ", data, 0)
    pos = 24 + header_len
    header = data[24:pos]
    (n,) = struct.unpack_from("<I", data, pos)
    pos += 4
    entries = []
    for _ in range(n):
        (name_len,) = struct.unpack_from("<H", data, pos)
        name = data[pos + 2:pos + 2 + name_len]
        pos += 2 + name_len
        code, ndim = struct.unpack_from("<BB", data, pos)
        dims = list(struct.unpack_from(f"<{ndim}Q", data, pos + 2))
        offset, nbytes = struct.unpack_from("<QQ", data, pos + 2 + 8 * ndim)
        pos += 2 + 8 * ndim + 16
        entries.append(Entry(name, code, dims, offset, nbytes))
    data_offset = -(-pos // 64) * 64
    blobs = [data[data_offset + e.offset:data_offset + e.offset + e.nbytes] for e in entries]
    return Raw(magic, version, reserved, header, entries, blobs)


def write(tmp_path, data: bytes, name="bad.tinyloop"):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def expect_error(tmp_path, data: bytes, match: str, header_too: bool = True):
    """open_model (and read_header when the problem is outside the data) raise ModelFormatError."""
    path = write(tmp_path, data)
    with pytest.raises(ModelFormatError, match=match):
        open_model(path)
    if header_too:
        with pytest.raises(ModelFormatError, match=match):
            read_header(path)
    else:
        read_header(path)


def blob_array(raw: Raw, name: str, dtype) -> np.ndarray:
    return np.frombuffer(raw.blobs[raw.index(name)], dtype=dtype).copy()


def set_blob(raw: Raw, name: str, array: np.ndarray) -> Raw:
    raw.blobs[raw.index(name)] = array.tobytes()
    return raw


# --------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("cfg, quant, default, tokenizer, metadata", [
    (CFG, QUANT, DEFAULT, TOKENIZER, METADATA),
    (CFG, {}, None, None, None),
    (CFG_TIED, {"embed": TensorQuant("q2", 16), "loop.0.w_down": TensorQuant("q8", 64)}, TensorQuant("f32"),
     TOKENIZER, {}),
    (CFG_TIED, {}, TensorQuant("q4", 32), None, {"k": "v"}),
])
def test_round_trip(tmp_path, cfg, quant, default, tokenizer, metadata):
    weights = make_weights(cfg, seed=3)
    path = tmp_path / "model.tinyloop"
    write_model(path, cfg, weights, quant, default, tokenizer, metadata)
    assert os.listdir(tmp_path) == ["model.tinyloop"]  # no temporary left behind
    expected_quant = resolved_quant(cfg, quant, default or TensorQuant("f16"))

    h = read_header(path)
    assert (h.version, h.config, h.quant, h.tokenizer, h.metadata) == (
        1, cfg, expected_quant, tokenizer, metadata or {})
    assert list(h.quant) == list(required_tensors(cfg))
    assert h.file_size == os.path.getsize(path) and h.data_offset % 64 == 0
    physical = {}
    for name, shape in required_tensors(cfg).items():
        physical.update(quantize_tensor(name, weights[name], expected_quant[name]))
    assert [e.name for e in h.tensors] == list(physical)
    raw = parse(path.read_bytes())  # the independent reader agrees with read_header
    assert [(e.name.decode(), tuple(e.dims), e.offset, e.nbytes) for e in raw.entries] == [
        (e.name, e.shape, e.offset, e.nbytes) for e in h.tensors]
    for e in h.tensors:
        assert e.offset % 64 == 0
        assert (e.dtype, e.shape) == ({"float32": "f32", "float16": "f16", "uint8": "u8"}[
            physical[e.name].dtype.name], physical[e.name].shape)

    with open_model(path) as m:
        assert m.header == h
        assert list(m.tensors) == list(physical)
        for name, arr in m.tensors.items():
            assert not arr.flags.writeable
            assert np.array_equal(arr, physical[name])
        for name, shape in required_tensors(cfg).items():
            got = m.logical(name)
            want = dequantize_tensor(name, physical, expected_quant[name], shape)
            assert got.dtype == np.float32 and np.array_equal(got, want)
            if expected_quant[name].type == "f32":
                assert np.array_equal(got, weights[name])
        del arr, got
    assert m.closed
    with pytest.raises(ModelFreedError, match="closed"):
        m.tensors
    with pytest.raises(ModelFreedError):
        m.logical("embed")


def test_logical_unknown_name(tmp_path, valid):
    with open_model(write(tmp_path, valid)) as m:
        with pytest.raises(ConfigError, match="unknown logical tensor 'nope'"):
            m.logical("nope")


def test_close_with_views_alive(tmp_path, valid):
    m = open_model(write(tmp_path, valid))
    view = m.tensors["embed.q"]
    m.close()
    m.close()  # idempotent
    assert view.sum() >= 0  # still valid: the map lives until the view goes
    del view


def test_overwrite_and_delete_after_close(tmp_path, valid):
    path = write(tmp_path, valid)
    with open_model(path):
        pass
    write_model(path, CFG, make_weights(CFG, seed=9))
    os.remove(path)


def test_open_missing_file(tmp_path):
    with pytest.raises(ModelFormatError, match="cannot open model file"):
        open_model(tmp_path / "absent.tinyloop")
    with pytest.raises(ModelFormatError, match="is a directory"):
        read_header(tmp_path)


# --------------------------------------------------------------------------- writer validation
def test_write_rejects_bad_weights(tmp_path):
    path = tmp_path / "m.tinyloop"
    w = make_weights(CFG)
    cases = [
        ({k: v for k, v in w.items() if k != "head"}, r"missing tensor\(s\) 'head'"),
        ({**w, "extra": w["head"]}, r"unknown tensor\(s\) 'extra'"),
        ({**w, "loop.0.wq": w["loop.0.wk"]}, r"'loop.0.wq' has shape \(16, 32\), but the config needs \(32, 32\)"),
        ({**w, "final_norm": np.full(32, np.nan)}, r"'final_norm': value nan at index \(0,\) is not finite"),
        ({**w, "embed": w["embed"].tolist()}, "real numeric ndarray"),
    ]
    for weights, match in cases:
        with pytest.raises(ModelFormatError, match=match):
            write_model(path, CFG, weights)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("kwargs, match", [
    ({"quant": {"final_norm": TensorQuant("q8", 32)}}, "final_norm is a norm vector and must be stored as f32 or f16"),
    ({"quant": {"pre.0.w_down": TensorQuant("q4", 128)}}, "not a multiple of group_size=128"),
    ({"quant": {"nope": TensorQuant("f16")}}, "unknown tensor 'nope'"),
    ({"quant": {"embed": "q8"}}, "must be a TensorQuant"),
    ({"default_quant": "f16"}, "default_quant must be a TensorQuant"),
    ({"tokenizer": {"type": "bpe", "vocab": {"a": 64}, "merges": []}}, r"id 64 is not an integer in \[0, 63\]"),
    ({"metadata": {"x": float("nan")}}, "plain JSON"),
    ({"metadata": {"x": object()}}, "plain JSON"),
    ({"metadata": ["not", "a", "dict"]}, "metadata must be a dict"),
])
def test_write_rejects_bad_arguments(tmp_path, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        write_model(tmp_path / "m.tinyloop", CFG, make_weights(CFG), **kwargs)
    assert os.listdir(tmp_path) == []


def test_write_is_atomic(tmp_path, valid):
    path = write(tmp_path, valid, "m.tinyloop")
    w = make_weights(CFG)
    w["post.0.wv"] = np.full((16, 32), 1e9, np.float32)  # too wide a range for q2 f16 scales
    with pytest.raises(ConfigError, match=r"post\.0\.wv: row 0, group 0: .* float16 maximum"):
        write_model(path, CFG, w, default_quant=TensorQuant("q2", 8))
    assert os.listdir(tmp_path) == ["m.tinyloop"] and path.read_bytes() == valid


def test_write_rejects_non_config(tmp_path):
    with pytest.raises(ConfigError, match="config must be a ModelConfig"):
        write_model(tmp_path / "m.tinyloop", CFG.to_dict(), make_weights(CFG))


# --------------------------------------------------------------------------- malformed prefix
def test_bad_magic(tmp_path, valid):
    expect_error(tmp_path, b"TINYLOOX" + valid[8:], r"not a TinyLoop model: magic is b'TINYLOOX'")


def test_unsupported_version(tmp_path, valid):
    expect_error(tmp_path, valid[:8] + struct.pack("<I", 2) + valid[12:], "unsupported format version 2")


def test_nonzero_reserved(tmp_path, valid):
    expect_error(tmp_path, valid[:12] + struct.pack("<I", 1) + valid[16:], "reserved prefix field is 0x1")


@pytest.mark.parametrize("header_len, match", [
    (2 ** 40, r"header_len=1099511627776 exceeds the limit"),
    (2 ** 64 - 1, "exceeds the limit"),
    (60 << 20, "truncated: JSON header needs 62914560 bytes"),
])
def test_oversized_header_len(tmp_path, valid, header_len, match):
    expect_error(tmp_path, valid[:16] + struct.pack("<Q", header_len) + valid[24:], match)


# --------------------------------------------------------------------------- malformed header
@pytest.mark.parametrize("header, match", [
    (b'{"config": "\xff"}', "not valid UTF-8"),
    (b"\xef\xbb\xbf{}", "not valid JSON"),
    (b"{not json", "not valid JSON"),
    (b"", "not valid JSON"),
    (b"[" * 100000, "not valid JSON"),
    (b'{"config": 1, "config": 2}', "duplicate key 'config'"),
    (b"[]", "must be a JSON object, got list"),
    (b'"x"', "must be a JSON object, got str"),
])
def test_header_not_json_object(tmp_path, valid, header, match):
    raw = parse(valid)
    raw.header = header
    expect_error(tmp_path, raw.build(), match)


def _edit(valid, fn):
    raw = parse(valid)
    meta = raw.meta
    fn(meta)
    raw.meta = meta
    return raw


@pytest.mark.parametrize("edit, match", [
    (lambda m: m.pop("metadata"), r"header keys are \['config', 'quant', 'tokenizer'\]"),
    (lambda m: m.update(extra=1), "expected exactly"),
    (lambda m: m["config"].update(n_kv_heads=3), "n_kv_heads=3 must divide n_heads=4"),
    (lambda m: m["config"].update(vocab_size=0), r"vocab_size=0 is outside"),
    (lambda m: m["config"].update(d_model="32"), "d_model must be an integer"),
    (lambda m: m["config"].update(bogus=1), r"unknown model config key\(s\) \['bogus'\]"),
    (lambda m: m["config"].pop("d_ff"), r"missing required key\(s\) \['d_ff'\]"),
    (lambda m: m["config"].update(rope_theta=10 ** 400), "rope_theta"),
    (lambda m: m["config"].update(eos_id=64), r"eos_id=64 is outside"),
    (lambda m: m.update(config=[1]), "model config must be a mapping"),
    (lambda m: m.update(quant=[]), "quant must be an object"),
    (lambda m: m["quant"].pop("head"), r"quant is missing tensor\(s\) 'head'"),
    (lambda m: m["quant"].update(bogus="f16"), r"quant names unknown tensor\(s\) 'bogus'"),
    (lambda m: m["quant"].update(final_norm={"type": "q4", "group_size": 8}), "final_norm is a norm vector"),
    (lambda m: m["quant"].update(embed={"type": "q5", "group_size": 8}), r"quant\['embed'\]: quantization type 'q5'"),
    (lambda m: m["quant"].update(embed={"type": "q4", "group_size": 12}), "multiple of 8"),
    (lambda m: m["quant"].update(embed={"type": "q4", "group_size": 64}), "not a multiple of group_size=64"),
    (lambda m: m["quant"].update(embed={"type": "q4"}), r"group_size=0 is outside the allowed range \[8, "),
    (lambda m: m.update(metadata=[]), "metadata must be a JSON object"),
])
def test_bad_header_contents(tmp_path, valid, edit, match):
    expect_error(tmp_path, _edit(valid, edit).build(), match)


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.update(type="wordpiece"), "type 'wordpiece' is not supported"),
    (lambda t: t.pop("merges"), r"keys are \['type', 'vocab'\]; expected \['merges', 'type', 'vocab'\] and optionally"),
    (lambda t: t.update(extra=1), r"keys are \['extra', 'merges', 'type', 'vocab'\]"),
    (lambda t: t.update(vocab=[]), "vocab must be a non-empty object"),
    (lambda t: t.update(vocab={}), "vocab must be a non-empty object"),
    (lambda t: t["vocab"].update(zz=64), r"'zz': id 64 is not an integer in \[0, 63\]"),
    (lambda t: t["vocab"].update(zz=-1), "id -1 is not an integer"),
    (lambda t: t["vocab"].update(zz=True), "id True is not an integer"),
    (lambda t: t["vocab"].update(zz=1.0), "id 1.0 is not an integer"),
    (lambda t: t["vocab"].update({"": 63}), "invalid token ''"),
    (lambda t: t["vocab"].update(zz=0), "id 0 is used by both 'a' and 'zz'"),
    (lambda t: t.update(merges="a b"), "merges must be a list"),
    (lambda t: t["merges"].append("ab"), "is not a string \"a b\" of two tokens"),
    (lambda t: t["merges"].append("a b c"), "of two tokens"),
    (lambda t: t["merges"].append(" b"), "of two tokens"),
    (lambda t: t["merges"].append(["a", "b"]), "of two tokens"),
    (lambda t: t["merges"].append("a zz"), "token 'zz' is not in the vocab"),
])
def test_bad_tokenizer(tmp_path, valid, edit, match):
    expect_error(tmp_path, _edit(valid, lambda m: edit(m["tokenizer"])).build(), "header: tokenizer.*" + match)


def test_tokenizer_not_object(tmp_path, valid):
    expect_error(tmp_path, _edit(valid, lambda m: m.update(tokenizer=[])).build(),
                 "tokenizer must be null or an object, got list")


# --------------------------------------------------------------------------- truncation
def test_truncated_everywhere(tmp_path, valid):
    raw = parse(valid)
    table_start = 24 + len(raw.header)
    data_offset = -(-_table_end(raw) // 64) * 64
    cuts = {0, 1, 7, 8, 10, 12, 15, 16, 20, 23, 24, 25, table_start - 1, table_start, table_start + 2,
            table_start + 4, table_start + 5, data_offset - 1, data_offset}
    cuts |= set(range(table_start, data_offset, 7))
    for e in raw.entries:
        start = data_offset + e.offset
        cuts |= {start, start + 1, start + e.nbytes // 2, start + e.nbytes - 1}
    cuts |= {len(valid) - 1}
    assert len(cuts) > 100
    path = tmp_path / "cut.tinyloop"
    for cut in sorted(cuts):
        path.write_bytes(valid[:cut])
        with pytest.raises(ModelFormatError, match="truncated"):
            open_model(path)
        with pytest.raises(ModelFormatError, match="truncated"):
            read_header(path)


# --------------------------------------------------------------------------- tensor table
def test_overlapping_tensors(tmp_path, valid):
    raw = parse(valid)
    raw.entries[2].offset = raw.entries[1].offset
    expect_error(tmp_path, raw.build(),
                 r"tensor 'embed.zeros' at offset \d+ overlaps the previous tensor 'embed.scales'")


def test_tensor_out_of_bounds(tmp_path, valid):
    raw = parse(valid)
    raw.entries[-1].offset += 64 * 1000
    raw.blobs[-1] = b""
    expect_error(tmp_path, raw.build(), "tensor 'head.zeros' .* extends past the end of the file")
    raw.entries[-1].offset = 2 ** 63
    expect_error(tmp_path, raw.build(), "extends past the end of the file")


@pytest.mark.parametrize("tail", [b"\0", b"x" * 64])
def test_trailing_bytes(tmp_path, valid, tail):
    raw = parse(valid)
    raw.tail = tail
    expect_error(tmp_path, raw.build(), f"{len(tail)} trailing bytes after the last tensor 'head.zeros'")


def test_gap_between_tensors(tmp_path, valid):
    raw = parse(valid)
    for e in raw.entries[3:]:
        e.offset += 64
    expect_error(tmp_path, raw.build(), r"tensor 'pre.0.attn_norm' at offset \d+ leaves a gap")


def test_misaligned_offset(tmp_path, valid):
    raw = parse(valid)
    for e in raw.entries[3:]:
        e.offset += 8
    expect_error(tmp_path, raw.build(), r"tensor 'pre.0.attn_norm': offset \d+ is not a multiple of 64")


def test_nbytes_mismatch(tmp_path, valid):
    raw = parse(valid)
    raw.entries[0].nbytes += 1
    expect_error(tmp_path, raw.build(), r"tensor 'embed.q': nbytes=2049 but shape \(64, 32\) of u8 needs 2048")


def test_shape_mismatch(tmp_path, valid):
    raw = parse(valid)
    i = raw.index("final_norm")
    raw.entries[i].dims = [8]
    raw.blobs[i] = raw.blobs[i][:16]
    expect_error(tmp_path, raw.relayout().build(), r"'final_norm' has shape \(8,\), but the config needs \(32,\)")
    raw = parse(valid)
    raw.entries[i].dims = [4, 8]
    expect_error(tmp_path, raw.relayout().build(), r"'final_norm' has shape \(4, 8\)")


@pytest.mark.parametrize("name, code, size, match", [
    ("final_norm", 0, 128, "'final_norm' is f32, but its quantization needs f16"),
    ("pre.0.attn_norm", 1, 64, "'pre.0.attn_norm' is f16, but its quantization needs f32"),
    ("embed.scales", 2, 64, "'embed.scales' is u8, but its quantization needs f16"),
    ("embed.zeros", 3, 256, "'embed.zeros' is i32, but its quantization needs u8"),
])
def test_wrong_dtype_for_tensor(tmp_path, valid, name, code, size, match):
    raw = parse(valid)
    i = raw.index(name)
    raw.entries[i].code = code
    raw.blobs[i] = bytes(size)
    expect_error(tmp_path, raw.relayout().build(), match)


@pytest.mark.parametrize("code", [4, 255])
def test_bad_dtype_code(tmp_path, valid, code):
    raw = parse(valid)
    raw.entries[0].code = code
    expect_error(tmp_path, raw.build(), f"'embed.q': dtype code {code} is not one of")


@pytest.mark.parametrize("dims, match", [
    ([], "ndim=0 is outside"),
    ([1, 1, 1, 1, 1], "ndim=5 is outside"),
    ([64, 0], r"shape \(64, 0\) has a zero dimension"),
    ([2 ** 40, 2 ** 40], "needs more bytes than the whole file"),
    ([2 ** 64 - 1, 2 ** 64 - 1, 2 ** 64 - 1, 2 ** 64 - 1], "needs more bytes than the whole file"),
    ([2 ** 16, 2 ** 16], "needs more bytes than the whole file"),
])
def test_bad_dims(tmp_path, valid, dims, match):
    raw = parse(valid)
    raw.entries[0].dims = dims
    expect_error(tmp_path, raw.build(), match)


def test_missing_tensor(tmp_path, valid):
    raw = parse(valid)
    i = raw.index("loop.0.wv.scales")
    del raw.entries[i], raw.blobs[i]
    expect_error(tmp_path, raw.relayout().build(), r"missing tensor\(s\) 'loop.0.wv.scales'")
    raw = parse(valid)
    raw.entries, raw.blobs = raw.entries[:-3], raw.blobs[:-3]
    expect_error(tmp_path, raw.build(), r"missing tensor\(s\) 'head.q', 'head.scales', 'head.zeros'")


def test_unknown_tensor(tmp_path, valid):
    raw = parse(valid)
    raw.entries.append(Entry(b"bogus", 0, [4], 0, 16))
    raw.blobs.append(bytes(16))
    expect_error(tmp_path, raw.relayout().build(), "unknown tensor 'bogus'")
    raw = parse(valid)
    raw.entries[raw.index("final_norm")].name = "final_nörm".encode()
    expect_error(tmp_path, raw.build(), "unknown tensor 'final_nörm'")


def test_duplicate_tensor(tmp_path, valid):
    raw = parse(valid)
    raw.entries.insert(1, copy.copy(raw.entries[0]))
    raw.blobs.insert(1, raw.blobs[0])
    expect_error(tmp_path, raw.relayout().build(), "tensor 'embed.q' appears twice")


def test_tensors_out_of_order(tmp_path, valid):
    raw = parse(valid)
    raw.entries[0], raw.entries[1] = raw.entries[1], raw.entries[0]
    raw.blobs[0], raw.blobs[1] = raw.blobs[1], raw.blobs[0]
    expect_error(tmp_path, raw.relayout().build(),
                 "tensor 'embed.q' is out of order: it must come before 'embed.scales'")


@pytest.mark.parametrize("name, match", [
    (b"", r"entry #0: name length 0 is outside \[1, 1024\]"),
    (b"x" * 1025, "name length 1025 is outside"),
    (b"embed\xff", r"entry #0: name b'embed\\xff' is not valid UTF-8"),
])
def test_bad_tensor_name(tmp_path, valid, name, match):
    raw = parse(valid)
    raw.entries[0].name = name
    expect_error(tmp_path, raw.build(), match)


@pytest.mark.parametrize("n, match", [
    (2 ** 32 - 1, "tensor count 4294967295 exceeds the limit of 1048576"),
    (2 ** 20 + 1, "tensor count 1048577 exceeds the limit"),
    (5000, r"truncated or the tensor count is wrong: 5000 entries need at least 145000 bytes"),
])
def test_impossible_tensor_count(tmp_path, valid, n, match):
    raw = parse(valid)
    raw.n_tensors = n
    expect_error(tmp_path, raw.build(), match)


def _table_end(raw: Raw) -> int:
    return 24 + len(raw.header) + 4 + sum(2 + len(e.name) + 2 + 8 * len(e.dims) + 16 for e in raw.entries)


def test_nonzero_padding_before_data(tmp_path, valid):
    table_end = _table_end(parse(valid))
    assert table_end % 64, "the fixture must have padding after the table"
    data = bytearray(valid)
    data[table_end] = 1
    expect_error(tmp_path, bytes(data), "padding between the tensor table and the data start")


def test_nonzero_padding_between_tensors(tmp_path, valid):
    raw = parse(valid)
    i = next(i for i, e in enumerate(raw.entries) if e.nbytes % 64)
    raw.gaps = [b""] * i + [b"\x01"]
    expect_error(tmp_path, raw.build(), f"padding between tensors '{raw.entries[i].name.decode()}' and "
                 f"'{raw.entries[i + 1].name.decode()}' is not zero", header_too=False)


# --------------------------------------------------------------------------- tensor data
@pytest.mark.parametrize("value, match", [
    (np.nan, r"'pre.0.wq.scales': value nan at index \(0, 1\) is not finite"),
    (np.inf, r"value inf at index \(0, 1\) is not finite"),
    (-np.inf, "value -inf"),
    (0.0, r"'pre.0.wq.scales': value 0.0 at index \(0, 1\) is not a positive scale"),
    (-0.0, "value -0.0 .* is not a positive scale"),
    (-1.5, "value -1.5 .* is not a positive scale"),
])
def test_bad_scales(tmp_path, valid, value, match):
    raw = parse(valid)
    scales = blob_array(raw, "pre.0.wq.scales", np.float16)
    scales[1] = value
    expect_error(tmp_path, set_blob(raw, "pre.0.wq.scales", scales).build(), match, header_too=False)


@pytest.mark.parametrize("name, value, match", [
    ("pre.0.wq.zeros", 16, r"value 16 at index \(0, 0\) is not a valid zero point \(must be < 16\)"),
    ("pre.0.wk.zeros", 4, r"must be < 4"),
    ("pre.0.wk.zeros", 255, r"must be < 4"),
])
def test_zero_points_out_of_range(tmp_path, valid, name, value, match):
    raw = parse(valid)
    zeros = blob_array(raw, name, np.uint8)
    zeros[0] = value
    expect_error(tmp_path, set_blob(raw, name, zeros).build(), match, header_too=False)


@pytest.mark.parametrize("name, dtype", [("pre.0.attn_norm", np.float32), ("final_norm", np.float16),
                                         ("pre.0.wo", np.float32), ("pre.0.w_up", np.float16)])
def test_non_finite_float_tensor(tmp_path, valid, name, dtype):
    raw = parse(valid)
    a = blob_array(raw, name, dtype)
    a[-1] = np.nan
    expect_error(tmp_path, set_blob(raw, name, a).build(), f"'{name}': value nan at index .* is not finite",
                 header_too=False)


# --------------------------------------------------------------------------- fuzzing
@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def _open_and_check(path):
    """Only ModelFormatError, or a model whose every logical tensor is finite and that loads and
    generates, is acceptable."""
    try:
        m = open_model(path)
    except ModelFormatError:
        return False
    with m:
        for name in required_tensors(m.header.config):
            assert np.isfinite(m.logical(name)).all()
    import tinyloop as tl
    model = tl.load_model(str(path), max_seq_len=8, backend="cpu")
    try:
        out = tl.generate(model, [0], tl.GenerateConfig(max_tokens=2, loops=1))
        assert len(out) in (2, 3) and all(0 <= t < model.vocab_size for t in out)
    finally:
        tl.free_model(model)
    return True


@st.composite
def mutations(draw, size, head):
    position = st.one_of(st.integers(0, head), st.integers(0, size - 1))
    ops = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "set", "truncate", "insert", "delete"]))
        ops.append((kind, draw(position), draw(st.integers(1, 255)), draw(st.binary(min_size=1, max_size=16))))
    return ops


def _mutate(data: bytes, ops) -> bytes:
    buf = bytearray(data)
    for kind, pos, byte, blob in ops:
        pos = min(pos, max(len(buf) - 1, 0))
        if kind == "flip" and buf:
            buf[pos] ^= byte
        elif kind == "set" and buf:
            buf[pos] = byte
        elif kind == "truncate":
            del buf[pos:]
        elif kind == "insert":
            buf[pos:pos] = blob
        elif kind == "delete":
            del buf[pos:pos + len(blob)]
    return bytes(buf)


def test_byte_mutations(valid, fuzz_dir):
    head = 24 + len(parse(valid).header) + 4096
    path = fuzz_dir / "mutated.tinyloop"
    outcomes = []

    @settings(max_examples=200, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(mutations(len(valid), head))
    def run(ops):
        path.write_bytes(_mutate(valid, ops))
        outcomes.append(_open_and_check(path))

    run()
    assert not all(outcomes)  # sanity: mutations do break files


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=6)


def test_header_value_mutations(valid, fuzz_dir):
    raw = parse(valid)
    meta = raw.meta
    slots = ([("config", k) for k in meta["config"]] + [("quant", k) for k in list(meta["quant"])[:6]]
             + [("tokenizer", k) for k in meta["tokenizer"]] + [(k, None) for k in meta])
    path = fuzz_dir / "header.tinyloop"

    @settings(max_examples=200, deadline=None, database=None)
    @given(st.sampled_from(slots), json_values)
    def run(slot, value):
        m = copy.deepcopy(meta)
        if slot[1] is None:
            m[slot[0]] = value
        else:
            m[slot[0]][slot[1]] = value
        raw.meta = m
        path.write_bytes(raw.build())
        _open_and_check(path)

    run()


def test_reading_leaves_nothing_open_after_errors(tmp_path, valid):
    """Explicit version of the no_leaks fixture: many failing opens, then the same checks."""
    before = _fds()
    path = write(tmp_path, valid[:-1])
    for _ in range(50):
        with pytest.raises(ModelFormatError):
            open_model(path)
    raw = parse(valid)
    scales = blob_array(raw, "embed.scales", np.float16)
    scales[0] = np.nan
    path = write(tmp_path, set_blob(raw, "embed.scales", scales).build())
    for _ in range(50):
        with pytest.raises(ModelFormatError):
            open_model(path)
    assert _fds() == before and _mapped(tmp_path) == []
    os.remove(path)


def test_model_file_repr(tmp_path, valid):
    m = open_model(write(tmp_path, valid))
    assert "tensors" in repr(m) and isinstance(m, ModelFile)
    m.close()
    assert "closed" in repr(m)


def test_failed_replace_leaves_nothing(tmp_path, monkeypatch):
    """A crash while writing (simulated) leaves neither a partial target nor a temporary file."""
    calls = []
    real = os.replace

    def boom(src, dst):
        calls.append(src)
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        write_model(tmp_path / "m.tinyloop", CFG, make_weights(CFG))
    monkeypatch.setattr(os, "replace", real)
    assert calls and os.listdir(tmp_path) == []
    assert os.path.dirname(calls[0]) == str(tmp_path) and calls[0].endswith(".tinyloop.tmp")


@pytest.mark.parametrize("value, match", [
    ([5], "other than eos_id"), ([6, 6], "distinct"), ("7", "list of token ids"), (None, "list of token ids"),
    ([True], "must be an integer"), ([2.0], "must be an integer"), ([97], "outside the allowed range"),
    ([-1], "outside the allowed range"), (list(range(6, 71)), "at most 64")])
def test_extra_eos_ids_are_checked(value, match):
    """ModelConfig.extra_eos_ids: distinct token ids other than eos_id, of the vocabulary, at most
    MAX_EOS_IDS; a ConfigError naming the value otherwise (and without an eos_id)."""
    from conftest import TINY
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**{**TINY, "eos_id": 5, "extra_eos_ids": value})
    with pytest.raises(ConfigError, match="needs eos_id"):
        ModelConfig(**{**TINY, "extra_eos_ids": [6]})


def test_extra_eos_ids_round_trip(tmp_path):
    """The ids survive the file (a JSON list in the header); files written before the field read
    as having none (the shipped demo model)."""
    from conftest import write_tiny
    from tinyloop.models import demo_model_path
    path = tmp_path / "eos.tinyloop"
    write_tiny(path, eos_id=5, extra_eos_ids=(9, 7))
    with open_model(str(path)) as mf:
        cfg = mf.header.config
    assert cfg.extra_eos_ids == (9, 7) and cfg.eos_ids == (5, 9, 7)
    with open_model(demo_model_path()) as mf:
        assert mf.header.config.extra_eos_ids == () and mf.header.config.eos_ids == (mf.header.config.eos_id,)


@pytest.mark.parametrize("fields, match", [
    (dict(rope_scaling="yarn"), "not one of"), (dict(rope_scaling="linear", rope_factor=0), "rope_factor=0"),
    (dict(rope_factor=2.0), "does not apply to rope_scaling='none'"),
    (dict(rope_scaling="linear", rope_factor=2.0, rope_original_max_positions=8), "does not apply"),
    (dict(rope_scaling="llama3", rope_factor=8.0), "needs rope_original_max_positions >= 1"),
    (dict(rope_scaling="llama3", rope_factor=8.0, rope_original_max_positions=8, rope_low_freq_factor=4.0,
          rope_high_freq_factor=2.0), "must be below"),
    (dict(rope_scaling="llama3", rope_factor=True, rope_original_max_positions=8), "rope_factor=True"),
    (dict(rope_scaling="llama3", rope_factor=8.0, rope_original_max_positions=-1), "outside the allowed range")])
def test_rope_scaling_is_checked(fields, match):
    """ModelConfig's RoPE scaling fields: a known kind, finite positive factors, the llama3
    parameters only with llama3 (and required there); a ConfigError naming the value."""
    from conftest import TINY
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**{**TINY, **fields})


def test_rope_inv_freq_definition():
    """rope_inv_freq: theta^(-2i/D) unscaled (the formula every backend used before scaling
    existed, to the bit), divided by the factor for linear, and Llama 3.1's three bands."""
    from conftest import TINY
    from tinyloop.model.arch import rope_inv_freq
    plain = ModelConfig(**TINY)
    D = plain.head_dim
    f = plain.rope_theta ** (-np.arange(0, D // 2, dtype=np.float64) * 2.0 / D)
    assert np.array_equal(rope_inv_freq(plain), f)
    assert np.array_equal(rope_inv_freq(ModelConfig(**TINY, rope_scaling="linear", rope_factor=4.0)), f / 4.0)
    c = ModelConfig(**TINY, rope_scaling="llama3", rope_factor=8.0, rope_original_max_positions=64,
                    rope_low_freq_factor=1.0, rope_high_freq_factor=4.0)
    got, wavelength = rope_inv_freq(c), 2 * np.pi / f
    for i in range(D // 2):
        if wavelength[i] < 64 / 4.0:
            assert got[i] == f[i]
        elif wavelength[i] > 64 / 1.0:
            assert got[i] == f[i] / 8.0
        else:
            s = (64 / wavelength[i] - 1.0) / 3.0
            assert got[i] == pytest.approx((1 - s) * f[i] / 8.0 + s * f[i], rel=1e-15)
    assert {(wavelength < 16).any(), (wavelength > 64).any(), ((wavelength >= 16) & (wavelength <= 64)).any()} == {True}


def test_embedded_chat_template_is_checked(tmp_path):
    """An 'hf' tokenizer entry may carry a chat template (non-empty text); anything else there is a
    ConfigError before the file is written."""
    from conftest import TINY, random_weights
    from tinyloop.model.format import _check_tokenizer
    tj = '{"model": {"type": "BPE"}}'
    assert _check_tokenizer({"type": "hf", "json": tj, "chat_template": "{{ messages }}"}, 97)["chat_template"]
    for bad in ({"type": "hf", "json": tj, "chat_template": 3}, {"type": "hf", "json": tj, "chat_template": ""},
                {"type": "hf", "json": tj, "template": "x"}):
        with pytest.raises(ConfigError):
            _check_tokenizer(bad, 97)
    cfg = ModelConfig(**TINY)
    with pytest.raises(ConfigError):
        write_model(str(tmp_path / "m.tinyloop"), cfg, random_weights(cfg), tokenizer={"type": "hf", "json": tj,
                                                                                        "chat_template": ["x"]})
    assert not (tmp_path / "m.tinyloop").exists()
