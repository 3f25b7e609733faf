"""The grammar checker alone, with the llama fixture's real tokenizer and llguidance."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from mlxcel.errors import InvalidRequest, ServerBusy
from mlxcel.model.grammar_check import GrammarChecker, one_line
from tests.actors.test_actor_router import chat, llama_info, start_router

pytestmark = pytest.mark.slow


def schema_grammar(schema: dict[str, Any]) -> str:
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})


# Over the validation's bounds (64 patternProperties): 6-19 s to compile here (150 took 0.1-2 s).
SLOW = schema_grammar({"type": "object", "patternProperties": {
    f"^a{i}[a-z]+{i}$": {"type": "string"} for i in range(200)}})


def checker(**options: Any) -> GrammarChecker:
    info = llama_info()
    return GrammarChecker(info.tokenizer, info.eos_token_ids, **options)


async def test_a_grammar_llguidance_cannot_enforce_is_a_400_naming_the_field() -> None:
    grammars = checker()
    for schema in ({"$ref": "#/nowhere"}, {"type": "string", "pattern": "(?=x)"}):
        with pytest.raises(InvalidRequest) as caught:
            await grammars.check(schema_grammar(schema), namespace="t", param="response_format.json_schema.schema",
                                 what="response_format.json_schema.schema cannot be enforced")
        assert caught.value.status == 400
        assert caught.value.param == "response_format.json_schema.schema"
        assert "\n" not in caught.value.message
    await grammars.check(schema_grammar({"type": "object"}), namespace="t", param="response_format", what="x")


async def test_a_panic_is_a_one_line_400_without_the_backtrace(monkeypatch: pytest.MonkeyPatch) -> None:
    """llguidance's `grammar.symbols.len() < u16::MAX` panic (100k GBNF branches, 11 s to reach here)
    comes back as a pyo3 PanicException, a BaseException, with the Rust backtrace in its text."""
    import llguidance

    class PanicException(BaseException):
        pass

    class Panicking:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise PanicException("assertion failed: grammar.symbols.len() < u16::MAX as usize - 10\n<backtrace>\n"
                                 "   0: <unknown>\n   1: type_call at Objects/typeobject.c:1091:11")

    grammars = checker()
    await grammars._ensure_tokenizer()
    monkeypatch.setattr(llguidance, "LLMatcher", Panicking)
    with pytest.raises(InvalidRequest) as caught:
        await grammars.check("start: \"a\"", namespace="t", param="grammar", what="grammar cannot be used")
    assert caught.value.status == 400
    assert caught.value.message == (
        "grammar cannot be used: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10")
    assert one_line("panic: x\n<backtrace>\n 0: y") == "panic: x"


async def test_a_slow_compile_is_refused_at_the_time_limit_and_a_waiting_one_is_busy() -> None:
    grammars = checker(timeout_s=0.3, max_concurrent=1)
    await grammars._ensure_tokenizer()
    outcomes: dict[str, tuple[type, float]] = {}
    # SLOW's real compile time depends on the machine (0.3-19 s seen); a compile held for 2 s makes the
    # time limit and the busy place certain (the HTTP bombs test compiles real slow grammars).
    compile_for_real = grammars._matcher_error

    def compile_slowly(grammar: str, started: threading.Event) -> str | None:
        if grammar != SLOW:
            return compile_for_real(grammar, started)
        started.set()
        time.sleep(2.0)
        return None

    grammars._matcher_error = compile_slowly  # type: ignore[method-assign]

    async def check(name: str, grammar: str) -> None:
        started = time.monotonic()
        try:
            await grammars.check(grammar, namespace=name, param="json_schema", what="json_schema cannot be enforced")
            outcomes[name] = (type(None), time.monotonic() - started)
        except InvalidRequest as error:
            outcomes[name] = (type(error), time.monotonic() - started)
            if name == "slow":
                assert "did not compile within 0.3 s" in error.message

    async with trio.open_nursery() as nursery:
        nursery.start_soon(check, "slow", SLOW)
        await trio.sleep(0.05)
        nursery.start_soon(check, "waiting", schema_grammar({"type": "integer"}))
    assert outcomes["slow"][0] is InvalidRequest, outcomes
    assert outcomes["waiting"][0] is ServerBusy, outcomes  # the only place was still taken by the runaway compile
    assert max(seconds for _, seconds in outcomes.values()) < 3.0, outcomes  # 0.3 s, and this CPU's load
    # The verdict is remembered: the same grammar again is refused at once.
    started = time.monotonic()
    with pytest.raises(InvalidRequest):
        await grammars.check(SLOW, namespace="slow", param="json_schema", what="json_schema cannot be enforced")
    assert time.monotonic() - started < 0.5


async def test_tool_grammar_compiles_are_remembered_per_tenant_only(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """The tools' grammar memo was process-wide (a timing oracle across salts); it is the tokenizer memo's."""
    import llguidance

    from mlxcel.model.loader import load_model
    from tests.http.test_tool_loop_and_logprobs import fixture_copy
    from tests.integration.test_tool_calls import TOOL_TEMPLATE

    loaded = load_model(fixture_copy(tmp_path / "tools", template=TOOL_TEMPLATE))
    info = attrs.evolve(llama_info(), tokenizer=loaded.tokenizer, chat_template=loaded.chat_template)
    harness = await start_router(nursery, info)
    await harness.actor._grammars._ensure_tokenizer()  # seconds, once, beyond the harness's wait
    original = llguidance.LLMatcher
    compiled: list[str] = []

    class Counting:
        def __new__(cls, tokenizer: Any, grammar: str, **kwargs: Any) -> Any:
            compiled.append(grammar)
            return original(tokenizer, grammar, **kwargs)

        @staticmethod
        def validate_grammar(grammar: str, *args: Any, **kwargs: Any) -> str:
            compiled.append(grammar)
            return original.validate_grammar(grammar, *args, **kwargs)

    monkeypatch.setattr(llguidance, "LLMatcher", Counting)
    tool = {"type": "function", "function": {"name": "look_up", "strict": True, "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
    from mlxcel.types import CacheOptions

    for salt in ("tenant-a", "tenant-a", "tenant-b", "tenant-b"):
        submit, _ = await harness.route(chat(tools=(tool,), cache=CacheOptions(cache_salt=salt)))
        assert submit is not None
    assert len(compiled) == 2  # once for each tenant


_BUILD_RSS_CHILD = """
import ctypes, sys, trio
from mlx_lm.utils import load_tokenizer
from mlxcel.fixtures import fixture_path
from mlxcel.model.grammar_check import GrammarChecker

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2

def rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))

def peak() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))

tokenizer = load_tokenizer(fixture_path("llama"))
rss_before, in_use_before = rss(), libc.mallinfo2().uordblks
with open("/proc/self/clear_refs", "w") as clear:
    clear.write("5")  # the peak (VmHWM) starts again from the RSS now
trio.run(GrammarChecker(tokenizer, frozenset(tokenizer.eos_token_ids)).prepare)
print(rss() - rss_before, peak() - rss_before, libc.mallinfo2().uordblks - in_use_before)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (glibc's mallinfo2)")
def test_the_tokenizer_build_leaves_no_freed_scratch_resident() -> None:
    """The build runs on a worker thread; glibc kept its ~150 MiB of freed scratch in that thread's arena
    (idle RSS +275 MiB for 114 MiB of tables on the fixture's 150k-token vocabulary), and the free heap
    the main arena held sat under the build's peak (+285 MiB). Trimmed before and after the build, RSS
    grows by no more than what the tables hold, and the peak by less than tables and scratch. A fresh
    process, so the heap is its own."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _BUILD_RSS_CHILD], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=300)
    rss_growth, peak_growth, tables = (int(word) for word in done.stdout.split())
    assert tables > 32 << 20, done.stdout  # the build did happen, and holds its tables
    assert rss_growth < tables + (32 << 20), done.stdout
    assert peak_growth < tables + (128 << 20), done.stdout
