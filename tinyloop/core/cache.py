"""KV-cache modes: what a cache-mode plugin declares."""

from __future__ import annotations

from typing import ClassVar, Mapping, Optional


class CacheMode:
    """A KV storage format selectable with GenerateConfig.cache_mode.

    The backend allocates and reads the storage named by ``kv_dtype``; a cache-mode plugin states
    the format and its place in the compat matrix."""

    name: ClassVar[str] = ""
    """The value of GenerateConfig.cache_mode that selects this mode."""
    mode: ClassVar[Optional[str]] = None
    """Row of configs/compat.yaml this plugin provides."""
    compat: ClassVar[Mapping[str, str]] = {}
    """Declared compat cells (context -> ok / partial / rejected); must equal the YAML row."""
    kv_dtype: ClassVar[str] = ""
    """Backend storage format of K and V (fp32, fp16)."""
    kv_bytes_per_element: ClassVar[float] = 0.0
    """Bytes per stored K or V element, for memory estimates."""
