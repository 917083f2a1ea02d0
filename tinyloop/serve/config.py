"""The server's configuration (``python -m tinyloop serve --config serve.yaml``): which model, where
to listen, how long the queue is, how long a request may take, and the scaffolds (shared prompt
prefixes) registered into a prefix pool at start-up. Every field is checked when the config is made
(a ConfigError naming the field and what is allowed), before the model is loaded."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from ..errors import ConfigError
from ..runtime.config import check_float, check_int, from_mapping, read_text, typed_init

#: Largest queue a server accepts (requests waiting for the model).
MAX_QUEUE = 1 << 16


@typed_init
@dataclass(frozen=True)
class Scaffold:
    """A shared prompt prefix kept prefilled in the server's prefix pool: requests whose prompt
    starts with it copy its K/V instead of recomputing them."""

    text: str = ""
    """The prefix text (encoded with the model's tokenizer)."""
    loops: Optional[int] = None
    """The depth it is prefilled at (None: the model's default); requests at that depth reuse it."""
    cache_mode: str = "fp16"
    """The cache mode it is kept in; requests in that mode reuse it."""

    def __post_init__(self) -> None:
        if not isinstance(self.text, str) or not self.text:
            raise ConfigError(f"scaffold text must be a non-empty string, got {self.text!r:.60}")
        if self.loops is not None:
            check_int("scaffold loops", self.loops, 1)
        if not isinstance(self.cache_mode, str) or not self.cache_mode:
            raise ConfigError(f"scaffold cache_mode must be a cache-mode name, got {self.cache_mode!r}")


@typed_init
@dataclass(frozen=True)
class ServeConfig:
    """Settings of ``tinyloop serve`` (YAML keys of the same names)."""

    model: Optional[str] = None
    """The .tinyloop file (None: the demo model)."""
    model_name: Optional[str] = None
    """The model id clients name (GET /v1/models; ``model`` of a request); None: the file's stem."""
    backend: str = "auto"
    """Where to run: auto, cpu or cuda."""
    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 8000
    """Port to listen on (0: any free port)."""
    max_seq_len: int = 2048
    """Prompt + completion tokens a request may use."""
    queue_size: int = 16
    """Requests that may wait for the model; one more is answered 429 with Retry-After."""
    retry_after_s: int = 1
    """The Retry-After a 429 carries (seconds)."""
    deadline_s: float = 300.0
    """The longest a request may run (queueing included); a request may ask for less (``timeout``).
    A request past its deadline ends with what it has, stop_reason DEADLINE."""
    max_tokens_default: int = 16
    """max_tokens of a request that does not say (the OpenAI default), or what its prompt leaves of
    max_seq_len when that is less."""
    max_body_bytes: int = 4 << 20
    """The largest request body taken (4 MiB); a larger one is a 413 before it is read (its prompt
    would be encoded on the event loop)."""
    scaffolds: Tuple[Scaffold, ...] = ()
    """Prefixes registered into the prefix pool at start-up."""
    pool_capacity: int = 8
    """Entries the prefix pool holds (scaffolds beyond it evict the oldest)."""
    pool_max_bytes: Optional[int] = None
    """Bytes the prefix pool's caches may hold (None: no cap)."""

    def __post_init__(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ConfigError(f"model must be a .tinyloop path or null (the demo model), got {self.model!r}")
        if self.model_name is not None and (not isinstance(self.model_name, str) or not self.model_name.strip()):
            raise ConfigError(f"model_name must be a non-empty string or null, got {self.model_name!r}")
        for name in ("backend", "host"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v:
                raise ConfigError(f"{name} must be a non-empty string, got {v!r}")
        check_int("port", self.port, 0, 65535)
        check_int("max_seq_len", self.max_seq_len, 2)
        check_int("queue_size", self.queue_size, 1, MAX_QUEUE)
        check_int("retry_after_s", self.retry_after_s, 0, 3600)
        d = check_float("deadline_s", self.deadline_s)
        if d <= 0:
            raise ConfigError(f"deadline_s={self.deadline_s} must be > 0 (seconds)")
        object.__setattr__(self, "deadline_s", d)
        check_int("max_tokens_default", self.max_tokens_default, 1)
        check_int("max_body_bytes", self.max_body_bytes, 1)
        check_int("pool_capacity", self.pool_capacity, 1)
        if self.pool_max_bytes is not None:
            check_int("pool_max_bytes", self.pool_max_bytes, 1)
        raw = self.scaffolds
        if isinstance(raw, (str, bytes)) or not isinstance(raw, (list, tuple)):
            raise ConfigError(f"scaffolds must be a list of texts or {{text, loops, cache_mode}} mappings, "
                              f"got {type(raw).__name__}")
        out = []
        for i, s in enumerate(raw):
            if isinstance(s, Scaffold):
                out.append(s)
            elif isinstance(s, str):
                out.append(Scaffold(text=s))
            elif isinstance(s, dict):
                out.append(from_mapping(Scaffold, s, f"scaffolds[{i}]"))
            else:
                raise ConfigError(f"scaffolds[{i}] must be a text or a mapping, got {type(s).__name__}")
        object.__setattr__(self, "scaffolds", tuple(out))

    def replace(self, **changes: Any) -> "ServeConfig":
        return dataclasses.replace(self, **changes)


def load_serve_config(path: str) -> ServeConfig:
    """Parse a YAML serve config; errors name the file and the bad key or value."""
    import yaml

    text = read_text(path, "serve config")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {' '.join(str(exc).split())}") from None
    except RecursionError:
        raise ConfigError(f"{path}: the YAML is nested too deeply to read") from None
    try:
        return from_mapping(ServeConfig, data, "serve config")
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
