"""The metrics actor: turns metric events into Prometheus series.

It owns its own ``CollectorRegistry`` (no process globals), so two engines in
one process, or one per test, never collide. The prompt cache's size and
evictions are not pushed: the asker of ``RenderMetrics`` brings the store's
statistics, and they are applied just before rendering.
"""

from __future__ import annotations

import contextlib

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mlxcel.actors.messages import CacheLookedUp, MetricsMsg, MetricsStats, RenderMetrics, RequestFinished
from mlxcel.cache.store import StoreStats
from mlxcel.core.plan import GrammarWork

EVICTION_REASONS = ("lru", "ttl", "capacity")


class MetricsActor:
    def __init__(self, *, inbox: trio.MemoryReceiveChannel[MetricsMsg]) -> None:
        self.inbox = inbox
        self.registry = CollectorRegistry()
        self._hits = Counter("mlxcel_prompt_cache_hits", "Successful prompt-cache adoptions", registry=self.registry)
        self._misses = Counter(
            "mlxcel_prompt_cache_misses", "Prompt-cache lookups with no match", registry=self.registry
        )
        self._tokens_reused = Counter(
            "mlxcel_prompt_cache_prefix_tokens_reused", "Prefix tokens reused across all hits", registry=self.registry
        )
        self._evictions = Counter(
            "mlxcel_prompt_cache_evictions", "Prompt-cache evictions by reason", ["reason"], registry=self.registry
        )
        for reason in EVICTION_REASONS:
            self._evictions.labels(reason=reason)
        self._bytes = Gauge(
            "mlxcel_prompt_cache_bytes", "Bytes held by live prompt-cache entries", registry=self.registry
        )
        self._entries = Gauge("mlxcel_prompt_cache_entries", "Live prompt-cache entries", registry=self.registry)
        self._pinned_entries = Gauge(
            "mlxcel_prompt_cache_pinned_entries", "Prompt-cache entries pinned by a retention request",
            registry=self.registry)
        self._pinned_bytes = Gauge(
            "mlxcel_prompt_cache_pinned_bytes", "Bytes held by pinned prompt-cache entries", registry=self.registry)
        self._pins_dropped = Counter(
            "mlxcel_prompt_cache_pins_dropped", "Retention pins given up for the pinned share or the store's limits",
            registry=self.registry)
        self._seen_pins_dropped = 0
        self._requests = Counter(
            "mlxcel_requests", "Finished requests by finish reason", ["finish_reason"], registry=self.registry
        )
        self._ttft = Histogram(
            "mlxcel_time_to_first_token_seconds", "Time from admission to the first token", registry=self.registry
        )
        self._grammar_builds = Counter(
            "mlxcel_grammar_matchers_built", "Grammar matchers compiled for constrained sequences",
            registry=self.registry)
        self._grammar_build_seconds = Counter(
            "mlxcel_grammar_build_seconds", "Time spent compiling grammar matchers", registry=self.registry)
        self._grammar_masks = Counter(
            "mlxcel_grammar_masks", "Per-token grammar masks computed", registry=self.registry)
        self._grammar_mask_seconds = Counter(
            "mlxcel_grammar_mask_seconds", "Time spent computing and unpacking grammar masks (a step's "
            "sequences together)", registry=self.registry)
        self._seen_evictions: dict[str, int] = {}
        self._num_events = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with self.inbox:
            task_status.started()
            async for message in self.inbox:
                self._handle(message)

    def statistics(self) -> MetricsStats:
        return MetricsStats(num_events=self._num_events)

    def _handle(self, message: MetricsMsg) -> None:
        self._num_events += 1
        match message:
            case CacheLookedUp(hit=True, tokens_reused=tokens):
                self._hits.inc()
                self._tokens_reused.inc(tokens)
            case CacheLookedUp(hit=False):
                self._misses.inc()
            case RequestFinished():
                self._requests.labels(finish_reason=message.finish_reason).inc()
                if message.seconds_to_first_token is not None:
                    self._ttft.observe(message.seconds_to_first_token)
            case GrammarWork():
                self._grammar_builds.inc(message.matchers_built)
                self._grammar_build_seconds.inc(message.build_seconds)
                self._grammar_masks.inc(message.masks)
                self._grammar_mask_seconds.inc(message.mask_seconds)
            case RenderMetrics():
                if message.store is not None:
                    self._apply_store(message.store)
                with message.reply_to, contextlib.suppress(trio.BrokenResourceError):
                    message.reply_to.send_nowait(generate_latest(self.registry))

    def _apply_store(self, stats: StoreStats) -> None:
        self._bytes.set(stats.bytes)
        self._entries.set(stats.entries)
        self._pinned_entries.set(stats.pinned_entries)
        self._pinned_bytes.set(stats.pinned_bytes)
        if stats.pins_dropped > self._seen_pins_dropped:
            self._pins_dropped.inc(stats.pins_dropped - self._seen_pins_dropped)
        self._seen_pins_dropped = stats.pins_dropped
        # The store's evictions are cumulative since start; the counters grow by the difference.
        for reason, total in stats.evictions.items():
            grown = total - self._seen_evictions.get(reason, 0)
            # "superseded" entries became aliases; they were not pushed out.
            if grown > 0 and reason in EVICTION_REASONS:
                self._evictions.labels(reason=reason).inc(grown)
            self._seen_evictions[reason] = total
