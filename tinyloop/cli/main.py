"""``python -m tinyloop``: run CFG.yaml | inspect | convert | synth | ppl | lens | bench | serve."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

from ..errors import TinyLoopError

#: subcommand modules, each exposing add_parser(subparsers) and run(args) -> int
COMMANDS = ("run", "inspect_cmd", "convert", "synth", "ppl", "lens", "bench", "serve")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tinyloop", description="Inference runtime for looped transformers")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        mod = importlib.import_module(f"tinyloop.cli.{name}")
        mod.add_parser(sub).set_defaults(_run=mod.run)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    try:
        args = build_parser().parse_args(argv)   # (imports every subcommand: Ctrl-C may land here)
        return int(args._run(args) or 0)
    except TinyLoopError as exc:
        print(f"error: {' '.join(str(exc).splitlines())}", file=sys.stderr)
        return 2
    except (OSError, UnicodeError) as exc:     # the environment (files, disks, pipes), not a bug
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
