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
)
from mlxcel.config import SchedulerConfig
from mlxcel.types import Delta, InvalidRequest, ServerBusy, TokenLogprob, Usage

logger = logging.getLogger(__name__)

SchedulerMsg = SubmitRequest | CancelRequest | GetSchedulerStats


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
    finished: bool = False


class StopMatcher:
    """Finds stop strings in streamed text without ever emitting part of one."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self._stop = stop

    def feed(self, held: str, new_text: str) -> tuple[str, str, bool]:
        """Returns (text safe to emit, text to keep holding, whether a stop string ended it)."""
        text = held + new_text
        if not self._stop:
            return text, "", False
        cut = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
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
    ) -> None:
        self._config = config
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
        # Contexts of finished sequences whose KV is still on its way back.
        self._pending_donations: dict[int, CacheContext] = {}
        self._cancelled_before_submit: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._next_sequence_id = 0
        self._work = trio.Event()
        self._num_steps = 0
        self._num_completed = 0
        self._num_cancelled = 0
        self._num_failed = 0
        self._num_interleaved_steps = 0
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
            running_request_ids=tuple(r.request.request_id for r in self._running.values()),
        )

    # --- inbox ---------------------------------------------------------------

    def _handle(self, message: SchedulerMsg) -> None:
        match message:
            case SubmitRequest():
                self._submit(message)
            case CancelRequest():
                self._cancel(message.request_id)
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
        if len(self._waiting) >= self._config.max_queued_requests:
            self._send_event_to(
                request.events,
                RequestFailed(error=ServerBusy(
                    f"the server is at capacity ({len(self._waiting)} requests waiting); retry shortly"
                )),
            )
            request.events.close()
            return
        self._waiting.append(request)
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
        # The cancel overtook its submission (still in the router).
        self._cancelled_before_submit[request_id] = None
        while len(self._cancelled_before_submit) > 1024:
            self._cancelled_before_submit.popitem(last=False)

    # --- step loop -----------------------------------------------------------

    async def _step_loop(self) -> None:
        while True:
            if not (self._waiting or self._running or self._removals):
                self._work = trio.Event()
                await self._work.wait()
            step = await self._build_step()
            reply_to, replies = trio.open_memory_channel[StepDone](1)
            await self._to_device.send(
                RunStep(admit=step[0], remove=step[1], reply_to=reply_to)
            )
            with replies:
                done = await replies.receive()
            self._apply(done)

    async def _build_step(self) -> tuple[tuple[AdmitSequence, ...], tuple[RemoveSequence, ...]]:
        removals = tuple(self._removals)
        self._removals.clear()
        admissions = []
        free_slots = self._config.max_batch_size - len(self._running)
        while self._waiting and free_slots > 0:
            request = self._waiting.popleft()
            admissions.append(await self._admit(request))
            free_slots -= 1
        return tuple(admissions), removals

    async def _admit(self, request: SubmitRequest) -> AdmitSequence:
        sequence_id = self._next_sequence_id
        self._next_sequence_id += 1
        prompt = request.prompt_tokens
        matched, payload = 0, None
        if request.cache_context is not None and self._to_cache_store is not None and len(prompt) > 1:
            found = await self._lookup(request.cache_context, prompt)
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
            donate_on_finish=request.cache_context is not None,
        )

    async def _lookup(self, context: CacheContext, prompt: tuple[int, ...]) -> PrefixFound | PrefixMissing:
        assert self._to_cache_store is not None
        reply_to, replies = trio.open_memory_channel[PrefixFound | PrefixMissing](1)
        await self._to_cache_store.send(
            LookupPrefix(context=context, tokens=prompt, max_len=len(prompt) - 1, reply_to=reply_to)
        )
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
            context = self._pending_donations.pop(item.sequence_id, None)
            if context is not None and self._to_cache_store is not None:
                self._send_nowait(
                    self._to_cache_store,
                    DonateSequence(context=context, tokens=item.tokens, payload=item.payload, nbytes=item.nbytes),
                )
        if done.error is not None:
            for sequence_id in done.failed_sequences:
                running = self._running.get(sequence_id)
                if running is None or running.finished:
                    continue
                self._num_failed += 1
                self._send_event(running, RequestFailed(error=InvalidRequest(
                    f"the model failed while generating: {done.error}",
                    status=500, error_type="server_error", code="generation_failed",
                )))
                # The device already dropped the sequence.
                self._forget(running)

    def _on_token(self, running: _Running, token: SampledToken) -> None:
        if running.first_token_at is None:
            running.first_token_at = trio.current_time()
        running.completion_tokens += 1
        is_eos = token.finish_reason == "stop" and token.token in self._eos_token_ids
        new_text = ""
        if not is_eos:
            running.detokenizer.add_token(token.token)
        if token.finish_reason is not None:
            running.detokenizer.finalize()
        new_text = running.detokenizer.last_segment
        matcher = StopMatcher(running.request.sampling.stop)
        emit, running.held_text, hit_stop = matcher.feed(running.held_text, new_text)
        logprobs = self._logprobs(running, token)
        if hit_stop:
            self._send_event(running, Delta(text=emit, logprobs=logprobs))
            self._finish_running(running, donate=True, reason="stop")
            return
        if token.finish_reason is not None:
            # The device finished and dropped the sequence; flush what was held.
            self._send_event(running, Delta(text=emit + running.held_text, logprobs=logprobs))
            running.held_text = ""
            self._finish_running(running, donate=True, reason=token.finish_reason, on_device=False)
            return
        if emit or logprobs:
            self._send_event(running, Delta(text=emit, logprobs=logprobs))

    def _logprobs(self, running: _Running, token: SampledToken) -> tuple[TokenLogprob, ...]:
        if not running.request.sampling.logprobs:
            return ()
        decode = self._tokenizer.decode
        return (
            TokenLogprob(
                token=decode([token.token]),
                logprob=token.logprob,
                top=tuple((decode([tid]), value) for tid, value in token.top_logprobs),
            ),
        )

    def _finish_running(self, running: _Running, *, donate: bool, reason: str | None, on_device: bool = True) -> None:
        """End a request. ``reason`` None means cancelled: no final event, no donation."""
        running.finished = True
        context = running.request.cache_context
        healthy = reason is not None
        if on_device:
            self._removals.append(RemoveSequence(sequence_id=running.sequence_id, donate=donate and healthy and context is not None))
            self._work.set()
        if healthy and context is not None and donate:
            self._pending_donations[running.sequence_id] = context
        if healthy:
            usage = Usage(
                prompt_tokens=len(running.request.prompt_tokens),
                completion_tokens=running.completion_tokens,
                cached_tokens=running.cached_tokens,
            )
            self._send_event(running, Delta(finish_reason=reason, usage=usage))
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
                    session_key=context.session_key,
                    prompt_tokens=usage.prompt_tokens,
                    completion_tokens=usage.completion_tokens,
                ))
        self._forget(running)

    def _forget(self, running: _Running) -> None:
        running.finished = True
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
