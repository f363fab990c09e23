"""What every route shares: the engine, the served name, the tokenizer on its own thread, and
the error a route raises to answer in OpenAI's error shape."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from tandem.grammar import GrammarCompiler
from tandem.server.async_engine import AsyncEngine
from tandem.server.logprobs import TextOffsets, TokenStrings, chat_logprobs, completion_logprobs
from tandem.server.responses import ChatLogprobs, CompletionLogprobs
from tandem.types import TokenLogprob

T = TypeVar("T")

# Normalizers may change a text's length; the early length check (ServingContext) allows for it.
TEXT_GROWTH_ALLOWANCE = 2


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


class ServingContext:
    """What the routes need: the engine, the served name, the context length, the tokenizer and
    the thread that runs it (tokenizing a long prompt must not hold up the event loop, and so
    every stream)."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        # Its own copy, used only on its own thread: the engine thread decodes with the original at
        # the same time, and a Rust tokenizer used from two threads at once can fail with
        # "Already borrowed".
        self.tokenizer = copy.deepcopy(engine.engine.tokenizer)
        self.max_model_len = engine.engine.config.max_model_len
        self.vocab_size = engine.engine.loaded.config.vocab_size
        self.max_token_chars = longest_token_chars(self.tokenizer)
        self.token_strings = TokenStrings(self.tokenizer)  # logprobs' token texts, on the same thread
        # Structured outputs are compiled here first (on the same thread), so a bad one is a 400.
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, sorted(engine.engine.eos_ids))
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-tokenize")

    async def tokenize(self, fn: Callable[[], T]) -> T:
        """fn, which uses self.tokenizer, on the tokenizer's own thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def completion_logprobs(self, entries: list[TokenLogprob | None], offsets: TextOffsets,
                                  unscored: int | None = None) -> CompletionLogprobs:
        return await self.tokenize(lambda: completion_logprobs(entries, self.token_strings, offsets, unscored))

    async def chat_logprobs(self, entries: list[TokenLogprob]) -> ChatLogprobs:
        return await self.tokenize(lambda: chat_logprobs(entries, self.token_strings))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def check_text_length(self, chars: int, param: str) -> None:
        """Refuse, before tokenizing it, a text that cannot fit the context: it has at least
        chars / max_token_chars tokens (no token covers more characters than its vocabulary
        entry spells)."""
        if self.max_token_chars is None:
            return
        least = chars // (self.max_token_chars * TEXT_GROWTH_ALLOWANCE)
        if least >= self.max_model_len:
            raise APIError(400, f"the prompt has {chars} characters, so at least {least} tokens; this model's "
                                f"context is {self.max_model_len} tokens: shorten the prompt", param=param,
                           code="context_length_exceeded")


def longest_token_chars(tokenizer) -> int | None:
    """The most characters one vocabulary entry spells (byte-level BPE spells a byte per
    character, SentencePiece a character per character, so no token covers more text), or
    None for a tokenizer without a vocabulary to read."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    vocab = get_vocab() if get_vocab is not None else None
    return max(map(len, vocab)) if vocab else None
