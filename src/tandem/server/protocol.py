"""The OpenAI request bodies tandem serves (completions, chat completions), as pydantic models;
what it answers is server/responses.py. Constraints live on the fields, so bad values are
rejected before they reach the engine and the OpenAPI schema at /openapi.json states them.
`top_k`, `min_p`, `repetition_penalty`, `ignore_eos` and `min_tokens` are vLLM-style extensions; `spec` on
responses carries the request's speculation stats. `speculative_num_draft_tokens` caps one request's drafts, and
`return_provenance` adds `provenance` to its choices: the text cut by who wrote it (the drafter or
the target) and each round's acceptance; without it no choice carries the field.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    field_validator,
    model_validator,
)

from tandem.config import GREEDY_TEMPERATURE, MAX_LOGPROBS, MAX_TOP_K, SEED_RANGE, StructuredOutput

MAX_N = 16
MAX_STOP = 8
SEED_MIN, SEED_MAX = SEED_RANGE
# Fields OpenAI defines that tandem does not implement: a request asking for them gets a 400
# naming the field instead of a silently different answer.
UNSUPPORTED = {
    "echo": "echo (on /v1/completions only)",
    "suffix": "suffix (insertion)",
    "functions": "the legacy function calling (use tools)",
    "function_call": "the legacy function calling (use tool_choice)",
}


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class JsonSchemaFormat(BaseModel):
    name: str = Field(..., max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field({}, alias="schema", description="the JSON schema the output must match "
                                                                     "(empty: any JSON object)")
    strict: StrictBool | None = None

    model_config = ConfigDict(populate_by_name=True, extra="forbid")


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), json_object or json_schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema")
        return self

    def structured_output(self) -> StructuredOutput | None:
        if self.type == "json_object" or (self.type == "json_schema" and not self.json_schema.schema_):
            return StructuredOutput(json_object=True)
        if self.type == "json_schema":
            return StructuredOutput.json_schema(self.json_schema.schema_)
        return None


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs extension: exactly one of json (a schema), json_object, regex,
    choice or grammar (Lark)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: StrictBool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def structured_output(self) -> StructuredOutput:
        if self.json_ is not None:
            return StructuredOutput.json_schema(self.json_)
        return StructuredOutput(json_object=bool(self.json_object), regex=self.regex,
                                choice=tuple(self.choice) if self.choice is not None else None, grammar=self.grammar)


class FieldError(ValueError):
    """A request error about one field, which the error body names as its `param` (pydantic
    names the whole body for an error a model validator raises)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def lone_surrogate_at(value: Any, path: tuple[str, ...] = ()) -> str | None:
    """Where, in a request body as JSON decodes it, the first string holding a lone UTF-16
    surrogate is (JSON's `\\ud800` escape decodes to one, and no tokenizer or grammar can take
    it): its dotted path, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return ".".join(path) or "body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        # The path names the key as text the error body can carry: a surrogate in it escaped.
        name = str(key).encode("utf-8", "backslashreplace").decode("utf-8")
        found = lone_surrogate_at(key, (*path, name)) or lone_surrogate_at(item, (*path, name))
        if found is not None:
            return found
    return None


class SamplingFields(BaseModel):
    """Fields completions and chat completions share."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, description="the served model's id (GET /v1/models); optional")
    max_tokens: StrictInt | None = Field(None, ge=0, description="default: the rest of the context; 0 only with "
                                                                   "echo (the prompt scored, nothing generated)")
    max_completion_tokens: StrictInt | None = Field(None, ge=1, description="OpenAI's newer name for max_tokens")
    temperature: StrictFloat = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False,
                                     description=f"0 (or below {GREEDY_TEMPERATURE}) = greedy")
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: StrictInt = Field(0, ge=-1, le=MAX_TOP_K, description="extension; 0 or -1 disables")
    min_p: StrictFloat = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False, description="extension")
    repetition_penalty: StrictFloat = Field(1.0, ge=0.01, le=10.0, allow_inf_nan=False, description="extension")
    presence_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False,
                                          description="subtracted from the logit of every token generated so far")
    frequency_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False,
                                           description="times each generated token's count so far, subtracted from "
                                                       "its logit")
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    seed: StrictInt | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = Field(None, description=f"up to {MAX_STOP} non-empty strings")
    stop_token_ids: list[StrictInt] | None = Field(None, description="extension (vLLM's): generation also stops "
                                                                     "after any of these token ids")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = Field(False, description="extension: generate max_tokens even past EOS")
    min_tokens: StrictInt = Field(0, ge=0, description="extension (vLLM's): EOS and stop_token_ids cannot be "
                                                       "drawn, and stop strings do not end the answer, until this "
                                                       "many tokens are out")
    user: str | None = None
    speculative_num_draft_tokens: StrictInt | None = Field(
        None, ge=0, description="extension: at most this many draft tokens per round for this request "
                                "(0: plain decoding); the server's --speculative-num-draft-tokens caps it")
    return_provenance: StrictBool = Field(
        False, description="extension: each choice carries `provenance`, its text cut by who wrote it and the "
                           "acceptance of each speculative round")
    response_format: ResponseFormat | None = Field(None, description="text, json_object or json_schema: what the "
                                                                     "output must match")
    logit_bias: dict[str, StrictFloat] | None = Field(None, description="token id -> bias in [-100, 100], added to "
                                                                        "that token's logit before sampling")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="extension (vLLM's): the output must match a JSON schema, any JSON object, a regex, one "
                          "of a list of strings or a Lark grammar")

    @model_validator(mode="before")
    @classmethod
    def _prepare_body(cls, data):
        at = lone_surrogate_at(data)
        if at is not None:
            raise FieldError(at, "holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its pair), "
                                 "which is not text")
        if isinstance(data, dict):  # null is "unset" (OpenAI's fields are nullable): the field's default
            data = {k: v for k, v in data.items() if v is not None or k not in cls._null_means_default()}
        return data

    @classmethod
    @functools.cache  # per request class, once: not per request
    def _null_means_default(cls) -> frozenset[str]:
        """The fields whose default is a value, not None: a null sent for one means that default."""
        return frozenset(name for name, f in cls.model_fields.items() if not f.is_required() and f.default is not None)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_biases(cls, v):
        for key, bias in (v or {}).items():
            if not -100.0 <= bias <= 100.0:  # NaN fails too
                raise ValueError(f"the bias of token {key} is {bias}; biases are in [-100, 100]")
        return v

    @property
    def ignored_fields(self) -> list[str]:
        """Fields the request sent that tandem does not know (vLLM's and OpenAI's others, such as
        best_of): accepted and ignored, as vLLM does, and named in the server's log."""
        return sorted(name for name in (self.model_extra or {}) if name not in UNSUPPORTED)

    @model_validator(mode="after")
    def _check_unsupported(self):
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and value not in (None, False, 0, [], {}):
                raise FieldError(name, f"{UNSUPPORTED[name]} is not supported by tandem")
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "only allowed with stream=true")
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise FieldError("max_completion_tokens",
                                 "max_tokens and max_completion_tokens differ: send one of them")
            self.max_tokens = self.max_completion_tokens
        if self.max_tokens is not None and self.min_tokens > max(self.max_tokens, 1):
            raise FieldError("min_tokens", f"min_tokens {self.min_tokens} is more than max_tokens {self.max_tokens}")
        return self

    @property
    def echoes_prompt(self) -> bool:
        """Whether each choice's text starts with its prompt (completions' echo)."""
        return False

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def logprobs_count(self) -> int | None:
        """How many alternatives per output token the request asked for (None: no logprobs)."""
        return None

    def token_biases(self, vocab_size: int) -> dict[int, float]:
        """logit_bias with its keys as token ids; raises ValueError for a key that is not an id
        of the vocabulary (the biases' range is SamplingParams')."""
        out = {}
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()):  # int() would also take " 5", "1_0" and other scripts' digits
                raise ValueError(f"logit_bias keys are token ids (decimal digits), got {key!r}")
            token = int(key)
            if not 0 <= token < vocab_size:
                raise ValueError(f"logit_bias names token {token}, outside the vocabulary [0, {vocab_size})")
            out[token] = bias
        return out

    def structured_output(self) -> StructuredOutput | None:
        """What the output must match (response_format or structured_outputs), or None; raises
        ValueError when both are given or the spec is invalid."""
        specs = [f.structured_output() for f in (self.response_format, self.structured_outputs) if f is not None]
        specs = [spec for spec in specs if spec is not None]
        if len(specs) > 1:
            raise ValueError("give response_format or structured_outputs, not both")
        return specs[0] if specs else None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]] = Field(
        ..., description="text, texts, token ids, or lists of token ids (each is one prompt)"
    )
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                       description="each output token's log-probability and this many most likely "
                                                   "alternatives (the sampled token's is always included)")
    echo: StrictBool = Field(False, description="each choice's text starts with its prompt (and, with logprobs, "
                                                "its logprobs with the prompt tokens', the first one's null)")

    @property
    def logprobs_count(self) -> int | None:
        return self.logprobs

    @property
    def echoes_prompt(self) -> bool:
        return self.echo

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt_ids(cls, v):
        ids = [i for p in v for i in (p if isinstance(p, list) else [p])] if isinstance(v, list) else []
        if any(isinstance(i, bool) or not isinstance(i, (int, str)) for i in ids):
            raise ValueError("a prompt is a string, a list of strings, a list of token ids (integers) or a list of "
                             "such lists")
        return v

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt list is empty")
        if isinstance(v, list) and isinstance(v[0], list) and any(not p for p in v):
            raise ValueError("a token-id prompt is empty")
        return v

    def prompt_list(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str):
            return [self.prompt]
        if isinstance(self.prompt[0], int):
            return [list(self.prompt)]
        return list(self.prompt)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # An assistant turn's calls and a tool turn's answer, handed to the chat template as sent.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v):
        for part in v if isinstance(v, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"a content part of type {kind!r} is not supported: tandem's models read text "
                                 "parts only ({\"type\": \"text\", \"text\": ...})")
        return v

    @model_validator(mode="after")
    def _check_content(self):
        # OpenAI lets only an assistant message (one that called tools) omit its content.
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content: a {self.role} message needs content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool_call_id: a tool message needs the id of the call it answers")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDefinition(BaseModel):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments (none: the function "
                                                                "takes no arguments, as OpenAI defines it)")
    strict: StrictBool | None = None

    @property
    def arguments_schema(self) -> dict[str, Any]:
        """What a call's arguments must match: the parameters' schema, or without one an empty
        object (OpenAI: omitting parameters defines a function with an empty parameter list); an
        empty schema ({}) allows any object."""
        if self.parameters is None:
            return {"type": "object", "properties": {}, "additionalProperties": False}
        return self.parameters or {"type": "object"}


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: StrictBool = Field(False, description="each output token's log-probability")
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                           description="with logprobs: this many most likely alternatives per token")
    tools: list[Tool] | None = Field(None, description="functions the model may call (the chat template renders "
                                                         "them where it can)")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="required or a named function: the answer is a call, its arguments held to the "
                          "function's schema; auto (the default with tools) and none: the answer is text")
    parallel_tool_calls: StrictBool | None = Field(None, description="accepted; an answer makes one call")

    @model_validator(mode="after")
    def _check_top_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "needs logprobs=true")
        names = [t.function.name for t in self.tools or ()]
        twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
        if twice is not None:
            raise FieldError("tools", f"two tools are named {twice!r}: a call names its function, so names must differ")
        if self.tool_choice not in (None, "none", "auto"):
            if not names:
                raise FieldError("tool_choice", "needs tools")
            if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
                raise FieldError("tool_choice", f"names {self.tool_choice.function.name!r}, which is not among the "
                                                f"tools ({', '.join(names)})")
        return self

    @property
    def calls_tool(self) -> bool:
        """Whether the answer is a tool call (tool_choice required or a named function)."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def tool_call_output(self) -> StructuredOutput | None:
        """What a tool call's answer must match: a named function's arguments (its parameters'
        schema), or under required {"name": one of the tools, "arguments": its arguments}; as
        compact JSON (no whitespace between tokens of the JSON: arguments are read by programs,
        and a small model may otherwise pad them with spaces until max_tokens)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            tool = next(t for t in self.tools if t.function.name == self.tool_choice.function.name)
            schema = tool.function.arguments_schema
        elif self.tool_choice == "required":
            schema = {"anyOf": [
                {"type": "object", "required": ["name", "arguments"], "additionalProperties": False,
                 "properties": {"name": {"const": t.function.name},
                                "arguments": t.function.arguments_schema}}
                for t in self.tools]}
        else:
            return None
        return StructuredOutput.json_schema({**schema, "x-guidance": {"whitespace_flexible": False}})

    def structured_output(self) -> StructuredOutput | None:
        spec = super().structured_output()
        call = self.tool_call_output()
        if spec is not None and call is not None:
            raise ValueError("a tool call's arguments follow the tool's schema: give response_format or "
                             "structured_outputs, or tool_choice, not both")
        return call or spec

    @property
    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
