"""The built-in KV storage codecs: their formats and float32 numpy references.

fp32   the row as float32 (exact).
fp16   the row as IEEE half (round to nearest even).
int8   symmetric, per row (one position, one KV head): ``amax = max|x|``, ``scale = amax / 127``,
       ``q = clip(rint(x * (127 / amax)), -127, 127)``, read back as ``q * scale``.
int4   asymmetric, per row: ``lo = min x``, ``r = max x - lo``, ``scale = r / 15``,
       ``q = clip(rint((x - lo) * (15 / r)), 0, 15)``, two codes per byte (even dim in the low
       nibble), read back as ``q * scale + lo`` (the zero point is stored as the offset ``lo``).

A row whose amax (int8) or r (int4) is below TINY = 2**-120 stores q = 0 (127 / amax would
overflow float32 below ~3.7e-37): an all-zero row, or a constant row for int4, is exact.

Rows at the edges of float32 (the formulas above are unchanged for every other row):

* +-inf counts as +-FLT_MAX in amax / lo / max x, and its code saturates (int8 +-127, int4 15 or 0):
  the row stores what it would store with +-FLT_MAX there, and reads back finite.
* int8: ``scale = min(amax / 127, INT8_MAX_SCALE)``, the largest float32 whose product with 127 is
  finite; it differs from amax / 127 only for amax = FLT_MAX, whose 127 * scale rounded to inf.
* int4, a row whose ``max x - lo`` overflows float32 (it spans more than FLT_MAX, so lo < 0 < max
  x): no grid of 16 codes whose ``q * scale + zero`` stays finite covers it, so the row keeps the
  widest one, centred on the row: ``scale = WIDE_SCALE = FLT_MAX / 15``, ``zero = (lo * 0.5 +
  max x * 0.5) - WIDE_HALF`` (WIDE_HALF = 7.5 * WIDE_SCALE), ``q = clip(rint((x - zero) *
  WIDE_INV), 0, 15)`` (WIDE_INV = 15 / FLT_MAX). Values within [zero, zero + 15 * scale] read back
  within half a step; those beyond saturate to the end codes (order and sign are kept).
* A row holding a NaN has no finite encoding: codes 0, scale (and int4 zero) NaN, so the whole row
  reads back NaN, as a float cache would carry the NaN on into attention.

Every quantity is float32 and rint rounds half to even, so a backend that evaluates the same
operations in float32 stores the same codes, scales and zero points bit for bit (a NaN row: NaN,
whatever its bits). The backends' store/load code lives with the backends (``backend_impls``);
this module only defines the formats.
"""

from __future__ import annotations

import numpy as np

from ...runtime.cache import KVCodec
from ...runtime.hookspecs import hookimpl

_F = np.float32
#: Rows with a range below this store q = 0 (127 / TINY still fits a float32).
TINY = _F(2.0 ** -120)
#: The largest finite float32; +-inf counts as +-FLT_MAX in a row's statistics.
FLT_MAX = _F(np.finfo(np.float32).max)
#: int8: the largest scale whose 127 * scale is finite (amax / 127 rounds above it for amax = FLT_MAX).
INT8_MAX_SCALE = np.nextafter(FLT_MAX / _F(127), _F(0))
#: int4, a row spanning more than FLT_MAX: the widest grid whose 15 * scale is finite, its inverse
#: and half its span (module doc).
WIDE_SCALE = FLT_MAX / _F(15)
WIDE_INV = _F(15) / FLT_MAX
WIDE_HALF = _F(7.5) * WIDE_SCALE


def _impls(name: str) -> dict:
    return {"cpu": f"tinyloop.cpu.kv_codecs:{name}", "cuda": f"tinyloop.cuda.kv_codecs:{name}"}


class FP32Codec(KVCodec):
    name = "fp32"
    data_dtype = "float32"
    backend_impls = _impls("FP32")

    @classmethod
    def encode(cls, x):
        return np.asarray(x, _F).copy(), None, None

    @classmethod
    def decode(cls, data, scale, zero):
        return np.asarray(data, _F).copy()


class FP16Codec(KVCodec):
    name = "fp16"
    data_dtype = "float16"
    backend_impls = _impls("FP16")

    @classmethod
    def encode(cls, x):
        return np.asarray(x, _F).astype(np.float16), None, None

    @classmethod
    def decode(cls, data, scale, zero):
        return np.asarray(data, np.float16).astype(_F)


class INT8Codec(KVCodec):
    name = "int8"
    data_dtype = "int8"
    has_scale = True
    backend_impls = _impls("INT8")

    @classmethod
    def encode(cls, x):
        x = np.asarray(x, _F)
        with np.errstate(over="ignore", invalid="ignore"):
            amax = np.max(np.minimum(np.abs(x), FLT_MAX), axis=-1)      # inf as FLT_MAX; NaN stays
            ok = amax >= TINY                                           # False for a NaN row
            inv = np.where(ok, _F(127) / np.where(ok, amax, _F(1)), _F(0)).astype(_F)
            q = np.where(ok[..., None], np.clip(np.rint(x * inv[..., None]), -127, 127), 0).astype(np.int8)
            return q, np.minimum(amax / _F(127), INT8_MAX_SCALE).astype(_F), None

    @classmethod
    def decode(cls, data, scale, zero):
        return np.asarray(data).astype(_F) * np.asarray(scale, _F)[..., None]


class INT4Codec(KVCodec):
    name = "int4"
    data_dtype = "uint8"
    pack = 2
    has_scale = True
    has_zero = True
    backend_impls = _impls("INT4")

    @classmethod
    def encode(cls, x):
        x = np.asarray(x, _F)
        with np.errstate(over="ignore", invalid="ignore"):
            xc = np.clip(x, -FLT_MAX, FLT_MAX)                          # inf as FLT_MAX; NaN stays
            lo, hi = np.min(xc, axis=-1), np.max(xc, axis=-1)
            rng = (hi - lo).astype(_F)
            wide = np.isinf(rng)                                        # the row spans > FLT_MAX
            ok = rng >= TINY                                            # False for a NaN row
            inv = np.where(ok & ~wide, _F(15) / np.where(ok & ~wide, rng, _F(1)), _F(0)).astype(_F)
            inv = np.where(wide, WIDE_INV, inv).astype(_F)
            scale = np.where(wide, WIDE_SCALE, rng / _F(15)).astype(_F)
            zero = np.where(wide, (lo * _F(0.5) + hi * _F(0.5)) - WIDE_HALF, lo).astype(_F)
            q = np.where(ok[..., None], np.clip(np.rint((x - zero[..., None]) * inv[..., None]), 0, 15),
                         0).astype(np.uint8)
        packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
        return packed, scale, zero

    @classmethod
    def unpack(cls, data):
        """(..., D/2) packed bytes -> (..., D) codes."""
        data = np.asarray(data, np.uint8)
        q = np.empty(data.shape[:-1] + (2 * data.shape[-1],), np.uint8)
        q[..., 0::2] = data & 15
        q[..., 1::2] = data >> 4
        return q

    @classmethod
    def decode(cls, data, scale, zero):
        q = cls.unpack(data).astype(_F)
        return q * np.asarray(scale, _F)[..., None] + np.asarray(zero, _F)[..., None]


@hookimpl
def tinyloop_kv_codecs():
    return [FP32Codec, FP16Codec, INT8Codec, INT4Codec]
