"""TinyLoop: an inference runtime for weight-shared looped transformers.

Public API (and nothing else): model lifecycle, generation, scoring, configs, stats and errors, and
the plugin author's API (hooks, base classes and the decode-session contract; docs/PLUGINS.md).
"""

from .runtime.config import (GenerateConfig, GenerateStats, RunConfig, SpeculativeConfig, StopReason,
                          TreeSpeculativeConfig)
from .runtime.engine import (Model, free_model, generate, generate_batch, generate_iter, generate_stream,
                          load_model, score, score_last_token, vram_usage_bytes)
from .errors import (BackendError, ConfigError, IncompatibleModesError, InvalidInputError,
                          ModelBusyError, ModelFormatError, ModelFreedError, NotImplementedModeError,
                          OutOfMemoryError, PluginError, TinyLoopError, TokenizerError)
from .analysis.inspect import inspect
from .api import generate_speculative, generate_text, generate_tree_speculative, stream_text
from .model.tokenizer import Tokenizer
from .plugins.decoders.autotune import DecoderChoice, calibrate
# the plugin author's API
from .runtime.backend import Backend, BackendEntry, DeviceChaining, TreeOps, Workspace
from .runtime.cache import CacheMode, KVCodec, SlotMap, SlotMapMode
from .runtime.decoding import DecodeSession, Decoder
from .runtime.engine import Plan, Session
from .runtime.hookspecs import hookimpl
from .runtime.processors import LogitProcessor, ProcessorChain, Stage
from .runtime.stopping import Stopper, StopperChain, StopOrder
from .plugins.decoders.spec_session import SpeculativeOptions, TreeSpeculativeOptions

__version__ = "0.1.0"

__all__ = [
    "load_model", "free_model", "vram_usage_bytes", "inspect", "Model",
    "generate", "generate_stream", "generate_iter", "generate_batch", "generate_text", "stream_text", "Tokenizer",
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
