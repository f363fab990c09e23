"""Suffix decoding drafter (SuffixDecoding, Oliaro et al. 2024): model-free drafts from suffix tries.

A per-request trie over prompt + output, a global trie over earlier requests' outputs and, where
one exists, a trie over a corpus of the target's own answers (drafters/corpus.py) count how often
each continuation followed the context's tail; the drafter follows the most frequent one while its
estimated probability stays above a floor, and keeps the best-scoring of the drafts.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from tandem.config import SpecConfig
from tandem.drafters.base import Drafter, DraftInput, DraftOutcome, TargetInfo, register
from tandem.drafters.calibration import OnlineCalibration
from tandem.drafters.corpus import corpus_trie, shipped_corpus_dir
from tandem.drafters.suffix_trie import SuffixTrie, TrieStream
from tandem.types import Draft


# The tries a draft can come from (SuffixDrafter.evidence).
OWN_TRIE, GLOBAL_TRIE, CORPUS_TRIE = 0, 1, 2

# Upper bounds of the match-length classes a lookup draft's pass rates are kept by: the context's
# tail matched over 1, 2, 3-4, 5-8, or 9 and more tokens. Replayed on 30 Spec-Bench greedy answers
# (SmolLM2, the shipped corpus), a draft's first token passed 0.25 / 0.37 / 0.45 / 0.65 / 0.91 of
# the time by class, and 0.54 from the request's own text against 0.20-0.31 from earlier answers
# or the corpus.
MATCH_CLASSES = (1, 2, 4, 8)
# Passes every rate starts with (a graded position adds one grade): at 1 of 1, a position the
# scheduler has never admitted is admitted and graded until its rate is known. Positions are only
# graded when admitted, and a start of 0.5 kept the later ones out for good: dspark scheduled
# verified one-token lookup drafts in 491 of 948 rounds where suffix decoding's own drafts ran to
# four tokens (Spec-Bench --limit 2, greedy, 128 tokens, Zen 5).
PRIOR_PASSES = 1


class LookupConfidence:
    """The confidences the lookup's drafts report, and what it learns from their grades.

    Position j's base rate is how often position j of earlier lookup drafts passed when every
    token before it had, over the whole server, kept apart by evidence (SuffixDrafter.evidence:
    the request's own text or not, and the match-length class). The request's own grades then
    move it by one logit offset per request (drafters/calibration.py), as a head's confidences
    are corrected: a request whose text drafts better or worse than the average is seen within a
    few rounds. Both are functions of the context and past rounds only."""

    def __init__(self) -> None:
        self.grades: dict[tuple[bool, int, int], tuple[int, int]] = {}  # (own, class, j) -> (graded, passed)
        self.calibration = OnlineCalibration()
        self.drafted: dict[str, tuple[bool, int]] = {}  # request -> evidence of its latest lookup draft

    @staticmethod
    def evidence_class(evidence: tuple[int, int]) -> tuple[bool, int]:
        which, matched = evidence
        return which == OWN_TRIE, bisect.bisect_left(MATCH_CLASSES, matched)

    def rate(self, evidence: tuple[int, int], j: int) -> float:
        graded, passed = self.grades.get((*self.evidence_class(evidence), j), (0, 0))
        return (passed + PRIOR_PASSES) / (graded + PRIOR_PASSES)

    def confidences(self, request_id: str, evidence: tuple[int, int], n: int) -> list[float]:
        """The confidences of the request's lookup draft of n tokens (kept until it is graded)."""
        self.drafted[request_id] = self.evidence_class(evidence)
        return self.calibration.correct(request_id, [self.rate(evidence, j) for j in range(n)])

    def not_drafted(self, request_id: str) -> None:
        """The request's latest draft is not the lookup's: nothing of it to grade here."""
        self.drafted.pop(request_id, None)
        self.calibration.not_drafted(request_id)

    def observe(self, request_id: str, verified: int, accepted: int) -> None:
        """The first `verified` tokens of the request's latest lookup draft were graded, the
        first `accepted` passed: position j was graded when every earlier one passed."""
        drafted = self.drafted.pop(request_id, None)
        if drafted is None:
            return
        for j in range(min(verified, accepted + 1)):
            graded, passed = self.grades.get((*drafted, j), (0, 0))
            self.grades[(*drafted, j)] = (graded + 1, passed + (j < accepted))
        self.calibration.observe(request_id, verified, accepted)

    def release(self, request_id: str) -> None:
        self.drafted.pop(request_id, None)
        self.calibration.release(request_id)


@dataclass(slots=True)
class _Request:
    trie: SuffixTrie
    stream: TrieStream
    num_prompt_tokens: int
    # Per trie (OWN_TRIE, ...): (context length, match length, the trie's version) at the last
    # match, which bounds the next one (SuffixTrie.longest_match's at_most).
    last_match: dict[int, tuple[int, int, int]] = field(default_factory=dict)


@register("suffix")
class SuffixDrafter(Drafter):
    """Suffix decoding with a per-request trie, a global trie of earlier outputs and a corpus.

    The corpus (SpecConfig.corpus, on by default): the directory given as the draft model path
    when suffix decoding is the algorithm, else the one tandem ships for the target, if any. It is
    read only: the served requests' outputs go to the global trie, as before.

    Draft length is adaptive: a tail matched over m tokens may draft at most
    min(k, floor(m * spec_factor + spec_offset)) tokens, so a short, weakly supported match drafts
    little (defaults factor 1, offset 0: a draft is never longer than the evidence behind it).

    Memory bounds: a trie's depth is max_match_len + num_draft_tokens (20 + k: a draft from a
    full-length match is never cut short; longer matches did not raise acceptance on GSM8K or code).
    The per-request trie holds prompt + output (bounded by the model's context): 1-2.5 nodes per
    token, tokens * depth at worst (a long verbatim copy). The global trie holds at most
    max_global_tokens output tokens and max_global_nodes nodes (defaults: 64k tokens, 256k nodes,
    about 60 MB); the oldest outputs are evicted first, an output longer than max_global_tokens is
    cut to its first tokens, and one that alone exceeds the node budget is not kept. The corpus
    trie is built once per process, corpus and depth and shared by every drafter (the shipped
    SmolLM2 corpus: 200k answer tokens, about 0.44M nodes, 100 MB).

    Under the confidence scheduler every draft carries confidences (LookupConfidence: how often
    earlier drafts on the same evidence passed, corrected for the request), so the scheduler can
    cut it where its next tokens no longer pay for their rows.
    """

    reports_confidences = True

    def __init__(
        self,
        spec: SpecConfig,
        target: TargetInfo,
        *,
        max_match_len: int = 20,
        spec_factor: float = 1.0,
        spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
        max_global_tokens: int = 1 << 16,
        max_global_nodes: int = 1 << 18,
    ) -> None:
        super().__init__(spec, target)
        if max_match_len < 1:
            raise ValueError(f"max_match_len must be >= 1, got {max_match_len}")
        if spec_factor < 0:
            raise ValueError(f"spec_factor must be >= 0, got {spec_factor}")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {min_token_prob}")
        if max_global_tokens < 0:
            raise ValueError(f"max_global_tokens must be >= 0, got {max_global_tokens}")
        if max_global_nodes < 1:
            raise ValueError(f"max_global_nodes must be >= 1 (the root), got {max_global_nodes}")
        self.max_match_len = max_match_len
        self.spec_factor = spec_factor
        self.spec_offset = spec_offset
        self.min_token_prob = min_token_prob
        self.max_global_tokens = max_global_tokens
        self.max_global_nodes = max_global_nodes
        self.depth = max_match_len + spec.num_draft_tokens
        self.global_trie = SuffixTrie(self.depth)
        corpus = _corpus_dir(spec, target)
        self.corpus_trie = corpus_trie(corpus, self.depth, target.vocab_size) if corpus else None
        self._global_streams: deque[TrieStream] = deque()
        self._requests: dict[str, _Request] = {}
        # Per request, the evidence behind its latest draft: which trie it came from (OWN_TRIE,
        # GLOBAL_TRIE or CORPUS_TRIE) and how many tokens of the context's tail that trie matched.
        self.evidence: dict[str, tuple[int, int]] = {}
        # The confidence scheduler prices drafts by their confidences; other policies read none.
        self.confidence = LookupConfidence() if spec.policy == "confidence" else None

    def propose(self, batch: list[DraftInput]) -> list[Draft]:
        return [self.with_confidences(inp.request_id, draft) for inp, draft in zip(batch, self.lookup(batch))]

    def lookup(self, batch: list[DraftInput]) -> list[Draft]:
        """The drafts alone, without confidences (nothing is kept for grading)."""
        return [self._propose_one(inp) for inp in batch]

    def with_confidences(self, request_id: str, draft: Draft) -> Draft:
        """The request's draft from `lookup` as the round proposes it: under the confidence
        scheduler with its confidences (an empty draft with none), kept until it is graded."""
        if self.confidence is None:
            return draft
        if not draft:
            self.confidence.not_drafted(request_id)
            return Draft([], confidence=[])
        return Draft(draft.token_ids,
                     confidence=self.confidence.confidences(request_id, self.evidence[request_id], len(draft)))

    def not_drafted(self, request_id: str) -> None:
        """The request's round is drafted by another source (a head behind the lookup)."""
        if self.confidence is not None:
            self.confidence.not_drafted(request_id)

    def observe(self, outcomes: list[DraftOutcome]) -> None:
        for outcome in outcomes:
            req = self._requests.get(outcome.request_id)
            if req is not None:
                req.trie.extend(req.stream, outcome.committed)
            if self.confidence is not None:
                self.confidence.observe(outcome.request_id, outcome.num_drafted, outcome.num_accepted)

    def release(self, request_id: str) -> None:
        self.evidence.pop(request_id, None)
        if self.confidence is not None:
            self.confidence.release(request_id)
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        output = req.stream.tokens[req.num_prompt_tokens :][: self.max_global_tokens]
        if not output:
            return
        trie = self.global_trie
        self._global_streams.append(trie.add(output))
        while self._global_streams and (
            trie.num_tokens > self.max_global_tokens or trie.num_nodes > self.max_global_nodes
        ):
            trie.remove(self._global_streams.popleft())

    def _propose_one(self, inp: DraftInput) -> Draft:
        req = self._synced(inp)
        k = min(self.spec.num_draft_tokens, inp.max_draft_tokens)
        if k < 1:
            return Draft.empty()
        best, best_score = [], 0.0
        # The request's own trie first: on equal scores its evidence is the more specific.
        for which, trie in ((OWN_TRIE, req.trie), (GLOBAL_TRIE, self.global_trie), (CORPUS_TRIE, self.corpus_trie)):
            if trie is None:
                continue
            cursor, m = trie.longest_match(inp.token_ids, self.max_match_len, self._match_bound(req, which, trie, inp))
            req.last_match[which] = (len(inp.token_ids), m, trie.version)
            budget = min(k, int(m * self.spec_factor + self.spec_offset))
            if cursor is None or budget < 1:
                continue
            tokens, score = trie.draft(cursor, budget, self.min_token_prob)
            if score > best_score:
                best, best_score = tokens, score
                self.evidence[inp.request_id] = (which, m)
        if not best:
            self.evidence.pop(inp.request_id, None)
        return Draft(token_ids=best)

    @staticmethod
    def _match_bound(req: _Request, which: int, trie: SuffixTrie, inp: DraftInput) -> int | None:
        """The most this trie can match now, from its match at the request's last draft: that
        match plus the tokens appended since, if the trie has not gained or lost a stream since
        (the request's own trie only grows along the request's own context); None otherwise."""
        last = req.last_match.get(which)
        if last is None or last[2] != trie.version or len(inp.token_ids) < last[0]:
            return None
        return last[1] + len(inp.token_ids) - last[0]

    def _synced(self, inp: DraftInput) -> _Request:
        """The request's trie brought up to `token_ids` (the source of truth for the context).

        Normally `observe` has already appended everything; this also covers a first call (the trie
        is built lazily here), rounds observe never saw, and a context that shrank or changed (the
        trie is rebuilt rather than trusted).
        """
        req = self._requests.get(inp.request_id)
        ids = inp.token_ids
        have = len(req.stream.tokens) if req is not None else 0
        if req is None or have > len(ids) or (have and ids[have - 1] != req.stream.tokens[-1]):
            trie = SuffixTrie(self.depth)
            req = self._requests[inp.request_id] = _Request(trie, trie.open(), inp.num_prompt_tokens)
            have = 0
        if have < len(ids):
            req.trie.extend(req.stream, ids[have:])
        return req


def _corpus_dir(spec: SpecConfig, target: TargetInfo) -> str | None:
    """The corpus the drafter matches against too: --speculative-draft-model-path when suffix
    decoding is the algorithm (a directory from `tandem train --method suffix`), else the one
    tandem ships for the target; None with the corpus turned off."""
    if spec.algorithm == "suffix" and spec.draft_model_path:
        if not spec.corpus:
            raise ValueError("--speculative-draft-model-path names a suffix corpus, and --no-speculative-corpus "
                             "turns the corpus off: drop one of them")
        return spec.draft_model_path
    if not spec.corpus:
        return None
    shipped = shipped_corpus_dir(target.model_name) if target.model_name else None
    return str(shipped) if shipped else None
