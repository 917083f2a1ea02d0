"""`tinyloop run` as a user meets it: --tokenizer, batch mode's per-prompt stats and its word on
streaming, errors on a line of their own, the benchmark alias, progress bars kept out of pipes."""

from __future__ import annotations

import pytest

from tinyloop.cli.main import build_parser, main

DEMO_BATCH = """model: ""
backend: cpu
max_seq_len: 64
mode: batch
prompts: ["def f(x):", "import os"]
generate: {max_tokens: 4}
"""


def _cfg(tmp_path, text, name="cfg.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_batch_mode_prints_stats_and_says_it_does_not_stream(tmp_path, capsys):
    assert main(["run", _cfg(tmp_path, DEMO_BATCH)]) == 0
    cap = capsys.readouterr()
    assert cap.err.count("[tinyloop] 4 tokens, stop MAX_TOKENS") == 2
    assert cap.err.count("decoded in a lockstep batch of 2 lanes") == 2
    assert "does not stream" in cap.err
    assert "def f(x):" in cap.out and "import os" in cap.out
    assert main(["run", _cfg(tmp_path, DEMO_BATCH + "stream: false\n", "quiet.yaml")]) == 0
    assert "does not stream" not in capsys.readouterr().err


def test_error_is_never_on_the_line_of_an_echoed_prompt(tmp_path, capsys):
    cfg = _cfg(tmp_path, 'model: ""\nbackend: cpu\nmax_seq_len: 16\nprompts: ["def fibonacci(n): return x"]\n'
                         'generate: {max_tokens: 20}\n')
    assert main(["run", cfg]) == 2
    cap = capsys.readouterr()
    assert "def fibonacci" not in cap.out                      # refused before the prompt is echoed
    assert cap.err.splitlines()[-1].startswith("error: prompt_len")


def test_run_tokenizer_option(tmp_path, capsys):
    cfg = _cfg(tmp_path, DEMO_BATCH)
    assert main(["run", cfg, "--tokenizer", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: tokenizer directory")


def test_benchmark_is_an_alias_of_bench():
    a = build_parser().parse_args(["benchmark"])
    b = build_parser().parse_args(["bench"])
    assert a._run is b._run


def test_progress_bars_hidden_when_stdout_is_not_a_terminal(monkeypatch, capsys):
    from tinyloop import progress
    monkeypatch.delenv(progress.PROGRESS_ENV, raising=False)
    items = [1, 2, 3]
    assert progress.bar(items, "x") is items                      # pytest's stdout is not a terminal
    monkeypatch.setenv(progress.PROGRESS_ENV, "1")
    pytest.importorskip("tqdm")
    assert list(progress.bar(items, "x")) == items and progress.bar(items, "x") is not items
    monkeypatch.setenv(progress.PROGRESS_ENV, "0")
    assert progress.bar(items, "x") is items


def test_every_bench_option_has_help():
    import argparse
    from tinyloop.cli import bench
    p = bench.add_parser(argparse.ArgumentParser().add_subparsers())
    for action in p._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"bench option {action.option_strings} has no help"
