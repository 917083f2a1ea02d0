"""``tinyloop bench``: the GPU decode benchmark in bench/decode_bench.py (source tree only)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import ConfigError

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def _module():
    if not (BENCH_DIR / "decode_bench.py").is_file():
        return None
    if str(BENCH_DIR.parent) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR.parent))
    from bench import decode_bench
    return decode_bench


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", aliases=["benchmark"],
                              help="GPU decode benchmark vs PyTorch (bench/decode_bench.py); alias: benchmark",
                              description="GPU decode benchmark: TinyLoop against PyTorch baselines in the same "
                                          "process (bench/decode_bench.py; a source checkout is needed)")
    mod = _module()
    if mod is not None:
        mod.add_arguments(p)
    return p


def run(args) -> int:
    mod = _module()
    if mod is None:
        raise ConfigError(f"the benchmarks live in the source tree ({BENCH_DIR} is missing); "
                          f"run from a checkout of the repository")
    if getattr(args, "json", None) is not None:     # written after each section: checked before any work
        from .run import _check_writable
        _check_writable(args.json, "--json", inputs=(getattr(args, "model", None),))
    return mod.run(args)
