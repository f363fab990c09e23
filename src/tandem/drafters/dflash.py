"""DFlash drafter: the block head of heads/dflash.py proposes a whole block in one forward.

Per request and draft layer a RowCache holds the keys and values of the context: the true target
features of every position before the anchor. Each round (docs/algorithms.md section 3):
1. catch-up: the hidden rows of the tokens the target just committed become context features,
   and every layer appends their keys and values;
2. one forward over [anchor, MASK x k] at positions a .. a+k (a = the last committed token's
   position) for every drafting request at once: the linears run over all requests' rows
   together, attention per request over its context plus its own block;
3. the block's keys are never stored: the next round's block sees only true features.

Mask position j's logits give draft token j. Greedy drafts take the argmax; sampled ones draw
token j from position j's processed distribution, reported as q_j. The positions do not depend on
one another's tokens (each sees only the context and MASK inputs), so q_j is exactly the
distribution token j was drawn from, which the verifier's rule needs (docs/algorithms.md
section 1). Each token's confidence is the largest probability of its position's distribution:
fixed before the token is drawn, so the policy may cut the draft on it. Every confidence is
reported through the request's online correction (drafters/calibration.py), fitted to how its
earlier drafts fared.

With --speculative-lookup (the default) a round first asks the suffix lookup (drafters/lookup.py)
and the head drafts only when the lookup has fewer than LOOKUP_MIN_TOKENS tokens; the rows of the
rounds it sat out wait and are caught up on in one go. Under the confidence scheduler the
lookup's drafts carry confidences of their own: how often earlier lookup drafts on the same
evidence passed, corrected for the request (LookupConfidence).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.drafters.base import DraftInput, DraftOutcome, register
from tandem.drafters.calibration import OnlineCalibration
from tandem.drafters.heads.block import RowCache
from tandem.drafters.heads.native import NativeBlock
from tandem.drafters.heads.serving import HeadDrafter, make_draft
from tandem.drafters.lookup import LookupFirst
from tandem.types import Draft


@register("dflash")
class DFlashDrafter(HeadDrafter):
    cost_per_round = True
    reports_confidences = True
    # The block's anchor output is a draft too (DSpark): a block of S inputs drafts S tokens, not S - 1.
    anchor_drafts = False

    def __init__(self, spec, target) -> None:
        super().__init__(spec, target)
        extra = 0 if self.anchor_drafts else 1
        trained = self.head.block_size - extra
        if spec.num_draft_tokens > trained:
            raise ValueError(
                f"this {self.method_name} head was trained on blocks of {trained} draft tokens: set "
                f"--speculative-num-draft-tokens to at most {trained}"
            )
        self.block_size = spec.num_draft_tokens + extra
        self.contexts: dict[str, list[RowCache]] = {}
        last = len(self.head.draft_layers) - 1  # its call gives the block's logits too
        natives = [NativeBlock.of(layer.block, (layer.norm,), (self.head.out_norm, self.head.lm_head) if i == last else None)
                   for i, layer in enumerate(self.head.draft_layers)]
        self.natives = natives if all(n is not None for n in natives) else None
        if self.natives is not None:
            NativeBlock.stream_together(self.natives)
        self.online_calibration = OnlineCalibration()
        self.lookup = None
        if spec.lookup:
            self.lookup = LookupFirst(spec, target, tuple(self.head.serving_layers))

    def observe(self, outcomes: list[DraftOutcome]) -> None:
        for o in outcomes:
            self.online_calibration.observe(o.request_id, o.num_drafted, o.num_accepted)
        if self.lookup is not None:
            self.lookup.observe(outcomes)

    def release(self, request_id: str) -> None:
        self.contexts.pop(request_id, None)
        self.online_calibration.release(request_id)
        if self.lookup is not None:
            self.lookup.release(request_id)

    def waiting_rows(self, request_id: str) -> int:
        return self.lookup.waiting_rows(request_id) if self.lookup is not None else 0

    @property
    def source_names(self) -> tuple[str, ...]:
        return ("lookup", "head") if self.lookup is not None else ("",)

    def draft_sources(self, batch: list[DraftInput]) -> list[str] | None:
        """"lookup" where the suffix lookup has a draft this round (it is proposed instead of the
        head's, and costs no drafting), else "head"; None without the lookup."""
        if self.lookup is None:
            return None
        return ["lookup" if found else "head" for found in self.lookup.peek(batch)]

    @torch.inference_mode()
    def propose(self, batch: list[DraftInput]) -> list[Draft]:
        drafts = [Draft.empty() for _ in batch]
        rows = [i for i, inp in enumerate(batch) if all(len(inp.hidden.get(layer, ())) for layer in self.head.serving_layers)]
        if not rows:
            return drafts
        inputs = [batch[i] for i in rows]
        if self.lookup is not None:
            looked = self.lookup.propose(inputs)
            for i, inp, draft in zip(rows, inputs, looked):
                if draft is not None:
                    drafts[i] = draft
                    self.online_calibration.not_drafted(inp.request_id)
            kept = [j for j, draft in enumerate(looked) if draft is None]
            rows, inputs = [rows[j] for j in kept], [self.lookup.with_pending(inputs[j]) for j in kept]
            if not rows:
                return drafts
        contexts = self._catch_up(inputs)
        for r, inp, draft in zip(rows, inputs, self._drafts(inputs, *self._block_states(inputs, contexts))):
            if draft.confidence:
                corrected = self.online_calibration.correct(inp.request_id, draft.confidence)
                draft = Draft(draft.token_ids, draft.probs, None, corrected)
            drafts[r] = draft
        return drafts

    def _drafts(self, inputs: list[DraftInput], states: torch.Tensor, logits: torch.Tensor) -> list[Draft]:
        """One draft per input from the block's output states [R, S, H] and the logits of its
        mask positions [R, S - 1, V']: mask position j's logits give token j, independently of
        the others."""
        return [self._draft(inp, logits[r, : min(self.block_size - 1, inp.max_draft_tokens)])
                for r, inp in enumerate(inputs)]

    def _draft(self, inp: DraftInput, logits: torch.Tensor) -> Draft:
        """Tokens (and q rows when sampling) from the block's logits [k, V'], cut at a broken row."""
        k = len(logits)
        seen = self.seen_ids(inp)
        tokens, qs = self.choose([inp] * k, [seen] * k, logits)
        end = tokens.index(-1) if -1 in tokens else k
        confidence = torch.softmax(logits[:end].float(), dim=-1).amax(-1).tolist()
        draft = make_draft(tokens[:end], qs[:end])
        return Draft(draft.token_ids, draft.probs, None, confidence) if end else draft

    def _block_states(self, inputs: list[DraftInput], contexts: list[list[RowCache]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The last draft layer's output [R, S, H] over every request's [anchor, MASK x (S-1)],
        and the head's logits of its drafting rows: [R, S - 1, V'] (the masks), or [R, S, V']
        where the anchor drafts too (DSpark)."""
        head, S = self.head, self.block_size
        anchors = torch.tensor([inp.token_ids[-1] for inp in inputs], device=self.device)
        positions = torch.tensor([len(inp.token_ids) - 1 for inp in inputs], device=self.device)
        positions = positions.unsqueeze(-1) + torch.arange(S, device=self.device)  # [R, S]
        x = head.block_input(self.parts.embed(anchors).float(), S)  # [R, S, H]
        first = 0 if self.anchor_drafts else 1  # the first row whose logits give a draft token
        if self.natives is not None:  # every row sees the whole context and the whole block
            drafting = (torch.arange(len(inputs)).unsqueeze(1) * S + torch.arange(first, S)).flatten()
            # The layers' caches hold the same positions: one placement of the block for all.
            placed = NativeBlock.place(positions.reshape(-1), [S] * len(inputs), [ctx[0] for ctx in contexts],
                                       whole=True)
            for li, native in enumerate(self.natives):
                last = li == len(self.natives) - 1
                x, logits = native.step(x, x, positions, [ctx[li] for ctx in contexts], keep=False, whole=True,
                                        logits=drafting if last else None, placed=placed)
            return x, (head.head_logits(x[:, first:]) if logits is None else logits.reshape(len(inputs), S - first, -1))
        for li, layer in enumerate(head.draft_layers):
            blk = layer.block
            q, kb, vb = blk.qkv_heads(layer.norm(x), positions)
            outs = []
            for r, ctx in enumerate(contexts):
                cache, n = ctx[li], ctx[li].length
                k = torch.cat([cache.k[:, :n], kb[r]], dim=1)[None]
                v = torch.cat([cache.v[:, :n], vb[r]], dim=1)[None]
                outs.append(F.scaled_dot_product_attention(q[r : r + 1], k, v, scale=blk.scale,
                                                           enable_gqa=blk.heads != blk.kv_heads))
            x = blk.finish(x, torch.cat(outs))
        return x, head.head_logits(x[:, first:])

    def _catch_up(self, inputs: list[DraftInput]) -> list[list[RowCache]]:
        """Each request's per-layer context caches extended by its new hidden rows (positions
        len-1-n .. len-2); on the block kernels all requests' rows go through one call per
        layer. Rows that never arrived (a round without a draft) cannot be recovered: the caches
        then restart at the first row they have (drafts stay valid, with less context)."""
        layers = self.head.serving_layers
        counts = [len(inp.hidden[layers[0]]) for inp in inputs]
        contexts = []
        for inp, n in zip(inputs, counts):
            first = len(inp.token_ids) - 1 - n
            caches = self.contexts.get(inp.request_id)
            if caches is None or caches[0].origin + caches[0].length != first:
                caches = self.contexts[inp.request_id] = [
                    layer.block.new_cache(self.device, origin=first) for layer in self.head.draft_layers
                ]
            contexts.append(caches)
        positions = torch.tensor([p for inp, n in zip(inputs, counts) for p in range(len(inp.token_ids) - 1 - n,
                                                                                    len(inp.token_ids) - 1)],
                                 device=self.device)
        hidden = {layer: torch.cat([inp.hidden[layer] for inp in inputs]).to(self.device).float().unsqueeze(0)
                  for layer in layers}
        if self.natives is not None:  # only the rows' keys and values are needed; the norm is fused
            projected = self.head.context_projection(hidden)[0]  # [N, H]
            placed = NativeBlock.place(positions, counts, [ctx[0] for ctx in contexts])  # the same for every layer
            for li, native in enumerate(self.natives):
                native.write_keys(projected, positions, counts, [ctx[li] for ctx in contexts],
                                  norm=self.head.context_norm, placed=placed)
            return contexts
        features = self.head.context(hidden)  # [1, N, H]
        start = 0
        for caches, n in zip(contexts, counts):
            rows = slice(start, start + n)
            for layer, cache in zip(self.head.draft_layers, caches):
                k, v = layer.context_kv(features[:, rows], positions[rows].unsqueeze(0))
                cache.append(k[0], v[0], positions[rows])
            start += n
        return contexts
