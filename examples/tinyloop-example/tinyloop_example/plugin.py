"""The package's hook implementations, found through the ``tinyloop`` entry-point group."""

from __future__ import annotations

import tinyloop as tl

from .bf16_codec import BF16Cache, BF16Codec
from .min_p import MinPDecoder


@tl.hookimpl
def tinyloop_decoders():
    return [MinPDecoder]


@tl.hookimpl
def tinyloop_kv_codecs():
    return [BF16Codec]


@tl.hookimpl
def tinyloop_cache_modes():
    return [BF16Cache]
