"""The CUDA backend's implementations of the built-in KV codecs (formats and float32 numpy
references: tinyloop/plugins/caches/codecs.py; ``KVCodec.backend_impls["cuda"]`` names the objects
of this module).

Storage of one layer group, for K and for V each (L layers, S slots, Hkv kv heads, hd head width,
cols = hd / pack)::

    data   (L, S, Hkv, cols)   the codec's dtype (float32, float16, int8, uint8 = two int4 codes)
    scale  (L, S, Hkv)         float32, codecs with a scale (int8, int4)
    zero   (L, S, Hkv)         float32, codecs with a zero point (int4: the offset ``lo``)

An implementation (:class:`CUDAKVCodec`) is the codec's device code, compiled into the kernels
that read and write the cache the way matmul takes an `Epilogue` (kernels/_common.py) — one op per
file, not one kernel per codec:

* **load** (kernels/attention.py is compiled per codec; lane l of a warp decodes dims
  d = l + 32 k of a row): ``row_params(sf, zf, srow) -> (s, z)`` reads a row's scale and zero once
  (flat float32 arrays, flat row index srow = (layer * S + slot) * Hkv + kvh);
  ``lane_offset(off, lane)`` is the lane's first code in the flat data for the row whose codes
  start at `off`, and ``elem(cf, o, k, lane, s, z) -> float32`` decodes the lane's k-th dim from
  there: fp32 / fp16 a cast (the float-only kernel's loads and address arithmetic, unchanged);
  int8 ``float32(code) * s``; int4 nibble ``d & 1`` of byte ``d >> 1`` (low nibble = even dim),
  ``q * s + z`` with the product rounded on its own (`_common.mul_rn`: a plain multiply-add would
  be contracted into one fma by ptxas, which the reference's two float32 steps are not).
* **store**: fp32 / fp16 rows are written where they are made (the q|k|v matmul's RoPE epilogue,
  rope_kv_append: a cast). A quantized row needs max |x| (or min and max) over its head_dim
  values before any code can be written, which one warp of the matmul epilogue cannot see (it
  holds one rotation pair), so those codecs carry a :class:`KVQuant` for kernels/kv_store.py: the
  epilogue stages the rotated k and raw v rows as float32, and kv_store quantizes each (row,
  kv head) with one warp. Every step is the reference's float32 operation (division correctly
  rounded, ``rint`` half to even, clip), so codes, scales and zeros equal ``encode``'s bit for bit.

A third-party codec provides a :class:`CUDAKVCodec` of its own (``backend_impls = {"cuda":
"pkg.module:NAME"}``); one without a cuda entry is refused with a PluginError when a cache is
allocated.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import numpy as np
from numba import cuda, float32, int8, int32, uint8, uint32, uint64

from .kernels._common import mul_rn, rint

NEG_INF = float32(-np.inf)
POS_INF = float32(np.inf)
NAN = float32(np.nan)
#: Rows whose range is below this store q = 0 (the codecs' reference: plugins/caches/codecs.py).
TINY = float32(2.0 ** -120)
#: The edge-of-float32 constants of the reference (plugins/caches/codecs.py, module doc): +-inf
#: counts as +-FLT_MAX, int8's scale is capped so that 127 * scale is finite, and an int4 row
#: spanning more than FLT_MAX keeps the widest grid, centred on it.
FLT_MAX = float32(np.finfo(np.float32).max)
INT8_MAX_SCALE = float32(np.nextafter(FLT_MAX / float32(127), float32(0)))
WIDE_SCALE = float32(FLT_MAX / float32(15))
WIDE_INV = float32(float32(15) / FLT_MAX)
WIDE_HALF = float32(float32(7.5) * WIDE_SCALE)


class Rows(NamedTuple):
    """One layer group's K or V storage on the device (shape legend in the module doc); scale and
    zero are None for codecs without them."""

    data: Any
    scale: Any = None
    zero: Any = None

    @property
    def arrays(self) -> tuple:
        return tuple(a for a in self if a is not None)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays)


class KVQuant(NamedTuple):
    """The per-row quantization a kv_store launch runs for one codec (all @cuda.jit device
    functions). A lane holds dim pairs (2j, 2j + 1):

    * ``init`` (a, b): start values of the two row statistics;
    * ``stat(a, b, x0, x1) -> (a, b)``: fold a pair into them; both are then reduced by a warp
      max (exact in any order), so a statistic that needs a minimum keeps its negation;
    * ``params(a, b) -> (inv, scale, zero)``: the row's quantization step and stored scale / zero;
    * ``put(data, layer, slot, kvh, j, x0, x1, inv, zero)``: the codes of dims 2j, 2j + 1.
    """

    init: tuple
    stat: Any
    params: Any
    put: Any


class CUDAKVCodec:
    """A KV codec's storage layout and device code on the CUDA backend (module doc)."""

    def __init__(self, name: str, dtype, pack: int, has_scale: bool, has_zero: bool, row_params,
                 lane_offset, elem, quant: Optional[KVQuant] = None):
        self.name = name
        self.dtype = np.dtype(dtype)
        self.pack = int(pack)
        self.has_scale = bool(has_scale)
        self.has_zero = bool(has_zero)
        self.row_params = row_params
        self.lane_offset = lane_offset
        self.elem = elem
        self.quant = quant

    @property
    def quantized(self) -> bool:
        """Rows are stored by the kv_store kernel from float32 staging rows (not by the epilogue)."""
        return self.quant is not None

    def cols(self, head_dim: int) -> int:
        return head_dim // self.pack

    def matches(self, codec) -> Optional[str]:
        """Why this implementation cannot store `codec`'s format (a KVCodec class), or None."""
        want = (np.dtype(codec.data_dtype), int(codec.pack), bool(codec.has_scale), bool(codec.has_zero))
        have = (self.dtype, self.pack, self.has_scale, self.has_zero)
        if want != have:
            return (f"it stores (dtype, pack, scale, zero) = {tuple(map(str, have))}, the codec's format is "
                    f"{tuple(map(str, want))}")
        return None

    def alloc(self, empty, n_layers: int, n_slots: int, n_kv: int, head_dim: int) -> Rows:
        """Uninitialised storage for one of K or V of a group; `empty(shape, dtype)` allocates."""
        shape = (n_layers, n_slots, n_kv)
        return Rows(empty(shape + (self.cols(head_dim),), self.dtype),
                    empty(shape, np.float32) if self.has_scale else None,
                    empty(shape, np.float32) if self.has_zero else None)

    def __repr__(self) -> str:
        return f"CUDAKVCodec({self.name!r})"


# --------------------------------------------------------------------------- load
@cuda.jit(device=True)
def _no_params(sf, zf, srow):
    """A float row has no scale or zero point (nothing is read)."""
    return float32(1.0), float32(0.0)


@cuda.jit(device=True)
def _scale_only(sf, zf, srow):
    return sf[srow], float32(0.0)


@cuda.jit(device=True)
def _scale_zero(sf, zf, srow):
    return sf[srow], zf[srow]


@cuda.jit(device=True)
def _lane_code(off, lane):
    """One code per dim: the lane's dims l + 32 k are codes off + l + 32 k."""
    return off + uint64(lane)


@cuda.jit(device=True)
def _lane_byte(off, lane):
    """Two dims per byte: dim l + 32 k is in byte off + l // 2 + 16 k."""
    return off + uint64(lane >> 1)


@cuda.jit(device=True)
def _load_float(cf, o, k, lane, s, z):
    """fp32 / fp16: the stored value as float32 (exact)."""
    return float32(cf[o + uint64(32 * k)])


@cuda.jit(device=True)
def _load_int8(cf, o, k, lane, s, z):
    return float32(cf[o + uint64(32 * k)]) * s


@cuda.jit(device=True)
def _load_int4(cf, o, k, lane, s, z):
    b = uint32(cf[o + uint64(16 * k)])
    q = (b >> uint32((lane & 1) * 4)) & uint32(15)
    return mul_rn(float32(q), s) + z


# --------------------------------------------------------------------------- store (kv_store)
@cuda.jit(device=True)
def _mag(x):
    """|x| for the row statistic: +-inf as FLT_MAX, NaN as +inf (a NaN row's flag: the warp max
    keeps it, where a NaN would be dropped or kept depending on the lane)."""
    ax = abs(x)
    if ax > FLT_MAX:
        return FLT_MAX
    if ax <= FLT_MAX:
        return ax
    return POS_INF


@cuda.jit(device=True)
def _stat_absmax(a, b, x0, x1):
    return max(a, max(_mag(x0), _mag(x1))), b


@cuda.jit(device=True)
def _params_int8(a, b):
    """amax = a: inv = 127 / amax (0 below TINY: all codes 0), scale = min(amax / 127,
    INT8_MAX_SCALE); a NaN row (a = inf): codes 0, scale NaN."""
    if a > FLT_MAX:
        return float32(0.0), NAN, float32(0.0)
    inv = float32(0.0)
    if a >= TINY:
        inv = float32(127.0) / a
    return inv, min(a / float32(127.0), INT8_MAX_SCALE), float32(0.0)


@cuda.jit(device=True)
def _code_int8(x, inv):
    if inv == float32(0.0):
        return int8(0)
    r = min(max(rint(x * inv), float32(-127.0)), float32(127.0))
    return int8(int32(r))


@cuda.jit(device=True)
def _put_int8(data, layer, slot, kvh, j, x0, x1, inv, zero):
    data[layer, slot, kvh, 2 * j] = _code_int8(x0, inv)
    data[layer, slot, kvh, 2 * j + 1] = _code_int8(x1, inv)


@cuda.jit(device=True)
def _fold_minmax(a, b, x):
    """Fold x into (a, b) = (-min, max), +-inf as +-FLT_MAX; a NaN sets both to +inf (the flag of
    a NaN row)."""
    if not (x == x):
        return POS_INF, POS_INF
    x = min(max(x, -FLT_MAX), FLT_MAX)
    return max(a, -x), max(b, x)


@cuda.jit(device=True)
def _stat_minmax(a, b, x0, x1):
    """a = max(-x) = -min(x), b = max(x)."""
    a, b = _fold_minmax(a, b, x0)
    return _fold_minmax(a, b, x1)


@cuda.jit(device=True)
def _params_int4(a, b):
    """lo = min x, range = max x - lo: inv = 15 / range (0 below TINY: all codes 0), scale =
    range / 15, zero = lo; a range past FLT_MAX: the centred widest grid (WIDE_*); a NaN row
    (a or b = inf): codes 0, scale and zero NaN."""
    if a > FLT_MAX or b > FLT_MAX:
        return float32(0.0), NAN, NAN
    lo = -a
    rng = b - lo
    if rng > FLT_MAX:
        return WIDE_INV, WIDE_SCALE, (lo * float32(0.5) + b * float32(0.5)) - WIDE_HALF
    inv = float32(0.0)
    if rng >= TINY:
        inv = float32(15.0) / rng
    return inv, rng / float32(15.0), lo


@cuda.jit(device=True)
def _code_int4(x, inv, lo):
    if inv == float32(0.0):
        return uint32(0)
    r = min(max(rint((x - lo) * inv), float32(0.0)), float32(15.0))
    return uint32(int32(r))


@cuda.jit(device=True)
def _put_int4(data, layer, slot, kvh, j, x0, x1, inv, zero):
    data[layer, slot, kvh, j] = uint8(_code_int4(x0, inv, zero) | (_code_int4(x1, inv, zero) << uint32(4)))


# --------------------------------------------------------------------------- the built-ins
FP32 = CUDAKVCodec("fp32", np.float32, 1, False, False, _no_params, _lane_code, _load_float)
FP16 = CUDAKVCodec("fp16", np.float16, 1, False, False, _no_params, _lane_code, _load_float)
INT8 = CUDAKVCodec("int8", np.int8, 1, True, False, _scale_only, _lane_code, _load_int8,
                   KVQuant((float32(0.0), float32(0.0)), _stat_absmax, _params_int8, _put_int8))
INT4 = CUDAKVCodec("int4", np.uint8, 2, True, True, _scale_zero, _lane_byte, _load_int4,
                   KVQuant((NEG_INF, NEG_INF), _stat_minmax, _params_int4, _put_int4))

#: The built-in implementation for each storage dtype (launchers given bare arrays or Rows
#: without a codec).
BY_DTYPE = {np.dtype(c.dtype): c for c in (FP32, FP16, INT8, INT4)}


def codec_for(data, codec=None) -> CUDAKVCodec:
    """`codec`, or the built-in implementation storing `data`'s dtype."""
    if codec is not None:
        return codec
    return BY_DTYPE.get(np.dtype(data.dtype))


def as_rows(x) -> Rows:
    """A bare data array (fp caches, as the launchers always took them) or Rows."""
    return x if isinstance(x, Rows) else Rows(x)
