"""The device actor: the only code that runs MLX, an executor of step plans.

Every MLX call happens on one long-lived worker thread (MLX ties streams to
the thread that made them). The thread loads the model, then loops on
``trio.from_thread.run(inbox.receive)``; the Trio side never blocks on it.
Each ``RunStep`` carries a ``StepPlan`` decided by the scheduling core
(``mlxcel/core/scheduler.py``); the device carries it out in order and
reports a ``StepResult``. Batching, chunked prefill and per-sequence caches
come from mlx-lm's ``BatchGenerator``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from mlxcel.actors.adapter_batches import AdapterBatches
from mlxcel.actors.messages import (
    DeviceMsg,
    LoadDiskPrefix,
    LoadDiskSnapshot,
    PersistPieces,
    PersistSnapshot,
    RunStep,
    UseDiskTier,
)
from mlxcel.core.plan import (
    AloneChunk,
    Capabilities,
    DetachedSequence,
    GrammarWork,
    InsertBatch,
    Removal,
    SampledToken,
    StartAlone,
    StartDirect,
    StepPlan,
    StepResult,
)
from mlxcel.model.adapters import AdapterSpec
from mlxcel.model.info import ModelInfo as ModelInfo
from mlxcel.model.lora import LoadedAdapters
from mlxcel.types import SamplingParams

logger = logging.getLogger(__name__)

# Steps that prefilled at least this many tokens measure the prefill rate (see prefill_seconds_per_token).
PREFILL_RATE_MIN_TOKENS = 128


@attrs.frozen(kw_only=True)
class DeviceStats:
    num_steps: int


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
    # Starts run in bucketed shapes and long prompts are prefilled alone
    # (None: with CUDA only; the core decides the shapes, see mlxcel/core/scheduler.py).
    bucket_starts: bool | None = None
    fail_step: int | None = None
    fail_out_of_memory: bool = False
    # LoRA adapters to load (unfused) and whether they start at their --lora scales or at 0.
    lora: tuple[AdapterSpec, ...] = ()
    lora_apply: bool = True
    # --prompt-cache-kv-bits (0: stored KV exact) and --prompt-cache-kv-group-size: see mlxcel/model/kv.py.
    kv_bits: int = 0
    kv_group_size: int = 64


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

    def statistics(self) -> DeviceStats:
        return DeviceStats(num_steps=self._num_steps)

    # --- everything below runs on the device thread -------------------------

    def _thread_main(self, task_status: trio.TaskStatus[ModelInfo]) -> None:
        import mlx.core as mx

        from mlxcel.model.kv import StoreFormat, use_store_format
        from mlxcel.model.loader import default_prefill_step_size, load_model

        use_store_format(StoreFormat(self._settings.kv_bits, self._settings.kv_group_size))
        loaded = load_model(self._settings.model_path)
        adapters = None
        if self._settings.lora:
            from mlxcel.model.lora import load_adapters

            adapters = load_adapters(loaded.model, self._settings.lora, apply=self._settings.lora_apply)
        context_size = self._settings.context_size or loaded.family.context_size or 4096
        step = self._settings.prefill_step_size or default_prefill_step_size()
        self._settings = attrs.evolve(self._settings, prefill_step_size=step, context_size=context_size)
        vision = None
        if loaded.vision is not None and loaded.vision.mrope and adapters is not None:
            # mlx-vlm's layers prefill M-RoPE prompts, and the adapters sit in mlx-lm's only.
            loaded = attrs.evolve(loaded, vision=attrs.evolve(
                loaded.vision, refusal="images are not served on this model while LoRA adapters are loaded"))
        if loaded.vision is not None and loaded.vision.refusal is None:
            from mlxcel.vision.encoder import VisionEncoder

            vision = VisionEncoder(loaded.path, loaded.model, mrope=loaded.vision.mrope)
        worker = _StepWorker(loaded.model, loaded.eos_token_ids, self._settings, loaded.family.model_type,
                             tokenizer=loaded.tokenizer, adapters=adapters, vision=vision)
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
            bucket_starts=worker.bucket_starts,
            adapters=adapters.infos if adapters is not None else (),
            vision=loaded.vision,
        )
        warm_up = self._settings.warm_up
        if mx.default_device() != mx.cpu if warm_up is None else warm_up:
            logger.info("device warm-up took %.2f s", worker.warm_up(info))
        trio.from_thread.run_sync(task_status.started, info)
        disk: Any = None  # model/disk_kv.py's DeviceDisk, once the engine hands over a disk tier
        try:
            while True:
                try:
                    message = self._receive(disk)
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    return
                match message:
                    case None:
                        continue
                    case RunStep():
                        done = worker.run_step(message.plan)
                        self._num_steps = done.step_number
                        trio.from_thread.run_sync(_reply, message.reply_to, done)
                        # Drops the released payloads here, so MLX frees them on this thread.
                        del message, done
                    case UseDiskTier() | PersistPieces() | LoadDiskPrefix() | PersistSnapshot() | LoadDiskSnapshot():
                        disk = _disk_message(disk, message, worker)
                        del message
                    case _:
                        raise AssertionError(f"unexpected device message {message!r}")
        finally:
            if disk is not None:
                disk.flush()

    def _receive(self, disk: Any) -> DeviceMsg | None:
        """The next message; with disk writes queued, None after converting a slice of them when none waits."""
        if disk is None or not disk.has_work():
            return trio.from_thread.run(self.inbox.receive)
        try:
            return trio.from_thread.run_sync(self.inbox.receive_nowait)
        except trio.WouldBlock:
            pass
        if disk.can_work():
            disk.work()
            return None
        # The writer is behind (its write budget): wait for a message a little, then look again.
        return trio.from_thread.run(_receive_within, self.inbox, 0.05)


async def _receive_within(inbox: trio.MemoryReceiveChannel[DeviceMsg], seconds: float) -> DeviceMsg | None:
    with trio.move_on_after(seconds):
        return await inbox.receive()
    return None


def _disk_message(disk: Any, message: UseDiskTier | PersistPieces | LoadDiskPrefix | PersistSnapshot
                  | LoadDiskSnapshot, worker: _StepWorker) -> Any:
    """The disk tier's messages (mlxcel/model/disk_kv.py does the work); returns the device's DeviceDisk."""
    from mlxcel.actors.messages import DiskPrefixLoaded
    from mlxcel.model.disk_kv import DeviceDisk

    match message:
        case UseDiskTier():
            return DeviceDisk(message.tier, worker.num_layers, worker.family)
        case PersistSnapshot():
            if disk is not None:
                disk.persist_snapshot(message.payload, message.name)
        case LoadDiskSnapshot():
            snapshot = None
            if disk is not None:
                try:
                    snapshot = disk.load_snapshot(message.name)
                except Exception:  # noqa: BLE001 - a disk fault must never stop the device
                    logger.exception("prompt-cache disk tier: loading a snapshot failed")
            trio.from_thread.run_sync(_reply, message.reply_to, DiskPrefixLoaded(
                payload=snapshot, num_tokens=snapshot.length if snapshot is not None else 0))
        case PersistPieces():
            if disk is not None:
                disk.persist(message.payload, message.pieces, urgent=message.urgent)
        case LoadDiskPrefix():
            payload = None
            if disk is not None:
                try:
                    payload = disk.load(message.plan, message.memory, worker.prefill_seconds_per_token)
                except Exception:  # noqa: BLE001 - a disk fault must never stop the device
                    logger.exception("prompt-cache disk tier: loading a disk hit failed")
            loaded = DiskPrefixLoaded(payload=payload, num_tokens=payload.length if payload is not None else 0)
            trio.from_thread.run_sync(_reply, message.reply_to, loaded)
    return disk


def _reply(reply_to: trio.MemorySendChannel[Any], done: Any) -> None:
    # The scheduler may have gone away (shutdown).
    with reply_to, contextlib.suppress(trio.BrokenResourceError, trio.WouldBlock):
        reply_to.send_nowait(done)


@attrs.define
class _DirectStart:
    """A start whose first token is computed outside the batch (see ``_start_direct``)."""

    start: StartDirect
    caches: list[Any]
    all_tokens: list[int]
    sampler: Callable[[Any], Any] | None
    processors: list[Callable[[Any, Any], Any]] | None
    token: Any
    logprobs: Any
    donation: DetachedSequence | None = None
    # The stored prefix its caches began from (see _Sequence.base).
    base: Any = None


@attrs.define
class _AlonePrefill:
    """A long prompt prefilled on its own cache, a chunk per step."""

    caches: list[Any]
    tokens: tuple[int, ...]  # cached and prompt tokens
    adapter_scales: tuple[float, ...] = ()
    base: Any = None


@attrs.define
class _Sequence:
    sequence_id: int
    sampling: SamplingParams
    donate_on_finish: bool
    donate_prompt: bool
    # Whole-state snapshots still due, in order: (cached + prompt tokens up to the point, checkpoint).
    snapshot_points: list[tuple[tuple[int, ...], bool]] = attrs.Factory(list)
    warm: bool = False
    # Started outside the batch: its prompt was reported done then.
    direct: bool = False
    # The stored prefix (a DetachedKV) its caches began from, or its prompt's donation: a later
    # donation reuses these pieces and copies only the rows past them.
    base: Any = None
    # Cached plus prompt tokens: a finished sequence's donation is cut there into prompt and reply pieces.
    prompt_len: int = 0


@attrs.define
class _Report:
    """What a step produced so far, in the order the device produced it."""

    sampled: list[SampledToken] = attrs.Factory(list)
    detached: list[DetachedSequence] = attrs.Factory(list)
    prefill_tokens: int = 0
    prefilling: list[int] = attrs.Factory(list)
    prompts_done: list[int] = attrs.Factory(list)
    restore_failures: list[tuple[int, str]] = attrs.Factory(list)
    warmed: list[int] = attrs.Factory(list)

    def result(self, step_number: int, *, decode_batch_size: int, grammar: GrammarWork | None) -> StepResult:
        return StepResult(
            step_number=step_number, sampled=tuple(self.sampled), detached=tuple(self.detached),
            decode_batch_size=decode_batch_size, prefill_tokens=self.prefill_tokens,
            prefilling=tuple(self.prefilling), prompts_done=tuple(self.prompts_done),
            restore_failures=tuple(self.restore_failures), warmed=tuple(self.warmed), grammar=grammar,
        )


class _NoClients:
    """The warm-up's requests go nowhere."""

    def send(self, request_id: str, delta: Any) -> bool:
        return True

    def fail(self, request_id: str, error: Any) -> None:
        raise RuntimeError(f"the device warm-up failed: {error.message}")

    def close(self, request_id: str) -> None:
        pass


class _StepWorker:
    """Holds the BatchGenerator and the map between our sequence ids and its uids."""

    def __init__(
        self, model: Any, eos_token_ids: frozenset[int] | set[int], settings: DeviceSettings, family: str = "",
        *, tokenizer: Any = None, adapters: LoadedAdapters | None = None, vision: Any = None,
    ) -> None:
        import mlx.core as mx
        from mlx_lm.generate import BatchGenerator
        from mlx_lm.models.cache import KVCache, make_prompt_cache

        self._model = model
        # How a direct start gets its last token's logits: on a GPU in the same
        # forward pass as the rest (projecting every position to the vocabulary
        # costs less than reading the weights again); on the CPU in a second
        # one-token pass, as mlx-lm does (the projection costs more there).
        one_pass = settings.one_pass_starts
        self._one_pass_starts = mx.default_device() != mx.cpu if one_pass is None else one_pass
        bucket = settings.bucket_starts
        # Only plain KV caches can be cut and trimmed: other layer kinds run unbucketed.
        self.bucket_starts = ((mx.cuda.is_available() if bucket is None else bucket)
                              and all(type(cache) is KVCache for cache in make_prompt_cache(model)))
        self.num_layers = len(make_prompt_cache(model))
        self._eos_token_ids = frozenset(eos_token_ids)
        self._grammars = _Grammars(tokenizer, self._eos_token_ids)
        self._family = family
        self.family = family
        self._settings = settings
        assert settings.prefill_step_size is not None, "resolved before the worker is made"
        self._step = settings.prefill_step_size
        self._make_generator: Callable[[], Any] = lambda: BatchGenerator(
            model,
            stop_tokens=[[token] for token in sorted(eos_token_ids)],
            completion_batch_size=settings.max_batch_size,
            prefill_batch_size=settings.prefill_batch_size,
            prefill_step_size=self._step,
        )
        self._adapters = adapters
        # A vision model's tower (mlxcel.vision.encoder.VisionEncoder); None for a text model.
        self._vision = vision
        # One BatchGenerator per adapter configuration (only one without adapters).
        self._generator = AdapterBatches(self._make_generator, adapters)
        self._by_uid: dict[int, _Sequence] = {}
        self._uid_of: dict[int, int] = {}
        # Long prompts prefilled outside the batch, and the KV of those whose last chunk ran.
        self._alone: dict[int, _AlonePrefill] = {}
        self._alone_done: dict[int, Any] = {}
        self._step_number = 0
        # Seconds a prefilled token costs, measured (None until measured): a disk hit reads from disk
        # only while that is faster than prefilling.
        self.prefill_seconds_per_token: float | None = None

    def warm_up(self, info: ModelInfo) -> float:
        """Run a direct start, a chunked prefill and decoding once, on throwaway prompts.

        A GPU backend compiles its kernels on first use (seconds for the first
        request otherwise). The plans come from a scheduling core of the real
        capabilities, so the warm-up runs the shapes real requests will.
        Returns the seconds it took. The generator is fresh afterwards.
        """
        import mlx.core as mx

        from mlxcel.core.scheduler import NewRequest, SchedulerCore

        start = time.perf_counter()
        settings = self._settings
        assert settings.prefill_step_size is not None
        assert settings.context_size is not None
        self._settings = attrs.evolve(settings, fail_step=None)
        core = SchedulerCore(
            Capabilities(prefill_step_size=settings.prefill_step_size, context_size=settings.context_size,
                         max_batch_size=settings.max_batch_size, bucket_starts=self.bucket_starts),
            tokenizer=info.tokenizer, eos_token_ids=info.eos_token_ids,
        )
        clients = _NoClients()
        for index, length in enumerate((8, settings.prefill_step_size + 8)):  # one chunk; two chunks
            prompt = tuple(10 + i % 1000 for i in range(length))
            core.add(NewRequest(request_id=f"warm-up-{index}", prompt_tokens=prompt, max_tokens=3,
                                sampling=SamplingParams(temperature=0.0), cache_context=None), clients)
        for _ in range(32):
            if not core.has_work():
                break
            assert core.next_lookup(0.0) is None
            plan = core.schedule()
            core.update(plan, self.run_step(plan), clients, 0.0)
        self._settings = settings
        self._generator.close()
        self._generator = AdapterBatches(self._make_generator, self._adapters)
        self._by_uid.clear()
        self._uid_of.clear()
        self._alone.clear()
        self._alone_done.clear()
        self._step_number = 0
        self.prefill_seconds_per_token = self._time_a_prefill_chunk()
        mx.clear_cache()
        return time.perf_counter() - start

    def _time_a_prefill_chunk(self) -> float:
        """Seconds per token of one prefill chunk on a fresh cache, once its shapes are compiled."""
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        tokens = mx.array([10 + i % 1000 for i in range(self._step)])[None]
        seconds = 0.0
        for _ in range(2):  # the first compiles
            caches = make_prompt_cache(self._model)
            started = time.perf_counter()
            with mx.stream(self._generator.stream):
                self._model(tokens, cache=caches)
                mx.eval([cache.state for cache in caches])
            seconds = time.perf_counter() - started
        return seconds / self._step

    def run_step(self, plan: StepPlan) -> StepResult:
        """Carry the plan out in its order; any error fails everything the device holds."""
        self._step_number += 1
        report = _Report()
        direct: list[_DirectStart] = []
        step_started = time.perf_counter()
        try:
            prompt_responses, generation_responses = self._execute(plan, report, direct)
            started = [self._start_generating(start) for start in direct]
        except Exception as error:  # noqa: BLE001 - reported to every sequence on the device
            return self._failed(plan, report, error)
        self._report_direct(direct, started, report)
        self._report_decoded(generation_responses, report)
        self._report_prefilled(prompt_responses, report)
        if report.prefill_tokens >= PREFILL_RATE_MIN_TOKENS:
            # The whole step over its prefill tokens: an over-estimate when it also decoded.
            sample = (time.perf_counter() - step_started) / report.prefill_tokens
            known = self.prefill_seconds_per_token
            self.prefill_seconds_per_token = sample if known is None else 0.8 * known + 0.2 * sample
        return report.result(self._step_number, decode_batch_size=len(generation_responses),
                             grammar=self._grammars.take_work())

    def _execute(self, plan: StepPlan, report: _Report, direct: list[_DirectStart]) -> tuple[list[Any], list[Any]]:
        """Removals, starts, the chunk alone, one evaluation of the direct starts, then the batch."""
        for removal in plan.removals:
            self._remove(removal, report.detached)
        for start in plan.starts:
            failure = self._start(start, direct)
            if failure is not None:
                report.restore_failures.append((start.sequence_id, failure))
        if plan.alone_chunk is not None:
            report.prefill_tokens += self._run_alone_chunk(plan.alone_chunk)
            if plan.alone_rest is None:
                report.prefilling.append(plan.alone_chunk.sequence_id)
        if plan.alone_rest is not None:
            direct.append(self._start_direct(plan.alone_rest))
        if self._settings.fail_step == self._step_number:
            if self._settings.fail_out_of_memory:
                raise RuntimeError(f"[malloc] injected out of memory at step {self._step_number}")
            raise RuntimeError(f"injected fault at step {self._step_number}")
        if direct:
            # One evaluation for every direct start (and its prompt donation copy).
            import mlx.core as mx

            mx.eval([(start.token, start.logprobs) for start in direct],
                    [start.donation.payload.arrays() for start in direct if start.donation is not None])
        if not (plan.run_batch and self._by_uid):
            return [], []
        with self._generator.stats() as stats:
            prompt_responses, generation_responses = self._generator.next()
        report.prefill_tokens += stats.prompt_tokens
        return prompt_responses, generation_responses

    def _failed(self, plan: StepPlan, report: _Report, error: Exception) -> StepResult:
        logger.exception("device step %d failed", self._step_number, exc_info=error)
        # Starts that raised never reached the generator: they fail too.
        failed = tuple(
            {sequence.sequence_id for sequence in self._by_uid.values()}
            | {start.sequence_id for start in plan.starts}
            | {start.sequence_id for start in plan.direct_starts}
            | set(self._alone) | set(self._alone_done)
        )
        self._alone.clear()
        self._alone_done.clear()
        self._generator.close()
        self._generator = AdapterBatches(self._make_generator, self._adapters)
        self._by_uid.clear()
        self._uid_of.clear()
        return StepResult(
            step_number=self._step_number,
            error=f"{type(error).__name__}: {error}",
            out_of_memory=_is_out_of_memory(error),
            failed_sequences=failed,
            detached=tuple(report.detached),
        )

    def _report_direct(self, direct: list[_DirectStart], started: list[tuple[SampledToken, DetachedSequence | None]],
                       report: _Report) -> None:
        for begun, (token, done) in zip(direct, started, strict=True):
            report.sampled.append(token)
            report.prompts_done.append(begun.start.sequence_id)
            report.prefill_tokens += len(begun.start.prompt_tokens)
            if done is not None:
                report.detached.append(done)
            elif begun.donation is not None:
                report.detached.append(begun.donation)

    def _report_decoded(self, responses: list[Any], report: _Report) -> None:
        for response in responses:
            sequence = self._by_uid.get(response.uid)
            if sequence is None:
                continue
            report.sampled.append(_sampled_token(sequence, response))
            if response.finish_reason is not None:
                del self._by_uid[response.uid]
                del self._uid_of[sequence.sequence_id]
                if sequence.donate_on_finish and response.prompt_cache is not None:
                    item = _detach(sequence.sequence_id, response.prompt_cache, response.all_tokens,
                                   base=sequence.base, split_at=sequence.prompt_len)
                    if item is not None:
                        report.detached.append(item)

    def _report_prefilled(self, responses: list[Any], report: _Report) -> None:
        for response in responses:
            sequence = self._by_uid.get(response.uid)
            if sequence is None or sequence.direct:
                continue
            if response.end_of_segment and sequence.snapshot_points:
                # The chunk just run ended exactly at a snapshot point.
                report.detached.append(self._snapshot(response.uid, sequence))
                if sequence.warm and not sequence.snapshot_points:
                    report.warmed.append(sequence.sequence_id)
                    self._drop(response.uid)
                    continue
            if not response.end_of_prompt:
                report.prefilling.append(sequence.sequence_id)
                continue
            report.prompts_done.append(sequence.sequence_id)
            if sequence.donate_prompt:
                cache_list, tokens = self._generator.extract_cache([response.uid])[response.uid]
                item = _detach(sequence.sequence_id, cache_list, tokens, final=False, base=sequence.base)
                if item is not None:
                    report.detached.append(item)
                    sequence.base = item.payload

    def _remove(self, removal: Removal, detached: list[DetachedSequence]) -> None:
        uid = self._uid_of.pop(removal.sequence_id, None)
        if uid is None:
            # Prefilled alone, or finished already: no KV to give.
            self._alone.pop(removal.sequence_id, None)
            self._alone_done.pop(removal.sequence_id, None)
            return
        sequence = self._by_uid.pop(uid)
        caches = self._generator.remove([uid], return_prompt_caches=removal.donate)
        if removal.donate and uid in caches:
            cache_list, tokens = caches[uid]
            item = _detach(sequence.sequence_id, cache_list, tokens, base=sequence.base,
                           split_at=sequence.prompt_len)
            if item is not None:
                detached.append(item)

    def _start(self, start: StartDirect | InsertBatch | StartAlone, direct: list[_DirectStart]) -> str | None:
        """Carry out one start; returns why a snapshot could not be restored (it then runs cold)."""
        from mlx_lm.models.cache import make_prompt_cache


        if isinstance(start, StartAlone):
            own = _adopt(start.adopted, start.kept) if start.adopted is not None else make_prompt_cache(self._model)
            self._alone[start.sequence_id] = _AlonePrefill(caches=own, tokens=start.tokens,
                                                           adapter_scales=start.adapter_scales,
                                                           base=_base(start.adopted, start.kept))
            return None
        if isinstance(start, StartDirect) and start.restore is None:
            direct.append(self._start_direct(start))
            return None
        caches, prompt, cached, failure = self._resume(start)
        if isinstance(start, StartDirect) and failure is None:
            direct.append(self._start_direct(start, caches))
            return None
        if isinstance(start, StartDirect) and len(prompt) <= self._step:
            # The snapshot would not restore: the whole prompt still fits one chunk.
            direct.append(self._start_direct(attrs.evolve(start, prompt_tokens=tuple(prompt), cached_tokens=(),
                                                          kept=0, restore=None)))
            return failure
        self._insert(start, caches, prompt, cached, failure)
        return failure

    def _resume(self, start: StartDirect | InsertBatch) -> tuple[list[Any] | None, list[int], list[int], str | None]:
        """The caches a start resumes from, its prompt and cached tokens (all cold if a snapshot fails)."""
        from mlx_lm.models.cache import make_prompt_cache

        from mlxcel.model.snapshot import SnapshotMismatch, restore

        prompt, cached = list(start.prompt_tokens), list(start.cached_tokens)
        if start.restore is not None:
            try:
                caches = restore(start.restore, self._family, make_prompt_cache(self._model), len(cached))
                return caches, prompt, cached, None
            except SnapshotMismatch as error:
                return None, cached + prompt, [], str(error)
        if start.adopted is not None and cached:
            return _adopt(start.adopted, len(cached)), prompt, cached, None
        return None, prompt, cached, None

    def _insert(self, start: StartDirect | InsertBatch, caches: list[Any] | None, prompt: list[int],
                cached: list[int], failure: str | None) -> None:
        points: list[tuple[tuple[int, ...], bool]] = []
        segments = [prompt]
        if isinstance(start, InsertBatch) and start.snapshots and failure is None:
            # One segment per snapshot point: mlx-lm reports the end of each, where it is taken.
            edges = [point.after for point in start.snapshots]
            bounds = [0, *edges]
            segments = [prompt[begin:end] for begin, end in itertools.pairwise(bounds)]
            if edges[-1] < len(prompt):
                segments.append(prompt[edges[-1]:])
            else:
                # A warm-up prefills everything, snapshots, then stops: the extra token is never run.
                segments.append(prompt[-1:])
            points = [(tuple(cached + prompt[:point.after]), point.checkpoint) for point in start.snapshots]
        sampler, processors = _make_sampling(start.sampling, self._grammars)
        base = _base(start.adopted, len(cached)) if start.restore is None and failure is None else None
        (uid,) = self._generator.insert_segments(
            [segments],
            config=start.sampling.adapter_scales,
            max_tokens=[start.max_tokens],
            # mlx-lm takes None for both (a fresh cache; the batch's shared sampler) but annotates neither.
            caches=[caches],  # type: ignore[list-item]
            all_tokens=[cached],
            samplers=[sampler],  # type: ignore[list-item]
            logits_processors=[processors],  # type: ignore[list-item]  # None: none
        )
        self._by_uid[uid] = _Sequence(
            sequence_id=start.sequence_id,
            sampling=start.sampling,
            donate_on_finish=start.donate_on_finish,
            donate_prompt=start.donate_prompt,
            snapshot_points=points,
            warm=isinstance(start, InsertBatch) and start.warm,
            base=base,
            prompt_len=len(cached) + len(prompt),
        )
        self._uid_of[start.sequence_id] = uid

    def _run_alone_chunk(self, chunk: AloneChunk) -> int:
        """Run one chunk of a prompt prefilled alone; after its last, keep its KV for the direct start."""
        import mlx.core as mx

        from mlxcel.model.kv import detach

        prefill = self._alone[chunk.sequence_id]
        self._generator.apply(prefill.adapter_scales)
        with mx.stream(self._generator.stream):
            self._model(mx.array(prefill.tokens[chunk.start:chunk.end])[None], cache=prefill.caches)
            mx.eval([cache.state for cache in prefill.caches])
        if chunk.last:
            del self._alone[chunk.sequence_id]
            self._alone_done[chunk.sequence_id] = detach(prefill.caches, chunk.end, base=prefill.base)
        return chunk.end - chunk.start

    def _start_direct(self, start: StartDirect, caches: list[Any] | None = None) -> _DirectStart:
        """Build (not evaluate) the prompt's forward pass and its first token.

        A prompt that needs at most one prefill chunk (a cache hit's new turn,
        or a short prompt) is prefilled on its own cache and its first token
        sampled in this step, in one evaluation, as mlx-lm's own ``generate``
        does; it joins the decode batch afterwards. The first ``kept`` cached
        tokens come from the adopted KV; the rest run again with the prompt,
        followed by the plan's padding (bucketed shapes, see the core).
        """
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache


        base = None
        # The rows this start writes, so a prefix assembled from several pieces is built with room for them.
        room = len(start.cached_tokens) - start.kept + len(start.prompt_tokens) + start.padding
        if start.from_alone:
            alone = self._alone_done.pop(start.sequence_id)
            caches, base = _adopt(alone, start.kept, room), _base(alone, start.kept)
        elif start.adopted is not None and start.kept:
            caches = _adopt(start.adopted, start.kept, room)
            # The rows past kept run again, but the stored ones are the same tokens' KV: reuse them.
            base = _base(start.adopted, len(start.cached_tokens))
        if caches is None:
            caches = make_prompt_cache(self._model)
        cached, prompt = list(start.cached_tokens), list(start.prompt_tokens)
        run = cached[start.kept:] + prompt
        padding = start.padding
        sampler, processors = _make_sampling(start.sampling, self._grammars)
        all_tokens = cached + prompt
        self._generator.apply(start.sampling.adapter_scales)
        with mx.stream(self._generator.stream):
            tokens = mx.array(run + run[-1:] * padding)[None]
            forward = self._text_forward if start.vision is None else self._embedded_forward(run, padding, start)
            if len(run) > 1 and not (self._one_pass_starts or padding):
                # All but the last token only fill the cache: their logits are never computed.
                forward(tokens[:, :-1], cache=caches)
                logits = forward(tokens[:, -1:], cache=caches, offset=len(run) - 1)[:, -1, :]
            else:
                logits = forward(tokens, cache=caches)[:, len(run) - 1, :]
                if padding:
                    for cache in caches:
                        cache.trim(padding)  # the padding's keys and values are dropped
            if processors:
                # As mlx-lm's batch does: the history is every token in the cache (the padding is not).
                history = mx.array(all_tokens, dtype=mx.int32)
                for processor in processors:
                    logits = processor(history, logits)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            token = mx.argmax(logprobs, axis=-1) if sampler is None else sampler(logprobs)
        donation = None
        if start.donate_prompt:
            donation = _detach(start.sequence_id, caches, all_tokens, final=False, evaluate=False, base=base)
            if donation is not None:
                base = donation.payload
        return _DirectStart(start=start, caches=caches, all_tokens=all_tokens, sampler=sampler,
                            processors=processors, token=token, logprobs=logprobs[0], donation=donation,
                            base=base)

    def _text_forward(self, tokens: Any, *, cache: list[Any], offset: int = 0) -> Any:
        return self._model(tokens, cache=cache)

    def _embedded_forward(self, run: list[int], padding: int, start: StartDirect) -> Callable[..., Any]:
        """The text model over the prompt's input embeddings, image features in place (a cold start only)."""
        import mlx.core as mx

        if self._vision is None:
            raise ValueError("this model has no vision tower")
        assert start.kept == 0, "the core starts prompts with images cold"
        assert not start.cached_tokens, "the core starts prompts with images cold"
        vision = self._vision
        embeddings, positions = vision.embed(run, start.vision)
        if padding:
            embeddings = mx.concatenate([embeddings, mx.repeat(embeddings[:, -1:], padding, axis=1)], axis=1)
            if positions is not None:
                # The text after the last image sits at its index (see mlxcel/vision/processing.py).
                extra = mx.arange(len(run), len(run) + padding, dtype=positions.dtype)
                positions = mx.concatenate([positions, mx.broadcast_to(extra, (3, 1, padding))], axis=2)

        def forward(tokens: Any, *, cache: list[Any], offset: int = 0) -> Any:
            end = offset + tokens.shape[1]
            rows = embeddings[:, offset:end]
            if positions is None:
                return self._model(tokens, cache=cache, input_embeddings=rows)
            return vision.forward(tokens, rows, positions[:, :, offset:end], cache)

        return forward

    def _start_generating(self, direct: _DirectStart) -> tuple[SampledToken, DetachedSequence | None]:
        """Report a direct start's first token; it decodes on in the batch unless that ends it.

        Returns the token and, when it finished the sequence, the final donation.
        """
        start = direct.start
        token = int(direct.token.item())
        finish_reason = None
        if token in self._eos_token_ids:
            finish_reason = "stop"
        elif start.max_tokens <= 1:
            finish_reason = "length"
        sequence = _Sequence(
            sequence_id=start.sequence_id, sampling=start.sampling,
            donate_on_finish=start.donate_on_finish, donate_prompt=False, direct=True, base=direct.base,
            prompt_len=len(direct.all_tokens),
        )
        sampled = _sampled_token(sequence, _FirstToken(token, direct.logprobs, finish_reason))
        if finish_reason is not None:
            done = None
            if start.donate_on_finish:
                done = _detach(start.sequence_id, direct.caches, direct.all_tokens, base=direct.base)
            return sampled, done
        # The first token goes in as the prompt's last: its forward pass gives the second.
        (uid,) = self._generator.insert(
            [[token]],
            config=start.sampling.adapter_scales,
            max_tokens=[start.max_tokens - 1],
            caches=[direct.caches],
            all_tokens=[direct.all_tokens],
            samplers=[direct.sampler],  # type: ignore[list-item]  # None: the batch's shared sampler
            logits_processors=[direct.processors],  # type: ignore[list-item]  # None: none
        )
        self._by_uid[uid] = sequence
        self._uid_of[start.sequence_id] = uid
        return sampled, None

    def _snapshot(self, uid: int, sequence: _Sequence) -> DetachedSequence:
        from mlxcel.model.snapshot import capture

        tokens, checkpoint = sequence.snapshot_points.pop(0)
        caches, _tokens = self._generator.extract_cache([uid])[uid]
        snapshot = capture(self._family, caches, len(tokens))
        return DetachedSequence(
            sequence_id=sequence.sequence_id, tokens=tokens, payload=snapshot,
            nbytes=snapshot.nbytes, final=False, snapshot=True, checkpoint=checkpoint,
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
    sequence_id: int, caches: Any, tokens: Any, *, final: bool = True, evaluate: bool = True, base: Any = None,
    split_at: int | None = None,
) -> DetachedSequence | None:
    from mlxcel.model.kv import detach

    token_tuple = tuple(int(token) for token in tokens)
    payload = detach(caches, len(token_tuple), evaluate=evaluate, base=base, split_at=split_at)
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
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    if sampling.temperature == 0:
        return None
    temperature = sampling.temperature
    top_p, min_p, top_k = sampling.top_p, sampling.min_p, sampling.top_k
    key_state = [mx.random.key(sampling.seed)] if sampling.seed is not None else None

    def sample(logprobs: Any) -> Any:
        # mlx-lm's make_sampler chain (top-p, min-p, top-k), with a per-request seed.
        if 0 < top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        if min_p > 0:
            logprobs = apply_min_p(logprobs, min_p)
        if 0 < top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, top_k)
        logits = logprobs * (1 / temperature)
        if key_state is None:
            return mx.random.categorical(logits)
        key_state[0], subkey = mx.random.split(key_state[0])
        return mx.random.categorical(logits, key=subkey)

    return sample


def _make_sampling(
    sampling: SamplingParams, grammars: _Grammars | None = None
) -> tuple[Callable[[Any], Any] | None, list[Callable[[Any, Any], Any]] | None]:
    """A sequence's sampler and logits processors (None: the batch's shared greedy sampler; no processors).

    A grammar takes a part in each: its processor feeds the matcher the token
    just sampled, its sampler masks what the grammar forbids (see _Grammars).
    """
    sampler = _make_sampler(sampling)
    processors = _make_logits_processors(sampling)
    if sampling.grammar is None:
        return sampler, processors
    if grammars is None:
        raise ValueError("a grammar-constrained request needs the model's tokenizer")
    grammar = grammars.sequence(sampling.grammar)
    return grammar.sampler(sampler), [*(processors or ()), grammar.feed]


def _make_logits_processors(sampling: SamplingParams) -> list[Callable[[Any, Any], Any]] | None:
    """mlx-lm's processors for the request's penalties and logit_bias; None when none."""
    if not sampling.processes_logits:
        return None
    from mlx_lm.sample_utils import make_logits_processors

    processors: list[Callable[[Any, Any], Any]] = make_logits_processors(
        logit_bias=dict(sampling.logit_bias) or None,
        repetition_penalty=None if sampling.repetition_penalty == 1.0 else sampling.repetition_penalty,
        repetition_context_size=sampling.penalty_context,
        presence_penalty=sampling.presence_penalty or None,
        presence_context_size=sampling.penalty_context,
        frequency_penalty=sampling.frequency_penalty or None,
        frequency_context_size=sampling.penalty_context,
    )
    return processors


class _Grammars:
    """The grammar-constrained sequences' matchers, and their masks computed a step at a time.

    mlx-lm's step runs every sequence's logits processors, then every
    sequence's sampler. Each constrained sequence's processor only hands over
    the token sampled last, still lazy; the first of their samplers to run
    reads all those tokens back, starts the step's forward pass (the device
    computes logits meanwhile), feeds the matchers and computes their masks in
    parallel on llguidance's threads, and unpacks them on the device in one
    pass; each sampler then masks its own row. The logprobs the API reports are the model's, before
    the mask (as vLLM's default). The llguidance tokenizer is built on first
    use (~1 s).
    """

    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self._eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer: Any = None
        self._executor: Any = None
        # Fed this step, mask not computed yet.
        self._pending: list[_GrammarSequence] = []
        # Each computed sequence's row in `_allowed` (the step's unpacked masks).
        self._rows: dict[int, int] = {}
        self._allowed: Any = None
        # Since the last take_work().
        self._work = GrammarWork()

    def sequence(self, grammar: str) -> _GrammarSequence:
        from llguidance import LLExecutor, LLMatcher

        if self._ll_tokenizer is None:
            from llguidance.hf import from_tokenizer

            if self._tokenizer is None:
                raise ValueError("a grammar-constrained request needs the model's tokenizer")
            # mlx-lm's wrapper holds the Hugging Face tokenizer.
            hf_tokenizer = getattr(self._tokenizer, "_tokenizer", self._tokenizer)
            self._ll_tokenizer = from_tokenizer(hf_tokenizer, eos_token=self._eos_token_ids or None)
            self._executor = LLExecutor()
        started = time.perf_counter()
        matcher = LLMatcher(self._ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"grammar rejected: {matcher.get_error()}")
        seconds = time.perf_counter() - started
        logger.debug("grammar matcher built in %.1f ms", 1000 * seconds)
        self._work = attrs.evolve(self._work, matchers_built=self._work.matchers_built + 1,
                                  build_seconds=self._work.build_seconds + seconds)
        return _GrammarSequence(self, matcher)

    def take_work(self) -> GrammarWork | None:
        work, self._work = self._work, GrammarWork()
        return work if work.matchers_built or work.masks else None

    def fed(self, sequence: _GrammarSequence) -> None:
        self._pending.append(sequence)

    def allowed(self, sequence: _GrammarSequence, logprobs: Any) -> Any:
        """The step's mask of ``sequence``: True where its grammar allows the token."""
        if self._pending:
            self._compute(logprobs)
        return self._allowed[self._rows[id(sequence)]]

    def _compute(self, logprobs: Any) -> None:
        import mlx.core as mx
        import numpy as np

        started = time.perf_counter()
        pending, self._pending = self._pending, []
        vocab = logprobs.shape[-1]
        # The tokens first (they wait for the last step only), then the forward pass is
        # started: queued before them, it would hold their read-back up.
        tokens = [sequence.last_token for sequence in pending if sequence.last_token is not None]
        mx.eval(tokens)
        mx.async_eval(logprobs)
        for sequence in pending:
            if sequence.last_token is not None and not sequence.matcher.is_error():
                sequence.matcher.consume_token(int(sequence.last_token.item()))
            sequence.last_token = None
        width = (self._ll_tokenizer.vocab_size + 31) // 32
        packed = np.zeros((len(pending), max(width, (vocab + 31) // 32)), dtype=np.int32)
        working = [(sequence.matcher, row) for row, sequence in enumerate(pending) if not sequence.matcher.is_error()]
        if working:
            self._executor.unsafe_compute_mask_ptr(working, packed.ctypes.data, packed.shape[1] * 4, len(pending))
        words = packed.view(np.uint32)
        for row, sequence in enumerate(pending):
            matcher = sequence.matcher
            if matcher.is_error():
                logger.warning("grammar matcher failed: %s", matcher.get_error())
            # EOS passes where the grammar may end; a failed matcher passes nothing else, so the reply stops.
            may_end = matcher.is_error() or matcher.is_accepting()
            for eos in self._eos_token_ids:
                if eos < vocab:
                    bit = np.uint32(1 << (eos % 32))
                    words[row, eos // 32] = words[row, eos // 32] | bit if may_end else words[row, eos // 32] & ~bit
        word_index, bit_index = _bit_positions(vocab)
        self._allowed = ((mx.array(words)[:, word_index] >> bit_index) & 1).astype(mx.bool_)
        self._rows = {id(sequence): row for row, sequence in enumerate(pending)}
        seconds = time.perf_counter() - started
        logger.debug("grammar masks of %d sequences in %.2f ms", len(pending), 1000 * seconds)
        self._work = attrs.evolve(self._work, masks=self._work.masks + len(pending),
                                  mask_seconds=self._work.mask_seconds + seconds)


class _GrammarSequence:
    """One sequence's matcher, its processor (``feed``) and its sampler's mask."""

    def __init__(self, grammars: _Grammars, matcher: Any) -> None:
        self._grammars = grammars
        self.matcher = matcher
        self._started = False
        # The token to feed the matcher before this step's mask (None on the first step).
        self.last_token: Any = None

    def feed(self, tokens: Any, logits: Any) -> Any:
        """A logits processor that changes nothing: it hands over the token sampled last, still lazy."""
        self.last_token = tokens[-1] if self._started else None
        self._started = True
        self._grammars.fed(self)
        return logits

    def sampler(self, sample: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
        def masked(logprobs: Any) -> Any:
            import mlx.core as mx

            allowed = self._grammars.allowed(self, logprobs)
            logprobs = mx.where(allowed, logprobs, mx.array(-mx.inf, dtype=logprobs.dtype))
            return mx.argmax(logprobs, axis=-1) if sample is None else sample(logprobs)

        return masked


@functools.lru_cache(maxsize=4)
def _bit_positions(vocab: int) -> tuple[Any, Any]:
    """For each token id: its word in a packed mask and its bit in that word."""
    import mlx.core as mx

    ids = mx.arange(vocab, dtype=mx.uint32)
    return ids >> 5, ids & 31


def _base(handle: Any, num_tokens: int) -> Any:
    """The first ``num_tokens`` of a stored prefix, as a later donation's base (None: nothing adopted)."""
    if handle is None or num_tokens <= 0:
        return None
    return handle.cut(min(num_tokens, handle.length))


def _adopt(handle: Any, num_tokens: int, room: int = 0) -> list[Any]:
    """Fresh caches holding a stored prefix's first ``num_tokens`` rows (the core's handle is a DetachedKV)."""
    from mlxcel.model.kv import DetachedKV, adopt

    if not isinstance(handle, DetachedKV):
        raise TypeError(f"not a stored KV prefix: {type(handle).__name__}")
    return adopt(handle, num_tokens, room=room)
