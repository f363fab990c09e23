"""The vLLM-shaped library entry point: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Iterator

import torch

from tandem.config import EngineConfig, SamplingParams, SpecConfig
from tandem.engine.engine import Engine
from tandem.model.loader import DEFAULT_MODEL, load_model
from tandem.types import RequestOutput

log = logging.getLogger("tandem")


def configure_threads(threads: int | None) -> int:
    """Use every core for intra-op parallelism (measured best for batch-1 decoding here)."""
    n = threads or os.cpu_count() or 1
    torch.set_num_threads(n)
    return n



def chat_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Messages -> token ids through the tokenizer's chat template, ready for the assistant's turn
    (transformers returns a list or, in some versions, a dict holding input_ids)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

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
        speculative_algorithm: str | None = None,
        speculative_num_draft_tokens: int = 4,
        speculative_draft_model_path: str | None = None,
        speculative_num_steps: int | None = None,
        speculative_eagle_topk: int = 1,
        speculative_tree_lookup: bool = True,
        kv_cache_dtype: str = "auto",
    ) -> None:
        spec = SpecConfig(
            algorithm=speculative_algorithm,
            num_draft_tokens=speculative_num_draft_tokens,
            draft_model_path=speculative_draft_model_path,
            num_steps=speculative_num_steps,
            eagle_topk=speculative_eagle_topk,
            tree_lookup=speculative_tree_lookup,
        )
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
        )
        configure_threads(threads)
        self.loaded = load_model(model, dtype=dtype, quantization=quantization, device=device,
                                 kv_cache_dtype=kv_cache_dtype)
        self.engine = Engine(self.loaded, self.config)
        # Loading leaves millions of long-lived objects; keep the cyclic GC from rescanning them
        # in the middle of decoding (measured 100+ ms pauses).
        gc.collect()
        gc.freeze()
        self.tokenizer = self.loaded.tokenizer

    @classmethod
    def from_loaded(cls, loaded, config: EngineConfig) -> "LLM":
        """Wrap an already loaded model (tests, benchmarks comparing several engines)."""
        self = cls.__new__(cls)
        self.config, self.loaded, self.tokenizer = config, loaded, loaded.tokenizer
        self.engine = Engine(loaded, config)
        return self

    def encode(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, list):
            return list(prompt)
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
        """Generate for every prompt; all prompts run together, batched by the engine."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        requests = [self.engine.add_request(self.encode(p, chat), sp) for p, sp in zip(prompts, params_list)]
        while self.engine.has_work():
            self.engine.step()
        return [r.output() for r in requests]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None, *, chat: bool = False) -> Iterator[str]:
        """Yield text pieces as they are committed; the finished request stays in `last_output`."""
        req = self.engine.add_request(self.encode(prompt, chat), params or SamplingParams())
        while not req.finished:
            for update in self.engine.step():
                if update.request is req and update.new_text:
                    yield update.new_text
        self.last_output = req.output()
