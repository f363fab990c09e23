"""DSpark drafter: the DFlash backbone drafts a block in one forward, the sequential head draws its
tokens left to right, and every token carries a calibrated confidence (heads/dspark.py).

The backbone forward, the per-layer context caches and their catch-up are DFlash's
(drafters/dflash.py); here the block's anchor output is draft token 0, so k draft tokens take a
block of k inputs. Then, for j = 0 .. k-1:
1. the previous token (the anchor for j = 0) gives the low-rank code e_j and the bias added to
   the backbone's logits at j; the token x_j is drawn from the processed result (argmax for
   greedy requests), which is exactly its q given x_0 .. x_{j-1};
2. c_j = confidence(h_j, e_j), calibrated per position for the request's kind (greedy or
   sampled), is computed before x_j is drawn and reported in Draft.confidence.
The confidence scheduler (scheduler/policy.py, ConfidenceScheduler) admits the verified prefix of
every draft from these survivals; docs/algorithms.md section 6 says why that stays lossless.
"""

from __future__ import annotations

import torch

from tandem.drafters.base import DraftInput, register
from tandem.drafters.dflash import DFlashDrafter
from tandem.types import Draft


@register("dspark")
class DSparkDrafter(DFlashDrafter):
    anchor_drafts = True
    serving_policy = "confidence"

    def _drafts(self, inputs: list[DraftInput], states: torch.Tensor) -> list[Draft]:
        head = self.head
        h = head.out_norm(states)  # [R, S, H]
        base = head.lm_head(h).float()  # [R, S, V']
        budgets = [min(self.block_size, inp.max_draft_tokens) for inp in inputs]
        seen = [self.seen_ids(inp) for inp in inputs]
        anchors = torch.tensor([inp.token_ids[-1] for inp in inputs], device=self.device)
        greedy = torch.tensor([inp.params.greedy for inp in inputs], device=self.device)
        previous = head.draft_index(anchors)  # [R] draft-vocabulary index of each row's last token
        tokens: list[list[int]] = [[] for _ in inputs]
        qs: list[list[torch.Tensor | None]] = [[] for _ in inputs]
        confidence: list[list[float]] = [[] for _ in inputs]
        for j in range(max(budgets, default=0)):
            live = [r for r in range(len(inputs)) if budgets[r] > j]
            if not live:
                break
            rows = torch.tensor(live, device=self.device)
            code, bias = head.sequential(previous[rows])
            c = head.confidence(head.confidence_logit(h[rows, j], code), j, greedy[rows]).tolist()  # before x_j is drawn
            chosen, q = self.choose([inputs[r] for r in live], [seen[r] for r in live], base[rows, j] + bias.float())
            for n, r in enumerate(live):
                if chosen[n] < 0:  # a broken row ends this draft; the target decides alone
                    budgets[r] = j
                    continue
                tokens[r].append(chosen[n])
                qs[r].append(q[n])
                confidence[r].append(c[n])
            picked = torch.tensor([max(t, 0) for t in chosen], device=self.device)
            previous[rows] = head.draft_index(picked)
        drafts = []
        for toks, q, conf in zip(tokens, qs, confidence):
            probs = torch.stack(q) if toks and q[0] is not None else None
            drafts.append(Draft(toks, probs, None, conf) if toks else Draft.empty())
        return drafts
