"""What a generation's deltas become: the whole answer of a non-streaming request, or the
server-sent events of a streaming one (both from the same deltas, so they carry the same text),
with echo, logprobs, tool calls and provenance where the request asked for them."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request

from tandem.server.async_engine import Delta, Generation
from tandem.server.context import ServingContext
from tandem.server.logprobs import TextOffsets
from tandem.server.protocol import ChatCompletionRequest, NamedToolChoice, SamplingFields
from tandem.server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    Provenance,
    RoundAcceptance,
    TokenPiece,
    ToolCall,
    ToolCallDelta,
    ToolCallFunction,
    Usage,
    error_payload,
)
from tandem.types import SpecStats

# After a request's body, its ASGI receive channel says nothing until the client disconnects
# (uvicorn); a server that answers receive() with more messages is asked again this much later.
DISCONNECT_POLL_S = 0.25


# Characters a JSON string may hold raw but that str.splitlines (and so httpx's aiter_lines, which
# many SSE clients read with) takes for line ends: a sampled token holding one cut its event in two
# there, and the client failed to parse either half (seen once in `tandem bench soak`). Escaped,
# the event is one line for every reader and decodes to the same text.
LINE_BREAKING = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload) -> str:
    """One server-sent event: `data: ` and the payload's JSON (or the string as it is), on one line."""
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data.translate(LINE_BREAKING)}\n\n"


@dataclass
class Echo:
    """What completions' echo puts before each choice: its prompt's text and tokens (choice i
    echoes prompt i // n), and whether nothing generated follows (max_tokens 0)."""

    texts: list[str]
    prompts: list[list[int]]
    n: int
    scoring_only: bool

    @classmethod
    async def of(cls, ctx: ServingContext, body: SamplingFields, prompts: list[list[int]]) -> "Echo | None":
        if not body.echoes_prompt:
            return None
        texts = [p if isinstance(p, str) else await ctx.tokenize(lambda p=p: ctx.tokenizer.decode(p))
                 for p in body.prompt_list()]
        return cls(texts, prompts, body.n, body.max_tokens == 0)

    def text(self, choice: int) -> str:
        return self.texts[choice // self.n]

    def prompt(self, choice: int) -> list[int]:
        return self.prompts[choice // self.n]


async def chat_response(ctx: ServingContext, body: ChatCompletionRequest, api_id: str, prompt_tokens: int,
                        texts: dict[int, str], outputs: dict[int, Delta],
                        provenance: dict[int, Provenance]) -> ChatCompletionResponse:
    """The chat answer of a drained generation (tool calls and logprobs where asked for)."""
    usage, spec = usage_of(prompt_tokens, outputs)
    entries = {i: d.output.logprobs for i, d in outputs.items()} if body.logprobs_count is not None else {}
    choices = []
    for i in sorted(texts):
        message, reason = AssistantMessage(content=texts[i]), outputs[i].finish_reason
        if body.calls_tool:
            message, reason = tool_call_message(body, texts[i], reason)
        choices.append(ChatChoice(index=i, message=message, finish_reason=reason, provenance=provenance.get(i),
                                  logprobs=await ctx.chat_logprobs(entries[i]) if entries else None))
    return ChatCompletionResponse(id=api_id, model=ctx.model_name, choices=choices, usage=usage, spec=spec)


async def completion_response(ctx: ServingContext, body: SamplingFields, api_id: str, prompt_tokens: int,
                              texts: dict[int, str], outputs: dict[int, Delta], provenance: dict[int, Provenance],
                              echo: Echo | None) -> CompletionResponse:
    """The completions answer of a drained generation (echo and logprobs where asked for)."""
    usage, spec = usage_of(prompt_tokens, outputs, echo is not None and echo.scoring_only)
    entries = {i: d.output.logprobs for i, d in outputs.items()} if body.logprobs_count is not None else {}
    choices = []
    for i in sorted(texts):
        text, logprobs, reason = texts[i], None, outputs[i].finish_reason
        if echo is not None:  # the prompt first; with max_tokens 0 only the prompt
            generated = "" if echo.scoring_only else text
            text = echo.text(i) + generated
            reason = "length" if echo.scoring_only else reason
        if entries:
            logprobs = await choice_logprobs(ctx, echo, i, outputs[i].output.prompt_logprobs, entries[i])
        choices.append(CompletionChoice(index=i, text=text, finish_reason=reason, provenance=provenance.get(i),
                                        logprobs=logprobs))
    return CompletionResponse(id=api_id, model=ctx.model_name, choices=choices, usage=usage, spec=spec)


def tool_call_message(body: ChatCompletionRequest, text: str, reason: str | None) -> tuple[AssistantMessage, str | None]:
    """An answer held to a tool call's schema (ChatCompletionRequest.tool_call_output) as
    OpenAI's assistant message with one tool call, finish_reason tool_calls. An answer that
    max_tokens cut short is not a call: it stays the message's content, finish_reason length."""
    if reason != "stop":
        return AssistantMessage(content=text), reason
    if isinstance(body.tool_choice, NamedToolChoice):
        name, arguments = body.tool_choice.function.name, text
    else:
        try:
            call = json.loads(text)
            name, arguments = call["name"], json.dumps(call["arguments"], separators=(",", ":"), ensure_ascii=False)
        except (ValueError, KeyError, TypeError):  # a stop string cut the call short
            return AssistantMessage(content=text), reason
    tool_call = ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=ToolCallFunction(name=name, arguments=arguments))
    return AssistantMessage(content=None, tool_calls=[tool_call]), "tool_calls"


async def choice_logprobs(ctx: ServingContext, echo: Echo | None, choice: int,
                          prompt_entries: list | None, entries: list,
                          offsets: TextOffsets | None = None) -> CompletionLogprobs:
    """A choice's legacy logprobs: with echo its prompt tokens' first (the first one's null),
    then its generated tokens' (none with max_tokens 0), whose text offsets continue from the
    end of the prompt's text; offsets: where the generated tokens' text starts (a stream's, which
    goes on moving), else from there."""
    if echo is None:
        return await ctx.completion_logprobs(entries, offsets or TextOffsets())
    scored = await ctx.completion_logprobs(prompt_entries, TextOffsets(text=echo.text(choice)),
                                           unscored=echo.prompt(choice)[0])
    if echo.scoring_only:
        return scored
    generated = await ctx.completion_logprobs(entries, offsets or TextOffsets(len(echo.text(choice))))
    return CompletionLogprobs(**{field: getattr(scored, field) + getattr(generated, field)
                                 for field in CompletionLogprobs.model_fields})


async def drain(gen: Generation, request: Request,
                 provenance: bool) -> tuple[dict[int, str], dict[int, Delta], dict[int, Provenance]]:
    """Collect every delta (text, final delta and, when asked for, provenance per choice);
    abort the generation if the client goes away first. The final delta's output holds the
    choice's logprobs whole."""

    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            await asyncio.sleep(DISCONNECT_POLL_S)
        gen.abort()  # at once: the engine drops the request at its next step

    watcher = asyncio.create_task(watch())
    texts: dict[int, str] = {i: "" for i in range(len(gen.choices))}
    finals: dict[int, Delta] = {}
    origins = {i: Provenance(pieces=[], rounds=[]) for i in range(len(gen.choices))} if provenance else {}
    try:
        async for index, delta in gen:
            texts[index] += delta.text
            if provenance:
                new = _provenance(delta)
                origins[index].pieces += new.pieces
                origins[index].rounds += new.rounds
            if delta.finish_reason is not None:
                finals[index] = delta
    finally:
        watcher.cancel()
        gen.abort()  # no-op when every choice finished
    return texts, finals, origins


def _provenance(delta: Delta) -> Provenance:
    """A delta's text cut by who wrote it, and the round that produced it (if one ran)."""
    pieces = [TokenPiece(text=text, origin=origin) for text, origin in delta.text_origins or ()]
    rounds = [] if delta.round is None else [RoundAcceptance(depth=delta.round.depth, accepted=delta.round.accepted)]
    return Provenance(pieces=pieces, rounds=rounds)


def usage_of(prompt_tokens: int, finals: dict[int, Delta], scoring_only: bool = False) -> tuple[Usage, dict]:
    """Usage over every choice (no completion tokens where echo with max_tokens 0 returned
    none) and the choices' speculation stats."""
    completion = 0 if scoring_only else sum(len(d.output.token_ids) for d in finals.values() if d.output is not None)
    stats = SpecStats()
    for d in finals.values():
        if d.output is not None:
            stats.merge(d.output.spec)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion,
                 total_tokens=prompt_tokens + completion), stats.as_dict()


def _error_event(delta: Delta) -> str:
    return sse(json.dumps(error_payload(delta.error, "internal_error")))


async def stream_completion(ctx, gen: Generation, api_id: str, prompt_tokens: int, include_usage: bool,
                             provenance: bool, echo: Echo | None) -> AsyncIterator[str]:
    finals: dict[int, Delta] = {}
    text_offsets = [TextOffsets() for _ in gen.choices]  # where each choice's next token's text starts
    echoed = [echo is None] * len(gen.choices)  # with echo: whether the choice's prompt went out yet
    try:
        async for index, delta in gen:
            if delta.error:
                yield _error_event(delta)
            if delta.finish_reason is not None:
                finals[index] = delta
            text, entries, reason, logprobs = delta.text, delta.logprobs, delta.finish_reason, None
            if echo is not None and echo.scoring_only:  # what was generated to score the prompt stays here
                text, entries = "", None
                reason = reason and "length"
            if not echoed[index] and (delta.token_ids or reason is not None):  # the prompt first
                echoed[index] = True
                text_offsets[index] = TextOffsets(len(echo.text(index)))  # generated tokens follow the prompt's text
                if delta.prompt_logprobs is not None:
                    logprobs = await choice_logprobs(ctx, echo, index, delta.prompt_logprobs, entries or [],
                                                     text_offsets[index])
                    entries = None
                text = echo.text(index) + text
            if entries:
                logprobs = await ctx.completion_logprobs(entries, text_offsets[index])
            if text or logprobs or reason is not None or (provenance and delta.round is not None):
                choice = CompletionChoice(index=index, text=text, finish_reason=reason,
                                          provenance=_provenance(delta) if provenance else None, logprobs=logprobs)
                yield sse(CompletionResponse(id=api_id, model=ctx.model_name, choices=[choice]))
        if include_usage:
            usage, spec = usage_of(prompt_tokens, finals, echo is not None and echo.scoring_only)
            yield sse(CompletionResponse(id=api_id, model=ctx.model_name, choices=[], usage=usage, spec=spec))
        yield sse("[DONE]")
    finally:
        gen.abort()  # the client went away mid-stream (or we finished: then a no-op)


async def stream_chat(ctx, gen: Generation, api_id: str, prompt_tokens: int, include_usage: bool,
                       provenance: bool, tool_call: ChatCompletionRequest | None) -> AsyncIterator[str]:
    """Chat chunks; with tool_call (the request whose answer is a call) the answer is held back
    and sent whole as the call's one tool_calls delta when it ends (its logprobs as they come)."""
    finals: dict[int, Delta] = {}
    held = [""] * len(gen.choices)

    def chunk(choices, **kw):
        return sse(ChatCompletionChunk(id=api_id, model=ctx.model_name, choices=choices, **kw))

    try:
        yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))
                     for i in range(len(gen.choices))])
        async for index, delta in gen:
            if delta.error:
                yield _error_event(delta)
            text = delta.text
            if tool_call is not None:
                held[index] += text
                text = ""
            if text or delta.logprobs or (provenance and delta.round is not None):
                logprobs = await ctx.chat_logprobs(delta.logprobs) if delta.logprobs else None
                yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(content=text),
                                             provenance=_provenance(delta) if provenance else None,
                                             logprobs=logprobs)])
            if delta.finish_reason is not None:
                finals[index] = delta
                reason = delta.finish_reason
                if tool_call is not None and not delta.error:
                    message, reason = tool_call_message(tool_call, held[index], reason)
                    calls = [ToolCallDelta(index=0, **c.model_dump()) for c in message.tool_calls or ()]
                    yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(content=message.content,
                                                                              tool_calls=calls or None))])
                yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason=reason)])
        if include_usage:
            usage, spec = usage_of(prompt_tokens, finals)
            yield chunk([], usage=usage, spec=spec)
        yield sse("[DONE]")
    finally:
        gen.abort()
