"""RequestOutput's reasoning and tool-call splitting, fed token ids of the fixture's real Qwen tokenizer."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import pytest
from mlx_lm.tool_parsers import glm47, json_tools, mistral, pythonic, qwen3_coder

from mlxcel.core.output import ReplyFormat, RequestOutput
from mlxcel.fixtures import fixture_path
from mlxcel.types import ChatRequest, Delta, SamplingParams, ToolCall

EOS = 151645
TOOLS = ({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}},)
USER = ({"role": "user", "content": "hi"},)


@cache
def tokenizer() -> Any:
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(fixture_path("llama"))


def qwen_format(**changes: Any) -> ReplyFormat:
    """Qwen3's markers and mlx-lm's json_tools parser (the fixture's template names neither)."""
    encode = tokenizer().encode
    fields: dict[str, Any] = {
        "think_start": "<think>", "think_end": "</think>",
        "think_start_tokens": tuple(encode("<think>")), "think_end_tokens": tuple(encode("</think>")),
        "tool_call_start": json_tools.tool_call_start, "tool_call_end": json_tools.tool_call_end,
        "tool_parser": json_tools.parse_tool_call,
    }
    return ReplyFormat(**{**fields, **changes})


def run(reply: str, *, fmt: ReplyFormat | None = None, prompt: tuple[str, ...] = ("<|im_start|>assistant\n",),
        finish: str = "stop", **request: Any) -> tuple[list[Delta], Delta]:
    """Feed the reply's ids one at a time (then EOS when ``finish`` is "stop"); the deltas and the final one."""
    chat = ChatRequest(messages=USER, **request)
    ids = tokenizer().encode(reply)
    # Each piece encoded alone, as Qwen3's single-token markers would be.
    prompt_ids = [token for piece in prompt for token in tokenizer().encode(piece)]
    parsing = (fmt or qwen_format()).parsing(chat, prompt_ids)
    output = RequestOutput(tokenizer=tokenizer(), sampling=chat.sampling, eos_token_ids=frozenset({EOS}),
                           prompt_tokens=3, submitted_at=0.0, parsing=parsing)
    steps = [(token, None) for token in ids]
    if finish == "stop":
        steps.append((EOS, "stop"))
    else:
        steps[-1] = (steps[-1][0], finish)
    deltas = []
    reason = None
    for token, finish_reason in steps:
        out = output.add(token, -0.5, (), finish_reason, 1.0)
        if out.delta is not None:
            deltas.append(out.delta)
        reason = out.finish_reason
        if reason is not None:
            break
    assert reason is not None
    return deltas, output.final(reason, 2.0)


def content(deltas: list[Delta]) -> str:
    return "".join(delta.text for delta in deltas)


def reasoning(deltas: list[Delta]) -> str:
    return "".join(delta.reasoning for delta in deltas)


def calls(deltas: list[Delta]) -> list[ToolCall]:
    return [call for delta in deltas for call in delta.tool_calls]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.slow
def test_a_tool_call_is_held_then_sent_parsed_and_the_reply_finishes_with_tool_calls() -> None:
    deltas, final = run("Let me check.\n" + CALL, tools=TOOLS)
    assert content(deltas) == "Let me check."
    [call] = calls(deltas)
    assert (call.index, call.name, json.loads(call.arguments)) == (0, "get_weather", {"city": "Paris"})
    assert call.id.startswith("call_")
    # No delta before the call's delta carries any of the markup.
    before = deltas[: next(i for i, delta in enumerate(deltas) if delta.tool_calls)]
    assert "<" not in content(before)
    assert final.finish_reason == "tool_calls"
    # Every generated id went out once, the call's with it.
    assert [t for delta in deltas for t in delta.token_ids] + list(final.token_ids) == tokenizer().encode(
        "Let me check.\n" + CALL)


def test_several_calls_get_indexes_in_order_and_no_content_between_them() -> None:
    second = CALL.replace("Paris", "Oslo")
    deltas, final = run(f"{CALL}\n{second}", tools=TOOLS)
    assert content(deltas) == ""
    assert [(call.index, json.loads(call.arguments)["city"]) for call in calls(deltas)] == [(0, "Paris"), (1, "Oslo")]
    assert len({call.id for call in calls(deltas)}) == 2
    assert final.finish_reason == "tool_calls"


def test_parallel_tool_calls_false_ends_the_reply_with_its_first_call() -> None:
    second = CALL.replace("Paris", "Oslo")
    deltas, final = run(f"{CALL}\n{second}", tools=TOOLS, parallel_tool_calls=False)
    assert [json.loads(call.arguments)["city"] for call in calls(deltas)] == ["Paris"]
    assert final.finish_reason == "tool_calls"
    # It stopped at the first call's end marker: the second call's ids were never fed.
    sent = [t for delta in deltas for t in delta.token_ids] + list(final.token_ids)
    whole = tokenizer().encode(f"{CALL}\n{second}")
    assert sent == whole[: len(sent)]
    assert len(tokenizer().decode(sent)) <= len(CALL) + 1


def test_parallel_tool_calls_false_keeps_one_call_of_a_format_without_an_end_marker() -> None:
    fmt = qwen_format(tool_call_start=mistral.tool_call_start, tool_call_end=mistral.tool_call_end,
                      tool_parser=mistral.parse_tool_call)
    reply = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
    deltas, final = run(reply, fmt=fmt, tools=TOOLS, parallel_tool_calls=False)
    assert [json.loads(call.arguments)["city"] for call in calls(deltas)] == ["Paris"]
    assert final.finish_reason == "tool_calls"
    both, _ = run(reply, fmt=fmt, tools=TOOLS)
    assert len(calls(both)) == 2


def test_a_malformed_call_is_content_text_and_the_reply_stops() -> None:
    # Not a call object at all: content, markers included.
    bad = '<tool_call>\n["get_weather", {"city": \n</tool_call>'
    deltas, final = run("Sure. " + bad, tools=TOOLS)
    assert calls(deltas) == []
    assert content(deltas) == "Sure. " + bad
    assert final.finish_reason == "stop"


def test_a_call_whose_arguments_streamed_stays_a_call_when_they_do_not_parse() -> None:
    # Its name and arguments went out as they were written, so it ends as a call with that text (OpenAI's
    # arguments are not always valid JSON either).
    deltas, final = run('Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',
                        tools=TOOLS)
    (call,) = calls(deltas)
    assert (call.name, call.arguments) == ("get_weather", '{"city":')
    assert "".join(part.arguments for delta in deltas for part in delta.tool_call_parts) == call.arguments
    assert content(deltas) == "Sure."
    assert final.finish_reason == "tool_calls"


def test_json_tools_arguments_stream_as_they_are_generated() -> None:
    reply = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "when": {"day": 1}}}\n'
             '</tool_call><tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>')
    deltas, final = run(reply, tools=TOOLS)
    parts = [part for delta in deltas for part in delta.tool_call_parts]
    finished = calls(deltas)
    assert [call.arguments for call in finished] == ['{"city": "Oslo", "when": {"day": 1}}', '{"city": "Lima"}']
    for call in finished:
        mine = [part for part in parts if part.index == call.index]
        # The name (and id) first, alone; then the arguments in many pieces that add up to the call's.
        assert (mine[0].id, mine[0].name, mine[0].arguments) == (call.id, call.name, "")
        assert len(mine) > 4
        assert "".join(part.arguments for part in mine) == call.arguments
    # The first call's pieces all came before its completion, one token at a time.
    first_done = next(index for index, delta in enumerate(deltas) if delta.tool_calls)
    assert sum(1 for delta in deltas[:first_done] if delta.tool_call_parts) > 4
    assert final.finish_reason == "tool_calls"


def test_a_call_without_a_name_is_content_too() -> None:
    bad = '<tool_call>{"arguments": {}}</tool_call>'
    deltas, _ = run(bad, tools=TOOLS)
    assert (calls(deltas), content(deltas)) == ([], bad)


def test_a_call_cut_off_by_the_length_limit_is_dropped_and_finishes_length() -> None:
    # The complete calls only, never markup in content (LangChain would see no tool_calls).
    deltas, final = run('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
                        '<tool_call>\n{"name": "get_weather", "argum', finish="length", tools=TOOLS)
    assert [call.name for call in calls(deltas)] == ["get_weather"]
    assert content(deltas) == ""
    assert final.finish_reason == "length"


def test_a_format_without_an_end_marker_parses_at_the_end_of_the_reply() -> None:
    fmt = qwen_format(tool_call_start=mistral.tool_call_start, tool_call_end=mistral.tool_call_end,
                      tool_parser=mistral.parse_tool_call)
    deltas, final = run('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', fmt=fmt, tools=TOOLS)
    assert [(call.name, json.loads(call.arguments)) for call in calls(deltas)] == [("get_weather", {"city": "Paris"})]
    assert final.finish_reason == "tool_calls"


@pytest.mark.parametrize(("module", "reply"), [
    (qwen3_coder, "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"),
    (glm47, "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"),
    (pythonic, '<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>'),
])
def test_other_mlx_lm_formats(module: Any, reply: str) -> None:
    fmt = qwen_format(tool_call_start=module.tool_call_start, tool_call_end=module.tool_call_end,
                      tool_parser=module.parse_tool_call)
    deltas, final = run("Checking. " + reply, fmt=fmt, tools=TOOLS)
    assert content(deltas) == "Checking."
    assert [(call.name, json.loads(call.arguments)) for call in calls(deltas)] == [("get_weather", {"city": "Paris"})]
    assert final.finish_reason == "tool_calls"


@pytest.mark.parametrize("request_fields", [{}, {"tools": TOOLS, "tool_choice": "none"}])
def test_without_tools_or_with_tool_choice_none_the_markup_is_plain_content(request_fields: dict[str, Any]) -> None:
    deltas, final = run("ok " + CALL, fmt=qwen_format(think_start=None, think_end=None), **request_fields)
    assert content(deltas) == "ok " + CALL
    assert calls(deltas) == []
    assert final.finish_reason == "stop"


def test_reasoning_is_split_from_the_content() -> None:
    deltas, final = run("<think>\nThe user greets me.\n</think>\n\nHello!")
    assert reasoning(deltas) == "The user greets me."
    assert content(deltas) == "Hello!"
    assert final.finish_reason == "stop"


def test_reasoning_when_the_template_opened_the_thinking_block() -> None:
    deltas, _ = run("Short thought.\n</think>\n\nHello!", prompt=("<|im_start|>assistant\n", "<think>", "\n"))
    assert (reasoning(deltas), content(deltas)) == ("Short thought.", "Hello!")
    # A closed block in the prompt (thinking switched off) opens nothing.
    deltas, _ = run("Hello!", prompt=("<|im_start|>assistant\n", "<think>", "\n\n", "</think>", "\n\n"))
    assert (reasoning(deltas), content(deltas)) == ("", "Hello!")


def test_reasoning_format_none_keeps_the_thinking_inline() -> None:
    reply = "<think>\nThe user greets me.\n</think>\n\nHello!"
    deltas, _ = run(reply, reasoning_format="none")
    assert (reasoning(deltas), content(deltas)) == ("", reply)


def test_reasoning_then_a_tool_call() -> None:
    deltas, final = run("<think>\nI need the weather.\n</think>\n\n" + CALL, tools=TOOLS)
    assert reasoning(deltas) == "I need the weather."
    assert content(deltas) == ""
    assert [call.name for call in calls(deltas)] == ["get_weather"]
    assert final.finish_reason == "tool_calls"


def test_a_model_without_markers_sends_text_as_it_is() -> None:
    output_format = ReplyFormat.of(tokenizer())
    assert output_format.parsing(ChatRequest(messages=USER, tools=TOOLS), ()) is None
    reply = "  <think>x</think> " + CALL + "\n"
    deltas, _ = run(reply, fmt=output_format, tools=TOOLS)
    assert content(deltas) == reply.removeprefix(" ")  # mlx-lm's BPE detokenizer drops one leading space


def test_a_stop_string_ends_the_reply_and_flushes_what_was_held() -> None:
    deltas, final = run("Done.\n<tool_ca", tools=TOOLS, sampling=SamplingParams(stop=("\n<tool_ca",)))
    assert content(deltas) == "Done."
    assert (final.finish_reason, final.stop_string) == ("stop", "\n<tool_ca")


@pytest.mark.slow
def test_reply_format_of_a_tokenizer_with_a_tool_template(tmp_path: Any) -> None:
    # mlx-lm picks json_tools from a template that writes `<tool_call>` and `tool_call.name`.
    from mlx_lm.utils import load_tokenizer

    from tests.http.test_tool_loop_and_logprobs import fixture_copy

    template = "{% for m in messages %}{{ m.content }}{% endfor %}{# <tool_call> tool_call.name #}"
    folder = fixture_copy(tmp_path / "tools", template=template)
    output_format = ReplyFormat.of(load_tokenizer(folder))
    assert output_format.tool_parser is json_tools.parse_tool_call
    assert (output_format.tool_call_start, output_format.tool_call_end) == ("<tool_call>", "</tool_call>")
    assert output_format.parsing(ChatRequest(messages=USER, tools=TOOLS), ()) is not None


def test_masked_logprobs_are_reported_as_openais_unlikely_value() -> None:
    # A grammar or a logit bias leaves -inf in the top logprobs; JSON has no -inf, so the reply says -9999.0
    # as OpenAI does, and the token's own logprob stays as it was.
    chat = ChatRequest(messages=USER, sampling=SamplingParams(logprobs=True, top_logprobs=3))
    output = RequestOutput(tokenizer=tokenizer(), sampling=chat.sampling, eos_token_ids=frozenset({EOS}),
                           prompt_tokens=3, submitted_at=0.0, parsing=None)
    hello, nan = tokenizer().encode("Hello")[0], float("nan")
    out = output.add(hello, -0.25, ((hello, -0.25), (11, float("-inf")), (12, nan)), None, 1.0)
    final = output.final("length", 2.0)
    (item,) = [logprob for delta in (out.delta, final) if delta is not None for logprob in delta.logprobs]
    assert item.logprob == -0.25
    assert [value for _, value in item.top] == [-0.25, -9999.0, -9999.0]


@pytest.mark.parametrize("asked", [False, True])
def test_deltas_carry_progress_only_when_the_request_asks_for_timings(asked: bool) -> None:
    # llama.cpp's timings_per_token puts counts and times on every chunk; without it no delta pays for them.
    chat = ChatRequest(messages=USER, timings_per_token=asked)
    output = RequestOutput(tokenizer=tokenizer(), sampling=chat.sampling, eos_token_ids=frozenset({EOS}),
                           prompt_tokens=3, submitted_at=0.0, report_progress=chat.timings_per_token)
    deltas = [out.delta for token in tokenizer().encode("Hello there")
              if (out := output.add(token, -0.5, (), None, 2.0)).delta is not None]
    assert deltas
    if asked:
        assert all(delta.progress is not None and delta.progress.completion_tokens > 0 for delta in deltas)
        assert deltas[-1].progress.decode_seconds == 0.0
    else:
        assert all(delta.progress is None for delta in deltas)
