"""A KV cache codec and the cache mode that selects it: bfloat16 K/V (the upper 16 bits of the
float32 value, rounded to nearest even), half the memory of fp32 with fp32's range.

The codec is a format (numpy ``encode`` / ``decode``, the reference the tests hold the backend to)
plus one implementation per backend it supports, named in ``backend_impls``. Only the CPU is
implemented here; on the CUDA backend the mode is refused with a PluginError before any work.
"""

from __future__ import annotations

import numpy as np
from numba import njit

import tinyloop as tl
from tinyloop.cpu.kv_codecs import CPUCodec


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> the bf16 bit pattern (uint16), round to nearest even (NaN stays NaN)."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = np.isnan(x)
    return np.where(nan, (u >> 16) | 0x40, rounded).astype(np.uint16)


#: bf16 bit pattern -> its float32 value (exact), read inside the attention kernel.
BF16_TO_FLOAT = (np.arange(65536, dtype=np.uint32) << 16).view(np.float32)


class BF16Codec(tl.KVCodec):
    name = "bf16"
    data_dtype = "uint16"
    backend_impls = {"cpu": "tinyloop_example.bf16_codec:CPU_BF16"}

    @classmethod
    def encode(cls, x):
        return _to_bf16_bits(np.asarray(x, np.float32)), None, None

    @classmethod
    def decode(cls, data, scale, zero):
        return BF16_TO_FLOAT[np.asarray(data, np.uint16)]


class BF16Cache(tl.CacheMode):
    name = "bf16"
    codec = "bf16"


@njit(inline="always", cache=True)
def _load_bf16(data, scale, zero, layer, s, h, d, lut):
    return lut[data[layer, s, h, d]]


class _CPUBF16(CPUCodec):
    lut = BF16_TO_FLOAT
    load = staticmethod(_load_bf16)


CPU_BF16 = _CPUBF16()
