"""The CPU backend's implementations of the built-in KV codecs (formats:
tinyloop/plugins/caches/codecs.py).

An implementation gives the storage of one layer group (:meth:`CPUCodec.alloc`), the store of a
block of rows (:meth:`CPUCodec.store`: the codec's own numpy ``encode``, so the stored codes are the
reference's by construction) and ``load``, an inline numba function that reads one value back inside
the attention kernel (tinyloop.cpu.ops.attention_for): ``load(data, scale, zero, layer, slot, head,
d, lut) -> float32``. fp16 is stored as uint16 bit patterns (numba has no float16 on the CPU) and
read through the 65536-entry table ``lut``. A third-party codec provides an object of the same shape
(``load`` compiled with ``numba.njit(inline="always")``).
"""

from __future__ import annotations

import numpy as np
from numba import float32, njit

from ..errors import OutOfMemoryError
from . import ops

_SEQ = dict(fastmath=False, cache=True, nogil=True)
_EMPTY = np.zeros((0, 0, 0), np.float32)


class CPUStorage:
    """One layer group's K or V storage: codes (layers, slots, Hkv, cols), scale / zero (layers,
    slots, Hkv) float32 or empty placeholders."""

    __slots__ = ("data", "scale", "zero")

    def __init__(self, data, scale, zero):
        self.data, self.scale, self.zero = data, scale, zero

    @property
    def arrays(self):
        return (self.data, self.scale, self.zero)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays)


class CPUCodec:
    """A codec's storage and store on the CPU (stateless; the codec class is passed in); subclasses
    set ``load``."""

    #: numpy dtype the codes are held in on the CPU (None: the codec's data_dtype)
    host_dtype = None
    lut = np.zeros(0, np.float32)

    def alloc(self, codec, n_layers: int, n_slots: int, n_kv: int, head_dim: int) -> CPUStorage:
        dt = np.dtype(self.host_dtype or codec.data_dtype)
        shape = (n_layers, n_slots, n_kv)
        try:
            data = np.zeros(shape + (codec.data_cols(head_dim),), dt)
            scale = np.zeros(shape, np.float32) if codec.has_scale else _EMPTY
            zero = np.zeros(shape, np.float32) if codec.has_zero else _EMPTY
        except MemoryError as exc:
            raise OutOfMemoryError(f"a KV cache group of {n_layers} layers x {n_slots} slots "
                                   f"({codec.name}) does not fit in host memory") from exc
        return CPUStorage(data, scale, zero)

    def store(self, codec, st: CPUStorage, layer: int, slots, rows: np.ndarray) -> None:
        """Encode rows (T, Hkv, head_dim) float32 into slots `slots` of `layer`."""
        data, scale, zero = codec.encode(rows)
        st.data[layer, slots] = data
        if scale is not None:
            st.scale[layer, slots] = scale
        if zero is not None:
            st.zero[layer, slots] = zero


@njit(inline="always", **_SEQ)
def _load_f32(data, scale, zero, layer, s, h, d, lut):
    return data[layer, s, h, d]


@njit(inline="always", **_SEQ)
def _load_f16(data, scale, zero, layer, s, h, d, lut):
    return lut[data[layer, s, h, d]]


@njit(inline="always", **_SEQ)
def _load_i8(data, scale, zero, layer, s, h, d, lut):
    return float32(data[layer, s, h, d]) * scale[layer, s, h]


@njit(inline="always", **_SEQ)
def _load_i4(data, scale, zero, layer, s, h, d, lut):
    b = data[layer, s, h, d >> 1]
    q = (b >> ((d & 1) * 4)) & 15
    return float32(q) * scale[layer, s, h] + zero[layer, s, h]


class _FP32(CPUCodec):
    load = staticmethod(_load_f32)

    def store(self, codec, st, layer, slots, rows):
        st.data[layer, slots] = rows


class _FP16(CPUCodec):
    host_dtype = "uint16"
    lut = ops.HALF_TO_FLOAT
    load = staticmethod(_load_f16)

    def store(self, codec, st, layer, slots, rows):
        # the cast of the float32 rows to half, written through a float16 view of the bits
        st.data.view(np.float16)[layer, slots] = rows


class _INT8(CPUCodec):
    load = staticmethod(_load_i8)


class _INT4(CPUCodec):
    load = staticmethod(_load_i4)


FP32, FP16, INT8, INT4 = _FP32(), _FP16(), _INT8(), _INT4()
