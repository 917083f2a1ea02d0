"""Plugin hooks (pluggy, project name "tinyloop").

Every hook is a *registry* hook: it is called once when the plugin manager is built, returns a list
of classes, and never runs per token. Built-in plugins (tinyloop.plugins.*) register through these
hooks exactly like third-party packages, which are found through the ``tinyloop`` entry-point group.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("tinyloop")
hookimpl = pluggy.HookimplMarker("tinyloop")


@hookspec
def tinyloop_decoders():
    """Return a list of Decoder subclasses (tinyloop.runtime.decoding.Decoder).

    A decoder turns a decode session (prefill / logits / greedy / advance) into a stream of tokens.
    Its ``name`` selects it (GenerateConfig.decoder); ``matches(config)`` lets it be picked
    automatically; ``mode`` and ``compat`` tie it to a row of configs/compat.yaml. It may bring
    its own session (``session_class``) and options (``options_class``, GenerateConfig.options)
    and declares the GenerateConfig fields it honours (``honours``).
    Result: all implementations' lists, concatenated."""


@hookspec
def tinyloop_cache_modes():
    """Return a list of CacheMode subclasses (tinyloop.runtime.cache.CacheMode).

    A cache mode (GenerateConfig.cache_mode) says which KV codec each layer group of the cache
    uses. Result: all implementations' lists, concatenated."""


@hookspec
def tinyloop_kv_codecs():
    """Return a list of KVCodec subclasses (tinyloop.runtime.cache.KVCodec).

    A codec defines how one K or V row is stored (codes, scale, zero point) with a numpy reference,
    and names each backend's implementation (``backend_impls``). Result: all lists, concatenated."""


@hookspec
def tinyloop_slot_maps():
    """Return a list of SlotMapMode subclasses (tinyloop.runtime.cache.SlotMapMode).

    ``from_config(config)`` returns an instance when the request enables the slot map (at most one
    may); it sizes the cache's ring (tinyloop.runtime.cache.SlotMap). Result: all lists, concatenated."""


@hookspec
def tinyloop_processors():
    """Return a list of LogitProcessor subclasses (tinyloop.runtime.processors.LogitProcessor).

    ``from_config(config)`` builds an instance when the request enables it; the chain orders
    processors by ``stage``. Result: all implementations' lists, concatenated."""


@hookspec
def tinyloop_stoppers():
    """Return a list of Stopper subclasses (tinyloop.runtime.stopping.Stopper).

    ``from_config(config, model_config)`` builds an instance when the request needs the rule; the
    decode loop asks the chain (ordered by ``order``) after every emitted token, and the first
    StopReason returned ends the request. Result: all implementations' lists, concatenated."""


@hookspec
def tinyloop_exit_criteria():
    """Return a list of ExitCriterion subclasses (tinyloop.runtime.early_exit.ExitCriterion).

    An exit criterion (GenerateConfig.early_exit_criterion) decides from a probe of the state
    between loop iterations whether a decode step is stable enough to leave the loop; its
    ``statistic`` and ``stable`` run once per probe. Result: all implementations' lists,
    concatenated."""


@hookspec
def tinyloop_backends():
    """Return a list of BackendEntry subclasses (tinyloop.runtime.backend.BackendEntry).

    An entry names a backend (RunConfig.backend, load_model(backend=...), --backend), the
    "module:Class" of its Backend implementation, whether this machine can run it, and its rank
    for backend="auto". Result: all implementations' lists, concatenated."""
