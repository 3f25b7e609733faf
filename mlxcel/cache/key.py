"""Cache key composition: the context a prefix is valid in, and its digest.

The byte layout of `prefix_digest` is part of the on-wire contract and is
pinned by golden tests; `docs/prompt-cache.md` describes it.
"""

from __future__ import annotations

import enum
import json
import struct
from collections.abc import Mapping, Sequence

import attrs
import blake3

DOMAIN_SEPARATOR = b"mlxcel:prompt-cache:v3"
ANONYMOUS_SESSION = "__mlxcel_anon__"
MULTIMODAL_DOMAIN_SEPARATOR = b"mlxcel:prompt-cache:multimodal:v1"
TEMPLATE_DOMAIN_SEPARATOR = b"mlxcel:template-sig:v1"
TOOLS_DOMAIN_SEPARATOR = b"mlxcel:tools:v1"
DIGEST_SIZE = 32

_U64 = struct.Struct("<Q")


def u64le(value: int) -> bytes:
    return _U64.pack(value)


TEXT_ONLY_MM_DIGEST: bytes = blake3.blake3(
    MULTIMODAL_DOMAIN_SEPARATOR + u64le(0) + u64le(0)
).digest()


def multimodal_digest(images: Sequence[bytes]) -> bytes:
    """``mm_digest`` of a request's decoded image bytes, in the order they arrived.

    The separator, the image and audio counts, then each image length-prefixed;
    no images gives `TEXT_ONLY_MM_DIGEST`.
    """
    hasher = blake3.blake3(MULTIMODAL_DOMAIN_SEPARATOR + u64le(len(images)) + u64le(0))
    for data in images:
        hasher.update(length_prefixed(data))
    return hasher.digest()


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as consecutive signed 32-bit little-endian integers."""
    # struct's "<" fixes both size and byte order, whatever the host is.
    return struct.pack(f"<{len(tokens)}i", *tokens)


def length_prefixed(data: bytes) -> bytes:
    return _U64.pack(len(data)) + data


class RopeRegime(enum.IntEnum):
    SHORT = 0
    LONG = 1


def rope_regime_for(
    prompt_len: int, original_max_position_embeddings: int | None
) -> RopeRegime | None:
    """The LongRoPE table a prompt of this length is rotated with.

    None for models whose rotation does not depend on the prompt length.
    """
    if original_max_position_embeddings is None:
        return None
    if prompt_len > original_max_position_embeddings:
        return RopeRegime.LONG
    return RopeRegime.SHORT


def _to_rope_regime(value: RopeRegime | int | None) -> RopeRegime | None:
    return None if value is None else RopeRegime(value)


def _check_mm_digest(instance: object, attribute: attrs.Attribute, value: bytes) -> None:
    if not isinstance(value, bytes) or len(value) != DIGEST_SIZE:
        raise ValueError(f"{attribute.name} must be {DIGEST_SIZE} bytes")


@attrs.frozen(kw_only=True)
class CacheContext:
    """Everything besides the tokens that decides whether KV can be reused."""

    model_id: str = attrs.field(validator=attrs.validators.instance_of(str))
    lora_id: str = attrs.field(default="", validator=attrs.validators.instance_of(str))
    template_sig: str = attrs.field(validator=attrs.validators.instance_of(str))
    session_key: str = attrs.field(
        default=ANONYMOUS_SESSION, validator=attrs.validators.instance_of(str)
    )
    rope_regime: RopeRegime | None = attrs.field(default=None, converter=_to_rope_regime)
    mm_digest: bytes = attrs.field(default=TEXT_ONLY_MM_DIGEST, validator=_check_mm_digest)
    # Tenant isolation: a non-empty salt separates buckets and digests.
    cache_salt: str = attrs.field(default="", validator=attrs.validators.instance_of(str))

    @property
    def bucket(self) -> tuple[str, str, str, str]:
        """Entries in different buckets never serve each other, in any tier."""
        return (self.model_id, self.lora_id, self.template_sig, self.cache_salt)

    @property
    def is_multimodal(self) -> bool:
        return self.mm_digest != TEXT_ONLY_MM_DIGEST


@attrs.frozen
class TrieKey:
    """Which radix trie a context's prefixes live in: entries of one trie may serve each other."""

    bucket: tuple[str, str, str, str]
    rope_regime: RopeRegime | None
    mm_digest: bytes


@attrs.frozen
class SessionId:
    """One conversation's place in the stores: its session key within one model, adapter set and tenant.

    A session's newer snapshot supersedes its older ones, and a pending warm-up
    its older ones; both sides name a session with this.
    """

    model_id: str
    lora_id: str
    cache_salt: str
    session_key: str


def trie_key(context: CacheContext) -> TrieKey:
    return TrieKey(bucket=context.bucket, rope_regime=context.rope_regime, mm_digest=context.mm_digest)


def session_id(context: CacheContext) -> SessionId:
    return SessionId(model_id=context.model_id, lora_id=context.lora_id, cache_salt=context.cache_salt,
                     session_key=context.session_key)


def context_header(context: CacheContext) -> bytes:
    """The digest input that precedes prefix_len and the tokens."""
    rope = b"\x00\x00" if context.rope_regime is None else bytes((1, int(context.rope_regime)))
    return b"".join(
        (
            DOMAIN_SEPARATOR,
            length_prefixed(context.model_id.encode("utf-8")),
            length_prefixed(context.lora_id.encode("utf-8")),
            length_prefixed(context.template_sig.encode("utf-8")),
            length_prefixed(context.session_key.encode("utf-8")),
            rope,
            context.mm_digest,
        )
    )


def digest_packed(context: CacheContext, token_bytes: bytes) -> bytes:
    """`prefix_digest` over tokens already packed with `pack_tokens`."""
    if len(token_bytes) % 4:
        raise ValueError("token_bytes must hold whole 4-byte tokens")
    hasher = blake3.blake3(context_header(context))
    hasher.update(_U64.pack(len(token_bytes) // 4))
    hasher.update(token_bytes)
    if context.cache_salt:
        # A trailer after the tokens: unsalted inputs end where it would
        # begin, so salted and unsalted inputs can never coincide.
        hasher.update(length_prefixed(context.cache_salt.encode("utf-8")))
    return hasher.digest()


def prefix_digest(context: CacheContext, tokens: Sequence[int], prefix_len: int) -> bytes:
    """32-byte BLAKE3 digest identifying tokens[:prefix_len] under context."""
    if not 0 <= prefix_len <= len(tokens):
        raise ValueError(f"prefix_len {prefix_len} outside 0..{len(tokens)}")
    return digest_packed(context, pack_tokens(tokens[:prefix_len]))


def canonical_json(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _utf8_part(text: str) -> bytes:
    return length_prefixed(text.encode("utf-8"))


def tools_digest(tools: Sequence[Mapping] | None) -> bytes:
    """Order-preserving digest of a tools array; empty bytes when absent."""
    if tools is None:
        # Templates can tell "no tools key" from "empty list"; keep them apart.
        return b""
    hasher = blake3.blake3(TOOLS_DOMAIN_SEPARATOR)
    hasher.update(u64le(len(tools)))
    for tool in tools:
        function = tool.get("function") or {}
        hasher.update(_utf8_part(str(tool.get("type", "function"))))
        hasher.update(_utf8_part(str(function.get("name", ""))))
        hasher.update(_utf8_part(str(function.get("description") or "")))
        hasher.update(_utf8_part(canonical_json(function.get("parameters"))))
    return hasher.digest()


def template_signature(
    template_source: str,
    template_kwargs: Mapping,
    tool_choice: str,
    tools: Sequence[Mapping] | None,
) -> str:
    """64-char lowercase hex digest of everything that shapes the rendering."""
    hasher = blake3.blake3(TEMPLATE_DOMAIN_SEPARATOR)
    hasher.update(_utf8_part(template_source))
    hasher.update(_utf8_part(canonical_json(dict(template_kwargs))))
    hasher.update(_utf8_part(tool_choice))
    hasher.update(length_prefixed(tools_digest(tools)))
    return hasher.hexdigest()


_TOOL_CHOICE_MODES = frozenset({"auto", "none", "required"})


def effective_tool_choice(tool_choice: str | Mapping | None, tools: Sequence[Mapping] | None) -> str:
    """The mode string a request renders with: a mode, or the forced function's name."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in _TOOL_CHOICE_MODES:
            raise ValueError(f"unknown tool_choice {tool_choice!r}")
        return tool_choice
    if isinstance(tool_choice, Mapping):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if tool_choice.get("type") == "function" and isinstance(name, str) and name:
            return name
    raise ValueError(f"unsupported tool_choice {tool_choice!r}")
