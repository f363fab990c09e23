"""Plain data records passed between layers: drafts, verification results, speculation stats, outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

import torch

# Who wrote an output token (SamplingParams.token_origins): a draft token the target accepted; the
# target's own token where it rejected a draft (recovered); its extra token after a draft it
# accepted whole (bonus); or a round without a draft (target: plain decoding).
TokenOrigin = Literal["accepted", "recovered", "bonus", "target"]
TOKEN_ORIGINS: tuple[str, ...] = get_args(TokenOrigin)


def tree_paths(parents: list[int]) -> list[list[int]]:
    """Each node's path from its root to itself (node indices, root first): the tree structure
    the model runner, the engine, the audit and the verifiers share."""
    paths: list[list[int]] = []
    for t, p in enumerate(parents):
        if p >= t:
            raise ValueError(f"tree parents must precede children; node {t} has parent {p}")
        paths.append((paths[p] if p >= 0 else []) + [t])
    return paths


def rooted_parents(parents: list[int] | None) -> list[int] | None:
    """A draft tree's parents as its verification forward sees them: row 0 is the last committed
    token (the root), draft node i is row i + 1. None (a chain) stays None."""
    return None if parents is None else [-1] + [p + 1 for p in parents]


@dataclass
class Draft:
    """What a drafter proposes for one request in one round.

    token_ids: the K draft tokens. probs: the K processed draft distributions q_i [K, V] the tokens
    were sampled from, or None for deterministic drafts (n-gram, suffix, argmax), which the verifier
    grades with the one-hot rule. parents: parent index of each node (-1 = the last committed
    token); None means a chain (parent of node i is i - 1). confidence: per node, the drafter's
    own estimate of P(node accepted | its parent accepted), or None when it gives none. It must
    be fixed before the node's token is sampled (a function of the context, the tokens before it
    and the drafter's state; for a deterministic draft also of the token itself): the policy
    may cut a draft on it (docs/algorithms.md, "Cutting a draft").
    """

    token_ids: list[int]
    probs: torch.Tensor | None = None
    parents: list[int] | None = None
    confidence: list[float] | None = None

    def __post_init__(self) -> None:
        if self.confidence is not None and len(self.confidence) != len(self.token_ids):
            raise ValueError(f"draft has {len(self.token_ids)} tokens but {len(self.confidence)} confidences")
        if self.probs is not None and self.probs.shape[0] != len(self.token_ids):
            raise ValueError(f"draft has {len(self.token_ids)} tokens but {self.probs.shape[0]} q rows")
        if self.parents is not None and len(self.parents) != len(self.token_ids):
            raise ValueError("draft parents must give one parent per token")

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    @property
    def depth(self) -> int:
        """The longest root-to-leaf path: how many tokens one round can accept at most."""
        return len(self.token_ids) if self.parents is None else max(self.node_depths(), default=0)

    def node_depths(self) -> list[int]:
        """Each tree node's depth (1 for the root's children)."""
        depths: list[int] = []
        for p in self.parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        return depths

    def survival(self) -> list[float]:
        """A chain's survivals a_j = prod_{i<=j} confidence_i: the drafter's estimate that its
        first j tokens all pass (needs confidences)."""
        out, reach = [], 1.0
        for c in self.confidence:
            reach *= c
            out.append(reach)
        return out

    @classmethod
    def empty(cls) -> "Draft":
        return cls(token_ids=[])

    def truncated(self, k: int) -> "Draft":
        """The first k nodes (a drafter may propose more than this round's budget)."""
        if len(self.token_ids) <= k:
            return self
        probs = self.probs[:k] if self.probs is not None else None
        parents = self.parents[:k] if self.parents is not None else None
        confidence = self.confidence[:k] if self.confidence is not None else None
        return Draft(self.token_ids[:k], probs, parents, confidence)

    def with_branch(self, tokens: list[int]) -> "Draft":
        """This deterministic draft as a tree with the chain `tokens` grafted onto its root:
        the chain follows existing nodes while their tokens match and adds the rest as new
        nodes (after all others, so parents still precede children)."""
        if self.probs is not None:
            raise ValueError("only deterministic drafts take a grafted branch")
        ids = list(self.token_ids)
        parents = list(self.parents) if self.parents is not None else list(range(-1, len(ids) - 1))
        children: dict[tuple[int, int], int] = {(p, t): n for n, (p, t) in enumerate(zip(parents, ids))}
        node = -1
        for token in tokens:
            child = children.get((node, token))
            if child is None:
                child = len(ids)
                ids.append(token)
                parents.append(node)
                children[(node, token)] = child
            node = child
        return Draft(ids, None, parents)

    def pruned(self, max_depth: int, max_nodes: int) -> "Draft":
        """A chain cut to max_depth tokens; a tree without its nodes deeper than max_depth, then
        cut to its first max_nodes nodes (parents precede children, so it stays a tree)."""
        if self.parents is None:
            return self.truncated(min(max_depth, max_nodes))
        keep: list[int] = []
        index: dict[int, int] = {}
        for node, (p, depth) in enumerate(zip(self.parents, self.node_depths())):
            if depth <= max_depth and (p < 0 or p in index) and len(keep) < max_nodes:
                index[node] = len(keep)
                keep.append(node)
        if len(keep) == len(self.token_ids):
            return self
        probs = self.probs[keep] if self.probs is not None else None
        parents = [-1 if self.parents[n] < 0 else index[self.parents[n]] for n in keep]
        confidence = [self.confidence[n] for n in keep] if self.confidence is not None else None
        return Draft([self.token_ids[n] for n in keep], probs, parents, confidence)


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

    def record_round(self, drafted: int, accepted: int, committed: int, depth: int | None = None) -> None:
        """One target forward graded `drafted` tokens, accepted `accepted`, committed `committed`.
        depth: a tree's depth (its positions are depths; a chain's depth is its length)."""
        self.num_forwards += 1
        self.num_committed_tokens += committed
        if drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        positions = drafted if depth is None else depth
        # Position i is graded when every earlier draft token passed; the first rejection ends it.
        # Both lists reach the deepest position ever graded (one never graded passed nothing).
        graded = min(positions, accepted + 1)
        for counts in (self.accepted_per_position, self.graded_per_position):
            if len(counts) < graded:
                counts.extend([0] * (graded - len(counts)))
        for i in range(accepted):
            self.accepted_per_position[i] += 1
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
    def drafted_tau(self) -> float:
        """Tokens committed per forward that verified a draft: its accepted tokens plus the
        recovered or bonus one (tau over the drafting rounds alone; 0 with none)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """P(draft token i passes | tokens before it passed), from the rounds that graded it
        (trees: P(a node at depth i passes | the accepted path reached depth i - 1))."""
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


@dataclass(frozen=True)
class GreedyRows:
    """Of some logits rows, found with them (the fused path's LM head): each row's argmax, the
    first index of its largest value as numpy's, and whether the row is all finite. What greedy
    grading needs, without reading the rows again."""

    argmax: list[int]
    finite: list[bool]  # Python lists: a round reads a few entries per request, and a tensor's
    # indexing costs microseconds a list's does not

    def __getitem__(self, rows: slice) -> "GreedyRows":
        return GreedyRows(self.argmax[rows], self.finite[rows])

    @staticmethod
    def cat(parts: "list[GreedyRows | None]") -> "GreedyRows | None":
        if not parts or any(p is None for p in parts):
            return None
        return GreedyRows([a for p in parts for a in p.argmax], [f for p in parts for f in p.finite])


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One output token's log-probability under the target's raw distribution at its position
    (log_softmax of the logits, before penalties, temperature and filters, as vLLM reports by
    default), and that row's most likely tokens, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """A finished (or streaming) request, shaped like vLLM's output."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    error: str | None = None  # why it ended, where finish_reason is "error"
    spec: SpecStats = field(default_factory=SpecStats)
    seconds: float = 0.0
    # Who wrote each of token_ids (accepted, recovered, bonus or target), when
    # SamplingParams.token_origins asked for it.
    token_origins: list[str] | None = None
    # One per token of token_ids, when SamplingParams.logprobs asked for them.
    logprobs: list[TokenLogprob] | None = None
    # One per prompt token, None for the first (nothing predicts it), when
    # SamplingParams.prompt_logprobs asked for them.
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
