"""``tinyloop serve [--model F] [--host H] [--port P] [--backend B] [--config serve.yaml]``: the
OpenAI-compatible HTTP server (tinyloop[serve]); flags override the config file's values."""

from __future__ import annotations

import argparse
import sys

from ..errors import ConfigError
from ..runtime.plugins import get_plugin_manager
from ..serve.config import ServeConfig, load_serve_config


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible completions)",
                              description="Serve one model over HTTP: POST /v1/completions (streaming as "
                                          "server-sent events), GET /v1/models, /health, /metrics, and a "
                                          "playground page at / (docs/SERVING.md).")
    p.add_argument("--model", default=None, help=".tinyloop file (default: the config's, else the demo model)")
    p.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port to listen on (default 8000)")
    p.add_argument("--backend", default=None, choices=get_plugin_manager().backend_names(),
                   help="where to run (default auto)")
    p.add_argument("--config", default=None, help="serve.yaml with the server's settings")
    return p


def config_of(args) -> ServeConfig:
    from .run import _check_nonempty
    _check_nonempty(args.config, "--config")
    cfg = load_serve_config(args.config) if args.config is not None else ServeConfig()
    changes = {k: getattr(args, k) for k in ("model", "host", "port", "backend") if getattr(args, k) is not None}
    return cfg.replace(**changes) if changes else cfg


def _check_listen(host: str, port: int) -> None:
    """ConfigError unless a server can listen on host:port now (bound as uvicorn binds it, then
    closed): a port in use or an unknown host is one error line, not uvicorn's log line and exit 3."""
    import asyncio

    async def probe():
        server = await asyncio.get_running_loop().create_server(asyncio.Protocol, host=host, port=port)
        server.close()
        await server.wait_closed()
    try:
        asyncio.run(probe())
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def run(args) -> int:
    cfg = config_of(args)
    try:
        import uvicorn  # noqa: F401
    except ImportError:
        raise ConfigError("the server needs the serve extra: pip install 'tinyloop[serve]'") from None
    _check_listen(cfg.host, cfg.port)         # before the model loads; uvicorn's own failure is exit 3
    from ..serve import create_app
    from ..serve.app import uvicorn_server
    app = create_app(cfg)
    print(f"[tinyloop] serving {app.state.served.name} on http://{cfg.host}:{cfg.port}", file=sys.stderr)
    try:
        # its shutdown fails the queued requests (503) before waiting on the open connections
        uvicorn_server(app, host=cfg.host, port=cfg.port, log_level="warning").run()
    finally:
        app.state.served.close()
    return 0
