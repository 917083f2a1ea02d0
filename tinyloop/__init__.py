"""TinyLoop: an inference runtime for weight-shared looped transformers.

Public API (and nothing else): model lifecycle, generation, scoring, configs, stats and errors, and
the plugin author's API (hooks, base classes and the decode-session contract; docs/PLUGINS.md).
"""

from .core.config import (GenerateConfig, GenerateStats, RunConfig, SpeculativeConfig, StopReason,
                          TreeSpeculativeConfig)
from .core.engine import (Model, free_model, generate, generate_batch, generate_iter, generate_stream,
                          load_model, score, score_last_token, vram_usage_bytes)
from .core.errors import (BackendError, ConfigError, IncompatibleModesError, InvalidInputError,
                          ModelBusyError, ModelFormatError, ModelFreedError, NotImplementedModeError,
                          OutOfMemoryError, PluginError, TinyLoopError, TokenizerError)
from .core.inspect import inspect
from .api import generate_speculative, generate_tree_speculative
from .plugins.decoders.autotune import DecoderChoice, calibrate
# the plugin author's API
from .core.backend import Backend, BackendEntry, DeviceChaining, TreeOps, Workspace
from .core.cache import CacheMode, KVCodec, SlotMap, SlotMapMode
from .core.decoding import DecodeSession, Decoder
from .core.engine import Plan, Session
from .core.hookspecs import hookimpl
from .core.processors import LogitProcessor, ProcessorChain, Stage
from .core.stopping import Stopper, StopperChain, StopOrder
from .plugins.decoders.spec_session import SpeculativeOptions, TreeSpeculativeOptions

__version__ = "0.1.0"

__all__ = [
    "load_model", "free_model", "vram_usage_bytes", "inspect", "Model",
    "generate", "generate_stream", "generate_iter", "generate_batch",
    "generate_speculative", "generate_tree_speculative", "calibrate", "DecoderChoice", "score",
    "score_last_token",
    "GenerateConfig", "GenerateStats", "SpeculativeConfig", "TreeSpeculativeConfig", "StopReason",
    "RunConfig", "SpeculativeOptions", "TreeSpeculativeOptions",
    "TinyLoopError", "ModelFormatError", "ConfigError", "InvalidInputError", "IncompatibleModesError",
    "NotImplementedModeError", "PluginError", "BackendError", "OutOfMemoryError", "TokenizerError",
    "ModelFreedError", "ModelBusyError",
    # plugin author's API
    "hookimpl", "Decoder", "DecodeSession", "Session", "Plan", "LogitProcessor", "ProcessorChain", "Stage",
    "Stopper", "StopperChain", "StopOrder", "CacheMode", "KVCodec", "SlotMapMode", "SlotMap",
    "Backend", "BackendEntry", "TreeOps", "DeviceChaining", "Workspace",
]
