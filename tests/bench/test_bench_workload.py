"""The benchmark workload: deterministic for a seed, the requested shape, exact lengths on the Qwen tokenizer."""

from __future__ import annotations

import hashlib

import attrs
import pytest

from mlxcel.bench.workload import UNSEEN_USER_STEP, Shape, build_workload, load_word_counter
from mlxcel.fixtures import fixture_path

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
    assert len(workload.user_turns) == 3
    assert all(len(turns) == 4 for turns in workload.user_turns)
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
    assert messages[2]["content"] == "first reply"
    assert messages[4]["content"] == "second reply"
    assert messages[5]["content"] == workload.user_turns[1][2]
    with pytest.raises(ValueError):
        workload.messages(0, 2, ["only one"])


def test_sizes_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="turns"):
        build_workload(Shape(turns=0))


def test_chat_texts_unchanged_by_the_unseen_probes() -> None:
    # The default shape's texts for seed 0, as before the probes existed.
    workload = build_workload(Shape())
    workload.unseen_messages(0)
    texts = repr((workload.system_prompt, workload.user_turns, workload.stand_in_replies)).encode()
    assert hashlib.sha256(texts).hexdigest() == "9ec748e3b2fa5aa74a9098e99d817248ed21185ada2b6306da955a36819c1024"
    assert workload.system_prompt.startswith("boy hair interest world community view wife sense summer")


def test_unseen_probes_are_deterministic_and_differ_by_index_and_seed() -> None:
    workload = build_workload(SHAPE)
    probes = [workload.unseen_messages(index) for index in range(4)]
    assert probes == [build_workload(SHAPE).unseen_messages(index) for index in range(4)]
    assert [[m["role"] for m in probe] for probe in probes] == [["system", "user"]] * 4
    assert len({probe[0]["content"] for probe in probes}) == 4
    assert len({probe[1]["content"] for probe in probes}) == 4
    assert build_workload(attrs.evolve(SHAPE, seed=6)).unseen_messages(0) != probes[0]
    with pytest.raises(ValueError):
        workload.unseen_messages(-1)


def test_unseen_probes_share_no_prefix_with_the_workload_or_each_other() -> None:
    workload = build_workload(SHAPE)
    systems = [workload.system_prompt] + [workload.unseen_messages(index)[0]["content"] for index in range(30)]
    # A different first word: no common prefix for a prompt cache to reuse.
    assert len({system.split()[0] for system in systems}) == len(systems)
    assert len({tuple(system.split()[:10]) for system in systems}) == len(systems)
    assert not any(system.startswith(workload.system_prompt[:40]) for system in systems[1:])


@pytest.mark.slow
def test_unseen_lengths_measured_with_the_model_tokenizer() -> None:
    workload = build_workload(SHAPE, model_path=fixture_path("llama"))
    loaded = load_word_counter(fixture_path("llama"))
    assert loaded is not None
    tokenizer = loaded[0]

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False).ids)

    for index in range(3):
        system, user = workload.unseen_messages(index)
        assert count(system["content"]) == 300
        assert count(user["content"]) == 40 + UNSEEN_USER_STEP * index == 40 + 8 * index
