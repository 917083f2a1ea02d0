"""TinyLoop: an inference runtime for weight-shared looped transformers.

Public API (and nothing else): model lifecycle, generation, scoring, configs, stats and errors.
"""

from .core.config import (GenerateConfig, GenerateStats, RunConfig, SpeculativeConfig, StopReason,
                          TreeSpeculativeConfig)
from .core.engine import (Model, free_model, generate, generate_batch, generate_iter, generate_stream,
                          load_model, score, score_last_token, vram_usage_bytes)
from .core.errors import (BackendError, ConfigError, IncompatibleModesError, InvalidInputError,
                          ModelBusyError, ModelFormatError, ModelFreedError, NotImplementedModeError,
                          OutOfMemoryError, PluginError, TinyLoopError, TokenizerError)
from .core.speculative import generate_speculative, generate_tree_speculative
from .core.inspect import inspect
from .core.autotune import DecoderChoice, calibrate

__version__ = "0.1.0"

__all__ = [
    "load_model", "free_model", "vram_usage_bytes", "inspect", "Model",
    "generate", "generate_stream", "generate_iter", "generate_batch",
    "generate_speculative", "generate_tree_speculative", "calibrate", "DecoderChoice", "score",
    "score_last_token",
    "GenerateConfig", "GenerateStats", "SpeculativeConfig", "TreeSpeculativeConfig", "StopReason",
    "RunConfig",
    "TinyLoopError", "ModelFormatError", "ConfigError", "InvalidInputError", "IncompatibleModesError",
    "NotImplementedModeError", "PluginError", "BackendError", "OutOfMemoryError", "TokenizerError",
    "ModelFreedError", "ModelBusyError",
]
