"""The scheduler actor: admission, backpressure, the step loop, adopt and donate.

Two tasks share this actor's state (and nothing else does): the inbox loop
takes submissions and cancellations; the step loop drives the device one
``RunStep`` at a time, strictly request/reply, so the scheduler -> device ->
scheduler cycle can never deadlock. Per-client events go out with
``send_nowait``: a client whose buffer is full, or who has gone, is dropped.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import attrs
import trio

from mlxcel.actors.messages import (
    AdmitSequence,
    CacheContext,
    CancelRequest,
    DonateSequence,
    GetSchedulerStats,
    LookupPrefix,
    MetricsMsg,
    PrefixFound,
    PrefixMissing,
    ReplyFinished,
    RequestFailed,
    RequestFinished,
    RemoveSequence,
    RunStep,
    SampledToken,
    SchedulerStats,
    StepDone,
    StreamEvent,
    SubmitRequest,
    WarmerMsg,
    DeviceMsg,
    CacheStoreMsg,
    DonateSnapshot,
    LookupSnapshot,
    SnapshotFound,
    SnapshotMissing,
    ReleasePayloads,
    ShedCache,
    SnapshotRestoreFailed,
    WarmSession,
)
from mlxcel.cache.snapshots import common_prefix_length
from mlxcel.config import PromptCacheConfig, SchedulerConfig
from mlxcel.types import Delta, InvalidRequest, SamplingParams, ServerBusy, TokenLogprob, Usage

logger = logging.getLogger(__name__)

SchedulerMsg = SubmitRequest | CancelRequest | GetSchedulerStats | WarmSession | ReleasePayloads

# Warm-ups waiting for an idle device, newest per session; older ones are dropped.
MAX_PENDING_WARMUPS = 64
# How long an idle device waits for requests the router says are right behind
# the first one, so clients that arrive together are prefilled together.
ARRIVAL_WINDOW_SECONDS = 0.02


@attrs.define(kw_only=True)
class _Running:
    request: SubmitRequest
    sequence_id: int
    cached_tokens: int
    detokenizer: Any
    submitted_at: float
    first_token_at: float | None = None
    completion_tokens: int = 0
    # Text decoded but held back because it may be the start of a stop string.
    held_text: str = ""
    # Ids of tokens whose text has not gone out yet.
    pending_ids: list[int] = attrs.Factory(list)
    prompt_done: bool = False
    finished: bool = False
    # The reply so far, for the warmer (snapshot families only).
    reply_parts: list[str] = attrs.Factory(list)


class StopMatcher:
    """Finds stop strings in streamed text without ever emitting part of one."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self._stop = stop
        # The stop string that ended the text, once feed found one.
        self.matched: str | None = None

    def feed(self, held: str, new_text: str) -> tuple[str, str, bool]:
        """Returns (text safe to emit, text to keep holding, whether a stop string ended it)."""
        text = held + new_text
        if not self._stop:
            return text, "", False
        found = [(index, stop) for stop in self._stop if (index := text.find(stop)) >= 0]
        if found:
            cut, self.matched = min(found, key=lambda pair: pair[0])
            return text[:cut], "", True
        keep = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(text)), keep, -1):
                if text.endswith(stop[:length]):
                    keep = length
                    break
        return text[: len(text) - keep], text[len(text) - keep :], False


class SchedulerActor:
    def __init__(
        self,
        *,
        config: SchedulerConfig,
        inbox: trio.MemoryReceiveChannel[SchedulerMsg],
        to_device: trio.MemorySendChannel[DeviceMsg],
        to_cache_store: trio.MemorySendChannel[CacheStoreMsg] | None,
        to_metrics: trio.MemorySendChannel[MetricsMsg] | None,
        to_warmer: trio.MemorySendChannel[WarmerMsg] | None,
        tokenizer: Any,
        eos_token_ids: frozenset[int],
        cache_config: PromptCacheConfig | None = None,
        prompt_donation: bool = False,
        snapshots: bool = False,
    ) -> None:
        self._config = config
        # Requests that share at least this many more tokens with a prompt being
        # prefilled than the store can give them wait for it instead of duplicating it.
        self._share_threshold = (
            max(cache_config.min_prefix, cache_config.apc_block_size, 1) if cache_config else 0
        )
        self._cross_session = cache_config.cross_session if cache_config else False
        self._prompt_donation = prompt_donation and cache_config is not None
        # Snapshot families resume from session snapshots instead of the prefix store.
        self._snapshots = snapshots and cache_config is not None
        self._boundary_snapshots = cache_config.boundary_snapshots if cache_config else False
        self._trace = cache_config.trace if cache_config else False
        self._pending_warmups: collections.OrderedDict[tuple[str, ...], WarmSession] = collections.OrderedDict()
        self._warming: dict[int, WarmSession] = {}
        self._num_warm_started = 0
        self._num_warm_completed = 0
        self._num_warm_preempted = 0
        self._num_warm_steps_with_foreground = 0
        self.inbox = inbox
        self._to_device = to_device
        self._to_cache_store = to_cache_store
        self._to_metrics = to_metrics
        self._to_warmer = to_warmer
        self._tokenizer = tokenizer
        self._eos_token_ids = eos_token_ids
        self._waiting: collections.deque[SubmitRequest] = collections.deque()
        self._running: dict[int, _Running] = {}
        self._sequence_of: dict[str, int] = {}
        self._removals: list[RemoveSequence] = []
        # Payloads the cache stores let go of, to be dropped on the device thread.
        self._release: list[Any] = []
        # Finished sequences whose KV is still on its way back: (context, prompt length).
        self._pending_donations: dict[int, tuple[CacheContext, int]] = {}
        self._cancelled_before_submit: collections.OrderedDict[str, None] = collections.OrderedDict()
        # Requests waiting for a prefilling sequence's prompt KV, by that sequence's id.
        self._parked: dict[int, list[SubmitRequest]] = {}
        self._next_sequence_id = 0
        self._work = trio.Event()
        self._more_coming = False
        self._arrival = trio.Event()
        self._num_steps = 0
        self._num_completed = 0
        self._num_cancelled = 0
        self._num_failed = 0
        self._num_interleaved_steps = 0
        self._num_shared_prefills = 0
        self._decode_batch_sizes: collections.Counter[int] = collections.Counter()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with self.inbox, self._to_device:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._step_loop)
                task_status.started()
                async for message in self.inbox:
                    self._handle(message)
                nursery.cancel_scope.cancel()

    def statistics(self) -> SchedulerStats:
        return SchedulerStats(
            num_waiting=len(self._waiting),
            num_running=len(self._running),
            num_steps=self._num_steps,
            num_completed=self._num_completed,
            num_cancelled=self._num_cancelled,
            num_failed=self._num_failed,
            max_decode_batch_size=max(self._decode_batch_sizes, default=0),
            decode_batch_sizes=dict(self._decode_batch_sizes),
            num_interleaved_steps=self._num_interleaved_steps,
            num_parked=sum(len(parked) for parked in self._parked.values()),
            num_shared_prefills=self._num_shared_prefills,
            num_warm_started=self._num_warm_started,
            num_warm_completed=self._num_warm_completed,
            num_warm_preempted=self._num_warm_preempted,
            num_warm_steps_with_foreground=self._num_warm_steps_with_foreground,
            running_request_ids=tuple(r.request.request_id for r in self._running.values()),
        )

    # --- inbox ---------------------------------------------------------------

    def _handle(self, message: SchedulerMsg) -> None:
        match message:
            case SubmitRequest():
                self._submit(message)
            case CancelRequest():
                self._cancel(message.request_id)
            case ReleasePayloads():
                self._release.extend(message.payloads)
                self._work.set()
            case WarmSession():
                if self._snapshots:
                    key = (message.context.model_id, message.context.cache_salt, message.context.session_key)
                    self._pending_warmups.pop(key, None)
                    self._pending_warmups[key] = message
                    while len(self._pending_warmups) > MAX_PENDING_WARMUPS:
                        self._pending_warmups.popitem(last=False)
                    self._work.set()
            case GetSchedulerStats():
                with message.reply_to:
                    try:
                        message.reply_to.send_nowait(self.statistics())
                    except trio.BrokenResourceError:
                        pass

    def _submit(self, request: SubmitRequest) -> None:
        if request.request_id in self._cancelled_before_submit:
            del self._cancelled_before_submit[request.request_id]
            request.events.close()
            return
        num_parked = sum(len(parked) for parked in self._parked.values())
        if len(self._waiting) + num_parked >= self._config.max_queued_requests:
            self._send_event_to(
                request.events,
                RequestFailed(error=ServerBusy(
                    f"the server is at capacity ({len(self._waiting)} requests waiting); retry shortly"
                )),
            )
            request.events.close()
            return
        self._waiting.append(request)
        self._more_coming = request.more_pending
        self._arrival.set()
        self._work.set()

    def _cancel(self, request_id: str) -> None:
        sequence_id = self._sequence_of.get(request_id)
        if sequence_id is not None:
            running = self._running.get(sequence_id)
            if running is not None and not running.finished:
                self._num_cancelled += 1
                self._finish_running(running, donate=False, reason=None)
            return
        for queued in self._waiting:
            if queued.request_id == request_id:
                self._waiting.remove(queued)
                queued.events.close()
                self._num_cancelled += 1
                return
        for parked in self._parked.values():
            for queued in parked:
                if queued.request_id == request_id:
                    parked.remove(queued)
                    queued.events.close()
                    self._num_cancelled += 1
                    return
        # The cancel overtook its submission (still in the router).
        self._cancelled_before_submit[request_id] = None
        while len(self._cancelled_before_submit) > 1024:
            self._cancelled_before_submit.popitem(last=False)

    # --- step loop -----------------------------------------------------------

    async def _step_loop(self) -> None:
        while True:
            while not self._has_work():
                self._work = trio.Event()
                await self._work.wait()
            if not self._running and self._more_coming:
                await self._gather_arrivals()
            step = await self._build_step()
            release, self._release = tuple(self._release), []
            reply_to, replies = trio.open_memory_channel[StepDone](1)
            await self._to_device.send(
                RunStep(admit=step[0], remove=step[1], release=release, reply_to=reply_to)
            )
            del release
            with replies:
                done = await replies.receive()
            self._apply(done)

    async def _gather_arrivals(self) -> None:
        """Starting from idle: let requests queued right behind the first join its step."""
        with trio.move_on_after(ARRIVAL_WINDOW_SECONDS):
            while self._more_coming:
                self._arrival = trio.Event()
                await self._arrival.wait()
        self._more_coming = False

    def _idle(self) -> bool:
        return not (self._waiting or self._running or self._parked)

    def _has_work(self) -> bool:
        if self._waiting or self._running or self._removals or self._warming or self._release:
            return True
        return bool(self._pending_warmups) and self._idle()

    async def _build_step(self) -> tuple[tuple[AdmitSequence, ...], tuple[RemoveSequence, ...]]:
        if self._waiting and self._warming:
            # Foreground work arrived: warm-ups give way at once and store nothing.
            for sequence_id in self._warming:
                self._removals.append(RemoveSequence(sequence_id=sequence_id, donate=False))
            self._num_warm_preempted += len(self._warming)
            self._warming.clear()
        removals = tuple(self._removals)
        self._removals.clear()
        admissions = []
        free_slots = self._config.max_batch_size - len(self._running)
        while self._waiting and free_slots > 0:
            request = self._waiting.popleft()
            leader = await self._prefix_leader(request)
            if self._cancelled_while_admitting(request):
                continue
            if leader is not None:
                self._parked.setdefault(leader, []).append(request)
                continue
            admission = await self._admit(request)
            if admission is None:
                continue
            admissions.append(admission)
            free_slots -= 1
        if not admissions and self._idle() and not self._warming and self._pending_warmups:
            warm = await self._admit_warmup()
            if warm is not None:
                admissions.append(warm)
        if self._warming and self._running:
            self._num_warm_steps_with_foreground += 1
        return tuple(self._trim_prompt_donation(admission) for admission in admissions), removals

    def _trim_prompt_donation(self, admission: AdmitSequence) -> AdmitSequence:
        """Drop a prompt donation no request can use before the final one.

        A prompt of one prefill chunk is done within the step that admits it,
        so only requests that parked on it while this step was built can use
        its KV early; without them the copy would only delay the first token.
        """
        step = self._config.prefill_step_size
        if (not admission.donate_prompt or step is None or len(admission.prompt_tokens) > step
                or admission.sequence_id in self._parked):
            return admission
        return attrs.evolve(admission, donate_prompt=False)

    async def _admit_warmup(self) -> AdmitSequence | None:
        _key, job = self._pending_warmups.popitem(last=False)
        tokens = job.tokens
        found = await self._lookup_snapshot(job.context, tokens, record=False)
        matched, payload = 0, None
        if isinstance(found, SnapshotFound):
            matched, payload = found.num_tokens, found.payload
        if len(tokens) - matched < 1:
            return None
        sequence_id = self._next_sequence_id
        self._next_sequence_id += 1
        self._warming[sequence_id] = job
        self._num_warm_started += 1
        if self._trace:
            logger.info("apc-trace: warm-up session=%s extends snapshot %d -> %d tokens",
                        job.context.session_key, matched, len(tokens))
        return AdmitSequence(
            sequence_id=sequence_id,
            prompt_tokens=tokens[matched:],
            cached_tokens=tokens[:matched],
            restore=payload,
            sampling=SamplingParams(temperature=0.0),
            max_tokens=1,
            snapshot_after=len(tokens) - matched,
            warm=True,
        )

    async def _lookup_snapshot(
        self, context: CacheContext, prompt: tuple[int, ...], *, record: bool = True
    ) -> SnapshotFound | SnapshotMissing:
        assert self._to_cache_store is not None
        reply_to, replies = trio.open_memory_channel[SnapshotFound | SnapshotMissing](1)
        await self._to_cache_store.send(
            LookupSnapshot(context=context, tokens=prompt, record=record, reply_to=reply_to)
        )
        with replies:
            try:
                return await replies.receive()
            except trio.EndOfChannel:
                return SnapshotMissing()

    async def _prefix_leader(self, request: SubmitRequest) -> int | None:
        """A prefilling sequence whose prompt KV would serve this request better than the store."""
        context = request.cache_context
        if not self._prompt_donation or context is None or len(request.prompt_tokens) < 2:
            return None
        best_sequence, best_shared = None, 0
        for running in self._running.values():
            other = running.request.cache_context
            if running.prompt_done or running.finished or other is None:
                continue
            if (other.bucket, other.rope_regime, other.mm_digest) != (
                context.bucket, context.rope_regime, context.mm_digest
            ):
                continue
            if not self._cross_session and other.session_key != context.session_key:
                continue
            shared = common_prefix_length(running.request.prompt_tokens, request.prompt_tokens)
            if shared > best_shared:
                best_sequence, best_shared = running.sequence_id, shared
        if best_sequence is None or best_shared < self._share_threshold:
            return None
        found = await self._lookup(context, request.prompt_tokens, record=False)
        matched = found.matched_len if isinstance(found, PrefixFound) else 0
        if best_shared - matched < self._share_threshold:
            return None
        return best_sequence

    def _release_parked(self, sequence_id: int) -> None:
        parked = self._parked.pop(sequence_id, None)
        if parked:
            self._num_shared_prefills += len(parked)
            # Ahead of later arrivals: they were admitted-in-waiting already.
            self._waiting.extendleft(reversed(parked))
            self._work.set()

    def _cancelled_while_admitting(self, request: SubmitRequest) -> bool:
        """A cancel that arrived while this request's lookup was awaited (it was in no queue)."""
        if request.request_id not in self._cancelled_before_submit:
            return False
        del self._cancelled_before_submit[request.request_id]
        request.events.close()
        self._num_cancelled += 1
        return True

    async def _admit(self, request: SubmitRequest) -> AdmitSequence | None:
        prompt = request.prompt_tokens
        matched, payload, snapshot = 0, None, None
        found: PrefixFound | PrefixMissing = PrefixMissing()
        context = request.cache_context
        if context is not None and self._to_cache_store is not None and len(prompt) > 1:
            if self._snapshots:
                restored = await self._lookup_snapshot(context, prompt)
                if isinstance(restored, SnapshotFound):
                    matched, snapshot = restored.num_tokens, restored.payload
                if self._trace:
                    self._trace_snapshot(request, restored)
            else:
                found = await self._lookup(context, prompt)
            if self._cancelled_while_admitting(request):
                return None
        sequence_id = self._next_sequence_id
        self._next_sequence_id += 1
        if isinstance(found, PrefixFound):
            if found.payload.can_adopt(found.matched_len):
                matched, payload = found.matched_len, found.payload
                logger.debug(
                    "prompt-cache hit: adopted %d/%d tokens  seq_id=%d",
                    matched, len(prompt), sequence_id,
                )
            else:
                logger.debug(
                    "prompt-cache adopt failed (payload cannot seed %d tokens); "
                    "falling back to cold prefill", found.matched_len,
                )
        snapshot_after = None
        boundary = request.history_boundary
        if self._snapshots and self._boundary_snapshots and boundary is not None and matched < boundary < len(prompt):
            snapshot_after = boundary - matched
        running = _Running(
            request=request,
            sequence_id=sequence_id,
            cached_tokens=matched,
            detokenizer=self._tokenizer.detokenizer,
            submitted_at=trio.current_time(),
        )
        self._running[sequence_id] = running
        self._sequence_of[request.request_id] = sequence_id
        return AdmitSequence(
            sequence_id=sequence_id,
            prompt_tokens=prompt[matched:],
            cached_tokens=prompt[:matched],
            adopted=payload,
            sampling=request.sampling,
            max_tokens=request.max_tokens,
            donate_on_finish=request.cache_context is not None and self._to_cache_store is not None,
            donate_prompt=self._prompt_donation and request.cache_context is not None,
            restore=snapshot,
            snapshot_after=snapshot_after,
        )

    def _trace_snapshot(self, request: SubmitRequest, result: SnapshotFound | SnapshotMissing) -> None:
        session = request.cache_context.session_key if request.cache_context else "-"
        if isinstance(result, SnapshotFound):
            logger.info("apc-trace: request %s session=%s restores its %d-token snapshot (prompt %d)",
                        request.request_id, session, result.num_tokens, len(request.prompt_tokens))
        elif result.refusal is not None:
            logger.info("apc-trace: request %s session=%s refused the stored snapshot: %s",
                        request.request_id, session, result.refusal)
        else:
            logger.info("apc-trace: request %s session=%s has no snapshot", request.request_id, session)

    async def _lookup(
        self, context: CacheContext, prompt: tuple[int, ...], *, record: bool = True
    ) -> PrefixFound | PrefixMissing:
        assert self._to_cache_store is not None
        reply_to, replies = trio.open_memory_channel[PrefixFound | PrefixMissing](1)
        await self._to_cache_store.send(LookupPrefix(
            context=context, tokens=prompt, max_len=len(prompt) - 1, record=record, reply_to=reply_to
        ))
        with replies:
            try:
                return await replies.receive()
            except trio.EndOfChannel:
                return PrefixMissing()

    def _apply(self, done: StepDone) -> None:
        self._num_steps += 1
        if done.decode_batch_size:
            self._decode_batch_sizes[done.decode_batch_size] += 1
            if done.prefilling:
                self._num_interleaved_steps += 1
        for token in done.sampled:
            running = self._running.get(token.sequence_id)
            if running is not None and not running.finished:
                self._on_token(running, token)
        for item in done.detached:
            if item.snapshot:
                self._donate_snapshot(item)
                continue
            if item.final:
                context, prompt_len = self._pending_donations.pop(item.sequence_id, (None, None))
            else:
                running = self._running.get(item.sequence_id)
                context = None if running is None else running.request.cache_context
                prompt_len = len(item.tokens)
            if context is not None and self._to_cache_store is not None:
                self._send_nowait(self._to_cache_store, DonateSequence(
                    context=context, tokens=item.tokens, payload=item.payload, nbytes=item.nbytes,
                    prompt_len=prompt_len,
                ))
        for sequence_id in done.warmed:
            if self._warming.pop(sequence_id, None) is not None:
                self._num_warm_completed += 1
        for sequence_id, reason in done.restore_failures:
            running = self._running.get(sequence_id)
            if running is not None:
                running.cached_tokens = 0
            logger.debug("snapshot restore failed (%s); the request prefilled cold", reason)
            if self._to_cache_store is not None:
                self._send_nowait(self._to_cache_store, SnapshotRestoreFailed(reason=reason))
        for sequence_id in done.prompts_done:
            running = self._running.get(sequence_id)
            if running is not None:
                running.prompt_done = True
            # After the donation above: the parked requests' lookups will find it.
            self._release_parked(sequence_id)
        if done.error is not None:
            if done.out_of_memory and self._to_cache_store is not None:
                # Queued before any later lookup, so the store sheds before the next admission.
                self._send_nowait(self._to_cache_store, ShedCache())
            for sequence_id in done.failed_sequences:
                self._warming.pop(sequence_id, None)
                running = self._running.get(sequence_id)
                if running is None or running.finished:
                    continue
                self._num_failed += 1
                error: InvalidRequest = InvalidRequest(
                    f"the model failed while generating: {done.error}",
                    status=500, error_type="server_error", code="generation_failed",
                )
                if done.out_of_memory:
                    error = ServerBusy("the device ran out of memory for this request; retry shortly")
                # The device already dropped the sequence; a client that is gone misses nothing.
                self._send_event_to(running.request.events, RequestFailed(error=error))
                self._forget(running)

    def _donate_snapshot(self, item: Any) -> None:
        warm = self._warming.get(item.sequence_id)
        running = self._running.get(item.sequence_id)
        context = warm.context if warm is not None else (
            running.request.cache_context if running is not None else None
        )
        if context is not None and self._to_cache_store is not None:
            self._send_nowait(self._to_cache_store, DonateSnapshot(
                context=context, tokens=item.tokens, payload=item.payload, nbytes=item.nbytes,
            ))

    def _on_token(self, running: _Running, token: SampledToken) -> None:
        if running.first_token_at is None:
            running.first_token_at = trio.current_time()
        is_eos = token.finish_reason == "stop" and token.token in self._eos_token_ids
        # As OpenAI does, the end-of-sequence token is neither counted nor given a logprob.
        if not is_eos:
            running.completion_tokens += 1
            running.detokenizer.add_token(token.token)
            running.pending_ids.append(token.token)
        if token.finish_reason is not None:
            running.detokenizer.finalize()
        matcher = StopMatcher(running.request.sampling.stop)
        emit, running.held_text, hit_stop = matcher.feed(running.held_text, running.detokenizer.last_segment)
        if token.finish_reason is not None and not hit_stop:
            # The device finished and dropped the sequence; flush what was held.
            emit, running.held_text = emit + running.held_text, ""
        logprobs = () if is_eos else self._logprobs(running, token)
        if emit or logprobs:
            if self._snapshots:
                running.reply_parts.append(emit)
            token_ids, running.pending_ids = tuple(running.pending_ids), []
            self._send_event(running, Delta(text=emit, logprobs=logprobs, token_ids=token_ids))
            if running.finished:
                return  # the client went away: cancelled, not completed
        if hit_stop:
            # The ids still pending spell the stop string, which is not part of the reply.
            running.pending_ids = []
            self._finish_running(running, donate=True, reason="stop", stop_string=matcher.matched)
        elif token.finish_reason is not None:
            self._finish_running(running, donate=True, reason=token.finish_reason, on_device=False)

    def _logprobs(self, running: _Running, token: SampledToken) -> tuple[TokenLogprob, ...]:
        if not running.request.sampling.logprobs:
            return ()
        decode = self._tokenizer.decode
        return (
            TokenLogprob(
                token=decode([token.token]),
                logprob=token.logprob,
                top=tuple((decode([tid]), value) for tid, value in token.top_logprobs),
                token_id=token.token,
                top_ids=tuple(tid for tid, _ in token.top_logprobs),
            ),
        )

    def _finish_running(
        self, running: _Running, *, donate: bool, reason: str | None, on_device: bool = True,
        stop_string: str | None = None,
    ) -> None:
        """End a request. ``reason`` None means cancelled: no final event, no donation.

        A reply counts as a healthy completion only if its final event reaches
        the client; one whose client has gone is cancelled instead.
        """
        running.finished = True
        context = running.request.cache_context
        now = trio.current_time()
        first_token_at = now if running.first_token_at is None else running.first_token_at
        usage = Usage(
            prompt_tokens=len(running.request.prompt_tokens),
            completion_tokens=running.completion_tokens,
            cached_tokens=running.cached_tokens,
            prompt_seconds=first_token_at - running.submitted_at,
            decode_seconds=now - first_token_at,
        )
        final = Delta(finish_reason=reason, usage=usage, token_ids=tuple(running.pending_ids), stop_string=stop_string)
        healthy = reason is not None and self._send_event_to(running.request.events, final)
        if reason is not None and not healthy:
            self._num_cancelled += 1
        donate = donate and healthy and context is not None
        if on_device:
            self._removals.append(RemoveSequence(sequence_id=running.sequence_id, donate=donate))
            self._work.set()
        if donate:
            self._pending_donations[running.sequence_id] = (context, len(running.request.prompt_tokens))
        if healthy:
            self._num_completed += 1
            if self._to_metrics is not None:
                self._send_nowait(self._to_metrics, RequestFinished(
                    finish_reason=reason,
                    prompt_tokens=usage.prompt_tokens,
                    cached_tokens=usage.cached_tokens,
                    completion_tokens=usage.completion_tokens,
                    seconds_to_first_token=(
                        None if running.first_token_at is None
                        else running.first_token_at - running.submitted_at
                    ),
                ))
            if self._to_warmer is not None and context is not None:
                self._send_nowait(self._to_warmer, ReplyFinished(
                    context=context,
                    chat=running.request.chat,
                    reply_text="".join(running.reply_parts),
                    prompt_tokens=usage.prompt_tokens,
                    completion_tokens=usage.completion_tokens,
                ))
        self._forget(running)

    def _forget(self, running: _Running) -> None:
        running.finished = True
        self._release_parked(running.sequence_id)
        running.request.events.close()
        self._running.pop(running.sequence_id, None)
        self._sequence_of.pop(running.request.request_id, None)

    def _send_event(self, running: _Running, event: StreamEvent) -> None:
        if not self._send_event_to(running.request.events, event) and not running.finished:
            # The client is gone or too slow: free its sequence.
            self._num_cancelled += 1
            self._finish_running(running, donate=False, reason=None)

    @staticmethod
    def _send_event_to(events: trio.MemorySendChannel[StreamEvent], event: StreamEvent) -> bool:
        try:
            events.send_nowait(event)
            return True
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
            return False

    @staticmethod
    def _send_nowait(channel: trio.MemorySendChannel[Any], message: Any) -> None:
        try:
            channel.send_nowait(message)
        except trio.WouldBlock:
            logger.warning("dropped %s: the receiving actor is behind", type(message).__name__)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
