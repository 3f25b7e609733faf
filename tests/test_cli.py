"""The command line and configuration: precedence, aliases, and one-line errors with status 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mlxcel.config import ConfigError, build_configs, build_serve_parser


def configs(argv: list[str], environ: dict[str, str] | None = None):
    return build_configs(build_serve_parser().parse_args(argv), environ or {})


def test_flags_win_over_environment_and_defaults_hold() -> None:
    engine, server = configs([], {})
    assert engine.prompt_cache.enabled
    assert engine.prompt_cache.max_entries == 1024
    assert engine.prompt_cache.capacity_bytes is None  # model-aware at startup
    assert server.host == "127.0.0.1"
    assert server.port == 8080
    engine, _ = configs(["--prompt-cache-max-entries", "7"], {"MLXCEL_PROMPT_CACHE_MAX_ENTRIES": "9"})
    assert engine.prompt_cache.max_entries == 7
    engine, _ = configs([], {"MLXCEL_PROMPT_CACHE_MAX_ENTRIES": "9", "APC_HASH": "blake3", "APC_BLOCK_SIZE": "32"})
    assert engine.prompt_cache.max_entries == 9
    assert engine.prompt_cache.apc_hash == "blake3"
    assert engine.prompt_cache.apc_block_size == 32


def test_the_disk_tier_is_off_until_a_directory_is_given(tmp_path) -> None:
    engine, _ = configs([])
    assert engine.prompt_cache.disk_dir is None
    engine, _ = configs(["--prompt-cache-dir", str(tmp_path / "a"), "--prompt-cache-disk-bytes", "1000"],
                        {"MLXCEL_PROMPT_CACHE_DIR": str(tmp_path / "b")})
    assert (engine.prompt_cache.disk_dir, engine.prompt_cache.disk_bytes) == (tmp_path / "a", 1000)
    engine, _ = configs([], {"MLXCEL_PROMPT_CACHE_DIR": str(tmp_path / "b"),
                             "MLXCEL_PROMPT_CACHE_DISK_WRITE_BYTES_PER_SECOND": "4096"})
    assert engine.prompt_cache.disk_dir == tmp_path / "b"
    assert engine.prompt_cache.disk_write_bytes_per_second == 4096


def test_stored_kv_is_exact_unless_kv_bits_are_given() -> None:
    engine, _ = configs([])
    assert (engine.prompt_cache.kv_bits, engine.prompt_cache.kv_group_size) == (0, 64)
    engine, _ = configs(["--prompt-cache-kv-bits", "8"], {"MLXCEL_PROMPT_CACHE_KV_BITS": "4",
                                                          "MLXCEL_PROMPT_CACHE_KV_GROUP_SIZE": "128"})
    assert (engine.prompt_cache.kv_bits, engine.prompt_cache.kv_group_size) == (8, 128)
    engine, _ = configs(["--prompt-cache-kv-bits", "off"])
    assert engine.prompt_cache.kv_bits == 0


@pytest.mark.parametrize(("argv", "environ", "enabled"), [
    (["--prompt-cache-enabled=false"], {"MLXCEL_PROMPT_CACHE_ENABLED": "true"}, False),
    (["--prompt-cache-enabled"], {"MLXCEL_PROMPT_CACHE_ENABLED": "0"}, True),
    ([], {"MLXCEL_PROMPT_CACHE_ENABLED": "false", "LLAMA_ARG_CACHE_REUSE": "256"}, False),
    ([], {"LLAMA_ARG_CACHE_REUSE": "0"}, False),
    ([], {"LLAMA_ARG_CACHE_REUSE": "256"}, True),
    (["--no-cache-prompt"], {}, False),
])
def test_enabled_precedence_and_the_llama_cpp_alias(argv, environ, enabled) -> None:
    engine, _ = configs(argv, environ)
    assert engine.prompt_cache.enabled is enabled


def test_apc_and_cross_session_switches() -> None:
    engine, _ = configs(["--apc-enabled=false", "--prompt-cache-cross-session=false"])
    assert not engine.prompt_cache.apc_enabled
    assert not engine.prompt_cache.cross_session
    engine, _ = configs([], {"MLXCEL_DISABLE_BOUNDARY_SNAPSHOT": "1", "MLXCEL_APC_TRACE": "1"})
    assert not engine.prompt_cache.boundary_snapshots
    assert engine.prompt_cache.warmup
    assert engine.prompt_cache.trace
    engine, _ = configs([], {"MLXCEL_DISABLE_CACHE_WARMUP": "yes", "MLXCEL_DISABLE_BOUNDARY_SNAPSHOT": "0"})
    assert (engine.prompt_cache.warmup, engine.prompt_cache.boundary_snapshots) == (False, True)
    with pytest.raises(ConfigError, match="MLXCEL_DISABLE_CACHE_WARMUP"):
        configs([], {"MLXCEL_DISABLE_CACHE_WARMUP": "maybe"})


def test_host_port_metrics_and_log_level_are_settings_like_the_others() -> None:
    _, server = configs([], {"MLXCEL_HOST": "0.0.0.0", "MLXCEL_PORT": "9000"})
    assert (server.host, server.port, server.metrics, server.log_level) == ("0.0.0.0", 9000, False, "info")
    _, server = configs(["--host", "::1", "--port", "0", "--metrics", "--log-level", "debug"],
                        {"MLXCEL_HOST": "0.0.0.0", "MLXCEL_PORT": "9000"})
    assert (server.host, server.port, server.metrics, server.log_level) == ("::1", 0, True, "debug")
    with pytest.raises(ConfigError, match="MLXCEL_PORT='65536'"):
        configs([], {"MLXCEL_PORT": "65536"})
    with pytest.raises(SystemExit):
        configs(["--log-level", "loud"])


def test_every_server_field_is_one_setting_row() -> None:
    """No HTTP setting is wired by hand: each field of ServerConfig has exactly one row, and each row of a
    table names a field of the config it builds."""
    import attrs

    from mlxcel.config import (
        ENGINE_SETTINGS,
        KV_EVENTS_SETTINGS,
        PROMPT_CACHE_SETTINGS,
        SCHEDULER_SETTINGS,
        SERVER_SETTINGS,
        EngineConfig,
        KvEventsConfig,
        PromptCacheConfig,
        SchedulerConfig,
        ServerConfig,
    )

    rows = [setting.dest for setting in SERVER_SETTINGS]
    assert sorted(rows) == sorted(attrs.fields_dict(ServerConfig))
    assert set(attrs.fields_dict(PromptCacheConfig)) == {setting.dest for setting in PROMPT_CACHE_SETTINGS}
    for table, cls in ((SCHEDULER_SETTINGS, SchedulerConfig), (ENGINE_SETTINGS, EngineConfig),
                       (KV_EVENTS_SETTINGS, KvEventsConfig)):
        assert {setting.dest for setting in table} <= set(attrs.fields_dict(cls)), cls
    flags = [setting.flag for table in (PROMPT_CACHE_SETTINGS, SCHEDULER_SETTINGS, SERVER_SETTINGS,
                                         ENGINE_SETTINGS, KV_EVENTS_SETTINGS) for setting in table if setting.flag]
    assert len(flags) == len(set(flags))


def test_a_new_http_setting_is_a_field_and_a_row() -> None:
    """The two places: a field (with its default) on ServerConfig and its Setting row. Nothing else is
    wired, and the value reaches the app's config whole."""
    import argparse

    import attrs

    from mlxcel.config import SERVER_SETTINGS, ServerConfig, Setting, add_settings, config_from_settings, parse_bool
    from mlxcel.http.app import create_app
    from tests.fakes import FakeEngine

    @attrs.frozen(kw_only=True)
    class WithGreeting(ServerConfig):
        greeting: bool = False  # place one

    rows = (*SERVER_SETTINGS, Setting("greeting", "--greeting", ("MLXCEL_GREETING",), parse_bool,
                                      "say hello", optional_value=True))  # place two
    parser = argparse.ArgumentParser()
    add_settings(parser, rows)

    def build(argv: list[str], environ: dict[str, str]) -> WithGreeting:
        return config_from_settings(WithGreeting, rows, parser.parse_args(argv), environ)

    assert not build([], {}).greeting
    assert build([], {"MLXCEL_GREETING": "1"}).greeting
    config = build(["--greeting", "--max-images", "3"], {"MLXCEL_GREETING": "0", "MLXCEL_PORT": "9"})
    assert (config.greeting, config.max_images, config.port) == (True, 3, 9)
    app = create_app(FakeEngine(), config)
    assert app.config["MLXCEL_SERVER"].greeting is True


@pytest.mark.parametrize(("argv", "environ", "buckets"), [
    ([], {}, None),
    (["--start-buckets", "auto"], {"MLXCEL_START_BUCKETS": "false"}, None),
    ([], {"MLXCEL_START_BUCKETS": "false"}, False),
    (["--start-buckets=on"], {}, True),
])
def test_start_buckets_is_auto_true_or_false(argv, environ, buckets) -> None:
    engine, _ = configs(argv, environ)
    assert engine.scheduler.start_buckets is buckets


def test_step_hit_bound_defaults_to_the_cores_and_takes_flag_or_environment() -> None:
    from mlxcel.core.plan import SHARED_HIT_KEPT_TOKENS, Capabilities

    default = configs([])[0].scheduler.max_step_hit_tokens
    assert default == SHARED_HIT_KEPT_TOKENS == Capabilities(prefill_step_size=1, context_size=1).hit_kept_tokens
    assert configs([], {"MLXCEL_MAX_STEP_HIT_TOKENS": "65536"})[0].scheduler.max_step_hit_tokens == 65536
    assert configs(["--max-step-hit-tokens", "1024"], {"MLXCEL_MAX_STEP_HIT_TOKENS": "65536"})[0] \
        .scheduler.max_step_hit_tokens == 1024
    with pytest.raises(ConfigError, match="MLXCEL_MAX_STEP_HIT_TOKENS"):
        configs([], {"MLXCEL_MAX_STEP_HIT_TOKENS": "0"})


def test_pinned_share_flag_environment_and_bounds() -> None:
    assert configs([])[0].prompt_cache.pinned_share == 0.5
    engine, _ = configs(["--prompt-cache-pinned-share", "0.25"], {"MLXCEL_PROMPT_CACHE_PINNED_SHARE": "0.9"})
    assert engine.prompt_cache.pinned_share == 0.25
    assert configs([], {"MLXCEL_PROMPT_CACHE_PINNED_SHARE": "0"})[0].prompt_cache.pinned_share == 0.0
    for bad in ("1.5", "-0.1", "half"):
        with pytest.raises(ConfigError, match="MLXCEL_PROMPT_CACHE_PINNED_SHARE"):
            configs([], {"MLXCEL_PROMPT_CACHE_PINNED_SHARE": bad})


def test_reply_parser_flags_reach_the_config() -> None:
    engine = configs(["--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"], {})[0]
    assert (engine.tool_call_parser, engine.reasoning_parser) == ("hermes", "qwen3")
    assert configs([], {})[0].tool_call_parser is None


def test_bad_environment_values_name_the_variable() -> None:
    with pytest.raises(ConfigError, match="MLXCEL_PROMPT_CACHE_TTL"):
        configs([], {"MLXCEL_PROMPT_CACHE_TTL": "soon"})
    with pytest.raises(ConfigError, match="APC_HASH"):
        configs([], {"APC_HASH": "md5"})


USER_ERRORS = [
    (["serve", "--prompt-cache-ttl", "abc"], {}, "--prompt-cache-ttl"),
    (["serve", "--apc-hash", "md5"], {}, "--apc-hash"),
    (["serve", "--start-buckets", "sometimes"], {}, "--start-buckets"),
    (["serve", "--bogus-flag"], {}, "unrecognized"),
    (["serve", "--prompt-cache-dir", "/etc/hostname"], {}, "exists and is not a directory"),
    (["serve", "--prompt-cache-disk-bytes", "0"], {}, "--prompt-cache-disk-bytes"),
    (["serve"], {"MLXCEL_PROMPT_CACHE_DISK_BYTES": "lots"}, "MLXCEL_PROMPT_CACHE_DISK_BYTES"),
    (["serve"], {"MLXCEL_PROMPT_CACHE_MAX_ENTRIES": "x"}, "MLXCEL_PROMPT_CACHE_MAX_ENTRIES"),
    (["serve", "-m", "/nonexistent/model"], {}, "model folder not found"),
    (["serve", "-m", "some-org/missing-model"], {"HF_HOME": "/nonexistent/hf"},
     "'some-org/missing-model' is neither a local folder nor a repo in the Hugging Face cache"),
    (["serve", "--chat-template-kwargs", "{bad"], {}, "--chat-template-kwargs: expected a JSON object"),
    (["serve", "--chat-template-kwargs", "[1]"], {}, "expected a JSON object, got list"),
    (["serve"], {"MLXCEL_CHAT_TEMPLATE_KWARGS": "nope"}, "MLXCEL_CHAT_TEMPLATE_KWARGS"),
    (["serve", "--chat-template", "/nonexistent/template.jinja"], {}, "cannot read the chat template file"),
    (["serve", "--tool-call-parser", "nope"], {}, "unknown tool-call parser 'nope'"),
    (["serve"], {"MLXCEL_REASONING_PARSER": "nope"}, "MLXCEL_REASONING_PARSER"),
    (["serve", "--prompt-cache-kv-bits", "3"], {}, "--prompt-cache-kv-bits"),
    (["serve", "--port", "70000"], {}, "--port: expected a port 0..65535"),
    (["serve"], {"MLXCEL_PORT": "eighty"}, "MLXCEL_PORT"),
    (["serve"], {"MLXCEL_PROMPT_CACHE_KV_GROUP_SIZE": "48"}, "MLXCEL_PROMPT_CACHE_KV_GROUP_SIZE"),
    (["serve", "--speculative", "draft"], {}, "--speculative draft needs --draft-model PATH"),
    (["serve", "--draft-model", "/nonexistent/draft"], {}, "--draft-model is used by --speculative draft only"),
    (["serve", "--speculative", "ngram"], {"MLXCEL_DRAFT_MODEL": "/x"}, "--draft-model is used by --speculative"),
    (["serve", "--speculative", "eagle"], {}, "expected ngram, draft or off"),
    (["nonsense"], {}, "unknown command"),
]


@pytest.fixture(scope="module")
def user_error_runs() -> list[subprocess.CompletedProcess[str]]:
    """Each of USER_ERRORS run by ``python -m mlxcel`` in a fresh process with a bare environment, all at once.

    Started together rather than one after another: each is an interpreter importing
    mlxcel (~0.4 s of CPU), and a second core halves the wait.
    """
    processes = [
        (argv, subprocess.Popen(
            [sys.executable, "-m", "mlxcel", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", **environ},
        ))
        for argv, environ, _ in USER_ERRORS
    ]
    runs = []
    for argv, process in processes:
        stdout, stderr = process.communicate(timeout=120)
        runs.append(subprocess.CompletedProcess(argv, process.returncode, stdout, stderr))
    return runs


@pytest.mark.parametrize(("case", "needle"), [(index, needle) for index, (_, _, needle) in enumerate(USER_ERRORS)])
def test_user_errors_exit_2_with_one_line(user_error_runs, case: int, needle: str) -> None:
    result = user_error_runs[case]
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert needle in lines[0], result.stderr


@pytest.mark.slow
def test_a_busy_port_fails_at_once_with_one_line() -> None:
    import socket
    import time

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "mlxcel", "serve", "--port", str(port), "--log-level", "warning"],
            capture_output=True, text=True, timeout=120, check=False,
            env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
        )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in lines[0], result.stderr
    # Before the model loads (which alone takes seconds); generous for a loaded machine.
    assert time.monotonic() - started < 30


@pytest.mark.parametrize(("argv", "environ", "warm_up"), [
    ([], {}, None),
    (["--device-warmup", "auto"], {"MLXCEL_DEVICE_WARMUP": "false"}, None),
    ([], {"MLXCEL_DEVICE_WARMUP": "false"}, False),
    (["--device-warmup=true"], {}, True),
])
def test_device_warmup_is_auto_true_or_false(argv, environ, warm_up) -> None:
    engine, _ = configs(argv, environ)
    assert engine.scheduler.device_warmup is warm_up


def test_served_model_names_and_chat_template_settings(tmp_path) -> None:
    engine, _ = configs(["--served-model-name", "gpt-4o", "smol"])
    assert engine.served_model_names == ("gpt-4o", "smol")
    engine, _ = configs([], {"MLXCEL_SERVED_MODEL_NAME": "a,b"})
    assert engine.served_model_names == ("a", "b")
    assert configs([])[0].served_model_names == ()
    template_file = tmp_path / "template.jinja"
    template_file.write_text("{{ messages[0]['content'] }}")
    engine, _ = configs(["--chat-template", str(template_file), "--chat-template-kwargs", '{"enable_thinking": false}'])
    assert engine.chat_template == "{{ messages[0]['content'] }}"
    assert engine.chat_template_kwargs == {"enable_thinking": False}
    # Jinja source is taken as it is.
    assert configs(["--chat-template", "{% for m in messages %}{{ m.content }}{% endfor %}"])[0].chat_template == (
        "{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(SystemExit):
        configs(["--chat-template-kwargs", '{"chat_template": "x"}'])


def test_request_limits_defaults_are_the_server_defaults() -> None:
    from mlxcel.config import ServerConfig
    from mlxcel.http.validation import Limits, request_limits

    assert request_limits(ServerConfig()) == Limits()


def test_volatile_system_normalization_flags() -> None:
    from mlxcel.http.validation import DEFAULT_VOLATILE_SYSTEM_PATTERNS, request_limits

    _, server = configs([])
    assert request_limits(server).volatile_system_patterns == DEFAULT_VOLATILE_SYSTEM_PATTERNS
    for argv, environ in ((["--normalize-volatile-system=false"], {}), ([], {"MLXCEL_NORMALIZE_VOLATILE_SYSTEM": "0"}),
                          (["--normalize-volatile-system", "off", "--volatile-system-pattern", "^a"], {})):
        _, server = configs(argv, environ)
        assert request_limits(server).volatile_system_patterns == ()
    _, server = configs(["--volatile-system-pattern", "^Date: .*$", "^x-"], {"MLXCEL_VOLATILE_SYSTEM_PATTERNS": "^b"})
    assert request_limits(server).volatile_system_patterns == ("^Date: .*$", "^x-")
    _, server = configs([], {"MLXCEL_VOLATILE_SYSTEM_PATTERNS": "^a,^b"})
    assert request_limits(server).volatile_system_patterns == ("^a", "^b")
    with pytest.raises(ConfigError, match="MLXCEL_VOLATILE_SYSTEM_PATTERNS"):
        configs([], {"MLXCEL_VOLATILE_SYSTEM_PATTERNS": "("})


def test_startup_warns_of_keys_without_isolation_and_of_kv_events_beyond_loopback() -> None:
    from mlxcel.cli import startup_warnings
    from mlxcel.config import EngineConfig, KvEventsConfig, PromptCacheConfig, ServerConfig

    def warnings(argv: list[str], environ: dict[str, str] | None = None) -> list[str]:
        engine, server = configs(argv, environ or {})
        return startup_warnings(engine, server)

    assert warnings([]) == []
    (keyed,) = warnings([], {"MLXCEL_API_KEY": "k"})
    assert "not isolated" in keyed
    assert "cache_salt" in keyed
    # Cross-session off isolates; no cache, nothing to leak.
    assert warnings(["--prompt-cache-cross-session=false"], {"MLXCEL_API_KEY": "k"}) == []
    assert startup_warnings(EngineConfig(prompt_cache=PromptCacheConfig(enabled=False)),
                            ServerConfig(api_key="k")) == []
    # A bare port binds loopback, which is quiet; a wildcard or an interface's address is not.
    engine, _ = configs(["--kv-events-endpoint", "5557"], {})
    assert engine.kv_events.endpoint == "tcp://127.0.0.1:5557"
    assert warnings(["--kv-events-endpoint", "5557"]) == []
    assert warnings(["--kv-events-endpoint", "ipc:///tmp/mlxcel-events"]) == []
    assert warnings(["--kv-events-endpoint", "tcp://collector:5557"]) == []  # connected to, not bound
    for endpoint in ("tcp://*:5557", "tcp://[::]:5557"):
        (warning,) = startup_warnings(EngineConfig(kv_events=KvEventsConfig(endpoint=endpoint)), ServerConfig())
        assert "beyond loopback" in warning
        assert "cache_salt in the clear" in warning


def test_kv_event_addresses_bind_as_vllm_does_and_on_loopback() -> None:
    from mlxcel.config import zmq_binds

    assert zmq_binds("tcp://*:5557")
    assert zmq_binds("ipc:///run/events")
    assert zmq_binds("tcp://127.0.0.1:5557")
    assert zmq_binds("tcp://[::1]:5557")
    assert not zmq_binds("tcp://collector:5557")
    assert not zmq_binds("tcp://10.0.0.5:5557")
def test_grammar_and_connection_bounds_flags() -> None:
    from mlxcel.http.validation import request_limits

    engine, server = configs([])
    assert engine.grammar_timeout == 10.0
    assert request_limits(server).grammar.max_bytes == 256 << 10
    assert server.max_connections_per_client == 256
    engine, server = configs(["--grammar-timeout", "2.5", "--max-grammar-bytes", "4096",
                              "--max-connections-per-client", "0"])
    assert engine.grammar_timeout == 2.5
    assert request_limits(server).grammar.max_bytes == 4096
    assert server.max_connections_per_client == 0
    engine, server = configs([], {"MLXCEL_GRAMMAR_TIMEOUT": "3", "MLXCEL_MAX_GRAMMAR_BYTES": "100",
                                  "MLXCEL_MAX_CONNECTIONS_PER_CLIENT": "8"})
    assert (engine.grammar_timeout, request_limits(server).grammar.max_bytes) == (3.0, 100)
    assert server.max_connections_per_client == 8
    with pytest.raises(ConfigError, match="MLXCEL_GRAMMAR_TIMEOUT"):
        configs([], {"MLXCEL_GRAMMAR_TIMEOUT": "0"})


def test_grammar_mask_timeout_flag() -> None:
    from mlxcel.model.grammar_masks import mask_timeout

    assert configs([])[0].grammar_mask_timeout_ms is None
    assert (mask_timeout(None, gpu=True), mask_timeout(None, gpu=False)) == (0.05, 0.2)
    assert configs(["--grammar-mask-timeout-ms", "30"])[0].grammar_mask_timeout_ms == 30
    assert configs(["--grammar-mask-timeout-ms", "auto"])[0].grammar_mask_timeout_ms is None
    assert configs([], {"MLXCEL_GRAMMAR_MASK_TIMEOUT_MS": "75"})[0].grammar_mask_timeout_ms == 75
    with pytest.raises(ConfigError, match="MLXCEL_GRAMMAR_MASK_TIMEOUT_MS"):
        configs([], {"MLXCEL_GRAMMAR_MASK_TIMEOUT_MS": "0"})
    with pytest.raises(SystemExit):  # a bad flag is one line and status 2
        configs(["--grammar-mask-timeout-ms", "0"])


def other_vocabulary_folder(source, folder):
    """A copy of a model folder's config and tokenizer whose vocabulary swaps two tokens' ids."""
    import json
    import shutil

    folder.mkdir()
    for name in ("config.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    vocabulary = tokenizer["model"]["vocab"]
    first, second = list(vocabulary)[:2]
    vocabulary[first], vocabulary[second] = vocabulary[second], vocabulary[first]
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return folder


@pytest.mark.slow
def test_a_draft_of_another_vocabulary_is_refused_at_start_up(tmp_path) -> None:
    from mlxcel.fixtures import fixture_path
    from mlxcel.model.draft import check_draft_vocabulary
    from mlxcel.model.loader import ModelLoadError

    target = fixture_path("llama")
    other = other_vocabulary_folder(target, tmp_path / "other")
    check_draft_vocabulary(target, fixture_path("llama", seed=1))  # the same tokenizer passes
    with pytest.raises(ModelLoadError, match="vocabulary differs"):
        check_draft_vocabulary(target, other)
    for draft, needle in ((other, "its tokenizer's vocabulary differs from the model's"),
                          (tmp_path / "missing", "model folder not found")):
        result = subprocess.run(
            [sys.executable, "-m", "mlxcel", "serve", "-m", str(target), "--speculative", "draft",
             "--draft-model", str(draft)],
            capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
        )
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert needle in lines[0]


def test_speculative_draft_flags_reach_the_config(tmp_path) -> None:
    engine, _ = configs(["--speculative", "draft", "--draft-model", str(tmp_path), "--speculative-tokens", "6"])
    assert (engine.speculative, engine.draft_model, engine.speculative_tokens) == ("draft", tmp_path, 6)
    engine, _ = configs([], {"MLXCEL_SPECULATIVE": "draft", "MLXCEL_DRAFT_MODEL": str(tmp_path)})
    assert (engine.speculative, engine.draft_model) == ("draft", tmp_path)
    assert configs([])[0].draft_model is None
    with pytest.raises(ConfigError, match="needs --draft-model"):
        configs(["--speculative", "draft"])


FREEZE_SCRIPT = """
import gc, weakref
from mlxcel.cli import _freeze_startup_objects
class Node: pass
kept, garbage = Node(), Node()
garbage.self = garbage  # a cycle only the collector frees
dead = weakref.ref(garbage)
del garbage
_freeze_startup_objects()
tracked = gc.get_objects()  # the collector's generations; frozen objects are in none of them
print(gc.get_freeze_count() > 0, dead() is None, not any(item is kept for item in tracked))
"""


def test_the_server_keeps_startup_objects_out_of_the_collector_after_collecting_its_garbage() -> None:
    """Full collections would walk every object a loaded server holds (docs/benchmarks.md); the garbage of
    loading is collected before the rest is frozen. (A fresh interpreter: freezing is process-wide.)"""
    result = subprocess.run([sys.executable, "-c", FREEZE_SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True", "True"]
