"""The Drafter interface and the registry that maps method names to drafter classes.

Adding a drafting method = one file with a `@register("name")` class + one import line in
`tandem/drafters/__init__.py` + one test file. Drafters and trained heads share one table of
methods (drafters/registry.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tandem.config import NO_SPECULATION, SamplingParams, SpecConfig
from tandem.drafters import registry
from tandem.drafters.heads.base import TargetParts
from tandem.types import Draft


@dataclass(frozen=True)
class DrafterNeeds:
    """What a drafter needs from the target's verification forward, declared as data.

    hidden_layers: indices of target layers whose output hidden states the drafter reads
    (i in [0, L) = output of decoder layer i; L = the final normed hidden state).
    """

    hidden_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class TargetInfo:
    """Facts about the target a drafter may check at construction (vocab, tokenizer, device).

    parts: the target's embedding, final norm and LM head as float32-returning callables in its
    serving dtype (a heads.base.TargetParts), for drafters that run trained heads on them.
    """

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    tokenizer: Any = None
    device: str = "cpu"
    model_name: str = ""
    parts: Any = None

    @classmethod
    def of(cls, loaded: Any, eos_token_ids: tuple[int, ...], device: str = "cpu") -> "TargetInfo":
        """Everything about a LoadedModel target a drafter may use (the engine builds it so)."""
        return cls(loaded.config.vocab_size, tuple(eos_token_ids), loaded.tokenizer, device, loaded.name,
                   TargetParts.serving(loaded))


@dataclass
class DraftInput:
    """One request's state when the drafter is asked for a draft.

    token_ids: prompt + every committed output token; the last one is the token the next target
    forward starts from. max_draft_tokens: this round's budget from the scheduler (>= 1).
    hidden: hidden states of the declared layers for the tokens committed in the previous round
    ({layer: [n, H]}), empty when the drafter declared none.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    max_draft_tokens: int
    params: SamplingParams
    generator: torch.Generator
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class DraftOutcome:
    """What happened to a request's draft: fed back to the drafter through `observe`.

    committed: the tokens appended this round (accepted drafts + the recovered/bonus token).
    When EOS or a stop landed inside the accepted run, every field stops there: the counts are
    the ones the stats and the speculation policy get (engine.RoundCounts.clipped).
    """

    request_id: str
    num_drafted: int
    num_accepted: int
    committed: list[int]


class Drafter(ABC):
    """Proposes draft tokens; the engine verifies them against the target.

    drafts_trees: the drafter can propose trees (SpecConfig.eagle_topk > 1); the others refuse it.
    cost_per_round: drafting costs about the same whatever the draft's length (a block drafter
    proposes a whole block in one forward), not an amount per drafted token (autoregressive
    heads, draft models). The policy prices a round's drafts accordingly.
    Drafts may carry per-token confidences (Draft.confidence) for the policy's cut.
    reports_confidences: every chain draft carries them, so the confidence scheduler can run it.
    serving_policy: the speculation policy `tandem serve` runs this drafter under when none is
    given (None: the server's default, adaptive).
    """

    needs: DrafterNeeds = DrafterNeeds()
    drafts_trees: bool = False
    cost_per_round: bool = False
    reports_confidences: bool = False
    serving_policy: str | None = None

    def __init__(self, spec: SpecConfig, target: TargetInfo) -> None:
        name = getattr(self, "method_name", type(self).__name__)
        # SpecConfig validates this too; checked here so a duck-typed spec cannot slip through.
        if spec.num_draft_tokens < 1:
            raise ValueError(f"{name} drafter needs num_draft_tokens >= 1, got {spec.num_draft_tokens}")
        if getattr(spec, "eagle_topk", 1) > 1 and not self.drafts_trees:
            tree_drafters = ", ".join(n for n in registry.names("drafter") if registry.lookup(n, "drafter").drafts_trees)
            raise ValueError(
                f"the {name} drafter drafts chains only: use --speculative-eagle-topk 1, or a tree "
                f"drafter ({tree_drafters})"
            )
        self.spec = spec
        self.target = target

    @property
    def sampling_device(self) -> str:
        """Where this drafter samples its draft tokens (its q rows live there); the engine hands
        it a generator on that device."""
        return self.target.device

    @abstractmethod
    def propose(self, batch: list[DraftInput]) -> list[Draft]:
        """One Draft per input, at most `max_draft_tokens` long (empty drafts are allowed)."""

    def waiting_rows(self, request_id: str) -> int:
        """Hidden rows the drafter holds for the request and would catch up on before its next
        draft, beyond those the engine hands it (DraftSlot.backlog)."""
        return 0

    @property
    def source_names(self) -> tuple[str, ...]:
        """Every name draft_sources can give ("" when it gives none)."""
        return ("",)

    def draft_sources(self, batch: list[DraftInput]) -> list[str] | None:
        """Before anything is drafted, which of the drafter's sources each request's draft would
        come from this round (e.g. "lookup" or "head"), for a policy that prices them apart; None
        when the drafter has one source. Must read nothing but the context and past rounds."""
        return None

    def observe(self, outcomes: list[DraftOutcome]) -> None:
        """Update drafter state (suffix trees, own KV cache) after verification."""

    def release(self, request_id: str) -> None:
        """The request finished or was aborted: drop its state."""


def register(name: str) -> Callable[[type[Drafter]], type[Drafter]]:
    """Class decorator: the drafter serving method `name` (drafters/registry.py)."""

    def wrap(cls: type[Drafter]) -> type[Drafter]:
        registry.add(name, "drafter", cls)
        cls.method_name = name
        return cls

    return wrap


def available_drafters() -> list[str]:
    return registry.names("drafter")


def check_algorithm_name(algorithm: str) -> None:
    """Refuse a --speculative-algorithm name that is neither a drafter nor none / off."""
    if algorithm.lower() not in NO_SPECULATION and registry.lookup(algorithm, "drafter") is None:
        raise ValueError(f"unknown speculative algorithm {algorithm!r}; available: {', '.join(available_drafters())} "
                         "(or none / off: plain decoding)")


def create_drafter(spec: SpecConfig, target: TargetInfo) -> Drafter:
    if not spec.algorithm:
        raise ValueError("no speculative algorithm to create a drafter for")
    check_algorithm_name(spec.algorithm)
    return registry.lookup(spec.algorithm, "drafter")(spec, target)
