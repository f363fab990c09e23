"""Per-request state: tokens, stop conditions and incremental detokenisation."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tandem.config import SamplingParams
from tandem.sampling import OTHER_DEVICE_SEED_OFFSET, make_generator
from tandem.types import RequestOutput, SpecStats


@dataclass
class Request:
    """One generation request as the engine tracks it.

    `next_token` is the newest committed token, sampled but not yet written to the KV cache: it is
    the first input of the request's next target forward (followed by that round's drafts).
    `generator` lives on the target's device, where the verifier and plain sampling draw; a
    drafter that samples on another device gets its own generator there (`generator_on`).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    eos_ids: frozenset[int]
    seq: int | None = None
    output_ids: list[int] = field(default_factory=list)
    next_token: int | None = None
    finish_reason: str | None = None
    text: str = ""
    emitted_text_len: int = 0
    stats: SpecStats = field(default_factory=SpecStats)
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    # Hidden states of the tokens the target processed since the drafter last saw this request
    # (rows accumulate over rounds the policy gave it no draft tokens).
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    hidden_delivered: bool = False
    _generators_elsewhere: dict[torch.device, torch.Generator] = field(default_factory=dict, repr=False)

    def generator_on(self, device: str | torch.device) -> torch.Generator:
        """The generator for draws on `device`: the request's own where it lives, else one made
        there on first use, seeded from the request's seed (so a seeded request stays
        reproducible) but never sharing its stream."""
        device = torch.device(device)
        if device.type == self.generator.device.type:
            return self.generator
        if device not in self._generators_elsewhere:
            seed = None if self.params.seed is None else self.params.seed + OTHER_DEVICE_SEED_OFFSET
            self._generators_elsewhere[device] = make_generator(seed, device)
        return self._generators_elsewhere[device]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def append(self, tokens: list[int], tokenizer) -> int:
        """Append committed tokens one by one, applying stop conditions inside the run.

        Returns how many were kept: nothing after EOS, a stop token, a completed stop string or
        max_tokens is ever added.
        """
        kept = 0
        p = self.params
        for tok in tokens:
            if self.finished:
                break
            self.output_ids.append(tok)
            kept += 1
            if self.first_token_time is None:
                self.first_token_time = time.perf_counter()
            if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
                self.finish_reason = "stop"
            elif p.stop and self._hit_stop_string(tokenizer):
                self.finish_reason = "stop"
            elif len(self.output_ids) >= p.max_tokens:
                self.finish_reason = "length"
        if not self.finished or not p.stop or self.finish_reason != "stop":
            self.text = tokenizer.decode(self.output_ids, skip_special_tokens=True)
        return kept

    def _hit_stop_string(self, tokenizer) -> bool:
        text = tokenizer.decode(self.output_ids, skip_special_tokens=True)
        # Only the tail can newly contain a stop string; search from a little before the old end.
        lookback = max(len(s) for s in self.params.stop) + 8
        begin = max(0, min(len(self.text), len(text)) - lookback)
        hits = [i for i in (text.find(s, begin) for s in self.params.stop) if i >= 0]
        self.text = text[: min(hits)] if hits else text
        return bool(hits)

    def take_new_text(self) -> str:
        """Text not yet streamed, holding back what may still grow into a stop string or an
        incomplete UTF-8 character."""
        end = len(self.text)
        if not self.finished:
            while end > self.emitted_text_len and self.text[end - 1] == "\ufffd":
                end -= 1
            for s in self.params.stop:
                for n in range(min(len(s) - 1, end - self.emitted_text_len), 0, -1):
                    if self.text[end - n : end] == s[:n]:
                        end -= n
                        break
        new = self.text[self.emitted_text_len : end]
        self.emitted_text_len = max(self.emitted_text_len, end)
        return new

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_ids),
            text=self.text,
            token_ids=list(self.output_ids),
            finish_reason=self.finish_reason,
            spec=self.stats,
            seconds=time.perf_counter() - self.arrival,
        )
