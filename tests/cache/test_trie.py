"""The radix trie against a plain list of sequences."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from mlxcel.cache.key import pack_tokens
from mlxcel.cache.trie import RadixTrie

sequences = st.lists(st.integers(0, 3), min_size=0, max_size=12)


def _common(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


@settings(max_examples=150, deadline=None)
@given(
    stored=st.lists(st.tuples(sequences, st.sampled_from(["a", "b"])), max_size=12),
    removed=st.lists(st.integers(0, 11), max_size=6),
    request=sequences,
    tag=st.sampled_from([None, "a", "b"]),
)
def test_queries_match_brute_force(stored, removed, request, tag) -> None:
    trie = RadixTrie()
    live: dict[int, tuple[list[int], str]] = {}
    for entry_id, (tokens, entry_tag) in enumerate(stored):
        trie.insert(tokens, entry_id, tag=entry_tag)
        live[entry_id] = (tokens, entry_tag)
    for entry_id in removed:
        if entry_id in live:
            trie.remove(live.pop(entry_id)[0], entry_id)
    assert len(trie) == len(live)

    walk = trie.walk(request)
    allowed = {i: v for i, v in live.items() if tag is None or v[1] == tag}
    prefixes = list(walk.prefix_matches(tag=tag))
    expected_prefixes = {
        (i, len(t)) for i, (t, _) in allowed.items() if request[: len(t)] == t
    }
    assert set(prefixes) == expected_prefixes
    assert [length for _, length in prefixes] == sorted((length for _, length in prefixes), reverse=True)

    diverging = list(walk.diverging_matches(tag=tag))
    expected_diverging = {
        (i, _common(t, request)) for i, (t, _) in allowed.items() if request[: len(t)] != t
    }
    assert set(diverging) == expected_diverging
    assert len(diverging) == len(expected_diverging)
    commons = [common for _, common in diverging]
    assert commons == sorted(commons, reverse=True)

    threshold = 2
    pruned = set(walk.diverging_matches(tag=tag, min_common=threshold))
    assert pruned == {item for item in expected_diverging if item[1] >= threshold}

    longest = walk.longest_common()
    if live:
        best = max(_common(t, request) for t, _ in live.values())
        assert longest is not None
        assert longest[1] == best
        assert _common(live[longest[0]][0], request) == best
    else:
        assert longest is None

    odd = set(walk.prefix_matches(accept=lambda entry_id: entry_id % 2 == 1))
    assert odd == {(i, len(t)) for i, (t, _) in live.items() if i % 2 and request[: len(t)] == t}


@settings(max_examples=60, deadline=None)
@given(stored=st.lists(sequences, max_size=10, unique_by=tuple))
def test_removing_everything_leaves_an_empty_root(stored) -> None:
    trie = RadixTrie()
    for entry_id, tokens in enumerate(stored):
        trie.insert(pack_tokens(tokens), entry_id, tag="s")
    for entry_id, tokens in reversed(list(enumerate(stored))):
        trie.remove(tokens, entry_id)
    assert len(trie) == 0
    root = trie._root
    assert not root.children
    assert not root.entries
    assert not root.tag_counts


def test_long_edges_split_and_merge() -> None:
    trie = RadixTrie()
    shared = list(range(1000, 9000))
    trie.insert(shared + [1, 2], "one")
    trie.insert(shared + [3], "two")
    walk = trie.walk(shared + [1, 9])
    assert list(walk.prefix_matches()) == []
    assert list(walk.diverging_matches()) == [("one", 8001), ("two", 8000)]
    trie.remove(shared + [1, 2], "one")
    (child,) = trie._root.children.values()
    assert len(child.label) == 4 * 8001  # folded back into one edge
    assert list(trie.walk(shared + [3, 4]).prefix_matches()) == [("two", 8001)]
