"""Scale-out on Ray Serve: the same app, one engine per replica.

    from calm_runtime.server import ServeConfig
    from calm_runtime.server.ray_serve import calm_deployment
    from ray import serve
    serve.run(calm_deployment(ServeConfig(engine="/models/engine"), replicas=2),
              route_prefix="/")

Each replica builds the app (and loads the engine) once, in its own process, through
``serve.ingress``'s builder; Ray's proxy spreads requests over the replicas, and every
replica batches its own share. ``engine`` must be a path that exists on every node.
"""

from __future__ import annotations

import logging

from calm_runtime.errors import BackendUnavailableError
from calm_runtime.extras import install_hint
from calm_runtime.server.config import ServeConfig

__all__ = ["calm_deployment", "run_ray"]

logger = logging.getLogger(__name__)


def calm_deployment(config: ServeConfig, *, replicas: int = 1, replica_cpus: float = 1.0,
                    name: str = "calm"):
    """A bound Ray Serve application serving ``config``'s engine on ``replicas`` replicas."""
    try:
        from ray import serve
    except ImportError:
        raise BackendUnavailableError(f"Ray Serve is not installed; {install_hint('ray')}, "
                                      "or pip install 'ray[serve]'") from None
    def build_app():  # a plain function: Ray calls it on each replica to build the app
        from calm_runtime.server.app import create_app

        return create_app(config)

    ingress = serve.ingress(build_app)

    class CalmReplica:
        """One replica: the calm app with its own engine and batcher."""

    deployment = serve.deployment(ingress(CalmReplica), name=name, num_replicas=replicas,
                                  ray_actor_options={"num_cpus": replica_cpus},
                                  max_ongoing_requests=config.max_queue)
    return deployment.bind()


def run_ray(config: ServeConfig, *, host: str, port: int, replicas: int,
            replica_cpus: float) -> None:  # pragma: no cover - blocks until interrupted
    """Start a local Ray instance (or join ``RAY_ADDRESS``) and serve until Ctrl-C."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise BackendUnavailableError(f"Ray Serve is not installed; {install_hint('ray')}, "
                                      "or pip install 'ray[serve]'") from None
    import time

    ray.init(include_dashboard=False)
    serve.start(http_options={"host": host, "port": port})
    serve.run(calm_deployment(config, replicas=replicas, replica_cpus=replica_cpus),
              route_prefix="/", name="calm")
    logger.info("serving %s on http://%s:%d with %d Ray Serve replicas", config.engine, host,
                port, replicas)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
