"""The real SmolLM2 (float32 fixture) on an edit workload: greedy replies identical with and without speculation.

The device's executor under a scheduling core on this thread, as
benchmarks/speculative.py runs it (there on the full 2k-token file): two
streams copy a short file back with one name changed, and must produce the
same tokens and logprobs with ``--speculative ngram`` as without, having
accepted proposals.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from mlxcel.core.plan import Capabilities
from mlxcel.core.scheduler import NewRequest, SchedulerCore
from mlxcel.fixtures import fixture_path
from mlxcel.model.executor import DeviceSettings, StepExecutor
from mlxcel.model.loader import load_model
from mlxcel.types import Delta, SamplingParams
from tests.support import Recorder

pytestmark = pytest.mark.slow

FILE = """def total_price(items, tax):
    total = 0
    for item in items:
        total = total + item.price * item.count
    return total * (1 + tax)


def total_weight(items):
    total = 0
    for item in items:
        total = total + item.weight
    return total
"""


def run(loaded: Any, prompts: list[tuple[int, ...]], speculative: str) -> tuple[dict[str, list[Delta]], Any]:
    path = fixture_path("smollm2-f32")
    settings = DeviceSettings(model_path=path, context_size=4096, prefill_step_size=256,
                              speculative=speculative, speculative_tokens=4)
    executor = StepExecutor(loaded.model, loaded.eos_token_ids, settings, loaded.family.model_type,
                            tokenizer=loaded.tokenizer)
    core = SchedulerCore(Capabilities(prefill_step_size=256, context_size=4096), tokenizer=loaded.tokenizer,
                         eos_token_ids=frozenset(loaded.eos_token_ids))
    clients = Recorder()
    for index, prompt in enumerate(prompts):
        core.add(NewRequest(request_id=f"r{index}", prompt_tokens=prompt, max_tokens=80,
                            sampling=SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3),
                            cache_context=None), clients)
    for _ in range(400):
        if not core.has_work():
            break
        assert core.next_lookup(0.0) is None
        plan = core.schedule()
        core.update(plan, executor.run_step(plan), clients, 0.0)
    assert not core.has_work()
    return clients.deltas, executor.speculation_stats


def test_an_edit_is_identical_with_speculation() -> None:
    loaded = load_model(fixture_path("smollm2-f32"))
    prompts = []
    for name in ("amount", "result"):
        text = (f"Here is a Python file.\n\n```python\n{FILE}```\n\nRewrite the whole file, unchanged except that "
                f"the variable `total` is renamed to `{name}`. Reply with the file only.")
        chat = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
        prompts.append(tuple(loaded.tokenizer.encode(chat, add_special_tokens=False)))
    plain, _ = run(loaded, prompts, "off")
    spoken, stats = run(loaded, prompts, "ngram")
    assert stats.accepted_tokens > 20
    for request_id, deltas in plain.items():
        assert [t for d in spoken[request_id] for t in d.token_ids] == [t for d in deltas for t in d.token_ids]
        assert "".join(d.text for d in spoken[request_id]) == "".join(d.text for d in deltas)
        assert spoken[request_id][-1].finish_reason == deltas[-1].finish_reason
        ours = np.array([lp.logprob for d in spoken[request_id] for lp in d.logprobs])
        theirs = np.array([lp.logprob for d in deltas for lp in d.logprobs])
        np.testing.assert_allclose(ours, theirs, atol=2e-4)
