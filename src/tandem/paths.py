"""Where tandem keeps what it builds once: converted models, compiled kernels, cost profiles,
trained drafters and training data (TANDEM_CACHE_DIR, default ~/.cache/tandem)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("TANDEM_CACHE_DIR", Path.home() / ".cache" / "tandem"))
