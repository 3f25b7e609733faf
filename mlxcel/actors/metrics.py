"""The metrics actor: turns metric events into Prometheus series.

It owns its own ``CollectorRegistry`` (no process globals), so two engines in
one process, or one per test, never collide. The prompt cache's size and
evictions are not pushed: the asker of ``RenderMetrics`` brings the store's
statistics, and they are applied just before rendering.

Beside mlxcel's own series it serves the ``vllm:`` names that routers read
(llm-d's endpoint picker, the vLLM production-stack router): the queue, the
store's use of its budget, prefix-cache queries and hits in tokens, and
``vllm:cache_config_info``, labelled ``model_name`` and ``engine`` as vLLM's
are (docs/scaling.md).
"""

from __future__ import annotations

import contextlib
from typing import Any

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mlxcel.actors.messages import (
    CacheLookedUp,
    MetricsMsg,
    MetricsStats,
    RenderMetrics,
    RequestFinished,
    SchedulerStats,
)
from mlxcel.cache.snapshots import RefusalCause, SnapshotStats
from mlxcel.cache.store import StoreStats
from mlxcel.core.plan import GrammarWork, SpeculationWork

EVICTION_REASONS = ("lru", "ttl", "capacity")


class MetricsActor:
    def __init__(
        self,
        *,
        inbox: trio.MemoryReceiveChannel[MetricsMsg],
        model_name: str = "",
        block_size: int = 16,
        num_blocks: int = 0,
        prefix_caching: bool = True,
    ) -> None:
        self.inbox = inbox
        self.registry = CollectorRegistry()
        # Registered on the first stats of a disk tier (off: no disk series at all).
        self._disk: _DiskSeries | None = None
        self._vllm = _VllmSeries(self.registry, model_name=model_name, block_size=block_size,
                                 num_blocks=num_blocks, prefix_caching=prefix_caching)
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
            "mlxcel_prompt_cache_bytes",
            "Unique bytes held by live prompt-cache entries (a piece shared by several counts once)",
            registry=self.registry,
        )
        self._logical_bytes = Gauge(
            "mlxcel_prompt_cache_logical_bytes", "Bytes the live prompt-cache entries would take unshared",
            registry=self.registry)
        self._sharing_ratio = Gauge(
            "mlxcel_prompt_cache_sharing_ratio", "Logical over unique prompt-cache bytes (1: nothing shared)",
            registry=self.registry)
        self._pieces = Gauge(
            "mlxcel_prompt_cache_pieces", "KV pieces held by the prompt cache (each stored once, shared by entries)",
            registry=self.registry)
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
        self._verify_steps = Counter(
            "mlxcel_speculative_verify_steps", "Decode steps that verified speculative proposals (--speculative)",
            registry=self.registry)
        self._proposed_tokens = Counter(
            "mlxcel_speculative_proposed_tokens", "Tokens proposed by speculative decoding", registry=self.registry)
        self._accepted_tokens = Counter(
            "mlxcel_speculative_accepted_tokens", "Proposed tokens the model accepted (emitted as its own)",
            registry=self.registry)
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
        self._grammar_failures = Counter(
            "mlxcel_grammar_failures", "Constrained replies ended on the device, by cause: mask_timeout (past "
            "--grammar-mask-timeout-ms) or matcher (a llguidance limit or dead end)", ["cause"],
            registry=self.registry)
        self._seen_evictions: dict[str, int] = {}
        self._init_snapshot_metrics()
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
                self._vllm.looked_up(message.tokens_queried, tokens)
            case CacheLookedUp(hit=False, refusal=None):
                self._misses.inc()
                self._vllm.looked_up(message.tokens_queried, 0)
            case CacheLookedUp(hit=False, refusal=cause):
                # A refused snapshot is counted by cause, apart from the misses.
                self._snapshot_refusals.labels(cause=cause).inc()
                self._vllm.looked_up(message.tokens_queried, 0)
            case RequestFinished():
                self._requests.labels(finish_reason=message.finish_reason).inc()
                if message.seconds_to_first_token is not None:
                    self._ttft.observe(message.seconds_to_first_token)
            case GrammarWork():
                self._grammar_builds.inc(message.matchers_built)
                self._grammar_build_seconds.inc(message.build_seconds)
                self._grammar_masks.inc(message.masks)
                self._grammar_mask_seconds.inc(message.mask_seconds)
                for failure in message.failures:
                    self._grammar_failures.labels(cause="mask_timeout" if failure.timed_out else "matcher").inc()
            case SpeculationWork():
                self._verify_steps.inc(message.verify_steps)
                self._proposed_tokens.inc(message.proposed_tokens)
                self._accepted_tokens.inc(message.accepted_tokens)
            case RenderMetrics():
                if message.store is not None:
                    self._apply_store(message.store)
                self._vllm.apply(message.store, message.scheduler)
                if message.snapshots is not None:
                    self._apply_snapshots(message.snapshots)
                if message.disk is not None:
                    if self._disk is None:
                        self._disk = _DiskSeries(self.registry)
                    self._disk.apply(message.disk)
                with message.reply_to, contextlib.suppress(trio.BrokenResourceError):
                    message.reply_to.send_nowait(generate_latest(self.registry))

    def _apply_store(self, stats: StoreStats) -> None:
        self._bytes.set(stats.bytes)
        self._logical_bytes.set(stats.logical_bytes)
        self._sharing_ratio.set(stats.sharing_ratio)
        self._pieces.set(stats.pieces)
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

    # --- the session snapshot store (snapshot families) -------------------------------------

    def _init_snapshot_metrics(self) -> None:
        self._snapshot_refusals = Counter(
            "mlxcel_prompt_cache_snapshot_refusals", "Stored session snapshots refused, by cause",
            ["cause"], registry=self.registry)
        for cause in RefusalCause:
            self._snapshot_refusals.labels(cause=cause.value)
        self._snapshot_bytes = Gauge(
            "mlxcel_prompt_cache_snapshot_bytes", "Bytes held by live session snapshots", registry=self.registry)
        self._snapshot_entries = Gauge(
            "mlxcel_prompt_cache_snapshot_entries", "Live session snapshots", registry=self.registry)
        self._snapshot_checkpoints = Gauge(
            "mlxcel_prompt_cache_snapshot_checkpoints", "Live session snapshots that are checkpoints",
            registry=self.registry)
        self._snapshot_evictions = Counter(
            "mlxcel_prompt_cache_snapshot_evictions", "Session snapshot evictions by reason", ["reason"],
            registry=self.registry)
        self._seen_snapshot_evictions: dict[str, int] = {}

    def _apply_snapshots(self, stats: SnapshotStats) -> None:
        self._snapshot_bytes.set(stats.bytes)
        self._snapshot_entries.set(stats.entries)
        self._snapshot_checkpoints.set(stats.checkpoints)
        for reason, total in stats.evictions.items():
            grown = total - self._seen_snapshot_evictions.get(reason, 0)
            if grown > 0:
                self._snapshot_evictions.labels(reason=reason).inc(grown)
            self._seen_snapshot_evictions[reason] = total


class _DiskSeries:
    """The disk tier's gauges and counters (disk/directory.py's DiskStats, cumulative since start)."""

    _COUNTERS = (
        ("hits", "mlxcel_prompt_cache_disk_hits", "Lookups answered from the disk tier"),
        ("misses", "mlxcel_prompt_cache_disk_misses", "Lookups the disk tier could not extend"),
        ("writes", "mlxcel_prompt_cache_disk_writes", "Pieces written to the disk tier"),
        ("bytes_written", "mlxcel_prompt_cache_disk_written_bytes", "Bytes written to the disk tier"),
        ("bytes_read", "mlxcel_prompt_cache_disk_read_bytes", "Bytes of disk-tier pieces loaded"),
        ("write_errors", "mlxcel_prompt_cache_disk_write_errors", "Disk-tier writes that failed"),
        ("writes_dropped", "mlxcel_prompt_cache_disk_writes_dropped", "Pieces not written (queue or budget)"),
        ("evictions", "mlxcel_prompt_cache_disk_evictions", "Pieces this process deleted for the budget"),
        ("loads_cut_short", "mlxcel_prompt_cache_disk_loads_cut_short",
         "Disk hits that stopped reading where prefilling the rest was projected to be faster"),
    )

    def __init__(self, registry: CollectorRegistry) -> None:
        from mlxcel.disk.index import REFUSAL_REASONS

        self._bytes = Gauge("mlxcel_prompt_cache_disk_bytes", "Bytes of pieces in the disk tier's directory",
                            registry=registry)
        self._entries = Gauge("mlxcel_prompt_cache_disk_entries", "Pieces in the disk tier's directory",
                              registry=registry)
        self._counters = {field: Counter(name, documentation, registry=registry)
                          for field, name, documentation in self._COUNTERS}
        self._load_seconds = Counter("mlxcel_prompt_cache_disk_load_seconds", "Seconds spent loading disk hits",
                                     registry=registry)
        self._refusals = Counter("mlxcel_prompt_cache_disk_refusals", "Disk-tier files refused (and deleted)",
                                 ["reason"], registry=registry)
        for reason in REFUSAL_REASONS:
            self._refusals.labels(reason=reason)
        self._seen: dict[str, float] = {}

    def _grow(self, key: str, total: float, counter: Any) -> None:
        grown = total - self._seen.get(key, 0)
        if grown > 0:
            counter.inc(grown)
        self._seen[key] = total

    def apply(self, stats: Any) -> None:
        self._bytes.set(stats.bytes)
        self._entries.set(stats.entries)
        for field, counter in self._counters.items():
            self._grow(field, getattr(stats, field), counter)
        self._grow("load_seconds", stats.load_seconds, self._load_seconds)
        for reason, total in stats.refusals.items():
            self._grow(f"refusal/{reason}", total, self._refusals.labels(reason=reason))


class _VllmSeries:
    """vLLM's names for the same facts (vllm/v1/metrics/loggers.py), one engine ("0")."""

    def __init__(self, registry: CollectorRegistry, *, model_name: str, block_size: int, num_blocks: int,
                 prefix_caching: bool) -> None:
        labels = ("model_name", "engine")
        values = (model_name, "0")

        def gauge(name: str, documentation: str) -> Gauge:
            return Gauge(name, documentation, labels, registry=registry).labels(*values)

        def counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, labels, registry=registry).labels(*values)

        self._running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self._waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self._usage = gauge("vllm:kv_cache_usage_perc",
                            "KV-cache usage (prompt-cache bytes over its budget). 1 means 100 percent usage.")
        self._gpu_usage = gauge("vllm:gpu_cache_usage_perc",
                                "GPU KV-cache usage. 1 means 100 percent usage. (vLLM's older name, as "
                                "vllm:kv_cache_usage_perc.)")
        self._queries = counter("vllm:prefix_cache_queries",
                                "Prefix cache queries, in terms of number of queried tokens.")
        self._hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self._hit_rate = gauge("vllm:gpu_prefix_cache_hit_rate",
                               "Prefix cache hit rate since start: cached tokens over queried tokens (vLLM's "
                               "older gauge, read by the production-stack router).")
        self._num_queried = 0
        self._num_hit = 0
        info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                     ("block_size", "num_gpu_blocks", "enable_prefix_caching", "engine"), registry=registry)
        info.labels(block_size=str(block_size), num_gpu_blocks=str(num_blocks),
                    enable_prefix_caching=str(prefix_caching), engine="0").set(1)

    def looked_up(self, queried: int, hit: int) -> None:
        self._queries.inc(queried)
        self._hits.inc(hit)
        self._num_queried += queried
        self._num_hit += hit

    def apply(self, store: StoreStats | None, scheduler: SchedulerStats | None) -> None:
        if scheduler is not None:
            self._running.set(scheduler.num_running)
            self._waiting.set(scheduler.num_waiting)
        usage = store.bytes / store.capacity_bytes if store is not None and store.capacity_bytes else 0.0
        self._usage.set(usage)
        self._gpu_usage.set(usage)
        self._hit_rate.set(self._num_hit / self._num_queried if self._num_queried else 0.0)
