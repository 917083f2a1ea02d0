"""Replicas beyond one process or machine: the same OpenAI routes as a Ray Serve application
(optional extra ``tinyloop[ray]``). Each replica is a Ray actor that builds its own app
(tinyloop.serve.app.create_app), so it loads its own model onto its own GPU (``num_gpus=1``) or
CPU; Ray Serve's proxy spreads requests over the replicas and restarts one that dies.

    from tinyloop.serve import ServeConfig
    from tinyloop.serve.ray import deploy
    deploy(ServeConfig(backend="cuda"), num_replicas=4, num_gpus=1)     # on a running Ray cluster

On a multi-node cluster: ``ray start --head`` on one node, ``ray start --address HEAD:6379`` on the
others (each with the model file at the same path, or a shared file system), then ``deploy`` from
any node; the proxy listens on every node at ``http_port`` (docs/SERVING.md, "Replicas with Ray
Serve")."""

from __future__ import annotations

from typing import Optional

from ..errors import ConfigError
from ..runtime.config import check_float, check_int
from .config import ServeConfig


def _ray():
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ConfigError("replicas need the ray extra: pip install 'tinyloop[ray]'") from None
    return ray, serve


def application(cfg: Optional[ServeConfig] = None, num_replicas: int = 2, num_gpus: float = 0.0,
                num_cpus: float = 1.0, name: str = "tinyloop"):
    """The Ray Serve application (a bound deployment) of `cfg`'s model with `num_replicas` replicas,
    each holding `num_gpus` GPUs and `num_cpus` CPUs (cfg.backend picks where the model runs)."""
    _, serve = _ray()
    cfg = cfg if cfg is not None else ServeConfig()
    if not isinstance(cfg, ServeConfig):
        raise ConfigError(f"application takes a ServeConfig, got {type(cfg).__name__}")
    check_int("num_replicas", num_replicas, 1)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"name={name!r} must be a non-empty application name")
    for what, v in (("num_gpus", num_gpus), ("num_cpus", num_cpus)):
        if check_float(what, v) < 0:
            raise ConfigError(f"{what}={v!r} is outside the allowed range >= 0")

    def build():                        # runs on each replica: its own model, worker and metrics
        from tinyloop.serve.app import create_app
        return create_app(cfg)

    ingress = serve.ingress(build)()
    deployment = serve.deployment(name=name, num_replicas=num_replicas,
                                  ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus})(ingress)
    return deployment.bind()


def deploy(cfg: Optional[ServeConfig] = None, num_replicas: int = 2, num_gpus: float = 0.0,
           num_cpus: float = 1.0, http_port: int = 8000, name: str = "tinyloop"):
    """Start Ray Serve on the running Ray cluster (or a local one) with `application(...)` at route
    prefix ``/`` on `http_port`; returns the deployment handle."""
    ray, serve = _ray()
    check_int("http_port", http_port, 0, 65535)
    app = application(cfg, num_replicas, num_gpus, num_cpus, name)
    if not ray.is_initialized():
        ray.init(ignore_reinit_error=True)
    serve.start(http_options={"host": (cfg or ServeConfig()).host, "port": http_port})
    return serve.run(app, name=name, route_prefix="/")
