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
The confidence scheduler (scheduler/confidence.py, ConfidenceScheduler) admits the verified prefix of
every draft from these survivals; docs/algorithms.md section 6 says why that stays lossless.
"""

from __future__ import annotations

import torch

from tandem.drafters.base import DraftInput, register
from tandem.drafters.dflash import DFlashDrafter
from tandem.model.block_linear import BlockQ8Linear
from tandem.model.kernels import block_kernels
from tandem.sampling import finite_rows, row_argmax
from tandem.types import Draft


@register("dspark")
class DSparkDrafter(DFlashDrafter):
    anchor_drafts = True
    serving_policy = "confidence"

    def __init__(self, spec, target) -> None:
        super().__init__(spec, target)
        # target id -> the sequential head's row (the draft index; len(draft_ids) outside it)
        vocab = len(self.head.draft_ids)
        self.markov_row = torch.where(self.to_draft >= 0, self.to_draft, vocab)
        head, hidden = self.head, self.head.confidence_weight.shape[0] - self.head.rank
        weight = head.confidence_weight.detach().float()
        codes = head.markov_in.weight.detach().float()
        # The confidence logit w . [h ; code] + b as its two halves: the code's half of every row
        # of the sequential head, computed once, so a draft step looks it up.
        self.code_confidence = (codes @ weight[hidden:]).contiguous()  # [V' + 1]
        self.state_confidence = weight[:hidden].contiguous()  # [H]
        self.codes = codes.contiguous()  # [V' + 1, r]
        kernels = block_kernels() if self.device.type == "cpu" else None
        # On the block kernels a greedy step is one native call: the bias of the sequential head
        # added to the backbone's logits, their argmax and finiteness (kernels.linear_argmax).
        self.markov_kernels = kernels if isinstance(head.markov_out, BlockQ8Linear) else None

    def _drafts(self, inputs: list[DraftInput], states: torch.Tensor, logits: torch.Tensor) -> list[Draft]:
        head = self.head
        h = head.out_norm(states)  # [R, S, H]: the confidence head reads it
        base = logits.float()  # [R, S, V'] = lm_head(h): every row drafts
        budgets = [min(self.block_size, inp.max_draft_tokens) for inp in inputs]
        seen = [self.seen_ids(inp) for inp in inputs]
        anchors = torch.tensor([inp.token_ids[-1] for inp in inputs], device=self.device)
        greedy = torch.tensor([inp.params.greedy for inp in inputs], device=self.device)
        temperature, offset = head.calibration(greedy)  # [R, S] each
        previous = self.markov_row[anchors]  # [R] the sequential head's row of each request's last token
        # The states' half of each position's confidence logit (+ the bias), before any token is drawn.
        state_logits = h[:, : max(budgets, default=0)].float() @ self.state_confidence + head.confidence_bias.float()
        if all(inp.params.greedy and s is None for inp, s in zip(inputs, seen)):
            if self.markov_kernels is not None:
                return self._native_argmax_drafts(state_logits, base, budgets, previous, temperature, offset)
            return self._argmax_drafts(state_logits, base, budgets, previous, temperature, offset)
        tokens: list[list[int]] = [[] for _ in inputs]
        qs: list[list[torch.Tensor | None]] = [[] for _ in inputs]
        confidence: list[list[float]] = [[] for _ in inputs]
        for j in range(max(budgets, default=0)):
            live = [r for r in range(len(inputs)) if budgets[r] > j]
            if not live:
                break
            rows = torch.tensor(live, device=self.device)
            bias = head.sequential(previous[rows])[1]
            c = self._confidence(state_logits[rows], previous[rows], temperature[rows], offset[rows], j).tolist()
            chosen, q = self.choose([inputs[r] for r in live], [seen[r] for r in live], base[rows, j] + bias.float())
            for n, r in enumerate(live):
                if chosen[n] < 0:  # a broken row ends this draft; the target decides alone
                    budgets[r] = j
                    continue
                tokens[r].append(chosen[n])
                qs[r].append(q[n])
                confidence[r].append(c[n])
            previous[rows] = self.markov_row[torch.tensor([max(t, 0) for t in chosen], device=self.device)]
        drafts = []
        for toks, q, conf in zip(tokens, qs, confidence):
            probs = torch.stack(q) if toks and q[0] is not None else None
            drafts.append(Draft(toks, probs, None, conf) if toks else Draft.empty())
        return drafts

    def _native_argmax_drafts(self, state_logits: torch.Tensor, base: torch.Tensor, budgets: list[int],
                              previous: torch.Tensor, temperature: torch.Tensor, offset: torch.Tensor) -> list[Draft]:
        """_argmax_drafts on the block kernels: per step, the codes of the previous tokens, their
        confidences (looked up) and one native call for bias + logits, argmax and finiteness. The
        same tokens: the kernel adds the backbone's logits to the bias as torch does."""
        steps = max(budgets, default=0)
        blocks = self.head.markov_out.blocks(self.markov_kernels)
        by_step = base[:, :steps].float().transpose(0, 1).contiguous()  # [steps, R, V']
        picked, finite, conf = [], [], []
        for j in range(steps):
            conf.append(self._confidence(state_logits, previous, temperature, offset, j))  # before x_j is drawn
            _, previous, ok = self.markov_kernels.linear_argmax(self.codes[previous], blocks, residual=by_step[j])
            picked.append(previous)
            finite.append(ok)
        return self._chains(picked, finite, conf, budgets)

    def _argmax_drafts(self, state_logits: torch.Tensor, base: torch.Tensor, budgets: list[int], previous: torch.Tensor,
                       temperature: torch.Tensor, offset: torch.Tensor) -> list[Draft]:
        """_drafts when every request is greedy without a repetition penalty: the same tokens and
        confidences, with the whole batch's positions kept as tensors until the end (one
        conversion instead of several per position; this loop is most of a round's cost)."""
        picked, finite, conf = [], [], []
        for j in range(max(budgets, default=0)):
            conf.append(self._confidence(state_logits, previous, temperature, offset, j))  # before x_j is drawn
            logits = base[:, j] + self.head.sequential(previous)[1].float()
            previous = row_argmax(logits)  # a draft index: its own row of the sequential head
            picked.append(previous)
            finite.append(finite_rows(logits))
        return self._chains(picked, finite, conf, budgets)

    def _confidence(self, state_logits: torch.Tensor, previous: torch.Tensor, temperature: torch.Tensor,
                    offset: torch.Tensor, j: int) -> torch.Tensor:
        """Position j's calibrated confidences [R], from its states' half of the logit and the
        previous tokens' half (the table)."""
        return torch.sigmoid((state_logits[:, j] + self.code_confidence[previous]) / temperature[:, j] + offset[:, j])

    def _chains(self, picked: list[torch.Tensor], finite: list[torch.Tensor], conf: list[torch.Tensor],
                budgets: list[int]) -> list[Draft]:
        """The greedy drafts from each step's draft indices, finiteness and confidences ([R] each):
        request r's first budgets[r] tokens, ended before its first broken row."""
        if not picked:
            return [Draft.empty() for _ in budgets]
        ids = self.head.draft_ids[torch.stack(picked, 1)].tolist()  # [R, steps]
        ok, conf = torch.stack(finite, 1).tolist(), torch.stack(conf, 1).tolist()
        drafts = []
        for r, budget in enumerate(budgets):
            end = next((j for j in range(budget) if not ok[r][j]), budget)
            drafts.append(Draft(ids[r][:end], None, None, conf[r][:end]) if end else Draft.empty())
        return drafts
