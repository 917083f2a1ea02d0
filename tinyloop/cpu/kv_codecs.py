"""The CPU backend's implementations of the built-in KV codecs (formats:
tinyloop/plugins/caches/codecs.py).

An implementation gives the storage of one layer group (:meth:`CPUCodec.alloc`), the store of a
block of rows (:meth:`CPUCodec.store`: the codec's own numpy ``encode``, so the stored codes are the
reference's by construction), ``load``, an inline numba function that reads one value back inside
the attention kernel: ``load(data, scale, zero, layer, slot, head, d, lut) -> float32``, and
:meth:`CPUCodec.attention_kernel`, that kernel. fp16 is stored as uint16 bit patterns (numba has no
float16 on the CPU) and read through the 65536-entry table ``lut``.

The built-ins' loads and kernels are module-level functions in tinyloop/cpu/ops.py (``load_fp16``,
``attention_fp16``, ...), so numba's disk cache serves them to every process after the first. A
third-party codec provides an object of the same shape with its own ``load`` (compiled with
``numba.njit(inline="always")``); its kernel is built by tinyloop.cpu.ops.attention_for and
compiles once in each process (a kernel made in a factory cannot be served from numba's cache).
"""

from __future__ import annotations

import numpy as np

from ..errors import OutOfMemoryError
from . import ops

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
    set ``load`` (and the built-ins ``attention``)."""

    #: numpy dtype the codes are held in on the CPU (None: the codec's data_dtype)
    host_dtype = None
    lut = np.zeros(0, np.float32)
    #: the attention kernel (a built-in's module-level kernel in tinyloop.cpu.ops, as a staticmethod);
    #: None: built from ``load`` by ops.attention_for, once per process
    attention = None

    def attention_kernel(self):
        """The attention kernel reading this codec's storage through ``load``."""
        return self.attention if self.attention is not None else ops.attention_for(self.load)

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

    def row_writer(self, codec, st: CPUStorage, layer: int, n_kv: int, head_dim: int):
        """``write(slots, rows)``: what ``store(codec, st, layer, slots, rows)`` does for rows
        given flat, (T, n_kv * head_dim) float32, made once per cache layer (the CPU backend's
        one-row path calls it for every block of every step)."""
        store = self.store

        def write(slots, rows):
            store(codec, st, layer, slots, rows.reshape(rows.shape[0], n_kv, head_dim))
        return write


def _flat_layer(a: np.ndarray, layer: int) -> np.ndarray:
    """Layer `layer` of codes (layers, slots, Hkv, cols) as a (slots, Hkv * cols) view."""
    out = a[layer].view()
    out.shape = (a.shape[1], -1)            # a view or an error, never a copy
    return out


class _FP32(CPUCodec):
    load = staticmethod(ops.load_fp32)
    attention = staticmethod(ops.attention_fp32)

    def store(self, codec, st, layer, slots, rows):
        st.data[layer, slots] = rows

    def row_writer(self, codec, st, layer, n_kv, head_dim):
        if type(self).store is not _FP32.store:         # a subclass with a store of its own
            return super().row_writer(codec, st, layer, n_kv, head_dim)
        return _flat_layer(st.data, layer).__setitem__


class _FP16(CPUCodec):
    host_dtype = "uint16"
    lut = ops.HALF_TO_FLOAT
    load = staticmethod(ops.load_fp16)
    attention = staticmethod(ops.attention_fp16)

    def store(self, codec, st, layer, slots, rows):
        # the cast of the float32 rows to half, written through a float16 view of the bits
        st.data.view(np.float16)[layer, slots] = rows

    def row_writer(self, codec, st, layer, n_kv, head_dim):
        if type(self).store is not _FP16.store:
            return super().row_writer(codec, st, layer, n_kv, head_dim)
        # the same cast, through a float16 view of the layer made once
        return _flat_layer(st.data.view(np.float16), layer).__setitem__


class _INT8(CPUCodec):
    load = staticmethod(ops.load_int8)
    attention = staticmethod(ops.attention_int8)


class _INT4(CPUCodec):
    load = staticmethod(ops.load_int4)
    attention = staticmethod(ops.attention_int4)


FP32, FP16, INT8, INT4 = _FP32(), _FP16(), _INT8(), _INT4()
