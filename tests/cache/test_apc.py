"""APC block hash chains: golden values, propagation, multimodal separation."""

from __future__ import annotations

import hashlib

import blake3
import pytest
from hypothesis import given, settings, strategies as st

from mlxcel.cache.apc import BlockHasher, agreeing_blocks
from mlxcel.cache.key import TEXT_ONLY_MM_DIGEST, pack_tokens

ALGORITHMS = {"sha256": hashlib.sha256, "blake3": blake3.blake3}
OTHER_MM = bytes(range(32))


def _by_hand(algorithm: str, tokens: list[int], block_size: int, mm_digest: bytes) -> list[bytes]:
    new = ALGORITHMS[algorithm]
    parent = new(b"mlxcel:apc:root:v1").digest()
    chain = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = b"".join(t.to_bytes(4, "little", signed=True) for t in tokens[start : start + block_size])
        parent = new(parent + block + mm_digest).digest()
        chain.append(parent)
    return chain


@pytest.mark.parametrize("algorithm", ["sha256", "blake3"])
def test_chain_matches_hand_computed(algorithm: str) -> None:
    tokens = [5, -3, 151_000, 0, 7, 8, 9, 10, 11, 12, 13]
    hasher = BlockHasher(algorithm, 4)
    assert hasher.chain(tokens, TEXT_ONLY_MM_DIGEST) == _by_hand(algorithm, tokens, 4, TEXT_ONLY_MM_DIGEST)
    assert hasher.chain(tokens, OTHER_MM) == _by_hand(algorithm, tokens, 4, OTHER_MM)


def test_golden_values() -> None:
    tokens = list(range(10))
    sha = BlockHasher("sha256", 4)
    assert sha.root.hex() == "5a57ca1a4bb0bb1251e1474b7388fa23b06b15369de7569974457a1a9b2e48db"
    assert [h.hex() for h in sha.chain(tokens, TEXT_ONLY_MM_DIGEST)] == [
        "61732f00fa5776e6f231593751e138e8eda2ae0aeacc374904902661d6137191",
        "a2edb43ba6b9da6dcb2c04df7af4adc3cbd1b518d8792c532b14bba720377a26",
    ]
    fast = BlockHasher("blake3", 4)
    assert fast.root.hex() == "ba8564f786b0ad4f2f71109b75332c71a2555ca7ebd0cc1f9410991baeca5d04"
    assert [h.hex() for h in fast.chain(tokens, TEXT_ONLY_MM_DIGEST)] == [
        "2af20db6d64135042a05a0c03ba8d9f38c0603083a1749447f781019159818f8",
        "74b30e0363d2edf81b94c68ec5c983beb7cbb0730a3ff612e9065702ca8669e4",
    ]


def test_only_full_blocks_and_num_blocks() -> None:
    hasher = BlockHasher("sha256", 16)
    assert hasher.chain(list(range(15)), TEXT_ONLY_MM_DIGEST) == []
    assert len(hasher.chain(list(range(47)), TEXT_ONLY_MM_DIGEST)) == 2
    full = hasher.chain(list(range(64)), TEXT_ONLY_MM_DIGEST)
    assert hasher.chain(list(range(64)), TEXT_ONLY_MM_DIGEST, num_blocks=2) == full[:2]
    assert hasher.chain(list(range(64)), TEXT_ONLY_MM_DIGEST, num_blocks=99) == full


def test_bad_settings() -> None:
    with pytest.raises(ValueError):
        BlockHasher("md5", 16)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        BlockHasher("sha256", 0)


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 50), min_size=8, max_size=80),
    data=st.data(),
    algorithm=st.sampled_from(["sha256", "blake3"]),
)
def test_changed_token_changes_its_block_and_all_later(tokens: list[int], data, algorithm: str) -> None:
    block_size = 4
    hasher = BlockHasher(algorithm, block_size)
    position = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[position] += 1
    before = hasher.chain(tokens, TEXT_ONLY_MM_DIGEST)
    after = hasher.chain(changed, TEXT_ONLY_MM_DIGEST)
    block = position // block_size
    assert before[:block] == after[:block]
    assert all(a != b for a, b in zip(before[block:], after[block:], strict=False))
    assert agreeing_blocks(before, after) == min(block, len(before))


@settings(max_examples=40, deadline=None)
@given(tokens=st.lists(st.integers(-5, 5), min_size=0, max_size=70), split=st.integers(0, 20))
def test_extend_equals_chain(tokens: list[int], split: int) -> None:
    hasher = BlockHasher("sha256", 4)
    full = hasher.chain(tokens, OTHER_MM)
    prefix = full[:split]
    assert hasher.extend(prefix, tokens, OTHER_MM) == full
    assert hasher.extend_packed(prefix, pack_tokens(tokens), OTHER_MM) == full
    assert hasher.extend_packed(None, pack_tokens(tokens), OTHER_MM, num_blocks=3) == full[:3]


def test_other_mm_digest_never_agrees() -> None:
    hasher = BlockHasher("sha256", 4)
    tokens = list(range(32))
    text = hasher.chain(tokens, TEXT_ONLY_MM_DIGEST)
    image = hasher.chain(tokens, OTHER_MM)
    assert agreeing_blocks(text, image) == 0
    assert not set(text) & set(image)


def test_agreeing_blocks() -> None:
    assert agreeing_blocks([], [b"a"]) == 0
    assert agreeing_blocks([b"a", b"b"], [b"a", b"b", b"c"]) == 2
    assert agreeing_blocks([b"a", b"x", b"c"], [b"a", b"b", b"c"]) == 1
    assert agreeing_blocks((b"a",), [b"a"]) == 1
