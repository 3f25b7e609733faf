"""Segment-wise tokenization gives exactly the whole-text ids, and memoizes history."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mlxcel.model.tokenize import SegmentTokenizer

ROLES = ("system", "user", "assistant", "tool")
TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=60)


def test_it_segments_the_fixture_tokenizer(loaded_model) -> None:
    assert SegmentTokenizer(loaded_model("llama").tokenizer).segmenting


@settings(max_examples=60, deadline=None)
@given(messages=st.lists(st.tuples(st.sampled_from(ROLES), TEXT), min_size=1, max_size=6))
def test_same_ids_as_encoding_the_whole_text(loaded_model, messages) -> None:
    tokenizer = loaded_model("llama").tokenizer
    segments = SegmentTokenizer(tokenizer)
    text = tokenizer.apply_chat_template(
        [{"role": role, "content": content} for role, content in messages],
        add_generation_prompt=True, tokenize=False,
    )
    assert segments.encode(text) == tuple(tokenizer.encode(text, add_special_tokens=False))


def test_history_pieces_are_memoized_within_a_character_budget(loaded_model) -> None:
    tokenizer = loaded_model("llama").tokenizer
    segments = SegmentTokenizer(tokenizer, cache_chars=200)
    history = "<|im_start|>system\n" + "rules " * 20 + "<|im_end|>\n"
    segments.encode(history + "<|im_start|>user\nhi<|im_end|>\n")
    assert "system\n" + "rules " * 20 in segments._pieces
    segments.encode("<|im_start|>user\n" + "x" * 300 + "<|im_end|>\n")  # too big to keep
    assert segments._chars <= 200
