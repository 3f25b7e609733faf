"""The router actor: from a validated API request to token ids and a cache context.

It renders the chat template and tokenizes (``mlxcel.model.prompt``'s
``PromptRenderer``, in worker threads: tokenizers are pure CPU work that
releases the GIL, and the model's MLX state is not touched), checks the
context size, resolves the cache context, and submits the request to the
scheduler. Up to ``MAX_CONCURRENT_ROUTES`` requests are
rendered and tokenized at once, so one huge prompt does not hold up the rest.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, assert_never

import attrs
import trio

from mlxcel.actors.messages import (
    AdapterScales,
    RenderPrompt,
    RequestFailed,
    RouteRequest,
    RouterMsg,
    RouterStats,
    SubmitRequest,
)
from mlxcel.cache.key import CacheContext, rope_regime_for
from mlxcel.core.output import ReplyFormat
from mlxcel.core.scheduler import NewRequest
from mlxcel.errors import ContextExceeded, InternalError, InvalidRequest, MlxcelError, ServerBusy
from mlxcel.model.adapters import adapter_cache_id
from mlxcel.model.grammar_check import GrammarChecker
from mlxcel.model.info import ModelInfo

# mlxcel/http/llamacpp.py reads FALLBACK_CHARS_PER_TOKEN from here.
from mlxcel.model.prompt import (
    FALLBACK_CHARS_PER_TOKEN as FALLBACK_CHARS_PER_TOKEN,
    PromptRenderer,
    RenderedPrompt,
    prompt_chars,
)
from mlxcel.types import ChatRequest, CompletionRequest
from mlxcel.vision.images import fetch_remote, is_remote

logger = logging.getLogger(__name__)

# Requests rendered and tokenized at the same time (each in its own worker thread).
MAX_CONCURRENT_ROUTES = 4
# Requests fetching remote images at the same time (their own threads, not the render slots').
MAX_CONCURRENT_FETCHES = 8
# A prompt whose text (messages and tools) is longer than this renders in the large lane: one at a
# time, at most MAX_LARGE_WAITING waiting. Four 9 MB prompts (under a 131k context's bound) held every
# slot, and a normal request, for 114 s.
LARGE_PROMPT_CHARS = 256 << 10
MAX_LARGE_ROUTES = 1
MAX_LARGE_WAITING = 16


class RouterActor:
    def __init__(
        self,
        *,
        model: ModelInfo,
        renderer: PromptRenderer,
        cache_enabled: bool,
        inbox: trio.MemoryReceiveChannel[RouterMsg],
        to_scheduler: trio.MemorySendChannel[Any],
        max_concurrent: int = MAX_CONCURRENT_ROUTES,
        grammar_checker: GrammarChecker | None = None,
    ) -> None:
        self._model = model
        self._renderer = renderer
        self._cache_enabled = cache_enabled
        self.inbox = inbox
        self._to_scheduler = to_scheduler
        self._num_routed = 0
        self._num_rejected = 0
        self._num_in_flight = 0
        # Taken before a request leaves the inbox, so waiting requests stay there (a full inbox is a 503).
        self._slots = trio.Semaphore(max_concurrent)
        # Requests whose remote images are being fetched (each fetch within --image-fetch-timeout).
        self._fetch_limiter = trio.CapacityLimiter(MAX_CONCURRENT_FETCHES)
        # Prompts past LARGE_PROMPT_CHARS: rendered one at a time, a few waiting (more are a 503).
        self._large_slots = trio.Semaphore(MAX_LARGE_ROUTES)
        self._num_large_waiting = 0
        self._grammars = grammar_checker or GrammarChecker(model.tokenizer, model.eos_token_ids)
        # The server-wide LoRA scales (GET/POST /lora-adapters), one per loaded adapter.
        self._adapter_scales: tuple[float, ...] = tuple(adapter.scale for adapter in model.adapters)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with self._to_scheduler:
            # Routes still in flight when the inbox closes finish before the scheduler channel does.
            async with trio.open_nursery() as nursery:
                with self.inbox:
                    task_status.started()
                    while True:
                        await self._slots.acquire()
                        try:
                            message = await self.inbox.receive()
                        except trio.EndOfChannel:
                            break
                        self._dispatch(nursery, message)
                        self._dispatch_queued(nursery)

    def _dispatch(self, nursery: trio.Nursery, message: RouterMsg) -> None:
        """Start a received message; it holds a render slot, taken before it was received."""
        self._num_in_flight += 1
        if isinstance(message, RouteRequest | RenderPrompt) and (
                not isinstance(message, RouteRequest) or message.rendered is None) and (
                prompt_chars(message.request) > LARGE_PROMPT_CHARS):
            # Huge prompts render in a lane of their own, so they never take every slot.
            self._slots.release()
            self._start_large(nursery, message)
        else:
            nursery.start_soon(self._handle, message, self._slots)

    def _dispatch_queued(self, nursery: trio.Nursery) -> None:
        """Start the messages already queued, as far as slots allow, without a checkpoint each.

        Each await of the loop above yields to every other runnable task: with 64 requests arriving at
        once, one message a turn left them waiting a median 30-40 ms in the inbox (decode_speed.py's wave).
        """
        while True:
            try:
                self._slots.acquire_nowait()
            except trio.WouldBlock:
                return
            try:
                message = self.inbox.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                self._slots.release()  # the loop's next receive waits, or ends at the channel's end
                return
            self._dispatch(nursery, message)

    def _start_large(self, nursery: trio.Nursery, message: RouteRequest | RenderPrompt) -> None:
        if self._num_large_waiting >= MAX_LARGE_WAITING:
            self._num_in_flight -= 1
            busy = ServerBusy("too many very large prompts are waiting to be rendered; retry shortly")
            if isinstance(message, RouteRequest):
                self._reject(message, busy)
            else:
                _answer(message.reply_to, busy)
            return
        self._num_large_waiting += 1
        nursery.start_soon(self._handle_large, message)

    async def _handle_large(self, message: RouteRequest | RenderPrompt) -> None:
        try:
            await self._large_slots.acquire()
        finally:
            self._num_large_waiting -= 1
        await self._handle(message, self._large_slots)

    def statistics(self) -> RouterStats:
        return RouterStats(num_routed=self._num_routed, num_rejected=self._num_rejected)

    async def _handle(self, message: RouterMsg, slot: trio.Semaphore) -> None:
        match message:
            case RouteRequest():
                await self._route(message, slot)
            case RenderPrompt():
                await self._render(message, slot)
            case AdapterScales():
                self._adapter_scales_message(message, slot)
            case _:
                assert_never(message)

    def _adapter_scales_message(self, message: AdapterScales, slot: trio.Semaphore) -> None:
        try:
            if message.scales is not None:
                self._adapter_scales = self._scales_of(message.scales, "body")
            answer: list[dict[str, Any]] | InvalidRequest = [
                {"id": adapter.id, "path": str(adapter.path), "scale": scale}
                for adapter, scale in zip(self._model.adapters, self._adapter_scales, strict=True)
            ]
        except InvalidRequest as error:
            answer = error
        finally:
            self._slot_done(slot)
        _answer(message.reply_to, answer)

    def _scales_of(self, pairs: tuple[tuple[int, float], ...], param: str) -> tuple[float, ...]:
        """Per-adapter scales from (id, scale) pairs: an adapter not named is at 0."""
        adapters = self._model.adapters
        scales = [0.0] * len(adapters)
        for index, (adapter_id, scale) in enumerate(pairs):
            if adapter_id >= len(adapters):
                loaded = f"ids 0 to {len(adapters) - 1}" if adapters else "none is loaded (--lora)"
                raise InvalidRequest(f"no LoRA adapter has id {adapter_id}; {loaded}",
                                     param=f"{param}[{index}].id", code="invalid_value")
            scales[adapter_id] = scale
        return tuple(scales)

    def _request_scales(self, request: ChatRequest | CompletionRequest) -> tuple[float, ...]:
        return self._adapter_scales if request.lora is None else self._scales_of(request.lora, "lora")

    async def _render(self, message: RenderPrompt, slot: trio.Semaphore) -> None:
        try:
            request = await self._with_remote_images(message.request, slot)
            rendered = await trio.to_thread.run_sync(self._renderer.render, request)
            answer: tuple[int, ...] | MlxcelError = rendered.tokens
        except InvalidRequest as error:
            answer = error
        except Exception:  # noqa: BLE001 - one request's failure must not end the router (and the server)
            answer = _preparation_failed()
        finally:
            self._slot_done(slot)
        _answer(message.reply_to, answer)

    async def _route(self, message: RouteRequest, slot: trio.Semaphore) -> None:
        holds_slot = True
        try:
            if message.rendered is not None:
                request, rendered = message.request, message.rendered
            else:
                request = await self._with_remote_images(message.request, slot)
                rendered = await trio.to_thread.run_sync(self._renderer.render, request)
            # A grammar compiles without a render slot, so it never holds a plain request up.
            self._slot_done(slot)
            holds_slot = False
            await self._check_grammar(request, rendered)
            submit = self._submission(attrs.evolve(message, request=request), rendered)
            self._to_scheduler.send_nowait(submit)
            self._num_routed += 1
        except trio.WouldBlock:
            self._reject(message, ServerBusy("the scheduler queue is full; retry shortly"))
        except InvalidRequest as error:
            self._reject(message, error)
        except Exception:  # noqa: BLE001 - one request's failure must not end the router (and the server)
            self._reject(message, _preparation_failed())
        finally:
            if holds_slot:
                self._slot_done(slot)

    async def _with_remote_images(self, request: ChatRequest | CompletionRequest,
                                  slot: trio.Semaphore) -> ChatRequest | CompletionRequest:
        """The request with its http(s) images fetched, its render slot given back meanwhile.

        Fetches run in threads of their own (at most ``MAX_CONCURRENT_FETCHES``
        at once), so slow image servers hold up neither the render slots nor
        the worker threads text requests need.
        """
        if not isinstance(request, ChatRequest) or not any(
                source.data is None and is_remote(source) for source in request.images):
            return request
        slot.release()
        try:
            images = await trio.to_thread.run_sync(fetch_remote, request.images, limiter=self._fetch_limiter)
        finally:
            with trio.CancelScope(shield=True):
                await slot.acquire()
        return attrs.evolve(request, images=images)

    async def _check_grammar(self, request: ChatRequest | CompletionRequest, rendered: RenderedPrompt) -> None:
        """A 400 naming the field whose grammar cannot be enforced (mlxcel.model.grammar_check)."""
        if rendered.tool_grammar is not None:
            await self._grammars.check(rendered.tool_grammar, namespace=self._renderer.memo_namespace(request),
                                       param="tools", what="the tools' parameters cannot be enforced",
                                       code="unsupported_value")
        elif request.sampling.grammar is not None:
            param = request.sampling.grammar_param or "response_format"
            what = "grammar cannot be used" if param == "grammar" else f"{param} cannot be enforced"
            await self._grammars.check(request.sampling.grammar, namespace=self._renderer.memo_namespace(request),
                                       param=param, what=what)

    def _slot_done(self, slot: trio.Semaphore) -> None:
        """A routed message is done with its slot (the router admits a bounded number at once)."""
        self._num_in_flight -= 1
        slot.release()

    def _reject(self, message: RouteRequest, error: MlxcelError) -> None:
        self._num_rejected += 1
        with message.events, contextlib.suppress(trio.BrokenResourceError, trio.WouldBlock):
            message.events.send_nowait(RequestFailed(error=error))

    def _submission(self, message: RouteRequest, rendered: RenderedPrompt) -> SubmitRequest:
        request = message.request
        context_size = self._model.context_size
        num_prompt = len(rendered.tokens)
        if num_prompt == 0:
            raise InvalidRequest("the prompt is empty after tokenization", param="prompt", code="invalid_value")
        if num_prompt >= context_size:
            raise ContextExceeded(
                f"the prompt is {num_prompt} tokens, but this model's context size is {context_size}",
                param="messages" if isinstance(request, ChatRequest) else "prompt",
                context_size=context_size, num_prompt_tokens=num_prompt,
            )
        room = context_size - num_prompt
        adapter_scales = self._request_scales(request)
        max_tokens = room if request.sampling.max_tokens is None else min(request.sampling.max_tokens, room)
        cache_context = None
        if self._cache_enabled and request.cache.cache_prompt:
            cache_context = CacheContext(
                model_id=self._model.model_id,
                lora_id=adapter_cache_id(self._model.adapters, adapter_scales) if adapter_scales else "",
                template_sig=rendered.template_sig,
                session_key=request.cache.session_key,
                rope_regime=rope_regime_for(num_prompt, self._model.family.longrope_original_max_positions),
                mm_digest=rendered.mm_digest,
                cache_salt=request.cache.cache_salt,
            )
        sampling = request.sampling
        budget = sampling.reasoning_budget
        if budget is not None:
            # The model's thinking markers; a model that marks none has nothing to close, and the
            # budget (an effort accepted there) changes nothing.
            fmt = ReplyFormat.of(self._model.tokenizer)
            marked = bool(fmt.think_start_tokens and fmt.think_end_tokens)
            sampling = attrs.evolve(sampling, reasoning_budget=attrs.evolve(
                budget, start_tokens=fmt.think_start_tokens, end_tokens=fmt.think_end_tokens) if marked else None)
        if rendered.tool_grammar is not None:
            sampling = attrs.evolve(sampling, grammar=rendered.tool_grammar)
        if adapter_scales:
            sampling = attrs.evolve(sampling, adapter_scales=adapter_scales)
        return SubmitRequest(request=NewRequest(
            request_id=message.request_id,
            prompt_tokens=rendered.tokens,
            sampling=sampling,
            max_tokens=max_tokens,
            cache_context=cache_context,
            history_boundary=rendered.history_boundary if cache_context is not None else None,
            shared_prefix=rendered.shared_prefix if cache_context is not None else None,
            chat=request if isinstance(request, ChatRequest) else None,
            more_pending=self.inbox.statistics().current_buffer_used > 0 or self._num_in_flight > 1,
            retain_seconds=request.cache.retain_seconds if cache_context is not None else 0.0,
            vision=rendered.vision,
            edge_output=message.edge_output,
        ), events=message.events)


def _preparation_failed() -> InternalError:
    """What a request gets when preparing it raised something unforeseen: a 500, logged with its traceback."""
    logger.exception("preparing a request failed")
    return InternalError("the server failed while preparing this request", code="preparation_failed")


def _answer(reply_to: trio.MemorySendChannel[Any], answer: Any) -> None:
    with reply_to, contextlib.suppress(trio.BrokenResourceError, trio.WouldBlock):  # the asker went away
        reply_to.send_nowait(answer)
