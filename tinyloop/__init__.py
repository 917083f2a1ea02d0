"""TinyLoop: an inference runtime for weight-shared looped transformers.

Public API (and nothing else): model lifecycle, generation, scoring, configs, stats and errors, and
the plugin author's API (hooks, base classes and the decode-session contract; docs/PLUGINS.md).
"""

from .runtime.config import (GenerateConfig, GenerateStats, RunConfig, SpeculativeConfig, StopReason,
                          TreeSpeculativeConfig)
from .runtime.engine import (Model, free_model, generate, generate_batch, generate_iter, generate_stream,
                          load_model, score, score_decoded, score_last_token, vram_usage_bytes)
from .errors import (BackendError, ConfigError, IncompatibleModesError, InvalidInputError,
                          ModelBusyError, ModelFormatError, ModelFreedError, NotImplementedModeError,
                          OutOfMemoryError, PluginError, TinyLoopError, TokenizerError, HandleFreedError,
                          HandleBudgetError)
from .runtime.reuse import (PrefixCache, PrefixPool, ResumeHandle, build_prefix_cache, build_resume_handle,
                            create_prefix_pool, free_prefix_cache, free_prefix_pool, free_resume_handle,
                            generate_from_prefix_cache, generate_from_prefix_cache_iter, generate_with_pool,
                            generate_with_pool_iter, live_handle_bytes, live_handles, register_prefix, resume_generate,
                            resume_generate_iter, set_handle_bytes_cap)
from .runtime.lockstep import LaneView, lane_seed
from .analysis.inspect import inspect
from .analysis.scoring import (Escalation, LensTopK, Uncertainty, score_logit_lens, score_with_consistency_escalation,
                               score_with_uncertainty)
from .api import apply_chat_template, generate_speculative, generate_text, generate_tree_speculative, stream_text
from .model.tokenizer import Tokenizer
from .runtime.grammar import Grammar
from .plugins.decoders.autotune import DecoderChoice, calibrate
# the plugin author's API
from .runtime.backend import (Backend, BackendEntry, CacheReuse, DeviceAcceptance, DeviceChaining, DeviceSampling,
                              LaneOps, TreeOps, Workspace)
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
    "generate", "generate_stream", "generate_iter", "generate_batch", "lane_seed", "LaneView", "generate_text", "stream_text", "apply_chat_template", "Tokenizer", "Grammar",
    "generate_speculative", "generate_tree_speculative", "calibrate", "DecoderChoice", "score",
    "score_last_token", "score_decoded", "score_logit_lens", "score_with_uncertainty", "score_with_consistency_escalation",
    "LensTopK", "Uncertainty", "Escalation",
    "PrefixCache", "PrefixPool", "ResumeHandle", "build_prefix_cache", "generate_from_prefix_cache",
    "free_prefix_cache", "create_prefix_pool", "register_prefix", "generate_with_pool", "free_prefix_pool",
    "build_resume_handle", "resume_generate", "free_resume_handle", "set_handle_bytes_cap", "live_handle_bytes",
    "generate_from_prefix_cache_iter", "generate_with_pool_iter", "resume_generate_iter", "live_handles",
    "GenerateConfig", "GenerateStats", "SpeculativeConfig", "TreeSpeculativeConfig", "StopReason",
    "RunConfig", "SpeculativeOptions", "TreeSpeculativeOptions",
    "TinyLoopError", "ModelFormatError", "ConfigError", "InvalidInputError", "IncompatibleModesError",
    "NotImplementedModeError", "PluginError", "BackendError", "OutOfMemoryError", "TokenizerError",
    "ModelFreedError", "ModelBusyError", "HandleFreedError", "HandleBudgetError",
    # plugin author's API
    "hookimpl", "Decoder", "DecodeSession", "Session", "Plan", "LogitProcessor", "ProcessorChain", "Stage",
    "Stopper", "StopperChain", "StopOrder", "CacheMode", "KVCodec", "SlotMapMode", "SlotMap",
    "Backend", "BackendEntry", "TreeOps", "DeviceChaining", "CacheReuse", "LaneOps", "DeviceSampling",
    "DeviceAcceptance", "Workspace",
]
