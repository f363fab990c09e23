"""Medusa drafter: K trained heads on the target's final hidden state draft the next K tokens.

The heads read the hidden state of the last token the target processed (whose logits gave the
token the next forward starts from) and propose the tokens after it, all in one head forward.
At most as many draft tokens per round as the head has heads.
"""

from __future__ import annotations

import torch

from tandem.drafters.base import DraftInput, register
from tandem.drafters.heads.serving import HeadDrafter, make_draft
from tandem.types import Draft


@register("medusa")
class MedusaDrafter(HeadDrafter):
    @torch.inference_mode()
    def propose(self, batch: list[DraftInput]) -> list[Draft]:
        layer = self.head.serving_layers[0]
        rows = [i for i, inp in enumerate(batch) if layer in inp.hidden and len(inp.hidden[layer])]
        drafts = [Draft.empty() for _ in batch]
        if not rows:
            return drafts
        k = min(self.spec.num_draft_tokens, self.head.num_heads, max(batch[i].max_draft_tokens for i in rows))
        h = torch.stack([batch[i].hidden[layer][-1] for i in rows]).to(self.device).float()  # [R, H]
        logits = self.head.logits(h, self.parts, k)  # [R, k, V]
        inputs = [batch[i] for i in rows]
        seen = [self.seen_ids(inp) for inp in inputs]
        tokens: list[list[int]] = [[] for _ in rows]
        qs: list[list] = [[] for _ in rows]
        live = list(range(len(rows)))
        for pos in range(k):
            live = [j for j in live if pos < inputs[j].max_draft_tokens]
            if not live:
                break
            picked, q = self.choose([inputs[j] for j in live], [seen[j] for j in live], logits[live, pos])
            still = []
            for j, token, q_row in zip(live, picked, q):
                if token >= 0:
                    tokens[j].append(token)
                    qs[j].append(q_row)
                    still.append(j)
            live = still
        for j, i in enumerate(rows):
            drafts[i] = make_draft(tokens[j], qs[j])
        return drafts
