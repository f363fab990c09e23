"""Frozen configuration records, validated at construction so bad values fail early and clearly.

Values discovered at run time (a model's vocabulary, a measured cost curve) are returned by the
code that finds them, never written back into these records.
"""

from __future__ import annotations

import json as _json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from numbers import Integral
from typing import Any

DTYPES = ("float32", "bfloat16")
DEVICES = ("cpu", "cuda")
QUANTIZATIONS = ("auto", "none", "native", "int8", "int4")
GREEDY_TEMPERATURE = 1e-5

KV_CACHE_DTYPES = ("auto", "float32", "float16")
KV_CACHE_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16"}


def kv_cache_dtype_name(requested: str) -> str:
    """--kv-cache-dtype's value as one of KV_CACHE_DTYPES (aliases resolved); raises on others."""
    name = KV_CACHE_ALIASES.get(requested, requested)
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} (or fp32, fp16), got {requested!r}")
    return name


MAX_LOGPROBS = 20  # the most alternatives per token a request may ask for (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match (vLLM's structured outputs, OpenAI's response_format):
    exactly one of `json` (a JSON schema, as JSON text), `json_object` (any JSON object),
    `regex`, `choice` (exactly one of these strings) or `grammar` (a Lark grammar). The target's
    distribution at each position is then its distribution over the tokens that keep the output
    matching (tandem.grammar), for plain decoding and verification alike."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in ("json", "json_object", "regex", "choice", "grammar") if getattr(self, name)]
        if len(given) != 1:
            raise ValueError("a structured output names exactly one of json, json_object, regex, choice or grammar"
                             + (f"; got {', '.join(given)}" if given else ""))
        if self.json is not None:
            try:
                schema = _json.loads(self.json)
            except ValueError as err:
                raise ValueError(f"the JSON schema is not valid JSON: {err}") from None
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema is a JSON object")
        if self.choice is not None and not all(isinstance(c, str) and c for c in self.choice):
            raise ValueError("choice must be non-empty strings")

    @classmethod
    def json_schema(cls, schema: dict | str) -> "StructuredOutput":
        """From a schema given as a dict or as JSON text."""
        return cls(json=schema if isinstance(schema, str) else _json.dumps(schema))


# The largest top_k taken: any k past the vocabulary keeps every token, so a larger one means
# nothing, and one past 2**63 did not even fit the int64 tensors the engine samples with.
MAX_TOP_K = 2**31 - 1
SEED_RANGE = (-(2**63), 2**64 - 1)  # what a torch.Generator takes (a negative seed wraps)


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens and when it stops (vLLM-shaped).

    temperature 0 means greedy. top_k 0 / top_p 1 / min_p 0 / repetition_penalty 1 disable
    their filters. The processed distribution these define is what plain sampling draws from and
    what the verifier compares drafts against.

    repetition_penalty (CTRL's) acts on every token of prompt and output; presence_penalty and
    frequency_penalty (OpenAI's, in [-2, 2]) on the generated tokens only, as vLLM and SGLang
    apply them: logit[t] -= presence * (c_t > 0) + frequency * c_t, c_t the times t was generated.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 128
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # vLLM's min_tokens: EOS and stop_token_ids cannot be drawn, and stop strings do not end the
    # answer, until this many tokens are out (max_tokens still ends it).
    min_tokens: int = 0
    # Speculation for this request: at most this many draft tokens per round along a path (None:
    # the engine's setting; 0: plain decoding). Output is the same either way; only speed moves.
    max_draft_tokens: int | None = None
    # Each output token's log-probability under the target and its row's `logprobs` most likely
    # tokens (types.TokenLogprob); None: none are computed.
    logprobs: int | None = None
    # The same for every prompt token but the first (RequestOutput.prompt_logprobs). The prompt
    # is then computed whole, never taken from the prefix cache, whose rows hold no logits.
    prompt_logprobs: int | None = None
    # Record which tokens the drafter wrote and the target kept (Request.origin_pieces): costs a
    # detokenisation per token, so only requests that ask for it (the playground) pay.
    token_origins: bool = False
    # What the output must match (None: anything): see StructuredOutput.
    structured_output: StructuredOutput | None = None
    # OpenAI's logit_bias: (token id, bias) pairs, each bias in [-100, 100] added to that token's
    # logit before penalties, temperature and filters (-100 bans a token, +100 all but forces it).
    # A dict {id: bias} is accepted.
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if any(not isinstance(s, str) for s in self.stop):
            raise TypeError(f"stop must be a string or strings, got {self.stop!r}")
        for name in ("top_k", "max_tokens", "min_tokens", "seed", "max_draft_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, Integral)):
                required = name in ('top_k', 'max_tokens', 'min_tokens')
                raise TypeError(f"{name} must be an integer{'' if required else ' or None'}, got {value!r}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}] (64 bits), got {self.seed}")
        for name in ("ignore_eos", "token_origins"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise TypeError("structured_output must be a StructuredOutput (e.g. StructuredOutput(regex=...)), got "
                            f"{self.structured_output!r}")
        if any(isinstance(t, bool) or not isinstance(t, Integral) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids (integers >= 0), got {self.stop_token_ids!r}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        for token, value in self.logit_bias:
            if token < 0 or not (math.isfinite(value) and -100.0 <= value <= 100.0):
                raise ValueError(f"logit_bias maps token ids (>= 0) to biases in [-100, 100], got {token}: {value}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be in [0, {MAX_TOP_K}] (0 disables it; a k past the vocabulary keeps every "
                             f"token), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}] (or None), got {value}")
        if self.max_draft_tokens is not None and self.max_draft_tokens < 0:
            raise ValueError(f"max_draft_tokens must be >= 0 (0: plain decoding), got {self.max_draft_tokens}")
        if self.structured_output is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with a structured output, which ends at EOS once matched")
        if self.structured_output is not None and self.min_tokens:
            raise ValueError("min_tokens cannot be combined with a structured output, which ends at EOS once matched")

    @property
    def greedy(self) -> bool:
        # As vLLM: temperatures this small are argmax in all but name (and 1/T overflows).
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalizes_output(self) -> bool:
        """Whether the presence or frequency penalty moves logits (they count generated tokens)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def penalized(self) -> bool:
        """Whether any penalty moves logits: then each verification row must see the tokens
        before it, drafts on its path included."""
        return self.repetition_penalty != 1.0 or self.penalizes_output


SPEC_POLICIES = ("fixed", "adaptive", "confidence")
# Algorithm names that mean plain decoding, for every command and the library.
NO_SPECULATION = ("none", "off")
TREE_DEPTH = 5  # a tree's depth when --speculative-num-steps is not given


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _name(value) -> bool:
    return value is None or isinstance(value, str)


# SpecConfig's fields: what each must be, as its error says it, and the test.
_SPEC_KINDS = {
    "algorithm": ("a name", _name),
    "num_draft_tokens": ("an integer", _integer),
    "draft_model_path": ("a path", lambda v: v is None or isinstance(v, (str, os.PathLike))),
    "ngram_max": ("an integer", _integer),
    "ngram_min": ("an integer", _integer),
    "num_steps": ("an integer", lambda v: v is None or _integer(v)),
    "eagle_topk": ("an integer", _integer),
    "lookup": ("true or false", lambda v: isinstance(v, bool)),
    "corpus": ("true or false", lambda v: isinstance(v, bool)),
    "policy": ("a name", _name),
    "min_survival": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
}


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings; names follow SGLang's launch flags.

    num_steps: draft depth (SGLang's --speculative-num-steps); a chain drafts
    min(num_steps, num_draft_tokens) tokens, so SGLang's chain setting "3 steps, 4 draft tokens"
    (which counts the root) drafts 3 here too. eagle_topk: 1 drafts chains; above 1 an EAGLE
    head drafts an EAGLE-2 tree: num_steps deep (default TREE_DEPTH), eagle_topk children per
    expanded node and eagle_topk nodes expanded per depth, the num_draft_tokens most likely
    nodes kept (the root, the last committed token, not counted). lookup: an EAGLE, DFlash or
    DSpark drafter also asks the suffix drafter (model-free; it wins where the answer copies its
    context: translation, summaries, RAG): an EAGLE tree gets its draft grafted on as one more
    branch, a chain or a block takes its draft instead of the head's whenever it has one
    (drafters/lookup.py). corpus: suffix decoding (and that lookup) also matches the context
    against a corpus of the target's own answers (drafters/corpus.py): the one tandem ships for
    the target, or for suffix decoding the directory in draft_model_path.
    policy: "fixed" drafts the full length every round; "adaptive" picks each request's length
    (a tree's depth) per round from the load, the measured cost curve and its acceptance; "confidence" (DSpark's scheduler,
    for drafters that report calibrated confidences) admits each draft's verified prefix after
    drafting from the confidences of the whole batch and the cost curve. min_survival: after proposal, a
    chain whose drafter reports confidences is cut where the product of its confidences falls
    below this (0: never; SpeculationPolicy.cut).
    """

    algorithm: str | None = None
    num_draft_tokens: int = 4
    draft_model_path: str | None = None
    ngram_max: int = 3
    ngram_min: int = 1
    num_steps: int | None = None
    eagle_topk: int = 1
    lookup: bool = True
    corpus: bool = True
    policy: str = "fixed"
    min_survival: float = 0.0

    def __post_init__(self) -> None:
        self._check_kinds()
        if isinstance(self.algorithm, str) and self.algorithm.lower() in NO_SPECULATION:
            object.__setattr__(self, "algorithm", None)  # "none" and "off" are plain decoding, as None is
        if self.algorithm == "":
            raise ValueError("speculative_algorithm is empty: name a drafter, or none (off) for plain decoding")
        if self.algorithm == "ngram" and self.draft_model_path is not None:
            raise ValueError("ngram drafts from the context alone and takes no draft model path "
                             f"(got {self.draft_model_path!r})")
        if self.num_draft_tokens < 1:
            raise ValueError(f"speculative_num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if not (1 <= self.ngram_min <= self.ngram_max):
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}..{self.ngram_max}")
        if self.num_steps is not None and self.num_steps < 1:
            raise ValueError(f"speculative_num_steps must be >= 1, got {self.num_steps}")
        if self.eagle_topk < 1:
            raise ValueError(f"speculative_eagle_topk must be >= 1, got {self.eagle_topk}")
        if not 0.0 <= self.min_survival < 1.0:
            raise ValueError(f"speculative_min_survival must lie in [0, 1), got {self.min_survival}")
        if self.policy not in SPEC_POLICIES:
            raise ValueError(f"speculative policy must be one of {SPEC_POLICIES}, got {self.policy!r}")

    def _check_kinds(self) -> None:
        """Each setting of the kind it must be, named as LLM's keyword when not (a string "4"
        for a count once failed in a comparison deep inside)."""
        for f in fields(self):
            value = getattr(self, f.name)
            kind, ok = _SPEC_KINDS[f.name]
            if not ok(value):
                raise ValueError(f"speculative_{f.name} must be {kind}, got {value!r}")

    @classmethod
    def from_prefixed(cls, values: Mapping[str, Any], prefix: str = "speculative_") -> SpecConfig:
        """The settings among `values` named `prefix + field` (LLM's speculative_* keywords,
        argparse's --speculative-* flags); other keys are ignored, absent fields and fields
        given as None (a flag left unset) keep their defaults. One place maps flags to fields, so
        a new setting is one new field."""
        names = {f.name for f in fields(cls)}
        return cls(**{k[len(prefix):]: v for k, v in values.items()
                      if k.startswith(prefix) and k[len(prefix):] in names and v is not None})

    @classmethod
    def prefixed_names(cls, prefix: str = "speculative_") -> frozenset[str]:
        return frozenset(prefix + f.name for f in fields(cls))

    @property
    def needs_cost_curve(self) -> bool:
        """The policy prices rounds on the target's measured forward cost curve."""
        return self.policy in ("adaptive", "confidence")

    @property
    def tree(self) -> bool:
        return self.eagle_topk > 1

    @property
    def max_draft_len(self) -> int:
        """The longest chain (deepest tree path) one round may draft."""
        default = TREE_DEPTH if self.tree else self.num_draft_tokens
        return min(self.num_steps or default, self.num_draft_tokens)

    @property
    def max_round_tokens(self) -> int:
        """The most draft tokens one round verifies: a tree's nodes, a chain's length."""
        return self.num_draft_tokens if self.tree else self.max_draft_len

    def describe(self) -> str:
        """The drafting shape in words, for logs: 'up to 4 draft tokens', or for a tree 'a tree
        of up to 10 draft tokens, 5 deep'."""
        if self.tree:
            return f"a tree of up to {self.max_round_tokens} draft tokens, {self.max_draft_len} deep"
        return f"up to {self.max_round_tokens} draft tokens"


@dataclass(frozen=True)
class EngineConfig:
    """Where and how the target runs."""

    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"
    device: str = "cpu"
    quantization: str = "auto"
    max_model_len: int = 2048
    max_num_seqs: int = 8
    threads: int | None = None
    spec: SpecConfig = field(default_factory=SpecConfig)
    kv_cache_dtype: str = "auto"  # passed to load_model (model/kv_cache.kv_cache_dtype)
    # KV slots all running requests may hold together; a request is admitted only when its
    # prompt + max_tokens (+ a draft) fits beside the others' (None: every row full, capped at
    # mem_fraction_static of the memory available when the engine starts).
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.5
    # Prompt tokens prefilled per step while other requests decode (0: whole prompts at once);
    # see Engine._prefill_chunks.
    chunked_prefill_size: int = 32
    # Keep finished requests' KV rows and reuse the longest matching prefix (engine/prefix_cache.py).
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "threads", "max_total_tokens", "chunked_prefill_size"):
            value = getattr(self, name)
            if value is not None and not _integer(value):
                optional = name in ("threads", "max_total_tokens")
                raise TypeError(f"{name} must be an integer{' or None' if optional else ''}, got {value!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        if not isinstance(self.spec, SpecConfig):
            raise TypeError(f"spec must be a SpecConfig, got {type(self.spec).__name__}")
        if self.dtype not in DTYPES + ("auto",):
            raise ValueError(f"dtype must be one of {DTYPES + ('auto',)}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.max_model_len < 16:
            raise ValueError(f"max_model_len must be >= 16, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1 (None: every core), got {self.threads}")
        kv_cache_dtype_name(self.kv_cache_dtype)
        if self.max_total_tokens is not None and self.max_total_tokens < 16:
            raise ValueError(f"max_total_tokens must be >= 16, got {self.max_total_tokens}")
        if self.chunked_prefill_size < 0:
            raise ValueError(f"chunked_prefill_size must be >= 0, got {self.chunked_prefill_size}")
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}")


@dataclass(frozen=True)
class ServerConfig:
    """The OpenAI-compatible server around one engine (`tandem serve`).

    max_queued_requests: requests waiting beyond the engine's running slots (max_num_seqs)
    before new ones get 503. drain_timeout_s: after SIGTERM, how long in-flight requests may
    finish before they are aborted. cost_profile: JSON file with the target's forward cost
    curve for the adaptive policy (None: the tandem cache, measured once per model/threads).
    api_key: every route but /health and the playground page (/) then needs `Authorization:
    Bearer <api_key>` (None: open).
    max_request_bytes: larger request bodies get 413 unread; 8 MiB is 64x the text of a
    32k-token prompt and still far from what could stall the server.
    request_read_timeout_s: a request whose headers take longer, or whose body stops arriving for
    this long, gets 408 and its connection is closed (as nginx's client_header_timeout /
    client_body_timeout).
    max_request_header_bytes: larger request headers get 431.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    max_queued_requests: int = 64
    served_model_name: str | None = None
    drain_timeout_s: float = 30.0
    cost_profile: str | None = None
    reprofile: bool = False
    api_key: str | None = field(default=None, repr=False)
    max_request_bytes: int = 8 * 2**20
    request_read_timeout_s: float = 60.0
    max_request_header_bytes: int = 64 * 2**10

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if not (math.isfinite(self.drain_timeout_s) and self.drain_timeout_s >= 0):
            raise ValueError(f"drain_timeout_s must be a finite number >= 0, got {self.drain_timeout_s}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if not (math.isfinite(self.request_read_timeout_s) and self.request_read_timeout_s > 0):
            raise ValueError(f"request_read_timeout_s must be a finite number > 0, got {self.request_read_timeout_s}")
        if self.max_request_header_bytes < 1024:
            raise ValueError(f"max_request_header_bytes must be >= 1024, got {self.max_request_header_bytes}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")
