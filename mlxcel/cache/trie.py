"""A radix trie over token ids that finds stored sequences sharing a prefix.

Sequences are held packed (`key.pack_tokens`: 4 bytes a token) and edges
are compared with `bytes.startswith` and slice equality, which run at memcmp
speed; a walk costs a few comparisons per branching node, not a Python step
per token. Each entry carries a tag (the store uses the session key) and
every node counts the tags in its subtree, so a tag-restricted query skips
subtrees holding none.

All lengths in the public interface are in tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Generic, TypeVar

from mlxcel.cache.key import pack_tokens

# Whatever the owner identifies its entries by (the store uses entry digests).
EntryId = TypeVar("EntryId", bound=Hashable)
EntryFilter = Callable[[EntryId], bool]
TokenInput = Sequence[int] | bytes

_TOKEN = 4  # bytes per packed token


def _packed(tokens: TokenInput) -> bytes:
    return tokens if isinstance(tokens, bytes) else pack_tokens(tokens)


class PackedPrefix:
    """A token sequence packed on demand, so a walk that stops early packs little."""

    __slots__ = ("_tokens", "data", "num_tokens")

    def __init__(self, tokens: TokenInput) -> None:
        if isinstance(tokens, bytes):
            self._tokens: Sequence[int] | None = None
            self.data = tokens
        else:
            self._tokens = tokens
            self.data = b""
        self.num_tokens = len(tokens) if self._tokens is not None else len(tokens) // _TOKEN

    def up_to(self, num_tokens: int) -> bytes:
        """The packed bytes of at least the first num_tokens tokens (or all)."""
        have = len(self.data) // _TOKEN
        if have < num_tokens and self._tokens is not None:
            # Grow at least twofold so repeated calls stay linear overall.
            end = min(self.num_tokens, max(num_tokens, 2 * have, 64))
            self.data += pack_tokens(self._tokens[have:end])
        return self.data


def _common_tokens(data: bytes, start: int, label: bytes) -> int:
    """Tokens shared by data[start:] (byte offset) and label."""
    if data.startswith(label, start):
        return len(label) // _TOKEN
    shared = min(len(data) - start, len(label)) // _TOKEN
    if data.startswith(label[: shared * _TOKEN], start):
        return shared
    # Bisect for the first differing token; each probe compares a halving range.
    low, high = 0, shared
    while high - low > 1:
        middle = (low + high) // 2
        if data[start + low * _TOKEN : start + middle * _TOKEN] == label[low * _TOKEN : middle * _TOKEN]:
            low = middle
        else:
            high = middle
    return low


class _Node(Generic[EntryId]):
    __slots__ = ("label", "children", "entries", "tag_counts", "parent", "depth")

    def __init__(self, label: bytes, parent: _Node[EntryId] | None, depth: int) -> None:
        self.label = label
        # Keyed by the first packed token of the child's label.
        self.children: dict[bytes, _Node[EntryId]] = {}
        # Entries whose sequence ends exactly here: entry id -> tag.
        self.entries: dict[EntryId, str] = {}
        # Entries in this subtree, this node included, per tag.
        self.tag_counts: dict[str, int] = {}
        self.parent = parent
        # Tokens from the root to the end of this node's label.
        self.depth = depth


class TrieWalk(Generic[EntryId]):
    """A request walked down the trie; query it once per lookup tier."""

    __slots__ = ("_path", "_partial", "_partial_depth")

    def __init__(self, path: list[_Node[EntryId]], partial: _Node[EntryId] | None, partial_depth: int) -> None:
        # Nodes whose whole label matches, root first.
        self._path = path
        # The child the request leaves or ends inside, when it matched part of it.
        self._partial = partial
        self._partial_depth = partial_depth

    def prefix_matches(
        self, tag: str | None = None, accept: EntryFilter[EntryId] | None = None
    ) -> Iterator[tuple[EntryId, int]]:
        """Entries that are whole prefixes of the request, longest first: (id, length)."""
        for node in reversed(self._path):
            if not node.entries or (tag is not None and not node.tag_counts.get(tag)):
                continue
            for entry_id, entry_tag in node.entries.items():
                if (tag is None or entry_tag == tag) and (accept is None or accept(entry_id)):
                    yield entry_id, node.depth

    def diverging_matches(
        self, tag: str | None = None, accept: EntryFilter[EntryId] | None = None, min_common: int = 0
    ) -> Iterator[tuple[EntryId, int]]:
        """Entries that are not prefixes of the request: (id, common length).

        Common lengths never increase along the iteration, so a caller can
        stop at the first that cannot beat what it has; branches sharing
        fewer than min_common tokens are not visited.
        """
        if self._partial is not None and self._partial_depth >= min_common:
            yield from _subtree_entries(self._partial, tag, accept, self._partial_depth)
        next_node = self._partial
        for node in reversed(self._path):
            if node.depth < min_common:
                return
            if tag is None or _tag_in_siblings(node, next_node, tag):
                for child in node.children.values():
                    if child is not next_node:
                        yield from _subtree_entries(child, tag, accept, node.depth)
            next_node = node

    def longest_common(self) -> tuple[EntryId, int] | None:
        """Any entry sharing the longest prefix with the request: (id, common length)."""
        if self._partial is not None:
            return next(_subtree_entries(self._partial, None, None, self._partial_depth))
        # Every entry under the deepest matched node shares exactly its depth.
        deepest = self._path[-1]
        return next(_subtree_entries(deepest, None, None, deepest.depth), None)


def _tag_in_siblings(node: _Node[EntryId], skipped: _Node[EntryId] | None, tag: str) -> bool:
    """Whether node's children other than skipped hold an entry with tag."""
    count = node.tag_counts.get(tag, 0)
    if skipped is not None:
        count -= skipped.tag_counts.get(tag, 0)
    for entry_tag in node.entries.values():
        count -= entry_tag == tag
    return count > 0


def _subtree_entries(
    top: _Node[EntryId], tag: str | None, accept: EntryFilter[EntryId] | None, common_length: int
) -> Iterator[tuple[EntryId, int]]:
    # Depth-first with iterators, so the first entry costs O(depth), not O(children).
    pending: list[Iterator[_Node[EntryId]]] = [iter((top,))]
    while pending:
        node = next(pending[-1], None)
        if node is None:
            pending.pop()
            continue
        if tag is not None and not node.tag_counts.get(tag):
            continue
        for entry_id, entry_tag in node.entries.items():
            if (tag is None or entry_tag == tag) and (accept is None or accept(entry_id)):
                yield entry_id, common_length
        if node.children:
            pending.append(iter(node.children.values()))


class RadixTrie(Generic[EntryId]):
    """Token sequences of one bucket; each entry id sits where its sequence ends."""

    def __init__(self) -> None:
        self._root: _Node[EntryId] = _Node(b"", None, 0)
        self._num_entries = 0

    def __len__(self) -> int:
        return self._num_entries

    def walk(self, tokens: TokenInput | PackedPrefix) -> TrieWalk[EntryId]:
        request = tokens if isinstance(tokens, PackedPrefix) else PackedPrefix(tokens)
        total = request.num_tokens * _TOKEN
        node = self._root
        path = [node]
        position = 0  # in bytes
        while position < total:
            data = request.up_to(position // _TOKEN + 1)
            child = node.children.get(data[position : position + _TOKEN])
            if child is None:
                break
            data = request.up_to((position + len(child.label)) // _TOKEN)
            matched = _common_tokens(data, position, child.label)
            if matched * _TOKEN < len(child.label):
                return TrieWalk(path, child, position // _TOKEN + matched)
            position += len(child.label)
            node = child
            path.append(node)
        return TrieWalk(path, None, 0)

    def insert(self, tokens: TokenInput, entry_id: EntryId, tag: str = "") -> None:
        data = _packed(tokens)
        node = self._root
        path = [node]
        position = 0
        while position < len(data):
            key = data[position : position + _TOKEN]
            child = node.children.get(key)
            if child is None:
                leaf = _Node(data[position:], node, len(data) // _TOKEN)
                node.children[key] = leaf
                path.append(leaf)
                node = leaf
                break
            matched = _common_tokens(data, position, child.label) * _TOKEN
            if matched < len(child.label):
                child = self._split(child, matched)
            position += matched
            node = child
            path.append(node)
        if entry_id in node.entries:
            raise KeyError(f"entry {entry_id!r} is already in the trie")
        node.entries[entry_id] = tag
        for visited in path:
            visited.tag_counts[tag] = visited.tag_counts.get(tag, 0) + 1
        self._num_entries += 1

    def remove(self, tokens: TokenInput, entry_id: EntryId) -> None:
        data = _packed(tokens)
        node = self._root
        position = 0
        while position < len(data):
            child = node.children.get(data[position : position + _TOKEN])
            if child is None or not data.startswith(child.label, position):
                raise KeyError(f"entry {entry_id!r} is not in the trie")
            position += len(child.label)
            node = child
        if entry_id not in node.entries:
            raise KeyError(f"entry {entry_id!r} is not in the trie")
        tag = node.entries.pop(entry_id)
        self._num_entries -= 1
        visited: _Node[EntryId] | None = node
        while visited is not None:
            remaining = visited.tag_counts[tag] - 1
            if remaining:
                visited.tag_counts[tag] = remaining
            else:
                del visited.tag_counts[tag]
            visited = visited.parent
        self._prune(node)

    def _split(self, child: _Node[EntryId], at: int) -> _Node[EntryId]:
        """Put a new node `at` bytes down child's edge and return it."""
        parent = child.parent
        assert parent is not None
        label = child.label
        middle = _Node(label[:at], parent, child.depth - (len(label) - at) // _TOKEN)
        middle.tag_counts = dict(child.tag_counts)
        parent.children[label[:_TOKEN]] = middle
        child.label = label[at:]
        child.parent = middle
        middle.children[child.label[:_TOKEN]] = child
        return middle

    def _prune(self, node: _Node[EntryId]) -> None:
        """Drop empty leaves and fold pass-through nodes into their only child."""
        while node.parent is not None and not node.entries:
            parent = node.parent
            if not node.children:
                del parent.children[node.label[:_TOKEN]]
                node = parent
                continue
            if len(node.children) == 1:
                (child,) = node.children.values()
                child.label = node.label + child.label
                child.parent = parent
                parent.children[child.label[:_TOKEN]] = child
            return
