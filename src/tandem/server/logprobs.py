"""Output tokens' log-probabilities in OpenAI's two shapes: the legacy completions one (tokens,
token_logprobs, top_logprobs, text_offset) and chat's (content: token, logprob, bytes,
top_logprobs). Token ids become text and bytes through `TokenStrings`, on the thread that owns
its tokenizer (ServingContext's)."""

from __future__ import annotations

import codecs

from tandem.server.responses import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from tandem.types import TokenLogprob


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): each byte is spelled by one printable character,
    the printable ASCII and Latin-1 bytes by themselves, the rest by characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            spelled[chr(256 + extra)] = b
            extra += 1
    return spelled


_BYTE_LEVEL = _byte_level_alphabet()


class TokenStrings:
    """A token id's text (what decoding it alone gives, special tokens included) and its UTF-8
    bytes, cached per id. The bytes are the token's own where its vocabulary entry spells them
    (byte-level BPE, SentencePiece byte pieces such as `<0xE2>`), so the bytes of the tokens
    that split a character join to that character; elsewhere they are the text's."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._in_text: dict[int, bytes] = {}

    def in_text(self, token_id: int) -> bytes:
        """The bytes the token adds to a choice's text, which is decoded without special tokens:
        its own bytes, none for a special token."""
        found = self._in_text.get(token_id)
        if found is None:
            kept = self.tokenizer.decode([token_id], skip_special_tokens=True)
            found = self._in_text[token_id] = bytes(self(token_id)[1]) if kept else b""
        return found

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._spell(token_id)
        return found

    def _spell(self, token_id: int) -> tuple[str, list[int]]:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        piece = self.tokenizer.convert_ids_to_tokens(token_id) if hasattr(self.tokenizer, "convert_ids_to_tokens") else None
        raw = _piece_bytes(piece) if isinstance(piece, str) else None
        if raw is None or ("\ufffd" not in text and text != raw.decode("utf-8", errors="replace")):
            return text, list(text.encode("utf-8"))  # the piece does not spell the token's bytes
        if "\ufffd" in text:  # part of a character: named by its bytes, as OpenAI does
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text, list(raw)


def _piece_bytes(piece: str) -> bytes | None:
    """The bytes a vocabulary entry spells: `<0xAB>` (SentencePiece byte fallback), a byte-level
    BPE piece, or None when it is neither."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            return None
    if piece and all(c in _BYTE_LEVEL for c in piece):
        return bytes(_BYTE_LEVEL[c] for c in piece)
    return None


class TextOffsets:
    """Where each next token's text starts in a choice's text, in characters: a token adds its
    bytes (TokenStrings.in_text), and a character counts once its last byte has come, so every
    token of a character split over several tokens starts where the character does. text: the
    text the tokens spell where special tokens may stand in it as text (an echoed prompt, as the
    client wrote it): a special token found there at its offset spans it; elsewhere (a BOS the
    tokenizer added, a choice's generated text) it adds nothing."""

    def __init__(self, start: int = 0, text: str | None = None) -> None:
        self.chars = start
        self.text = text
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def next(self, piece: bytes, spelled: str = "") -> int:
        """The offset of a token adding `piece` (spelled `spelled` with special tokens kept);
        moves past it."""
        offset = self.chars
        if not piece and spelled and self.text is not None and self.text.startswith(spelled, offset):
            self.chars += len(spelled)
        else:
            self.chars += len(self._decoder.decode(piece))
        return offset


def completion_logprobs(entries: list[TokenLogprob | None], strings: TokenStrings, offsets: TextOffsets,
                        unscored: int | None = None) -> CompletionLogprobs:
    """The completions shape of `entries`, their text offsets taken from `offsets` (which moves
    past them); `unscored`: the token of a leading None entry (an echoed prompt's first token,
    which nothing predicts: null logprob and alternatives)."""
    tokens, starts, tops, values = [], [], [], []
    for e in entries:
        token_id = unscored if e is None else e.token_id
        text = strings(token_id)[0]
        tokens.append(text)
        starts.append(offsets.next(strings.in_text(token_id), text))
        if e is None:
            tops.append(None)
            values.append(None)
            continue
        top = {strings(t)[0]: lp for t, lp in e.top}
        top.setdefault(text, e.logprob)  # OpenAI: the sampled token is always among them
        tops.append(top)
        values.append(e.logprob)
    return CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=starts)


def chat_logprobs(entries: list[TokenLogprob], strings: TokenStrings) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        text, raw = strings(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=raw)

    content = []
    for e in entries:
        text, raw = strings(e.token_id)
        content.append(ChatTokenLogprob(token=text, logprob=e.logprob, bytes=raw,
                                        top_logprobs=[top(t, lp) for t, lp in e.top]))
    return ChatLogprobs(content=content)
