"""Float KV caches: fp16 (the default: half the memory, ~1e-3 relative rounding of K/V) and fp32
(exact, used to check backends against the float64 reference)."""

from __future__ import annotations

from ...runtime.cache import CacheMode
from ...runtime.hookspecs import hookimpl
from .. import ALL_CONTEXTS_OK


class FP16Cache(CacheMode):
    name = "fp16"
    mode = "fp16_cache"
    compat = ALL_CONTEXTS_OK
    codec = "fp16"


class FP32Cache(CacheMode):
    name = "fp32"
    mode = "fp32_cache"
    compat = ALL_CONTEXTS_OK
    codec = "fp32"


@hookimpl
def tinyloop_cache_modes():
    return [FP16Cache, FP32Cache]
