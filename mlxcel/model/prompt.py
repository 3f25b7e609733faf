"""From a validated request to its prompt tokens: chat rendering, tokenizing and their checks.

``PromptRenderer`` is plain code with no Trio and no MLX. The router runs
``render`` in worker threads, several at once, and the warmer runs
``next_turn_history``; its only mutable state is its memos (the tokenizer's
message memo, ``model/tokenize.py``, and the compiled request templates,
``model/chat_template.py``, each behind its own lock), and the tokenizer in
``ModelInfo`` is used read-only.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

import attrs

from mlxcel.cache.key import TEXT_ONLY_MM_DIGEST, effective_tool_choice, template_signature
from mlxcel.core.output import ReplyFormat
from mlxcel.core.tool_grammar import (
    ENFORCED_PARAMETERS,
    FORCEABLE_FORMATS,
    UnforceableToolChoice,
    forced_tool_grammar,
    strict_tools_grammar,
    tool_format_name,
)
from mlxcel.errors import ContextExceeded, InvalidRequest
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
from mlxcel.vision.processing import VisionInputs
from mlxcel.vision.prompt import ImagePrompts

logger = logging.getLogger(__name__)

# The template signature of raw-text prompts, which bypass the chat template.
RAW_PROMPT_TEMPLATE = "mlxcel:raw-prompt"
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


