"""OpenAI's chat and completions dialect, and llama.cpp's native `/completion` (and `/infill`) beside it.

The three share one request pipeline and one reply builder, ``CompletionReply``:
its chunks as the reply streams, its body once it has finished. The bodies are
parsed by ``mlxcel/http/validation.py`` (``parse_chat_completions``,
``parse_completion_request``, ``parse_native_completion``: each ``(body, limits=...)``).
Also here: vLLM's render routes and the model list.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from quart import Response

from mlxcel.errors import InvalidRequest, MlxcelError
from mlxcel.http import llamacpp, sse
from mlxcel.http.reply import Event
from mlxcel.http.route import RouteContext, json_response
from mlxcel.http.validation import parse_chat_completions, parse_completion_request, parse_native_completion
from mlxcel.types import ChatRequest, CompletionRequest, Delta, TokenLogprob, ToolCall, Usage

Kind = Literal["chat", "completions", "native"]


# --- bodies ------------------------------------------------------------------------------


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def chat_logprobs_body(logprobs: tuple[TokenLogprob, ...]) -> dict[str, Any]:
    def one(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {
        "content": [
            {**one(item.token, item.logprob), "top_logprobs": [one(t, lp) for t, lp in item.top]}
            for item in logprobs
        ]
    }


def legacy_logprobs_body(logprobs: tuple[TokenLogprob, ...]) -> dict[str, Any]:
    return {
        "tokens": [item.token for item in logprobs],
        "token_logprobs": [item.logprob for item in logprobs],
        "top_logprobs": [dict(item.top) for item in logprobs],
    }


def tool_call_body(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


class CompletionReply:
    """One reply of `/v1/chat/completions`, `/v1/completions` or `/completion` (a ``ReplyBuilder``)."""

    named_events = False

    def __init__(self, kind: Kind, parsed: ChatRequest | CompletionRequest, context: RouteContext) -> None:
        self.kind = kind
        self.model = context.engine.model_id
        self.fingerprint = context.fingerprint
        self.native = (llamacpp.NativeReply(parsed, context.engine)
                       if kind == "native" and isinstance(parsed, CompletionRequest) else None)
        # llama.cpp's stream has no `[DONE]` and no usage chunk.
        self.done = b"" if self.native is not None else sse.DONE
        self.streaming = parsed.stream
        self.want_logprobs = parsed.sampling.logprobs
        self.include_usage = parsed.include_usage and self.native is None
        chat = parsed if isinstance(parsed, ChatRequest) else None
        # Legacy `functions`: calls come back as `function_call`, and finish as "function_call".
        self.legacy_functions = chat is not None and chat.legacy_functions
        self.timings = chat is not None and chat.timings_per_token
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        # Calls whose arguments were streamed in pieces: their completion is not sent again.
        self._streamed_calls: set[int] = set()
        self._first = True
        # What the whole reply is made of.
        self._texts: list[str] = []
        self._reasoning: list[str] = []
        self._tool_calls: list[ToolCall] = []
        self._logprobs: list[TokenLogprob] = []
        self._token_ids: list[int] = []
        self._last: Delta | None = None

    # --- the builder ----------------------------------------------------------------------

    def start(self, first: Delta) -> list[Event]:
        return []

    def feed(self, delta: Delta) -> list[Event]:
        self._texts.append(delta.text)
        self._reasoning.append(delta.reasoning)
        self._tool_calls.extend(delta.tool_calls)
        self._logprobs.extend(delta.logprobs)
        self._token_ids.extend(delta.token_ids)
        if not self.streaming:
            return []
        chunk = self._chunk(delta, first=self._first)
        self._first = False
        return [chunk]

    def finish(self, last: Delta) -> list[Event]:
        events = self.feed(last)
        self._last = last
        if self.streaming and self.include_usage and last.usage is not None:
            events.append(self._usage_chunk(last.usage))
        return events

    def fail(self, error: MlxcelError) -> list[Event]:
        return [error.to_body()]

    def body(self) -> dict[str, Any]:
        last = self._last
        assert last is not None
        assert last.finish_reason is not None
        assert last.usage is not None
        return self._whole("".join(self._texts), last.finish_reason, last.usage, tuple(self._logprobs),
                           tuple(self._token_ids), last.stop_string, "".join(self._reasoning),
                           tuple(self._tool_calls))

    # --- the shapes ------------------------------------------------------------------------

    def _envelope(self, object_name: str, choices: list[Any]) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices}

    def _finish_reason(self, reason: str | None) -> str | None:
        return "function_call" if self.legacy_functions and reason == "tool_calls" else reason

    def _whole(self, text: str, finish_reason: str, usage: Usage, logprobs: tuple[TokenLogprob, ...],
               token_ids: tuple[int, ...], stop_string: str | None, reasoning: str,
               tool_calls: tuple[ToolCall, ...]) -> dict[str, Any]:
        if self.native is not None:
            native = self.native.whole(text, finish_reason, usage, logprobs, token_ids, stop_string)
            return native if self.native.selects_fields else {**native, "usage": usage_body(usage)}
        if self.kind == "chat":
            # As OpenAI: content is null in a reply of tool calls alone.
            message: dict[str, Any] = {"role": "assistant", "content": None if tool_calls and not text else text}
            if reasoning:
                message["reasoning_content"] = reasoning
            if tool_calls and self.legacy_functions:
                message["function_call"] = {"name": tool_calls[0].name, "arguments": tool_calls[0].arguments}
            elif tool_calls:
                message["tool_calls"] = [tool_call_body(call) for call in tool_calls]
            choice = {
                "index": 0,
                "message": message,
                "logprobs": chat_logprobs_body(logprobs) if self.want_logprobs else None,
                "finish_reason": self._finish_reason(finish_reason),
            }
            body = self._envelope("chat.completion", [choice])
            if self.timings:
                body["timings"] = llamacpp.timings(usage)
        else:
            choice = {"index": 0, "text": text,
                      "logprobs": legacy_logprobs_body(logprobs) if self.want_logprobs else None,
                      "finish_reason": finish_reason}
            body = self._envelope("text_completion", [choice])
        body["usage"] = usage_body(usage)
        return body

    def _chunk(self, delta: Delta, *, first: bool = False) -> dict[str, Any]:
        want_logprobs = self.want_logprobs
        if self.native is not None:
            body: dict[str, Any] = self.native.chunk(delta)
            if delta.usage is not None and not self.native.selects_fields:
                body["usage"] = usage_body(delta.usage)
            return body
        if self.kind == "chat":
            content: dict[str, Any] = {"content": delta.text} if delta.text or first else {}
            if first:
                content["role"] = "assistant"
            if delta.reasoning:
                content["reasoning_content"] = delta.reasoning
            calls = self._call_pieces(delta)
            if calls and self.legacy_functions:
                content["function_call"] = calls[0]["function"]
            elif calls:
                # Each call's pieces by index: the SDKs join them (the name first, then the arguments' text).
                content["tool_calls"] = calls
            choice = {"index": 0, "delta": content,
                      "logprobs": chat_logprobs_body(delta.logprobs) if want_logprobs and delta.logprobs else None,
                      "finish_reason": self._finish_reason(delta.finish_reason)}
            body = self._envelope("chat.completion.chunk", [choice])
            progress = delta.usage or delta.progress
            if self.timings and progress is not None:
                body["timings"] = llamacpp.timings(progress)
            return body
        choice = {"index": 0, "text": delta.text,
                  "logprobs": legacy_logprobs_body(delta.logprobs) if want_logprobs and delta.logprobs else None,
                  "finish_reason": delta.finish_reason}
        return self._envelope("text_completion", [choice])

    def _call_pieces(self, delta: Delta) -> list[dict[str, Any]]:
        """A chunk's `tool_calls`: streamed pieces, and whole any call completed without having streamed."""
        pieces: list[dict[str, Any]] = []
        for part in delta.tool_call_parts:
            if self.legacy_functions and part.index > 0:
                continue
            if part.name:
                self._streamed_calls.add(part.index)
                pieces.append({"index": part.index, "id": part.id, "type": "function",
                               "function": {"name": part.name, "arguments": part.arguments}})
            else:
                pieces.append({"index": part.index, "function": {"arguments": part.arguments}})
        for call in delta.tool_calls:
            if call.index not in self._streamed_calls and not (self.legacy_functions and call.index > 0):
                pieces.append({"index": call.index, **tool_call_body(call)})
        return pieces

    def _usage_chunk(self, usage: Usage) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.kind == "chat" else "text_completion", [])
        body["usage"] = usage_body(usage)
        return body


# --- routes ------------------------------------------------------------------------------


async def reply_to(context: RouteContext, kind: Kind, parsed: ChatRequest | CompletionRequest) -> Response:
    """Start ``parsed`` and answer it, whole or streamed."""
    deltas, first = await context.start(parsed)
    return await context.reply(deltas, first, CompletionReply(kind, parsed, context), stream=parsed.stream)


async def chat_completions(context: RouteContext) -> Response:
    return await reply_to(context, "chat", await context.parse_body(parse_chat_completions))


async def completions(context: RouteContext) -> Response:
    return await reply_to(context, "completions", await context.parse_body(parse_completion_request))


async def native_completion(context: RouteContext) -> Response:
    return await reply_to(context, "native", await context.parse_body(parse_native_completion))


async def infill(context: RouteContext) -> Response:
    """llama.cpp's fill-in-the-middle: its prompt built from the prefix and suffix, then a `/completion`."""
    body = await context.read_body()
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object", code="invalid_type")
    ids = await llamacpp.infill_prompt(context.engine, body)
    fields = {key: value for key, value in body.items() if key not in ("input_prefix", "input_suffix", "input_extra")}
    parsed = await context.parse(parse_native_completion, {**fields, "prompt": list(ids)})
    return await reply_to(context, "native", parsed)


# vLLM's render endpoints: the prompt's ids as this server would prefill them, for routers
# that tokenize before they pick a replica (llm-d's precise prefix-cache scorer).


def render_body(parsed: ChatRequest | CompletionRequest, token_ids: tuple[int, ...], model: str) -> dict[str, Any]:
    """vLLM's ``GenerateRequest`` (what its render endpoints answer) for a rendered prompt."""
    sampling = parsed.sampling
    return {
        "request_id": f"render-{uuid.uuid4().hex}",
        "token_ids": list(token_ids),
        "features": None,
        "sampling_params": {
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "min_p": sampling.min_p,
            "seed": sampling.seed,
            "stop": list(sampling.stop),
            "presence_penalty": sampling.presence_penalty,
            "frequency_penalty": sampling.frequency_penalty,
            "repetition_penalty": sampling.repetition_penalty,
            "logprobs": sampling.top_logprobs if sampling.logprobs else None,
        },
        "model": model,
        "stream": parsed.stream,
        "stream_options": None,
        "cache_salt": parsed.cache.cache_salt or None,
        "priority": 0,
        "kv_transfer_params": None,
    }


async def _render(context: RouteContext, parse: Callable[..., ChatRequest | CompletionRequest]) -> Response:
    parsed = await context.parse_body(parse)
    token_ids = await context.engine.render_prompt(parsed)
    body = render_body(parsed, token_ids, context.engine.model_id)
    return json_response(body if isinstance(parsed, ChatRequest) else [body])


async def chat_completions_render(context: RouteContext) -> Response:
    return await _render(context, parse_chat_completions)


async def completions_render(context: RouteContext) -> Response:
    return await _render(context, parse_completion_request)


def model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "mlxcel"}


async def models(context: RouteContext) -> Response:
    return json_response({"object": "list", "data": [model_card(name) for name in context.engine.model_names]})


async def model(context: RouteContext, model_id: str) -> Response:
    # <path:...>: a repo id such as "org/name" holds a slash.
    if model_id not in context.engine.model_names:
        raise InvalidRequest(f"the model {model_id!r} is not served here", param="model",
                             code="model_not_found", status=404)
    return json_response(model_card(model_id))
