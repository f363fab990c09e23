"""`tandem bench soak`, shortened, against a real `tandem serve` of the bundled model: mixed
requests with cancellations, nothing left running or reserved, and a SIGTERM that drains what is
in flight and exits 0. (Slow: it launches the server; the full 1,000-request soak is the command.)"""

from __future__ import annotations

import json

import pytest

from tandem.cli import main

pytestmark = pytest.mark.slow


def test_a_short_soak_leaves_nothing_behind_and_drains_on_sigterm(tmp_path):
    out = tmp_path / "soak.json"
    rc = main(["bench", "soak", "--requests", "40", "--concurrency", "6", "--cancel-share", "0.25",
               "--drain-requests", "3", "--out", str(out)])
    report = json.loads(out.read_text())["soak"]
    assert report["requests"] == 40 and report["cancelled"] > 0
    assert report["errors"] == []
    assert report["running_after"] == 0 and report["reserved_after"] == 0
    assert report["drained"] == report["drain_in_flight"] == 3
    assert report["exit_code"] == 0
    # 40 requests never reach the 100th: the memory check is skipped, not failed, and the rest pass.
    assert report["checks"].pop("RSS growth from request 100 to the end <= 5%") is None
    assert all(report["checks"].values())
    assert rc == 0
