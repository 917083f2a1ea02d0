"""pyproject.toml lists every package of the source tree (a non-editable install ships exactly
those), and the shipped data files exist."""

from __future__ import annotations

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_package_is_listed():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(conf["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "tinyloop").rglob("__init__.py")}
    assert found - listed == set(), f"packages missing from pyproject.toml: {sorted(found - listed)}"
    extra = listed - found - set(conf.get("package-dir", {}))
    assert extra == set(), f"pyproject.toml lists packages that do not exist: {sorted(extra)}"


def test_shipped_data():
    assert (ROOT / "tinyloop" / "models" / "demo.tinyloop").is_file()
    assert (ROOT / "configs" / "compat.yaml").is_file()
