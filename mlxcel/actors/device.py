"""The device actor: the only code that runs MLX.

Every MLX call happens on one long-lived worker thread (MLX ties streams to
the thread that made them). The thread loads the model, then loops on
``trio.from_thread.run(inbox.receive)``; the Trio side never blocks on it.
Batching, chunked prefill and per-sequence caches come from mlx-lm's
``BatchGenerator``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from mlxcel.actors.messages import (
    AdmitSequence,
    DetachedSequence,
    DeviceMsg,
    RunStep,
    SampledToken,
    StepDone,
)
from mlxcel.model.family import ModelFamily
from mlxcel.types import SamplingParams

logger = logging.getLogger(__name__)

# Steps in a row in which direct starts may hold back the batch's decode step.
MAX_BATCH_HOLDS = 4
# Shape buckets of direct starts (see _StepWorker._bucket): the adopted prefix is
# cut to a multiple of START_PREFIX_ALIGN tokens and the tokens run are padded to
# a multiple of START_QUERY_BUCKET, so key lengths are multiples of 128 too. A
# 256-token cut gave the same shapes with twice the tokens run again: 8B hits of
# random lengths, median 31.2 vs 23.0 ms once planned (benchmarks/start_shapes.py).
START_PREFIX_ALIGN = 128
START_QUERY_BUCKET = 128


@attrs.frozen(kw_only=True)
class ModelInfo:
    """What the rest of the engine needs to know of the loaded model (no arrays)."""

    model_id: str
    path: Path
    config: dict[str, Any] = attrs.field(repr=False)
    family: ModelFamily
    tokenizer: Any = attrs.field(repr=False, eq=False)
    chat_template: str = attrs.field(repr=False)
    eos_token_ids: frozenset[int]
    context_size: int
    prefill_step_size: int = 2048


@attrs.frozen(kw_only=True)
class DeviceSettings:
    model_path: Path
    context_size: int | None = None
    max_batch_size: int = 32
    prefill_batch_size: int = 8
    prefill_step_size: int | None = None
    # None: warm up on a GPU only.
    warm_up: bool | None = False
    # A direct start's logits in one forward pass (None: on a GPU only; see _StepWorker).
    one_pass_starts: bool | None = None
    # Direct starts run in bucketed shapes and long prompts are prefilled alone
    # (None: with CUDA only; see _StepWorker._bucket and _advance_alone).
    bucket_starts: bool | None = None
    fail_step: int | None = None
    fail_out_of_memory: bool = False


class DeviceActor:
    def __init__(self, settings: DeviceSettings, inbox: trio.MemoryReceiveChannel[DeviceMsg]) -> None:
        self._settings = settings
        self.inbox = inbox
        self._num_steps = 0

    async def run(self, *, task_status: trio.TaskStatus[ModelInfo] = trio.TASK_STATUS_IGNORED) -> None:
        with self.inbox:
            await trio.to_thread.run_sync(
                self._thread_main, task_status, abandon_on_cancel=False
            )

    def statistics(self) -> dict[str, int]:
        return {"num_steps": self._num_steps}

    # --- everything below runs on the device thread -------------------------

    def _thread_main(self, task_status: trio.TaskStatus[ModelInfo]) -> None:
        import mlx.core as mx

        from mlxcel.model.loader import default_prefill_step_size, load_model

        loaded = load_model(self._settings.model_path)
        context_size = self._settings.context_size or loaded.family.context_size or 4096
        step = self._settings.prefill_step_size or default_prefill_step_size()
        self._settings = attrs.evolve(self._settings, prefill_step_size=step, context_size=context_size)
        worker = _StepWorker(loaded.model, loaded.eos_token_ids, self._settings, loaded.family.model_type)
        warm_up = self._settings.warm_up
        if mx.default_device() != mx.cpu if warm_up is None else warm_up:
            logger.info("device warm-up took %.2f s", worker.warm_up())
        info = ModelInfo(
            model_id=loaded.model_id,
            path=loaded.path,
            config=loaded.config,
            family=loaded.family,
            tokenizer=loaded.tokenizer,
            chat_template=loaded.chat_template,
            eos_token_ids=frozenset(loaded.eos_token_ids),
            context_size=context_size,
            prefill_step_size=step,
        )
        trio.from_thread.run_sync(task_status.started, info)
        while True:
            try:
                message = trio.from_thread.run(self.inbox.receive)
            except (trio.EndOfChannel, trio.ClosedResourceError):
                return
            match message:
                case RunStep():
                    done = worker.run_step(message)
                    self._num_steps = done.step_number
                    trio.from_thread.run_sync(_reply, message.reply_to, done)
                    # Drops the released payloads here, so MLX frees them on this thread.
                    del message, done
                case _:
                    raise AssertionError(f"unexpected device message {message!r}")


def _reply(reply_to: trio.MemorySendChannel[StepDone], done: StepDone) -> None:
    with reply_to:
        try:
            reply_to.send_nowait(done)
        except (trio.BrokenResourceError, trio.WouldBlock):
            pass  # the scheduler went away (shutdown)


@attrs.define
class _DirectStart:
    """An admission whose first token is computed outside the batch (see ``_admit``)."""

    admission: AdmitSequence
    caches: list[Any]
    all_tokens: list[int]
    sampler: Callable[[Any], Any] | None
    token: Any
    logprobs: Any
    donation: DetachedSequence | None = None


@attrs.define
class _AlonePrefill:
    """A long prompt prefilled on its own cache, a chunk per step (see ``_advance_alone``)."""

    admission: AdmitSequence
    caches: list[Any]
    tokens: list[int]  # cached and prompt tokens
    done: int  # tokens in ``caches``


@attrs.define
class _Sequence:
    sequence_id: int
    sampling: SamplingParams
    donate_on_finish: bool
    donate_prompt: bool
    # Tokens at which a whole-state snapshot is due (cached + prompt up to the boundary).
    snapshot_tokens: tuple[int, ...] | None = None
    warm: bool = False
    # Started outside the batch: its prompt was reported done then.
    direct: bool = False
    # Prefilled in the batch, first token not sampled yet: the batch is not held for it.
    awaiting_first: bool = False


class _StepWorker:
    """Holds the BatchGenerator and the map between our sequence ids and its uids."""

    def __init__(
        self, model: Any, eos_token_ids: frozenset[int] | set[int], settings: DeviceSettings, family: str = ""
    ) -> None:
        import mlx.core as mx
        from mlx_lm.generate import BatchGenerator

        self._model = model
        # How a direct start gets its last token's logits: on a GPU in the same
        # forward pass as the rest (projecting every position to the vocabulary
        # costs less than reading the weights again); on the CPU in a second
        # one-token pass, as mlx-lm does (the projection costs more there).
        one_pass = settings.one_pass_starts
        self._one_pass_starts = mx.default_device() != mx.cpu if one_pass is None else one_pass
        from mlx_lm.models.cache import KVCache, make_prompt_cache

        bucket = settings.bucket_starts
        # Only plain KV caches can be cut and trimmed: other layer kinds run unbucketed.
        self._bucket_starts = ((mx.cuda.is_available() if bucket is None else bucket)
                               and all(type(cache) is KVCache for cache in make_prompt_cache(model)))
        self._eos_token_ids = frozenset(eos_token_ids)
        self._family = family
        self._settings = settings
        self._make_generator: Callable[[], Any] = lambda: BatchGenerator(
            model,
            stop_tokens=[[token] for token in sorted(eos_token_ids)],
            completion_batch_size=settings.max_batch_size,
            prefill_batch_size=settings.prefill_batch_size,
            prefill_step_size=settings.prefill_step_size,
        )
        self._generator = self._make_generator()
        self._by_uid: dict[int, _Sequence] = {}
        self._uid_of: dict[int, int] = {}
        # Admitted one-chunk prompts left for a later step (see run_step).
        self._deferred: list[AdmitSequence] = []
        # Long prompts prefilled outside the batch, oldest first (see _advance_alone).
        self._alone: list[_AlonePrefill] = []
        # Steps in a row that held the batch back for direct starts.
        self._batch_holds = 0
        self._step_number = 0

    def warm_up(self) -> float:
        """Run a direct start, a chunked prefill and decoding once on throwaway prompts.

        The CUDA backend compiles its kernels on first use (seconds for the
        first request otherwise); on the CPU this costs a fraction of a second.
        Returns the seconds it took. The generator is fresh afterwards.
        """
        import mlx.core as mx

        start = time.perf_counter()
        settings = self._settings
        self._settings = attrs.evolve(settings, fail_step=None)
        greedy = SamplingParams(temperature=0.0)
        prompts = {-1: 8, -2: settings.prefill_step_size + 8}  # one chunk; two chunks
        admissions = tuple(
            AdmitSequence(sequence_id=sequence_id, prompt_tokens=tuple(10 + i % 1000 for i in range(length)),
                          cached_tokens=(), sampling=greedy, max_tokens=3)
            for sequence_id, length in prompts.items()
        )
        unfinished = set(prompts)
        step = RunStep(admit=admissions, reply_to=None)  # type: ignore[arg-type]
        for _ in range(32):
            done = self.run_step(step)
            if done.error is not None:
                raise RuntimeError(f"the device warm-up failed: {done.error}")
            unfinished -= {token.sequence_id for token in done.sampled if token.finish_reason is not None}
            if not unfinished:
                break
            step = RunStep(reply_to=None)  # type: ignore[arg-type]
        self._settings = settings
        self._generator = self._make_generator()
        self._by_uid.clear()
        self._uid_of.clear()
        self._deferred.clear()
        self._alone.clear()
        self._batch_holds = 0
        self._step_number = 0
        mx.clear_cache()
        return time.perf_counter() - start

    def run_step(self, step: RunStep) -> StepDone:
        self._step_number += 1
        detached: list[DetachedSequence] = []
        admissions, self._deferred = [*self._deferred, *step.admit], []
        try:
            for removal in step.remove:
                uid = self._uid_of.pop(removal.sequence_id, None)
                if uid is None:
                    # A deferred start or one prefilled alone (no KV to give yet).
                    admissions = [a for a in admissions if a.sequence_id != removal.sequence_id]
                    self._alone = [p for p in self._alone if p.admission.sequence_id != removal.sequence_id]
                    continue
                sequence = self._by_uid.pop(uid)
                caches = self._generator.remove([uid], return_prompt_caches=removal.donate)
                if removal.donate and uid in caches:
                    cache_list, tokens = caches[uid]
                    item = _detach(sequence.sequence_id, cache_list, tokens)
                    if item is not None:
                        detached.append(item)
            restore_failures = []
            direct: list[_DirectStart] = []
            # Direct starts take at most one prefill chunk's worth of tokens per
            # step (at least one start): the first tokens of prompts admitted
            # together come out step by step instead of all after the last.
            direct_tokens = 0
            for admission in admissions:
                if self._starts_directly(admission):
                    direct_tokens += len(admission.prompt_tokens)
                    if direct and direct_tokens > self._settings.prefill_step_size:
                        self._deferred.append(admission)
                        continue
                failure = self._admit(admission, direct)
                if failure is not None:
                    restore_failures.append((admission.sequence_id, failure))
            alone_prefilling, alone_tokens = (), 0
            if self._alone:
                sequence_id, alone_tokens, rest = self._advance_alone()
                if rest is not None and not (direct and direct_tokens + len(rest.prompt_tokens)
                                             > self._settings.prefill_step_size):
                    direct_tokens += len(rest.prompt_tokens)
                    self._admit(rest, direct)  # its first token comes in this step
                else:
                    alone_prefilling = (sequence_id,)
                    if rest is not None:
                        self._deferred.append(rest)
            if self._settings.fail_step == self._step_number:
                if self._settings.fail_out_of_memory:
                    raise RuntimeError(f"[malloc] injected out of memory at step {self._step_number}")
                raise RuntimeError(f"injected fault at step {self._step_number}")
            if direct:
                # One evaluation for every direct start (and its prompt donation copy).
                import mlx.core as mx

                mx.eval([(start.token, start.logprobs) for start in direct],
                        [start.donation.payload.arrays() for start in direct if start.donation is not None])
            if not self._by_uid and not direct:
                return StepDone(
                    step_number=self._step_number, detached=tuple(detached),
                    restore_failures=tuple(restore_failures), prefill_tokens=alone_tokens,
                    prefilling=alone_prefilling,
                )
            prompt_responses, generation_responses, prompt_tokens = [], [], alone_tokens
            # While started prompts wait, first tokens go ahead of the batch's
            # decode and prefill chunk, for a bounded number of steps in a row;
            # never ahead of a first token the batch itself owes.
            hold_batch = (bool(self._deferred) and self._batch_holds < MAX_BATCH_HOLDS
                          and not any(sequence.awaiting_first for sequence in self._by_uid.values()))
            self._batch_holds = self._batch_holds + 1 if hold_batch else 0
            if self._by_uid and not hold_batch:
                with self._generator.stats() as stats:
                    prompt_responses, generation_responses = self._generator.next()
                prompt_tokens += stats.prompt_tokens
            started = [self._start_generating(start) for start in direct]
        except Exception as error:  # noqa: BLE001 - reported to every sequence in the batch
            logger.exception("device step %d failed", self._step_number)
            out_of_memory = _is_out_of_memory(error)
            # Admissions that raised never reached the generator: they fail too.
            failed = tuple(
                {sequence.sequence_id for sequence in self._by_uid.values()}
                | {admission.sequence_id for admission in [*admissions, *self._deferred]}
                | {prefill.admission.sequence_id for prefill in self._alone}
            )
            self._deferred = []
            self._alone = []
            self._generator = self._make_generator()
            self._by_uid.clear()
            self._uid_of.clear()
            return StepDone(
                step_number=self._step_number,
                error=f"{type(error).__name__}: {error}",
                out_of_memory=out_of_memory,
                failed_sequences=failed,
                detached=tuple(detached),
            )

        sampled = []
        prompts_done = []
        for start, (token, done) in zip(direct, started):
            sampled.append(token)
            prompts_done.append(start.admission.sequence_id)
            prompt_tokens += len(start.admission.prompt_tokens)
            if done is not None:
                detached.append(done)
            elif start.donation is not None:
                detached.append(start.donation)
        for response in generation_responses:
            sequence = self._by_uid.get(response.uid)
            if sequence is None:
                continue
            sampled.append(_sampled_token(sequence, response))
            sequence.awaiting_first = False
            if response.finish_reason is not None:
                del self._by_uid[response.uid]
                del self._uid_of[sequence.sequence_id]
                if sequence.donate_on_finish and response.prompt_cache is not None:
                    item = _detach(sequence.sequence_id, response.prompt_cache, response.all_tokens)
                    if item is not None:
                        detached.append(item)
        prefilling = list(alone_prefilling)
        warmed = []
        for response in prompt_responses:
            sequence = self._by_uid.get(response.uid)
            if sequence is None or sequence.direct:
                continue
            if response.end_of_segment and sequence.snapshot_tokens is not None:
                # The chunk just run ended exactly at the history boundary.
                detached.append(self._snapshot(response.uid, sequence))
                if sequence.warm:
                    warmed.append(sequence.sequence_id)
                    self._drop(response.uid)
                    continue
            if not response.end_of_prompt:
                prefilling.append(sequence.sequence_id)
                continue
            prompts_done.append(sequence.sequence_id)
            sequence.awaiting_first = True
            if sequence.donate_prompt:
                cache_list, tokens = self._generator.extract_cache([response.uid])[response.uid]
                item = _detach(sequence.sequence_id, cache_list, tokens, final=False)
                if item is not None:
                    detached.append(item)
        return StepDone(
            step_number=self._step_number,
            sampled=tuple(sampled),
            detached=tuple(detached),
            decode_batch_size=len(generation_responses),
            prefill_tokens=prompt_tokens,
            prefilling=tuple(prefilling),
            prompts_done=tuple(prompts_done),
            restore_failures=tuple(restore_failures),
            warmed=tuple(warmed),
        )

    def _admit(self, admission: AdmitSequence, direct: list[_DirectStart]) -> str | None:
        """Insert a sequence; returns why a snapshot could not be restored (it then runs cold).

        A prompt that needs at most one prefill chunk (a cache hit's new turn,
        or a short prompt) starts directly: it is prefilled on its own cache
        and its first token sampled in this step, in one evaluation, as
        mlx-lm's own ``generate`` does; it joins the decode batch afterwards.
        Through the batch, the same first token would take three steps (the
        chunk, the move to decoding, the first decode) and a copy of the whole
        cache into the batch before the prefill.
        """
        from mlx_lm.models.cache import make_prompt_cache

        from mlxcel.model.kv import adopt
        from mlxcel.model.snapshot import SnapshotMismatch, restore

        caches = None
        prompt = list(admission.prompt_tokens)
        cached = list(admission.cached_tokens)
        kept = len(cached)
        failure = None
        if admission.adopted is not None:
            if self._bucket_starts and (self._starts_directly(admission) or self._prefills_alone(admission)):
                kept -= kept % START_PREFIX_ALIGN
            caches = adopt(admission.adopted, kept) if kept else None
        elif admission.restore is not None:
            try:
                caches = restore(admission.restore, self._family, make_prompt_cache(self._model))
            except SnapshotMismatch as error:
                failure = str(error)
                prompt, cached, kept = cached + prompt, [], 0
        if self._starts_directly(admission) and len(prompt) <= self._settings.prefill_step_size:
            # (A snapshot that would not restore makes the prompt longer.)
            direct.append(self._start_direct(admission, caches, cached, prompt, kept))
            return failure
        if self._prefills_alone(admission):
            if caches is None:
                caches = make_prompt_cache(self._model)
            self._alone.append(_AlonePrefill(admission=admission, caches=caches, tokens=cached + prompt, done=kept))
            return failure
        snapshot_tokens = None
        if admission.snapshot_after is not None and failure is None:
            boundary = admission.snapshot_after
            if admission.warm:
                # Prefill everything, snapshot, then stop: the extra token is never run.
                segments = [prompt, prompt[-1:]]
            else:
                segments = [prompt[:boundary], prompt[boundary:]]
            snapshot_tokens = tuple(cached + prompt[:boundary])
        else:
            segments = [prompt]
        (uid,) = self._generator.insert_segments(
            [segments],
            max_tokens=[admission.max_tokens],
            caches=[caches],
            all_tokens=[cached],
            samplers=[_make_sampler(admission.sampling)],
        )
        self._by_uid[uid] = _Sequence(
            sequence_id=admission.sequence_id,
            sampling=admission.sampling,
            donate_on_finish=admission.donate_on_finish,
            donate_prompt=admission.donate_prompt,
            snapshot_tokens=snapshot_tokens,
            warm=admission.warm,
        )
        self._uid_of[admission.sequence_id] = uid
        return failure

    def _prefills_alone(self, admission: AdmitSequence) -> bool:
        """A prompt longer than one chunk that is prefilled outside the batch (see _advance_alone)."""
        step = self._settings.prefill_step_size
        return (self._bucket_starts and admission.restore is None
                and admission.snapshot_after is None and not admission.warm
                and len(admission.prompt_tokens) > step >= START_PREFIX_ALIGN)

    def _advance_alone(self) -> tuple[int, int, AdmitSequence | None]:
        """Run one chunk of the oldest prompt prefilled alone.

        Returns its sequence id, the tokens run, and once the chunks are done,
        the admission that starts the rest directly.

        With CUDA (where starts are bucketed), a prompt longer than one chunk
        is not prefilled in the batch: there an 8k-token prefill through the
        batch took 2.4-2.6x (8B) and 4-5x (1B) the time it takes on a plain
        cache (benchmarks/start_shapes.py --cold); the batch cache hands
        attention a mask array where a plain one gets the causal kernel.
        Instead it runs on its own cache, one chunk per step, the
        chunks ending on multiples of the chunk size and the last one on a
        multiple of START_PREFIX_ALIGN (so their shapes repeat and cuDNN's
        plans are reused). The last 1-START_PREFIX_ALIGN tokens then start
        directly like a hit's new turn: padded, logits in the same pass (few
        positions to project to the vocabulary), first token in that step.
        """
        import mlx.core as mx

        from mlxcel.model.kv import detach

        prefill = self._alone[0]
        step = self._settings.prefill_step_size
        body_end = (len(prefill.tokens) - 1) // START_PREFIX_ALIGN * START_PREFIX_ALIGN
        end = min((prefill.done // step + 1) * step, body_end)
        with mx.stream(self._generator.stream):
            self._model(mx.array(prefill.tokens[prefill.done:end])[None], cache=prefill.caches)
            mx.eval([cache.state for cache in prefill.caches])
        ran, prefill.done = end - prefill.done, end
        rest = None
        if end == body_end:
            self._alone.pop(0)
            rest = attrs.evolve(prefill.admission, cached_tokens=tuple(prefill.tokens[:end]),
                                prompt_tokens=tuple(prefill.tokens[end:]), adopted=detach(prefill.caches, end))
        return prefill.admission.sequence_id, ran, rest

    def _starts_directly(self, admission: AdmitSequence) -> bool:
        return (admission.snapshot_after is None and not admission.warm
                and len(admission.prompt_tokens) <= self._settings.prefill_step_size)

    def _start_direct(
        self, admission: AdmitSequence, caches: list[Any] | None, cached: list[int], prompt: list[int], kept: int
    ) -> _DirectStart:
        """Build (not evaluate) the prompt's forward pass and its first token.

        ``caches`` hold the first ``kept`` of the ``cached`` tokens; the rest
        run again with the prompt (a bucketed start, see ``_bucket``).
        """
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        if caches is None:
            caches = make_prompt_cache(self._model)
        run = cached[kept:] + prompt
        padding = self._bucket(kept, len(run))
        sampler = _make_sampler(admission.sampling)
        with mx.stream(self._generator.stream):
            tokens = mx.array(run + run[-1:] * padding)[None]
            if len(run) > 1 and not (self._one_pass_starts or padding):
                # All but the last token only fill the cache: their logits are never computed.
                self._model(tokens[:, :-1], cache=caches)
                logits = self._model(tokens[:, -1:], cache=caches)[:, -1, :]
            else:
                logits = self._model(tokens, cache=caches)[:, len(run) - 1, :]
                if padding:
                    for cache in caches:
                        cache.trim(padding)  # the padding's keys and values are dropped
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            token = mx.argmax(logprobs, axis=-1) if sampler is None else sampler(logprobs)
        all_tokens = cached + prompt
        donation = None
        if admission.donate_prompt:
            donation = _detach(admission.sequence_id, caches, all_tokens, final=False, evaluate=False)
        return _DirectStart(admission=admission, caches=caches, all_tokens=all_tokens, sampler=sampler,
                            token=token, logprobs=logprobs[0], donation=donation)

    def _bucket(self, kept: int, length: int) -> int:
        """How many padding tokens follow a direct start's ``length`` tokens (0: none).

        MLX's CUDA backend builds a cuDNN attention plan for every new pair
        of query and key lengths it meets, 0.06-0.16 s each on the H200
        (docs/benchmarks.md), and a hit's lengths are nearly always new. So
        there a start runs in bucketed shapes: the prefix it resumes from is
        cut to a multiple of START_PREFIX_ALIGN tokens (the cut tokens run
        again) and the tokens run are padded to a multiple of
        START_QUERY_BUCKET. Causal attention keeps the padding out of the
        real tokens' results, and the cache drops it afterwards.
        """
        if not self._bucket_starts:
            return 0
        padding = -length % START_QUERY_BUCKET
        context_size = self._settings.context_size
        if context_size is not None and kept + length + padding > context_size:
            return 0
        return padding

    def _start_generating(self, start: _DirectStart) -> tuple[SampledToken, DetachedSequence | None]:
        """Report a direct start's first token; it decodes on in the batch unless that ends it.

        Returns the token and, when it finished the sequence, the final donation.
        """
        admission = start.admission
        token = int(start.token.item())
        finish_reason = None
        if token in self._eos_token_ids:
            finish_reason = "stop"
        elif admission.max_tokens <= 1:
            finish_reason = "length"
        sequence = _Sequence(
            sequence_id=admission.sequence_id, sampling=admission.sampling,
            donate_on_finish=admission.donate_on_finish, donate_prompt=False, direct=True,
        )
        sampled = _sampled_token(sequence, _FirstToken(token, start.logprobs, finish_reason))
        if finish_reason is not None:
            done = None
            if admission.donate_on_finish:
                done = _detach(admission.sequence_id, start.caches, start.all_tokens)
            return sampled, done
        # The first token goes in as the prompt's last: its forward pass gives the second.
        (uid,) = self._generator.insert(
            [[token]],
            max_tokens=[admission.max_tokens - 1],
            caches=[start.caches],
            all_tokens=[start.all_tokens],
            samplers=[start.sampler],
        )
        self._by_uid[uid] = sequence
        self._uid_of[admission.sequence_id] = uid
        return sampled, None

    def _snapshot(self, uid: int, sequence: _Sequence) -> DetachedSequence:
        from mlxcel.model.snapshot import capture

        assert sequence.snapshot_tokens is not None
        caches, _tokens = self._generator.extract_cache([uid])[uid]
        snapshot = capture(self._family, caches, len(sequence.snapshot_tokens))
        tokens = sequence.snapshot_tokens
        sequence.snapshot_tokens = None  # one snapshot per sequence
        return DetachedSequence(
            sequence_id=sequence.sequence_id, tokens=tokens, payload=snapshot,
            nbytes=snapshot.nbytes, final=False, snapshot=True,
        )

    def _drop(self, uid: int) -> None:
        sequence = self._by_uid.pop(uid)
        del self._uid_of[sequence.sequence_id]
        self._generator.remove([uid])


def _is_out_of_memory(error: Exception) -> bool:
    text = str(error).lower()
    return isinstance(error, MemoryError) or "out of memory" in text or "malloc" in text


@attrs.frozen
class _FirstToken:
    """The fields of mlx-lm's generation response that ``_sampled_token`` reads."""

    token: int
    logprobs: Any
    finish_reason: str | None


def _detach(
    sequence_id: int, caches: Any, tokens: Any, *, final: bool = True, evaluate: bool = True
) -> DetachedSequence | None:
    from mlxcel.model.kv import detach

    token_tuple = tuple(int(token) for token in tokens)
    payload = detach(caches, len(token_tuple), evaluate=evaluate)
    if payload is None:
        return None
    return DetachedSequence(
        sequence_id=sequence_id, tokens=token_tuple, payload=payload, nbytes=payload.nbytes, final=final
    )


def _sampled_token(sequence: _Sequence, response: Any) -> SampledToken:
    token = int(response.token)
    if not sequence.sampling.logprobs:
        # Reading logprobs would queue behind the next step that mlx-lm has
        # already started (same stream), undoing its pipelining: skip it.
        return SampledToken(sequence_id=sequence.sequence_id, token=token, logprob=0.0,
                            finish_reason=response.finish_reason)
    import numpy as np

    # The vector is already evaluated: copying it to the host waits for nothing.
    logprobs = np.asarray(response.logprobs, dtype=np.float32)
    top: tuple[tuple[int, float], ...] = ()
    count = sequence.sampling.top_logprobs
    if count > 0:
        indices = np.argpartition(-logprobs, count - 1)[:count]
        indices = indices[np.argsort(-logprobs[indices], kind="stable")]
        top = tuple((int(index), float(logprobs[index])) for index in indices)
    return SampledToken(
        sequence_id=sequence.sequence_id,
        token=token,
        logprob=float(logprobs[token]),
        top_logprobs=top,
        finish_reason=response.finish_reason,
    )


def _make_sampler(sampling: SamplingParams) -> Callable[[Any], Any] | None:
    """None means greedy: the generator's shared sampler, so the batch samples in one call."""
    import mlx.core as mx
    from mlx_lm.sample_utils import apply_top_p

    if sampling.temperature == 0:
        return None
    temperature = sampling.temperature
    top_p = sampling.top_p
    key_state = [mx.random.key(sampling.seed)] if sampling.seed is not None else None

    def sample(logprobs: Any) -> Any:
        if 0 < top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        logits = logprobs * (1 / temperature)
        if key_state is None:
            return mx.random.categorical(logits)
        key_state[0], subkey = mx.random.split(key_state[0])
        return mx.random.categorical(logits, key=subkey)

    return sample
