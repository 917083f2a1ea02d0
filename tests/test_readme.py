"""Every Python snippet of README.md runs as written (on the CPU here: backend "auto" finds no GPU)."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SNIPPETS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), re.S)


def test_readme_has_snippets():
    assert len(SNIPPETS) >= 2


@pytest.mark.parametrize("i", range(len(SNIPPETS)))
def test_readme_snippet_runs(i, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    exec(compile(SNIPPETS[i], f"README.md snippet {i}", "exec"), {"__name__": "__readme__"})
