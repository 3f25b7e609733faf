"""Per-row LoRA scales: one mlx-lm BatchGenerator for every adapter configuration, each row as if alone.

The llama fixture (float32) with the two random fixture adapters; rows
under four configurations (none, A, B, A+B at other scales) share one batch
through mlx-lm's prompt stage and decode. Each row's greedy tokens and
logprobs must be what it computes alone, and each step runs one forward
pass whatever the mix.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator

from mlxcel.core.plan import Capabilities, StartDirect, StepPlan
from mlxcel.core.scheduler import NewRequest, SchedulerCore
from mlxcel.fixtures import fixture_path, lora_fixture_path
from mlxcel.model.adapter_batches import AdapterBatches
from mlxcel.model.adapters import AdapterSpec
from mlxcel.model.executor import DeviceSettings, StepExecutor
from mlxcel.model.loader import LoadedModel, load_model
from mlxcel.model.lora import Config, LoadedAdapters, load_adapters
from mlxcel.types import Delta, SamplingParams
from tests.support import Recorder

pytestmark = pytest.mark.slow

# none; A; B; A at 0.5 with B at -0.7 (a negative scale too).
CONFIGS: list[Config] = [(), (1.0, 0.0), (0.0, 1.0), (0.5, -0.7)]
MAX_TOKENS = 6
# Tokens per mlx-lm prefill chunk: the longer prompts take several, through its prompt stage.
PREFILL_STEP = 8


class CountingModel:
    """The model, counting its forward passes."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.model(*args, **kwargs)


@pytest.fixture(scope="module")
def adapted_model() -> tuple[LoadedModel, LoadedAdapters]:
    loaded = load_model(fixture_path("llama"))
    specs = [AdapterSpec(path=lora_fixture_path(seed=1)), AdapterSpec(path=lora_fixture_path(seed=2))]
    return loaded, load_adapters(loaded.model, specs)


@pytest.fixture(scope="module")
def adapted(adapted_model: tuple[LoadedModel, LoadedAdapters]) -> tuple[Any, LoadedAdapters]:
    loaded, adapters = adapted_model
    return loaded.model, adapters


def prompts() -> list[list[int]]:
    # Different lengths (some over a prefill chunk), so rows are padded and finish prefilling apart.
    return [[100 + 37 * row + step for step in range(5 + 3 * row)] for row in range(8)]


def generate(model: Any, adapters: LoadedAdapters, rows: list[tuple[list[int], Config]],
             ) -> tuple[list[list[tuple[int, Any]]], list[int]]:
    """Each row's (token, logprobs) to MAX_TOKENS, greedy, and the forward passes of each decode-only step."""
    counting = CountingModel(model)
    batches = AdapterBatches(
        lambda batched: BatchGenerator(batched, stop_tokens=[], prefill_step_size=PREFILL_STEP,
                                       prefill_batch_size=len(rows), completion_batch_size=len(rows)),
        counting, adapters)
    uids = [batches.insert([prompt], config=config, max_tokens=[MAX_TOKENS])[0] for prompt, config in rows]
    produced: dict[int, list[tuple[int, Any]]] = {uid: [] for uid in uids}
    decode_passes: list[int] = []
    try:
        while any(len(tokens) < MAX_TOKENS for tokens in produced.values()):
            before = counting.calls
            prompt_responses, generation_responses = batches.next()
            if not prompt_responses:
                decode_passes.append(counting.calls - before)
            for response in generation_responses:
                produced[response.uid].append((response.token, response.logprobs))
    finally:
        batches.close()
    return [produced[uid] for uid in uids], decode_passes


def test_rows_under_four_configurations_in_one_batch_match_each_row_alone(
    adapted: tuple[Any, LoadedAdapters],
) -> None:
    model, adapters = adapted
    rows = [(prompt, CONFIGS[index % len(CONFIGS)]) for index, prompt in enumerate(prompts())]
    together, decode_passes = generate(model, adapters, rows)
    alone = [generate(model, adapters, [row])[0][0] for row in rows]
    for index, (mixed, single) in enumerate(zip(together, alone, strict=True)):
        assert [token for token, _ in mixed] == [token for token, _ in single], index
        # The first token's whole distribution, then each chosen token's logprob.
        first = mx.abs(mixed[0][1] - single[0][1]).max().item()
        assert first < 1e-4, (index, first)
        for (token, mixed_logprobs), (_, single_logprobs) in zip(mixed, single, strict=True):
            assert abs(mixed_logprobs[token].item() - single_logprobs[token].item()) < 1e-4, index
    # Every configuration computes something else, so the comparison above is not vacuous.
    firsts = [together[index][0][1] for index in range(len(CONFIGS))]
    for one in range(len(CONFIGS)):
        for other in range(one + 1, len(CONFIGS)):
            assert mx.abs(firsts[one] - firsts[other]).max().item() > 1e-2, (one, other)
    # The mixed batch decodes in one forward pass a step.
    assert decode_passes
    assert set(decode_passes) == {1}, decode_passes


def test_the_scales_follow_the_batch_as_rows_finish_and_join(adapted: tuple[Any, LoadedAdapters]) -> None:
    """A row removed mid-decode and one inserted late leave every other row's tokens as they were alone."""
    model, adapters = adapted
    rows = [(prompt, CONFIGS[index % len(CONFIGS)]) for index, prompt in enumerate(prompts()[:5])]
    alone = [[token for token, _ in generate(model, adapters, [row])[0][0]] for row in rows]
    batches = AdapterBatches(
        lambda batched: BatchGenerator(batched, stop_tokens=[], prefill_step_size=PREFILL_STEP),
        model, adapters)
    try:
        uids = [batches.insert([prompt], config=config, max_tokens=[MAX_TOKENS])[0] for prompt, config in rows[:4]]
        produced: dict[int, list[int]] = {uid: [] for uid in uids}
        late = None
        while any(len(produced[uid]) < MAX_TOKENS for uid in produced if uid != uids[1]):
            _prompts, generated = batches.next()
            for response in generated:
                produced[response.uid].append(response.token)
            if len(produced[uids[0]]) == 2 and late is None:
                batches.remove([uids[1]])  # the second row leaves mid-decode
                late = batches.insert([rows[4][0]], config=rows[4][1], max_tokens=[MAX_TOKENS])[0]
                produced[late] = []
    finally:
        batches.close()
    assert late is not None
    for index, uid in ((0, uids[0]), (2, uids[2]), (3, uids[3]), (4, late)):
        assert produced[uid] == alone[index], index


def test_a_pass_with_scales_for_other_rows_is_refused(adapted: tuple[Any, LoadedAdapters]) -> None:
    model, adapters = adapted
    adapters.set_rows([(1.0, 0.0), ()])
    try:
        with pytest.raises(ValueError, match="set for 2 rows"):
            model(mx.array([[1, 2, 3]]))
        adapters.set_rows([()])
        mx.eval(model(mx.array([[1, 2, 3]])))  # every adapter off for every row: the base model's pass
    finally:
        adapters.set_rows([])


# The executor's paths: 512-token chunks; a 600-token prompt takes two (mlx-lm's prompt stage, or
# prefilled alone with bucketed starts).
STEP = 512


def run_plans(loaded: LoadedModel, adapters: LoadedAdapters, requests: list[tuple[tuple[int, ...], Config]],
              *, buckets: bool) -> tuple[dict[str, list[Delta]], list[StepPlan]]:
    """Run ``requests`` to the end through a scheduling core and the device's executor, as the engine does."""
    settings = DeviceSettings(model_path=fixture_path("llama"), context_size=4096, prefill_step_size=STEP,
                              bucket_starts=buckets, one_pass_starts=False)
    executor = StepExecutor(loaded.model, loaded.eos_token_ids, settings, "llama", tokenizer=loaded.tokenizer,
                            adapters=adapters)
    assert executor.bucket_starts is buckets
    core = SchedulerCore(Capabilities(prefill_step_size=STEP, context_size=4096, bucket_starts=buckets),
                         tokenizer=loaded.tokenizer, eos_token_ids=frozenset(loaded.eos_token_ids))
    clients = Recorder()
    for index, (prompt, config) in enumerate(requests):
        sampling = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5, adapter_scales=config)
        core.add(NewRequest(request_id=f"r{index}", prompt_tokens=prompt, max_tokens=MAX_TOKENS, sampling=sampling,
                            cache_context=None), clients)
    plans = []
    for _ in range(200):
        if not core.has_work():
            break
        assert core.next_lookup(0.0) is None  # no cache context: nothing to look up
        plan = core.schedule()
        plans.append(plan)
        core.update(plan, executor.run_step(plan), clients, 0.0)
    assert not core.has_work()
    return clients.deltas, plans


def reference(model: Any, adapters: LoadedAdapters, prompt: tuple[int, ...], config: Config,
              eos_token_ids: frozenset[int]) -> list[tuple[int, Any]]:
    """The request alone in its plainest form: one row, one cache, the prompt in one pass, greedy."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    produced: list[tuple[int, Any]] = []
    try:
        adapters.set_rows([config])
        # The llama body alone fills the cache: the vocabulary's logits of the last token only.
        model.model(mx.array([list(prompt[:-1])]), cache=cache)
        inputs = mx.array([list(prompt[-1:])])
        while len(produced) < MAX_TOKENS:
            adapters.set_rows([config])
            logits = model(inputs, cache=cache)[0, -1]
            logprobs = logits - mx.logsumexp(logits)
            token = int(mx.argmax(logprobs).item())
            if token in eos_token_ids:
                break
            produced.append((token, logprobs))
            inputs = mx.array([[token]])
    finally:
        adapters.set_rows([])
    return produced


@pytest.mark.parametrize("buckets", [False, True])
def test_the_executors_passes_mix_configurations_and_match_each_request_alone(
    adapted_model: tuple[LoadedModel, LoadedAdapters], buckets: bool,
) -> None:
    """A batched cold start over four configurations, long prompts in chunks, then decode, all mixed."""
    loaded, adapters = adapted_model
    requests = [(tuple(200 + 11 * index + step for step in range(600 if index in (3, 6) else 6 + 2 * index)),
                 CONFIGS[index % len(CONFIGS)]) for index in range(8)]
    together, plans = run_plans(loaded, adapters, requests, buckets=buckets)
    # The short prompts started cold in one plan, so in one batched pass, under several configurations.
    cold = [start for start in plans[0].starts if isinstance(start, StartDirect) and start.kept == 0]
    assert len({start.sampling.adapter_scales for start in cold}) >= 3, plans[0]
    if buckets:
        assert any(plan.alone_chunk is not None for plan in plans)
    eos = frozenset(loaded.eos_token_ids)
    for index, (prompt, config) in enumerate(requests):
        expected = reference(loaded.model, adapters, prompt, config, eos)
        entries = [entry for delta in together[f"r{index}"] for entry in delta.logprobs]
        assert [entry.token_id for entry in entries] == [token for token, _ in expected], index
        assert entries, index
        for entry, (token, logprobs) in zip(entries, expected, strict=True):
            assert entry.logprob == pytest.approx(logprobs[token].item(), abs=1e-4), index
            assert [value for _text, value in entry.top] == pytest.approx(
                [logprobs[top_id].item() for top_id in entry.top_ids], abs=1e-4), index
