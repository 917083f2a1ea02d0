"""Edges of .tinyloop model files and of the CLI tools (inspect, synth, bench): a malformed or
changing model file, or a wrong argument, ends in a typed error or a clear ``error:`` line with exit
code 2, never a crash or a traceback.

Malformed files are built from the shipped demo model by re-serializing it with an edited JSON
header (an independent reader of the layout in docs/FORMAT.md)."""

import json
import os
import struct
import subprocess
import sys
import textwrap

import pytest

import tinyloop as tl
from tinyloop.cli.main import main
from tinyloop.errors import ConfigError
from tinyloop.models import demo_model_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------- building files
def _split(raw: bytes):
    """(header dict, tensor table bytes, tensor data bytes) of a model file."""
    (hlen,) = struct.unpack_from("<Q", raw, 16)
    header = json.loads(raw[24:24 + hlen])
    pos = p = 24 + hlen
    (n,) = struct.unpack_from("<I", raw, p)
    p += 4
    for _ in range(n):
        (name_len,) = struct.unpack_from("<H", raw, p)
        p += 2 + name_len
        ndim = raw[p + 1]
        p += 2 + 8 * ndim + 16
    return header, raw[pos:p], raw[-(-p // 64) * 64:]


def _build(header_bytes: bytes, table: bytes, data: bytes) -> bytes:
    head = b"TINYLOOP" + struct.pack("<IIQ", 1, 0, len(header_bytes)) + header_bytes + table
    return head + b"\0" * (-len(head) % 64) + data


@pytest.fixture(scope="module")
def demo_parts():
    with open(demo_model_path(), "rb") as f:
        return _split(f.read())


def _with_hf_tokenizer(tmp_path, demo_parts, tokenizer_json: str):
    header, table, data = demo_parts
    header = dict(header, tokenizer={"type": "hf", "json": tokenizer_json})
    path = tmp_path / "m.tinyloop"
    path.write_bytes(_build(json.dumps(header).encode(), table, data))
    return str(path)


def _run_cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# --------------------------------------------------------------------------- inspect
BAD_TOKENIZER_JSON = {
    # nested deeper than the interpreter's recursion limit: json.loads raises RecursionError
    "deeply_nested": '{"model": {"type": "BPE", "vocab": ' + "[" * 100_000 + "]" * 100_000 + "}}",
    # a 4300-digit id: max(ids) + 1 has 4301 digits, which Python refuses to turn into text
    "huge_id": '{"model": {"type": "BPE", "vocab": {"a": ' + "9" * 4300 + '}, "merges": []}}',
}


@pytest.mark.parametrize("case", sorted(BAD_TOKENIZER_JSON))
def test_inspect_reports_an_unreadable_embedded_tokenizer_json(tmp_path, demo_parts, capsys, case):
    """An embedded tokenizer.json that inspect cannot read is reported as unreadable (as the
    inspect docstring promises), never a RecursionError / ValueError out of the CLI."""
    path = _with_hf_tokenizer(tmp_path, demo_parts, BAD_TOKENIZER_JSON[case])
    d = tl.inspect(path)
    assert d["tokenizer"]["embedded"] and d["tokenizer"]["model"].startswith("unreadable")
    for extra in ([], ["--json"]):
        rc, out, err = _run_cli(capsys, "inspect", path, *extra)
        assert rc == 0, err
        assert "Traceback" not in err
    assert json.loads(out)["tokenizer"]["model"].startswith("unreadable")
    # loading it is a typed error too (the tokenizer is resolved on first use)
    model = tl.load_model(path, backend="cpu", max_seq_len=16)
    try:
        with pytest.raises(tl.TokenizerError):
            model.tokenizer
    finally:
        tl.free_model(model)


# --------------------------------------------------------------------------- a file changing under a load
_TRUNCATE_DURING_LOAD = textwrap.dedent("""
    import os, sys
    import tinyloop as tl
    from tinyloop.errors import TinyLoopError
    from tinyloop.model.format import open_model
    from tinyloop.cpu.backend import CPUBackend

    path, where = sys.argv[1], sys.argv[2]
    half = os.path.getsize(path) // 2
    try:
        if where == "load_weights":      # truncated between open_model and the backend's copies
            orig = CPUBackend.load_weights
            def load_weights(self, model_file):
                os.truncate(path, half)
                return orig(self, model_file)
            CPUBackend.load_weights = load_weights
            tl.load_model(path, backend="cpu", max_seq_len=16)
        else:                            # truncated while a ModelFile is open
            with open_model(path) as m:
                os.truncate(path, half)
                for name in m.header.quant:
                    m.logical(name)
        print("no error")
    except TinyLoopError as e:
        print("typed error:", type(e).__name__, e)
""")


@pytest.mark.parametrize("where", ["load_weights", "open_model"])
def test_file_truncated_while_loading_is_a_typed_error(tmp_path, where):
    """A model file truncated while it is being loaded (another process rewriting it in place) must
    not kill the process with SIGBUS (tensors read from a memory map past the new end of the
    file): the load ends in a ModelFormatError naming the change."""
    path = tmp_path / "m.tinyloop"
    with open(demo_model_path(), "rb") as f:
        path.write_bytes(f.read())
    r = subprocess.run([sys.executable, "-c", _TRUNCATE_DURING_LOAD, str(path), where], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"rc={r.returncode} (-7 is SIGBUS): {r.stderr[-2000:]}"
    assert "typed error: ModelFormatError" in r.stdout, r.stdout + r.stderr[-2000:]
    assert "changed" in r.stdout or "truncated" in r.stdout, r.stdout


# --------------------------------------------------------------------------- synth
def test_synth_negative_seed_is_a_clear_error(tmp_path, capsys):
    out = tmp_path / "s.tinyloop"
    rc, _, err = _run_cli(capsys, "synth", "--preset", "tiny", "-o", str(out), "--seed", "-1")
    assert rc == 2 and err.startswith("error:") and "seed" in err and "Traceback" not in err, err
    assert not out.exists()
    from tinyloop.cli.synth import synth_model
    with pytest.raises(ConfigError, match="seed"):
        synth_model("tiny", out, seed=-1)


# --------------------------------------------------------------------------- bench
@pytest.mark.parametrize("args, what", [
    (["--prompt-len", "-1"], "--prompt-len"),    # was numpy's "negative dimensions" traceback
    (["--sweep", "1,two"], "--sweep"),           # was int()'s traceback
    (["--repeats", "0"], "--repeats"),           # was a report of NaN medians
])
def test_bench_bad_numbers_are_clear_errors(capsys, monkeypatch, args, what):
    """On a machine with a GPU (availability faked here; the arguments are checked before any CUDA
    call), a bad number is an ``error:`` line and exit code 2, not a traceback or a NaN report."""
    from tinyloop.plugins.backends import CUDAEntry
    monkeypatch.setattr(CUDAEntry, "available", classmethod(lambda cls, simulator_ok=False: (True, "")))
    rc, _, err = _run_cli(capsys, "bench", "--model", demo_model_path(), "--skip-torch", "--skip-matmul",
                          *args)
    assert rc == 2 and err.startswith("error:") and what in err, err
