"""The backend-ops interface the looped forward is written against.

A backend owns device memory (weights, workspace, KV caches) and implements a small set of ops over
*row blocks*: every activation buffer has ``rows`` rows of features and an op touches rows
``0 .. T-1``. Positions are an opaque *position handle* made by :meth:`Backend.positions` (a Python
int on the CPU, a device int32[1] on CUDA so that a captured graph replays unchanged); row t of a
launch is at absolute position ``pos + t`` and its KV lands in cache slot ``pos + t``.

Contract shared by every backend (tested):

* **Batch invariance.** Each output element is reduced in a fixed order that does not depend on T,
  so row t of a T-row launch is bit-identical to the same row computed alone.
* **No allocation in ops.** Ops write into buffers made by :meth:`alloc_workspace` /
  :meth:`alloc_cache`; nothing is allocated inside the decode loop.

Composite ops (:meth:`attn_half`, :meth:`mlp_half`, :meth:`final_logits`) have default
implementations over the primitives; a backend overrides them with fused kernels where that removes
launches or passes over memory. The forward only calls composites and the few primitives it needs.

Optional capabilities (:data:`CAPABILITIES`) are mixin classes a backend inherits:
:class:`TreeOps`, :class:`DeviceChaining`, :class:`CacheReuse`, :class:`TokenMasks`,
:class:`KVLayerCopy`, :class:`GuardedSteps`, :class:`LaneOps`, :class:`DeviceSampling` and
:class:`DeviceAcceptance`.
Callers ask :meth:`Backend.supports` and fall back; a decoder that cannot declares
``Decoder.requires``. Backends are registered as :class:`BackendEntry` classes through the
``tinyloop_backends`` hook (one registry for every name check).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import Any, Dict, FrozenSet, Mapping

import numpy as np

from ..model.arch import ModelConfig
from ..errors import BackendError


@dataclass(slots=True)
class Workspace:
    """Activation buffers for up to ``rows`` rows (shape legend: T rows x features).

    x (T, d) residual; h (T, d) normed; e (T, d) loop-inject copy; q (T, q_dim); k, v (T, kv_dim);
    att (T, q_dim); g, u (T, d_ff); logits (T, vocab); snap_x, snap_e (T, d) residual stashes
    (speculative verify-resume); ids (T,) the token-id buffer set_ids fills (and, on a
    :class:`DeviceChaining` backend, the tokens chained where the logits live).

    Every buffer is a declared field (``slots``: assigning an undeclared attribute raises), so what
    a workspace holds is visible here; a backend that needs more (staging buffers, split-reduction
    partials) declares them in a dataclass subclass of its own (e.g. tinyloop.cuda.backend's
    CUDAWorkspace), and :meth:`buffers` lists them all.
    """

    rows: int
    x: Any
    h: Any
    e: Any
    q: Any
    k: Any
    v: Any
    att: Any
    g: Any
    u: Any
    logits: Any
    snap_x: Any = None
    snap_e: Any = None
    ids: Any = None

    def buffers(self) -> Dict[str, Any]:
        """Every declared buffer by name (``rows`` excluded)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "rows"}


@dataclass
class TreeRows:
    """A position handle for a launch over nodes of a draft tree (tree-speculative decoding).

    Row t is tree node ``n`` at depth ``depth[t]``: its RoPE position is ``pos + depth[t]``, its
    K/V go to cache slot ``pos + path[t, depth[t]]`` (``path[t, :depth[t]+1]`` lists the node
    indices from the root to the node itself), and it attends to slots ``0 .. pos-1`` (the
    committed context) and then to ``pos + path[t, i]`` for i = 0 .. depth[t], in that order. For a
    chain (path[t] = 0, 1, .., t) this is exactly causal attention. `pos` is the backend's ordinary
    position handle; depth (rows,) and path (rows, max_depth + 1) are int32 tables in backend
    memory (:meth:`Backend.tree_layout`), already offset to the launch's first row.
    """

    pos: Any
    depth: Any
    path: Any


@dataclass
class BlockWeights:
    """Backend handles of one transformer block's tensors."""

    attn_norm: Any
    wq: Any
    wk: Any
    wv: Any
    wo: Any
    mlp_norm: Any
    w_gate: Any
    w_up: Any
    w_down: Any
    bq: Any = None
    bk: Any = None
    bv: Any = None
    """Projection biases (float vectors), None unless the model has qkv_bias."""
    attn_out_norm: Any = None
    mlp_out_norm: Any = None
    """The norms after each sublayer (block_norm "sandwich" / "sublayer"), None for "pre"."""


@dataclass
class ModelWeights:
    """Backend handles of a whole model, grouped the way the forward walks them."""

    embed: Any
    pre: list
    loop: list
    post: list
    final_norm: Any
    head: Any
    nbytes: int = 0
    loop_adapter_x: Any = None
    loop_adapter_e: Any = None
    """The loop-input adapter's halves (loop_inject "adapter"), else None."""
    loop_norm: Any = None
    """The loop's norm (loop_norm "after" / "every"), else None."""
    exit_gate: Any = None
    exit_gate_bias: Any = None
    """The learned exit gate's weight (d_model,) and bias (1,) vectors (exit_gate), else None."""

    @classmethod
    def from_handles(cls, cfg: ModelConfig, h: Mapping[str, Any], nbytes: int = 0) -> "ModelWeights":
        def blocks(part: str, n: int) -> list:
            return [BlockWeights(**{f: h.get(f"{part}.{i}.{f}") for f in BlockWeights.__dataclass_fields__})
                    for i in range(n)]
        return cls(embed=h["embed"], pre=blocks("pre", cfg.n_pre), loop=blocks("loop", cfg.n_loop),
                   post=blocks("post", cfg.n_post), final_norm=h.get("final_norm"),
                   head=h["embed"] if cfg.tied_embeddings else h["head"], nbytes=nbytes,
                   loop_adapter_x=h.get("loop_adapter_x"), loop_adapter_e=h.get("loop_adapter_e"),
                   loop_norm=h.get("loop_norm"), exit_gate=h.get("exit_gate"),
                   exit_gate_bias=h.get("exit_gate_bias"))


class Backend(ABC):
    """The ops every backend implements (abstract here), over row blocks. Optional capabilities
    are the mixin classes below (:class:`TreeOps`, :class:`DeviceChaining`); a backend class
    inherits the ones it provides, and callers ask with :meth:`supports` and fall back without
    them. Implementations: tinyloop.cpu.backend.CPUBackend, tinyloop.cuda.backend.CUDABackend;
    backends are found through the ``tinyloop_backends`` hook (:class:`BackendEntry`)."""

    name: str = "abstract"
    #: The key of this backend's KV codec implementations (KVCodec.backend_impls): backends that
    #: share kernels (a subclass of the CPU backend, say) share it.
    codec_key: str = "abstract"

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg

    # ------------------------------------------------------------------ capabilities
    @property
    def capabilities(self) -> FrozenSet[str]:
        """Names of the optional capabilities this backend provides (see CAPABILITIES): those of
        the capability classes it inherits. A subclass may narrow it (never widen it: the methods
        must exist) to run without a capability, e.g. to test a decoder's fallback."""
        return frozenset(name for name, cls in CAPABILITIES.items() if isinstance(self, cls))

    def supports(self, capability: str) -> bool:
        """True when this backend provides the named optional capability."""
        if capability not in CAPABILITIES:
            raise BackendError(f"unknown backend capability {capability!r}; known: {', '.join(CAPABILITIES)}")
        return capability in self.capabilities

    # ------------------------------------------------------------------ memory
    @abstractmethod
    def load_weights(self, model_file) -> ModelWeights:
        """Take the model's tensors (a format.ModelFile) into backend memory: copies, with every
        transfer finished on return, since the caller closes the file right after (its tensors
        are read from the file on each access)."""

    @classmethod
    def workspace_layout(cls, cfg: ModelConfig, rows: int, max_seq_len: int) -> Dict[str, tuple]:
        """{buffer name: (shape, numpy dtype)} of every device buffer alloc_workspace(rows) makes
        for a model loaded with max_seq_len: the one description both the allocation and
        estimate_memory read, so the estimate is what is held."""
        raise NotImplementedError(f"{cls.__name__} does not describe its workspace")

    @classmethod
    def workspace_nbytes(cls, cfg: ModelConfig, rows: int, max_seq_len: int) -> int:
        """Device bytes the backend holds besides weights and KV caches once alloc_workspace(rows)
        ran: the workspace (from workspace_layout), plus any table a backend makes at construction
        (a subclass adds it)."""
        return sum(int(np.prod(shape)) * np.dtype(dt).itemsize
                   for shape, dt in cls.workspace_layout(cfg, rows, max_seq_len).values())

    @classmethod
    def weights_nbytes(cls, cfg: ModelConfig):
        """Bytes load_weights will hold for a model of `cfg`, where the backend lays its weights out
        in a way the file does not tell (padding, a blocked copy); None: estimate_memory's formula
        for the entry's ``weights_dtype``."""
        return None

    @classmethod
    def cache_slots(cls, n_slots: int, window: int = 0) -> int:
        """Slots alloc_cache allocates per layer for a spec of n_slots (a backend may round up)."""
        return n_slots

    @abstractmethod
    def alloc_workspace(self, rows: int) -> Workspace:
        """Activation buffers for launches of up to `rows` rows (every buffer a declared field of
        the returned Workspace, or of the backend's Workspace subclass)."""

    @abstractmethod
    def alloc_cache(self, spec) -> Any:
        """A zeroed KV cache laid out as `spec` (tinyloop.runtime.cache.CacheSpec): one K and one V
        storage per layer group, in the group's codec, with spec.n_slots slots per layer. The
        returned object has ``spec`` (the spec it was made for, possibly with more slots: the
        attribute is authoritative), ``n_slots`` and ``nbytes``. Ops that take a global `layer`
        resolve it with ``cache.spec.group_of(layer)``; the slot map ``cache.spec.slots`` says
        where position p lives (slot p, or p % n_slots with attention over the last `window`
        positions)."""

    @abstractmethod
    def copy_cache(self, dst, src, n_slots: int) -> None:
        """Make `dst` hold `src`'s K/V in slots 0..n_slots-1 of every layer (forking a decode state,
        e.g. a beam). Both caches come from :meth:`alloc_cache` with the same spec; a
        backend may copy more slots than asked (the whole cache), never fewer. Ordered after every
        op queued before it."""

    def report(self, stats) -> None:
        """Called with a request's GenerateStats when it ends (a backend may print a profile)."""

    def release_cache(self, cache) -> None:
        """A request is done with `cache` (a backend may keep it for the next request)."""

    def free(self) -> None:
        """Release everything this backend holds (weights, workspaces, caches)."""

    def memory_bytes(self) -> int:
        """Bytes held on the backend's device by weights and workspaces."""
        return 0

    # ------------------------------------------------------------------ positions / host transfer
    @abstractmethod
    def positions(self, pos: int) -> Any:
        """A position handle for absolute position `pos`."""

    def advance_position(self, pos, n: int = 1) -> None:
        """Advance a device-resident position by n (default: one, at the end of a one-token step, so
        a captured step finds the next position in place); a no-op where positions are host ints."""

    @abstractmethod
    def set_ids(self, ws: Workspace, ids) -> Any:
        """Upload token ids (sequence of ints) into ws.ids; returns the handle a forward takes."""

    @abstractmethod
    def logits_to_host(self, ws: Workspace, row: int):
        """Row `row` of ws.logits as a host float32 numpy array (a view or copy)."""

    @abstractmethod
    def logits_block_to_host(self, ws: Workspace, n: int):
        """Rows 0..n-1 of ws.logits as a host float32 array (scoring; may allocate)."""

    @abstractmethod
    def rows_to_host(self, buf, n: int):
        """Rows 0..n-1 of an activation buffer (ws.x, ws.e, ...) as a new host float32 array, after
        every op queued before it has finished (diagnostics such as tinyloop.analysis.loopgain, and
        the conformance suite; allocates)."""

    @abstractmethod
    def rows(self, buf, row0: int):
        """A view of `buf` starting at row `row0` (for ops on a suffix of rows)."""

    # ------------------------------------------------------------------ primitive ops
    @abstractmethod
    def embed(self, table, ids, out, T: int) -> None:
        """out[t] = dequantized row ids[t] of `table`, times the model's embed_scale (when not 1)."""

    @abstractmethod
    def rmsnorm(self, x, w, out, T: int) -> None:
        """out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w."""

    @abstractmethod
    def matmul(self, x, W, out, T: int, accumulate: bool = False) -> None:
        """out[t, n] (+)= sum_k x[t, k] * W[n, k]."""

    @abstractmethod
    def rope_kv_append(self, q, k, v, cache, layer: int, pos, T: int) -> None:
        """RoPE on q and k rows at positions pos+t (in place), then K/V rows stored (in the layer
        group's codec) at the slots of positions pos+t (the cache's slot map)."""

    @abstractmethod
    def attention(self, q, cache, layer: int, pos, T: int, out) -> None:
        """Causal GQA attention of query rows (positions pos+t) over positions 0..pos+t, or the
        last `window` of them for a ring slot map; keys are reduced in position order."""

    @abstractmethod
    def swiglu(self, g, u, out, T: int) -> None:
        """out = silu(g) * u."""

    @abstractmethod
    def add(self, x, y, T: int) -> None:
        """x += y."""

    def add_bias(self, x, b, T: int) -> None:
        """x[t] += b for t < T (b a float vector of x's width): the q/k/v biases of a model with
        qkv_bias. A backend without it cannot load such a model (checked at load)."""
        raise BackendError(f"the {self.name} backend has no add_bias op, which models with "
                           f"qkv_bias need")

    @abstractmethod
    def copy(self, dst, src, T: int) -> None:
        """dst[:T] = src[:T]."""

    def zero(self, x, T: int) -> None:
        """x[:T] = 0: the loop's initial state of a model with loop_init "zeros". A backend
        without it cannot load such a model (checked at load)."""
        raise BackendError(f"the {self.name} backend has no zero op, which models with "
                           f"loop_init='zeros' need")

    def init_state(self, x, pos, T: int) -> None:
        """x[:T] = the seeded random initial state (loop_init "random") of the T rows at the
        positions of handle `pos` (their RoPE positions: pos + t, or a tree's pos + depth[t]),
        exactly tinyloop.model.init_state.random_state. A backend without it cannot load such a
        model (checked at load)."""
        raise BackendError(f"the {self.name} backend has no init_state op, which models with "
                           f"loop_init='random' need")

    def norm_add(self, x, y, w, T: int) -> None:
        """x += rmsnorm(y) * w (y may be clobbered): a sublayer's normed output added to the
        residual. Default: rmsnorm in place, then add (a backend fuses them)."""
        self.rmsnorm(y, w, y, T)
        self.add(x, y, T)

    def sublayer_out(self, ws: Workspace, src, W, out_norm, T: int) -> None:
        """The residual update by one sublayer's output W @ src, as the model's block_norm
        places its norms: x += W @ src ("pre"); x = norm(x + W @ src) ("sandwich"); x +=
        norm(W @ src) ("sublayer"; ws.h is clobbered)."""
        style = self.cfg.block_norm
        if style == "sublayer":
            self.matmul(src, W, ws.h, T)
            self.norm_add(ws.x, ws.h, out_norm, T)
            return
        self.matmul(src, W, ws.x, T, accumulate=True)
        if style == "sandwich":
            self.rmsnorm(ws.x, out_norm, ws.x, T)

    # ------------------------------------------------------------------ composites (fusable)
    def attn_half(self, ws: Workspace, b: BlockWeights, cache, layer: int, pos, T: int) -> None:
        """x += Wo @ attention(rope(Wq n(x)), rope(Wk n(x)), Wv n(x)), KV appended to `layer`."""
        self.qkv_project(ws, b, ws.x, T)
        self.rope_kv_append(ws.q, ws.k, ws.v, cache, layer, pos, T)
        self.attention(ws.q, cache, layer, pos, T, ws.att)
        self.sublayer_out(ws, ws.att, b.wo, b.attn_out_norm, T)

    def mlp_half(self, ws: Workspace, b: BlockWeights, T: int) -> None:
        """x += Wd @ (silu(Wg n(x)) * Wu n(x))."""
        self.rmsnorm(ws.x, b.mlp_norm, ws.h, T)
        self.matmul(ws.h, b.w_gate, ws.g, T)
        self.matmul(ws.h, b.w_up, ws.u, T)
        self.swiglu(ws.g, ws.u, ws.g, T)
        self.sublayer_out(ws, ws.g, b.w_down, b.mlp_out_norm, T)

    def kv_project(self, ws: Workspace, b: BlockWeights, cache, layer: int, pos, T: int, src) -> None:
        """K/V of rows `src` (an activation buffer, not clobbered) through block b's attention
        norm and projections, RoPE'd and stored to `layer` at positions pos+t; nothing attends
        and the residual is untouched (ws.h, ws.q, ws.k, ws.v are clobbered). Early exit's
        ``recompute`` policy fills skipped iterations with it."""
        self.qkv_project(ws, b, src, T)
        self.rope_kv_append(ws.q, ws.k, ws.v, cache, layer, pos, T)

    def qkv_project(self, ws: Workspace, b: BlockWeights, src, T: int) -> None:
        """ws.q, ws.k, ws.v = Wq, Wk, Wv @ norm(src) (+ the block's biases), before RoPE."""
        self.rmsnorm(src, b.attn_norm, ws.h, T)
        self.matmul(ws.h, b.wq, ws.q, T)
        self.matmul(ws.h, b.wk, ws.k, T)
        self.matmul(ws.h, b.wv, ws.v, T)
        if b.bq is not None:
            self.add_bias(ws.q, b.bq, T)
            self.add_bias(ws.k, b.bk, T)
            self.add_bias(ws.v, b.bv, T)

    def final_logits(self, ws: Workspace, w: ModelWeights, row0: int, T: int) -> None:
        """logits[0:T] = head(norm(x[row0:row0+T])) (head(x[row0:row0+T]) without head_norm)."""
        if w.final_norm is None:
            self.matmul(self.rows(ws.x, row0), w.head, ws.logits, T)
            return
        self.rmsnorm(self.rows(ws.x, row0), w.final_norm, ws.h, T)
        self.matmul(ws.h, w.head, ws.logits, T)

    # ------------------------------------------------------------------ greedy picks and graphs
    def launch_argmax(self, ws: Workspace) -> None:
        """Start computing argmax of ws.logits[0] where the logits live (part of a captured step)."""

    @abstractmethod
    def read_argmax(self, ws: Workspace) -> int:
        """The argmax of ws.logits[0] (ties to the lowest id); only the id reaches the host."""

    def launch_argmax_rows(self, ws: Workspace, n: int) -> None:
        """Start the argmax of each of ws.logits[0:n] where the logits live."""

    @abstractmethod
    def read_argmax_rows(self, ws: Workspace, n: int) -> list:
        """The argmax of each of ws.logits[0:n] (ties to the lowest id), as host ints."""

    def replay(self, key, fn, step: bool = True) -> None:
        """Run `fn` (a fixed sequence of ops). A backend with graphs captures it under `key` on first
        use and replays the captured graph afterwards; positions and ids live in device buffers that
        the caller updates before each call, so the same graph serves every step. `step`: `fn` is a
        decode step (a prompt's forward is not), for the backend's node counts."""
        fn()

    def row_pieces(self, T: int) -> list:
        """How a prompt chunk of T rows is launched: consecutive pieces of these row counts (sum T).
        A backend that captures graphs gives a few fixed sizes, so that a handful of captured
        forwards serve every prompt length; rows are independent (batch-invariant kernels), so any
        split computes the same bits."""
        return [T]


# =============================================================================== capabilities
class TreeOps(ABC):
    """Capability ``tree``: launches over the nodes of a draft tree (tree-speculative decoding).

    rope_kv_append and attention accept a :class:`TreeRows` handle as `pos`; top-k picks branch the
    tree; move_cache_slots compacts the accepted path. Without it the tree-speculative decoder runs
    its one-branch tree (chain speculative decoding: the same tokens)."""

    def tree_layout(self, depth, path) -> Any:
        """Backend copies of a draft tree's int32 tables (depth (N,), path (N, D+1)); a backend may
        keep them across requests (they depend on the tree shape only)."""
        return (np.ascontiguousarray(depth, np.int32), np.ascontiguousarray(path, np.int32))

    def tree_positions(self, layout, pos: int, row0: int = 0) -> TreeRows:
        """A :class:`TreeRows` handle for a launch whose row 0 is node `row0` of `layout`, with the
        tree's root at absolute position `pos` (None: where the device's position handle stands,
        for a cycle queued ahead on a device_acceptance backend)."""
        depth, path = layout
        if pos is None:
            if not self.supports("device_acceptance"):
                raise BackendError(f"tree_positions(pos=None) reads the device's position handle: backend "
                                   f"{self.name!r} lacks the device_acceptance capability")
            handle = self.device_position()
        else:
            handle = self.positions(pos)
        return TreeRows(handle, self.rows(depth, row0), self.rows(path, row0))

    @abstractmethod
    def move_cache_slots(self, cache, moves) -> None:
        """For each (src, dst) of `moves` in order: slot dst of every cache layer := slot src
        (compacts an accepted tree path). Ordered after every op queued before it."""

    def launch_topk_rows(self, ws: Workspace, n: int, k: int, out_row=None) -> None:
        """Start the top-k of each of ws.logits[0:n] where the logits live; with `out_row`
        (DeviceChaining backends only), the (n, k) ids go to ws.ids[out_row : out_row + n*k]
        (row-major) instead."""

    @abstractmethod
    def read_topk_rows(self, ws: Workspace, n: int, k: int) -> list:
        """For each of ws.logits[0:n] the k ids of largest logit, best first (ties to the lower id)."""


class DeviceChaining(ABC):
    """Capability ``device_chaining``: greedy token ids stay where the logits live from one step to
    the next, so a whole draft cycle runs as one captured sequence with one readback, and a decode
    step can be queued before the previous token reaches the host. Without it, decoders read each
    token back and upload it (the host loop: the same tokens)."""

    @abstractmethod
    def store_token(self, ws: Workspace, row: int) -> None:
        """ws.ids[row] = the id in the one-token id buffer (the last launch_argmax's token, or the last
        one-token set_ids), where both live."""

    @abstractmethod
    def read_ids(self, ws: Workspace, n: int) -> list:
        """ws.ids[0:n] as host ints, after every op queued before it has finished."""

    @abstractmethod
    def begin_read_argmax(self, ws: Workspace) -> None:
        """Queue the copy of the last launch_argmax's id to the host without waiting for it
        (finish_read_argmax returns it). Ops queued after this call may overwrite the device id:
        the copy is ordered before them."""

    @abstractmethod
    def finish_read_argmax(self, ws: Workspace) -> int:
        """The id begin_read_argmax queued, once its copy has landed (ops queued after it may still
        be running)."""

    @abstractmethod
    def device_token(self, ws: Workspace) -> Any:
        """The one-token id buffer as it is on the device (the last launch_argmax's token), as a
        forward's `ids`: what set_ids returns for one token, without an upload."""

    @abstractmethod
    def device_tokens(self, ws: Workspace, n: int) -> Any:
        """The ids the last launch_argmax_rows(ws, n) leaves where they live, as a forward's `ids`
        for n rows (a lockstep step fed with the previous step's greedy tokens, no upload)."""

    @abstractmethod
    def begin_read_argmax_rows(self, ws: Workspace, n: int) -> None:
        """Queue the copy of the last launch_argmax_rows(ws, n) ids to the host without waiting
        (finish_read_argmax_rows returns them); ops queued after it may overwrite the ids."""

    @abstractmethod
    def finish_read_argmax_rows(self, ws: Workspace, n: int) -> list:
        """The n ids begin_read_argmax_rows queued, once their copy has landed."""


class CacheReuse(ABC):
    """Capability ``cache_reuse``: state that outlives one request (prefix caches, prefix pools and
    warm-start handles, tinyloop.runtime.reuse). A kept cache is copied into a request's cache of
    another layout (more slots, more or fewer loop iterations, a draft's extra layers), and the
    residual stream of a prompt is kept in row buffers between requests. Without it those entry
    points are refused with a BackendError naming the capability."""

    @abstractmethod
    def copy_cache_layers(self, dst, src, n_slots: int) -> None:
        """For every layer group of `dst` that `src` also has (same name and codec; the pairs and
        checks of tinyloop.runtime.cache.shared_layers): layers 0 .. min(layers) - 1, slots
        0 .. n_slots - 1 of dst := src's (codes, scales and zeros). The caches may differ in slots
        and in loop iterations; both use the linear slot map. Ordered after every op queued
        before it; nothing else of dst changes."""

    @abstractmethod
    def alloc_rows(self, n: int, cols: int) -> Any:
        """A zeroed float32 buffer of n rows x cols held by the backend (kept residual rows), usable
        wherever an activation buffer is (copy, rows); released when the last reference goes."""

    @abstractmethod
    def alloc_kept_cache(self, spec) -> Any:
        """A zeroed cache laid out as `spec` (as alloc_cache) for state kept between requests: never
        taken from or handed back to a backend's spare caches and never part of a captured graph,
        so it is released with its last reference."""


class TokenMasks(ABC):
    """Capability ``token_masks``: a constraint's allowed set (a grammar's) is applied to the
    pending logits where they live, so a constrained greedy step sends ~V/8 bytes of mask to the
    device and reads back one id, and the next step can be queued before that id reaches the host
    (Session.greedy). Without it the logits row is copied to the host and masked there (the same
    tokens)."""

    @abstractmethod
    def launch_masked_argmax(self, ws: Workspace, words: np.ndarray) -> None:
        """ws.logits[0][i] := -inf for every token i whose bit (i % 32) of ``words[i // 32]`` is
        clear (a host int32 array of at least ceil(vocab / 32) words; allowed entries keep their
        bits), then launch_argmax: read the masked argmax with read_argmax / begin_read_argmax /
        device_token. Ordered after every op queued before it; `words` may be reused by the
        caller once the call returns."""

    def mask_words(self, words) -> np.ndarray:
        """`words` checked for launch_masked_argmax: a 1-D int32 numpy array covering the vocabulary
        (BackendError otherwise), its first ceil(vocab / 32) words."""
        n = -(-self.cfg.vocab_size // 32)
        if not isinstance(words, np.ndarray) or words.dtype != np.int32 or words.ndim != 1:
            raise BackendError(f"launch_masked_argmax takes a 1-D int32 numpy array of mask words, got "
                               f"{type(words).__name__} {getattr(words, 'dtype', '')}".rstrip())
        if words.shape[0] < n:
            raise BackendError(f"launch_masked_argmax: {words.shape[0]} mask words cover fewer tokens than the "
                               f"vocabulary's {self.cfg.vocab_size} (need {n} words)")
        return words[:n]


class KVLayerCopy(ABC):
    """Capability ``kv_layer_copy``: one position's K/V rows copied between layers of a cache, so a
    token that exits the loop early (tinyloop.runtime.early_exit, policy ``copy_last``) leaves
    the K/V of its last iteration in the layers of the iterations it skipped. Without it that
    policy is refused (``recompute`` runs on the required ops)."""

    @abstractmethod
    def copy_kv_layers_at(self, cache, pos, src_layer: int, dst_layers: range) -> None:
        """For each layer of `dst_layers` (a range of global layers of the same layer group as
        `src_layer`): the stored K and V rows of the position `pos` (a position handle; the
        position's slot under the cache's slot map; codes, scales and zero points) := those of
        `src_layer`. Part of a replayable step (the position is read where it lives)."""


class GuardedSteps(ABC):
    """Capability ``guarded_steps``: a decode step whose later stretches run only while an exit
    flag, set where the probed state lives, is clear (early exit, tinyloop.runtime.early_exit).
    A backend with graphs captures the whole step, probes included, as one graph of conditional
    stretches, so no probe waits for the host; without graphs the flag is read between stretches.
    Without the capability (or for a statistic not in ``exit_stats``) the runtime probes on the
    host: the same decisions, one round trip per probe.

    Probe statistics (`stat`; numpy references in tinyloop.runtime.early_exit.STATISTICS, with the
    direction a stable probe lies in): ``rel_l2``, ``top2_margin``, ``kl``, ``argmax_change``; and
    ``gate_cdf`` (early_exit.GATE_CDF), the learned exit gate's cumulative exit probability
    ``gate_cdf(sum of gate_log_survival)`` over the step's probes, stable at or above the
    threshold."""

    #: The probe statistics this backend computes where the state lives.
    exit_stats: FrozenSet[str] = frozenset()

    @abstractmethod
    def exit_reset(self) -> None:
        """Queue: clear the exit flag, the recorded depth and the stability count (a step's start)."""

    @abstractmethod
    def exit_probe(self, ws: Workspace, src, stat: str, threshold: float, patience: int, depth: int,
                   compare: bool, gate=None) -> None:
        """Queue a probe of row 0 of `src` (ws.x or ws.logits). With `compare`: statistic `stat` of
        it against the stashed previous probe, the count of consecutive stable probes updated
        (reset by an unstable one) and, when it reaches `patience`, the flag set and `depth`
        recorded. Then the row is stashed as the previous probe. For ``gate_cdf``, `gate` is the
        (weight, bias) handles of ModelWeights.exit_gate / exit_gate_bias: the row's
        log-survival is added to the step's running sum (cleared by exit_reset) and the
        statistic is the cumulative exit probability."""

    @abstractmethod
    def exit_copy_last(self, cache, pos, loops: int) -> None:
        """Queue early exit's copy_last for the depth d the guarded step recorded (nothing when it
        did not exit), read where it lives: for each loop layer j and iteration i in d .. loops-1,
        the K/V rows of position `pos` in layer (loop, j, i) := those of (loop, j, d - 1)."""

    @abstractmethod
    def exit_depth(self) -> int:
        """The depth the last guarded step recorded (0: it did not exit), once it has finished."""

    @abstractmethod
    def queue_exit_depth(self) -> None:
        """Queue the copy of the depth the last guarded step records to the host, without waiting
        (ordered after the ops queued before it, so a step queued after it may reset the depth).
        On a DeviceChaining backend, a begin_read_argmax queued after it covers it:
        :meth:`queued_exit_depth` is valid once finish_read_argmax returned."""

    @abstractmethod
    def queued_exit_depth(self) -> int:
        """The depth the last queue_exit_depth copied (0: no exit), once its copy has landed."""

    def replay_guarded(self, key, head, stretches, fills, tail) -> None:
        """Run head(); each of `stretches` in order while the flag is clear; ``fills[d]()`` for
        the recorded depth d (if it exited and `fills` has d); then tail(). exit_reset is queued
        first. A backend with graphs captures it all under `key` and replays it; this default
        reads the flag on the host between stretches."""
        self.exit_reset()
        head()
        for fn in stretches:
            if self.exit_depth():
                break
            fn()
        d = self.exit_depth()
        if d and d in fills:
            fills[d]()
        tail()


class DeviceSampling(ABC):
    """Capability ``device_sampling``: the draw of tinyloop.runtime.sampling.sample_token run where
    the logits live, so a sampling step, like a greedy one, sends only a token id to the host and
    can be queued before the previous token is read (DeviceChaining's reads and device_token see
    the drawn token). The session uses it for requests with no logit processors, no early exit
    and top_k <= :attr:`sample_kmax`; the others sample on the host (the same tokens)."""

    #: The largest top_k (candidates) the device draw takes.
    sample_kmax: int = 0

    @abstractmethod
    def load_sampler(self, ws: Workspace, temperature: float, top_k: int, top_p: float, uniforms,
                     base: int) -> None:
        """Hold one request's sampling knobs and its uniform numbers (`uniforms`, float64: the
        draw of generated token i uses ``uniforms[i]``; at most the backend's max_seq_len of
        them) where the draws read them; `base` is the prompt's length. Replaces the previous
        request's (captured steps read them where they live)."""

    @abstractmethod
    def launch_sample(self, ws: Workspace, pos, T: int) -> None:
        """Queue: the token sample_token draws from ws.logits row 0 with the loaded knobs and the
        uniform ``uniforms[p + T - base]`` (p the value of the position handle `pos` of the
        launch of T rows whose last row those logits are) into the slot read_argmax reads. Part
        of a replayable step; only the token is written."""


class DeviceAcceptance(ABC):
    """Capability ``device_acceptance`` (with ``device_chaining``): a greedy draft cycle's
    acceptance decided where its ids live, so the next cycle can be queued before the host has
    read this one (the chain and tree decoders' look-ahead, the cycle's counterpart of
    greedy(ahead=True)).

    A cycle is a full draft tree with `branches` children per node and k levels below the root
    (a chain of k drafts: branches = 1), N nodes in breadth-first order (the children of node i
    are nodes i*branches + 1 .. i*branches + branches): its ids are ws.ids rows 0..N-1 (row 0 the
    pending token) and its verify argmax the ids launch_argmax_rows(ws, N) left. The accepted
    path starts at the root and follows the first child whose id equals the verify argmax after
    the current node; n is its length, and the argmax after its last node the next token."""

    @abstractmethod
    def launch_accept(self, ws: Workspace, k: int, branches: int = 1, cache=None) -> None:
        """Queue (part of a replayable cycle): decide the path; the one-token id buffer
        (device_token) becomes the next token, the position handle's value advances by n + 1,
        and the cycle's record (its position, n, ids, verified ids) is kept for
        begin_read_cycle. A tree names its cache (required with branches > 1): the accepted
        nodes' slots are compacted to position + depth as move_cache_slots would. The host mirrors of the position
        and the token are unknown afterwards."""

    @abstractmethod
    def device_position(self) -> Any:
        """The one-token position handle as the device holds it (after launch_accept the host
        does not know its value), for a step queued before the host has read it: what
        positions(p) returns, without an upload."""

    @abstractmethod
    def begin_read_cycle(self, ws: Workspace, k: int, slot: int, branches: int = 1) -> None:
        """Queue the copy of the last launch_accept's record into host slot `slot` (0 or 1: a
        cycle queued ahead has its own slot, read while the next one runs); ops queued after
        this call may overwrite the device record."""

    @abstractmethod
    def finish_read_cycle(self, ws: Workspace, k: int, slot: int, branches: int = 1) -> tuple:
        """``(position, n, ids, verified)`` of the record begin_read_cycle queued into `slot`
        (ids: the N cycle ids, verified: the N verify argmax ids), once it has landed."""


class LaneOps(ABC):
    """Capability ``lanes``: launches whose rows belong to different sequences (batch lanes of a
    lockstep batch, tinyloop.runtime.lockstep), each with its own position and its own region of
    one cache. The cache's slot map has ``lanes`` > 0 (tinyloop.runtime.cache.SlotMap): lane l's
    position p lives in slot ``l * lane_slots + p``, and a row of lane l at position p attends to
    its lane's positions 0 .. p only, reduced in position order, so it computes exactly what the
    same row of a one-sequence launch computes (batch invariance). rope_kv_append, attention and
    the composites accept the handle :meth:`lane_positions` makes as `pos`. Without it
    generate_batch decodes its prompts one after another (the same tokens)."""

    @abstractmethod
    def lane_positions(self, cache, lanes, positions) -> Any:
        """A position handle for a launch over a lanes cache whose row t is lane ``lanes[t]`` at
        position ``positions[t]`` (sequences of host ints, at most the workspace's rows; every
        position below the cache's ``spec.slots.lane_slots``; BackendError otherwise). The handle
        reads its tables where they live, so a captured step replays with the positions of the
        latest call; a backend may hold one handle per cache (a call invalidates the previous
        handle of the same cache)."""

    @abstractmethod
    def advance_lanes(self, pos, n: int) -> None:
        """Queue: the positions of rows 0 .. n-1 of a lane_positions handle += 1 where they live
        (the end of a lockstep step, so a replay fed with device_tokens finds its next positions
        in place; part of a replayable step)."""


def lane_tables(lanes, positions, lane_slots: int, n_lanes: int, rows: int):
    """Host tables of a lanes launch as a :class:`TreeRows` layout rooted at position 0 (the way
    both built-in backends execute lanes): row t's depth is its position and its path lists the
    slots of its lane's positions 0 .. lane_slots-1 (:func:`fill_lane_paths`). Returns (depth
    (T,), lane of each row (T,)) as int32 arrays, checked: BackendError for a lane or position
    outside the cache or more rows than `rows`."""
    lanes = np.asarray(lanes, np.int64).reshape(-1)
    positions = np.asarray(positions, np.int64).reshape(-1)
    if lanes.shape != positions.shape or not 0 < lanes.shape[0] <= rows:
        raise BackendError(f"lane_positions: {lanes.shape[0]} lanes and {positions.shape[0]} positions for a "
                           f"launch of 1 .. {rows} rows")
    if lanes.min() < 0 or lanes.max() >= n_lanes:
        raise BackendError(f"lane_positions: lane {int(lanes.max() if lanes.max() >= n_lanes else lanes.min())} "
                           f"is outside the cache's lanes [0, {n_lanes})")
    if positions.min() < 0 or positions.max() >= lane_slots:
        bad = int(positions.max() if positions.max() >= lane_slots else positions.min())
        raise BackendError(f"lane_positions: position {bad} is outside a lane's slots [0, {lane_slots})")
    return positions.astype(np.int32), lanes.astype(np.int32)


def fill_lane_paths(path, held, lane_of, lane_slots: int):
    """Make rows 0 .. T-1 of a lanes path table (host, (rows, lane_slots) int32) hold the slots of
    the lanes `lane_of` (T,) assigns them, rewriting only the rows whose lane changed; `held`
    (rows,) records each row's lane (-1: none yet) and is updated. Returns the half-open range of
    rewritten rows, or None when none changed (a backend uploads only that range)."""
    changed = np.flatnonzero(held[:lane_of.shape[0]] != lane_of)
    if not changed.size:
        return None
    base = np.arange(lane_slots, dtype=np.int32)
    for t in changed:
        path[t] = base + lane_of[t] * lane_slots
        held[t] = lane_of[t]
    return int(changed[0]), int(changed[-1]) + 1


#: The optional capabilities by name (Backend.supports).
CAPABILITIES: Dict[str, type] = {"tree": TreeOps, "device_chaining": DeviceChaining,
                                 "cache_reuse": CacheReuse, "token_masks": TokenMasks,
                                 "kv_layer_copy": KVLayerCopy, "guarded_steps": GuardedSteps,
                                 "lanes": LaneOps, "device_sampling": DeviceSampling,
                                 "device_acceptance": DeviceAcceptance}


# =============================================================================== registry
class BackendEntry:
    """A backend as the ``tinyloop_backends`` hook registers it (a class, like every registry;
    ``description`` is the one line `tinyloop inspect` prints after its name).

    ``name`` selects it (RunConfig.backend, load_model(backend=...), the CLI's --backend);
    ``impl`` is "module:Class" of its Backend subclass, imported only when a model is loaded on it;
    ``available()`` says whether this machine can run it (and why not); ``auto_priority`` orders
    the candidates of backend="auto" (highest available wins; None: never chosen automatically);
    ``weights_dtype`` says how weights are held ("dequantized" float32 or "packed" as stored), for
    estimate_memory."""

    name: str = ""
    impl: str = ""
    auto_priority: Any = None
    weights_dtype: str = "packed"
    description: str = ""

    @classmethod
    def available(cls, simulator_ok: bool = False) -> tuple:
        """(True, "") when this machine can run the backend, else (False, the reason)."""
        return True, ""

    @classmethod
    def memory_model(cls, cfg: ModelConfig, rows: int, max_seq_len: int):
        """(workspace bytes, cache slots per layer of a max_seq_len request) as the backend lays
        them out (Backend.workspace_nbytes / cache_slots; imports the backend class); the
        workspace is None where the backend does not describe it."""
        be = cls.load_class()
        try:
            ws = be.workspace_nbytes(cfg, rows, max_seq_len)
        except NotImplementedError:
            ws = None
        return ws, be.cache_slots(max_seq_len)

    @classmethod
    def weights_model(cls, cfg: ModelConfig):
        """Backend.weights_nbytes of the backend (imports the backend class): the bytes its weights
        take once loaded, or None where the weights_dtype formula applies."""
        return cls.load_class().weights_nbytes(cfg)

    @classmethod
    def load_class(cls) -> type:
        modname, _, clsname = cls.impl.partition(":")
        try:
            obj = getattr(importlib.import_module(modname), clsname)
        except (ImportError, AttributeError) as exc:
            raise BackendError(f"backend {cls.name!r}: cannot import {cls.impl!r}: {exc}") from exc
        if not (isinstance(obj, type) and issubclass(obj, Backend)):
            raise BackendError(f"backend {cls.name!r}: {cls.impl!r} is not a Backend subclass")
        return obj
