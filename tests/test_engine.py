"""Engine on tiny random models: greedy identity with transformers, batching, seeds, stop
conditions, and the speculative loop with scripted drafters (accepts, rejections, stops inside
accepted runs)."""

import time

import pytest
import torch

from conftest import tiny_loaded
from tandem.config import EngineConfig, SamplingParams, SpecConfig
from tandem.drafters import Drafter, DrafterNeeds, register
from tandem.llm import LLM
from tandem.engine.drafting import POOR_DRAFTER_TAU, poor_drafter
from tandem.types import Draft, SpecStats

PROMPTS = [[5, 17, 33, 8, 91, 4], [60, 61, 62], [7] * 11 + [12, 13]]


def make_llm(arch="llama", spec: SpecConfig | None = None, max_num_seqs=4):
    _, loaded = tiny_loaded(arch)
    return LLM.from_loaded(loaded, EngineConfig(max_model_len=128, max_num_seqs=max_num_seqs, spec=spec or SpecConfig()))


# A scripted drafter: proposes the plain greedy continuation (from a reference run the test
# installs), corrupted at every `wrong_every`-th draft position, so rounds mix full acceptance,
# early rejection and bonus tokens.
SCRIPT: dict = {}


@register("test_scripted")
class ScriptedDrafter(Drafter):
    def propose(self, batch):
        drafts = []
        for inp in batch:
            ref = SCRIPT["continuations"][tuple(inp.token_ids[: inp.num_prompt_tokens])]
            done = len(inp.token_ids) - inp.num_prompt_tokens
            k = min(self.spec.num_draft_tokens, inp.max_draft_tokens)
            SCRIPT.setdefault("budgets", []).append((done, inp.max_draft_tokens))
            toks = list(ref[done : done + k])
            # keep drafting past the reference end (beyond EOS/max_tokens) to test trimming
            toks += [3] * (k - len(toks))
            every = SCRIPT["wrong_every"]
            if every:
                toks = [(t + 1) % 97 if (done + i) % every == every - 1 else t for i, t in enumerate(toks)]
            drafts.append(Draft(toks))
        return drafts


def scripted_chain(inp, k: int) -> list[int]:
    """The plain greedy continuation from the installed script, corrupted every `wrong_every`."""
    ref = SCRIPT["continuations"][tuple(inp.token_ids[: inp.num_prompt_tokens])]
    done = len(inp.token_ids) - inp.num_prompt_tokens
    toks = list(ref[done : done + k])
    toks += [3] * (k - len(toks))
    every = SCRIPT["wrong_every"]
    if every:
        toks = [(t + 1) % 97 if (done + i) % every == every - 1 else t for i, t in enumerate(toks)]
    return toks


@register("test_scripted_tree")
class ScriptedTreeDrafter(Drafter):
    """The scripted chain as the second branch of a tree: a decoy branch first, and a decoy
    sibling beside every scripted node, so acceptance has to pick the right child at every depth."""

    drafts_trees = True

    def propose(self, batch):
        drafts = []
        for inp in batch:
            chain = scripted_chain(inp, min(self.spec.max_draft_len, inp.max_draft_tokens))
            tree = Draft([(chain[0] + 2) % 97, (chain[0] + 5) % 97], None, [-1, 0])
            for i, token in enumerate(chain):
                tree = tree.with_branch(chain[:i] + [(token + 7) % 97]).with_branch(chain[: i + 1])
            drafts.append(tree)
        return drafts


@register("test_sampled")
class SampledDrafter(Drafter):
    """Draws drafts from a fixed random distribution q and reports q: exercises the stochastic rule."""

    def propose(self, batch):
        out = []
        for inp in batch:
            k = min(self.spec.num_draft_tokens, inp.max_draft_tokens)
            q = torch.softmax(torch.randn(k, 97, generator=torch.Generator().manual_seed(len(inp.token_ids))) * 3, -1)
            toks = torch.multinomial(q, 1, generator=inp.generator).squeeze(-1).tolist()
            out.append(Draft(toks, probs=q))
        return out


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_matches_transformers_generate(arch):
    hf, loaded = tiny_loaded(arch)
    llm = LLM.from_loaded(loaded, EngineConfig(max_model_len=128))
    for prompt in PROMPTS:
        ours = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20, min_new_tokens=20)
        assert ours.token_ids == ref[0, len(prompt):].tolist()
        assert ours.finish_reason == "length"


def test_batched_equals_single():
    llm = make_llm(max_num_seqs=2)  # 3 prompts, 2 cache rows: also exercises queueing
    params = SamplingParams(temperature=0, max_tokens=15, ignore_eos=True)
    batched = llm.generate(PROMPTS, params)
    single = [make_llm().generate(p, params)[0] for p in PROMPTS]
    assert [o.token_ids for o in batched] == [o.token_ids for o in single]


def test_seeds_reproduce_and_differ():
    llm = make_llm()
    a = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=30, seed=7, ignore_eos=True))[0]
    b = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=30, seed=7, ignore_eos=True))[0]
    c = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=30, seed=8, ignore_eos=True))[0]
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    # without a seed every request draws its own: not the same tokens twice, nor within a batch
    unseeded = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    d, e = llm.generate([PROMPTS[0], PROMPTS[0]], unseeded)
    f = llm.generate(PROMPTS[0], unseeded)[0]
    assert len({tuple(d.token_ids), tuple(e.token_ids), tuple(f.token_ids)}) == 3


def test_stop_token_and_stop_string_and_max_tokens():
    llm = make_llm()
    base = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].token_ids
    stop_tok = base[6]
    first = base.index(stop_tok)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=(stop_tok,), ignore_eos=True))[0]
    assert out.token_ids == base[: first + 1] and out.finish_reason == "stop"
    assert out.text == "".join(f"<{t}>" for t in base[:first])  # the stop token's text is not the answer's (vLLM)
    stop_str = f"<{base[4]}><{base[5]}>"
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, stop=(stop_str,), ignore_eos=True))[0]
    assert stop_str not in out.text and out.finish_reason == "stop"
    full = "".join(f"<{t}>" for t in base)
    assert out.text == full[: full.find(stop_str)]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert out.token_ids == base[:5] and out.finish_reason == "length"


def _install_script(llm, params, wrong_every):
    plain = make_llm().generate(PROMPTS, params)
    SCRIPT["continuations"] = {tuple(p): o.token_ids for p, o in zip(PROMPTS, plain)}
    SCRIPT["wrong_every"] = wrong_every
    return plain


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("wrong_every", [0, 3, 5])
def test_speculative_greedy_identity_scripted(k, wrong_every):
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    llm = make_llm(spec=SpecConfig(algorithm="test_scripted", num_draft_tokens=k))
    plain = _install_script(llm, params, wrong_every)
    spec = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    stats = spec[0].spec
    assert stats.num_draft_tokens > 0
    if wrong_every == 0:
        assert stats.acceptance_rate == 1.0 and stats.mean_acceptance_length > 1.0
    else:
        assert stats.acceptance_rate < 1.0
    assert len(spec[0].token_ids) == 25


@pytest.mark.parametrize("depth", [1, 3, 6])
@pytest.mark.parametrize("wrong_every", [0, 2, 5])
def test_tree_greedy_identity_scripted(depth, wrong_every):
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    spec = SpecConfig(algorithm="test_scripted_tree", num_draft_tokens=2 * depth + 2, eagle_topk=2, num_steps=depth)
    llm = make_llm(spec=spec)
    plain = _install_script(llm, params, wrong_every)
    out = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    stats = out[0].spec
    assert stats.num_draft_tokens > stats.num_drafts  # several nodes per round
    if wrong_every == 0:
        assert stats.mean_acceptance_length > min(depth, 3)  # the scripted branch is found at every depth
    assert len(stats.accepted_per_position) <= depth


@pytest.mark.parametrize("penalty", [{"repetition_penalty": 1.8}, {"presence_penalty": 1.5},
                                     {"frequency_penalty": 0.8, "presence_penalty": -0.3}], ids=lambda p: ",".join(p))
@pytest.mark.parametrize("algorithm, tree", [("test_scripted", False), ("test_scripted_tree", True)])
@pytest.mark.parametrize("wrong_every", [0, 3])
def test_penalised_greedy_identity(algorithm, tree, penalty, wrong_every):
    """With a penalty, the target row after draft tokens d_1..d_i counts them too, as plain
    decoding would after committing them: speculative output stays plain output, through
    accepted runs and rejections alike."""
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, **penalty)
    spec = SpecConfig(algorithm=algorithm, num_draft_tokens=10 if tree else 4, eagle_topk=2 if tree else 1, num_steps=4)
    llm = make_llm(spec=spec)
    plain = _install_script(llm, params, wrong_every)
    unpenalised = make_llm().generate(PROMPTS, SamplingParams(temperature=0, max_tokens=25, ignore_eos=True))
    assert [o.token_ids for o in plain] != [o.token_ids for o in unpenalised]  # the penalty is felt
    out = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    assert out[0].spec.mean_acceptance_length > (2 if wrong_every == 0 else 1.2)


@pytest.mark.parametrize("algorithm, tree", [("test_scripted", False), ("test_scripted_tree", True), ("ngram", False)])
def test_logit_bias_greedy_identity(algorithm, tree):
    """A logit bias banning some of plain decoding's tokens and favouring another moves the
    output, and speculative output is plain output under the same bias, token for token."""
    free = make_llm().generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    banned = {t: -100.0 for o in free for t in o.token_ids[2:5]}
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logit_bias={**banned, 44: 3.0})
    spec = SpecConfig(algorithm=algorithm, num_draft_tokens=10 if tree else 4, eagle_topk=2 if tree else 1, num_steps=4)
    llm = make_llm(spec=spec)
    plain = _install_script(llm, params, 3)
    assert all(t not in banned for o in plain for t in o.token_ids)
    assert [o.token_ids for o in plain] != [o.token_ids for o in free]
    out = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    forced = make_llm().generate(PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=8, seed=1, logit_bias={44: 100.0},
                                                            ignore_eos=True))[0]
    assert forced.token_ids == [44] * 8


def test_logit_bias_is_checked():
    with pytest.raises(ValueError, match="biases in"):
        SamplingParams(logit_bias={5: 101.0})
    with pytest.raises(ValueError, match="vocabulary"):
        make_llm().generate(PROMPTS[0], SamplingParams(logit_bias={500: 1.0}))


def _min_tokens_case():
    """A greedy answer, a stop token it draws early (at index 2 or later) and a min_tokens past it."""
    base = make_llm().generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].token_ids
    stop = next(t for i, t in enumerate(base) if i >= 2 and base.index(t) == i)
    return base, stop, base.index(stop) + 4


def test_min_tokens_holds_back_stop_tokens_and_strings():
    """vLLM's min_tokens: the stop tokens cannot be drawn at the first min_tokens positions (the
    answer is the one with the token banned there) and stop strings found in those tokens' text
    do not end it; a stop token after them does."""
    base, stop, m = _min_tokens_case()
    banned = make_llm().generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                             logit_bias={stop: -100.0}))[0].token_ids
    llm = make_llm()
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                  stop_token_ids=(stop,), min_tokens=m))[0]
    assert out.token_ids[:m] == banned[:m] and stop not in out.token_ids[:m]
    if stop in out.token_ids:  # a stop token after min_tokens still ends the answer
        assert out.token_ids[-1] == stop and out.token_ids.index(stop) >= m and out.finish_reason == "stop"
    early = f"<{base[1]}>"  # in the text of the first tokens, where stop strings are not looked for
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=(early,),
                                                  min_tokens=m))[0]
    assert out.token_ids[:m] == base[:m] and len(out.token_ids) > m
    j = next(i for i, t in enumerate(base) if i > m and t not in base[:i])  # a token new after min_tokens
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                  stop=(early, f"<{base[j]}>"), min_tokens=m))[0]
    assert out.finish_reason == "stop" and out.token_ids == base[: j + 1]
    assert out.text == "".join(f"<{t}>" for t in base[:j])
    eos = llm.engine.add_request(PROMPTS[0], SamplingParams(min_tokens=3, stop_token_ids=(stop,)))
    ban = eos.stop_ban  # EOS (2) and the stop token, nothing else
    assert ban[2] == ban[stop] == float("-inf") and ban.isfinite().sum() == ban.numel() - 2
    llm.engine.abort(eos.request_id)


@pytest.mark.parametrize("algorithm, tree", [("test_scripted", False), ("test_scripted_tree", True), ("ngram", False)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_under_speculation(algorithm, tree, temperature):
    """Speculative output under min_tokens is plain output under it, token for token (greedy),
    and for a seeded sampled request its stop tokens never come early: each verified row's ban
    follows the output position it draws, along a chain or a tree's paths."""
    _, stop, m = _min_tokens_case()
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=25, ignore_eos=True, stop_token_ids=(stop,),
                            min_tokens=m)
    spec = SpecConfig(algorithm=algorithm, num_draft_tokens=10 if tree else 4, eagle_topk=2 if tree else 1, num_steps=4)
    llm = make_llm(spec=spec)
    plain = _install_script(llm, params, 3)
    unbanned = make_llm().generate(PROMPTS, SamplingParams(temperature=temperature, seed=3, max_tokens=25,
                                                           ignore_eos=True, stop_token_ids=(stop,)))
    out = llm.generate(PROMPTS, params)
    for o in out:
        assert stop not in o.token_ids[:m]
    if temperature == 0:
        assert [o.token_ids for o in plain] != [o.token_ids for o in unbanned]  # min_tokens is felt
        assert [o.token_ids for o in out] == [o.token_ids for o in plain]
        assert sum(o.spec.num_accepted_tokens for o in out) > 0


@pytest.mark.parametrize("algorithm, tree", [("test_scripted", False), ("test_scripted_tree", True)])
def test_a_stop_token_right_at_min_tokens_ends_the_answer_under_speculation(algorithm, tree):
    """min_tokens = the index where greedy decoding draws the stop token: the first position it
    may come at. Whichever draft row (a chain position, a tree depth) draws that position must not
    ban it; rounds of several alignments put it at several depths."""
    base, stop, _ = _min_tokens_case()
    m = base.index(stop)
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, stop_token_ids=(stop,), min_tokens=m)
    spec = SpecConfig(algorithm=algorithm, num_draft_tokens=10 if tree else 4, eagle_topk=2 if tree else 1, num_steps=4)
    for wrong_every in (0, 2, 3, 5):
        llm = make_llm(spec=spec)
        plain = _install_script(llm, params, wrong_every)
        assert plain[0].token_ids == base[: m + 1] and plain[0].finish_reason == "stop"
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == [o.token_ids for o in plain], wrong_every


def test_logit_bias_holds_while_min_tokens_bans_the_stop_tokens():
    """The logit bias is added to the rows the min_tokens ban shifts too, not only to unbanned ones."""
    _, stop, m = _min_tokens_case()
    favoured = next(t for t in range(3, 97) if t != stop)
    for spec in (None, SpecConfig(algorithm="ngram", num_draft_tokens=4)):
        out = make_llm(spec=spec).generate(PROMPTS[0], SamplingParams(
            temperature=0, max_tokens=m + 3, min_tokens=m, stop_token_ids=(stop,), logit_bias={favoured: 100.0},
            ignore_eos=True))[0]
        assert out.token_ids == [favoured] * (m + 3)


def test_min_tokens_is_checked():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=-1)
    with pytest.raises(TypeError, match="min_tokens"):
        SamplingParams(min_tokens=2.5)
    from tandem.config import StructuredOutput
    with pytest.raises(ValueError, match="min_tokens cannot be combined"):
        SamplingParams(min_tokens=2, structured_output=StructuredOutput(regex="a+"))
    # a max_tokens the context cuts takes min_tokens down with it
    out = make_llm().generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=500, min_tokens=400))[0]
    assert len(out.token_ids) == 128 - len(PROMPTS[0]) and out.finish_reason == "length"


def test_stops_inside_an_accepted_run():
    """Drafts run past max_tokens and past a stop token: nothing after them is emitted or counted."""
    base_params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm = make_llm(spec=SpecConfig(algorithm="test_scripted", num_draft_tokens=8))
    plain = _install_script(llm, base_params, 0)
    for p, ref in zip(PROMPTS, plain):
        SCRIPT["budgets"] = []
        out = llm.generate(p, SamplingParams(temperature=0, max_tokens=11, ignore_eos=True))[0]
        assert out.token_ids == ref.token_ids[:11] and out.finish_reason == "length"
        # no round drafts past what max_tokens leaves (the bonus token is the round's own)
        assert SCRIPT["budgets"] and all(k <= 11 - done - 1 for done, k in SCRIPT["budgets"])
        stop_tok = ref.token_ids[9]
        cut = ref.token_ids.index(stop_tok)
        out = llm.generate(p, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=(stop_tok,), ignore_eos=True))[0]
        assert out.token_ids == ref.token_ids[: cut + 1]
        assert out.spec.num_committed_tokens == len(out.token_ids)


def test_a_round_longer_than_max_tokens_leaves_is_cut_where_it_reaches_it(toy_tokenizer):
    """Request.append itself keeps no token past max_tokens, whatever a round hands it."""
    from tandem.engine.request import Request

    req = Request("r", [5, 6], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), torch.Generator(),
                  frozenset({2}))
    assert req.append([7, 8, 9], toy_tokenizer) == 3 and req.finish_reason is None
    assert req.append([10, 11, 12], toy_tokenizer) == 1
    assert req.output_ids == [7, 8, 9, 10] and req.finish_reason == "length"


def test_sampled_drafter_seeds_reproduce():
    llm = make_llm(spec=SpecConfig(algorithm="test_sampled", num_draft_tokens=3))
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=20, seed=11, ignore_eos=True)
    a = llm.generate(PROMPTS[0], params)[0]
    b = llm.generate(PROMPTS[0], params)[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 20
    assert all(0 <= t < 97 for t in a.token_ids)
    assert a.spec.num_draft_tokens > 0


def test_prompt_longer_than_context_is_rejected():
    llm = make_llm()
    with pytest.raises(ValueError, match="context"):
        llm.generate([5] * 200, SamplingParams(max_tokens=4))


def test_a_bad_request_is_refused_and_leaves_the_engine_working():
    """Token ids outside the vocabulary (prompt or stop_token_ids) are refused before anything
    runs, and a generate() that fails part way (here: the second prompt of a batch) leaves
    nothing in the engine: the next call decodes as if it never happened."""
    llm = make_llm(spec=SpecConfig(algorithm="suffix", num_draft_tokens=4))
    params = SamplingParams(temperature=0, max_tokens=8)
    want = llm.generate(PROMPTS[0], params)[0].token_ids
    for bad in ([[10**9]], [[-5, 3]], [PROMPTS[0], [5, 97]]):
        with pytest.raises(ValueError, match="vocabulary"):
            llm.generate(bad, params)
        assert not llm.engine.has_work()
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=(500,)))
    assert llm.generate(PROMPTS[0], params)[0].token_ids == want
    stream = llm.stream(PROMPTS[1], params)
    next(stream)
    stream.close()  # a caller that stops reading: its request leaves the engine
    assert not llm.engine.has_work() and llm.generate(PROMPTS[0], params)[0].token_ids == want


@pytest.mark.parametrize("algorithm", [None, "suffix"])
def test_streams_read_in_turn_and_a_generate_between_reads_lose_no_text(algorithm):
    """Each stream keeps the text committed for it while another stream or a generate() steps
    the engine: every stream's pieces join to what generate() gives the same prompt."""
    import itertools

    llm = make_llm(spec=SpecConfig(algorithm=algorithm, num_draft_tokens=4))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.text for o in llm.generate(PROMPTS[:3], params)]
    first, second = llm.stream(PROMPTS[0], params), llm.stream(PROMPTS[1], params)
    got = ["", ""]
    for a, b in itertools.zip_longest(first, second, fillvalue=""):  # read in turn
        got[0] += a
        got[1] += b
    assert got == want[:2] and got[0] and got[1]
    third = llm.stream(PROMPTS[2], params)
    text = next(third)
    assert llm.generate(PROMPTS[0], params)[0].text == want[0]  # runs while the stream waits unread
    text += "".join(third)
    assert text == want[2] and not llm.engine.has_work()


@pytest.mark.parametrize("algorithm", [None, "suffix"])
def test_threads_sharing_one_llm_get_their_own_answers(algorithm):
    """generate and stream called from several threads at once on one LLM: every call gets what
    it gets alone (greedy), none hangs, and the engine is empty afterwards."""
    import threading

    llm = make_llm(spec=SpecConfig(algorithm=algorithm, num_draft_tokens=4))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(PROMPTS, params)]
    texts = [o.text for o in llm.generate(PROMPTS, params)]
    got, errors = {}, []

    def work(name, calls):
        try:
            for i in range(calls):
                if name == "stream":
                    got.setdefault(name, []).append("".join(llm.stream(PROMPTS[i % 3], params)))
                else:
                    got.setdefault(name, []).append([o.token_ids for o in llm.generate(PROMPTS, params)])
        except Exception as err:  # reported below, with the thread's name
            errors.append((name, err))

    threads = [threading.Thread(target=work, args=(name, 6), daemon=True) for name in ("a", "b", "stream")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert got["a"] == got["b"] == [want] * 6
    assert got["stream"] == [texts[i % 3] for i in range(6)]
    assert not llm.engine.has_work()
    # each thread's last stream is its own
    outputs = {}

    def last_of(name, prompt, tokens):
        "".join(llm.stream(prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)))
        time.sleep(0.5)  # the other thread finishes its stream meanwhile
        outputs[name] = llm.last_output.prompt_token_ids

    threads = [threading.Thread(target=last_of, args=(name, PROMPTS[i], 3 + 20 * i)) for i, name in enumerate("ab")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert outputs == {"a": PROMPTS[0], "b": PROMPTS[1]}


def test_library_arguments_of_the_wrong_kind_are_named():
    llm = make_llm()
    for prompts, message in ((None, "got NoneType"), (5, "got int"), (b"1 2", "got bytes"),
                             ({"a": 1}, "got dict"), (["1 2", None], "got NoneType")):
        with pytest.raises(TypeError, match=message):
            llm.generate(prompts)
    with pytest.raises(TypeError, match="sampling_params is a SamplingParams"):
        llm.generate(PROMPTS[0], {"temperature": 0})
    with pytest.raises(ValueError, match="chat=True"):
        llm.generate(PROMPTS[0], chat=True)
    with pytest.raises(ValueError, match="not a token id"):
        llm.generate([True, 5, 6])
    with pytest.raises(TypeError, match="stream takes one prompt"):
        next(llm.stream([PROMPTS[0], PROMPTS[1]]))
    with pytest.raises(ValueError, match="seed must be in"):
        SamplingParams(seed=2**64)
    SamplingParams(seed=2**64 - 1), SamplingParams(seed=-(2**63))
    with pytest.raises(TypeError, match="ignore_eos must be True or False"):
        SamplingParams(ignore_eos="yes")
    with pytest.raises(TypeError, match="structured_output must be a StructuredOutput"):
        SamplingParams(structured_output="json")
    with pytest.raises(TypeError, match="max_model_len must be an integer"):
        EngineConfig(max_model_len="2048")
    with pytest.raises(TypeError, match="enable_prefix_caching must be True or False"):
        EngineConfig(enable_prefix_caching="no")
    assert not llm.engine.has_work() and llm.generate(PROMPTS[0], SamplingParams(max_tokens=2))[0].token_ids


@pytest.mark.parametrize("field, value", [("seed", "x"), ("stop", [1, 2]), ("max_tokens", 2.5), ("top_k", 1.5),
                                          ("max_tokens", True), ("stop_token_ids", (-1,)), ("top_k", 2**63)])
def test_sampling_params_refuse_values_of_the_wrong_kind(field, value):
    with pytest.raises((TypeError, ValueError), match=field):
        SamplingParams(**{field: value})


def test_unknown_drafter_lists_available():
    with pytest.raises(ValueError, match="available"):
        make_llm(spec=SpecConfig(algorithm="nope"))


@register("test_hidden_counter")
class HiddenCountingDrafter(Drafter):
    """Declares the final hidden layer and records how many rows each proposal receives."""

    needs = DrafterNeeds(hidden_layers=(2,))
    received: list[tuple[int, int]] = []  # (rows received, tokens in the context)

    def propose(self, batch):
        for inp in batch:
            type(self).received.append((int(inp.hidden[2].shape[0]), len(inp.token_ids)))
        return [Draft([5]) for _ in batch]


def test_drafter_sees_every_hidden_row_when_the_policy_skips_rounds():
    """Rounds where the policy gives a request k = 0 must not drop the hidden states of the
    tokens processed in them: the next proposal gets all rows since the previous one."""
    llm = make_llm(spec=SpecConfig(algorithm="test_hidden_counter", num_draft_tokens=1))
    engine = llm.engine
    turn = iter(range(1000))
    engine.policy.draft_lengths = lambda slots: [s.limit if next(turn) % 3 == 2 else 0 for s in slots]
    HiddenCountingDrafter.received.clear()
    llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    received = HiddenCountingDrafter.received
    assert received
    # The target has processed every token but the last one of the context: all of those rows
    # reached the drafter, summed over its proposals.
    assert sum(rows for rows, _ in received) == received[-1][1] - 1


@register("test_scripted_recording")
class RecordingScriptedDrafter(ScriptedDrafter):
    """The scripted drafter, keeping every outcome the engine reports back."""

    def __init__(self, spec, target):
        super().__init__(spec, target)
        self.outcomes = []

    def observe(self, outcomes):
        self.outcomes += outcomes


def test_a_stop_inside_an_accepted_run_counts_only_what_precedes_it():
    """Every draft is right, and a stop token lands inside an accepted run: the positions after
    the stop were never used, so acceptance stays 1 at every position, and the stats, the policy
    and the drafter all see the same clipped counts."""
    base_params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm = make_llm(spec=SpecConfig(algorithm="test_scripted_recording", num_draft_tokens=8))
    ref = _install_script(llm, base_params, 0)[0].token_ids
    seen_by_policy = []
    policy = llm.engine.policy
    observe = policy.observe
    policy.observe = lambda rid, drafted, accepted: (seen_by_policy.append((drafted, accepted)), observe(rid, drafted, accepted))
    # Output token 0 comes from the prefill, tokens 1..9 from the first round (8 accepted drafts
    # and the bonus): a stop on one of tokens 2..8 lands on an accepted draft token.
    cut = next(i for i in range(2, 9) if ref.index(ref[i]) == i)
    stop_tok = ref[cut]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=(stop_tok,), ignore_eos=True))[0]
    assert out.token_ids == ref[: cut + 1]
    stats = out.spec
    assert stats.num_drafts >= 1
    assert stats.acceptance_rate == 1.0
    assert all(a == 1.0 for a in stats.acceptance_per_position)
    assert stats.num_committed_tokens == len(out.token_ids)
    outcomes = llm.engine.drafter.outcomes
    assert [(o.num_drafted, o.num_accepted) for o in outcomes] == seen_by_policy
    last = outcomes[-1]
    assert last.committed[-1] == stop_tok and last.num_accepted == last.num_drafted == len(last.committed)
    assert stats.num_draft_tokens == sum(o.num_drafted for o in outcomes)


def test_generators_live_on_the_device_their_draws_happen_on(monkeypatch):
    """The request's generator is made on the engine's device (verification and plain sampling
    draw there); a drafter sampling elsewhere gets a generator of its own on its device."""
    import tandem.engine.engine as engine_module
    import tandem.engine.request as request_module

    made = []

    def recording(seed, device="cpu"):
        made.append(str(device))
        return torch.Generator().manual_seed(0 if seed is None else seed)

    monkeypatch.setattr(engine_module, "make_generator", recording)
    monkeypatch.setattr(request_module, "make_generator", recording)
    llm = make_llm(spec=SpecConfig(algorithm="test_sampled", num_draft_tokens=3))
    req = llm.engine.add_request(PROMPTS[0], SamplingParams(temperature=1.0, seed=5))
    assert made == [llm.engine.config.device]
    assert req.generator_on("cpu") is req.generator
    other = req.generator_on("cuda:0")  # made by the recording factory: no GPU needed
    assert made[-1] == "cuda:0" and other is not req.generator and req.generator_on("cuda:0") is other


def test_sampling_refuses_a_generator_on_another_device():
    from tandem.sampling import sample

    probs = torch.full((1, 4), 0.25)

    class Elsewhere:
        device = torch.device("cuda")

    with pytest.raises(ValueError, match="device its draws happen on"):
        sample(probs, Elsewhere())


def _stats(rounds: list[tuple[int, int]], plain_forwards: int = 0) -> SpecStats:
    """Counters of drafting rounds (drafted, accepted) and forwards that verified no draft."""
    stats = SpecStats()
    for drafted, accepted in rounds:
        stats.record_round(drafted, accepted, accepted + 1)
    for _ in range(plain_forwards):
        stats.record_round(0, 0, 1)
    return stats


def test_the_poor_drafter_warning_judges_the_drafting_rounds_alone():
    # Four-token drafts of which a quarter of a token passes: the drafter is poor.
    assert poor_drafter(_stats([(4, 0), (4, 0), (4, 1), (4, 0)] * 6))
    # Good drafts on a loaded server that drafts in one forward of ten: tau over all forwards is
    # about 1.2, but the drafter is not the problem.
    loaded = _stats([(4, 3)] * 24, plain_forwards=216)
    assert loaded.mean_acceptance_length < POOR_DRAFTER_TAU
    assert loaded.drafted_tau == 4.0 and not poor_drafter(loaded)
    # The policy cut every draft to one token: tau 2 is out of reach whatever the drafter.
    assert not poor_drafter(_stats([(1, 1), (1, 0)] * 15))
    # Too few drafting rounds to judge.
    assert not poor_drafter(_stats([(4, 0)] * 19))
