"""Drafters: every drafting method behind one interface, resolved by name in one registry."""

from tandem.drafters.base import (  # noqa: F401
    Drafter,
    DrafterNeeds,
    DraftInput,
    DraftOutcome,
    TargetInfo,
    available_drafters,
    check_algorithm_name,
    create_drafter,
    register,
)

# One import line per drafting method: each module registers its drafter, a trained method's
# head module its head (drafters/registry.py).
from tandem.drafters import ngram  # noqa: E402,F401
from tandem.drafters import suffix  # noqa: E402,F401
from tandem.drafters import draft_model  # noqa: E402,F401
from tandem.drafters import cross_tokenizer  # noqa: E402,F401
from tandem.drafters import medusa  # noqa: E402,F401
from tandem.drafters import eagle  # noqa: E402,F401
from tandem.drafters import mtp  # noqa: E402,F401
from tandem.drafters import dflash  # noqa: E402,F401
from tandem.drafters import dspark  # noqa: E402,F401
from tandem.drafters.heads import dflash as _dflash_head  # noqa: E402,F401
from tandem.drafters.heads import dspark as _dspark_head  # noqa: E402,F401
from tandem.drafters.heads import draft_model as _draft_model_head  # noqa: E402,F401
from tandem.drafters.heads import eagle as _eagle_head  # noqa: E402,F401
from tandem.drafters.heads import eagle3 as _eagle3_head  # noqa: E402,F401
from tandem.drafters.heads import medusa as _medusa_head  # noqa: E402,F401
from tandem.drafters.heads import mtp as _mtp_head  # noqa: E402,F401
