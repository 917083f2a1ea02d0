"""The KV cache as a spec the backends execute.

A request's cache is described, not implemented, by the plugins that shape it:

* a **storage codec** (:class:`KVCodec`, hook ``tinyloop_kv_codecs``): how one K or V row of
  head_dim values is stored (codes, and a per-row scale and zero point for the quantized ones) and
  its float reference (``encode`` / ``decode``, numpy, the definition every backend matches);
* a **cache mode** (:class:`CacheMode`, hook ``tinyloop_cache_modes``, GenerateConfig.cache_mode):
  which codec each layer group uses;
* a **slot map** (:class:`SlotMapMode`, hook ``tinyloop_slot_maps``): how positions map to cache
  slots. Backends execute one parametric family, :class:`SlotMap`: a ring of ``n_slots`` slots in
  which a query at position p attends to the last ``window`` positions (``window = 0``: every
  position 0..p, slot = position). Tree rows (speculative trees) are a position handle
  (tinyloop.runtime.backend.TreeRows) over the linear map.

:class:`CacheSpec` puts them together: layer groups in the order pre | post | extra groups (a
speculative draft's post layers) | loop iterations. The loop group is last, so the number of loop
iterations a cache holds can grow after allocation without moving any other layer (warm start,
early exit). A backend allocates one storage per group (``Backend.alloc_cache(spec)``) and resolves
each group's codec to store/load code inside its own kernels (``KVCodec.backend_impls``).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Optional, Tuple

import numpy as np

from ..errors import ConfigError, PluginError


# --------------------------------------------------------------------------- codecs
class KVCodec:
    """How one K or V row (head_dim floats of one position and KV head) is stored.

    Storage per layer group and for K and V each: ``data`` (layers, slots, n_kv_heads,
    head_dim // pack) of ``data_dtype``, plus ``scale`` and ``zero`` (layers, slots, n_kv_heads)
    float32 when the codec has them. ``encode`` / ``decode`` are the float32 numpy reference of the
    format; a backend's implementation must store and load exactly these values."""

    name: ClassVar[str] = ""
    """The codec's name (a CacheMode's ``codec``)."""
    data_dtype: ClassVar[str] = "float32"
    """numpy dtype name of the stored codes."""
    pack: ClassVar[int] = 1
    """Values per stored code (2 for two 4-bit codes per byte)."""
    has_scale: ClassVar[bool] = False
    """A float32 scale per row."""
    has_zero: ClassVar[bool] = False
    """A float32 zero point (offset) per row."""
    backend_impls: ClassVar[Mapping[str, str]] = {}
    """Backend name -> "module:attribute" of that backend's implementation of this codec."""

    @classmethod
    def data_cols(cls, head_dim: int) -> int:
        return head_dim // cls.pack

    @classmethod
    def row_bytes(cls, head_dim: int) -> int:
        """Bytes one stored row (K or V of one position and KV head) takes."""
        return (cls.data_cols(head_dim) * np.dtype(cls.data_dtype).itemsize
                + 4 * (int(cls.has_scale) + int(cls.has_zero)))

    @classmethod
    def encode(cls, x: np.ndarray) -> Tuple[np.ndarray, Optional[np.ndarray], Optional[np.ndarray]]:
        """float32 rows (..., head_dim) -> (data (..., head_dim // pack), scale (...) | None,
        zero (...) | None)."""
        raise NotImplementedError

    @classmethod
    def decode(cls, data: np.ndarray, scale: Optional[np.ndarray], zero: Optional[np.ndarray]) -> np.ndarray:
        """The float32 rows (..., head_dim) a backend's attention reads back."""
        raise NotImplementedError

    @classmethod
    def roundtrip(cls, x: np.ndarray) -> np.ndarray:
        """x (..., head_dim) as stored and read back, float64 (the oracle's model of the cache)."""
        return cls.decode(*cls.encode(np.asarray(x, np.float32))).astype(np.float64)

    @classmethod
    def impl(cls, backend: str) -> Any:
        """This codec's implementation object for `backend` (imported on first use)."""
        path = cls.backend_impls.get(backend)
        if path is None:
            raise PluginError(f"KV codec {cls.name!r} has no implementation for the {backend} backend "
                              f"(it provides: {sorted(cls.backend_impls) or 'none'})")
        modname, _, attr = path.partition(":")
        try:
            return getattr(importlib.import_module(modname), attr)
        except (ImportError, AttributeError) as exc:
            raise PluginError(f"KV codec {cls.name!r}: cannot import its {backend} implementation "
                              f"{path!r}: {exc}") from exc


# --------------------------------------------------------------------------- cache modes
class CacheMode:
    """A KV storage mode selectable with GenerateConfig.cache_mode: which codec each layer group
    of the cache uses."""

    name: ClassVar[str] = ""
    """The value of GenerateConfig.cache_mode that selects this mode."""
    mode: ClassVar[Optional[str]] = None
    """Row of configs/compat.yaml this plugin provides."""
    compat: ClassVar[Mapping[str, str]] = {}
    """Declared compat cells (context -> ok / partial / rejected); must equal the YAML row."""
    codec: ClassVar[str] = ""
    """Codec of every layer group (override group_codec to mix codecs)."""

    @classmethod
    def group_codec(cls, group: str) -> str:
        """Codec name of layer group `group` (pre, post, draft_post, loop)."""
        return cls.codec


# --------------------------------------------------------------------------- slot maps
@dataclass(frozen=True)
class SlotMap:
    """Where positions live in a cache layer: a ring of `n_slots` slots; a query at position p
    attends to positions max(0, p - window + 1) .. p, position j at slot j % n_slots. window = 0
    is the linear map: every position 0 .. p, slot = position (positions must stay below
    n_slots). The session sizes a ring so that no launch overwrites a slot one of its rows still
    reads: n_slots >= min(positions, window + rows per launch - 1)."""

    n_slots: int
    window: int = 0
    #: batch lanes (lockstep decoding, tinyloop.runtime.lockstep): > 0 splits the slots into
    #: `lanes` linear regions of ``lane_slots`` slots each, lane l's position p at slot
    #: ``l * lane_slots + p``; launches address them through Backend.lane_positions (capability
    #: ``lanes``). 0: one sequence.
    lanes: int = 0

    def __post_init__(self) -> None:
        if self.n_slots < 1:
            raise ConfigError(f"a cache needs at least one slot, got n_slots={self.n_slots}")
        if self.window < 0:
            raise ConfigError(f"window={self.window} must be >= 0 (0: linear)")
        if self.lanes < 0 or (self.lanes and (self.window or self.n_slots < self.lanes)):
            raise ConfigError(f"lanes={self.lanes} must be >= 0, at most n_slots={self.n_slots}, and lanes "
                              f"need a linear map (window={self.window})")

    @property
    def ring(self) -> bool:
        return self.window > 0

    @property
    def lane_slots(self) -> int:
        """Slots of one lane's region (all of them without lanes)."""
        return self.n_slots // self.lanes if self.lanes else self.n_slots

    def slot(self, position: int, lane: int = 0) -> int:
        """The slot absolute position `position` (of lane `lane`, with lanes) lives in."""
        bound = self.lane_slots
        if (not 0 <= position < (1 << 40) or (not self.ring and position >= bound)
                or not 0 <= lane < max(1, self.lanes)):
            raise PluginError(f"position {position} of lane {lane} has no slot in a cache of {self.n_slots} "
                              f"slots (window={self.window}, lanes={self.lanes})")
        if self.ring:
            return position % self.n_slots
        return lane * bound + position


class SlotMapMode:
    """A slot-map plugin: switched on by a request setting (``from_config``), it sizes the ring."""

    name: ClassVar[str] = ""
    mode: ClassVar[Optional[str]] = None
    compat: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def from_config(cls, config) -> Optional["SlotMapMode"]:
        """An instance when the request enables this slot map, else None."""
        return None

    def validate(self, max_seq_len: int) -> None:
        """Model-dependent checks (before any allocation)."""

    def launch_rows(self, rows: int) -> int:
        """The most rows one launch (a prefill chunk) may carry, given the workspace's `rows`."""
        return rows

    def slot_map(self, positions: int, launch_rows: int) -> SlotMap:
        """The map for a request touching `positions` positions with launches of up to
        `launch_rows` rows."""
        raise NotImplementedError


def linear_slots(positions: int) -> SlotMap:
    """The default map: one slot per position."""
    return SlotMap(n_slots=positions)


# --------------------------------------------------------------------------- the spec
@dataclass(frozen=True)
class LayerGroup:
    """`n_layers` cache layers stored with one codec."""

    name: str
    n_layers: int
    codec: str


@dataclass(frozen=True)
class CacheSpec:
    """A whole cache: layer groups (global layer numbers run through them in order) and the slot
    map they share. ``loop`` is the last group; each loop iteration owns ``n_loop`` of its layers."""

    groups: Tuple[LayerGroup, ...]
    slots: SlotMap
    n_loop: int
    codecs: Optional[Mapping[str, type]] = field(default=None, compare=False, repr=False)
    """The groups' KVCodec classes by name, as the request resolved them (its plugin snapshot: a
    codec unregistered after the request was validated still serves it); None: the registered ones."""

    def codec_class(self, name: str) -> type:
        """The KVCodec class of codec `name` (PluginError when it is neither the spec's nor registered)."""
        if self.codecs is not None and name in self.codecs:
            return self.codecs[name]
        from .plugins import get_plugin_manager
        return get_plugin_manager().codec(name)

    def codec_classes(self) -> Mapping[str, type]:
        """{codec name: KVCodec class} of the spec's groups (for nbytes)."""
        return {g.codec: self.codec_class(g.codec) for g in self.groups}

    @property
    def n_layers(self) -> int:
        return sum(g.n_layers for g in self.groups)

    @property
    def n_slots(self) -> int:
        return self.slots.n_slots

    @property
    def loops(self) -> int:
        """Loop iterations the cache holds layers for."""
        return self.groups[-1].n_layers // self.n_loop if self.n_loop else 0

    def group_start(self, name: str) -> int:
        start = 0
        for g in self.groups:
            if g.name == name:
                return start
            start += g.n_layers
        raise PluginError(f"the cache has no layer group {name!r} (it has {[g.name for g in self.groups]})")

    def layer(self, part: str, index: int, iteration: int = 0) -> int:
        """Global cache layer of block `index` of `part` (pre, post, draft_post, loop); loop layers
        also need the `iteration`."""
        if part == "loop":
            return self.group_start("loop") + iteration * self.n_loop + index
        return self.group_start(part) + index

    def group_of(self, layer: int) -> Tuple[int, int]:
        """(group index, layer within the group) of a global layer."""
        start = 0
        for i, g in enumerate(self.groups):
            if layer < start + g.n_layers:
                return i, layer - start
            start += g.n_layers
        raise PluginError(f"cache layer {layer} is outside the cache's {self.n_layers} layers")

    def skipped_loop_layers(self, depth: int, loops: int):
        """Early exit's copy_last layers for a token that ran `depth` of `loops` iterations: for each
        loop layer j, (the layer of iteration depth - 1, the range of its layers in iterations
        depth .. loops-1)."""
        for j in range(self.n_loop):
            first = self.layer("loop", j, iteration=depth)
            yield self.layer("loop", j, iteration=depth - 1), range(first, first + (loops - depth) * self.n_loop,
                                                                    self.n_loop)

    def with_loops(self, loops: int) -> "CacheSpec":
        """The same spec with the loop group sized for `loops` iterations."""
        g = self.groups[-1]
        loop = LayerGroup(g.name, loops * self.n_loop, g.codec)
        return dataclasses.replace(self, groups=self.groups[:-1] + (loop,))

    def nbytes(self, n_kv_heads: int, head_dim: int, codecs: Mapping[str, type]) -> int:
        """Bytes the K and V storage of this spec takes."""
        rows = self.n_slots * n_kv_heads
        return sum(2 * g.n_layers * rows * codecs[g.codec].row_bytes(head_dim) for g in self.groups)


def build_spec(cfg, loops: int, mode: type, slots: SlotMap, extra_groups: Tuple[str, ...] = (),
               codecs: Optional[Mapping[str, type]] = None) -> CacheSpec:
    """The spec of a cache for `loops` iterations of model `cfg` under cache mode `mode`.
    `extra_groups` are groups of n_post layers after the post group (a speculative draft's post
    layers: ``draft_post``); `codecs`: the request's KVCodec classes by name (Plan.codecs)."""
    parts = [("pre", cfg.n_pre), ("post", cfg.n_post)] + [(g, cfg.n_post) for g in extra_groups]
    parts.append(("loop", loops * cfg.n_loop))
    groups = tuple(LayerGroup(name, n, mode.group_codec(name)) for name, n in parts)
    return CacheSpec(groups, slots, cfg.n_loop, codecs)


def shared_layers(dst: CacheSpec, src: CacheSpec, n_slots: int) -> Tuple[Tuple[int, int, int], ...]:
    """What Backend.copy_cache_layers copies from a cache laid out as `src` into one laid out as
    `dst`: (dst group index, src group index, layers) for every group of dst that src also has
    (by name), `layers` = the smaller layer count. Raises BackendError when a shared group's codec
    differs, a cache uses a ring, or n_slots exceeds either cache's slots."""
    from ..errors import BackendError
    if dst.slots.ring or src.slots.ring:
        raise BackendError("copying between cache layouts needs linear slot maps (a ring's slots are "
                           "positions modulo its size, which differs between layouts)")
    if isinstance(n_slots, bool) or not isinstance(n_slots, int) or not 0 <= n_slots <= min(dst.n_slots, src.n_slots):
        raise BackendError(f"copy of {n_slots!r} slots does not fit caches of {src.n_slots} and {dst.n_slots} slots")
    if dst.n_loop != src.n_loop:
        raise BackendError(f"caches of {src.n_loop} and {dst.n_loop} layers per loop iteration do not share layers")
    by_name = {g.name: i for i, g in enumerate(src.groups)}
    out = []
    for di, g in enumerate(dst.groups):
        si = by_name.get(g.name)
        if si is None:
            continue
        sg = src.groups[si]
        if sg.codec != g.codec:
            raise BackendError(f"layer group {g.name!r} is stored as {sg.codec} in the source cache and as "
                               f"{g.codec} in the destination; a copy cannot convert codecs")
        out.append((di, si, min(g.n_layers, sg.n_layers)))
    return tuple(out)
