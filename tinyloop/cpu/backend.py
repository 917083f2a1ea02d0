"""The CPU backend: the embedded default where no GPU is present.

Weights: every tensor is held as a float32 copy (float32 tensors copied, f16 and quantized ones
dequantized once at load; the file is closed after loading) (measured in docs/BENCHMARKS.md: the float32 GEMV in
tinyloop.cpu.ops runs at ~23 GB/s on one core, faster than unpacking INT4 per token in numba), the
matrices in tinyloop.cpu.ops' row-block layout (:class:`RowBlocks`), vectors as they are.
Activations are float32; the KV cache is stored per layer group in its codec (tinyloop/cpu/kv_codecs.py:
float32, IEEE fp16 as uint16 bit patterns, int8 or int4 codes with per-row scales).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..model.arch import required_tensors, rope_inv_freq
from ..model.init_state import random_state
from ..runtime.backend import (Backend, BlockWeights, CacheReuse, GuardedSteps, KVLayerCopy, LaneOps, ModelWeights,
                               TokenMasks, TreeOps, TreeRows, Workspace, fill_lane_paths, lane_tables)
from ..runtime.early_exit import GATE_CDF, STABLE_BELOW, STATISTICS, gate_cdf, gate_log_survival, is_stable
from ..runtime.cache import shared_layers
from ..errors import BackendError, OutOfMemoryError
from . import ops, threads


_NO_DEPTH = np.zeros(0, np.int32)
_NO_PATH = np.zeros((0, 1), np.int32)


def _layout(pos, T):
    """(base position, depth table, path table, cache slots of the T rows) of a position handle."""
    if isinstance(pos, TreeRows):
        depth = pos.depth[:T]
        return pos.pos, depth, pos.path, pos.pos + pos.path[np.arange(T), depth]
    return pos, _NO_DEPTH, _NO_PATH, slice(pos, pos + T)


def available_host_bytes():
    """Memory the kernel says can be allocated without swapping (Linux MemAvailable), or None
    where it cannot be read."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_host_memory(nbytes: int, what: str) -> None:
    """OutOfMemoryError before allocating `nbytes` that the machine does not have: numpy's zeros
    would succeed (pages are mapped lazily) and the process be killed when they are first
    written."""
    avail = available_host_bytes()
    if avail is not None and nbytes > avail:
        raise OutOfMemoryError(f"{what} needs {nbytes / 2**20:.1f} MiB of host memory, but only "
                               f"{avail / 2**20:.1f} MiB are available")


class RowBlocks:
    """A weight matrix of logical shape (N, K) held as ops.block_rows' (ceil(N / LANES), K, LANES)
    float32 blocks, the layout the CPU matmul and embedding kernels read."""

    __slots__ = ("blocks", "shape")

    def __init__(self, W: np.ndarray):
        self.blocks = ops.block_rows(W)
        self.shape = tuple(int(n) for n in W.shape)

    @staticmethod
    def nbytes_for(shape) -> int:
        N, K = shape
        return 4 * -(-N // ops.LANES) * ops.LANES * K

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    @property
    def dtype(self):
        return self.blocks.dtype

    def to_array(self) -> np.ndarray:
        """The (N, K) matrix."""
        return ops.unblock_rows(self.blocks, self.shape[0])


class CPUCache:
    """A cache laid out as its spec: per layer group, the codec class, its CPU implementation and
    the K and V storage (tinyloop.cpu.kv_codecs.CPUStorage)."""

    def __init__(self, spec, n_kv: int, D: int):
        self.spec = spec
        self.n_layers, self.n_slots = spec.n_layers, spec.n_slots
        self.lane_path = self.lane_of = None        # a lanes cache's tables (lane_positions)
        self.groups = []
        for g in spec.groups:
            codec = spec.codec_class(g.codec)
            impl = codec.impl("cpu")
            self.groups.append((codec, impl, impl.alloc(codec, g.n_layers, spec.n_slots, n_kv, D),
                                impl.alloc(codec, g.n_layers, spec.n_slots, n_kv, D)))
        #: per global layer, what the one-row path (CPUBackend.attn_half) reads: made on first use
        self._layer_kv = [None] * self.n_layers
        self._n_kv, self._head_dim = n_kv, D

    def layer_kv(self, layer: int):
        """(write K rows, write V rows, attention kernel, the group's K and V arrays (codes,
        scales, zeros), layer within the group, the codec's table) of global layer `layer`, made
        once; None for a ring cache (its slots wrap: the generic ops handle it)."""
        kv = self._layer_kv[layer]
        if kv is None:
            if self.spec.slots.ring:
                return None
            gi, local = self.spec.group_of(layer)
            codec, impl, kst, vst = self.groups[gi]
            kv = self._layer_kv[layer] = (
                impl.row_writer(codec, kst, local, self._n_kv, self._head_dim),
                impl.row_writer(codec, vst, local, self._n_kv, self._head_dim),
                impl.attention_kernel(), kst.arrays + vst.arrays, local, impl.lut)
        return kv

    def storages(self):
        for _, _, k, v in self.groups:
            yield k
            yield v

    @property
    def nbytes(self) -> int:
        return sum(st.nbytes for st in self.storages())


#: The primitives the CPU backend's composites (attn_half, mlp_half, final_logits) stand for when
#: they call the kernels directly.
_DIRECT_PRIMITIVES = ("rmsnorm", "matmul", "rope_kv_append", "attention", "swiglu", "qkv_project",
                      "sublayer_out", "rows")


class CPUBackend(Backend, TreeOps, CacheReuse, TokenMasks, KVLayerCopy, GuardedSteps, LaneOps):
    """Numba/numpy implementation of the backend ops."""

    name = "cpu"
    codec_key = "cpu"

    def __init__(self, cfg, max_seq_len: int):
        super().__init__(cfg)
        self.max_seq_len = max_seq_len
        inv_freq = rope_inv_freq(cfg)
        # speculative drafts run up to 64 positions (draft_ahead <= 64) past the last emitted token
        ang = np.arange(max_seq_len + 65, dtype=np.float64)[:, None] * inv_freq[None, :]
        self.cos = np.cos(ang).astype(np.float32)
        self.sin = np.sin(ang).astype(np.float32)
        self._held = 0
        self._scores = None
        self._rows = 0
        self._exit_run, self._exit_at, self._exit_prev = 0, 0, None     # guarded steps (early exit)
        self._exit_log_survival = 0.0
        self._exit_queued = 0
        #: threads of the parallel kernels (TINYLOOP_CPU_THREADS; tinyloop/cpu/threads.py)
        self.threads = threads.configure()
        self._par = threads.Region(self.threads)
        #: the composites below call the kernels themselves (the same kernels, arguments and order
        #: as the generic composites over this class's primitives) unless a subclass overrides one
        #: of those primitives, or the model needs what only the generic ones do (biases, other
        #: block norms)
        cls = type(self)
        self._direct = (cfg.block_norm == "pre" and not cfg.qkv_bias
                        and all(getattr(cls, n) is getattr(CPUBackend, n) for n in _DIRECT_PRIMITIVES))
        self._blocks = {}               # id(BlockWeights) -> its kernel arguments (_block_args)

    # ------------------------------------------------------------------ memory
    @classmethod
    def weights_nbytes(cls, cfg) -> int:
        """float32 vectors, and matrices in row blocks (padded to whole blocks of ops.LANES rows)."""
        return sum(RowBlocks.nbytes_for(s) if len(s) == 2 else 4 * int(np.prod(s))
                   for s in required_tensors(cfg).values())

    def load_weights(self, model_file) -> ModelWeights:
        check_host_memory(self.weights_nbytes(self.cfg), "the float32 weights")
        handles = {}
        nbytes = 0
        for name, tq in model_file.header.quant.items():
            # a copy of its own: the file is closed after loading, and
            # a file rewritten under a loaded model must not reach it (docs/FORMAT.md)
            arr = np.ascontiguousarray(model_file.logical(name), dtype=np.float32)
            if arr.ndim == 2:
                arr = RowBlocks(arr)                 # (a copy: the blocked layout)
            elif tq.type == "f32":
                arr = arr.copy()                     # logical() of an f32 tensor is read-only
            nbytes += arr.nbytes
            handles[name] = arr
        self._held += nbytes
        return ModelWeights.from_handles(self.cfg, handles, nbytes=nbytes)

    @classmethod
    def workspace_layout(cls, cfg, rows: int, max_seq_len: int) -> dict:
        f = np.float32
        width = dict(x=cfg.d_model, h=cfg.d_model, e=cfg.d_model, q=cfg.q_dim, k=cfg.kv_dim, v=cfg.kv_dim,
                     att=cfg.q_dim, g=cfg.d_ff, u=cfg.d_ff, logits=cfg.vocab_size, snap_x=cfg.d_model,
                     snap_e=cfg.d_model)
        out = {n: ((rows, w), f) for n, w in width.items()}
        out["ids"] = ((rows,), np.int64)
        # attention scores of every (row, head) over the keys (+ a margin for a speculative verify)
        out["scores"] = ((rows * cfg.n_heads, max_seq_len + 65), f)
        return out

    def alloc_workspace(self, rows: int) -> Workspace:
        check_host_memory(self.workspace_nbytes(self.cfg, rows, self.max_seq_len),
                          f"the workspace of {rows} rows (max_seq_len {self.max_seq_len})")
        arrays = {n: np.zeros(shape, dt)
                  for n, (shape, dt) in self.workspace_layout(self.cfg, rows, self.max_seq_len).items()}
        self._scores = arrays.pop("scores")
        self._rows = rows
        ws = Workspace(rows=rows, **arrays)
        self._held += sum(a.nbytes for a in arrays.values()) + self._scores.nbytes
        return ws

    def alloc_cache(self, spec) -> CPUCache:
        need = spec.nbytes(self.cfg.n_kv_heads, self.cfg.head_dim, spec.codec_classes())
        check_host_memory(need, f"a KV cache of {spec.n_layers} layers x {spec.n_slots} slots")
        return CPUCache(spec, self.cfg.n_kv_heads, self.cfg.head_dim)

    def lane_positions(self, cache: CPUCache, lanes, positions) -> TreeRows:
        # lanes run as a tree rooted at position 0 whose paths are the lanes' slots (_layout)
        sm = cache.spec.slots
        if not sm.lanes:
            raise BackendError("lane_positions needs a cache whose slot map has lanes > 0")
        depth, lane_of = lane_tables(lanes, positions, sm.lane_slots, sm.lanes, self._rows)
        if cache.lane_path is None:
            cache.lane_path = np.zeros((self._rows, sm.lane_slots), np.int32)
            cache.lane_of = np.full(self._rows, -1, np.int32)
        fill_lane_paths(cache.lane_path, cache.lane_of, lane_of, sm.lane_slots)
        return TreeRows(0, depth, cache.lane_path)

    def advance_lanes(self, pos: TreeRows, n: int) -> None:
        pos.depth[:n] += 1

    def copy_cache(self, dst: CPUCache, src: CPUCache, n_slots: int) -> None:
        if dst.spec != src.spec:
            raise BackendError(f"copy_cache: a cache of spec {src.spec} does not fit one of spec {dst.spec}")
        if dst is not src:
            n = n_slots if not src.spec.slots.ring else src.n_slots   # a ring: every slot
            for d, s_ in zip(dst.storages(), src.storages()):
                for da, sa in zip(d.arrays, s_.arrays):
                    if sa.size:
                        np.copyto(da[:, :n], sa[:, :n])

    def copy_cache_layers(self, dst: CPUCache, src: CPUCache, n_slots: int) -> None:
        for di, si, n_layers in shared_layers(dst.spec, src.spec, n_slots):
            for d, s_ in zip(dst.groups[di][2:], src.groups[si][2:]):      # K, then V storage
                for da, sa in zip(d.arrays, s_.arrays):
                    if sa.size:
                        np.copyto(da[:n_layers, :n_slots], sa[:n_layers, :n_slots])

    def copy_kv_layers_at(self, cache: CPUCache, pos, src_layer: int, dst_layers: range) -> None:
        slot = cache.spec.slots.slot(int(pos))
        gi, src = cache.spec.group_of(src_layer)
        for layer in dst_layers:
            gd, dst = cache.spec.group_of(layer)
            if gd != gi:
                raise BackendError(f"copy_kv_layers_at: layer {layer} is not in the group of layer {src_layer}")
            for st in cache.groups[gi][2:]:                 # K, then V storage
                for a in st.arrays:
                    if a.size:
                        a[dst, slot] = a[src, slot]

    # ------------------------------------------------------------------ guarded steps (early exit)
    exit_stats = frozenset(STABLE_BELOW)

    def exit_reset(self) -> None:
        self._exit_run, self._exit_at, self._exit_log_survival = 0, 0, 0.0

    def exit_probe(self, ws, src, stat, threshold, patience, depth, compare, gate=None) -> None:
        cur = np.asarray(src[0], np.float64)
        if compare:
            if stat == GATE_CDF:
                self._exit_log_survival += gate_log_survival(cur, gate[0], float(gate[1][0]))
                value = gate_cdf(self._exit_log_survival)
            else:
                value = STATISTICS[stat][0](cur, self._exit_prev)
            self._exit_run = self._exit_run + 1 if is_stable(stat, value, threshold) else 0
            if self._exit_run >= patience and not self._exit_at:
                self._exit_at = depth
        self._exit_prev = cur.copy()

    def exit_copy_last(self, cache: CPUCache, pos, loops: int) -> None:
        if self._exit_at:
            for src, dst in cache.spec.skipped_loop_layers(self._exit_at, loops):
                self.copy_kv_layers_at(cache, pos, src, dst)

    def exit_depth(self) -> int:
        return self._exit_at

    def queue_exit_depth(self) -> None:
        self._exit_queued = self._exit_at

    def queued_exit_depth(self) -> int:
        return self._exit_queued

    def alloc_rows(self, n: int, cols: int) -> np.ndarray:
        check_host_memory(4 * n * cols, f"a row buffer of {n} x {cols}")
        return np.zeros((n, cols), np.float32)

    def alloc_kept_cache(self, spec) -> CPUCache:
        return self.alloc_cache(spec)

    def memory_bytes(self) -> int:
        return self._held

    def free(self) -> None:
        self._scores = None
        self.cos = self.sin = self._exit_prev = None
        self._blocks.clear()
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
        if isinstance(table, RowBlocks):
            ops.embed(table.blocks, ids, out, T)
        else:
            out[:T] = table[ids[:T]]
        if self.cfg.embed_scale != 1.0:
            out[:T] *= np.float32(self.cfg.embed_scale)

    def add_bias(self, x, b, T: int) -> None:
        x[:T] += b

    def rmsnorm(self, x, w, out, T: int) -> None:
        ops.rmsnorm(x, w, out, T, self.cfg.norm_eps)

    def norm_add(self, x, y, w, T: int) -> None:
        ops.norm_add(x, y, w, T, self.cfg.norm_eps)

    def matmul(self, x, W, out, T: int, accumulate: bool = False) -> None:
        if not isinstance(W, RowBlocks):             # a plain (N, K) array: the row-wise reference form
            with self._par:
                ops.matmul_rowwise(x, W, out, T, accumulate)
            return
        with self._par:
            ops.matmul(x, W.blocks, W.shape[0], out, T, accumulate)

    def rope_kv_append(self, q, k, v, cache: CPUCache, layer: int, pos, T: int) -> None:
        c = self.cfg
        ring = cache.spec.slots
        p0, depth, _, slots = _layout(pos, T)
        if ring.ring:
            if depth.shape[0]:
                raise BackendError("a draft tree's rows cannot be stored in a sliding-window cache")
            slots = np.arange(p0, p0 + T) % cache.n_slots
        else:
            last = (int(slots.max()) if isinstance(slots, np.ndarray) and T else p0 + T - 1)
            if last >= cache.n_slots:
                raise BackendError(f"cache slot {last} is past the cache's {cache.n_slots} slots")
        ops.rope(q, p0, T, c.n_heads, c.head_dim, self.cos, self.sin, depth)
        ops.rope(k, p0, T, c.n_kv_heads, c.head_dim, self.cos, self.sin, depth)
        shape = (T, c.n_kv_heads, c.head_dim)
        gi, local = cache.spec.group_of(layer)
        codec, impl, kst, vst = cache.groups[gi]
        impl.store(codec, kst, local, slots, k[:T].reshape(shape))
        impl.store(codec, vst, local, slots, v[:T].reshape(shape))

    def attention(self, q, cache: CPUCache, layer: int, pos, T: int, out) -> None:
        c = self.cfg
        p0, depth, path, _ = _layout(pos, T)
        gi, local = cache.spec.group_of(layer)
        _, impl, kst, vst = cache.groups[gi]
        kernel = impl.attention_kernel()
        with self._par:
            kernel(q, *kst.arrays, *vst.arrays, local, p0, T, c.n_heads, c.n_kv_heads, c.head_dim,
                   out, self._scores, impl.lut, depth, path, cache.spec.slots.window, cache.n_slots)

    # ------------------------------------------------------------------ composites
    # The generic composites (tinyloop.runtime.backend) cost ~10 us of Python per block (a dozen
    # method calls, position-handle and slot-map checks, group lookups, a Region per matmul) on top
    # of the kernels; these make the same kernel calls with the same arguments in the same order
    # for the common case (a position int, a linear cache, row-blocked weights, "pre" blocks
    # without biases), with the per-layer and per-block lookups made once. Anything else takes the
    # generic composites.

    def _block_args(self, b: BlockWeights):
        """(b, its matrices' blocks and row counts, its norms) for the direct composites, kept per
        block; (b, None) when a matrix is not row-blocked (the generic composites then run)."""
        ent = self._blocks.get(id(b))
        if ent is None or ent[0] is not b:
            mats = (b.wq, b.wk, b.wv, b.wo, b.w_gate, b.w_up, b.w_down)
            if all(type(W) is RowBlocks for W in mats):
                ent = (b, tuple(a for W in mats for a in (W.blocks, W.shape[0])), b.attn_norm, b.mlp_norm)
            else:
                ent = (b, None)
            self._blocks[id(b)] = ent
        return ent

    def attn_half(self, ws: Workspace, b: BlockWeights, cache, layer: int, pos, T: int) -> None:
        kv = cache.layer_kv(layer) if self._direct and type(pos) is int else None
        ent = self._block_args(b) if kv is not None else None
        if ent is None or ent[1] is None:
            return super().attn_half(ws, b, cache, layer, pos, T)
        if pos + T - 1 >= cache.n_slots:
            raise BackendError(f"cache slot {pos + T - 1} is past the cache's {cache.n_slots} slots")
        wq, nq, wk, nk, wv, nv, wo, no = ent[1][:8]
        write_k, write_v, kernel, (kd, ks, kz, vd, vs, vz), local, lut = kv
        c, mm = self.cfg, ops.matmul
        x, h, q, k, v, att = ws.x, ws.h, ws.q, ws.k, ws.v, ws.att
        ops.rmsnorm(x, ent[2], h, T, c.norm_eps)
        with self._par:
            mm(h, wq, nq, q, T, False)
            mm(h, wk, nk, k, T, False)
            mm(h, wv, nv, v, T, False)
            ops.rope(q, pos, T, c.n_heads, c.head_dim, self.cos, self.sin, _NO_DEPTH)
            ops.rope(k, pos, T, c.n_kv_heads, c.head_dim, self.cos, self.sin, _NO_DEPTH)
            slots = slice(pos, pos + T)
            write_k(slots, k[:T])
            write_v(slots, v[:T])
            kernel(q, kd, ks, kz, vd, vs, vz, local, pos, T, c.n_heads, c.n_kv_heads, c.head_dim, att,
                   self._scores, lut, _NO_DEPTH, _NO_PATH, cache.spec.slots.window, cache.n_slots)
            mm(att, wo, no, x, T, True)

    def mlp_half(self, ws: Workspace, b: BlockWeights, T: int) -> None:
        ent = self._block_args(b) if self._direct else None
        if ent is None or ent[1] is None:
            return super().mlp_half(ws, b, T)
        wg, ng, wu, nu, wd, nd = ent[1][8:]
        mm = ops.matmul
        x, h, g, u = ws.x, ws.h, ws.g, ws.u
        ops.rmsnorm(x, ent[3], h, T, self.cfg.norm_eps)
        with self._par:
            mm(h, wg, ng, g, T, False)
            mm(h, wu, nu, u, T, False)
            ops.swiglu(g, u, g, T)
            mm(g, wd, nd, x, T, True)

    def final_logits(self, ws: Workspace, w: ModelWeights, row0: int, T: int) -> None:
        head = w.head
        if not (self._direct and w.final_norm is not None and type(head) is RowBlocks):
            return super().final_logits(ws, w, row0, T)
        ops.rmsnorm(ws.x[row0:], w.final_norm, ws.h, T, self.cfg.norm_eps)
        with self._par:
            ops.matmul(ws.h, head.blocks, head.shape[0], ws.logits, T, False)

    def move_cache_slots(self, cache: CPUCache, moves) -> None:
        for st in cache.storages():
            for a in st.arrays:
                if a.size:
                    for src, dst in moves:
                        a[:, dst] = a[:, src]

    def swiglu(self, g, u, out, T: int) -> None:
        ops.swiglu(g, u, out, T)

    def add(self, x, y, T: int) -> None:
        ops.add(x, y, T)

    def copy(self, dst, src, T: int) -> None:
        dst[:T] = src[:T]

    def zero(self, x, T: int) -> None:
        x[:T] = 0.0

    def init_state(self, x, pos, T: int) -> None:
        p0, depth, _, _ = _layout(pos, T)
        rows = p0 + (depth if depth.shape[0] else np.arange(T))
        c = self.cfg
        x[:T] = random_state(c.loop_init_seed, c.loop_init_scale, rows, c.d_model)

    def read_argmax(self, ws: Workspace) -> int:
        return int(ops.argmax(ws.logits[0]))

    def launch_masked_argmax(self, ws: Workspace, words) -> None:
        ops.mask_logits(ws.logits[0], self.mask_words(words))     # read_argmax reads the row

    def read_argmax_rows(self, ws: Workspace, n: int) -> list:
        return [int(ops.argmax(ws.logits[r])) for r in range(n)]

    def read_topk_rows(self, ws: Workspace, n: int, k: int) -> list:
        out = np.zeros(k, np.int64)
        rows = []
        for r in range(n):
            ops.topk(ws.logits[r], k, out)
            rows.append([int(i) for i in out])
        return rows
