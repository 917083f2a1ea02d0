"""Quantized KV caches: int8 (symmetric, a scale per position and KV head: 68 bytes per 64-wide row
against fp16's 128) and int4 (the spec's "store-h INT4": asymmetric, scale and zero point per
position and KV head, two codes per byte: 40 bytes per 64-wide row). Formats: codecs.py; each
backend stores and loads them inside its own kernels (tinyloop/cpu/kv_codecs.py,
tinyloop/cuda/kv_codecs.py)."""

from __future__ import annotations

from ...runtime.cache import CacheMode
from ...runtime.hookspecs import hookimpl


class INT8Cache(CacheMode):
    name = "int8"
    mode = "int8_cache"
    compat = {"single": "ok", "batched": "ok", "speculative": "ok", "tree_speculative": "ok",
              "prefix_reuse": "ok", "warm_start": "ok"}
    codec = "int8"


class INT4Cache(CacheMode):
    name = "int4"
    mode = "int4_cache"
    compat = {"single": "ok", "batched": "ok", "speculative": "partial", "tree_speculative": "partial",
              "prefix_reuse": "ok", "warm_start": "ok"}
    codec = "int4"


@hookimpl
def tinyloop_cache_modes():
    return [INT8Cache, INT4Cache]
