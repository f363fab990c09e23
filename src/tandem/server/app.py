"""The FastAPI app: OpenAI-compatible routes over an AsyncEngine.

Every call becomes one Generation (n choices per prompt); a streaming response turns its deltas
into server-sent events, a non-streaming one drains the same deltas, so both produce the same
text. Errors use OpenAI's body {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import uuid
from dataclasses import dataclass
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.config import SamplingParams, ServerConfig, StructuredOutput
from tandem.grammar import GrammarCompiler
from tandem.llm import chat_token_ids
from tandem.server.async_engine import AsyncEngine, Delta, EngineStoppedError, Generation, QueueFullError
from tandem.server.guard import RequestGuard
from tandem.server.logprobs import TokenStrings, chat_logprobs, completion_logprobs
from tandem.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    NamedToolChoice,
    Provenance,
    RoundAcceptance,
    SamplingFields,
    TokenPiece,
    ToolCall,
    ToolCallDelta,
    ToolCallFunction,
    Usage,
    error_payload,
)
from tandem.server.playground import playground_html
from tandem.types import SpecStats, TokenLogprob

log = logging.getLogger("tandem.server")
T = TypeVar("T")

DISCONNECT_POLL_S = 0.25
# Normalizers may change a text's length; the early length check (ServingContext) allows for it.
TEXT_GROWTH_ALLOWANCE = 2


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_response(status: int, message: str, type_: str, param: str | None = None, code=None, headers=None) -> JSONResponse:
    return JSONResponse(error_payload(message, type_, param, code), status_code=status, headers=headers)


def _sse(payload) -> str:
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


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

    async def completion_logprobs(self, entries: list[TokenLogprob | None], offset: int,
                                  unscored: int | None = None) -> CompletionLogprobs:
        return await self.tokenize(lambda: completion_logprobs(entries, self.token_strings, offset, unscored))

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


def build_app(engine: AsyncEngine, model_name: str, *, api_key: str | None = None,
              max_request_bytes: int | None = ServerConfig.max_request_bytes) -> FastAPI:
    """api_key: every route but /health and the playground page (/) then needs `Authorization:
    Bearer <api_key>`;
    max_request_bytes: larger bodies get 413 unread (None: no cap)."""
    ctx = ServingContext(engine, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        log.info("serving %s (max_model_len %d)", model_name, ctx.max_model_len)
        yield
        # uvicorn has already let in-flight requests run for its drain timeout (SIGTERM) and
        # cancelled the rest; whatever the engine still holds is aborted now.
        await engine.stop(timeout_s=0.0)
        ctx.close()

    app = FastAPI(title="tandem", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible server with lossless speculative decoding",
                  responses={400: {"model": ErrorResponse}, 404: {"model": ErrorResponse},
                             503: {"model": ErrorResponse}})
    _add_error_handlers(app)
    _add_routes(app, ctx)
    app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=max_request_bytes)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's body shape: ours, request validation, HTTP errors and the unexpected."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        headers = {"Retry-After": "1"} if err.status == 503 else None
        return error_response(err.status, err.message, err.type, err.param, err.code, headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        if first.get("type") == "json_invalid":
            detail = (first.get("ctx") or {}).get("error", "")
            return error_response(400, f"the request body is not valid JSON: {detail}", "invalid_request_error")
        param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None  # loc starts with "body"
        if param is None and first.get("type") == "model_attributes_type":
            message = "the request body must be a JSON object (send Content-Type: application/json)"
        return error_response(400, f"{param}: {message}" if param else message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        type_ = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return error_response(err.status_code, str(err.detail), type_)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception):
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(err).__name__}: {err}", "internal_error")


def _add_routes(app: FastAPI, ctx: ServingContext) -> None:
    engine, model_name = ctx.engine, ctx.model_name

    @app.get("/health")
    async def health():
        if not engine.healthy:
            raise APIError(503, "the engine is not running (shutting down)", "service_unavailable")
        return {"status": "ok"}

    @app.get("/", include_in_schema=False)
    async def playground():
        return HTMLResponse(playground_html())

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        spec = engine.engine.config.spec
        return ModelList(data=[ModelCard(id=model_name, max_model_len=ctx.max_model_len,
                                         speculative_algorithm=spec.algorithm,
                                         speculative_num_draft_tokens=spec.max_draft_len if spec.algorithm else 0)])

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions", response_model=CompletionResponse)
    async def completions(body: CompletionRequest, request: Request):
        prompts = [await _encode_prompt(ctx, p) for p in body.prompt_list()]
        return await _serve(ctx, body, prompts, request, chat=False)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        prompt = await _encode_chat(ctx, body)
        return await _serve(ctx, body, [prompt], request, chat=True)


# ---- request -> engine ------------------------------------------------------------------------


async def _encode_prompt(ctx: ServingContext, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, list):
        bad = [t for t in prompt if not 0 <= t < ctx.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {ctx.vocab_size})", param="prompt")
        return list(prompt)
    ctx.check_text_length(len(prompt), "prompt")
    ids = await ctx.tokenize(lambda: ctx.tokenizer.encode(prompt))
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    return list(ids)


async def _encode_chat(ctx: ServingContext, body: ChatCompletionRequest) -> list[int]:
    tok = ctx.tokenizer
    if getattr(tok, "chat_template", None) is None:
        raise APIError(400, f"{ctx.model_name} has no chat template; use /v1/completions", param="messages")
    messages = [{"role": m.role, "content": m.text(),
                 **{k: v for k, v in (("name", m.name), ("tool_calls", m.tool_calls), ("tool_call_id", m.tool_call_id))
                    if v is not None}}
                for m in body.messages]
    ctx.check_text_length(sum(len(m["content"]) for m in messages), "messages")
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    try:
        return await ctx.tokenize(lambda: chat_token_ids(tok, messages, tools))
    except Exception as err:  # jinja raises for conversations a template rejects (role order ...)
        raise APIError(400, f"the chat template rejected these messages: {err}", param="messages") from err


async def _structured_output(ctx: ServingContext, body: SamplingFields) -> StructuredOutput | None:
    """The request's structured output, compiled once on the tokenizer thread: an invalid one is
    a 400 naming the field it came from."""
    param = "structured_outputs" if body.structured_outputs is not None else "response_format"
    if getattr(body, "calls_tool", False) and body.structured_outputs is None and body.response_format is None:
        param = "tool_choice"
    try:
        spec = body.structured_output()
        if spec is not None:
            await ctx.tokenize(lambda: ctx.grammars.check(spec))
    except ValueError as err:  # GrammarError is one
        raise APIError(400, str(err), param=param) from err
    return spec


def _sampling_params(ctx: ServingContext, body: SamplingFields, prompts: list[list[int]],
                     structure: StructuredOutput | None) -> list[list[SamplingParams]]:
    """One SamplingParams per choice of each prompt; checks each prompt fits the context."""
    if body.max_tokens == 0 and not body.echoes_prompt:
        raise APIError(400, "max_tokens must be at least 1 (0 only with echo on /v1/completions)", param="max_tokens")
    try:
        biases = body.token_biases(ctx.vocab_size)
    except ValueError as err:
        raise APIError(400, str(err), param="logit_bias") from err
    out = []
    engine = ctx.engine.engine
    param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    for p in prompts:
        room = ctx.max_model_len - len(p)
        if room < 1:
            raise APIError(400, f"the prompt has {len(p)} tokens; this model's context is {ctx.max_model_len} "
                                "tokens: shorten the prompt", param=param, code="context_length_exceeded")
        if body.max_tokens is not None and body.max_tokens > room:
            raise APIError(400, f"max_tokens {body.max_tokens} + the prompt's {len(p)} tokens exceed this model's "
                                f"context of {ctx.max_model_len} tokens: ask for at most {room}", param="max_tokens",
                           code="context_length_exceeded")
        # Admission reserves prompt + max_tokens of KV cache (Admission.max_total_tokens for all requests).
        kv_room = engine.admission.max_tokens_room(len(p))
        if kv_room < 1 or (body.max_tokens is not None and body.max_tokens > kv_room):
            raise APIError(400, f"the prompt's {len(p)} tokens and max_tokens {body.max_tokens} exceed the KV cache this "
                                f"server holds for all requests ({engine.admission.max_total_tokens} tokens, --max-total-tokens): "
                                f"ask for at most {max(kv_room, 0)} tokens", param="max_tokens",
                           code="context_length_exceeded")
        room = kv_room
        choices = []
        for i in range(body.n):
            seed = None if body.seed is None else (body.seed + i) % 2**64
            try:
                choices.append(SamplingParams(
                    temperature=body.temperature, top_k=max(0, body.top_k), top_p=body.top_p, min_p=body.min_p,
                    repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
                    frequency_penalty=body.frequency_penalty,
                    # max_tokens 0 (echo: the prompt scored): one token is generated and not returned.
                    max_tokens=room if body.max_tokens is None else max(body.max_tokens, 1),
                    seed=seed, stop=body.stops, ignore_eos=body.ignore_eos,
                    max_draft_tokens=body.speculative_num_draft_tokens, token_origins=body.return_provenance,
                    logprobs=body.logprobs_count, structured_output=structure,
                    prompt_logprobs=body.logprobs_count if body.echoes_prompt else None, logit_bias=biases,
                ))
            except ValueError as err:
                raise APIError(400, str(err)) from err
        out.append(choices)
    return out


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


async def _serve(ctx: ServingContext, body: SamplingFields, prompts: list[list[int]], request: Request, chat: bool):
    if body.model is not None and body.model != ctx.model_name:
        raise APIError(404, f"the model {body.model!r} does not exist; this server serves {ctx.model_name!r}",
                       param="model", code="model_not_found")
    params = _sampling_params(ctx, body, prompts, await _structured_output(ctx, body))
    flat_prompts = [p for p, ps in zip(prompts, params) for _ in ps]
    flat_params = [sp for ps in params for sp in ps]
    if len(flat_params) > ctx.engine.capacity:
        raise APIError(400, f"{len(prompts)} prompts x n={body.n} = {len(flat_params)} generations exceed what this "
                            f"server holds at once ({ctx.engine.capacity}); split the request", param="n")
    api_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    try:
        gen = ctx.engine.submit(flat_prompts, flat_params, api_id)
    except QueueFullError as err:
        raise APIError(503, str(err), "service_unavailable", code="queue_full") from err
    except EngineStoppedError as err:
        raise APIError(503, str(err), "service_unavailable", code="shutting_down") from err
    prompt_tokens = sum(len(p) for p in prompts)
    echo = await Echo.of(ctx, body, prompts)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = (_stream_chat(ctx, gen, api_id, prompt_tokens, include_usage, body.return_provenance,
                               body if chat and body.calls_tool else None) if chat else
                  _stream_completion(ctx, gen, api_id, prompt_tokens, include_usage, body.return_provenance, echo))
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    texts, outputs, provenance = await _drain(gen, request, body.return_provenance)
    if len(outputs) < len(gen.choices):  # the client went away and the generation was aborted
        return Response(status_code=499)
    if any(o.error for o in outputs.values()):
        message = next(o.error for o in outputs.values() if o.error)
        raise APIError(500, message, "internal_error")
    usage, spec = _usage(prompt_tokens, outputs, echo is not None and echo.scoring_only)
    model = ctx.model_name
    entries = {i: d.output.logprobs for i, d in outputs.items()} if body.logprobs_count is not None else {}
    if chat:
        choices = []
        for i in sorted(texts):
            message, reason = AssistantMessage(content=texts[i]), outputs[i].finish_reason
            if body.calls_tool:
                message, reason = _tool_call_message(body, texts[i], reason)
            choices.append(ChatChoice(index=i, message=message, finish_reason=reason, provenance=provenance.get(i),
                                      logprobs=await ctx.chat_logprobs(entries[i]) if entries else None))
        return ChatCompletionResponse(id=api_id, model=model, choices=choices, usage=usage, spec=spec)
    choices = []
    for i in sorted(texts):
        text, logprobs, reason = texts[i], None, outputs[i].finish_reason
        if echo is not None:  # the prompt first; with max_tokens 0 only the prompt
            generated = "" if echo.scoring_only else text
            text = echo.text(i) + generated
            reason = "length" if echo.scoring_only else reason
        if entries:
            logprobs = await _completion_logprobs(ctx, echo, i, outputs[i].output.prompt_logprobs, entries[i])
        choices.append(CompletionChoice(index=i, text=text, finish_reason=reason, provenance=provenance.get(i),
                                        logprobs=logprobs))
    return CompletionResponse(id=api_id, model=model, choices=choices, usage=usage, spec=spec)


def _tool_call_message(body: ChatCompletionRequest, text: str, reason: str | None) -> tuple[AssistantMessage, str | None]:
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
            name, arguments = call["name"], json.dumps(call["arguments"])
        except (ValueError, KeyError, TypeError):  # a stop string cut the call short
            return AssistantMessage(content=text), reason
    tool_call = ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=ToolCallFunction(name=name, arguments=arguments))
    return AssistantMessage(content=None, tool_calls=[tool_call]), "tool_calls"


async def _completion_logprobs(ctx: ServingContext, echo: Echo | None, choice: int,
                               prompt_entries: list | None, entries: list, offset: int = 0) -> CompletionLogprobs:
    """A choice's legacy logprobs: with echo its prompt tokens' first (the first one's null),
    then its generated tokens' (none with max_tokens 0), whose text offsets continue from the
    end of the prompt's text."""
    if echo is None:
        return await ctx.completion_logprobs(entries, offset)
    scored = await ctx.completion_logprobs(prompt_entries, offset, unscored=echo.prompt(choice)[0])
    if echo.scoring_only:
        return scored
    generated = await ctx.completion_logprobs(entries, offset + len(echo.text(choice)))
    return CompletionLogprobs(**{field: getattr(scored, field) + getattr(generated, field)
                                 for field in CompletionLogprobs.model_fields})


async def _drain(gen: Generation, request: Request,
                 provenance: bool) -> tuple[dict[int, str], dict[int, Delta], dict[int, Provenance]]:
    """Collect every delta (text, final delta and, when asked for, provenance per choice);
    abort the generation if the client goes away first. The final delta's output holds the
    choice's logprobs whole."""

    async def watch():
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            if await request.is_disconnected():
                gen.abort()
                return

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


def _usage(prompt_tokens: int, finals: dict[int, Delta], scoring_only: bool = False) -> tuple[Usage, dict]:
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
    return _sse(json.dumps({"error": {"message": delta.error, "type": "internal_error", "param": None, "code": None}}))


async def _stream_completion(ctx, gen: Generation, api_id: str, prompt_tokens: int, include_usage: bool,
                             provenance: bool, echo: Echo | None) -> AsyncIterator[str]:
    finals: dict[int, Delta] = {}
    text_offsets = [0] * len(gen.choices)  # where each choice's next token's text starts (logprobs)
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
                text_offsets[index] = len(echo.text(index))  # generated tokens' offsets follow the prompt's text
                if delta.prompt_logprobs is not None:
                    logprobs = await _completion_logprobs(ctx, echo, index, delta.prompt_logprobs, entries or [])
                    text_offsets[index] += sum(len(t) for t in logprobs.tokens[len(delta.prompt_logprobs):])
                    entries = None
                text = echo.text(index) + text
            if entries:
                logprobs = await ctx.completion_logprobs(entries, text_offsets[index])
                text_offsets[index] += sum(len(t) for t in logprobs.tokens)
            if text or logprobs or reason is not None or (provenance and delta.round is not None):
                choice = CompletionChoice(index=index, text=text, finish_reason=reason,
                                          provenance=_provenance(delta) if provenance else None, logprobs=logprobs)
                yield _sse(CompletionResponse(id=api_id, model=ctx.model_name, choices=[choice]))
        if include_usage:
            usage, spec = _usage(prompt_tokens, finals, echo is not None and echo.scoring_only)
            yield _sse(CompletionResponse(id=api_id, model=ctx.model_name, choices=[], usage=usage, spec=spec))
        yield _sse("[DONE]")
    finally:
        gen.abort()  # the client went away mid-stream (or we finished: then a no-op)


async def _stream_chat(ctx, gen: Generation, api_id: str, prompt_tokens: int, include_usage: bool,
                       provenance: bool, tool_call: ChatCompletionRequest | None) -> AsyncIterator[str]:
    """Chat chunks; with tool_call (the request whose answer is a call) the answer is held back
    and sent whole as the call's one tool_calls delta when it ends (its logprobs as they come)."""
    finals: dict[int, Delta] = {}
    held = [""] * len(gen.choices)

    def chunk(choices, **kw):
        return _sse(ChatCompletionChunk(id=api_id, model=ctx.model_name, choices=choices, **kw))

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
                    message, reason = _tool_call_message(tool_call, held[index], reason)
                    calls = [ToolCallDelta(index=0, **c.model_dump()) for c in message.tool_calls or ()]
                    yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(content=message.content,
                                                                              tool_calls=calls or None))])
                yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason=reason)])
        if include_usage:
            usage, spec = _usage(prompt_tokens, finals)
            yield chunk([], usage=usage, spec=spec)
        yield _sse("[DONE]")
    finally:
        gen.abort()
