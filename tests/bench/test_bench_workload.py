"""The benchmark workload: deterministic for a seed, the requested shape, exact lengths on the Qwen tokenizer."""

from __future__ import annotations

import attrs
import pytest

from mlxcel.bench.workload import Shape, build_workload
from mlxcel.model.fixtures import fixture_path

SHAPE = Shape(conversations=3, turns=4, system_tokens=300, user_tokens=40, reply_tokens=8, seed=5)


def test_same_seed_same_texts_other_seed_other_texts() -> None:
    first, again = build_workload(SHAPE), build_workload(SHAPE)
    assert (first.system_prompt, first.user_turns, first.stand_in_replies) == (
        again.system_prompt, again.user_turns, again.stand_in_replies)
    other = build_workload(attrs.evolve(SHAPE, seed=6))
    assert other.system_prompt != first.system_prompt


def test_shape_and_word_counts() -> None:
    workload = build_workload(SHAPE)
    assert len(workload.system_prompt.split()) == 300
    assert len(workload.user_turns) == 3 and all(len(turns) == 4 for turns in workload.user_turns)
    assert all(len(text.split()) == 40 for turns in workload.user_turns for text in turns)
    assert all(len(text.split()) == 8 for turns in workload.stand_in_replies for text in turns)
    # Conversations differ after the shared system prompt.
    assert len({turns[0] for turns in workload.user_turns}) == 3


def test_lengths_measured_with_the_model_tokenizer() -> None:
    workload = build_workload(SHAPE, model_path=fixture_path("llama"))
    assert workload.system_tokens_measured == 300
    assert workload.user_tokens_measured == 40
    assert workload.tokenizer_source.endswith("tokenizer.json")


def test_messages_resend_history_with_the_replies_given() -> None:
    workload = build_workload(SHAPE)
    messages = workload.messages(1, 2, ["first reply", "second reply"])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert messages[0]["content"] == workload.system_prompt
    assert messages[2]["content"] == "first reply" and messages[4]["content"] == "second reply"
    assert messages[5]["content"] == workload.user_turns[1][2]
    with pytest.raises(ValueError):
        workload.messages(0, 2, ["only one"])


def test_sizes_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="turns"):
        build_workload(Shape(turns=0))
