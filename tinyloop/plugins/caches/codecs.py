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

Every quantity is float32 and rint rounds half to even, so a backend that evaluates the same
operations in float32 stores the same codes, scales and zero points bit for bit. The backends'
store/load code lives with the backends (``backend_impls``); this module only defines the formats.
"""

from __future__ import annotations

import numpy as np

from ...runtime.cache import KVCodec
from ...runtime.hookspecs import hookimpl

_F = np.float32
#: Rows with a range below this store q = 0 (127 / TINY still fits a float32).
TINY = _F(2.0 ** -120)


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
        amax = np.max(np.abs(x), axis=-1)
        ok = amax >= TINY
        inv = np.where(ok, _F(127) / np.where(ok, amax, _F(1)), _F(0)).astype(_F)
        q = np.clip(np.rint(x * inv[..., None]), -127, 127).astype(np.int8)
        return q, (amax / _F(127)).astype(_F), None

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
        lo = np.min(x, axis=-1)
        rng = (np.max(x, axis=-1) - lo).astype(_F)
        ok = rng >= TINY
        inv = np.where(ok, _F(15) / np.where(ok, rng, _F(1)), _F(0)).astype(_F)
        q = np.clip(np.rint((x - lo[..., None]) * inv[..., None]), 0, 15).astype(np.uint8)
        packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
        return packed, (rng / _F(15)).astype(_F), lo.astype(_F)

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
