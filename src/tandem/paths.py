"""Where tandem keeps what it builds once: converted models, compiled kernels, cost profiles,
trained drafters and training data (TANDEM_CACHE_DIR, default ~/.cache/tandem), and where the
package keeps the drafters it ships."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("TANDEM_CACHE_DIR", Path.home() / ".cache" / "tandem"))


SHIPPED_DIR = Path(__file__).resolve().parent / "drafters" / "shipped"


def shipped_drafter_dir(model_name: str, method: str, marker: str) -> Path | None:
    """The directory of what the package ships for a built-in model and drafting method
    (drafters/shipped/<model>/<method>: a trained head, the suffix corpus), None unless it holds
    `marker` (the file that says what it is)."""
    path = SHIPPED_DIR / model_name / method
    return path if (path / marker).exists() else None


def save_safetensors(tensors: dict, path: str | Path, metadata: dict | None = None) -> None:
    """safetensors' save_file, the file then readable as the umask allows, like every other file
    tandem writes (safetensors creates its files 0600: a head trained by one account could not be
    served by another)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)
