"""The engine's hot loop: schedule -> propose -> verify-forward -> verify -> commit -> emit.

Plain decoding is the same loop with empty drafts (the verifier then only samples from p_1), so
speculative and plain output share every line that decides what is emitted.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from numbers import Integral

import torch

from tandem.config import EngineConfig, SamplingParams
from tandem.drafters import Drafter, DraftOutcome
from tandem.engine.admission import Admission
from tandem.engine.drafting import Drafting
from tandem.engine.request import Request
from tandem.engine.rounds import RoundCounts, StepUpdate, chunk_inputs, round_origins
from tandem.grammar import GrammarCompiler
from tandem.model.kv_cache import KVCache
from tandem.model.loader import LoadedModel
from tandem.model.runner import ForwardOutput, ModelRunner, SeqInput
from tandem.sampling import NonFiniteLogitsError, make_generator, native_sampling, token_logprobs
from tandem.scheduler.cost_model import CostCurve
from tandem.scheduler.policy import SpeculationPolicy
from tandem.types import Draft, GreedyRows, SpecStats, rooted_parents, tree_paths
from tandem.verify import grading

log = logging.getLogger("tandem.engine")

LOG_EVERY_S = 10.0
PROMPT_LOGPROBS_ROWS = 128  # prompt rows per forward for prompt logprobs ([rows, V] fp32 logits)


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, cost_curve: CostCurve | None = None) -> None:
        """cost_curve: the target's measured forward seconds vs new tokens; the adaptive
        speculation policy needs it (tandem serve profiles it at startup)."""
        self.loaded = loaded
        self.config = config
        self.tokenizer = loaded.tokenizer
        cfg = loaded.config
        if config.max_model_len > cfg.max_position_embeddings:
            log.warning("max_model_len %d is beyond %s's max_position_embeddings (%d): positions past %d are "
                        "ones the model was not trained on", config.max_model_len, loaded.name,
                        cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.cache = KVCache(cfg, config.max_num_seqs, config.max_model_len, loaded.dtype, config.device,
                             loaded.kv_dtype(config.device))
        self.runner = ModelRunner(loaded.model, self.cache)
        self.admission = Admission(self.cache, config, self.runner.batch_invariant)
        self.eos_ids = frozenset(cfg.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        )
        # The drafter, its speculation policy and the round's proposal step (None: plain decoding).
        self.drafting = (Drafting.create(loaded, config, cost_curve, self.eos_ids, self.runner.verify_rows,
                                         self.cache) if config.spec.algorithm else None)
        self.grammars = GrammarCompiler(self.tokenizer, cfg.vocab_size, sorted(self.eos_ids))
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # admitted (a cache row each), prompt not yet all in the cache
        self.running: list[Request] = []
        self.stats = SpecStats()
        self._updates: list[StepUpdate] = []  # what the current step did, as it goes (step)
        self._failures, self._last_failure_log = 0, -LOG_EVERY_S  # failures not yet logged (_log_failure)
        self._ids = itertools.count()
        self._last_log = time.perf_counter()

    # Read-only views of `drafting`'s parts; replace them there (bench/spec.py wraps the drafter
    # in a probe, tests put other schedulers in).
    @property
    def drafter(self) -> Drafter | None:
        return self.drafting.drafter if self.drafting is not None else None

    @property
    def policy(self) -> SpeculationPolicy | None:
        return self.drafting.policy if self.drafting is not None else None

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Request:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        vocab = self.loaded.config.vocab_size
        for what, ids in (("the prompt", prompt_ids), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if isinstance(t, bool) or not (isinstance(t, Integral) and 0 <= t < vocab)]
            if bad:
                raise ValueError(f"{what} holds {bad[0]!r}, which is not a token id of the vocabulary [0, {vocab})")
        budget = self.config.max_model_len - len(prompt_ids)
        if budget < 1:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; the context holds {self.config.max_model_len}"
            )
        if params.max_tokens > budget:
            params = dataclasses.replace(params, max_tokens=budget, min_tokens=min(params.min_tokens, budget))
        need = self.admission.kv_need(len(prompt_ids), params)
        if need > self.admission.max_total_tokens:
            raise ValueError(
                f"the request may hold {need} KV tokens (prompt + max_tokens + a draft); the engine holds at most "
                f"{self.admission.max_total_tokens} for all requests (max_total_tokens): ask for fewer max_tokens"
            )
        grammar = self.grammars.state(params.structured_output) if params.structured_output is not None else None
        bias_row = None
        if params.logit_bias:
            vocab = self.loaded.config.vocab_size
            if max(t for t, _ in params.logit_bias) >= vocab:
                raise ValueError(f"logit_bias names a token outside the vocabulary [0, {vocab})")
            bias_row = torch.zeros(vocab)
            bias_row[[t for t, _ in params.logit_bias]] = torch.tensor([b for _, b in params.logit_bias])
        stop_ban = None
        if params.min_tokens:
            stop_ban = torch.zeros(vocab)
            stop_ban[list(params.stop_token_ids) + ([] if params.ignore_eos else sorted(self.eos_ids))] = float("-inf")
        req = Request(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_ids=list(prompt_ids),
            params=params,
            generator=make_generator(params.seed, self.config.device),
            eos_ids=self.eos_ids,
            grammar=grammar,
            bias_row=bias_row,
            stop_ban=stop_ban,
        )
        self.waiting.append(req)
        return req

    def abort(self, request_id: str) -> None:
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
                req.finish_reason = "abort"
        for req in [*self.prefilling, *self.running]:
            if req.request_id == request_id:
                req.finish_reason = "abort"
                self._retire(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[StepUpdate]:
        """One speculative round for the running requests and a piece of the admitted prompts
        (whole prompts when nothing else decodes; see _prefill_chunks). Where a token's numbers do
        not depend on what shares its forward (the fused CPU path), both run in one forward: the
        weights are read once per step, not twice.

        A step that raises does not end every request in it: what one request's round or first
        draw raises ends that request alone (finish_reason "error"), and after an error in what
        the requests share (the drafter, the forward) the requests the step had not served run
        again (_recover)."""
        self.prefilling.extend(self.admission.admit(self.waiting))
        self._updates = []
        try:
            self._round(draft=True)
        except Exception:
            # The step's requests: the round only moves a completed prompt from prefilling to running
            # (retiring comes after it), so they are looked up here, not copied on every step.
            members = [*self.running, *self.prefilling]
            unserved = self._unserved(members)
            self._log_failure("a step over %d requests failed; the %d it had not served run again without drafts",
                              len(members), len(unserved))
            self._recover(unserved)
        updates, self._updates = self._updates, []
        for u in updates:
            if u.request.finished:
                self._retire(u.request)
        self._maybe_log()
        return updates

    def _round(self, draft: bool) -> None:
        """The step's forwards: one round for the running requests (drafting where `draft`) and
        this step's prompt chunks, in one forward where the runner is batch invariant."""
        chunks = self._prefill_chunks() if self.prefilling else []
        if self.runner.batch_invariant:
            self._decode_round(chunks, draft)
        else:
            self._decode_round([], draft)
            if chunks:
                self._prefill(chunks)

    def _unserved(self, members: list[Request]) -> list[Request]:
        served = {id(u.request) for u in self._updates}
        return [r for r in members if id(r) not in served]

    def _recover(self, members: list[Request]) -> None:
        """After a step failed in what its requests share: `members` (the requests it had not
        served) run again from their committed state, first together in a plain round (a drafter
        that failed is not asked again this step: a drafter's bug costs a round's drafts), and if
        that fails too, each in a plain round of its own, so only a request whose round fails
        alone ends. The others go on with the tokens they would have had (on the fused path a
        token's numbers do not depend on what shares its forward; a sampled request draws from
        its own generator, past the draws the failed step made)."""
        try:
            self._round_of(members)
            return
        except Exception:
            members = self._unserved(members)
            self._log_failure("a plain round over %d requests failed too; each runs alone", len(members))
        for req in members:
            try:
                self._round_of([req])
            except Exception as err:
                self._fail(req, err)

    def _log_failure(self, message: str, *args) -> None:
        """Log a failure of a step or its plain retry with its traceback, at most once per
        LOG_EVERY_S (a drafter that fails for one request fails every step while that request
        lives), counting the rest."""
        now = time.perf_counter()
        self._failures += 1
        if now - self._last_failure_log >= LOG_EVERY_S:
            more = f" ({self._failures - 1} more failures since the last report)" if self._failures > 1 else ""
            log.error(message + more, *args, exc_info=True)
            self._last_failure_log, self._failures = now, 0

    def _round_of(self, members: list[Request]) -> None:
        """A plain round of `members` alone, from their committed state (slots a failed forward
        wrote past it are dropped); the other requests sit it out."""
        for req in members:
            held = len(req.context) - 1 if req.output_ids else req.prefilled
            if req.seq is not None and self.cache.lengths[req.seq] > held:
                self.cache.truncate(req.seq, held)
        running, prefilling = self.running, self.prefilling
        self.running = [r for r in running if r in members]
        self.prefilling = [r for r in prefilling if r in members]
        try:
            self._round(draft=False)
        finally:  # a prompt that completed moved from prefilling to running within the round
            self.running = [r for r in running if r not in members] + self.running
            self.prefilling = [r for r in prefilling if r not in members] + self.prefilling

    def _prefill_chunks(self) -> list[tuple[Request, int, int]]:
        """The prompt pieces (request, start, end) this step prefills.

        While requests decode, at most `chunked_prefill_size` prompt tokens per step, oldest
        request first, so a burst of new prompts delays each running request's next token by a
        bounded piece instead of the whole burst. With nothing decoding, whole prompts (nobody
        waits on them). Chunks only where the runner is batch invariant: there a chunked prompt
        gives bit for bit the numbers of an unchunked one, which later verification compares
        against; elsewhere prompts always run whole.
        """
        self.admission.share_live_prefixes([r for r in self.prefilling if not r.prefill_started],
                                           self.running, self.prefilling)
        budget = self.config.chunked_prefill_size
        if not (budget and self.running and self.runner.batch_invariant):
            return [(r, r.prefilled, self._prompt_piece_end(r)) for r in self.prefilling]
        chunks = []
        for req in self.prefilling:
            take = min(budget, self._prompt_piece_end(req) - req.prefilled)
            chunks.append((req, req.prefilled, req.prefilled + take))
            budget -= take
            if budget == 0:
                break
        return chunks

    def _prompt_piece_end(self, req: Request) -> int:
        """Where this step's piece of a prompt may end: the prompt's end, or for a request that
        wants every prompt row's logprobs PROMPT_LOGPROBS_ROWS rows on (where pieces are exact),
        so its logits never take more than that many rows of memory at once."""
        end = len(req.prompt_ids)
        if req.params.prompt_logprobs is not None and self.runner.batch_invariant:
            end = min(end, req.prefilled + PROMPT_LOGPROBS_ROWS)
        return end

    def _prefill(self, chunks: list[tuple[Request, int, int]]) -> None:
        """A forward of the chunks' prompt tokens alone (see _prefilled)."""
        needs = self.drafter.needs.hidden_layers if self.drafter else ()
        self._prefilled(self.runner.forward(chunk_inputs(chunks), needs), chunks, first=0)

    def _prefilled(self, out: ForwardOutput, chunks: list[tuple[Request, int, int]], first: int) -> None:
        """After a forward wrote the chunks' prompt tokens to the cache (its inputs first,
        first + 1, ...): a request whose prompt is then complete samples its first token from the
        last prompt row and starts decoding. What raises for one request ends it alone."""
        for i, (req, start, end) in enumerate(chunks):
            try:
                self._prompt_chunk_done(out, first + i, req, start, end)
            except Exception as err:
                self._fail(req, err)

    def _prompt_chunk_done(self, out: ForwardOutput, b: int, req: Request, start: int, end: int) -> None:
        """One chunk of _prefilled: the forward's input b."""
        if req.params.prompt_logprobs is not None:  # row j predicts prompt token start + j + 1
            scored = min(end, len(req.prompt_ids) - 1) - start
            if scored > 0:
                req.prompt_logprobs += token_logprobs(out.rows(b)[:scored], req.prompt_ids[start + 1 : start + 1 + scored],
                                                      req.params.prompt_logprobs)
        req.prefilled = end
        req.prefill_started = True
        req.hidden.add_stacked(out.hidden_layers, out.stacked_hidden, slice(out.bounds[b], out.bounds[b + 1]))
        if end < len(req.prompt_ids):
            return
        token = self._sample_one(out.rows(b), req,
                                 req.logit_shift(None if req.grammar is None else req.grammar.allowed()[None], 1),
                                 out.greedy_rows(b))
        self.prefilling.remove(req)  # not before the draw: one that raises leaves it where _retire finds it
        self._commit(req, [token], RoundCounts(0, 0, 0), rows=out.rows(b)[-1:])

    def _decode_round(self, chunks: list[tuple[Request, int, int]], draft: bool) -> None:
        """One speculative round for every running request (plain where not `draft`), with the
        prompt chunks in the same forward: propose -> verify forward -> grade -> commit -> learn.
        Each phase is one method below; what raises in one request's grading or commit ends
        that request alone."""
        batch = list(self.running)
        if not batch:
            if chunks:
                self._prefill(chunks)
            return
        contexts = [len(r.context) for r in batch]  # before this round: the keys its rows read
        drafts = self._propose(batch, contexts) if draft else [Draft.empty() for _ in batch]
        drafts, shifts = self._shift_rows(batch, drafts)
        verify_start = time.perf_counter()
        out, tokens = self._verify_forward(batch, drafts, chunks)
        plain = self._plain_draws(batch, drafts, shifts, out)
        outcomes = []
        for b, (req, draft) in enumerate(zip(batch, drafts)):
            logits = out.rows(b)
            try:
                if b in plain:
                    if isinstance(plain[b], NonFiniteLogitsError):
                        raise plain[b]
                    committed, path = [plain[b]], []
                else:
                    committed, path = self._grade(logits, req, draft, shifts[b], out.greedy_rows(b))
                update, counted = self._commit_round(req, draft, committed, path, out, b, logits)
            except Exception as err:
                self._fail(req, err)
                continue
            outcomes.append(DraftOutcome(req.request_id, counted.drafted, counted.accepted, update.new_token_ids))
        # A forward that also prefilled prompt rows (no LM head, other contexts) is not a sample
        # of the verification cost curve.
        seconds = time.perf_counter() - verify_start
        self._learn(outcomes, None if chunks else (tokens, seconds, [1 + len(d.token_ids) for d in drafts], contexts))
        self._prefilled(out, chunks, first=len(batch))

    def _plain_draws(self, batch: list[Request], drafts: list[Draft], shifts: list[torch.Tensor | None],
                     out: ForwardOutput) -> dict[int, "int | NonFiniteLogitsError"]:
        """The tokens of this round's sampled requests without a draft, a shift or a penalty,
        drawn in one kernel call (grading.sample_plain_rows: what grade_round's empty-draft case
        gives each, without a call per request), by batch index; {} where there are fewer than
        two or the kernels do not serve them."""
        served = [(b, native_sampling(req.params, out.logits)) for b, (req, draft) in enumerate(zip(batch, drafts))
                  if not draft.token_ids and shifts[b] is None]
        picked = [b for b, kernels in served if kernels is not None]
        if len(picked) < 2:
            return {}
        kernels = next(k for _, k in served if k is not None)
        tokens = grading.sample_plain_rows(kernels, out.logits, [out.offsets[b + 1] - 1 for b in picked],
                                           [batch[b].params for b in picked], [batch[b].generator for b in picked])
        return dict(zip(picked, tokens))

    def _shift_rows(self, batch: list[Request], drafts: list[Draft]) -> tuple[list[Draft], list[torch.Tensor | None]]:
        """What each request adds to its verified rows' logits first (Request.logit_shift; None
        for most): its logit bias, -inf at its stop tokens in rows before min_tokens, and for a
        structured output -inf where the grammar refuses a token, row i after the committed
        tokens and the draft's path to node i (tandem.grammar).
        A deterministic chain is cut before the first token its grammar refuses: the one-hot rule
        would reject it with certainty and draw from p with it removed, which is p itself (its
        probability is 0), so the cut changes nothing but the rows computed. A sampled draft is
        kept whole: the q-ratio rule's residual at a refused token is not p."""
        shifts: list[torch.Tensor | None] = [None] * len(batch)
        for b, (req, draft) in enumerate(zip(batch, drafts)):
            allowed = None
            if req.grammar is not None and draft.is_tree:
                nodes = draft.token_ids
                allowed = req.grammar.allowed_paths([[nodes[i] for i in path] for path in tree_paths(draft.parents)])
            elif req.grammar is not None:
                allowed, valid = req.grammar.allowed_along(draft.token_ids)
                if draft.probs is None and valid < len(draft):
                    draft = drafts[b] = draft.truncated(valid)
                    allowed = allowed[: valid + 1]
            shifts[b] = req.logit_shift(allowed, len(draft) + 1, draft.parents)
        return drafts, shifts

    def _verify_forward(self, batch: list[Request], drafts: list[Draft], chunks: list[tuple[Request, int, int]]):
        """One target forward over every request's next token and draft, token by token: each
        verified token (tree node) sees exactly what plain decoding of its path would; then the
        prompt chunks. Returns the output and the rows the forward computed
        (ModelRunner.verify_rows), which the policy learns the cost curve from."""
        inputs = [
            SeqInput(r.seq, [r.next_token] + d.token_ids, logits="all",
                     parents=rooted_parents(d.parents))
            for r, d in zip(batch, drafts)
        ] + chunk_inputs(chunks)
        needs = self.drafter.needs.hidden_layers if self.drafter else ()
        out = self.runner.forward(inputs, needs, token_by_token=True)
        return out, self.runner.verify_rows([len(i.token_ids) for i in inputs])

    def _commit_round(self, req: Request, draft: Draft, committed: list[int], path: list[int],
                      out: ForwardOutput, b: int, logits: torch.Tensor) -> tuple[StepUpdate, RoundCounts]:
        """Keep the KV and hidden rows of next_token + the accepted drafts (the recovered/bonus
        token is the next input; the request is the forward's input b, its logits `logits`), then
        append the committed tokens."""
        kept_rows = [0] + [node + 1 for node in path]
        first_row = out.bounds[b]
        self.cache.keep(req.seq, kept_rows)
        if out.stacked_hidden is not None:
            # A chain keeps a leading run of rows: a slice; a tree's path: indices.
            leading = kept_rows[-1] == len(kept_rows) - 1
            req.hidden.add_stacked(out.hidden_layers, out.stacked_hidden,
                                   slice(first_row, first_row + len(kept_rows)) if leading
                                   else [first_row + r for r in kept_rows])
        # Row kept_rows[i] of the request's logits is the distribution committed[i] came from.
        rows = logits[kept_rows] if req.params.logprobs is not None else None
        update, counted = self._commit(req, committed, RoundCounts.of(draft, len(path)), round_origins(draft, path),
                                       rows)
        if self.policy is not None:
            self.policy.observe(req.request_id, counted.depth, counted.accepted)
        return update, counted

    def _learn(self, outcomes: list[DraftOutcome], cost: tuple | None) -> None:
        """The policy learns the round's verification cost (rows, seconds, each request's rows
        and context), the drafter what was committed."""
        if self.drafter is not None:
            if cost is not None:
                self.policy.observe_round(*cost)
            self.drafter.observe(outcomes)

    def _propose(self, batch: list[Request], contexts: list[int]) -> list[Draft]:
        if self.drafting is None:
            return [Draft.empty() for _ in batch]
        return self.drafting.propose(batch, contexts)

    def _sample_one(self, logits: torch.Tensor, req: Request, shift: torch.Tensor | None,
                    greedy: GreedyRows | None) -> int:
        """Plain decoding's token from the last row (the shared grading's empty-draft case)."""
        return grading.sample_plain(logits, req.params, req.context, req.generator, len(req.prompt_ids), shift, greedy)

    def _grade(self, logits: torch.Tensor, req: Request, draft: Draft, shift: torch.Tensor | None,
               greedy: GreedyRows | None) -> tuple[list[int], list[int]]:
        """Target logits [n+1, V] for [next_token, d_1..d_n] -> committed tokens and the accepted
        draft nodes (a chain's are 0..accepted-1). Through `grading.grade_round`, the function
        `tandem audit` grades with: the audit checks exactly this."""
        return grading.grade_round(logits, draft, req.params, req.context, req.generator, len(req.prompt_ids), shift,
                                   greedy)

    def _commit(self, req: Request, tokens: list[int], counts: "RoundCounts",
                origins: list[str] | None = None, rows: torch.Tensor | None = None) -> tuple[StepUpdate, "RoundCounts"]:
        """Append the round's tokens (stop conditions apply inside the run) and record its
        counts, clipped at a stop: what follows it was never used, so it is not counted.
        origins: each token's types.TOKEN_ORIGINS entry (default: all the target's); rows: the
        target's logits each token was drawn from [len(tokens), V], for params.logprobs."""
        kept = req.append(tokens, self.tokenizer, origins)
        if req.grammar is not None:
            req.grammar.consume(tokens[:kept])
        logprobs = None
        if req.params.logprobs is not None and kept:
            logprobs = token_logprobs(rows[:kept], tokens[:kept], req.params.logprobs)
            req.logprobs.extend(logprobs)
        req.next_token = tokens[kept - 1] if kept else req.next_token
        if kept < len(tokens):
            counts = counts.clipped(kept)
        depth = counts.depth if counts.tree_depths is not None else None
        req.stats.record_round(counts.drafted, counts.accepted, kept, depth)
        self.stats.record_round(counts.drafted, counts.accepted, kept, depth)
        if req not in self.running and not req.finished:
            self.running.append(req)
        start = req.emitted_text_len
        text = req.take_new_text()
        if not req.params.token_origins:
            update = StepUpdate(req, tokens[:kept], text, logprobs=logprobs)
        else:
            update = StepUpdate(req, tokens[:kept], text, req.origin_pieces(start, start + len(text)), counts, logprobs)
        self._updates.append(update)
        return update, counts

    def _fail(self, req: Request, err: Exception) -> None:
        """End `req` for what its step raised: NaN or inf logits (the model's, for this request),
        or a bug, whose traceback goes to the log."""
        if isinstance(err, NonFiniteLogitsError):
            log.error("request %s ended: %s", req.request_id, err)
            req.error = "the model produced NaN or inf logits for this request; it was ended"
        else:
            log.error("request %s ended: its step raised %s", req.request_id, type(err).__name__, exc_info=err)
            req.error = f"the engine failed while running this request ({type(err).__name__}); see the server log"
        req.finish_reason = "error"
        self._updates.append(StepUpdate(req, [], ""))

    def _retire(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        if req in self.prefilling:
            self.prefilling.remove(req)
        if req.seq is not None:
            self.admission.release(req)
        if self.drafting is not None:
            self.drafting.release(req.request_id)

    def _maybe_log(self) -> None:
        now = time.perf_counter()
        if self.drafting is None or now - self._last_log < LOG_EVERY_S or not self.stats.num_drafts:
            return
        self._last_log = now
        self.drafting.log_acceptance(self.stats)
