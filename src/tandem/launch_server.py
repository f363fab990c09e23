"""`python -m tandem.launch_server` (= `tandem serve`): load a target and drafter, measure or load
its cost curve, and serve the OpenAI API with uvicorn.

    python -m tandem.launch_server --model-path smollm2-135m-instruct --speculative-algorithm suffix \\
        --speculative-num-draft-tokens 4 --host 127.0.0.1 --port 8000 --max-running-requests 64
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn

from tandem.config import EngineConfig, ServerConfig
from tandem.drafters.heads.serving import check_head_available
from tandem.engine.engine import Engine
from tandem.flags import add_model_args, add_spec_args, flag_message, spec_from_args
from tandem.llm import configure_threads
from tandem.model.catalogue import DEFAULT_DRAFTERS, builtin_name
from tandem.model.loader import load_model, return_freed_memory
from tandem.scheduler.profile import cost_curve_for
from tandem.server.app import build_app
from tandem.server.async_engine import AsyncEngine
from tandem.server.connections import guarded_protocol
from tandem.server.metrics import ServerMetrics

# The server adapts draft lengths to load by default (a drafter may name its own scheduler:
# Drafter.serving_policy); the library keeps SpecConfig's "fixed" (what you configure is what
# runs) because a policy without a measured cost curve cannot adapt.
SERVE_POLICY = "adaptive"
# 64 requests decode together by default: the KV cache commits memory only for the tokens they
# hold (model/kv_cache.py), so the rows cost nothing until used. With 32, a burst of 32 beside a
# few running streams queued its last prompts behind whole answers (docs/serving.md).
SERVE_MAX_RUNNING_REQUESTS = 64
API_KEY_ENV = "TANDEM_API_KEY"  # as vLLM's VLLM_API_KEY: the key without putting it on the command line


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_spec_args(p, algorithm_help="drafter name; default: the model's default drafter (DEFAULT_DRAFTERS); "
                                    "none: plain decoding")
    p.add_argument("--host", default=ServerConfig.host)
    p.add_argument("--port", type=int, default=ServerConfig.port)
    p.add_argument("--max-running-requests", "--max-num-seqs", type=int, default=SERVE_MAX_RUNNING_REQUESTS,
                   help="requests decoded together (KV cache rows)")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV slots all running requests may hold together (default: every row full, capped by "
                        "--mem-fraction-static; a larger value is every row full, one past the memory a warning)")
    p.add_argument("--chunked-prefill-size", type=int, default=EngineConfig.chunked_prefill_size,
                   help="prompt tokens prefilled per step while other requests decode (0: whole prompts)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=EngineConfig.enable_prefix_caching,
                   help="keep finished requests' KV rows and reuse the longest matching prompt prefix")
    p.add_argument("--disable-radix-cache", dest="enable_prefix_caching", action="store_false",
                   help="SGLang's spelling of --no-enable-prefix-caching")
    p.add_argument("--mem-fraction-static", "--gpu-memory-utilization", type=float,
                   default=EngineConfig.mem_fraction_static,
                   help="the share of the memory available at startup the KV cache may take")
    p.add_argument("--max-queued-requests", type=int, default=ServerConfig.max_queued_requests,
                   help="requests waiting for a running slot before new ones get 503")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    p.add_argument("--drain-timeout", type=float, default=ServerConfig.drain_timeout_s,
                   help="seconds in-flight requests may finish after SIGTERM")
    p.add_argument("--cost-profile", default=None,
                   help="forward cost curve JSON for the adaptive policy (default: measured once, cached)")
    p.add_argument("--reprofile", action="store_true", help="measure the cost curve again")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer <key>' on every route but /health and the playground page "
                        f"/ (default: ${API_KEY_ENV})")
    p.add_argument("--max-request-bytes", type=int, default=ServerConfig.max_request_bytes,
                   help="larger request bodies get 413 without being read")
    p.add_argument("--max-request-header-bytes", type=int, default=ServerConfig.max_request_header_bytes,
                   help="larger request headers get 431 (default 64 KiB)")
    p.add_argument("--request-read-timeout", type=float, default=ServerConfig.request_read_timeout_s,
                   help="seconds a request's headers may take, or its body stop arriving, before it gets 408 "
                        "(default 60)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    replicas = p.add_argument_group("replicas on Ray Serve (an optional extra: pip install 'tandem[ray]'; "
                                    "docs/serving.md)")
    replicas.add_argument("--replicas", type=int, default=None,
                          help="serve N engines behind Ray Serve's route (the starting count when autoscaling); "
                               "their --threads default to cores / replicas")
    replicas.add_argument("--min-replicas", type=int, default=None,
                          help="autoscale on Ray Serve from this many replicas")
    replicas.add_argument("--max-replicas", type=int, default=None, help="... up to this many")
    replicas.add_argument("--ray-address", default=None,
                          help="the Ray cluster to serve on ('auto': the one `ray start` joined this machine to; "
                               "default: start a Ray here)")


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    try:
        return _configs_from_args(args)
    except (ValueError, TypeError) as err:
        raise type(err)(flag_message(str(err))) from None


def _configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    algorithm = args.speculative_algorithm
    if algorithm is None:
        algorithm = DEFAULT_DRAFTERS.get(builtin_name(args.model))
    spec = spec_from_args(args, algorithm, SERVE_POLICY)  # none / off: plain decoding
    engine = EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, quantization=args.quantization,
        max_model_len=args.max_model_len, max_num_seqs=args.max_running_requests, threads=args.threads, spec=spec,
        kv_cache_dtype=args.kv_cache_dtype, max_total_tokens=args.max_total_tokens,
        mem_fraction_static=args.mem_fraction_static, chunked_prefill_size=args.chunked_prefill_size,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    server = ServerConfig(
        host=args.host, port=args.port, max_queued_requests=args.max_queued_requests,
        served_model_name=args.served_model_name, drain_timeout_s=args.drain_timeout,
        cost_profile=args.cost_profile, reprofile=args.reprofile,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None, max_request_bytes=args.max_request_bytes,
        request_read_timeout_s=args.request_read_timeout, max_request_header_bytes=args.max_request_header_bytes,
    )
    return engine, server


def server_threads(requested: int | None) -> int:
    """The kernels' threads in a server: `--threads`, else every core but one. The HTTP event loop
    streams every token on a core of its own; when it had to preempt a kernel thread, every
    parallel region waited for that thread (2-core AMD EPYC, `tandem bench serve`, 1 / 4 / 8 / 32
    users: 1 thread 159 / 55 / 34 / 16 tok/s per user, 2 threads 53 / 25 / 20 / 13)."""
    if requested:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores - 1)


def build_server_app(engine_config: EngineConfig, server_config: ServerConfig,
                     metrics: Callable[[str], ServerMetrics] = ServerMetrics):
    """Load everything the server needs and return the FastAPI app (engine thread not started;
    `app.state.async_engine` is its engine). metrics: builds the metrics from the served name."""
    threads = configure_threads(server_threads(engine_config.threads))
    loaded = load_model(engine_config.model, dtype=engine_config.dtype, quantization=engine_config.quantization,
                        device=engine_config.device, kv_cache_dtype=engine_config.kv_cache_dtype)
    spec = engine_config.spec
    check_head_available(spec, loaded.name)  # before the cost profile, which takes seconds
    curve = None
    if spec.algorithm and spec.needs_cost_curve:
        curve = cost_curve_for(loaded, engine_config.device, threads, server_config.cost_profile,
                               server_config.reprofile)
    engine = Engine(loaded, engine_config, cost_curve=curve)
    return_freed_memory()  # what the cost profile's measurement allocated
    # As in LLM: keep the cyclic GC from rescanning the loaded model mid-decoding.
    gc.freeze()
    name = server_config.served_model_name or engine_config.model
    async_engine = AsyncEngine(engine, server_config.max_queued_requests, metrics(name))
    app = build_app(async_engine, name, api_key=server_config.api_key,
                    max_request_bytes=server_config.max_request_bytes,
                    request_read_timeout_s=server_config.request_read_timeout_s,
                    max_request_header_bytes=server_config.max_request_header_bytes)
    app.state.async_engine = async_engine
    app.state.memory_summary = memory_summary(loaded, engine)
    return app


def memory_summary(loaded, engine: Engine) -> str:
    """What the startup line says about memory: the weights, the KV cache's budget and the RSS."""
    cache = engine.cache
    weights = sum(t.numel() * t.element_size() for t in (*loaded.model.parameters(), *loaded.model.buffers()))
    budget = engine.admission.max_total_tokens
    return (f"memory: weights {weights / 1e6:.0f} MB; KV cache up to {budget} tokens = "
            f"{budget * cache.bytes_per_token / 1e6:.0f} MB ({cache.bytes_per_token / 1e3:.1f} KB per token, "
            f"{cache.max_seqs} rows of {cache.max_len}; committed as requests write it, "
            f"{cache.tokens_held * cache.bytes_per_token / 1e6:.0f} MB now); process RSS {resident_bytes() / 1e6:.0f} MB")


def resident_bytes(pid: int | str = "self") -> int:
    """A process's resident memory (VmRSS; this one by default), 0 where /proc does not say."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def check_listenable(host: str, port: int) -> None:
    """Refuse, before the model loads, an address the server could not listen on (a host that
    does not resolve, a port in use): a ValueError naming it."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as err:
        raise ValueError(f"--host {host!r} is not an address to listen on: {err.strerror}") from err
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as err:
            raise ValueError(f"cannot listen on {host}:{port}: {err.strerror}") from err


def serve(engine_config: EngineConfig, server_config: ServerConfig, log_level: str = "info") -> int:
    check_listenable(server_config.host, server_config.port)
    app = build_server_app(engine_config, server_config)
    spec = engine_config.spec
    where = (f"http://{server_config.host}:{server_config.port}/v1" if server_config.port
             else f"a free port of {server_config.host} (uvicorn names it below)")
    print(f"tandem serving {engine_config.model} on {where} "
          f"(speculation: {spec.algorithm or 'off'}"
          f"{f', policy {spec.policy}, {spec.describe()}' if spec.algorithm else ''})",
          flush=True)
    print(app.state.memory_summary, flush=True)
    run_uvicorn(app, server_config.host, server_config.port, server_config.drain_timeout_s, log_level,
                server_config.request_read_timeout_s, server_config.max_request_header_bytes)
    return 0


def run_uvicorn(app, host: str, port: int, drain_timeout_s: float, log_level: str = "info",
                read_timeout_s: float = ServerConfig.request_read_timeout_s,
                max_header_bytes: int = ServerConfig.max_request_header_bytes) -> None:
    """Serve `app` until SIGTERM/SIGINT; on SIGTERM in-flight requests get `drain_timeout_s` to
    finish. uvicorn then raises the signal again with the handler it found: a no-op one here, so a
    drained shutdown returns (the process exits 0) instead of dying of the signal. A request's
    headers get read_timeout_s to arrive and max_header_bytes of room (connections.py)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=drain_timeout_s,
                            http=guarded_protocol(read_timeout_s, max_header_bytes))
    logging.getLogger("uvicorn.error").addFilter(_quiet_drain_cancellations)  # after Config set logging up
    server = uvicorn.Server(config)
    try:
        server.run()
    except KeyboardInterrupt:  # as uvicorn.run: a second Ctrl-C ends the drain
        pass
    if not server.started:  # uvicorn logged why (a port taken meanwhile, ...)
        raise SystemExit(3)


def _quiet_drain_cancellations(record: logging.LogRecord) -> bool:
    """Drop uvicorn's traceback for each stream the drain timeout cancels (CancelledError): its
    own line "Cancel N running task(s)" already says so, and N tracebacks of the same
    cancellation bury it."""
    return not (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))


def run_serve(args: argparse.Namespace) -> int:
    engine_config, server_config = configs_from_args(args)
    if uses_ray(args):
        try:
            from tandem.server.ray_serve import serve_replicas  # lazy: Ray is an optional extra
        except ImportError as err:
            raise ValueError("replicas run on Ray Serve, an optional extra: "
                             f"pip install 'tandem[ray]' ({err})") from err
        return serve_replicas(args, engine_config, server_config, build_server_app)
    return serve(engine_config, server_config, args.log_level)


def uses_ray(args: argparse.Namespace) -> bool:
    """Whether the flags ask for replicas on Ray Serve rather than one in-process server."""
    return any(flag is not None for flag in (args.replicas, args.min_replicas, args.max_replicas, args.ray_address))


@dataclass
class BackgroundServer:
    """A uvicorn server on a thread of this process (tests, notebooks): `url` ends in /v1."""

    server: object
    thread: threading.Thread
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def serve_in_background(app, host: str = "127.0.0.1", port: int = 0, drain_timeout_s: float = 5.0,
                        read_timeout_s: float = ServerConfig.request_read_timeout_s,
                        max_header_bytes: int = ServerConfig.max_request_header_bytes) -> BackgroundServer:
    """Start `app` on host:port (0 = a free port) and return once it accepts connections."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           timeout_graceful_shutdown=drain_timeout_s,
                                           http=guarded_protocol(read_timeout_s, max_header_bytes)))
    thread = threading.Thread(target=server.run, name="tandem-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return BackgroundServer(server, thread, host, port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.launch_server", description="tandem's OpenAI-compatible server")
    parser.add_argument("-v", "--verbose", action="store_true")
    add_serve_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run_serve(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"tandem serve: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
