"""Models shipped inside the package (the data files next to this module)."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ConfigError

MODELS_DIR = Path(__file__).resolve().parent
DEMO_MODEL = "demo.tinyloop"
#: The name load_model / inspect take for the shipped demo model (as does path None).
DEMO = "demo"
#: Shipped models by the name load_model / inspect take: the demo model, and its exit-trained
#: sibling (same architecture, trained with the loss at every depth and a learned exit gate;
#: MODEL_CARD.md, "The exit-trained sibling").
SHIPPED = {DEMO: DEMO_MODEL, "demo-exit": "demo-exit.tinyloop"}


def demo_model_path() -> str:
    """Path of the embedded demo model (used when a run config names no model)."""
    p = MODELS_DIR / DEMO_MODEL
    if not p.is_file():
        raise ConfigError(f"the embedded demo model {p} is missing; set `model:` in the run config")
    return str(p)


def model_path(path) -> str:
    """The file a model argument names: None or "demo" is the shipped demo model, "demo-exit" its
    exit-trained sibling; else a str or os.PathLike (an int is refused: it would be taken for a
    file descriptor)."""
    if path is None or (isinstance(path, str) and path == DEMO):
        return demo_model_path()
    if isinstance(path, str) and path in SHIPPED:
        p = MODELS_DIR / SHIPPED[path]
        if not p.is_file():
            raise ConfigError(f"the shipped model {path!r} ({p}) is missing from this installation")
        return str(p)
    if isinstance(path, bool) or not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"path={path!r} must be a model file path (str or os.PathLike), None or the name "
                          f"of a shipped model ({', '.join(map(repr, SHIPPED))}), not {type(path).__name__}")
    p = os.fspath(path)
    if not isinstance(p, str):
        raise ConfigError(f"path={path!r} must name a file by a str path, not bytes")
    return p
