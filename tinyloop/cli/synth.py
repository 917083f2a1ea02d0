"""``tinyloop synth --preset NAME -o FILE``: write a random-weight model of a named shape
(see :mod:`tinyloop.model.presets`). Also :func:`synth_model`, the same as a Python function.

Weights: seeded normal, std 0.02 for ``embed``, ``head`` and the input projections; the output
projections ``wo`` and ``w_down`` use ``0.02 / sqrt(2 * n_layers(max_loops))`` so the residual stays
bounded even at the largest loop count; norms are ones. Every tensor has its own generator seeded
from (seed, tensor name), so a tensor's values do not depend on the order tensors are produced in.

Tensors are generated lazily, one at a time, when the writer asks for them; peak memory is then
about one float32 tensor plus what the writer keeps (the 360m preset's largest tensor, embed, is
412 MB in float32).
"""

from __future__ import annotations

import argparse
import math
import operator
import os
import sys
import zlib
from typing import Iterator, Mapping, Optional

import numpy as np

from ..model.arch import QUANT_TYPES, ModelConfig, is_matrix, required_tensors
from ..errors import ConfigError, TinyLoopError
from ..model.presets import PRESETS, check_quant_shapes, get_preset, make_quant


class RandomWeights(Mapping):
    """Lazy {name: float32 array} of seeded random weights for `cfg`; each access regenerates the
    same values."""

    def __init__(self, cfg: ModelConfig, seed: int = 0, std: float = 0.02) -> None:
        try:
            value = None if isinstance(seed, bool) else operator.index(seed)
        except TypeError:
            value = None
        if value is None or value < 0:   # (numpy's seed sequence takes non-negative integers only)
            raise ConfigError(f"seed={seed!r} must be an integer >= 0")
        self.cfg = cfg
        self.seed = value
        self.std = float(std)
        self.shapes = required_tensors(cfg)
        self.out_std = std / math.sqrt(2 * cfg.n_layers(cfg.max_loops))

    def __getitem__(self, name: str) -> np.ndarray:
        shape = self.shapes[name]
        if not is_matrix(name):
            return np.ones(shape, dtype=np.float32)
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
        std = self.out_std if name.rsplit(".", 1)[-1] in ("wo", "w_down") else self.std
        w = rng.standard_normal(shape, dtype=np.float32)
        w *= np.float32(std)
        return w

    def __contains__(self, name) -> bool:  # Mapping's default would load the tensor
        return name in self.shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def synth_model(preset: str, path, seed: int = 0, *, quant: Optional[str] = None,
                group_size: Optional[int] = None, embed_quant: Optional[str] = None,
                head_quant: Optional[str] = None, tokenizer: Optional[dict] = None,
                metadata: Optional[dict] = None, **overrides) -> ModelConfig:
    """Write a random-weight model of `preset` to `path` and return its config.

    `overrides` replace ModelConfig fields of the preset (e.g. ``tied_embeddings=True``);
    `quant` / `group_size` / `embed_quant` / `head_quant` replace the preset's storage choices
    (passing `quant` alone also sets embed/head to it)."""
    from ..model.format import write_model

    p = get_preset(preset)
    cfg = ModelConfig.from_dict({**p.config, **overrides})
    if quant is not None:
        q, e, h = quant, embed_quant or quant, head_quant or quant
    else:
        q, e, h = p.quant, embed_quant or p.embed_quant, head_quant or p.head_quant
    gs = p.group_size if group_size is None else group_size
    tq = make_quant(cfg, q, gs, e, h)
    check_quant_shapes(cfg, tq)
    meta = {"generator": "tinyloop synth", "preset": preset, "seed": str(seed)}
    meta.update(metadata or {})
    write_model(path, cfg, RandomWeights(cfg, seed), quant=tq,
                tokenizer=tokenizer, metadata=meta)
    return cfg


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "synth", help="write a random-weight model of a named shape",
        description="Write a random-weight model of a named shape (presets: "
                    + ", ".join(sorted(PRESETS)) + ").")
    p.add_argument("--preset", required=True, choices=sorted(PRESETS))
    p.add_argument("-o", "--output", required=True, help="output .tinyloop file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quant", choices=QUANT_TYPES, default=None,
                   help="storage of every matrix (default: the preset's)")
    p.add_argument("--group-size", type=int, default=None,
                   help="quantization group size (default: the preset's)")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    try:
        cfg = synth_model(args.preset, args.output, seed=args.seed, quant=args.quant,
                          group_size=args.group_size)
    except (TinyLoopError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from ..analysis.memory import format_bytes, parameter_count
    size = os.path.getsize(args.output)
    print(f"wrote {args.output}: preset {args.preset}, {parameter_count(cfg):,} parameters, "
          f"{format_bytes(size)}")
    return 0
