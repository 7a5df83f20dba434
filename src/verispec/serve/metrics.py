"""Prometheus metrics for the server (text format at GET /metrics), one registry per app."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from verispec.serve.scheduler import Scheduler
from verispec.stats import GenerationStats

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)


class Metrics:
    """Counters for requests and tokens, latency histograms, and gauges read from the scheduler.

    Args:
        scheduler: read at scrape time for queue depth, running sequences and cache rows.
    """

    def __init__(self, scheduler: Scheduler, adapter=None) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("verispec_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("verispec_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter("verispec_generated_tokens", "tokens generated for finished requests", registry=r)
        self.drafted = Counter("verispec_draft_tokens", "draft tokens proposed and verified", registry=r)
        self.accepted = Counter("verispec_accepted_tokens", "draft tokens the target accepted", registry=r)
        self.target_passes = Counter("verispec_target_passes", "target forward passes, summed over sequences", registry=r)
        self.latency = Histogram("verispec_request_latency_seconds", "arrival to last token", registry=r,
                                 buckets=LATENCY_BUCKETS)
        self.first_token = Histogram("verispec_time_to_first_token_seconds", "arrival to first token", registry=r,
                                     buckets=LATENCY_BUCKETS)
        self.totals = GenerationStats()  # the same sums, for the ratio gauges
        Gauge("verispec_acceptance_rate", "accepted / drafted tokens since start", registry=r).set_function(
            lambda: self.totals.acceptance_rate)
        Gauge("verispec_tokens_per_target_pass", "generated tokens per target pass since start", registry=r).set_function(
            lambda: self.totals.tokens_per_target_pass)
        Gauge("verispec_queue_depth", "requests waiting for a batch row", registry=r).set_function(
            lambda: scheduler.queue_depth)
        Gauge("verispec_running_sequences", "sequences in the running batch", registry=r).set_function(
            lambda: scheduler.running)
        Gauge("verispec_cache_rows", "rows held in the target's KV cache", registry=r).set_function(scheduler.cache_rows)
        Gauge("verispec_cache_reserved_bytes", "key/value cache reserved by the running requests",
              registry=r).set_function(lambda: scheduler.reserved)
        Gauge("verispec_cache_budget_bytes", "key/value cache the running requests may reserve",
              registry=r).set_function(lambda: scheduler.max_cache_bytes)
        Gauge("verispec_decoding_alive", "1 while the decoding thread runs", registry=r).set_function(
            lambda: int(scheduler.alive))
        r.register(_FaultCollector(scheduler))
        prefixes = scheduler.engine.prefixes
        if prefixes is not None:  # prefix reuse across requests (`verispec.core.prefix`)
            for key, doc in (("lookups", "joining rows that looked for a stored prefix"),
                             ("hits", "joining rows that started from a stored prefix"),
                             ("tokens_reused", "prompt tokens not read again"),
                             ("held_bytes", "target cache held for reuse"), ("entries", "prefixes held"),
                             ("evicted", "prefixes dropped for room")):
                Gauge(f"verispec_prefix_{key}", f"prefix reuse: {doc}", registry=r).set_function(
                    lambda key=key: getattr(prefixes.stats, key))
        if adapter is not None:  # online adaptation (`serve --adapt`)
            for key, doc in (("collected", "examples collected"), ("buffered", "examples waiting"),
                             ("updates", "drafter updates made"), ("examples_used", "examples trained on"),
                             ("update_seconds", "seconds spent updating")):
                Gauge(f"verispec_adaptation_{key}", f"online adaptation: {doc}", registry=r).set_function(
                    lambda key=key: adapter.stats()[key])
            Gauge("verispec_adaptation_failed", "1 when the last update failed (the server log says why)",
                  registry=r).set_function(lambda: int(adapter.stats()["last_error"] is not None))

    def finished(self, prompt_tokens: int, stats: GenerationStats) -> None:
        """Count a finished request's tokens (called on the event loop)."""
        self.totals = GenerationStats.merge([self.totals, stats])
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(stats.new_tokens)
        self.drafted.inc(stats.draft_tokens)
        self.accepted.inc(stats.accepted_tokens)
        self.target_passes.inc(stats.target_forward_passes)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _FaultCollector:
    """verispec_faults_total{stage}: faults the server absorbed (a request's own, the drafter's, the target's, the
    scheduler's), read from the scheduler at scrape time."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def collect(self):
        family = CounterMetricFamily("verispec_faults", "faults absorbed, by where they happened", labels=["stage"])
        for stage, count in sorted(self.scheduler.faults.counts.items()):
            family.add_metric([stage], count)
        yield family
