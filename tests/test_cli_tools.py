"""CLI tools: synth, inspect, convert (run in-process through their add_parser/run), presets and the
memory estimate."""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from tinyloop.cli import convert as convert_cmd
from tinyloop.cli import inspect_cmd, synth as synth_cmd
from tinyloop.cli.synth import RandomWeights, synth_model
from tinyloop.model.arch import ModelConfig, TensorQuant, required_tensors
from tinyloop.errors import ConfigError
from tinyloop.model.format import open_model, read_header
from tinyloop.analysis.memory import estimate_memory, parameter_count, physical_weight_bytes
from tinyloop.model.presets import PRESETS, check_quant_shapes, make_quant
from tinyloop.model.quant import dequantize_tensor, quantize_tensor
from tinyloop.model.tokenizer import byte_to_unicode

safetensors_numpy = pytest.importorskip("safetensors.numpy")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = PRESETS["tiny"].config


def cli(capsys, *argv):
    """Run one of this module's subcommands in-process: (exit code, stdout, stderr)."""
    p = argparse.ArgumentParser(prog="tinyloop")
    sp = p.add_subparsers(dest="command", required=True)
    for mod in (inspect_cmd, convert_cmd, synth_cmd):
        mod.add_parser(sp)
    args = p.parse_args([str(a) for a in argv])
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("synth") / "tiny.tinyloop"
    synth_model("tiny", path, seed=3)
    return str(path)


# ------------------------------------------------------------------------------- synth
def test_synth_cli_and_determinism(tmp_path, capsys):
    a, b, c = (tmp_path / n for n in ("a.tinyloop", "b.tinyloop", "c.tinyloop"))
    rc, out, err = cli(capsys, "synth", "--preset", "tiny", "-o", a, "--seed", "5")
    assert rc == 0, err
    assert "143,808 parameters" in out
    assert cli(capsys, "synth", "--preset", "tiny", "-o", b, "--seed", "5")[0] == 0
    assert cli(capsys, "synth", "--preset", "tiny", "-o", c, "--seed", "6")[0] == 0
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    h = read_header(a)
    assert h.config == ModelConfig(**TINY)
    assert h.quant["embed"] == TensorQuant("f16") and h.quant["head"] == TensorQuant("f16")
    assert h.quant["loop.0.wq"] == TensorQuant("q4", 32)
    assert h.quant["final_norm"] == TensorQuant("f32")
    assert h.metadata["preset"] == "tiny"


def test_synth_weights_statistics(tiny_file):
    cfg = ModelConfig(**TINY)
    with open_model(tiny_file) as m:
        assert np.array_equal(m.logical("loop.0.attn_norm"), np.ones(cfg.d_model, np.float32))
        wq = m.logical("pre.0.wq")
        wo = m.logical("pre.0.wo")
        assert 0.015 < float(wq.std()) < 0.025
        expect_out = 0.02 / np.sqrt(2 * cfg.n_layers(cfg.max_loops))
        assert 0.7 * expect_out < float(wo.std()) < 1.3 * expect_out
    w = RandomWeights(cfg, seed=3)
    assert np.array_equal(w["embed"], w["embed"])          # regenerated identically


def test_synth_overrides_and_bad_group(tmp_path, capsys):
    cfg = synth_model("tiny", tmp_path / "t.tinyloop", tied_embeddings=True, quant="q8",
                      group_size=64)
    h = read_header(tmp_path / "t.tinyloop")
    assert cfg.tied_embeddings and "head" not in h.quant
    assert h.quant["embed"] == TensorQuant("q8", 64) and h.quant["pre.0.w_down"] == TensorQuant("q8", 64)
    rc, _, err = cli(capsys, "synth", "--preset", "tiny", "-o", tmp_path / "x.tinyloop",
                     "--group-size", "48")
    assert rc == 2 and "use --group-size 32" in err
    assert not (tmp_path / "x.tinyloop").exists()


def test_presets_are_consistent():
    for name, p in PRESETS.items():
        cfg = ModelConfig(**p.config)
        check_quant_shapes(cfg, make_quant(cfg, p.quant, p.group_size, p.embed_quant, p.head_quant))
    cfg = ModelConfig(**PRESETS["360m"].config)
    assert 340e6 < parameter_count(cfg) < 380e6
    q = make_quant(cfg, "q4", 128)
    assert all(q[n] == TensorQuant("q4", 128) for n in required_tensors(cfg) if not n.endswith("norm"))


# ------------------------------------------------------------------------------ inspect
def test_inspect_json(tiny_file, capsys):
    rc, out, err = cli(capsys, "inspect", tiny_file, "--json", "--max-seq-len", "128", "--loops", "8")
    assert rc == 0, err
    d = json.loads(out)
    cfg = ModelConfig(**TINY)
    h = read_header(tiny_file)
    assert d["config"] == cfg.to_dict()
    assert d["parameters"] == parameter_count(cfg) == sum(d["parameters_by_part"].values())
    assert d["file_size"] == os.path.getsize(tiny_file)
    assert d["metadata"]["preset"] == "tiny"
    t = d["tensors"]
    assert t["count"] == len(h.tensors)
    assert t["bytes"] == sum(e.nbytes for e in h.tensors) == sum(v["bytes"] for v in t["by_dtype"].values())
    assert sum(t["bytes_by_quant"].values()) == t["bytes"]
    assert set(t["bytes_by_quant"]) == {"f16", "f32", "q4/g32"}
    assert t["logical_by_quant"]["f16"] == 2
    assert t["largest"][0]["bytes"] == max(e.nbytes for e in h.tensors)
    assert d["tokenizer"] == {"embedded": False}
    m = d["memory"]
    assert m["loops"] == 8 and m["max_seq_len"] == 128
    assert set(m["backends"]) == {"cpu", "cuda"}
    for mode, kvb in m["cache_modes"].items():
        cpu = m["backends"]["cpu"]["cache_modes"][mode]
        cuda = m["backends"]["cuda"]["cache_modes"][mode]
        assert cpu["weights_bytes"] == 4 * d["parameters"]
        assert cuda["weights_bytes"] == t["bytes"]
        assert cuda["kv_cache_bytes"] == int(np.ceil(cfg.n_layers(8) * 128 * 2 * cfg.kv_dim * kvb))
        assert cuda["total_bytes"] == cuda["weights_bytes"] + cuda["kv_cache_bytes"] + cuda["scratch_bytes"]
    assert {"fp32", "fp16"} <= set(m["cache_modes"])


def test_inspect_text_reads_header_only(tiny_file, capsys, monkeypatch):
    import tinyloop.model.format as fmt

    def boom(*a, **k):
        raise AssertionError("inspect must not open the weights")
    monkeypatch.setattr(fmt, "open_model", boom)
    rc, out, err = cli(capsys, "inspect", tiny_file)
    assert rc == 0, err
    for word in ("parameters: 143,808", "q4/g32", "largest:", "cpu (weights dequantized to float32)",
                 "cuda", "tokenizer: none embedded"):
        assert word in out


def test_inspect_embedded_tokenizer(tmp_path, capsys):
    alphabet = byte_to_unicode()
    tok = {"type": "bpe", "vocab": {alphabet[b]: b for b in range(256)}, "merges": []}
    path = tmp_path / "tok.tinyloop"
    synth_model("tiny", path, tokenizer=tok)
    rc, out, _ = cli(capsys, "inspect", path, "--json")
    assert rc == 0
    assert json.loads(out)["tokenizer"] == {"embedded": True, "type": "bpe", "tokens": 256,
                                            "vocab_size": 256, "merges": 0}


def test_inspect_errors(tmp_path, tiny_file, capsys):
    garbage = tmp_path / "garbage.tinyloop"
    garbage.write_bytes(os.urandom(300))
    rc, out, err = cli(capsys, "inspect", garbage)
    assert rc == 2 and err.startswith("error: ") and out == ""
    truncated = tmp_path / "trunc.tinyloop"
    truncated.write_bytes(open(tiny_file, "rb").read()[:100])
    assert cli(capsys, "inspect", truncated)[0] == 2
    rc, _, err = cli(capsys, "inspect", tmp_path / "missing.tinyloop")
    assert rc == 2 and "no such file" in err
    rc, _, err = cli(capsys, "inspect", tiny_file, "--loops", "99")
    assert rc == 2 and "loops=99" in err


# ------------------------------------------------------------------------------ convert
def tiny_weights(seed=1, **cfg_overrides):
    cfg = ModelConfig(**{**TINY, **cfg_overrides})
    return cfg, dict(RandomWeights(cfg, seed).items())


def write_ckpt(tmp_path, weights, config=None, name="ckpt.safetensors"):
    ck = tmp_path / name
    safetensors_numpy.save_file(weights, str(ck))
    cf = tmp_path / "config.json"
    cf.write_text(json.dumps(TINY if config is None else config))
    return ck, cf


def test_convert_round_trip(tmp_path, capsys):
    cfg, w = tiny_weights()
    ck, cf = write_ckpt(tmp_path, w)
    out = tmp_path / "out.tinyloop"
    rc, stdout, err = cli(capsys, "convert", "--checkpoint", ck, "--config", cf, "-o", out,
                          "--quant", "q4", "--group-size", "32", "--embed-quant", "f16",
                          "--head-quant", "q8", "--metadata", "name=tiny-test", "license=mit")
    assert rc == 0, err
    assert "parameters: 143,808" in stdout and "rms_rel" in stdout and "w_down" in stdout
    quant = make_quant(cfg, "q4", 32, "f16", "q8")
    with open_model(out) as m:
        h = m.header
        assert h.config == cfg
        assert h.metadata["name"] == "tiny-test" and h.metadata["license"] == "mit"
        assert h.metadata["source_checkpoint"] == "ckpt.safetensors"
        assert dict(h.quant) == quant
        for name, shape in required_tensors(cfg).items():
            expect = dequantize_tensor(name, quantize_tensor(name, w[name], quant[name]), quant[name], shape)
            np.testing.assert_array_equal(m.logical(name), expect, err_msg=name)
        np.testing.assert_array_equal(m.logical("embed"), w["embed"].astype(np.float16).astype(np.float32))
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []   # no temp files left


def _bf16_bits(a):
    u = a.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _write_bf16_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        raw = _bf16_bits(a).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def test_convert_sharded_bf16_f16(tmp_path, capsys):
    cfg, w = tiny_weights(seed=2)
    names = list(w)
    shards = tmp_path / "shards"
    shards.mkdir()
    safetensors_numpy.save_file({n: w[n].astype(np.float16) for n in names[:12]},
                                str(shards / "model-00001-of-00002.safetensors"))
    _write_bf16_safetensors(shards / "model-00002-of-00002.safetensors", {n: w[n] for n in names[12:]})
    cf = tmp_path / "config.json"
    cf.write_text(json.dumps(TINY))
    out = tmp_path / "o.tinyloop"
    rc, _, err = cli(capsys, "convert", "--checkpoint", shards, "--config", cf, "-o", out, "--quant", "f32")
    assert rc == 0, err
    with open_model(out) as m:
        for n in names[:12]:
            np.testing.assert_array_equal(m.logical(n), w[n].astype(np.float16).astype(np.float32))
        for n in names[12:]:
            bf = (_bf16_bits(w[n]).astype(np.uint32) << 16).view(np.float32)
            np.testing.assert_array_equal(m.logical(n), bf)
            np.testing.assert_allclose(m.logical(n), w[n], rtol=1e-2, atol=1e-6)


@pytest.mark.parametrize("case", ["missing", "bias", "extra_layer", "shape", "dtype", "nonfinite",
                                  "config_key", "group", "bad_json", "no_ckpt", "duplicate_shard",
                                  "tied_head", "metadata"])
def test_convert_refusals(tmp_path, capsys, case):
    cfg, w = tiny_weights()
    config = dict(TINY)
    extra = ["--group-size", "32"]
    expect = []
    ckpt_path = None
    if case == "missing":
        del w["loop.0.wk"]
        expect = ["missing tensor", "loop.0.wk"]
    elif case == "bias":
        w["pre.0.wq.bias"] = np.zeros(64, np.float32)
        expect = ["unexpected tensor", "pre.0.wq.bias"]
    elif case == "extra_layer":
        for n in [k for k in w if k.startswith("loop.0.")]:
            w[n.replace("loop.0.", "loop.1.")] = w[n]
        expect = ["unexpected tensor", "loop.1.wq"]
    elif case == "shape":
        w["post.0.w_up"] = np.zeros((128, 32), np.float32)
        expect = ["post.0.w_up", "expected (128, 64), got (128, 32)"]
    elif case == "dtype":
        w["final_norm"] = np.ones(64, np.int32)
        expect = ["final_norm", "I32", "not a float"]
    elif case == "nonfinite":
        w["loop.0.w_down"][3, 5] = np.nan
        expect = ["loop.0.w_down", "non-finite"]
    elif case == "config_key":
        config["n_layers"] = 3
        expect = ["unknown model config key", "n_layers"]
    elif case == "group":
        extra = ["--group-size", "48"]
        expect = ["group_size=48", "--group-size 32"]
    elif case == "bad_json":
        expect = ["not valid JSON"]
    elif case == "no_ckpt":
        ckpt_path = tmp_path / "nothing.safetensors"
        expect = ["does not exist"]
    elif case == "duplicate_shard":
        d = tmp_path / "dup"
        d.mkdir()
        safetensors_numpy.save_file(w, str(d / "a.safetensors"))
        safetensors_numpy.save_file({"embed": w["embed"]}, str(d / "b.safetensors"))
        ckpt_path = d
        expect = ["'embed'", "two shards"]
    elif case == "tied_head":
        config["tied_embeddings"] = True
        expect = ["unexpected tensor", "tied_embeddings=true"]
    elif case == "metadata":
        extra += ["--metadata", "novalue"]
        expect = ["KEY=VALUE"]
    ck, cf = write_ckpt(tmp_path, w, config)
    if case == "bad_json":
        cf.write_text("{vocab_size: 3")
    out = tmp_path / "out.tinyloop"
    rc, stdout, err = cli(capsys, "convert", "--checkpoint", ckpt_path or ck, "--config", cf,
                          "-o", out, *extra)
    assert rc == 2, (stdout, err)
    assert err.startswith("error: ")
    for e in expect:
        assert e in err, (e, err)
    assert not out.exists()
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []


def test_convert_not_safetensors(tmp_path, capsys):
    ck = tmp_path / "x.safetensors"
    ck.write_bytes(b"\xff" * 64)
    cf = tmp_path / "c.json"
    cf.write_text(json.dumps(TINY))
    rc, _, err = cli(capsys, "convert", "--checkpoint", ck, "--config", cf, "-o", tmp_path / "o")
    assert rc == 2 and "not a safetensors file" in err


def test_convert_embeds_tokenizer(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    alphabet = byte_to_unicode()
    tdir = tmp_path / "tok"
    tdir.mkdir()
    (tdir / "vocab.json").write_text(json.dumps({alphabet[b]: b for b in range(256)}), encoding="utf-8")
    (tdir / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    _, w = tiny_weights()
    ck, cf = write_ckpt(tmp_path, w)
    out = tmp_path / "o.tinyloop"
    rc, _, err = cli(capsys, "convert", "--checkpoint", ck, "--config", cf, "-o", out,
                     "--group-size", "32", "--tokenizer", tdir)
    assert rc == 0, err
    tok = read_header(out).tokenizer
    assert tok["type"] == "bpe" and len(tok["vocab"]) == 256 and tok["merges"] == []
    # a tokenizer bigger than the model's vocab is refused
    (tdir / "vocab.json").write_text(json.dumps({**{alphabet[b]: b for b in range(256)}, "ĠĠ": 300}),
                                     encoding="utf-8")
    rc, _, err = cli(capsys, "convert", "--checkpoint", ck, "--config", cf, "-o", out,
                     "--group-size", "32", "--tokenizer", tdir)
    assert rc == 2 and "vocab_size is 256" in err


# ------------------------------------------------------------------------------- memory
def test_memory_estimate_arithmetic(tiny_file):
    h = read_header(tiny_file)
    cfg = h.config
    quant = dict(h.quant)
    assert physical_weight_bytes(cfg, quant) == sum(e.nbytes for e in h.tensors)
    a = estimate_memory(h, 100, 3, 2.0)
    b = estimate_memory(cfg, 100, 3, 2.0, quant=quant)
    assert a == b
    assert a["n_layers"] == cfg.n_pre + 3 * cfg.n_loop + cfg.n_post == 5
    # CUDA allocates a power of two >= 128 slots for a request of 100 (round_slots); the CPU, 100
    assert a["kv_cache_bytes"] == 5 * 128 * 2 * cfg.kv_dim * 2
    assert estimate_memory(h, 100, 3, 2.0, backend="cpu")["kv_cache_bytes"] == 5 * 100 * 2 * cfg.kv_dim * 2
    from tinyloop.cpu.backend import CPUBackend
    from tinyloop.cuda.backend import CUDABackend
    # the workspace of 100 rows (min(max_seq_len, 512)) as each backend lays it out
    assert a["scratch_bytes"] == CUDABackend.workspace_nbytes(cfg, 100, 100) > 4 * 100 * cfg.vocab_size
    assert estimate_memory(h, 100, 3, 2.0, backend="cpu", prefill_chunk=8)["scratch_bytes"] == \
        CPUBackend.workspace_nbytes(cfg, 8, 100)
    assert estimate_memory(h, 100, 3, 0.53, backend="cpu")["kv_cache_bytes"] == int(np.ceil(5 * 100 * 2 * 32 * 0.53))
    cpu = estimate_memory(h, 100, None, 4, backend="cpu")
    assert cpu["weights_bytes"] == 4 * parameter_count(cfg) and cpu["loops"] == cfg.default_loops
    big = ModelConfig(**PRESETS["360m"].config)
    e = estimate_memory(big, 2048, 8, 2.0, default_quant=TensorQuant("q4", 128))
    assert e["kv_cache_bytes"] == 10 * 2048 * 2 * 2048 * 2
    with pytest.raises(ConfigError):
        estimate_memory(h, 0, 1, 2.0)
    with pytest.raises(ConfigError):
        estimate_memory(h, 10, cfg.max_loops + 1, 2.0)
    with pytest.raises(ConfigError):
        estimate_memory(h, 10, 1, 2.0, backend="tpu")


# ---------------------------------------------------------------------- real entry point
@pytest.mark.skipif(not (os.path.exists(os.path.join(REPO, "tinyloop", "__main__.py"))
                         and os.path.exists(os.path.join(REPO, "tinyloop", "cli", "main.py"))),
                    reason="tinyloop/__main__.py or tinyloop/cli/main.py not written yet")
def test_python_m_tinyloop(tmp_path, tiny_file):
    garbage = tmp_path / "g.tinyloop"
    garbage.write_bytes(b"not a model at all")
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", "tinyloop", "inspect", str(garbage)],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("error: ")
    r = subprocess.run([sys.executable, "-m", "tinyloop", "inspect", tiny_file, "--json"],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["parameters"] == 143808
