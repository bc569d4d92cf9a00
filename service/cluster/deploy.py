"""The Ray Serve application: a Litestar ingress in front of N engine replicas.

``build_app(engine_config, service_config, options)`` returns the Serve ``Application``::

    HTTP (Serve's proxy) ──► StencilIngress (the usual Litestar app, ClusterEngine inside)
                                 │  validates, applies the chat template, tokenizes
                                 ▼  ReplicaRequest (token ids), routed by the request router
                             EngineReplica × N (one AsyncEngine each)

``serve_cluster(...)`` is ``stencil serve --replicas N``: start (or join) Ray, run the app,
wait for SIGTERM / SIGINT, then let Serve drain and stop it.

Ray opens ports on every interface (each replica's gRPC server binds ``[::]:0``) even when
HTTP is on 127.0.0.1: on a shared host run it inside a private network namespace or a
firewalled network (the tests and ``stencil bench cluster`` use ``unshare -n``).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from stencil.engine.config import ConfigError, EngineConfig
from stencil.service.cluster import ROUTERS
from stencil.service.cluster.cluster_engine import ClusterEngine, ClusterSettings
from stencil.service.cluster.replica import EngineReplica
from stencil.service.state import ServiceConfig

log = logging.getLogger("stencil.cluster")

INSTALL_HINT = "Ray Serve is not installed: pip install 'stencil-serve[cluster]' (ray[serve]==2.60.0)"


def require_ray() -> None:
    """Raise ``RuntimeError`` with the install command when Ray Serve cannot be imported."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"{INSTALL_HINT} ({e})") from None


@dataclass(slots=True)
class ClusterOptions:
    """How the replicas are deployed, routed and scaled.

    Attributes:
        replicas: engine replicas (the minimum when autoscaling).
        max_replicas: set (> ``replicas``) to autoscale between ``replicas`` and this on queue
            length; ``None`` = a fixed number.
        target_ongoing_requests: autoscaling target per replica; ``None`` = 80% of the engine's
            batch capacity (``max_num_seqs``, which is also ``max_ongoing_requests``), so a
            replica is added before batches are full and requests start to queue.
        upscale_delay_s / downscale_delay_s: how long the load must stay above / below target
            before Serve adds / removes a replica. Downscaling is slow (10 min) because a removed
            replica takes its prefix cache with it.
        max_ongoing_requests: requests one replica holds at once; ``None`` = ``max_num_seqs``
            (beyond its batch, requests wait in the router, where they can still go anywhere).
        max_queued_requests: requests the ingress may queue for the replicas; beyond → 429
            (``-1``: no limit; ``None``: the engine's ``max_waiting``).
        router: a name in ``stencil.service.cluster.routers.ROUTERS``: "affinity" (default),
            "round_robin", "pow2" (Serve's default) or "ray_prefix" (Ray's
            PrefixCacheAffinityRouter).
        router_kwargs: the router's settings (for "affinity": ``AffinityConfig`` fields).
        routing_stats_period_s: how often Serve collects ``record_routing_stats``.
        replica_cpus / replica_gpus: Ray resources of one replica (one GPU each on a GPU
            cluster: Ray places one replica per GPU, across nodes).
        ingress_replicas: Litestar ingress replicas (stateless; more for many clients).
        ingress_max_ongoing: concurrent requests one ingress replica serves.
        health_check_period_s: Serve's ``check_health`` period for replicas.
        graceful_shutdown_s: how long a stopping replica lets its requests finish.
        app_name: the Serve application's name.
        settings: the ingress's retry and timeout settings.
    """

    replicas: int = 2
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    max_ongoing_requests: int | None = None
    max_queued_requests: int | None = None
    router: str = "affinity"
    router_kwargs: dict[str, Any] = field(default_factory=dict)
    routing_stats_period_s: float = 1.0
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    ingress_replicas: int = 1
    ingress_max_ongoing: int = 1024
    health_check_period_s: float = 2.0
    graceful_shutdown_s: float = 30.0
    app_name: str = "stencil"
    settings: ClusterSettings = field(default_factory=ClusterSettings)

    def validate(self) -> "ClusterOptions":
        """Check ranges; return self.

        Raises:
            stencil.engine.config.ConfigError: naming the field.
        """
        if self.replicas < 1:
            raise ConfigError(f"replicas must be >= 1, got {self.replicas}")
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ConfigError(f"max_replicas ({self.max_replicas}) must be >= replicas ({self.replicas})")
        if self.router not in ROUTERS:
            raise ConfigError(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        for name in ("routing_stats_period_s", "health_check_period_s", "ingress_max_ongoing", "ingress_replicas"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.replica_cpus < 0 or self.replica_gpus < 0:
            raise ConfigError("replica_cpus and replica_gpus must be >= 0")
        return self


class StencilIngress:
    """The Litestar app of ``stencil.service.app``, built on the ingress replica over a ``ClusterEngine``.

    Serve calls ``__serve_build_asgi_app__`` on the replica after ``__init__`` (``build_app``
    wraps this class with ``serve.ingress()``), so the tokenizer loads there, not in the driver.

    Args:
        replicas: the ``DeploymentHandle`` of the engine replicas.
        engine_config: their engine configuration (the tokenizer comes from its ``model``).
        service_config: the HTTP service's limits.
        settings: retries and timeouts towards the replicas.
    """

    def __init__(self, replicas, engine_config: EngineConfig, service_config: ServiceConfig,
                 settings: ClusterSettings):
        self._replicas = replicas
        self._engine_config = engine_config
        self._service_config = service_config
        self._settings = settings

    def __serve_build_asgi_app__(self):
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import BackPressureError, ReplicaUnavailableError

        from stencil.service.app import create_app

        stream = self._replicas.options(stream=True, method_name="generate")
        timeout = self._settings.stats_timeout_s

        def call(request):
            return stream.remote(request)

        def broadcast(method: str):
            return self._replicas.broadcast(method).results_async(timeout_s=timeout, return_exceptions=True)

        cluster = ClusterEngine(self._engine_config, call, broadcast,
                                retry_on=(RayActorError, ReplicaUnavailableError),
                                overload_on=(BackPressureError,), settings=self._settings)
        self._app = create_app(cluster, self._service_config)
        return self._app

    def drain(self) -> int:
        """Refuse new generation requests from now on (503 ``draining``); return how many are
        still in flight here (``serve_cluster`` calls it on SIGTERM until it reads 0)."""
        from stencil.service.state import service_state

        state = service_state(self._app)
        if state is None:
            return 0
        state.draining = True
        return state.inflight


def build_app(engine_config: EngineConfig, service_config: ServiceConfig | None = None,
              options: ClusterOptions | None = None):
    """The Serve ``Application`` (pass it to ``serve.run``).

    Args:
        engine_config: every replica's engine configuration (the model directory must exist on
            every node: same path, or shared storage).
        service_config: the ingress's limits (API key, caps, timeouts).
        options: deployment, routing and scaling (``ClusterOptions``).

    Raises:
        RuntimeError: Ray Serve is not installed (the message says how to install it).
        stencil.engine.config.ConfigError: a bad option, naming it.
    """
    require_ray()
    from ray import serve
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig

    opts = (options or ClusterOptions()).validate()
    engine_config = engine_config.validate()
    scfg = (service_config or ServiceConfig()).validate()
    opts.settings.block_size = engine_config.block_size
    capacity = engine_config.max_num_seqs
    max_ongoing = opts.max_ongoing_requests or capacity
    queued = opts.max_queued_requests if opts.max_queued_requests is not None else engine_config.max_waiting
    scaling: dict[str, Any]
    if opts.max_replicas is not None and opts.max_replicas > opts.replicas:
        scaling = {"autoscaling_config": AutoscalingConfig(
            min_replicas=opts.replicas, max_replicas=opts.max_replicas,
            target_ongoing_requests=opts.target_ongoing_requests or max(1.0, 0.8 * max_ongoing),
            upscale_delay_s=opts.upscale_delay_s, downscale_delay_s=opts.downscale_delay_s)}
    else:
        scaling = {"num_replicas": opts.replicas}
    replica = serve.deployment(EngineReplica, name="EngineReplica").options(
        max_ongoing_requests=max_ongoing, max_queued_requests=queued,
        ray_actor_options={"num_cpus": opts.replica_cpus, "num_gpus": opts.replica_gpus},
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTERS[opts.router], request_router_kwargs=dict(opts.router_kwargs),
            request_routing_stats_period_s=opts.routing_stats_period_s),
        health_check_period_s=opts.health_check_period_s,
        graceful_shutdown_timeout_s=opts.graceful_shutdown_s, **scaling)
    ingress = serve.deployment(serve.ingress()(StencilIngress), name="StencilIngress").options(
        num_replicas=opts.ingress_replicas, max_ongoing_requests=opts.ingress_max_ongoing,
        ray_actor_options={"num_cpus": 0}, graceful_shutdown_timeout_s=opts.graceful_shutdown_s)
    return ingress.bind(replica.bind(engine_config), engine_config, scfg, opts.settings)


def start_local_ray(num_cpus: float | None = None, temp_dir: str | None = None) -> None:
    """``ray.init`` for this process: join ``$RAY_ADDRESS`` if set, else start a local Ray
    (no dashboard, a 256 MiB object store: only small messages travel)."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Serve's controller kills a proxy actor not ready within 5 s (its default ready check) and
    # starts another; on a machine whose cores are busy every new proxy took longer to import,
    # so serve.start failed three times over (a fresh-clone test run under load). The actors
    # of a local Ray inherit this environment.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "30")
    # Ray starts its worker processes (every replica and the proxy) at niceness 15: beside any
    # other busy process on the node they got almost no CPU (seen as replicas and proxies at
    # "RN" under two busy loops, a cluster test taking 20 min instead of 2). Serving is the
    # node's foreground work, so a local Ray runs its workers at the normal priority.
    os.environ.setdefault("RAY_worker_niceness", "0")
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        return
    kwargs: dict[str, Any] = {"include_dashboard": False, "object_store_memory": 256 << 20,
                              "log_to_driver": False}
    if num_cpus is not None:
        kwargs["num_cpus"] = num_cpus
    if temp_dir is not None:
        kwargs["_temp_dir"] = temp_dir
    ray.init(**kwargs)


def start_serve(host: str, port: int, attempts: int = 3) -> int:
    """``serve.start`` on ``host:port``, tried up to ``attempts`` times; returns the attempts used.

    On a machine whose cores are busy, Serve's proxy actor was seen to die while it started
    (``ActorDiedError`` from ``serve.start``, a fresh-clone test run under load): the controller
    had killed it for missing its 5 s ready check, which ``start_local_ray`` now lengthens. Serve
    is shut down and started again after a pause. Any other error, or the last attempt's, is raised.
    """
    from ray import exceptions as ray_errors
    from ray import serve

    for attempt in range(1, attempts + 1):
        try:
            serve.start(http_options={"host": host, "port": port})
            return attempt
        except (ray_errors.RayActorError, ray_errors.GetTimeoutError) as e:
            if attempt == attempts:
                raise
            log.warning("Serve did not start (attempt %d of %d: %s); starting it again",
                        attempt, attempts, type(e).__name__)
            try:
                serve.shutdown()
            except Exception:  # noqa: BLE001 - nothing to shut down is fine
                pass
            time.sleep(2.0 * attempt)
    return attempts


def _drain(ingress, grace_s: float, quiet_s: float = 2.0, clock=time.monotonic, sleep=time.sleep) -> None:
    """Make every ingress replica refuse new requests, then wait (at most ``grace_s`` seconds)
    until none has had a request in flight for ``quiet_s`` seconds in a row.

    Serve's own shutdown would close the proxy's connections. The quiet period covers a request
    the proxy accepted before the signal but had not handed to an ingress yet: the ingress counts
    it only once it arrives (on a loaded machine that hop was seen to take seconds, and a drain
    that stopped at the first zero cut such a request off without a response). ``clock`` and
    ``sleep`` are injectable for tests.
    """
    deadline = clock() + grace_s
    quiet_since = None
    while True:
        answers = ingress.broadcast("drain").results(timeout_s=5, return_exceptions=True)
        inflight = sum(a for a in answers if isinstance(a, int))
        now = clock()
        if inflight == 0:
            quiet_since = now if quiet_since is None else quiet_since
            if now - quiet_since >= quiet_s:
                return
        else:
            quiet_since = None
        if now >= deadline:
            if inflight:
                log.warning("shutdown: %d requests still in flight after %.0f s", inflight, grace_s)
            return
        sleep(0.2)


def serve_cluster(engine_config: EngineConfig, service_config: ServiceConfig, options: ClusterOptions,
                  host: str = "127.0.0.1", port: int = 8000) -> int:
    """Run the cluster app until SIGTERM / SIGINT; return the exit status (0 after a drain).

    On a stop signal the ingress refuses new generation requests (503 ``draining``) and the
    requests in flight finish, for up to ``options.graceful_shutdown_s``; then Serve stops the
    application and Ray stops (a joined cluster keeps running, without the application).

    Raises:
        RuntimeError: Ray Serve is not installed.
    """
    require_ray()
    import ray
    from ray import serve

    opts = options.validate()
    cpus = max(os.cpu_count() or 1, opts.replicas * opts.replica_cpus)
    if opts.max_replicas:
        cpus = max(cpus, opts.max_replicas * opts.replica_cpus)
    start_local_ray(num_cpus=cpus)
    log.warning("Ray opens ports on all interfaces (replica gRPC servers bind [::]); "
                "run it in a private network or namespace")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        start_serve(host, port)
        serve.run(build_app(engine_config, service_config, opts), name=opts.app_name, route_prefix="/",
                  blocking=False)
        log.info("serving %d replica(s) on http://%s:%d", opts.replicas, host, port)
        stop.wait()
        log.info("stopping: draining (up to %.0f s)", opts.graceful_shutdown_s)
        _drain(serve.get_app_handle(opts.app_name), opts.graceful_shutdown_s)
        if os.environ.get("RAY_ADDRESS"):
            serve.delete(opts.app_name)
        else:
            serve.shutdown()
    finally:
        ray.shutdown()
    return 0
