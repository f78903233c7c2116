"""Prometheus metrics of one server (own registry, so several apps can live in one process).

Counters and histograms are updated by the API process as requests run; the gauges (running and
waiting requests, pool usage) and the scheduler's own counters (retractions, aborts by reason) are
refreshed from its stats on every scrape. The stats are counters the scheduler keeps as it goes,
so a scrape costs O(1) there, however large the cache.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "hybrid_serve_"
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
CONTENT_TYPE = CONTENT_TYPE_LATEST
OUTCOMES = ("stop", "length", "abort", "error")
TIER_EVENT_KEYS = {
    "written": "host_written_tokens",
    "loaded_back": "loaded_back_tokens",
    "demoted": "demoted_tokens",
    "evicted": "host_evicted_tokens",
    "stored": "storage_written_tokens",
}
PREFETCH_KEYS = {
    "started": "prefetch_started",
    "done": "prefetches",
    "truncated": "prefetch_truncated",
    "skipped": "prefetch_skipped",
    "failed": "prefetch_failed",
    "terminated": "prefetch_terminated",
    "discarded": "prefetch_discarded",
}


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        label = {"model_name": model_name}

        # one series per metric, bound to the model name (so each exists, at 0, from the start)
        def counter(name: str, doc: str) -> Any:
            return Counter(PREFIX + name, doc, ("model_name",), registry=r).labels(**label)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(PREFIX + name, doc, ("model_name",), registry=r).labels(**label)

        def histogram(name: str, doc: str) -> Any:
            h = Histogram(PREFIX + name, doc, ("model_name",), buckets=LATENCY_BUCKETS, registry=r)
            return h.labels(**label)

        def family(kind: type, name: str, doc: str, second: str) -> Any:
            metric = kind(PREFIX + name, doc, ("model_name", second), registry=r)
            return lambda value: metric.labels(model_name, value)

        self.requests = family(Counter, "requests", "Finished requests by outcome", "outcome")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.cached_tokens = counter("cached_tokens", "Prompt tokens served by the prefix cache")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens")
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, end to end")
        self.running = gauge("num_running_reqs", "Requests being prefilled or decoded")
        self.waiting = gauge("num_queue_reqs", "Requests waiting for admission")
        self.effective_max_running = gauge(
            "effective_max_running_requests",
            "Requests that can run at once: --max-running-requests, or less when the Mamba or "
            "KV pool holds fewer",
        )
        self.token_usage = gauge("token_usage", "Fraction of KV pages in use (tree included)")
        self.mamba_usage = gauge("mamba_usage", "Fraction of Mamba state slots in use")
        self.cache_hit_rate = gauge("cache_hit_rate", "Cached prompt tokens / prompt tokens")
        self.tier_hit_tokens = family(
            Gauge,
            "cache_tier_hit_tokens",
            "Prefix tokens served by the radix cache from each tier, since start",
            "tier",
        )
        self.host_usage = gauge("hicache_host_usage", "Fraction of host-tier KV pages in use")
        self.prefetches = family(
            Gauge,
            "hicache_prefetches",
            "Storage prefetches since start, by outcome (started, done, truncated, skipped, "
            "failed, terminated early, discarded)",
            "outcome",
        )
        self.tier_events = family(
            Gauge,
            "hicache_tokens",
            "Tier token movements since start (written to host, loaded_back, demoted, evicted "
            "from host, stored)",
            "event",
        )
        self.queue_time = histogram("queue_time_seconds", "Time from arrival to first prefill")
        self.retractions = counter("retractions", "Requests sent back to the queue, out of KV")
        self.aborts = family(Counter, "aborted_requests", "Requests aborted, by reason", "reason")
        self._seen: dict[str, float] = {}  # scheduler totals already counted
        self._prompt_total = 0
        self._cached_total = 0
        for outcome in OUTCOMES:  # every series exists (at 0) from the first scrape
            self.requests(outcome)

    def request_done(
        self, outcome: str, prompt: int, generated: int, cached: int, latency: float | None
    ) -> None:
        """Count one finished request (outcome: stop, length, abort or error)."""
        self.requests(outcome).inc()
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(generated)
        self.cached_tokens.inc(cached)
        self._prompt_total += prompt
        self._cached_total += cached
        if latency is not None:
            self.e2e.observe(latency)

    def queued(self, seconds: float) -> None:
        self.queue_time.observe(seconds)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def next_tokens(self, seconds: float, n: int) -> None:
        """`n` tokens arrived together `seconds` after the previous ones."""
        for _ in range(n):
            self.itl.observe(seconds / n)

    def update_gauges(self, stats: dict[str, Any]) -> None:
        self.running.set(stats["num_running_reqs"])
        self.waiting.set(stats["num_waiting_reqs"])
        self.token_usage.set(stats["token_usage"])
        self.mamba_usage.set(stats["mamba_usage"])
        self.effective_max_running.set(stats["capacity"]["effective_max_running_requests"])
        rate = self._cached_total / self._prompt_total if self._prompt_total else 0.0
        self.cache_hit_rate.set(rate)
        tiers = stats.get("cache_tiers", {})
        for tier in ("device", "host", "storage"):
            self.tier_hit_tokens(tier).set(tiers.get(f"{tier}_hit_tokens", 0))
        total = tiers.get("host_kv_pages_total", 0)
        used = total - tiers.get("host_kv_pages_free", 0)
        self.host_usage.set(used / total if total else 0.0)
        for event, key in TIER_EVENT_KEYS.items():
            self.tier_events(event).set(tiers.get(key, 0))
        for outcome, key in PREFETCH_KEYS.items():
            self.prefetches(outcome).set(tiers.get(key, 0))
        self._add("retractions", stats.get("num_retractions", 0), self.retractions)
        for reason, n in stats.get("aborts", {}).items():
            self._add(f"abort:{reason}", n, self.aborts(reason))

    def _add(self, key: str, total: float, counter: Any) -> None:
        """Bring a counter up to the scheduler's running total."""
        if total > self._seen.get(key, 0):
            counter.inc(total - self._seen.get(key, 0))
            self._seen[key] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)
