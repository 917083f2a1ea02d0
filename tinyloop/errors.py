"""Typed errors. Every failure a caller can cause raises a subclass of :class:`TinyLoopError`
whose message names the offending value and what is allowed."""

from __future__ import annotations


class TinyLoopError(Exception):
    """Base class of every error TinyLoop raises on purpose."""


class ModelFormatError(TinyLoopError):
    """A .tinyloop file (or a checkpoint being converted) is malformed, truncated or inconsistent."""


class ConfigError(TinyLoopError, ValueError):
    """A configuration value is out of range, of the wrong type, or unknown."""


class InvalidInputError(TinyLoopError, ValueError):
    """A request's data is invalid: token ids out of range, empty prompt, too long for the cache."""


class IncompatibleModesError(TinyLoopError):
    """The requested combination of modes is rejected by configs/compat.yaml."""


class NotImplementedModeError(IncompatibleModesError):
    """The requested mode is listed in configs/compat.yaml but not built yet."""


class PluginError(TinyLoopError):
    """A plugin is unknown, registered twice, or declares capabilities the compat matrix contradicts."""


class BackendError(TinyLoopError):
    """A backend is unavailable (e.g. CUDA requested without a GPU) or failed."""


class OutOfMemoryError(BackendError, MemoryError):
    """Allocating weights, buffers or the KV cache failed; everything taken so far was released."""


class TokenizerError(TinyLoopError):
    """A tokenizer could not be loaded or cannot encode/decode the given input."""


class ModelFreedError(TinyLoopError):
    """A model (or an opened model file) was used after free_model() / close()."""


class ModelBusyError(TinyLoopError):
    """A model is already running a forward (models are not reentrant; serialize calls)."""


class HandleFreedError(TinyLoopError):
    """A PrefixCache, PrefixPool or ResumeHandle was used after it was freed, evicted (the live
    handle cap) or released with its model."""


class HandleBudgetError(OutOfMemoryError):
    """Keeping a prefix cache, pool entry or resume handle would exceed the process-wide cap on
    live handle bytes even after evicting every handle that can be evicted."""
