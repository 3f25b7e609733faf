"""The n-gram proposer of speculative decoding: the most recent earlier occurrence, longest n first."""

from __future__ import annotations

import random

import pytest

from mlxcel.core.ngram import NgramIndex


def reference(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """A rescan: the continuation of the most recent earlier occurrence of the longest matching suffix."""
    for n in range(max_n, min_n - 1, -1):
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
    index = NgramIndex(max_n=3, min_n=2)
    index.extend([1, 2, 3, 4, 5, 9, 1, 2, 3, 8, 8, 1, 2, 3])
    # 1 2 3 last occurred before the end followed by 8 8 (more recent than 4 5).
    assert index.propose(3) == [8, 8, 1]
    # With the token in flight: 2 3 then 4 occurred once, followed by 5 9 1.
    assert index.propose(3, next_token=4) == [5, 9, 1]
    assert index.propose(3, next_token=7) == []


def test_the_longest_suffix_wins() -> None:
    index = NgramIndex(max_n=3, min_n=2)
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
    index = NgramIndex(max_n=3, min_n=1 + seed % 2)
    tokens: list[int] = []
    for _ in range(300):
        token = rng.randrange(6)
        tokens.append(token)
        index.append(token)
        assert index.propose(4) == reference(tokens, 4, 3, index.min_n)
        peek = rng.randrange(6)
        assert index.propose(4, next_token=peek) == reference([*tokens, peek], 4, 3, index.min_n)


def test_catch_up_indexes_only_what_is_new() -> None:
    index = NgramIndex()
    index.catch_up([1, 2, 3])
    index.catch_up([1, 2, 3, 1, 2])
    assert index.tokens == [1, 2, 3, 1, 2]
    assert index.propose(2) == [3, 1]


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex(max_n=1, min_n=2)
