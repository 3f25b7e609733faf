"""The router actor: from a validated API request to token ids and a cache context.

It renders the chat template, tokenizes (in worker threads: tokenizers are
pure CPU work that releases the GIL, and the model's MLX state is not
touched), checks the context size, resolves the cache context, and submits
the request to the scheduler. Up to ``MAX_CONCURRENT_ROUTES`` requests are
rendered and tokenized at once, so one huge prompt does not hold up the rest.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Mapping
from typing import Any, assert_never

import attrs
import trio

from mlxcel.actors.grammar_check import GrammarChecker
from mlxcel.actors.messages import (
    AdapterScales,
    RenderPrompt,
    RequestFailed,
    RouteRequest,
    RouterMsg,
    RouterStats,
    SubmitRequest,
)
from mlxcel.cache.key import (
    TEXT_ONLY_MM_DIGEST,
    CacheContext,
    effective_tool_choice,
    rope_regime_for,
    template_signature,
)
from mlxcel.core.output import ReplyFormat
from mlxcel.core.scheduler import NewRequest
from mlxcel.core.tool_grammar import (
    ENFORCED_PARAMETERS,
    FORCEABLE_FORMATS,
    UnforceableToolChoice,
    forced_tool_grammar,
    strict_tools_grammar,
    tool_format_name,
)
from mlxcel.errors import ContextExceeded, InternalError, InvalidRequest, MlxcelError, ServerBusy
from mlxcel.model.adapters import adapter_cache_id
from mlxcel.model.chat_template import (
    RENDER_TIMEOUT_S,
    RenderOverrun,
    RequestTemplates,
    check_size,
    render_deadline,
)
from mlxcel.model.info import ModelInfo
from mlxcel.model.tokenize import SegmentTokenizer, max_chars_per_token, vocabulary_size
from mlxcel.types import ChatRequest, CompletionRequest
from mlxcel.vision.images import fetch_remote, is_remote
from mlxcel.vision.processing import VisionInputs
from mlxcel.vision.prompt import ImagePrompts

logger = logging.getLogger(__name__)

# The template signature of raw-text prompts, which bypass the chat template.
RAW_PROMPT_TEMPLATE = "mlxcel:raw-prompt"
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
# Characters per token of context allowed in a rendered prompt when the
# tokenizer gives no proven bound (see max_chars_per_token): only a size cap.
FALLBACK_CHARS_PER_TOKEN = 1024
REQUEST_TEMPLATE_PARAM = "chat_template_kwargs.chat_template"
# Stands for a continued assistant message's text while the template renders (never in a prompt).
CONTINUE_MARKER = "\x00mlxcel-continue\x00"
# The largest grammar strict or forced tools may make together (each tool's schema is bounded on its own).
MAX_TOOL_GRAMMAR_CHARS = 1 << 20


@attrs.frozen(kw_only=True)
class RenderedPrompt:
    tokens: tuple[int, ...] = attrs.field(repr=False)
    template_sig: str
    # Tokens of the history before the newest user message, when the prompt splits there.
    history_boundary: int | None = None
    # Tokens of the system prompt and tool schemas that begin the prompt (what conversations share).
    shared_prefix: int | None = None
    # The grammar a forced tool_choice puts on the reply (None: the request's own, if any).
    tool_grammar: str | None = None
    # The request's images: their digest (part of the cache key) and what the device encodes.
    mm_digest: bytes = TEXT_ONLY_MM_DIGEST
    vision: VisionInputs | None = attrs.field(default=None, repr=False)


def prompt_chars(request: ChatRequest | CompletionRequest) -> int:
    """The characters of a request's text (messages and tools, or a text prompt): what rendering costs."""
    if isinstance(request, CompletionRequest):
        return len(request.prompt) if isinstance(request.prompt, str) else 0
    total = 0
    stack: list[Any] = [request.messages, request.tools or ()]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, Mapping):
            stack.extend(value.values())
        elif isinstance(value, list | tuple):
            stack.extend(value)
    return total


def rendered_tools(request: ChatRequest) -> list[Any] | None:
    """The tools the template sees: all of them, except with tool_choice "none" (without mlxcel's own keys)."""
    try:
        tool_choice = effective_tool_choice(request.tool_choice, request.tools)
    except ValueError as error:
        raise InvalidRequest(str(error), param="tool_choice", code="invalid_value") from None
    if not request.tools or tool_choice == "none":
        return None
    return [_shown(tool) for tool in request.tools]


def _shown(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    function = tool.get("function")
    if not isinstance(function, Mapping) or not any(key.startswith("x-mlxcel-") for key in function):
        return tool
    return {**tool, "function": {key: value for key, value in function.items() if not key.startswith("x-mlxcel-")}}


def forced_tool_names(request: ChatRequest) -> tuple[str, ...]:
    """The tools one of which the reply must call: all with "required", one when named; () when not forced."""
    if not request.tools or request.tool_choice in (None, "auto", "none"):
        return ()
    if request.tool_choice == "required":
        return tuple(tool["function"]["name"] for tool in request.tools)
    return (effective_tool_choice(request.tool_choice, request.tools),)


class PromptRenderer:
    """Chat rendering and tokenization; plain code, shared by the router and tests."""

    def __init__(
        self,
        model: ModelInfo,
        *,
        default_template_kwargs: Mapping[str, Any],
        cache_enabled: bool,
        history_boundaries: bool = False,
        allow_request_template: bool = False,
        memo_per_session: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self._model = model
        # `--chat-template` replaces the model's; it is what the cache keys' signature hashes.
        self._chat_template = model.chat_template if chat_template is None else chat_template
        self._template_override = {} if chat_template is None else {"chat_template": chat_template}
        self._segments = SegmentTokenizer(model.tokenizer)
        self._special_ids = _special_token_ids(model.tokenizer)
        self._vocab_size = vocabulary_size(model.tokenizer, model.config)
        # Rendered text longer than this cannot fit the context (or, without a proven bound, is absurd).
        self._max_chars = model.context_size * (max_chars_per_token(model.tokenizer) or FALLBACK_CHARS_PER_TOKEN)
        self._request_templates = RequestTemplates(max_chars=self._max_chars) if allow_request_template else None
        # Without cross-session reuse, the tokenizer's memo is kept per session too.
        self._memo_per_session = memo_per_session
        # Snapshot families split prefill where the conversation history ends.
        self._history_boundaries = history_boundaries
        self._default_template_kwargs = dict(default_template_kwargs)
        self._images = ImagePrompts(model.vision)
        # A template that can drop earlier reasoning would re-render history
        # differently each turn; keeping it makes the prefix stable.
        if cache_enabled and "preserve_thinking" in self._chat_template:
            self._default_template_kwargs.setdefault("preserve_thinking", True)

    def render(self, request: ChatRequest | CompletionRequest) -> RenderedPrompt:
        tokenizer = self._model.tokenizer
        self._check_logit_bias(request.sampling.logit_bias)
        if isinstance(request, CompletionRequest):
            if isinstance(request.prompt, str):
                self._check_fits(request.prompt, "prompt")
                tokens = tuple(tokenizer.encode(request.prompt))
            else:
                tokens = request.prompt
                self._check_token_ids(tokens)
            self._images.refuse_stray_placeholders(tokens, "prompt")
            return RenderedPrompt(tokens=tokens, template_sig=template_signature(RAW_PROMPT_TEMPLATE, {}, "none", None))
        kwargs = self._template_kwargs(request)
        tools = rendered_tools(request)
        namespace = self.memo_namespace(request)
        if request.images:
            return self._render_images(request, kwargs, tools, namespace)
        tokens = self._prompt_tokens(request, request.messages, tools, kwargs, namespace)
        self._images.refuse_stray_placeholders(tokens, "messages")
        template_sig = self._template_signature(kwargs, tools)
        boundary = None
        if self._history_boundaries and len(request.messages) > 1 and request.messages[-1].get("role") == "user":
            history = self._chat_tokens(
                request.messages[:-1], tools, kwargs, add_generation_prompt=False, namespace=namespace
            )
            if 0 < len(history) < len(tokens) and tokens[: len(history)] == history:
                boundary = len(history)
        shared = self._shared_prefix(request, tokens, tools, kwargs, namespace) if self._history_boundaries else None
        return RenderedPrompt(tokens=tokens, template_sig=template_sig, history_boundary=boundary,
                              shared_prefix=shared, tool_grammar=self._tool_grammar(request))

    def _render_images(self, request: ChatRequest, kwargs: dict[str, Any], tools: list[Any] | None,
                       namespace: tuple[str, str | None]) -> RenderedPrompt:
        """A prompt with images: each rendered as the model's placeholder, then expanded to its token run.

        No history boundary or shared prefix: snapshots decline multimodal
        prompts, and the prefix store serves them whole entries only.
        """
        images = self._images.read(request.images)
        messages = self._images.placeholders(request.messages)
        tokens = self._prompt_tokens(request, messages, tools, kwargs, namespace)
        # The prompt's entry ends with the last message: a resend, or a next turn whose reply merges with
        # the generation prompt when re-tokenized (a reply starting with a newline), still finds it whole.
        try:
            history = self._chat_tokens(messages, tools, kwargs, add_generation_prompt=False, namespace=namespace)
        except InvalidRequest:  # a template that renders only with the generation prompt
            history = ()
        entry_end = len(history) if history and tokens[:len(history)] == history else None
        tokens, vision = self._images.expand(tokens, images, entry_end=entry_end)
        return RenderedPrompt(tokens=tokens, template_sig=self._template_signature(kwargs, tools),
                              tool_grammar=self._tool_grammar(request), mm_digest=images.digest, vision=vision)

    def _template_signature(self, kwargs: Mapping[str, Any], tools: list[Any] | None) -> str:
        """The signature of what the template renders with.

        `tool_choice` never reaches the template (only whether tools are
        rendered does), so a forced call and the `auto` turn after it (the
        Agents SDK's loop) render, and sign, one prompt.
        """
        return template_signature(self._chat_template, kwargs, "auto" if tools else "none", tools)

    def _shared_prefix(
        self, request: ChatRequest, tokens: tuple[int, ...], tools: list[Any] | None, kwargs: Mapping[str, Any],
        namespace: tuple[str, str | None],
    ) -> int | None:
        """Where the leading system (or developer) messages and the tool schemas end in the prompt.

        Rendered alone, they must be a strict token prefix of the whole
        prompt; a template that folds the system prompt into the first user
        turn (or cannot render it alone) gives None.
        """
        num_leading = 0
        for message in request.messages:
            if message.get("role") not in ("system", "developer"):
                break
            num_leading += 1
        if num_leading == 0 and not tools:
            return None
        try:
            prefix = self._chat_tokens(request.messages[:num_leading], tools, kwargs, add_generation_prompt=False,
                                       namespace=namespace)
        except InvalidRequest:
            return None
        if 0 < len(prefix) < len(tokens) and tokens[: len(prefix)] == prefix:
            return len(prefix)
        return None

    def _tool_grammar(self, request: ChatRequest) -> str | None:
        """The grammar a request's tools put on its reply: a forced call, or `strict` tools' calls; or None."""
        names = forced_tool_names(request)
        strict = [index for index, tool in enumerate(request.tools or ())
                  if tool["function"].get("strict") is True] if request.tool_choice != "none" else []
        # A custom tool's grammar holds where a call can be made and read back; a model with no
        # tool-call format cannot call it at all.
        grammar_tools = [index for index, tool in enumerate(request.tools or ())
                         if ENFORCED_PARAMETERS in tool["function"]] if request.tool_choice != "none" else []
        if grammar_tools and not strict and not names and request.sampling.grammar is None:
            fmt = ReplyFormat.of(self._model.tokenizer)
            if fmt.tool_parser is None or fmt.tool_call_start is None or tool_format_name(
                    fmt.tool_parser) not in FORCEABLE_FORMATS:
                logger.info("custom tool grammars are not enforced: this model's tool-call format has no grammar")
                return None
            strict = grammar_tools
        if not names and not strict:
            return None
        # What a refusal names: the forced choice, or the first strict tool.
        param = "tool_choice" if names else f"tools[{strict[0]}].function.strict"
        if request.sampling.grammar is not None:
            raise InvalidRequest(
                f"{'a forced tool_choice' if names else 'strict tools'} and response_format cannot both shape "
                "one reply; send one of them", param=param, code="unsupported_value",
            )
        fmt = ReplyFormat.of(self._model.tokenizer)
        if fmt.tool_parser is None or fmt.tool_call_start is None:
            raise InvalidRequest(
                "this model's chat template has no tool-call format, so its tool calls cannot be enforced",
                param=param, code="unsupported_value",
            )
        build = functools.partial(
            forced_tool_grammar, names=names) if names else strict_tools_grammar
        try:
            grammar = build(format_name=tool_format_name(fmt.tool_parser), tools=request.tools or (),
                            parallel=request.parallel_tool_calls, start_marker=fmt.tool_call_start,
                            end_marker=fmt.tool_call_end, special_ids=self._special_ids)
        except UnforceableToolChoice as error:
            raise InvalidRequest(str(error), param=param, code="unsupported_value") from None
        if len(grammar) > MAX_TOOL_GRAMMAR_CHARS:
            # Each schema is bounded; many tools together could still take minutes to compile.
            raise InvalidRequest(
                f"the tools' grammar is {len(grammar)} characters; the limit is {MAX_TOOL_GRAMMAR_CHARS}: "
                "send fewer or smaller strict tools", param=param, code="grammar_too_large")
        # Whether it compiles is checked after rendering, off the render slots (RouterActor._check_grammar).
        return grammar

    def next_turn_history(self, request: ChatRequest, reply_text: str) -> tuple[int, ...]:
        """The tokens the next turn will start with: this conversation plus the reply."""
        kwargs = self._template_kwargs(request)
        tools = rendered_tools(request)
        if request.continue_final_message:
            # The reply continued the final assistant message: the next turn sends them as one.
            final = request.messages[-1]
            messages = (*request.messages[:-1], {**final, "content": final["content"] + reply_text})
        else:
            messages = (*request.messages, {"role": "assistant", "content": reply_text})
        return self._chat_tokens(
            messages, tools, kwargs, add_generation_prompt=False, namespace=self.memo_namespace(request)
        )

    def _prompt_tokens(self, request: ChatRequest, messages: Any, tools: list[Any] | None,
                       kwargs: Mapping[str, Any], namespace: tuple[str, str | None]) -> tuple[int, ...]:
        """The prompt: the conversation and the generation prompt, or up to the final message's text when
        that message is continued."""
        if not request.continue_final_message:
            return self._chat_tokens(messages, tools, kwargs, add_generation_prompt=request.add_generation_prompt,
                                     namespace=namespace)
        # Rendered with a marker in place of the final message's text, then cut at the marker: the
        # template's end-of-turn after it is dropped, whatever the template does with whitespace.
        final = messages[-1]
        rendered = self._render_text([*(dict(message) for message in messages[:-1]),
                                      {**final, "content": CONTINUE_MARKER}], tools, kwargs, False)
        cut = rendered.rfind(CONTINUE_MARKER)
        if cut < 0:
            raise InvalidRequest("this chat template does not render the final assistant message's text, so it "
                                 "cannot be continued", param="continue_final_message", code="invalid_value")
        text = rendered[:cut] + final["content"]
        self._check_fits(text, "messages")
        return self._segments.encode(text, namespace=namespace)

    def _template_kwargs(self, request: ChatRequest) -> dict[str, Any]:
        if "chat_template" in request.chat_template_kwargs:
            if self._request_templates is None:
                raise InvalidRequest(
                    "this server does not accept a chat template in the request "
                    "(the operator can allow it with --allow-request-chat-template)",
                    param=REQUEST_TEMPLATE_PARAM, code="unsupported_parameter",
                )
            if not isinstance(request.chat_template_kwargs["chat_template"], str):
                raise InvalidRequest(
                    "the chat template must be a string", param=REQUEST_TEMPLATE_PARAM, code="invalid_type"
                )
        template = request.chat_template_kwargs.get("chat_template") or self._chat_template
        effort = effort_template_kwargs(request.reasoning_effort, template)
        return {**self._default_template_kwargs, **effort, **request.chat_template_kwargs}

    def memo_namespace(self, request: ChatRequest | CompletionRequest) -> tuple[str, str | None]:
        """Whose tokenizer memo a request may use: its salt's, and its session's when sessions are isolated."""
        return (request.cache.cache_salt, request.cache.session_key if self._memo_per_session else None)

    def _check_fits(self, text: str, param: str) -> None:
        """Refuse, before tokenizing, text the context provably cannot hold."""
        try:
            check_size(text, self._max_chars)
        except RenderOverrun as error:
            raise ContextExceeded(str(error), param=param, context_size=self._model.context_size) from None

    def _check_token_ids(self, tokens: tuple[int, ...]) -> None:
        if self._vocab_size is None or not tokens or max(tokens) < self._vocab_size:
            return
        index = next(index for index, token in enumerate(tokens) if token >= self._vocab_size)
        raise InvalidRequest(
            f"token id {tokens[index]} is outside this model's vocabulary (ids 0 to {self._vocab_size - 1})",
            param=f"prompt[{index}]", code="invalid_value",
        )

    def _check_logit_bias(self, biases: tuple[tuple[int, float], ...]) -> None:
        # Ids ascending: the last is the largest.
        if self._vocab_size is None or not biases or biases[-1][0] < self._vocab_size:
            return
        token = next(token for token, _bias in biases if token >= self._vocab_size)
        raise InvalidRequest(
            f"logit_bias names token id {token}, outside this model's vocabulary (ids 0 to {self._vocab_size - 1})",
            param="logit_bias", code="invalid_value",
        )

    def _chat_tokens(
        self,
        messages: Any,
        tools: list[Any] | None,
        kwargs: Mapping[str, Any],
        *,
        add_generation_prompt: bool,
        namespace: tuple[str, str | None],
    ) -> tuple[int, ...]:
        text = self._render_text([dict(message) for message in messages], tools, kwargs, add_generation_prompt)
        self._check_fits(text, "messages")
        return self._segments.encode(text, namespace=namespace)

    def _render_text(
        self, messages: list[dict[str, Any]], tools: list[Any] | None, kwargs: Mapping[str, Any],
        add_generation_prompt: bool,
    ) -> str:
        tokenizer = self._model.tokenizer
        request_templates = self._request_templates
        template = kwargs.get("chat_template") if request_templates is not None else None
        try:
            if request_templates is not None and template is not None:
                variables = {**getattr(tokenizer, "special_tokens_map", {}), **kwargs}
                variables.update(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)
                return request_templates.render(template, variables)
            with render_deadline(RENDER_TIMEOUT_S):
                return tokenizer.apply_chat_template(
                    messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False,
                    **{**self._template_override, **kwargs},
                )
        except RenderOverrun as error:
            if error.too_large and template is None:
                raise ContextExceeded(str(error), param="messages", context_size=self._model.context_size) from None
            raise InvalidRequest(
                str(error), param=REQUEST_TEMPLATE_PARAM if template else "messages", code="invalid_value"
            ) from None
        except Exception as error:  # noqa: BLE001 - a template error is the request's fault
            raise InvalidRequest(
                f"the chat template could not render these messages: {error}", param="messages",
                code="invalid_value",
            ) from None


def effort_template_kwargs(effort: str | None, template: str) -> dict[str, Any]:
    """The template kwargs that carry a `reasoning_effort` (chat's; Responses' `reasoning.effort`).

    A template that reads `reasoning_effort` (gpt-oss) gets it; one that reads
    `enable_thinking` (Qwen3) thinks unless the effort is "none" or "minimal". A
    template with neither has no reasoning switch: there is nothing for the effort
    to change, so it is accepted and changes nothing (docs/api.md).
    """
    if effort is None:
        return {}
    if "reasoning_effort" in template:
        if effort not in ("low", "medium", "high"):
            raise InvalidRequest(f"reasoning_effort {effort!r} is not supported by this model's chat template; "
                                 "send 'low', 'medium' or 'high'", param="reasoning_effort",
                                 code="unsupported_parameter")
        return {"reasoning_effort": effort}
    if "enable_thinking" in template:
        return {"enable_thinking": effort not in ("none", "minimal")}
    return {}


def _special_token_ids(tokenizer: Any) -> dict[str, int]:
    """Special tokens by text: a grammar must name them by id (their text never spells them)."""
    backend = getattr(tokenizer, "_tokenizer", tokenizer)
    decoder = getattr(backend, "added_tokens_decoder", None) or {}
    return {token.content: token_id for token_id, token in decoder.items() if getattr(token, "special", False)}


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
                        self._num_in_flight += 1
                        if isinstance(message, RouteRequest | RenderPrompt) and (
                                prompt_chars(message.request) > LARGE_PROMPT_CHARS):
                            # Huge prompts render in a lane of their own, so they never take every slot.
                            self._slots.release()
                            self._start_large(nursery, message)
                        else:
                            nursery.start_soon(self._handle, message, self._slots)

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
        """A 400 naming the field whose grammar cannot be enforced (mlxcel.actors.grammar_check)."""
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
        ), events=message.events)


def _preparation_failed() -> InternalError:
    """What a request gets when preparing it raised something unforeseen: a 500, logged with its traceback."""
    logger.exception("preparing a request failed")
    return InternalError("the server failed while preparing this request", code="preparation_failed")


def _answer(reply_to: trio.MemorySendChannel[Any], answer: Any) -> None:
    with reply_to, contextlib.suppress(trio.BrokenResourceError, trio.WouldBlock):  # the asker went away
        reply_to.send_nowait(answer)
