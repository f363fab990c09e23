"""Drafters: every drafting method behind one interface, resolved by name in one registry."""

from tandem.drafters.base import (  # noqa: F401
    Drafter,
    DrafterNeeds,
    DraftInput,
    DraftOutcome,
    TargetInfo,
    available_drafters,
    create_drafter,
    register,
)

# One import line per drafting method (each module registers itself).
from tandem.drafters import ngram  # noqa: E402,F401
from tandem.drafters import suffix  # noqa: E402,F401
from tandem.drafters import draft_model  # noqa: E402,F401
from tandem.drafters import cross_tokenizer  # noqa: E402,F401
from tandem.drafters import medusa  # noqa: E402,F401
from tandem.drafters import eagle  # noqa: E402,F401
from tandem.drafters import mtp  # noqa: E402,F401
