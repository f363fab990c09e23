"""The benchmarks' `tandem serve` processes: start one on a free loopback port and wait for
/health, stop it with SIGTERM, read its resident memory; and write a report as JSON."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
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
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the {label} server exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, f"{url}/v1"
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the {label} server did not become healthy in {HEALTHY_WITHIN_S} s; see {log_path}")


def start_with_flags(flags: str, model: str, log_path: Path) -> tuple[subprocess.Popen, str]:
    """`tandem serve FLAGS` (a shell-quoted string; '' = the defaults)."""
    return start_server(model, shlex.split(flags), log_path, f"`tandem serve {flags}`" if flags else "`tandem serve`")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def resident_mb(pid: int) -> float | None:
    return resident_bytes(pid) / 2**20 or None


def write_report(report: dict, out: str) -> None:
    """The report as JSON at `out` ('' = nowhere)."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2))
        print(f"wrote {out}")
