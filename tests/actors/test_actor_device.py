"""The device actor alone, on the real llama fixture: the test hands it plans, as the core would.

What to run and when is the core's (tests/core/); here the executor must carry
plans out faithfully: every way of starting a prompt (the batch, directly,
alone in bucketed shapes, resumed from a prefix) gives the batch's tokens
and logprobs, removals hand back KV, and a failed step fails what it held.
Loading the model takes seconds, so one test drives one actor through a lot.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio

from mlxcel.actors.device import DeviceActor, DeviceSettings, DeviceStats, ModelInfo
from mlxcel.actors.messages import RunStep
from mlxcel.core.plan import (
    AloneChunk,
    InsertBatch,
    Removal,
    SampledToken,
    StartAlone,
    StartDirect,
    StepPlan,
    StepResult,
)
from mlxcel.fixtures import fixture_path
from mlxcel.types import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0)
WITH_LOGPROBS = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)
FAIL_STEP = 20


def batch(sequence_id: int, prompt: tuple[int, ...], max_tokens: int, **fields: Any) -> InsertBatch:
    fields.setdefault("sampling", GREEDY)
    return InsertBatch(sequence_id=sequence_id, prompt_tokens=prompt, cached_tokens=(), max_tokens=max_tokens,
                       **fields)


def direct(sequence_id: int, prompt: tuple[int, ...], max_tokens: int, **fields: Any) -> StartDirect:
    fields.setdefault("sampling", GREEDY)
    fields.setdefault("cached_tokens", ())
    return StartDirect(sequence_id=sequence_id, prompt_tokens=prompt, max_tokens=max_tokens, **fields)


class Driver:
    """Hands the device one plan at a time, strictly request/reply."""

    def __init__(self, to_device: trio.MemorySendChannel[RunStep]) -> None:
        self.to_device = to_device
        self.steps: list[StepResult] = []

    async def step(self, plan: StepPlan | None = None, **fields: Any) -> StepResult:
        reply_to, replies = trio.open_memory_channel[StepResult](1)
        await self.to_device.send(RunStep(plan=plan or StepPlan(**fields), reply_to=reply_to))
        with replies:
            done = await replies.receive()
        self.steps.append(done)
        return done

    async def run_until_finished(self, sequence_ids: set[int], *, max_steps: int = 60) -> dict[int, list[SampledToken]]:
        """Batch steps until every sequence in sequence_ids has finished; their sampled tokens."""
        sampled: dict[int, list[SampledToken]] = {sequence_id: [] for sequence_id in sequence_ids}
        unfinished = set(sequence_ids)
        for _ in range(max_steps):
            if not unfinished:
                return sampled
            done = await self.step(run_batch=True)
            assert done.error is None, done.error
            for token in done.sampled:
                if token.sequence_id in sampled:
                    sampled[token.sequence_id].append(token)
                if token.finish_reason is not None:
                    unfinished.discard(token.sequence_id)
        raise AssertionError(f"sequences {unfinished} did not finish in {max_steps} steps")


@contextlib.asynccontextmanager
async def running_device(inbox_size: int = 0, **settings: Any) -> AsyncIterator[tuple[Driver, ModelInfo, DeviceActor]]:
    to_device, inbox = trio.open_memory_channel[RunStep](inbox_size)
    actor = DeviceActor(DeviceSettings(model_path=fixture_path("llama"), **settings), inbox)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            info: ModelInfo = await nursery.start(actor.run)
            try:
                yield Driver(to_device), info, actor
            finally:
                to_device.close()  # run() returns: the nursery can exit (a failed assertion too)


def assert_same_tokens(ours: list[SampledToken], theirs: list[SampledToken]) -> None:
    assert [token.token for token in ours] == [token.token for token in theirs]
    for mine, other in zip(ours, theirs, strict=True):
        assert mine.logprob == pytest.approx(other.logprob, abs=1e-4)
        assert [index for index, _ in mine.top_logprobs] == [index for index, _ in other.top_logprobs]


async def test_the_device_batches_fails_a_step_and_stops_when_its_inbox_closes() -> None:
    first_prompt, second_prompt = tuple(range(1000, 1012)), tuple(range(2000, 2007))
    async with running_device(prefill_step_size=512, fail_step=FAIL_STEP) as (driver, info, actor):
        assert info.model_id == fixture_path("llama").name
        assert info.eos_token_ids == frozenset({151645})
        assert (info.context_size, info.family.model_type, info.bucket_starts) == (4096, "llama", False)

        # Two sequences in the batch, greedy, run to their max_tokens; only sequence 0 gives its KV.
        done = await driver.step(starts=(batch(0, first_prompt, 4, donate_on_finish=True), batch(1, second_prompt, 3)),
                                 run_batch=True)
        assert done.error is None
        assert done.step_number == 1
        sampled = await driver.run_until_finished({0, 1})
        assert [len(sampled[0]), len(sampled[1])] == [4, 3]
        for tokens in sampled.values():
            assert [token.finish_reason for token in tokens] == [None] * (len(tokens) - 1) + ["length"]
            assert all(0 <= token.token < 151_646 and token.logprob <= 0 for token in tokens)
        assert max(step.decode_batch_size for step in driver.steps) == 2
        num_prompt = len(first_prompt) + len(second_prompt)
        # mlx-lm may feed each prompt's last token to its first decode step instead.
        assert num_prompt - 2 <= sum(step.prefill_tokens for step in driver.steps) <= num_prompt
        detached = [item for step in driver.steps for item in step.detached]
        assert [item.sequence_id for item in detached] == [0]
        assert detached[0].tokens[: len(first_prompt)] == first_prompt
        assert detached[0].nbytes > 0
        assert actor.statistics() == DeviceStats(num_steps=len(driver.steps))

        # The injected fault fails what the step held.
        while len(driver.steps) < FAIL_STEP - 1:
            assert (await driver.step()).sampled == ()
        done = await driver.step(starts=(batch(2, second_prompt, 3),), run_batch=True)
        assert done.step_number == FAIL_STEP
        assert done.error is not None
        assert "injected fault" in done.error
        assert done.failed_sequences == (2,)

        # The next step works: a fresh sequence runs, another is removed mid-flight with its KV.
        done = await driver.step(starts=(batch(3, second_prompt, 3), batch(4, first_prompt, 50)), run_batch=True)
        assert done.error is None
        third = [token for token in done.sampled if token.sequence_id == 3]
        while not any(token.sequence_id == 4 for token in done.sampled):
            done = await driver.step(run_batch=True)
            third += [token for token in done.sampled if token.sequence_id == 3]
        done = await driver.step(removals=(Removal(sequence_id=4, donate=True),), run_batch=True)
        assert [item.sequence_id for item in done.detached] == [4]
        assert done.detached[0].tokens[: len(first_prompt)] == first_prompt
        third += [token for token in done.sampled if token.sequence_id == 3]
        if third[-1].finish_reason is None:
            third += (await driver.run_until_finished({3}))[3]
        # Greedy decoding of the same prompt gives the same tokens, batched alone or with others.
        assert [token.token for token in third] == [token.token for token in sampled[1]]
        # A plan that holds the batch back runs nothing of it.
        done = await driver.step(starts=(batch(5, second_prompt, 3),))
        assert (done.sampled, done.prefill_tokens) == ((), 0)


async def test_a_start_that_raises_fails_with_the_rest_of_its_step() -> None:
    async with running_device() as (driver, _info, _actor):
        bad = StartDirect(sequence_id=7, prompt_tokens=(5, 6), cached_tokens=(1, 2, 3, 4), adopted="not a KV payload",
                          kept=4, sampling=GREEDY, max_tokens=2)  # type: ignore[arg-type]
        done = await driver.step(starts=(direct(6, (1, 2, 3), 2), bad))
    assert done.error is not None
    assert set(done.failed_sequences) == {6, 7}


@pytest.mark.parametrize(("one_pass", "padding", "kept"), [(False, 0, 30), (True, 0, 30), (True, 16, 24)],
                         ids=["two-pass", "one-pass", "bucketed"])
async def test_a_direct_start_gives_the_batch_tokens_in_its_admitting_step(one_pass: bool, padding: int,
                                                                            kept: int) -> None:
    """A hit's new turn started directly: on its own cache, first token in the step that starts it, with
    the last token's logits from the prompt's own pass (GPU default) or a second one, and in bucketed
    shapes (part of the prefix run again, padding after the prompt)."""
    long_prompt = tuple(range(3000, 3040))
    async with running_device(prefill_step_size=16, one_pass_starts=one_pass) as (driver, _info, _actor):
        # Through the batch: several 16-token chunks, then decode.
        done = await driver.step(starts=(batch(0, long_prompt, 5, donate_on_finish=True, sampling=WITH_LOGPROBS),),
                                 run_batch=True)
        assert done.sampled == ()
        assert done.prefilling == (0,)
        batched = (await driver.run_until_finished({0}))[0]
        (final,) = [item for step in driver.steps for item in step.detached]
        assert final.final

        # Resumed from that KV at 30 tokens; the 10 left start directly.
        done = await driver.step(starts=(StartDirect(
            sequence_id=1, prompt_tokens=long_prompt[30:], cached_tokens=long_prompt[:30], adopted=final.payload,
            kept=kept, padding=padding, sampling=WITH_LOGPROBS, max_tokens=5, donate_prompt=True,
        ),))
        assert done.error is None
        assert [token.sequence_id for token in done.sampled] == [1]
        assert done.prompts_done == (1,)
        assert done.prefill_tokens == 10
        # Its prompt KV is handed out in the same step, covering the whole prompt.
        assert [(item.sequence_id, item.final, item.tokens) for item in done.detached] == [(1, False, long_prompt)]
        resumed = list(done.sampled) + (await driver.run_until_finished({1}))[1]
        assert_same_tokens(resumed, batched)
        assert [token.finish_reason for token in resumed] == [None] * 4 + ["length"]

        # One token asked for: it ends in the starting step and its KV is the final donation.
        done = await driver.step(starts=(direct(2, long_prompt[:12], 1, donate_on_finish=True),), run_batch=True)
        assert [(token.sequence_id, token.finish_reason) for token in done.sampled] == [(2, "length")]
        assert [(item.sequence_id, item.final, item.tokens) for item in done.detached] == [(2, True, long_prompt[:12])]
        assert (await driver.step(run_batch=True)).sampled == ()  # nothing left running


@pytest.mark.parametrize("bucketed", [False, True], ids=["plain", "bucketed"])
async def test_cold_starts_in_one_pass_give_what_each_gives_alone(bucketed: bool) -> None:
    """Cold direct starts of one step share a forward pass (rows padded on the right) and join the batch
    without one of their own: every sequence's tokens and logprobs are those it gets started alone."""
    prompts = [tuple(range(100 * index, 100 * index + length)) for index, length in enumerate((5, 17, 9))]
    padding = [32 - len(prompt) for prompt in prompts] if bucketed else [0, 0, 0]
    async with running_device(prefill_step_size=64, bucket_starts=bucketed) as (driver, _info, _actor):
        alone = {}
        for index, prompt in enumerate(prompts):
            done = await driver.step(starts=(direct(index, prompt, 6, sampling=WITH_LOGPROBS,
                                                    padding=padding[index]),))
            alone[index] = list(done.sampled) + (await driver.run_until_finished({index}))[index]
        done = await driver.step(starts=tuple(
            direct(10 + index, prompt, 6, sampling=WITH_LOGPROBS, padding=padding[index],
                   donate_prompt=index == 1) for index, prompt in enumerate(prompts)))
        assert done.error is None
        assert sorted(token.sequence_id for token in done.sampled) == [10, 11, 12]
        # The prompt donation of a batched row holds that row's tokens only.
        assert [(item.sequence_id, item.tokens) for item in done.detached] == [(11, prompts[1])]
        together = (await driver.run_until_finished({10, 11, 12}))
        for index in range(3):
            first = [token for token in done.sampled if token.sequence_id == 10 + index]
            tokens = first + together[10 + index]
            assert_same_tokens(tokens, alone[index])
            assert [token.finish_reason for token in tokens] == [None] * 5 + ["length"]


@pytest.mark.parametrize("bucketed", [False, True], ids=["plain", "bucketed"])
async def test_hits_that_keep_one_prefix_length_share_a_pass_and_give_what_each_gives_alone(bucketed: bool) -> None:
    """Hits of one step that keep the same length of their stored prefixes run in one forward pass (their
    prefixes copied into one buffer, new tokens padded on the right); a hit that keeps another length runs
    on its own. Each gets the tokens and logprobs it gets started alone, and donates its own prompt."""
    prefix = tuple(range(5000, 5040))
    suffixes = [tuple(range(6000 + 100 * index, 6000 + 100 * index + length))
                for index, length in enumerate((5, 9, 13, 7))]
    # The first three keep 32 of the 40 cached tokens (8 run again), the fourth keeps all 40.
    kept = [32, 32, 32, 40]
    async with running_device(prefill_step_size=64, bucket_starts=bucketed) as (driver, _info, _actor):
        done = await driver.step(starts=(direct(0, prefix, 1, donate_prompt=True),))
        (stored,) = [item.payload for item in done.detached if item.tokens == prefix]

        def hit(sequence_id: int, index: int) -> StartDirect:
            run = len(prefix) - kept[index] + len(suffixes[index])
            return StartDirect(sequence_id=sequence_id, prompt_tokens=suffixes[index], cached_tokens=prefix,
                               adopted=stored, kept=kept[index], padding=-run % 16 if bucketed else 0,
                               sampling=WITH_LOGPROBS, max_tokens=6, donate_prompt=True)

        alone = {}
        for index in range(4):
            done = await driver.step(starts=(hit(10 + index, index),))
            assert done.error is None, done.error
            alone[index] = list(done.sampled) + (await driver.run_until_finished({10 + index}))[10 + index]
        done = await driver.step(starts=tuple(hit(20 + index, index) for index in range(4)))
        assert done.error is None, done.error
        assert sorted(token.sequence_id for token in done.sampled) == [20, 21, 22, 23]
        assert sorted((item.sequence_id, item.tokens) for item in done.detached) == [
            (20 + index, prefix + suffixes[index]) for index in range(4)]
        together = await driver.run_until_finished({20, 21, 22, 23})
        for index in range(4):
            first = [token for token in done.sampled if token.sequence_id == 20 + index]
            tokens = first + together[20 + index]
            assert_same_tokens(tokens, alone[index])
            assert [token.finish_reason for token in tokens] == [None] * 5 + ["length"]
        # A donated hit's KV seeds the next turn like any stored prefix: its rows are the hit's own.
        (second,) = [item.payload for item in done.detached if item.sequence_id == 21]
        again = StartDirect(sequence_id=30, prompt_tokens=(7, 8, 9), cached_tokens=prefix + suffixes[1],
                            adopted=second, kept=len(prefix) + len(suffixes[1]), sampling=WITH_LOGPROBS,
                            max_tokens=2)
        reference = StartDirect(sequence_id=31, prompt_tokens=prefix + suffixes[1] + (7, 8, 9), cached_tokens=(),
                                sampling=WITH_LOGPROBS, max_tokens=2)
        resumed = await driver.step(starts=(again,))
        cold = await driver.step(starts=(reference,))
        assert_same_tokens(list(resumed.sampled), list(cold.sampled))
        await driver.run_until_finished({30, 31})


async def test_a_prompt_prefilled_alone_then_started_directly_gives_the_batch_tokens() -> None:
    """A long prompt on its own cache, chunk by chunk, its rest started directly (padded) from that KV;
    removed alone or after its last chunk, it gives nothing."""
    prompt = tuple(range(4000, 4045))
    async with running_device(prefill_step_size=16, bucket_starts=True) as (driver, info, _actor):
        assert info.bucket_starts
        await driver.step(starts=(batch(0, prompt, 4, sampling=WITH_LOGPROBS),), run_batch=True)
        batched = (await driver.run_until_finished({0}))[0]

        first = await driver.step(starts=(StartAlone(sequence_id=1, tokens=prompt),),
                                  alone_chunk=AloneChunk(sequence_id=1, start=0, end=16, last=False))
        assert (first.prefill_tokens, first.prefilling, first.sampled) == (16, (1,), ())
        second = await driver.step(alone_chunk=AloneChunk(sequence_id=1, start=16, end=40, last=True))
        assert (second.prefill_tokens, second.prefilling) == (24, (1,))  # the rest waits for a later step
        rest = StartDirect(sequence_id=1, prompt_tokens=prompt[40:], cached_tokens=prompt[:40], kept=40,
                           padding=11, from_alone=True, sampling=WITH_LOGPROBS, max_tokens=4, donate_prompt=True)
        third = await driver.step(alone_rest=rest)
        assert [token.sequence_id for token in third.sampled] == [1]
        assert third.prompts_done == (1,)
        assert [(item.final, item.tokens) for item in third.detached] == [(False, prompt)]
        alone = list(third.sampled) + (await driver.run_until_finished({1}))[1]
        assert_same_tokens(alone, batched)

        # Removed while alone, and after its last chunk: nothing starts, nothing is given.
        await driver.step(starts=(StartAlone(sequence_id=2, tokens=prompt), StartAlone(sequence_id=3, tokens=prompt)),
                          alone_chunk=AloneChunk(sequence_id=2, start=0, end=40, last=True))
        done = await driver.step(removals=(Removal(sequence_id=2, donate=True), Removal(sequence_id=3, donate=True)),
                                 run_batch=True)
        assert (done.sampled, done.detached, done.prompts_done) == ((), (), ())


async def test_sampling_fields_apply_per_sequence_in_the_batch_and_directly() -> None:
    """top_k, logit_bias and the penalties, through mlx-lm's sample_utils: per sequence inside one
    batch, the same whether a prompt starts in the batch or directly (its prompt the penalties' history)."""
    from mlxcel.model.sampling import make_logits_processors as _make_logits_processors, make_sampler as _make_sampler

    # Absent fields change nothing: greedy keeps the batch's shared sampler and no processors.
    assert _make_sampler(GREEDY) is None
    assert _make_logits_processors(SamplingParams()) is None
    assert _make_logits_processors(SamplingParams(temperature=0.0, top_k=5, min_p=0.5)) is None

    prompt = tuple(range(1000, 1012))
    repeating = prompt + (123695,) * 4  # the fixture's greedy pick after `prompt`
    favoured = 4242
    biased = SamplingParams(temperature=0.0, logit_bias=((favoured, 100.0),), logprobs=True)
    top_one = SamplingParams(temperature=1.0, top_k=1, seed=7, logprobs=True)
    # min_p 1 keeps only the likeliest token too.
    top_only = SamplingParams(temperature=1.0, min_p=1.0, logprobs=True)
    penalized = SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5, logprobs=True)
    async with running_device(prefill_step_size=512) as (driver, _info, _actor):
        done = await driver.step(starts=(
            batch(0, prompt, 8, sampling=SamplingParams(temperature=0.0, logprobs=True)),
            batch(1, prompt, 8, sampling=biased), direct(2, prompt, 8, sampling=biased),
            batch(3, prompt, 8, sampling=top_one), direct(4, prompt, 8, sampling=top_one),
            batch(5, prompt, 8, sampling=penalized), direct(6, prompt, 8, sampling=penalized),
            # The prompt is the penalties' first history: its own greedy pick is penalized at once.
            batch(7, repeating, 8, sampling=WITH_LOGPROBS), batch(8, repeating, 8, sampling=penalized),
            direct(9, repeating, 8, sampling=penalized), batch(10, prompt, 8, sampling=top_only),
        ), run_batch=True)
        assert done.error is None
        await driver.run_until_finished(set(range(11)))
        sampled = {sequence_id: [token for step in driver.steps for token in step.sampled
                                 if token.sequence_id == sequence_id] for sequence_id in range(11)}
        greedy = [token.token for token in sampled[0]]
    # The fixture's greedy reply repeats one token: the penalties must break that.
    assert len(greedy) == 8
    assert len(set(greedy)) == 1
    assert [token.token for token in sampled[1]] == [favoured] * 8
    assert [token.token for token in sampled[2]] == [favoured] * 8
    assert [token.token for token in sampled[3]] == greedy
    assert [token.token for token in sampled[4]] == greedy
    assert [token.token for token in sampled[10]] == greedy
    penalized_tokens = [token.token for token in sampled[5]]
    assert penalized_tokens[0] == greedy[0]
    assert len(set(penalized_tokens)) > 1
    assert_same_tokens(sampled[6], sampled[5])
    assert sampled[7][0].token == greedy[0]
    assert sampled[8][0].token != greedy[0]
    assert_same_tokens(sampled[9], sampled[8])


def test_a_grammar_at_a_dead_end_lets_only_eos_through_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    """A matcher fed a token its grammar forbids (never expected: the mask forbids it) fails; the
    sequence's next mask then allows EOS alone, so the reply stops instead of raising or hanging."""
    import mlx.core as mx
    from mlx_lm.utils import load_tokenizer

    from mlxcel.http.validation import parse_chat_request
    from mlxcel.model.grammar_masks import Grammars as _Grammars
    from mlxcel.model.sampling import make_sampling as _make_sampling

    tokenizer = load_tokenizer(fixture_path("llama"))
    eos = tokenizer.eos_token_id
    grammar = parse_chat_request({"messages": [{"role": "user", "content": "x"}],
                                  "response_format": {"type": "json_object"}}).sampling.grammar
    grammars = _Grammars(tokenizer, frozenset({eos}))
    sampler, processors = _make_sampling(SamplingParams(temperature=0.0, grammar=grammar), grammars)
    assert sampler is not None
    assert processors is not None
    logits = mx.zeros((1, 151646))
    history = mx.array([1, 2, 3])
    for processor in processors:
        logits = processor(history, logits)
    first = int(sampler(logits).item())
    assert tokenizer.decode([first]).lstrip().startswith("{")  # the grammar's opening
    with caplog.at_level("WARNING", logger="mlxcel.actors.device"):
        forbidden = tokenizer.encode("zzz")[0]  # not JSON after "{"
        for processor in processors:
            processor(mx.array([1, 2, 3, first, forbidden]), logits)
        # Greedy over flat logits would pick token 0; only EOS is left.
        assert int(sampler(mx.zeros((1, 151646))).item()) == eos
    assert any("grammar matcher failed" in record.message for record in caplog.records)


def test_a_strict_tools_grammar_constrains_a_call_once_its_marker_is_written() -> None:
    """Text is free; after `<tool_call>` every sampled token keeps the call valid, whatever the logits."""

    import jsonschema
    import mlx.core as mx
    from mlx_lm.tool_parsers import json_tools
    from mlx_lm.utils import load_tokenizer

    from mlxcel.core.tool_grammar import strict_tools_grammar
    from mlxcel.model.grammar_masks import Grammars as _Grammars
    from mlxcel.model.sampling import make_sampling as _make_sampling

    tokenizer = load_tokenizer(fixture_path("llama"))
    parameters = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                  "required": ["city", "days"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "forecast", "strict": True, "parameters": parameters}}]
    grammar = strict_tools_grammar(format_name="json_tools", tools=tools, parallel=False,
                                   start_marker="<tool_call>", end_marker="</tool_call>", special_ids={})
    grammars = _Grammars(tokenizer, frozenset({tokenizer.eos_token_id}))
    sampler, processors = _make_sampling(SamplingParams(temperature=1.0, seed=3, grammar=grammar), grammars)
    assert sampler is not None
    assert processors is not None
    history = [1, 2, 3]
    written = tokenizer.encode("Let me look. <tool_call>")
    random_logits = mx.random.normal((1, 151646), key=mx.random.key(0)) * 5
    reply: list[int] = []
    for step in range(120):
        logits = random_logits
        for processor in processors:
            logits = processor(mx.array(history), logits)
        # mlx-lm samples every sequence each step; the written text stands in for the first samples.
        sampled = int(sampler(logits).item())
        token = written[step] if step < len(written) else sampled
        if token == tokenizer.eos_token_id:
            break
        history.append(token)
        reply.append(token)
    text = tokenizer.decode(reply)
    assert text.startswith("Let me look. <tool_call>\n")
    body = text.split("<tool_call>", 1)[1].split("</tool_call>", 1)[0]
    call = json_tools.parse_tool_call(body)
    assert call["name"] == "forecast"
    jsonschema.validate(call["arguments"], parameters)


async def test_a_steps_removals_filter_the_batch_once_and_each_donor_gets_its_own_kv(monkeypatch) -> None:
    """mlx-lm copies every layer's batch cache on each filter: a wave of cancellations must not copy it per removal."""
    from mlx_lm.models.cache import BatchKVCache

    filters = []
    original = BatchKVCache.filter

    def counted(self: Any, batch_indices: Any) -> None:
        filters.append(len(batch_indices))
        original(self, batch_indices)

    prompts = {sequence: tuple(range(1000 + 100 * sequence, 1010 + 100 * sequence)) for sequence in range(4)}
    async with running_device() as (driver, _info, _actor):
        done = await driver.step(starts=tuple(batch(sequence, prompt, 40) for sequence, prompt in prompts.items()),
                                 run_batch=True)
        while len({token.sequence_id for step in driver.steps for token in step.sampled}) < 4:
            done = await driver.step(run_batch=True)
        monkeypatch.setattr(BatchKVCache, "filter", counted)
        done = await driver.step(removals=(Removal(sequence_id=0, donate=True), Removal(sequence_id=1, donate=False),
                                           Removal(sequence_id=2, donate=True)), run_batch=True)
        layers = json.loads((fixture_path("llama") / "config.json").read_text())["num_hidden_layers"]
        # One filter per layer, keeping the one row left (removing one by one filtered 3 times per layer).
        assert filters == [1] * layers
        assert [item.sequence_id for item in done.detached] == [0, 2]
        for item in done.detached:
            assert item.tokens[:10] == prompts[item.sequence_id]
        assert {token.sequence_id for token in done.sampled} == {3}



async def test_a_plan_of_disk_writes_alone_is_not_a_step() -> None:
    """An idle scheduler sends the disk tier's writes in a plan of their own: the executor never sees it."""
    from mlxcel.core.plan import DiskWrite

    async with running_device(prefill_step_size=512) as (driver, _info, actor):
        writes = (DiskWrite(payload=None, pieces=("piece",)),)  # no disk tier here: queued nowhere
        done = await driver.step(disk_writes=writes)
        assert (done.step_number, done.sampled, done.decode_batch_size) == (0, (), 0)
        assert actor.statistics() == DeviceStats(num_steps=0)
        # Beside a start they ride a real step, which counts.
        done = await driver.step(starts=(direct(0, tuple(range(1000, 1008)), 1),), disk_writes=writes)
        assert done.step_number == 1
        assert [token.sequence_id for token in done.sampled] == [0]


async def test_a_plan_sent_during_a_step_runs_when_the_step_ends_while_the_event_loop_is_busy(monkeypatch) -> None:
    """The device takes a plan already sent without a turn of the loop (busy writing many streams' tokens)."""
    import time

    from mlxcel.model.executor import StepExecutor

    started: list[float] = []
    original = StepExecutor.run_step

    def slow_first(self: Any, plan: StepPlan) -> StepResult:
        started.append(time.monotonic())
        if len(started) == 1:
            time.sleep(0.3)
        return original(self, plan)

    monkeypatch.setattr(StepExecutor, "run_step", slow_first)
    async with running_device(inbox_size=64) as (driver, _info, _actor):  # the engine's inbox is buffered too
        first_to, first_replies = trio.open_memory_channel[StepResult](1)
        second_to, second_replies = trio.open_memory_channel[StepResult](1)
        await driver.to_device.send(RunStep(plan=StepPlan(), reply_to=first_to))
        while not started:
            await trio.sleep(0.01)
        await driver.to_device.send(RunStep(plan=StepPlan(starts=(direct(0, tuple(range(1000, 1008)), 2),)),
                                            reply_to=second_to))
        await trio.testing.wait_all_tasks_blocked()  # the plan has reached the device's mailbox
        busy_from = time.monotonic()
        time.sleep(0.8)  # noqa: ASYNC251 - the loop does not run for 0.8 s, on purpose
        assert len(started) == 2
        assert started[1] < busy_from + 0.5  # it ran when the first step ended, during the busy loop
        assert (await first_replies.receive()).error is None
        second = await second_replies.receive()
        assert second.error is None
        assert [token.sequence_id for token in second.sampled] == [0]


async def test_a_steps_released_payloads_are_freed_on_the_device_thread() -> None:
    """MLX frees an array where its last reference dies: the mailbox's forwarding must not keep one on the loop."""
    import threading

    freed_on: list[str] = []

    class Payload:
        def __del__(self) -> None:
            freed_on.append(threading.current_thread().name)

    async with running_device(inbox_size=64) as (driver, _info, _actor):
        reply_to, replies = trio.open_memory_channel[StepResult](1)
        await driver.to_device.send(RunStep(plan=StepPlan(), release=(Payload(),), reply_to=reply_to))
        assert (await replies.receive()).error is None
        await trio.testing.wait_all_tasks_blocked()
        assert freed_on == ["mlxcel-device"]
