"""Entry points of the speculative decode contexts.

Both contexts are `planned` in configs/compat.yaml; the entry points validate their config and the
request, then the compat check rejects them with NotImplementedModeError naming the rule, before
any work."""

from __future__ import annotations

from typing import List, Optional, Sequence

from .compat import check_request
from .config import GenerateConfig, SpeculativeConfig, TreeSpeculativeConfig
from .engine import Model, validate_request
from .errors import ConfigError, NotImplementedModeError


def _request(model: Model, prompt, config, cls, context: str) -> None:
    if not isinstance(config, cls):
        raise ConfigError(f"{context} decoding takes a {cls.__name__}, got {type(config).__name__}")
    model._check_live()
    if config.verify_loops > model.cfg.max_loops:
        raise ConfigError(f"verify_loops={config.verify_loops} is outside the allowed range "
                          f"[2, {model.cfg.max_loops}] (model.max_loops)")
    gc = GenerateConfig(max_tokens=config.max_tokens, loops=config.verify_loops,
                        temperature=config.temperature)
    validate_request(model, prompt, gc)
    check_request(context, gc)


def generate_speculative(model: Model, prompt: Sequence[int],
                         config: Optional[SpeculativeConfig] = None) -> List[int]:
    """Chain self-speculative decoding (draft at draft_loops, verify at verify_loops)."""
    _request(model, prompt, config or SpeculativeConfig(), SpeculativeConfig, "speculative")
    raise NotImplementedModeError("speculative decoding is not implemented yet")


def generate_tree_speculative(model: Model, prompt: Sequence[int],
                              config: Optional[TreeSpeculativeConfig] = None) -> List[int]:
    """Tree self-speculative decoding with K_branches candidates per draft step."""
    _request(model, prompt, config or TreeSpeculativeConfig(), TreeSpeculativeConfig, "tree_speculative")
    raise NotImplementedModeError("tree-speculative decoding is not implemented yet")
