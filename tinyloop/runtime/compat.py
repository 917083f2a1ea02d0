"""The mode-composition matrix (configs/compat.yaml) loaded as data and checked per request.

``check_request(context, config)`` is called by every entry point before any work. It finds the
modes the request switches on (each row's ``when`` rule), then raises

* NotImplementedModeError when the context or an active mode is ``planned``;
* IncompatibleModesError when a cell is ``rejected`` or a ``pairs`` rule matches;

and, once nothing is refused, emits a ``CompatWarning`` for ``partial`` cells. It returns the list
of active modes. ``context`` may list several columns (a decoder's and a reuse entry point's):
all of them are checked before any warning.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import os
import warnings
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ..errors import ConfigError, IncompatibleModesError, NotImplementedModeError

CELLS = ("ok", "partial", "rejected")
STATUSES = ("implemented", "planned")
_OPS = {"==": operator.eq, "!=": operator.ne, ">": operator.gt, ">=": operator.ge,
        "<": operator.lt, "<=": operator.le}


class CompatWarning(UserWarning):
    """A mode combination marked `partial`: it runs, but is not exhaustively tested."""


@dataclass(frozen=True)
class ModeRule:
    name: str
    status: str
    field: str
    op: str
    value: Any
    cells: Mapping[str, str]
    why: Mapping[str, str] = None      # context -> the rationale of a rejected cell (the row's ``why``)

    def active(self, config: Any) -> bool:
        v = getattr(config, self.field, None)
        try:
            return bool(_OPS[self.op](v, self.value))
        except TypeError:   # e.g. None > 0: the knob is not set
            return False

    def describe(self, config: Any) -> str:
        return f"{self.name} ({self.field}={getattr(config, self.field, None)!r})"


@dataclass(frozen=True)
class CompatMatrix:
    contexts: Mapping[str, str]                       # name -> status
    modes: Mapping[str, ModeRule]
    pairs: Tuple[Tuple[frozenset, str], ...]
    source: str

    def active_modes(self, config: Any) -> List[ModeRule]:
        return [m for m in self.modes.values() if m.active(config)]

    def check(self, context: Union[str, Sequence[str]], config: Any) -> List[str]:
        """Check one request; see the module docstring. `context`: its column, or every column it
        is checked against (a decoder's and a reuse entry point's: prefix_reuse, warm_start), in
        order. Every column is checked before any ``partial`` warning is given: a refused request
        warns of nothing. Returns the names of its active modes."""
        contexts = (context,) if isinstance(context, str) else tuple(context)
        active = self.active_modes(config)
        names = {m.name for m in active}
        partial = []
        for i, ctx in enumerate(contexts):
            if ctx not in self.contexts:
                raise IncompatibleModesError(
                    f"unknown decode context {ctx!r}; {self.source} lists {sorted(self.contexts)}")
            if self.contexts[ctx] == "planned":
                raise NotImplementedModeError(
                    f"{ctx} decoding is not implemented yet ({self.source}: contexts.{ctx} is planned)")
            for m in active:
                if m.status == "planned":
                    raise NotImplementedModeError(
                        f"mode {m.describe(config)} is not implemented yet ({self.source}: modes.{m.name} "
                        f"is planned)")
            for m in active:
                cell = m.cells[ctx]
                if cell == "rejected":
                    why = (m.why or {}).get(ctx)
                    raise IncompatibleModesError(
                        f"mode {m.describe(config)} is rejected in {ctx} decoding"
                        f"{': ' + why if why else ''} ({self.source}: modes.{m.name}.{ctx} = rejected)")
                if cell == "partial":
                    partial.append((m.name, ctx))
            if i == 0:
                for pair, reason in self.pairs:
                    if pair <= names:
                        a, b = sorted(pair)
                        raise IncompatibleModesError(
                            f"modes {a} and {b} cannot be combined: {reason} ({self.source}: pairs)")
        # only now, with nothing refused: a warning before a refusal would say "it works" of a
        # request that does not run (and use up the default filter's one showing of the message)
        for name, ctx in partial:
            warnings.warn(f"mode {name} in {ctx} decoding is partial: it works but is not "
                          f"exhaustively tested ({self.source})", CompatWarning, stacklevel=3)
        return sorted(names)


def _request_fields() -> Dict[str, Any]:
    """GenerateConfig field -> its default (None where it has a factory): what ``when`` may name."""
    from .config import GenerateConfig
    return {f.name: (None if f.default is dataclasses.MISSING else f.default)
            for f in dataclasses.fields(GenerateConfig)}


def _parse(data: Any, source: str) -> CompatMatrix:
    def bad(msg: str) -> ConfigError:
        return ConfigError(f"{source}: {msg}")

    if not isinstance(data, dict) or set(data) - {"version", "contexts", "modes", "pairs"}:
        raise bad("top level must be a mapping with keys version, contexts, modes, pairs")
    if data.get("version") != 1 or isinstance(data.get("version"), bool):
        raise bad(f"version {data.get('version')!r} is not supported (expected 1)")
    for key, kind in (("contexts", dict), ("modes", dict), ("pairs", list)):
        if not isinstance(data.get(key) or kind(), kind):
            raise bad(f"{key} must be a {'mapping' if kind is dict else 'list'}, got {data[key]!r:.80}")
    fields = _request_fields()
    contexts: Dict[str, str] = {}
    for name, c in (data.get("contexts") or {}).items():
        if not isinstance(c, dict) or c.get("status") not in STATUSES:
            raise bad(f"contexts.{name}.status must be one of {STATUSES}")
        contexts[name] = c["status"]
    modes: Dict[str, ModeRule] = {}
    for name, m in (data.get("modes") or {}).items():
        if not isinstance(m, dict) or set(m) - {"status", "when", "cells", "why", "doc"}:
            raise bad(f"modes.{name} must have keys status, when, cells (and optionally why, doc)")
        if m.get("status") not in STATUSES:
            raise bad(f"modes.{name}.status must be one of {STATUSES}")
        when = m.get("when")
        if not (isinstance(when, list) and len(when) == 3 and isinstance(when[1], str) and when[1] in _OPS):
            raise bad(f"modes.{name}.when must be [field, op, value] with op in {sorted(_OPS)}")
        if not isinstance(when[0], str) or when[0] not in fields:
            # an unknown field would leave the mode switched off for every request, silently
            raise bad(f"modes.{name}.when names {when[0]!r}, which is not a GenerateConfig field "
                      f"(one of {', '.join(sorted(fields))})")
        default = fields[when[0]]
        if default is not None:
            try:
                _OPS[when[1]](default, when[2])
            except TypeError:
                raise bad(f"modes.{name}.when compares {when[0]} (a {type(default).__name__}) with "
                          f"{when[2]!r}, a {type(when[2]).__name__}: the rule could never match") from None
        cells = m.get("cells") or {}
        if (not isinstance(cells, dict) or set(cells) != set(contexts)
                or any(v not in CELLS for v in cells.values())):
            raise bad(f"modes.{name}.cells must give one of {CELLS} for each context {sorted(contexts)}")
        why = m.get("why") or {}
        if not isinstance(why, dict) or any(
                cells.get(ctx) != "rejected" or not (isinstance(text, str) and text.strip())
                for ctx, text in why.items()):
            raise bad(f"modes.{name}.why must map rejected contexts (of "
                      f"{sorted(c for c, v in cells.items() if v == 'rejected')}) to their rationale, got {why!r:.120}")
        modes[name] = ModeRule(name, m["status"], when[0], when[1], when[2], dict(cells), dict(why))
    pairs = []
    for i, p in enumerate(data.get("pairs") or []):
        ms = p.get("modes") if isinstance(p, dict) else None
        if not (isinstance(ms, list) and len(ms) == 2 and all(isinstance(x, str) and x in modes for x in ms)
                and ms[0] != ms[1]):
            raise bad(f"pairs[{i}].modes must name two different known modes (of {sorted(modes)}), got {ms!r}")
        reason = p.get("reason")
        if not (isinstance(reason, str) and reason.strip()):
            raise bad(f"pairs[{i}] ({ms[0]} + {ms[1]}) needs a reason: the rationale the rejection names")
        pairs.append((frozenset(ms), reason))
    return CompatMatrix(contexts, modes, tuple(pairs), source)


def compat_path() -> str:
    """The matrix file: $TINYLOOP_COMPAT, the source tree's configs/compat.yaml, or the installed copy."""
    env = os.environ.get("TINYLOOP_COMPAT")
    if env:
        return env
    tree = Path(__file__).resolve().parents[2] / "configs" / "compat.yaml"
    if tree.is_file():
        return str(tree)
    return str(resources.files("tinyloop.configs").joinpath("compat.yaml"))


def _strict_loader():
    """yaml.SafeLoader that refuses a key given twice in one mapping (plain PyYAML keeps the last
    one, so a repeated mode row or cell would silently replace the first)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def mapping(loader, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool, type(None))):
                continue            # (construct_mapping refuses an unhashable key)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found the key {key!r} twice", key_node.start_mark)
            seen.add(key)
        return loader.construct_mapping(node, deep=deep)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return Loader


@functools.lru_cache(maxsize=8)
def _load(path: str) -> CompatMatrix:
    import yaml

    try:
        with open(path, "r", encoding="utf-8") as fh:
            data = yaml.load(fh, Loader=_strict_loader())
    except (OSError, ValueError, yaml.YAMLError) as exc:   # (ValueError: not UTF-8, 5000-digit numbers)
        raise ConfigError(f"cannot load the compat matrix {path}: {exc}") from None
    except RecursionError:
        raise ConfigError(f"cannot load the compat matrix {path}: nested too deeply") from None
    # the shipped matrix (source tree or installed copy) by its documented name; any other file
    # (TINYLOOP_COMPAT, a test's) by its own path, so an error points at the file to edit
    here = Path(__file__).resolve()
    shipped = Path(path).resolve() in (here.parents[2] / "configs" / "compat.yaml",
                                       here.parents[1] / "configs" / "compat.yaml")
    return _parse(data, "configs/compat.yaml" if shipped else path)


def load_matrix(path: Optional[str] = None) -> CompatMatrix:
    """The parsed matrix (cached per path)."""
    return _load(path or compat_path())


def check_request(context: Union[str, Sequence[str]], config: Any) -> List[str]:
    """Check a request against configs/compat.yaml before any work (every column in `context`
    before any warning); see the module docstring."""
    return load_matrix().check(context, config)
