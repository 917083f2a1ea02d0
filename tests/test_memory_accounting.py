"""inspect's memory estimate is what a loaded model holds: weights + workspace exactly, and + the KV
cache of a request of max_seq_len tokens (fp32 / fp16), for several max_seq_len / prefill_chunk."""

from __future__ import annotations

import pytest

import tinyloop as tl
from tinyloop.analysis.memory import estimate_memory


@pytest.mark.parametrize("max_seq_len,prefill_chunk", [(64, 0), (128, 16), (40, 64), (512, 0)])
def test_estimate_equals_held_memory_on_the_cpu(tiny_path, max_seq_len, prefill_chunk):
    m = tl.load_model(str(tiny_path), max_seq_len=max_seq_len, backend="cpu", prefill_chunk=prefill_chunk)
    try:
        for mode, kvb in (("fp32", 4.0), ("fp16", 2.0)):
            est = estimate_memory(m.header, max_seq_len, kv_bytes_per_element=kvb, backend="cpu",
                                  prefill_chunk=prefill_chunk)
            assert tl.vram_usage_bytes(m) == est["weights_bytes"] + est["scratch_bytes"]
            seen = []
            prompt = [1] * (max_seq_len - 2)
            tl.generate_stream(m, prompt, tl.GenerateConfig(max_tokens=2, cache_mode=mode),
                               on_token=lambda t, p: seen.append(tl.vram_usage_bytes(m)) or True)
            assert seen[0] == est["total_bytes"], (mode, seen[0], est)
    finally:
        tl.free_model(m)


def test_inspect_reports_the_estimate(tiny_path):
    d = tl.inspect(str(tiny_path), max_seq_len=64, prefill_chunk=16)
    m = tl.load_model(str(tiny_path), max_seq_len=64, backend="cpu", prefill_chunk=16)
    try:
        e = d["memory"]["backends"]["cpu"]["cache_modes"]["fp16"]
        assert e["weights_bytes"] + e["scratch_bytes"] == tl.vram_usage_bytes(m)
    finally:
        tl.free_model(m)
