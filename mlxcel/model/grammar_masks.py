"""Grammar-constrained rows of the decode batch: llguidance matchers and their token masks, a step at a time."""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs

from mlxcel.core.plan import GrammarFailure, GrammarWork

logger = logging.getLogger(__name__)

# Seconds a step waits for its constrained rows' masks once they could start (--grammar-mask-timeout-ms);
# a row whose mask is later ends, and the others go on. On the CPU the mask threads share the cores with
# the forward pass: a step's masks took up to 82 ms there (p99 41 ms) on the 2-core test machine under
# load; on a GPU the host's cores are the masks' own (docs/operations.md).
MASK_TIMEOUT_GPU_S = 0.05
MASK_TIMEOUT_CPU_S = 0.2


def mask_timeout(configured_s: float | None, *, gpu: bool) -> float:
    """The step's bound on mask work: the configured one, else the backend's default."""
    if configured_s is not None:
        return configured_s
    return MASK_TIMEOUT_GPU_S if gpu else MASK_TIMEOUT_CPU_S
_MAX_REASON_CHARS = 400


def one_line(reason: str) -> str:
    """llguidance's reason without its backtrace or parser state: the first line, bounded."""
    reason = reason.split("<backtrace>", 1)[0].strip()
    first = reason.splitlines()[0] if reason else ""
    return first[:_MAX_REASON_CHARS]


def parser_limits() -> Any:
    """llguidance's limits for every matcher, at the router's check and on the device alike.

    Its defaults bound one mask's lexer and Earley work (step_lexer_fuel, step_max_items: about
    15 ms of work each) and the grammar's size; past them the matcher fails, and so does the
    request. Errors leave out the parser state and grammar, which would echo a request's schema
    into the logs.
    """
    from llguidance import LLParserLimits

    return LLParserLimits(verbose_errors=False)


def new_matcher(ll_tokenizer: Any, grammar: str) -> Any:
    """A llguidance matcher of ``grammar``, with the limits every matcher gets."""
    from llguidance import LLMatcher

    return LLMatcher(ll_tokenizer, grammar, log_level=0, limits=parser_limits())


# llguidance tokenizers by (tokenizer files, size, eos ids): immutable once built, so the router's grammar
# check and the device share one, and engines of one tokenizer too (building it takes 1-12 s here).
_LL_TOKENIZERS: dict[tuple[str, int, tuple[int, ...]], Any] = {}
_LL_TOKENIZERS_LOCK = threading.Lock()
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def _tokenizer_identity(hf_tokenizer: Any) -> str:
    """What the tokenizer is: a digest of its files where its folder has them (models sharing a tokenizer
    share its llguidance one), else its name."""
    import hashlib
    from pathlib import Path

    name = str(getattr(hf_tokenizer, "name_or_path", "") or "")
    folder = Path(name) if name else None
    if folder is None or not folder.is_dir():
        return name or str(id(hf_tokenizer))
    digest = hashlib.sha256()
    for file_name in _TOKENIZER_FILES:
        path = folder / file_name
        if path.is_file():
            digest.update(file_name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):  # not glibc (macOS): nothing to call
        return None


def give_back_freed_heap() -> None:
    """Return the heap's free pages to the system (glibc's ``malloc_trim``; a no-op elsewhere).

    The llguidance tokenizer's build, on a worker thread, frees about 150 MiB of scratch (a 150k-token
    vocabulary) in that thread's malloc arena, which glibc keeps: idle RSS +150 MiB over the 114 MiB
    the tables hold. A trim takes ~12 ms (docs/benchmarks.md, issue 32).
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def llguidance_tokenizer(tokenizer: Any, eos_token_ids: tuple[int, ...]) -> Any:
    from llguidance.hf import from_tokenizer

    if tokenizer is None:
        raise ValueError("a grammar-constrained request needs the model's tokenizer")
    # mlx-lm's wrapper holds the Hugging Face tokenizer; its files' folder names it.
    hf_tokenizer = getattr(tokenizer, "_tokenizer", tokenizer)
    key = (_tokenizer_identity(hf_tokenizer), len(hf_tokenizer), eos_token_ids)
    with _LL_TOKENIZERS_LOCK:
        found = _LL_TOKENIZERS.get(key)
        if found is not None:
            return found
    # Trimmed before as well: the build's scratch goes to a thread's arena, so what the main one holds free
    # would otherwise sit under the build's peak (start-up peak -145 MiB on the fixture's vocabulary).
    give_back_freed_heap()
    built = from_tokenizer(hf_tokenizer, eos_token=list(eos_token_ids) or None)
    give_back_freed_heap()
    with _LL_TOKENIZERS_LOCK:
        if len(_LL_TOKENIZERS) >= 4:
            _LL_TOKENIZERS.clear()
        _LL_TOKENIZERS[key] = built
    return built


# An evaluation of the forward pass that took longer than this found it still running.
_FORWARD_STILL_RUNNING_S = 0.001
# Threads beyond the cores' worth, for masks given up on that still run (a thread cannot be stopped).
_SPARE_THREADS = 4


def _mask_threads() -> int:
    # As llguidance's own executor (80% of the cores, up to 32), and the spare ones.
    return max(2, min(32, (os.cpu_count() or 2) * 4 // 5)) + _SPARE_THREADS


@attrs.frozen
class StartedMasks:
    """A step's masks under way: each sequence's job (none for a sequence given up), from ``start_masks``."""

    sequences: list[GrammarSequence]
    jobs: dict[int, concurrent.futures.Future[Any]]
    width: int
    vocab: int
    started: float


class Grammars:
    """The grammar-constrained sequences' matchers, and their masks computed a step at a time.

    A decode step (``model/batch_step.py``) reads its rows' tokens back,
    starts their masks (``start_masks``) before it queues the forward pass,
    and masks its rows together (``finish_masks``, ``unpack_masks``,
    ``apply_masks``). Elsewhere (a start pass, a speculative verify step)
    mlx-lm's way holds: every sequence's logits processors, then every
    sequence's sampler. Each constrained sequence's processor only hands over
    the token sampled last, still lazy; the first of their samplers to run
    queues the step's forward pass behind those tokens (so the device goes
    from the last step to this one without a gap), reads the tokens back,
    and has each matcher consume its token and compute its mask on a thread
    of its own while the device computes the logits; the masks are unpacked
    on the device in one pass and each sampler masks its own row.

    A mask not ready ``mask_timeout_s`` after both the step's mask work
    started and its forward pass ended (so after the point where it would
    start delaying the batch) costs its own row, not the batch: the row gets
    a mask of EOS alone (so mlx-lm ends it in this step) and is reported in
    ``GrammarWork.failures``, and the core fails its request. A matcher that
    fails (a llguidance limit, a dead end) ends its row the same way.

    The logprobs the API reports are the model's, before the mask (as
    vLLM's default). The llguidance tokenizer is the one the router's
    grammar check built before the request got here (``llguidance_tokenizer``).
    """

    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int], *,
                 mask_timeout_s: float = MASK_TIMEOUT_CPU_S) -> None:
        self._tokenizer = tokenizer
        self._eos_token_ids = sorted(eos_token_ids)
        # Also what min_tokens / ignore_eos mask (the Grammars object is the executor's one view of them).
        self.eos_token_ids = frozenset(eos_token_ids)
        self.mask_timeout_s = mask_timeout_s
        self._ll_tokenizer: Any = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        # Masks given up on whose threads still compute them.
        self._abandoned: list[concurrent.futures.Future[Any]] = []
        # Fed this step, mask not computed yet.
        self._pending: list[GrammarSequence] = []
        # Each computed sequence's row in `_allowed` (the step's unpacked masks).
        self._rows: dict[int, int] = {}
        self._allowed: Any = None
        # Since the last take_work().
        self._work = GrammarWork()

    def sequence(self, grammar: str, sequence_id: int | None = None) -> GrammarSequence:
        if self._ll_tokenizer is None:
            started = time.perf_counter()
            self._ll_tokenizer = llguidance_tokenizer(self._tokenizer, tuple(self._eos_token_ids))
            seconds = time.perf_counter() - started
            if seconds > 0.1:
                # The router's check builds it first: only a caller that skipped the check gets here.
                logger.info("built the llguidance tokenizer on the device (%.1f s)", seconds)
        started = time.perf_counter()
        matcher = new_matcher(self._ll_tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(f"grammar rejected: {one_line(matcher.get_error())}")
        seconds = time.perf_counter() - started
        logger.debug("grammar matcher built in %.1f ms", 1000 * seconds)
        self._work = attrs.evolve(self._work, matchers_built=self._work.matchers_built + 1,
                                  build_seconds=self._work.build_seconds + seconds)
        return GrammarSequence(self, matcher, sequence_id)

    def take_work(self) -> GrammarWork | None:
        work, self._work = self._work, GrammarWork()
        return work if work.matchers_built or work.masks or work.failures else None

    def fed(self, sequence: GrammarSequence) -> None:
        self._pending.append(sequence)

    def allowed(self, sequence: GrammarSequence, logprobs: Any) -> Any:
        """The step's mask of ``sequence``, as ``apply_masks`` takes it."""
        if self._pending:
            self._compute(logprobs)
        return self._allowed[self._rows[id(sequence)]]

    def _compute(self, logprobs: Any) -> None:
        import mlx.core as mx

        pending, self._pending = self._pending, []
        lazy = [sequence.last_token for sequence in pending if sequence.last_token is not None]
        # The tokens' read-back first in the queue, then the forward pass behind them: the device runs
        # on from the last step while the host waits for its tokens (queued the other way round, the
        # read-back would wait for the forward pass).
        mx.async_eval(lazy)
        mx.async_eval(logprobs)
        mx.eval(lazy)
        tokens = [None if sequence.last_token is None else int(sequence.last_token.item()) for sequence in pending]
        for sequence in pending:
            sequence.last_token = None
        started = self.start_masks(pending, tokens, logprobs.shape[-1])
        self._allowed = unpack_masks(self.finish_masks(started, logprobs), logprobs.shape[-1])
        self._rows = {id(sequence): row for row, sequence in enumerate(pending)}

    def start_masks(self, sequences: list[GrammarSequence], tokens: list[int | None], vocab: int) -> StartedMasks:
        """Feed each sequence its token sampled last (None: none yet) and start its next mask on a thread."""
        started = time.perf_counter()
        width = max((self._ll_tokenizer.vocab_size + 31) // 32, (vocab + 31) // 32)
        jobs: dict[int, concurrent.futures.Future[Any]] = {}
        for row, (sequence, token) in enumerate(zip(sequences, tokens, strict=True)):
            if sequence.failed is None:
                jobs[row] = self._mask_pool().submit(_consume_and_mask, sequence.matcher, token, width)
        return StartedMasks(sequences=sequences, jobs=jobs, width=width, vocab=vocab, started=started)

    def finish_masks(self, masks: StartedMasks, logprobs: Any) -> Any:
        """The started masks, packed (a row of 32-bit words a sequence), once ready or given up (``mask_timeout_s``)."""
        import mlx.core as mx
        import numpy as np

        jobs, vocab = masks.jobs, masks.vocab
        if jobs:
            _done, late = concurrent.futures.wait(jobs.values(), timeout=self.mask_timeout_s)
            if late:
                # Masks may take as long as the forward pass for free (the step waits for it anyway): when it
                # was still running, the bound counts from its end. Only here does the host wait for the device.
                waited = time.perf_counter()
                mx.eval(logprobs)
                if time.perf_counter() - waited > _FORWARD_STILL_RUNNING_S:
                    concurrent.futures.wait(late, timeout=self.mask_timeout_s)
        packed = np.zeros((len(masks.sequences), masks.width), dtype=np.uint32)
        failures: list[GrammarFailure] = []
        for row, sequence in enumerate(masks.sequences):
            job = jobs.get(row)
            if job is not None:
                failure = self._collect(sequence, job, packed[row])
                if failure is not None:
                    failures.append(failure)
            # EOS passes where the grammar may end; a failed row gets EOS alone, so the reply stops now.
            may_end = sequence.failed is not None or sequence.matcher.is_accepting()
            if sequence.failed is not None:
                packed[row] = 0
            for eos in self._eos_token_ids:
                if eos < vocab:
                    bit = np.uint32(1 << (eos % 32))
                    packed[row, eos // 32] = packed[row, eos // 32] | bit if may_end else packed[row, eos // 32] & ~bit
        seconds = time.perf_counter() - masks.started
        logger.debug("grammar masks of %d sequences in %.2f ms", len(masks.sequences), 1000 * seconds)
        self._work = attrs.evolve(self._work, masks=self._work.masks + len(jobs),
                                  mask_seconds=self._work.mask_seconds + seconds,
                                  failures=self._work.failures + tuple(failures))
        return packed

    def _collect(self, sequence: GrammarSequence, job: concurrent.futures.Future[Any],
                 row: Any) -> GrammarFailure | None:
        """Copy a finished mask into its row, or give the sequence up: late, or its matcher failed."""
        if not job.done():
            if not job.cancel():
                self._abandoned.append(job)
            sequence.failed = (f"its grammar's token mask took longer than {1000 * self.mask_timeout_s:g} ms "
                               "(--grammar-mask-timeout-ms)")
            logger.warning("grammar mask of sequence %s not ready within %g ms: the sequence ends",
                           sequence.sequence_id, 1000 * self.mask_timeout_s)
            timed_out = True
        else:
            error = job.exception()
            if error is None and not sequence.matcher.is_error():
                row[:] = job.result()
                return None
            reason = str(error) if error is not None else sequence.matcher.get_error()
            sequence.failed = f"its grammar failed: {one_line(reason)}"
            logger.warning("grammar matcher failed for sequence %s: %s", sequence.sequence_id, one_line(reason))
            timed_out = False
        if sequence.sequence_id is None:
            return None
        return GrammarFailure(sequence_id=sequence.sequence_id, timed_out=timed_out, reason=sequence.failed)

    def _mask_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        self._abandoned = [job for job in self._abandoned if not job.done()]
        if self._pool is not None and len(self._abandoned) >= _SPARE_THREADS:
            # Masks given up on still hold that many threads: a fresh pool, so the other rows' masks never queue
            # behind them (the old pool's threads end with their masks).
            self._pool.shutdown(wait=False)
            self._pool = None
            self._abandoned = []
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(_mask_threads(), thread_name_prefix="mlxcel-grammar")
        return self._pool


def _consume_and_mask(matcher: Any, token: int | None, width: int) -> Any:
    """On a mask thread: feed the matcher the token sampled last, then compute its next mask (its own array:
    a mask given up on may still finish and write it)."""
    import numpy as np

    if token is not None:
        matcher.consume_token(token)
    mask = np.zeros(width, dtype=np.uint32)
    if not matcher.is_error():
        # llguidance drops the GIL while it computes.
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
    return mask


class GrammarSequence:
    """One sequence's matcher, its processor (``feed``) and its sampler's mask."""

    def __init__(self, grammars: Grammars, matcher: Any, sequence_id: int | None = None) -> None:
        self.grammars = grammars
        self.matcher = matcher
        self.sequence_id = sequence_id
        self._started = False
        # The token to feed the matcher before this step's mask (None on the first step).
        self.last_token: Any = None
        # Why the sequence was given up (None: it goes on); its masks then allow EOS alone.
        self.failed: str | None = None

    def feed(self, tokens: Any, logits: Any) -> Any:
        """A logits processor that changes nothing: it hands over the token sampled last, still lazy."""
        self.last_token = tokens[-1] if self._started else None
        self._started = True
        self.grammars.fed(self)
        return logits

    def sampler(self, sample: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
        def masked(logprobs: Any) -> Any:
            import mlx.core as mx

            logprobs = apply_masks(logprobs, self.grammars.allowed(self, logprobs))
            return mx.argmax(logprobs, axis=-1) if sample is None else sample(logprobs)

        # The mask moves no allowed token's logit: what the wrapped sampler needs, this one does.
        masked.reads_logprobs = sample is not None and getattr(sample, "reads_logprobs", True)  # type: ignore[attr-defined]
        # A decode step masks its constrained rows together and samples with the wrapped one (model/batch_step.py).
        masked.grammar = self  # type: ignore[attr-defined]
        masked.wrapped = sample  # type: ignore[attr-defined]
        return masked

    def next_token(self, token: int) -> int | None:
        """What this step's mask follows, ``token`` being the row's input token: none on the sequence's first."""
        started, self._started = self._started, True
        self.last_token = None
        return token if started else None


def unpack_masks(packed: Any, vocab: int) -> Any:
    """Packed masks (``finish_masks``; a row of all ones allows every token) in the form ``apply_masks`` takes.

    On a GPU, a boolean array unpacked on the device from the packed words (a small upload). On the CPU,
    MLX's gather and ``where`` over a vocabulary a row are slow (16 rows of 151,646 tokens: 86 and 16 ms,
    against 5 ms for the host's unpacking and 3 ms for an addition), so there it is an additive mask,
    0 or -inf a token, unpacked on the host.
    """
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        bias = _byte_bias()[packed.view("uint8")].reshape(packed.shape[0], -1)[:, :vocab]
        return mx.array(bias)
    word_index, bit_index = _bit_positions(vocab)
    return ((mx.array(packed)[:, word_index] >> bit_index) & 1).astype(mx.bool_)


def apply_masks(logits: Any, masks: Any) -> Any:
    """``logits`` where the masks allow, -inf elsewhere (an allowed token's value unchanged)."""
    import mlx.core as mx

    if masks.dtype == mx.bool_:
        return mx.where(masks, logits, mx.array(-mx.inf, dtype=logits.dtype))
    return logits + masks.astype(logits.dtype)


@functools.cache
def _byte_bias() -> Any:
    """For each byte of a packed mask: its 8 tokens' additive mask (bit set: 0, else -inf), little-endian."""
    import numpy as np

    bits = (np.arange(256, dtype=np.uint32)[:, None] >> np.arange(8, dtype=np.uint32)) & 1
    return np.where(bits == 1, np.float32(0), np.float32(-np.inf))


@functools.lru_cache(maxsize=4)
def _bit_positions(vocab: int) -> tuple[Any, Any]:
    """For each token id: its word in a packed mask and its bit in that word."""
    import mlx.core as mx

    ids = mx.arange(vocab, dtype=mx.uint32)
    return ids >> 5, ids & 31
