"""Models shipped inside the package (the data files next to this module)."""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError

MODELS_DIR = Path(__file__).resolve().parent
DEMO_MODEL = "demo.tinyloop"


def demo_model_path() -> str:
    """Path of the embedded demo model (used when a run config names no model)."""
    p = MODELS_DIR / DEMO_MODEL
    if not p.is_file():
        raise ConfigError(f"the embedded demo model {p} is missing; set `model:` in the run config")
    return str(p)
