"""Group-wise affine quantization of 2-D weights and bit packing of the quantized codes.

A qN tensor (N in 8, 4, 2) of shape (rows, cols) is split along the input (last) dimension into
groups of ``group_size`` consecutive elements. Each group g of row r has a float16 ``scale`` and a
uint8 ``zero`` point, and every element is stored as an N-bit code ``q`` with::

    w ~= (q - zero) * scale        0 <= q, zero < 2**N

computed in float32 (exact: q - zero is a small integer and scale has 11 significant bits).
Codes are packed little-end first: for q4 element 2j sits in the low nibble of byte j, for q2
element 4j sits in the lowest two bits of byte j; q8 is stored unpacked.

The per-group range is [min(w, 0), max(w, 0)]: the zero point is an integer in [0, 2**N - 1], so
0 is always on the quantization grid and the grid must be widened to include it. The scale is
(max - min) / (2**N - 1) rounded *up* to float16, which keeps every element within scale / 2 of
its dequantized value.
"""

from __future__ import annotations

from typing import Dict, Mapping, Tuple

import numpy as np

from .arch import TensorQuant
from ..errors import ConfigError

#: Elements processed per step by :func:`quantize`; bounds the float64 temporaries.
_CHUNK_ELEMENTS = 1 << 22
_F16_MAX = float(np.finfo(np.float16).max)


def _check_bits(bits) -> int:
    if isinstance(bits, bool) or bits not in (2, 4, 8):
        raise ConfigError(f"bits={bits!r} is not one of (2, 4, 8)")
    return bits


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack codes ``q`` (rows, cols), each in [0, 2**bits), into a uint8 array (rows, cols*bits//8).

    q4 puts element 2j in the low nibble of byte j; q2 puts element 4j in the lowest two bits of
    byte j; q8 is a copy as uint8. Raises ConfigError for bad bits, a non-integer or non-2-D
    array, values out of range, or cols not a multiple of 8 // bits.
    """
    bits = _check_bits(bits)
    if not isinstance(q, np.ndarray) or q.dtype.kind not in "iu":
        raise ConfigError(f"codes must be an integer ndarray, got {getattr(q, 'dtype', type(q).__name__)}")
    if q.ndim != 2:
        raise ConfigError(f"codes must be 2-D (rows, cols), got shape {q.shape}")
    per = 8 // bits
    rows, cols = q.shape
    if cols % per:
        raise ConfigError(f"cols={cols} is not a multiple of {per} (required to pack {bits}-bit codes)")
    if q.size:
        lo, hi = int(q.min()), int(q.max())
        if lo < 0 or hi >= 1 << bits:
            raise ConfigError(f"codes must lie in [0, {(1 << bits) - 1}] for {bits}-bit packing, "
                              f"got values in [{lo}, {hi}]")
    q8 = q.astype(np.uint8)
    if per == 1:
        return q8
    parts = q8.reshape(rows, cols // per, per)
    out = parts[..., 0].copy()
    for k in range(1, per):
        out |= parts[..., k] << np.uint8(k * bits)
    return out


def unpack(packed: np.ndarray, bits: int, cols: int) -> np.ndarray:
    """Inverse of :func:`pack`: a uint8 array (rows, cols*bits//8) -> uint8 codes (rows, cols).

    Raises ConfigError for bad bits, a non-uint8 or non-2-D array, or a width that does not match
    ``cols``.
    """
    bits = _check_bits(bits)
    if not isinstance(packed, np.ndarray) or packed.dtype != np.uint8 or packed.ndim != 2:
        raise ConfigError(f"packed codes must be a 2-D uint8 ndarray, got "
                          f"{getattr(packed, 'dtype', type(packed).__name__)} "
                          f"shape {getattr(packed, 'shape', None)}")
    per = 8 // bits
    if isinstance(cols, bool) or not isinstance(cols, (int, np.integer)) or cols < 0 or cols % per:
        raise ConfigError(f"cols={cols!r} must be a non-negative multiple of {per} for {bits}-bit codes")
    rows, width = packed.shape
    if width * per != cols:
        raise ConfigError(f"packed width {width} holds {width * per} {bits}-bit codes, expected cols={cols}")
    if per == 1:
        return packed.copy()
    mask = np.uint8((1 << bits) - 1)
    out = np.empty((rows, width, per), np.uint8)
    for k in range(per):
        np.bitwise_and(packed >> np.uint8(k * bits), mask, out=out[..., k])
    return out.reshape(rows, cols)


def _f16_scale_up(s: np.ndarray) -> np.ndarray:
    """Smallest float16 >= s, elementwise (s >= 0); a zero range gets scale 1."""
    with np.errstate(over="ignore"):
        s16 = s.astype(np.float16)
    low = s16.astype(np.float64) < s
    s16[low] = np.nextafter(s16[low], np.float16(np.inf))
    s16[s == 0] = np.float16(1.0)
    return s16


def _quantize_groups(w: np.ndarray, bits: int, group_size: int):
    rows, cols = w.shape
    groups = cols // group_size
    qmax = (1 << bits) - 1
    codes = np.empty((rows, groups, group_size), np.uint8)
    scales = np.empty((rows, groups), np.float16)
    zeros = np.empty((rows, groups), np.uint8)
    step = max(1, _CHUNK_ELEMENTS // max(cols, 1))
    for r0 in range(0, rows, step):  # blocks of rows, each fully vectorized
        x = np.asarray(w[r0:r0 + step], dtype=np.float64).reshape(-1, groups, group_size)
        lo = np.minimum(x.min(axis=2), 0.0)
        hi = np.maximum(x.max(axis=2), 0.0)
        s16 = _f16_scale_up((hi - lo) / qmax)
        if not np.isfinite(s16).all():
            r, g = np.argwhere(~np.isfinite(s16))[0]
            raise ConfigError(
                f"row {r0 + r}, group {g}: value range [{lo[r, g]:g}, {hi[r, g]:g}] needs a scale above "
                f"the float16 maximum {_F16_MAX:g}; {bits}-bit groups can span at most {_F16_MAX * qmax:g}")
        s = s16.astype(np.float64)
        z = np.clip(np.rint(-lo / s), 0, qmax)
        q = np.rint(x / s[..., None]) + z[..., None]
        np.clip(q, 0, qmax, out=q)
        codes[r0:r0 + step] = q
        scales[r0:r0 + step] = s16
        zeros[r0:r0 + step] = z
    return codes.reshape(rows, cols), scales, zeros


def quantize(w: np.ndarray, tq: TensorQuant, *, name: str = "weights") -> Dict[str, np.ndarray]:
    """Store float array ``w`` as ``tq`` says; returns physical arrays keyed by suffix.

    f32 / f16: ``{"": w as float32 / float16}`` (any shape). qN: ``{"q": packed uint8,
    "scales": float16, "zeros": uint8}`` for a 2-D ``w`` (see the module docstring); every element
    dequantizes to within scale / 2 of its value. ``name`` only labels error messages. Raises
    ConfigError for a non-numeric array, non-finite values, values beyond float16 range (f16 data
    or qN scales), or a shape the quantization does not fit (qN: 2-D, cols a multiple of group_size).
    """
    if not isinstance(tq, TensorQuant):
        raise ConfigError(f"{name}: quantization must be a TensorQuant, got {type(tq).__name__}")
    if not isinstance(w, np.ndarray) or w.dtype.kind not in "fiu":
        raise ConfigError(f"{name}: weights must be a real numeric ndarray, got "
                          f"{getattr(w, 'dtype', type(w).__name__)}")
    tq.physical(name, w.shape)  # raises ConfigError when shape and quantization disagree
    _check_finite(name, w, w, "is not finite")
    if tq.type in ("f32", "f16"):
        with np.errstate(over="ignore"):
            out = np.asarray(w, dtype=np.float32 if tq.type == "f32" else np.float16)
        _check_finite(name, out, w, f"overflows {tq.type}")
        return {"": out}
    try:
        codes, scales, zeros = _quantize_groups(w, tq.bits, tq.group_size)
    except ConfigError as e:
        raise ConfigError(f"{name}: {e}") from None
    return {"q": pack(codes, tq.bits), "scales": scales, "zeros": zeros}


def _check_finite(name: str, a: np.ndarray, source: np.ndarray, what: str) -> None:
    """Raise ConfigError naming the first non-finite element of ``a`` (shown as its ``source`` value)."""
    if a.dtype.kind == "f" and a.size:
        ok = np.isfinite(a)
        if not ok.all():
            idx = tuple(int(i) for i in np.argwhere(~ok)[0])
            raise ConfigError(f"{name}: value {source[idx].item()!r} at index {idx} {what}")


def _expect(name: str, parts: Mapping[str, np.ndarray], key: str, dtype: str,
            shape: Tuple[int, ...]) -> np.ndarray:
    if key not in parts:
        raise ConfigError(f"{name}: missing part {key!r}; got {sorted(parts)}")
    a = parts[key]
    np_dtype = {"f32": np.float32, "f16": np.float16, "u8": np.uint8}[dtype]
    if not isinstance(a, np.ndarray) or a.dtype != np_dtype or a.shape != tuple(shape):
        raise ConfigError(f"{name}: part {key!r} must be {dtype} {tuple(shape)}, got "
                          f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', None)}")
    return a


def dequantize(parts: Mapping[str, np.ndarray], tq: TensorQuant, shape: Tuple[int, ...], *,
               name: str = "weights") -> np.ndarray:
    """Inverse of :func:`quantize`: physical arrays keyed by suffix -> float32 array of ``shape``.

    qN computes ``(q - zero) * scale`` in float32, which is exact and equals the float64 value
    ``(float(q) - float(zero)) * float(scale)``. An f32 part is returned as is (no copy), an f16
    part converted. ``name`` only labels error messages. Raises ConfigError when a part is missing
    or has the wrong dtype or shape.
    """
    if not isinstance(tq, TensorQuant):
        raise ConfigError(f"{name}: quantization must be a TensorQuant, got {type(tq).__name__}")
    shape = tuple(shape)
    physical = tq.physical(name, shape)
    if tq.type in ("f32", "f16"):
        return _expect(name, parts, "", tq.type, shape).astype(np.float32, copy=False)
    specs = {_suffix(name, phys): spec for phys, spec in physical.items()}
    q = _expect(name, parts, "q", *specs["q"])
    scales = _expect(name, parts, "scales", *specs["scales"])
    zeros = _expect(name, parts, "zeros", *specs["zeros"])
    rows, cols = shape
    groups = scales.shape[1]
    codes = unpack(np.ascontiguousarray(q), tq.bits, cols).reshape(rows, groups, tq.group_size)
    out = np.empty((rows, groups, tq.group_size), np.float32)
    np.subtract(codes, zeros[..., None], out=out, dtype=np.float32)
    out *= scales.astype(np.float32)[..., None]
    return out.reshape(shape)


def _suffix(name: str, physical_name: str) -> str:
    return physical_name[len(name) + 1:] if physical_name != name else ""


def quantize_tensor(name: str, w: np.ndarray, tq: TensorQuant) -> Dict[str, np.ndarray]:
    """:func:`quantize` keyed by physical tensor name (``name`` or ``name.q`` / ``.scales`` / ``.zeros``)."""
    parts = quantize(w, tq, name=name)
    return {phys: parts[_suffix(name, phys)] for phys in tq.physical(name, w.shape)}


def dequantize_tensor(name: str, physical: Mapping[str, np.ndarray], tq: TensorQuant,
                      shape: Tuple[int, ...]) -> np.ndarray:
    """:func:`dequantize` of logical tensor ``name`` taking its parts from ``physical`` (keyed by
    physical name, e.g. a :class:`~tinyloop.model.format.ModelFile`'s ``tensors``)."""
    if not isinstance(tq, TensorQuant):
        raise ConfigError(f"{name}: quantization must be a TensorQuant, got {type(tq).__name__}")
    names = tq.physical(name, tuple(shape))
    missing = [n for n in names if n not in physical]
    if missing:
        raise ConfigError(f"{name}: missing physical tensor(s) {missing}")
    return dequantize({_suffix(name, n): physical[n] for n in names}, tq, shape, name=name)


__all__ = ["pack", "unpack", "quantize", "dequantize", "quantize_tensor", "dequantize_tensor"]
