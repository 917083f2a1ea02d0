"""Fuzzing the file readers: .tinyloop model files (docs/FORMAT.md) through every entry point
(read_header, open_model, tl.inspect, tl.load_model and its embedded tokenizer, the CLI), Hugging
Face checkpoint directories for ``convert --hf`` (config.json, safetensors shards and their index,
tokenizer.json, tokenizer_config.json), run-config YAML and a compat matrix given through
TINYLOOP_COMPAT.

Valid files are mutated (byte flips, values of the wrong type or size, truncation at structural
boundaries, deep nesting, non-UTF-8 bytes, directories / FIFOs / symlinks where a file is expected,
a file changed under a reader). Every outcome must be success (with the unmutated result where the
change is neutral) or a TinyLoopError naming the problem: never a raw ValueError / TypeError /
RecursionError / MemoryError, a hang, a multi-GB allocation, or a file left open or mapped (the
no_leaks fixture of tests/test_format.py runs around every test here). The HF checkpoints are built
with numpy, safetensors and tokenizers alone (no torch), so the file runs in seconds."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import resource
import shutil
import struct
import tempfile
import threading
import time

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

safetensors_numpy = pytest.importorskip("safetensors.numpy")
pytest.importorskip("tokenizers")

import tinyloop as tl  # noqa: E402
from tinyloop.cli.convert import CheckpointWeights, convert_hf  # noqa: E402
from tinyloop.errors import ConfigError, ModelFormatError, TinyLoopError, TokenizerError  # noqa: E402
from tinyloop.model.format import open_model, read_header  # noqa: E402
from tinyloop.model.tokenizer import HFTokenizer, byte_to_unicode, load_tokenizer_dir  # noqa: E402
from tinyloop.runtime import compat  # noqa: E402
from tinyloop.runtime.config import GenerateConfig, load_run_config  # noqa: E402

from conftest import logical_weights  # noqa: E402
from test_format import (collect_earlier_garbage, json_values, no_leaks, parse,  # noqa: E402,F401 (fixtures)
                         valid)
from test_model_file_cli_edges import _build, _run_cli, _split, demo_parts  # noqa: E402,F401 (fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FUZZ = dict(deadline=None, database=None, derandomize=True,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# =============================================================================== guards
@contextlib.contextmanager
def bounded_memory(headroom: int = 2 << 30):
    """Inside, the process may map at most `headroom` bytes more than it does now (RLIMIT_AS): a
    reader that sizes an allocation by a number in the file fails with MemoryError (and the test
    with it) instead of taking gigabytes from the machine."""
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = vm + headroom if hard == resource.RLIM_INFINITY else min(vm + headroom, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@contextlib.contextmanager
def fifo_watchdog(fifo: str, seconds: float = 5.0):
    """A FIFO where a file is expected must be refused, not opened (an open for reading blocks
    until a writer comes). After `seconds`, this opens `fifo` for writing (and closes it) until the
    block ends, so a reader stuck in open() returns instead of hanging the test; the yielded list
    is non-empty when it had to."""
    fired, stop = [], threading.Event()

    def unblock():
        if stop.wait(seconds):
            return
        while not stop.is_set():
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:          # no reader waiting (yet)
                stop.wait(0.2)
                continue
            fired.append(True)
            os.close(fd)
            stop.wait(0.2)

    t = threading.Thread(target=unblock, daemon=True)
    t.start()
    try:
        yield fired
    finally:
        stop.set()
        t.join()


def edited(base, edits):
    """A deep copy of the JSON-like `base` with each (path, value) of `edits` set where its path
    exists (a path through a missing key or a non-container is skipped)."""
    out = copy.deepcopy(base)
    for slot, value in edits:
        o = out
        try:
            for k in slot[:-1]:
                o = o[k]
            o[slot[-1]] = value
        except (KeyError, IndexError, TypeError):
            pass
    return out


def typed(fn, *args, **kwargs):
    """fn(...) -> (result, None), or (None, the TinyLoopError it raised). Any other exception
    propagates: it is what these tests look for."""
    try:
        return fn(*args, **kwargs), None
    except TinyLoopError as e:
        return None, e


def cli(capsys, *argv):
    """The CLI in-process: (exit code, stderr). An exception escaping main() fails the test."""
    rc, _, err = _run_cli(capsys, *argv)
    assert "Traceback" not in err, err
    return rc, err


# =============================================================================== .tinyloop files
def _entry_fields(data: bytes):
    """[(entry index, field, byte position, struct format)] of every table field of a valid file
    (an independent walk of docs/FORMAT.md's layout), plus the prefix's header_len and the count."""
    (hlen,) = struct.unpack_from("<Q", data, 16)
    out = [(-1, "header_len", 16, "<Q"), (-1, "n_tensors", 24 + hlen, "<I")]
    pos = 24 + hlen + 4
    for i in range(struct.unpack_from("<I", data, 24 + hlen)[0]):
        (name_len,) = struct.unpack_from("<H", data, pos)
        out.append((i, "name_len", pos, "<H"))
        pos += 2 + name_len
        ndim = data[pos + 1]
        out += [(i, "dtype", pos, "<B"), (i, "ndim", pos + 1, "<B")]
        out += [(i, f"dim{k}", pos + 2 + 8 * k, "<Q") for k in range(ndim)]
        pos += 2 + 8 * ndim
        out += [(i, "offset", pos, "<Q"), (i, "nbytes", pos + 8, "<Q")]
        pos += 16
    return out


def _boundaries(data: bytes):
    """Every offset where a structure of the file starts or ends: the prefix fields, the header,
    every table field, the data start and every tensor's start and end."""
    raw = parse(data)
    cuts = {0, 8, 12, 16, 24, 24 + len(raw.header)}
    cuts |= {pos for _, _, pos, _ in _entry_fields(data)}
    table_end = max(pos + struct.calcsize(fmt) for _, _, pos, fmt in _entry_fields(data))
    start = -(-table_end // 64) * 64
    cuts |= {table_end, start}
    for e in raw.entries:
        cuts |= {start + e.offset, start + e.offset + e.nbytes}
    cuts |= {c + d for c in list(cuts) for d in (-1, 1)}
    return sorted(c for c in cuts if 0 <= c < len(data))


def _same_tensors(path, reference: bytes) -> None:
    """The model at `path` holds exactly the physical tensors of the file `reference`."""
    want = parse(reference)
    with open_model(path) as m:
        assert [e.name for e in m.header.tensors] == [e.name.decode() for e in want.entries]
        for e, blob in zip(m.header.tensors, want.blobs):
            assert m.tensors[e.name].tobytes() == blob


def test_truncation_at_every_structural_boundary_through_every_entry_point(tmp_path, valid, capsys):
    """A file cut at any structural boundary (or one byte either side) is a ModelFormatError
    naming the file from read_header, open_model, tl.inspect and tl.load_model, and an ``error:``
    line with exit code 2 from ``tinyloop inspect``."""
    path = tmp_path / "cut.tinyloop"
    cuts = _boundaries(valid)
    assert len(cuts) > 100
    for i, n in enumerate(cuts):
        path.write_bytes(valid[:n])
        for fn in (read_header, open_model, tl.inspect):
            _, err = typed(fn, path)
            assert isinstance(err, ModelFormatError) and str(path) in str(err), (n, fn, err)
        if i % 5 == 0:      # the heavier entry points on a sample of the cuts
            _, err = typed(tl.load_model, path, backend="cpu", max_seq_len=16)
            assert isinstance(err, ModelFormatError) and str(path) in str(err), (n, err)
            rc, err = cli(capsys, "inspect", str(path))
            assert rc == 2 and err.startswith("error:") and str(path) in err, (n, err)


HUGE = [0, 1, 63, 64, 65, 255, 1023, 1024, 1025, 2 ** 16 - 1, 2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 63 - 1, 2 ** 63,
        2 ** 64 - 1]


def test_table_fields_with_huge_or_odd_values(tmp_path, valid, capsys):
    """Any value in any table or prefix field (header_len, the tensor count, a name length, dtype
    code, ndim, a dimension, an offset, nbytes): a typed error quickly and within bounded memory,
    or, where the value is the one already there, the same tensors."""
    fields = _entry_fields(valid)
    path = tmp_path / "table.tinyloop"

    @settings(max_examples=80, **FUZZ)
    @given(st.sampled_from(fields), st.sampled_from(HUGE) | st.integers(0, 2 ** 64 - 1))
    def run(field, value):
        _, name, pos, fmt = field
        value %= 1 << (8 * struct.calcsize(fmt))
        data = bytearray(valid)
        struct.pack_into(fmt, data, pos, value)
        path.write_bytes(bytes(data))
        t0 = time.monotonic()
        with bounded_memory():
            for fn in (read_header, tl.inspect, open_model):
                got, err = typed(fn, path)
                if err is None:
                    assert bytes(data) == valid, (name, value)
                    if fn is open_model:
                        got.close()
                else:
                    assert isinstance(err, ModelFormatError) and str(path) in str(err), (name, value, err)
        assert time.monotonic() - t0 < 10, (name, value)

    run()
    rc, err = cli(capsys, "inspect", str(path))
    assert rc in (0, 2)


def test_header_json_mutations_through_inspect_and_load(tmp_path, valid):
    """A header value of any JSON type or size in any slot, read by tl.inspect and tl.load_model
    (with its tokenizer resolved): a TinyLoopError, or a model whose tensors are the file's."""
    header, table, data = _split(valid)
    slots = ([("config", k) for k in header["config"]] + [("quant", k) for k in list(header["quant"])[:4]]
             + [("tokenizer", k) for k in header["tokenizer"]] + [(k, None) for k in header])
    path = tmp_path / "header.tinyloop"

    @settings(max_examples=60, **FUZZ)
    @given(st.sampled_from(slots), json_values | st.sampled_from([2 ** 64, -1, 10 ** 300, "hf", "bpe", "q4"]))
    def run(slot, value):
        h = copy.deepcopy(header)
        if slot[1] is None:
            h[slot[0]] = value
        else:
            h[slot[0]][slot[1]] = value
        path.write_bytes(_build(json.dumps(h).encode(), table, data))
        with bounded_memory():
            _, err = typed(tl.inspect, path)
            assert err is None or str(path) in str(err), err
            model, err = typed(tl.load_model, path, backend="cpu", max_seq_len=16)
            if model is None:
                assert str(path) in str(err), err
                return
            try:
                typed(lambda: model.tokenizer)
            finally:
                tl.free_model(model)
        _same_tensors(path, valid)

    run()


# ----------------------------------------------------------------- embedded tokenizer.json
def _tokenizer_json(n: int = 64) -> dict:
    """A byte-level BPE tokenizer.json (the first `n` characters of GPT-2's byte alphabet, no merges),
    as the tokenizers library writes it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {c: i for i, c in enumerate(list(byte_to_unicode().values())[:n])}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    return json.loads(t.to_str())


def _huge_digit_id(j: dict) -> str:
    """`j` with an added token whose id has 5000 digits (Python's json refuses more than 4300)."""
    text = json.dumps({**j, "added_tokens": [{"id": 0, "content": "<x>", "single_word": False, "lstrip": False,
                                              "rstrip": False, "normalized": False, "special": True}]})
    return text.replace('"id": 0', '"id": ' + "7" * 5000, 1)


def _sparse_id(j: dict) -> str:
    """`j` with one vocab id at 2**32 - 1 (the largest the tokenizers library takes): a table
    indexed by id would take 32 GiB."""
    j = copy.deepcopy(j)
    j["model"]["vocab"][list(j["model"]["vocab"])[-1]] = 2 ** 32 - 1
    return json.dumps(j)


@pytest.mark.parametrize("case", ["huge_digit_id", "sparse_id"])
def test_embedded_tokenizer_json_with_impossible_ids(tmp_path, demo_parts, capsys, case):
    """An embedded tokenizer.json with an id of 5000 digits (json.loads' ValueError) or one id at
    2**32 - 1 (a 32 GiB table): inspect reports it, loading works, resolving the tokenizer is a
    TokenizerError, within bounded memory; ``tinyloop run`` says ``error:``."""
    text = {"huge_digit_id": _huge_digit_id, "sparse_id": _sparse_id}[case](_tokenizer_json())
    header, table, data = demo_parts
    path = tmp_path / "tok.tinyloop"
    path.write_bytes(_build(json.dumps(dict(header, tokenizer={"type": "hf", "json": text})).encode(), table, data))
    assert tl.inspect(str(path))["tokenizer"]["embedded"]
    with bounded_memory():
        _, err = typed(HFTokenizer, text)
        assert isinstance(err, TokenizerError), err
        model = tl.load_model(str(path), backend="cpu", max_seq_len=16)
        try:
            _, err = typed(lambda: model.tokenizer)
            assert isinstance(err, TokenizerError), err
        finally:
            tl.free_model(model)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"model": str(path), "prompts": ["x"], "backend": "cpu", "max_seq_len": 16}))
    with bounded_memory():
        rc, err = cli(capsys, "run", str(cfg))
    assert rc == 2 and err.startswith("error:") and "tokenizer" in err, err


def test_tokenizer_json_mutations(tmp_path):
    """A tokenizer.json changed anywhere (the library's own layout, a SentencePiece-style decoder
    too) builds a tokenizer or raises TokenizerError, within bounded memory."""
    byte_level = _tokenizer_json()
    sp = copy.deepcopy(byte_level)
    sp["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
        {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    sp["added_tokens"] = [{"id": 3, "content": "<s>", "single_word": False, "lstrip": False, "rstrip": False,
                           "normalized": False, "special": True}]
    slots = [("model", "vocab", "!"), ("model", "vocab"), ("model", "type"), ("model", "byte_fallback"),
             ("model", "merges"), ("decoder",), ("decoder", "type"), ("decoder", "decoders", 0),
             ("decoder", "decoders", 3, "start"), ("pre_tokenizer",), ("added_tokens",), ("added_tokens", 0, "id"),
             ("added_tokens", 0, "special"), ("normalizer",), ("model",)]
    odd = st.sampled_from([2 ** 32 - 1, 2 ** 32, 2 ** 31, -1, 10 ** 30, "ByteLevel", "Metaspace", "Sequence",
                           "WordPiece", {"type": "Metaspace", "replacement": ""},
                           {"type": "Sequence", "decoders": [{"type": []}]},
                           {"type": "Strip", "content": " ", "start": -1, "stop": 0}])

    @settings(max_examples=80, **FUZZ)
    @given(st.sampled_from([byte_level, sp]), st.lists(st.tuples(st.sampled_from(slots), json_values | odd),
                                                       min_size=1, max_size=3))
    def run(base, edits):
        j = edited(base, edits)
        with bounded_memory():
            typed(HFTokenizer, json.dumps(j))

    run()


# ----------------------------------------------------------------- paths that are not files
def _path_kinds(tmp_path, valid):
    good = tmp_path / "good.tinyloop"
    good.write_bytes(valid)
    kinds = {}
    (tmp_path / "empty.tinyloop").write_bytes(b"")
    kinds["empty"] = tmp_path / "empty.tinyloop"
    (tmp_path / "dir.tinyloop").mkdir()
    kinds["directory"] = tmp_path / "dir.tinyloop"
    os.mkfifo(tmp_path / "fifo.tinyloop")
    kinds["fifo"] = tmp_path / "fifo.tinyloop"
    for name, target in (("to_dir", "dir.tinyloop"), ("to_fifo", "fifo.tinyloop"), ("dangling", "absent"),
                         ("loop", "loop.tinyloop")):
        os.symlink(target, tmp_path / f"{name}.tinyloop")
        kinds[f"symlink_{name}"] = tmp_path / f"{name}.tinyloop"
    kinds["dev_null"] = "/dev/null"
    return good, kinds


def test_model_paths_that_are_not_files(tmp_path, valid, capsys):
    """An empty file, a directory, a FIFO, /dev/null, or a symlink to one of them, dangling or in a
    loop: a ModelFormatError naming it from every entry point, without blocking; a symlink to a
    valid file reads as the file."""
    good, kinds = _path_kinds(tmp_path, valid)
    link = tmp_path / "link.tinyloop"
    os.symlink(good.name, link)
    _same_tensors(link, valid)
    for kind, path in kinds.items():
        with fifo_watchdog(str(tmp_path / "fifo.tinyloop")) as fired:
            for fn in (read_header, open_model, tl.inspect):
                _, err = typed(fn, path)
                assert isinstance(err, ModelFormatError) and str(path) in str(err), (kind, fn, err)
            _, err = typed(tl.load_model, path, backend="cpu", max_seq_len=16)
            assert isinstance(err, ModelFormatError), (kind, err)
            rc, err = cli(capsys, "inspect", str(path))
            assert rc == 2 and err.startswith("error:"), (kind, err)
        assert not fired, f"{kind}: a reader blocked opening the FIFO"


def test_file_changed_between_inspect_and_load(tmp_path, valid):
    """inspect reads the header only; a file rewritten before the load is read afresh (the new
    model), and one truncated before it is a ModelFormatError."""
    from conftest import write_tiny
    path = tmp_path / "m.tinyloop"
    path.write_bytes(valid)
    first = tl.inspect(str(path))
    other = write_tiny(tmp_path / "other.tinyloop", quant="q8", group_size=32)
    os.replace(tmp_path / "other.tinyloop", path)
    model = tl.load_model(str(path), backend="cpu", max_seq_len=16)
    try:
        assert model.cfg == other and model.cfg.to_dict() != first["config"]
    finally:
        tl.free_model(model)
    data = path.read_bytes()
    tl.inspect(str(path))
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(ModelFormatError, match="truncated|past the end"):
        tl.load_model(str(path), backend="cpu", max_seq_len=16)


# =============================================================================== Hugging Face directories
V, D, FF, H, KV, N_LAYERS = 64, 16, 24, 2, 1, 2


def _hf_tensors(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    hd = D // H
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for i in range(N_LAYERS):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                       p + "self_attn.q_proj.weight": (H * hd, D), p + "self_attn.k_proj.weight": (KV * hd, D),
                       p + "self_attn.v_proj.weight": (KV * hd, D), p + "self_attn.o_proj.weight": (D, H * hd),
                       p + "mlp.gate_proj.weight": (FF, D), p + "mlp.up_proj.weight": (FF, D),
                       p + "mlp.down_proj.weight": (D, FF)})
    return {k: (0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}


def _write_safetensors(path, header: dict, blobs: bytes) -> None:
    """A safetensors file from its header (dict) and data (raw)."""
    hb = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb + blobs)


def _read_safetensors(path):
    """(header dict, data bytes) of a safetensors file."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack_from("<Q", raw)
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _save_bf16(path, tensors: dict) -> None:
    """BF16 tensors (float32 truncated to their top 16 bits), written byte by byte (numpy has no bfloat16)."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        b = (tensors[name].view(np.uint32) >> 16).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(tensors[name].shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    _write_safetensors(path, header, b"".join(blobs))


def make_hf_dir(path, layout: str = "single") -> str:
    """A tiny Llama checkpoint directory as transformers saves one: config.json, tokenizer.json and
    model.safetensors ("single"), two shards with model.safetensors.index.json ("sharded"), or one
    BF16 file ("bf16")."""
    os.makedirs(path, exist_ok=True)
    t = _hf_tensors()
    if layout == "single":
        safetensors_numpy.save_file(t, os.path.join(path, "model.safetensors"))
    elif layout == "bf16":
        _save_bf16(os.path.join(path, "model.safetensors"), t)
    else:
        names = sorted(t)
        wm = {}
        for i, part in enumerate((names[::2], names[1::2])):
            shard = f"model-0000{i + 1}-of-00002.safetensors"
            safetensors_numpy.save_file({k: t[k] for k in part}, os.path.join(path, shard))
            wm.update({k: shard for k in part})
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": wm}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=V, hidden_size=D,
                       intermediate_size=FF, num_hidden_layers=N_LAYERS, num_attention_heads=H,
                       num_key_value_heads=KV, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                       hidden_act="silu", eos_token_id=1, bos_token_id=0), f)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump(_tokenizer_json(V), f)
    return str(path)


LAYOUTS = ("single", "sharded", "bf16")


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """{layout: (clean directory, its conversion's ModelConfig, its logical weights)}."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for layout in LAYOUTS:
        src = make_hf_dir(root / layout, layout)
        dst = str(root / f"{layout}.tinyloop")
        convert_hf(src, dst, quant="f32")
        out[layout] = (src, read_header(dst).config, logical_weights(dst))
    return out


class Scratch:
    """Fresh copies of a clean checkpoint directory under the test's tmp_path (so no_leaks sees
    its files), removed when the next one is made."""

    def __init__(self, root):
        self.root, self.last = root, None

    def copy(self, src) -> str:
        if self.last:
            shutil.rmtree(self.last, ignore_errors=True)
        self.last = tempfile.mkdtemp(dir=self.root)
        shutil.copytree(src, self.last, dirs_exist_ok=True)
        return self.last


def check_convert(d: str, hf_entry) -> None:
    """convert_hf of `d`: a TinyLoopError naming the directory, or a file that loads, and holds the
    clean conversion's weights wherever its config is the clean one's."""
    out = os.path.join(d, "out.tinyloop")
    with bounded_memory():
        _, err = typed(convert_hf, d, out, quant="f32")
    if err is not None:
        assert d in str(err), err
        assert not os.path.exists(out)
        return
    _, cfg, weights = hf_entry
    if read_header(out).config == cfg:
        got = logical_weights(out)
        assert got.keys() == weights.keys() and all(np.array_equal(got[k], weights[k]) for k in got)
    os.unlink(out)


def _edit_json(path, edits) -> None:
    with open(path) as f:
        d = json.load(f)
    for key, value in edits:
        if value is _DELETE:
            d.pop(key, None)
        else:
            d[key] = value
    with open(path, "w") as f:
        json.dump(d, f)


_DELETE = object()
CONFIG_KEYS = ["architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
               "hidden_act", "eos_token_id", "bos_token_id", "head_dim", "rope_scaling", "rope_parameters",
               "layer_types", "use_sliding_window", "max_window_layers", "sliding_window", "partial_rotary_factor",
               "pretraining_tp", "attention_bias", "mlp_bias", "num_experts"]
CONFIG_VALUES = st.sampled_from([
    _DELETE, ["LlamaForCausalLM"], ["Qwen2ForCausalLM"], ["MistralForCausalLM"], ["OuroForCausalLM"],
    ["RavenForCausalLM"], "2", 2, 16, 2 ** 64, -1, True, float("nan"), float("inf"), [1], {"rope_type": []},
    {"type": {}}, {"rope_type": "linear", "factor": 2.0}, {"rope_type": "linear", "factor": 10 ** 400},
    {"rope_type": "llama3", "factor": "x", "low_freq_factor": 1, "high_freq_factor": 4,
     "original_max_position_embeddings": 8}, ["full_attention", "sliding_attention"]]) | json_values


def test_hf_config_mutations(tmp_path, hf):
    """config.json with values of any type or size under the keys the importer reads (several at
    once): a TinyLoopError naming the directory, or a conversion equal to the clean one."""
    scratch = Scratch(tmp_path)

    @settings(max_examples=70, **FUZZ)
    @given(st.sampled_from(("single", "sharded")),
           st.lists(st.tuples(st.sampled_from(CONFIG_KEYS), CONFIG_VALUES), min_size=1, max_size=3))
    def run(layout, edits):
        d = scratch.copy(hf[layout][0])
        _edit_json(os.path.join(d, "config.json"), edits)
        check_convert(d, hf[layout])

    run()


# config.json edits that were raw exceptions (each a key of the importer's, with what it reads)
CONFIG_CASES = {
    "rope_type_list": [("rope_scaling", {"rope_type": [], "factor": 2.0})],
    "rope_type_dict": [("rope_parameters", {"rope_type": {"a": 1}, "rope_theta": 1e4})],
    "qwen2_layer_count_text": [("architectures", ["Qwen2ForCausalLM"]), ("use_sliding_window", True),
                               ("num_hidden_layers", "2")],
    "ouro_layer_count_text": [("architectures", ["OuroForCausalLM"]), ("use_sliding_window", True),
                              ("num_hidden_layers", "2")],
    "raven_embed_scale_huge": [("architectures", ["RavenForCausalLM"]), ("n_embd", 16), ("n_heads", 2),
                               ("n_layers_in_prelude", 1), ("n_layers_in_recurrent_block", 1),
                               ("n_layers_in_coda", 0), ("mean_recurrence", 2), ("padded_vocab_size", 64),
                               ("init_values", {"embed_scale": 10 ** 400})],
    "nan_eps": [("rms_norm_eps", float("nan"))],
}
# config.json texts that are not JSON the importer can read
CONFIG_TEXTS = {
    "deeply_nested": '{"a": ' * 100_000 + "1" + "}" * 100_000,
    "huge_digit_number": '{"architectures": ["LlamaForCausalLM"], "vocab_size": ' + "6" * 5000 + "}",
    "not_utf8": b'{"architectures": ["\xff"]}',
    "empty": "",
    "array": "[]",
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES) + sorted(CONFIG_TEXTS))
def test_hf_config_hand_picked(tmp_path, hf, capsys, case):
    """Each is a ModelFormatError naming the directory, from convert_hf and from ``tinyloop
    convert --hf`` (exit code 2, an ``error:`` line)."""
    d = Scratch(tmp_path).copy(hf["single"][0])
    p = os.path.join(d, "config.json")
    if case in CONFIG_CASES:
        _edit_json(p, CONFIG_CASES[case])
    else:
        text = CONFIG_TEXTS[case]
        with open(p, "wb") as f:
            f.write(text if isinstance(text, bytes) else text.encode())
    out = os.path.join(d, "o.tinyloop")
    _, err = typed(convert_hf, d, out, quant="f32")
    assert isinstance(err, ModelFormatError) and d in str(err), err
    rc, err = cli(capsys, "convert", "--hf", d, "-o", out, "--quant", "f32")
    assert rc == 2 and err.startswith("error:"), err
    assert not os.path.exists(out)


@pytest.mark.parametrize("what", ["config.json", "model.safetensors", "extra.safetensors"])
@pytest.mark.parametrize("kind", ["fifo", "symlink_to_fifo", "directory", "empty", "dangling_symlink"])
def test_hf_files_that_are_not_files(tmp_path, hf, what, kind):
    """config.json or a shard that is a FIFO (or a symlink to one), a directory, an empty file or a
    dangling symlink: refused with a ModelFormatError, never blocking on the FIFO."""
    d = Scratch(tmp_path).copy(hf["single"][0])
    p = os.path.join(d, what)
    if os.path.exists(p):
        os.unlink(p)
    fifo = os.path.join(tmp_path, "pipe")
    os.mkfifo(fifo)
    if kind == "fifo":
        os.mkfifo(p)
        fifo = p
    elif kind == "symlink_to_fifo":
        os.symlink(fifo, p)
    elif kind == "directory":
        os.mkdir(p)
    elif kind == "empty":
        open(p, "wb").close()
    else:
        os.symlink(os.path.join(tmp_path, "absent"), p)
    if what == "extra.safetensors":     # beside model.safetensors, which is then read alone
        os.unlink(os.path.join(d, "model.safetensors"))
        safetensors_numpy.save_file(_hf_tensors(), os.path.join(d, "a.safetensors"))
    with fifo_watchdog(fifo) as fired:
        _, err = typed(convert_hf, d, os.path.join(d, "o.tinyloop"), quant="f32")
    assert not fired, "a reader blocked opening a FIFO"
    assert isinstance(err, ModelFormatError) and p in str(err), err


ENTRY_FIELDS = ("dtype", "shape", "data_offsets", "entry")
ENTRY_VALUES = st.sampled_from([
    "F32", "BF16", "F16", "F64", "I8", "F4", "", [], {}, None, [16], [16.0], [16.5], ["16"], [True], [-16], [-4, -4],
    [2 ** 64], [0, 64], [64, 0], [0, 2 ** 64], [-64, 0], [10 ** 30, 10 ** 30 + 64], "ab", [0, 64, 128]]) | json_values


def test_safetensors_header_mutations(tmp_path, hf):
    """A tensor entry of a shard's header (dtype, shape, data_offsets or the whole entry) of any
    value, F32 and BF16 shards, single or sharded: a TinyLoopError naming the directory, or the
    clean conversion."""
    scratch = Scratch(tmp_path)

    @settings(max_examples=70, **FUZZ)
    @given(st.sampled_from(LAYOUTS), st.integers(0, 10 ** 6), st.sampled_from(ENTRY_FIELDS), ENTRY_VALUES)
    def run(layout, which, field, value):
        d = scratch.copy(hf[layout][0])
        shard = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))[which % (1 + (layout == "sharded"))]
        header, blob = _read_safetensors(os.path.join(d, shard))
        names = sorted(k for k in header if k != "__metadata__")
        name = names[which % len(names)]
        if field == "entry":
            header[name] = value
        else:
            header[name][field] = value
        _write_safetensors(os.path.join(d, shard), header, blob)
        check_convert(d, hf[layout])

    run()


def _alias(h):
    a, b = "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"
    h[b]["data_offsets"] = list(h[a]["data_offsets"])


def _shift(h):      # a gap before one tensor, its end past the others
    h["model.norm.weight"]["data_offsets"] = [o + 2 for o in h["model.norm.weight"]["data_offsets"]]


SAFETENSORS_CASES = {
    "dtype_list": lambda h: h["model.norm.weight"].update(dtype=[]),
    "dtype_object": lambda h: h["model.norm.weight"].update(dtype={"a": 1}),
    "dims_text": lambda h: h["model.norm.weight"].update(shape=["16"]),
    "dims_fraction": lambda h: h["model.norm.weight"].update(shape=[16.7]),
    "dims_bool": lambda h: h["model.layers.0.input_layernorm.weight"].update(shape=[True, 16]),
    "metadata_not_strings": lambda h: h.update(__metadata__={"format": ["pt"]}),
    "aliased_tensors": _alias,
    "gap_between_tensors": _shift,
}
SAFETENSORS_TEXTS = {
    "deeply_nested": b"[" * 100_000 + b"]" * 100_000,
    "huge_digit_number": b'{"a": ' + b"3" * 5000 + b"}",
    "not_utf8": b'{"\xff": 1}',
    "not_object": b"[]",
}


@pytest.mark.parametrize("layout", ["single", "bf16"])
@pytest.mark.parametrize("case", sorted(SAFETENSORS_CASES) + sorted(SAFETENSORS_TEXTS) + ["trailing_bytes"])
def test_safetensors_hand_picked(tmp_path, hf, layout, case):
    """Malformed shard headers the safetensors library refuses (wrong types, dims that are not
    non-negative integers, overlapping or non-contiguous tensors, trailing bytes, deep nesting,
    numbers Python's json refuses) are a ModelFormatError for F32 and BF16 shards alike (BF16 is
    read by tinyloop itself, which accepted aliased tensors and fractional dims)."""
    d = Scratch(tmp_path).copy(hf[layout][0])
    p = os.path.join(d, "model.safetensors")
    header, blob = _read_safetensors(p)
    if case in SAFETENSORS_CASES:
        SAFETENSORS_CASES[case](header)
        _write_safetensors(p, header, blob)
    elif case == "trailing_bytes":
        _write_safetensors(p, header, blob + b"\0" * 8)
    else:
        text = SAFETENSORS_TEXTS[case]
        with open(p, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text + blob)
    _, err = typed(convert_hf, d, os.path.join(d, "o.tinyloop"), quant="f32")
    assert isinstance(err, ModelFormatError) and "model.safetensors" in str(err), err


def test_safetensors_byte_flips(tmp_path, hf):
    """Flipped bytes in a shard's length prefix and JSON header: a TinyLoopError or the clean
    conversion."""
    scratch = Scratch(tmp_path)

    @settings(max_examples=50, **FUZZ)
    @given(st.sampled_from(LAYOUTS), st.lists(st.tuples(st.integers(0, 10 ** 6), st.integers(1, 255)),
                                              min_size=1, max_size=3))
    def run(layout, flips):
        d = scratch.copy(hf[layout][0])
        shard = os.path.join(d, sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))[0])
        with open(shard, "rb") as f:
            raw = bytearray(f.read())
        head = 8 + struct.unpack_from("<Q", raw)[0]
        for pos, bit in flips:
            raw[pos % head] ^= bit
        with open(shard, "wb") as f:
            f.write(raw)
        check_convert(d, hf[layout])

    run()


INDEX_CASES = {
    "deeply_nested": "[" * 100_000 + "]" * 100_000,
    "huge_digit_number": '{"weight_map": {}, "n": ' + "5" * 5000 + "}",
    "weight_map_list": '{"weight_map": []}',
    "shard_number": '{"weight_map": {"model.norm.weight": 1}}',
    "shard_path": '{"weight_map": {"model.norm.weight": "../model-00001-of-00002.safetensors"}}',
    "shard_absent": '{"weight_map": {"model.norm.weight": "absent.safetensors"}}',
    "not_utf8": b'{"weight_map": {"\xff": "x"}}',
}


@pytest.mark.parametrize("case", sorted(INDEX_CASES))
def test_shard_index_hand_picked(tmp_path, hf, case):
    d = Scratch(tmp_path).copy(hf["sharded"][0])
    text = INDEX_CASES[case]
    with open(os.path.join(d, "model.safetensors.index.json"), "wb") as f:
        f.write(text if isinstance(text, bytes) else text.encode())
    _, err = typed(convert_hf, d, os.path.join(d, "o.tinyloop"), quant="f32")
    assert isinstance(err, ModelFormatError) and "model.safetensors.index.json" in str(err), err


@pytest.mark.parametrize("change", ["truncate", "remove"])
def test_bf16_shard_changed_during_convert(tmp_path, hf, monkeypatch, change):
    """A BF16 shard truncated or removed after it was indexed, before its tensors are read (another
    process rewriting the checkpoint): a ModelFormatError naming the file, not numpy's reshape
    ValueError or a raw FileNotFoundError; no output is left."""
    d = Scratch(tmp_path).copy(hf["bf16"][0])
    p = os.path.join(d, "model.safetensors")
    read = CheckpointWeights._read

    def changed(self, info, name):
        if os.path.exists(p):
            if change == "truncate":
                os.truncate(p, 100)
            else:
                os.unlink(p)
        return read(self, info, name)

    monkeypatch.setattr(CheckpointWeights, "_read", changed)
    out = os.path.join(d, "o.tinyloop")
    _, err = typed(convert_hf, d, out, quant="f32")
    assert isinstance(err, ModelFormatError) and p in str(err), err
    assert not os.path.exists(out)


_TRUNCATE_DURING_CONVERT = """
import os, sys
sys.path.insert(0, sys.argv[3])
from test_file_fuzz import make_hf_dir
from tinyloop.cli.convert import CheckpointWeights, convert_hf
from tinyloop.errors import TinyLoopError
d = make_hf_dir(sys.argv[1], sys.argv[2])
shard = os.path.join(d, "model.safetensors")
read, calls = CheckpointWeights._read, []
def _read(self, info, name):
    calls.append(name)
    if len(calls) == 2:             # the shard is open (and was memory-mapped) by now
        os.truncate(shard, 200)
    return read(self, info, name)
CheckpointWeights._read = _read
try:
    convert_hf(d, os.path.join(d, "o.tinyloop"), quant="f32")
    print("no error")
except TinyLoopError as e:
    print("typed error:", type(e).__name__, e)
"""


@pytest.mark.parametrize("layout", ["single", "bf16"])
def test_shard_truncated_while_converting_is_a_typed_error(tmp_path, layout):
    """A shard truncated while convert reads it (another process rewriting the checkpoint) must not
    kill the process with SIGBUS, as reading F32 / F16 tensors through safetensors' memory map did
    (a page past the new end of the file touched): a ModelFormatError naming the file."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", _TRUNCATE_DURING_CONVERT, str(tmp_path / "hf"), layout,
                        os.path.dirname(os.path.abspath(__file__))], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, f"rc={r.returncode} (-7 is SIGBUS): {r.stderr[-2000:]}"
    assert "typed error: ModelFormatError" in r.stdout and "model.safetensors" in r.stdout, r.stdout + r.stderr


def test_failed_convert_leaves_no_shard_mapped(tmp_path, hf):
    """A conversion that fails on a tensor (here a NaN) leaves nothing of the checkpoint open or
    mapped when it raises, without help from the garbage collector (safetensors' maps of the shards
    stayed until a collection: the error held the weights through its traceback, and they held the
    error)."""
    import gc
    d = Scratch(tmp_path).copy(hf["single"][0])
    p = os.path.join(d, "model.safetensors")
    t = safetensors_numpy.load_file(p)
    t["model.layers.1.mlp.up_proj.weight"][0, 0] = np.nan
    safetensors_numpy.save_file(t, p)
    gc.disable()
    try:
        _, err = typed(convert_hf, d, os.path.join(d, "o.tinyloop"), quant="f32")
        assert isinstance(err, ModelFormatError) and "non-finite" in str(err), err
        with open("/proc/self/maps") as f:
            assert [line for line in f if d in line] == []
    finally:
        gc.enable()


def test_tokenizer_files_in_hf_dir(tmp_path, hf):
    """tokenizer.json with an id at 2**32 - 1 or of 5000 digits, a vocab.json the same, and a
    tokenizer_config.json whose chat templates are named by lists or objects: TokenizerErrors,
    within bounded memory."""
    base = _tokenizer_json(V)
    d = Scratch(tmp_path).copy(hf["single"][0])
    for text in (_sparse_id(base), _huge_digit_id(base)):
        with open(os.path.join(d, "tokenizer.json"), "w") as f:
            f.write(text)
        with bounded_memory():
            _, err = typed(convert_hf, d, os.path.join(d, "o.tinyloop"), quant="f32")
        assert isinstance(err, TokenizerError), err
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "merges.txt").write_text("#version: 0.2\n")
    for vocab in ('{"a": 0, "b": 4294967295}', '{"a": ' + "8" * 5000 + "}", "[" * 100_000 + "]" * 100_000):
        (gpt2 / "vocab.json").write_text(vocab)
        with bounded_memory():
            _, err = typed(load_tokenizer_dir, str(gpt2))
        assert isinstance(err, TokenizerError), (vocab[:20], err)
    (gpt2 / "vocab.json").write_text('{"a": 0, "b": 1}')
    for templates in ([{"name": ["x"], "template": "a"}], [{"name": "default", "template": "a"}, {"name": {"b": 1}}]):
        (gpt2 / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
        tok, err = typed(load_tokenizer_dir, str(gpt2))
        assert isinstance(err, TokenizerError) or tok.chat_template == "a", (templates, err)


# =============================================================================== run config YAML
def _run_yaml(tmp_path, text, name="run.yaml") -> str:
    p = tmp_path / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(p)


RUN_CASES = {
    "huge_digit_number": "prompts: [x]\nmax_seq_len: " + "9" * 5000 + "\n",
    "grammar_file_deeply_nested": ("prompts: [x]\ngenerate: {grammar: {json_schema: schema.json}}\n",
                                   "[" * 100_000 + "]" * 100_000),
    "grammar_file_huge_digit_number": ("prompts: [x]\ngenerate: {grammar: {json_schema: schema.json}}\n",
                                       '{"type": "integer", "maximum": ' + "9" * 5000 + "}"),
    "grammar_file_not_utf8": ("prompts: [x]\ngenerate: {grammar: {json_schema: schema.json}}\n", b'{"\xff": 1}'),
    "not_utf8": b"prompts: [\xff]\n",
    "impossible_date": "prompts: [x]\nmodel: 2001-13-45\n",
    "deeply_nested": "prompts: " + "[" * 50_000 + "]" * 50_000 + "\n",
    "directory": None,
}


@pytest.mark.parametrize("case", sorted(RUN_CASES))
def test_run_config_hand_picked(tmp_path, capsys, case):
    """A ConfigError naming the file from load_run_config, and ``error:`` with exit code 2 from
    ``tinyloop run``, before any model is loaded."""
    spec = RUN_CASES[case]
    if spec is None:
        path = str(tmp_path)
    elif isinstance(spec, tuple):
        path = _run_yaml(tmp_path, spec[0])
        (tmp_path / "schema.json").write_bytes(spec[1] if isinstance(spec[1], bytes) else spec[1].encode())
    else:
        path = _run_yaml(tmp_path, spec)
    _, err = typed(load_run_config, path)
    assert isinstance(err, ConfigError) and path in str(err), err
    rc, err = cli(capsys, "run", path)
    assert rc == 2 and err.startswith("error:"), err


def test_run_config_mutations(tmp_path):
    """Run-config keys (top level and generate:) of any YAML value: a RunConfig or a ConfigError."""
    from dataclasses import fields
    from tinyloop.runtime.config import RunConfig
    top = [f.name for f in fields(RunConfig)]
    gen = [f.name for f in fields(GenerateConfig)]
    path = tmp_path / "run.yaml"
    values = json_values | st.sampled_from([2 ** 64, 10 ** 400, float("nan"), "a\0b", "demo", "batch", "speculative",
                                            {"draft_loops": 2}, {"loops_used": 1, "depths": [2]},
                                            {"json_schema": "absent.json"}, {"regex": "a+"}])

    @settings(max_examples=80, **FUZZ)
    @given(st.lists(st.tuples(st.sampled_from(top + [f"generate.{g}" for g in gen]), values), min_size=1, max_size=3))
    def run(edits):
        d = {"prompts": ["x"]}
        for key, value in edits:
            if key.startswith("generate."):
                if not isinstance(d.get("generate"), dict):
                    d["generate"] = {}
                d["generate"][key[9:]] = value
            else:
                d[key] = value
        path.write_text(yaml.safe_dump(d))
        typed(load_run_config, str(path))

    run()


# =============================================================================== compat.yaml override
@pytest.fixture
def compat_override(monkeypatch, tmp_path):
    """Write a matrix, point TINYLOOP_COMPAT (the documented override) at it, and return the path;
    the matrix cache is emptied before and after."""
    compat._load.cache_clear()
    p = tmp_path / "compat.yaml"
    monkeypatch.setenv("TINYLOOP_COMPAT", str(p))

    def write(text):
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
        return str(p)

    yield write
    compat._load.cache_clear()


SHIPPED_COMPAT = os.path.join(ROOT, "configs", "compat.yaml")
with open(SHIPPED_COMPAT, encoding="utf-8") as _f:
    COMPAT_TEXT = _f.read()
COMPAT_CASES = {
    "not_utf8": COMPAT_TEXT.encode() + b"\n# \xff\xfe\n",
    "deeply_nested": "a: " + "[" * 50_000 + "]" * 50_000 + "\n",
    "huge_digit_number": COMPAT_TEXT.replace("version: 1", "version: " + "1" * 5000),
    "version_true": COMPAT_TEXT.replace("version: 1", "version: true"),
    "impossible_date": COMPAT_TEXT.replace("version: 1", "version: 2001-13-45"),
    "op_list": COMPAT_TEXT.replace('when: [cache_mode, "==", fp16]', "when: [cache_mode, [1], fp16]"),
    "op_mapping": COMPAT_TEXT.replace('when: [cache_mode, "==", fp16]', "when: [cache_mode, {a: 1}, fp16]"),
    "complex_key": COMPAT_TEXT + "\n? [a, b]\n: 1\n",
    "complex_context_name": COMPAT_TEXT.replace("  single:           {status", "  [1]:           {status", 1),
}


@pytest.mark.parametrize("case", sorted(COMPAT_CASES))
def test_compat_override_hand_picked(compat_override, case):
    """A matrix given through TINYLOOP_COMPAT that is not valid is a ConfigError naming the file,
    from the loader and from the first request checked; the failure is not cached (the fixed file
    loads next)."""
    path = compat_override(COMPAT_CASES[case])
    before = compat._load.cache_info().currsize
    _, err = typed(compat.load_matrix)
    assert isinstance(err, ConfigError) and path in str(err), err
    _, err = typed(compat.check_request, "single", GenerateConfig())
    assert isinstance(err, ConfigError) and path in str(err), err
    assert compat._load.cache_info().currsize == before
    compat_override(COMPAT_TEXT)
    assert compat.check_request("single", GenerateConfig()) == compat.load_matrix(SHIPPED_COMPAT).check(
        "single", GenerateConfig())


def test_compat_override_mutations(compat_override):
    """A matrix whose values are changed anywhere (mode rules, cells, contexts, pairs) loads and
    checks requests with TinyLoopErrors only, or is refused with a ConfigError."""
    import warnings
    base = yaml.safe_load(COMPAT_TEXT)

    def slots(o, pre=()):
        if pre:
            yield pre
        if isinstance(o, dict):
            for k, v in o.items():
                yield from slots(v, pre + (k,))
        elif isinstance(o, list):
            for i, v in enumerate(o[:3]):
                yield from slots(v, pre + (i,))

    every = list(slots(base))
    values = st.sampled_from(["ok", "rejected", "partial", "planned", "implemented", "==", ">", "cache_mode",
                              "beam_size", ["beam_size", ">", 1], ["beam_size", ">", "x"], ["cache_mode", [1], 1],
                              {"status": "planned"}, {"modes": ["fp16_cache", "grammar"], "reason": "r"}]) | json_values
    requests = [GenerateConfig(), GenerateConfig(cache_mode="int8"), GenerateConfig(beam_size=2)]

    @settings(max_examples=80, **FUZZ)
    @given(st.lists(st.tuples(st.sampled_from(every), values), min_size=1, max_size=3))
    def run(edits):
        d = edited(base, edits)
        compat._load.cache_clear()
        compat_override(yaml.safe_dump(d))
        matrix, err = typed(compat.load_matrix)
        if matrix is None:
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for context in list(matrix.contexts)[:4] + ["single"]:
                for request in requests:
                    typed(matrix.check, context, request)

    run()
