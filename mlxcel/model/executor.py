"""The executor of step plans: what the device thread runs for each ``RunStep``.

It carries out a ``StepPlan`` decided by the scheduling core
(``mlxcel/core/scheduler.py``) in order and returns a ``StepResult``:
removals (with donations), starts (cold ones batched into one forward pass,
hits that keep the same prefix length too, long prompts a chunk at a time alone),
then the batch's decode step. Batching, chunked prefill in the batch and
per-sequence caches come from mlx-lm's ``BatchGenerator`` (one for every
LoRA configuration, ``adapter_batches.py``); started sequences join its decode
batch without a pass of their own (``batch_join.py``). Only the device
thread (``mlxcel/actors/device.py``) uses it.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from mlxcel.core.plan import (
    AloneChunk,
    DetachedSequence,
    GrammarWork,
    InsertBatch,
    Removal,
    SampledToken,
    SpeculationWork,
    StartAlone,
    StartDirect,
    StepPlan,
    StepResult,
)
from mlxcel.model import batch_step
from mlxcel.model.adapter_batches import AdapterBatches
from mlxcel.model.adapters import AdapterSpec
from mlxcel.model.grammar_masks import Grammars, mask_timeout
from mlxcel.model.lora import LoadedAdapters
from mlxcel.model.sampling import make_sampling, sampled_token
from mlxcel.model.speculation import SpeculationStats, install as install_speculation
from mlxcel.types import SamplingParams

logger = logging.getLogger(__name__)


# Steps that prefilled at least this many tokens measure the prefill rate (see prefill_seconds_per_token).
PREFILL_RATE_MIN_TOKENS = 128


# Token positions (rows x padded length) of one batched pass of cold starts: a model outside
# HEAD_AFTER_INNER_MODULES projects every one of them to the vocabulary (4,096 x 128k bf16 is 1 GiB),
# so larger waves take several passes.
COLD_GROUP_POSITIONS = 4096

# mlx-lm model classes whose forward is their inner model, then the vocabulary head and nothing else: a start
# projects only the positions whose logits it reads (a wave's shared pass of 64 rows x 64 positions otherwise
# projects all 4,096 to the vocabulary; with the demo model's 151k-token vocabulary that was 90 % of the pass).
HEAD_AFTER_INNER_MODULES = frozenset({"mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3"})


@attrs.frozen(kw_only=True)
class DeviceSettings:
    model_path: Path
    context_size: int | None = None
    max_batch_size: int = 64
    prefill_batch_size: int = 8
    prefill_step_size: int | None = None
    # None: warm up on a GPU only.
    warm_up: bool | None = False
    # A direct start's logits in one forward pass (None: on a GPU only; see StepExecutor).
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
    # Masked one-token attention on mlxcel's kernel (mlxcel/model/ragged_attention.py); CUDA only.
    ragged_attention: bool = True
    # --grammar-mask-timeout-ms: a constrained row whose mask is later than this in a step ends (None: by backend).
    grammar_mask_timeout_s: float | None = None
    # --speculative ("ngram", "draft" or "off") and --speculative-tokens: see mlxcel/model/speculation.py.
    speculative: str = "off"
    speculative_tokens: int = 4
    # --draft-model (with --speculative draft): loaded by the device thread, handed to the executor.
    draft_model_path: Path | None = None


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
    # The batched pass it started in, and its row there (its caches are views of that row).
    shared: Any = None
    shared_row: int = 0


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
    # Joined the decode batch with its first token as input: the batch's next step reports that token again.
    replays_first: bool = False


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


class StepExecutor:
    """Holds the BatchGenerator and the map between our sequence ids and its uids."""

    def __init__(
        self, model: Any, eos_token_ids: frozenset[int] | set[int], settings: DeviceSettings, family: str = "",
        *, tokenizer: Any = None, adapters: LoadedAdapters | None = None, vision: Any = None, draft: Any = None,
    ) -> None:
        import mlx.core as mx
        from mlx_lm.generate import BatchGenerator
        from mlx_lm.models.cache import KVCache, make_prompt_cache

        self._model = model
        # Process-wide patches of mlx-lm (only device threads run them): decode steps normalize the logits only
        # when a row reads them, rows leave the batch by slices, not MLX's gather, and a row read back out of it
        # is a view, each stored piece copied out of the batch once, and a batch with no padding decodes without
        # a mask.
        from mlxcel.model import batch_rows, unpadded_decode

        batch_step.install()
        batch_rows.install()
        unpadded_decode.install()
        if settings.ragged_attention:
            from mlxcel.model import ragged_attention

            if changed := ragged_attention.install(model):
                logger.info("decode attention of %s runs on the ragged kernel", ", ".join(changed))
        # How a direct start gets its last token's logits: on a GPU in the same
        # forward pass as the rest (projecting the last position alone, or for
        # models outside HEAD_AFTER_INNER_MODULES every position, which costs less
        # than reading the weights again); on the CPU in a second one-token pass,
        # as mlx-lm does (the projection costs more there).
        one_pass = settings.one_pass_starts
        self._one_pass_starts = mx.default_device() != mx.cpu if one_pass is None else one_pass
        bucket = settings.bucket_starts
        # Only plain KV caches can be cut and trimmed: other layer kinds run unbucketed.
        self.bucket_starts = ((mx.cuda.is_available() if bucket is None else bucket)
                              and all(type(cache) is KVCache for cache in make_prompt_cache(model)))
        self.num_layers = len(make_prompt_cache(model))
        # Plain KV caches only: cold starts share a forward pass and join the batch without one of their own.
        self._plain_kv = all(type(cache) is KVCache for cache in make_prompt_cache(model))
        self._eos_token_ids = frozenset(eos_token_ids)
        self._grammars = Grammars(tokenizer, self._eos_token_ids, mask_timeout_s=mask_timeout(
            settings.grammar_mask_timeout_s, gpu=mx.default_device() != mx.cpu))
        self._family = family
        self.family = family
        self._settings = settings
        assert settings.prefill_step_size is not None, "resolved before the worker is made"
        self._step = settings.prefill_step_size
        # Proposals made, accepted and verified since start (speculation.py), whatever the resets.
        self.speculation_stats = SpeculationStats()
        self._speculation_seen = SpeculationWork()
        if settings.speculative == "draft" and draft is None:
            raise ValueError("--speculative draft needs a draft model (mlxcel.model.draft.load_draft)")

        def make_generator(batched: Any) -> Any:
            generator = BatchGenerator(
                batched,
                stop_tokens=[[token] for token in sorted(eos_token_ids)],
                completion_batch_size=settings.max_batch_size,
                prefill_batch_size=settings.prefill_batch_size,
                prefill_step_size=self._step,
            )
            if settings.speculative in ("ngram", "draft") and self._plain_kv:
                install_speculation(generator, num_tokens=settings.speculative_tokens,
                                    policy=self._speculation_policy, stats=self.speculation_stats,
                                    draft=draft if settings.speculative == "draft" else None)
            return generator

        self._make_generator: Callable[[Any], Any] = make_generator
        self._adapters = adapters
        # A vision model's tower (mlxcel.vision.encoder.VisionEncoder); None for a text model.
        self._vision = vision
        # One BatchGenerator whatever the rows' adapter configurations.
        self._generator = AdapterBatches(self._make_generator, model, adapters)
        self._by_uid: dict[int, _Sequence] = {}
        self._uid_of: dict[int, int] = {}
        # Long prompts prefilled outside the batch, and the KV of those whose last chunk ran.
        self._alone: dict[int, _AlonePrefill] = {}
        self._alone_done: dict[int, Any] = {}
        self._step_number = 0
        self._fault_injected = False  # fail_step's fault, once
        # Seconds a prefilled token costs, measured (None until measured): a disk hit reads from disk
        # only while that is faster than prefilling.
        self.prefill_seconds_per_token: float | None = None

    def _speculation_policy(self, uid: int) -> SamplingParams | None:
        """A batch row's sampling settings if it may speculate (its request did not opt out), else None."""
        sequence = self._by_uid.get(uid)
        if sequence is None or not sequence.sampling.speculative:
            return None
        return sequence.sampling

    @property
    def settings(self) -> DeviceSettings:
        return self._settings

    @settings.setter
    def settings(self, settings: DeviceSettings) -> None:
        self._settings = settings

    def reset(self) -> None:
        """Forget every sequence: a fresh generator, as after start-up."""
        batch_step.flush_older_than(self._step_number + 1)
        self._generator.close()
        self._generator = AdapterBatches(self._make_generator, self._model, self._adapters)
        self._by_uid.clear()
        self._uid_of.clear()
        self._alone.clear()
        self._alone_done.clear()
        self._step_number = 0

    def time_a_prefill_chunk(self) -> float:
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
            started = self._start_generating(direct)
            # Reporting queues donation copies: an out-of-memory there fails the step, not the server.
            self._report_direct(direct, started, report)
            self._report_decoded(generation_responses, report)
            self._report_prefilled(prompt_responses, report)
            # Copies no decode step has taken for a while (the steps ran no batch, or too few to take them all).
            batch_step.flush_older_than(self._step_number - batch_step.RIDER_SPREAD_STEPS + 1)
        except Exception as error:  # noqa: BLE001 - reported to every sequence on the device
            batch_step.flush_older_than(self._step_number + 1)
            return self._failed(plan, report, error)
        if report.prefill_tokens >= PREFILL_RATE_MIN_TOKENS:
            # The whole step over its prefill tokens: an over-estimate when it also decoded.
            sample = (time.perf_counter() - step_started) / report.prefill_tokens
            known = self.prefill_seconds_per_token
            self.prefill_seconds_per_token = sample if known is None else 0.8 * known + 0.2 * sample
        result = report.result(self._step_number, decode_batch_size=len(generation_responses),
                               grammar=self._grammars.take_work())
        return self._with_speculation(result)

    def after_reply(self) -> None:
        """The device thread has sent the step's result: queue the KV copies no decode step will carry."""
        if not self._by_uid:
            batch_step.flush_older_than(self._step_number + 1)

    def _with_speculation(self, result: StepResult) -> StepResult:
        """The step's share of the speculation counters (none: the result as it was)."""
        stats, seen = self.speculation_stats, self._speculation_seen
        if stats.verify_steps == seen.verify_steps:
            return result
        work = SpeculationWork(verify_steps=stats.verify_steps - seen.verify_steps,
                               proposed_tokens=stats.proposed_tokens - seen.proposed_tokens,
                               accepted_tokens=stats.accepted_tokens - seen.accepted_tokens)
        self._speculation_seen = SpeculationWork(verify_steps=stats.verify_steps,
                                                 proposed_tokens=stats.proposed_tokens,
                                                 accepted_tokens=stats.accepted_tokens)
        return attrs.evolve(result, speculation=work)

    def _execute(self, plan: StepPlan, report: _Report, direct: list[_DirectStart]) -> tuple[list[Any], list[Any]]:
        """Removals, starts, the chunk alone, one evaluation of the direct starts, then the batch."""
        self._remove_all(plan.removals, report.detached)
        shared = self._shared_passes(plan.starts)
        batched = {id(start) for group in shared.values() for start in group}
        for start in plan.starts:
            if id(start) in batched:
                continue
            failure = self._start(start, direct)
            if failure is not None:
                report.restore_failures.append((start.sequence_id, failure))
        for kept, group in shared.items():
            direct.extend(self._start_shared(group, kept))
        if plan.alone_chunk is not None:
            report.prefill_tokens += self._run_alone_chunk(plan.alone_chunk)
            if plan.alone_rest is None:
                report.prefilling.append(plan.alone_chunk.sequence_id)
        if plan.alone_rest is not None:
            direct.append(self._start_direct(plan.alone_rest))
        if self._fault_due(plan, direct):
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
        prompt_tokens = self._generator.prompt_tokens()
        prompt_responses, generation_responses = self._generator.next()
        report.prefill_tokens += self._generator.prompt_tokens() - prompt_tokens
        return prompt_responses, generation_responses

    def _fault_due(self, plan: StepPlan, direct: list[_DirectStart]) -> bool:
        """The test hook (``fail_step``): fail the first step from that number on that runs a sequence, once. A
        step planned ahead can find its rows finished; failing it would fail no request."""
        due = self._settings.fail_step
        if due is None or self._step_number < due or self._fault_injected:
            return False
        if not (direct or plan.alone_chunk is not None or (plan.run_batch and self._by_uid)):
            return False
        self._fault_injected = True
        return True

    def _failed(self, plan: StepPlan, report: _Report, error: Exception) -> StepResult:
        logger.exception("device step %d failed", self._step_number, exc_info=error)
        # Starts that raised never reached the generator: they fail too.
        failed = tuple(
            {sequence.sequence_id for sequence in self._by_uid.values()}
            | {start.sequence_id for start in plan.starts}
            | {start.sequence_id for start in plan.direct_starts}
            | {token.sequence_id for token in report.sampled}  # reported before the failure, now dropped
            | set(self._alone) | set(self._alone_done)
        )
        self._alone.clear()
        self._alone_done.clear()
        self._generator.close()
        self._generator = AdapterBatches(self._make_generator, self._model, self._adapters)
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
        donated: list[Any] = []
        for response in responses:
            sequence = self._by_uid.get(response.uid)
            if sequence is None:
                continue
            if sequence.replays_first:
                sequence.replays_first = False
                if response.finish_reason is None:
                    continue  # the first token, reported by its start
            report.sampled.append(sampled_token(sequence.sequence_id, sequence.sampling, response))
            if response.finish_reason is not None:
                del self._by_uid[response.uid]
                del self._uid_of[sequence.sequence_id]
                if sequence.donate_on_finish and response.prompt_cache is not None:
                    # Copied on the device's stream behind the next step, not waited for here.
                    item = _detach(sequence.sequence_id, response.prompt_cache, response.all_tokens,
                                   base=sequence.base, split_at=sequence.prompt_len, evaluate=False)
                    if item is not None:
                        donated.extend(item.payload.arrays())
                        report.detached.append(item)
        if donated:
            # Copied with the next decode step (batch_step.py says why); with no row left to decode, once the
            # step's tokens are on their way (``after_reply``): queueing 64 rows' copies took 0.2 s on an H100.
            batch_step.evaluate_with_next_step(donated, self._step_number)

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

    def _remove_all(self, removals: tuple[Removal, ...], detached: list[DetachedSequence]) -> None:
        """A step's removals in one ``remove``: mlx-lm filters (copies) every layer's batch cache once per call."""
        leaving: list[tuple[Removal, int, _Sequence]] = []
        for removal in removals:
            uid = self._uid_of.pop(removal.sequence_id, None)
            if uid is None:
                # Prefilled alone, or finished already: no KV to give.
                self._alone.pop(removal.sequence_id, None)
                self._alone_done.pop(removal.sequence_id, None)
                continue
            leaving.append((removal, uid, self._by_uid.pop(uid)))
        if not leaving:
            return
        donors = [uid for removal, uid, _sequence in leaving if removal.donate]
        caches = self._generator.extract_cache(donors) if donors else {}
        self._generator.remove([uid for _removal, uid, _sequence in leaving])
        for _removal, uid, sequence in leaving:
            if uid in caches:
                cache_list, tokens = caches[uid]
                item = _detach(sequence.sequence_id, cache_list, tokens, base=sequence.base,
                               split_at=sequence.prompt_len)
                if item is not None:
                    detached.append(item)

    def _start(self, start: StartDirect | InsertBatch | StartAlone, direct: list[_DirectStart]) -> str | None:
        """Carry out one start; returns why a snapshot could not be restored (the start then did not run)."""
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
        if failure is not None:
            # Not started: the core places it again with nothing to restore (the one place of policy).
            return failure
        if isinstance(start, StartDirect):
            direct.append(self._start_direct(start, caches))
            return None
        self._insert(start, caches, prompt, cached)
        return None

    def _resume(self, start: StartDirect | InsertBatch) -> tuple[list[Any] | None, list[int], list[int], str | None]:
        """The caches a start resumes from, its prompt and cached tokens, and why a snapshot would not restore."""
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
                cached: list[int]) -> None:
        points: list[tuple[tuple[int, ...], bool]] = []
        segments = [prompt]
        if isinstance(start, InsertBatch) and start.snapshots:
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
        sampler, processors = make_sampling(start.sampling, self._grammars, start.sequence_id)
        base = _base(start.adopted, len(cached)) if start.restore is None else None
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
        self._generator.apply([prefill.adapter_scales])
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
        sampler, processors = make_sampling(start.sampling, self._grammars, start.sequence_id)
        all_tokens = cached + prompt
        self._generator.apply([start.sampling.adapter_scales])
        with mx.stream(self._generator.stream):
            tokens = mx.array(run + run[-1:] * padding)[None]
            forward = self._text_forward if start.vision is None else self._embedded_forward(run, padding, start)
            if len(run) > 1 and not (self._one_pass_starts or padding):
                # All but the last token only fill the cache: their logits are never computed.
                forward(tokens[:, :-1], cache=caches)
                logits = forward(tokens[:, -1:], cache=caches, offset=len(run) - 1)[:, -1, :]
            elif start.vision is None:
                logits = self._logits_at(tokens, caches, mx.array([len(run) - 1]))
                if padding:
                    for cache in caches:
                        cache.trim(padding)  # the padding's keys and values are dropped
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

    def _shares_a_pass(self, start: StartDirect | InsertBatch | StartAlone) -> bool:
        """A direct start of a text prompt, from nothing stored or from a stored prefix: it can share a pass."""
        from mlxcel.model.kv import DetachedKV

        return (isinstance(start, StartDirect) and self._plain_kv and start.restore is None
                and not start.from_alone and start.vision is None
                and (start.kept == 0 or isinstance(start.adopted, DetachedKV)))

    def _shared_passes(self, starts: tuple[Any, ...]) -> dict[int, list[StartDirect]]:
        """The starts that share forward passes, by the prefix length they keep (two or more of each)."""
        by_kept: dict[int, list[StartDirect]] = {}
        for start in starts:
            if self._shares_a_pass(start):
                by_kept.setdefault(start.kept, []).append(start)
        return {kept: group for kept, group in by_kept.items() if len(group) > 1}

    def _start_shared(self, starts: list[StartDirect], kept: int) -> list[_DirectStart]:
        """Direct starts that keep the same prefix length, batched: one forward pass per row budget.

        Cold starts keep nothing; hits keep ``kept`` rows of their own stored
        prefixes (the core cuts hits' prefixes to aligned lengths, so hits of
        similar conversations keep the same). Each row's tokens after what it
        keeps are padded on the right to the longest (with the core's bucket
        padding, a multiple of the bucket), so causal attention keeps each
        row's real tokens exact; each row's first token comes from the logits
        at its own last token, and its cache keeps only its own rows.
        """
        width = max(len(start.cached_tokens) - kept + len(start.prompt_tokens) + start.padding for start in starts)
        # What hits keep in all is bounded by the core (Capabilities.hit_kept_tokens).
        rows = max(1, COLD_GROUP_POSITIONS // max(width, 1))
        begun: list[_DirectStart] = []
        for first in range(0, len(starts), rows):
            begun.extend(self._start_shared_rows(starts[first:first + rows], kept, width))
        return begun

    def _start_shared_rows(self, starts: list[StartDirect], kept: int, width: int) -> list[_DirectStart]:
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache, make_prompt_cache

        from mlxcel.model.batch_join import SharedPass
        from mlxcel.model.kv import DetachedKV, adopt_rows

        every = [list(start.cached_tokens) + list(start.prompt_tokens) for start in starts]
        runs = [tokens[kept:] for tokens in every]
        count = len(runs)
        # With bucketed shapes the row count is bucketed too (powers of two): filler rows repeat the first.
        padded_count = 1 << (count - 1).bit_length() if self.bucket_starts else count
        matrix = [run + run[-1:] * (width - len(run)) for run in runs]
        matrix += matrix[:1] * (padded_count - count)
        if kept:
            handles = [start.adopted for start in starts if isinstance(start.adopted, DetachedKV)]
            assert len(handles) == count, "_shares_a_pass: a hit's prefix is a DetachedKV"
            group_caches = adopt_rows(handles + handles[:1] * (padded_count - count), kept, room=width)
        else:
            group_caches = make_prompt_cache(self._model)
        configs = [start.sampling.adapter_scales for start in starts]
        self._generator.apply(configs + configs[:1] * (padded_count - count))
        begun = []
        with mx.stream(self._generator.stream):
            # Each row's logits at its own last token (filler rows at the first row's).
            ends = [len(run) - 1 for run in runs] + [len(runs[0]) - 1] * (padded_count - count)
            last = self._logits_at(mx.array(matrix), group_caches, mx.array(ends))
            shared = SharedPass(caches=group_caches)
            for row, (start, tokens) in enumerate(zip(starts, every, strict=True)):
                sampler, processors = make_sampling(start.sampling, self._grammars, start.sequence_id)
                row_logits = last[row:row + 1]
                if processors:
                    history = mx.array(tokens, dtype=mx.int32)
                    for processor in processors:
                        row_logits = processor(history, row_logits)
                logprobs = row_logits - mx.logsumexp(row_logits, axis=-1, keepdims=True)
                token = mx.argmax(logprobs, axis=-1) if sampler is None else sampler(logprobs)
                caches = []
                for layer in group_caches:
                    own = KVCache()
                    own.keys = layer.keys[row:row + 1, :, :len(tokens)]
                    own.values = layer.values[row:row + 1, :, :len(tokens)]
                    own.offset = len(tokens)
                    caches.append(own)
                # A hit's donation reuses its stored pieces and copies only the rows past them.
                base = _base(start.adopted, len(start.cached_tokens)) if kept else None
                donation = None
                if start.donate_prompt:
                    donation = _detach(start.sequence_id, caches, tokens, final=False, evaluate=False, base=base)
                    if donation is not None:
                        base = donation.payload
                begun.append(_DirectStart(start=start, caches=caches, all_tokens=tokens, sampler=sampler,
                                          processors=processors, token=token, logprobs=logprobs[0],
                                          donation=donation, base=base, shared=shared, shared_row=row))
        return begun

    def _text_forward(self, tokens: Any, *, cache: list[Any], offset: int = 0) -> Any:
        return self._model(tokens, cache=cache)

    def _logits_at(self, tokens: Any, caches: list[Any], positions: Any) -> Any:
        """The forward pass of ``tokens`` (rows x length) and the logits at one position per row (rows x vocab).

        For the model classes of HEAD_AFTER_INNER_MODULES the head projects those positions alone; any other
        model projects every position and the rows are picked after.
        """
        import mlx.core as mx

        model = self._model
        rows = mx.arange(tokens.shape[0])
        if type(model).__module__ not in HEAD_AFTER_INNER_MODULES:
            return model(tokens, cache=caches)[rows, positions]
        hidden = model.model(tokens, caches)[rows, positions][:, None]
        head = model.model.embed_tokens.as_linear if model.args.tie_word_embeddings else model.lm_head
        return head(hidden)[:, 0]

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

    def _start_generating(self, direct: list[_DirectStart]) -> list[tuple[SampledToken, DetachedSequence | None]]:
        """Report each direct start's first token; those it does not end decode on in the batch.

        Returns each start's token and, when it finished the sequence, the final donation.
        """
        from mlxcel.model.batch_join import Joiner, joinable

        started: list[tuple[SampledToken, DetachedSequence | None]] = []
        joining: dict[tuple[float, ...], list[tuple[_Sequence, Joiner]]] = {}
        for begun in direct:
            start = begun.start
            token = int(begun.token.item())
            finish_reason = None
            if token in self._eos_token_ids:
                finish_reason = "stop"
            elif start.max_tokens <= 1:
                finish_reason = "length"
            sequence = _Sequence(
                sequence_id=start.sequence_id, sampling=start.sampling,
                donate_on_finish=start.donate_on_finish, donate_prompt=False, direct=True, base=begun.base,
                prompt_len=len(begun.all_tokens),
            )
            first = _FirstToken(token, begun.logprobs, finish_reason)
            sampled = sampled_token(sequence.sequence_id, sequence.sampling, first)
            if finish_reason is not None:
                done = None
                if start.donate_on_finish:
                    done = _detach(start.sequence_id, begun.caches, begun.all_tokens, base=begun.base)
                started.append((sampled, done))
                continue
            started.append((sampled, None))
            if joinable(begun.caches):
                # Joins the batch's next step, which reports the first token again: dropped then.
                sequence.replays_first = True
                joining.setdefault(start.sampling.adapter_scales, []).append((sequence, Joiner(
                    first_token=begun.token, first_logprobs=begun.logprobs, caches=begun.caches,
                    all_tokens=begun.all_tokens, max_tokens=start.max_tokens, sampler=begun.sampler,
                    processors=begun.processors, shared=begun.shared, shared_row=begun.shared_row)))
                continue
            # Other cache kinds go through mlx-lm's prompt stage: the first token as the prompt's last.
            (uid,) = self._generator.insert(
                [[token]],
                config=start.sampling.adapter_scales,
                max_tokens=[start.max_tokens - 1],
                caches=[begun.caches],
                all_tokens=[begun.all_tokens],
                samplers=[begun.sampler],  # type: ignore[list-item]  # None: the batch's shared sampler
                logits_processors=[begun.processors],  # type: ignore[list-item]  # None: none
            )
            self._by_uid[uid] = sequence
            self._uid_of[start.sequence_id] = uid
        for config, rows in joining.items():
            uids = self._generator.join([joiner for _sequence, joiner in rows], config=config)
            for uid, (sequence, _joiner) in zip(uids, rows, strict=True):
                self._by_uid[uid] = sequence
                self._uid_of[sequence.sequence_id] = uid
        return started

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
