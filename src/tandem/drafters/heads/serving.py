"""What every trained-head drafter shares: loading the head for the target, and turning head
logits into draft tokens plus the q rows the verifier needs (docs/algorithms.md section 1).

Greedy requests get argmax drafts (deterministic, no q). Sampled requests draw each draft token
from the head's processed distribution q (same temperature / top-k / top-p / min-p / repetition
penalty as the target), reported over the target's vocabulary: a reduced draft vocabulary
scatters q onto its target ids and leaves zeros elsewhere.
"""

from __future__ import annotations

import torch

from tandem.config import SpecConfig
from tandem.drafters import registry
from tandem.drafters.base import Drafter, DrafterNeeds, DraftInput, TargetInfo
from tandem.drafters.heads.io import load_head, read_head_config, shipped_head_dir, with_article
from tandem.model.block_linear import BLOCK, BlockQ8Linear
from tandem.model.kernels import block_kernels
from tandem.sampling import NonFiniteLogitsError, finite_rows, row_argmax, sample_processed
from tandem.types import Draft


def serving_kernels(head: torch.nn.Module) -> torch.nn.Module:
    """On a CPU with tandem's block kernels, the head's linears become 8-bit block linears.

    Drafting runs one row at a time, where an fp32 matmul is bound by reading its weights (an
    EAGLE-3 head's layer and 8k-row LM head are ~43 MB in fp32, ~11 MB in 8-bit blocks; measured
    ~8 ms vs ~2 ms per draft token here). Drafts only propose: their rounding never reaches the
    output, which the verifier decides.
    """
    if block_kernels() is None or any(p.device.type != "cpu" for p in head.parameters()):
        return head
    for parent in list(head.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and child.in_features % BLOCK == 0:
                bias = None if child.bias is None else child.bias.detach().float()
                setattr(parent, name, BlockQ8Linear.quantize(child.weight.detach().float(), bias))
    return head


def head_path(spec: SpecConfig, model_name: str, method: str):
    """The head a `method` drafter serves: --speculative-draft-model-path, else the one tandem
    ships for the model; a ValueError saying what to do when there is neither."""
    path = spec.draft_model_path or shipped_head_dir(model_name, method)
    if path is None:
        raise ValueError(
            f"the {method} drafter serves a trained head and tandem ships none for {model_name}: "
            f"set speculative_draft_model_path (--speculative-draft-model-path) to a directory made by "
            f"`tandem train --method {method}`"
        )
    return path


def check_head_available(spec: SpecConfig, model_name: str) -> None:
    """Refuse a trained-head drafter without a head before anything slow runs (the cost profile
    the policy needs is measured before the drafter is built)."""
    drafter = registry.lookup(spec.algorithm, "drafter") if spec.algorithm else None
    if drafter is not None and issubclass(drafter, HeadDrafter):
        head_path(spec, model_name, spec.algorithm)


class HeadDrafter(Drafter):
    """Base of the drafters that serve a head trained by `tandem train` (medusa, eagle, eagle3, mtp, dflash)."""

    def __init__(self, spec: SpecConfig, target: TargetInfo) -> None:
        super().__init__(spec, target)
        name = self.method_name
        if target.parts is None:
            raise ValueError(
                f"the {name} drafter needs the target's embedding and LM head: build its TargetInfo "
                "with TargetInfo.of(loaded, ...)"
            )
        path = head_path(spec, target.parts.model_name, name)
        method = read_head_config(path)["method"]
        if method != name:
            raise ValueError(f"{path} holds {with_article(method)} head; serve it with "
                             f"--speculative-algorithm {method}")
        self.parts = target.parts
        self.head = serving_kernels(load_head(path, target.parts, target.device).requires_grad_(False))
        self.needs = DrafterNeeds(tuple(self.head.serving_layers))
        self.device = torch.device(target.device)
        draft_ids = getattr(self.head, "draft_ids", None)
        self.draft_ids = None if draft_ids is None else draft_ids.to(self.device)
        # target id -> draft index (-1 outside the draft vocabulary), for repetition penalties.
        self.to_draft = None
        # A reduced draft vocabulary reports q over the target's: q of draft index t at draft_ids[t].
        self.into = None if self.draft_ids is None else (self.draft_ids.long().contiguous(), target.vocab_size)
        if self.draft_ids is not None:
            self.to_draft = torch.full((target.vocab_size,), -1, dtype=torch.long, device=self.device)
            self.to_draft[self.draft_ids] = torch.arange(len(self.draft_ids), device=self.device)

    def seen_ids(self, inp: DraftInput) -> torch.Tensor | None:
        """The context's distinct ids (in the head's vocabulary) when a repetition penalty applies."""
        if inp.params.repetition_penalty == 1.0:
            return None
        ids = torch.tensor(sorted(set(inp.token_ids)), dtype=torch.long, device=self.device)
        if self.to_draft is None:
            return ids
        mapped = self.to_draft[ids]
        return mapped[mapped >= 0]

    def choose(self, inputs: list[DraftInput], seen: list[torch.Tensor | None], logits: torch.Tensor) -> tuple[list[int], list[torch.Tensor | None]]:
        """One draft token per row of logits [R, V'] (row r drafts for inputs[r]), in target ids,
        and per row the q row [V] it was sampled from (None: deterministic, or -1 = draft ends)."""
        logits = logits.float()
        tokens: list[int] = [-1] * len(inputs)
        qs: list[torch.Tensor | None] = [None] * len(inputs)
        plain = [r for r, inp in enumerate(inputs) if inp.params.greedy and seen[r] is None]
        if plain:
            rows = logits[plain]
            for r, token, ok in zip(plain, row_argmax(rows).tolist(), finite_rows(rows).tolist()):
                tokens[r] = token if ok else -1
        for r, inp in enumerate(inputs):
            if r in plain:
                continue
            try:
                q, tokens[r] = sample_processed(logits[r : r + 1], inp.params, inp.generator, seen[r], self.into)
            except NonFiniteLogitsError:
                continue  # a broken head row ends this draft; the target decides alone
            if not inp.params.greedy:
                qs[r] = q[0]
        if self.draft_ids is not None:
            index = torch.tensor([max(t, 0) for t in tokens], dtype=torch.long, device=self.draft_ids.device)
            tokens = [m if t >= 0 else -1 for t, m in zip(tokens, self.draft_ids[index].tolist())]
        return tokens, qs


def make_draft(tokens: list[int], qs: list[torch.Tensor | None]):
    """A Draft from a chain of tokens and their q rows (all None for deterministic drafts)."""
    if not tokens or qs[0] is None:
        return Draft(tokens)
    return Draft(tokens, torch.stack(qs))
