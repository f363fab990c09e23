"""Per-request state: tokens, stop conditions and incremental detokenisation."""

from __future__ import annotations

import bisect
import re
import time
from dataclasses import dataclass, field

import torch

from tandem.config import SamplingParams
from tandem.grammar import GrammarState
from tandem.sampling import OTHER_DEVICE_SEED_OFFSET, make_generator
from tandem.types import RequestOutput, SpecStats, TokenLogprob, tree_paths

_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece's byte-fallback tokens


class HiddenRows:
    """The target's hidden states of a request's tokens, in order, for its drafter.

    Rows are added after every forward and the ones not taken yet are taken when the drafter is
    next asked for a draft, so rounds the policy gave no draft tokens still reach it. With
    keep_all (the prefix cache keeps a finished request's rows) taken rows stay held too.

    One buffer [layers, capacity, H] per request, grown by doubling: a round adds its few rows
    with one copy, and taking them is a view, where keeping each round's rows as tensors of
    their own cost a Python-level operation per layer per request per round (about 3% of a
    batch of eight's decoding on two cores). Rows once written are never moved or overwritten
    in place, so what `take` returned stays valid.
    """

    def __init__(self, keep_all: bool = False) -> None:
        self.keep_all = keep_all
        self._layers: tuple[int, ...] = ()
        self._buf: torch.Tensor | None = None
        self._taken = 0  # buffer rows before this were taken
        self._end = 0  # buffer rows before this are held

    def add(self, rows: dict[int, torch.Tensor]) -> None:
        """Keep rows[layer] (the same number of rows for every layer) after the ones held."""
        if not rows:
            return
        layers = tuple(rows)
        self._check_layers(layers)
        first = rows[layers[0]]
        n = first.shape[0]
        self._reserve(n, len(layers), first)
        for i, layer in enumerate(layers):  # straight into the buffer: no stacked copy first
            self._buf[i, self._end : self._end + n].copy_(rows[layer])
        self._end += n

    def add_stacked(self, layers: tuple[int, ...], stacked: torch.Tensor,
                    index: slice | list[int] | None = None) -> None:
        """Keep stacked[i, index] as layer layers[i]'s next rows (stacked: [layers, rows, H];
        index None: all rows, a slice or a list of row indices)."""
        if not layers:
            return
        self._check_layers(layers)
        block = stacked if index is None else stacked[:, index]
        n = block.shape[1]
        self._reserve(n, len(layers), block)
        self._buf[:, self._end : self._end + n].copy_(block)
        self._end += n

    def _check_layers(self, layers: tuple[int, ...]) -> None:
        if self._buf is None:
            self._layers = layers
        elif layers != self._layers:
            raise ValueError(f"hidden rows of layers {layers} added to rows of layers {self._layers}")

    def _reserve(self, n: int, layers: int, like: torch.Tensor) -> None:
        """Room for n more rows of `layers` layers (like: their width, dtype and device): a new
        buffer twice the rows it must hold, holding only the rows still wanted (every row with
        keep_all, else the untaken ones)."""
        if self._buf is not None and self._end + n <= self._buf.shape[1]:
            return
        first = 0 if self.keep_all else self._taken
        held = self._end - first
        buf = like.new_empty((layers, max(16, 2 * (held + n)), like.shape[-1]))
        if held:
            buf[:, :held].copy_(self._buf[:, first : self._end])
        self._buf, self._taken, self._end = buf, self._taken - first, held

    def __len__(self) -> int:
        """Rows not taken yet (of each layer)."""
        return self._end - self._taken

    def take(self) -> dict[int, torch.Tensor]:
        """The rows not taken yet, per layer (views; {} when there are none)."""
        if self._taken == self._end:
            return {}
        rows = self._rows(self._taken, self._end)
        self._taken = self._end
        return rows

    def first(self, n: int) -> dict[int, torch.Tensor]:
        """The first n rows of every layer, taken or not (keep_all; views)."""
        if not self.keep_all:
            raise ValueError("only hidden rows kept with keep_all can be read from the start")
        return self._rows(0, min(n, self._end))

    def _rows(self, start: int, end: int) -> dict[int, torch.Tensor]:
        if self._buf is None:
            return {}
        return {layer: self._buf[i, start:end] for i, layer in enumerate(self._layers)}


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
    error: str | None = None  # why it ended, where finish_reason is "error"
    text: str = ""
    emitted_text_len: int = 0
    stats: SpecStats = field(default_factory=SpecStats)
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    # The hidden rows of its tokens for the drafter; all of them (keep_all) when the engine keeps
    # finished rows for prefix caching and the drafter reads hidden states (a hit hands them on).
    hidden: HiddenRows = field(default_factory=HiddenRows)
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
    # With params.logprobs: each output token's log-probability under the target; with
    # params.prompt_logprobs each prompt token's but the first, as its prompt is prefilled.
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # With params.structured_output: its matcher, advanced by every committed token.
    grammar: GrammarState | None = None
    # With params.logit_bias: the bias as one [V] row, added to every row's logits.
    bias_row: torch.Tensor | None = None
    # With params.min_tokens: one [V] row, -inf at EOS (unless ignore_eos) and the stop token ids,
    # added to the rows that draw one of the first min_tokens output tokens.
    stop_ban: torch.Tensor | None = None
    # Stop strings count only where they end past this much text: the text of the first
    # min_tokens output tokens, in which none is looked for.
    _stop_floor: int = field(default=0, repr=False)

    def prompt_logprob_entries(self) -> list[TokenLogprob | None]:
        """One per prompt token (params.prompt_logprobs), None for the first: nothing predicts it."""
        return [None, *self.prompt_logprobs]

    def logit_shift(self, allowed: torch.Tensor | None, rows: int, parents: list[int] | None = None
                    ) -> torch.Tensor | None:
        """What to add to `rows` logit rows before anything else (sampling.shifted): -inf where
        the structured output refuses a token (allowed: [rows, V] bool from its grammar), plus
        the logit bias, plus -inf at the stop tokens in rows that draw one of the first
        min_tokens output tokens (row i draws output token len(output_ids) + its depth: i along a
        chain, its path's length in a tree of these draft `parents`); None when nothing applies."""
        banning = self.stop_ban is not None and len(self.output_ids) < self.params.min_tokens
        if allowed is None and not banning:
            return None if self.bias_row is None else self.bias_row.expand(rows, -1)
        shift = (torch.zeros(rows, self.stop_ban.shape[0]) if allowed is None
                 else torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf")))
        if self.bias_row is not None:
            shift += self.bias_row
        if banning:
            depth = (torch.arange(rows) if parents is None
                     else torch.tensor([0] + [len(path) for path in tree_paths(parents)]))
            shift[len(self.output_ids) + depth < self.params.min_tokens] += self.stop_ban
        return shift

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
        stop_token = False
        for i, tok in enumerate(tokens):
            if self.finished:
                break
            self.output_ids.append(tok)
            kept += 1
            if self.first_token_time is None:
                self.first_token_time = time.perf_counter()
            if tok in self.eos_ids and not p.ignore_eos:
                self.finish_reason = "stop"
            elif tok in p.stop_token_ids:
                self.finish_reason, stop_token = "stop", True
            elif p.stop and self._hit_stop_string(tokenizer):
                self.finish_reason = "stop"
            elif len(self.output_ids) >= p.max_tokens:
                self.finish_reason = "length"
            if p.token_origins:
                self._record_origin(tokenizer, origins[i] if origins else "target")
        # With stop strings `_hit_stop_string` has set the text already, with origins `_record_origin`.
        if kept and not p.stop and not p.token_origins:
            self.text = self._decode_output(tokenizer)
        if stop_token:  # the token stays in the output's ids, its text does not (vLLM's rule)
            self.text = self.text[: len(tokenizer.decode(self.output_ids[:-1], skip_special_tokens=True))]
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
        if len(self.output_ids) <= self.params.min_tokens:  # none is looked for yet (vLLM's rule)
            self.text = text
            self._stop_floor = len(text)
            return False
        # Only the tail can newly contain a stop string; search from a little before the old end.
        lookback = max(len(s) for s in self.params.stop) + 8
        begin = max(0, min(len(self.text), len(text)) - lookback)
        hits = [i for i in (text.find(s, max(begin, self._stop_floor - len(s) + 1)) for s in self.params.stop)
                if i >= 0]
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
            error=self.error,
            spec=self.stats,
            seconds=time.perf_counter() - self.arrival,
            token_origins=list(self.token_origins) if self.params.token_origins else None,
            logprobs=list(self.logprobs) if self.params.logprobs is not None else None,
            prompt_logprobs=self.prompt_logprob_entries() if self.params.prompt_logprobs is not None else None,
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
