"""The one table of drafting methods: under each name, the drafter that serves it and, for the
trained methods, the head class `tandem train` builds and head files name.

Drafter classes enter it through `drafters.base.register`, head classes through
`drafters.heads.base.register_head`; `tandem/drafters/__init__.py` imports every method's
modules, so the table is complete once anything under `tandem.drafters` is imported.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MethodEntry:
    drafter: type | None = None  # a drafters.base.Drafter subclass
    head: type | None = None  # a drafters.heads.base.DraftHead subclass


METHODS: dict[str, MethodEntry] = {}


def add(name: str, kind: str, cls: type) -> None:
    """Record `cls` as method `name`'s "drafter" or "head"; each may be registered once."""
    entry = METHODS.setdefault(name, MethodEntry())
    if getattr(entry, kind) is not None:
        raise ValueError(f"{kind} {name!r} registered twice")
    setattr(entry, kind, cls)


def names(kind: str) -> list[str]:
    """The methods that have a `kind` ("drafter" or "head"), sorted."""
    return sorted(n for n, e in METHODS.items() if getattr(e, kind) is not None)


def lookup(name: str, kind: str) -> type | None:
    entry = METHODS.get(name)
    return None if entry is None else getattr(entry, kind)
