"""The synchronous Engine behind an asyncio server: one background thread owns every torch call.

The event loop sends typed commands (`AddRequest`, `AbortRequest`, `Stop`: the `Command` union)
through a queue; the engine thread applies them between steps, runs `Engine.step` while there is
work, and hands each step's updates back to the loop in one `call_soon_threadsafe`. A call to the
API (n choices of several prompts) is one `Generation`: an async iterator of (choice index, Delta)
that streaming and non-streaming responses both drain; it tells its `AsyncEngine` when a choice
ends (`finish`) and which to abort (`abort`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tandem.config import SamplingParams
from tandem.engine.engine import Engine
from tandem.engine.rounds import RoundCounts, StepUpdate
from tandem.server.metrics import ServerMetrics
from tandem.types import RequestOutput, TokenLogprob

log = logging.getLogger("tandem.server")

IDLE_WAIT_S = 0.05


class QueueFullError(RuntimeError):
    """More requests than running slots + queue places: the caller should retry later."""


class EngineStoppedError(RuntimeError):
    """The engine is draining for shutdown (or died) and takes no new requests."""


@dataclass
class Delta:
    """New output of one choice: text and tokens since the last delta; the final one carries the
    finish reason and the whole RequestOutput (usage, spec stats). Where the request asked for
    token origins: the text cut by who wrote it and the round that ran (StepUpdate's); for
    logprobs: its tokens' log-probabilities."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    output: RequestOutput | None = None
    error: str | None = None
    text_origins: list[tuple[str, str]] | None = None
    round: RoundCounts | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, where asked for
    # Where asked for (SamplingParams.prompt_logprobs), on the choice's first delta with tokens:
    # one per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class _Choice:
    request_id: str
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    done: bool = False


class Generation:
    """Every choice of one API call; iterate for (index, Delta) until all have finished."""

    def __init__(self, owner: "AsyncEngine", request_ids: list[str],
                 finish_label: Callable[[Delta], str] | None = None, prompt_tokens: int = 0,
                 scoring_only: bool = False) -> None:
        self._owner = owner
        self._finish_label = finish_label
        self._scoring_only = scoring_only  # echo with max_tokens 0: the token drawn is not the answer's
        self._uncounted_prompt_tokens = prompt_tokens  # counted with the call's first token, as usage counts them
        now = time.perf_counter()
        self.choices = [_Choice(rid, now) for rid in request_ids]
        self._queue: asyncio.Queue[tuple[int, Delta] | None] = asyncio.Queue()
        self._open = len(request_ids)

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[int, Delta]:
        if self._open == 0:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is None:  # aborted
            raise StopAsyncIteration
        if item[1].finish_reason is not None:
            self._open -= 1
        return item

    def deliver(self, index: int, delta: Delta) -> None:
        """On the event loop: record latencies, then queue the delta for the consumer."""
        choice = self.choices[index]
        if choice.done:
            return
        now = time.perf_counter()
        metrics = self._owner.metrics
        if delta.token_ids:
            if self._uncounted_prompt_tokens:
                metrics.prompt_tokens.inc(self._uncounted_prompt_tokens)
                self._uncounted_prompt_tokens = 0
        if delta.token_ids and not self._scoring_only:
            metrics.generation_tokens.inc(len(delta.token_ids))
            if choice.first_token is None:
                choice.first_token = now
                metrics.time_to_first_token.observe(now - choice.arrival)
                gaps = len(delta.token_ids) - 1
                gap = 0.0
            else:
                gaps = len(delta.token_ids)
                gap = (now - choice.last_token) / gaps
            # Tokens committed together in one speculative round share the step's time.
            for _ in range(gaps):
                metrics.inter_token_latency.observe(gap)
            choice.last_token = now
        if delta.finish_reason is not None:
            choice.done = True
            reason = "length" if self._scoring_only else delta.finish_reason  # as the answer reports it
            if self._finish_label is not None and delta.output is not None:
                reason = self._finish_label(delta)
            self._owner.finish(reason, delta.output, now - choice.arrival)
        self._queue.put_nowait((index, delta))

    def abort(self) -> None:
        """Stop every unfinished choice (client gone); frees their cache rows. Idempotent."""
        for choice in self.choices:
            if not choice.done:
                choice.done = True
                self._owner.finish("abort", None, time.perf_counter() - choice.arrival)
                self._owner.abort(choice.request_id)
        self._open = 0
        self._queue.put_nowait(None)


@dataclass(frozen=True)
class AddRequest:
    """Start one choice: prompt_ids under params; its deltas go to generation's choice_index."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generation: Generation
    choice_index: int


@dataclass(frozen=True)
class AbortRequest:
    """End one choice whose client went away; frees its cache rows."""

    request_id: str


@dataclass(frozen=True)
class Stop:
    """Drain for shutdown: finish what runs until deadline (a perf_counter time), abort the rest."""

    deadline: float


Command = AddRequest | AbortRequest | Stop


class AsyncEngine:
    """Owns the engine thread. max_queued: requests admitted beyond the engine's running slots."""

    def __init__(self, engine: Engine, max_queued: int, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self.capacity = engine.config.max_num_seqs + max_queued
        self.in_flight = 0
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._targets: dict[str, tuple[Generation, int]] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._accepting = False

    # ---- event-loop side ----------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self._accepting and self._thread is not None and self._thread.is_alive()

    def submit(self, prompts: list[list[int]], params: list[SamplingParams], request_id: str, prompt_tokens: int,
               finish_label: Callable[[Delta], str] | None = None, scoring_only: bool = False) -> Generation:
        """Queue one API call's choices (all or none); raises QueueFullError / EngineStoppedError.
        prompt_tokens: what the call's usage counts (each prompt once, however many choices share
        it); finish_label: the finish reason the answer reports for a choice's last delta, where
        it is not the engine's (a tool call's `tool_calls`), for the request counter. The prompt
        tokens count once a choice has a token: a call cancelled or refused before has no usage.
        scoring_only: the call scores its prompts (echo, max_tokens 0): the one token each choice
        draws is not an answer's, so it counts as no generated token and the choice as `length`,
        as the response reports them."""
        if not self.healthy:
            raise EngineStoppedError("the server is shutting down and takes no new requests")
        if self.in_flight + len(prompts) > self.capacity:
            raise QueueFullError(
                f"the server is at capacity ({self.in_flight} requests in flight, each choice of a call one; it runs "
                f"{self.engine.config.max_num_seqs} and queues up to {self.capacity - self.engine.config.max_num_seqs}); "
                "retry later"
            )
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        gen = Generation(self, ids, finish_label, prompt_tokens, scoring_only)
        self.in_flight += len(prompts)
        for i, (rid, prompt_ids, sp) in enumerate(zip(ids, prompts, params)):
            self._commands.put(AddRequest(rid, prompt_ids, sp, gen, i))
        return gen

    def finish(self, reason: str, output: RequestOutput | None, elapsed_s: float) -> None:
        """One choice has ended (finished or aborted): free its place and record it."""
        self.in_flight -= 1
        self.metrics.record_finished(reason, output, elapsed_s)

    def abort(self, request_id: str) -> None:
        """Ask the engine thread to end one choice (its client went away); a no-op once it ended."""
        self._commands.put(AbortRequest(request_id))

    async def stop(self, timeout_s: float) -> None:
        """Take no new requests; let running ones finish for up to timeout_s, abort the rest."""
        self._accepting = False
        if self._thread is None:
            return
        self._commands.put(Stop(time.perf_counter() + timeout_s))
        await asyncio.to_thread(self._thread.join)

    # ---- engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        deadline: float | None = None
        while True:
            stop_at = self._apply_commands(block=not engine.has_work())
            if stop_at is not None:
                deadline = stop_at
            if deadline is not None and (not engine.has_work() or time.perf_counter() >= deadline):
                self._abort_all("abort")
                return
            if not engine.has_work():
                continue
            try:
                updates = engine.step()
            except Exception:  # a bug outside any request's round must not take the server down
                log.exception("engine step failed; ending the requests in flight")
                self._abort_all("error", "the engine failed while running this request; see the server log")
                continue
            out = self._deltas(updates)
            self.metrics.record_step(engine)
            if out:
                self._loop.call_soon_threadsafe(_dispatch, out)

    def _deltas(self, updates: list[StepUpdate]) -> list[tuple[tuple[Generation, int], Delta]]:
        """One step's updates as (target, Delta), forgetting the targets that finished."""
        out = []
        for u in updates:
            target = self._targets.get(u.request.request_id)
            if target is None:
                continue
            reason = u.request.finish_reason
            delta = Delta(u.new_text, u.new_token_ids, reason, u.request.output() if reason else None,
                          text_origins=u.text_origins, round=u.round, logprobs=u.logprobs)
            req = u.request
            if req.params.prompt_logprobs is not None and u.new_token_ids and len(req.output_ids) == len(u.new_token_ids):
                delta.prompt_logprobs = req.prompt_logprob_entries()
            if reason == "error":
                delta.error = req.error
            if reason:
                del self._targets[u.request.request_id]
            out.append((target, delta))
        return out

    def _apply_commands(self, block: bool) -> float | None:
        """Apply queued commands in order; returns the last stop deadline that arrived, if any."""
        stop_at = None
        try:
            cmd = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return None
        while True:
            deadline = self._apply(cmd)
            if deadline is not None:
                stop_at = deadline
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
        self.metrics.record_step(self.engine)
        return stop_at

    def _apply(self, cmd: Command) -> float | None:
        """Apply one command; returns its deadline if it is a Stop."""
        match cmd:
            case AddRequest():
                self._add(cmd)
            case AbortRequest():
                self._abort(cmd)
            case Stop():
                return cmd.deadline
            case _:  # only this module makes commands; never stop the engine thread over one
                log.error("engine thread ignored an unknown command %r", cmd)
        return None

    def _add(self, cmd: AddRequest) -> None:
        target = (cmd.generation, cmd.choice_index)
        try:
            self.engine.add_request(cmd.prompt_ids, cmd.params, request_id=cmd.request_id)
            self._targets[cmd.request_id] = target
        except ValueError as err:
            self._loop.call_soon_threadsafe(_dispatch, [(target, Delta("", [], "error", error=str(err)))])

    def _abort(self, cmd: AbortRequest) -> None:
        if self._targets.pop(cmd.request_id, None) is not None:
            self.engine.abort(cmd.request_id)

    def _abort_all(self, reason: str, error: str | None = None) -> None:
        out = []
        for rid, target in list(self._targets.items()):
            self.engine.abort(rid)
            out.append((target, Delta("", [], reason, error=error)))
        self._targets.clear()
        self.metrics.record_step(self.engine)
        if out:
            self._loop.call_soon_threadsafe(_dispatch, out)


def _dispatch(items: list[tuple[tuple[Generation, int], Delta]]) -> None:
    for (gen, index), delta in items:
        gen.deliver(index, delta)
