"""Per-request state: tokens, stop conditions and incremental detokenisation."""

from __future__ import annotations

import bisect
import re
import time
from dataclasses import dataclass, field

import torch

from tandem.config import SamplingParams
from tandem.sampling import OTHER_DEVICE_SEED_OFFSET, make_generator
from tandem.types import RequestOutput, SpecStats

_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece's byte-fallback tokens


class HiddenRows:
    """The target's hidden states of the tokens a request's drafter has not seen yet: rows are
    added after every forward and taken when the drafter is next asked for a draft, so rounds
    the policy gave no draft tokens still reach it."""

    def __init__(self) -> None:
        self._rows: dict[int, list[torch.Tensor]] = {}

    def add(self, rows: dict[int, torch.Tensor]) -> None:
        # Kept as pieces and joined once when taken: joining every round would copy everything
        # held so far each time (a prompt's rows, round after round, while the policy drafts nothing).
        for layer, h in rows.items():
            self._rows.setdefault(layer, []).append(h)

    def __len__(self) -> int:
        """Rows held (of each layer)."""
        return sum(len(h) for h in next(iter(self._rows.values()), []))

    def take(self) -> dict[int, torch.Tensor]:
        joined = self._joined()
        self._rows = {}
        return joined

    def first(self, n: int) -> dict[int, torch.Tensor]:
        """The first n rows of every layer, leaving them held (joined into one piece)."""
        joined = self._joined()
        self._rows = {layer: [h] for layer, h in joined.items()}
        return {layer: h[:n] for layer, h in joined.items()}

    def _joined(self) -> dict[int, torch.Tensor]:
        return {layer: parts[0] if len(parts) == 1 else torch.cat(parts) for layer, parts in self._rows.items()}


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
    prefilled: int = 0  # prompt tokens already in the KV cache (prompts may be prefilled in chunks)
    prefill_started: bool = False  # a forward has run over some of its prompt
    output_ids: list[int] = field(default_factory=list)
    next_token: int | None = None
    finish_reason: str | None = None
    text: str = ""
    emitted_text_len: int = 0
    stats: SpecStats = field(default_factory=SpecStats)
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    pending_hidden: HiddenRows = field(default_factory=HiddenRows)
    # Every hidden row the request's tokens produced, kept only when the engine keeps finished
    # rows for prefix caching and the drafter reads hidden states (a later hit hands them on).
    hidden_log: HiddenRows = field(default_factory=HiddenRows)
    _generators_elsewhere: dict[torch.device, torch.Generator] = field(default_factory=dict, repr=False)
    # Incremental detokenisation (`_decode_output`): `_decoded` is the text of
    # output_ids[:_read_offset]; output_ids[_prefix_offset:_read_offset] decode to `_prefix_text`.
    # `_full_decode` is None until the first decode tells whether the tokenizer allows it.
    _decoded: str = field(default="", repr=False)
    _prefix_offset: int = field(default=0, repr=False)
    _read_offset: int = field(default=0, repr=False)
    _prefix_text: str = field(default="", repr=False)
    _full_decode: bool | None = field(default=None, repr=False)
    # With params.token_origins: each output token's origin, and how long `text` was once it was
    # appended (never less than for the token before), for `origin_pieces`.
    token_origins: list[str] = field(default_factory=list)
    _text_ends: list[int] = field(default_factory=list, repr=False)

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

    def append(self, tokens: list[int], tokenizer, origins: list[str] | None = None) -> int:
        """Append committed tokens one by one, applying stop conditions inside the run; origins:
        each token's origin (types.TOKEN_ORIGINS; recorded when params.token_origins asks for it).

        Returns how many were kept: nothing after EOS, a stop token, a completed stop string or
        max_tokens is ever added.
        """
        kept = 0
        p = self.params
        for i, tok in enumerate(tokens):
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
            if p.token_origins:
                self._record_origin(tokenizer, origins[i] if origins else "target")
        # With stop strings `_hit_stop_string` has set the text already, with origins `_record_origin`.
        if kept and not p.stop and not p.token_origins:
            self.text = self._decode_output(tokenizer)
        return kept

    def _record_origin(self, tokenizer, origin: str) -> None:
        if not self.params.stop:
            self.text = self._decode_output(tokenizer)
        self.token_origins.append(origin)
        self._text_ends.append(max(len(self.text), self._text_ends[-1] if self._text_ends else 0))

    def origin_pieces(self, start: int, end: int) -> list[tuple[str, str]]:
        """text[start:end] cut where the token that wrote it changes, as (piece, origin) pairs
        whose pieces join to exactly that text. A character belongs to the first token after
        which the text reached past it (a character spread over several byte tokens, to the
        first of them)."""
        pieces = []
        token = bisect.bisect_right(self._text_ends, start)
        pos = start
        while pos < end and self.token_origins:
            last = token >= len(self._text_ends)
            stop = end if last else min(self._text_ends[token], end)
            pieces.append((self.text[pos:stop], self.token_origins[-1 if last else token]))
            pos, token = stop, token + 1
        return pieces

    def _hit_stop_string(self, tokenizer) -> bool:
        text = self._decode_output(tokenizer)
        # Only the tail can newly contain a stop string; search from a little before the old end.
        lookback = max(len(s) for s in self.params.stop) + 8
        begin = max(0, min(len(self.text), len(text)) - lookback)
        hits = [i for i in (text.find(s, begin) for s in self.params.stop) if i >= 0]
        self.text = text[: min(hits)] if hits else text
        return bool(hits)

    def _decode_output(self, tokenizer) -> str:
        """`tokenizer.decode(output_ids, skip_special_tokens=True)`, re-decoding only the tokens
        from the prefix offset on.

        The window from the prefix offset decodes to `_prefix_text` up to the read offset; what
        the newer tokens add to it is the new text. It is committed (the offsets move up) once it
        is complete: not ending in an unfinished UTF-8 character and cut after a token the
        decoder does not merge with what follows (`_splits_after`). Tokenizers without
        `convert_ids_to_tokens`, or that clean up spaces around punctuation, decode in full.
        """
        ids = self.output_ids
        if self._full_decode is None:
            self._full_decode = (not callable(getattr(tokenizer, "convert_ids_to_tokens", None))
                                 or bool(getattr(tokenizer, "clean_up_tokenization_spaces", False)))
        if self._full_decode:
            return tokenizer.decode(ids, skip_special_tokens=True)
        window = tokenizer.decode(ids[self._prefix_offset:], skip_special_tokens=True)
        if not window.startswith(self._prefix_text):  # the decoder merged across the boundary
            self._full_decode = True
            return tokenizer.decode(ids, skip_special_tokens=True)
        new = window[len(self._prefix_text):]
        if not new or new.endswith("\ufffd") or not _splits_after(tokenizer, ids[-1]):
            return self._decoded + new
        self._decoded += new
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        self._prefix_text = tokenizer.decode(ids[self._prefix_offset:], skip_special_tokens=True)
        return self._decoded

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
            token_origins=list(self.token_origins) if self.params.token_origins else None,
        )


def _splits_after(tokenizer, token: int) -> bool:
    """Whether text decoded up to `token` stays put whatever follows: `token` yields text of its
    own (a skipped special token does not, and decoders join its neighbours as if it were not
    there) and is no SentencePiece byte piece (`<0xE2>`: a run of those is decoded as one, so
    one invalid byte later turns all of them into replacement characters)."""
    piece = tokenizer.convert_ids_to_tokens(token)
    if not isinstance(piece, str) or _BYTE_PIECE.fullmatch(piece):
        return False
    return tokenizer.decode([token], skip_special_tokens=True) != ""
