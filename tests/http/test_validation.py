"""Request validation: every rule has a bad case with its param, every good variant its values."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from mlxcel.http import validation
from mlxcel.http.validation import (
    Limits,
    decode_json_body,
    parse_chat_request,
    parse_completion_request,
    parse_native_completion,
)
from mlxcel.types import (
    CacheOptions,
    ChatRequest,
    CompletionRequest,
    InvalidRequest,
    SamplingParams,
)

ANON = "__mlxcel_anon__"
CAP = Limits().max_tokens_cap
USER = {"role": "user", "content": "hi"}
TOOL_F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [USER], **fields}


def message(**fields: Any) -> dict[str, Any]:
    return {"messages": [fields]}


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "hi", **fields}


def assert_well_formed(error: InvalidRequest) -> None:
    assert error.message
    assert error.param is None or isinstance(error.param, str)
    assert 400 <= error.status < 500
    json.dumps(error.to_body(), ensure_ascii=False).encode("utf-8")


def expect_invalid(parse: Any, body: object, param: str | None, code: str | None) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        parse(body)
    error = caught.value
    assert_well_formed(error)
    assert (error.param, error.status) == (param, 400), error.message
    if code is not None:
        assert error.code == code, error.message
    return error


MISSING = "missing_required_parameter"
TYPE = "invalid_type"
VALUE = "invalid_value"
UNSUPPORTED = "unsupported_parameter"

# Bad input shared by all three parsers: sampling and cache fields.
BAD_COMMON: list[tuple[dict[str, Any], str, str]] = [
    ({"temperature": -0.1}, "temperature", VALUE),
    ({"temperature": 2.01}, "temperature", VALUE),
    ({"temperature": "1"}, "temperature", TYPE),
    ({"temperature": True}, "temperature", TYPE),
    ({"temperature": math.nan}, "temperature", VALUE),
    ({"temperature": math.inf}, "temperature", VALUE),
    ({"temperature": 10**400}, "temperature", VALUE),
    ({"top_p": 0}, "top_p", VALUE),
    ({"top_p": 0.0}, "top_p", VALUE),
    ({"top_p": 1.5}, "top_p", VALUE),
    ({"top_p": [1]}, "top_p", TYPE),
    ({"stop": 5}, "stop", TYPE),
    ({"stop": ""}, "stop", VALUE),
    ({"stop": [""]}, "stop[0]", VALUE),
    ({"stop": ["a", 5]}, "stop[1]", TYPE),
    ({"stop": ["x"] * 17}, "stop", VALUE),
    ({"stop": ["x" * 1025]}, "stop[0]", VALUE),
    ({"stop": "\ud800"}, "stop", VALUE),
    ({"seed": 1.5}, "seed", TYPE),
    ({"seed": "1"}, "seed", TYPE),
    ({"seed": True}, "seed", TYPE),
    ({"seed": 2**64}, "seed", VALUE),
    ({"seed": -(2**63) - 1}, "seed", VALUE),
    ({"model": 5}, "model", TYPE),
    ({"stream": "yes"}, "stream", TYPE),
    ({"stream": 1}, "stream", TYPE),
    ({"extra_body": "x"}, "extra_body", TYPE),
    ({"cache_prompt": "false"}, "cache_prompt", TYPE),
    ({"cache_prompt": 0}, "cache_prompt", TYPE),
    ({"extra_body": {"cache_prompt": 0}}, "extra_body.cache_prompt", TYPE),
    # The root value wins, but a malformed nested one is still reported.
    ({"cache_prompt": True, "extra_body": {"cache_prompt": "no"}}, "extra_body.cache_prompt", TYPE),
    ({"prompt_cache_key": 5}, "prompt_cache_key", TYPE),
    ({"extra_body": {"prompt_cache_key": []}}, "extra_body.prompt_cache_key", TYPE),
    ({"user": 5}, "user", TYPE),
    ({"prompt_cache_key": "k", "user": {"id": 1}}, "user", TYPE),
    ({"cache_salt": 5}, "cache_salt", TYPE),
    ({"cache_salt": "s" * 257}, "cache_salt", VALUE),
    ({"extra_body": {"cache_salt": False}}, "extra_body.cache_salt", TYPE),
]

# OpenAI's prompt_cache_retention: chat completions and /v1/completions (not llama.cpp's /completion).
BAD_OPENAI_RETENTION: list[tuple[dict[str, Any], str, str]] = [
    ({"prompt_cache_retention": "1h"}, "prompt_cache_retention", VALUE),
    ({"prompt_cache_retention": "24H"}, "prompt_cache_retention", VALUE),
    ({"prompt_cache_retention": 86400}, "prompt_cache_retention", VALUE),
    ({"prompt_cache_retention": True}, "prompt_cache_retention", VALUE),
    ({"extra_body": {"prompt_cache_retention": "forever"}}, "extra_body.prompt_cache_retention", VALUE),
    # The root value wins, but a malformed nested one is still reported.
    ({"prompt_cache_retention": "24h", "extra_body": {"prompt_cache_retention": ""}},
     "extra_body.prompt_cache_retention", VALUE),
]

BAD_OPENAI_SAMPLING: list[tuple[dict[str, Any], str, str]] = [
    ({"max_tokens": 0}, "max_tokens", VALUE),
    ({"max_tokens": -1}, "max_tokens", VALUE),
    ({"max_tokens": 5.0}, "max_tokens", TYPE),
    ({"max_tokens": True}, "max_tokens", TYPE),
    ({"max_tokens": "5"}, "max_tokens", TYPE),
    ({"max_tokens": CAP + 1}, "max_tokens", VALUE),
    ({"max_tokens": 10**30}, "max_tokens", VALUE),
    ({"max_completion_tokens": 0}, "max_completion_tokens", VALUE),
    ({"max_completion_tokens": 1.5}, "max_completion_tokens", TYPE),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens", VALUE),
    ({"n": 2}, "n", UNSUPPORTED),
    ({"n": 0}, "n", UNSUPPORTED),
    ({"n": 1.0}, "n", TYPE),
    ({"n": "1"}, "n", TYPE),
    ({"frequency_penalty": 2.5}, "frequency_penalty", VALUE),
    ({"frequency_penalty": "0"}, "frequency_penalty", TYPE),
    ({"presence_penalty": -2.01}, "presence_penalty", VALUE),
    ({"presence_penalty": math.nan}, "presence_penalty", VALUE),
    ({"top_k": -1}, "top_k", VALUE),
    ({"top_k": 1.5}, "top_k", TYPE),
    ({"extra_body": {"top_k": "5"}}, "extra_body.top_k", TYPE),
    # The root value wins, but a malformed nested one is still reported.
    ({"top_k": 5, "extra_body": {"top_k": -5}}, "extra_body.top_k", VALUE),
    ({"min_p": 1.01}, "min_p", VALUE),
    ({"min_p": -0.1}, "min_p", VALUE),
    ({"extra_body": {"min_p": True}}, "extra_body.min_p", TYPE),
    ({"repetition_penalty": 0}, "repetition_penalty", VALUE),
    ({"repetition_penalty": -1.0}, "repetition_penalty", VALUE),
    ({"repetition_penalty": 101}, "repetition_penalty", VALUE),
    ({"repetition_penalty": 0.009}, "repetition_penalty", VALUE),
    ({"extra_body": {"repetition_penalty": "1.1"}}, "extra_body.repetition_penalty", TYPE),
    ({"logit_bias": []}, "logit_bias", TYPE),
    ({"logit_bias": {"x": 1}}, "logit_bias", VALUE),
    ({"logit_bias": {"-1": 1}}, "logit_bias", VALUE),
    ({"logit_bias": {" 5": 1}}, "logit_bias", VALUE),
    ({"logit_bias": {"1.5": 1}}, "logit_bias", VALUE),
    ({"logit_bias": {str(2**31): 1}}, "logit_bias", VALUE),
    ({"logit_bias": {"9" * 5000: 1}}, "logit_bias", VALUE),
    ({"logit_bias": {"5": 100.5}}, "logit_bias.5", VALUE),
    ({"logit_bias": {"5": -101}}, "logit_bias.5", VALUE),
    ({"logit_bias": {"5": "1"}}, "logit_bias.5", TYPE),
    ({"logit_bias": {"5": False}}, "logit_bias.5", TYPE),
    ({"logit_bias": {"5": 1, "05": 2}}, "logit_bias.05", VALUE),
    ({"logit_bias": {str(index): 1 for index in range(1025)}}, "logit_bias", VALUE),
    ({"response_format": {"type": "grammar"}}, "response_format.type", UNSUPPORTED),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", MISSING),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name", MISSING),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}},
     "response_format.json_schema.strict", TYPE),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", MISSING),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
     "response_format.json_schema.schema", TYPE),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", VALUE),
    # Valid JSON Schema the grammar engine cannot enforce is refused by the router, once compiled
    # (tests/actors/test_grammar_check.py); one too large to compile is refused here.
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "patternProperties": {f"^a{i}": {"type": "string"} for i in range(65)}}}}},
     "response_format.json_schema.schema", "grammar_too_large"),
    ({"response_format": {}}, "response_format.type", MISSING),
    ({"response_format": "text"}, "response_format", TYPE),
    ({"top_logprobs": 2}, "top_logprobs", VALUE),
    ({"logprobs": False, "top_logprobs": 0}, "top_logprobs", VALUE),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", VALUE),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", VALUE),
    ({"logprobs": True, "top_logprobs": 1.0}, "top_logprobs", TYPE),
    ({"stream_options": []}, "stream_options", TYPE),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", TYPE),
]

BAD_CHAT_ONLY: list[tuple[object, str | None, str]] = [
    ([], None, TYPE),
    ("hi", None, TYPE),
    (None, None, TYPE),
    ({}, "messages", MISSING),
    ({"messages": None}, "messages", MISSING),
    ({"messages": "hi"}, "messages", TYPE),
    ({"messages": {"role": "user"}}, "messages", TYPE),
    ({"messages": []}, "messages", VALUE),
    ({"messages": [USER, "hi"]}, "messages[1]", TYPE),
    (message(content="hi"), "messages[0].role", MISSING),
    (message(role="robot", content="hi"), "messages[0].role", VALUE),
    (message(role=5, content="hi"), "messages[0].role", TYPE),
    (message(role="user"), "messages[0].content", MISSING),
    (message(role="user", content=None), "messages[0].content", MISSING),
    (message(role="assistant"), "messages[0].content", MISSING),
    (message(role="assistant", tool_calls=[]), "messages[0].content", MISSING),
    (message(role="tool", tool_call_id="c1"), "messages[0].content", MISSING),
    (message(role="user", content=5), "messages[0].content", TYPE),
    (message(role="user", content={"type": "text"}), "messages[0].content", TYPE),
    (message(role="user", content="\udfff"), "messages[0].content", VALUE),
    (message(role="user", content=["hi"]), "messages[0].content[0]", TYPE),
    (message(role="user", content=[{"text": "hi"}]), "messages[0].content[0].type", MISSING),
    (message(role="user", content=[{"type": "text"}]), "messages[0].content[0].text", MISSING),
    (message(role="user", content=[{"type": "text", "text": 5}]), "messages[0].content[0].text", TYPE),
    (message(role="user", content=[{"type": "video", "text": "x"}]), "messages[0].content[0].type", VALUE),
    (message(role="user", content=[{"type": ["text"]}]), "messages[0].content[0].type", VALUE),
    (
        {
            "messages": [
                USER,
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
                    ],
                },
            ]
        },
        "messages[1].content[1].image_url.url",
        VALUE,
    ),
    (
        message(role="user", content=[{"type": "input_audio", "input_audio": {}}]),
        "messages[0].content[0]",
        "unsupported_content",
    ),
    (message(role="user", content="hi", name=5), "messages[0].name", TYPE),
    (message(role="tool", content="42", tool_call_id=7), "messages[0].tool_call_id", TYPE),
    (message(role="assistant", content="x", reasoning_content=1), "messages[0].reasoning_content", TYPE),
    (
        message(role="user", content="x", tool_calls=[{"function": {"name": "f", "arguments": "{}"}}]),
        "messages[0].tool_calls",
        VALUE,
    ),
    (message(role="assistant", tool_calls="f()"), "messages[0].tool_calls", TYPE),
    (message(role="assistant", tool_calls=[5]), "messages[0].tool_calls[0]", TYPE),
    (message(role="assistant", tool_calls=[{"id": "c"}]), "messages[0].tool_calls[0].function", MISSING),
    (
        message(role="assistant", tool_calls=[{"id": 1, "function": {"name": "f", "arguments": "{}"}}]),
        "messages[0].tool_calls[0].id",
        TYPE,
    ),
    (
        message(role="assistant", tool_calls=[{"type": "x", "function": {"name": "f", "arguments": "{}"}}]),
        "messages[0].tool_calls[0].type",
        VALUE,
    ),
    (
        message(role="assistant", tool_calls=[{"function": {"arguments": "{}"}}]),
        "messages[0].tool_calls[0].function.name",
        MISSING,
    ),
    (
        message(role="assistant", tool_calls=[{"function": {"name": "f"}}]),
        "messages[0].tool_calls[0].function.arguments",
        MISSING,
    ),
    (
        message(role="assistant", tool_calls=[{"function": {"name": "f", "arguments": 5}}]),
        "messages[0].tool_calls[0].function.arguments",
        TYPE,
    ),
    (
        message(role="assistant", tool_calls=[{"function": {"name": "f", "arguments": {"x": math.inf}}}]),
        "messages[0].tool_calls[0].function.arguments.x",
        VALUE,
    ),
    (chat(logprobs=1), "logprobs", TYPE),
    (chat(logprobs="true"), "logprobs", TYPE),
    (chat(tools={"type": "function"}), "tools", TYPE),
    (chat(tools=[5]), "tools[0]", TYPE),
    (chat(tools=[{"function": {"name": "f"}}]), "tools[0].type", MISSING),
    (chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools[0].type", VALUE),
    (chat(tools=[{"type": "function"}]), "tools[0].function", MISSING),
    (chat(tools=[{"type": "function", "function": "f"}]), "tools[0].function", TYPE),
    (chat(tools=[{"type": "function", "function": {}}]), "tools[0].function.name", MISSING),
    (chat(tools=[{"type": "function", "function": {"name": ""}}]), "tools[0].function.name", VALUE),
    (
        chat(tools=[{"type": "function", "function": {"name": "f", "description": 5}}]),
        "tools[0].function.description",
        TYPE,
    ),
    (
        chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "{}"}}]),
        "tools[0].function.parameters",
        TYPE,
    ),
    (
        chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"x": math.nan}}}]),
        "tools[0].function.parameters.x",
        VALUE,
    ),
    (chat(tools=[TOOL_F, TOOL_F]), "tools[1].function.name", VALUE),
    (chat(tool_choice="sometimes"), "tool_choice", VALUE),
    (chat(tool_choice=5), "tool_choice", TYPE),
    (chat(tool_choice="required"), "tool_choice", VALUE),
    (chat(tools=[], tool_choice="required"), "tool_choice", VALUE),
    (chat(tools=[TOOL_F], tool_choice={"function": {"name": "f"}}), "tool_choice.type", MISSING),
    (chat(tools=[TOOL_F], tool_choice={"type": "tool", "name": "f"}), "tool_choice.type", VALUE),
    (chat(tools=[TOOL_F], tool_choice={"type": "function"}), "tool_choice.function", MISSING),
    (
        chat(tools=[TOOL_F], tool_choice={"type": "function", "function": {"name": "g"}}),
        "tool_choice.function.name",
        VALUE,
    ),
    (
        chat(tool_choice={"type": "function", "function": {"name": "f"}}),
        "tool_choice.function.name",
        VALUE,
    ),
    (chat(chat_template_kwargs="x"), "chat_template_kwargs", TYPE),
    (chat(chat_template_kwargs={"a": math.inf}), "chat_template_kwargs.a", VALUE),
    (chat(extra_body={"chat_template_kwargs": 5}), "extra_body.chat_template_kwargs", TYPE),
    # A bad key is reported before its value, so the param never holds a surrogate.
    (chat(chat_template_kwargs={"\ud800": math.nan}), "chat_template_kwargs", VALUE),
]


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = {"a": value}
    return value


def _cases(rows: list[tuple[Any, Any, str]], build: Any) -> list[Any]:
    return [
        pytest.param(build(fields), param, code, id=f"{param}-{index}")
        for index, (fields, param, code) in enumerate(rows)
    ]


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [pytest.param(body, param, code, id=f"{param}-{i}") for i, (body, param, code) in enumerate(BAD_CHAT_ONLY)]
    + _cases(BAD_COMMON + BAD_OPENAI_SAMPLING + BAD_OPENAI_RETENTION, lambda fields: chat(**fields)),
)
def test_bad_chat_request(body: object, param: str | None, code: str) -> None:
    expect_invalid(parse_chat_request, body, param, code)


BAD_COMPLETION_ONLY: list[tuple[object, str | None, str]] = [
    ([1, 2], None, TYPE),
    ({}, "prompt", MISSING),
    ({"prompt": None}, "prompt", MISSING),
    ({"prompt": 5}, "prompt", TYPE),
    ({"prompt": {"text": "hi"}}, "prompt", TYPE),
    ({"prompt": ""}, "prompt", VALUE),
    ({"prompt": []}, "prompt", VALUE),
    ({"prompt": "\ud800x"}, "prompt", VALUE),
    ({"prompt": ["a", "b"]}, "prompt", UNSUPPORTED),
    ({"prompt": [[1], [2]]}, "prompt", UNSUPPORTED),
    ({"prompt": [""]}, "prompt[0]", VALUE),
    ({"prompt": [[]]}, "prompt[0]", VALUE),
    ({"prompt": [[1, "x"]]}, "prompt[0][1]", TYPE),
    ({"prompt": [1, "a"]}, "prompt[1]", TYPE),
    ({"prompt": [1, 2.0]}, "prompt[1]", TYPE),
    ({"prompt": [True]}, "prompt[0]", TYPE),
    ({"prompt": [-1]}, "prompt[0]", VALUE),
    ({"prompt": [2**31]}, "prompt[0]", VALUE),
    ({"prompt": [1, [2]]}, "prompt[1]", TYPE),
    (completion(echo=True), "echo", UNSUPPORTED),
    (completion(echo="no"), "echo", TYPE),
    (completion(best_of=2), "best_of", UNSUPPORTED),
    (completion(best_of=1.0), "best_of", TYPE),
    (completion(suffix="}"), "suffix", UNSUPPORTED),
    (completion(suffix=1), "suffix", TYPE),
    (completion(logprobs=21), "logprobs", VALUE),
    (completion(logprobs=-1), "logprobs", VALUE),
    (completion(logprobs=2.0), "logprobs", TYPE),
    (completion(logprobs="2"), "logprobs", TYPE),
    (completion(logprobs=2, top_logprobs=2), "top_logprobs", VALUE),
]


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        pytest.param(body, param, code, id=f"{param}-{i}")
        for i, (body, param, code) in enumerate(BAD_COMPLETION_ONLY)
    ]
    + _cases(BAD_COMMON + BAD_OPENAI_SAMPLING + BAD_OPENAI_RETENTION, lambda fields: completion(**fields)),
)
def test_bad_completion_request(body: object, param: str | None, code: str) -> None:
    expect_invalid(parse_completion_request, body, param, code)


BAD_NATIVE_ONLY: list[tuple[object, str | None, str]] = [
    ("prompt", None, TYPE),
    ({}, "prompt", MISSING),
    ({"prompt": 3}, "prompt", TYPE),
    ({"prompt": ""}, "prompt", VALUE),
    ({"prompt": []}, "prompt", VALUE),
    ({"prompt": ["hi"]}, "prompt[0]", TYPE),
    ({"prompt": [1, -5]}, "prompt[1]", VALUE),
    (completion(n_predict=0), "n_predict", VALUE),
    (completion(n_predict=-2), "n_predict", VALUE),
    (completion(n_predict=CAP + 1), "n_predict", VALUE),
    (completion(n_predict=1.5), "n_predict", TYPE),
    (completion(n_predict="8"), "n_predict", TYPE),
    (completion(max_tokens=0), "max_tokens", VALUE),
    (completion(seed=-1.0), "seed", TYPE),
    (completion(top_k=-1), "top_k", VALUE),
    (completion(min_p=2), "min_p", VALUE),
    (completion(repeat_penalty=0), "repeat_penalty", VALUE),
    (completion(repeat_penalty="1.1"), "repeat_penalty", TYPE),
    (completion(presence_penalty=3), "presence_penalty", VALUE),
    (completion(frequency_penalty=-2.5), "frequency_penalty", VALUE),
    (completion(logit_bias=5), "logit_bias", TYPE),
    (completion(logit_bias=[5]), "logit_bias[0]", TYPE),
    (completion(logit_bias=[[5, 1, 2]]), "logit_bias[0]", TYPE),
    (completion(logit_bias=[["Hello", 1.0]]), "logit_bias[0][0]", UNSUPPORTED),
    (completion(logit_bias=[[-1, 1.0]]), "logit_bias[0][0]", VALUE),
    (completion(logit_bias=[[5, 101]]), "logit_bias[0][1]", VALUE),
    (completion(logit_bias=[[5, True]]), "logit_bias[0][1]", TYPE),
    (completion(logit_bias=[[5, 1], [5, 2]]), "logit_bias[1]", VALUE),
    (completion(logit_bias={"5": "x"}), "logit_bias.5", TYPE),
    (completion(logit_bias={"a": 1}), "logit_bias", VALUE),
]


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        pytest.param(body, param, code, id=f"{param}-{i}")
        for i, (body, param, code) in enumerate(BAD_NATIVE_ONLY)
    ]
    + _cases(BAD_COMMON, lambda fields: completion(**fields)),
)
def test_bad_native_completion(body: object, param: str | None, code: str) -> None:
    expect_invalid(parse_native_completion, body, param, code)


def test_error_messages_name_the_field_and_the_problem() -> None:
    error = expect_invalid(
        parse_chat_request, message(role="robot", content="x"), "messages[0].role", VALUE
    )
    assert "robot" in error.message
    assert "assistant" in error.message
    error = expect_invalid(
        parse_chat_request,
        message(role="user", content=[{"type": "input_audio", "input_audio": {}}]),
        "messages[0].content[0]",
        "unsupported_content",
    )
    assert error.message == "multimodal input is not supported by this model"
    error = expect_invalid(parse_chat_request, chat(temperature=3), "temperature", VALUE)
    assert "temperature" in error.message
    assert "[0, 2]" in error.message
    error = expect_invalid(parse_chat_request, chat(max_tokens=5.0), "max_tokens", TYPE)
    assert "integer" in error.message
    # Large values are described, not echoed.
    error = expect_invalid(parse_chat_request, chat(seed=10**5000), "seed", VALUE)
    assert len(error.message) < 200
    error = expect_invalid(parse_chat_request, message(role="x" * 10_000, content=""), "messages[0].role", VALUE)
    assert len(error.message) < 200


def test_nesting_past_the_depth_limit_is_refused() -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_chat_request(chat(chat_template_kwargs=_nested(100)))
    assert_well_formed(caught.value)
    assert caught.value.param == "chat_template_kwargs" + ".a" * 65
    assert parse_chat_request(chat(chat_template_kwargs=_nested(30))).chat_template_kwargs == _nested(30)


@pytest.mark.parametrize(
    ("limits", "fields", "param"),
    [
        (Limits(max_messages=2), {"messages": [USER] * 3}, "messages"),
        (Limits(max_stop_strings=1), {"stop": ["a", "b"]}, "stop"),
        (Limits(max_stop_string_chars=3), {"stop": "abcd"}, "stop"),
        (Limits(max_tokens_cap=100), {"max_tokens": 101}, "max_tokens"),
        (Limits(max_top_logprobs=5), {"logprobs": True, "top_logprobs": 6}, "top_logprobs"),
    ],
)
def test_limits_are_configurable(limits: Limits, fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_chat_request(chat(**fields), limits=limits)
    assert caught.value.param == param
    parse_chat_request(chat(**fields))  # within the default limits


# --- good chat requests -------------------------------------------------------


def test_minimal_chat_request_gets_defaults() -> None:
    request = parse_chat_request({"messages": [USER]})
    assert request == ChatRequest(
        messages=({"role": "user", "content": "hi"},),
        sampling=SamplingParams(),
        cache=CacheOptions(),
    )
    assert request.tools is None
    assert request.tool_choice is None
    assert request.chat_template_kwargs == {}
    assert (request.stream, request.include_usage, request.model) == (False, False, None)


def test_messages_are_normalised() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    body = {
        "messages": [
            {"role": "system", "content": "be brief", "extra": "dropped"},
            {"role": "developer", "content": []},
            {
                "role": "user",
                "name": "ann",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b", "cache_control": {}}],
            },
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "assistant", "tool_calls": [{"function": {"name": "g", "arguments": {"y": [1]}}}]},
            {"role": "tool", "content": [{"type": "text", "text": "42"}], "tool_call_id": "c1"},
            {"role": "assistant", "content": "done", "tool_calls": [], "reasoning_content": "hm"},
            {"role": "user", "content": "ok", "tool_call_id": "ignored on user"},
        ]
    }
    request = parse_chat_request(body)
    assert request.messages == (
        {"role": "system", "content": "be brief"},
        {"role": "developer", "content": ""},
        {"role": "user", "content": "ab", "name": "ann"},
        # Null content renders as ""; a JSON-string arguments is parsed, as templates expect.
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "g", "arguments": {"y": [1]}}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "assistant", "content": "done", "reasoning_content": "hm"},
        {"role": "user", "content": "ok"},
    )
    assert type(request.messages) is tuple
    assert all(type(m) is dict for m in request.messages)
    # Nothing mutable is shared with the caller's body.
    body["messages"][3]["tool_calls"][0]["function"]["name"] = "changed"
    assert request.messages[3]["tool_calls"][0]["function"]["name"] == "f"


def test_tool_call_arguments_that_are_not_a_json_object_stay_as_sent() -> None:
    for arguments in ("not json", "[1, 2]"):
        call = {"function": {"name": "f", "arguments": arguments}}
        request = parse_chat_request({"messages": [{"role": "assistant", "content": None, "tool_calls": [call]}]})
        assert request.messages[0]["tool_calls"][0]["function"]["arguments"] == arguments


GOOD_SAMPLING: list[tuple[dict[str, Any], SamplingParams]] = [
    ({"temperature": 0}, SamplingParams(temperature=0.0)),
    ({"temperature": 2, "top_p": 1}, SamplingParams(temperature=2.0)),
    ({"temperature": 0.7, "top_p": 0.01}, SamplingParams(temperature=0.7, top_p=0.01)),
    ({"stop": "END"}, SamplingParams(stop=("END",))),
    ({"stop": ["a", "b" * 1024]}, SamplingParams(stop=("a", "b" * 1024))),
    ({"stop": ["x"] * 16}, SamplingParams(stop=("x",) * 16)),
    ({"stop": []}, SamplingParams()),
    ({"seed": 42}, SamplingParams(seed=42)),
    ({"seed": 0}, SamplingParams(seed=0)),
    ({"seed": -1}, SamplingParams(seed=2**64 - 1)),
    ({"seed": -(2**63)}, SamplingParams(seed=2**63)),
    ({"seed": 2**64 - 1}, SamplingParams(seed=2**64 - 1)),
    (
        {"temperature": None, "top_p": None, "stop": None, "seed": None, "max_tokens": None},
        SamplingParams(),
    ),
]

GOOD_OPENAI_SAMPLING: list[tuple[dict[str, Any], SamplingParams]] = [
    ({"max_tokens": 1}, SamplingParams(max_tokens=1)),
    ({"max_tokens": CAP}, SamplingParams(max_tokens=CAP)),
    ({"max_completion_tokens": 7}, SamplingParams(max_tokens=7)),
    ({"max_tokens": 7, "max_completion_tokens": 7}, SamplingParams(max_tokens=7)),
    ({"max_tokens": None, "max_completion_tokens": 9}, SamplingParams(max_tokens=9)),
    ({"n": 1, "frequency_penalty": 2, "presence_penalty": -2.0},
     SamplingParams(frequency_penalty=2.0, presence_penalty=-2.0)),
    ({"n": None, "frequency_penalty": None, "presence_penalty": 0, "logit_bias": None}, SamplingParams()),
    # Ids ascending; a zero bias changes nothing and is dropped.
    ({"logit_bias": {"7": -100, "5": 10, "6": 0}}, SamplingParams(logit_bias=((5, 10.0), (7, -100.0)))),
    ({"logit_bias": {}}, SamplingParams()),
    ({"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1},
     SamplingParams(top_k=40, min_p=0.05, repetition_penalty=1.1)),
    ({"extra_body": {"top_k": 3, "min_p": 1, "repetition_penalty": 0.01}},
     SamplingParams(top_k=3, min_p=1.0, repetition_penalty=0.01)),
    ({"top_k": 0, "extra_body": {"top_k": 9}}, SamplingParams()),
    ({"top_k": None, "extra_body": {"top_k": 9}}, SamplingParams(top_k=9)),
    # Greedy with penalties still applies them (the device does).
    ({"temperature": 0, "frequency_penalty": 0.5}, SamplingParams(temperature=0.0, frequency_penalty=0.5)),
    ({"response_format": {"type": "text"}, "response_format_extra": 1}, SamplingParams()),
    ({"logprobs": False}, SamplingParams()),
    ({"logprobs": True}, SamplingParams(logprobs=True)),
    ({"logprobs": True, "top_logprobs": 20}, SamplingParams(logprobs=True, top_logprobs=20)),
    ({"logprobs": True, "top_logprobs": 0}, SamplingParams(logprobs=True)),
    ({"logprobs": None, "top_logprobs": None}, SamplingParams()),
]


@pytest.mark.parametrize(("fields", "expected"), GOOD_SAMPLING + GOOD_OPENAI_SAMPLING)
def test_chat_sampling(fields: dict[str, Any], expected: SamplingParams) -> None:
    assert parse_chat_request(chat(**fields)).sampling == expected


GOOD_CACHE: list[tuple[dict[str, Any], CacheOptions]] = [
    ({}, CacheOptions(cache_prompt=True, session_key=ANON, cache_salt="")),
    ({"cache_prompt": False}, CacheOptions(cache_prompt=False)),
    ({"extra_body": {"cache_prompt": False}}, CacheOptions(cache_prompt=False)),
    ({"cache_prompt": True, "extra_body": {"cache_prompt": False}}, CacheOptions(cache_prompt=True)),
    ({"cache_prompt": None, "extra_body": {"cache_prompt": False}}, CacheOptions(cache_prompt=False)),
    ({"extra_body": None}, CacheOptions()),
    ({"prompt_cache_key": "conv-1", "user": "ann"}, CacheOptions(session_key="conv-1")),
    (
        {"prompt_cache_key": "root", "extra_body": {"prompt_cache_key": "nested"}},
        CacheOptions(session_key="root"),
    ),
    (
        {"prompt_cache_key": "", "extra_body": {"prompt_cache_key": "nested"}, "user": "ann"},
        CacheOptions(session_key="nested"),
    ),
    ({"extra_body": {"prompt_cache_key": ""}, "user": "ann"}, CacheOptions(session_key="ann")),
    ({"prompt_cache_key": None, "user": "ann"}, CacheOptions(session_key="ann")),
    ({"user": ""}, CacheOptions(session_key=ANON)),
    ({"user": None, "prompt_cache_key": ""}, CacheOptions(session_key=ANON)),
    ({"cache_salt": "s" * 256}, CacheOptions(cache_salt="s" * 256)),
    ({"extra_body": {"cache_salt": "tenant-a"}}, CacheOptions(cache_salt="tenant-a")),
    ({"cache_salt": "root", "extra_body": {"cache_salt": "nested"}}, CacheOptions(cache_salt="root")),
]


def test_response_format_json_compiles_a_grammar_on_both_openai_routes() -> None:
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
    named = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}
    # strict: true closes the object (OpenAI's strict mode: no property beyond the schema's).
    closed = {**schema, "additionalProperties": False}
    for response_format, expected in ((named, closed), ({"type": "json_object"}, {"type": "object"})):
        for request in (parse_chat_request(chat(response_format=response_format)),
                        parse_completion_request({"prompt": "x", "response_format": response_format})):
            grammar = request.sampling.grammar
            assert grammar is not None
            (compiled,) = json.loads(grammar)["grammars"]
            assert {key: value for key, value in compiled["json_schema"].items() if key != "x-guidance"} == expected
    assert parse_chat_request(chat(response_format={"type": "text"})).sampling.grammar is None
    assert parse_chat_request(chat()).sampling.grammar is None


@pytest.mark.parametrize(("fields", "expected"), GOOD_CACHE)
def test_cache_options_on_every_route(fields: dict[str, Any], expected: CacheOptions) -> None:
    assert parse_chat_request(chat(**fields)).cache == expected
    assert parse_completion_request(completion(**fields)).cache == expected
    assert parse_native_completion(completion(**fields)).cache == expected


@pytest.mark.parametrize(("fields", "seconds"), [
    ({}, 0.0),
    ({"prompt_cache_retention": "in_memory"}, 0.0),
    ({"prompt_cache_retention": "24h"}, 86400.0),
    ({"prompt_cache_retention": None}, 0.0),
    ({"extra_body": {"prompt_cache_retention": "24h"}}, 86400.0),
    ({"prompt_cache_retention": "in_memory", "extra_body": {"prompt_cache_retention": "24h"}}, 0.0),
])
def test_prompt_cache_retention_on_the_openai_routes(fields: dict[str, Any], seconds: float) -> None:
    assert parse_chat_request(chat(**fields)).cache.retain_seconds == seconds
    assert parse_completion_request(completion(**fields)).cache.retain_seconds == seconds
    # llama.cpp's /completion has no such field: it is ignored there, as other unknown fields are.
    assert parse_native_completion(completion(**fields)).cache.retain_seconds == 0.0


def test_a_bad_retention_names_the_field_and_its_values() -> None:
    with pytest.raises(InvalidRequest, match=r"prompt_cache_retention must be 'in_memory' or '24h', got '1h'"):
        parse_chat_request(chat(prompt_cache_retention="1h"))


@pytest.mark.parametrize(
    ("fields", "stream", "include_usage"),
    [
        ({}, False, False),
        ({"stream": True}, True, False),
        ({"stream": True, "stream_options": {"include_usage": True}}, True, True),
        ({"stream": True, "stream_options": {"include_usage": None}}, True, False),
        ({"stream": True, "stream_options": {}}, True, False),
        ({"stream": False, "stream_options": {"include_usage": True}}, False, False),
        ({"stream": None, "stream_options": None}, False, False),
    ],
)
def test_stream_flags(fields: dict[str, Any], stream: bool, include_usage: bool) -> None:
    for parse, body in ((parse_chat_request, chat(**fields)), (parse_completion_request, completion(**fields))):
        request = parse(body)
        assert (request.stream, request.include_usage) == (stream, include_usage)


def test_tools_and_tool_choice() -> None:
    tool_g = {"type": "function", "function": {"name": "g", "description": "G", "strict": True}}
    request = parse_chat_request(
        chat(tools=[TOOL_F, tool_g], tool_choice={"type": "function", "function": {"name": "g"}})
    )
    assert request.tools == (TOOL_F, tool_g)
    assert request.tool_choice == {"type": "function", "function": {"name": "g"}}
    for mode in ("auto", "none", "required"):
        assert parse_chat_request(chat(tools=[TOOL_F], tool_choice=mode)).tool_choice == mode
    assert parse_chat_request(chat(tool_choice="auto")).tool_choice == "auto"
    assert parse_chat_request(chat(tool_choice="none", tools=None)).tool_choice == "none"
    assert parse_chat_request(chat(tools=[])).tools is None


def test_chat_template_kwargs_merge_with_root_winning() -> None:
    body = chat(
        chat_template_kwargs={"enable_thinking": False},
        extra_body={"chat_template_kwargs": {"enable_thinking": True, "x": [1]}},
    )
    assert parse_chat_request(body).chat_template_kwargs == {"enable_thinking": False, "x": [1]}
    nested_only = chat(extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert parse_chat_request(nested_only).chat_template_kwargs == {"enable_thinking": True}


def test_unknown_fields_are_ignored() -> None:
    body = chat(
        model="m",
        metadata={"a": "b"},
        service_tier="auto",
        store=False,
        extra_body={"whatever": [math.nan]},
        n_predict="ignored on chat",
        unknown=object(),
    )
    request = parse_chat_request(body)
    assert request.model == "m"
    assert request.sampling == SamplingParams()


def test_parallel_tool_calls_is_carried_to_the_request() -> None:
    for value, expected in ((True, True), (None, True), (False, False)):
        assert parse_chat_request(chat(tools=[TOOL_F], parallel_tool_calls=value)).parallel_tool_calls is expected
    expect_invalid(parse_chat_request, chat(parallel_tool_calls="no"), "parallel_tool_calls", TYPE)


# --- good completions ---------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hi", "hi"),
        (["hi"], "hi"),
        ([0, 1, 2**31 - 1], (0, 1, 2**31 - 1)),
        ([[5, 6]], (5, 6)),
        ("héllo 👋", "héllo 👋"),
    ],
)
def test_completion_prompt_forms(prompt: object, expected: object) -> None:
    request = parse_completion_request({"prompt": prompt})
    assert request.prompt == expected
    assert isinstance(request, CompletionRequest)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, SamplingParams(max_tokens=16)),
        ({"max_tokens": None}, SamplingParams(max_tokens=16)),
        ({"max_tokens": 100}, SamplingParams(max_tokens=100)),
        ({"echo": False, "best_of": 1, "suffix": ""}, SamplingParams(max_tokens=16)),
        ({"echo": None, "best_of": None, "suffix": None}, SamplingParams(max_tokens=16)),
        ({"logprobs": 0}, SamplingParams(max_tokens=16, logprobs=True, top_logprobs=0)),
        ({"logprobs": 5}, SamplingParams(max_tokens=16, logprobs=True, top_logprobs=5)),
        ({"logprobs": True, "top_logprobs": 3}, SamplingParams(max_tokens=16, logprobs=True, top_logprobs=3)),
        ({"logprobs": False}, SamplingParams(max_tokens=16)),
    ]
    + [(fields, attrs.evolve(expected, max_tokens=16)) for fields, expected in GOOD_SAMPLING],
)
def test_completion_sampling(fields: dict[str, Any], expected: SamplingParams) -> None:
    assert parse_completion_request(completion(**fields)).sampling == expected


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, SamplingParams()),
        ({"n_predict": -1}, SamplingParams()),
        ({"n_predict": 1}, SamplingParams(max_tokens=1)),
        ({"n_predict": CAP}, SamplingParams(max_tokens=CAP)),
        ({"max_tokens": 7}, SamplingParams(max_tokens=7)),
        ({"n_predict": 3, "max_tokens": 7}, SamplingParams(max_tokens=3)),
        ({"n_predict": -1, "max_tokens": 7}, SamplingParams()),
        ({"seed": -1}, SamplingParams()),
        ({"seed": 123}, SamplingParams(seed=123)),
        ({"seed": -2}, SamplingParams(seed=2**64 - 2)),
        ({"temperature": 0, "top_p": 0.9, "stop": ["\n\n"]}, SamplingParams(temperature=0.0, top_p=0.9, stop=("\n\n",))),
        # Not read on the native route: llama.cpp has its own names for these.
        ({"logprobs": True, "n": 4, "echo": True, "repetition_penalty": 0}, SamplingParams()),
        ({"top_k": 40, "min_p": 0.05, "repeat_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -1},
         SamplingParams(top_k=40, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=-1.0)),
        # llama.cpp's pairs (false bans the token) and the OpenAI object form.
        ({"logit_bias": [[15043, 1.0], [7, False], [9, 0]]}, SamplingParams(logit_bias=((7, -math.inf), (15043, 1.0)))),
        ({"logit_bias": {"15043": -2, "7": False}}, SamplingParams(logit_bias=((7, -math.inf), (15043, -2.0)))),
        ({"logit_bias": []}, SamplingParams()),
    ],
)
def test_native_sampling(fields: dict[str, Any], expected: SamplingParams) -> None:
    assert parse_native_completion(completion(**fields)).sampling == expected


def test_native_completion_fields() -> None:
    request = parse_native_completion(
        {"prompt": [1, 2, 3], "stream": True, "cache_prompt": False, "model": "m", "n_probs": 3,
         "return_tokens": True}
    )
    assert request == CompletionRequest(
        prompt=(1, 2, 3),
        # n_probs is llama.cpp's top-N log-probabilities.
        sampling=SamplingParams(logprobs=True, top_logprobs=3),
        cache=CacheOptions(cache_prompt=False),
        model="m",
        stream=True,
        include_usage=False,
        return_tokens=True,
    )


# --- decode_json_body -----------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b'{"a": 1}', {"a": 1}),
        (b' \n{"messages": [], "x": 1.5e3}\n ', {"messages": [], "x": 1500.0}),
        ('{"t": "h\u00e9 \\ud83d\\udc4b"}'.encode(), {"t": "hé 👋"}),
        (b'{"n": 1e-400}', {"n": 0.0}),
        (b"{}", {}),
    ],
)
def test_decode_good_bodies(raw: bytes, expected: object) -> None:
    assert decode_json_body(raw, max_bytes=1024) == expected


@pytest.mark.parametrize(
    ("raw", "status", "code"),
    [
        (b'{"a": "' + b"x" * 100 + b'"}', 413, "request_too_large"),
        (b'{"a": "\xff"}', 400, "invalid_json"),
        (b'{"a": "\xed\xa0\x80"}', 400, "invalid_json"),  # an encoded surrogate
        (b'{"a": 1', 400, "invalid_json"),
        (b"{'a': 1}", 400, "invalid_json"),
        (b'{"a": 1}{"b": 2}', 400, "invalid_json"),
        (b'{"a": NaN}', 400, "invalid_json"),
        (b'{"a": [Infinity]}', 400, "invalid_json"),
        (b'{"a": -Infinity}', 400, "invalid_json"),
        (b'{"a": 1e999}', 400, "invalid_json"),
        (b'{"a": -1e999}', 400, "invalid_json"),
        (b'{"a": ' + b"9" * 5000 + b"}", 400, "invalid_json"),
        (b"[" * 50_000 + b"]" * 50_000, 400, "invalid_json"),
        (b"\xef\xbb\xbf{}", 400, "invalid_json"),  # a UTF-8 byte-order mark
        (b"", 400, "invalid_json"),
        (b"  \n", 400, "invalid_json"),
        (b"[]", 400, "invalid_type"),
        (b'"hi"', 400, "invalid_type"),
        (b"null", 400, "invalid_type"),
        (b"42", 400, "invalid_type"),
    ],
)
def test_decode_bad_bodies(raw: bytes, status: int, code: str) -> None:
    max_bytes = 64 if status == 413 else 1 << 20
    with pytest.raises(InvalidRequest) as caught:
        decode_json_body(raw, max_bytes=max_bytes)
    error = caught.value
    assert_well_formed(error)
    assert (error.status, error.code, error.param) == (status, code, None), error.message


def test_decode_size_limit_is_inclusive() -> None:
    raw = b'{"a": "xyz"}'
    assert decode_json_body(raw, max_bytes=len(raw)) == {"a": "xyz"}
    with pytest.raises(InvalidRequest) as caught:
        decode_json_body(raw, max_bytes=len(raw) - 1)
    assert caught.value.status == 413


def test_decoded_lone_surrogate_is_caught_by_the_parser() -> None:
    body = decode_json_body(b'{"messages": [{"role": "user", "content": "\\ud800"}]}', max_bytes=1024)
    expect_invalid(parse_chat_request, body, "messages[0].content", VALUE)


def test_module_is_pure() -> None:
    tree = ast.parse(Path(validation.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"trio", "quart", "quart_trio", "mlx", "mlx_lm", "hypercorn"}


# --- properties -------------------------------------------------------------------

PARSERS = [
    (parse_chat_request, ChatRequest),
    (parse_completion_request, CompletionRequest),
    (parse_native_completion, CompletionRequest),
]

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, 1, -1, 2, 16, 2**31, 2**64])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["", "text", "user", "assistant", "tool", "function", "auto", "image_url", "\ud800"])
)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
FIELDS = [
    "messages", "prompt", "model", "stream", "stream_options", "temperature", "top_p",
    "max_tokens", "max_completion_tokens", "n_predict", "stop", "seed", "logprobs",
    "top_logprobs", "n", "frequency_penalty", "presence_penalty", "tools", "tool_choice",
    "top_k", "min_p", "repetition_penalty", "repeat_penalty", "logit_bias", "response_format",
    "parallel_tool_calls",
    "chat_template_kwargs", "extra_body", "cache_prompt", "prompt_cache_key", "user",
    "cache_salt", "echo", "best_of", "suffix", "prompt_cache_retention",
]  # fmt: skip
field_bodies = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6)

def mostly(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Usually a valid value, sometimes any JSON value: bodies that get past the first check."""
    return st.sampled_from([False] * 15 + [True]).flatmap(lambda wrong: json_values if wrong else valid)


short_text = st.text(max_size=8)
part = st.fixed_dictionaries(
    {
        "type": mostly(st.sampled_from(["text"] * 6 + ["image_url", "input_audio", "video"])),
        "text": mostly(short_text),
    },
    optional={"image_url": json_values},
)
tool_call = st.fixed_dictionaries(
    {
        "function": mostly(
            st.fixed_dictionaries(
                {"name": mostly(st.sampled_from(["f", "f", "f", ""])), "arguments": mostly(st.just("{}"))}
            )
        )
    },
    optional={"id": mostly(short_text), "type": mostly(st.just("function"))},
)
chat_message = st.fixed_dictionaries(
    {
        "role": mostly(st.sampled_from([*validation.ROLES, *validation.ROLES, "robot"])),
        "content": mostly(st.one_of(short_text, short_text, st.lists(part, max_size=3), st.none())),
    },
    optional={
        "name": mostly(short_text),
        "tool_calls": mostly(st.lists(tool_call, max_size=2)),
        "tool_call_id": mostly(short_text),
    },
)
tool = st.fixed_dictionaries(
    {
        "type": mostly(st.just("function")),
        "function": mostly(
            st.fixed_dictionaries(
                {"name": mostly(st.sampled_from(["f", "g", "g", ""]))},
                optional={"description": mostly(short_text), "parameters": mostly(st.just({"type": "object"}))},
            )
        ),
    },
)
plausible_chat = st.fixed_dictionaries(
    {
        "messages": mostly(st.lists(chat_message, min_size=1, max_size=3)),
        # The completions routes' prompt, so their parsers get past their first check too.
        "prompt": mostly(
            st.one_of(st.text(min_size=1, max_size=8), st.lists(st.integers(0, 2**31), min_size=1, max_size=4))
        ),
    },
    optional={
        "temperature": mostly(st.floats(-0.5, 2.5)),
        "top_p": mostly(st.floats(-0.5, 1.5)),
        "max_tokens": mostly(st.integers(-2, CAP + 2)),
        "max_completion_tokens": mostly(st.integers(-2, CAP + 2)),
        "stop": mostly(st.one_of(short_text, st.lists(short_text, max_size=18))),
        "seed": mostly(st.integers(-(2**64), 2**65)),
        "logprobs": mostly(st.booleans()),
        "top_logprobs": mostly(st.integers(-1, 22)),
        "n": mostly(st.sampled_from([1, 1, 1, 2])),
        "tools": mostly(st.lists(tool, max_size=2)),
        "tool_choice": mostly(
            st.one_of(
                st.sampled_from(["auto", "none", "required", "x"]),
                st.fixed_dictionaries(
                    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "h"])})}
                ),
            )
        ),
        "stream": mostly(st.booleans()),
        "stream_options": mostly(st.fixed_dictionaries({}, optional={"include_usage": mostly(st.booleans())})),
        "extra_body": mostly(
            st.fixed_dictionaries(
                {},
                optional={
                    "cache_prompt": mostly(st.booleans()),
                    "prompt_cache_key": mostly(short_text),
                    "cache_salt": mostly(short_text),
                    "chat_template_kwargs": mostly(st.dictionaries(short_text, json_values, max_size=2)),
                },
            )
        ),
        "cache_prompt": mostly(st.booleans()),
        "prompt_cache_key": mostly(short_text),
        "user": mostly(short_text),
        "n_predict": mostly(st.integers(-3, 5)),
        "echo": mostly(st.sampled_from([False, False, False, True])),
    },
)

FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _parse_or_refuse(body: object) -> None:
    for parse, result_type in PARSERS:
        try:
            result = parse(body)
        except InvalidRequest as error:
            assert_well_formed(error)
            assert error.status == 400
        else:
            assert type(result) is result_type


@FAST
@given(json_values)
def test_any_value_parses_or_is_refused(value: object) -> None:
    _parse_or_refuse(value)


@FAST
@given(field_bodies)
def test_any_known_fields_parse_or_are_refused(body: dict[str, Any]) -> None:
    _parse_or_refuse(body)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plausible_chat)
def test_plausible_bodies_parse_or_are_refused(body: dict[str, Any]) -> None:
    _parse_or_refuse(body)


@FAST
@given(st.one_of(st.binary(max_size=64), json_values.map(lambda v: json.dumps({"v": v}).encode())))
def test_any_bytes_decode_or_are_refused(raw: bytes) -> None:
    try:
        value = decode_json_body(raw, max_bytes=4096)
    except InvalidRequest as error:
        assert_well_formed(error)
        assert error.param is None
    else:
        assert isinstance(value, dict)
        _parse_or_refuse(value)


@settings(max_examples=50, deadline=None)
@given(
    temperature=st.floats(0, 2),
    top_p=st.floats(0, 1, exclude_min=True),
    max_tokens=st.integers(1, CAP),
    stop=st.lists(st.text(min_size=1, max_size=8).filter(lambda s: s.isprintable()), max_size=16),
    seed=st.integers(-(2**63), 2**64 - 1),
)
def test_valid_sampling_round_trips(
    temperature: float, top_p: float, max_tokens: int, stop: list[str], seed: int
) -> None:
    fields = {"temperature": temperature, "top_p": top_p, "max_tokens": max_tokens, "stop": stop, "seed": seed}
    expected = SamplingParams(
        temperature=temperature, top_p=top_p, max_tokens=max_tokens, stop=tuple(stop), seed=seed % 2**64
    )
    assert parse_chat_request(chat(**fields)).sampling == expected
    assert parse_completion_request(completion(**fields)).sampling == expected
    raw = json.dumps(chat(**fields)).encode()
    assert parse_chat_request(decode_json_body(raw, max_bytes=1 << 20)).sampling == expected


SCOPED = Limits(user_scopes_session=True)


@pytest.mark.parametrize(("fields", "session_key"), [
    # The gateway's `user` is the session; the client's key only splits it.
    ({"user": "ann", "prompt_cache_key": "bob"}, json.dumps(["ann", "bob"])),
    ({"user": "ann", "extra_body": {"prompt_cache_key": "bob"}}, json.dumps(["ann", "bob"])),
    ({"user": "ann"}, "ann"),
    ({"user": "ann", "prompt_cache_key": ""}, "ann"),
    # No gateway user: as without the scope.
    ({"prompt_cache_key": "bob"}, "bob"),
    ({}, ANON),
])
def test_a_user_scoped_session_cannot_be_left_by_the_client(fields: dict[str, Any], session_key: str) -> None:
    for parsed in (parse_chat_request(chat(**fields), limits=SCOPED),
                   parse_completion_request(completion(**fields), limits=SCOPED),
                   parse_native_completion(completion(**fields), limits=SCOPED)):
        assert parsed.cache.session_key == session_key
    # A client naming another user's session as its key does not land in it.
    alice = parse_chat_request(chat(user="mallory", prompt_cache_key="alice"), limits=SCOPED).cache.session_key
    assert alice not in ("alice", parse_chat_request(chat(user="alice"), limits=SCOPED).cache.session_key)


@pytest.mark.parametrize("parameters", [
    {"type": "nonsense"},
    {"type": "object", "properties": {"city": {"type": 5}}},
    {"type": "object", "required": "city"},
])
def test_tool_parameters_that_are_not_json_schema_are_refused(parameters: dict[str, Any]) -> None:
    tools = [{"type": "function", "function": {"name": "weather", "parameters": parameters}}]
    with pytest.raises(InvalidRequest) as caught:
        parse_chat_request(chat(tools=tools))
    assert caught.value.param == "tools[0].function.parameters"
    assert "not a valid JSON Schema" in caught.value.message


def test_tool_parameters_in_json_schema_are_accepted() -> None:
    parameters = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                  "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "weather", "parameters": parameters}}]
    (tool,) = parse_chat_request(chat(tools=tools)).tools or ()
    assert tool["function"]["parameters"] == parameters


@pytest.mark.parametrize(("field", "value"), [
    ("typical_p", 0.9), ("mirostat", 2), ("dry_multiplier", 0.8), ("xtc_probability", 0.5),
    ("top_n_sigma", 1.0), ("dynatemp_range", 0.5), ("mirostat", False),
])
def test_native_samplers_this_server_does_not_run_are_refused(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_native_completion(completion(**{field: value}))
    assert caught.value.param == field
    assert caught.value.code == "unsupported_parameter"


def test_native_json_schema_and_gbnf_grammar_compile_to_a_grammar() -> None:
    schema = parse_native_completion(completion(json_schema={"type": "object", "properties": {"a": {"type": "integer"}}}))
    assert schema.sampling.grammar is not None
    assert '"a"' in schema.sampling.grammar
    gbnf = parse_native_completion(completion(grammar='root ::= "yes" | "no"'))
    assert gbnf.sampling.grammar is not None
    assert '"yes"' in gbnf.sampling.grammar


@pytest.mark.parametrize(("fields", "param", "reason"), [
    ({"grammar": 'root ::= "yes'}, "grammar", "end of input"),
    ({"grammar": "root ::= missing"}, "grammar", "missing"),
    ({"grammar": 7}, "grammar", None),
    ({"json_schema": {"type": "nope"}}, "json_schema", "not a valid JSON Schema"),
    ({"json_schema": {"properties": {f"p{i}": {} for i in range(2001)}}}, "json_schema", "2001 properties"),
    ({"grammar": "root ::= a\n" + "".join(f'a ::= "{i}"\n' for i in range(512))}, "grammar", "513 rules"),
    ({"grammar": 'root ::= "' + "x" * (256 << 10) + '"'}, "grammar", "the limit is 262144"),
    ({"json_schema": {"type": "object"}, "grammar": 'root ::= "a"'}, "grammar", "not both"),
])
def test_native_grammars_that_cannot_be_used_are_refused_with_a_reason(
    fields: dict[str, Any], param: str, reason: str | None,
) -> None:
    error = expect_invalid(parse_native_completion, completion(**fields), param, None)
    if reason is not None:
        assert reason in error.message


def test_native_samplers_left_off_are_accepted() -> None:
    # What llama.cpp's web UI sends with every request.
    off = {"typical_p": 1.0, "mirostat": 0, "dry_multiplier": 0.0, "xtc_probability": 0, "top_n_sigma": -1,
           "dynatemp_range": 0, "ignore_eos": False, "grammar": "", "json_schema": {}, "mirostat_tau": 5}
    assert parse_native_completion(completion(**off)).sampling == parse_native_completion(completion()).sampling


@pytest.mark.parametrize(("repeat_last_n", "window", "penalty"), [
    (None, 20, 1.3), (64, 64, 1.3), (-1, 2**31 - 1, 1.3), (0, 20, 1.0),
])
def test_native_repeat_last_n_is_the_penalty_window(repeat_last_n: int | None, window: int, penalty: float) -> None:
    fields: dict[str, Any] = {"repeat_penalty": 1.3, "presence_penalty": 0.5}
    if repeat_last_n is not None:
        fields["repeat_last_n"] = repeat_last_n
    sampling = parse_native_completion(completion(**fields)).sampling
    # llama.cpp: 0 turns the penalties off, -1 looks at the whole context.
    assert (sampling.penalty_context, sampling.repetition_penalty) == (window, penalty)
    assert sampling.presence_penalty == (0.0 if repeat_last_n == 0 else 0.5)


def test_native_repeat_last_n_below_minus_one_is_refused() -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_native_completion(completion(repeat_last_n=-2))
    assert caught.value.param == "repeat_last_n"


def test_schema_checks_are_remembered_per_tenant_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Agents resend their tool schemas every turn: the check runs once per tenant, and one tenant's
    check never makes another's faster (a timing oracle for what others sent)."""
    from jsonschema import validators

    from mlxcel.http import validation

    validation._SCHEMA_MEMO.clear()
    checked: list[object] = []
    original = validators.Draft202012Validator.check_schema
    monkeypatch.setattr(validators.Draft202012Validator, "check_schema",
                        classmethod(lambda cls, schema: checked.append(schema) or original(schema)))
    parameters = {"type": "object", "properties": {"q": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "search", "parameters": parameters}}]
    for salt in ("tenant-a", "tenant-a", "tenant-b", "tenant-b"):
        parse_chat_request(chat(tools=tools, cache_salt=salt))
    assert len(checked) == 2  # once for each tenant
    parse_chat_request(chat(tools=tools, cache_salt="tenant-a", user="another-user"))
    assert len(checked) == 3  # and per session within a tenant


def test_a_renamed_error_is_new_and_leaves_the_caught_one_as_it_was() -> None:
    from mlxcel.errors import ContextExceeded
    from mlxcel.http.validation import renamed_param

    caught = ContextExceeded("messages[2].content is too long", param="messages[2].content", context_size=8)
    renamed = renamed_param(caught, "messages[2]", "input[0]")
    assert (renamed.param, renamed.message, str(renamed)) == (
        "input[0].content", "input[0].content is too long", "input[0].content is too long")
    assert isinstance(renamed, ContextExceeded)
    assert (renamed.context_size, renamed.code, renamed.status) == (8, "context_length_exceeded", 400)
    assert (caught.param, caught.message, str(caught)) == (
        "messages[2].content", "messages[2].content is too long", "messages[2].content is too long")
