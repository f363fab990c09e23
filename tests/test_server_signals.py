"""SIGTERM: the server stops accepting, lets in-flight requests finish within the drain timeout,
cuts what is still running after it, and exits. Runs a real server process on a tiny model."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

DRAIN_S = 5.0
SERVER = """
import sys
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)
from conftest import tiny_loaded
from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.launch_server import run_uvicorn
from tandem.server.app import build_app
from tandem.server.async_engine import AsyncEngine
from tandem.server.metrics import ServerMetrics

_, loaded = tiny_loaded("llama")
engine = Engine(loaded, EngineConfig(max_model_len=8192, max_num_seqs=4))
app = build_app(AsyncEngine(engine, 8, ServerMetrics("tiny")), "tiny")
run_uvicorn(app, "127.0.0.1", {port}, {drain}, log_level="warning")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_into(url: str, body: dict, out: dict) -> None:
    """Read a streamed completion; record its events and whether it ended cleanly."""
    out["events"] = []
    try:
        with httpx.stream("POST", url, json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out["events"].append(line[6:])
        out["complete"] = True
    except httpx.HTTPError as err:
        out["complete"], out["error"] = False, repr(err)


def test_sigterm_drains_then_exits(tmp_path):
    port = free_port()
    script = SERVER.format(tests=str(Path(__file__).parent), port=port, drain=DRAIN_S)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        short, long = {}, {}
        url = f"{base}/v1/completions"
        body = {"prompt": [5, 6, 7], "temperature": 0, "ignore_eos": True, "stream": True}
        threads = [threading.Thread(target=stream_into, args=(url, {**body, "max_tokens": 8000}, long)),
                   threading.Thread(target=stream_into, args=(url, {**body, "max_tokens": 20}, short))]
        for t in threads:
            t.start()
        while len(long.get("events", [])) < 2 or len(short.get("events", [])) < 1:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # the listening socket is closed at once
            httpx.post(url, json={**body, "stream": False, "max_tokens": 2}, timeout=5)
        for t in threads:
            t.join(timeout=60)
        rc = proc.wait(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # The short request drained to its natural end ...
    assert short["complete"] and short["events"][-1] == "[DONE]"
    finishes = [json.loads(e)["choices"][0]["finish_reason"] for e in short["events"][:-1]]
    assert finishes[-1] == "length"
    # ... the long one was cut when the drain timeout ran out, and the process exited soon after.
    assert "[DONE]" not in long["events"]
    assert DRAIN_S - 0.5 <= elapsed < DRAIN_S + 30
    assert rc == 0  # a drained shutdown is a clean exit
    log = proc.stdout.read().decode()
    assert "Exception in ASGI application" not in log, log  # the cut stream's cancellation is no traceback
