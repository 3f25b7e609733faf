"""Segment-wise tokenization gives exactly the whole-text ids, and memoizes history."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from mlxcel.model.tokenize import (
    SegmentTokenizer,
    _cut,
    max_chars_per_token,
    vocabulary_size,
)

pytestmark = pytest.mark.slow

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
    assert (None, "system\n" + "rules " * 20) in segments._pieces
    segments.encode("<|im_start|>user\n" + "x" * 300 + "<|im_end|>\n")  # too big to keep
    assert segments._chars <= 200


WORDS = st.sampled_from(["alpha", "beta", "x1", "42", "it's", "naïve", "日本", "a", "émigré", "done."])
LONG_TEXT = st.lists(st.one_of(WORDS, WORDS, TEXT), min_size=1, max_size=40).map(" ".join)


@settings(max_examples=80, deadline=None)
@given(text=LONG_TEXT, part_chars=st.integers(min_value=1, max_value=30))
def test_long_pieces_encoded_in_parts_give_the_whole_text_ids(loaded_model, text, part_chars) -> None:
    tokenizer = loaded_model("llama").tokenizer
    segments = SegmentTokenizer(tokenizer, part_chars=part_chars)
    assert segments.encodes_in_parts
    assert "".join(_cut(text, part_chars)) == text
    assert segments.encode(text) == tuple(tokenizer.encode(text, add_special_tokens=False))


def test_a_long_system_prompt_is_cut_into_parts_at_spaces_between_words() -> None:
    text = "word " * 1000
    parts = _cut(text, 2000)
    assert len(parts) == 3
    assert "".join(parts) == text
    assert all(part.startswith(" word") for part in parts[1:])
    assert len(parts[0]) >= 2000


@pytest.mark.parametrize("strips", [False, True])
def test_a_tokenizer_that_changes_a_part_s_leading_space_encodes_long_pieces_whole(strips) -> None:
    """Parts are used only where they give the whole text's ids: a normalizer that strips each
    input's leading space (so " beta" would lose its space) turns them off."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(["alpha beta gamma words numbers 12 345 and spaces"] * 10, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    if strips:
        backend.normalizer = normalizers.Strip()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    segments = SegmentTokenizer(tokenizer, part_chars=4)
    assert segments.encodes_in_parts is not strips
    text = "alpha beta gamma words numbers and spaces alpha"
    assert segments.encode(text) == tuple(tokenizer.encode(text, add_special_tokens=False))


class CountingTokenizer:
    """The fixture tokenizer, counting the encode calls that reach it."""

    def __init__(self, tokenizer) -> None:
        self._inner = tokenizer
        self.num_encodes = 0

    def encode(self, text, add_special_tokens=False):
        self.num_encodes += 1
        return self._inner.encode(text, add_special_tokens=add_special_tokens)

    def get_added_vocab(self):
        return self._inner.get_added_vocab()


def test_the_memo_is_never_shared_across_namespaces(loaded_model) -> None:
    """One tenant's memo entries must not make another tenant's identical message faster
    (a timing side channel across cache_salt or sessions)."""
    inner = loaded_model("llama").tokenizer
    tokenizer = CountingTokenizer(inner)
    segments = SegmentTokenizer(tokenizer)
    text = "<|im_start|>user\nthe secret message of tenant A<|im_end|>\n"
    first = segments.encode(text, namespace=("salt-a", None))
    calls = tokenizer.num_encodes
    assert segments.encode(text, namespace=("salt-a", None)) == first
    assert tokenizer.num_encodes == calls  # a hit within the namespace
    assert segments.encode(text, namespace=("salt-b", None)) == first
    assert tokenizer.num_encodes > calls  # no hit across salts
    calls = tokenizer.num_encodes
    assert segments.encode(text, namespace=("salt-a", "session-2")) == first
    assert tokenizer.num_encodes > calls  # nor across sessions
    assert first == tuple(inner.encode(text, add_special_tokens=False))


def test_the_fixture_tokenizer_bounds_characters_per_token(loaded_model) -> None:
    loaded = loaded_model("llama")
    bound = max_chars_per_token(loaded.tokenizer)
    assert bound == max(len(entry) for entry in loaded.tokenizer.get_vocab())
    for text in ("x" * 5000, " " * 5000, "日本語" * 500, "=" * 3000):
        assert len(loaded.tokenizer.encode(text, add_special_tokens=False)) >= len(text) / bound
    assert vocabulary_size(loaded.tokenizer, loaded.config) == 151_646
    assert vocabulary_size(loaded.tokenizer, {"vocab_size": 1000}) == 1000  # the smaller of the two
    assert vocabulary_size(loaded.tokenizer, {"text_config": {"vocab_size": 2000}, "vocab_size": 9}) == 2000


@pytest.mark.parametrize("normalizer", ["strip", "bert"])
def test_a_tokenizer_that_can_drop_input_gets_no_bound(normalizer) -> None:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.train_from_iterator(["alpha beta"] * 10, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    assert max_chars_per_token(PreTrainedTokenizerFast(tokenizer_object=backend)) is not None
    backend.normalizer = normalizers.Strip() if normalizer == "strip" else normalizers.BertNormalizer()
    assert max_chars_per_token(PreTrainedTokenizerFast(tokenizer_object=backend)) is None
