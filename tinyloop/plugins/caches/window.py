"""Sliding-window KV cache (GenerateConfig.cache_window = W > 0): every layer keeps a ring of slots
and a query at position p attends to the last W positions, max(0, p - W + 1) .. p. RoPE keeps
absolute positions. Memory is bounded by the ring, whatever max_tokens is.

Ring size: a launch of n rows writes its n rows' K/V before any of them attends, so the ring holds
W + n - 1 slots (the oldest position a row of the launch still needs is W - 1 behind it, the newest
n - 1 ahead). Prefill chunks are capped at W rows, so the ring is at most 2W - 1 slots (plus the
rows of a speculative verify launch).

A request of at most W positions never leaves the window: it gets the linear map (every position,
the same keys in the same order, so the same bits), not a ring of fewer slots than its window,
which backends refuse (the CUDA kernels need window <= slots)."""

from __future__ import annotations

from ...runtime.cache import SlotMap, SlotMapMode, linear_slots
from ...errors import ConfigError
from ...runtime.hookspecs import hookimpl


class RingWindow(SlotMapMode):
    name = "window"
    mode = "cache_window"
    compat = {"single": "ok", "batched": "rejected", "speculative": "partial", "tree_speculative": "rejected",
              "prefix_reuse": "rejected", "warm_start": "rejected"}

    def __init__(self, window: int):
        self.window = window

    @classmethod
    def from_config(cls, config):
        w = getattr(config, "cache_window", 0)
        return cls(w) if w > 0 else None

    def validate(self, max_seq_len: int) -> None:
        if self.window > max_seq_len:
            raise ConfigError(f"cache_window={self.window} exceeds the model's max_seq_len={max_seq_len}; "
                              f"a window is at most max_seq_len positions (0 disables it)")

    def launch_rows(self, rows: int) -> int:
        return min(rows, self.window)

    def slot_map(self, positions: int, launch_rows: int) -> SlotMap:
        if positions <= self.window:
            return linear_slots(max(1, positions))
        return SlotMap(n_slots=max(1, min(positions, self.window + launch_rows - 1)), window=self.window)


@hookimpl
def tinyloop_slot_maps():
    return [RingWindow]
