"""The engine is lossless under sampling with a repetition penalty, end to end.

Thousands of seeded requests from one prompt run through the real engine loop (prefill,
drafting, verification forward, grading, commit) with a real drafter, and what they generate is
compared with the exact law computed from the target itself: a forward over prompt + prefix for
every prefix that matters, processed by `processed_probs` with the penalty's seen set = prompt +
prefix, exactly what plain sampling draws from. Covered: the n-gram drafter (deterministic
drafts, one-hot rule; its drafts always repeat a context token), a draft model (sampled drafts,
q-ratio rule; it often drafts tokens new to the context, which the bonus row must then penalise)
and the adaptive speculation policy (lengths 0, 1 and 2 chosen by load and acceptance).
Negative controls (broken verification rows, a length cut that reads the draft) must fail.

Design, for power:
* conftest's tiny models have logits of std ~0.15: at temperature 1 they are nearly uniform over
  97 tokens, and neither the penalty nor a bug would move anything measurably. The target here
  is the tiny llama with its final norm scaled by SHARPEN, which scales the logits exactly: at
  temperature 1 a few tokens then hold most of the mass, and the penalty moves it visibly (tied
  embeddings make a random model repeat its last token; the penalty is what stops it).
* The prompt is the sharpened model's own sampled text, from the first seed where the n-gram
  drafter drafts for most first tokens and is accepted 30-80% of the time (computed exactly).
* max_tokens = 3: t1 comes from the prefill and t2, t3 from one round with k = 1 (accepted draft
  + bonus, or recovered token + a plain round), so the law of (t1, t2, t3) covers every way a
  token gets committed. With 4000 requests that law has ~90 pooled cells of >= 5 expected.
* Checks (Bonferroni to ALPHA per test): the joint law (chi-square + TV bound over pooled
  cells); the mean probability of t2 and of t3 under their own exact rows (a z-test that sees
  any reweighting toward likely or unlikely tokens, which the many-celled test dilutes); the
  bonus tokens against their rows, and how often the bonus repeats a new draft token (exact).
"""

from __future__ import annotations

import collections
import functools
import math
from dataclasses import dataclass, replace
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from conftest import ToyTokenizer, tiny_loaded
from tandem.config import EngineConfig, SamplingParams, SpecConfig
from tandem.drafters import DraftInput, TargetInfo, create_drafter, draft_model
from tandem.drafters.draft_model import DraftModelDrafter
from tandem.engine import drafting as drafting_module
from tandem.engine import engine as engine_module
from tandem.engine.engine import Engine
from tandem.model.arch import model_config_from_hf
from tandem.model.kv_cache import KVCache
from tandem.model.loader import LoadedModel, StateDictSource
from tandem.model.runner import ModelRunner, SeqInput
from tandem.model.transformer import TransformerLM
from tandem.sampling import make_generator, processed_probs
from tandem.scheduler.cost_model import CostCurve
from tandem.types import Draft
from tandem.verify import grading
from tandem.verify.stats import chi_square_test, total_variation, tv_bound

pytestmark = pytest.mark.usefixtures("one_thread")

SHARPEN = 20.0
PENALTY = 1.3
PARAMS = SamplingParams(temperature=1.0, repetition_penalty=PENALTY, max_tokens=3, ignore_eos=True)
ALPHA = 1e-4  # fixed seeds make every check deterministic; alpha only guards the choice of seeds
N = 4000  # requests per engine run
N_CONTROL = 2000  # requests per negative-control run
VOCAB = 97
MAX_NUM_SEQS = 128


def _model(state: dict[str, torch.Tensor], hf_config) -> TransformerLM:
    cfg = model_config_from_hf(hf_config.to_dict())
    return TransformerLM(cfg, StateDictSource(state, "none", torch.float32), torch.float32).eval()


@functools.lru_cache(maxsize=None)
def sharp_state(noise: float = 0.0) -> dict[str, torch.Tensor]:
    hf, _ = tiny_loaded("llama")
    gen = torch.Generator().manual_seed(1)
    state = {k: v.detach().clone() + noise * torch.randn(v.shape, generator=gen) for k, v in hf.state_dict().items()}
    state["model.norm.weight"] *= SHARPEN
    return state


@functools.lru_cache(maxsize=None)
def sharp_loaded(noise: float = 0.0) -> LoadedModel:
    """The sharpened tiny llama (noise > 0: a perturbed copy, the draft model)."""
    hf, _ = tiny_loaded("llama")
    model = _model(sharp_state(noise), hf.config)
    name = "tiny-sharp" if noise == 0 else f"tiny-sharp-noisy-{noise}"
    return LoadedModel(model, ToyTokenizer(), model.cfg, name, torch.float32, "none")


class Target:
    """Processed target distributions after any token sequence, by plain forwards (memoised):
    what plain sampling draws from after it, the penalty's seen set being the sequence's ids."""

    def __init__(self, loaded: LoadedModel, params: SamplingParams, rows: int = 128, max_len: int = 40) -> None:
        self.params = params
        self.cache = KVCache(loaded.config, rows, max_len, loaded.dtype, "cpu")
        self.runner = ModelRunner(loaded.model, self.cache)
        self.rows = [self.cache.allocate() for _ in range(rows)]
        self.memo: dict[tuple[int, ...], torch.Tensor] = {}

    def probs(self, seqs: list[tuple[int, ...]]) -> list[torch.Tensor]:
        todo = [s for s in dict.fromkeys(seqs) if s not in self.memo]
        for start in range(0, len(todo), len(self.rows)):
            chunk = todo[start : start + len(self.rows)]
            out = self.runner.forward([SeqInput(r, list(s), logits="last") for r, s in zip(self.rows, chunk)])
            for i, seq in enumerate(chunk):
                self.cache.truncate(self.rows[i], 0)
                seen = torch.tensor(sorted(set(seq)), dtype=torch.long)
                self.memo[seq] = processed_probs(out.rows(i), self.params, seen)[0].double()
        return [self.memo[s] for s in seqs]

    def joint(self, prompt: tuple[int, ...], depth: int, n: int, min_expected: float = 1.0) -> dict[tuple[int, ...], float]:
        """The law of the first `depth` tokens after the prompt as a partition into cells: full
        tuples, and shorter prefixes standing for all their continuations (expected count below
        min_expected in n samples: not worth a forward, and pooled by the test anyway)."""
        cells: dict[tuple[int, ...], float] = {}
        frontier = {(): 1.0}
        for _ in range(depth):
            expand = [p for p, m in frontier.items() if m * n >= min_expected]
            cells.update({p: m for p, m in frontier.items() if m * n < min_expected})
            nxt = {}
            for prefix, row in zip(expand, self.probs([prompt + p for p in expand])):
                for t in row.nonzero().flatten().tolist():
                    nxt[prefix + (t,)] = frontier[prefix] * float(row[t])
            frontier = nxt
        cells.update(frontier)
        return cells


@dataclass
class Check:
    name: str
    p_value: float
    n: int
    alpha: float
    tv: float = 0.0
    bound: float = 1.0
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.p_value >= self.alpha and self.tv <= self.bound

    def __str__(self) -> str:
        return f"{self.name}: n={self.n} p={self.p_value:.3g} {self.detail} tv={self.tv:.4f} bound={self.bound:.4f}"


def pooled_check(name: str, counts: torch.Tensor, expected: torch.Tensor, alpha: float = ALPHA) -> Check:
    """Chi-square and TV of counts against expected counts. Bins expected to hold < 5 are pooled
    first (a fixed function of the exact law, so tv_bound over the pooled bins is valid); counts
    in a bin of expected 0 are impossible and make chi-square infinite."""
    counts, expected = counts.double(), expected.double()
    n = float(counts.sum())
    rare = (expected < 5) & (expected > 0)
    counts = torch.cat([counts[~rare], counts[rare].sum()[None]])
    expected = torch.cat([expected[~rare], expected[rare].sum()[None]])
    support = int((expected > 0).sum())
    chi = chi_square_test(counts, expected)
    return Check(name, chi.p_value, int(n), alpha, total_variation(counts, expected), tv_bound(int(n), support, 1 - alpha),
                 f"(chi2={chi.statistic:.1f}, dof={chi.dof})")


def poisson_binomial_check(name: str, hits: int, probs: list[float], alpha: float = ALPHA) -> Check:
    """Exact two-sided test of a count of independent events with known probabilities (each
    round its own): the law of the count by convolution, p = the mass of counts no likelier
    than the one observed. No approximation, so small expected counts are fine."""
    pmf = torch.ones(1, dtype=torch.float64)
    for p in probs:
        pmf = torch.cat([pmf * (1 - p), torch.zeros(1, dtype=torch.float64)]) + torch.cat(
            [torch.zeros(1, dtype=torch.float64), pmf * p])
    p_value = float(pmf[pmf <= pmf[hits] * (1 + 1e-9)].sum())
    return Check(name, min(1.0, p_value), len(probs), alpha, detail=f"(observed {hits}, expected {sum(probs):.1f})")


def joint_check(name: str, samples: list[tuple[int, ...]], cells: dict[tuple[int, ...], float],
                alpha: float = ALPHA) -> Check:
    """The samples' tuples against the exact cells (a sample in no cell had probability 0)."""
    index = {c: i for i, c in enumerate(cells)}
    counts = torch.zeros(len(cells) + 1, dtype=torch.float64)  # last: impossible samples
    for s in samples:
        cell = next((s[:j] for j in range(len(s), -1, -1) if s[:j] in index), None)
        counts[index[cell] if cell is not None else -1] += 1
    probs = torch.tensor(list(cells.values()) + [0.0], dtype=torch.float64)
    return pooled_check(name, counts, probs * len(samples), alpha)


def likelihood_check(name: str, prompt: tuple[int, ...], target: Target, samples: list[tuple[int, ...]],
                     position: int, alpha: float = ALPHA) -> Check:
    """Do the tokens at `position` (0-based) have the right mean probability under their own
    exact rows? Given the prefixes, p(x_i) are independent, bounded, with known mean sum_x p(x)^2
    and variance sum_x p(x)^3 - (sum_x p(x)^2)^2: a z-test (thousands of terms: the normal
    approximation is accurate). It reacts to any reweighting toward likely (or unlikely) tokens,
    which the many-celled joint test dilutes: a length cut that reads the draft, a wrong
    temperature."""
    rows = target.probs([prompt + s[:position] for s in samples])
    observed = sum(float(row[s[position]]) for row, s in zip(rows, samples))
    expected = sum(float((row**2).sum()) for row in rows)
    variance = sum(float((row**3).sum() - (row**2).sum() ** 2) for row in rows)
    z = (observed - expected) / math.sqrt(variance)
    return Check(name, math.erfc(abs(z) / math.sqrt(2)), len(samples), alpha,
                 detail=f"(mean p {observed / len(samples):.4f}, expected {expected / len(samples):.4f}, z={z:.2f})")


@functools.lru_cache(maxsize=None)
def setup() -> tuple[tuple[int, ...], Target]:
    """The prompt: the sharpened model's own text (24 tokens sampled with the penalty) from the
    first seed where the n-gram drafter drafts for most first tokens (> 1/2 of p_1's mass) and
    is accepted 30-80% of the time, both computed exactly from p_1 and p_2."""
    target = Target(sharp_loaded(), PARAMS)
    ngram = create_drafter(NGRAM, TargetInfo(97, (2,)))
    for seed in range(20):
        gen = make_generator(seed)
        prompt = tuple(torch.randint(3, 97, (2,), generator=gen).tolist())
        while len(prompt) < 24:
            prompt += (int(torch.multinomial(target.probs([prompt])[0].float(), 1, generator=gen)),)
        p1 = target.probs([prompt])[0]
        firsts = [t for t in p1.nonzero().flatten().tolist() if p1[t] > 1e-3]
        drafted = accepted = 0.0
        for t, p2 in zip(firsts, target.probs([prompt + (t,) for t in firsts])):
            draft = ngram.propose([DraftInput("probe", list(prompt + (t,)), len(prompt), 1, PARAMS, None, {})])[0]
            ngram.release("probe")
            if draft.token_ids:
                drafted += float(p1[t])
                accepted += float(p1[t] * p2[draft.token_ids[0]])
        if drafted > 0.5 and 0.3 < accepted / drafted < 0.8:
            return prompt, target
    raise AssertionError("no prompt makes the n-gram drafter draft and get accepted often")


def run_engine(spec: SpecConfig, waves: list[int], params: SamplingParams = PARAMS, seed: int = 0,
               cost_curve: CostCurve | None = None, max_num_seqs: int = MAX_NUM_SEQS, hook=None):
    """Requests from the prompt (request i seeded seed * 1_000_003 + i), a wave at a time: each
    wave's requests are added together and stepped until all are done. -> (requests, engine)."""
    prompt, _ = setup()
    engine = Engine(sharp_loaded(), EngineConfig(max_model_len=64, max_num_seqs=max_num_seqs, spec=spec), cost_curve)
    if hook is not None:
        hook(engine)
    reqs = []
    for size in waves:
        for _ in range(size):
            reqs.append(engine.add_request(list(prompt), replace(params, seed=seed * 1_000_003 + len(reqs))))
        while engine.has_work():
            engine.step()
    assert all(len(r.output_ids) == params.max_tokens for r in reqs)
    assert all(r.finish_reason == "length" or r.output_ids[-1] in params.stop_token_ids for r in reqs)
    return reqs, engine


NGRAM = SpecConfig(algorithm="ngram", num_draft_tokens=1)
DRAFT_MODEL = SpecConfig(algorithm="draft_model", num_draft_tokens=1, draft_model_path="noisy")


@pytest.fixture
def noisy_draft_model(monkeypatch):
    """draft_model_path "noisy" loads a perturbed copy of the sharpened target: its q is close
    to p (acceptance ~0.7) but not equal, and it often drafts tokens new to the context."""
    monkeypatch.setattr(draft_model, "load_draft_model", lambda path, target: sharp_loaded(0.02))


def bonus_checks(reqs, prompt: tuple[int, ...], target: Target, alpha: float) -> list[Check]:
    """Rounds whose one draft token was accepted end with the bonus token t3, drawn from the
    target row after prompt + t1 + t2, which penalises t2 as well.

    1. The bonus tokens' histogram against the sum of their rows: given the prefixes the bonus
       tokens are independent draws from known rows, so the counts are a sum of multinomials,
       less dispersed than one multinomial with the averaged law: the chi-square is conservative.
    2. How often the bonus repeats a draft token new to the context, by an exact test against
       the rounds' own repeat probabilities: the one statistic a bonus row that
       forgets to penalise the draft token moves, by a factor ~4 here (tied embeddings make
       the random model repeat its last token; the penalty is what stops it).
    """
    full = [tuple(r.output_ids) for r in reqs if r.stats.num_accepted_tokens == 1]
    rows = target.probs([prompt + s[:2] for s in full])
    counts = torch.bincount(torch.tensor([s[2] for s in full]), minlength=VOCAB)
    checks = [pooled_check("bonus tokens", counts, torch.stack(rows).sum(0), alpha)]
    new = [(s, row) for s, row in zip(full, rows) if s[1] not in set(prompt) | {s[0]}]
    if new:
        repeats = sum(s[2] == s[1] for s, _ in new)
        checks.append(poisson_binomial_check("bonus repeats a new draft token", repeats,
                                             [float(row[s[1]]) for s, row in new], alpha))
    return checks


def engine_checks(reqs, sizes: list[int] | None = None, bonus: bool = True) -> list[Check]:
    """Every check of the committed tokens, Bonferroni-corrected to ALPHA in all:
    - the joint law of (t1, t2, t3) (also within each wave size, when `sizes` gives them);
    - the mean probability of t2 and of t3 under their exact rows;
    - with one draft token per round (`bonus`), the bonus checks."""
    prompt, target = setup()
    groups = [("", reqs)]
    if sizes is not None:
        groups += [(f", waves of {w}", [r for r, s in zip(reqs, sizes) if s == w]) for w in sorted(set(sizes), reverse=True)]
    alpha = ALPHA / (len(groups) + 2 + 2 * bonus)
    checks = []
    for name, group in groups:
        samples = [tuple(r.output_ids[:3]) for r in group]
        checks.append(joint_check(f"(t1, t2, t3){name}", samples, target.joint(prompt, 3, len(samples)), alpha))
    samples = [tuple(r.output_ids[:3]) for r in reqs]
    for j in (1, 2):
        checks.append(likelihood_check(f"mean p(t{j + 1})", prompt, target, samples, j, alpha))
    if bonus:
        checks += bonus_checks(reqs, prompt, target, alpha)
    return checks


def report(checks: list[Check]) -> str:
    return "\n".join(str(c) for c in checks)


@pytest.mark.parametrize("spec", [NGRAM, DRAFT_MODEL], ids=lambda s: s.algorithm)
def test_sampled_output_follows_the_target_under_a_repetition_penalty(spec, noisy_draft_model):
    """N requests, each: t1 from the prefill, then one round with one draft token. Power: 4000
    samples over ~90 pooled cells (TV bound 0.095; the chi-square sees much less: the
    no-penalty control, TV 0.18, gets p ~ 1e-70 from half the requests), 1600-3000 bonus tokens,
    and for the draft model ~1100 accepted new draft tokens, whose bonus repeats them ~10 times
    (~40 times without the draft token's penalty: p ~ 1e-8 from half the requests)."""
    reqs, engine = run_engine(spec, [N])
    stats = engine.stats
    # The drafter really drafted, and rounds mixed acceptances and rejections.
    assert stats.num_draft_tokens >= N / 2, stats.as_dict()
    assert 0.3 < stats.acceptance_rate < 0.9, stats.as_dict()
    checks = engine_checks(reqs)
    assert all(c.passed for c in checks), report(checks)
    names = [c.name for c in checks]
    if spec is DRAFT_MODEL:  # it drafts new tokens: the bonus row's penalty on them is checked
        assert "bonus repeats a new draft token" in names
        assert checks[-1].n >= 800


def rows_without_penalty(logits, draft, params, context, num_prompt_tokens=None, shift=None):
    """Verification rows processed without the repetition penalty (plain rows keep it)."""
    return processed_probs(logits, params)


def rows_penalising_the_context_only(logits, draft, params, context, num_prompt_tokens=None, shift=None):
    """Every verification row penalises the context only: the bonus row after an accepted
    draft token forgets that token (row i must also penalise d_1..d_{i-1})."""
    return processed_probs(logits, params, grading.seen_ids(context, params))


@pytest.mark.parametrize(
    "broken, spec, failing",
    [
        (rows_without_penalty, NGRAM, "(t1, t2, t3)"),
        (rows_penalising_the_context_only, DRAFT_MODEL, "bonus repeats a new draft token"),
    ],
    ids=lambda x: getattr(x, "__name__", None) or getattr(x, "algorithm", None),
)
def test_engine_negative_controls_fail_the_same_checks(broken, spec, failing, noisy_draft_model):
    """Broken verification rows, swapped in where the engine looks them up (grading's
    target_probs), must fail the checks above with half the requests (the same seeds). The
    n-gram drafter could not catch the second bug: its drafts are context tokens, penalised
    anyway; that is why the draft model runs too."""
    with mock.patch.object(grading, "target_probs", broken):
        reqs, _ = run_engine(spec, [N_CONTROL])
    checks = {c.name: c for c in engine_checks(reqs)}
    assert not checks[failing].passed, report(list(checks.values()))


# The adaptive policy. Its profile: a forward costs the same up to 48 tokens, then grows
# linearly (a CPU-like shape). With acceptance ~0.75 then ~0.5 per position the policy's best
# length is 0 for a batch of 64 (speculation off), 1 for 32 and 2 for 16: waves of those sizes
# make it change its mind with the load.
ADAPTIVE_CURVE = CostCurve.from_points({1: 0.010, 48: 0.010, 96: 0.020, 192: 0.040, 384: 0.080})
ADAPTIVE = SpecConfig(algorithm="draft_model", num_draft_tokens=2, draft_model_path="noisy", policy="adaptive")
ADAPTIVE_PARAMS = replace(PARAMS, max_tokens=4)  # the prefill, then a round with up to 2 drafts
WAVES = (64, 32, 32, 16, 16, 16, 16)  # a cycle: 64 requests at each of the three loads


def run_adaptive(waves: list[int]):
    """Waves of requests under the adaptive policy -> (requests, their wave sizes, engine,
    Counter of (limit, chosen length) over request-rounds).

    The engine's clock is frozen (the step's and the drafting's): the policy then corrects its
    profile by no measured time (it ignores rounds of 0 s), so its choices depend on the load and the acceptance history only,
    and the test is deterministic. Reading past rounds' times is allowed; it just is not
    reproducible."""
    chosen = collections.Counter()

    def spy_on_policy(engine):
        decide = engine.policy.draft_lengths

        def draft_lengths(slots):
            ks = decide(slots)
            chosen.update((s.limit, k) for s, k in zip(slots, ks))
            return ks

        engine.policy.draft_lengths = draft_lengths

    frozen = SimpleNamespace(perf_counter=lambda: 0.0)
    with mock.patch.object(engine_module, "time", frozen), mock.patch.object(drafting_module, "time", frozen):
        reqs, engine = run_engine(ADAPTIVE, waves, ADAPTIVE_PARAMS, cost_curve=ADAPTIVE_CURVE,
                                  max_num_seqs=max(WAVES), hook=spy_on_policy)
    sizes = [size for size in waves for _ in range(size)]
    return reqs, sizes, engine, chosen


ADAPTIVE_CYCLES = 21  # 4032 requests: 1344 per wave size


def test_sampled_output_follows_the_target_under_the_adaptive_policy(noisy_draft_model):
    """Waves of 64, 32 and 16 requests, max_tokens 4 (after the prefill, up to 2 drafts): the
    joint law of (t1, t2, t3) over all 4032 requests and within each wave size (1344 each: the
    lengths differ between them and each must be lossless on its own), and the mean p checks.
    Power: the negative control below (TV ~0.05 on t2 where it drafts) fails with 3200
    requests at p ~ 1e-13 (with 1600 its p-value was 1e-7 on torch.multinomial's random
    stream and 1e-4 on the inverse CDF's, either side of the 2.5e-5 threshold)."""
    reqs, sizes, engine, chosen = run_adaptive(list(WAVES) * ADAPTIVE_CYCLES)
    # The policy varied the length: with room for 2 drafts it chose 0, 1 and 2, each often.
    at_full_room = {k: n for (limit, k), n in chosen.items() if limit == 2}
    assert all(at_full_room.get(k, 0) >= 200 for k in (0, 1, 2)), sorted(chosen.items())
    stats = engine.stats
    assert len(stats.graded_per_position) == 2 and stats.graded_per_position[1] >= 500, stats.as_dict()
    assert 0.3 < stats.acceptance_rate < 0.9, stats.as_dict()
    checks = engine_checks(reqs, sizes, bonus=False)
    assert all(c.passed for c in checks), report(checks)


CUT = 0.3


def cut_before_an_unlikely_draft(propose):
    """A length decision that reads the draft (docs/algorithms.md section 5): each draft is cut before its
    first token the drafter itself found unlikely (q(d_j) < CUT). Graded with the q-ratio rule,
    a draft token that survived the cut no longer has law q: the output is biased."""
    def wrapped(self, batch):
        drafts = []
        for draft in propose(self, batch):
            keep = next((j for j, t in enumerate(draft.token_ids) if draft.probs[j, t] < CUT), len(draft))
            drafts.append(draft.truncated(keep) if keep else Draft.empty())
        return drafts
    return wrapped


def test_adaptive_negative_control_a_cut_that_reads_the_draft_fails(noisy_draft_model):
    """200 waves of 16 (the policy drafts 2 every time there is room) with the cut applied
    after drafting: the same checks must fail."""
    with mock.patch.object(DraftModelDrafter, "propose", cut_before_an_unlikely_draft(DraftModelDrafter.propose)):
        reqs, sizes, _, chosen = run_adaptive([16] * 200)
    assert {k for (limit, k) in chosen if limit == 2} == {2}  # the policy drafts 2, the cut shortens
    checks = {c.name: c for c in engine_checks(reqs, sizes, bonus=False)}
    assert not checks["(t1, t2, t3), waves of 16"].passed, report(list(checks.values()))


# min_tokens: the two tokens the prompt's first row likes best (0.55 of its mass, 0.28 of the
# third token's) are stop tokens, held back at the first two output positions. t1 comes from
# the prefill and t2 from a round's first row, both held back; t3 from the round's second row
# after an accepted draft, or from a plain round's first, free either way.
MIN_TOKENS = 2


class HeldBack(Target):
    """The target with the stop tokens at probability 0 (the rest renormalised) at the first
    MIN_TOKENS output positions: what plain decoding draws from under min_tokens (the ban is
    -inf on the logits before the penalty and temperature, and nothing here filters)."""

    def __init__(self, target: Target, prompt: tuple[int, ...], stops: list[int]) -> None:
        self.__dict__.update(vars(target))
        self.base, self.prompt_len, self.stops = target, len(prompt), stops

    def probs(self, seqs):
        rows = []
        for seq, row in zip(seqs, self.base.probs(seqs)):
            if len(seq) - self.prompt_len < MIN_TOKENS:
                row = row.clone()
                row[self.stops] = 0.0
                row /= row.sum()
            rows.append(row)
        return rows


def run_min_tokens(spec: SpecConfig, n: int) -> list[Check]:
    prompt, target = setup()
    stops = target.probs([prompt])[0].argsort(descending=True)[:2].tolist()
    params = replace(PARAMS, stop_token_ids=tuple(stops), min_tokens=MIN_TOKENS)
    reqs, engine = run_engine(spec, [n], params)
    stats = engine.stats  # drafts were graded, some accepted and some not
    assert stats.num_draft_tokens >= n / 5 and 50 <= stats.num_accepted_tokens < stats.num_draft_tokens, stats.as_dict()
    held = HeldBack(target, prompt, stops)
    samples = [tuple(r.output_ids) for r in reqs]
    alpha = ALPHA / 3
    return [joint_check("(t1, t2, t3)", samples, held.joint(prompt, 3, n), alpha),
            *(likelihood_check(f"mean p(t{j + 1})", prompt, held, samples, j, alpha) for j in (1, 2))]


@pytest.mark.parametrize("spec", [NGRAM, DRAFT_MODEL], ids=lambda s: s.algorithm)
def test_sampled_output_follows_the_target_under_min_tokens(spec, noisy_draft_model):
    """min_tokens under sampling: (t1, t2, t3) against the exact law with the stop tokens held
    back at the first two positions, through deterministic and sampled drafts."""
    checks = run_min_tokens(spec, N)
    assert all(c.passed for c in checks), report(checks)


def test_min_tokens_negative_control_a_ban_on_every_row_fails(noisy_draft_model):
    """A ban that ignores which output position each verified row draws (every row of a round
    that starts before min_tokens held back) keeps the stop tokens from t3 after an accepted
    draft: the joint law must see it."""
    def every_row(self, allowed, rows, parents=None):  # each row shifted as the round's first
        shift = original(self, allowed, 1)
        return None if shift is None else shift.expand(rows, -1)

    original = engine_module.Request.logit_shift
    with mock.patch.object(engine_module.Request, "logit_shift", every_row):
        checks = run_min_tokens(DRAFT_MODEL, N_CONTROL)
    assert not checks[0].passed, report(checks)

