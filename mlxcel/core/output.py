"""Per-request output processing: sampled ids in, reply deltas out.

One ``RequestOutput`` per request owns its detokenizer, stop strings,
logprobs and usage counts, and splits reasoning and tool calls out of the
text (with mlx-lm's tool parsers, handed in); it knows nothing of channels
or the device.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from mlxcel.core.tool_grammar import tool_format_name
from mlxcel.types import ChatRequest, Delta, SamplingParams, TokenLogprob, ToolCall, ToolCallPart, Usage

logger = logging.getLogger(__name__)

CONTENT, REASONING, TOOL = "content", "reasoning", "tool"
# `reasoning_format` values: llama.cpp's names ("deepseek" puts thinking in reasoning_content too).
REASONING_FORMATS = ("auto", "deepseek", "none")


@attrs.frozen(kw_only=True)
class ReplyFormat:
    """How a model marks thinking and tool calls, as mlx-lm's TokenizerWrapper knows it.

    ``tool_parser`` is the ``parse_tool_call(text, tools)`` of the module in
    ``mlx_lm.tool_parsers`` that mlx-lm chose from the chat template.
    """

    think_start: str | None = None
    think_end: str | None = None
    think_start_tokens: tuple[int, ...] = ()
    think_end_tokens: tuple[int, ...] = ()
    tool_call_start: str | None = None
    tool_call_end: str | None = None
    tool_parser: Callable[[str, Any], Any] | None = attrs.field(default=None, eq=False)

    @classmethod
    def of(cls, tokenizer: Any) -> ReplyFormat:
        """Read off a TokenizerWrapper; a tokenizer without the markers (a test's) has none."""
        def text(name: str) -> str | None:
            value = getattr(tokenizer, name, None)
            return value if isinstance(value, str) and value else None

        def ids(name: str) -> tuple[int, ...]:
            value = getattr(tokenizer, name, None)
            return tuple(value) if isinstance(value, (tuple, list)) else ()

        parser = getattr(tokenizer, "tool_parser", None)
        start = text("tool_call_start")
        return cls(
            think_start=text("think_start"), think_end=text("think_end"),
            think_start_tokens=ids("think_start_tokens"), think_end_tokens=ids("think_end_tokens"),
            tool_call_start=start if callable(parser) else None,
            # mistral's parser has no end marker: its calls run to the end of the reply.
            tool_call_end=text("tool_call_end") if callable(parser) and start else None,
            tool_parser=parser if callable(parser) and start else None,
        )

    def parsing(self, chat: ChatRequest | None, prompt: Sequence[int]) -> ReplyParsing | None:
        """What to split out of one request's reply; None: the text goes out as it is."""
        if chat is None:
            return None
        tools = (list(chat.tools) if chat.tools and chat.tool_choice != "none" and self.tool_parser is not None
                 else None)
        reasoning = self.think_start is not None and self.think_end is not None and chat.reasoning_format != "none"
        if tools is None and not reasoning:
            return None
        return ReplyParsing(
            format=self, tools=tools, reasoning=reasoning,
            starts_in_reasoning=reasoning and self._opens_reasoning(prompt),
            single_call=not chat.parallel_tool_calls,
        )

    def _opens_reasoning(self, prompt: Sequence[int]) -> bool:
        """The prompt ends inside a thinking block (templates that open it for the model)."""
        start = _rfind(prompt, self.think_start_tokens)
        return start >= 0 and start > _rfind(prompt, self.think_end_tokens)


def _rfind(tokens: Sequence[int], pattern: tuple[int, ...]) -> int:
    if not pattern:
        return -1
    # Only the prompt's tail can open a block the reply continues.
    for index in range(len(tokens) - len(pattern), max(-1, len(tokens) - len(pattern) - 64), -1):
        if tuple(tokens[index : index + len(pattern)]) == pattern:
            return index
    return -1


@attrs.frozen(kw_only=True)
class ReplyParsing:
    format: ReplyFormat
    # None: tool calls are not parsed (no tools, tool_choice "none", or no parser for this model).
    tools: list[Any] | None = attrs.field(default=None, eq=False)
    reasoning: bool = False
    starts_in_reasoning: bool = False
    # parallel_tool_calls false: the reply ends with its first call.
    single_call: bool = False


# A json_tools call up to its arguments: `{"name": "...", "arguments": ` (the order Qwen's and Hermes' templates
# write), after which the arguments' text streams as the model writes it.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
# What may be the call object's own end rather than its arguments': held back until more text comes.
_CALL_TAIL = re.compile(r"\s*(?:\}\s*)?$")
# Formats whose arguments stream as they are generated (the others' calls go out whole at their end marker).
STREAMED_FORMATS = ("json_tools",)


@attrs.define
class _StreamedCall:
    call_id: str
    name: str
    # Where the arguments start in the call's text, and how much of them went out.
    arguments_start: int
    num_sent: int = 0


class ReplySplitter:
    """Splits streamed text into content, reasoning and tool-call regions at the model's markers.

    A piece that may be the start of a marker is held back, as stop strings
    are. Whitespace at the edges of a region is held and dropped where the
    region ends (``<think>\n...\n</think>\n\n`` gives bare reasoning and
    content), so what goes out is what the API shows.
    """

    def __init__(self, parsing: ReplyParsing) -> None:
        fmt = parsing.format
        self._parsing = parsing
        self._markers: dict[str, list[tuple[str, str]]] = {CONTENT: [], REASONING: [], TOOL: []}
        if parsing.reasoning:
            assert fmt.think_start is not None
            assert fmt.think_end is not None
            self._markers[CONTENT].append((fmt.think_start, REASONING))
            self._markers[REASONING].append((fmt.think_end, CONTENT))
        if parsing.tools is not None:
            assert fmt.tool_call_start is not None
            self._markers[CONTENT].append((fmt.tool_call_start, TOOL))
            self._markers[REASONING].append((fmt.tool_call_start, TOOL))
            if fmt.tool_call_end:
                self._markers[TOOL].append((fmt.tool_call_end, CONTENT))
        self.state = REASONING if parsing.starts_in_reasoning else CONTENT
        self._buffer = ""
        # Whitespace held at the end of the current region.
        self._space = ""
        # Leading whitespace of the current region is dropped.
        self._at_start = self.state == REASONING
        self._tool_text = ""
        self._space_before_call = ""
        self.num_calls = 0
        self._tools = parsing.tools
        self.single_call = parsing.single_call
        # Calls whose arguments stream: their pieces since the last take_parts().
        self._streams_arguments = bool(fmt.tool_call_end) and tool_format_name(fmt.tool_parser) in STREAMED_FORMATS
        self._streamed: _StreamedCall | None = None
        self._parts: list[ToolCallPart] = []

    def take_parts(self) -> tuple[ToolCallPart, ...]:
        """The pieces of calls still being written since the last call (a name first, then argument text)."""
        parts, self._parts = tuple(self._parts), []
        return parts

    def feed(self, text: str, *, final: bool = False, cut: bool = False) -> tuple[str, str, tuple[ToolCall, ...]]:
        """Returns (content, reasoning, completed tool calls) safe to send now.

        ``cut``: the reply was cut off (max_tokens): a call still open is dropped, not sent as text.
        """
        pieces: dict[str, list[str]] = {CONTENT: [], REASONING: []}
        calls: list[ToolCall] = []
        self._buffer += text
        while True:
            found = [(index, marker, target) for marker, target in self._markers[self.state]
                     if (index := self._buffer.find(marker)) >= 0]
            if not found:
                break
            at, marker, target = min(found, key=lambda item: item[0])
            self._region_text(self._buffer[:at], pieces)
            self._buffer = self._buffer[at + len(marker):]
            self._leave(target, pieces, calls)
        keep = 0 if final else _partial_marker(self._buffer, [marker for marker, _ in self._markers[self.state]])
        self._region_text(self._buffer[: len(self._buffer) - keep], pieces)
        self._buffer = self._buffer[len(self._buffer) - keep:]
        if final:
            self._finish(pieces, calls, cut=cut)
        return "".join(pieces[CONTENT]), "".join(pieces[REASONING]), tuple(calls)

    def _region_text(self, text: str, pieces: dict[str, list[str]]) -> None:
        if self.state == TOOL:
            self._tool_text += text
            self._stream_call()
            return
        if self._at_start:
            text = text.lstrip()
            if not text:
                return
            self._at_start = False
        stripped = text.rstrip()
        if stripped:
            pieces[self.state].append(self._space + stripped)
            self._space = text[len(stripped):]
        else:
            self._space += text

    def _leave(self, target: str, pieces: dict[str, list[str]], calls: list[ToolCall]) -> None:
        if self.state == TOOL:
            self._end_call(pieces, calls, closed=True)
        # The whitespace before a marker belongs to no region (unless the call turns out not to be one).
        self._space_before_call = self._space if target == TOOL else ""
        self._space = ""
        previous, self.state = self.state, target
        self._at_start = target == REASONING or previous != CONTENT

    def _finish(self, pieces: dict[str, list[str]], calls: list[ToolCall], *, cut: bool) -> None:
        if self.state == TOOL:
            # An end marker never came: mistral's format has none; otherwise the call was cut off.
            if cut:
                # Cut by max_tokens: the reply is its complete calls (finish_reason "length"), never markup.
                logger.info("a tool call was cut off by max_tokens; it is dropped")
                self._tool_text = ""
                self._streamed = None
            else:
                self._end_call(pieces, calls, closed=not self._parsing.format.tool_call_end)
            self.state = CONTENT
        if self.state == CONTENT and self._space and not self.num_calls:
            pieces[CONTENT].append(self._space)
        self._space = ""

    def _stream_call(self) -> None:
        """Send what is known of the call being written: its name once its arguments begin, then their text."""
        if not self._streams_arguments or (self.single_call and self.num_calls):
            return
        if self._streamed is None:
            head = _CALL_HEAD.match(self._tool_text)
            if head is None:
                return
            try:
                name = json.loads(f'"{head.group(1)}"')
            except ValueError:
                return
            self._streamed = _StreamedCall(call_id=f"call_{uuid.uuid4().hex[:24]}", name=name,
                                           arguments_start=head.end())
            self._parts.append(ToolCallPart(index=self.num_calls, id=self._streamed.call_id, name=name))
        streamed = self._streamed
        arguments = self._tool_text[streamed.arguments_start:]
        tail = _CALL_TAIL.search(arguments)
        end = tail.start() if tail is not None else len(arguments)
        if end > streamed.num_sent:
            self._parts.append(ToolCallPart(index=self.num_calls, arguments=arguments[streamed.num_sent:end]))
            streamed.num_sent = end

    def _end_streamed(self, body: str, calls: list[ToolCall]) -> None:
        """A streamed call closed: its arguments are the text as written (the pieces sent add up to them)."""
        streamed, self._streamed = self._streamed, None
        assert streamed is not None
        arguments = body[streamed.arguments_start:]
        tail = re.search(r"\s*\}\s*$", arguments)
        arguments = arguments[: tail.start()] if tail is not None else arguments.rstrip()
        parsed = self._parse(body)
        if parsed is None or parsed[0][0] != streamed.name or not _same_json(parsed[0][1], arguments):
            # Its name and part of its arguments went out already: the call ends with the text it has.
            logger.warning("a streamed tool call did not parse as its pieces said; it ends with its arguments "
                           "as written")
        if len(arguments) > streamed.num_sent:
            self._parts.append(ToolCallPart(index=self.num_calls, arguments=arguments[streamed.num_sent:]))
        calls.append(ToolCall(index=self.num_calls, id=streamed.call_id, name=streamed.name, arguments=arguments))
        self.num_calls += 1

    def _end_call(self, pieces: dict[str, list[str]], calls: list[ToolCall], *, closed: bool) -> None:
        fmt = self._parsing.format
        body, self._tool_text = self._tool_text, ""
        if closed and self._streamed is not None:
            self._end_streamed(body, calls)
            return
        self._streamed = None
        parsed = self._parse(body) if closed else None
        if parsed is None:
            # Not a call after all: the model's text goes out as content, markers included.
            raw = f"{fmt.tool_call_start}{body}{fmt.tool_call_end if closed else ''}"
            pieces[CONTENT].append(self._space_before_call + raw)
            return
        if self._parsing.single_call:
            if len(parsed) > 1 or self.num_calls:
                logger.info("parallel_tool_calls is false: %d call(s) after the first are dropped",
                            len(parsed) - 1 + self.num_calls)
            parsed = parsed[: 1 - min(self.num_calls, 1)]
        for name, arguments, call_id in parsed:
            calls.append(ToolCall(index=self.num_calls, id=call_id, name=name, arguments=arguments))
            self.num_calls += 1

    def _parse(self, body: str) -> list[tuple[str, str, str]] | None:
        parser = self._parsing.format.tool_parser
        assert parser is not None
        try:
            parsed = parser(body, self._tools)
        except Exception as error:  # noqa: BLE001 - any parser failure means the text was not a call
            logger.warning("a tool call did not parse (%s); it is returned as content", type(error).__name__)
            return None
        items = parsed if isinstance(parsed, list) else [parsed]
        calls = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
                logger.warning("a tool call parsed to no function name; it is returned as content")
                return None
            arguments = item.get("arguments", {})
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            call_id = item.get("id")
            calls.append((item["name"], arguments,
                          call_id if isinstance(call_id, str) and call_id else f"call_{uuid.uuid4().hex[:24]}"))
        return calls or None


def _same_json(text: str, other: str) -> bool:
    try:
        return bool(json.loads(text) == json.loads(other))
    except ValueError:
        return False


def _partial_marker(text: str, markers: list[str]) -> int:
    """Length of the longest end of ``text`` that starts one of ``markers``."""
    keep = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text)), keep, -1):
            if text.endswith(marker[:length]):
                keep = length
                break
    return keep


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


@attrs.frozen(kw_only=True)
class TokenOut:
    """What the output makes of one sampled token."""

    # The delta to send now, if any.
    delta: Delta | None
    # Set when this token ends the reply: "stop", "length"...
    finish_reason: str | None = None
    # A stop string (not the device) ended it: the device still holds the sequence.
    stopped_by_text: bool = False


# OpenAI's stand-in for a token with no chance (a logit bias forbids it): JSON has no -inf.
UNLIKELY_LOGPROB = -9999.0


def _reportable(logprob: float) -> float:
    """``logprob`` as a JSON number: -inf (and NaN) become UNLIKELY_LOGPROB."""
    return logprob if logprob > UNLIKELY_LOGPROB else UNLIKELY_LOGPROB


class ReplyCounts:
    """A reply's counts and times, for its usage."""

    def __init__(self, *, prompt_tokens: int, submitted_at: float) -> None:
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0
        self.submitted_at = submitted_at
        self.first_token_at: float | None = None
        self.completion_tokens = 0

    def usage(self, now: float) -> Usage:
        first_token_at = now if self.first_token_at is None else self.first_token_at
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            prompt_seconds=first_token_at - self.submitted_at,
            decode_seconds=now - first_token_at,
        )


class RequestOutput(ReplyCounts):
    """Detokenizing, stop strings, logprobs and usage of one reply."""

    def __init__(
        self, *, tokenizer: Any, sampling: SamplingParams, eos_token_ids: frozenset[int],
        prompt_tokens: int, submitted_at: float, keep_text: bool = False, parsing: ReplyParsing | None = None,
        report_progress: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        # Counts and times on every delta (llama.cpp's `timings_per_token`); only when asked, since a Usage a token
        # is work on the event loop for every stream.
        self._report_progress = report_progress
        # Reasoning and tool calls split out of the text; None: the text goes out as it is.
        self._splitter = ReplySplitter(parsing) if parsing is not None else None
        self._detokenizer = tokenizer.detokenizer
        self._sampling = sampling
        self._eos_token_ids = eos_token_ids
        self._matcher = StopMatcher(sampling.stop)
        super().__init__(prompt_tokens=prompt_tokens, submitted_at=submitted_at)
        # Text decoded but held back because it may be the start of a stop string.
        self._held_text = ""
        # Ids of tokens whose text has not gone out yet.
        self._pending_ids: list[int] = []
        # Logprobs of tokens whose text has not gone out yet, with where that text starts; a
        # stop string's tokens are never reported.
        self._pending_logprobs: list[tuple[int, TokenLogprob]] = []
        # Characters the stop matcher was given, and of those, sent on.
        self._num_chars_seen = 0
        self._num_chars_sent = 0
        # The reply so far as the model wrote it, markers included, when asked
        # for (the warmer renders the next turn from it).
        self._keep_text = keep_text
        self._parts: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def add(self, token: int, logprob: float, top: tuple[tuple[int, float], ...],
            finish_reason: str | None, now: float) -> TokenOut:
        if self.first_token_at is None:
            self.first_token_at = now
        is_eos = finish_reason == "stop" and token in self._eos_token_ids
        # As OpenAI does, the end-of-sequence token is neither counted nor given a logprob.
        if not is_eos:
            self.completion_tokens += 1
            self._detokenizer.add_token(token)
            self._pending_ids.append(token)
        if finish_reason is not None:
            self._detokenizer.finalize()
        segment = self._detokenizer.last_segment
        if not is_eos and self._sampling.logprobs:
            self._pending_logprobs.extend((self._num_chars_seen, item) for item in self._logprobs(token, logprob, top))
        self._num_chars_seen += len(segment)
        emit, self._held_text, hit_stop = self._matcher.feed(self._held_text, segment)
        if finish_reason is not None and not hit_stop:
            # The device finished and dropped the sequence; flush what was held.
            emit, self._held_text = emit + self._held_text, ""
        self._num_chars_sent += len(emit)
        logprobs = self._sent_logprobs(stopped=hit_stop, finished=finish_reason is not None) \
            if self._pending_logprobs else ()
        if self._keep_text:
            self._parts.append(emit)
        reasoning = ""
        calls: tuple[ToolCall, ...] = ()
        parts: tuple[ToolCallPart, ...] = ()
        if self._splitter is not None:
            emit, reasoning, calls = self._splitter.feed(emit, final=finish_reason is not None or hit_stop,
                                                         cut=finish_reason == "length" and not hit_stop)
            parts = self._splitter.take_parts()
        delta = None
        if emit or reasoning or calls or parts or logprobs:
            token_ids, self._pending_ids = tuple(self._pending_ids), []
            delta = Delta(text=emit, logprobs=logprobs, token_ids=token_ids, reasoning=reasoning, tool_calls=calls,
                          tool_call_parts=parts, progress=self.usage(now) if self._report_progress else None)
        if hit_stop:
            # The ids still pending spell the stop string, which is not part of the reply.
            self._pending_ids = []
            return TokenOut(delta=delta, finish_reason="stop", stopped_by_text=True)
        if finish_reason is None and calls and self._splitter is not None and self._splitter.single_call:
            # parallel_tool_calls false: the first call is the whole reply.
            return TokenOut(delta=delta, finish_reason="stop", stopped_by_text=True)
        return TokenOut(delta=delta, finish_reason=finish_reason)

    def final(self, reason: str, now: float) -> Delta:
        """The last delta: finish reason, usage, and ids that have not gone out."""
        stop_string = self._matcher.matched if reason == "stop" else None
        if reason == "stop" and self._splitter is not None and self._splitter.num_calls:
            reason = "tool_calls"
        return Delta(finish_reason=reason, usage=self.usage(now), token_ids=tuple(self._pending_ids),
                     stop_string=stop_string)

    def _sent_logprobs(self, *, stopped: bool, finished: bool) -> tuple[TokenLogprob, ...]:
        """The logprobs of tokens whose text went out (some of it), in order.

        While text is held back (it may start a stop string), so are the logprobs
        of the tokens that wrote it; at a stop string, the tokens that spell only
        the stop string are dropped (a token with text before it is kept).
        """
        if stopped or not (finished or not self._held_text):
            sent = tuple(item for start, item in self._pending_logprobs if start < self._num_chars_sent)
            self._pending_logprobs = [] if stopped else [
                (start, item) for start, item in self._pending_logprobs if start >= self._num_chars_sent]
            return sent
        sent = tuple(item for _start, item in self._pending_logprobs)
        self._pending_logprobs = []
        return sent

    def _logprobs(self, token: int, logprob: float, top: tuple[tuple[int, float], ...]) -> tuple[TokenLogprob, ...]:
        """The token's logprob entry (``add`` asks only for a request that wants logprobs)."""
        decode = self._tokenizer.decode
        return (
            TokenLogprob(
                token=decode([token]),
                logprob=_reportable(logprob),
                top=tuple((decode([tid]), _reportable(value)) for tid, value in top),
                token_id=token,
                top_ids=tuple(tid for tid, _ in top),
            ),
        )


class TokenRelay(ReplyCounts):
    """A reply whose output is processed at the edge (an API process): the core only counts its tokens.

    The sampled tokens go out as they are; the edge runs a ``RequestOutput``
    on them, and tells the engine when a stop string ends the reply there
    (``SchedulerCore.stop``). Counts here include what the device sampled
    after a stop string the edge found a step late; the edge reports the
    reply's own counts.
    """

    def __init__(self, *, eos_token_ids: frozenset[int], prompt_tokens: int, submitted_at: float) -> None:
        super().__init__(prompt_tokens=prompt_tokens, submitted_at=submitted_at)
        self._eos_token_ids = eos_token_ids
        # The text is the edge's: a warmer that needs it keeps output processing in the engine.
        self.text = ""

    def count(self, token: int, finish_reason: str | None, now: float) -> None:
        if self.first_token_at is None:
            self.first_token_at = now
        if not (finish_reason == "stop" and token in self._eos_token_ids):
            self.completion_tokens += 1

    def final(self, reason: str, now: float) -> Delta:
        """The engine's last event: its reason and usage (the edge takes ``cached_tokens`` from it)."""
        return Delta(finish_reason=reason, usage=self.usage(now))
