"""Models shipped inside the package (the data files next to this module)."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ConfigError

MODELS_DIR = Path(__file__).resolve().parent
DEMO_MODEL = "demo.tinyloop"
#: The name load_model / inspect take for the shipped demo model (as does path None).
DEMO = "demo"


def demo_model_path() -> str:
    """Path of the embedded demo model (used when a run config names no model)."""
    p = MODELS_DIR / DEMO_MODEL
    if not p.is_file():
        raise ConfigError(f"the embedded demo model {p} is missing; set `model:` in the run config")
    return str(p)


def model_path(path) -> str:
    """The file a model argument names: None or "demo" is the shipped demo model; else a str or
    os.PathLike (an int is refused: it would be taken for a file descriptor)."""
    if path is None or (isinstance(path, str) and path == DEMO):
        return demo_model_path()
    if isinstance(path, bool) or not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"path={path!r} must be a model file path (str or os.PathLike), None or "
                          f"{DEMO!r} (the shipped demo model), not {type(path).__name__}")
    p = os.fspath(path)
    if not isinstance(p, str):
        raise ConfigError(f"path={path!r} must name a file by a str path, not bytes")
    return p
