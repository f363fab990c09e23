"""The playground page `tandem serve` shows at /: one HTML file with its script inline, no build
step. It streams a chat answer with `return_provenance` and colours each token by who wrote it
(docs/serving.md, "The playground")."""

from __future__ import annotations

from functools import cache
from importlib.resources import files


@cache
def playground_html() -> str:
    return files("tandem.server").joinpath("playground.html").read_text(encoding="utf-8")
