"""Text pieces of the results page (bench/results_doc.py): numbers, markdown tables, shell commands, anchors.

Pure formatting: no file is read here, and nothing knows what a report holds.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

LOOP_VARIABLE = "$cat"  # the subtask of a shell loop over sittings: left for the shell to expand


def num(x: Any, digits: int = 2) -> str:
    """A number with `digits` decimals; "-" for anything else (None, a bool, a string)."""
    if x is None or isinstance(x, bool) or not isinstance(x, (int, float)):
        return "-"
    return f"{x:.{digits}f}"


def times(x: Any) -> str:
    """A ratio as `1.23x`; "-" when it is not a number."""
    return "-" if not isinstance(x, (int, float)) else f"{x:.2f}x"


def seq(xs: Any, digits: int = 2) -> str:
    """Numbers joined by " / "; "-" when there are none."""
    return " / ".join(num(x, digits) for x in xs) if xs else "-"


def cell(value: Any) -> str:
    """A value as one markdown table cell: pipes escaped, newlines flattened."""
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return lines


def shell_line(words: list[str], env: str = "") -> str:
    """A command line a shell runs as `words`, after an optional `VAR=value` environment prefix."""
    def quote(word: str) -> str:
        if not word:
            return "''"
        if LOOP_VARIABLE in word:  # unquoted where the rest of the word is shell-safe, else in double quotes
            return word if shlex.quote(word.replace(LOOP_VARIABLE, "x"))[0] != "'" else f'"{word}"'
        return shlex.quote(word)

    text = " ".join(quote(w) for w in words)
    return f"{env} {text}" if env else text


def bash_block(lines: list[str]) -> list[str]:
    return ["```bash", *lines, "```"]


def slug(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def curve_ratio(curve: dict, n: int) -> float | None:
    """c(n) of a cost curve {"1": seconds, "n": seconds, ...}: a forward over n tokens / one token."""
    base = curve.get("1")
    value = curve.get(str(n))
    return value / base if isinstance(base, (int, float)) and base and isinstance(value, (int, float)) else None
