"""inspect(): what a .tinyloop file holds and what running it costs, without reading the weights."""

from __future__ import annotations

from typing import Optional


def inspect(path: str, max_seq_len: int = 2048, loops: Optional[int] = None) -> dict:
    """Metadata, architecture, tensor-table summary and memory estimates per backend and cache mode."""
    from ..cli.inspect_cmd import describe
    return describe(path, max_seq_len=max_seq_len, loops=loops)
