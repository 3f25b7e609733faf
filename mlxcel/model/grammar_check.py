"""Whether a grammar compiles, found before generation starts, off every thread plain requests need.

A request's grammar (a JSON Schema, GBNF, or the one its tools make) is
compiled here once into a llguidance matcher over the model's tokenizer,
exactly as the device will build it, so what would fail there (an error,
or a panic such as ``grammar.symbols.len() < u16::MAX``) is a 400 before any
step runs. Compilation costs grow much faster than the grammar, so:

- it runs on a few threads of its own (``max_concurrent``), never on the
  thread pool that parsing, rendering and tokenizing share, and never while
  holding one of the router's render slots;
- it has a time limit: a compile still running then is a 400, and its
  thread, which cannot be stopped, keeps its place until it ends, so
  runaway compiles cannot pile up; a request that waited that long for a
  place gets a 503;
- verdicts are remembered per tenant (the tokenizer memo's namespace), by
  bytes, so agents resending their tools compile once, and a hit tells no
  tenant what another sent; requests of one tenant sending a grammar that
  is compiling wait for its verdict instead of compiling it again.

The llguidance tokenizer it builds once, at start-up (``prepare``), is the
one the device's masks use (``mlxcel.model.grammar_masks.llguidance_tokenizer``),
so the device never builds it on the step.

Worker threads are daemons: a compile still running does not hold up shutdown.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable
from typing import Any

import trio

from mlxcel.core.grammar_bounds import BoundedMemo, text_nbytes
from mlxcel.errors import InvalidRequest, ServerBusy
from mlxcel.model.grammar_masks import llguidance_tokenizer, new_matcher, one_line

logger = logging.getLogger(__name__)

# Seconds a grammar may take to compile (`--grammar-timeout`).
GRAMMAR_TIMEOUT_S = 10.0
# Grammars compiled at once: each takes a core while it runs.
MAX_CONCURRENT_COMPILES = 2
MEMO_ENTRIES = 4096
MEMO_BYTES = 32 << 20
class GrammarChecker:
    def __init__(
        self,
        tokenizer: Any,
        eos_token_ids: frozenset[int],
        *,
        timeout_s: float = GRAMMAR_TIMEOUT_S,
        max_concurrent: int = MAX_CONCURRENT_COMPILES,
        memo_bytes: int = MEMO_BYTES,
    ) -> None:
        self._tokenizer = tokenizer
        self._eos_token_ids = sorted(eos_token_ids)
        self.timeout_s = timeout_s
        self._limiter = trio.CapacityLimiter(max_concurrent)
        self._memo: BoundedMemo[str | None] = BoundedMemo(
            max_entries=MEMO_ENTRIES, max_bytes=memo_bytes, value_nbytes=text_nbytes)
        self._ll_tokenizer: Any = None
        self._tokenizer_lock = trio.Lock()
        # Grammars compiling now, by memo key: a request sending one of them waits for its verdict.
        self._compiling: dict[tuple[Hashable, str], trio.Event] = {}
        self.num_compiled = 0
        self.num_timed_out = 0

    async def check(self, grammar: str, *, namespace: Hashable, param: str, what: str,
                    code: str = "unsupported_parameter") -> None:
        """Raise a 400 naming ``param`` if ``grammar`` cannot be enforced, a 503 if no compile place came."""
        key = (namespace, grammar)
        found, reason = self._memo.get(key)
        while not found and key in self._compiling:
            # The same grammar is compiling for another request: its verdict serves both.
            await self._compiling[key].wait()
            found, reason = self._memo.get(key)
        if not found:
            done = self._compiling[key] = trio.Event()
            try:
                reason = await self._compile(grammar)
                self._memo.put(key, reason)
            finally:
                del self._compiling[key]
                done.set()
        if reason is not None:
            raise InvalidRequest(f"{what}: {reason}", param=param, code=code)

    async def _compile(self, grammar: str) -> str | None:
        await self._ensure_tokenizer()
        started = threading.Event()
        with trio.move_on_after(self.timeout_s):
            return await trio.to_thread.run_sync(
                self._matcher_error, grammar, started, limiter=self._limiter, abandon_on_cancel=True)
        if not started.is_set():
            raise ServerBusy("every grammar compile place is taken; retry shortly")
        self.num_timed_out += 1
        return f"it did not compile within {self.timeout_s:g} s (--grammar-timeout)"

    async def prepare(self) -> None:
        """Build the llguidance tokenizer now (the engine does, before it serves): its build holds the GIL
        for seconds, which beside running steps would stall every stream. A tokenizer llguidance cannot
        take is left to fail the first grammar instead."""
        try:
            await self._ensure_tokenizer()
        except Exception as error:  # noqa: BLE001 - grammars then fail one by one, with this reason
            logger.warning("no llguidance tokenizer for this model (%s): constrained requests will fail", error)

    async def _ensure_tokenizer(self) -> None:
        """The llguidance tokenizer, built once (about a second; not counted in the time limit)."""
        async with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = await trio.to_thread.run_sync(
                    self._build_tokenizer, limiter=self._limiter, abandon_on_cancel=True)

    def _build_tokenizer(self) -> Any:
        return llguidance_tokenizer(self._tokenizer, tuple(self._eos_token_ids))

    def _matcher_error(self, grammar: str, started: threading.Event) -> str | None:
        started.set()
        self.num_compiled += 1
        try:
            # As the device builds it; llguidance releases the GIL while it compiles.
            matcher = new_matcher(self._ll_tokenizer, grammar)
            reason = matcher.get_error() if matcher.is_error() else ""
        except BaseException as error:  # noqa: BLE001 - pyo3's PanicException derives from BaseException
            if isinstance(error, KeyboardInterrupt | SystemExit):
                raise
            reason = str(error) or type(error).__name__
        return one_line(reason) or None
