"""Adversarial command lines for ``python -m tinyloop``: what a new user or a script gets wrong
(an output path that is one of the command's own inputs, an empty path from an unset shell
variable, a FIFO, a port already taken, Ctrl-C at an awkward moment). Each ends in exit status 2
(130 for Ctrl-C) and one ``error:`` line naming the flag, never a clobbered input, a silently
ignored flag, a traceback or a half-written output file. Complements test_cli_errors.py,
test_cli_run.py, test_cli_tools.py, test_model_file_cli_edges.py and test_stream_cli_edges.py."""

from __future__ import annotations

import json
import os
import shutil
import socket

import pytest

from tinyloop.cli.main import main
from tinyloop.models import demo_model_path

BASE = 'model: ""\nbackend: cpu\nmax_seq_len: 64\nprompts: ["def f(x):"]\ngenerate: {max_tokens: 2}\n'


def _cli(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _one_error(rc, err, *words):
    lines = [ln for ln in err.splitlines() if not ln.startswith("[tinyloop]")]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


@pytest.fixture
def demo_copy(tmp_path):
    """A copy of the demo model (a test that fails must not clobber the shipped file)."""
    p = tmp_path / "m.tinyloop"
    shutil.copyfile(demo_model_path(), p)
    return p


# ------------------------------------------------------------------ outputs that are inputs
def test_run_output_jsonl_that_is_the_config_itself_is_refused(tmp_path, capsys):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(BASE)
    rc, out, err = _cli(capsys, "run", cfg, "--output-jsonl", cfg)
    _one_error(rc, err, "output_jsonl", "input")
    assert cfg.read_text() == BASE and out == ""


def test_run_config_output_jsonl_that_is_the_prompts_file_is_refused(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\nimport os\n")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text('model: ""\nbackend: cpu\nmax_seq_len: 64\nprompts_file: p.txt\noutput_jsonl: p.txt\n'
                   'generate: {max_tokens: 2}\n')
    rc, out, err = _cli(capsys, "run", cfg)
    _one_error(rc, err, "output_jsonl", "p.txt")
    assert prompts.read_text() == "def f(x):\nimport os\n" and out == ""


@pytest.mark.parametrize("target", ["model", "text"])
def test_ppl_json_that_is_an_input_is_refused(tmp_path, capsys, demo_copy, target):
    """--json naming the model (or the text) used to overwrite it with the results, after scoring."""
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 20)
    before = {p: p.read_bytes() for p in (demo_copy, text)}
    rc, out, err = _cli(capsys, "ppl", demo_copy, "--text", text, "--backend", "cpu", "--window", "16",
                        "--max-windows", "1", "--json", demo_copy if target == "model" else text)
    _one_error(rc, err, "--json", "input")
    assert out == ""
    assert all(p.read_bytes() == b for p, b in before.items())


@pytest.mark.parametrize("case", ["missing_folder", "model"])
def test_bench_json_is_checked_before_any_work(tmp_path, capsys, demo_copy, case):
    """bench --json was opened only after the first benchmark section (minutes of GPU time): a
    missing folder was an OSError then, and --json naming --model overwrote the model."""
    target = tmp_path / "nowhere" / "b.json" if case == "missing_folder" else demo_copy
    rc, _, err = _cli(capsys, "bench", "--model", demo_copy, "--json", target)
    _one_error(rc, err, "--json")
    assert demo_copy.read_bytes()[:8] == b"TINYLOOP"


# ------------------------------------------------------------------ empty paths (unset shell variables)
@pytest.mark.parametrize("argv, flag", [
    (["serve", "--config", ""], "--config"),                   # served the defaults
    (["ppl", "demo", "--text", "t.txt", "--json", ""], "--json"),      # scored, wrote nothing, exit 0
    (["ppl", "demo", "--text", "t.txt", "--tokenizer", ""], "--tokenizer"),   # used the embedded one
    (["run", "cfg.yaml", "--tokenizer", ""], "--tokenizer"),          # used the config's
    (["convert", "--checkpoint", "ck.safetensors", "--config", "c.json", "-o", "o.tinyloop",
      "--tokenizer", ""], "--tokenizer"),                      # embedded no tokenizer
    (["convert", "--checkpoint", "ck.safetensors", "--config", "c.json", "-o", ""], "--output"),
], ids=["serve-config", "ppl-json", "ppl-tokenizer", "run-tokenizer", "convert-tokenizer", "convert-output"])
def test_an_empty_path_is_refused_not_ignored(tmp_path, capsys, monkeypatch, argv, flag):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.txt").write_text("def f(x):\n    return x + 1\n" * 20)
    (tmp_path / "cfg.yaml").write_text(BASE)
    rc, out, err = _cli(capsys, *argv)
    _one_error(rc, err, flag, "empty")
    assert out == ""


# ------------------------------------------------------------------ convert paths
def test_convert_output_in_a_missing_folder_names_the_output(tmp_path, capsys):
    """The error named the hidden temporary file (.o.tinyloop.PID.partial), not the -o path."""
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    from tinyloop.cli.synth import RandomWeights
    from tinyloop.model.arch import ModelConfig
    from tinyloop.model.presets import PRESETS
    (tmp_path / "c.json").write_text(json.dumps(PRESETS["tiny"].config))
    cfg = ModelConfig.from_dict(PRESETS["tiny"].config)
    safetensors_numpy.save_file(dict(RandomWeights(cfg, 1).items()), str(tmp_path / "ck.safetensors"))
    out = tmp_path / "nowhere" / "o.tinyloop"
    rc, _, err = _cli(capsys, "convert", "--checkpoint", tmp_path / "ck.safetensors", "--config",
                      tmp_path / "c.json", "-o", out)
    line = _one_error(rc, err, str(out), "does not exist")
    assert ".partial" not in line


def test_convert_checkpoint_that_is_a_fifo_is_not_called_missing(tmp_path, capsys):
    fifo = tmp_path / "ck.safetensors"
    os.mkfifo(fifo)
    from tinyloop.model.presets import PRESETS
    (tmp_path / "c.json").write_text(json.dumps(PRESETS["tiny"].config))
    rc, _, err = _cli(capsys, "convert", "--checkpoint", fifo, "--config", tmp_path / "c.json",
                      "-o", tmp_path / "o.tinyloop")
    line = _one_error(rc, err, "not a regular file")
    assert "does not exist" not in line


# ------------------------------------------------------------------ lens
def test_lens_output_without_a_file_name_is_refused(tmp_path, capsys, monkeypatch):
    """-o .png passed the suffix check, and matplotlib wrote '.png.png' while the CLI said
    'wrote .png'."""
    monkeypatch.chdir(tmp_path)
    rc, _, err = _cli(capsys, "lens", "--text", "hi", "--backend", "cpu", "-o", ".png")
    _one_error(rc, err, "--output")
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ inspect --measure
@pytest.mark.parametrize("case", ["missing", "directory"])
def test_inspect_measure_text_errors_name_the_flag(tmp_path, capsys, case):
    path = tmp_path / ("nothere.txt" if case == "missing" else "")
    rc, out, err = _cli(capsys, "inspect", demo_model_path(), "--measure", "--text", path)
    _one_error(rc, err, "--text")
    assert out == ""


@pytest.mark.parametrize("value", ["0", "99"])
def test_inspect_measure_loops_max_out_of_range_names_the_flag(capsys, value):
    rc, _, err = _cli(capsys, "inspect", demo_model_path(), "--measure", "--loops-max", value)
    _one_error(rc, err, f"--loops-max={value}", "16")


# ------------------------------------------------------------------ serve
def test_serve_on_a_port_in_use_is_one_error_line(capsys):
    """uvicorn's own 'ERROR: [Errno 98] ...' log line and exit status 3 came after the model was
    loaded and '[tinyloop] serving ... on http://...' was printed."""
    pytest.importorskip("uvicorn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc, _, err = _cli(capsys, "serve", "--backend", "cpu", "--port", port)
    _one_error(rc, err, f"127.0.0.1:{port}")
    assert "serving" not in err


# ------------------------------------------------------------------ Ctrl-C
def test_ctrl_c_while_building_the_parser_is_not_a_traceback(capsys, monkeypatch):
    from tinyloop.cli import main as main_mod

    def interrupted():
        raise KeyboardInterrupt
    monkeypatch.setattr(main_mod, "build_parser", interrupted)
    try:
        rc = main_mod.main(["run", "x.yaml"])
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped main() (a traceback on the terminal)")
    assert rc == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_ctrl_c_while_writing_output_jsonl_leaves_no_partial_file(tmp_path, capsys, monkeypatch):
    """The JSONL was written in place: an interrupt (or a full disk) after the first record left a
    file that looks like the output of a run of fewer prompts."""
    from tinyloop.runtime.config import GenerateStats
    calls = []
    real = GenerateStats.to_dict

    def to_dict(self):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self)
    monkeypatch.setattr(GenerateStats, "to_dict", to_dict)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(BASE.replace('["def f(x):"]', '["def f(x):", "import os"]') + "output_jsonl: o.jsonl\n")
    rc, _, err = _cli(capsys, "run", cfg)
    assert rc == 130 and err.splitlines()[-1] == "interrupted"
    assert sorted(os.listdir(tmp_path)) == ["cfg.yaml"]


def test_ppl_loops_that_name_no_depth_are_refused(tmp_path, capsys):
    """`ppl --loops ",,"` names no depth: an error, not the model's default depth silently."""
    from tinyloop.cli.main import main
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x\n" * 8)
    rc = main(["ppl", "demo", "--text", str(text), "--loops", ",,", "--window", "16", "--backend", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and "--loops=',,' names no loop count" in err, err
