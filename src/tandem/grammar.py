"""Structured output: a request's constraint (config.StructuredOutput) as a matcher over the
tokenizer's vocabulary (llguidance), which says which tokens may come next.

The target's distribution at a position is its distribution over the allowed tokens: their
logits are kept and every other token's is -inf before penalties, temperature and the filters
(sampling.processed_probs). Plain decoding samples from that; verification grades each draft
token against the row computed after the committed tokens and the draft tokens before it, with
the matcher advanced along that same path (GrammarState.allowed_along), so speculation stays
lossless under a constraint (docs/algorithms.md). A drafter's token the grammar refuses has
target probability 0 and is rejected like any other.
"""

from __future__ import annotations

import functools
import re
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from tandem.config import StructuredOutput

# Compiled grammars kept per tokenizer (a matcher is copied from its grammar's for each request).
COMPILED_GRAMMARS = 64


class GrammarError(ValueError):
    """A structured output that does not compile (an invalid schema, regex or grammar)."""


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar of a structured output."""
    from llguidance import LLMatcher

    if spec.json is not None:
        return LLMatcher.grammar_from_json_schema(spec.json)
    if spec.json_object:
        return LLMatcher.grammar_from_json_schema({"type": "object"})
    if spec.regex is not None:
        return LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return LLMatcher.grammar_from_regex("(" + "|".join(re.escape(c) for c in spec.choice) + ")")
    return LLMatcher.grammar_from_lark(spec.grammar)


class GrammarCompiler:
    """One tokenizer's grammars: its llguidance tokenizer (built once, about 0.3 s for a 49k
    vocabulary) and the compiled matchers of recent grammars, copied for each request.

    tokenizer: a Hugging Face fast tokenizer, or any object with `vocabulary_bytes()` (each
    token id's bytes; special tokens' start with 0xFF) and `encode(text)` able to spell any text
    in those tokens; vocab_size: the width of the model's logits (ids past the tokenizer's own are
    never allowed); eos_ids: the tokens that end a matched output.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._tokenizer = tokenizer
        self._compiled: OrderedDict[str, object] = OrderedDict()

    @functools.cached_property
    def ll_tokenizer(self):
        import llguidance
        import llguidance.hf

        if callable(getattr(self._tokenizer, "vocabulary_bytes", None)):
            return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_BytesVocabulary(self._tokenizer, self.eos_ids)),
                                          n_vocab=self.vocab_size, eos_token=self.eos_ids)
        if getattr(self._tokenizer, "backend_tokenizer", None) is None:
            raise GrammarError("structured output needs a fast (Rust) Hugging Face tokenizer")
        return llguidance.hf.from_tokenizer(self._tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_ids)

    def check(self, spec: StructuredOutput) -> None:
        """Raise GrammarError when the structured output does not compile for this tokenizer."""
        self._template(spec)

    def state(self, spec: StructuredOutput) -> "GrammarState":
        """A fresh matcher for one request."""
        return GrammarState(self._template(spec).deep_copy(), self.vocab_size, self.eos_ids)

    def _template(self, spec: StructuredOutput):
        import llguidance.torch  # noqa: F401  GrammarState's: its first import takes most of a second, paid
        from llguidance import LLMatcher  # here (the server's tokenizer thread), not on the engine's thread

        text = grammar_text(spec)
        matcher = self._compiled.get(text)
        if matcher is None:
            error = LLMatcher.validate_grammar(text, self.ll_tokenizer)
            if error:
                raise GrammarError(f"the structured output does not compile: {error.strip()}")
            matcher = LLMatcher(self.ll_tokenizer, text, log_level=0)
            if matcher.is_error():
                raise GrammarError(f"the structured output does not compile: {matcher.get_error()}")
            if not matcher.is_accepting() and not self._starts_any_text(matcher):
                raise GrammarError("the structured output matches no text (not even the empty one): no answer could "
                                   "follow it")
            self._compiled[text] = matcher
            while len(self._compiled) > COMPILED_GRAMMARS:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(text)
        return matcher

    def _starts_any_text(self, matcher) -> bool:
        """Whether some token other than EOS may begin an output under a fresh `matcher`."""
        allowed = GrammarState(matcher.deep_copy(), self.vocab_size, self.eos_ids).allowed()
        allowed[self.eos_ids] = False
        return bool(allowed.any())


class GrammarState:
    """One request's matcher, advanced by every committed token. Masks are bool [rows, V]
    tensors, True where a token may come next."""

    def __init__(self, matcher, vocab_size: int, eos_ids: Sequence[int]) -> None:
        import llguidance.torch

        self._matcher = matcher
        self._vocab_size = vocab_size
        self._eos = list(eos_ids)
        self._bits = llguidance.torch.allocate_token_bitmask(1, vocab_size)
        self._fill = llguidance.torch.fill_next_token_bitmask

    def allowed(self) -> torch.Tensor:
        """[V] the tokens that may come next: only EOS once the output is complete (or if the
        matcher has failed, so the request ends rather than emit what does not match)."""
        if self._matcher.is_error():
            mask = torch.zeros(self._vocab_size, dtype=torch.bool)
            mask[self._eos] = True
            return mask
        self._fill(self._matcher, self._bits, 0)
        bits = np.unpackbits(self._bits.numpy().view(np.uint8), axis=-1, bitorder="little")[0, : self._vocab_size]
        return torch.from_numpy(bits.astype(bool))

    def allowed_along(self, tokens: Sequence[int]) -> tuple[torch.Tensor, int]:
        """Masks after each prefix of `tokens` (a draft): row i is what may follow tokens[:i],
        for i = 0 .. len(tokens); and how many leading tokens the grammar accepts. Rows past
        the first refused token repeat the mask before it: verification never reads them, as
        that token's target probability is 0. The matcher ends where it began."""
        rows = [self.allowed()]
        valid = self.valid_prefix(tokens)
        consumed = 0
        for token in tokens[:valid]:
            consumed += self._advance(token)
            rows.append(self.allowed())
        self._rewind(consumed)
        rows.extend([rows[-1]] * (len(tokens) - valid))
        return torch.stack(rows), valid

    def allowed_paths(self, paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """[1 + len(paths), V]: row 0 what may come next, row 1 + n what may follow the tokens
        of path n (a tree node's path from the root, its own token last)."""
        rows = [self.allowed()]
        for path in paths:
            valid = self._matcher.validate_tokens(list(path))
            if valid < len(path):  # never read: a refused token on the way (see allowed_along)
                rows.append(rows[0])
                continue
            consumed = sum(self._advance(token) for token in path)
            rows.append(self.allowed())
            self._rewind(consumed)
        return torch.stack(rows)

    def consume(self, tokens: Sequence[int]) -> None:
        """Advance by committed tokens (EOS at the end of a matched output included)."""
        for token in tokens:
            self._advance(token)

    def _advance(self, token: int) -> int:
        """Consume one token; 1 where the matcher counted it. EOS after a complete output (the
        matcher stopped on its own) is not consumed: llguidance would take it without counting
        it, so a rollback by the tokens given would undo one token too many."""
        if self._matcher.is_stopped() and token in self._eos:
            return 0
        self._matcher.consume_token(token)
        return 1

    def _rewind(self, consumed: int) -> None:
        if consumed:
            self._matcher.rollback(consumed)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens the grammar accepts from here."""
        return self._matcher.validate_tokens(list(tokens)) if tokens else 0

    @property
    def complete(self) -> bool:
        return self._matcher.is_stopped() or self._matcher.is_error()


class _BytesVocabulary:
    """llguidance's view of a tokenizer that spells each id's bytes itself (vocabulary_bytes)."""

    def __init__(self, tokenizer, eos_ids: Sequence[int]) -> None:
        self.tokens = list(tokenizer.vocabulary_bytes())
        self.eos_token_id = eos_ids[0]
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self.special_token_ids = sorted({*eos_ids, *(i for i, b in enumerate(self.tokens) if b[:1] == b"\xff")})
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text))
