"""Prometheus metrics for `GET /metrics`, named like vLLM's under a `tandem:` prefix.

Speculation counters follow the engine's one SpecStats record (deltas per step); request
counters and latency histograms are recorded where responses are produced. Counters are exposed
with prometheus_client's `_total` suffix (e.g. `tandem:spec_decode_num_drafts_total`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tandem.types import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class ServerMetrics:
    """One registry per server (tests run several in one process)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, m = self.registry, {"model_name": model_name}

        def counter(name, doc, labels=()):
            c = Counter(name, doc, ["model_name", *labels], registry=r)
            return c if labels else c.labels(**m)

        def gauge(name, doc):
            return Gauge(name, doc, ["model_name"], registry=r).labels(**m)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=r).labels(**m)

        self._model = m
        self.request_success = counter("tandem:request_success",
                                       "Finished choices by the finish reason their answer reports (stop, length, "
                                       "tool_calls, error; abort: the client went away)", ["finished_reason"])
        self.prompt_tokens = counter("tandem:prompt_tokens",
                                     "Prompt tokens of the requests, as their usage counts them (each prompt once "
                                     "however many choices share it; prefix-cache hits included)")
        self.generation_tokens = counter("tandem:generation_tokens", "Generated (committed) tokens")
        self.running = gauge("tandem:num_requests_running", "Requests admitted to the running batch (decoding or having their prompt prefilled)")
        self.waiting = gauge("tandem:num_requests_waiting",
                             "Requests queued for admission (a running slot, KV room, or the next step)")
        self.kv_usage = gauge("tandem:kv_cache_usage_perc",
                              "KV cache slots held / the engine's token budget (max_total_tokens), 0-1")
        self.kv_reserved = gauge("tandem:kv_cache_reserved_perc",
                                 "KV slots reserved by running requests (prompt + max_tokens) / the token budget, 0-1")
        self.kv_bytes = gauge("tandem:kv_cache_bytes", "Bytes of KV cache the held slots take")
        self.prefix_queries = counter("tandem:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("tandem:prefix_cache_hits", "Prompt tokens whose KV the prefix cache supplied")
        self.time_to_first_token = histogram("tandem:time_to_first_token_seconds", "Arrival to first token", LATENCY_BUCKETS)
        self.inter_token_latency = histogram(
            "tandem:inter_token_latency_seconds",
            "Time per output token after the first (tokens of one speculative round share its time)",
            LATENCY_BUCKETS,
        )
        self.e2e_latency = histogram("tandem:e2e_request_latency_seconds",
                                     "Arrival to finish, of the choices that finished (not the aborted)", E2E_BUCKETS)
        self.num_drafts = counter("tandem:spec_decode_num_drafts", "Speculative rounds that drafted tokens")
        self.num_forwards = counter("tandem:spec_decode_num_forwards",
                                    "Target forwards per request, drafted or not (generation_tokens / this = tau)")
        self.num_draft_tokens = counter("tandem:spec_decode_num_draft_tokens", "Draft tokens proposed and verified")
        self.num_accepted_tokens = counter("tandem:spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.accepted_per_pos = counter(
            "tandem:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each draft position", ["position"]
        )
        self.draft_length = gauge(
            "tandem:spec_decode_policy_draft_length", "Mean draft length the speculation policy chose in the last round"
        )
        self.predicted_speedup = gauge(
            "tandem:spec_decode_policy_predicted_speedup",
            "The policy's predicted throughput gain over plain decoding for the last round",
        )
        self._seen = (0, 0, 0, [], 0)
        self._prefix_seen = (0, 0)

    def record_step(self, engine) -> None:
        """After a step (engine thread): gauges and the speculation counters' increments."""
        self.running.set(len(engine.running) + len(engine.prefilling))
        self.waiting.set(len(engine.waiting))
        held, admission = engine.cache.tokens_held, engine.admission
        self.kv_usage.set(held / admission.max_total_tokens)
        self.kv_reserved.set(admission.kv_reserved / admission.max_total_tokens)
        self.kv_bytes.set(held * engine.cache.bytes_per_token)
        if admission.prefix_cache is not None:
            queried, hits = admission.prefix_cache.queried_tokens, admission.prefix_cache.hit_tokens
            self.prefix_queries.inc(queried - self._prefix_seen[0])
            self.prefix_hits.inc(hits - self._prefix_seen[1])
            self._prefix_seen = (queried, hits)
        s = engine.stats
        drafts, draft_tokens, accepted, per_pos, forwards = self._seen
        self.num_drafts.inc(s.num_drafts - drafts)
        self.num_forwards.inc(s.num_forwards - forwards)
        self.num_draft_tokens.inc(s.num_draft_tokens - draft_tokens)
        self.num_accepted_tokens.inc(s.num_accepted_tokens - accepted)
        for pos, count in enumerate(s.accepted_per_position):
            before = per_pos[pos] if pos < len(per_pos) else 0
            if count > before or pos >= len(per_pos):  # a new position is exported even at 0
                self.accepted_per_pos.labels(**self._model, position=str(pos)).inc(count - before)
        self._seen = (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, list(s.accepted_per_position),
                      s.num_forwards)
        if engine.policy is not None and engine.policy.last.batch:
            last = engine.policy.last
            self.draft_length.set(sum(last.draft_lengths) / last.batch)
            self.predicted_speedup.set(last.predicted_speedup)

    def record_finished(self, reason: str, output: RequestOutput | None, seconds: float) -> None:
        self.request_success.labels(**self._model, finished_reason=reason).inc()
        if output is not None:
            self.e2e_latency.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
