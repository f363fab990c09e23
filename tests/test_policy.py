"""The speculation policy: adaptive draft lengths from load, a cost curve and acceptance history;
the fixed policy; config checks; and the engine staying lossless under the adaptive policy."""

import pytest

from conftest import tiny_loaded
from tandem.config import EngineConfig, SamplingParams, SpecConfig
from tandem.engine.engine import Engine
from tandem.llm import LLM
from tandem.scheduler.cost_model import CostCurve
from tandem.scheduler.factory import create_policy
from tandem.scheduler.policy import AdaptivePolicy, DraftSlot, FixedPolicy

pytestmark = pytest.mark.usefixtures("one_thread")

SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
# Verification nearly free: a forward over 128 tokens costs what one token costs.
CHEAP = CostCurve.from_points({n: 0.010 + 0.00001 * n for n in SIZES})
# Verification as expensive as decoding: time grows linearly with tokens.
LINEAR = CostCurve.from_points({n: 0.010 * n for n in SIZES})
# CPU-shaped: flat to ~4 tokens (per-op overhead), then compute-bound (torch int4 kernels measured on a 2-core CPU).
CPU = CostCurve.from_points({1: 0.030, 2: 0.032, 4: 0.036, 8: 0.060, 16: 0.110, 32: 0.210, 64: 0.410, 128: 0.810})


def adaptive(curve, k=6, **kw):
    return AdaptivePolicy(SpecConfig(algorithm="suffix", num_draft_tokens=k, policy="adaptive"), curve, **kw)


def slots(n, limit=6, prefix="r"):
    return [DraftSlot(f"{prefix}{i}", limit) for i in range(n)]


def teach(policy, request_id, accepted_of, rounds=40):
    """Feed rounds in which the request drafted `accepted_of[1]` tokens and `accepted_of[0]` passed
    (40 by default: a request's moving average keeps about ten rounds, REQUEST_EMA)."""
    accepted, drafted = accepted_of
    for _ in range(rounds):
        policy.observe(request_id, drafted, accepted)


def test_expensive_verification_turns_speculation_off():
    p = adaptive(LINEAR)
    teach(p, "r0", (6, 6))  # even perfect acceptance cannot beat a linear curve by the margin
    assert p.draft_lengths(slots(1)) == [0]
    assert p.draft_lengths(slots(4)) == [0, 0, 0, 0]


def test_cheap_verification_and_high_acceptance_draft_long():
    p = adaptive(CHEAP, k=6)
    teach(p, "r0", (6, 6))
    assert p.draft_lengths(slots(1)) == [6]
    assert p.last.predicted_speedup > 3


def test_low_acceptance_drafts_short_or_nothing():
    cheap = adaptive(CPU, k=6)
    teach(cheap, "r0", (6, 6))
    teach(cheap, "r1", (0, 6))  # rejected at the first token every time
    ks = cheap.draft_lengths([DraftSlot("r0", 6), DraftSlot("r1", 6)])
    assert ks[0] > 0 and ks[1] <= ks[0]
    # The padded forward makes r1's slots free; any drafting time makes them not worth it.
    for _ in range(20):
        cheap.observe_draft_time(seconds=0.001, tokens=1)
    ks = cheap.draft_lengths([DraftSlot("r0", 6), DraftSlot("r1", 6)])
    assert ks[0] > 0 and ks[1] == 0
    alone = adaptive(CPU, k=6)
    teach(alone, "bad", (0, 6))
    assert alone.draft_lengths([DraftSlot("bad", 6)]) == [0]


def test_load_shrinks_the_draft_until_it_turns_off():
    p = adaptive(CPU, k=6, prior=0.7)  # every request: 70% conditional acceptance per position
    longest = [max(p.draft_lengths(slots(batch))) for batch in (1, 2, 4, 8, 16, 32)]
    assert longest[0] >= 2, longest
    assert longest[-1] == 0, longest
    assert all(a >= b for a, b in zip(longest, longest[1:])), longest


def test_limits_are_respected():
    p = adaptive(CHEAP, k=6)
    for rid in ("a", "b", "c"):
        teach(p, rid, (6, 6))
    assert p.draft_lengths([DraftSlot("a", 0), DraftSlot("b", 2), DraftSlot("c", 6)]) == [0, 2, 6]


def test_acceptance_history_moves_the_length():
    p = adaptive(CPU, k=6)
    teach(p, "r", (6, 6))
    high = p.draft_lengths([DraftSlot("r", 6)])[0]
    teach(p, "r", (0, high), rounds=20)  # two memories of failures at the first token
    low = p.draft_lengths([DraftSlot("r", 6)])[0]
    assert high > 0 and low < high


def test_switched_off_request_is_retried_later():
    p = adaptive(CPU, k=6)
    teach(p, "r", (0, 6))
    assert p.draft_lengths([DraftSlot("r", 6)]) == [0]
    for _ in range(100):  # rounds without a draft relax the estimate toward the prior
        p.observe("r", 0, 0)
    assert p.draft_lengths([DraftSlot("r", 6)])[0] > 0


def test_new_requests_start_from_what_earlier_requests_showed():
    p = adaptive(CPU, k=6)
    for i in range(40):  # many short requests that never get their first draft token accepted
        teach(p, f"old{i}", (0, 2), rounds=3)
        p.release(f"old{i}")
    assert p.draft_lengths([DraftSlot("new", 6)]) == [0]
    assert "old0" not in p.acceptance  # released state is dropped


def test_expensive_drafter_turns_speculation_off():
    p = adaptive(CHEAP, k=6)
    teach(p, "r", (6, 6))
    assert p.draft_lengths([DraftSlot("r", 6)]) == [6]
    for _ in range(20):
        p.observe_draft_time(seconds=0.5, tokens=6)  # drafting a token costs 8x a whole forward
    assert p.draft_lengths([DraftSlot("r", 6)]) == [0]


def test_a_per_round_drafter_is_priced_per_round_not_per_token():
    """A block drafter's time is one cost per drafting request: a draft time that makes every
    draft token too dear for a per-token drafter still lets a per-round one draft its whole
    block, and the length is then chosen by the verification curve alone."""
    per_token, per_round = adaptive(CPU, k=6), adaptive(CPU, k=6, per_round_drafts=True)
    for p in (per_token, per_round):
        teach(p, "r", (6, 6))
        for _ in range(20):
            p.observe_draft_time(seconds=0.04, tokens=1)  # 40 ms per unit (a forward is 30): a token, or a round
    assert per_token.draft_lengths([DraftSlot("r", 6)]) == [0]
    assert per_round.draft_lengths([DraftSlot("r", 6)])[0] >= 3
    for _ in range(40):
        per_round.observe_draft_time(seconds=0.5, tokens=1)  # a round costs many forwards: off
    assert per_round.draft_lengths([DraftSlot("r", 6)]) == [0]


def test_engine_tells_the_policy_how_its_drafter_is_priced():

    spec = SpecConfig(algorithm="suffix", num_draft_tokens=4, policy="adaptive")
    assert create_policy(spec, CPU, per_round_drafts=True).per_round_drafts
    assert not create_policy(spec, CPU).per_round_drafts


def test_measured_rounds_override_a_wrong_profile():
    p = adaptive(CHEAP, k=6)
    teach(p, "r", (6, 6))
    assert p.draft_lengths([DraftSlot("r", 6)]) == [6]
    for _ in range(200):  # the rounds this process really runs cost what a linear curve says
        p.observe_round(1, 0.010)
        p.observe_round(7, 0.070)
    assert p.curve(7) == pytest.approx(0.070, rel=0.05) and p.curve(1) == pytest.approx(0.010, rel=0.05)
    assert p.curve(4) > 3 * CHEAP(4)  # unmeasured sizes: the profile scaled by the measured ratios
    assert p.draft_lengths([DraftSlot("r", 6)]) == [0]


def test_a_busy_spell_moves_the_level_and_leaves_the_shape():
    """Rounds of 5 rows measured while another tenant doubled every time, then plain rounds after
    it left: the 5-row size is priced at its old ratio to one row again, not at the busy time."""
    p = adaptive(CPU, k=6)
    for _ in range(10):
        p.observe_round(1, CPU(1))
        p.observe_round(5, CPU(5))
    for _ in range(10):
        p.observe_round(5, 2 * CPU(5))
    for _ in range(20):
        p.observe_round(1, CPU(1))
    assert p.curve(1) == pytest.approx(CPU(1), rel=0.05)
    assert p.curve(5) / p.curve(1) == pytest.approx(CPU(5) / CPU(1), rel=0.1)


def test_neighbouring_large_sizes_share_one_shape():
    """Rounds of 15 rows read 10% slow and of 16 rows 5% fast (noise): priced alone, the 16th row
    would cost about nothing; sharing their shape, it costs the profile's row again. Small sizes
    keep their own shapes."""
    curve = CostCurve((1, 8, 32), (0.010, 0.020, 0.060))  # rows past 8 cost 1.67 ms
    p = adaptive(curve, k=6)
    for _ in range(40):
        p.observe_round(15, 1.10 * curve(15))
        p.observe_round(16, 0.95 * curve(16))
        p.observe_round(1, curve(1))
        p.observe_round(2, 1.3 * curve(2))
    row = curve(16) - curve(15)
    assert p.curve(16) - p.curve(15) == pytest.approx(row * p.curve.level * p.curve._shape(16), rel=1e-6)
    assert p.curve(16) - p.curve(15) > 0.9 * row
    assert p.curve(2) / p.curve(1) == pytest.approx(1.3 * curve(2) / curve(1), rel=0.05)


def test_prefixes_are_priced_and_taken_off_what_is_learnt():
    """A round over longer prefixes costs more by the profile's per-key costs, and what they
    added is taken off before the live curve learns from it."""
    curve = CostCurve((1, 8), (0.010, 0.012), context=200, per_key=1e-6, per_key_row=0.5e-6)
    p = adaptive(curve, k=6)
    assert p.seconds([5], [1200]) == pytest.approx(curve(5) + 1000 * (1e-6 + 5 * 0.5e-6))
    assert p.seconds([1, 1], [100, 300]) == pytest.approx(curve(2))  # one prefix shorter, one longer
    assert p.seconds([5], [0]) >= 0.5 * curve(5)  # never below half the curve
    for _ in range(10):
        p.observe_round(5, curve(5) + 1000 * (1e-6 + 5 * 0.5e-6), [5], [1200])
    assert p.curve(5) == pytest.approx(curve(5))
    # The engine's slots carry their contexts: a long prefix makes rows dearer, so drafts shorter.
    p.acceptance["r"] = [0.8] * 6
    short = p.draft_lengths([DraftSlot("r", 6, context=200)])
    long = p.draft_lengths([DraftSlot("r", 6, context=4000)])
    assert long[0] < short[0]


def test_one_slow_draft_measurement_does_not_stop_drafting_for_good():
    """Drafting time is measured only when something is drafted: a round in which the shared CPU
    was taken away mid-draft prices drafting too high to draft, and the estimate then relaxes
    toward the fastest drafting measured until drafting pays again."""
    p = adaptive(CPU, k=4)
    teach(p, "r", (2, 4))
    p.observe_draft_time(0.0004, 4)
    assert p.draft_lengths([DraftSlot("r", 4)])[0] > 0
    for _ in range(10):
        p.observe_draft_time(0.4, 4)  # 100x the drafting measured before
    assert p.draft_lengths([DraftSlot("r", 4)]) == [0]
    rounds = 1
    while p.draft_lengths([DraftSlot("r", 4)]) == [0]:
        rounds += 1
        assert rounds < 300
    assert rounds > 10  # not at once: a drafter that really got slower stays off for a while


def test_uniform_slowdown_keeps_the_decisions():
    p, q = adaptive(CPU, k=6, prior=0.7), adaptive(CPU, k=6, prior=0.7)
    for _ in range(5):
        q.observe_round(1, 2 * CPU(1))  # another tenant made everything twice as slow
    assert q.curve(16) == pytest.approx(2 * CPU(16))
    for batch in (1, 2, 4, 8):
        assert p.draft_lengths(slots(batch)) == q.draft_lengths(slots(batch))


def test_fixed_policy_and_num_steps():
    spec = SpecConfig(algorithm="suffix", num_draft_tokens=4, num_steps=3)
    assert spec.max_draft_len == 3
    p = create_policy(spec)
    assert isinstance(p, FixedPolicy)
    assert p.draft_lengths([DraftSlot("a", 9), DraftSlot("b", 1), DraftSlot("c", 0)]) == [3, 1, 0]


def test_trees_are_costed_at_their_node_budget():
    """A tree verifies num_draft_tokens + 1 tokens per request whatever its depth: on the CPU
    curve a 32-node tree committing 4 tokens per round loses to plain decoding, a 4-node one
    wins; on a cheap curve the big tree drafts deep."""
    def tree(curve, nodes):
        spec = SpecConfig(algorithm="eagle3", num_draft_tokens=nodes, eagle_topk=4, num_steps=5, policy="adaptive")
        policy = AdaptivePolicy(spec, curve)
        for _ in range(12):
            policy.observe("r0", 5, 3)  # depth 5, three levels passed every round
        return policy

    assert tree(CPU, 32).draft_lengths(slots(1, limit=5)) == [0]
    assert tree(CPU, 4).draft_lengths(slots(1, limit=5))[0] > 0
    assert tree(CHEAP, 32).draft_lengths(slots(1, limit=5)) == [5]


def test_tree_depth_defaults():
    assert SpecConfig(algorithm="eagle3", num_draft_tokens=16, eagle_topk=4).max_draft_len == 5
    assert SpecConfig(algorithm="eagle3", num_draft_tokens=16, eagle_topk=4, num_steps=7).max_draft_len == 7
    assert SpecConfig(algorithm="eagle3", num_draft_tokens=3, eagle_topk=2).max_draft_len == 3


def test_config_errors_say_what_to_do():
    with pytest.raises(ValueError, match="eagle_topk must be >= 1"):
        SpecConfig(eagle_topk=0)
    with pytest.raises(ValueError, match="policy must be one of"):
        SpecConfig(policy="greedy")
    with pytest.raises(ValueError, match="num_steps"):
        SpecConfig(num_steps=0)
    with pytest.raises(ValueError, match="cost curve"):
        create_policy(SpecConfig(algorithm="suffix", policy="adaptive"))


PROMPTS = [[5, 17, 33, 8, 91, 4, 5, 17, 33, 8], [60, 61, 62, 60, 61, 62, 60], [7] * 11 + [12, 13], [40, 41, 42, 43]]


@pytest.mark.parametrize("curve, drafts", [(CHEAP, True), (LINEAR, False)])
def test_engine_with_adaptive_policy_is_lossless(curve, drafts):
    _, loaded = tiny_loaded("llama")
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = LLM.from_loaded(loaded, EngineConfig(max_model_len=128, max_num_seqs=1))
    expected = [plain.generate(p, params)[0].token_ids for p in PROMPTS]
    spec = SpecConfig(algorithm="suffix", num_draft_tokens=5, policy="adaptive")
    engine = Engine(loaded, EngineConfig(max_model_len=128, max_num_seqs=4, spec=spec), cost_curve=curve)
    reqs = [engine.add_request(p, params) for p in PROMPTS]
    while engine.has_work():
        engine.step()
    assert [r.output_ids for r in reqs] == expected
    assert (engine.stats.num_draft_tokens > 0) == drafts
    assert engine.policy.acceptance == {}  # every finished request's state was released
