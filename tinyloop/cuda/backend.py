"""The CUDA backend: the backend ops on numba-cuda kernels (tinyloop/cuda/kernels, one op per file).

Memory (all taken at load, released by free()):
  weights     packed as stored in the file (q8/q4/q2 + fp16 scales + uint8 zeros, or fp16/fp32);
              per block, wq|wk|wv and w_gate|w_up are uploaded concatenated by rows (``wqkv``,
              ``wgu`` on the BlockWeights) and wq, wk, wv, w_gate, w_up are row views into them
              (one copy resident); a group whose tensors differ in storage stays separate;
  workspace   the BufferPool: float32 activations for `rows` rows, the logits rows, ids, the
              position, the argmax token, the split-KV attention partials and counters
              (``ws.att_work``, ``ws.att_count``), the split argmax's candidates and counters
              (``ws.amax_work``), and pinned host staging buffers;
  KV caches   fp16 or fp32 (n_layers, slots, n_kv_heads, head_dim), slots rounded up to a power of
              two; up to MAX_SPARE_CACHES released caches are kept and handed to later requests that
              fit, so captured graphs stay valid across requests (counted in memory_bytes);
  RoPE table  float32 cos/sin (P, head_dim / 2, 2) (kernels/rope.py ``rope_table``), uploaded at
              init for P = max_cache_slots(max_seq_len) + rope.POSITION_MARGIN positions: every
              position a cache this backend hands out can reach (counted in memory_bytes).

Decode steps run as captured CUDA graphs (``replay``): the first step of a (loops, cache) pair runs
eagerly (compiling kernels), the second is captured on this backend's stream through the driver API
and every later one replays it. Positions and token ids live in device buffers written before each
replay. ``TINYLOOP_CUDA_GRAPHS=0`` runs every step eagerly (same tokens). Only the argmax token id
(4 bytes) crosses to the host per greedy step. On compute capability 9.0 and later the captured
kernel -> kernel edges are programmatic (kernels/_pdl.py: a kernel may be launched before its
predecessor's completion has been fully processed, and waits for it on the device);
``TINYLOOP_CUDA_PDL=0`` keeps default edges.

Fusion (``attn_half``, ``mlp_half``, ``final_logits`` overridden): the block's RMSNorm runs inside
the following matmul (``matmul(norm_w=...)``); q|k|v is one matmul whose epilogue rotates q into
``ws.q`` and k into the cache and appends v (``rope.qkv_epilogue``); gate|up is one matmul whose
epilogue stores ``silu(gate) * up`` into ``ws.g`` (``swiglu.glu_epilogue``): 3 + 2 launches per
block instead of 7 + 5, and the final norm rides in the head matmul. ``TINYLOOP_CUDA_FUSE=0``
runs the unfused default composites (A/B, debugging).
"""

from __future__ import annotations

import os
import sys
import time
from collections import OrderedDict
from typing import Any

import numba
import numpy as np
from numba import cuda
from numba.cuda.cudadrv.driver import device_memset

from ..core.backend import Backend, ModelWeights, TreeRows, Workspace
from ..core.config import env_switch
from ..core.errors import BackendError, OutOfMemoryError
from .graphs import Graph
from .kernels._common import no_tree
from .kernels import _pdl as k_pdl
from .kernels import add as k_add
from .kernels import argmax as k_argmax
from .kernels import attention as k_attention
from .kernels import cache_move as k_cache_move
from .kernels import embed as k_embed
from .kernels import matmul as k_matmul
from .kernels import position as k_position
from .kernels import rmsnorm as k_rmsnorm
from .kernels import rope as k_rope
from .kernels import swiglu as k_swiglu

MAX_GRAPHS = 64
#: Released KV caches kept for later requests (a plain and a speculative shape, beams, ...).
MAX_SPARE_CACHES = 4
#: Largest top-k a launch_topk_rows call may ask for (tree-speculative K_branches).
MAX_TOPK = 16
_DT = {"fp16": np.float16, "fp32": np.float32}


#: Weights of a block concatenated by rows at load: attribute on BlockWeights -> member tensors.
FUSED_WEIGHTS = (("wqkv", ("wq", "wk", "wv")), ("wgu", ("w_gate", "w_up")))


def round_slots(n_slots: int) -> int:
    """Cache slots alloc_cache allocates for a request of n_slots: a power of two >= 128 (requests
    of similar length then share caches, and with them the captured graphs)."""
    return max(128, 1 << max(0, n_slots - 1).bit_length())


def max_cache_slots(max_seq_len: int) -> int:
    """The most slots a session of a backend loaded with max_seq_len asks alloc_cache for, rounded:
    prompt + max_tokens <= max_seq_len, plus the speculative extra slots, draft_ahead + 1 <= 65
    for a chain or the tree's nodes (at most the workspace rows <= max_seq_len) for a tree."""
    return round_slots(max_seq_len + max(65, max_seq_len))


class CUDAWeight:
    """A weight on the device: `w` plus `scales` / `zeros` when quantized. `owner` is the
    concatenated weight this one is a row view of (its memory is counted there), else None."""

    def __init__(self, w, scales=None, zeros=None, owner=None):
        self.w, self.scales, self.zeros, self.owner = w, scales, zeros, owner

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.w, self.scales, self.zeros) if a is not None)


class CUDACache:
    """K and V (n_layers, n_slots, n_kv_heads, head_dim) on the device."""

    def __init__(self, k, v, kv_dtype: str):
        self.k, self.v, self.kv_dtype = k, v, kv_dtype
        self.n_layers, self.n_slots = int(k.shape[0]), int(k.shape[1])

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)


def _is_oom(exc: BaseException) -> bool:
    return "OUT_OF_MEMORY" in str(exc).upper() or "out of memory" in str(exc).lower()


class CUDABackend(Backend):
    """numba-cuda implementation of the backend ops, with graph-captured decode steps."""

    name = "cuda"

    def __init__(self, cfg, max_seq_len: int):
        super().__init__(cfg)
        self.max_seq_len = max_seq_len
        self.stream = cuda.stream()
        self._held = 0
        self._ws = None                   # the workspace (alloc_workspace)
        # cos/sin for every position a launch into any of this backend's caches can reach (the
        # launchers check cache slots + POSITION_MARGIN); read-only, shared by every graph
        n_pos = max_cache_slots(max_seq_len) + k_rope.POSITION_MARGIN
        self.rope_table = self._to_device(k_rope.rope_table(cfg.head_dim, cfg.rope_theta, n_pos))
        self.stream.synchronize()
        self.pos = cuda.device_array(1, np.int32)
        self._pos_host = cuda.pinned_array(1, np.int32)
        self._tok_host = cuda.pinned_array(1, np.int32)
        self._tok_event = cuda.event()     # begin/finish_read_argmax
        self._tok_up = cuda.pinned_array(1, np.int32)
        # host mirrors of the device position and of ws.tok (None: unknown); an upload is skipped
        # when the device already holds the value, which is the case for every greedy decode step
        self._pos_value = None
        self._tok_value = None
        self._spares = []                 # released caches kept for later requests (oldest first)
        self._graphs: "OrderedDict[Any, tuple]" = OrderedDict()
        self.use_graphs = env_switch("TINYLOOP_CUDA_GRAPHS") and not numba.config.ENABLE_CUDASIM
        self.fuse = env_switch("TINYLOOP_CUDA_FUSE")
        # programmatic kernel -> kernel edges in the captured steps (kernels/_pdl.py)
        self.pdl = self.use_graphs and env_switch("TINYLOOP_CUDA_PDL") and k_pdl.enabled()
        self._glu = k_swiglu.glu_epilogue(cfg.d_ff)
        self.profile = os.environ.get("TINYLOOP_CUDA_PROFILE", "") not in ("", "0")
        self.graph_launches = 0
        self.step_nodes = 0
        self.step_programmatic_edges = 0
        self._no_tree = no_tree()          # made here, never during a capture
        self._tree_layouts = {}

    # ------------------------------------------------------------------ memory
    def _to_device(self, a: np.ndarray):
        try:
            d = cuda.to_device(np.ascontiguousarray(a), stream=self.stream)
        except Exception as exc:
            if _is_oom(exc):
                raise OutOfMemoryError(f"uploading {a.nbytes} bytes to the GPU failed: out of memory") from exc
            raise
        self._held += int(d.nbytes)
        return d

    def _empty(self, shape, dtype):
        try:
            d = cuda.device_array(shape, dtype)
        except Exception as exc:
            if _is_oom(exc):
                nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
                raise OutOfMemoryError(f"allocating {nbytes} bytes on the GPU failed: out of memory") from exc
            raise
        return d

    def load_weights(self, model_file) -> ModelWeights:
        handles = {}
        fused = {}
        t = model_file.tensors
        quant = model_file.header.quant
        cfg = self.cfg
        for part, n in (("pre", cfg.n_pre), ("loop", cfg.n_loop), ("post", cfg.n_post)):
            for i in range(n):
                for attr, members in FUSED_WEIGHTS:
                    names = [f"{part}.{i}.{m}" for m in members]
                    w = self._load_concatenated(t, quant, names, handles)
                    if w is not None:
                        fused[(part, i, attr)] = w
        for name, tq in quant.items():
            if name in handles:
                continue
            if name.endswith("norm"):      # norm weights are read as float32 by the kernels
                handles[name] = CUDAWeight(self._to_device(np.asarray(t[name], np.float32)))
            else:
                handles[name] = CUDAWeight(*(self._to_device(a) for a in self._host_parts(t, name, tq)))
        self.stream.synchronize()
        nbytes = (sum(w.nbytes for w in handles.values() if w.owner is None)
                  + sum(w.nbytes for w in fused.values()))
        weights = ModelWeights.from_handles(self.cfg, handles, nbytes=nbytes)
        for part in ("pre", "loop", "post"):
            for i, blk in enumerate(getattr(weights, part)):
                for attr, _ in FUSED_WEIGHTS:
                    setattr(blk, attr, fused.get((part, i, attr)))
        return weights

    @staticmethod
    def _host_parts(t, name, tq) -> tuple:
        """The host arrays of a stored matrix: (w,) for f32/f16, (q, scales, zeros) for qN."""
        if tq.type in ("f32", "f16"):
            return (t[name],)
        return (t[name + ".q"], t[name + ".scales"], t[name + ".zeros"])

    def _load_concatenated(self, t, quant, names, handles):
        """Upload the matrices `names` (same in_features) concatenated by rows, and put row views
        of the result into `handles` under each name. None (nothing uploaded) when their storage
        kinds or group sizes differ."""
        tqs = [quant[n] for n in names]
        if len({(q.type, q.group_size) for q in tqs}) != 1:
            return None
        parts = [self._host_parts(t, n, q) for n, q in zip(names, tqs)]
        whole = CUDAWeight(*(self._to_device(np.concatenate([p[j] for p in parts], axis=0))
                             for j in range(len(parts[0]))))
        r0 = 0
        for n, p in zip(names, parts):
            rows = int(p[0].shape[0])
            views = [a[r0:r0 + rows] for a in (whole.w, whole.scales, whole.zeros) if a is not None]
            handles[n] = CUDAWeight(*views, owner=whole)
            r0 += rows
        return whole

    def alloc_workspace(self, rows: int) -> Workspace:
        c = self.cfg
        f = np.float32
        bufs = dict(x=(rows, c.d_model), h=(rows, c.d_model), e=(rows, c.d_model), q=(rows, c.q_dim),
                    k=(rows, c.kv_dim), v=(rows, c.kv_dim), att=(rows, c.q_dim), g=(rows, c.d_ff),
                    u=(rows, c.d_ff), logits=(rows, c.vocab_size), snap_x=(rows, c.d_model),
                    snap_e=(rows, c.d_model))
        arrays = {n: self._empty(s, f) for n, s in bufs.items()}
        ws = Workspace(rows=rows, **arrays)
        ws.ids = self._empty(rows, np.int32)
        ws.tok = self._empty(1, np.int32)
        ws.toks = self._empty(rows, np.int32)
        ws.toks_host = cuda.pinned_array(rows, np.int32)
        ws.topk = self._empty(rows * MAX_TOPK, np.int32)       # (n, k) views over the start
        ws.topk_host = cuda.pinned_array(rows * MAX_TOPK, np.int32)
        ws.moves = self._empty((2, rows), np.int32)
        ws.moves_host = cuda.pinned_array((2, rows), np.int32)
        ws.ids_host = cuda.pinned_array(rows, np.int32)
        ws.logits_host = cuda.pinned_array(c.vocab_size, np.float32)
        # split-KV attention: per-split partials and per-(row, head) arrival counters, zeroed here
        # once (every launch leaves them zero, graph replays included)
        ws.att_work = self._empty(k_attention.workspace_shape(rows, c.n_heads, c.head_dim), f)
        ws.att_count = self._empty(k_attention.counter_shape(rows, c.n_heads), np.int32)
        # split argmax: per-slice candidates and per-row arrival counters, zeroed here once
        av, ai, ac = k_argmax.work_shapes(rows)
        ws.amax_work = (self._empty(av, f), self._empty(ai, np.int32), self._empty(ac, np.int32))
        for counter in self._counters(ws):
            self._memset0(counter)
        device = [*arrays.values(), ws.ids, ws.tok, ws.toks, ws.topk, ws.moves, ws.att_work,
                  ws.att_count, *ws.amax_work]
        self._held += sum(int(a.nbytes) for a in device)
        self._ws = ws
        return ws

    def alloc_cache(self, n_layers: int, n_slots: int, kv_dtype: str) -> CUDACache:
        if kv_dtype not in _DT:
            raise BackendError(f"cuda backend stores KV as fp32 or fp16, not {kv_dtype!r}")
        fits = [c for c in self._spares if c.kv_dtype == kv_dtype and c.n_layers == n_layers and c.n_slots >= n_slots]
        if fits:
            best = min(fits, key=lambda c: c.n_slots)
            self._spares.remove(best)
            self._zero(best)
            return best
        n_slots = round_slots(n_slots)
        shape = (n_layers, n_slots, self.cfg.n_kv_heads, self.cfg.head_dim)
        try:
            k = self._empty(shape, _DT[kv_dtype])
            v = self._empty(shape, _DT[kv_dtype])
        except OutOfMemoryError:
            if not self._spares:
                raise
            while self._spares:        # the spares may be what fills the device: drop them, retry
                self._drop_spare(self._spares[0])
            k = self._empty(shape, _DT[kv_dtype])
            v = self._empty(shape, _DT[kv_dtype])
        cache = CUDACache(k, v, kv_dtype)
        self._zero(cache)
        return cache

    def _zero(self, cache: CUDACache) -> None:
        """Every request starts from a zeroed cache, as on the CPU: a slot the decode never wrote (a
        speculative draft's post layers at a position only the verify pass computed) then reads the
        same values every time, so seeded speculative sampling is reproducible. The split kernels'
        arrival counters are zeroed with it: every launch leaves them zero, but one that failed
        part-way (an earlier request's error) may not have."""
        arrays = [cache.k, cache.v]
        if self._ws is not None:
            arrays += self._counters(self._ws)
        for a in arrays:
            self._memset0(a)

    @staticmethod
    def _counters(ws: Workspace) -> list:
        """The split kernels' arrival counters (split-KV attention, split argmax)."""
        return [ws.att_count, ws.amax_work[2]]

    def _memset0(self, a) -> None:
        if numba.config.ENABLE_CUDASIM:
            a.copy_to_device(np.zeros(a.shape, a.dtype))
        else:
            device_memset(a, 0, int(a.nbytes), stream=self.stream)

    def report(self, stats) -> None:
        if self.profile:
            per = stats.decode_ms / max(1, stats.tokens_emitted - 1)
            print(f"[tinyloop cuda] prefill {stats.prefill_ms:.2f} ms, first token {stats.first_token_ms:.2f} ms, "
                  f"decode {stats.decode_ms:.2f} ms ({per:.3f} ms/token, {stats.tokens_emitted} tokens, "
                  f"L={stats.loops_used}), {self.step_nodes} graph nodes per step, "
                  f"{self.graph_launches} graph launches so far", file=sys.stderr)

    def release_cache(self, cache: CUDACache) -> None:
        """Keep the cache for a later request (its graphs stay valid); beyond MAX_SPARE_CACHES the
        least recently released spare is freed with its graphs."""
        if cache not in self._spares:
            self._spares.append(cache)
        while len(self._spares) > MAX_SPARE_CACHES:
            self._drop_spare(self._spares[0])

    def copy_cache(self, dst: CUDACache, src: CUDACache, n_slots: int) -> None:
        """Device-to-device copy of the whole K and V arrays (contiguous) on the backend stream."""
        if dst.k.shape != src.k.shape or dst.kv_dtype != src.kv_dtype:
            raise BackendError(f"copy_cache: a {src.kv_dtype} cache of shape {src.k.shape} does not fit a "
                               f"{dst.kv_dtype} cache of shape {dst.k.shape}")
        if dst is not src:
            dst.k.copy_to_device(src.k, stream=self.stream)
            dst.v.copy_to_device(src.v, stream=self.stream)

    def move_cache_slots(self, cache: CUDACache, moves) -> None:
        ws = self._ws
        n = len(moves)
        if n > ws.moves.shape[1]:
            raise BackendError(f"move_cache_slots: {n} moves exceed the pool's {ws.moves.shape[1]}")
        for src, dst in moves:
            if not (0 <= src < cache.n_slots and 0 <= dst < cache.n_slots):
                raise BackendError(f"move_cache_slots: slot move {src} -> {dst} is outside [0, {cache.n_slots})")
        self.stream.synchronize()   # the staging buffer may still be in flight (see positions())
        for i, (src, dst) in enumerate(moves):
            ws.moves_host[0, i] = src
            ws.moves_host[1, i] = dst
        ws.moves.copy_to_device(ws.moves_host, stream=self.stream)
        k_cache_move.move_slots(cache.k, cache.v, ws.moves, n, stream=self.stream)

    def tree_layout(self, depth, path):
        depth = np.ascontiguousarray(depth, np.int32)
        path = np.ascontiguousarray(path, np.int32)
        key = (depth.tobytes(), path.shape, path.tobytes())
        lay = self._tree_layouts.get(key)
        if lay is None:
            # kept for the backend's lifetime: the captured graphs of tree steps point into them
            lay = (self._to_device(depth), self._to_device(path))
            self.stream.synchronize()
            self._tree_layouts[key] = lay
        return lay

    def _drop_spare(self, sp: CUDACache) -> None:
        self._spares.remove(sp)
        for key in [k for k in self._graphs if any(part is sp for part in k)]:
            del self._graphs[key]

    def memory_bytes(self) -> int:
        return self._held + sum(c.nbytes for c in self._spares)

    def free(self) -> None:
        self._graphs.clear()
        self._tree_layouts.clear()
        self._spares = []
        self._held = 0
        if not numba.config.ENABLE_CUDASIM:
            cuda.current_context().deallocations.clear()

    # ------------------------------------------------------------------ positions / transfer
    def positions(self, pos: int):
        if pos != self._pos_value:
            # the previous upload from this staging buffer must have left before it is overwritten
            self.stream.synchronize()
            self._pos_host[0] = pos
            self.pos.copy_to_device(self._pos_host, stream=self.stream)
            self._pos_value = pos
        return self.pos

    def advance_position(self, pos, n: int = 1) -> None:
        k_position.advance_position(self.pos, n, stream=self.stream)
        if self._pos_value is not None:
            self._pos_value += n

    chains_on_device = True

    def store_token(self, ws: Workspace, row: int) -> None:
        ws.ids[row:row + 1].copy_to_device(ws.tok, stream=self.stream)

    def read_ids(self, ws: Workspace, n: int) -> list:
        ws.ids[:n].copy_to_host(ws.ids_host[:n], stream=self.stream)
        self.stream.synchronize()
        return [int(t) for t in ws.ids_host[:n]]

    def set_ids(self, ws: Workspace, ids):
        n = len(ids)
        if n == 1:
            # one-token steps read their id from ws.tok, where the argmax of the previous step is
            # already waiting: a greedy step uploads nothing
            t = int(ids[0])
            if t != self._tok_value:
                self.stream.synchronize()   # see positions()
                self._tok_up[0] = t
                ws.tok.copy_to_device(self._tok_up, stream=self.stream)
                self._tok_value = t
            return ws.tok
        self.stream.synchronize()   # see positions()
        ws.ids_host[:n] = ids
        ws.ids[:n].copy_to_device(ws.ids_host[:n], stream=self.stream)
        return ws.ids[:n]

    def logits_to_host(self, ws: Workspace, row: int) -> np.ndarray:
        ws.logits[row].copy_to_host(ws.logits_host, stream=self.stream)
        self.stream.synchronize()
        return ws.logits_host

    def logits_block_to_host(self, ws: Workspace, n: int) -> np.ndarray:
        out = ws.logits[:n].copy_to_host(stream=self.stream)
        self.stream.synchronize()
        return out

    def rows(self, buf, row0: int):
        return buf[row0:]

    def rows_to_host(self, buf, n: int) -> np.ndarray:
        out = buf[:n].copy_to_host(stream=self.stream)
        self.stream.synchronize()
        return out

    def launch_argmax(self, ws: Workspace) -> None:
        k_argmax.argmax(ws.tok, ws.logits[:1], stream=self.stream, work=ws.amax_work)
        self._tok_value = None

    def read_argmax(self, ws: Workspace) -> int:
        ws.tok.copy_to_host(self._tok_host, stream=self.stream)
        self.stream.synchronize()
        self._tok_value = int(self._tok_host[0])
        return self._tok_value

    def begin_read_argmax(self, ws: Workspace) -> None:
        ws.tok.copy_to_host(self._tok_host, stream=self.stream)
        self._tok_event.record(self.stream)

    def finish_read_argmax(self, ws: Workspace) -> int:
        self._tok_event.synchronize()
        # ws.tok may already hold a later step's argmax: the mirror does not know it
        return int(self._tok_host[0])

    def device_token(self, ws: Workspace):
        return ws.tok

    def launch_topk_rows(self, ws: Workspace, n: int, k: int, out_row=None) -> None:
        if not 1 <= k <= MAX_TOPK:
            raise BackendError(f"top-k of k={k} is outside [1, {MAX_TOPK}] on the cuda backend")
        if out_row is None:
            out = ws.topk[:n * k]
        elif 0 <= out_row and out_row + n * k <= ws.ids.shape[0]:
            out = ws.ids[out_row:out_row + n * k]
        else:
            raise BackendError(f"top-k ids for {n} x {k} rows do not fit the id buffer at row {out_row}")
        k_argmax.topk(out.reshape(n, k), ws.logits[:n], stream=self.stream)

    def read_topk_rows(self, ws: Workspace, n: int, k: int) -> list:
        ws.topk[:n * k].copy_to_host(ws.topk_host[:n * k], stream=self.stream)
        self.stream.synchronize()
        flat = ws.topk_host
        return [[int(i) for i in flat[r * k:(r + 1) * k]] for r in range(n)]

    def launch_argmax_rows(self, ws: Workspace, n: int) -> None:
        k_argmax.argmax(ws.toks[:n], ws.logits[:n], stream=self.stream, work=ws.amax_work)

    def read_argmax_rows(self, ws: Workspace, n: int) -> list:
        ws.toks[:n].copy_to_host(ws.toks_host[:n], stream=self.stream)
        self.stream.synchronize()
        return [int(t) for t in ws.toks_host[:n]]

    # ------------------------------------------------------------------ graphs
    def replay(self, key, fn) -> None:
        if not self.use_graphs:
            fn()
            return
        entry = self._graphs.get(key)
        if entry is None:
            # first use: run eagerly so every kernel is compiled and loaded (module loading is not
            # allowed while a stream captures), then capture on the next call
            fn()
            self._graphs[key] = ("warm", None, None)
            self._trim()
            return
        if entry[0] == "warm":
            # the capture run issues the same ops, so it leaves the host mirrors as a replay will
            pos0 = self._pos_value
            gexec = self._capture(fn)
            effect = (None if pos0 is None or self._pos_value is None else self._pos_value - pos0,
                      self._tok_value is None)
            self._graphs[key] = ("graph", gexec, effect)
            # capture did not execute anything: restore the mirrors, then replay
            self._pos_value = pos0
            entry = self._graphs[key]
        self._graphs.move_to_end(key)
        entry[1].launch()
        self.graph_launches += 1
        dpos, tok_clobbered = entry[2]
        self._pos_value = None if dpos is None or self._pos_value is None else self._pos_value + dpos
        if tok_clobbered:
            self._tok_value = None

    def _trim(self) -> None:
        while len(self._graphs) > MAX_GRAPHS:
            self._graphs.popitem(last=False)

    def _capture(self, fn) -> Graph:
        t0 = time.perf_counter()
        g = Graph(self.stream, fn, programmatic=self.pdl)
        self.step_nodes = g.nodes
        self.step_programmatic_edges = g.programmatic_edges
        if self.profile:
            print(f"[tinyloop cuda] captured a decode step: {g.nodes} graph nodes "
                  f"({g.programmatic_edges} programmatic edges) in "
                  f"{(time.perf_counter() - t0) * 1e3:.1f} ms", file=sys.stderr)
        return g

    # ------------------------------------------------------------------ ops
    def embed(self, table, ids, out, T: int) -> None:
        k_embed.embed(out[:T], ids[:T], table.w, table.scales, table.zeros, stream=self.stream)

    def rmsnorm(self, x, w, out, T: int) -> None:
        k_rmsnorm.rmsnorm(out[:T], x[:T], w.w, self.cfg.norm_eps, stream=self.stream)

    def matmul(self, x, W, out, T: int, accumulate: bool = False) -> None:
        k_matmul.matmul(out[:T], x[:T], W.w, W.scales, W.zeros, accumulate=accumulate, stream=self.stream)

    def _tables(self, pos):
        if isinstance(pos, TreeRows):
            return pos.pos, pos.depth, pos.path
        return pos, self._no_tree[0], self._no_tree[1]

    def rope_kv_append(self, q, k, v, cache: CUDACache, layer: int, pos, T: int) -> None:
        p, depth, path = self._tables(pos)
        k_rope.rope_kv_append(q[:T], k[:T], v[:T], cache.k, cache.v, layer, p, self.rope_table,
                              stream=self.stream, depth=depth, path=path)

    def attention(self, q, cache: CUDACache, layer: int, pos, T: int, out) -> None:
        p, depth, path = self._tables(pos)
        ws = self._ws
        k_attention.attention(out[:T], q[:T], cache.k, cache.v, layer, p, ws.att_work, ws.att_count,
                              stream=self.stream, depth=depth, path=path)

    def swiglu(self, g, u, out, T: int) -> None:
        k_swiglu.swiglu(out[:T], g[:T], u[:T], stream=self.stream)

    def add(self, x, y, T: int) -> None:
        k_add.add(x[:T], y[:T], stream=self.stream)

    def copy(self, dst, src, T: int) -> None:
        dst[:T].copy_to_device(src[:T], stream=self.stream)

    # ------------------------------------------------------------------ fused composites
    def _norm_matmul(self, x, norm, W, out, T: int, epilogue=None) -> None:
        """out[:T] = (rmsnorm(x[:T]) * norm) @ W^T in one launch (stored through `epilogue`)."""
        k_matmul.matmul(out[:T], x[:T], W.w, W.scales, W.zeros, stream=self.stream, norm_w=norm.w,
                        eps=self.cfg.norm_eps, epilogue=epilogue)

    def attn_half(self, ws: Workspace, b, cache: CUDACache, layer: int, pos, T: int) -> None:
        """norm+q|k|v matmul with the RoPE + KV-append epilogue (rotated q -> ws.q), attention,
        wo (+= x): 3 launches. A block without a concatenated wqkv takes three norm-fused matmuls
        and rope_kv_append instead."""
        if not self.fuse:
            return super().attn_half(ws, b, cache, layer, pos, T)
        wqkv = getattr(b, "wqkv", None)
        if wqkv is not None:
            p, depth, path = self._tables(pos)
            ep = k_rope.qkv_epilogue(ws.q[:T], cache.k, cache.v, layer, p, self.rope_table,
                                     depth=depth, path=path)
            self._norm_matmul(ws.x, b.attn_norm, wqkv, ws.q, T, ep)
        else:
            for W, out in ((b.wq, ws.q), (b.wk, ws.k), (b.wv, ws.v)):
                self._norm_matmul(ws.x, b.attn_norm, W, out, T)
            self.rope_kv_append(ws.q, ws.k, ws.v, cache, layer, pos, T)
        self.attention(ws.q, cache, layer, pos, T, ws.att)
        self.matmul(ws.att, b.wo, ws.x, T, accumulate=True)

    def mlp_half(self, ws: Workspace, b, T: int) -> None:
        """norm+gate|up matmul with the SwiGLU epilogue (-> ws.g), down (+= x): 2 launches. A block
        without a concatenated wgu takes two norm-fused matmuls and the two-input SwiGLU instead."""
        if not self.fuse:
            return super().mlp_half(ws, b, T)
        wgu = getattr(b, "wgu", None)
        if wgu is not None:
            self._norm_matmul(ws.x, b.mlp_norm, wgu, ws.g, T, self._glu)
        else:
            self._norm_matmul(ws.x, b.mlp_norm, b.w_gate, ws.g, T)
            self._norm_matmul(ws.x, b.mlp_norm, b.w_up, ws.u, T)
            self.swiglu(ws.g, ws.u, ws.g, T)
        self.matmul(ws.g, b.w_down, ws.x, T, accumulate=True)

    def final_logits(self, ws: Workspace, w: ModelWeights, row0: int, T: int) -> None:
        """The final norm fused into the head matmul (one launch)."""
        if not self.fuse:
            return super().final_logits(ws, w, row0, T)
        self._norm_matmul(self.rows(ws.x, row0), w.final_norm, w.head, ws.logits, T)
