"""Suffix decoding drafter (SuffixDecoding, Oliaro et al. 2024): model-free drafts from suffix tries.

A per-request trie over prompt + output, a global trie over earlier requests' outputs and, where
one exists, a trie over a corpus of the target's own answers (drafters/corpus.py) count how often
each continuation followed the context's tail; the drafter follows the most frequent one while its
estimated probability stays above a floor, and keeps the best-scoring of the drafts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tandem.config import SpecConfig
from tandem.drafters.base import Drafter, DraftInput, DraftOutcome, TargetInfo, register
from tandem.drafters.corpus import corpus_trie, shipped_corpus_dir
from tandem.drafters.suffix_trie import SuffixTrie, TrieStream
from tandem.types import Draft


# The tries a draft can come from (SuffixDrafter.evidence).
OWN_TRIE, GLOBAL_TRIE, CORPUS_TRIE = 0, 1, 2


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
    """

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

    def propose(self, batch: list[DraftInput]) -> list[Draft]:
        return [self._propose_one(inp) for inp in batch]

    def observe(self, outcomes: list[DraftOutcome]) -> None:
        for outcome in outcomes:
            req = self._requests.get(outcome.request_id)
            if req is not None:
                req.trie.extend(req.stream, outcome.committed)

    def release(self, request_id: str) -> None:
        self.evidence.pop(request_id, None)
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
