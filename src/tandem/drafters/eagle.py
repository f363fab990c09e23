"""EAGLE-1 and EAGLE-3 drafters: one trained decoder layer drafts from the target's features.

Per request the layer keeps a small KV cache over the positions whose true target features it
has seen. Each round (docs/algorithms.md section 3):
1. catch-up: the hidden rows of the tokens the target just committed, paired with the token
   after each (position j: embedding(x_{j+1}) with feature f_j), extend the cache; the output at
   the last row gives draft token 1;
2. step s >= 1 feeds (draft token s, the layer's own previous output) at the next position;
3. the draft steps' cache slots are dropped again: next round's keys come from true features.

With --speculative-lookup (the default) a chain first asks the suffix drafter (drafters/lookup.py):
when its lookup draft has LOOKUP_MIN_TOKENS tokens or more, the round proposes that draft and the
head does not run; the round's new hidden rows wait, and the next round the head drafts in
catches up on them all in one forward. A tree gets the lookup's draft as one more branch.

With --speculative-eagle-topk K > 1 the drafter grows an EAGLE-2 tree instead: the root's top K
tokens form depth 1; at each further depth the K nodes with the highest path log-probability
(draft confidence) are fed through the layer at once, each seeing the prefix and its own path,
and each gets its top K children; finally the num_draft_tokens most likely nodes are kept. The
children are the head's top-k, so the tree is deterministic (no q), which the tree verifier
grades losslessly under greedy and sampling alike. On the block kernels (an EAGLE-3 head with
its own vocabulary) every level of every request's tree after the catch-up runs in one native call
(NativeBlock.trees).
"""

from __future__ import annotations

import dataclasses

import torch

from tandem.drafters.base import DraftInput, DraftOutcome, register
from tandem.drafters.heads.block import RowCache
from tandem.drafters.heads.native import NativeBlock, path_keys, path_mask
from tandem.drafters.heads.serving import HeadDrafter, make_draft
from tandem.drafters.lookup import LookupFirst
from tandem.sampling import all_finite
from tandem.types import Draft


@register("eagle")
class EagleDrafter(HeadDrafter):
    drafts_trees = True

    def __init__(self, spec, target) -> None:
        super().__init__(spec, target)
        self.caches: dict[str, RowCache] = {}
        self.native = NativeBlock.of(self.head.block, self.head.input_norms, self.head.vocab_head)
        if self.native is not None:
            NativeBlock.stream_together([self.native])
        self.lookup = LookupFirst(spec, target, self.head.serving_layers) if spec.lookup else None

    def observe(self, outcomes: list[DraftOutcome]) -> None:
        if self.lookup is not None:
            self.lookup.observe(outcomes)

    def release(self, request_id: str) -> None:
        self.caches.pop(request_id, None)
        if self.lookup is not None:
            self.lookup.release(request_id)

    @torch.inference_mode()
    def propose(self, batch: list[DraftInput]) -> list[Draft]:
        layers = self.head.serving_layers
        drafts = [Draft.empty() for _ in batch]
        rows = [i for i, inp in enumerate(batch) if all(len(inp.hidden.get(layer, ())) for layer in layers)]
        if not rows:
            return drafts
        inputs = [batch[i] for i in rows]
        if self.spec.tree:
            branches = [[] for _ in rows]
            if self.lookup is not None:
                depth = self.spec.max_draft_len
                looked = [dataclasses.replace(inp, max_draft_tokens=min(depth, inp.max_draft_tokens)) for inp in inputs]
                branches = [d.token_ids for d in self.lookup.suffix.lookup(looked)]
            for i, branch, (tokens, parents, scores) in zip(rows, branches, self._grow_trees(inputs)):
                # The lookup branch's nodes come out of the tree's budget.
                size = self.spec.num_draft_tokens - len(branch)
                drafts[i] = best_subtree(tokens, parents, scores, size).with_branch(branch)
            return drafts
        if self.lookup is not None:
            looked = self.lookup.propose(inputs)
            for i, draft in zip(rows, looked):
                if draft is not None:
                    drafts[i] = draft
            kept = [j for j, draft in enumerate(looked) if draft is None]
            rows, inputs = [rows[j] for j in kept], [self.lookup.with_pending(inputs[j]) for j in kept]
            if not rows:
                return drafts
        seen = [self.seen_ids(inp) for inp in inputs]
        budgets = [min(self.spec.num_draft_tokens, inp.max_draft_tokens) for inp in inputs]
        caches = [self._catch_up_cache(inp) for inp in inputs]
        feat, logits = self._catch_up(inputs, caches)  # step 0: [R, H], [R, V']
        if self._chains_natively(inputs, seen):  # greedy: every further step in one native call
            chains = self.native.chain(feat, logits, caches, [len(inp.token_ids) - 1 for inp in inputs], budgets,
                                       self.draft_ids, self.parts.embed_table, self.parts.embed_scale)
            for j, tokens in enumerate(chains):
                drafts[rows[j]] = Draft(tokens)
            return drafts
        tokens: list[list[int]] = [[] for _ in rows]
        qs: list[list] = [[] for _ in rows]
        live = list(range(len(rows)))
        for s in range(max(budgets)):
            picked, q = self.choose([inputs[j] for j in live], [seen[j] for j in live], logits)
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
            positions = torch.tensor([[len(inputs[j].token_ids) - 1 + s] for j in keep], device=self.device)
            out, logits = self._layer(self.parts.embed(ids).float().unsqueeze(1), feat[keep_rows].unsqueeze(1),
                                      positions, [caches[j] for j in keep])
            feat = out[:, 0]
            live = keep
        for j, (inp, cache) in enumerate(zip(inputs, caches)):
            cache.truncate(len(inp.token_ids) - 1 - cache.origin)  # drop the draft steps' keys
            drafts[rows[j]] = make_draft(tokens[j], qs[j])
        return drafts

    def _drafts_natively(self) -> bool:
        """Whether the head's steps can run in one native call per round: a head with its own
        vocabulary on the kernels whose layer input is [embedding | feature] (EAGLE-3), and a
        float32 target embedding on the CPU."""
        table = self.parts.embed_table
        return (self.native is not None and self.native.has_vocab and self.head.input_is_embedding_and_feature
                and table is not None and table.dtype == torch.float32 and table.device.type == "cpu")

    def _chains_natively(self, inputs: list[DraftInput], seen: list[torch.Tensor | None]) -> bool:
        """Whether these requests' chains run as one native call: _drafts_natively, and greedy
        without a repetition penalty (argmax drafts, no q)."""
        return self._drafts_natively() and all(inp.params.greedy and s is None for inp, s in zip(inputs, seen))

    def _grow_trees(self, inputs: list[DraftInput]) -> list[tuple[list[int], list[int], list[float]]]:
        """Each request's EAGLE-2 tree before it is cut to size (see the module docstring): its
        nodes (target ids), their parents (-1: the root) and path log-probabilities. Every
        request's catch-up is one call; on the kernels every level of every tree is one more,
        and else each tree grows in Python, one layer call per level."""
        depths = [min(self.spec.max_draft_len, inp.max_draft_tokens) for inp in inputs]
        caches = [self._catch_up_cache(inp) for inp in inputs]
        feats, logits = self._catch_up(inputs, caches)  # [R, H], [R, V']
        if self._drafts_natively():
            return self.native.trees(feats, logits, caches, [len(inp.token_ids) - 1 for inp in inputs],
                                     self.spec.eagle_topk, depths, self.draft_ids, self.parts.embed_table,
                                     self.parts.embed_scale)
        return [self._grow_tree(inp, cache, feats[j : j + 1], logits[j : j + 1], depth)
                for j, (inp, cache, depth) in enumerate(zip(inputs, caches, depths))]

    def _grow_tree(self, inp: DraftInput, cache: RowCache, feats: torch.Tensor, logits: torch.Tensor,
                   depth: int) -> tuple[list[int], list[int], list[float]]:
        """One request's tree in Python, from its catch-up's feature [1, H] and logits [1, V']."""
        topk = self.spec.eagle_topk
        prefix = cache.length
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        slot_of: dict[int, int] = {}  # node -> its cache slot once fed through the layer
        frontier, frontier_scores = [-1], torch.zeros(1, device=self.device)
        for d in range(1, depth + 1):
            logits = logits.float()  # [F, V']
            if not all_finite(logits):
                break  # a broken head row: verify what the tree has so far
            k = min(topk, logits.shape[-1])
            logp, ids = torch.log_softmax(logits, -1).topk(k, dim=-1)  # [F, k]
            child_scores = (frontier_scores[:, None] + logp).flatten()
            target_ids = ids.flatten() if self.draft_ids is None else self.draft_ids[ids.flatten()]
            first = len(tokens)
            for n, (token, score) in enumerate(zip(target_ids.tolist(), child_scores.tolist())):
                tokens.append(token)
                parents.append(frontier[n // k])
                scores.append(score)
            if d == depth:
                break
            # Expand the K most likely new nodes: feed (node token, feature that produced it).
            best = child_scores.topk(min(topk, len(child_scores))).indices
            expand = [first + int(i) for i in best]
            parent_rows = torch.div(best, k, rounding_mode="floor")
            ids_in = torch.tensor([tokens[n] for n in expand], device=self.device)
            position = len(inp.token_ids) - 2 + d
            positions = torch.full((1, len(expand)), position, device=self.device)
            for j, n in enumerate(expand):
                slot_of[n] = cache.length + j
            paths = []  # each expanded node sees the prefix, then its ancestors' slots and its own
            for n in expand:
                path, node = [], n
                while node >= 0:
                    path.append(slot_of[node])
                    node = parents[node]
                paths.append(path[::-1])
            visible = (path_keys(prefix, paths, positions[0]) if self.native is not None
                       else path_mask(prefix, paths, cache.length + len(expand)).to(self.device))
            out, logits = self._layer(self.parts.embed(ids_in).float().unsqueeze(0), feats[parent_rows].unsqueeze(0),
                                      positions, [cache], masks=[visible], logits="all")
            feats = out[0]  # [K, H]
            frontier, frontier_scores = expand, child_scores[best]
        cache.truncate(len(inp.token_ids) - 1 - cache.origin)  # drop the draft steps' keys
        return tokens, parents, scores

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

    def _catch_up(self, inputs: list[DraftInput], caches: list[RowCache]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed each request's n new rows (positions len-1-n .. len-2) paired with the tokens
        after them; returns the layer's output at each request's last row [R, H] and its logits
        [R, V']. On the block kernels all requests' rows (ragged) go through one call."""
        layers = self.head.serving_layers
        counts = [len(inp.hidden[layers[0]]) for inp in inputs]
        ends = [len(inp.token_ids) - 1 for inp in inputs]
        next_ids = torch.tensor([t for inp, n, end in zip(inputs, counts, ends) for t in inp.token_ids[end - n + 1 : end + 1]],
                                device=self.device)
        positions = torch.tensor([p for n, end in zip(counts, ends) for p in range(end - n, end)], device=self.device)
        hidden = {layer: torch.cat([inp.hidden[layer] for inp in inputs]).to(self.device).float() for layer in layers}
        feat = self.head.fuse({layer: h.unsqueeze(0) for layer, h in hidden.items()})  # [1, N, H]
        emb = self.parts.embed(next_ids).float().unsqueeze(0)
        if self.native is not None:
            resid, raw = self.head.raw_layer_input(emb, feat)
            out, logits = self.native.rows(resid[0], raw[0], positions, counts, caches, logits="last")
            last = torch.tensor(counts).cumsum(0) - 1
            if logits is None:
                logits = self.head.head_logits(out[last], self.parts)
            return out[last], logits
        outs, start = [], 0
        for cache, n in zip(caches, counts):  # the PyTorch path: one request at a time
            rows = slice(start, start + n)
            out, lg = self._layer(emb[:, rows], feat[:, rows], positions[rows].unsqueeze(0), [cache])
            outs.append((out[:, -1], lg))
            start += n
        return torch.cat([o for o, _ in outs]), torch.cat([lg for _, lg in outs])

    def _layer(self, emb: torch.Tensor, feat: torch.Tensor, positions: torch.Tensor, caches: list[RowCache],
               masks: list | None = None, logits: str = "last") -> tuple[torch.Tensor, torch.Tensor]:
        """The draft layer (DraftBlock.step) over (embedding, feature) rows [R, t, H] each, on
        the block kernels where they serve: its output [R, t, H] and the logits of each request's
        last row [R, V'] (logits="all": of every row, [R * t, V']). masks: as NativeBlock.step's
        (TreeKeys only where the native path runs)."""
        if self.native is not None:
            resid, raw = self.head.raw_layer_input(emb, feat)
            out, row_logits = self.native.step(resid, raw, positions, caches, masks, logits=logits)
        else:
            resid, attn_in = self.head.layer_input(emb, feat)
            out, row_logits = self.head.block.step(resid, attn_in, positions, caches, masks=masks), None
        if row_logits is None:  # no vocabulary projection of the head's own on the kernels
            rows = out[:, -1] if logits == "last" else out.reshape(-1, out.shape[-1])
            row_logits = self.head.head_logits(rows, self.parts)
        return out, row_logits


@register("eagle3")
class Eagle3Drafter(EagleDrafter):
    """The same drafting loop; the head fuses three target layers and drafts over its own vocab."""


def best_subtree(tokens: list[int], parents: list[int], scores: list[float], size: int) -> Draft:
    """The `size` nodes with the highest path scores (log-probabilities, which never rise along
    a path, so a kept node's parent is kept too), ordered by depth: parents before children."""
    order = sorted(range(len(tokens)), key=lambda n: -scores[n])[:size]
    kept = set(order)
    # A tie between a parent and its child (log p = 0 in float32) may have ranked the child
    # higher: keep each kept node's ancestors, dropping the lowest-scoring leaves to make room.
    for n in list(order):
        p = parents[n]
        while p >= 0 and p not in kept:
            kept.add(p)
            p = parents[p]
    depth: dict[int, int] = {}
    for n in range(len(tokens)):
        depth[n] = 0 if parents[n] < 0 else depth[parents[n]] + 1
    while len(kept) > size:
        leaves = [n for n in kept if not any(parents[c] == n for c in kept)]
        kept.remove(min(leaves, key=lambda n: scores[n]))
    nodes = sorted(kept, key=lambda n: (depth[n], n))
    index = {n: i for i, n in enumerate(nodes)}
    return Draft([tokens[n] for n in nodes], None, [-1 if parents[n] < 0 else index[parents[n]] for n in nodes])
