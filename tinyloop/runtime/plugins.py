"""The plugin manager: built-ins from a default list, third-party packages from entry points.

Core never imports a plugin module except through DEFAULT_PLUGINS, which is loaded exactly the
way an installed third-party package is: the module is registered with pluggy and its hooks are
called once. Registries are built once and cached; nothing here runs per token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import threading
from typing import Dict, Iterable, List, Optional, Type

import numpy as np
import pluggy

from . import hookspecs
from .backend import BackendEntry
from .cache import CacheMode, KVCodec, SlotMapMode
from .decoding import Decoder
from .early_exit import STABLE_BELOW, ExitCriterion
from ..errors import BackendError, ConfigError, PluginError
from .processors import LogitProcessor
from .stopping import Stopper

#: Built-in plugin modules, registered like any third-party plugin.
DEFAULT_PLUGINS = (
    "tinyloop.plugins.decoders.greedy",
    "tinyloop.plugins.decoders.sampling",
    "tinyloop.plugins.decoders.beam",
    "tinyloop.plugins.decoders.speculative",
    "tinyloop.plugins.decoders.tree_speculative",
    "tinyloop.plugins.decoders.auto",
    "tinyloop.plugins.caches.codecs",
    "tinyloop.plugins.caches.float_cache",
    "tinyloop.plugins.caches.quant_cache",
    "tinyloop.plugins.caches.window",
    "tinyloop.plugins.processors.repetition",
    "tinyloop.plugins.processors.grammar",
    "tinyloop.plugins.stoppers.standard",
    "tinyloop.plugins.exits.criteria",
    "tinyloop.plugins.backends",
)

ENTRY_POINT_GROUP = "tinyloop"

#: The registries one request resolves its plugins from (PluginManager.snapshot).
REQUEST_REGISTRIES = (("tinyloop_decoders", Decoder), ("tinyloop_cache_modes", CacheMode),
                      ("tinyloop_kv_codecs", KVCodec), ("tinyloop_slot_maps", SlotMapMode),
                      ("tinyloop_processors", LogitProcessor), ("tinyloop_stoppers", Stopper),
                      ("tinyloop_exit_criteria", ExitCriterion))


class PluginManager:
    """Wraps pluggy's manager and the registries built from the hooks."""

    def __init__(self, load_entrypoints: bool = True):
        # registration and registry builds exclude each other: a registry built from the hooks as
        # they were before a register / unregister must not be cached after it
        self._lock = threading.RLock()
        self.pm = pluggy.PluginManager("tinyloop")
        self.pm.add_hookspecs(hookspecs)
        for modname in DEFAULT_PLUGINS:
            self.pm.register(importlib.import_module(modname), name=modname)
        if load_entrypoints:
            self._load_entrypoints()
        self._cache: Dict[str, Dict[str, type]] = {}

    def _load_entrypoints(self) -> None:
        """Load the ``tinyloop`` entry points one at a time, so that a broken package is a
        PluginError naming its entry point (a broken third-party package must not take core down
        with an anonymous error)."""
        import importlib.metadata

        eps = list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
        seen = {}
        for ep in eps:
            # a name already taken would leave the package out silently: pluggy loads one plugin
            # per name (a built-in module's, or the first package's)
            if ep.name in DEFAULT_PLUGINS:
                raise PluginError(f"entry point {ep.name!r} ({ep.name} = {ep.value} of group "
                                  f"{ENTRY_POINT_GROUP!r}) has the name of the built-in plugin module "
                                  f"{ep.name}; rename the entry point")
            first = seen.setdefault(ep.name, ep)
            if first.value != ep.value:
                raise PluginError(f"two installed packages declare the entry point {ep.name!r} of group "
                                  f"{ENTRY_POINT_GROUP!r} ({first.value} and {ep.value}); one of them would "
                                  f"not be loaded: rename one")
        for ep in eps:
            if self.pm.has_plugin(ep.name) or self.pm.is_blocked(ep.name):
                continue
            try:
                self.pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=ep.name)
                self.pm.check_pending()
            except Exception as exc:
                if self.pm.has_plugin(ep.name):
                    self.pm.unregister(name=ep.name)
                raise PluginError(f"plugin {ep.name!r} (entry point {ep.name} = {ep.value} of group "
                                  f"{ENTRY_POINT_GROUP!r}) failed to load: {type(exc).__name__}: {exc}") from exc

    def register(self, plugin, name: Optional[str] = None) -> None:
        """Register a plugin object or module (e.g. from a test); registries are rebuilt. A plugin
        pluggy refuses (a hook tinyloop does not define, a hook with arguments, a name already in
        use) is a PluginError naming it, and is left unregistered."""
        label = name or getattr(plugin, "__name__", None) or type(plugin).__qualname__
        with self._lock:
            try:
                self.pm.register(plugin, name=name)
            except (ValueError, pluggy.PluginValidationError) as exc:
                raise PluginError(f"plugin {label!r} cannot be registered: {exc}") from exc
            try:
                self.pm.check_pending()
            except pluggy.PluginValidationError as exc:
                self.pm.unregister(plugin)
                raise PluginError(f"plugin {label!r} cannot be registered: {exc}") from exc
            self._cache.clear()

    def unregister(self, plugin=None, name: Optional[str] = None) -> None:
        """Remove a registered plugin (the object, or its name); registries are rebuilt. A plugin
        that is not registered is a PluginError."""
        with self._lock:
            known = self.pm.get_name(plugin) if plugin is not None else name
            if known is None or self.pm.get_plugin(known) is None or (
                    plugin is not None and name is not None and known != name):
                label = name or getattr(plugin, "__name__", None) or type(plugin).__qualname__
                raise PluginError(f"plugin {label!r} is not registered (nothing to unregister)")
            self.pm.unregister(plugin=plugin, name=name)
            self._cache.clear()

    @contextlib.contextmanager
    def registered(self, plugin, name: Optional[str] = None):
        """``with pm.registered(obj):`` the plugin is registered inside the block (tests)."""
        self.register(plugin, name=name)
        try:
            yield self
        finally:
            if self.pm.is_registered(plugin):       # the block may have unregistered it itself
                self.unregister(plugin)

    def snapshot(self) -> "PluginManager":
        """The registries one request reads, as they are now (built if need be): what the request
        is validated against is what it runs with, whatever is registered or unregistered while
        it is queued or decoding. Read-only."""
        with self._lock:
            registries = {hook: self._registry(hook, base) for hook, base in REQUEST_REGISTRIES}
        return _Snapshot(registries)

    def _hook_results(self, hook: str):
        """(plugin name, result) of every implementation of `hook`, in pluggy's call order; a
        hook that raises is a PluginError naming its plugin."""
        caller = getattr(self.pm.hook, hook)
        impls = caller.get_hookimpls()
        if any(i.hookwrapper or i.wrapper for i in impls):    # let pluggy run the wrappers
            return [(None, r) for r in caller()]
        out = []
        for impl in reversed(impls):
            try:
                result = impl.function()
            except Exception as exc:
                raise PluginError(f"plugin {impl.plugin_name!r}: its {hook} hook raised "
                                  f"{type(exc).__name__}: {exc}") from exc
            if result is not None:
                out.append((impl.plugin_name, result))
        return out

    def _registry(self, hook: str, base: type) -> Dict[str, type]:
        with self._lock:
            return self._build(hook, base)

    def _build(self, hook: str, base: type) -> Dict[str, type]:
        if hook not in self._cache:
            out: Dict[str, type] = {}
            source: Dict[str, Optional[str]] = {}
            for plugin, result in self._hook_results(hook):
                who = f"plugin {plugin!r}: " if plugin is not None else ""
                if not isinstance(result, (list, tuple)):
                    raise PluginError(f"{who}{hook} returned {result!r:.120}, not a list of {base.__name__} "
                                      f"subclasses")
                for cls in result:
                    if not (isinstance(cls, type) and issubclass(cls, base)):
                        raise PluginError(f"{who}{hook} returned {cls!r}, which is not a {base.__name__} subclass")
                    if not isinstance(cls.name, str) or not cls.name:
                        raise PluginError(f"{who}{cls.__qualname__} from {hook} has no name (a non-empty "
                                          f"str), got {cls.name!r}")
                    if cls.name in out and out[cls.name] is not cls:
                        raise PluginError(f"two plugins register the {base.__name__} name {cls.name!r}: "
                                          f"{out[cls.name].__module__} (plugin {source[cls.name]!r}) and "
                                          f"{cls.__module__} (plugin {plugin!r})")
                    out[cls.name] = cls
                    source.setdefault(cls.name, plugin)
            for name, cls in out.items():       # after the names: a clash is reported as such
                problem = _class_problem(cls)
                if problem:
                    who = f"plugin {source[name]!r}: " if source[name] is not None else ""
                    raise PluginError(f"{who}{cls.__qualname__} from {hook} {problem}")
            self._cache[hook] = out
        return self._cache[hook]

    def decoders(self) -> Dict[str, Type[Decoder]]:
        return self._registry("tinyloop_decoders", Decoder)

    def cache_modes(self) -> Dict[str, Type[CacheMode]]:
        return self._registry("tinyloop_cache_modes", CacheMode)

    def processors(self) -> Dict[str, Type[LogitProcessor]]:
        return self._registry("tinyloop_processors", LogitProcessor)

    def kv_codecs(self) -> Dict[str, Type[KVCodec]]:
        return self._registry("tinyloop_kv_codecs", KVCodec)

    def slot_maps(self) -> Dict[str, Type[SlotMapMode]]:
        return self._registry("tinyloop_slot_maps", SlotMapMode)

    def stoppers(self) -> Dict[str, Type[Stopper]]:
        return self._registry("tinyloop_stoppers", Stopper)

    def exit_criteria(self) -> Dict[str, Type[ExitCriterion]]:
        return self._registry("tinyloop_exit_criteria", ExitCriterion)

    def backends(self) -> Dict[str, Type[BackendEntry]]:
        return self._registry("tinyloop_backends", BackendEntry)

    def backend_names(self) -> List[str]:
        """Registered backend names, "auto" first (the choices of every --backend option)."""
        return ["auto", *self.backends()]

    def backend_entry(self, name: str, simulator_ok: bool = True) -> Type[BackendEntry]:
        """The entry `name` selects ("auto": the available entry of highest auto_priority),
        checked to be runnable on this machine (a BackendError saying why not)."""
        self.check_backend_name(name)
        entries = self.backends()
        if name == "auto":
            ranked = sorted((e for e in entries.values() if e.auto_priority is not None),
                            key=lambda e: -e.auto_priority)
            for e in ranked:
                if e.available(simulator_ok=False)[0]:
                    return e
            raise BackendError(f"backend='auto': none of {[e.name for e in ranked]} is available here")
        ok, why = entries[name].available(simulator_ok=simulator_ok)
        if not ok:
            raise BackendError(f"backend={name!r} was requested but {why}")
        return entries[name]

    def check_backend_name(self, name) -> None:
        """ConfigError unless `name` is "auto" or a registered backend (nothing imported)."""
        if not isinstance(name, str) or (name != "auto" and name not in self.backends()):
            raise ConfigError(f"backend={name!r} is not one of {', '.join(self.backend_names())}")

    def all_plugin_classes(self) -> Iterable[type]:
        yield from self.decoders().values()
        yield from self.cache_modes().values()
        yield from self.processors().values()
        yield from self.slot_maps().values()
        yield from self.exit_criteria().values()

    # ------------------------------------------------------------------ per-request lookups
    def decoder_for(self, config) -> Type[Decoder]:
        decs = self.decoders()
        if config.decoder is not None:
            if config.decoder not in decs:
                raise PluginError(f"decoder={config.decoder!r} is not registered; available: {sorted(decs)}")
            return decs[config.decoder]
        found: List[Type[Decoder]] = [d for d in decs.values() if d.matches(config)]
        if len(found) != 1:
            raise PluginError(f"{len(found)} decoders match this request ({[d.name for d in found]}); "
                              f"set GenerateConfig.decoder to one of {sorted(decs)}")
        return found[0]

    def cache_mode_for(self, config) -> Type[CacheMode]:
        modes = self.cache_modes()
        if config.cache_mode not in modes:
            raise PluginError(f"cache_mode={config.cache_mode!r} is not registered; available: {sorted(modes)}")
        return modes[config.cache_mode]

    def codec(self, name: str) -> Type[KVCodec]:
        codecs = self.kv_codecs()
        if name not in codecs:
            raise PluginError(f"KV codec {name!r} is not registered; available: {sorted(codecs)}")
        return codecs[name]

    def slot_map_for(self, config) -> Optional[SlotMapMode]:
        """The slot-map plugin the request switches on (None: the linear map)."""
        found = _from_config(self.slot_maps(), config, SlotMapMode)
        if len(found) > 1:
            raise PluginError(f"{len(found)} slot maps match this request ({[m.name for m in found]}); "
                              f"a cache has one slot map")
        return found[0] if found else None

    def processors_for(self, config) -> List[LogitProcessor]:
        return _from_config(self.processors(), config, LogitProcessor)

    def stoppers_for(self, config, model_config) -> List[Stopper]:
        """The registered stop rules the request needs (not yet reset), in the registry's order
        (pluggy's call order: the plugin registered last first)."""
        out = []
        for cls in self.stoppers().values():
            s = cls.from_config(config, model_config)
            if s is not None:
                if not isinstance(s, Stopper):
                    raise PluginError(f"{cls.__qualname__}.from_config returned {s!r}, not a Stopper")
                out.append(s)
        return out


class _Snapshot(PluginManager):
    """PluginManager.snapshot(): fixed registries, the per-request lookups over them."""

    def __init__(self, registries: Dict[str, Dict[str, type]]):
        self._lock = threading.RLock()
        self._cache = registries

    def _build(self, hook: str, base: type) -> Dict[str, type]:
        if hook not in self._cache:
            raise PluginError(f"a request's plugin snapshot holds no {hook} registry")
        return self._cache[hook]

    def register(self, plugin, name: Optional[str] = None) -> None:
        raise PluginError("a request's plugin snapshot is read-only: register with get_plugin_manager()")

    unregister = register


def _from_config(registry: Dict[str, type], config, base: type) -> list:
    """The instances the registry's classes make for the request (``from_config``; None: not
    switched on), each checked to be a `base` (PluginError naming the class otherwise)."""
    out = []
    for cls in registry.values():
        x = cls.from_config(config)
        if x is not None:
            if not isinstance(x, base):
                raise PluginError(f"{cls.__qualname__}.from_config returned {x!r:.80}, not a {base.__name__}")
            out.append(x)
    return out


def _overrides(cls: type, base: type, attr: str) -> bool:
    return getattr(cls, attr) is not getattr(base, attr)


def _class_problem(cls: type) -> Optional[str]:
    """What a plugin class lacks or declares wrongly (None: nothing), so that it is refused when
    the registry is built, not deep inside a request."""
    if issubclass(cls, Decoder):
        if not _overrides(cls, Decoder, "decode"):
            return f"(decoder {cls.name!r}) does not implement decode(session)"
        if cls.lockstep and not _overrides(cls, Decoder, "pick"):
            return f"(decoder {cls.name!r}) declares lockstep = True but does not implement pick(lane)"
        oc = cls.options_class
        if oc is not None and not (isinstance(oc, type) and dataclasses.is_dataclass(oc)):
            return f"(decoder {cls.name!r}) options_class {oc!r} is not a dataclass"
    if issubclass(cls, ExitCriterion):
        if cls.reads not in ("hidden", "logits"):
            return f"(exit criterion {cls.name!r}) reads {cls.reads!r}; allowed: 'hidden', 'logits'"
        if cls.stat is None and not _overrides(cls, ExitCriterion, "statistic"):
            return f"(exit criterion {cls.name!r}) declares no stat and no statistic(cur, prev)"
        if (cls.stat is None and cls.default_threshold is None and not _overrides(cls, ExitCriterion, "stable")
                and cls.threshold_of.__func__ is ExitCriterion.threshold_of.__func__):
            # the default stable() compares with the threshold, which it then never has
            return (f"(exit criterion {cls.name!r}) takes no threshold (default_threshold None) and does not "
                    f"define stable(value), whose default compares the statistic with the threshold")
        if cls.stat is not None and cls.stat not in STABLE_BELOW:
            return (f"(exit criterion {cls.name!r}) stat={cls.stat!r} is not a backend statistic "
                    f"({', '.join(sorted(STABLE_BELOW))}); leave stat None and define statistic()")
    if issubclass(cls, KVCodec):
        try:
            np.dtype(cls.data_dtype)
        except TypeError:
            return f"(KV codec {cls.name!r}) data_dtype={cls.data_dtype!r} is not a numpy dtype name"
        if isinstance(cls.pack, bool) or not isinstance(cls.pack, int) or cls.pack < 1:
            return f"(KV codec {cls.name!r}) pack={cls.pack!r} must be an integer >= 1"
    mode = getattr(cls, "mode", None)
    if mode is not None:
        from .compat import load_matrix

        matrix = load_matrix()
        if mode not in matrix.modes:
            return (f"declares mode {mode!r}, which is not a row of {matrix.source} "
                    f"({', '.join(sorted(matrix.modes))}); a plugin outside the matrix leaves mode None")
        cells = dict(matrix.modes[mode].cells)
        if dict(cls.compat) != cells:
            return (f"declares mode {mode!r} with compat {dict(cls.compat)!r}, which contradicts "
                    f"{matrix.source} (modes.{mode}: {cells!r}); the matrix decides, so declare its cells")
    return None


_manager: Optional[PluginManager] = None
_lock = threading.Lock()


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager, built on first use."""
    global _manager
    with _lock:
        if _manager is None:
            _manager = PluginManager()
        return _manager


def reset_plugin_manager() -> None:
    """Forget the process-wide manager (tests); the next call rebuilds it."""
    global _manager
    with _lock:
        _manager = None
