"""Draft-model drafter: greedy identity through the engine (the target drafting for itself must be
accepted in full; a noisy copy's drafts must equal a cache-free recomputation, rejections and all),
batching, seeds, the q rows it reports and draws that follow them, vocab alignment, construction
errors, and DraftLM's rollback and growth against a cache-free recomputation."""

from __future__ import annotations

import functools
import random
from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chisquare

from conftest import ToyTokenizer, build_tiny, tiny_loaded
from tandem.config import EngineConfig, SamplingParams, SpecConfig
from tandem.drafters import DraftInput, TargetInfo, create_drafter, draft_model
from tandem.drafters.draft_model import DraftLM, DraftModelDrafter, common_prefix_len
from tandem.llm import LLM
from tandem.model.arch import model_config_from_hf
from tandem.model.kv_cache import KVCache
from tandem.model.loader import LoadedModel, StateDictSource
from tandem.model.runner import ModelRunner, SeqInput
from tandem.model.transformer import TransformerLM
from tandem.sampling import processed_probs

PROMPTS = [[5, 17, 33, 8, 91, 4], [60, 61, 62], [7] * 11 + [12, 13]]
GREEDY = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
TARGET = TargetInfo(vocab_size=97, eos_token_ids=(2,))


pytestmark = pytest.mark.usefixtures("one_thread")


def as_loaded(model: TransformerLM, name: str, tokenizer=None) -> LoadedModel:
    return LoadedModel(model, tokenizer or ToyTokenizer(), model.cfg, name, torch.float32, "none")


# Weight noise that leaves the draft agreeing with the target often, not always (greedy acceptance
# about 0.2-0.7 at k = 1..8), so rounds mix full runs and rejections.
NOISE = {"llama": 0.01, "gemma3": 0.03}


@functools.lru_cache(maxsize=None)
def noisy_copy(arch: str = "llama") -> LoadedModel:
    """The tiny target with perturbed weights."""
    hf, _ = tiny_loaded(arch)
    gen = torch.Generator().manual_seed(1)
    state = {k: v + NOISE[arch] * torch.randn(v.shape, generator=gen) for k, v in hf.state_dict().items()}
    cfg = model_config_from_hf(hf.config.to_dict())
    return as_loaded(TransformerLM(cfg, StateDictSource(state, "none", torch.float32), torch.float32).eval(), "noisy")


@functools.lru_cache(maxsize=None)
def tiny_with_vocab(vocab_size: int) -> TransformerLM:
    return build_tiny("llama", seed=3, vocab_size=vocab_size)[1]


DRAFTS = {
    "self": lambda arch: tiny_loaded(arch)[1],
    "noisy": lambda arch: noisy_copy(arch),
    "other": lambda arch: tiny_loaded("qwen2", 1)[1],  # unrelated weights and architecture, same vocab
}


@pytest.fixture(autouse=True)
def fake_loader(monkeypatch):
    """draft_model_path names an entry of DRAFTS, built around the target's architecture."""
    calls = []

    def load(path: str, target: TargetInfo) -> LoadedModel:
        calls.append(path)
        arch = target.model_name.removeprefix("tiny-") or "llama"
        return DRAFTS[path](arch)

    monkeypatch.setattr(draft_model, "load_draft_model", load)
    return calls


def make_llm(draft: str | None, k: int = 4, arch: str = "llama", max_num_seqs: int = 4) -> LLM:
    _, loaded = tiny_loaded(arch)
    spec = SpecConfig(algorithm="draft_model", num_draft_tokens=k, draft_model_path=draft) if draft else SpecConfig()
    return LLM.from_loaded(loaded, EngineConfig(max_model_len=128, max_num_seqs=max_num_seqs, spec=spec))


@functools.lru_cache(maxsize=None)
def plain_greedy(arch: str = "llama") -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(o.token_ids) for o in make_llm(None, arch=arch).generate(PROMPTS, GREEDY))


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("draft", ["self", "noisy", "other"])
def test_greedy_identity(draft, k):
    llm = make_llm(draft, k)
    out = llm.generate(PROMPTS, GREEDY)
    assert tuple(tuple(o.token_ids) for o in out) == plain_greedy()
    stats = llm.engine.stats
    assert stats.num_draft_tokens > 0
    if draft == "self":
        # Same model, same context: every draft is the target's own argmax, unless the draft
        # cache lost or misplaced a committed token (such as the never-fed last draft token).
        assert all(o.spec.acceptance_rate == 1.0 for o in out)
        assert stats.mean_acceptance_length > 1 + 0.5 * k
    if draft == "noisy":
        assert 0.0 < stats.acceptance_rate < 1.0


def test_greedy_identity_sliding_window_target():
    """Gemma 3 shapes: sliding-window layers in the draft cache, rolled back every round."""
    out = make_llm("self", 3, arch="gemma3").generate(PROMPTS, GREEDY)
    assert tuple(tuple(o.token_ids) for o in out) == plain_greedy("gemma3")
    assert all(o.spec.acceptance_rate == 1.0 for o in out)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_engine_drafts_are_cache_free_continuations(arch):
    """With rejections every round, each draft must still be the draft model's greedy continuation
    of the committed context, recomputed from scratch: rejected drafts' KV was dropped."""
    llm = make_llm("noisy", 3, arch=arch)
    seen = []
    propose = llm.engine.drafter.propose

    def recording(batch):
        drafts = propose(batch)
        seen.extend((list(inp.token_ids), d.token_ids) for inp, d in zip(batch, drafts))
        return drafts

    llm.engine.drafter.propose = recording
    out = llm.generate(PROMPTS, GREEDY)
    assert tuple(tuple(o.token_ids) for o in out) == plain_greedy(arch)
    assert 0 < llm.engine.stats.acceptance_rate < 1
    for ids, draft in seen:
        assert draft == cache_free_greedy(noisy_copy(arch).model, ids, len(draft))


def test_batched_equals_single():
    llm = make_llm("noisy", 3, max_num_seqs=2)  # 3 prompts, 2 rows: queueing, rows released and reused
    batched = llm.generate(PROMPTS, GREEDY)
    single = [make_llm("noisy", 3).generate(p, GREEDY)[0] for p in PROMPTS]
    assert [o.token_ids for o in batched] == [o.token_ids for o in single]
    assert tuple(tuple(o.token_ids) for o in batched) == plain_greedy()


def test_seeds_reproduce_and_differ():
    llm = make_llm("noisy", 3)
    params = SamplingParams(temperature=0.9, top_k=30, max_tokens=30, seed=5, ignore_eos=True)
    a = llm.generate(PROMPTS[0], params)[0]
    b = llm.generate(PROMPTS[0], params)[0]
    c = llm.generate(PROMPTS[0], SamplingParams(temperature=0.9, top_k=30, max_tokens=30, seed=6, ignore_eos=True))[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 30
    assert a.token_ids != c.token_ids
    assert a.spec.num_draft_tokens > 0


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, max_tokens=40, seed=3, ignore_eos=True),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=40, seed=4, ignore_eos=True),
])
def test_sampling_with_the_target_as_drafter_accepts_everything(params):
    """q == p (up to float rounding between the two forwards), so u * q < p always passes."""
    out = make_llm("self", 4).generate(PROMPTS, params)
    for o in out:
        assert o.spec.num_draft_tokens > 0
        assert o.spec.acceptance_rate >= 0.98


def all_logits(model: TransformerLM, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] logits of a fresh cache-free forward."""
    runner = ModelRunner(model, KVCache(model.cfg, 1, 256, torch.float32))
    return runner.forward([SeqInput(runner.cache.allocate(), ids, logits="all")]).logits


def reference_probs(loaded: LoadedModel, ids: list[int], n: int, params: SamplingParams) -> torch.Tensor:
    """processed_probs of the draft model's logits after ids[:-n], ..., ids[:-1]."""
    return processed_probs(all_logits(loaded.model, ids)[len(ids) - 1 - n : len(ids) - 1], params)


def ask(drafter, ids, params, seed=0, budget=16, rid="r"):
    inp = DraftInput(rid, list(ids), len(ids), budget, params, torch.Generator().manual_seed(seed))
    (draft,) = drafter.propose([inp])
    return draft


def test_draft_probs_are_the_processed_draft_distributions():
    drafter = create_drafter(SpecConfig(algorithm="draft_model", num_draft_tokens=5, draft_model_path="noisy"), TARGET)
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.01)
    ctx = PROMPTS[0] + [9, 10]
    for _ in range(2):
        draft = ask(drafter, ctx, params)
        assert len(draft) == 5 and draft.probs.shape == (5, 97) and draft.probs.dtype == torch.float32
        assert (draft.probs >= 0).all()
        torch.testing.assert_close(draft.probs.sum(-1), torch.ones(5))
        assert all(draft.probs[i, t] > 0 for i, t in enumerate(draft.token_ids))
        ref = reference_probs(noisy_copy(), ctx + draft.token_ids, 5, params)
        torch.testing.assert_close(draft.probs, ref, atol=1e-5, rtol=1e-4)
        # Next round as after a rejection at the second draft: the cache must roll back.
        ctx = ctx + draft.token_ids[:1] + [(draft.token_ids[1] + 1) % 97]


def test_greedy_drafts_are_argmax_without_probs():
    drafter = create_drafter(SpecConfig(algorithm="draft_model", num_draft_tokens=4, draft_model_path="noisy"), TARGET)
    draft = ask(drafter, PROMPTS[1], SamplingParams(temperature=0))
    assert draft.probs is None and len(draft) == 4
    ref = reference_probs(noisy_copy(), PROMPTS[1] + draft.token_ids, 4, SamplingParams(temperature=0))
    assert draft.token_ids == ref.argmax(-1).tolist()
    assert len(ask(drafter, PROMPTS[1], SamplingParams(temperature=0), budget=2)) == 2


def fits(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Chi-square goodness-of-fit p-value of counts against expected frequencies (on their support)."""
    support = expected > 0
    assert counts[~support].sum() == 0, "a token with zero probability was drawn"
    exp = expected[support].double()
    return chisquare(counts[support].double(), exp / exp.sum() * counts.sum()).pvalue


def test_draws_follow_the_reported_q():
    """d_1 over many seeds matches q_1; d_2 matches the mixture of the q_2 rows reported with it.
    The negative control (q at another temperature) shows the test can fail."""
    drafter = create_drafter(SpecConfig(algorithm="draft_model", num_draft_tokens=2, draft_model_path="noisy"), TARGET)
    params = SamplingParams(temperature=0.1, top_k=8)
    counts = torch.zeros(2, 97)
    expected = torch.zeros(2, 97)
    for seed in range(600):
        draft = ask(drafter, PROMPTS[2], params, seed=seed)
        for i, t in enumerate(draft.token_ids):
            counts[i, t] += 1
        expected += draft.probs
    assert fits(counts[0], expected[0]) > 1e-3
    assert fits(counts[1], expected[1]) > 1e-3
    hotter = ask(drafter, PROMPTS[2], SamplingParams(temperature=0.2, top_k=8)).probs[0]
    assert fits(counts[0], hotter) < 1e-3


@pytest.mark.parametrize("draft_vocab", [90, 101])
def test_vocab_sizes_differing_by_padding_are_aligned(monkeypatch, draft_vocab):
    """Same tokenizer, different model vocab sizes: ids past the target's are never drafted and q
    rows are [k, V_target]."""
    vocab = {f"t{i}": i for i in range(97)}
    target = TargetInfo(97, (2,), tokenizer=SimpleNamespace(get_vocab=lambda: vocab))
    draft_tok = SimpleNamespace(get_vocab=lambda: {f"t{i}": i for i in range(min(draft_vocab, 97))})
    loaded = as_loaded(tiny_with_vocab(draft_vocab), "padded", draft_tok)
    monkeypatch.setattr(draft_model, "load_draft_model", lambda path, t: loaded)
    drafter = DraftModelDrafter(SpecConfig(algorithm="draft_model", num_draft_tokens=6, draft_model_path="x"), target)
    for seed in range(5):
        draft = ask(drafter, PROMPTS[0], SamplingParams(temperature=3.0), seed=seed)
        assert draft.probs.shape == (6, 97)
        assert all(0 <= t < min(draft_vocab, 97) for t in draft.token_ids)
        assert (draft.probs[:, draft_vocab:] == 0).all()


@pytest.mark.parametrize(
    "spec, match",
    [
        (SimpleNamespace(num_draft_tokens=0, draft_model_path="noisy"), "num_draft_tokens"),
        (SpecConfig(algorithm="draft_model", num_draft_tokens=4), "draft_model_path"),
    ],
)
def test_construction_rejects_bad_config_before_loading(fake_loader, spec, match):
    with pytest.raises(ValueError, match=match):
        DraftModelDrafter(spec, TARGET)
    assert fake_loader == []


def test_construction_rejects_another_vocabulary(monkeypatch):
    spec = SpecConfig(algorithm="draft_model", num_draft_tokens=4, draft_model_path="x")
    monkeypatch.setattr(draft_model, "load_draft_model", lambda path, t: as_loaded(tiny_with_vocab(89), "small"))
    with pytest.raises(ValueError, match="vocab size 89 .*cross_tokenizer"):
        DraftModelDrafter(spec, TARGET)
    # Equal sizes, but the tokenizers disagree on what an id means.
    words = [f"w{i}" for i in range(97)]
    target = TargetInfo(97, (2,), tokenizer=SimpleNamespace(get_vocab=lambda: {w: i for i, w in enumerate(words)}))
    shuffled = SimpleNamespace(get_vocab=lambda: {w: i for i, w in enumerate(reversed(words))})
    monkeypatch.setattr(draft_model, "load_draft_model", lambda path, t: as_loaded(tiny_loaded()[1].model, "x", shuffled))
    with pytest.raises(ValueError, match="tokenizer differs.*cross_tokenizer"):
        DraftModelDrafter(spec, target)


def test_common_prefix_len_matches_a_scan():
    rng = random.Random(0)
    for _ in range(300):
        a = [rng.randrange(3) for _ in range(rng.randrange(12))]
        b = a[: rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(6))]
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        assert common_prefix_len(a, b) == n == common_prefix_len(b, a)


def argmax_chooser(rows, logits):
    return logits.argmax(-1).tolist()


def cache_free_greedy(model: TransformerLM, ids: list[int], n: int) -> list[int]:
    out = []
    for _ in range(n):
        out.append(int(all_logits(model, ids + out)[-1].argmax()))
    return out


def test_draft_lm_rolls_back_and_grows():
    """Contexts that extend, diverge from and shrink below what a row cached, on a cache that starts
    with one row and must grow: every continuation equals a recomputation from scratch."""
    _, loaded = tiny_loaded("llama")
    lm = DraftLM(loaded, "cpu", max_len=64, max_seqs=1)
    a, b, c = PROMPTS
    rounds = [
        [("a", a, 4)],
        [("a", a + [1, 2], 3), ("b", b, 5), ("c", c, 2)],  # two new rows: 1 -> 2 -> 4
        [("a", a[:3], 4), ("b", b + [40], 1), ("c", c + [3, 3, 3], 6)],
        [("b", b + [40], 3)],  # everything cached already: the last token is fed again
    ]
    for requests in rounds:
        got = lm.extend(requests, argmax_chooser)
        assert got == [cache_free_greedy(loaded.model, ids, n) for _, ids, n in requests]
        for (rid, ids, n), new in zip(requests, got):
            assert lm._rows[rid].tokens == ids + new[:-1]  # the last draft token is never fed
    assert lm.cache.max_seqs == 4 and lm.cache.num_free == 1
    lm.release("b")
    assert lm.cache.num_free == 2
    # The cache end caps a continuation: len(ids) + n - 1 <= max_len.
    (tail,) = lm.extend([("d", [5] * 62, 8)], argmax_chooser)
    assert len(tail) == 3
