"""Cross-tokenizer drafter: greedy identity through the engine with toy tokenizers that cut text
differently, full acceptance for a draft model that is the target under another tokenizer, the
re-encoding boundary rules, construction errors, and one slow test on the real bundled models."""

from __future__ import annotations

import functools
import random
from types import SimpleNamespace

import pytest
import torch

from conftest import ToyTokenizer, build_tiny
from tandem.config import EngineConfig, SamplingParams, SpecConfig
from tandem.drafters import TargetInfo, draft_model
from tandem.drafters.cross_tokenizer import CrossTokenizerDrafter
from tandem.llm import LLM
from tandem.model.loader import LoadedModel, StateDictSource
from tandem.model.transformer import TransformerLM

CHARS = "abcdefghijklmnopqrstuvwxyz .,"
SPECIALS = ["<pad>", "<bos>", "<eos>"]  # ids 0, 1, 2: the tiny configs' pad, bos and eos
TARGET_MERGES = [("t", "h"), ("th", "e"), ("a", "n"), ("i", "n"), ("o", "n"), ("r", "e"), ("e", " "),
                 ("h", "e"), ("he", "l"), ("hel", "l"), ("hell", "o")]
DRAFT_MERGES = [("h", "e"), ("t", "he"), ("e", "r"), ("o", "u"), ("i", "n"), ("in", "g"), ("a", "n"),
                ("an", "d"), (" ", "a"), ("s", " "), ("e", "d"), ("the", " ")]
TEXTS = ["the cat sat on the mat.", "hello there", "a, b, and c"]
GREEDY = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")


def toy_tokenizer(tokens: list[str], merges=(), specials=(), metaspace=False):
    """A Rust-backed BPE tokenizer: tokens[i] gets id i, merged tokens follow. Text decodes
    verbatim, or (metaspace) SentencePiece-style: spaces as "▁" and a "▁" put before every text."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(tokens)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(BPE(vocab=vocab, merges=list(merges)))
    if metaspace:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    else:
        tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(specials))
    names = dict(zip(("pad_token", "bos_token", "eos_token"), specials))
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False, **names)


def tiny_model(seed: int, vocab_size: int, arch: str = "llama") -> TransformerLM:
    return build_tiny(arch, seed, vocab_size=vocab_size)[1]


def as_loaded(model: TransformerLM, tokenizer, name: str) -> LoadedModel:
    return LoadedModel(model, tokenizer, model.cfg, name, torch.float32, "none")


@functools.lru_cache(maxsize=None)
def merges_pair() -> tuple[LoadedModel, LoadedModel]:
    """Target and draft whose tokenizers share characters and specials but merge differently."""
    target_tok = toy_tokenizer(SPECIALS + list(CHARS), TARGET_MERGES, SPECIALS)
    draft_tok = toy_tokenizer(SPECIALS + list(CHARS), DRAFT_MERGES, SPECIALS)
    return (as_loaded(tiny_model(0, len(target_tok)), target_tok, "tiny-target"),
            as_loaded(tiny_model(4, len(draft_tok), "qwen2"), draft_tok, "tiny-draft"))


@functools.lru_cache(maxsize=None)
def equivalent_pair() -> tuple[LoadedModel, LoadedModel]:
    """A character-level target and the same model under a shuffled character vocabulary.

    Draft id j is target id perm[j]: the draft's embedding (tied to its LM head) takes the target's
    row perm[j], so both models predict the same text and every draft should be accepted.
    """
    target_tok = toy_tokenizer(list(CHARS))
    perm = list(range(len(CHARS)))
    random.Random(0).shuffle(perm)
    draft_tok = toy_tokenizer([CHARS[perm[j]] for j in range(len(CHARS))])
    hf, target = build_tiny("llama", 0, vocab_size=len(CHARS))
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"][perm]
    draft = TransformerLM(target.cfg, StateDictSource(state, "none", torch.float32), torch.float32).eval()
    return as_loaded(target, target_tok, "tiny-char"), as_loaded(draft, draft_tok, "tiny-char-shuffled")


@pytest.fixture(autouse=True)
def fake_loader(request, monkeypatch):
    """draft_model_path "merges" / "equivalent" names the draft of a pair above (slow tests: the
    real loader)."""
    calls = []
    if request.node.get_closest_marker("slow"):
        return calls

    def load(path: str, target: TargetInfo) -> LoadedModel:
        calls.append(path)
        return {"merges": merges_pair, "equivalent": equivalent_pair}[path]()[1]

    monkeypatch.setattr(draft_model, "load_draft_model", load)
    return calls


def make_llm(pair: str, k: int | None) -> LLM:
    target = {"merges": merges_pair, "equivalent": equivalent_pair}[pair]()[0]
    spec = SpecConfig(algorithm="cross_tokenizer", num_draft_tokens=k, draft_model_path=pair) if k else SpecConfig()
    return LLM.from_loaded(target, EngineConfig(max_model_len=128, max_num_seqs=4, spec=spec))


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("pair", ["merges", "equivalent"])
def test_greedy_identity(pair, k):
    plain = make_llm(pair, None).generate(TEXTS, GREEDY)
    llm = make_llm(pair, k)
    out = llm.generate(TEXTS, GREEDY)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    stats = llm.engine.stats
    assert stats.num_draft_tokens > 0
    if pair == "equivalent":
        # The draft model writes the target's own text; any loss in decode -> draft tokens ->
        # draft text -> target tokens (or a stale draft cache) would show as a rejection.
        assert stats.acceptance_rate == 1.0
        assert stats.mean_acceptance_length > 1 + 0.5 * k


def test_sampling_runs_reproducibly():
    llm = make_llm("merges", 3)
    params = SamplingParams(temperature=0.8, max_tokens=20, seed=2, ignore_eos=True)
    a, b = (llm.generate(TEXTS[0], params)[0] for _ in range(2))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 20
    assert a.spec.num_draft_tokens > 0


@pytest.fixture
def drafter():
    target, _ = merges_pair()
    spec = SpecConfig(algorithm="cross_tokenizer", num_draft_tokens=4, draft_model_path="merges")
    return CrossTokenizerDrafter(spec, TargetInfo(len(target.tokenizer), (2,), target.tokenizer))


def pieces(drafter, ids):
    return drafter.target.tokenizer.convert_ids_to_tokens(ids)


def test_reencoding_starts_at_the_context_end(drafter):
    context = drafter.target.tokenizer.encode("the cat")
    # "the cat" + " then hello": ... 't' | ' ' 'the' 'n' ' ' 'hello'
    assert pieces(drafter, drafter._to_target(context, " then hello", complete=True)) == [" ", "the", "n", " ", "hello"]
    # Unfinished draft text: its last token may be a cut word ("hello" could be "hellos").
    assert pieces(drafter, drafter._to_target(context, " then hello", complete=False)) == [" ", "the", "n", " "]


def test_reencoding_when_the_context_end_merges_with_the_draft(drafter):
    context = drafter.target.tokenizer.encode("say hel")
    assert pieces(drafter, context)[-1] == "hel"
    # "say hello there" would cut "hello" across the context's end; the draft text stands alone.
    assert pieces(drafter, drafter._to_target(context, "lo there", complete=False)) == ["l", "o", " ", "the"]


def test_reencoding_keeps_the_context_in_front_of_the_text():
    """SentencePiece-style: "at" alone would encode as ["▁", "a", "t"]; after "the c" it is ["a", "t"]."""
    tok = toy_tokenizer(list("▁abcdefghijklmnopqrstuvwxyz.,"), [("▁", "s"), ("▁s", "a"), ("▁sa", "t"),
                                                                 ("▁", "t"), ("▁t", "h"), ("▁th", "e"), ("▁", "c")],
                        metaspace=True)
    spec = SpecConfig(algorithm="cross_tokenizer", num_draft_tokens=4, draft_model_path="merges")
    drafter = CrossTokenizerDrafter(spec, TargetInfo(len(tok), (), tok))
    context = tok.encode("the c")
    assert pieces(drafter, context) == ["▁the", "▁c"]
    assert pieces(drafter, drafter._to_target(context, "at sat", complete=True)) == ["a", "t", "▁sat"]


def test_reencoding_never_leaves_the_target_vocab():
    target, _ = merges_pair()
    tok = target.tokenizer
    spec = SpecConfig(algorithm="cross_tokenizer", num_draft_tokens=4, draft_model_path="merges")
    small = CrossTokenizerDrafter(spec, TargetInfo(tok.convert_tokens_to_ids("the"), (2,), tok))
    tokens = small._to_target(tok.encode("a"), " cat the dog", complete=True)
    assert pieces(small, tokens) == [" ", "c", "a", "t", " "]  # "the" has an id past the vocab


def test_drafts_cover_k_target_tokens(drafter):
    """k + 2 draft tokens re-encode into up to k target tokens; a draft is at most k long."""
    from tandem.drafters import DraftInput

    ids = drafter.target.tokenizer.encode(TEXTS[0])
    lengths = []
    for budget in (1, 2, 4, 9):
        (draft,) = drafter.propose([DraftInput("r", ids, len(ids), budget, GREEDY, torch.Generator())])
        assert draft.probs is None and len(draft) <= min(4, budget)
        assert all(0 <= t < drafter.target.vocab_size for t in draft.token_ids)
        lengths.append(len(draft))
    assert max(lengths) > 1


@pytest.mark.parametrize(
    "spec, target, match",
    [
        (SimpleNamespace(num_draft_tokens=0, draft_model_path="merges"), None, "num_draft_tokens"),
        (SpecConfig(algorithm="cross_tokenizer", num_draft_tokens=4), None, "draft_model_path"),
        (SpecConfig(algorithm="cross_tokenizer", draft_model_path="merges"), TargetInfo(97, (2,)), "tokenizer"),
        (SpecConfig(algorithm="cross_tokenizer", draft_model_path="merges"),
         TargetInfo(97, (2,), ToyTokenizer()), "fast"),
    ],
)
def test_construction_rejects_bad_config_before_loading(fake_loader, spec, target, match):
    target = target or TargetInfo(len(merges_pair()[0].tokenizer), (2,), merges_pair()[0].tokenizer)
    with pytest.raises(ValueError, match=match):
        CrossTokenizerDrafter(spec, target)
    assert fake_loader == []


@pytest.mark.slow
def test_real_gemma3_target_with_smollm2_drafter_greedy_identity():
    target = LLM("gemma3-270m", quantization="native", max_model_len=512)
    prompt = "The first three planets from the Sun are Mercury, Venus and"
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = target.generate(prompt, params)[0]
    spec = SpecConfig(algorithm="cross_tokenizer", num_draft_tokens=4, draft_model_path="smollm2-135m-instruct")
    llm = LLM.from_loaded(target.loaded, EngineConfig(model="gemma3-270m", max_model_len=512, spec=spec))
    out = llm.generate(prompt, params)[0]
    assert out.token_ids == plain.token_ids
    assert out.spec.num_draft_tokens > 0 and out.spec.num_accepted_tokens > 0
