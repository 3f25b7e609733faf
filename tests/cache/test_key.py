"""Cache key composition: golden digests, sensitivity, session and template rules."""

from __future__ import annotations

import struct

import attrs
import blake3
import pytest

from mlxcel.cache.key import (
    ANONYMOUS_SESSION,
    DOMAIN_SEPARATOR,
    TEXT_ONLY_MM_DIGEST,
    CacheContext,
    RopeRegime,
    effective_tool_choice,
    pack_tokens,
    prefix_digest,
    rope_regime_for,
    template_signature,
)

LLAMA = CacheContext(model_id="Llama-3.1-8B-Instruct", template_sig="ab" * 32)
PHI = CacheContext(
    model_id="phi-4",
    lora_id="lora-x",
    template_sig="cd" * 32,
    session_key="user-7",
    rope_regime=RopeRegime.LONG,
    mm_digest=bytes(range(32)),
)


def _field(text: str) -> bytes:
    data = text.encode("utf-8")
    return len(data).to_bytes(8, "little") + data


def _hand_assembled(context: CacheContext, tokens: list[int], prefix_len: int) -> bytes:
    """The digest input written out byte by byte, independent of key.py."""
    rope = b"\x00\x00" if context.rope_regime is None else b"\x01" + int(context.rope_regime).to_bytes(1, "little")
    data = (
        b"mlxcel:prompt-cache:v3"
        + _field(context.model_id)
        + _field(context.lora_id)
        + _field(context.template_sig)
        + _field(context.session_key)
        + rope
        + context.mm_digest
        + prefix_len.to_bytes(8, "little")
        + b"".join(token.to_bytes(4, "little", signed=True) for token in tokens[:prefix_len])
    )
    if context.cache_salt:
        data += _field(context.cache_salt)
    return blake3.blake3(data).digest()


def test_constants() -> None:
    assert DOMAIN_SEPARATOR == b"mlxcel:prompt-cache:v3"
    assert ANONYMOUS_SESSION == "__mlxcel_anon__"
    expected = blake3.blake3(b"mlxcel:prompt-cache:multimodal:v1" + bytes(16)).digest()
    assert expected == TEXT_ONLY_MM_DIGEST
    assert TEXT_ONLY_MM_DIGEST.hex() == "ef7a54571ae5a2a85fff7d834976109cec3359eaf80864632ea0830345495ef5"


@pytest.mark.parametrize(
    ("context", "tokens", "prefix_len"),
    [
        (LLAMA, [1, 2, 3, 128000, -1], 5),
        (PHI, list(range(40)), 33),
        (LLAMA, [5, 6], 0),
        (attrs.evolve(LLAMA, cache_salt="tenant-a"), [1, 2, 3], 3),
        (attrs.evolve(PHI, rope_regime=RopeRegime.SHORT, model_id="ünïcödé"), [2**31 - 1, -(2**31)], 2),
    ],
)
def test_digest_matches_hand_assembled_layout(
    context: CacheContext, tokens: list[int], prefix_len: int
) -> None:
    assert prefix_digest(context, tokens, prefix_len) == _hand_assembled(context, tokens, prefix_len)


def test_golden_digests() -> None:
    assert (
        prefix_digest(LLAMA, [1, 2, 3, 128000, -1], 5).hex()
        == "ff3c0ec18a588442da43b85cd0a77b51bfcd06d3a64519feb772852152c5e98b"
    )
    assert (
        prefix_digest(PHI, list(range(40)), 33).hex()
        == "c631b535d23a8695c3e524119604b9c174a0a1952bebc52bdf0cbe64f1e9eb1f"
    )
    salted = attrs.evolve(LLAMA, cache_salt="tenant-a")
    assert (
        prefix_digest(salted, [1, 2, 3], 3).hex()
        == "d78b301592405c297a3c8b6a6d2f647443ca2589347611477ab8718f846c41f4"
    )


def test_tokens_pack_as_int32_little_endian() -> None:
    assert pack_tokens([1, -1, 2**31 - 1]) == struct.pack("<3i", 1, -1, 2**31 - 1)
    assert pack_tokens([0x01020304]) == b"\x04\x03\x02\x01"
    with pytest.raises(struct.error):
        pack_tokens([2**31])


def test_prefix_len_bounds() -> None:
    with pytest.raises(ValueError):
        prefix_digest(LLAMA, [1, 2], 3)
    with pytest.raises(ValueError):
        prefix_digest(LLAMA, [1, 2], -1)
    assert prefix_digest(LLAMA, [1, 2, 9], 2) == prefix_digest(LLAMA, [1, 2], 2)


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "other-model"},
        {"lora_id": "adapter-scales"},
        {"template_sig": "ef" * 32},
        {"session_key": "someone"},
        {"rope_regime": RopeRegime.SHORT},
        {"rope_regime": RopeRegime.LONG},
        {"mm_digest": bytes(32)},
        {"cache_salt": "tenant-b"},
    ],
)
def test_every_dimension_changes_the_digest(change: dict) -> None:
    tokens = list(range(100, 140))
    changed = attrs.evolve(LLAMA, **change)
    assert prefix_digest(changed, tokens, 40) != prefix_digest(LLAMA, tokens, 40)


def test_tokens_and_prefix_len_change_the_digest() -> None:
    tokens = list(range(100, 140))
    base = prefix_digest(LLAMA, tokens, 40)
    assert prefix_digest(LLAMA, tokens, 39) != base
    assert prefix_digest(LLAMA, tokens[:-1] + [7], 40) != base


def test_length_prefixes_keep_fields_apart() -> None:
    # Moving a character across a field boundary must not collide.
    first = CacheContext(model_id="ab", lora_id="c", template_sig="t")
    second = CacheContext(model_id="a", lora_id="bc", template_sig="t")
    assert prefix_digest(first, [1], 1) != prefix_digest(second, [1], 1)


def test_salt_enters_bucket_and_digest_only_when_set() -> None:
    salted = attrs.evolve(LLAMA, cache_salt="tenant-a")
    assert salted.bucket != LLAMA.bucket
    assert LLAMA.bucket == (LLAMA.model_id, "", LLAMA.template_sig, "")
    assert attrs.evolve(LLAMA, cache_salt="tenant-b").bucket != salted.bucket


def test_context_validation_and_flags() -> None:
    assert not LLAMA.is_multimodal
    assert PHI.is_multimodal
    assert CacheContext(model_id="m", template_sig="t", rope_regime=1).rope_regime is RopeRegime.LONG
    with pytest.raises(ValueError):
        CacheContext(model_id="m", template_sig="t", mm_digest=b"short")
    with pytest.raises(TypeError):
        CacheContext(model_id=None, template_sig="t")  # type: ignore[arg-type]


def test_rope_regime_for() -> None:
    assert rope_regime_for(10_000, None) is None
    assert rope_regime_for(4096, 4096) is RopeRegime.SHORT
    assert rope_regime_for(4097, 4096) is RopeRegime.LONG


def _tool(name: str, parameters: dict | None = None) -> dict:
    return {
        "type": "function",
        "function": {"name": name, "description": f"{name} things", "parameters": parameters or {}},
    }


def test_template_signature_shape_and_golden() -> None:
    signature = template_signature(
        "{{ messages }}",
        {"b": 1, "a": [1, "é"]},
        "auto",
        [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}],
    )
    assert signature == "b0339004cbbe016a8d76901ee17f75adf573dc0f008f18062007100317e51d21"
    assert len(signature) == 64
    assert signature == signature.lower()


def test_template_signature_canonical_kwargs() -> None:
    first = template_signature("tpl", {"a": 1, "b": {"y": 2, "x": 3}}, "none", None)
    second = template_signature("tpl", {"b": {"x": 3, "y": 2}, "a": 1}, "none", None)
    assert first == second
    assert template_signature("tpl", {"a": 2, "b": {"x": 3, "y": 2}}, "none", None) != first


def test_template_signature_sensitivity() -> None:
    tools = [_tool("search"), _tool("fetch", {"type": "object", "properties": {"url": {"type": "string"}}})]
    base = template_signature("tpl", {}, "auto", tools)
    assert template_signature("tpl", {}, "auto", list(reversed(tools))) != base
    assert template_signature("tpl ", {}, "auto", tools) != base
    assert template_signature("tpl", {}, "required", tools) != base
    assert template_signature("tpl", {}, "auto", tools[:1]) != base
    assert template_signature("tpl", {}, "auto", None) != template_signature("tpl", {}, "auto", [])
    renamed = [tools[0], _tool("fetch2", tools[1]["function"]["parameters"])]
    assert template_signature("tpl", {}, "auto", renamed) != base
    reordered_schema = [tools[0], _tool("fetch", {"properties": {"url": {"type": "string"}}, "type": "object"})]
    assert template_signature("tpl", {}, "auto", reordered_schema) == base


def test_effective_tool_choice() -> None:
    tools = [_tool("search")]
    assert effective_tool_choice(None, None) == "none"
    assert effective_tool_choice(None, []) == "none"
    assert effective_tool_choice(None, tools) == "auto"
    for mode in ("auto", "none", "required"):
        assert effective_tool_choice(mode, tools) == mode
    forced = {"type": "function", "function": {"name": "search"}}
    assert effective_tool_choice(forced, tools) == "search"
    with pytest.raises(ValueError):
        effective_tool_choice("sometimes", tools)
    with pytest.raises(ValueError):
        effective_tool_choice({"type": "function", "function": {}}, tools)
