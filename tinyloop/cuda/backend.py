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
  KV caches   laid out by a tinyloop.runtime.cache.CacheSpec: per layer group one K and one V storage
              in the group's codec (tinyloop/cuda/kv_codecs.py: codes (n_layers, slots, n_kv_heads,
              head_dim / pack), plus float32 scale / zero (n_layers, slots, n_kv_heads) for int8 /
              int4), slots rounded up (`round_slots`; the cache's ``spec`` says how many it has);
              up to MAX_SPARE_CACHES released caches are kept and handed to later requests of the
              same groups and window that fit, so captured graphs stay valid across requests
              (counted in memory_bytes);
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
block instead of 7 + 5, and the final norm rides in the head matmul. A one-row sublayer output
of a "sandwich" or "sublayer" block (``sublayer_out``) with rows of up to 2048 carries its norm
as the matmul's row tail (``rmsnorm.rmsnorm_tail``, ``norm_add.norm_add_tail``: the launch's last
block runs it on the finished row), one launch instead of two (``rmsnorm.tail_pays``: measured
faster on Ouro's 2048-wide rows, slower on Huginn's 5280); ``TINYLOOP_CUDA_ROW_TAIL=0`` keeps the
two (A/B).
``TINYLOOP_CUDA_FUSE=0`` runs the unfused default composites (A/B, debugging).

KV codecs and slot maps. Ops take a global cache layer and resolve it to (group, layer in the group)
with ``cache.spec.group_of``. fp32 / fp16 groups are stored by the epilogue (or rope_kv_append)
directly; an int8 / int4 group's epilogue stages the rotated k and the v rows in ``ws.k`` /
``ws.v`` and one kv_store launch per block quantizes them (a row's scale needs all its head_dim
values: 4 launches per block instead of 3). The attention kernel is compiled per codec and decodes
the rows as it loads them. A ring slot map (``spec.slots.window`` W > 0) puts position p at slot
p % n_slots and attends over the last W positions; RoPE keeps absolute positions (the table covers
every position a session reaches). Draft-tree rows need the linear map.
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

import dataclasses
from dataclasses import dataclass

from ..runtime.backend import (Backend, CacheReuse, DeviceAcceptance, DeviceChaining, DeviceSampling, GuardedSteps,
                               KVLayerCopy, LaneOps, ModelWeights, TokenMasks, TreeOps, TreeRows, Workspace, fill_lane_paths, lane_tables)
from ..model.arch import is_matrix, rope_inv_freq
from ..runtime.cache import CacheSpec, SlotMap, shared_layers
from ..runtime.config import env_switch
from ..errors import BackendError, OutOfMemoryError, PluginError
from .graphs import Graph, GuardedGraph, conditional_nodes_supported
from .kv_codecs import CUDAKVCodec
from .kernels._common import no_tree
from .kernels import _pdl as k_pdl
from .kernels import accept as k_accept
from .kernels import add as k_add
from .kernels import argmax as k_argmax
from .kernels import sample as k_sample
from .kernels import attention as k_attention
from .kernels import bias as k_bias
from .kernels import norm_add as k_norm_add
from .kernels import cache_move as k_cache_move
from .kernels import embed as k_embed
from .kernels import exit_probe as k_exit_probe
from .kernels import init_state as k_init_state
from .kernels import kv_layer_copy as k_kv_layer_copy
from .kernels import kv_store as k_kv_store
from .kernels import matmul as k_matmul
from .kernels import matmul_exact as k_exact
from .kernels import position as k_position
from .kernels import rmsnorm as k_rmsnorm
from .kernels import rope as k_rope
from .kernels import swiglu as k_swiglu
from .kernels import token_mask as k_token_mask

MAX_GRAPHS = 64
#: Released KV caches kept for later requests (a plain and a speculative shape, beams, ...).
MAX_SPARE_CACHES = 4
#: Largest top-k a launch_topk_rows call may ask for (tree-speculative K_branches).
MAX_TOPK = 16


#: Weights of a block concatenated by rows at load: attribute on BlockWeights -> member tensors.
FUSED_WEIGHTS = (("wqkv", ("wq", "wk", "wv")), ("wgu", ("w_gate", "w_up")))


def exact_requested() -> bool:
    """TINYLOOP_CUDA_EXACT=1 (opt-in): q4 matmuls on the exact kernels where the device has
    integer tensor cores (`CUDABackend.exact`; under the simulator their twins)."""
    return os.environ.get("TINYLOOP_CUDA_EXACT", "0") not in ("", "0", "false", "no")


def round_slots(n_slots: int, window: int = 0) -> int:
    """Cache slots alloc_cache allocates for a request of n_slots: a power of two >= 128 (requests
    of similar length then share caches, and with them the captured graphs); a ring (window > 0)
    is rounded to a multiple of 128 only, so its memory stays bounded by the window."""
    if window:
        return max(128, -(-n_slots // 128) * 128)
    return max(128, 1 << max(0, n_slots - 1).bit_length())


def _codec_class(name: str):
    """The registered KVCodec class of codec `name` (PluginError when none is)."""
    from ..runtime.plugins import get_plugin_manager
    return get_plugin_manager().codec(name)


def resolve_codec(name: str, spec=None):
    """(KVCodec class, its CUDA implementation) of codec `name` (the class `spec` resolved, else
    the registered one); PluginError for an unknown codec, one without a cuda implementation, or
    an implementation that does not store its format."""
    codecs = getattr(spec, "codecs", None) or {}
    codec = codecs[name] if name in codecs else _codec_class(name)
    impl = codec.impl("cuda")
    if not isinstance(impl, CUDAKVCodec):
        raise PluginError(f"KV codec {name!r}: its cuda implementation {impl!r} is not a "
                          f"tinyloop.cuda.kv_codecs.CUDAKVCodec")
    why = impl.matches(codec)
    if why:
        raise PluginError(f"KV codec {name!r}: its cuda implementation {impl.name!r} does not store its "
                          f"format: {why}")
    return codec, impl


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


class CUDACacheGroup:
    """One layer group's K and V storage (kv_codecs.Rows) in the group's codec (`impl`)."""

    __slots__ = ("name", "codec", "impl", "k", "v")

    def __init__(self, name, codec, impl, k, v):
        self.name, self.codec, self.impl, self.k, self.v = name, codec, impl, k, v

    @property
    def arrays(self) -> tuple:
        return self.k.arrays + self.v.arrays

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class CUDACache:
    """A KV cache on the device laid out as `spec` (authoritative: its slots are the allocated,
    rounded number): one CUDACacheGroup per layer group."""

    def __init__(self, spec: CacheSpec, groups):
        self.spec = spec
        self.groups = list(groups)
        self.n_slots = spec.n_slots
        self.n_layers = spec.n_layers
        self.window = spec.slots.window
        #: a lanes cache's tables (CUDABackend.lane_positions): LaneTables, else None
        self.lanes = None

    @property
    def key(self) -> tuple:
        """What a spare must match to serve a request (with at least its slots)."""
        return _spec_key(self.spec)

    def group(self, layer: int):
        """(the group's storage, layer within the group) of global cache layer `layer`."""
        gi, local = self.spec.group_of(int(layer))
        return self.groups[gi], local

    @property
    def arrays(self) -> tuple:
        return tuple(a for g in self.groups for a in g.arrays)

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups) + (self.lanes.nbytes if self.lanes is not None else 0)


class LaneTables:
    """A lanes cache's launch tables, held with the cache (its graphs point into them): lanes run
    as a draft-tree layout rooted at position 0 (the kernels' tree tables), row t at position
    ``depth[t]`` with ``path[t]`` the slots of its lane's positions 0 .. lane_slots-1. `zero` is
    the layout's base position; `lane_of` (host) the lane whose slots each path row holds (-1:
    none yet); `depth_host` the pinned staging of the depth upload."""

    def __init__(self, be: "CUDABackend", rows: int, lane_slots: int):
        self.zero = be._to_device(np.zeros(1, np.int32))
        self.depth = be._to_device(np.zeros(rows, np.int32))
        self.path = be._to_device(np.zeros((rows, lane_slots), np.int32))
        self.depth_host = cuda.pinned_array(rows, np.int32)
        self.path_host = np.zeros((rows, lane_slots), np.int32)
        self.lane_of = np.full(rows, -1, np.int32)
        self.handle = TreeRows(self.zero, self.depth, self.path)

    @property
    def nbytes(self) -> int:
        return int(self.zero.nbytes + self.depth.nbytes + self.path.nbytes)


def _spec_key(spec: CacheSpec) -> tuple:
    return (tuple(spec.groups), spec.slots.window, spec.slots.lanes, spec.n_loop)


def _is_oom(exc: BaseException) -> bool:
    return "OUT_OF_MEMORY" in str(exc).upper() or "out of memory" in str(exc).lower()


@dataclass(slots=True)
class CUDAWorkspace(Workspace):
    """The CUDA backend's workspace: the declared activation buffers plus its own.

    tok (1,) the one-token id (argmax result / chained token); toks (T,) argmax ids of a row block,
    toks_host its pinned copy; topk (T*MAX_TOPK,) top-k ids (row-major (n, k) views), topk_host;
    moves (2, T) cache slot moves, moves_host; ids_host (T,) pinned staging for set_ids;
    logits_host (vocab,) pinned row of logits; att_work / att_count split-KV attention partials and
    per-(row, head) arrival counters; tail_count (1,) the matmul row tails' arrival counter
    (`CUDABackend.sublayer_out`); amax_work (values, ids, counters) of the split argmax; mask
    (ceil(vocab / 32),) the token mask words of launch_masked_argmax, mask_host their pinned staging;
    exit_prev (max(d_model, vocab),) the previous early-exit probe's row, exit_state (2,) the probes'
    [stable count, exit depth] (tok and exit_state are views of tok_exit (3,), so one read-back
    carries a token and its step's depth), exit_acc (1,) float64 the exit gate's running log-survival,
    exit_host (2,) pinned copies of the depth (a queued read, a waited one); accept_rec (2 rows +
    2,) a greedy draft cycle's record (launch_accept), accept_host (2, 2 rows + 2) its two pinned
    copies (a cycle read while the next one runs). The counters are zeroed once at allocation, and
    every launch leaves them zero. xlimbs / xsx / xex are the exact matmul's staging (flat:
    `CUDABackend.matmul_q` views them per launch shape).
    """

    tok: Any = None
    tok_exit: Any = None
    toks: Any = None
    toks_host: Any = None
    topk: Any = None
    topk_host: Any = None
    moves: Any = None
    moves_host: Any = None
    ids_host: Any = None
    logits_host: Any = None
    att_work: Any = None
    att_count: Any = None
    tail_count: Any = None
    amax_work: Any = None
    mask: Any = None
    mask_host: Any = None
    exit_prev: Any = None
    exit_state: Any = None
    exit_acc: Any = None
    exit_host: Any = None
    accept_rec: Any = None
    accept_host: Any = None
    xlimbs: Any = None
    xsx: Any = None
    xex: Any = None


class CUDABackend(Backend, TreeOps, DeviceChaining, DeviceAcceptance, CacheReuse, TokenMasks, KVLayerCopy,
                  GuardedSteps, LaneOps, DeviceSampling):
    """numba-cuda implementation of the backend ops, with graph-captured decode steps."""

    name = "cuda"
    codec_key = "cuda"
    sample_kmax = k_sample.KMAX

    def __init__(self, cfg, max_seq_len: int):
        super().__init__(cfg)
        self.max_seq_len = max_seq_len
        self.stream = cuda.stream()
        self._held = 0
        self._ws = None                   # the workspace (alloc_workspace)
        # cos/sin for every position a launch can reach; read-only, shared by every graph
        n_pos = self.rope_positions(max_seq_len)
        self.rope_table = self._to_device(k_rope.rope_table(cfg.head_dim, cfg.rope_theta, n_pos,
                                                            freqs=rope_inv_freq(cfg)))
        self.stream.synchronize()
        self.pos = cuda.device_array(1, np.int32)
        self._pos_host = cuda.pinned_array(1, np.int32)
        self._tok_host = cuda.pinned_array(3, np.int32)     # [tok, stable count, exit depth]
        self._exit_with_tok = False        # queue_exit_depth: the next begin_read_argmax copies the depth
        self._exit_in_tok_host = False     # the last queued depth read landed in _tok_host[2]
        self._tok_event = cuda.event()     # begin/finish_read_argmax
        self._cycle_events = (cuda.event(), cuda.event())     # begin/finish_read_cycle, per slot
        self._tok_up = cuda.pinned_array(1, np.int32)
        self._mask_event = cuda.event()    # the last mask upload has left ws.mask_host
        # host mirrors of the device position and of ws.tok (None: unknown); an upload is skipped
        # when the device already holds the value, which is the case for every greedy decode step
        self._pos_value = None
        self._tok_value = None
        self._spares = []                 # released caches kept for later requests (oldest first)
        self._graphs: "OrderedDict[Any, tuple]" = OrderedDict()
        self.use_graphs = env_switch("TINYLOOP_CUDA_GRAPHS") and not numba.config.ENABLE_CUDASIM
        # prompt chunks split into power-of-two pieces (row_pieces): opt-in, TINYLOOP_CUDA_SPLIT_ROWS=1
        # (on an H100 the int8 / int4 cache tests against the CPU failed with it at L = 3; see
        # docs/BENCHMARKS.md, "Prompt forwards captured, ...")
        self.split_rows = os.environ.get("TINYLOOP_CUDA_SPLIT_ROWS", "0") == "1"
        self.fuse = env_switch("TINYLOOP_CUDA_FUSE")
        # one-row sublayer outputs with their norm as the matmul's row tail (sublayer_out): blocks
        # with an output norm, rows narrow enough for the tail to pay (rmsnorm.tail_pays)
        self.row_tail = (self.fuse and env_switch("TINYLOOP_CUDA_ROW_TAIL")
                         and cfg.block_norm in ("sandwich", "sublayer") and k_rmsnorm.tail_pays(cfg.d_model))
        # programmatic kernel -> kernel edges in the captured steps (kernels/_pdl.py)
        self.pdl = self.use_graphs and env_switch("TINYLOOP_CUDA_PDL") and k_pdl.enabled()
        self._glu = k_swiglu.glu_epilogue(cfg.d_ff)
        # q4 matmuls on the exact integer numerics (kernels/matmul_exact.py: dp4a at one row,
        # tensor cores beyond), opt-in with TINYLOOP_CUDA_EXACT=1: faster lockstep lanes, verify
        # rows and prefill, slower one-row decode today (docs/BENCHMARKS.md); the simulator has
        # no tensor cores
        self.exact = exact_requested() and k_exact.available()
        self._stage_views = {}
        self.profile = os.environ.get("TINYLOOP_CUDA_PROFILE", "") not in ("", "0")
        self.graph_launches = 0
        self.step_nodes = 0
        self.step_programmatic_edges = 0
        self._no_tree = no_tree()          # made here, never during a capture
        self._tree_layouts = {}
        # guarded early-exit steps as one graph of conditional nodes: the device runtime's
        # cudaGraphSetConditional must link, and the driver must have IF nodes (CUDA 12.4)
        self.guarded_graphs = (self.use_graphs and env_switch("TINYLOOP_CUDA_GUARDED")
                               and k_exit_probe.DEVRT is not None and conditional_nodes_supported())
        # the head and tail of a guarded step as nodes of its graph (not child graphs)
        self.guarded_flat = env_switch("TINYLOOP_CUDA_GUARDED_FLAT")
        self._guard = None                 # the GuardedGraph being captured (its handles)
        self._exit_fresh = False           # the next exit_probe is its step's first (clears the state)
        self._no_conts = cuda.to_device(np.zeros(1, np.uint64))     # no handles: eager probes
        self._sampler = None               # load_sampler's device arrays (made at its first call)

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
                if cfg.qkv_bias:   # one float32 q|k|v vector (the qkv epilogue's), bq/bk/bv views of it
                    fused[(part, i, "bqkv")] = self._load_bias_vector(t, [f"{part}.{i}.{n}" for n in
                                                                          ("bq", "bk", "bv")], handles)
        for name, tq in quant.items():
            if name in handles:
                continue
            if not is_matrix(name):        # norms (and biases): float32 vectors for the kernels
                handles[name] = CUDAWeight(self._to_device(np.asarray(t[name], np.float32)))
            else:
                handles[name] = CUDAWeight(*(self._to_device(a) for a in self._host_parts(t, name, tq)))
        self.stream.synchronize()
        nbytes = (sum(w.nbytes for w in handles.values() if w.owner is None)
                  + sum(w.nbytes for w in fused.values()))
        weights = ModelWeights.from_handles(self.cfg, handles, nbytes=nbytes)
        for part in ("pre", "loop", "post"):
            for i, blk in enumerate(getattr(weights, part)):
                for attr in [a for a, _ in FUSED_WEIGHTS] + ["bqkv"]:
                    setattr(blk, attr, fused.get((part, i, attr)))
        return weights

    def _load_bias_vector(self, t, names, handles) -> CUDAWeight:
        """Upload the bias vectors `names` concatenated as float32, and put views of the result
        into `handles` under each name."""
        parts = [np.asarray(t[n], np.float32) for n in names]
        whole = CUDAWeight(self._to_device(np.concatenate(parts)))
        r0 = 0
        for n, p in zip(names, parts):
            handles[n] = CUDAWeight(whole.w[r0:r0 + p.shape[0]], owner=whole)
            r0 += p.shape[0]
        return whole

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

    @classmethod
    def cache_slots(cls, n_slots: int, window: int = 0) -> int:
        return round_slots(n_slots, window)

    @classmethod
    def rope_positions(cls, max_seq_len: int) -> int:
        """Rows of the cos/sin table: every position a launch into any of this backend's caches can
        reach (the launchers check cache slots + POSITION_MARGIN)."""
        return max_cache_slots(max_seq_len) + k_rope.POSITION_MARGIN

    @classmethod
    def workspace_nbytes(cls, cfg, rows: int, max_seq_len: int) -> int:
        # the workspace, and the cos/sin table made with the backend
        table = cls.rope_positions(max_seq_len) * (cfg.head_dim // 2) * 2 * np.dtype(np.float32).itemsize
        return super().workspace_nbytes(cfg, rows, max_seq_len) + table

    @classmethod
    def workspace_layout(cls, cfg, rows: int, max_seq_len: int) -> dict:
        c, f, i32 = cfg, np.float32, np.int32
        width = dict(x=c.d_model, h=c.d_model, e=c.d_model, q=c.q_dim, k=c.kv_dim, v=c.kv_dim, att=c.q_dim,
                     g=c.d_ff, u=c.d_ff, logits=c.vocab_size, snap_x=c.d_model, snap_e=c.d_model)
        out = {n: ((rows, w), f) for n, w in width.items()}
        # tok_exit: [tok, stable count, exit depth], the one-token id and exit_state in one buffer
        # so a token's read-back carries its step's exit depth (queue_exit_depth)
        out.update(ids=((rows,), i32), tok_exit=((3,), i32), toks=((rows,), i32),
                   topk=((rows * MAX_TOPK,), i32),            # (n, k) views over the start
                   moves=((2, rows), i32), mask=((-(-c.vocab_size // 32),), i32),
                   accept_rec=((k_accept.record_size(rows - 1),), i32),
                   exit_prev=((max(c.d_model, c.vocab_size),), f),
                   exit_acc=((1,), np.float64),
                   # split-KV attention: per-split partials and per-(row, head) arrival counters
                   att_work=(k_attention.workspace_shape(rows, c.n_heads, c.head_dim), f),
                   att_count=(k_attention.counter_shape(rows, c.n_heads), i32),
                   # the matmul row tails' arrival counter (sublayer_out)
                   tail_count=((1,), i32))
        # the exact matmul's staging of many-row launches (kernels/matmul_exact.py): limbs, group
        # sums and exponents for rows rounded up to the token block, the widest matmul input
        # (empty unless TINYLOOP_CUDA_EXACT asks for the exact kernels)
        kx, gx = (k_exact.staging_bound(rows, max(2 * c.d_model, c.q_dim, c.d_ff)) if exact_requested()
                  else (0, 0))
        out.update(xlimbs=((kx,), np.uint8), xsx=((gx,), np.int64), xex=((gx,), i32))
        # split argmax: per-slice candidates and per-row arrival counters
        av, ai, ac = k_argmax.work_shapes(rows)
        out.update(amax_v=(av, f), amax_i=(ai, i32), amax_c=(ac, i32))
        return out

    def alloc_workspace(self, rows: int) -> Workspace:
        c = self.cfg
        dev = {n: self._empty(shape, dt)
               for n, (shape, dt) in self.workspace_layout(c, rows, self.max_seq_len).items()}
        amax = (dev.pop("amax_v"), dev.pop("amax_i"), dev.pop("amax_c"))
        tok_exit = dev.pop("tok_exit")
        ws = CUDAWorkspace(rows=rows, amax_work=amax, tok=tok_exit[0:1], exit_state=tok_exit[1:3], **dev)
        ws.tok_exit = tok_exit
        ws.toks_host = cuda.pinned_array(rows, np.int32)
        ws.topk_host = cuda.pinned_array(rows * MAX_TOPK, np.int32)
        ws.moves_host = cuda.pinned_array((2, rows), np.int32)
        ws.ids_host = cuda.pinned_array(rows, np.int32)
        ws.logits_host = cuda.pinned_array(c.vocab_size, np.float32)
        ws.mask_host = cuda.pinned_array(ws.mask.shape[0], np.int32)
        ws.exit_host = cuda.pinned_array(2, np.int32)
        ws.accept_host = cuda.pinned_array((2, ws.accept_rec.shape[0]), np.int32)
        # the arrival counters are zeroed here once (every launch leaves them zero, graph replays
        # included)
        for counter in self._counters(ws):
            self._memset0(counter)
        # and the exact matmul's staging: rows past a launch's T are read into outputs that are
        # never stored, so they must hold in-range values (zero, or an earlier launch's)
        for a in (ws.xlimbs, ws.xsx, ws.xex):
            if a.size:
                self._memset0(a)
        self._held += sum(int(a.nbytes) for a in (*dev.values(), *amax, tok_exit))
        self._ws = ws
        self._stage_views = {}
        return ws

    def alloc_cache(self, spec: CacheSpec) -> CUDACache:
        """A zeroed cache for `spec`: a kept spare of the same groups, codecs and window with at
        least spec.n_slots slots, else a new one with the slots rounded up (`round_slots`). Every
        group's codec is resolved first (PluginError before anything is allocated)."""
        if not isinstance(spec, CacheSpec):
            raise BackendError(f"alloc_cache takes a tinyloop.runtime.cache.CacheSpec, got {type(spec).__name__}")
        impls = [resolve_codec(g.codec, spec) for g in spec.groups]
        key = _spec_key(spec)
        fits = [c for c in self._spares if c.key == key and c.n_slots >= spec.n_slots]
        if fits:
            best = min(fits, key=lambda c: c.n_slots)
            self._spares.remove(best)
            self._zero(best)
            return best
        return self._fresh_cache(spec, impls)

    def _fresh_cache(self, spec: CacheSpec, impls) -> CUDACache:
        """A new zeroed cache for `spec` with its slots rounded up (`round_slots`); under memory
        pressure the spares are dropped and the allocation retried."""
        window, lanes = spec.slots.window, spec.slots.lanes
        spec = dataclasses.replace(spec, slots=SlotMap(self.cache_slots(spec.n_slots, window), window, lanes))
        try:
            cache = self._new_cache(spec, impls)
        except OutOfMemoryError:
            if not self._spares:
                raise
            while self._spares:        # the spares may be what fills the device: drop them, retry
                self._drop_spare(self._spares[0])
            cache = self._new_cache(spec, impls)
        self._zero(cache)
        return cache

    def _new_cache(self, spec: CacheSpec, impls) -> CUDACache:
        c = self.cfg
        groups = []
        for g, (codec, impl) in zip(spec.groups, impls):
            k, v = (impl.alloc(self._empty, g.n_layers, spec.n_slots, c.n_kv_heads, c.head_dim)
                    for _ in range(2))
            groups.append(CUDACacheGroup(g.name, codec, impl, k, v))
            for a in k.arrays if g.n_layers else ():    # load the layer-copy kernel now, not while capturing
                k_kv_layer_copy.copy_layers_at(a, self.pos, False, 0, range(0), stream=self.stream)
        cache = CUDACache(spec, groups)
        if spec.slots.lanes:
            cache.lanes = LaneTables(self, self._ws.rows, spec.slots.lane_slots)
        return cache

    def _zero(self, cache: CUDACache) -> None:
        """Every request starts from a zeroed cache, as on the CPU: a slot the decode never wrote (a
        speculative draft's post layers at a position only the verify pass computed) then reads the
        same values every time, so seeded speculative sampling is reproducible. The split kernels'
        arrival counters are zeroed with it: every launch leaves them zero, but one that failed
        part-way (an earlier request's error) may not have."""
        arrays = list(cache.arrays)
        if self._ws is not None:
            arrays += self._counters(self._ws)
        for a in arrays:
            self._memset0(a)

    @staticmethod
    def _counters(ws: Workspace) -> list:
        """The split kernels' arrival counters (split-KV attention, split argmax)."""
        return [ws.att_count, ws.amax_work[2], ws.tail_count]

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
        """Device-to-device copy of every storage array (codes, scales, zeros; contiguous, whole
        arrays) on the backend stream."""
        if dst.key != src.key or dst.n_slots != src.n_slots:
            raise BackendError(f"copy_cache: a cache of {src.n_slots} slots laid out as {src.spec} does "
                               f"not fit one of {dst.n_slots} slots laid out as {dst.spec}")
        if dst is not src:
            for d, s_ in zip(dst.arrays, src.arrays):
                d.copy_to_device(s_, stream=self.stream)

    def copy_cache_layers(self, dst: CUDACache, src: CUDACache, n_slots: int) -> None:
        """One device-to-device copy per (layer, storage array) on the backend stream: slots
        0..n_slots-1 of one layer are contiguous in every storage array."""
        pairs = shared_layers(dst.spec, src.spec, n_slots)
        if n_slots == 0:
            return
        for di, si, n_layers in pairs:
            for da, sa in zip(dst.groups[di].arrays, src.groups[si].arrays):
                for layer in range(n_layers):
                    da[layer, :n_slots].copy_to_device(sa[layer, :n_slots], stream=self.stream)

    def copy_kv_layers_at(self, cache: CUDACache, pos, src_layer: int, dst_layers: range) -> None:
        """One kv_layer_copy launch per storage array of the group: the slot is read from the
        device position, so the copy replays inside a captured step."""
        g, src = cache.group(src_layer)
        if not isinstance(dst_layers, range) or dst_layers.step < 1:
            raise BackendError(f"copy_kv_layers_at: dst_layers must be an increasing range, got {dst_layers!r}")
        local = []
        for layer in (dst_layers[0], dst_layers[-1]) if len(dst_layers) else ():
            gd, dst = cache.group(layer)
            if gd is not g:
                raise BackendError(f"copy_kv_layers_at: layer {layer} is not in the group of layer {src_layer}")
            local.append(dst)
        dst = range(local[0], local[1] + 1, dst_layers.step) if local else range(0)
        for a in g.arrays:
            k_kv_layer_copy.copy_layers_at(a, pos, cache.window > 0, src, dst, stream=self.stream)

    def alloc_rows(self, n: int, cols: int):
        buf = self._empty((n, cols), np.float32)
        self._memset0(buf)
        return buf

    def alloc_kept_cache(self, spec: CacheSpec) -> CUDACache:
        if not isinstance(spec, CacheSpec):
            raise BackendError(f"alloc_kept_cache takes a CacheSpec, got {type(spec).__name__}")
        return self._fresh_cache(spec, [resolve_codec(g.codec, spec) for g in spec.groups])

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
        for g in cache.groups:
            k_cache_move.move_slots(g.k.data, g.v.data, ws.moves, n, stream=self.stream,
                                    k_scale=g.k.scale, v_scale=g.v.scale, k_zero=g.k.zero,
                                    v_zero=g.v.zero)

    def lane_positions(self, cache: CUDACache, lanes, positions) -> TreeRows:
        tab = cache.lanes
        if tab is None:
            raise BackendError("lane_positions needs a cache whose slot map has lanes > 0")
        sm = cache.spec.slots
        depth, lane_of = lane_tables(lanes, positions, sm.lane_slots, sm.lanes, self._ws.rows)
        T = depth.shape[0]
        if int(depth.max()) >= self.rope_table.shape[0] - k_rope.POSITION_MARGIN:
            raise BackendError(f"lane_positions: position {int(depth.max())} is outside the RoPE table's "
                               f"{self.rope_table.shape[0] - k_rope.POSITION_MARGIN} positions")
        self.stream.synchronize()       # the previous uploads must have left the staging buffers
        rows = fill_lane_paths(tab.path_host, tab.lane_of, lane_of, sm.lane_slots)
        if rows is not None:
            a, b = rows
            tab.path[a:b].copy_to_device(tab.path_host[a:b], stream=self.stream)
            self.stream.synchronize()   # path_host is pageable: let the copy finish before reuse
        tab.depth_host[:T] = depth
        tab.depth[:T].copy_to_device(tab.depth_host[:T], stream=self.stream)
        return tab.handle

    def advance_lanes(self, pos: TreeRows, n: int) -> None:
        k_position.advance_rows(pos.depth, n, stream=self.stream)

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
        self._sampler = None
        self._held = 0
        if not numba.config.ENABLE_CUDASIM:
            cuda.current_context().deallocations.clear()

    # ------------------------------------------------------------------ positions / transfer
    def positions(self, pos: int):
        if pos != self._pos_value:
            # The launchers can check the RoPE table against a linear cache's slots only; a ring's
            # positions pass its slots, so the start of every position handle is checked against
            # the table here. (The table covers max_cache_slots(max_seq_len) + POSITION_MARGIN
            # positions, past every position a session's rows and draft trees reach.)
            last = int(self.rope_table.shape[0]) - k_rope.POSITION_MARGIN
            if not 0 <= pos < last:
                raise BackendError(f"position {pos} is outside [0, {last}): the backend's RoPE table "
                                   f"covers {int(self.rope_table.shape[0])} positions "
                                   f"(max_seq_len={self.max_seq_len})")
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

    def load_sampler(self, ws: Workspace, temperature: float, top_k: int, top_p: float, uniforms,
                     base: int) -> None:
        u = np.ascontiguousarray(uniforms, np.float64).reshape(-1)
        cap = max(1, self.max_seq_len)
        if not 0 < u.shape[0] <= cap:
            raise BackendError(f"load_sampler: {u.shape[0]} uniform numbers; the table holds 1 .. {cap} "
                               f"(max_seq_len)")
        if self._sampler is None:
            # params, iparams, the uniform table and the kernels' work arrays, kept for the
            # backend's life so captured sampling steps stay valid across requests
            arrays = [self._to_device(np.zeros(2, np.float64)), self._to_device(np.zeros(2, np.int32)),
                      self._to_device(np.zeros(cap, np.float64))]
            arrays.append(tuple(self._to_device(np.zeros(n, np.int32)) for (n,) in k_sample.work_shapes()))
            self._sampler = arrays
        params, iparams, utab, _ = self._sampler
        # pageable sources: each copy has left the host array when it returns
        params.copy_to_device(np.array([temperature, top_p], np.float64), stream=self.stream)
        iparams.copy_to_device(np.array([top_k, base], np.int32), stream=self.stream)
        utab[:u.shape[0]].copy_to_device(u, stream=self.stream)

    def launch_sample(self, ws: Workspace, pos, T: int) -> None:
        if self._sampler is None:
            raise BackendError("launch_sample before load_sampler")
        params, iparams, utab, work = self._sampler
        k_sample.sample(ws.tok, ws.logits[0], params, iparams, utab, pos, T, work, stream=self.stream)
        self._tok_value = None

    def launch_masked_argmax(self, ws: Workspace, words) -> None:
        w = self.mask_words(words)
        self._mask_event.synchronize()     # the previous upload has read the staging buffer
        ws.mask_host[:] = w
        # upload, mask and split argmax as one captured graph: three eager numba launches would
        # cost the host more than the decode step they overlap with
        self._replay(("masked_argmax", ws.mask), lambda: self._masked_argmax(ws), step=False)
        self._mask_event.record(self.stream)

    def _masked_argmax(self, ws: Workspace) -> None:
        ws.mask.copy_to_device(ws.mask_host, stream=self.stream)
        k_token_mask.mask_logits(ws.logits[0], ws.mask, stream=self.stream)
        self.launch_argmax(ws)

    def read_argmax(self, ws: Workspace) -> int:
        self._flush_exit_read()
        ws.tok.copy_to_host(self._tok_host[0:1], stream=self.stream)
        self.stream.synchronize()
        self._tok_value = int(self._tok_host[0])
        return self._tok_value

    def begin_read_argmax(self, ws: Workspace) -> None:
        if self._exit_with_tok:         # the queued depth read rides along (one copy, not two)
            ws.tok_exit.copy_to_host(self._tok_host, stream=self.stream)
            self._exit_with_tok, self._exit_in_tok_host = False, True
        else:
            ws.tok.copy_to_host(self._tok_host[0:1], stream=self.stream)
        self._tok_event.record(self.stream)

    def finish_read_argmax(self, ws: Workspace) -> int:
        self._tok_event.synchronize()
        # ws.tok may already hold a later step's argmax: the mirror does not know it
        return int(self._tok_host[0])

    def device_token(self, ws: Workspace):
        return ws.tok

    def device_tokens(self, ws: Workspace, n: int):
        return ws.toks[:n]

    def begin_read_argmax_rows(self, ws: Workspace, n: int) -> None:
        ws.toks[:n].copy_to_host(ws.toks_host[:n], stream=self.stream)
        self._tok_event.record(self.stream)

    def finish_read_argmax_rows(self, ws: Workspace, n: int) -> list:
        self._tok_event.synchronize()
        return [int(t) for t in ws.toks_host[:n]]

    # ------------------------------------------------------------------ device acceptance
    def launch_accept(self, ws: Workspace, k: int, branches: int = 1, cache=None) -> None:
        nodes = k_accept.tree_size(branches, k) if k >= 1 and branches >= 1 else 0
        if not 2 <= nodes <= ws.rows:
            raise BackendError(f"launch_accept: a cycle of depth k={k} with {branches} branches per node has "
                               f"{nodes} nodes; allowed: 2 .. {ws.rows} (the workspace's rows), k and branches >= 1")
        if branches > 1 and cache is None:
            raise BackendError(f"launch_accept: a tree cycle ({branches} branches per node) names the cache whose "
                               f"accepted path it compacts")
        k_accept.accept(ws.ids, ws.toks, ws.tok, self.pos, ws.accept_rec, ws.moves, k, branches, stream=self.stream)
        if cache is not None and branches > 1:      # a one-branch path never leaves its depth's slots
            for g in cache.groups:      # the k columns the acceptance wrote: its moves, then self-moves
                k_cache_move.move_slots(g.k.data, g.v.data, ws.moves, k, stream=self.stream, k_scale=g.k.scale,
                                        v_scale=g.v.scale, k_zero=g.k.zero, v_zero=g.v.zero)
        self._pos_value = None
        self._tok_value = None

    def device_position(self):
        return self.pos

    def begin_read_cycle(self, ws: Workspace, k: int, slot: int, branches: int = 1) -> None:
        n = k_accept.record_size(k, branches) if k >= 1 and branches >= 1 else 0
        if slot not in (0, 1) or not 0 < n <= ws.accept_rec.shape[0]:
            raise BackendError(f"begin_read_cycle: slot {slot!r} (0 or 1), or depth k={k} with {branches} branches "
                               f"outside the record of {ws.accept_rec.shape[0]} entries")
        ws.accept_rec[:n].copy_to_host(ws.accept_host[slot, :n], stream=self.stream)
        self._cycle_events[slot].record(self.stream)

    def finish_read_cycle(self, ws: Workspace, k: int, slot: int, branches: int = 1) -> tuple:
        self._cycle_events[slot].synchronize()
        N = k_accept.tree_size(branches, k)
        rec = [int(v) for v in ws.accept_host[slot, :2 * N + 2]]
        return rec[1], rec[0], rec[2:2 + N], rec[2 + N:]

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

    # ------------------------------------------------------------------ guarded steps (early exit)
    exit_stats = frozenset(k_exit_probe.MODES)

    def exit_reset(self) -> None:
        self._flush_exit_read()
        k_exit_probe.reset(self._ws.exit_state, self._ws.exit_acc, stream=self.stream)

    def exit_probe(self, ws, src, stat, threshold, patience, depth, compare, gate=None) -> None:
        g = self._guard
        if g is not None:               # capturing a guarded graph: an exit skips the stretches after this piece
            conts, first, fill = g.conts, g.piece, g.fill_handles.get(depth, 0)
        else:
            conts, first, fill = self._no_conts, self._no_conts.shape[0], 0
        if gate is not None:
            gate = (gate[0].w, gate[1].w)
        fresh, self._exit_fresh = self._exit_fresh, False
        k_exit_probe.probe(src[0], ws.exit_prev, ws.exit_state, stat, threshold, patience, depth, compare,
                           conts, first, fill, gate=gate, acc=ws.exit_acc, fresh=fresh, stream=self.stream)

    def exit_copy_last(self, cache: CUDACache, pos, loops: int) -> None:
        spec = cache.spec
        g, first = cache.group(spec.layer("loop", 0, iteration=0))
        for a in g.arrays:
            k_kv_layer_copy.copy_from_exit(a, pos, cache.window > 0, self._ws.exit_state, first, spec.n_loop, loops,
                                           stream=self.stream)

    def exit_depth(self) -> int:
        # its own staging word: the eager guarded path reads the flag between stretches while a
        # queued read (queue_exit_depth) of the step before may still be waiting in word 0
        self._flush_exit_read()
        ws = self._ws
        ws.exit_state[1:2].copy_to_host(ws.exit_host[1:2], stream=self.stream)
        self.stream.synchronize()
        return int(ws.exit_host[1])

    def queue_exit_depth(self) -> None:
        # deferred: the token's read-back (begin_read_argmax) that follows copies the depth with the
        # token; anything else queued first makes the copy on its own (_flush_exit_read)
        self._exit_with_tok, self._exit_in_tok_host = True, False

    def _flush_exit_read(self) -> None:
        """The copy a queue_exit_depth deferred, queued now (before anything that could reset the
        depth)."""
        if self._exit_with_tok:
            ws = self._ws
            ws.exit_state[1:2].copy_to_host(ws.exit_host[0:1], stream=self.stream)
            self._exit_with_tok, self._exit_in_tok_host = False, False

    def queued_exit_depth(self) -> int:
        if self._exit_with_tok:         # no token read covered it: copy now and wait for it
            self._flush_exit_read()
            self.stream.synchronize()
        if self._exit_in_tok_host:
            return int(self._tok_host[2])
        return int(self._ws.exit_host[0])

    def replay_guarded(self, key, head, stretches, fills, tail) -> None:
        """With graphs: the whole guarded step as one graph of conditional nodes (GuardedGraph),
        captured on the second call like a decode step; the probes set the graph's handles on the
        device. Otherwise (TINYLOOP_CUDA_GUARDED=0, no device runtime, drivers before CUDA 12.4,
        the simulator) the flag is read between stretches."""
        def eager():
            GuardedSteps.replay_guarded(self, key, head, stretches, fills, tail)
        self._flush_exit_read()         # a deferred depth read goes before the step that resets it
        if not self.guarded_graphs:
            return eager()

        def capture():
            def prepare(graph):
                self._guard = graph

            def first():
                # no reset launch: the head's first probe starts from a cleared state (fresh)
                self._exit_fresh = True
                try:
                    head()
                finally:
                    self._exit_fresh = False
            try:
                try:
                    g = GuardedGraph(self.stream, first, stretches, fills, tail, prepare, programmatic=self.pdl,
                                     flat=self.guarded_flat)
                except BackendError:
                    if not self.pdl:
                        raise
                    # conditional bodies refused programmatic edges: default edges
                    g = GuardedGraph(self.stream, first, stretches, fills, tail, prepare, flat=self.guarded_flat)
            finally:
                self._guard = None
            self.step_nodes, self.step_programmatic_edges = g.nodes, g.programmatic_edges
            return g
        self._replay(("guarded", key), eager, step=True, capture=capture)

    # ------------------------------------------------------------------ graphs
    def replay(self, key, fn, step: bool = True) -> None:
        self._replay(key, fn, step=step)

    def row_pieces(self, T: int) -> list:
        """The whole chunk; with `split_rows` (TINYLOOP_CUDA_SPLIT_ROWS=1) its binary pieces, largest
        first (a 100-row chunk is 64 + 32 + 4), so that at most log2(rows) + 1 captured forwards
        serve every prompt length. Either way each piece's forward is replayed from a graph once its
        row count was seen before (engine `_rows_forward`)."""
        if not self.split_rows:
            return [T]
        return [1 << b for b in range(T.bit_length() - 1, -1, -1) if T >> b & 1]

    def _replay(self, key, fn, step: bool, capture=None) -> None:
        """replay; `step`: `fn` is a decode step (its captured node counts are reported as the
        step's), not one of the backend's own small graphs; `capture`: builds the graph instead
        of capturing `fn` (a guarded step)."""
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
            gexec = capture() if capture is not None else self._capture(fn, step)
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

    def _capture(self, fn, step: bool) -> Graph:
        """Capture `fn` (`step`: see _replay)."""
        t0 = time.perf_counter()
        g = Graph(self.stream, fn, programmatic=self.pdl)
        if step:
            self.step_nodes = g.nodes
            self.step_programmatic_edges = g.programmatic_edges
        if self.profile:
            print(f"[tinyloop cuda] captured {'a decode step' if step else 'a backend graph'}: {g.nodes} graph nodes "
                  f"({g.programmatic_edges} programmatic edges) in "
                  f"{(time.perf_counter() - t0) * 1e3:.1f} ms", file=sys.stderr)
        return g

    # ------------------------------------------------------------------ ops
    def embed(self, table, ids, out, T: int) -> None:
        k_embed.embed(out[:T], ids[:T], table.w, table.scales, table.zeros, stream=self.stream,
                      scale=self.cfg.embed_scale)

    def rmsnorm(self, x, w, out, T: int) -> None:
        k_rmsnorm.rmsnorm(out[:T], x[:T], w.w, self.cfg.norm_eps, stream=self.stream)

    def matmul(self, x, W, out, T: int, accumulate: bool = False) -> None:
        self.matmul_q(out[:T], x[:T], W, accumulate=accumulate)

    def matmul_q(self, out, x, W, accumulate=False, norm_w=None, epilogue=None) -> None:
        """One matmul launch: the exact integer kernel for weights it serves (the choice depends on
        the weight's shape only, never on the row count, so every path of a request reduces a
        weight alike), else the fast kernel."""
        T, K = x.shape
        eps = 0.0 if norm_w is None else self.cfg.norm_eps
        if self.exact and k_exact.supports(W.w, W.scales, K):
            group = K // W.scales.shape[1]
            staged = k_exact.needs_staging(T, K, group, W.w.shape[0], epilogue is not None)
            stage = self._staging(T, K, group) if staged else (None, None, None)
            k_exact.matmul_exact(out, x, W.w, W.scales, W.zeros, *stage, accumulate=accumulate,
                                 stream=self.stream, norm_w=norm_w, eps=eps, epilogue=epilogue)
        else:
            k_matmul.matmul(out, x, W.w, W.scales, W.zeros, accumulate=accumulate, stream=self.stream,
                            norm_w=norm_w, eps=eps, epilogue=epilogue)

    def _staging(self, T: int, K: int, group: int) -> tuple:
        """Views of the workspace's exact-matmul staging for a launch of T rows (made once per
        shape: never inside a capture after the first)."""
        key = (T, K, group)
        v = self._stage_views.get(key)
        if v is None:
            ws = self._ws
            ls, ss, es = k_exact.staging_shapes(T, K, group)
            v = (ws.xlimbs[:int(np.prod(ls))].reshape(ls), ws.xsx[:int(np.prod(ss))].reshape(ss),
                 ws.xex[:int(np.prod(es))].reshape(es))
            self._stage_views[key] = v
        return v

    def _tables(self, pos, cache: CUDACache = None):
        if isinstance(pos, TreeRows):
            if cache is not None and cache.window:
                raise BackendError(f"draft-tree rows cannot use a sliding-window cache "
                                   f"(window={cache.window}): trees need the linear slot map")
            return pos.pos, pos.depth, pos.path
        return pos, self._no_tree[0], self._no_tree[1]

    def _kv_store(self, k, v, g: CUDACacheGroup, local: int, p, depth, path, window: int) -> None:
        """Quantize staged float32 k / v rows into a quantized group (kernels/kv_store.py)."""
        k_kv_store.kv_store(k, v, g.k, g.v, local, p, g.impl, stream=self.stream, depth=depth,
                            path=path, window=window)

    def rope_kv_append(self, q, k, v, cache: CUDACache, layer: int, pos, T: int) -> None:
        p, depth, path = self._tables(pos, cache)
        g, local = cache.group(layer)
        if g.impl.quantized:
            # rotate in place, then quantize the rotated k and the v rows
            k_rope.rope(q[:T], k[:T], p, self.rope_table, stream=self.stream, depth=depth, path=path)
            self._kv_store(k[:T], v[:T], g, local, p, depth, path, cache.window)
            return
        k_rope.rope_kv_append(q[:T], k[:T], v[:T], g.k.data, g.v.data, local, p, self.rope_table,
                              stream=self.stream, depth=depth, path=path, window=cache.window)

    def attention(self, q, cache: CUDACache, layer: int, pos, T: int, out) -> None:
        p, depth, path = self._tables(pos, cache)
        g, local = cache.group(layer)
        ws = self._ws
        k_attention.attention(out[:T], q[:T], g.k, g.v, local, p, ws.att_work, ws.att_count,
                              stream=self.stream, depth=depth, path=path, codec=g.impl,
                              window=cache.window)

    def swiglu(self, g, u, out, T: int) -> None:
        k_swiglu.swiglu(out[:T], g[:T], u[:T], stream=self.stream)

    def add(self, x, y, T: int) -> None:
        k_add.add(x[:T], y[:T], stream=self.stream)

    def add_bias(self, x, b, T: int) -> None:
        k_bias.add_bias(x[:T], b.w, stream=self.stream)

    def copy(self, dst, src, T: int) -> None:
        dst[:T].copy_to_device(src[:T], stream=self.stream)

    def norm_add(self, x, y, w, T: int) -> None:
        k_norm_add.norm_add(x[:T], y[:T], w.w, self.cfg.norm_eps, stream=self.stream)

    def sublayer_out(self, ws: Workspace, src, W, out_norm, T: int) -> None:
        """The base class's residual update; with row tails on (`row_tail`), a one-row update
        through a weight the fast kernel takes is one launch: the matmul with the norm as its row
        tail (the same bits as the two launches, kernels/matmul.py)."""
        if not (self.row_tail and T == 1 and self._row_tail_ok(W, src.shape[1])):
            return super().sublayer_out(ws, src, W, out_norm, T)
        eps = self.cfg.norm_eps
        if self.cfg.block_norm == "sublayer":
            self.matmul_q(ws.h[:1], src[:1], W,
                          epilogue=k_norm_add.norm_add_tail(ws.x[:1], out_norm.w, eps, ws.tail_count))
        else:
            self.matmul_q(ws.x[:1], src[:1], W, accumulate=True,
                          epilogue=k_rmsnorm.rmsnorm_tail(out_norm.w, eps, ws.tail_count))

    def _row_tail_ok(self, W, K: int) -> bool:
        """Whether a one-row launch of weight W can carry a row tail: the fast kernel serves it
        (not the exact kernels)."""
        if self.exact and k_exact.supports(W.w, W.scales, K):
            return False
        group = 0 if W.scales is None else K // W.scales.shape[1]
        return k_matmul.uses_fast_path(k_matmul.weight_kind(W.w, K), K, group, W.w)

    def zero(self, x, T: int) -> None:
        self._memset0(x[:T])

    def init_state(self, x, pos, T: int) -> None:
        p, depth, path = self._tables(pos)
        c = self.cfg
        k_init_state.init_state(x[:T], p, c.loop_init_seed, c.loop_init_scale, stream=self.stream,
                                depth=depth, path=path)

    # ------------------------------------------------------------------ fused composites
    def _norm_matmul(self, x, norm, W, out, T: int, epilogue=None) -> None:
        """out[:T] = (rmsnorm(x[:T]) * norm) @ W^T in one launch (stored through `epilogue`)."""
        self.matmul_q(out[:T], x[:T], W, norm_w=norm.w, epilogue=epilogue)

    def attn_half(self, ws: Workspace, b, cache: CUDACache, layer: int, pos, T: int) -> None:
        """norm+q|k|v matmul with the RoPE + KV-append epilogue (rotated q -> ws.q), attention,
        wo (+= x): 3 launches; for a quantized codec the epilogue stages k and v in ws.k / ws.v
        and kv_store encodes them (4 launches); q/k/v biases (a concatenated bqkv) are added in
        the epilogue before RoPE. A block without a concatenated wqkv takes three norm-fused
        matmuls, the bias adds and rope_kv_append instead."""
        if not self.fuse:
            return super().attn_half(ws, b, cache, layer, pos, T)
        wqkv = getattr(b, "wqkv", None)
        if wqkv is not None:
            p, depth, path = self._tables(pos, cache)
            g, local = cache.group(layer)
            bqkv = getattr(b, "bqkv", None)
            bias = None if bqkv is None else bqkv.w
            if g.impl.quantized:
                ep = k_rope.qkv_stage_epilogue(ws.q[:T], ws.k[:T], ws.v[:T], p, self.rope_table,
                                               depth=depth, path=path, bias=bias)
                self._norm_matmul(ws.x, b.attn_norm, wqkv, ws.q, T, ep)
                self._kv_store(ws.k[:T], ws.v[:T], g, local, p, depth, path, cache.window)
            else:
                ep = k_rope.qkv_epilogue(ws.q[:T], g.k.data, g.v.data, local, p, self.rope_table,
                                         depth=depth, path=path, window=cache.window, bias=bias)
                self._norm_matmul(ws.x, b.attn_norm, wqkv, ws.q, T, ep)
        else:
            for W, bias, out in ((b.wq, b.bq, ws.q), (b.wk, b.bk, ws.k), (b.wv, b.bv, ws.v)):
                self._norm_matmul(ws.x, b.attn_norm, W, out, T)
                if bias is not None:
                    self.add_bias(out, bias, T)
            self.rope_kv_append(ws.q, ws.k, ws.v, cache, layer, pos, T)
        self.attention(ws.q, cache, layer, pos, T, ws.att)
        self.sublayer_out(ws, ws.att, b.wo, b.attn_out_norm, T)

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
        self.sublayer_out(ws, ws.g, b.w_down, b.mlp_out_norm, T)

    def final_logits(self, ws: Workspace, w: ModelWeights, row0: int, T: int) -> None:
        """The final norm fused into the head matmul (one launch)."""
        if not self.fuse or w.final_norm is None:
            return super().final_logits(ws, w, row0, T)
        self._norm_matmul(self.rows(ws.x, row0), w.final_norm, w.head, ws.logits, T)
