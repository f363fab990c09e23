"""The FastAPI app: OpenAI-compatible routes over an AsyncEngine.

Every call becomes one Generation (n choices per prompt); a streaming response turns its deltas
into server-sent events, a non-streaming one drains the same deltas, so both produce the same
text. Errors use OpenAI's body {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import logging
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.config import SamplingParams, ServerConfig, StructuredOutput
from tandem.llm import chat_token_ids
from tandem.server.answers import (
    Echo,
    chat_response,
    completion_response,
    drain,
    stream_chat,
    stream_completion,
    tool_call_message,
)
from tandem.server.async_engine import AsyncEngine, EngineStoppedError, QueueFullError
from tandem.server.context import APIError, ServingContext
from tandem.server.guard import RequestGuard
from tandem.server.playground import playground_html
from tandem.server.protocol import ChatCompletionRequest, CompletionRequest, FieldError, SamplingFields
from tandem.server.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    error_payload,
)

log = logging.getLogger("tandem.server")


def error_response(status: int, message: str, type_: str, param: str | None = None, code=None, headers=None) -> JSONResponse:
    return JSONResponse(error_payload(message, type_, param, code), status_code=status, headers=headers)


def build_app(engine: AsyncEngine, model_name: str, *, api_key: str | None = None,
              max_request_bytes: int | None = ServerConfig.max_request_bytes,
              request_read_timeout_s: float = ServerConfig.request_read_timeout_s,
              max_request_header_bytes: int | None = ServerConfig.max_request_header_bytes) -> FastAPI:
    """api_key: every route but /health and the playground page (/) then needs `Authorization:
    Bearer <api_key>`;
    max_request_bytes: larger bodies get 413 unread (None: no cap);
    request_read_timeout_s: a body that stops arriving for this long gets 408;
    max_request_header_bytes: larger request headers get 431 (None: no cap)."""
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
    app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=max_request_bytes,
                       read_timeout_s=request_read_timeout_s, max_header_bytes=max_request_header_bytes)
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
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, FieldError):  # a model validator's error about one field
            return error_response(400, str(cause), "invalid_request_error", cause.param)
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

    def model_card() -> ModelCard:
        spec = engine.engine.config.spec
        return ModelCard(id=model_name, max_model_len=ctx.max_model_len, speculative_algorithm=spec.algorithm,
                         speculative_num_draft_tokens=spec.max_round_tokens if spec.algorithm else 0)

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard)
    async def model(model_id: str):
        if model_id != model_name:
            raise APIError(404, f"the model {model_id!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        return model_card()

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions", response_model=CompletionResponse)
    async def completions(body: CompletionRequest, request: Request):
        _check_generations(ctx, len(body.prompt_list()), body.n)  # before tokenizing thousands of prompts
        prompts = [await _encode_prompt(ctx, p) for p in body.prompt_list()]
        return await _serve(ctx, body, prompts, request, chat=False)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_generations(ctx, 1, body.n)
        prompt = await _encode_chat(ctx, body)
        return await _serve(ctx, body, [prompt], request, chat=True)


# ---- request -> engine ------------------------------------------------------------------------


def _check_generations(ctx: ServingContext, prompts: int, n: int) -> None:
    """Refuse a call whose prompts x n generations exceed what the server holds at once."""
    if prompts * n > ctx.engine.capacity:
        raise APIError(400, f"{prompts} prompts x n={n} = {prompts * n} generations exceed what this server holds "
                            f"at once ({ctx.engine.capacity}); split the request", param="n")


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
        param = "tools"  # the schema comes from the tools' parameters
    try:
        spec = body.structured_output()
        if spec is not None:
            await ctx.tokenize(lambda: ctx.grammars.check(spec))
    except ValueError as err:  # GrammarError is one
        raise APIError(400, str(err), param=param) from err
    # The tools' schemas are checked when no call is asked for too: a client learns of a bad one at once.
    for tool in getattr(body, "tools", None) or ():
        try:
            schema = StructuredOutput.json_schema(tool.function.arguments_schema)
            await ctx.tokenize(lambda: ctx.grammars.check(schema))
        except ValueError as err:
            raise APIError(400, f"the parameters of tool {tool.function.name!r} are not a schema tandem can follow: "
                                f"{err}", param="tools") from err
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
    bad = [t for t in body.stop_token_ids or () if not 0 <= t < ctx.vocab_size]
    if bad:
        raise APIError(400, f"stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {ctx.vocab_size})",
                       param="stop_token_ids")
    if body.ignored_fields:
        log.warning("request fields tandem does not know, ignored: %s", ", ".join(body.ignored_fields))
    out = []
    engine = ctx.engine.engine
    param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    admission = engine.admission
    budget = admission.max_total_tokens
    draft = f" and one round's draft ({admission.draft_slots} slots)" if admission.draft_slots else ""
    for p in prompts:
        context_room = ctx.max_model_len - len(p)
        if context_room < 1:
            raise APIError(400, f"the prompt has {len(p)} tokens; this model's context is {ctx.max_model_len} "
                                "tokens: shorten the prompt", param=param, code="context_length_exceeded")
        # Admission reserves prompt + max_tokens + one round's draft of KV cache (max_total_tokens for all requests).
        kv_room = admission.max_tokens_room(len(p))
        if kv_room < 1:
            raise APIError(400, f"the prompt's {len(p)} tokens, one generated token{draft} need "
                                f"{len(p) + 1 + admission.draft_slots} KV-cache slots; this server holds {budget} for "
                                "all requests (--max-total-tokens): shorten the prompt", param=param,
                           code="context_length_exceeded")
        if body.max_tokens is not None and body.max_tokens > kv_room:
            if body.max_tokens > context_room:
                why = (f"max_tokens {body.max_tokens} + the prompt's {len(p)} tokens exceed this model's context of "
                       f"{ctx.max_model_len} tokens")
            else:
                why = (f"the prompt's {len(p)} tokens, max_tokens {body.max_tokens}{draft} need "
                       f"{len(p) + body.max_tokens + admission.draft_slots} KV-cache slots; this server holds "
                       f"{budget} for all requests (--max-total-tokens)")
            raise APIError(400, f"{why}: ask for at most {kv_room}", param="max_tokens", code="context_length_exceeded")
        room = kv_room
        if body.max_tokens is None and body.min_tokens > room:
            raise APIError(400, f"min_tokens {body.min_tokens} is more than the {room} tokens this prompt leaves room "
                                "for (the context and the KV budget)", param="min_tokens")
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
                    seed=seed, stop=body.stops, ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
                    max_draft_tokens=body.speculative_num_draft_tokens, token_origins=body.return_provenance,
                    logprobs=body.logprobs_count, structured_output=structure,
                    prompt_logprobs=body.logprobs_count if body.echoes_prompt else None, logit_bias=biases,
                    stop_token_ids=tuple(body.stop_token_ids or ()),
                ))
            except ValueError as err:
                raise APIError(400, str(err)) from err
        out.append(choices)
    return out


async def _serve(ctx: ServingContext, body: SamplingFields, prompts: list[list[int]], request: Request, chat: bool):
    if body.model is not None and body.model != ctx.model_name:
        raise APIError(404, f"the model {body.model!r} does not exist; this server serves {ctx.model_name!r}",
                       param="model", code="model_not_found")
    params = _sampling_params(ctx, body, prompts, await _structured_output(ctx, body))
    flat_prompts = [p for p, ps in zip(prompts, params) for _ in ps]
    flat_params = [sp for ps in params for sp in ps]
    api_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    prompt_tokens = sum(len(p) for p in prompts)
    finish_label = None
    if chat and body.calls_tool:  # the request counter counts what the answer reports
        def finish_label(delta):
            return tool_call_message(body, delta.output.text, delta.finish_reason)[1]
    try:
        gen = ctx.engine.submit(flat_prompts, flat_params, api_id, prompt_tokens, finish_label,
                                scoring_only=body.echoes_prompt and body.max_tokens == 0)
    except QueueFullError as err:
        raise APIError(503, str(err), "service_unavailable", code="queue_full") from err
    except EngineStoppedError as err:
        raise APIError(503, str(err), "service_unavailable", code="shutting_down") from err
    echo = await Echo.of(ctx, body, prompts)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = (stream_chat(ctx, gen, api_id, prompt_tokens, include_usage, body.return_provenance,
                               body if chat and body.calls_tool else None) if chat else
                  stream_completion(ctx, gen, api_id, prompt_tokens, include_usage, body.return_provenance, echo))
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    texts, outputs, provenance = await drain(gen, request, body.return_provenance)
    if len(outputs) < len(gen.choices):  # the client went away and the generation was aborted
        return Response(status_code=499)
    if any(o.error for o in outputs.values()):
        message = next(o.error for o in outputs.values() if o.error)
        raise APIError(500, message, "internal_error")
    if chat:
        return await chat_response(ctx, body, api_id, prompt_tokens, texts, outputs, provenance)
    return await completion_response(ctx, body, api_id, prompt_tokens, texts, outputs, provenance, echo)
