"""`tandem audit`: a statistical proof that a target + drafter pair is lossless on the user's setup.

Many independent speculative rounds are run from one context with the real drafter, the real
target forward and the real verifier. Each outcome is compared against distributions computed
exactly from the target (ALGORITHMS.md section 1):
- the token at draft position j, given the round reached j with the most common accepted prefix,
  must follow p_j(. | context, prefix) (position 1 is the first committed token);
- the recovered token after a rejection at position 1 must follow norm(max(0, p_1 - q_1));
- the bonus token after a fully accepted draft must follow p_{k+1}(. | context, draft).
Greedy decoding is audited by token identity with plain decoding instead.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch

from tandem.config import SamplingParams
from tandem.drafters import DraftInput, DraftOutcome
from tandem.engine.engine import Engine
from tandem.model.kv_cache import KVCache
from tandem.model.runner import ModelRunner, SeqInput
from tandem.sampling import make_generator, processed_probs
from tandem.verify.stats import chi_square_test, total_variation, tv_bound

MIN_GROUP = 200


@dataclass
class AuditCheck:
    name: str
    samples: int
    p_value: float | None = None
    tv: float | None = None
    tv_bound: float | None = None
    passed: bool | None = None  # None: skipped (too few samples)


@dataclass
class AuditReport:
    algorithm: str
    rounds: int
    alpha: float
    checks: list[AuditCheck] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed is not False for c in self.checks) and any(c.passed for c in self.checks)

    def render(self) -> str:
        lines = [f"tandem audit: {self.algorithm}, {self.rounds} rounds, alpha {self.alpha:g} (Bonferroni over checks)"]
        lines.append(f"{'check':36} {'n':>7} {'p-value':>10} {'TV':>7} {'TV bound':>9}  verdict")
        for c in self.checks:
            if c.passed is None:
                lines.append(f"{c.name:36} {c.samples:7d} {'-':>10} {'-':>7} {'-':>9}  skipped (fewer than {MIN_GROUP})")
            else:
                lines.append(f"{c.name:36} {c.samples:7d} {c.p_value:10.3g} {c.tv:7.4f} {c.tv_bound:9.4f}  {'pass' if c.passed else 'FAIL'}")
        lines.append("verdict: " + ("PASS (lossless within the test's power)" if self.passed else "FAIL"))
        return "\n".join(lines)


@dataclass
class _Round:
    """One round: its draft's tokens, q_1 (sampled chains), the accepted count, the committed
    tokens, the tokens tried at position 1 (a chain's first draft token; a tree's root children)
    and whether the accepted path ended at a leaf (the last token is then the bonus)."""

    draft: tuple[int, ...]
    q1: torch.Tensor | None
    accepted: int
    committed: list[int]
    first_tried: tuple[int, ...]
    at_leaf: bool


class Auditor:
    """Runs rounds from one context; `batch` rounds share one target forward."""

    def __init__(self, engine: Engine, prompt_ids: list[int], params: SamplingParams, batch: int = 64) -> None:
        if engine.drafter is None:
            raise ValueError("audit needs a speculative algorithm (--speculative-algorithm)")
        self.engine = engine
        self.ctx = list(prompt_ids)
        self.params = params
        self.k = engine.config.spec.num_draft_tokens
        cfg = engine.loaded.config
        self.batch = batch
        self.cache = KVCache(cfg, batch, len(self.ctx) + 2 * self.k + 4, engine.loaded.dtype, engine.config.device)
        self.runner = ModelRunner(engine.loaded.model, self.cache)
        self.rows = [self.cache.allocate() for _ in range(batch)]
        # Prefill the context once and copy its KV rows: every round starts from the same state.
        # Drafters that read target hidden states (trained heads) get the context's rows, as the
        # engine gives them after a prefill.
        prefill = self.runner.forward([SeqInput(self.rows[0], self.ctx[:-1])], engine.drafter.needs.hidden_layers)
        self.hidden = {layer: rows[0] for layer, rows in prefill.hidden.items()}
        n = len(self.ctx) - 1
        for r in self.rows[1:]:
            self.cache.k[:, r, :, :n] = self.cache.k[:, self.rows[0], :, :n]
            self.cache.v[:, r, :, :n] = self.cache.v[:, self.rows[0], :, :n]
            self.cache.lengths[r] = n
        self._exact: dict[tuple[int, ...], torch.Tensor] = {}

    def exact(self, prefix: tuple[int, ...]) -> torch.Tensor:
        """The processed target distribution after context + prefix: [V]."""
        if prefix not in self._exact:
            row, n = self.rows[0], len(self.ctx) - 1
            logits = self.runner.forward([SeqInput(row, [self.ctx[-1], *prefix], logits="last")]).logits
            self.cache.truncate(row, n)
            self._exact[prefix] = processed_probs(logits, self.params)[0]
        return self._exact[prefix]

    def run(self, rounds: int, seed: int = 0) -> list[_Round]:
        from tqdm.auto import tqdm

        from tandem.engine import engine as engine_module

        drafter, n = self.engine.drafter, len(self.ctx) - 1
        out: list[_Round] = []
        with tqdm(total=rounds, desc="audit rounds", disable=None) as bar:
            for start in range(0, rounds, self.batch):
                size = min(self.batch, rounds - start)
                gens = [make_generator(seed * 1_000_003 + start + i) for i in range(size)]
                inputs = [
                    DraftInput(f"audit-{start + i}", self.ctx, len(self.ctx), self.k, self.params, g, self.hidden)
                    for i, g in enumerate(gens)
                ]
                drafts = [d.pruned(self.k, self.k) for d in drafter.propose(inputs)]
                if any(d.is_tree for d in drafts):
                    out += self._tree_rounds(inputs, drafts, gens)
                    bar.update(size)
                    continue
                fwd = self.runner.forward(
                    [SeqInput(self.rows[i], [self.ctx[-1], *d.token_ids], logits="all") for i, d in enumerate(drafts)]
                )
                kmax = max(len(d) for d in drafts)
                probs = torch.zeros(size, kmax + 1, fwd.logits.shape[-1])
                tokens = torch.zeros(size, kmax, dtype=torch.long)
                for i, d in enumerate(drafts):
                    probs[i, : len(d) + 1] = processed_probs(fwd.rows(i), self.params)
                    tokens[i, : len(d)] = torch.tensor(d.token_ids, dtype=torch.long)
                # Through the engine module's name so a test can swap in a broken verifier.
                result = engine_module.verify_chain(
                    probs, tokens, [d.probs for d in drafts], torch.tensor([len(d) for d in drafts]), gens,
                    [self.params.greedy] * size,
                )
                outcomes = []
                for i, d in enumerate(drafts):
                    committed = result.committed(i)
                    accepted = int(result.num_accepted[i])
                    out.append(_Round(tuple(d.token_ids), None if d.probs is None else d.probs[0], accepted, committed,
                                      tuple(d.token_ids[:1]), accepted == len(d)))
                    outcomes.append(DraftOutcome(inputs[i].request_id, len(d), accepted, committed))
                    self.cache.truncate(self.rows[i], n)
                self._finish(inputs, outcomes)
                bar.update(size)
        return out

    def _tree_rounds(self, inputs: list[DraftInput], drafts: list, gens: list[torch.Generator]) -> list[_Round]:
        """Tree drafts: one tree forward per batch, each round graded by the tree verifier."""
        from tandem.engine import engine as engine_module

        n = len(self.ctx) - 1
        fwd = self.runner.forward([
            SeqInput(self.rows[i], [self.ctx[-1], *d.token_ids], logits="all",
                     parents=None if d.parents is None else [-1] + [p + 1 for p in d.parents])
            for i, d in enumerate(drafts)
        ])
        rounds, outcomes = [], []
        for i, d in enumerate(drafts):
            parents = d.parents if d.parents is not None else list(range(-1, len(d) - 1))
            probs = processed_probs(fwd.rows(i), self.params)
            result = engine_module.verify_tree(probs, d.token_ids, parents, gens[i], self.params.greedy)
            at_leaf = bool(result.path) and result.path[-1] not in parents
            first_tried = tuple(t for t, p in zip(d.token_ids, parents) if p < 0)
            rounds.append(_Round(tuple(d.token_ids), None, len(result.path), result.tokens, first_tried, at_leaf))
            outcomes.append(DraftOutcome(inputs[i].request_id, len(d), len(result.path), result.tokens))
            self.cache.truncate(self.rows[i], n)
        self._finish(inputs, outcomes)
        return rounds

    def _finish(self, inputs: list[DraftInput], outcomes: list[DraftOutcome]) -> None:
        drafter = self.engine.drafter
        drafter.observe(outcomes)
        for inp in inputs:
            drafter.release(inp.request_id)


def _check(name: str, observed: list[int], expected: torch.Tensor, alpha: float) -> AuditCheck:
    if len(observed) < MIN_GROUP:
        return AuditCheck(name, len(observed))
    counts = torch.bincount(torch.tensor(observed), minlength=expected.numel()).double()
    expected = expected.double() / expected.sum()
    test = chi_square_test(counts, expected)
    support = int((expected > 0).sum())
    tv = total_variation(counts, expected)
    bound = tv_bound(len(observed), support)
    return AuditCheck(name, len(observed), test.p_value, tv, bound, test.p_value >= alpha and tv <= bound)


def audit_rounds(auditor: Auditor, rounds: list[_Round], alpha: float) -> list[AuditCheck]:
    k = auditor.k
    num_checks = k + 2
    a = alpha / num_checks
    checks = []
    # Token at position j given the round reached j through the most common accepted prefix.
    for j in range(k + 1):
        reached = [r for r in rounds if len(r.committed) > j]
        groups = collections.Counter(tuple(r.committed[:j]) for r in reached)
        if not groups:
            checks.append(AuditCheck(f"position {j + 1} token", 0))
            continue
        prefix, _ = groups.most_common(1)[0]
        obs = [r.committed[j] for r in reached if tuple(r.committed[:j]) == prefix]
        checks.append(_check(f"position {j + 1} token", obs, auditor.exact(prefix), a))
    # Recovered token after rejecting draft position 1, grouped by the (most common) first draft.
    rejected = [r for r in rounds if r.draft and r.accepted == 0]
    if rejected:
        by_first = collections.Counter(r.first_tried for r in rejected if r.q1 is None)
        p1 = auditor.exact(())
        if by_first and by_first.most_common(1)[0][1] >= len(rejected) / 2:
            tried = by_first.most_common(1)[0][0]
            group = [r for r in rejected if r.q1 is None and r.first_tried == tried]
            residual = p1.clone()
            residual[list(tried)] = 0.0
        else:
            group = [r for r in rejected if r.q1 is not None]
            residual = torch.clamp(p1 - group[0].q1.float(), min=0.0) if group else p1
        obs = [r.committed[0] for r in group]
        checks.append(_check("recovered token (position 1)", obs, residual, a) if residual.sum() > 0 else AuditCheck("recovered token (position 1)", 0))
    else:
        checks.append(AuditCheck("recovered token (position 1)", 0))
    # Bonus token after the most common fully accepted path (a chain's whole draft, a tree's
    # path to a leaf).
    full = [r for r in rounds if r.draft and r.at_leaf]
    groups = collections.Counter(tuple(r.committed[:-1]) for r in full)
    if groups:
        path, _ = groups.most_common(1)[0]
        obs = [r.committed[-1] for r in full if tuple(r.committed[:-1]) == path]
        checks.append(_check("bonus token", obs, auditor.exact(path), a))
    else:
        checks.append(AuditCheck("bonus token", 0))
    return checks


def run_audit(engine: Engine, prompt_ids: list[int], params: SamplingParams, rounds: int = 4000,
              alpha: float = 1e-3, batch: int = 64, seed: int = 0) -> AuditReport:
    report = AuditReport(engine.config.spec.algorithm or "", rounds, alpha)
    if params.greedy:
        report.checks.append(_greedy_identity(engine, prompt_ids, params))
        return report
    auditor = Auditor(engine, prompt_ids, params, batch)
    report.checks = audit_rounds(auditor, auditor.run(rounds, seed), alpha)
    return report


def _greedy_identity(engine: Engine, prompt_ids: list[int], params: SamplingParams) -> AuditCheck:
    """Greedy: speculative output must equal plain output token for token."""
    from dataclasses import replace

    from tandem.config import SpecConfig

    plain = Engine(engine.loaded, replace(engine.config, spec=SpecConfig()))
    outs = []
    for eng in (engine, plain):
        req = eng.add_request(prompt_ids, params)
        while eng.has_work():
            eng.step()
        outs.append(req.output_ids)
    same = outs[0] == outs[1]
    return AuditCheck("greedy token identity", len(outs[0]), 1.0 if same else 0.0, 0.0, 0.0, same)
