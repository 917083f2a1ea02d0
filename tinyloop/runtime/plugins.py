"""The plugin manager: built-ins from a default list, third-party packages from entry points.

Core never imports a plugin module except through DEFAULT_PLUGINS, which is loaded exactly the
way an installed third-party package is: the module is registered with pluggy and its hooks are
called once. Registries are built once and cached; nothing here runs per token.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from typing import Dict, Iterable, List, Optional, Type

import pluggy

from . import hookspecs
from .backend import BackendEntry
from .cache import CacheMode, KVCodec, SlotMapMode
from .decoding import Decoder
from .early_exit import ExitCriterion
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


class PluginManager:
    """Wraps pluggy's manager and the registries built from the hooks."""

    def __init__(self, load_entrypoints: bool = True):
        self.pm = pluggy.PluginManager("tinyloop")
        self.pm.add_hookspecs(hookspecs)
        for modname in DEFAULT_PLUGINS:
            self.pm.register(importlib.import_module(modname), name=modname)
        if load_entrypoints:
            try:
                self.pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
            except Exception as exc:  # a broken third-party package must not take core down silently
                raise PluginError(f"loading entry points of group {ENTRY_POINT_GROUP!r} failed: {exc}") from exc
        self.pm.check_pending()
        self._cache: Dict[str, Dict[str, type]] = {}

    def register(self, plugin, name: Optional[str] = None) -> None:
        """Register a plugin object or module (e.g. from a test); registries are rebuilt."""
        self.pm.register(plugin, name=name)
        self.pm.check_pending()
        self._cache.clear()

    def unregister(self, plugin=None, name: Optional[str] = None) -> None:
        self.pm.unregister(plugin=plugin, name=name)
        self._cache.clear()

    @contextlib.contextmanager
    def registered(self, plugin, name: Optional[str] = None):
        """``with pm.registered(obj):`` the plugin is registered inside the block (tests)."""
        self.register(plugin, name=name)
        try:
            yield self
        finally:
            self.unregister(plugin)

    def _registry(self, hook: str, base: type) -> Dict[str, type]:
        if hook not in self._cache:
            out: Dict[str, type] = {}
            for result in getattr(self.pm.hook, hook)():
                for cls in result or ():
                    if not (isinstance(cls, type) and issubclass(cls, base)):
                        raise PluginError(f"{hook} returned {cls!r}, which is not a {base.__name__} subclass")
                    if not cls.name:
                        raise PluginError(f"{cls.__qualname__} from {hook} has no name")
                    if cls.name in out and out[cls.name] is not cls:
                        raise PluginError(f"two plugins register the {base.__name__} name {cls.name!r}: "
                                          f"{out[cls.name].__module__} and {cls.__module__}")
                    out[cls.name] = cls
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
        found = [m for m in (cls.from_config(config) for cls in self.slot_maps().values()) if m is not None]
        if len(found) > 1:
            raise PluginError(f"{len(found)} slot maps match this request ({[m.name for m in found]}); "
                              f"a cache has one slot map")
        return found[0] if found else None

    def processors_for(self, config) -> List[LogitProcessor]:
        out = []
        for cls in self.processors().values():
            p = cls.from_config(config)
            if p is not None:
                out.append(p)
        return out

    def stoppers_for(self, config, model_config) -> List[Stopper]:
        """The registered stop rules the request needs (not yet reset), in registration order."""
        out = []
        for cls in self.stoppers().values():
            s = cls.from_config(config, model_config)
            if s is not None:
                if not isinstance(s, Stopper):
                    raise PluginError(f"{cls.__qualname__}.from_config returned {s!r}, not a Stopper")
                out.append(s)
        return out


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
