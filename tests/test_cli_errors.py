"""Every bad value given to the CLI or a run config is one `error:` line on stderr and exit status
2, never a traceback (run in a subprocess, as a user meets it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

DEMO = "demo"          # load_model's name for the shipped model; the CLI takes paths


def _cli(tmp_path, *argv):
    r = subprocess.run([sys.executable, "-m", "tinyloop", *map(str, argv)], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    return r.returncode, r.stdout, r.stderr


def _one_error(rc, err):
    lines = [ln for ln in err.splitlines() if not ln.startswith("[tinyloop]")]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err


CONFIGS = {
    "not_utf8": b"\xff\xfe prompts: [x]\n",
    "not_yaml": b": : :\n  - ]",
    "a_list": b"[1, 2]\n",
    "prompts_not_list": b"prompts: x\n",
    "prompt_not_str": b"prompts: [1]\n",
    "negative_count": b"prompts: [x]\ngenerate: {max_tokens: -1}\n",
    "wrong_type": b"prompts: [x]\nmax_seq_len: abc\n",
    "unknown_key": b"prompts: [x]\nbogus: 1\n",
    "output_is_dir": b"prompts: [x]\noutput_jsonl: .\n",
    "output_in_missing_folder": b"prompts: [x]\noutput_jsonl: nowhere/o.jsonl\n",
    "prompts_file_is_dir": b"prompts_file: .\n",
    "prompts_file_not_utf8": b"prompts_file: bad.txt\n",
    "model_is_dir": b"prompts: [x]\nmodel: .\n",
    "bad_mode": b"prompts: [x]\nmode: nope\n",
    "bad_options": b"prompts: [x]\ngenerate: {decoder: speculative, options: 3}\n",
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_bad_run_configs(tmp_path, name):
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\n")
    (tmp_path / "cfg.yaml").write_bytes(CONFIGS[name])
    rc, out, err = _cli(tmp_path, "run", "cfg.yaml")
    _one_error(rc, err)


def test_bad_command_lines(tmp_path):
    (tmp_path / "t.txt").write_text("hello world, some text to score " * 4)
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\n")
    from tinyloop.models import demo_model_path
    m = demo_model_path()
    for argv in (["run", "missing.yaml"], ["run", "."],
                 ["ppl", m, "--text", "bad.txt"], ["ppl", m, "--text", "missing.txt"],
                 ["ppl", m, "--text", "t.txt", "--window", "-3"], ["ppl", m, "--text", "t.txt", "--json", "."],
                 ["ppl", m, "--text", "t.txt", "--max-windows", "0"],
                 ["ppl", m, "--text", "t.txt", "--window", "4", "--cache-mode", "bogus"],
                 ["inspect", "."], ["inspect", m, "--max-seq-len", "-5"],
                 ["synth", "--preset", "tiny", "-o", "."], ["synth", "--preset", "tiny", "-o", "nowhere/x.tinyloop"]):
        rc, out, err = _cli(tmp_path, *argv)
        _one_error(rc, err)
