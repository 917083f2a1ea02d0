"""The HTTP server (``python -m tinyloop serve``; the optional extra ``tinyloop[serve]``): an
OpenAI-compatible completions API over one loaded model, with TinyLoop's own knobs as extra body
fields, Prometheus metrics and a playground page. docs/SERVING.md."""

from .config import Scaffold, ServeConfig, load_serve_config

__all__ = ["Scaffold", "ServeConfig", "load_serve_config", "create_app"]


def create_app(cfg=None, model=None):
    """The FastAPI app (tinyloop.serve.app.create_app); a ConfigError naming the extra when
    FastAPI or prometheus-client is missing."""
    from ..errors import ConfigError
    try:
        from .app import create_app as _create
    except ImportError as exc:
        raise ConfigError(str(exc)) from None
    return _create(cfg, model)
