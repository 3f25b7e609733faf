"""The router actor alone, with the llama fixture's real tokenizer and a hand-built scheduler channel."""

from __future__ import annotations

import functools
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from mlxcel.actors.device import ModelInfo
from mlxcel.actors.messages import (
    RequestFailed,
    RouteRequest,
    RouterStats,
    StreamEvent,
    SubmitRequest,
)
from mlxcel.actors.router import RouterActor
from mlxcel.cache.key import ANONYMOUS_SESSION, RopeRegime, template_signature
from mlxcel.core.scheduler import NewRequest
from mlxcel.fixtures import fixture_path
from mlxcel.model.family import detect_family
from mlxcel.model.loader import load_model, read_model_config
from mlxcel.model.prompt import RAW_PROMPT_TEMPLATE, PromptRenderer
from mlxcel.types import (
    CacheOptions,
    ChatRequest,
    CompletionRequest,
    SamplingParams,
    ServerBusy,
)
from tests.support import wait_until

pytestmark = pytest.mark.slow

MESSAGES = ({"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"})
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather now", "parameters": {"type": "object"}},
}


@functools.cache
def llama_info() -> ModelInfo:
    """The llama fixture, loaded once per test session (a few seconds)."""
    loaded = load_model(fixture_path("llama"))
    return ModelInfo(
        model_id=loaded.model_id,
        path=loaded.path,
        config=loaded.config,
        family=loaded.family,
        tokenizer=loaded.tokenizer,
        chat_template=loaded.chat_template,
        eos_token_ids=loaded.eos_token_ids,
        context_size=loaded.family.context_size or 4096,
    )


@functools.cache
def phi3_longrope_info() -> ModelInfo:
    """The phi3-longrope fixture's family and config; the fixtures share one tokenizer and template."""
    path = fixture_path("phi3-longrope")
    config = read_model_config(path)
    return attrs.evolve(llama_info(), model_id=path.name, path=path, config=config, family=detect_family(config))


@attrs.define
class RouterHarness:
    actor: RouterActor
    inbox: trio.MemorySendChannel[RouteRequest]
    scheduler: trio.MemoryReceiveChannel[Any]
    num_sent: int = 0

    def num_answered(self) -> int:
        stats = self.actor.statistics()
        return stats.num_routed + stats.num_rejected

    async def send(self, message: RouteRequest) -> None:
        """Sends one request and waits until the router has routed or rejected it."""
        self.num_sent += 1
        await self.inbox.send(message)
        # Rendering runs in a worker thread, which wait_all_tasks_blocked cannot see.
        await wait_until(lambda: self.num_answered() >= self.num_sent, seconds=10, interval=0.002)
        await trio.testing.wait_all_tasks_blocked()

    async def route(
        self, request: ChatRequest | CompletionRequest, request_id: str = "req-1"
    ) -> tuple[Any, trio.MemoryReceiveChannel[StreamEvent]]:
        """The routed request that reached the scheduler (None if nothing did), and the request's events."""
        events_send, events = trio.open_memory_channel[StreamEvent](4)
        await self.send(RouteRequest(request=request, request_id=request_id, events=events_send))
        try:
            submit = self.scheduler.receive_nowait()
        except trio.WouldBlock:
            return None, events
        assert isinstance(submit, SubmitRequest)
        assert submit.events is events_send
        return submit.request, events


async def start_router(
    nursery: trio.Nursery,
    model: ModelInfo | None = None,
    *,
    cache_enabled: bool = True,
    scheduler_capacity: int = 8,
    template_kwargs: dict[str, Any] | None = None,
    renderer: Any = None,
    allow_request_template: bool = False,
) -> RouterHarness:
    model = model or llama_info()
    inbox_send, inbox = trio.open_memory_channel[RouteRequest](8)
    to_scheduler, scheduler = trio.open_memory_channel[Any](scheduler_capacity)
    actor = RouterActor(
        model=model,
        renderer=renderer or PromptRenderer(
            model, default_template_kwargs=template_kwargs or {}, cache_enabled=cache_enabled,
            allow_request_template=allow_request_template,
        ),
        cache_enabled=cache_enabled,
        inbox=inbox,
        to_scheduler=to_scheduler,
    )
    await nursery.start(actor.run)
    return RouterHarness(actor=actor, inbox=inbox_send, scheduler=scheduler)


def chat(**changes: Any) -> ChatRequest:
    return ChatRequest(messages=MESSAGES, **changes)


def failure_of(events: trio.MemoryReceiveChannel[StreamEvent]) -> RequestFailed:
    failed = events.receive_nowait()
    assert isinstance(failed, RequestFailed)
    with pytest.raises(trio.EndOfChannel):
        events.receive_nowait()  # the router closed the stream
    return failed


async def test_chat_request_is_rendered_tokenized_and_submitted(nursery: trio.Nursery) -> None:
    model = llama_info()
    harness = await start_router(nursery)
    request = chat(
        sampling=SamplingParams(temperature=0.0, max_tokens=7, stop=("\n",)),
        cache=CacheOptions(session_key="alice", cache_salt="tenant-a"),
    )
    submit, events = await harness.route(request, "req-42")
    assert isinstance(submit, NewRequest)

    expected_text = (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHello there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert submit.prompt_tokens == tuple(model.tokenizer.encode(expected_text, add_special_tokens=False))
    assert submit.prompt_tokens[0] == 151644  # <|im_start|> is one special token
    assert submit.request_id == "req-42"
    assert submit.sampling == request.sampling
    assert submit.max_tokens == 7
    context = submit.cache_context
    assert context is not None
    assert context.model_id == model.model_id
    assert context.session_key == "alice"
    assert context.cache_salt == "tenant-a"
    assert context.rope_regime is None  # llama's rotation does not depend on the length
    assert context.template_sig == template_signature(model.chat_template, {}, "none", None)
    assert harness.actor.statistics() == RouterStats(num_routed=1, num_rejected=0)
    # The router hands the stream to the scheduler; it sends nothing itself.
    with pytest.raises(trio.WouldBlock):
        events.receive_nowait()


async def test_template_signature_tracks_what_shapes_the_rendering(nursery: trio.Nursery) -> None:
    harness = await start_router(nursery)

    async def signature(request: ChatRequest) -> str:
        submit, _ = await harness.route(request)
        assert submit is not None
        assert submit.cache_context is not None
        return submit.cache_context.template_sig

    plain = await signature(chat())
    other_messages = await signature(ChatRequest(messages=({"role": "user", "content": "Something else"},)))
    with_kwargs = await signature(chat(chat_template_kwargs={"enable_thinking": False}))
    with_tools = await signature(chat(tools=(TOOL,)))
    # tool_choice "none" renders no tools: the prompt, and so its signature, are the plain one's.
    with_tools_off = await signature(chat(tools=(TOOL,), tool_choice="none"))
    assert plain == other_messages  # the conversation is not part of the signature
    assert len({plain, with_kwargs, with_tools}) == 3
    assert with_tools_off == plain


async def test_default_template_kwargs_are_in_the_signature(nursery: trio.Nursery) -> None:
    plain = await start_router(nursery)
    configured = await start_router(nursery, template_kwargs={"enable_thinking": False})
    first, _ = await plain.route(chat())
    second, _ = await configured.route(chat())
    assert first.cache_context.template_sig != second.cache_context.template_sig
    # Asking per request for what the server defaults to renders (and signs) the same.
    third, _ = await plain.route(chat(chat_template_kwargs={"enable_thinking": False}))
    assert third.cache_context.template_sig == second.cache_context.template_sig


async def test_anonymous_session_by_default(nursery: trio.Nursery) -> None:
    harness = await start_router(nursery)
    submit, _ = await harness.route(chat())
    assert submit.cache_context.session_key == ANONYMOUS_SESSION


async def test_retention_reaches_the_scheduler_with_the_cache_context(nursery: trio.Nursery) -> None:
    harness = await start_router(nursery)
    submit, _ = await harness.route(chat(cache=CacheOptions(retain_seconds=3600)))
    assert submit.retain_seconds == 3600
    # A request that does not cache has nothing to retain.
    submit, _ = await harness.route(chat(cache=CacheOptions(cache_prompt=False, retain_seconds=3600)))
    assert submit.retain_seconds == 0


async def test_cache_prompt_false_gives_no_cache_context(nursery: trio.Nursery) -> None:
    harness = await start_router(nursery)
    submit, _ = await harness.route(chat(cache=CacheOptions(cache_prompt=False)))
    assert submit is not None
    assert submit.cache_context is None


async def test_disabled_cache_gives_no_cache_context(nursery: trio.Nursery) -> None:
    harness = await start_router(nursery, cache_enabled=False)
    submit, _ = await harness.route(chat())
    assert submit is not None
    assert submit.cache_context is None


async def test_completion_prompt_bypasses_the_template(nursery: trio.Nursery) -> None:
    model = llama_info()
    harness = await start_router(nursery)
    text_submit, _ = await harness.route(CompletionRequest(prompt="Once upon a time"))
    assert text_submit.prompt_tokens == tuple(model.tokenizer.encode("Once upon a time"))
    ids_submit, _ = await harness.route(CompletionRequest(prompt=(5, 6, 7)))
    assert ids_submit.prompt_tokens == (5, 6, 7)
    raw_sig = template_signature(RAW_PROMPT_TEMPLATE, {}, "none", None)
    assert text_submit.cache_context.template_sig == ids_submit.cache_context.template_sig == raw_sig


async def test_max_tokens_defaults_to_the_room_left(nursery: trio.Nursery) -> None:
    model = attrs.evolve(llama_info(), context_size=100)
    harness = await start_router(nursery, model)
    submit, _ = await harness.route(CompletionRequest(prompt=tuple(range(30))))
    assert submit.max_tokens == 70
    submit, _ = await harness.route(CompletionRequest(
        prompt=tuple(range(30)), sampling=SamplingParams(max_tokens=500),
    ))
    assert submit.max_tokens == 70


async def test_prompt_over_the_context_size_is_rejected(nursery: trio.Nursery) -> None:
    model = attrs.evolve(llama_info(), context_size=16)
    harness = await start_router(nursery, model)
    submit, events = await harness.route(chat())
    assert submit is None
    failed = failure_of(events)
    assert failed.error.code == "context_length_exceeded"
    assert failed.error.status == 400
    assert failed.error.param == "messages"
    assert "16" in failed.error.message
    assert harness.actor.statistics() == RouterStats(num_routed=0, num_rejected=1)

    submit, events = await harness.route(CompletionRequest(prompt=tuple(range(16))))
    assert submit is None
    failed = failure_of(events)
    assert (failed.error.code, failed.error.param) == ("context_length_exceeded", "prompt")


async def test_empty_prompt_is_rejected(nursery: trio.Nursery) -> None:
    harness = await start_router(nursery)
    submit, events = await harness.route(CompletionRequest(prompt=""))
    assert submit is None
    assert failure_of(events).error.param == "prompt"


async def test_full_scheduler_channel_answers_server_busy(nursery: trio.Nursery) -> None:
    harness = await start_router(nursery, scheduler_capacity=0)  # nobody receiving: full
    submit, events = await harness.route(chat())
    assert submit is None
    failed = failure_of(events)
    assert isinstance(failed.error, ServerBusy)
    assert failed.error.status == 503


async def test_client_gone_before_rejection_does_not_break_the_router(nursery: trio.Nursery) -> None:
    model = attrs.evolve(llama_info(), context_size=16)
    harness = await start_router(nursery, model)
    events_send, events = trio.open_memory_channel[StreamEvent](1)
    events.close()
    await harness.send(RouteRequest(request=chat(), request_id="gone", events=events_send))
    submit, _ = await harness.route(CompletionRequest(prompt=(1, 2)))
    assert submit is not None
    assert submit.prompt_tokens == (1, 2)


@pytest.mark.parametrize(("prompt_len", "regime"), [
    (100, RopeRegime.SHORT),
    (511, RopeRegime.SHORT),
    (512, RopeRegime.SHORT),  # short_factor up to original_max_position_embeddings
    (513, RopeRegime.LONG),
    (1000, RopeRegime.LONG),
])
async def test_longrope_regime_follows_the_prompt_length(
    nursery: trio.Nursery, prompt_len: int, regime: RopeRegime
) -> None:
    model = phi3_longrope_info()
    assert model.family.longrope_original_max_positions == 512
    harness = await start_router(nursery, model)
    submit, _ = await harness.route(CompletionRequest(prompt=tuple(range(1000, 1000 + prompt_len))))
    assert submit.cache_context.rope_regime is regime


async def test_chat_prompt_regime_uses_the_rendered_length(nursery: trio.Nursery) -> None:
    harness = await start_router(nursery, phi3_longrope_info())
    short, _ = await harness.route(chat())
    long_message = ({"role": "user", "content": " ".join(["word"] * 600)},)
    long, _ = await harness.route(ChatRequest(messages=long_message))
    assert len(short.prompt_tokens) < 512 < len(long.prompt_tokens)
    assert short.cache_context.rope_regime is RopeRegime.SHORT
    assert long.cache_context.rope_regime is RopeRegime.LONG
    assert short.cache_context.template_sig == long.cache_context.template_sig


async def test_unknown_tool_choice_is_rejected_not_fatal() -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            harness = await start_router(nursery)
            submit, events = await harness.route(chat(tools=(TOOL,), tool_choice="sometimes"))
            assert submit is None
            failed = failure_of(events)
            assert (failed.error.status, failed.error.param) == (400, "tool_choice")
            # The router keeps serving.
            submit, _ = await harness.route(chat())
            assert submit is not None
            nursery.cancel_scope.cancel()


def test_preserve_thinking_defaults_on_with_the_cache_and_a_request_can_override() -> None:
    from mlxcel.model.prompt import PromptRenderer

    class Tokenizer:
        def __init__(self) -> None:
            self.seen: list[dict] = []

        def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, tokenize=False, **kwargs):
            self.seen.append(kwargs)
            return "text"

        def encode(self, text, add_special_tokens=False):
            return [1, 2, 3]

        def get_added_vocab(self):
            return {}

    tokenizer = Tokenizer()
    model = attrs.evolve(
        llama_info(), tokenizer=tokenizer,
        chat_template="{% if preserve_thinking %}keep{% endif %}{{ messages }}",
    )
    renderer = PromptRenderer(model, default_template_kwargs={}, cache_enabled=True)
    renderer.render(ChatRequest(messages=({"role": "user", "content": "x"},)))
    assert tokenizer.seen[-1]["preserve_thinking"] is True
    renderer.render(ChatRequest(messages=({"role": "user", "content": "x"},),
                                chat_template_kwargs={"preserve_thinking": False}))
    assert tokenizer.seen[-1]["preserve_thinking"] is False
    PromptRenderer(model, default_template_kwargs={}, cache_enabled=False).render(
        ChatRequest(messages=({"role": "user", "content": "x"},)))
    assert "preserve_thinking" not in tokenizer.seen[-1]


async def test_token_ids_outside_the_vocabulary_are_rejected_naming_the_field(nursery: trio.Nursery) -> None:
    """An id past the embedding table crashed the device (a segfault) or read past the table."""
    harness = await start_router(nursery)
    for prompt, param in (((200000,), "prompt[0]"), ((5, 6, 151_646), "prompt[2]")):
        submit, events = await harness.route(CompletionRequest(prompt=prompt))
        assert submit is None
        failed = failure_of(events)
        assert (failed.error.status, failed.error.param) == (400, param)
        assert "151645" in failed.error.message  # the largest valid id
    submit, _ = await harness.route(CompletionRequest(prompt=(0, 151_645)))
    assert submit is not None
    assert submit.prompt_tokens == (0, 151_645)
    # A logit_bias past the vocabulary would scatter past the logits.
    for bias, expected in ((((5, 1.0), (151_646, 2.0)), "logit_bias"), (((151_645, -1.0),), None)):
        submit, events = await harness.route(chat(sampling=SamplingParams(logit_bias=bias)))
        if expected is None:
            assert submit is not None
        else:
            assert submit is None
            failed = failure_of(events)
            assert (failed.error.status, failed.error.param) == (400, expected)
            assert "151646" in failed.error.message


BOMB = {"chat_template": '{{ "ab " * 30000000 }}'}


async def test_a_request_chat_template_is_refused_unless_allowed(nursery: trio.Nursery) -> None:
    harness = await start_router(nursery)
    submit, events = await harness.route(chat(chat_template_kwargs={"chat_template": "{{ 'hi' }}"}))
    assert submit is None
    failed = failure_of(events)
    assert (failed.error.status, failed.error.param) == (400, "chat_template_kwargs.chat_template")

    allowed = await start_router(nursery, allow_request_template=True)
    submit, _ = await allowed.route(chat(chat_template_kwargs={
        "chat_template": "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"}))
    text = "system: You are terse.\nuser: Hello there\n"
    assert submit.prompt_tokens == tuple(llama_info().tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("template", [
    '{{ "ab " * 30000000 }}',
    '{% set ns = namespace(s="ab") %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}',
    '{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}',
    '{% for i in range(100000) %}{{ "x" * 100000 }}{% endfor %}',
])
async def test_an_allowed_request_template_is_bounded_in_time_and_size(template: str) -> None:
    from mlxcel.model import chat_template

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            harness = await start_router(nursery, allow_request_template=True)
            started = trio.current_time()
            chat_template.RENDER_TIMEOUT_S, saved = 1.0, chat_template.RENDER_TIMEOUT_S
            try:
                submit, events = await harness.route(chat(chat_template_kwargs={"chat_template": template}))
            finally:
                chat_template.RENDER_TIMEOUT_S = saved
            assert trio.current_time() - started < 10
            assert submit is None
            failed = failure_of(events)
            assert (failed.error.status, failed.error.param) == (400, "chat_template_kwargs.chat_template")
            submit, _ = await harness.route(chat())  # the router keeps serving
            assert submit is not None
            nursery.cancel_scope.cancel()


async def test_text_that_cannot_fit_is_refused_before_tokenizing(nursery: trio.Nursery) -> None:
    model = attrs.evolve(llama_info(), context_size=64)
    harness = await start_router(nursery, model)
    # 128 characters per token at most (the longest vocabulary entry): 64 tokens hold 8,192.
    _, events = await harness.route(CompletionRequest(prompt="word " * 2000))
    failed = failure_of(events)
    assert (failed.error.code, failed.error.param) == ("context_length_exceeded", "prompt")
    assert "characters" in failed.error.message  # refused on its length, not after tokenizing
    _, events = await harness.route(ChatRequest(messages=({"role": "user", "content": "word " * 2000},)))
    failed = failure_of(events)
    assert (failed.error.code, failed.error.param) == ("context_length_exceeded", "messages")
    assert "characters" in failed.error.message


class GatedRenderer:
    """Renders like PromptRenderer, but a request whose prompt is "slow" waits for ``release``."""

    def __init__(self) -> None:
        import threading

        self.inner = PromptRenderer(llama_info(), default_template_kwargs={}, cache_enabled=True)
        self.release = threading.Event()

    def render(self, request: Any) -> Any:
        if isinstance(request, CompletionRequest) and str(request.prompt).startswith("slow"):
            assert self.release.wait(10)
            request = attrs.evolve(request, prompt="slow")
        return self.inner.render(request)


async def test_a_slow_render_does_not_hold_up_other_requests(nursery: trio.Nursery) -> None:
    renderer = GatedRenderer()
    harness = await start_router(nursery, renderer=renderer)
    slow_send, _slow_events = trio.open_memory_channel[StreamEvent](4)
    await harness.inbox.send(RouteRequest(request=CompletionRequest(prompt="slow"), request_id="slow",
                                          events=slow_send))
    submit, _ = await harness.route(CompletionRequest(prompt=(1, 2, 3)), "fast")
    assert submit is not None
    assert submit.request_id == "fast"
    renderer.release.set()
    with trio.fail_after(10):
        submit = await harness.scheduler.receive()
    assert submit.request.request_id == "slow"
    assert harness.actor.statistics() == RouterStats(num_routed=2, num_rejected=0)


async def test_huge_prompts_never_take_every_render_slot(nursery: trio.Nursery) -> None:
    """Four prompts of many megabytes (under a long context's bound) took all four slots, and a normal
    request waited for their tokenizing (114 s); huge ones now render one at a time in a lane of their own."""
    from mlxcel.actors.router import LARGE_PROMPT_CHARS

    renderer = GatedRenderer()
    harness = await start_router(nursery, renderer=renderer)
    huge = "slow" + "x" * LARGE_PROMPT_CHARS
    for index in range(6):
        events_send, _events = trio.open_memory_channel[StreamEvent](4)
        await harness.inbox.send(RouteRequest(request=CompletionRequest(prompt=huge), request_id=f"huge{index}",
                                              events=events_send))
    submit, _ = await harness.route(CompletionRequest(prompt="hello"), "small")
    assert submit is not None
    assert submit.request_id == "small"
    renderer.release.set()
    with trio.fail_after(20):
        routed = {(await harness.scheduler.receive()).request.request_id for _ in range(6)}
    assert routed == {f"huge{index}" for index in range(6)}


async def test_render_prompt_renders_without_submitting(nursery: trio.Nursery) -> None:
    from mlxcel.actors.messages import RenderPrompt
    from mlxcel.errors import InvalidRequest

    harness = await start_router(nursery)
    request = chat(tools=(TOOL,))
    submitted, _events = await harness.route(request)
    inbox: trio.MemorySendChannel[Any] = harness.inbox  # the router's inbox takes both kinds of message
    for asked, expected in ((request, submitted.prompt_tokens),
                            (chat(tool_choice="bogus"), None)):
        reply_to, replies = trio.open_memory_channel[Any](1)
        await inbox.send(RenderPrompt(request=asked, reply_to=reply_to))
        with trio.fail_after(10):
            answer = await replies.receive()
        if expected is None:
            assert isinstance(answer, InvalidRequest)
            assert answer.param == "tool_choice"
        else:
            assert answer == expected
        with pytest.raises(trio.EndOfChannel):
            await replies.receive()
    # Nothing reached the scheduler, and the router's counts of routed requests did not move.
    with pytest.raises(trio.WouldBlock):
        harness.scheduler.receive_nowait()
    assert harness.actor.statistics() == RouterStats(num_routed=1, num_rejected=0)


class _FailingRenderer:
    """A renderer whose first calls raise what no request check foresaw (an image processor's MemoryError)."""

    def __init__(self, errors: list[BaseException]) -> None:
        self._errors = errors

    def render(self, request: Any) -> Any:
        if self._errors:
            raise self._errors.pop(0)
        return PromptRenderer(llama_info(), default_template_kwargs={}, cache_enabled=True).render(request)


@pytest.mark.parametrize("error", [MemoryError(), OverflowError("cannot fit 'int' into an index-sized integer"),
                                   RuntimeError("unforeseen")])
async def test_an_unforeseen_error_while_preparing_fails_that_request_only(nursery: trio.Nursery,
                                                                             error: Exception) -> None:
    from mlxcel.actors.messages import RenderPrompt
    from mlxcel.errors import InternalError

    harness = await start_router(nursery, renderer=_FailingRenderer([error, error]))
    submit, events = await harness.route(chat())
    assert submit is None
    failed = failure_of(events)
    assert isinstance(failed.error, InternalError)
    assert (failed.error.status, failed.error.code) == (500, "preparation_failed")
    # The render route too; then the router goes on routing.
    reply_to, replies = trio.open_memory_channel[Any](1)
    await harness.inbox.send(RenderPrompt(request=chat(), reply_to=reply_to))  # type: ignore[arg-type]
    with trio.fail_after(10):
        answer = await replies.receive()
    assert isinstance(answer, InternalError)
    submit, _ = await harness.route(chat(), request_id="req-2")
    assert submit is not None


async def test_requests_already_queued_start_in_one_turn_as_far_as_slots_allow(
        nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch) -> None:
    """With 64 short chats arriving at once, the router took one message a turn of the event loop (each
    turn runs every other task), and requests waited a median 30-40 ms in its inbox. The ones already
    queued now start together, up to the free render slots (MAX_CONCURRENT_ROUTES)."""
    from mlxcel.actors.router import MAX_CONCURRENT_ROUTES

    turns = 0

    async def count_turns() -> None:
        nonlocal turns
        while True:
            turns += 1
            await trio.lowlevel.checkpoint()

    started: list[int] = []
    original = RouterActor._handle

    async def handle(actor: RouterActor, message: Any, slot: trio.Semaphore) -> None:
        started.append(turns)
        await original(actor, message, slot)

    monkeypatch.setattr(RouterActor, "_handle", handle)
    harness = await start_router(nursery)
    count = MAX_CONCURRENT_ROUTES + 2
    for index in range(count):
        events_send, _events = trio.open_memory_channel[StreamEvent](4)
        harness.inbox.send_nowait(RouteRequest(request=CompletionRequest(prompt=(1, 2, 3 + index)),
                                               request_id=f"req-{index}", events=events_send))
    nursery.start_soon(count_turns)
    with trio.fail_after(10):
        routed = {(await harness.scheduler.receive()).request.request_id for _ in range(count)}
    assert routed == {f"req-{index}" for index in range(count)}
    first = started[:MAX_CONCURRENT_ROUTES]
    assert max(first) - min(first) <= 1, started
