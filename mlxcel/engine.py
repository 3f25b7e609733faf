"""The engine: starts the actors in the caller's nursery and hands back a handle.

    async with mlxcel.open_engine(config) as engine:
        completion = await engine.chat(ChatRequest(...))

or, as one more task in an existing nursery:

    engine = await nursery.start(mlxcel.run_engine, config)
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import attrs
import trio

from mlxcel.actors.cache_store import CacheStoreActor
from mlxcel.actors.device import DeviceActor, DeviceSettings, ModelInfo
from mlxcel.actors.messages import (
    AdapterScales,
    CacheStoreStats,
    CancelRequest,
    EventSink,
    GetCacheStats,
    GetSchedulerStats,
    RenderMetrics,
    RenderPrompt,
    RequestFailed,
    RequestFinished,
    ResetCache,
    RouteRequest,
    RouterMsg,
    SchedulerStats,
    StopRequest,
    StreamEvent,
    UseDiskTier,
)
from mlxcel.actors.metrics import MetricsActor
from mlxcel.actors.router import RouterActor
from mlxcel.actors.scheduler import SchedulerActor
from mlxcel.actors.warmer import WarmerActor
from mlxcel.cache.capacity import CapacityDecision, kv_bytes_per_token, kv_head_dim
from mlxcel.cache.snapshots import SnapshotLimits, SnapshotStore
from mlxcel.cache.store import ApcSettings, PromptCacheStore, StoreLimits
from mlxcel.config import EngineConfig, PromptCacheConfig, check_speculative
from mlxcel.core.cache_plan import CachePlan, plan_cache
from mlxcel.core.plan import Capabilities
from mlxcel.disk import index as disk_index
from mlxcel.disk.directory import DiskSettings
from mlxcel.disk.tier import DiskTier, open_disk_tier
from mlxcel.errors import MlxcelError, ServerBusy
from mlxcel.model.grammar_check import GrammarChecker
from mlxcel.model.prompt import PromptRenderer, RenderedPrompt
from mlxcel.model.reply_parsers import with_reply_parsers
from mlxcel.types import ChatRequest, Completion, CompletionRequest, Delta, TokenLogprob, ToolCall

logger = logging.getLogger(__name__)

_INBOX_SIZE = 1024


class DeltaStream:
    """The deltas of one request. Closing it early cancels the request."""

    def __init__(self, engine: EngineHandle, request_id: str,
                 events: trio.MemoryReceiveChannel[StreamEvent]) -> None:
        self._engine = engine
        self.request_id = request_id
        self._events = events
        self._finished = False

    def __aiter__(self) -> DeltaStream:
        return self

    async def __anext__(self) -> Delta:
        if self._finished:
            raise StopAsyncIteration
        try:
            event = await self._events.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            self._finished = True
            raise StopAsyncIteration from None
        if isinstance(event, RequestFailed):
            self._finished = True
            raise event.error
        # Sampled tokens go only to a caller that asked to process them (submit's edge_output).
        assert isinstance(event, Delta)
        if event.finish_reason is not None:
            self._finished = True
        return event

    async def aclose(self) -> None:
        self._events.close()
        if not self._finished:
            self._finished = True
            self._engine._cancel(self.request_id)

    async def __aenter__(self) -> DeltaStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class EngineHandle:
    """What an application (or the HTTP app) talks to: an ``Engine`` in this process, or one across a socket
    (``mlxcel.http.engine_link.RemoteEngine``). Safe to share between tasks."""

    model: ModelInfo
    config: EngineConfig
    cache_plan: CachePlan
    # ``--served-model-name``: every id a request may name, the reported one first.
    served_model_names: tuple[str, ...] = ()

    @property
    def model_id(self) -> str:
        """The id replies report: the first ``--served-model-name``, else the model's own."""
        return self.model.model_id

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every id a request may name (``--served-model-name``), the reported one first."""
        return self.served_model_names or (self.model_id,)

    def stream(self, request: ChatRequest | CompletionRequest) -> DeltaStream:
        """Start a request; iterate the result for its deltas (the last has usage)."""
        raise NotImplementedError

    async def render_prompt(self, request: ChatRequest | CompletionRequest) -> tuple[int, ...]:
        """The prompt's token ids as ``stream`` would prefill them (template, tools, tokenizer), without generating."""
        raise NotImplementedError

    async def lora_adapters(self, scales: tuple[tuple[int, float], ...] | None = None) -> list[dict[str, Any]]:
        """The LoRA adapters (id, path, server-wide scale); ``scales`` sets the server-wide scales first
        ((id, scale) pairs, every adapter not named at 0)."""
        raise NotImplementedError

    async def cache_stats(self) -> dict[str, Any]:
        """The cache store's statistics as the JSON body of ``/v1/cache/stats``."""
        raise NotImplementedError

    async def reset_cache(self, *, disk: bool = False) -> dict[str, int]:
        """Empty the memory stores; with ``disk``, delete the disk tier's files too (every process's)."""
        raise NotImplementedError

    async def scheduler_stats(self) -> SchedulerStats:
        raise NotImplementedError

    async def metrics_text(self) -> bytes:
        raise NotImplementedError

    def _cancel(self, request_id: str) -> None:
        raise NotImplementedError

    async def count_prompt_tokens(self, request: ChatRequest) -> int:
        """The prompt's length in tokens, rendered and tokenized as ``stream`` would, without generating."""
        return len(await self.render_prompt(request))

    async def chat(self, request: ChatRequest | CompletionRequest) -> Completion:
        """Run a request to the end and return the whole reply."""
        texts: list[str] = []
        reasoning: list[str] = []
        tool_calls: list[ToolCall] = []
        logprobs: list[TokenLogprob] = []
        async with self.stream(request) as deltas:
            async for delta in deltas:
                texts.append(delta.text)
                reasoning.append(delta.reasoning)
                tool_calls.extend(delta.tool_calls)
                logprobs.extend(delta.logprobs)
                if delta.finish_reason is not None:
                    assert delta.usage is not None
                    return Completion(
                        text="".join(texts),
                        finish_reason=delta.finish_reason,
                        usage=delta.usage,
                        logprobs=tuple(logprobs),
                        model=self.model_id,
                        reasoning="".join(reasoning),
                        tool_calls=tuple(tool_calls),
                    )
        raise RuntimeError("the request ended without a finish reason")


class Engine(EngineHandle):
    """The handle of an engine running in this process's nursery (``run_engine``)."""

    def __init__(
        self,
        *,
        model: ModelInfo,
        config: EngineConfig,
        to_router: trio.MemorySendChannel[RouterMsg],
        to_scheduler: trio.MemorySendChannel[Any],
        to_cache_store: trio.MemorySendChannel[Any],
        to_metrics: trio.MemorySendChannel[Any],
        cache_plan: CachePlan,
        disk: DiskTier | None = None,
    ) -> None:
        self.model = model
        self._disk = disk
        self.config = config
        self.served_model_names = config.served_model_names
        # How this engine caches, as run_engine decided it (core/cache_plan.py).
        self.cache_plan = cache_plan
        self._to_router = to_router
        self._to_scheduler = to_scheduler
        self._to_cache_store = to_cache_store
        self._to_metrics = to_metrics
        self._request_ids = itertools.count()

    def stream(self, request: ChatRequest | CompletionRequest) -> DeltaStream:
        request_id = f"req-{next(self._request_ids)}"
        send, receive = trio.open_memory_channel[StreamEvent](self.config.scheduler.client_buffer_events)
        try:
            self.submit(request, request_id, send)
        except ServerBusy:
            send.close()
            receive.close()
            raise
        return DeltaStream(self, request_id, receive)

    def submit(self, request: ChatRequest | CompletionRequest, request_id: str, events: EventSink,
               rendered: RenderedPrompt | None = None, *, edge_output: bool = False) -> None:
        """Start a request whose events go to ``events`` (closed after the last); ServerBusy when the router's
        inbox is full (``events`` untouched). ``request_id`` must be unique among the requests in flight.
        ``rendered``: the request's prompt as ``prompt_renderer`` renders it, done already (by an API process).
        ``edge_output``: the caller processes the output itself: ``events`` gets the sampled tokens
        (``SampledToken``) and the usage of the engine's last event, and the caller calls ``stop`` when a
        stop string ends the reply and ``record_finished`` when it has (unless the first event is a ``Delta``:
        then the engine processed it, as it does when it needs the reply's text)."""
        try:
            self._to_router.send_nowait(RouteRequest(request=request, request_id=request_id, events=events,
                                                     rendered=rendered, edge_output=edge_output))
        except trio.WouldBlock:
            raise ServerBusy("the server is at capacity; retry shortly") from None

    async def render_prompt(self, request: ChatRequest | CompletionRequest) -> tuple[int, ...]:
        answer: tuple[int, ...] = await self._ask_router(partial(RenderPrompt, request=request))
        return answer

    async def lora_adapters(self, scales: tuple[tuple[int, float], ...] | None = None) -> list[dict[str, Any]]:
        answer: list[dict[str, Any]] = await self._ask_router(partial(AdapterScales, scales=scales))
        return answer

    async def _ask_router(self, make: Callable[..., Any]) -> Any:
        reply_to, replies = trio.open_memory_channel[Any](1)
        try:
            self._to_router.send_nowait(make(reply_to=reply_to))
        except trio.WouldBlock:
            reply_to.close()
            replies.close()
            raise ServerBusy("the server is at capacity; retry shortly") from None
        with replies:
            answer = await replies.receive()
        if isinstance(answer, MlxcelError):
            raise answer
        return answer

    async def cache_stats(self) -> dict[str, Any]:
        stats: CacheStoreStats = await self._ask(self._to_cache_store, GetCacheStats)
        body = stats.to_json()
        body["apc_enabled"] = body["apc_enabled"] and self.cache_plan.apc
        body["disk"] = {"enabled": False}
        body["speculative"] = await self._speculation_stats()
        if self._disk is not None:
            body["disk"] = {"enabled": True, **(await trio.to_thread.run_sync(self._disk.statistics)).to_json()}
        return body

    async def _speculation_stats(self) -> dict[str, Any]:
        """--speculative's counters since start and the share of proposed tokens accepted."""
        scheduler: SchedulerStats = await self._ask(self._to_scheduler, GetSchedulerStats)
        proposed, accepted = scheduler.num_proposed_tokens, scheduler.num_accepted_tokens
        return {"mode": self.config.speculative, "verify_steps": scheduler.num_verify_steps,
                "proposed_tokens": proposed, "accepted_tokens": accepted,
                "acceptance_rate": round(accepted / proposed, 4) if proposed else None}

    async def reset_cache(self, *, disk: bool = False) -> dict[str, int]:
        freed: dict[str, int] = await self._ask(self._to_cache_store, ResetCache)
        if disk and self._disk is not None:
            freed["disk_entries_freed"], freed["disk_bytes_freed"] = await trio.to_thread.run_sync(self._disk.clear)
        return freed

    async def scheduler_stats(self) -> SchedulerStats:
        return await self._ask(self._to_scheduler, GetSchedulerStats)

    async def metrics_text(self) -> bytes:
        # The store's and the queue's gauges are pulled now rather than pushed after every change.
        stats: CacheStoreStats = await self._ask(self._to_cache_store, GetCacheStats)
        scheduler: SchedulerStats = await self._ask(self._to_scheduler, GetSchedulerStats)
        disk = await trio.to_thread.run_sync(self._disk.statistics) if self._disk is not None else None
        return await self._ask(self._to_metrics, RenderMetrics, store=stats.store, snapshots=stats.snapshots,
                               scheduler=scheduler, disk=disk)

    async def _ask(self, channel: trio.MemorySendChannel[Any], message_type: Any, **fields: Any) -> Any:
        reply_to, replies = trio.open_memory_channel[Any](1)
        await channel.send(message_type(reply_to=reply_to, **fields))
        with replies:
            return await replies.receive()

    def _cancel(self, request_id: str) -> None:
        # When it cannot be sent, the closed event channel still frees the sequence at its next token.
        with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            self._to_scheduler.send_nowait(CancelRequest(request_id=request_id))

    def stop(self, request_id: str) -> bool:
        """A stop string ended a reply the caller processes (``submit``'s ``edge_output``); False: the scheduler's
        inbox is full (the caller then closes the request's events, which cancels it at its next token)."""
        try:
            self._to_scheduler.send_nowait(StopRequest(request_id=request_id))
        except trio.WouldBlock:
            return False
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        return True

    def record_finished(self, finished: RequestFinished) -> None:
        """A reply the caller processed has finished (``submit``'s ``edge_output``): for the metrics."""
        with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            self._to_metrics.send_nowait(finished)


def prompt_renderer(model: ModelInfo, config: EngineConfig, plan: CachePlan) -> PromptRenderer:
    """The renderer of an engine serving ``model`` as ``config`` and ``plan`` say (an API process makes
    the same one from the engine's facts, so its renders are the engine's)."""
    return PromptRenderer(
        model,
        default_template_kwargs=config.chat_template_kwargs,
        cache_enabled=plan.enabled,
        history_boundaries=plan.snapshots,
        allow_request_template=config.allow_request_chat_template,
        memo_per_session=not plan.cross_session,
        chat_template=config.chat_template,
    )


def _log_capacity(plan: CapacityDecision, store: str, flag: str) -> None:
    if plan.applied:
        logger.info(
            "Applied model-aware prompt-cache %s capacity default: previous=%d recommended=%d "
            "entry_bytes=%d ceiling=%d",
            store, plan.previous, plan.recommended, plan.entry_nbytes, plan.ceiling,
        )
    if plan.entry_never_fits:
        logger.warning(
            "one %s entry at the representative length (%d bytes) is larger than the whole store "
            "(%d bytes), so such entries are never kept; raise %s",
            store, plan.entry_nbytes, plan.recommended, flag,
        )


def _build_store(config: EngineConfig, plan: CachePlan) -> PromptCacheStore | None:
    cache = config.prompt_cache
    if not plan.enabled:
        return None
    return PromptCacheStore(
        StoreLimits(
            capacity_bytes=plan.kv_capacity_bytes,
            max_entries=cache.max_entries,
            ttl_seconds=cache.ttl_seconds,
            min_prefix=cache.min_prefix,
            pinned_share=cache.pinned_share,
        ),
        ApcSettings(
            enabled=plan.apc,
            block_size=cache.apc_block_size,
            num_blocks=cache.apc_num_blocks,
            algorithm=cache.apc_hash,
        ),
        # The store logs its block changes only for a KV event stream.
        log_blocks=config.kv_events.enabled,
    )


def _log_plan(plan: CachePlan, config: EngineConfig, model: ModelInfo) -> None:
    """What the cache plan decided that an operator may want to know."""
    for note in plan.notes:
        logger.info("%s", note)
    if plan.kv_capacity is not None:
        _log_capacity(plan.kv_capacity, "KV store", "--prompt-cache-capacity-bytes")
    if plan.prefix:
        _log_kv_bits(config.prompt_cache, model)
    if plan.snapshot_capacity is not None:
        _log_capacity(plan.snapshot_capacity, "snapshot", "--prompt-cache-snapshot-capacity-bytes")
    if config.prompt_cache.disk_dir is not None and not plan.disk:
        logger.warning("--prompt-cache-dir is ignored: the prompt cache is off")


def _log_kv_bits(cache: PromptCacheConfig, model: ModelInfo) -> None:
    if not cache.kv_bits:
        return
    try:
        head_dim = kv_head_dim(model.config)
    except ValueError:
        head_dim = 0
    if head_dim and head_dim % cache.kv_group_size:
        logger.warning("--prompt-cache-kv-bits %d is ignored: head_dim %d is not a multiple of "
                       "--prompt-cache-kv-group-size %d, so stored KV stays exact", cache.kv_bits, head_dim,
                       cache.kv_group_size)
        return
    logger.info("prompt cache: stored KV kept at %d bits in groups of %d (hits are close to, not equal to, "
                "a cold run; session snapshots stay exact)", cache.kv_bits, cache.kv_group_size)


def _build_snapshot_store(config: EngineConfig, plan: CachePlan) -> SnapshotStore | None:
    """The session snapshot store, for families that cannot resume from a prefix."""
    if not plan.snapshots:
        return None
    cache = config.prompt_cache
    return SnapshotStore(SnapshotLimits(
        capacity_bytes=plan.snapshot_capacity_bytes,
        max_entries=cache.snapshot_max_entries,
        ttl_seconds=cache.snapshot_ttl_seconds,
    ))


def _disk_file_bounds(plan: CachePlan, model: ModelInfo) -> tuple[int | None, int | None]:
    """The largest piece and snapshot file this model can write (None: unknown, the budget bounds it).

    Reads refuse anything larger unopened: a planted file must not cost its size. A factor of 4
    covers a KV dtype wider than config.json's (float32 CPU fixtures of a bf16 config).
    """
    try:
        piece = 4 * kv_bytes_per_token(model.config) * disk_index.PIECE_TOKENS + disk_index.MAX_HEADER_BYTES
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        piece = None
    snapshot = None
    if plan.snapshots:
        # A snapshot larger than the memory store could not have been stored, so not written either.
        snapshot = plan.snapshot_capacity_bytes + disk_index.MAX_HEADER_BYTES
    return piece, snapshot


async def _open_disk(config: EngineConfig, model: ModelInfo, plan: CachePlan) -> DiskTier | None:
    """The disk tier (--prompt-cache-dir), fingerprinted and indexed in a worker thread; None when off."""
    cache = config.prompt_cache
    if not plan.disk or cache.disk_dir is None:
        return None
    max_piece_bytes, max_snapshot_bytes = _disk_file_bounds(plan, model)
    settings = DiskSettings(directory=cache.disk_dir, budget_bytes=cache.disk_bytes,
                            write_bytes_per_second=cache.disk_write_bytes_per_second,
                            session_scoped=not cache.cross_session, min_prefix=cache.min_prefix,
                            max_piece_bytes=max_piece_bytes, max_snapshot_bytes=max_snapshot_bytes,
                            kv_bits=cache.kv_bits, kv_group_size=cache.kv_group_size)
    adapters = [spec.path for spec in config.lora]
    # The served name is in every context's bucket already; the scales change the KV too.
    extra = [repr([spec.scale for spec in config.lora]), str(not config.lora_init_without_apply)]
    if cache.kv_bits:
        # Quantized pieces are other files: a server with another setting neither reads nor evicts-by-name them.
        # (Hadamard-rotated groups since issue 31: files of the plain layout are not these.)
        extra.append(f"kv_bits={cache.kv_bits},kv_group_size={cache.kv_group_size},kv_rotation=hadamard")
    try:
        return await trio.to_thread.run_sync(partial(open_disk_tier, settings, model.path, adapters, extra))
    except OSError as error:
        # The server keeps serving on any disk fault, this one included.
        logger.error("prompt-cache disk tier: cannot fingerprint the model at %s (%s); the disk tier is off",
                     model.path, error.strerror or error)
        return None


async def run_engine(config: EngineConfig, *, task_status: trio.TaskStatus[Engine] = trio.TASK_STATUS_IGNORED) -> None:
    """Run every actor until cancelled; ``task_status.started`` hands out the Engine."""
    check_speculative(config)
    model_path = config.model_path
    if model_path is None:
        from mlxcel.fixtures.text import demo_model_path

        model_path = await trio.to_thread.run_sync(demo_model_path)
        logger.warning(
            "no --model given: serving the built-in demo model at %s, which has RANDOM WEIGHTS "
            "and answers with gibberish (for trying the server, not for use)", model_path,
        )
    # The scheduler's steps in flight (the disk tier's reads and writes ride them) and UseDiskTier.
    to_device, device_inbox = trio.open_memory_channel[Any](64)
    to_cache_store, cache_inbox = trio.open_memory_channel[Any](_INBOX_SIZE)
    to_metrics, metrics_inbox = trio.open_memory_channel[Any](_INBOX_SIZE)
    to_warmer, warmer_inbox = trio.open_memory_channel[Any](_INBOX_SIZE)
    to_scheduler, scheduler_inbox = trio.open_memory_channel[Any](config.scheduler.max_queued_requests + 64)
    to_router, router_inbox = trio.open_memory_channel[Any](config.scheduler.max_queued_requests)

    async with trio.open_nursery() as nursery:
        device = DeviceActor(
            DeviceSettings(
                model_path=model_path,
                context_size=config.ctx_size,
                max_batch_size=config.scheduler.max_batch_size,
                prefill_batch_size=config.scheduler.prefill_batch_size,
                prefill_step_size=config.scheduler.prefill_step_size,
                warm_up=config.scheduler.device_warmup,
                bucket_starts=config.scheduler.start_buckets,
                fail_step=config.fail_step,
                fail_out_of_memory=config.fail_out_of_memory,
                lora=config.lora,
                lora_apply=not config.lora_init_without_apply,
                kv_bits=config.prompt_cache.kv_bits,
                kv_group_size=config.prompt_cache.kv_group_size,
                grammar_mask_timeout_s=(None if config.grammar_mask_timeout_ms is None
                                        else config.grammar_mask_timeout_ms / 1000),
                speculative=config.speculative,
                speculative_tokens=config.speculative_tokens,
                draft_model_path=config.draft_model,
            ),
            device_inbox,
        )
        model: ModelInfo = await nursery.start(device.run)
        if config.served_model_names:
            # The reported id is also the cache keys' model id, so every alias shares one cache.
            model = attrs.evolve(model, model_id=config.served_model_names[0])
        # The tool-call and reasoning formats of the template in effect, or the ones named.
        model = attrs.evolve(model, tokenizer=with_reply_parsers(
            model.tokenizer, chat_template=config.chat_template, tool_call_parser=config.tool_call_parser,
            reasoning_parser=config.reasoning_parser))
        # How this server caches, decided once here and handed whole to every part that needs it.
        plan = plan_cache(config, model.family, model.config)
        _log_plan(plan, config, model)
        store = _build_store(config, plan)
        snapshots = _build_snapshot_store(config, plan)
        disk = await _open_disk(config, model, plan)
        if disk is not None:
            await to_device.send(UseDiskTier(tier=disk))
        renderer = prompt_renderer(model, config, plan)
        await nursery.start(MetricsActor(
            inbox=metrics_inbox,
            model_name=model.model_id,
            block_size=config.prompt_cache.apc_block_size,
            num_blocks=store.apc.block_cap(store.limits.max_entries) if store is not None and plan.apc else 0,
            prefix_caching=plan.enabled,
        ).run)
        to_kv_events = None
        if config.kv_events.enabled:
            # Imported here: zmq is loaded only by a server that publishes events.
            from mlxcel.actors.kv_events import KvEventPublisherActor

            to_kv_events, kv_events_inbox = trio.open_memory_channel[Any](_INBOX_SIZE)
            await nursery.start(KvEventPublisherActor(
                config=config.kv_events, block_size=config.prompt_cache.apc_block_size, inbox=kv_events_inbox,
            ).run)
        await nursery.start(CacheStoreActor(
            store=store, snapshots=snapshots, inbox=cache_inbox, to_metrics=to_metrics.clone(),
            cross_session=plan.cross_session,
            to_scheduler=to_scheduler.clone(),
            to_kv_events=to_kv_events,
            disk=disk,
        ).run)
        await nursery.start(WarmerActor(
            inbox=warmer_inbox,
            renderer=renderer if plan.warm_ups else None,
            to_scheduler=to_scheduler.clone() if plan.warm_ups else None,
        ).run)
        await nursery.start(SchedulerActor(
            config=config.scheduler,
            # The device resolved the per-backend default prefill step and whether starts are bucketed.
            capabilities=Capabilities(
                prefill_step_size=model.prefill_step_size, context_size=model.context_size,
                max_batch_size=config.scheduler.max_batch_size, bucket_starts=model.bucket_starts,
                hit_kept_tokens=config.scheduler.max_step_hit_tokens,
            ),
            inbox=scheduler_inbox,
            to_device=to_device,
            to_cache_store=to_cache_store.clone(),
            to_metrics=to_metrics.clone(),
            to_warmer=to_warmer,
            tokenizer=model.tokenizer,
            eos_token_ids=model.eos_token_ids,
            cache=plan,
        ).run)
        grammar_checker = GrammarChecker(model.tokenizer, model.eos_token_ids, timeout_s=config.grammar_timeout)
        # llguidance's tokenizer holds the GIL for seconds while it is built: before serving, not beside steps.
        await grammar_checker.prepare()
        await nursery.start(RouterActor(
            model=model,
            renderer=renderer,
            cache_enabled=plan.enabled,
            inbox=router_inbox,
            to_scheduler=to_scheduler.clone(),
            grammar_checker=grammar_checker,
        ).run)
        logger.info(
            "engine ready: model %s (%s, context %d, prefill step %d), prompt cache %s, APC %s",
            model.model_id, model.family.kind.value, model.context_size, model.prefill_step_size,
            plan.mode.value, "on" if plan.apc else "off",
        )
        task_status.started(Engine(
            model=model,
            config=config,
            to_router=to_router,
            to_scheduler=to_scheduler,
            to_cache_store=to_cache_store,
            to_metrics=to_metrics,
            cache_plan=plan,
            disk=disk,
        ))


@contextlib.asynccontextmanager
async def open_engine(config: EngineConfig) -> AsyncIterator[Engine]:
    """Start the engine in a nursery of its own; leaving the block stops it."""
    async with trio.open_nursery() as nursery:
        engine = await nursery.start(run_engine, config)
        try:
            yield engine
        finally:
            nursery.cancel_scope.cancel()
