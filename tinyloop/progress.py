"""Progress bars (tqdm) for long-running commands: shown on stderr while stdout is a terminal,
hidden otherwise (pipes, files, CI logs), so output that is read by programs stays clean.
``TINYLOOP_PROGRESS=0`` hides them, ``=1`` shows them even when stdout is not a terminal."""

from __future__ import annotations

import os
import sys
from typing import Iterable, Optional

PROGRESS_ENV = "TINYLOOP_PROGRESS"


def enabled() -> bool:
    env = os.environ.get(PROGRESS_ENV, "")
    if env in ("0", "1"):
        return env == "1"
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):      # a replaced or closed stdout
        return False


def bar(iterable: Iterable, desc: str, total: Optional[int] = None, unit: str = "it") -> Iterable:
    """`iterable` wrapped in a tqdm bar when bars are enabled (and tqdm is installed), else itself."""
    if not enabled():
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, desc=desc, total=total, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True)
