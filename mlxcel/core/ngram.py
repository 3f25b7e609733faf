"""Prompt-lookup (n-gram) proposals for speculative decoding: pure, no MLX.

A row's tokens (prompt and reply so far) are indexed as they grow: for each
n of ``sizes`` the end of the most recent occurrence of every n-gram. A
proposal continues the longest suffix (the row's last tokens, plus the
token the step is about to feed) that occurred earlier: the tokens that
followed that occurrence, up to ``k``. Longest first, as vLLM's and
llama.cpp's lookup do: a longer match is likelier to continue the same way.
The smallest size is 2 by default: a single-token match proposes too often
to pay for its verify positions in a batch (docs/architecture.md,
"Speculation"). The largest, 8, finds the place a copy has reached: in a
file being rewritten, a 3-token suffix (``return x\n``) most recently
occurred in the reply itself, so its continuation repeats the last function
instead of the next one.

Each appended token costs one dictionary write per size; a lookup as many
reads. Nothing rescans the row.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

DEFAULT_SIZES = (2, 3, 8)


class NgramIndex:
    """The n-gram index of one growing token row."""

    def __init__(self, *, sizes: Sequence[int] = DEFAULT_SIZES) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"need n-gram sizes of at least 1, got {tuple(sizes)}")
        # Longest first: the order lookups try them in.
        self.sizes = tuple(sorted(set(sizes), reverse=True))
        self.tokens: list[int] = []
        # n -> n-gram -> the index just past its most recent occurrence.
        self._last_end: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        # n -> the end of the previous occurrence of the row's last n tokens (None: none).
        self._previous: dict[int, int | None] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        self.tokens.append(int(token))
        end = len(self.tokens)
        for n, table in self._last_end.items():
            if end >= n:
                gram = tuple(self.tokens[end - n:end])
                # The suffix's earlier occurrence, before this one replaces it.
                self._previous[n] = table.get(gram)
                table[gram] = end
            else:
                self._previous[n] = None

    def catch_up(self, tokens: Sequence[int]) -> None:
        """Index the tokens of ``tokens`` past those already indexed (``tokens`` extends what was indexed)."""
        if len(tokens) > len(self.tokens):
            self.extend(tokens[len(self.tokens):])

    def propose(self, k: int, next_token: int | None = None) -> list[int]:
        """Up to ``k`` tokens to follow the row and then ``next_token`` (when given); [] for none."""
        if k <= 0:
            return []
        tokens = self.tokens
        for n in self.sizes:
            if next_token is None:
                end = self._previous.get(n)
            elif len(tokens) >= n - 1:
                # Not indexed yet, so any occurrence found is an earlier one.
                end = self._last_end[n].get((*tokens[len(tokens) - n + 1:], int(next_token)) if n > 1
                                            else (int(next_token),))
            else:
                end = None
            if end is None:
                continue
            return self._continuation(end, k, next_token)
        return []

    def _continuation(self, end: int, k: int, next_token: int | None) -> list[int]:
        """The ``k`` tokens after ``end`` in the row extended by ``next_token`` and by the proposal itself.

        An occurrence that overlaps the row's end (a repeating run) continues
        periodically, as the text would if it kept repeating.
        """
        tokens = self.tokens
        known = len(tokens) + (next_token is not None)
        proposal: list[int] = []
        for position in range(end, end + k):
            if position < len(tokens):
                proposal.append(tokens[position])
            elif position < known:
                assert next_token is not None
                proposal.append(int(next_token))
            else:
                proposal.append(proposal[position - known])
        return proposal
