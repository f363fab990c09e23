"""The benchmarks' `tandem serve` processes and their client: start one on a free loopback port
and wait for /health, stop it with SIGTERM, read its resident memory, stream a chat completion's
events from it; and write a report as JSON."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

from tandem.launch_server import resident_bytes

HEALTHY_WITHIN_S = 900


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, server_args: list[str], log_path: Path, label: str) -> tuple[subprocess.Popen, str]:
    """`python -m tandem.launch_server --model MODEL ...server_args` on a free loopback port, its
    output in `log_path`; returns the process and its base URL (ending in /v1) once /health answers."""
    import httpx  # lazy: ~0.2 s to import; only the benchmarks' clients need it

    port = free_port()
    cmd = [sys.executable, "-m", "tandem.launch_server", "--model", model, "--port", str(port),
           "--log-level", "warning", *server_args]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + HEALTHY_WITHIN_S
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the {label} server exited with {proc.returncode}; see {log_path}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return proc, f"{url}/v1"
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the {label} server did not become healthy in {HEALTHY_WITHIN_S} s; see {log_path}")
    except BaseException:  # not healthy, or interrupted while starting: nothing is left running
        if proc.poll() is None:
            stop_server(proc)
        raise


def start_with_flags(flags: str, model: str, log_path: Path) -> tuple[subprocess.Popen, str]:
    """`tandem serve FLAGS` (a shell-quoted string; '' = the defaults)."""
    return start_server(model, shlex.split(flags), log_path, f"`tandem serve {flags}`" if flags else "`tandem serve`")


def api_base(url: str) -> str:
    """A server's API base as the clients here take it (ending in /v1): `http://host:port`,
    `http://host:port/` and `http://host:port/v1` all name the same one."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def resident_mb(pid: int) -> float | None:
    return resident_bytes(pid) / 2**20 or None


class ServerError(Exception):
    """The server answered a request with an error status."""


async def chat_events(http, url: str, body: dict) -> AsyncIterator[dict]:
    """POST a streamed chat completion to `url` (ending in /v1) with `http` (an httpx.AsyncClient);
    yields each server-sent event's JSON as it arrives ([DONE] ends it). Close the iterator
    (contextlib.aclosing) to leave a stream early: that closes the connection, which the server
    takes as a cancellation."""
    async with http.stream("POST", f"{url}/chat/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise ServerError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                yield json.loads(line[6:])


def event_text(event: dict) -> str:
    """The text a chat-completion chunk adds (its choices' delta contents)."""
    return "".join(c.get("delta", {}).get("content") or "" for c in event.get("choices", []))


def write_report(report: dict, out: str) -> None:
    """The report as JSON at `out` ('' = nowhere)."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2))
        print(f"wrote {out}")
