"""The OpenAI response bodies tandem sends (completions, chat completions and their stream
chunks, models, errors), as pydantic models; the requests are server/protocol.py. Parts that
only some requests ask for (provenance, tool calls) are left out of the others' responses, so
the OpenAI schema is unchanged for them.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, model_serializer

from tandem.types import TokenOrigin


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TokenPiece(BaseModel):
    """Text one output token wrote, and who wrote it: `accepted` (the drafter's token, kept by
    the target), `recovered` (the target's token where it rejected a draft), `bonus` (the
    target's extra token after a draft it kept whole) or `target` (a round without a draft)."""

    text: str
    origin: TokenOrigin


class RoundAcceptance(BaseModel):
    """One target forward: draft positions it graded (a chain's length, a tree's depth) and how
    many draft tokens it accepted. A prompt's forward grades none."""

    depth: int
    accepted: int


class Provenance(BaseModel):
    """Who wrote a choice's text (its pieces join to exactly the text or delta they come with)
    and the rounds that produced it. Text held back for stop strings or an unfinished UTF-8
    character arrives later with its own tokens' origins; a round arrives with the step that
    ran it."""

    pieces: list[TokenPiece]
    rounds: list[RoundAcceptance]


class LeavesOutAbsent(BaseModel):
    """A response part whose fields named in OMITTED are left out when None (not sent as null),
    so a response shows them only where they apply."""

    OMITTED: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _without_absent(self, handler):
        data = handler(self)
        for name in self.OMITTED:
            if data.get(name) is None:
                data.pop(name, None)
        return data


class ProvenanceChoice(LeavesOutAbsent):
    """A choice that carries `provenance` only when the request asked for it (return_provenance):
    otherwise the field is left out, so the OpenAI schema is unchanged."""

    OMITTED: ClassVar[tuple[str, ...]] = ("provenance",)

    provenance: Provenance | None = Field(None, description="extension: see return_provenance")


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: per output token its text, log-probability, the most likely
    alternatives with the sampled token among them, and where its text starts in the choice's
    text (counted from the start of the choice, across a stream's chunks)."""

    tokens: list[str]
    token_logprobs: list[float | None]  # null for an echoed prompt's first token (nothing predicts it)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(ProvenanceChoice):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    spec: dict[str, Any] | None = Field(None, description="speculation stats of this request (tandem extension)")


class ToolCallFunction(BaseModel):
    name: str
    arguments: str = Field(..., description="the arguments, JSON text")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ToolCallDelta(ToolCall):
    index: int


class AssistantMessage(LeavesOutAbsent):
    OMITTED: ClassVar[tuple[str, ...]] = ("tool_calls",)

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = Field(None, description="the token's UTF-8 bytes (a character may span tokens)")


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class ChatChoice(ProvenanceChoice):
    index: int
    message: AssistantMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    spec: dict[str, Any] | None = None


class ChatDelta(LeavesOutAbsent):
    OMITTED: ClassVar[tuple[str, ...]] = ("tool_calls",)

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(ProvenanceChoice):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    spec: dict[str, Any] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tandem"
    max_model_len: int
    speculative_algorithm: str | None = Field(None, description="extension: the drafter (None: plain decoding)")
    speculative_num_draft_tokens: int = Field(0, description="extension: the most draft tokens (tree nodes) a round "
                                                             "verifies")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_payload(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error body, as every error of the server carries it (ErrorResponse's shape)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
