"""The CPU backend: the embedded default where no GPU is present.

Weights: float32 tensors stay memory-mapped from the file (no copy); f16 and quantized tensors are
dequantized once at load into float32 (measured in docs/BENCHMARKS.md: the float32 GEMV in
tinyloop.cpu.ops runs at ~23 GB/s on one core, faster than unpacking INT4 per token in numba).
Activations are float32; the KV cache is float32 or IEEE fp16 (stored as uint16 bit patterns).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..core.backend import Backend, ModelWeights, TreeRows, Workspace
from ..core.errors import BackendError, OutOfMemoryError
from . import ops


_NO_DEPTH = np.zeros(0, np.int32)
_NO_PATH = np.zeros((0, 1), np.int32)


def _layout(pos, T):
    """(base position, depth table, path table, cache slots of the T rows) of a position handle."""
    if isinstance(pos, TreeRows):
        depth = pos.depth[:T]
        return pos.pos, depth, pos.path, pos.pos + pos.path[np.arange(T), depth]
    return pos, _NO_DEPTH, _NO_PATH, slice(pos, pos + T)


class CPUCache:
    """K and V of shape (n_layers, n_slots, n_kv_heads, head_dim); fp16 stored as uint16 bits."""

    def __init__(self, n_layers: int, n_slots: int, n_kv: int, D: int, kv_dtype: str):
        if kv_dtype not in ("fp32", "fp16"):
            raise BackendError(f"cpu backend stores KV as fp32 or fp16, not {kv_dtype!r}")
        self.kv_dtype = kv_dtype
        self.n_layers, self.n_slots = n_layers, n_slots
        dt = np.float32 if kv_dtype == "fp32" else np.uint16
        shape = (n_layers, n_slots, n_kv, D)
        try:
            self.k = np.zeros(shape, dt)
            self.v = np.zeros(shape, dt)
        except MemoryError as exc:
            raise OutOfMemoryError(
                f"KV cache of {2 * np.prod(shape) * np.dtype(dt).itemsize} bytes does not fit") from exc
        # numpy views with the storage's real element type, for casting writes
        self.k_w = self.k if kv_dtype == "fp32" else self.k.view(np.float16)
        self.v_w = self.v if kv_dtype == "fp32" else self.v.view(np.float16)
        self.lut = ops.HALF_TO_FLOAT if kv_dtype == "fp16" else np.zeros(0, np.float32)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class CPUBackend(Backend):
    """Numba/numpy implementation of the backend ops."""

    name = "cpu"

    def __init__(self, cfg, max_seq_len: int):
        super().__init__(cfg)
        self.max_seq_len = max_seq_len
        D = cfg.head_dim
        inv_freq = cfg.rope_theta ** (-np.arange(0, D // 2, dtype=np.float64) * 2.0 / D)
        # speculative drafts run up to 64 positions (draft_ahead <= 64) past the last emitted token
        ang = np.arange(max_seq_len + 65, dtype=np.float64)[:, None] * inv_freq[None, :]
        self.cos = np.cos(ang).astype(np.float32)
        self.sin = np.sin(ang).astype(np.float32)
        self._held = 0
        self._scores = None

    # ------------------------------------------------------------------ memory
    def load_weights(self, model_file) -> ModelWeights:
        handles = {}
        nbytes = 0
        for name, tq in model_file.header.quant.items():
            if tq.type == "f32":
                arr = model_file.tensors[name]        # memory-mapped, read-only, no copy
            else:
                arr = np.ascontiguousarray(model_file.logical(name), dtype=np.float32)
                nbytes += arr.nbytes
            handles[name] = arr
        self._held += nbytes
        return ModelWeights.from_handles(self.cfg, handles, nbytes=nbytes)

    def alloc_workspace(self, rows: int) -> Workspace:
        c = self.cfg
        f = np.float32

        def z(n):
            return np.zeros((rows, n), f)
        ws = Workspace(rows=rows, x=z(c.d_model), h=z(c.d_model), e=z(c.d_model), q=z(c.q_dim),
                       k=z(c.kv_dim), v=z(c.kv_dim), att=z(c.q_dim), g=z(c.d_ff), u=z(c.d_ff),
                       logits=z(c.vocab_size), snap_x=z(c.d_model), snap_e=z(c.d_model))
        ws.ids = np.zeros(rows, np.int64)
        self._scores = np.zeros((rows * c.n_heads, self.max_seq_len + 65), f)
        self._held += sum(a.nbytes for a in (ws.x, ws.h, ws.e, ws.q, ws.k, ws.v, ws.att, ws.g, ws.u,
                                            ws.logits, ws.snap_x, ws.snap_e, self._scores))
        return ws

    def alloc_cache(self, n_layers: int, n_slots: int, kv_dtype: str) -> CPUCache:
        return CPUCache(n_layers, n_slots, self.cfg.n_kv_heads, self.cfg.head_dim, kv_dtype)

    def copy_cache(self, dst: CPUCache, src: CPUCache, n_slots: int) -> None:
        if dst.k.shape != src.k.shape or dst.kv_dtype != src.kv_dtype:
            raise BackendError(f"copy_cache: a {src.kv_dtype} cache of shape {src.k.shape} does not fit a "
                               f"{dst.kv_dtype} cache of shape {dst.k.shape}")
        if dst is not src:
            np.copyto(dst.k[:, :n_slots], src.k[:, :n_slots])
            np.copyto(dst.v[:, :n_slots], src.v[:, :n_slots])

    def memory_bytes(self) -> int:
        return self._held

    def free(self) -> None:
        self._scores = None
        self._held = 0

    # ------------------------------------------------------------------ positions / transfer
    def positions(self, pos: int) -> int:
        return int(pos)

    def set_ids(self, ws: Workspace, ids) -> Any:
        n = len(ids)
        ws.ids[:n] = ids
        return ws.ids

    def logits_to_host(self, ws: Workspace, row: int) -> np.ndarray:
        return ws.logits[row]

    def logits_block_to_host(self, ws: Workspace, n: int) -> np.ndarray:
        return ws.logits[:n]

    def rows(self, buf, row0: int):
        return buf[row0:]

    def rows_to_host(self, buf, n: int) -> np.ndarray:
        return np.array(buf[:n], dtype=np.float32)


    # ------------------------------------------------------------------ ops
    def embed(self, table, ids, out, T: int) -> None:
        ops.embed(table, ids, out, T)

    def rmsnorm(self, x, w, out, T: int) -> None:
        ops.rmsnorm(x, w, out, T, self.cfg.norm_eps)

    def matmul(self, x, W, out, T: int, accumulate: bool = False) -> None:
        ops.matmul(x, W, out, T, accumulate)

    def rope_kv_append(self, q, k, v, cache: CPUCache, layer: int, pos, T: int) -> None:
        c = self.cfg
        p0, depth, _, slots = _layout(pos, T)
        last = (int(slots.max()) if isinstance(slots, np.ndarray) and T else p0 + T - 1)
        if last >= cache.n_slots:
            raise BackendError(f"cache slot {last} is past the cache's {cache.n_slots} slots")
        ops.rope(q, p0, T, c.n_heads, c.head_dim, self.cos, self.sin, depth)
        ops.rope(k, p0, T, c.n_kv_heads, c.head_dim, self.cos, self.sin, depth)
        shape = (T, c.n_kv_heads, c.head_dim)
        cache.k_w[layer, slots] = k[:T].reshape(shape)
        cache.v_w[layer, slots] = v[:T].reshape(shape)

    def attention(self, q, cache: CPUCache, layer: int, pos, T: int, out) -> None:
        c = self.cfg
        p0, depth, path, _ = _layout(pos, T)
        kernel = ops.attention_f16 if cache.kv_dtype == "fp16" else ops.attention_f32
        kernel(q, cache.k, cache.v, layer, p0, T, c.n_heads, c.n_kv_heads, c.head_dim, out,
               self._scores, cache.lut, depth, path)

    def move_cache_slots(self, cache: CPUCache, moves) -> None:
        for src, dst in moves:
            cache.k[:, dst] = cache.k[:, src]
            cache.v[:, dst] = cache.v[:, src]

    def swiglu(self, g, u, out, T: int) -> None:
        ops.swiglu(g, u, out, T)

    def add(self, x, y, T: int) -> None:
        ops.add(x, y, T)

    def copy(self, dst, src, T: int) -> None:
        dst[:T] = src[:T]

    def read_argmax(self, ws: Workspace) -> int:
        return int(ops.argmax(ws.logits[0]))

    def read_argmax_rows(self, ws: Workspace, n: int) -> list:
        return [int(ops.argmax(ws.logits[r])) for r in range(n)]

    def read_topk_rows(self, ws: Workspace, n: int, k: int) -> list:
        out = np.zeros(k, np.int64)
        rows = []
        for r in range(n):
            ops.topk(ws.logits[r], k, out)
            rows.append([int(i) for i in out])
        return rows
