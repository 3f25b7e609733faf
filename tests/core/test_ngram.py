"""The n-gram proposer of speculative decoding: the most recent earlier occurrence, longest n first."""

from __future__ import annotations

import random

import pytest

from mlxcel.core.ngram import NgramIndex


def reference(tokens: list[int], k: int, sizes: tuple[int, ...]) -> list[int]:
    """A rescan: the continuation of the most recent earlier occurrence of the longest matching suffix."""
    for n in sorted(sizes, reverse=True):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n:end] == suffix:
                extended = list(tokens)
                for position in range(end, end + k):
                    extended.append(extended[position])
                return extended[len(tokens):]
    return []


def test_the_tokens_after_the_most_recent_earlier_occurrence() -> None:
    index = NgramIndex(sizes=(2, 3))
    index.extend([1, 2, 3, 4, 5, 9, 1, 2, 3, 8, 8, 1, 2, 3])
    # 1 2 3 last occurred before the end followed by 8 8 (more recent than 4 5).
    assert index.propose(3) == [8, 8, 1]
    # With the token in flight: 2 3 then 4 occurred once, followed by 5 9 1.
    assert index.propose(3, next_token=4) == [5, 9, 1]
    assert index.propose(3, next_token=7) == []


def test_the_longest_suffix_wins() -> None:
    index = NgramIndex(sizes=(2, 3))
    # "5 6" occurred twice: after 4 (followed by 10) and after 3 (followed by 20); the row ends 3 5 6.
    index.extend([4, 5, 6, 10, 3, 5, 6, 20, 4, 5, 6, 30, 3, 5, 6])
    assert index.propose(1) == [20]


def test_a_repeating_run_continues_periodically() -> None:
    index = NgramIndex()
    index.extend([7, 7, 7])
    assert index.propose(4) == [7, 7, 7, 7]
    index = NgramIndex()
    index.extend([1, 2, 1, 2])
    assert index.propose(5) == [1, 2, 1, 2, 1]
    assert index.propose(3, next_token=1) == [2, 1, 2]


def test_nothing_to_propose() -> None:
    index = NgramIndex()
    assert index.propose(4) == []
    index.extend([1, 2, 3, 4])
    assert index.propose(4) == []
    assert index.propose(0) == []


@pytest.mark.parametrize("seed", range(20))
def test_incremental_index_equals_a_rescan(seed: int) -> None:
    rng = random.Random(seed)
    sizes = [(1, 2, 3), (2, 3), (2, 3, 8), (2, 5)][seed % 4]
    index = NgramIndex(sizes=sizes)
    tokens: list[int] = []
    for _ in range(300):
        # Few symbols, so that 8-grams repeat too.
        token = rng.randrange(3 if seed % 4 == 2 else 6)
        tokens.append(token)
        index.append(token)
        assert index.propose(4) == reference(tokens, 4, sizes)
        peek = rng.randrange(6)
        assert index.propose(4, next_token=peek) == reference([*tokens, peek], 4, sizes)


def test_catch_up_indexes_only_what_is_new() -> None:
    index = NgramIndex()
    index.catch_up([1, 2, 3])
    index.catch_up([1, 2, 3, 1, 2])
    assert index.tokens == [1, 2, 3, 1, 2]
    assert index.propose(2) == [3, 1]


def test_a_long_match_finds_where_a_copy_has_reached() -> None:
    """Copying a file of similar blocks: a 3-token suffix last occurred in the copy itself, 8 tokens say where."""
    blocks = [[10, block, 11, 12, 13, 14, 15, 16, 17] for block in range(20, 26)]
    original = [token for block in blocks for token in block]
    copied = original[:9 + 8]  # the first block copied, then 8 tokens of the second
    index = NgramIndex(sizes=(2, 3))
    index.extend(original + copied)
    # The last 3 tokens (14 15 16) last occurred in the copy's first block, followed by block 1 again.
    assert index.propose(4) != original[len(copied):len(copied) + 4]
    index = NgramIndex(sizes=(2, 3, 8))
    index.extend(original + copied)
    assert index.propose(4) == original[len(copied):len(copied) + 4]


def test_sizes_are_checked() -> None:
    for sizes in ((), (0, 2)):
        with pytest.raises(ValueError, match="sizes"):
            NgramIndex(sizes=sizes)
