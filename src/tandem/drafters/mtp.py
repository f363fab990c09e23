"""MTP drafter: the trained MTP modules of heads/mtp.py draft `depth` tokens per round.

Per request each module k keeps a KV cache over its settled positions (i <= m - k, whose input
token x_{i+k} is committed) and the outputs h^{(k)} that module k + 1 has not consumed yet.
A round: module 1 catches up on the new hidden rows and its output at the last true position
m - 1 gives draft 1; modules k >= 2 first settle the positions that became known, then query at
m - 1 with (draft k - 1, h^{(k-1)}_{m-1}) for draft k; that query's key is dropped afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.drafters.base import DraftInput, register
from tandem.drafters.heads.block import RowCache
from tandem.drafters.heads.native import NativeBlock
from tandem.drafters.heads.serving import HeadDrafter, make_draft
from tandem.types import Draft


@dataclass
class _Pending:
    """Outputs of one module at positions [start, start + len(rows)) not yet read by the next."""

    start: int
    rows: torch.Tensor  # [n, H]

    def take(self, a: int, b: int) -> torch.Tensor:
        return self.rows[a - self.start : b - self.start]

    def extend(self, start: int, rows: torch.Tensor) -> None:
        if start != self.start + len(self.rows):
            raise AssertionError("MTP outputs must arrive in position order")
        self.rows = torch.cat([self.rows, rows])

    def drop_before(self, position: int) -> None:
        cut = max(0, position - self.start)
        self.rows, self.start = self.rows[cut:], self.start + cut


@dataclass
class _State:
    origin: int  # first position this state has seen (0 unless it had to restart)
    caches: list[RowCache]
    pending: list[_Pending] = field(default_factory=list)

    def settled(self, k: int) -> int:
        """Next unsettled position of module k (1-based)."""
        return self.origin + self.caches[k - 1].length


@register("mtp")
class MTPDrafter(HeadDrafter):
    def __init__(self, spec, target) -> None:
        super().__init__(spec, target)
        self.states: dict[str, _State] = {}
        natives = [NativeBlock.of(module.block) for module in self.head.mtp]
        self.natives = natives if all(n is not None for n in natives) else None
        if self.natives is not None:
            NativeBlock.stream_together(self.natives)

    def release(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, batch: list[DraftInput]) -> list[Draft]:
        layer = self.head.serving_layers[0]
        drafts = [Draft.empty() for _ in batch]
        for i, inp in enumerate(batch):  # modules settle ragged position ranges: one request at a time
            if len(inp.hidden.get(layer, ())):
                drafts[i] = self._draft(inp, inp.hidden[layer].to(self.device).float())
        return drafts

    def _state(self, inp: DraftInput, first: int) -> _State:
        state = self.states.get(inp.request_id)
        if state is None or state.settled(1) != first:
            caches = [module.block.new_cache(self.device) for module in self.head.mtp]
            state = self.states[inp.request_id] = _State(first, caches)
        return state

    def _run(self, k: int, state: _State, ids: list[int], a: int, b: int, h_prev: torch.Tensor, keep: bool) -> torch.Tensor:
        """Module k over positions [a, b) with inputs x_{i+k} (from ids) and h^{(k-1)} rows."""
        module, cache = self.head.mtp[k - 1], state.caches[k - 1]
        before = cache.length
        tokens = torch.tensor(ids[a + k : b + k], device=self.device)
        x, attn_in = module.inputs(self.parts.embed(tokens).float().unsqueeze(0), h_prev.unsqueeze(0))
        positions = torch.arange(a, b, device=self.device).unsqueeze(0)
        if self.natives is not None:  # on the block kernels; keep=False leaves the draft query's key out
            return self.natives[k - 1].step(x, attn_in, positions, [cache], keep=keep, gap=module.gap)[0][0]
        out = module.block.step(x, attn_in, positions, [cache], gap=module.gap)[0]
        if not keep:  # a draft query: its key came from draft tokens
            cache.truncate(before)
        return out

    def _draft(self, inp: DraftInput, hidden: torch.Tensor) -> Draft:
        ids, m = inp.token_ids, len(inp.token_ids) - 1  # x_m: the next target forward's first token
        first = m - len(hidden)
        state = self._state(inp, first)
        budget = min(self.spec.num_draft_tokens, inp.max_draft_tokens, self.head.depth)
        # Module 1 settles [first, m); its output at m - 1 drafts token 1.
        out = self._run(1, state, ids, first, m, hidden, keep=True)
        if self.head.depth > 1:
            if state.pending:
                state.pending[0].extend(first, out)
            else:
                state.pending.append(_Pending(first, out))
        # Modules k >= 2 settle the positions whose input token became known: [settled, m - k + 1).
        for k in range(2, self.head.depth + 1):
            a, b = state.settled(k), m - k + 1
            if b > a:
                rows = self._run(k, state, ids, a, b, state.pending[k - 2].take(a, b), keep=True)
                state.pending[k - 2].drop_before(b)
                if k == self.head.depth:
                    continue  # no module reads the last one's outputs
                if len(state.pending) < k:
                    state.pending.append(_Pending(a, rows))
                else:
                    state.pending[k - 1].extend(a, rows)
        seen = [self.seen_ids(inp)]
        tokens, qs = [], []
        h = out[-1:]
        for k in range(1, budget + 1):
            if k > 1:  # query module k at m - 1 with the previous draft token
                h = self._run(k, state, ids + tokens, m - 1, m, h, keep=False)
            picked, q = self.choose([inp], seen, self.head.logits(h, self.parts))
            if picked[0] < 0:
                break
            tokens.append(picked[0])
            qs.append(q[0])
        return make_draft(tokens, qs)
