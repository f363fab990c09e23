"""Cross-tokenizer draft model: a draft LM with its own tokenizer drafts text the target re-tokenizes.

Each round the committed context is decoded to text and encoded with the draft tokenizer (the draft
KV cache keeps the common token prefix), the draft model extends it greedily, and the new text is
re-encoded with the target tokenizer. Drafts are deterministic (probs=None): exact under greedy,
graded with the one-hot rule under sampling (docs/algorithms.md sections 1 and 3).
"""

from __future__ import annotations

import torch

from tandem.config import SpecConfig
from tandem.drafters.base import Drafter, DraftInput, TargetInfo, register
from tandem.drafters import draft_model  # via the module: one patch of load_draft_model serves both
from tandem.types import Draft

# Draft tokens beyond k: the two tokenizers cut text differently, and the last re-encoded target
# token is dropped (the draft text may end mid-word).
EXTRA_DRAFT_TOKENS = 2
# Committed target tokens re-encoded in front of the draft text: enough left context for the
# target tokenizer to cut the boundary as it would in the full text, without re-encoding it all.
TAIL_TOKENS = 16
# Draft-context tokens decoded in front of the new ones, so decoders that treat the start of a
# text specially (a stripped leading space) see the new tokens mid-text.
ANCHOR_TOKENS = 4


@register("cross_tokenizer")
class CrossTokenizerDrafter(Drafter):
    """Greedy draft text from a model with another tokenizer, re-encoded into target tokens."""

    def __init__(self, spec: SpecConfig, target: TargetInfo) -> None:
        super().__init__(spec, target)
        if not spec.draft_model_path:
            raise ValueError("cross_tokenizer drafter needs a draft model: set draft_model_path (speculative_draft_model_path)")
        # Re-encoding needs character offsets, which only the Rust-backed tokenizers report.
        if target.tokenizer is None or not getattr(target.tokenizer, "is_fast", False):
            raise ValueError("cross_tokenizer drafter needs the target's fast (Rust-backed) Hugging Face tokenizer")
        loaded = draft_model.load_draft_model(spec.draft_model_path, target)
        if loaded.tokenizer is None:
            raise ValueError(f"draft model {loaded.name!r} has no tokenizer")
        self.lm = draft_model.DraftLM(loaded, target.device)
        self.draft_tokenizer = loaded.tokenizer
        eos = loaded.tokenizer.eos_token_id
        self.draft_eos = frozenset(loaded.config.eos_token_ids) | ({eos} if eos is not None else set())

    def propose(self, batch: list[DraftInput]) -> list[Draft]:
        ks = [min(self.spec.num_draft_tokens, inp.max_draft_tokens) for inp in batch]
        views = [self._draft_view(inp.token_ids) for inp in batch]
        finished: set[int] = set()  # requests whose draft text ended with the draft model's EOS

        def choose(rows: list[int], logits: torch.Tensor) -> list[int]:
            tokens = logits.argmax(-1).tolist()
            for j, i in enumerate(rows):
                if tokens[j] in self.draft_eos:
                    finished.add(i)
                    tokens[j] = -1
            return tokens

        requests = [(inp.request_id, view, k + EXTRA_DRAFT_TOKENS) for inp, view, k in zip(batch, views, ks)]
        drafted = self.lm.extend(requests, choose)
        drafts = []
        for i, (inp, view, new) in enumerate(zip(batch, views, drafted)):
            text = self._draft_text(view, new)
            tokens = self._to_target(inp.token_ids, text, complete=i in finished) if text else []
            drafts.append(Draft(tokens[: ks[i]]))
        return drafts

    def release(self, request_id: str) -> None:
        self.lm.release(request_id)

    def _draft_view(self, ids: list[int]) -> list[int]:
        """The committed context as draft tokens (special target tokens have no shared text)."""
        return self.draft_tokenizer.encode(self.target.tokenizer.decode(ids, skip_special_tokens=True))

    def _draft_text(self, view: list[int], new: list[int]) -> str:
        """The text the new draft tokens add after the context, without a trailing partial character."""
        if not new:
            return ""
        decode = self.draft_tokenizer.decode
        anchor = view[-ANCHOR_TOKENS:]
        head = decode(anchor, skip_special_tokens=True)
        full = decode(anchor + new, skip_special_tokens=True)
        text = full[len(head) :] if full.startswith(head) else decode(new, skip_special_tokens=True)
        return text.rstrip("\ufffd")

    def _to_target(self, context: list[int], text: str, complete: bool) -> list[int]:
        """Target tokens for `text` written right after `context`.

        The context's tail and the text are encoded together, and the tokens starting at or after
        the text's first character are the draft. Example (byte-level BPE): tail "The quick" and
        text " brown fo" encode to [The, Ġquick, Ġbrown, Ġfo]; the draft is [Ġbrown], since "fo"
        may be the start of "fox" (the last token is kept only when the draft model ended its text).
        """
        tokenizer = self.target.tokenizer
        head = tokenizer.decode(context[-TAIL_TOKENS:], skip_special_tokens=False)
        enc = tokenizer(head + text, add_special_tokens=False, return_offsets_mapping=True)
        ids, spans, cut = enc["input_ids"], enc["offset_mapping"], len(head)
        first = next((j for j, (start, _) in enumerate(spans) if start >= cut), len(ids))
        if first and spans[first - 1][1] > cut:
            # The context's last token merges with the text ("hel" + "lo" -> "hello"); the target,
            # bound to the tokens it already produced, would go on with the text cut on its own.
            tokens = tokenizer.encode(text, add_special_tokens=False)
        else:
            tokens = ids[first:]
        if not complete:
            tokens = tokens[:-1]
        in_vocab = next((j for j, t in enumerate(tokens) if not 0 <= t < self.target.vocab_size), len(tokens))
        return tokens[:in_vocab]
