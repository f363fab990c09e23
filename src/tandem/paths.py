"""Where tandem keeps what it builds once: converted models, compiled kernels, cost profiles,
trained drafters and training data (TANDEM_CACHE_DIR, default ~/.cache/tandem), and where the
package keeps the drafters it ships."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("TANDEM_CACHE_DIR", Path.home() / ".cache" / "tandem"))


def shipped_dir() -> Path:
    """Where the package keeps the drafters it ships: <model>/<method>/ (trained heads, the
    suffix corpus)."""
    return Path(__file__).resolve().parent / "drafters" / "shipped"
