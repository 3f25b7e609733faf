"""The configuration tree and how it is read from flags and the environment.

Precedence for every setting: CLI flag, then its ``MLXCEL_*`` (or spec-named)
environment variable, then a compatibility alias (``LLAMA_ARG_CACHE_REUSE``),
then a model-aware default (filled in at startup, when ``None`` here), then the
built-in default.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import attrs

from mlxcel.cache.apc import ALGORITHMS, HashAlgorithm
from mlxcel.core.grammar_bounds import DEFAULT_GRAMMAR_BOUNDS
from mlxcel.model.adapters import AdapterSpec, parse_adapter_spec
from mlxcel.model.parser_names import parse_reasoning_parser, parse_tool_call_parser

GIB = 1 << 30


class ConfigError(Exception):
    """A bad flag or environment value: the CLI prints one line and exits 2."""


@attrs.frozen(kw_only=True)
class PromptCacheConfig:
    enabled: bool = True
    # None: sized from the model's config.json at startup.
    capacity_bytes: int | None = None
    max_entries: int = 1024
    ttl_seconds: float = 3600.0
    min_prefix: int = 32
    # The largest share of capacity_bytes that retention pins (cache_control, prompt_cache_retention) hold.
    pinned_share: float = 0.5
    apc_enabled: bool = True
    apc_block_size: int = 16
    apc_num_blocks: int | None = None
    apc_hash: HashAlgorithm = "sha256"
    snapshot_capacity_bytes: int | None = None
    snapshot_max_entries: int = 4096
    snapshot_ttl_seconds: float = 7200.0
    # Snapshot families: checkpoints at multiples of this many tokens of a long prompt (0: none),
    # the last snapshot_chunk_checkpoints of them before its history boundary.
    snapshot_checkpoint_tokens: int = 8192
    snapshot_chunk_checkpoints: int = 2
    # False keeps every lookup inside the request's own session (tenant isolation).
    cross_session: bool = True
    # Snapshot families: snapshot at the history boundary.
    boundary_snapshots: bool = True
    # Snapshot families: extend the snapshot over each reply in the background.
    warmup: bool = True
    # One log line per snapshot decision.
    trace: bool = False
    # The disk tier: a directory of content-addressed KV pieces, shared by the processes on a host (None: off).
    disk_dir: Path | None = None
    # Its byte budget, least recently used pieces deleted first, kept by whichever process writes.
    disk_bytes: int = 20 << 30
    # At most this many bytes a second written to it (SSD wear, and the device's host copies).
    disk_write_bytes_per_second: int = 256 << 20
    # Stored KV pieces kept quantized to this many bits (0: exact, the default) in groups of kv_group_size.
    kv_bits: int = 0
    kv_group_size: int = 64


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    # Sequences decoded together in one forward (an H200 decodes 64 rows of an 8B model in
    # the time of 16: gpu/README.md's floor).
    max_batch_size: int = 64
    # Decode steps in flight at most: 2 plans the next one while the device runs this one (1: lockstep).
    steps_ahead: int = 2
    # Prompts prefilled together in one forward.
    prefill_batch_size: int = 8
    # None: measured per backend (benchmarks/prefill_step.py): 256 on the CPU,
    # where attention dominates prefill, 2048 on a GPU.
    prefill_step_size: int | None = None
    # Requests waiting for a batch slot before new ones get 503.
    max_queued_requests: int = 256
    # Undelivered stream events per request before a slow client is dropped.
    client_buffer_events: int = 4096
    # Run each kind of step once at start-up (a GPU compiles kernels on first use).
    # None (auto): on a GPU only; on the CPU it cost 18 s with a 4-bit model and saved nothing.
    device_warmup: bool | None = None
    # Cache-hit starts in bucketed shapes and long prompts prefilled alone, so cuDNN
    # attention plans repeat and run unmasked (None, auto: with CUDA only).
    start_buckets: bool | None = None
    # Stored prefix tokens one step's cache hits may adopt in all: each is copied into the step's pass and
    # held there beside the store's copy, so this bounds a step's extra memory (8B: 128 KiB a token).
    max_step_hit_tokens: int = 32768  # core.plan.SHARED_HIT_KEPT_TOKENS (the config sits below the core)


KV_EVENT_FORMATS = ("positional", "map")


@attrs.frozen(kw_only=True)
class KvEventsConfig:
    """vLLM-style KV cache events over ZeroMQ (off unless ``endpoint`` is set)."""

    # A ZMQ PUB address, e.g. tcp://*:5557 (bound) or tcp://router:5557 (connected); None: off.
    endpoint: str | None = None
    topic: str = ""
    # A ZMQ ROUTER address answering replay requests from the buffer; None: no replay.
    replay_endpoint: str | None = None
    # "positional": events as tagged arrays (vLLM before mid-2026); "map": tagged maps (after).
    format: str = attrs.field(default="positional", validator=attrs.validators.in_(KV_EVENT_FORMATS))
    # Published batches kept for replay.
    buffer_steps: int = attrs.field(default=10_000, validator=attrs.validators.ge(1))

    @property
    def enabled(self) -> bool:
        return self.endpoint is not None


@attrs.frozen(kw_only=True)
class EngineConfig:
    # A local folder or a Hugging Face repo id; None: the built-in random-weight demo model.
    model_path: Path | None = None
    # The ids requests may name (the first is the one reported); empty: the model folder's name or repo id.
    served_model_names: tuple[str, ...] = ()
    # Replaces the model's chat template server-wide (the source text, not a path).
    chat_template: str | None = None
    # How replies are split into tool calls and thinking (mlxcel/model/reply_parsers.py); None:
    # inferred from the template in effect (tool calls) and the vocabulary (thinking), as mlx-lm does.
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # None: the model's max_position_embeddings.
    ctx_size: int | None = None
    chat_template_kwargs: Mapping[str, Any] = attrs.field(factory=dict)
    # LoRA adapters served unfused, in `--lora` order (their ids are 0, 1, ...).
    lora: tuple[AdapterSpec, ...] = ()
    # Load them at scale 0 (POST /lora-adapters or a request's `lora` turns them on).
    lora_init_without_apply: bool = False
    # Accept `chat_template` in a request's chat_template_kwargs (rendered in a bounded sandbox).
    allow_request_chat_template: bool = False
    # Seconds a request's grammar (JSON Schema, GBNF, strict or forced tools) may take to compile.
    grammar_timeout: float = 10.0
    # Milliseconds a decode step waits for a constrained row's token mask; a row whose mask is later ends
    # (its request fails), the others go on. None: 50 on a GPU, 200 on the CPU (docs/operations.md).
    grammar_mask_timeout_ms: int | None = None
    # Speculative decoding in the decode batch: "ngram" (prompt lookup), "draft" (a draft model) or "off";
    # K proposed tokens a step.
    speculative: str = "off"
    speculative_tokens: int = 4
    # The draft model of --speculative draft (a folder or repo id sharing the model's tokenizer).
    draft_model: Path | None = None
    prompt_cache: PromptCacheConfig = PromptCacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    kv_events: KvEventsConfig = KvEventsConfig()
    # Test-only fault hook: the device fails the first step from this number on
    # that runs a sequence (once), as an out-of-memory error when
    # fail_out_of_memory is set.
    fail_step: int | None = None
    fail_out_of_memory: bool = False


# Claude Code starts its system prompt with a line whose `cch=` changes on every request.
DEFAULT_VOLATILE_SYSTEM_PATTERNS: tuple[str, ...] = (r"^x-anthropic-billing-header:[^\n]*(?:\n|$)",)


@attrs.frozen(kw_only=True)
class ServerConfig:
    """The HTTP server's settings, whole: ``mlxcel.http.serve(engine, config)`` and ``create_app`` take it.

    Each field has one row in ``SERVER_SETTINGS`` (its flag and environment variables) and its default
    here only; the request parsers' ``Limits`` are derived from it (``mlxcel.http.validation.request_limits``).
    """

    host: str = "127.0.0.1"
    port: int = 8080
    metrics: bool = False
    log_level: str = "info"
    max_body_bytes: int = 16 << 20
    # The largest JSON Schema (canonical JSON) or GBNF grammar a request may send.
    max_grammar_bytes: int = DEFAULT_GRAMMAR_BOUNDS.max_bytes
    # Required as `Authorization: Bearer KEY` on every route but /health.
    api_key: str | None = attrs.field(default=None, repr=False)
    # When set, only this key may reset the cache or read /metrics.
    admin_api_key: str | None = attrs.field(default=None, repr=False)
    # Seconds in-flight streams get to finish after SIGTERM before they are cancelled.
    shutdown_grace_seconds: float = 30.0
    # Open connections at most (lowered to fit the open-file limit); the longest-idle one makes room.
    max_connections: int = 2048
    # Without an API key: connections one client address may hold (0: no bound); the address's
    # longest-waiting connection makes room for its next.
    max_connections_per_client: int = 256
    # Seconds a connection may sit without a complete request (before the first one and between them).
    keep_alive_timeout: float = 5.0
    # Seconds a request body may take to arrive before a 408.
    body_timeout: float = 60.0
    # One log line per request (method, path, status, time; never a prompt).
    access_log: bool = False
    # Processes running the HTTP edge apart from the engine's (0: it runs in the engine's process).
    api_processes: int = 0
    # "user": a gateway-set `user` scopes the session; "client": the client's key picks it.
    session_key_scope: str = "client"
    # /v1/messages: cut per-request lines (Claude Code's billing header) from the system prompt.
    normalize_volatile_system: bool = True
    # The patterns of those lines; None: the built-in list (DEFAULT_VOLATILE_SYSTEM_PATTERNS).
    volatile_system_patterns: tuple[str, ...] | None = None
    # /v1/responses: hosted tools (web_search...) are a 400 rather than left out of the model's view.
    refuse_hosted_tools: bool = False
    # Bounds of the stored /v1/responses replies behind `previous_response_id` (LRU past either).
    responses_store_entries: int = 1024
    responses_store_bytes: int = 64 << 20
    # Image parts: at most this many a request, this many bytes each (decoded).
    max_images: int = 8
    max_image_bytes: int = 20 << 20
    # `file://` image URLs are read under this folder only; None: refused.
    allow_image_files: str | None = None
    # `http(s)://` image URLs are fetched, each within max_image_bytes and image_fetch_timeout seconds.
    allow_image_urls: bool = False
    image_fetch_timeout: float = 10.0
    # Hosts and networks image fetches may reach although they are loopback, private or link-local.
    image_fetch_allow: tuple[str, ...] = ()


# --- value parsers ------------------------------------------------------------

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"expected a boolean (true/false/1/0), got {text!r}")


def parse_negated_bool(text: str) -> bool:
    """A ``MLXCEL_DISABLE_*`` switch: true turns the setting off."""
    return not parse_bool(text)


def parse_auto_bool(text: str) -> bool | None:
    """``auto`` (None: decided at start-up), ``true`` or ``false``."""
    if text.strip().lower() == "auto":
        return None
    try:
        return parse_bool(text)
    except ValueError:
        raise ValueError(f"expected auto, true or false, got {text!r}") from None


def parse_auto_milliseconds(text: str) -> int | None:
    """``auto`` (None: decided at start-up) or a positive number of milliseconds."""
    if text.strip().lower() == "auto":
        return None
    try:
        return parse_positive_int(text)
    except ValueError:
        raise ValueError(f"expected auto or a positive number of milliseconds, got {text!r}") from None


def parse_llama_cache_reuse(text: str) -> bool:
    """llama.cpp's ``--cache-reuse N``: a chunk size where 0 means off; booleans also accepted."""
    try:
        return int(text.strip()) > 0
    except ValueError:
        pass
    return parse_bool(text)


def _int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"expected an integer, got {text!r}") from None


def parse_non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise ValueError(f"expected a non-negative integer, got {text!r}")
    return value


MAX_API_PROCESSES = 64


def parse_api_processes(text: str) -> int:
    value = parse_non_negative_int(text)
    if value > MAX_API_PROCESSES:
        raise ValueError(f"expected at most {MAX_API_PROCESSES} processes, got {text!r}")
    return value


def parse_positive_int(text: str) -> int:
    value = _int(text)
    if value <= 0:
        raise ValueError(f"expected a positive integer, got {text!r}")
    return value


def parse_kv_bits(text: str) -> int:
    """0 (or off/none: exact), 8 or 4."""
    if text.strip().lower() in ("off", "none", "0"):
        return 0
    value = _int(text)
    if value not in (4, 8):
        raise ValueError(f"expected 8, 4 or 0 (off), got {text!r}")
    return value


def parse_kv_group_size(text: str) -> int:
    value = _int(text)
    if value not in (32, 64, 128):
        raise ValueError(f"expected 32, 64 or 128, got {text!r}")
    return value


def parse_seconds(text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise ValueError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"expected a positive number of seconds, got {text!r}")
    return value


def parse_share(text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise ValueError(f"expected a fraction from 0 to 1, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"expected a fraction from 0 to 1, got {text!r}")
    return value


def parse_hash(text: str) -> HashAlgorithm:
    value = text.strip().lower()
    for algorithm in ALGORITHMS:
        if value == algorithm:
            return algorithm
    raise ValueError(f"expected sha256 or blake3, got {text!r}")


def parse_chat_template(text: str) -> str:
    """``--chat-template``: Jinja source (it has ``{{`` or ``{%``), else the path of a file holding it."""
    if "{{" in text or "{%" in text:
        return text
    path = Path(text).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else error
        raise ValueError(f"cannot read the chat template file {str(path)!r}: {reason}") from None


def parse_template_kwargs(text: str) -> dict[str, Any]:
    """``--chat-template-kwargs``: a JSON object of extra template variables."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"expected a JSON object, got invalid JSON ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {type(value).__name__}")
    if "chat_template" in value:
        raise ValueError("set the template with --chat-template, not in the template kwargs")
    return value


def parse_model_name(text: str) -> str:
    name = text.strip()
    if not name:
        raise ValueError("expected a model name, got an empty string")
    return name


def parse_regex(text: str) -> str:
    try:
        re.compile(text, re.MULTILINE)
    except re.error as error:
        raise ValueError(f"not a valid regular expression ({error}): {text!r}") from None
    return text


def parse_zmq_endpoint(text: str) -> str:
    """A ZeroMQ address; a bare port is that port on loopback (``5557``: ``tcp://127.0.0.1:5557``, bound)."""
    value = text.strip()
    if value.isdigit() and 0 < int(value) < 65536:
        return f"tcp://127.0.0.1:{int(value)}"
    if not value.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"expected a port (bound on loopback) or a ZeroMQ address such as tcp://127.0.0.1:5557, "
                         f"got {text!r}")
    return value


def zmq_binds(endpoint: str) -> bool:
    """vLLM's rule (a wildcard or local-transport address is bound, any other connected to), and a loopback
    address is bound too: a publisher on loopback serves subscribers on this host."""
    return ("*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
            or zmq_loopback(endpoint))


def zmq_loopback(endpoint: str) -> bool:
    """A tcp address on loopback (127.0.0.0/8, ::1, localhost)."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def zmq_binds_beyond_loopback(endpoint: str) -> bool:
    """A bound tcp address other hosts can reach (a wildcard or an interface's address)."""
    return endpoint.startswith("tcp://") and zmq_binds(endpoint) and not zmq_loopback(endpoint)


def parse_kv_event_format(text: str) -> str:
    value = text.strip().lower()
    if value not in KV_EVENT_FORMATS:
        raise ValueError(f"expected positional or map, got {text!r}")
    return value


SPECULATIVE_MODES = ("ngram", "draft", "off")


def parse_speculative(text: str) -> str:
    value = text.strip().lower()
    if value not in SPECULATIVE_MODES:
        raise ValueError(f"expected ngram, draft or off, got {text!r}")
    return value


def parse_model_path(text: str) -> Path:
    if not text.strip():
        raise ValueError("expected a model folder or repo id")
    return Path(text.strip()).expanduser()


def check_speculative(engine: EngineConfig) -> None:
    """--speculative draft and --draft-model come together (ConfigError otherwise)."""
    if engine.speculative == "draft" and engine.draft_model is None:
        raise ConfigError("--speculative draft needs --draft-model PATH")
    if engine.draft_model is not None and engine.speculative != "draft":
        raise ConfigError(f"--draft-model is used by --speculative draft only (--speculative is {engine.speculative})")


def parse_speculative_tokens(text: str) -> int:
    value = parse_positive_int(text)
    if value > 16:
        raise ValueError(f"expected at most 16 tokens, got {text!r}")
    return value


def parse_folder(text: str) -> str:
    folder = Path(text.strip()).expanduser()
    if not folder.is_dir():
        raise ValueError(f"not a folder: {text!r}")
    return str(folder.resolve())


def parse_fetch_allow(text: str) -> str:
    """``--image-fetch-allow``: a host name, an address or a network in CIDR form."""
    value = text.strip()
    try:
        if "/" in value:
            ipaddress.ip_network(value, strict=False)
        elif not re.fullmatch(r"[A-Za-z0-9.-]+", value):
            ipaddress.ip_address(value)
    except ValueError:
        raise ValueError(f"expected a host name, an address or a network such as 10.0.0.0/8, got {text!r}") from None
    return value


def parse_host(text: str) -> str:
    value = text.strip()
    if not value:
        raise ValueError("expected a bind address, got an empty string")
    return value


def parse_port(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= 65535:
        raise ValueError(f"expected a port 0..65535, got {text!r}")
    return value


LOG_LEVELS = ("debug", "info", "warning", "error")


def parse_log_level(text: str) -> str:
    value = text.strip().lower()
    if value not in LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return value


def parse_session_key_scope(text: str) -> str:
    value = text.strip().lower()
    if value not in ("client", "user"):
        raise ValueError(f"expected client or user, got {text!r}")
    return value


def parse_directory(text: str) -> Path:
    """A directory to use (created at start-up if missing); not an existing file."""
    if not text.strip():
        raise ValueError("expected a directory, got an empty string")
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{str(path)!r} exists and is not a directory")
    return path


@attrs.frozen
class Setting:
    """One field of a config class: its flag and its environment variables, in precedence order.

    A new setting is two edits: the field (with its default) and its row here.
    """

    dest: str
    # None: environment only.
    flag: str | None
    env: tuple[str, ...]
    parse: Callable[[str], Any]
    help: str
    optional_value: bool = False  # `--flag` alone means true (`--flag[=BOOL]`)
    # One or more values (`--flag A B`; comma-separated in the environment), as a tuple.
    multiple: bool = False
    metavar: str = "NAME"


PROMPT_CACHE_SETTINGS = (
    Setting("enabled", "--prompt-cache-enabled",
            ("MLXCEL_PROMPT_CACHE_ENABLED", "LLAMA_ARG_CACHE_REUSE"), parse_bool,
            "enable the prompt-prefix KV cache (default true)", optional_value=True),
    Setting("capacity_bytes", "--prompt-cache-capacity-bytes",
            ("MLXCEL_PROMPT_CACHE_CAPACITY_BYTES",), parse_positive_int,
            "byte budget of the KV prefix store (default: model-aware, at least 2 GiB)"),
    Setting("max_entries", "--prompt-cache-max-entries",
            ("MLXCEL_PROMPT_CACHE_MAX_ENTRIES",), parse_positive_int,
            "most live prefix entries (default 1024)"),
    Setting("ttl_seconds", "--prompt-cache-ttl", ("MLXCEL_PROMPT_CACHE_TTL",),
            parse_seconds, "seconds an entry lives after its last hit (default 3600)"),
    Setting("min_prefix", "--prompt-cache-min-prefix",
            ("MLXCEL_PROMPT_CACHE_MIN_PREFIX",), parse_non_negative_int,
            "shortest prefix in tokens worth storing or adopting (default 32)"),
    Setting("pinned_share", "--prompt-cache-pinned-share",
            ("MLXCEL_PROMPT_CACHE_PINNED_SHARE",), parse_share,
            "largest share of the KV store's byte budget that retained prompts may pin against "
            "eviction, 0 to 1 (default 0.5; 0 turns pinning off)"),
    Setting("apc_enabled", "--apc-enabled", ("APC_ENABLED",), parse_bool,
            "block-level automatic prefix caching (default true)", optional_value=True),
    Setting("apc_block_size", "--apc-block-size", ("APC_BLOCK_SIZE",),
            parse_positive_int, "tokens per APC block (default 16)"),
    Setting("apc_num_blocks", "--apc-num-blocks", ("APC_NUM_BLOCKS",),
            parse_positive_int, "cap on tracked APC blocks (default: derived)"),
    Setting("apc_hash", "--apc-hash", ("APC_HASH",), parse_hash,
            "APC block hash: sha256 (default) or blake3"),
    Setting("snapshot_capacity_bytes", "--prompt-cache-snapshot-capacity-bytes",
            ("MLXCEL_PROMPT_CACHE_SNAPSHOT_CAPACITY_BYTES",), parse_positive_int,
            "byte budget of the session snapshot store (default: model-aware, at least 512 MiB)"),
    Setting("snapshot_max_entries", "--prompt-cache-snapshot-max-entries",
            ("MLXCEL_PROMPT_CACHE_SNAPSHOT_MAX_ENTRIES",), parse_positive_int,
            "most live session snapshots (default 4096)"),
    Setting("snapshot_ttl_seconds", "--prompt-cache-snapshot-ttl",
            ("MLXCEL_PROMPT_CACHE_SNAPSHOT_TTL",), parse_seconds,
            "seconds a session snapshot lives (default 7200)"),
    Setting("snapshot_checkpoint_tokens", "--prompt-cache-snapshot-checkpoint-tokens",
            ("MLXCEL_PROMPT_CACHE_SNAPSHOT_CHECKPOINT_TOKENS",), parse_non_negative_int,
            "snapshot families: checkpoint long prompts every this many tokens (default 8192; 0: off)"),
    Setting("snapshot_chunk_checkpoints", "--prompt-cache-snapshot-chunk-checkpoints",
            ("MLXCEL_PROMPT_CACHE_SNAPSHOT_CHUNK_CHECKPOINTS",), parse_non_negative_int,
            "snapshot families: most chunk checkpoints per prompt, the last before its boundary (default 2)"),
    Setting("cross_session", "--prompt-cache-cross-session", ("MLXCEL_PROMPT_CACHE_CROSS_SESSION",),
            parse_bool, "let a request reuse another session's prefix (default true; false isolates tenants)",
            optional_value=True),
    Setting("disk_dir", "--prompt-cache-dir", ("MLXCEL_PROMPT_CACHE_DIR",), parse_directory,
            "keep prompt-cache KV in this directory too, so it survives restarts and is shared by the "
            "servers on this host (default: off)"),
    Setting("disk_bytes", "--prompt-cache-disk-bytes", ("MLXCEL_PROMPT_CACHE_DISK_BYTES",), parse_positive_int,
            "byte budget of --prompt-cache-dir, least recently used pieces deleted first (default 20 GiB)"),
    Setting("disk_write_bytes_per_second", "--prompt-cache-disk-write-bytes-per-second",
            ("MLXCEL_PROMPT_CACHE_DISK_WRITE_BYTES_PER_SECOND",), parse_positive_int,
            "most bytes a second written to --prompt-cache-dir (default 256 MiB)"),
    Setting("kv_bits", "--prompt-cache-kv-bits", ("MLXCEL_PROMPT_CACHE_KV_BITS",), parse_kv_bits,
            "keep stored KV quantized to 8 or 4 bits, so the same budget holds ~1.9x / ~3.6x the tokens; "
            "a hit is then close to, not equal to, a cold run (default 0: exact)"),
    Setting("kv_group_size", "--prompt-cache-kv-group-size", ("MLXCEL_PROMPT_CACHE_KV_GROUP_SIZE",),
            parse_kv_group_size, "values sharing one scale and bias in quantized stored KV: 32, 64 or 128 "
            "(default 64)"),
    Setting("boundary_snapshots", None, ("MLXCEL_DISABLE_BOUNDARY_SNAPSHOT",), parse_negated_bool,
            "snapshot families: 1 stops snapshots at the history boundary"),
    Setting("warmup", None, ("MLXCEL_DISABLE_CACHE_WARMUP",), parse_negated_bool,
            "snapshot families: 1 stops extending snapshots over replies in the background"),
    Setting("trace", None, ("MLXCEL_APC_TRACE",), parse_bool, "1 logs one line per snapshot decision"),
)

SERVER_SETTINGS = (
    Setting("host", "--host", ("MLXCEL_HOST",), parse_host, "bind address (default 127.0.0.1)"),
    Setting("port", "--port", ("MLXCEL_PORT",), parse_port, "port (default 8080)"),
    Setting("metrics", "--metrics", (), parse_bool, "serve Prometheus metrics at /metrics", optional_value=True),
    Setting("log_level", "--log-level", (), parse_log_level,
            f"{', '.join(LOG_LEVELS)} (default info)"),
    Setting("api_key", "--api-key", ("MLXCEL_API_KEY",), str,
            "require `Authorization: Bearer KEY` on every route but /health"),
    Setting("admin_api_key", "--admin-api-key", ("MLXCEL_ADMIN_API_KEY",), str,
            "a separate key required for /v1/cache/reset and /metrics"),
    Setting("max_body_bytes", "--max-body-bytes", ("MLXCEL_MAX_BODY_BYTES",), parse_positive_int,
            "largest accepted request body (default 16 MiB)"),
    Setting("max_grammar_bytes", "--max-grammar-bytes", ("MLXCEL_MAX_GRAMMAR_BYTES",), parse_positive_int,
            "largest JSON Schema (response_format, json_schema, a tool's parameters) or GBNF grammar a "
            "request may send (default 256 KiB)"),
    Setting("shutdown_grace_seconds", "--shutdown-grace-seconds", ("MLXCEL_SHUTDOWN_GRACE_SECONDS",),
            parse_seconds, "after SIGTERM, seconds in-flight streams get to finish (default 30)"),
    Setting("max_connections", "--max-connections", ("MLXCEL_MAX_CONNECTIONS",), parse_positive_int,
            "open connections at most; when full, the one that has waited on its client longest (idle, "
            "or a body still arriving) is closed (default 2048)"),
    Setting("max_connections_per_client", "--max-connections-per-client", ("MLXCEL_MAX_CONNECTIONS_PER_CLIENT",),
            parse_non_negative_int, "without --api-key, connections one client address may hold; past it the "
            "address's own longest-waiting one is closed (default 256; 0: no bound; raise it behind a proxy)"),
    Setting("keep_alive_timeout", "--keep-alive-timeout", ("MLXCEL_KEEP_ALIVE_TIMEOUT",), parse_seconds,
            "seconds a connection may wait for its next complete request headers (default 5)"),
    Setting("body_timeout", "--body-timeout", ("MLXCEL_BODY_TIMEOUT",), parse_seconds,
            "seconds a request body may take to arrive before a 408 (default 60)"),
    Setting("api_processes", "--api-processes", ("MLXCEL_API_PROCESSES",), parse_api_processes,
            "run the HTTP edge (connections, parsing, prompt rendering, replies) in N processes of its own, beside the "
            "engine's; 0 keeps it in the engine's process (default 0, at most 64)"),
    Setting("access_log", "--access-log", ("MLXCEL_ACCESS_LOG",), parse_bool,
            "log one line per request: client, method, path, status, time (default false)",
            optional_value=True),
    Setting("session_key_scope", "--session-key-scope", ("MLXCEL_SESSION_KEY_SCOPE",),
            parse_session_key_scope,
            "client (default): the session is prompt_cache_key, else user; user: a gateway-set "
            "`user` is the session and a client's prompt_cache_key only subdivides it"),
    Setting("normalize_volatile_system", "--normalize-volatile-system", ("MLXCEL_NORMALIZE_VOLATILE_SYSTEM",),
            parse_bool, "cut per-request lines (Claude Code's x-anthropic-billing-header) from /v1/messages "
            "system prompts, so the prompt's prefix stays the same and cached (default true)", optional_value=True),
    Setting("volatile_system_patterns", "--volatile-system-pattern", ("MLXCEL_VOLATILE_SYSTEM_PATTERNS",),
            parse_regex, "regular expressions (multiline) whose matches --normalize-volatile-system cuts; "
            "they replace the built-in '^x-anthropic-billing-header:[^\\n]*(?:\\n|$)' (comma-separated in "
            "the environment)", multiple=True, metavar="REGEX"),
    Setting("refuse_hosted_tools", "--refuse-hosted-tools", ("MLXCEL_REFUSE_HOSTED_TOOLS",), parse_bool,
            "/v1/responses: refuse hosted tools (web_search, file_search, code_interpreter, computer_use, "
            "image_generation, mcp) with a 400, instead of leaving them out of the model's view and naming them "
            "in the X-Mlxcel-Dropped-Tools header (default false)", optional_value=True),
    Setting("responses_store_entries", "--responses-store-entries", ("MLXCEL_RESPONSES_STORE_ENTRIES",),
            parse_non_negative_int, "most stored /v1/responses replies kept for previous_response_id and "
            "GET /v1/responses/{id}, least recently used evicted first; 0 keeps none (default 1024)"),
    Setting("responses_store_bytes", "--responses-store-bytes", ("MLXCEL_RESPONSES_STORE_BYTES",),
            parse_positive_int, "byte bound of those stored replies, each with its whole conversation, "
            "as JSON (default 64 MiB)"),
    Setting("max_images", "--max-images", ("MLXCEL_MAX_IMAGES",), parse_non_negative_int,
            "image parts one request may carry; 0 refuses images (default 8)"),
    Setting("max_image_bytes", "--max-image-bytes", ("MLXCEL_MAX_IMAGE_BYTES",), parse_positive_int,
            "largest image part, decoded (default 20 MiB)"),
    Setting("allow_image_files", "--allow-image-files", ("MLXCEL_ALLOW_IMAGE_FILES",), parse_folder,
            "read file:// image URLs, only under this folder (default: refused)", metavar="DIR"),
    Setting("allow_image_urls", "--allow-image-urls", ("MLXCEL_ALLOW_IMAGE_URLS",), parse_bool,
            "fetch http(s):// image URLs, each within --max-image-bytes and --image-fetch-timeout "
            "(default false)", optional_value=True),
    Setting("image_fetch_timeout", "--image-fetch-timeout", ("MLXCEL_IMAGE_FETCH_TIMEOUT",), parse_seconds,
            "seconds a remote image's whole fetch may take, redirects included (default 10)"),
    Setting("image_fetch_allow", "--image-fetch-allow", ("MLXCEL_IMAGE_FETCH_ALLOW",), parse_fetch_allow,
            "a host name, address or network (CIDR) image fetches may reach although it is loopback, "
            "private, link-local or metadata (refused by default); repeatable", multiple=True,
            metavar="HOST|NETWORK"),
)

SCHEDULER_SETTINGS = (
    Setting("max_batch_size", "--max-batch-size", ("MLXCEL_MAX_BATCH_SIZE",),
            parse_positive_int, "sequences decoded together (default 64)"),
    Setting("steps_ahead", "--decode-steps-ahead", ("MLXCEL_DECODE_STEPS_AHEAD",),
            parse_positive_int, "steps planned ahead of the device (decode steps, and starts that "
            "share a pass); 1 runs host and device in lockstep (default 2)"),
    Setting("prefill_batch_size", "--prefill-batch-size", ("MLXCEL_PREFILL_BATCH_SIZE",),
            parse_positive_int, "prompts prefilled together (default 8)"),
    Setting("prefill_step_size", "--prefill-step-size", ("MLXCEL_PREFILL_STEP_SIZE",),
            parse_positive_int, "prompt tokens per prefill chunk (default: 256 on CPU, 2048 on GPU)"),
    Setting("max_queued_requests", "--max-queued-requests", ("MLXCEL_MAX_QUEUED_REQUESTS",),
            parse_positive_int, "waiting requests before new ones get 503 (default 256)"),
    Setting("device_warmup", "--device-warmup", ("MLXCEL_DEVICE_WARMUP",), parse_auto_bool,
            "run throwaway steps at start-up so the first request compiles no kernels: auto (on a GPU "
            "only), true or false (default auto)"),
    Setting("start_buckets", "--start-buckets", ("MLXCEL_START_BUCKETS",), parse_auto_bool,
            "start cache hits in bucketed lengths and prefill long prompts alone, so CUDA attention "
            "plans are reused and unmasked: auto (with CUDA only), true or false (default auto)"),
    Setting("max_step_hit_tokens", "--max-step-hit-tokens", ("MLXCEL_MAX_STEP_HIT_TOKENS",),
            parse_positive_int, "stored prefix tokens the cache hits started in one step may adopt in all; "
            "bounds the step's copies of them (default 32768)"),
)

ENGINE_SETTINGS = (
    Setting("ctx_size", "--ctx-size", (), parse_positive_int, "context size in tokens (default: the model's)"),
    Setting("lora", "--lora", ("MLXCEL_LORA",), parse_adapter_spec,
            "an mlx-lm LoRA adapter folder to serve unfused, optionally with its scale (PATH or "
            "PATH=SCALE, default 1: the adapter as trained); repeatable, ids 0, 1, ... in order",
            multiple=True, metavar="PATH[=SCALE]"),
    Setting("lora_init_without_apply", "--lora-init-without-apply", ("MLXCEL_LORA_INIT_WITHOUT_APPLY",),
            parse_bool, "load the --lora adapters at scale 0 (default false)", optional_value=True),
    Setting("allow_request_chat_template", "--allow-request-chat-template",
            ("MLXCEL_ALLOW_REQUEST_CHAT_TEMPLATE",), parse_bool,
            "accept a chat template in a request's chat_template_kwargs, rendered in a bounded "
            "sandbox (default false: such a request gets a 400)", optional_value=True),
    Setting("grammar_timeout", "--grammar-timeout", ("MLXCEL_GRAMMAR_TIMEOUT",), parse_seconds,
            "seconds a request's grammar (response_format, json_schema, grammar, strict or forced tools) "
            "may take to compile before the request gets a 400 (default 10)"),
    Setting("grammar_mask_timeout_ms", "--grammar-mask-timeout-ms", ("MLXCEL_GRAMMAR_MASK_TIMEOUT_MS",),
            parse_auto_milliseconds, "milliseconds a decode step waits for a constrained reply's next token "
            "mask; a reply whose mask is later ends with a 400 grammar_too_slow and the other replies go on "
            "(default auto: 50 on a GPU, 200 on the CPU, where masks share the cores with the forward pass)",
            metavar="MS"),
    Setting("speculative", "--speculative", ("MLXCEL_SPECULATIVE",), parse_speculative,
            "speculative decoding in the decode batch: ngram (prompt lookup: rows whose recent tokens "
            "occurred earlier in their prompt or reply verify the tokens that followed, several per forward "
            "pass), draft (--draft-model proposes each row's next tokens) or off (default off); outputs "
            "unchanged", metavar="MODE"),
    Setting("speculative_tokens", "--speculative-tokens", ("MLXCEL_SPECULATIVE_TOKENS",),
            parse_speculative_tokens, "tokens a row proposes per verify step with --speculative ngram or "
            "draft, 1 to 16 (default 4)", metavar="K"),
    Setting("draft_model", "--draft-model", ("MLXCEL_DRAFT_MODEL",), parse_model_path,
            "the draft model of --speculative draft: a model folder or Hugging Face repo id with the "
            "model's tokenizer (same vocabulary), loaded beside it", metavar="PATH"),
    Setting("served_model_names", "--served-model-name", ("MLXCEL_SERVED_MODEL_NAME",), parse_model_name,
            "the model ids requests may name, the first reported as the model's id (default: the model "
            "folder's name or repo id)", multiple=True),
    Setting("chat_template", "--chat-template", ("MLXCEL_CHAT_TEMPLATE",), parse_chat_template,
            "a Jinja chat template, or the path of a file holding one, used instead of the model's"),
    Setting("tool_call_parser", "--tool-call-parser", ("MLXCEL_TOOL_CALL_PARSER",), parse_tool_call_parser,
            "the tool-call format replies are parsed in: vLLM's name (hermes, mistral, pythonic, qwen3_coder, "
            "glm45, kimi_k2, ...) or an mlx_lm.tool_parsers module; 'none' turns tool-call parsing off "
            "(default: inferred from the chat template in effect)"),
    Setting("reasoning_parser", "--reasoning-parser", ("MLXCEL_REASONING_PARSER",), parse_reasoning_parser,
            "the thinking markers replies are split at: vLLM's name (deepseek_r1, qwen3, mistral, gemma4, "
            "...); 'none' keeps thinking in the content (default: inferred from the vocabulary)"),
    Setting("chat_template_kwargs", "--chat-template-kwargs", ("MLXCEL_CHAT_TEMPLATE_KWARGS",),
            parse_template_kwargs, "a JSON object of template variables for every request (a request's "
            "own chat_template_kwargs override them), e.g. '{\"enable_thinking\": false}'"),
)


KV_EVENTS_SETTINGS = (
    Setting("endpoint", "--kv-events-endpoint", ("MLXCEL_KV_EVENTS_ENDPOINT",), parse_zmq_endpoint,
            "publish vLLM-style KV cache events (msgpack KVEventBatch, with every prompt's tokens and "
            "cache_salt in the clear) on this ZeroMQ PUB address: a port binds it on loopback (5557: "
            "tcp://127.0.0.1:5557), tcp://*:5557 on every interface (default: off)", metavar="ADDRESS"),
    Setting("topic", "--kv-events-topic", ("MLXCEL_KV_EVENTS_TOPIC",), str,
            "the topic frame of every KV event message (default empty)", metavar="TOPIC"),
    Setting("replay_endpoint", "--kv-events-replay-endpoint", ("MLXCEL_KV_EVENTS_REPLAY_ENDPOINT",),
            parse_zmq_endpoint, "a ZeroMQ ROUTER address where a late subscriber asks for the batches it "
            "missed, from a buffer of the last 10,000 (default: no replay)", metavar="ADDRESS"),
    Setting("format", "--kv-events-format", ("MLXCEL_KV_EVENTS_FORMAT",), parse_kv_event_format,
            "positional (default: events as tagged arrays, as vLLM sent them until mid-2026) or map "
            "(tagged maps, as vLLM sends them since)", metavar="FORMAT"),
)


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _flag_type(setting: Setting) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return setting.parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    convert.__name__ = setting.dest
    return convert


def add_settings(parser: argparse.ArgumentParser, settings: tuple[Setting, ...]) -> None:
    for setting in settings:
        if setting.flag is None:
            continue
        env = f"; env {', '.join(setting.env)}" if setting.env else ""
        # SUPPRESS: a flag not given leaves no attribute, so a flag's own None (`auto`) still wins.
        kwargs: dict[str, Any] = dict(
            dest=setting.dest, type=_flag_type(setting), default=argparse.SUPPRESS, help=f"{setting.help}{env}",
        )
        if setting.optional_value:
            kwargs.update(nargs="?", const=True, metavar="BOOL")
        if setting.multiple:
            # `--flag A B` and `--flag A --flag B` alike.
            kwargs.update(nargs="+", action="extend", metavar=setting.metavar)
        parser.add_argument(setting.flag, **kwargs)


def resolve_settings(
    namespace: argparse.Namespace,
    settings: tuple[Setting, ...],
    environ: Mapping[str, str],
) -> dict[str, Any]:
    """Flag over environment, first variable listed wins; unset keys are omitted."""
    values: dict[str, Any] = {}
    given = vars(namespace)
    for setting in settings:
        if setting.dest in given:
            flag_value = given[setting.dest]
            values[setting.dest] = tuple(flag_value) if setting.multiple else flag_value
            continue
        for name in setting.env:
            raw = environ.get(name)
            if raw is None or raw == "":
                continue
            parse = parse_llama_cache_reuse if name == "LLAMA_ARG_CACHE_REUSE" else setting.parse
            try:
                values[setting.dest] = (
                    tuple(parse(item) for item in raw.split(",")) if setting.multiple else parse(raw)
                )
            except ValueError as error:
                raise ConfigError(f"{name}={raw!r}: {error}") from None
            break
    return values


_Config = TypeVar("_Config")


def config_from_settings(
    cls: type[_Config],
    settings: tuple[Setting, ...],
    namespace: argparse.Namespace,
    environ: Mapping[str, str],
    **fixed: Any,
) -> _Config:
    """``cls`` with every row of ``settings`` that a flag or the environment sets; its defaults otherwise."""
    return cls(**{**resolve_settings(namespace, settings, environ), **fixed})


def build_serve_parser(prog: str = "mlxcel serve") -> argparse.ArgumentParser:
    parser = _OneLineParser(prog=prog, description="Serve an OpenAI-compatible API.")
    parser.add_argument("-m", "--model", type=Path, default=None,
                        help="local model folder or Hugging Face repo id, resolved through the local hub "
                        "cache (HF_HUB_OFFLINE=1: the cache only) (default: the random-weight demo model)")
    parser.add_argument("--no-cache-prompt", action="store_true",
                        help="turn the prompt cache off server-wide")
    add_settings(parser, PROMPT_CACHE_SETTINGS)
    add_settings(parser, SCHEDULER_SETTINGS)
    add_settings(parser, SERVER_SETTINGS)
    add_settings(parser, ENGINE_SETTINGS)
    add_settings(parser, KV_EVENTS_SETTINGS)
    return parser


def build_configs(
    namespace: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> tuple[EngineConfig, ServerConfig]:
    environ = os.environ if environ is None else environ
    # `--no-cache-prompt` is llama.cpp's spelling of --prompt-cache-enabled=false.
    disabled = {"enabled": False} if namespace.no_cache_prompt else {}
    engine = config_from_settings(
        EngineConfig, ENGINE_SETTINGS, namespace, environ,
        model_path=namespace.model,
        prompt_cache=config_from_settings(PromptCacheConfig, PROMPT_CACHE_SETTINGS, namespace, environ, **disabled),
        scheduler=config_from_settings(SchedulerConfig, SCHEDULER_SETTINGS, namespace, environ),
        kv_events=config_from_settings(KvEventsConfig, KV_EVENTS_SETTINGS, namespace, environ),
    )
    check_speculative(engine)
    return engine, config_from_settings(ServerConfig, SERVER_SETTINGS, namespace, environ)
