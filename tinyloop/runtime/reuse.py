"""Cache reuse: prefix caches, prefix pools and warm start to a deeper loop (the spec's "Cache Reuse
and State Transition APIs"; docs/ARCHITECTURE.md, "Cache reuse").

Three kinds of kept state, each bound to the model that built it:

* :class:`PrefixCache` (``build_prefix_cache`` / ``generate_from_prefix_cache`` /
  ``free_prefix_cache``): the K/V of a prefix at one loop depth and cache mode. A request whose
  prompt starts with the prefix copies them into its own cache (device to device) and computes only
  the rest.
* :class:`PrefixPool` (``create_prefix_pool`` / ``register_prefix`` / ``generate_with_pool`` /
  ``free_prefix_pool``): prefix caches in a token trie; a request reuses the longest registered
  prefix of its prompt (same loops and cache mode), a miss is an ordinary prefill. LRU eviction on
  the pool's capacity (entries, and bytes if given); hit / miss / eviction counters.
* :class:`ResumeHandle` (``build_resume_handle`` / ``resume_generate`` / ``free_resume_handle``):
  a prompt prefilled at L_used, keeping its cache layers and the residual stream after the last
  iteration at every prompt position. ``resume_generate(handle, L_new)`` runs iterations
  L_used .. L_new - 1 over the prompt from that residual, recomputes the post blocks at the new
  depth and decodes: bit-exact to a fresh request at L_new (the loop block's weights are shared,
  so iteration k of a position depends only on the residual after k - 1 and on cache layers of
  iterations <= k, all kept exactly). The handle keeps every depth it reached, so a later request
  at any depth >= the shallowest kept one is answered from it.

How a request starts from kept state: the entry point puts a *seed* on its Plan (``Plan.seed``);
``Session.start`` asks it to fill the session's cache (``fill(session) -> positions``) and computes
the remaining prompt positions itself. The last prompt position is always computed (it makes the
next-token logits the ordinary way), so a prompt equal to a kept prefix still works. The copy is the
backend capability ``cache_reuse`` (:class:`tinyloop.runtime.backend.CacheReuse`).

Every call validates its arguments before any work and runs under the model's lock, like every
other call on a model. Kept bytes count in ``vram_usage_bytes`` and under a process-wide cap
(:func:`set_handle_bytes_cap`, TINYLOOP_MAX_HANDLE_BYTES): admitting a handle beyond the cap
evicts the least recently used handles first (never on memory pressure; the bytes admitted for
another model's build under way count too); a handle evicted or freed raises HandleFreedError
when used.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import weakref
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import ConfigError, HandleBudgetError, HandleFreedError, InvalidInputError
from .cache import linear_slots
from .config import GenerateConfig, GenerateStats, numpy_int
from .engine import (Model, Plan, _as_ids, _decode, _let_go, _locked, check_call, check_model_window, check_vocab,
                     resolve_loops, set_up, validate_request)
from .stopping import CallbackStopper

#: Environment: the process-wide cap on live handle bytes (an integer; unset or 0: no cap).
MAX_HANDLE_BYTES_ENV = "TINYLOOP_MAX_HANDLE_BYTES"


def _count(v: Any) -> Any:
    """A numpy integer as the int it is (np.bool_ is not one); anything else unchanged."""
    return int(v) if numpy_int(v) else v


# --------------------------------------------------------------------------- the live-handle cap
def _env_cap() -> Optional[int]:
    raw = os.environ.get(MAX_HANDLE_BYTES_ENV, "").strip()
    if raw in ("", "0"):
        return None
    try:
        cap = int(raw)
    except ValueError:
        raise ConfigError(f"{MAX_HANDLE_BYTES_ENV}={raw!r} must be a byte count (an integer >= 1), or unset") from None
    if cap < 1:
        raise ConfigError(f"{MAX_HANDLE_BYTES_ENV}={raw!r} must be >= 1 (unset or 0: no cap)")
    return cap


class _Budget:
    """Every live handle of the process (weakly: a handle nobody holds is collected and uncharged)
    in least-recently-used order, and the cap on their bytes."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.live: "OrderedDict[int, weakref.ref]" = OrderedDict()
        self.cap: Optional[int] = None
        self.cap_from_env = True
        # id(model) -> bytes admitted for the request that holds that model and not charged yet (a
        # build under way): they count against every other model's admissions (one model per thread
        # builds at the same time as another); settle() ends them with the request
        self.reserved: Dict[int, int] = {}

    def current_cap(self) -> Optional[int]:
        return _env_cap() if self.cap_from_env else self.cap

    def handles(self) -> List["_Kept"]:
        return [h for h in (r() for r in list(self.live.values())) if h is not None and h.alive]

    def total(self) -> int:
        return sum(h.nbytes for h in self.handles())

    def used(self, model: Model) -> int:
        """The live handles' bytes and those admitted for builds of other models under way."""
        return self.total() + sum(n for k, n in self.reserved.items() if k != id(model))

    def charged(self, model: Model, nbytes: int) -> None:
        """`nbytes` admitted for `model` are now charged to a handle (no longer a reservation)."""
        with self.lock:
            left = self.reserved.get(id(model), 0) - nbytes
            if left > 0:
                self.reserved[id(model)] = left
            else:
                self.reserved.pop(id(model), None)

    def settle(self, model: Model) -> None:
        """The request that admitted bytes for `model` is over (built, or failed)."""
        with self.lock:
            self.reserved.pop(id(model), None)

    def touch(self, h: "_Kept") -> None:
        with self.lock:
            if id(h) in self.live:
                self.live.move_to_end(id(h))

    def add(self, h: "_Kept") -> None:
        key = id(h)

        def gone(_ref, key=key, live=self.live, lock=self.lock):
            with lock:
                if live.get(key) is _ref:
                    del live[key]
        with self.lock:
            self.live[key] = weakref.ref(h, gone)

    def remove(self, h: "_Kept") -> None:
        with self.lock:
            self.live.pop(id(h), None)

    def check(self, nbytes: int, what: str) -> None:
        """HandleBudgetError when `nbytes` can never fit under the cap (whatever is evicted)."""
        cap = self.current_cap()
        if cap is not None and nbytes > cap:
            raise HandleBudgetError(f"{what} needs {nbytes} bytes, more than the live handle cap of {cap} "
                                    f"bytes ({MAX_HANDLE_BYTES_ENV} / set_handle_bytes_cap)")

    def admit(self, nbytes: int, what: str, model: Model, keep: Tuple["_Kept", ...] = ()) -> None:
        """Make room for `nbytes` more under the cap, evicting least recently used handles (not
        those in `keep`; a handle of another model only while that model is idle). The caller
        holds `model`'s lock. HandleBudgetError when the cap cannot be met."""
        cap = self.current_cap()
        if cap is None:
            return
        with self.lock:
            self.check(nbytes, what)
            for h in self.handles():
                if self.used(model) + nbytes <= cap:
                    break
                if any(h is k for k in keep):
                    continue
                if h.model is model:
                    h._evict()
                elif h.model._lock.acquire(blocking=False):
                    try:
                        h._evict()
                    finally:
                        _let_go(h.model)        # with a free_model of that model that came meanwhile
            if self.used(model) + nbytes > cap:
                raise HandleBudgetError(
                    f"{what} needs {nbytes} bytes; the live handles (and builds under way) hold {self.used(model)} "
                    f"of the cap of {cap} bytes and none of the rest can be evicted now (in use, or kept by this call)")
            self.reserved[id(model)] = max(self.reserved.get(id(model), 0), nbytes)


_BUDGET = _Budget()


def set_handle_bytes_cap(max_bytes: Optional[int]) -> None:
    """Cap the bytes all live prefix caches, pool entries and resume handles of the process hold
    together (None: no cap; the default is TINYLOOP_MAX_HANDLE_BYTES). Admitting state beyond the
    cap evicts least recently used handles; lowering the cap evicts nothing until the next
    admission."""
    max_bytes = _count(max_bytes)
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
        raise ConfigError(f"max_bytes={max_bytes!r} must be an integer >= 1, or None for no cap")
    with _BUDGET.lock:
        _BUDGET.cap, _BUDGET.cap_from_env = max_bytes, False


def live_handle_bytes() -> int:
    """Bytes held by every live prefix cache, pool entry and resume handle of the process."""
    with _BUDGET.lock:
        return _BUDGET.total()


def live_handles(model: Optional[Model] = None) -> List[Dict[str, Any]]:
    """One record per live prefix cache, pool entry and resume handle of the process (of `model`
    only, when given), least recently used first: kind, model path, tokens, depths, cache_mode,
    bytes, and whether a pool holds it. Their bytes are those vram_usage_bytes counts."""
    if model is not None:
        check_call(model)
    out = []
    with _BUDGET.lock:
        for h in _BUDGET.handles():
            if model is not None and h.model is not model:
                continue
            out.append(h._record())
    return out


# --------------------------------------------------------------------------- kept state
#: Why a handle ended when its model was freed (freeing it afterwards is then a no-op).
RELEASED_WITH_MODEL = "released with its model (free_model)"
#: The state of a handle object made directly (its class called) rather than by its builder.
_UNBUILT = "never built"


def _uncharge(model: Model, acct: List[int]) -> None:
    """A collected handle's bytes leave its model's account (weakref.finalize)."""
    model._live_handle_bytes -= acct[0]
    acct[0] = 0


class _Kept:
    """What every kept state shares: its model, its bytes (charged to the model's
    vram_usage_bytes and to the process cap; a handle nobody holds is collected and uncharged),
    and its end (freed, evicted, or released with its model)."""

    kind = "handle"
    #: the function that builds this kind of state (named when an object made otherwise is used)
    builder = "its builder"
    #: False for a call's working state (score_with_consistency_escalation's low pass), freed before
    #: that call returns: its bytes count in vram_usage_bytes, but it is not under the live handle
    #: cap (admitting it evicts nothing, it is never evicted) and live_handles does not list it
    kept = True

    def __init__(self, model: Model) -> None:
        check_call(model)
        self.model = model
        self._acct = [0]
        # a handle is usable once its builder registers it; one made by calling the class is not
        self._gone: Optional[str] = _UNBUILT
        weakref.finalize(self, _uncharge, model, self._acct)

    @property
    def nbytes(self) -> int:
        """Bytes this state holds on the model's backend."""
        return self._acct[0]

    def _register(self) -> None:
        self._gone = None
        self.model._handles.add(self)
        if self.kept:
            _BUDGET.add(self)

    def _unbuilt(self, what: str = "") -> InvalidInputError:
        return InvalidInputError(f"{what}{': ' if what else ''}this {self.kind} was made by calling the class, "
                                 f"not by {self.builder}, so it holds no state; use {self.builder}")

    def _charge(self, delta: int) -> None:
        self._acct[0] += delta
        self.model._live_handle_bytes += delta
        if delta > 0:
            _BUDGET.charged(self.model, delta)

    def _check_state(self) -> None:
        """The handle holds its state: not freed, evicted or released, and made by its builder."""
        if self._gone == _UNBUILT:
            raise self._unbuilt()
        if self._gone is not None:
            raise HandleFreedError(f"this {self.kind} was {self._gone}; build a new one")

    def _check(self, model: Optional[Model] = None) -> None:
        self._check_state()
        if model is not None and model is not self.model:
            raise InvalidInputError(f"this {self.kind} was built with model {self.model.path!r} (another Model "
                                    f"object); a {self.kind} serves only the model that built it")
        self.model._check_live()

    def _release_memory(self) -> None:
        """Drop the references to backend memory (a subclass's buffers)."""

    def _drop(self, reason: str) -> None:
        """Release everything (the caller holds the model's lock, or the model is being freed)."""
        if self._gone is not None:
            return
        self._release_memory()
        self._charge(-self.nbytes)
        self._gone = reason
        _BUDGET.remove(self)
        self.model._handles.discard(self)

    def _evict(self) -> None:
        self._drop("evicted under the live handle cap (set_handle_bytes_cap / TINYLOOP_MAX_HANDLE_BYTES)")

    def _free(self, what: str) -> None:
        if self._gone == RELEASED_WITH_MODEL:
            return
        if self._gone == _UNBUILT:
            raise self._unbuilt(what)
        if self._gone is not None:
            raise HandleFreedError(f"{what}: this {self.kind} was already {self._gone}")
        lock = _locked(self.model)
        try:
            self._drop("freed")
        finally:
            lock.release()

    @property
    def alive(self) -> bool:
        """False once freed, evicted or released with its model."""
        return self._gone is None

    def _record(self) -> Dict[str, Any]:
        return {"kind": self.kind, "model": self.model.path, "bytes": self.nbytes}


def _cache_bytes(model: Model, spec) -> int:
    be = model.backend
    slots = type(be).cache_slots(spec.n_slots, spec.slots.window)
    sized = dataclasses.replace(spec, slots=dataclasses.replace(spec.slots, n_slots=slots))
    return sized.nbytes(model.cfg.n_kv_heads, model.cfg.head_dim, sized.codec_classes())


def _rows_bytes(model: Model, n: int) -> int:
    return 4 * n * model.cfg.d_model


def _check_ids(model: Model, ids: Any, what: str) -> List[int]:
    """A non-empty prompt-like token list within the vocabulary and max_seq_len."""
    out = _as_ids(ids, what, model)
    if not out:
        raise InvalidInputError(f"{what} is empty: it needs at least 1 token")
    check_vocab(model, out, what)
    if len(out) > model.max_seq_len:
        raise InvalidInputError(f"{what} has {len(out)} tokens, more than max_seq_len={model.max_seq_len}")
    check_model_window(model, len(out), -1, what)
    return out


def _prefix_plan(model: Model, loops: Any, cache_mode: Any) -> Plan:
    """The plan a prefix cache is built under: its depth and cache mode, checked against the
    prefix_reuse compat column and the backend's capability."""
    if not isinstance(cache_mode, str) or not cache_mode:
        raise ConfigError(f"cache_mode must be a registered cache mode name, got {cache_mode!r}")
    L = resolve_loops(model, _count(loops))
    return Plan(model, GenerateConfig(max_tokens=0, loops=L, cache_mode=cache_mode), "single", reuse="prefix_reuse")


def _prefill(model: Model, ids: List[int], cache, loops: int, snap=None, e_rows=None) -> None:
    """Prefill `ids` into `cache` at `loops` iterations (no logits); keep the residual after the last
    iteration in `snap` and the loop-inject residual in `e_rows` when given."""
    be, ws, fwd = model.backend, model.ws, model.fwd
    for a in range(0, len(ids), ws.rows):
        T = min(ws.rows, len(ids) - a)
        pos = be.positions(a)
        fwd.prefix(be.set_ids(ws, ids[a:a + T]), pos, T, cache)
        if e_rows is not None:
            be.copy(be.rows(e_rows, a), ws.e, T)
        fwd.run_loop_iters_range(pos, T, cache, 0, loops)
        if snap is not None:
            be.copy(be.rows(snap, a), ws.x, T)
        fwd.suffix(pos, T, cache)


def _request(model: Model, config: Optional[GenerateConfig], loops: int, cache_mode: str, what: str) -> GenerateConfig:
    """The request's config with the kept state's depth filled in (loops None) and both checked."""
    config = config or GenerateConfig()
    if config.loops is not None and config.loops != loops:
        raise ConfigError(f"loops={config.loops} differs from the {what}'s depth {loops}; a {what} serves its "
                          f"own depth (leave loops unset)")
    if config.cache_mode != cache_mode:
        raise ConfigError(f"cache_mode={config.cache_mode!r} differs from the {what}'s {cache_mode!r}; set "
                          f"cache_mode={cache_mode!r} (a kept cache is not converted between codecs)")
    return dataclasses.replace(config, loops=loops) if config.loops is None else config


def _iter(model: Model, ids: List[int], plan: Plan, stats: Optional[GenerateStats], consumer=(),
          before: Optional[Callable[[], None]] = None):
    """Decode a prepared request under the model's lock (like generate_iter: the lock is taken at
    the first next()); `before` runs first, under the lock (a pool lookup, admission to the cap)."""
    stats = stats if stats is not None else GenerateStats()
    lock = _locked(model)
    try:
        if before is not None:
            before()
        yield from _decode(model, ids, plan, stats, consumer)
    finally:
        _BUDGET.settle(model)
        lock.release()


def _run(model: Model, ids: List[int], plan: Plan, stats: Optional[GenerateStats], on_token,
         before: Optional[Callable[[], None]] = None) -> List[int]:
    """The blocking form of _iter with generate_stream's callback; returns prompt + generated."""
    consumer = [CallbackStopper(on_token)] if on_token is not None else []
    return ids + list(_iter(model, ids, plan, stats, consumer, before))


def _check_depth(plan: Plan, loops: int, what: str) -> None:
    if plan.loops != loops:
        raise ConfigError(f"the request decodes at loop depth {plan.loops} (its decoder's), but the {what} "
                          f"holds depth {loops}")


# --------------------------------------------------------------------------- prefix caches
class PrefixCache(_Kept):
    """The K/V of a prefix at one loop depth and cache mode (build_prefix_cache; a pool's entries
    are PrefixCaches too). ``prefix_ids``, ``loops``, ``cache_mode``, ``nbytes``, ``alive``."""

    kind = "PrefixCache"
    builder = "build_prefix_cache or register_prefix"

    def __init__(self, model: Model, ids: List[int], loops: int, cache_mode: str) -> None:
        super().__init__(model)
        self.prefix_ids: Tuple[int, ...] = tuple(_as_ids(ids, "ids"))
        self.loops, self.cache_mode = loops, cache_mode
        self.pool: Optional["PrefixPool"] = None
        self.cache = None

    def __repr__(self) -> str:
        state = "live" if self._gone is None else self._gone
        return (f"PrefixCache({len(self.prefix_ids)} tokens, loops={self.loops}, cache_mode={self.cache_mode!r}, "
                f"{self.nbytes} bytes, {state})")

    def _drop(self, reason: str) -> None:
        if self._gone is None and self.pool is not None:
            self.pool._forget(self, evicted=reason.startswith("evicted"))
        super()._drop(reason)

    def _release_memory(self) -> None:
        self.cache = None

    def _record(self) -> Dict[str, Any]:
        return {**super()._record(), "tokens": len(self.prefix_ids), "depths": [self.loops],
                "cache_mode": self.cache_mode, "in_pool": self.pool is not None}


class _PrefixSeed:
    """Fills a request's cache with the first `n` positions of a prefix cache."""

    def __init__(self, pc: PrefixCache, n: int) -> None:
        self.pc, self.n = pc, n

    def fill(self, session) -> int:
        self.pc._check(session.model)           # never another model's K/V
        session.model.backend.copy_cache_layers(session.cache, self.pc.cache, self.n)
        _BUDGET.touch(self.pc)
        return self.n


def _new_prefix_cache(model: Model, ids: List[int], plan: Plan) -> PrefixCache:
    """Allocate and prefill (the caller holds the model's lock and has validated everything)."""
    spec = plan.cache_spec(plan.loops, linear_slots(len(ids)))
    pc = PrefixCache(model, ids, plan.loops, plan.config.cache_mode)
    _BUDGET.admit(_cache_bytes(model, spec), f"a prefix cache of {len(ids)} tokens", model)
    cache = model.backend.alloc_kept_cache(spec)
    _prefill(model, ids, cache, plan.loops)          # on an error the cache goes with its reference
    pc.cache = cache
    pc._charge(int(cache.nbytes))
    pc._register()
    return pc


def build_prefix_cache(model: Model, prefix_ids: Sequence[int], loops: Optional[int] = None,
                       cache_mode: str = "fp16") -> PrefixCache:
    """Prefill `prefix_ids` once at `loops` iterations (None: the model's default) into a kept cache
    of `cache_mode`; ``generate_from_prefix_cache`` then starts requests from it."""
    check_call(model)
    ids = _check_ids(model, prefix_ids, "prefix_ids")
    plan = _prefix_plan(model, loops, cache_mode)
    lock = _locked(model)
    try:
        return _new_prefix_cache(model, ids, plan)
    finally:
        _BUDGET.settle(model)
        lock.release()


def _prepare_prefix(model, pc, suffix_ids, config, stats, on_token=None):
    t_entry = time.perf_counter()
    check_call(model, config, stats, on_token)
    if not isinstance(pc, PrefixCache):
        raise InvalidInputError(f"pc must be a PrefixCache from build_prefix_cache, got {type(pc).__name__}")
    pc._check(model)
    config = _request(model, config, pc.loops, pc.cache_mode, "prefix cache")
    suffix = _as_ids(suffix_ids, "suffix_ids", model, start=False)      # a continuation: no BOS
    check_vocab(model, suffix, "suffix_ids")
    plan = Plan(model, config, "single", reuse="prefix_reuse")
    ids = validate_request(model, list(pc.prefix_ids) + suffix, config)
    plan.delegate()
    _check_depth(plan, pc.loops, "prefix cache")
    plan.seed = _PrefixSeed(pc, min(len(pc.prefix_ids), len(ids) - 1))
    return ids, set_up(plan, t_entry), pc._check


def generate_from_prefix_cache(model: Model, pc: PrefixCache, suffix_ids: Sequence[int],
                               config: Optional[GenerateConfig] = None,
                               stats: Optional[GenerateStats] = None,
                               on_token: Optional[Callable[[int, int], Any]] = None) -> List[int]:
    """Decode prefix + suffix, the prefix's K/V copied from `pc` instead of computed: the tokens of
    ``generate(model, prefix + suffix, config)`` at the prefix cache's depth and cache mode (which
    the config must match; loops None takes the cache's). Returns prefix + suffix + generated;
    ``on_token`` and ``stats`` as generate_stream (stats.reused_tokens says how many positions were
    copied). `suffix_ids` may be empty (the prompt is the prefix)."""
    ids, plan, before = _prepare_prefix(model, pc, suffix_ids, config, stats, on_token)
    return _run(model, ids, plan, stats, on_token, before)


def generate_from_prefix_cache_iter(model: Model, pc: PrefixCache, suffix_ids: Sequence[int],
                                    config: Optional[GenerateConfig] = None,
                                    stats: Optional[GenerateStats] = None) -> Iterator[int]:
    """generate_from_prefix_cache as a token iterator (like generate_iter: validated now, decoded
    as it is read; closing it early stops decoding)."""
    ids, plan, before = _prepare_prefix(model, pc, suffix_ids, config, stats)
    return _iter(model, ids, plan, stats, (), before)


def free_prefix_cache(pc: PrefixCache) -> None:
    """Release a prefix cache (a pool's entry leaves its pool). A second free is a HandleFreedError."""
    if not isinstance(pc, PrefixCache):
        raise InvalidInputError(f"pc must be a PrefixCache, got {type(pc).__name__}")
    pc._free("free_prefix_cache")


# --------------------------------------------------------------------------- prefix pools
class _Node:
    __slots__ = ("children", "entries")

    def __init__(self) -> None:
        self.children: Dict[int, "_Node"] = {}
        self.entries: Dict[Tuple[int, str], PrefixCache] = {}


#: Held while a registration checks and binds a pool to its model (PrefixPool.model).
_BIND = threading.Lock()


class PrefixPool:
    """Registered prefixes in a token trie (create_prefix_pool). Bound to the model of its first
    registration. ``stats()`` gives the counters; ``entries`` the live PrefixCaches, least recently
    used first."""

    def __init__(self, capacity: int, max_bytes: Optional[int] = None) -> None:
        capacity, max_bytes = _count(capacity), _count(max_bytes)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(f"capacity={capacity!r} must be an integer >= 1 (entries the pool holds)")
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int)
                                      or max_bytes < 1):
            raise ConfigError(f"max_bytes={max_bytes!r} must be an integer >= 1, or None for no byte cap")
        self.capacity, self.max_bytes = capacity, max_bytes
        self.model: Optional[Model] = None
        self._root = _Node()
        self._lru: "OrderedDict[int, PrefixCache]" = OrderedDict()
        self._freed = False
        self.hits = self.misses = self.evictions = self.reused_tokens = 0

    def __repr__(self) -> str:
        return (f"PrefixPool({len(self._lru)}/{self.capacity} entries, {self.nbytes} bytes, hits={self.hits}, "
                f"misses={self.misses}, evictions={self.evictions}{', freed' if self._freed else ''})")

    @property
    def entries(self) -> List[PrefixCache]:
        return list(self._lru.values())

    @property
    def nbytes(self) -> int:
        return sum(pc.nbytes for pc in self._lru.values())

    def stats(self) -> Dict[str, int]:
        """hits, misses, evictions, reused_tokens (over all hits), entries, bytes."""
        return dict(hits=self.hits, misses=self.misses, evictions=self.evictions,
                    reused_tokens=self.reused_tokens, entries=len(self._lru), bytes=self.nbytes)

    def _check(self, model: Model) -> None:
        if self._freed:
            raise HandleFreedError("this PrefixPool was freed; create a new one")
        check_call(model)
        if self.model is not None and self.model._freed and not self._lru:
            self.model = None           # its model was freed with every entry: the pool starts over
        if self.model is not None and model is not self.model:
            raise InvalidInputError(f"this PrefixPool holds prefixes of model {self.model.path!r} (another Model "
                                    f"object); a pool serves only the model it was first registered with")
        model._check_live()

    def _node(self, ids: Sequence[int], create: bool) -> Optional[_Node]:
        node = self._root
        for t in ids:
            nxt = node.children.get(t)
            if nxt is None:
                if not create:
                    return None
                nxt = node.children[t] = _Node()
            node = nxt
        return node

    def _lookup(self, ids: Sequence[int], key: Tuple[int, str]) -> Optional[PrefixCache]:
        """The longest registered prefix of `ids` with `key` (one walk down the trie)."""
        node, best = self._root, None
        for t in ids:
            node = node.children.get(t)
            if node is None:
                break
            pc = node.entries.get(key)
            if pc is not None and pc.alive:
                best = pc
        return best

    def _forget(self, pc: PrefixCache, evicted: bool) -> None:
        """Take `pc` out of the trie and the LRU order (it is being dropped)."""
        self._lru.pop(id(pc), None)
        path, node = [], self._root
        for t in pc.prefix_ids:
            path.append((node, t))
            node = node.children.get(t)
            if node is None:
                return
        node.entries.pop((pc.loops, pc.cache_mode), None)
        for parent, t in reversed(path):       # prune the branch that no longer leads to an entry
            child = parent.children[t]
            if child.entries or child.children:
                break
            del parent.children[t]
        if evicted:
            self.evictions += 1
        pc.pool = None


def create_prefix_pool(capacity: int, max_bytes: Optional[int] = None) -> PrefixPool:
    """A pool of up to `capacity` registered prefixes (and `max_bytes` of their caches, when given);
    registering beyond either evicts the least recently used entries."""
    return PrefixPool(capacity, max_bytes)


def register_prefix(pool: PrefixPool, model: Model, ids: Sequence[int], loops: Optional[int] = None,
                    cache_mode: str = "fp16") -> PrefixCache:
    """Prefill `ids` at `loops` (None: the model's default) into `pool` and return its entry; a
    prefix already registered at that depth and cache mode is not rebuilt (it becomes the most
    recently used). Entries beyond the pool's capacity are evicted least recently used first."""
    if not isinstance(pool, PrefixPool):
        raise InvalidInputError(f"pool must be a PrefixPool from create_prefix_pool, got {type(pool).__name__}")
    pool._check(model)
    ids = _check_ids(model, ids, "ids")
    plan = _prefix_plan(model, loops, cache_mode)
    key = (plan.loops, cache_mode)
    lock = _locked(model)
    bound = False
    try:
        with _BIND:       # checked and bound at once: another model registering now finds the pool taken
            pool._check(model)
            bound, pool.model = pool.model is None, model
        node = pool._node(ids, create=False)
        old = node.entries.get(key) if node is not None else None
        if old is not None and old.alive:
            pool._lru.move_to_end(id(old))
            _BUDGET.touch(old)
            return old
        spec = plan.cache_spec(plan.loops, linear_slots(len(ids)))
        need = _cache_bytes(model, spec)
        if pool.max_bytes is not None and need > pool.max_bytes:
            raise HandleBudgetError(f"a prefix of {len(ids)} tokens needs {need} bytes, more than the pool's "
                                    f"max_bytes={pool.max_bytes}")
        # refused before the pool makes room: a registration that can never fit evicts nothing
        _BUDGET.check(need, f"a prefix cache of {len(ids)} tokens")
        while pool._lru and (len(pool._lru) >= pool.capacity
                             or (pool.max_bytes is not None and pool.nbytes + need > pool.max_bytes)):
            next(iter(pool._lru.values()))._evict()
        pc = _new_prefix_cache(model, ids, plan)
        pc.pool = pool
        pool.model = model
        pool._node(ids, create=True).entries[key] = pc
        pool._lru[id(pc)] = pc
        return pc
    except BaseException:
        if bound and not pool._lru:
            pool.model = None           # a first registration that failed leaves the pool unbound
        raise
    finally:
        _BUDGET.settle(model)
        lock.release()


def _prepare_pool(model, pool, ids, config, stats, on_token=None):
    t_entry = time.perf_counter()
    check_call(model, config, stats, on_token)
    if not isinstance(pool, PrefixPool):
        raise InvalidInputError(f"pool must be a PrefixPool from create_prefix_pool, got {type(pool).__name__}")
    pool._check(model)
    config = config or GenerateConfig()
    plan = Plan(model, config, "single", reuse="prefix_reuse")
    prompt = validate_request(model, ids, config)
    plan.delegate()

    def lookup() -> None:
        """Under the request's lock, so the entry found cannot be evicted before it is copied."""
        pool._check(model)
        best = pool._lookup(prompt, (plan.loops, plan.config.cache_mode))
        n = min(len(best.prefix_ids), len(prompt) - 1) if best is not None else 0
        if n > 0:
            pool.hits += 1
            pool.reused_tokens += n
            pool._lru.move_to_end(id(best))
            plan.seed = _PrefixSeed(best, n)
        else:
            pool.misses += 1
            plan.seed = None
    return prompt, set_up(plan, t_entry), lookup


def generate_with_pool(model: Model, pool: PrefixPool, ids: Sequence[int], config: Optional[GenerateConfig] = None,
                       stats: Optional[GenerateStats] = None,
                       on_token: Optional[Callable[[int, int], Any]] = None) -> List[int]:
    """Decode `ids`, reusing the longest prefix of it registered in `pool` at the request's depth
    and cache mode (a hit copies its K/V; a miss prefills as generate does). Same tokens as
    ``generate(model, ids, config)``; returns prompt + generated; stats.reused_tokens says how many
    prompt positions were copied."""
    prompt, plan, lookup = _prepare_pool(model, pool, ids, config, stats, on_token)
    return _run(model, prompt, plan, stats, on_token, lookup)


def generate_with_pool_iter(model: Model, pool: PrefixPool, ids: Sequence[int],
                            config: Optional[GenerateConfig] = None,
                            stats: Optional[GenerateStats] = None) -> Iterator[int]:
    """generate_with_pool as a token iterator (validated now, decoded as it is read)."""
    prompt, plan, lookup = _prepare_pool(model, pool, ids, config, stats)
    return _iter(model, prompt, plan, stats, (), lookup)


def free_prefix_pool(pool: PrefixPool) -> None:
    """Release every entry of `pool`. A second free is a HandleFreedError."""
    if not isinstance(pool, PrefixPool):
        raise InvalidInputError(f"pool must be a PrefixPool, got {type(pool).__name__}")
    if pool._freed:
        raise HandleFreedError("free_prefix_pool: this PrefixPool was already freed")
    entries, model = pool.entries, pool.model
    if entries and not (model._freed or model._free_pending):
        lock = _locked(model)
        try:
            for pc in entries:
                pc._drop("freed with its pool")
        finally:
            lock.release()
    pool._freed = True
    pool._lru.clear()
    pool._root = _Node()


# --------------------------------------------------------------------------- warm start
class ResumeHandle(_Kept):
    """A prompt's state for warm start (build_resume_handle): the cache layers of every iteration
    reached, the residual after the last iteration of each depth reached (``depths``), the post
    blocks' layers of the depth served last. ``prompt_ids``, ``loops_used`` (the build depth),
    ``cache_mode``, ``config`` (build_resume_handle's, what resume_generate decodes with when
    given no config), ``nbytes``, ``alive``."""

    kind = "ResumeHandle"
    builder = "build_resume_handle"

    def __init__(self, model: Model, ids: List[int], loops: int, cache_mode: str) -> None:
        super().__init__(model)
        self.prompt_ids: Tuple[int, ...] = tuple(_as_ids(ids, "ids"))
        self.loops_used, self.cache_mode = loops, cache_mode
        #: the config resume_generate decodes with when it is given none (build_resume_handle's,
        #: its loops left to each request's depth)
        self.config = GenerateConfig(cache_mode=cache_mode)
        self.cache = None
        self.snaps: Dict[int, Any] = {}        # depth -> (P, d_model) residual after its last iteration
        self.e_rows = None                     # (P, d_model) the loop input (cfg.keeps_loop_input)
        self.post_depth = 0                    # depth whose post-block K/V the cache holds

    def __repr__(self) -> str:
        state = "live" if self._gone is None else self._gone
        return (f"ResumeHandle({len(self.prompt_ids)} tokens, depths={self.depths}, cache_mode={self.cache_mode!r}, "
                f"{self.nbytes} bytes, {state})")

    @property
    def depths(self) -> List[int]:
        """Loop depths whose residual the handle keeps (a request at any depth >= the smallest is
        answered from it exactly)."""
        return sorted(self.snaps)

    def _depth(self, loops: Any, name: str = "loops", lo: int = 1, hi: Optional[int] = None) -> int:
        """`loops` (named `name`) as a loop depth in [lo, hi] (hi: the model's max_loops), on a handle
        that holds its state: the methods below check their arguments before any work."""
        self._check_state()
        top = self.model.cfg.max_loops if hi is None else hi
        L = _count(loops)
        if isinstance(L, bool) or not isinstance(L, int):
            raise ConfigError(f"{name}={loops!r} must be an integer in [{lo}, {top}]")
        if not lo <= L <= top:
            raise ConfigError(f"{name}={L} is outside the allowed range [{lo}, {top}]")
        return L

    def base_depth(self, loops: int) -> int:
        """The deepest kept depth <= loops (ConfigError when there is none)."""
        loops = self._depth(loops)
        below = [d for d in self.snaps if d <= loops]
        if not below:
            raise ConfigError(f"loops_new={loops} is below the handle's shallowest kept depth {min(self.snaps)}: the "
                              f"residual before iteration {loops} was never kept, so the state at depth {loops} "
                              f"cannot be recovered exactly (build a handle at loops_used <= {loops})")
        return max(below)

    def growth_bytes(self, loops: int) -> int:
        """Bytes serving depth `loops` adds (a new kept residual, a cache grown to more iterations;
        the old cache is released after the copy, but both exist during it)."""
        loops = self._depth(loops)
        extra = 0 if loops in self.snaps else _rows_bytes(self.model, len(self.prompt_ids))
        if loops > self.cache.spec.loops:
            extra += _cache_bytes(self.model, self.cache.spec.with_loops(loops))
        return extra

    def _release_memory(self) -> None:
        self.cache, self.snaps, self.e_rows = None, {}, None

    def _record(self) -> Dict[str, Any]:
        return {**super()._record(), "tokens": len(self.prompt_ids), "depths": self.depths,
                "cache_mode": self.cache_mode, "in_pool": False}

    def reserve(self, loops: int) -> None:
        """Make the cache hold `loops` iterations (the caller holds the model's lock): a larger
        cache, admitted under the live handle cap, takes a copy of the kept layers."""
        loops = self._depth(loops)
        be, old = self.model.backend, self.cache
        if loops <= old.spec.loops:
            return
        spec = old.spec.with_loops(loops)
        if self.kept:
            _BUDGET.admit(_cache_bytes(self.model, spec), f"growing a resume handle to loops={loops}", self.model,
                          keep=(self,))
        new = be.alloc_kept_cache(spec)
        be.copy_cache_layers(new, old, len(self.prompt_ids))
        self.cache = new
        self._charge(int(new.nbytes) - int(old.nbytes))

    def run_rows(self, base: int, loops: int, n: int, keep=None, post: bool = False,
                 logits: bool = False) -> Optional[np.ndarray]:
        """Over prompt rows 0 .. n - 1, chunk by chunk: the residual kept at depth `base` (and the
        loop-inject residual), iterations base .. loops - 1 into the handle's cache, the residual
        after them into `keep` (a row buffer) when given, then with `post` the post blocks at
        that depth and, with `logits`, the head: returns the host logits (n, vocab) float32.
        The caller holds the model's lock and has reserved `loops` iterations."""
        self._check_state()
        b = _count(base)
        if isinstance(b, bool) or not isinstance(b, int) or b not in self.snaps:
            raise ConfigError(f"base={base!r} is not a depth this handle keeps (depths {self.depths})")
        base = b
        loops = self._depth(loops, "loops", base, self.cache.spec.loops)
        n = self._depth(n, "n", 1, len(self.prompt_ids))           # (rows, checked as a depth is)
        for flag, v in (("post", post), ("logits", logits)):
            if not isinstance(v, bool):
                raise ConfigError(f"{flag}={v!r} must be True or False")
        model = self.model
        be, ws, fwd = model.backend, model.ws, model.fwd
        src = self.snaps[base]
        out = np.empty((n, model.cfg.vocab_size), np.float32) if logits else None
        for a in range(0, n, ws.rows):
            T = min(ws.rows, n - a)
            pos = be.positions(a)
            be.copy(ws.x, be.rows(src, a), T)
            if self.e_rows is not None and base < loops:
                be.copy(ws.e, be.rows(self.e_rows, a), T)
            fwd.run_loop_iters_range(pos, T, self.cache, base, loops)
            if keep is not None:
                be.copy(be.rows(keep, a), ws.x, T)
            if post:
                fwd.suffix(pos, T, self.cache)
                if logits:
                    fwd.logits(0, T)
                    out[a:a + T] = be.logits_block_to_host(ws, T)
        return out

    def upgrade(self, loops: int) -> int:
        """Bring the kept state to depth `loops` (the caller holds the model's lock and admitted the
        growth): iterations base .. loops - 1 over the prompt from the kept residual, the residual
        kept, the post blocks recomputed at that depth. Returns the base depth."""
        loops = self._depth(loops)
        model = self.model
        P = len(self.prompt_ids)
        base = self.base_depth(loops)
        self.reserve(loops)
        if base < loops:
            snap = model.backend.alloc_rows(P, model.cfg.d_model)
            self.run_rows(base, loops, P, keep=snap)
            self.snaps[loops] = snap
            self._charge(_rows_bytes(model, P))
        if self.post_depth != loops:
            # no depth's post layers until the pass is complete: one cut short (an interrupt, an
            # allocation) leaves a mix of two depths, which the next request must recompute
            self.post_depth = 0
            self.run_rows(loops, loops, P, post=True)
            self.post_depth = loops
        return base


class _ResumeSeed:
    """Upgrades the handle to the request's depth, then fills the request's cache from it."""

    def __init__(self, handle: ResumeHandle, loops: int) -> None:
        self.handle, self.loops = handle, loops

    def fill(self, session) -> int:
        h = self.handle
        h._check()
        base = h.upgrade(self.loops)
        _BUDGET.settle(h.model)                 # what the request was admitted for is charged now
        n = len(h.prompt_ids) - 1
        session.model.backend.copy_cache_layers(session.cache, h.cache, n)
        # the copied rows skip iterations 0 .. base - 1; the last prompt row is computed in full
        # by the request (and its upgrade serves the handle), so it spares nothing
        session.stats.warm_start_iters_saved = base * n
        _BUDGET.touch(h)
        return n


def build_resume_handle(model: Model, ids: Sequence[int], loops_used: int,
                        config: Optional[GenerateConfig] = None) -> ResumeHandle:
    """Prefill `ids` at `loops_used` iterations and keep what a deeper request needs (the cache
    layers and the residual after iteration loops_used - 1 at every position). `config` holds the
    settings the handle will serve, checked now as a warm-start request's (configs/compat.yaml:
    warm_start; its loops, when set, must equal loops_used): its cache_mode shapes the kept cache,
    and it is the config of every resume_generate that passes none (its max_tokens is checked
    against the prompt now)."""
    return _build_resume_handle(model, ids, loops_used, config)


def _build_resume_handle(model: Model, ids: Sequence[int], loops_used: int, config: Optional[GenerateConfig],
                         kept: bool = True, held=None) -> ResumeHandle:
    """build_resume_handle; ``kept=False`` builds a call's working state instead (_Kept.kept);
    ``held``: the model's request lock, already taken by the caller (kept taken when this returns)."""
    check_call(model, config)
    given = config is not None
    config = config or GenerateConfig()
    loops_used = _count(loops_used)
    if isinstance(loops_used, bool) or not isinstance(loops_used, int):
        raise ConfigError(f"loops_used={loops_used!r} must be an integer in [1, {model.cfg.max_loops}]")
    if config.loops is not None and config.loops != loops_used:
        raise ConfigError(f"config.loops={config.loops} differs from loops_used={loops_used}")
    prompt = _check_ids(model, ids, "ids")
    # the settings the handle serves are checked now as a warm-start request's (its cache shape
    # comes from them; the decoding fields apply to each resume_generate without a config)
    plan = Plan(model, dataclasses.replace(config, loops=resolve_loops(model, loops_used), max_tokens=0),
                "single", reuse="warm_start")
    if given:
        validate_request(model, prompt, dataclasses.replace(config, loops=loops_used))
    L, P = loops_used, len(prompt)
    spec = plan.cache_spec(L, linear_slots(P))
    inject = model.cfg.keeps_loop_input
    rows_bytes = _rows_bytes(model, P) * (2 if inject else 1)          # the residual (+ the inject copy)
    need = _cache_bytes(model, spec) + rows_bytes
    lock = _locked(model) if held is None else None
    try:
        if kept:
            _BUDGET.admit(need, f"a resume handle of {P} tokens", model)
        h = ResumeHandle(model, prompt, L, config.cache_mode)
        h.kept = kept
        h.config = dataclasses.replace(config, loops=None)
        be = model.backend
        cache = be.alloc_kept_cache(spec)
        snap = be.alloc_rows(P, model.cfg.d_model)
        e_rows = be.alloc_rows(P, model.cfg.d_model) if inject else None
        _prefill(model, prompt, cache, L, snap, e_rows)
        h.cache, h.snaps[L], h.e_rows, h.post_depth = cache, snap, e_rows, L
        h._charge(int(cache.nbytes) + rows_bytes)
        h._register()
        return h
    finally:
        _BUDGET.settle(model)
        if lock is not None:
            lock.release()


def _prepare_resume(handle, loops_new, config, stats, on_token=None):
    t_entry = time.perf_counter()
    if not isinstance(handle, ResumeHandle):
        raise InvalidInputError(f"handle must be a ResumeHandle from build_resume_handle, got "
                                f"{type(handle).__name__}")
    handle._check()
    model = handle.model
    check_call(model, config, stats, on_token)
    L, top = _count(loops_new), model.cfg.max_loops
    if isinstance(L, bool) or not isinstance(L, int):
        raise ConfigError(f"loops_new={L!r} must be an integer in [1, {top}] (the depth to decode at; "
                          f"model.max_loops)")
    if not 1 <= L <= top:
        raise ConfigError(f"loops_new={L} is outside the allowed range [1, {top}] (model.max_loops)")
    handle.base_depth(L)
    config = _request(model, handle.config if config is None else config, L, handle.cache_mode, "resume handle")
    plan = Plan(model, config, "single", reuse="warm_start")
    ids = validate_request(model, list(handle.prompt_ids), config)
    plan.delegate()
    _check_depth(plan, L, "resume request")
    plan.seed = _ResumeSeed(handle, L)

    def admit() -> None:
        handle._check()
        _BUDGET.admit(handle.growth_bytes(L), f"resuming at loops={L}", model, keep=(handle,))
    return model, ids, set_up(plan, t_entry), admit


def resume_generate(handle: ResumeHandle, loops_new: int, config: Optional[GenerateConfig] = None,
                    stats: Optional[GenerateStats] = None,
                    on_token: Optional[Callable[[int, int], Any]] = None) -> List[int]:
    """Decode the handle's prompt at `loops_new` iterations, starting from its kept state: the
    iterations the handle has not run yet run over the prompt, the cache is extended with their
    layers, and decoding proceeds. Bit-exact to ``generate(model, prompt, loops=loops_new)``. Any
    depth >= the handle's shallowest kept depth is answered (the handle keeps each depth it
    serves); a shallower one is a ConfigError. `config` None: the config the handle was built
    with (its loops: loops_new). Returns prompt + generated."""
    model, ids, plan, admit = _prepare_resume(handle, loops_new, config, stats, on_token)
    return _run(model, ids, plan, stats, on_token, before=admit)


def resume_generate_iter(handle: ResumeHandle, loops_new: int, config: Optional[GenerateConfig] = None,
                         stats: Optional[GenerateStats] = None) -> Iterator[int]:
    """resume_generate as a token iterator (validated now, decoded as it is read)."""
    model, ids, plan, admit = _prepare_resume(handle, loops_new, config, stats)
    return _iter(model, ids, plan, stats, (), admit)


def free_resume_handle(handle: ResumeHandle) -> None:
    """Release a resume handle. A second free is a HandleFreedError."""
    if not isinstance(handle, ResumeHandle):
        raise InvalidInputError(f"handle must be a ResumeHandle, got {type(handle).__name__}")
    handle._free("free_resume_handle")
