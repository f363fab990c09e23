"""Plain data records passed between layers: drafts, verification results, speculation stats, outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Draft:
    """What a drafter proposes for one request in one round.

    token_ids: the K draft tokens. probs: the K processed draft distributions q_i [K, V] the tokens
    were sampled from, or None for deterministic drafts (n-gram, suffix, argmax), which the verifier
    grades with the one-hot rule. parents: parent index of each node (-1 = the last committed
    token); None means a chain (parent of node i is i - 1).
    """

    token_ids: list[int]
    probs: torch.Tensor | None = None
    parents: list[int] | None = None

    def __post_init__(self) -> None:
        if self.probs is not None and self.probs.shape[0] != len(self.token_ids):
            raise ValueError(f"draft has {len(self.token_ids)} tokens but {self.probs.shape[0]} q rows")
        if self.parents is not None and len(self.parents) != len(self.token_ids):
            raise ValueError("draft parents must give one parent per token")

    def __len__(self) -> int:
        return len(self.token_ids)

    @classmethod
    def empty(cls) -> "Draft":
        return cls(token_ids=[])

    def truncated(self, k: int) -> "Draft":
        """The first k nodes (a drafter may propose more than this round's budget)."""
        if len(self.token_ids) <= k:
            return self
        probs = self.probs[:k] if self.probs is not None else None
        parents = self.parents[:k] if self.parents is not None else None
        return Draft(self.token_ids[:k], probs, parents)


@dataclass
class VerifyResult:
    """Outcome of grading a batch of drafts against the target.

    tokens: [B, K_max + 1] committed tokens per request (accepted drafts, then one recovered or
    bonus token), padded with -1. num_accepted: [B] accepted draft tokens per request.
    """

    tokens: torch.Tensor
    num_accepted: torch.Tensor

    def committed(self, row: int) -> list[int]:
        n = int(self.num_accepted[row]) + 1
        return [int(t) for t in self.tokens[row, :n]]


@dataclass
class SpecStats:
    """Speculation counters. One record feeds logs, per-request usage, metrics and benchmarks.

    tau (mean acceptance length) counts committed tokens per target forward *including* the
    recovered/bonus token, so plain decoding has tau = 1.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    graded_per_position: list[int] = field(default_factory=list)
    num_forwards: int = 0
    num_committed_tokens: int = 0

    def record_round(self, drafted: int, accepted: int, committed: int) -> None:
        """One target forward graded `drafted` tokens, accepted `accepted`, committed `committed`."""
        self.num_forwards += 1
        self.num_committed_tokens += committed
        if drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position.extend([0] * (drafted - len(self.accepted_per_position)))
        for i in range(accepted):
            self.accepted_per_position[i] += 1
        # Position i is graded when every earlier draft token passed; the first rejection ends it.
        graded = min(drafted, accepted + 1)
        if len(self.graded_per_position) < graded:
            self.graded_per_position.extend([0] * (graded - len(self.graded_per_position)))
        for i in range(graded):
            self.graded_per_position[i] += 1

    def merge(self, other: "SpecStats") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_forwards += other.num_forwards
        self.num_committed_tokens += other.num_committed_tokens
        self.accepted_per_position = _add_counts(self.accepted_per_position, other.accepted_per_position)
        self.graded_per_position = _add_counts(self.graded_per_position, other.graded_per_position)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return self.num_committed_tokens / self.num_forwards if self.num_forwards else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """P(draft token i passes | tokens before it passed), from the rounds that graded it."""
        return [a / g if g else 0.0 for a, g in zip(self.accepted_per_position, self.graded_per_position)]

    @classmethod
    def from_dict(cls, d: dict) -> "SpecStats":
        """The counters back from `as_dict` (rates are recomputed from them)."""
        missing = {"graded_per_position", "num_committed_tokens"} - set(d)
        if missing:
            raise ValueError(f"speculation counters lack {', '.join(sorted(missing))} (written by an older tandem)")
        return cls(num_drafts=d["num_drafts"], num_draft_tokens=d["num_draft_tokens"],
                   num_accepted_tokens=d["num_accepted_tokens"],
                   accepted_per_position=list(d["accepted_per_position"]),
                   graded_per_position=list(d["graded_per_position"]), num_forwards=d["num_target_forwards"],
                   num_committed_tokens=d["num_committed_tokens"])

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "accepted_per_position": list(self.accepted_per_position),
            "graded_per_position": list(self.graded_per_position),
            "acceptance_per_position": [round(a, 4) for a in self.acceptance_per_position],
            "num_target_forwards": self.num_forwards,
            "num_committed_tokens": self.num_committed_tokens,
        }


def _add_counts(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


@dataclass
class RequestOutput:
    """A finished (or streaming) request, shaped like vLLM's output."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    spec: SpecStats = field(default_factory=SpecStats)
    seconds: float = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
