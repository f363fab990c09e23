"""`tandem serve --replicas N`: tandem engines as Ray Serve replicas behind one OpenAI route.

Every replica builds the app `tandem serve` builds (the builder the caller passes in,
launch_server.build_server_app, so this module never imports the launcher that imports it: the same
routes, error bodies, guard and engine thread; the app's own lifespan starts the engine, and Ray
Serve runs that lifespan on the replica's event loop) from the same flags. Ray Serve provides the
HTTP proxy and route, health checks (`TandemReplica.check_health`: the engine thread runs),
restarts and autoscaling. This module adds:

- placement: each replica's kernels get `--threads` threads (default: this machine's cores /
  the most replicas) and reserve as many Ray CPUs;
- one cost profile: the driver measures (or loads) the adaptive policy's cost curve once, before
  any replica starts, and hands its JSON to every replica, so no two replicas profile side by
  side on shared cores;
- session affinity (SessionAffinityRouter): requests with the same session id (Ray Serve's
  session header, `X-Session-Id`) go to the same replica, the one holding that conversation's
  prefix cache; requests without one go to the less loaded of two random replicas;
- one /metrics: each replica shares its Prometheus text through a MetricsBoard actor every
  METRICS_SHARE_S and answers /metrics with the series of every live replica, each sample
  labelled `replica`; a replica that stops sharing drops out after METRICS_TTL_S;
- `X-Tandem-Replica` on every response: the replica that answered.

Ray is an optional extra (`pip install 'tandem[ray]'`): no other tandem module imports it, and
`tandem serve` imports this module only when it is asked for replicas (launch_server.run_serve).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import logging
import os
import random
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ray
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import RayServeException
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from tandem.config import EngineConfig, ServerConfig
from tandem.llm import configure_threads
from tandem.model.loader import load_model, return_freed_memory
from tandem.scheduler.profile import cost_curve_for, default_profile_path
from tandem.server.metrics import ServerMetrics

log = logging.getLogger("tandem.server")

APP_NAME = "tandem"
REPLICA_HEADER = "X-Tandem-Replica"
METRICS_SHARE_S = 1.0
# A replica whose text is older than this is gone (killed, scaled down): its series leave /metrics.
METRICS_TTL_S = 10.0
# How a replica builds `tandem serve`'s app: launch_server.build_server_app(engine_config,
# server_config, metrics=...).
AppBuilder = Callable[..., Any]


# ---- the plan: how many replicas, what each gets ---------------------------------------------


def local_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass(frozen=True)
class ReplicaPlan:
    """`replicas` engines (the starting count when autoscaling between `min_replicas` and
    `max_replicas`), each running its kernels on `threads` threads and reserving as many Ray CPUs."""

    replicas: int
    threads: int
    min_replicas: int | None = None
    max_replicas: int | None = None

    @property
    def most_replicas(self) -> int:
        return self.max_replicas if self.max_replicas is not None else self.replicas

    def describe(self) -> str:
        count = (f"{self.replicas} replicas (autoscaling {self.min_replicas}-{self.max_replicas})"
                 if self.max_replicas is not None else f"{self.replicas} replica{'s' * (self.replicas != 1)}")
        return f"{count}, {self.threads} kernel thread{'s' * (self.threads != 1)} each"

    def deployment_options(self, engine_config: EngineConfig, server_config: ServerConfig) -> dict:
        """Ray Serve's options for the deployment: a replica takes as many requests at once as the
        engine has running slots (Ray queues the rest, up to --max-queued-requests, before it
        answers 503), drains for --drain-timeout, and is routed to by SessionAffinityRouter."""
        options = dict(
            ray_actor_options={"num_cpus": self.threads},
            max_ongoing_requests=engine_config.max_num_seqs,
            max_queued_requests=server_config.max_queued_requests,
            graceful_shutdown_timeout_s=server_config.drain_timeout_s,
            request_router_config=RequestRouterConfig(request_router_class=SessionAffinityRouter),
        )
        if self.max_replicas is None:
            options["num_replicas"] = self.replicas
        else:
            # Ray adds replicas while the mean replica holds more than half its running slots.
            options["autoscaling_config"] = {
                "min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "initial_replicas": self.replicas, "target_ongoing_requests": max(1, engine_config.max_num_seqs // 2),
            }
        return options


def replica_plan(replicas: int | None, min_replicas: int | None, max_replicas: int | None, threads: int | None,
                 cores: int) -> ReplicaPlan:
    """The plan the flags ask for: `--replicas N` alone is a fixed count; `--min-replicas A
    --max-replicas B` autoscale, starting at --replicas (default A, at least 1). Threads default
    to cores / the most replicas (at least 1), so the replicas share this machine's cores."""
    if (min_replicas is None) != (max_replicas is None):
        raise ValueError("--min-replicas and --max-replicas go together (the autoscaling bounds)")
    if max_replicas is not None:
        if not 0 <= min_replicas <= max_replicas or max_replicas < 1:
            raise ValueError(f"autoscaling needs 0 <= --min-replicas <= --max-replicas and --max-replicas >= 1, "
                             f"got {min_replicas} and {max_replicas}")
        start = replicas if replicas is not None else max(min_replicas, 1)
        if not min_replicas <= start <= max_replicas:
            raise ValueError(f"--replicas {start} (the starting count) is outside {min_replicas}-{max_replicas}")
    else:
        start = 1 if replicas is None else replicas
        if start < 1:
            raise ValueError(f"--replicas must be at least 1, got {start}")
    most = max_replicas if max_replicas is not None else start
    return ReplicaPlan(start, threads or max(1, cores // most), min_replicas, max_replicas)


def shared_cost_profile(engine_config: EngineConfig, server_config: ServerConfig) -> str | None:
    """The adaptive policy's cost curve as JSON, measured here (or loaded from --cost-profile or
    the cache) once before any replica starts, on the replicas' thread count; None when the
    speculation policy prices nothing. Replicas load this text instead of profiling."""
    spec = engine_config.spec
    if not (spec.algorithm and spec.needs_cost_curve):
        return None
    threads = configure_threads(engine_config.threads)
    loaded = load_model(engine_config.model, dtype=engine_config.dtype, quantization=engine_config.quantization,
                        device=engine_config.device, kv_cache_dtype=engine_config.kv_cache_dtype)
    path = Path(server_config.cost_profile or default_profile_path(loaded, engine_config.device, threads))
    cost_curve_for(loaded, engine_config.device, threads, str(path), server_config.reprofile)
    del loaded
    return_freed_memory()
    return path.read_text()


# ---- routing: session affinity ---------------------------------------------------------------


def session_rank(session: str, replica: str) -> int:
    """Rendezvous (highest random weight) hashing: a session belongs to the replica of highest
    rank, so a replica that joins or leaves moves only the sessions it wins or held."""
    digest = hashlib.blake2b(f"{session}\0{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class SessionAffinityRouter(RequestRouter):
    """Ray Serve's request router for tandem. A request with a session id (the `X-Session-Id`
    header, or the one RAY_SERVE_SESSION_ID_HEADER_KEY names; Ray's proxy reads it) goes to the
    replica that ranks first for that id, then, while that one is full, to the next in rank; a
    request without one goes to the less loaded of two random replicas (Ray's default rule)."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is None:
            return [candidate_replicas]
        # Once every rank has refused (all full), wait with backoff instead of asking again at once.
        pending_request.routing_context.should_backoff = True
        session = pending_request.metadata.session_id
        if session:
            ranked = sorted(candidate_replicas, key=lambda r: session_rank(session, r.replica_id.unique_id),
                            reverse=True)
            return [[r] for r in ranked]
        return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]


# ---- metrics: every replica on one /metrics ----------------------------------------------------


@ray.remote(num_cpus=0)
class MetricsBoard:
    """Where replicas leave their rendered Prometheus text; entries older than METRICS_TTL_S
    (a replica that died or was scaled down) are dropped."""

    def __init__(self) -> None:
        self.texts: dict[str, tuple[float, str]] = {}

    def publish(self, replica: str, text: str) -> dict[str, str]:
        """Store `replica`'s text; returns the other live replicas' texts."""
        now = time.monotonic()
        self.texts[replica] = (now, text)
        self.texts = {r: (t, x) for r, (t, x) in self.texts.items() if now - t <= METRICS_TTL_S}
        return {r: x for r, (_, x) in self.texts.items() if r != replica}


class _Families(Collector):
    """Metric families already collected, for generate_latest."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def merge_replica_metrics(texts: dict[str, str]) -> bytes:
    """Several replicas' Prometheus texts as one: each family once, every sample labelled with
    the replica it came from."""
    families: dict[str, Metric] = {}
    for replica in sorted(texts):
        for family in text_string_to_metric_families(texts[replica]):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            merged.samples += [s._replace(labels={**s.labels, "replica": replica}) for s in family.samples]
    return generate_latest(_Families(list(families.values())))


class ReplicaMetrics(ServerMetrics):
    """A replica's ServerMetrics whose /metrics shows every live replica: this one's series as they
    are now and the others' as they last shared them (`peers`, at most METRICS_SHARE_S old)."""

    def __init__(self, model_name: str, replica: str) -> None:
        super().__init__(model_name)
        self.replica = replica
        self.peers: dict[str, str] = {}

    def own_text(self) -> str:
        return super().render().decode()

    def render(self) -> bytes:
        return merge_replica_metrics({**self.peers, self.replica: self.own_text()})


# ---- the replica ------------------------------------------------------------------------------


class ReplicaHeader:
    """ASGI middleware: names the replica that answered in every HTTP response's headers."""

    def __init__(self, app, replica: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.lower().encode(), replica.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_named)


@serve.deployment(name="TandemReplica")
@serve.ingress()
class TandemReplica:
    """One tandem engine as a Ray Serve replica, serving `tandem serve`'s app. The constructor
    loads the model (the cost curve from the driver's JSON, never measured here); Ray Serve then
    runs the app's lifespan, which starts the engine thread on this replica's event loop."""

    def __init__(self, build_app: AppBuilder, engine_config: EngineConfig, server_config: ServerConfig, board,
                 cost_profile_json: str | None) -> None:
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.board = board
        with tempfile.TemporaryDirectory(prefix="tandem-replica-") as tmp:
            if cost_profile_json is not None:
                path = Path(tmp) / "cost_profile.json"
                path.write_text(cost_profile_json)
                server_config = replace(server_config, cost_profile=str(path), reprofile=False)
            # (`app` is Ray's: its ASGI wrapper serves what __serve_build_asgi_app__ returns under that name)
            self.tandem_app = build_app(engine_config, server_config,
                                        metrics=functools.partial(ReplicaMetrics, replica=self.replica))
        self.engine = self.tandem_app.state.async_engine
        self.tandem_app.add_middleware(ReplicaHeader, replica=self.replica)
        # Held here: the event loop keeps only a weak reference to a task.
        self._sharing = asyncio.get_running_loop().create_task(self._share_metrics())

    def __serve_build_asgi_app__(self):
        return self.tandem_app

    def check_health(self) -> None:
        """Ray Serve's periodic health check: a replica whose engine stopped is replaced."""
        if not self.engine.healthy:
            raise RuntimeError(f"replica {self.replica}: the tandem engine is not running")

    async def _share_metrics(self) -> None:
        metrics: ReplicaMetrics = self.engine.metrics
        while True:
            try:
                metrics.peers = await self.board.publish.remote(self.replica, metrics.own_text())
            except ray.exceptions.RayActorError:  # the driver (which owns the board) is gone
                metrics.peers = {}
            await asyncio.sleep(METRICS_SHARE_S)


# ---- the driver -------------------------------------------------------------------------------


@dataclass
class RayDeployment:
    """tandem running on Ray Serve: its OpenAI base URL (ending in /v1) and the metrics board,
    which lives as long as this object's owner holds it."""

    url: str
    board: ray.actor.ActorHandle


def deploy(build_app: AppBuilder, engine_config: EngineConfig, server_config: ServerConfig,
           plan: ReplicaPlan) -> RayDeployment:
    """On the Ray this process is connected to: measure or load the cost curve once, start Ray
    Serve's proxy on --host/--port, deploy the replicas (each builds its app with `build_app`,
    which Ray sends them by reference) and return once they all serve."""
    if server_config.port == 0:
        raise ValueError("Ray Serve's proxy needs a fixed --port")
    engine_config = replace(engine_config, threads=plan.threads)
    cost_profile_json = shared_cost_profile(engine_config, server_config)
    serve.start(http_options={"host": server_config.host, "port": server_config.port})
    board = MetricsBoard.remote()
    app = TandemReplica.options(**plan.deployment_options(engine_config, server_config)).bind(
        build_app, engine_config, server_config, board, cost_profile_json)
    serve.run(app, name=APP_NAME, route_prefix="/")
    return RayDeployment(f"http://{server_config.host}:{server_config.port}/v1", board)


def wait_for_stop_signal() -> None:
    """Block until SIGINT or SIGTERM."""
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass


def serve_replicas(args: argparse.Namespace, engine_config: EngineConfig, server_config: ServerConfig,
                   build_app: AppBuilder) -> int:
    """`tandem serve --replicas N` (or --min/--max-replicas, --ray-address), with the configs its
    flags give: join the Ray cluster at --ray-address, or start a Ray on this machine, serve until
    SIGINT/SIGTERM, then stop the application (and the Ray this started)."""
    plan = replica_plan(args.replicas, args.min_replicas, args.max_replicas, args.threads, local_cores())
    if args.ray_address:
        ray.init(address=args.ray_address)
    else:
        demand = plan.most_replicas * plan.threads
        if demand > local_cores():
            log.warning("%s ask for %d CPUs on %d cores: they will share them", plan.describe(), demand, local_cores())
        ray.init(num_cpus=max(local_cores(), demand), include_dashboard=False)
    try:
        deployment = deploy(build_app, engine_config, server_config, plan)
        spec = engine_config.spec
        print(f"tandem serving {engine_config.model} on {deployment.url} through Ray Serve: {plan.describe()} "
              f"(speculation: {spec.algorithm or 'off'}{f', policy {spec.policy}' if spec.algorithm else ''})",
              flush=True)
        wait_for_stop_signal()
    finally:
        if args.ray_address:  # the cluster's Serve (its proxies) stays, as it was found
            with contextlib.suppress(RayServeException):  # none: this failed before starting it
                serve.delete(APP_NAME)
        else:
            serve.shutdown()
        ray.shutdown()
    return 0
