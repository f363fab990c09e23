"""The vLLM-shaped library entry point: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import gc
import logging
import os
import threading
from collections.abc import Iterator
from numbers import Integral

import torch

from tandem.config import EngineConfig, SamplingParams, SpecConfig
from tandem.drafters.heads.serving import check_head_available
from tandem.engine.engine import Engine
from tandem.engine.request import Request
from tandem.model.catalogue import DEFAULT_MODEL
from tandem.model.loader import load_model
from tandem.scheduler.profile import cost_curve_for
from tandem.types import RequestOutput

log = logging.getLogger("tandem")


def configure_threads(threads: int | None) -> int:
    """Use every core for intra-op parallelism (measured best for batch-1 decoding here)."""
    n = threads or os.cpu_count() or 1
    torch.set_num_threads(n)
    return n


def chat_token_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Messages (and tools, for a template that renders them) -> token ids through the
    tokenizer's chat template, ready for the assistant's turn (transformers returns a list or, in
    some versions, a dict holding input_ids)."""
    extra = {"tools": tools} if tools else {}
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _prompt_list(prompts) -> list:
    """generate's prompts as a list of prompts (each a string or token ids)."""
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                    and isinstance(prompts[0], Integral)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts are a string, token ids, or a list of either; got {type(prompts).__name__}")
    return list(prompts)


class LLM:
    """Load a target (and drafter) once; generate for one prompt or many (batched)."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        dtype: str = "auto",
        quantization: str = "auto",
        device: str = "cpu",
        max_model_len: int = 2048,
        max_num_seqs: int = 8,
        threads: int | None = None,
        kv_cache_dtype: str = "auto",
        enable_prefix_caching: bool = True,
        chunked_prefill_size: int = 32,
        max_total_tokens: int | None = None,
        spec: SpecConfig | None = None,
        **speculative,
    ) -> None:
        """spec: the speculative decoding settings whole; or, as vLLM/SGLang spell them, any of
        SpecConfig's fields as speculative_* keywords (speculative_algorithm="ngram",
        speculative_num_draft_tokens=4, speculative_policy="adaptive", ...). The engine's
        enable_prefix_caching, chunked_prefill_size and max_total_tokens are EngineConfig's."""
        unknown = sorted(set(speculative) - SpecConfig.prefixed_names())
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword arguments {unknown}: not a parameter of LLM, nor a "
                            f"speculative setting ({', '.join(sorted(SpecConfig.prefixed_names()))})")
        if spec is not None and speculative:
            raise ValueError("pass spec=SpecConfig(...) or speculative_* keywords, not both")
        spec = spec or SpecConfig.from_prefixed(speculative)
        self.config = EngineConfig(
            model=model,
            dtype=dtype,
            device=device,
            quantization=quantization,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            threads=threads,
            spec=spec,
            kv_cache_dtype=kv_cache_dtype,
            enable_prefix_caching=enable_prefix_caching,
            chunked_prefill_size=chunked_prefill_size,
            max_total_tokens=max_total_tokens,
        )
        threads = configure_threads(threads)
        self.loaded = load_model(model, dtype=dtype, quantization=quantization, device=device,
                                 kv_cache_dtype=kv_cache_dtype)
        # The adaptive policy and the confidence scheduler need the target's cost curve: measured
        # once per model, kernels, KV dtype, machine and thread count, then read from the cache
        # (as tandem serve does).
        check_head_available(spec, self.loaded.name)  # before the cost profile, which takes seconds
        curve = cost_curve_for(self.loaded, device, threads) if spec.needs_cost_curve else None
        self.engine = Engine(self.loaded, self.config, cost_curve=curve)
        self._unread: dict[str, list[str]] = {}  # streamed requests' text not yet yielded (_step)
        self._lock = threading.Lock()  # the engine's: adding, stepping and aborting requests
        self._finished = threading.local()  # each thread's last finished stream (last_output)
        # Loading leaves millions of long-lived objects; keep the cyclic GC from rescanning them
        # in the middle of decoding (measured 100+ ms pauses).
        gc.collect()
        gc.freeze()
        self.tokenizer = self.loaded.tokenizer

    @classmethod
    def from_loaded(cls, loaded, config: EngineConfig, cost_curve=None) -> "LLM":
        """Wrap an already loaded model (tests, benchmarks comparing several engines);
        cost_curve: for the policies that price rounds (SpecConfig.needs_cost_curve)."""
        self = cls.__new__(cls)
        self.config, self.loaded, self.tokenizer = config, loaded, loaded.tokenizer
        self.engine = Engine(loaded, config, cost_curve=cost_curve)
        self._unread, self._lock, self._finished = {}, threading.Lock(), threading.local()
        return self

    @property
    def last_output(self) -> RequestOutput | None:
        """The output of the last stream this thread read to its end (None before one)."""
        return getattr(self._finished, "output", None)

    def encode(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, (list, tuple)):
            if chat:
                raise ValueError("chat=True puts a text prompt in the chat template; these are token ids (give "
                                 "the text, or the template's ids with chat=False)")
            return list(prompt)
        if not isinstance(prompt, str):
            raise TypeError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        if chat:
            if self.tokenizer.chat_template is None:
                raise ValueError(f"{self.loaded.name} has no chat template; send a plain prompt")
            return chat_token_ids(self.tokenizer, [{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        chat: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; all prompts run together, batched by the engine. Calls
        from several threads are served together too (each step serves every call's requests)."""
        prompts = _prompt_list(prompts)
        params = SamplingParams() if sampling_params is None else sampling_params
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if not all(isinstance(sp, SamplingParams) for sp in params_list):
            raise TypeError("sampling_params is a SamplingParams or a list of them (one per prompt)")
        if len(params_list) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        ids = [self.encode(p, chat) for p in prompts]
        requests = []
        try:
            for prompt_ids, sp in zip(ids, params_list):
                requests.append(self._add(prompt_ids, sp))
            while not all(r.finished for r in requests):
                self._step()
        except BaseException:  # an error or an interrupt: nothing of this call stays in the engine
            self._abort(requests)
            raise
        return [r.output() for r in requests]

    def _add(self, prompt_ids: list[int], params: SamplingParams, streamed: bool = False) -> Request:
        """Add a request (a streamed one with its unread text, before any step can commit to it)."""
        with self._lock:
            req = self.engine.add_request(prompt_ids, params)
            if streamed:
                self._unread[req.request_id] = []
            return req

    def _step(self) -> None:
        """One engine step; the text it commits for requests being streamed waits for their
        generators (several may be open, and a `generate` may run between their reads). The
        engine is one: a thread steps it under the lock, for every thread's requests."""
        with self._lock:
            for update in self.engine.step():
                unread = self._unread.get(update.request.request_id)
                if unread is not None and update.new_text:
                    unread.append(update.new_text)

    def _abort(self, requests: list[Request]) -> None:
        with self._lock:
            for req in requests:
                if not req.finished:
                    self.engine.abort(req.request_id)

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None, *, chat: bool = False) -> Iterator[str]:
        """Yield text pieces as they are committed; the finished request stays in `last_output`.
        Several streams may be read in turn, and `generate` called between reads: each stream
        keeps its own text until it is read."""
        if isinstance(prompt, (list, tuple)) and prompt and not isinstance(prompt[0], Integral):
            raise TypeError("stream takes one prompt (a string or token ids); generate takes several")
        if params is not None and not isinstance(params, SamplingParams):
            raise TypeError(f"params is a SamplingParams, got {type(params).__name__}")
        req = self._add(self.encode(prompt, chat), params or SamplingParams(), streamed=True)
        unread = self._unread[req.request_id]
        try:
            while unread or not req.finished:
                if not unread:
                    self._step()
                while unread:
                    yield unread.pop(0)
        finally:  # an error, or the caller stopped iterating: the request leaves the engine
            del self._unread[req.request_id]
            self._abort([req])
        self._finished.output = req.output()
