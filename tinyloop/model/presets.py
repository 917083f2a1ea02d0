"""Named model shapes for random-weight models (``tinyloop synth``) and tests.

``PRESETS[name]`` is a :class:`Preset`: ModelConfig keyword arguments, the default quantization of
the block matrices, its group size, and the quantization of ``embed`` / ``head`` (None = same as
the block matrices). Norms are always stored f32.
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional

from .arch import ModelConfig, TensorQuant, is_matrix, required_tensors
from ..errors import ConfigError


class Preset(NamedTuple):
    config: dict
    """ModelConfig keyword arguments."""
    quant: str
    """Quantization type of the block matrices (f32, f16, q8, q4, q2)."""
    group_size: int
    """Group size of every quantized matrix (ignored for f32/f16)."""
    embed_quant: Optional[str] = None
    """Quantization of `embed`; None = `quant`."""
    head_quant: Optional[str] = None
    """Quantization of `head`; None = `quant`."""


PRESETS: Dict[str, Preset] = {
    # Smallest useful model: byte vocabulary, one block in each part. Fast enough for any unit test.
    "tiny": Preset(
        config=dict(vocab_size=256, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128,
                    n_pre=1, n_loop=1, n_post=1, default_loops=4, max_loops=16),
        quant="q4", group_size=32, embed_quant="f16", head_quant="f16"),
    # CPU-test sized: two shared loop layers and input injection, to exercise those code paths.
    "small": Preset(
        config=dict(vocab_size=512, d_model=128, n_heads=4, n_kv_heads=2, d_ff=256,
                    n_pre=1, n_loop=2, n_post=1, default_loops=4, max_loops=16, loop_inject="add"),
        quant="q4", group_size=64, embed_quant="f16", head_quant="f16"),
    # ~360M-parameter shape (GPU benchmarks): everything INT4, group 128, embed and head included.
    "360m": Preset(
        config=dict(vocab_size=50304, d_model=2048, n_heads=16, n_kv_heads=16, d_ff=5632,
                    n_pre=2, n_loop=1, n_post=0, default_loops=8, max_loops=32,
                    tied_embeddings=False),
        quant="q4", group_size=128),
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; available: {sorted(PRESETS)}") from None


def make_quant(cfg: ModelConfig, quant: str, group_size: int, embed_quant: Optional[str] = None,
               head_quant: Optional[str] = None) -> Dict[str, TensorQuant]:
    """Per-tensor quantization for every required tensor: norms f32, embed/head as given (None =
    `quant`), other matrices `quant`; `group_size` is used for the quantized types only."""

    def tq(t: str) -> TensorQuant:
        return TensorQuant(t, group_size if t in ("q8", "q4", "q2") else 0)

    out: Dict[str, TensorQuant] = {}
    for name in required_tensors(cfg):
        if not is_matrix(name):
            out[name] = TensorQuant("f32")
        elif name == "embed":
            out[name] = tq(embed_quant or quant)
        elif name == "head":
            out[name] = tq(head_quant or quant)
        else:
            out[name] = tq(quant)
    return out


def valid_group_sizes(in_features: int, limit: int = 4096):
    """Group sizes (multiples of 8) that divide `in_features`, ascending."""
    return [g for g in range(8, min(in_features, limit) + 1, 8) if in_features % g == 0]


def check_quant_shapes(cfg: ModelConfig, quant: Dict[str, TensorQuant]) -> None:
    """Raise ConfigError when a quantized matrix's in_features is not a multiple of its group size,
    naming the tensors and suggesting a group size that fits all of them."""
    shapes = required_tensors(cfg)
    bad = {}
    ins = set()
    for name, tq in quant.items():
        if tq.bits:
            cols = shapes[name][-1]
            ins.add(cols)
            if cols % tq.group_size:
                bad[name] = (cols, tq.group_size)
    if not bad:
        return
    common = None
    for c in ins:
        s = set(valid_group_sizes(c))
        common = s if common is None else common & s
    requested = max(g for _, g in bad.values())
    common = sorted(common or ())
    if common:
        below = [g for g in common if g <= requested]
        hint = f"use --group-size {below[-1] if below else common[0]} (valid for every quantized " \
               f"matrix: {common})"
    else:
        hint = "no group size (a multiple of 8) divides every in_features; use --quant f16 or f32"
    items = sorted(bad.items())
    listed = ", ".join(f"{n} (in_features={c})" for n, (c, _) in items[:6])
    more = f" and {len(items) - 6} more" if len(items) > 6 else ""
    raise ConfigError(f"in_features is not a multiple of group_size={requested} for {listed}{more}; "
                      f"{hint}")
