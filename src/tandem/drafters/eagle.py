"""EAGLE-1 and EAGLE-3 drafters: one trained decoder layer drafts from the target's features.

Per request the layer keeps a small KV cache over the positions whose true target features it
has seen. Each round (ALGORITHMS.md section 3):
1. catch-up: the hidden rows of the tokens the target just committed, paired with the token
   after each (position j: embedding(x_{j+1}) with feature f_j), extend the cache; the output at
   the last row gives draft token 1;
2. step s >= 1 feeds (draft token s, the layer's own previous output) at the next position;
3. the draft steps' cache slots are dropped again: next round's keys come from true features.
"""

from __future__ import annotations

import torch

from tandem.drafters.base import DraftInput, register
from tandem.drafters.heads.block import RowCache
from tandem.drafters.heads.serving import HeadDrafter, make_draft
from tandem.types import Draft


@register("eagle")
class EagleDrafter(HeadDrafter):
    def __init__(self, spec, target) -> None:
        super().__init__(spec, target)
        self.caches: dict[str, RowCache] = {}

    def release(self, request_id: str) -> None:
        self.caches.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, batch: list[DraftInput]) -> list[Draft]:
        head, layers = self.head, self.head.serving_layers
        drafts = [Draft.empty() for _ in batch]
        rows = [i for i, inp in enumerate(batch) if all(len(inp.hidden.get(layer, ())) for layer in layers)]
        if not rows:
            return drafts
        inputs = [batch[i] for i in rows]
        seen = [self.seen_ids(inp) for inp in inputs]
        budgets = [min(self.spec.num_draft_tokens, inp.max_draft_tokens) for inp in inputs]
        caches = [self._catch_up_cache(inp) for inp in inputs]
        # Step 0: catch up on the new true features, one request at a time (ragged lengths).
        feat = torch.cat([self._catch_up(inp, cache) for inp, cache in zip(inputs, caches)])  # [R, H]
        tokens: list[list[int]] = [[] for _ in rows]
        qs: list[list] = [[] for _ in rows]
        live = list(range(len(rows)))
        for s in range(max(budgets)):
            picked, q = self.choose([inputs[j] for j in live], [seen[j] for j in live], head.head_logits(feat, self.parts))
            keep, keep_rows = [], []
            for n, (j, token, q_row) in enumerate(zip(live, picked, q)):
                if token < 0:
                    continue
                tokens[j].append(token)
                qs[j].append(q_row)
                if len(tokens[j]) < budgets[j]:
                    keep.append(j)
                    keep_rows.append(n)
            if not keep:
                break
            # Step s + 1: (draft token, own output) at the position after the last one fed.
            ids = torch.tensor([tokens[j][-1] for j in keep], device=self.device)
            resid, attn_in = head.layer_input(self.parts.embed(ids).float().unsqueeze(1), feat[keep_rows].unsqueeze(1))
            positions = torch.tensor([[len(inputs[j].token_ids) - 1 + s] for j in keep], device=self.device)
            feat = head.block.step(resid, attn_in, positions, [caches[j] for j in keep])[:, 0]
            live = keep
        for j, (inp, cache) in enumerate(zip(inputs, caches)):
            cache.truncate(len(inp.token_ids) - 1 - cache.origin)  # drop the draft steps' keys
            drafts[rows[j]] = make_draft(tokens[j], qs[j])
        return drafts

    def _catch_up_cache(self, inp: DraftInput) -> RowCache:
        """The request's cache, holding exactly the positions before its new hidden rows. Rows
        that never arrived (a round the engine did not ask for a draft) cannot be recovered: the
        cache then restarts at the first row it has (drafts stay valid, with less context)."""
        cache = self.caches.get(inp.request_id)
        n = len(inp.hidden[self.head.serving_layers[0]])
        first = len(inp.token_ids) - 1 - n
        if cache is None or cache.origin + cache.length != first:
            cache = self.caches[inp.request_id] = self.head.block.new_cache(self.device, origin=first)
        return cache

    def _catch_up(self, inp: DraftInput, cache: RowCache) -> torch.Tensor:
        """Feed the n new rows (positions len-1-n .. len-2) paired with the tokens after them;
        returns the layer's output at the last row [1, H]."""
        hidden = {layer: inp.hidden[layer].to(self.device) for layer in self.head.serving_layers}
        n = len(next(iter(hidden.values())))
        end = len(inp.token_ids) - 1
        next_ids = torch.tensor(inp.token_ids[end - n + 1 : end + 1], device=self.device)
        feat = self.head.fuse({layer: h.float().unsqueeze(0) for layer, h in hidden.items()})  # [1, n, H]
        resid, attn_in = self.head.layer_input(self.parts.embed(next_ids).float().unsqueeze(0), feat)
        positions = torch.arange(end - n, end, device=self.device).unsqueeze(0)
        return self.head.block.step(resid, attn_in, positions, [cache])[:, -1]


@register("eagle3")
class Eagle3Drafter(EagleDrafter):
    """The same drafting loop; the head fuses three target layers and drafts over its own vocab."""
