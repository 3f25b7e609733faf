"""The device actor alone, on the real llama fixture; the test plays the scheduler.

Loading the model takes seconds, so one test drives one actor through its whole life.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio

from mlxcel.actors import device
from mlxcel.actors.device import DeviceActor, DeviceSettings, ModelInfo
from mlxcel.actors.messages import AdmitSequence, RemoveSequence, RunStep, StepDone
from mlxcel.model.fixtures import fixture_path
from mlxcel.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
FAIL_STEP = 20


def admit(sequence_id: int, prompt: tuple[int, ...], max_tokens: int, **fields: Any) -> AdmitSequence:
    fields.setdefault("sampling", GREEDY)
    return AdmitSequence(
        sequence_id=sequence_id, prompt_tokens=prompt, cached_tokens=(), max_tokens=max_tokens, **fields,
    )


class Scheduler:
    """Drives the device strictly request/reply, one step in flight."""

    def __init__(self, to_device: trio.MemorySendChannel[RunStep]) -> None:
        self.to_device = to_device
        self.steps: list[StepDone] = []

    async def step(self, admit: tuple[AdmitSequence, ...] = (), remove: tuple[RemoveSequence, ...] = ()) -> StepDone:
        reply_to, replies = trio.open_memory_channel[StepDone](1)
        await self.to_device.send(RunStep(admit=admit, remove=remove, reply_to=reply_to))
        with replies:
            done = await replies.receive()
        self.steps.append(done)
        return done

    async def run_until_finished(self, sequence_ids: set[int], *, max_steps: int = 40) -> dict[int, list[Any]]:
        """Steps until every sequence in sequence_ids has finished; their sampled tokens."""
        sampled: dict[int, list[Any]] = {sequence_id: [] for sequence_id in sequence_ids}
        unfinished = set(sequence_ids)
        for _ in range(max_steps):
            if not unfinished:
                return sampled
            done = await self.step()
            assert done.error is None, done.error
            for token in done.sampled:
                sampled[token.sequence_id].append(token)
                if token.finish_reason is not None:
                    unfinished.discard(token.sequence_id)
        raise AssertionError(f"sequences {unfinished} did not finish in {max_steps} steps")


@contextlib.asynccontextmanager
async def running_device(**settings: Any) -> AsyncIterator[Scheduler]:
    """A device actor on the llama fixture with these settings, driven by a Scheduler."""
    to_device, inbox = trio.open_memory_channel[RunStep](0)
    actor = DeviceActor(DeviceSettings(model_path=fixture_path("llama"), **settings), inbox)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(actor.run)
            yield Scheduler(to_device)
            to_device.close()  # run() returns: the nursery can exit


async def test_device_batches_fails_a_step_and_stops_when_its_inbox_closes() -> None:
    to_device, inbox = trio.open_memory_channel[RunStep](0)
    actor = DeviceActor(
        DeviceSettings(model_path=fixture_path("llama"), prefill_step_size=512, fail_step=FAIL_STEP), inbox
    )
    first_prompt = tuple(range(1000, 1012))
    second_prompt = tuple(range(2000, 2007))
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            info: ModelInfo = await nursery.start(actor.run)
            assert info.model_id == fixture_path("llama").name
            assert info.eos_token_ids == frozenset({151645})
            assert info.context_size == 4096
            assert info.family.model_type == "llama"
            scheduler = Scheduler(to_device)

            # Two sequences admitted together, greedy, run to their max_tokens.
            done = await scheduler.step(admit=(
                admit(0, first_prompt, 4, donate_on_finish=True),
                admit(1, second_prompt, 3),
            ))
            assert done.error is None and done.step_number == 1
            sampled = {0: [], 1: []}
            for token in done.sampled:
                sampled[token.sequence_id].append(token)
            rest = await scheduler.run_until_finished(
                {sequence_id for sequence_id, tokens in sampled.items() if not tokens or tokens[-1].finish_reason is None}
            )
            for sequence_id, tokens in rest.items():
                sampled[sequence_id] += tokens
            assert [len(sampled[0]), len(sampled[1])] == [4, 3]
            for tokens in sampled.values():
                assert [token.finish_reason for token in tokens][-1] == "length"
                assert all(token.finish_reason is None for token in tokens[:-1])
                assert all(0 <= token.token < 151_646 and token.logprob <= 0 for token in tokens)
            assert max(step.decode_batch_size for step in scheduler.steps) == 2
            # mlx-lm may feed each prompt's last token to its first decode step instead.
            num_prompt = len(first_prompt) + len(second_prompt)
            assert num_prompt - 2 <= sum(step.prefill_tokens for step in scheduler.steps) <= num_prompt
            # Only sequence 0 asked for its KV at the finish.
            detached = [item for step in scheduler.steps for item in step.detached]
            assert [item.sequence_id for item in detached] == [0]
            assert detached[0].tokens[: len(first_prompt)] == first_prompt
            assert detached[0].nbytes > 0
            assert actor.statistics() == {"num_steps": len(scheduler.steps)}

            # An idle device answers empty steps until the injected fault.
            while len(scheduler.steps) < FAIL_STEP - 1:
                done = await scheduler.step()
                assert done.sampled == () and done.error is None
            done = await scheduler.step(admit=(admit(2, second_prompt, 3),))
            assert done.step_number == FAIL_STEP
            assert done.error is not None and "injected fault" in done.error
            assert done.failed_sequences == (2,)

            # The next step works: a fresh sequence runs, another is removed mid-flight with its KV.
            done = await scheduler.step(admit=(admit(3, second_prompt, 3), admit(4, first_prompt, 50)))
            assert done.error is None
            third = [token for token in done.sampled if token.sequence_id == 3]
            while not any(token.sequence_id == 4 for token in done.sampled):
                done = await scheduler.step()
                third += [token for token in done.sampled if token.sequence_id == 3]
            done = await scheduler.step(remove=(RemoveSequence(sequence_id=4, donate=True),))
            assert [item.sequence_id for item in done.detached] == [4]
            assert done.detached[0].tokens[: len(first_prompt)] == first_prompt
            assert all(token.sequence_id == 3 for token in done.sampled)
            third += done.sampled
            if third[-1].finish_reason is None:
                third += (await scheduler.run_until_finished({3}))[3]
            assert len(third) == 3
            # Greedy decoding of the same prompt gives the same tokens, batched or not.
            assert [token.token for token in third] == [token.token for token in sampled[1]]

            to_device.close()  # run() returns: the nursery can exit


async def test_an_admission_that_raises_is_reported_as_failed() -> None:
    to_device, inbox = trio.open_memory_channel[RunStep](0)
    actor = DeviceActor(DeviceSettings(model_path=fixture_path("llama")), inbox)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(actor.run)
            scheduler = Scheduler(to_device)
            bad = AdmitSequence(
                sequence_id=7, prompt_tokens=(5, 6), cached_tokens=(1, 2, 3, 4), adopted="not a KV payload",
                sampling=GREEDY, max_tokens=2,
            )
            done = await scheduler.step(admit=(admit(6, (1, 2, 3), 2), bad))
            to_device.close()
    assert done.error is not None
    assert set(done.failed_sequences) == {6, 7}


@pytest.mark.parametrize(("one_pass", "bucket"), [(False, False), (True, False), (True, True)],
                         ids=["two-pass", "one-pass", "bucketed"])
async def test_a_one_chunk_prompt_gets_its_first_token_in_its_admitting_step(
    one_pass: bool, bucket: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Short prompts (and a hit's new turn) start outside the batch; the tokens match the batch's,
    whether the last token's logits come from the prompt's own forward pass (GPU default) or a
    second, and when the start runs in bucketed shapes (CUDA default: part of the prefix again,
    padding after the prompt)."""
    # Small buckets for a small prompt: the 30-token prefix is cut to 24, and 6 + 10 tokens pad to 32.
    monkeypatch.setattr(device, "START_PREFIX_ALIGN", 8)
    monkeypatch.setattr(device, "START_QUERY_BUCKET", 32)
    with_logprobs = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)
    long_prompt = tuple(range(3000, 3040))
    async with running_device(prefill_step_size=16, one_pass_starts=one_pass, bucket_starts=bucket) as scheduler:
        # 40 tokens > one 16-token chunk: the batch prefills it over several steps.
        done = await scheduler.step(admit=(
            admit(0, long_prompt, 5, donate_on_finish=True, sampling=with_logprobs),
        ))
        assert done.sampled == () and done.prefilling == (0,)
        batched = (await scheduler.run_until_finished({0}))[0]
        final = [item for step in scheduler.steps for item in step.detached]
        assert [(item.sequence_id, item.final) for item in final] == [(0, True)]

        # The same prompt resumed from that KV at 30 tokens: the 10 left fit one chunk.
        done = await scheduler.step(admit=(AdmitSequence(
            sequence_id=1, prompt_tokens=long_prompt[30:], cached_tokens=long_prompt[:30],
            adopted=final[0].payload, sampling=with_logprobs, max_tokens=5, donate_prompt=True,
        ),))
        assert done.error is None
        assert [token.sequence_id for token in done.sampled] == [1]
        assert done.prompts_done == (1,) and done.prefill_tokens == 10
        # Its prompt KV is handed out in the same step, covering the whole prompt.
        assert [(item.sequence_id, item.final, item.tokens) for item in done.detached] == [
            (1, False, long_prompt)
        ]
        resumed = list(done.sampled) + (await scheduler.run_until_finished({1}))[1]
        assert [token.token for token in resumed] == [token.token for token in batched]
        assert [token.finish_reason for token in resumed] == [None] * 4 + ["length"]
        for ours, theirs in zip(resumed, batched, strict=True):
            assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-4)
            assert [index for index, _ in ours.top_logprobs] == [index for index, _ in theirs.top_logprobs]

        # One token asked for: it ends in the admitting step and its KV is the final donation.
        done = await scheduler.step(admit=(admit(2, long_prompt[:12], 1, donate_on_finish=True),))
        assert [(token.sequence_id, token.finish_reason) for token in done.sampled] == [(2, "length")]
        assert [(item.sequence_id, item.final, item.tokens) for item in done.detached] == [
            (2, True, long_prompt[:12])
        ]
        assert (await scheduler.step()).sampled == ()  # nothing left running


async def test_a_long_prompt_in_bucketed_shapes_is_prefilled_alone_then_starts_its_last_chunk(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """With buckets (CUDA default), a prompt longer than a chunk is prefilled outside the batch,
    a chunk per step ending on chunk multiples (the last on an align multiple), and its last few
    tokens start directly, padded, in the step of its last chunk; the tokens and logprobs are
    those of the plain batch, cold and resumed from a stored prefix."""
    monkeypatch.setattr(device, "START_PREFIX_ALIGN", 8)
    monkeypatch.setattr(device, "START_QUERY_BUCKET", 32)
    sampling = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)
    prompt = tuple(range(4000, 4045))  # 45 tokens: chunks of 16, 16 and 8 alone, the last 5 start directly
    runs: dict[bool, dict[str, Any]] = {}
    for bucket in (False, True):
        async with running_device(prefill_step_size=16, bucket_starts=bucket) as scheduler:
            await scheduler.step(admit=(admit(0, prompt, 4, donate_prompt=True, donate_on_finish=True,
                                              sampling=sampling),))
            cold = (await scheduler.run_until_finished({0}))[0]
            steps = list(scheduler.steps)
            prompt_kv = [item for step in steps for item in step.detached if not item.final]
            # Resumed at 21 cached tokens with 24 new ones (more than a chunk): cut to 16, chunks of 16 and 8.
            await scheduler.step(admit=(AdmitSequence(
                sequence_id=1, prompt_tokens=prompt[21:], cached_tokens=prompt[:21],
                adopted=prompt_kv[0].payload, sampling=sampling, max_tokens=4,
            ),))
            resumed = (await scheduler.run_until_finished({1}))[1]
            runs[bucket] = {"cold": cold, "resumed": resumed, "steps": steps, "prompt_kv": prompt_kv}
            if bucket:
                # Removed while prefilled alone, after one chunk (2) and after two (3):
                # neither starts nor gives anything.
                first = await scheduler.step(admit=(admit(2, prompt, 4, donate_on_finish=True),
                                                    admit(3, prompt[1:], 4, donate_on_finish=True)))
                assert (first.prefill_tokens, first.prefilling) == (16, (2,))  # one chunk per step, oldest first
                removed = await scheduler.step(remove=(RemoveSequence(sequence_id=2, donate=True),))
                assert (removed.prefill_tokens, removed.prefilling) == (16, (3,))
                assert (await scheduler.step()).prefill_tokens == 16  # 3's second chunk
                removed = await scheduler.step(remove=(RemoveSequence(sequence_id=3, donate=True),))
                assert removed.sampled == () and removed.detached == () and removed.prompts_done == ()
                assert (await scheduler.step()).prefill_tokens == 0
                # A last chunk in a step whose starts already took a chunk's worth of tokens:
                # its rest starts in the next step.
                await scheduler.step(admit=(admit(4, prompt, 2),))
                await scheduler.step()
                third = await scheduler.step(admit=(admit(5, prompt[:16], 2),))
                assert [t.sequence_id for t in third.sampled] == [5]
                assert (third.prefill_tokens, third.prefilling, third.prompts_done) == (8 + 16, (4,), (5,))
                fourth = await scheduler.step()
                assert 4 in [t.sequence_id for t in fourth.sampled] and fourth.prompts_done == (4,)
    plain, bucketed = runs[False], runs[True]
    for name in ("cold", "resumed"):
        assert [t.token for t in bucketed[name]] == [t.token for t in plain[name]]
        for ours, theirs in zip(bucketed[name], plain[name], strict=True):
            assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-4)
            assert [index for index, _ in ours.top_logprobs] == [index for index, _ in theirs.top_logprobs]
    assert [t.token for t in plain["resumed"]] == [t.token for t in plain["cold"]]
    # Three chunks alone; the last 5 tokens start directly in the third step, with the first token.
    prefill = [(step.prefill_tokens, step.prefilling, step.prompts_done) for step in bucketed["steps"]]
    assert prefill[:4] == [(16, (0,), ()), (16, (0,), ()), (13, (), (0,)), (0, (), ())]
    assert [step.prefill_tokens for step in plain["steps"]][:3] == [16, 16, 12]
    # The prompt's KV is handed over whole, once, as without buckets.
    assert [item.tokens for item in bucketed["prompt_kv"]] == [prompt] == [item.tokens for item in plain["prompt_kv"]]


async def test_direct_starts_take_one_chunk_of_tokens_per_step() -> None:
    """Prompts admitted together get their first tokens step by step, not all after the last."""
    prompts = {sequence_id: tuple(range(100 * sequence_id, 100 * sequence_id + 10)) for sequence_id in (1, 2, 3)}
    async with running_device(prefill_step_size=16) as scheduler:
        await scheduler.step(admit=(admit(0, tuple(range(7, 15)), 40),))
        while not any(token.sequence_id == 0 for token in (await scheduler.step()).sampled):
            pass  # sequence 0 is decoding
        # 10 + 10 tokens would pass the 16-token chunk: one start per step,
        # and while starts wait, the decoding sequence is held back.
        first = await scheduler.step(admit=tuple(admit(i, prompt, 4) for i, prompt in prompts.items()))
        assert [token.sequence_id for token in first.sampled] == [1]
        assert first.prompts_done == (1,) and first.prefill_tokens == 10
        # Sequence 3 leaves before it started: it never runs and gives no KV.
        second = await scheduler.step(remove=(RemoveSequence(sequence_id=3, donate=True),))
        assert [token.sequence_id for token in second.sampled] == [2, 0]  # nothing waits: decode again
        assert second.prompts_done == (2,) and second.detached == ()
        await scheduler.run_until_finished({0, 1, 2}, max_steps=80)
        counts = {i: sum(token.sequence_id == i for step in scheduler.steps for token in step.sampled)
                  for i in (0, *prompts)}
        assert counts == {0: 40, 1: 4, 2: 4, 3: 0}


async def test_waiting_starts_hold_back_decoding_for_a_bounded_number_of_steps() -> None:
    async with running_device(prefill_step_size=16) as scheduler:
        await scheduler.step(admit=(admit(0, tuple(range(7, 15)), 60),))
        while not any(token.sequence_id == 0 for token in (await scheduler.step()).sampled):
            pass
        burst = tuple(admit(i, tuple(range(100 * i, 100 * i + 10)), 2) for i in range(1, 8))
        steps = [await scheduler.step(admit=burst)] + [await scheduler.step() for _ in range(4)]
        starts = [[t.sequence_id for t in step.sampled if t.sequence_id != 0 and t.finish_reason is None]
                  for step in steps]
        assert starts == [[1], [2], [3], [4], [5]]
        # Four steps in a row held sequence 0 back; the fifth decodes it although starts wait.
        assert [any(t.sequence_id == 0 for t in step.sampled) for step in steps] == [False] * 4 + [True]


async def test_a_prompt_prefilled_in_the_batch_gets_its_first_token_although_starts_wait() -> None:
    """The batch hold delays decoding of running streams, never a first token the batch owes."""
    async with running_device(prefill_step_size=16) as scheduler:
        done = await scheduler.step(admit=(admit(0, tuple(range(500, 540)), 4),))  # three chunks
        for _ in range(6):
            if 0 in done.prompts_done:
                break
            done = await scheduler.step()
        assert 0 in done.prompts_done and not done.sampled
        burst = tuple(admit(i, tuple(range(100 * i, 100 * i + 10)), 2) for i in range(1, 6))
        done = await scheduler.step(admit=burst)
        # One start this step (a 16-token budget), the rest wait, and sequence 0's first token comes too.
        assert sorted(token.sequence_id for token in done.sampled) == [0, 1]
        # Once it has its first token, waiting starts hold its decoding back again.
        done = await scheduler.step()
        assert [token.sequence_id for token in done.sampled] == [2]
