"""Admission: which waiting requests get a KV-cache row, how many slots each reserves, and which
prefix of its prompt it starts from (a kept row of an earlier request, or a live request's row).

Each admitted request reserves the most slots it can hold (prompt + max_tokens + one round's
draft), so the running requests never outgrow the token budget: nothing is preempted, new requests
wait. Finished requests' rows are kept for prefix reuse where that is exact (the batch-invariant
fused path, where a token's KV does not depend on how it was computed); their tokens count against
the budget, and the least recently used row is evicted when a request needs its room.
"""

from __future__ import annotations

from collections import deque

from tandem.config import EngineConfig, SamplingParams
from tandem.engine.prefix_cache import CachedRow, PrefixCache, longest_shared_prefix
from tandem.engine.request import HiddenRows, Request
from tandem.model.kv_cache import KVCache


class Admission:
    def __init__(self, cache: KVCache, config: EngineConfig, batch_invariant: bool) -> None:
        self.cache = cache
        self.max_model_len = config.max_model_len
        self.max_total_tokens = cache.token_budget(config.mem_fraction_static, config.max_total_tokens)
        self.kv_reserved = 0
        self._reservations: dict[str, int] = {}
        self.prefix_cache = PrefixCache() if config.enable_prefix_caching and batch_invariant else None
        # Slots one round's draft may write past the last token (a tree writes every node).
        self.draft_slots = config.spec.max_round_tokens if config.spec.algorithm else 0

    def kv_need(self, prompt_len: int, params: SamplingParams) -> int:
        """The most cache slots a request can hold: its prompt, every token it may generate and
        one round's draft beyond the last."""
        return min(self.max_model_len, prompt_len + params.max_tokens + self.draft_slots)

    def max_tokens_room(self, prompt_len: int) -> int:
        """The most tokens a request with this prompt may ask for: what the context and the KV
        budget (max_total_tokens) both leave."""
        context = self.max_model_len - prompt_len
        if self.max_total_tokens >= self.max_model_len:  # any request that fits the context fits
            return context
        return min(context, self.max_total_tokens - prompt_len - self.draft_slots)

    def admit(self, waiting: deque[Request]) -> list[Request]:
        """Take waiting requests in arrival order while a cache row is free and their KV slots fit
        (kept prefix rows are evicted, least recently used first, to make room). A request whose
        prompt starts like a kept row gets that prefix's KV and prefills only the rest."""
        admitted = []
        while waiting:
            req = waiting[0]
            need = self.kv_need(len(req.prompt_ids), req.params)
            if not self._place(req, need):
                break
            waiting.popleft()
            self.kv_reserved += need
            self._reservations[req.request_id] = need
            admitted.append(req)
        return admitted

    def share_live_prefixes(self, starting: list[Request], running: list[Request], prefilling: list[Request]) -> None:
        """Before its prompt's first forward, each starting request copies the longest prefix of
        its prompt that a live request's row already holds, when that beats its kept-row hit: a
        burst of prompts sharing a system prompt with each other or with the running requests
        prefills it once. Exact for the reason kept rows are, so only where the prefix cache is on."""
        if self.prefix_cache is None or not starting:
            return
        # The tokens whose KV each live row holds: a running request's context but its last
        # (sampled, not yet fed) token, a prefilling one's prefilled prompt.
        live = [(r, r.context[: min(self.cache.lengths[r.seq], len(r.context) - 1)]) for r in running]
        live += [(r, r.prompt_ids[: r.prefilled]) for r in prefilling]
        for req in starting:
            if req.params.prompt_logprobs is not None:  # every prompt row's logits are wanted
                continue
            best, best_len = longest_shared_prefix(req.prompt_ids, ((r, t) for r, t in live if r is not req),
                                                   at_least=req.prefilled)
            if best is None:
                continue
            self.cache.truncate(req.seq, 0)
            self.cache.copy_prefix(best.seq, req.seq, best_len)
            self.prefix_cache.record_shared(best_len - req.prefilled)
            req.prefilled = best_len
            req.hidden = HiddenRows(keep_all=True)
            req.hidden.add(best.hidden.first(best_len))

    def release(self, req: Request) -> None:
        """A finished request gives back its reservation, and its row is kept for prefix reuse
        (its cache holds every token of its context but the last, which was sampled and never
        fed) or freed."""
        self.kv_reserved -= self._reservations.pop(req.request_id)
        held = min(self.cache.lengths[req.seq], len(req.context) - 1)
        if self.prefix_cache is None or req.finish_reason == "error" or held < 1:
            self.cache.release(req.seq)
        else:
            self.cache.truncate(req.seq, held)
            self.prefix_cache.add(CachedRow(req.seq, req.context[:held], req.hidden.first(held)))
        req.seq = None

    def _place(self, req: Request, need: int) -> bool:
        """Give `req` a cache row, starting with the longest kept prefix of its prompt; False
        when it must wait."""
        reuse = self.prefix_cache is not None and req.params.prompt_logprobs is None  # reused rows hold no logits
        row, hit = self.prefix_cache.longest_prefix(req.prompt_ids) if reuse else (None, 0)
        if row is None:
            if not self._make_room(need, keep=None):
                return False
            req.seq = self.cache.allocate()
        elif self._make_room(need, keep=row.seq):
            req.seq = self.cache.allocate()
            self.cache.copy_prefix(row.seq, req.seq, hit)
        elif self.kv_reserved + self.prefix_cache.tokens_held - len(row.tokens) + need <= self.max_total_tokens:
            # The matching row is the only one left to evict: the request takes it over.
            req.seq = self.prefix_cache.take(row.seq).seq
            self.cache.truncate(req.seq, hit)
        else:
            return False
        req.hidden = HiddenRows(keep_all=self.prefix_cache is not None)
        if self.prefix_cache is not None:
            self.prefix_cache.record(len(req.prompt_ids), hit, row)
        if hit:
            req.prefilled = hit
            req.hidden.add({layer: rows[:hit] for layer, rows in row.hidden.items()})
        return True

    def _fits(self, need: int) -> bool:
        kept = self.prefix_cache.tokens_held if self.prefix_cache else 0
        return self.kv_reserved + kept + need <= self.max_total_tokens

    def _make_room(self, need: int, keep: int | None) -> bool:
        """Evict kept rows (never row `keep`) until a row is free and `need` slots fit."""
        while not (self.cache.num_free and self._fits(need)):
            row = self.prefix_cache.evict(keep) if self.prefix_cache else None
            if row is None:
                return False
            self.cache.release(row.seq)
        return True
