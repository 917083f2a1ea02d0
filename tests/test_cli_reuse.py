"""`tinyloop run` with reuse sections: a `prefix:` served through a prefix pool and a `resume:`
section served from resume handles give the tokens of plain generate, show the reuse in their
per-prompt stats, and refuse bad settings before any work."""

from __future__ import annotations

import json

import pytest

import tinyloop as tl
from tinyloop.cli.main import main
from tinyloop.runtime.config import ResumeConfig, RunConfig, load_run_config

HEAD = 'model: ""\nbackend: cpu\nmax_seq_len: 128\nstream: false\n'


def _cfg(tmp_path, text, name="cfg.yaml"):
    p = tmp_path / name
    p.write_text(HEAD + text)
    return str(p)


def _records(path):
    return [json.loads(line) for line in open(path)]


@pytest.fixture(scope="module")
def demo():
    m = tl.load_model(None, backend="cpu", max_seq_len=128)
    yield m
    tl.free_model(m)


def test_prefix_run_reuses_the_prefix_and_keeps_the_tokens(tmp_path, capsys, demo):
    out = tmp_path / "out.jsonl"
    cfg = _cfg(tmp_path, 'prefix: "import os\\nimport sys\\n\\n"\nprompts: ["def f(x):", "class A:"]\n'
                         f'generate: {{max_tokens: 6, loops: 3}}\noutput_jsonl: "{out}"\n')
    assert main(["run", cfg]) == 0
    err = capsys.readouterr().err
    assert "registered in a prefix pool" in err
    n_prefix = len(demo.tokenizer.encode("import os\nimport sys\n\n"))
    assert err.count(f"{n_prefix} prompt tokens reused") == 2
    for r in _records(out):
        assert r["stats"]["reused_tokens"] == n_prefix
        want = tl.generate(demo, r["prompt_ids"], tl.GenerateConfig(max_tokens=6, loops=3))
        assert r["prompt_ids"] + r["output_ids"] == want


def test_prefix_run_with_the_speculative_mode(tmp_path, capsys, demo):
    out = tmp_path / "spec.jsonl"
    cfg = _cfg(tmp_path, 'mode: speculative\nprefix: "import os\\n"\nprompts: ["def f(x):"]\n'
                         'speculative: {max_tokens: 6, draft_loops: 1, verify_loops: 4}\n'
                         f'output_jsonl: "{out}"\n')
    assert main(["run", cfg]) == 0
    (r,) = _records(out)
    assert r["stats"]["reused_tokens"] > 0 and r["stats"]["decoder"] == "speculative"
    assert r["prompt_ids"] + r["output_ids"] == tl.generate(demo, r["prompt_ids"],
                                                            tl.GenerateConfig(max_tokens=6, loops=4))


def test_resume_run_serves_every_depth_exactly(tmp_path, capsys, demo):
    out = tmp_path / "resume.jsonl"
    cfg = _cfg(tmp_path, 'prompts: ["def f(x):", "import os"]\ngenerate: {max_tokens: 5}\n'
                         f'resume: {{loops_used: 2, depths: [2, 3, 6]}}\noutput_jsonl: "{out}"\n')
    assert main(["run", cfg]) == 0
    err = capsys.readouterr().err
    assert err.count("[L=6]") == 2 and "row-iterations of the loop" in err
    recs = _records(out)
    assert [r["stats"]["loops_used"] for r in recs] == [2, 3, 6, 2, 3, 6]
    for r in recs:
        L = r["stats"]["loops_used"]
        assert r["prompt_ids"] + r["output_ids"] == tl.generate(demo, r["prompt_ids"],
                                                                tl.GenerateConfig(max_tokens=5, loops=L))


@pytest.mark.parametrize("text, match", [
    ('prefix: 3\n', "prefix must be a non-empty string"),
    ('prefix: ""\n', "prefix must be a non-empty string"),
    ('mode: batch\nprefix: "x"\n', "mode batch"),
    ('resume: {loops_used: 2}\n', "depths must be a non-empty list"),
    ('resume: {loops_used: 2, depths: [1]}\n', "resume depth=1"),
    ('resume: {loops_used: 0, depths: [2]}\n', "loops_used=0"),
    ('resume: {loops_used: 2, depths: "4"}\n', "depths must be"),
    ('resume: {loops_used: 2, depths: [4], extra: 1}\n', "unknown key 'extra'"),
    ('resume: [2, 4]\n', "resume must be a mapping"),
    ('resume: {depths: [4]}\ngenerate: {loops: 4}\n', "generate.loops=4 would be ignored"),
    ('resume: {depths: [4]}\nprefix: "x"\n', "separate reuse patterns"),
    ('mode: speculative\nspeculative: {draft_loops: 1}\nresume: {depths: [4]}\n', "mode generate"),
])
def test_bad_reuse_settings_are_config_errors(tmp_path, text, match):
    with pytest.raises(tl.ConfigError, match=match):
        load_run_config(_cfg(tmp_path, 'prompts: ["a"]\n' + text))


def test_model_dependent_reuse_settings_fail_before_any_output(tmp_path, capsys):
    for text, match in [('resume: {loops_used: 2, depths: [99]}\n', "loops=99"),
                        ('prefix: "x"\ngenerate: {cache_window: 8}\n', "prefix_reuse"),
                        ('resume: {depths: [4]}\ngenerate: {beam_size: 2}\n', "warm_start")]:
        assert main(["run", _cfg(tmp_path, 'prompts: ["def f(x):"]\n' + text)]) == 2
        cap = capsys.readouterr()
        assert "def f" not in cap.out and match in cap.err.splitlines()[-1]


def test_resume_config_typed():
    assert ResumeConfig(loops_used=1, depths=[1, 2]).depths == (1, 2)
    with pytest.raises(tl.ConfigError, match="allowed fields"):
        ResumeConfig(loops=3)
    assert RunConfig(prompts=["a"], resume={"loops_used": 1, "depths": [3]}).resume.depths == (3,)
