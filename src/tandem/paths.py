"""Where tandem keeps what it builds once: converted models, compiled kernels, cost profiles,
trained drafters and training data (TANDEM_CACHE_DIR, default ~/.cache/tandem), and where the
package keeps the drafters it ships."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    root = Path(os.environ.get("TANDEM_CACHE_DIR", Path.home() / ".cache" / "tandem"))
    if root.exists() and not root.is_dir():
        raise ValueError(f"the cache directory {root} (TANDEM_CACHE_DIR) is a file; point TANDEM_CACHE_DIR at a "
                         "directory")
    return root


SHIPPED_DIR = Path(__file__).resolve().parent / "drafters" / "shipped"


def shipped_drafter_dir(model_name: str, method: str, marker: str) -> Path | None:
    """The directory of what the package ships for a built-in model and drafting method
    (drafters/shipped/<model>/<method>: a trained head, the suffix corpus), None unless it holds
    `marker` (the file that says what it is)."""
    path = SHIPPED_DIR / model_name / method
    return path if (path / marker).exists() else None


def read_user_text(path: str | Path, what: str) -> str:
    """A file the user named on the command line, as text, or an error naming it and `what` it
    was given as: missing, not a file, unreadable or not UTF-8."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path}: {'is a directory' if path.is_dir() else 'no such file'}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{what} {path} is not UTF-8 text (byte {err.start}: {err.reason})") from None
    except OSError as err:
        raise ValueError(f"{what} {path} cannot be read: {err.strerror or err}") from None


def check_not_an_input(output: str | Path, inputs: list, flag: str) -> None:
    """Refuse an output path that names one of the command's input files (it would be overwritten)."""
    out = Path(output).resolve()
    for given in inputs:
        if Path(given).resolve() == out:
            raise ValueError(f"{flag} {output} is one of the command's input files, which the output would "
                             "overwrite; give another path")


def save_safetensors(tensors: dict, path: str | Path, metadata: dict | None = None) -> None:
    """safetensors' save_file, the file then readable as the umask allows, like every other file
    tandem writes (safetensors creates its files 0600: a head trained by one account could not be
    served by another)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~umask())


def umask() -> int:
    """This process's umask (what a plainly created file leaves out), for files made private by
    the call that makes them (mkdtemp, safetensors) and then opened to the cache's other users."""
    mask = os.umask(0)
    os.umask(mask)
    return mask
