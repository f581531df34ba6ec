"""`serve --replicas N`: N runtime replicas as one Ray Serve deployment, over the same FastAPI app.

Each replica is a Ray actor that builds `create_app(config)` at init (`serve.ingress()` with
`__serve_build_asgi_app__`, Ray Serve's late-bound ingress: the app holds locks and threads, so it is
built in the replica instead of pickled) and loads the engines before it reports ready (the lifespan
runs inside Ray's replica wrapper). Ray Serve's HTTP proxy routes requests to the replicas and its
controller replaces a replica that dies. Every response names its replica in `x-dspark-replica`
("dspark#<replica id>").

Replica death: the controller starts a replacement; a request the dead replica held ends with an
explicit error, never a hang: a 500 from Ray's proxy (non-streaming), or a stream cut short without
its `data: [DONE]` (the client sees an incomplete chunked body). Ray Serve does not retry requests a
replica had accepted, and this deployment adds no retrying router in front of the replicas (yet).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from typing import Callable

from ..errors import ConfigError
from .app import ServeConfig

__all__ = ["deployment", "start_on_ray", "serve_on_ray", "RayDeployment", "DEPLOYMENT_NAME"]

DEPLOYMENT_NAME = "dspark"


def _ray():
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise ConfigError("--replicas > 1 needs Ray Serve: pip install 'dspark-export[ray]' "
                          f"(ray[serve]); found no ray ({e})") from e
    return ray, serve


def deployment(config: ServeConfig, replicas: int, replica_cpus: float = 1.0):
    """The bound Ray Serve application: `replicas` copies of the app over `config`'s engine directory.

    Args:
        config: what each replica serves (its engines load synchronously at replica init).
        replicas: number of replicas (Ray Serve's num_replicas).
        replica_cpus: CPUs Ray reserves for each replica actor.
    """
    ray, serve = _ray()
    config = dataclasses.replace(config, load_in_background=False)

    @serve.deployment(name=DEPLOYMENT_NAME, num_replicas=replicas, ray_actor_options={"num_cpus": replica_cpus},
                      max_ongoing_requests=max(8, config.max_queue + (config.max_slots or 16)),
                      health_check_period_s=2, health_check_timeout_s=30, graceful_shutdown_timeout_s=30)
    @serve.ingress()
    class DsparkReplica:
        def __init__(self, cfg: ServeConfig):
            self.cfg = cfg

        def __serve_build_asgi_app__(self):
            from dspark_export.serve.app import create_app

            return create_app(self.cfg)

    return DsparkReplica.bind(config)


class RayDeployment:
    """A running deployment: `start_on_ray` returns it, `stop()` deletes it (and stops the Ray instance and
    Serve if they were started here)."""

    def __init__(self, started_here: bool):
        self.started_here = started_here

    def stop(self) -> None:
        ray, serve = _ray()
        try:
            serve.delete(DEPLOYMENT_NAME)
            if self.started_here:
                serve.shutdown()
        finally:
            if self.started_here:
                ray.shutdown()


def start_on_ray(config: ServeConfig, replicas: int, host: str = "127.0.0.1", port: int = 8000,
                 ray_address: str | None = None, replica_cpus: float = 1.0, num_cpus: int | None = None,
                 progress: Callable[[str], None] = print) -> RayDeployment:
    """Deploy on a local Ray instance (started here: `num_cpus` CPUs, default this machine's, no
    dashboard) or the cluster at `ray_address`; returns once every replica has loaded its engines.

    Raises:
        ConfigError: no Ray installed.
    """
    ray, serve = _ray()
    started_here = not ray_address
    if started_here:
        cpus = num_cpus or max(os.cpu_count() or 1, int(replicas * replica_cpus + 0.999))
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=ray_address, log_to_driver=False)
    handle = RayDeployment(started_here)
    try:
        serve.start(http_options={"host": host, "port": port})
        progress(f"deploying {replicas} replicas of {config.served_model} on Ray "
                 f"({'a local instance' if started_here else ray_address}), http://{host}:{port}/v1")
        serve.run(deployment(config, replicas, replica_cpus), name=DEPLOYMENT_NAME, route_prefix="/", blocking=False)
    except BaseException:
        handle.stop()
        raise
    progress("all replicas ready")
    return handle


def serve_on_ray(config: ServeConfig, replicas: int, host: str = "127.0.0.1", port: int = 8000,
                 ray_address: str | None = None, replica_cpus: float = 1.0,
                 progress: Callable[[str], None] = print) -> int:
    """`start_on_ray`, then serve until SIGTERM/SIGINT and stop (Ray Serve drains each replica for up
    to graceful_shutdown_timeout_s). Returns the exit code."""
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        running = start_on_ray(config, replicas, host, port, ray_address, replica_cpus, progress=progress)
        try:
            stop.wait()
            progress("shutting down (draining the replicas)")
        finally:
            running.stop()
        return 0
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
