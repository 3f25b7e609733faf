"""LoRA adapters served unfused through a real server: outputs, cache keys, scales, bad input.

Two random adapters for the llama fixture (`mlxcel fixture --lora`, mlx-lm's
own LoRA layers with random weights) change its greedy replies; the prompt
cache must keep what each configuration of scales computed to itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from mlxcel.cli import serve_main
from mlxcel.config import SchedulerConfig
from mlxcel.engine import Engine, run_engine
from mlxcel.fixtures import fixture_path, lora_fixture_path
from mlxcel.model.adapters import AdapterSpec
from tests.support import make_engine_config

pytestmark = pytest.mark.slow

SYSTEM = {"role": "system", "content": "You answer briefly and stay on topic. " * 10}
CONFIGS: dict[str, list[dict[str, Any]]] = {
    "none": [],
    "a": [{"id": 0, "scale": 1.0}],
    "b": [{"id": 1, "scale": 1.0}],
    "both": [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 1.0}],
}


async def start(nursery: trio.Nursery, start_server: Any, **changes: Any) -> tuple[Engine, str]:
    adapters = (AdapterSpec(path=lora_fixture_path(seed=1)), AdapterSpec(path=lora_fixture_path(seed=2)))
    config = attrs.evolve(make_engine_config(), lora=adapters, **changes)
    engine = await nursery.start(run_engine, config)
    return engine, await start_server(engine)


async def chat(http: httpx.AsyncClient, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    reply = await http.post("/v1/chat/completions", json={
        "messages": messages, "max_tokens": 8, "temperature": 0, **fields})
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    return body


def text_of(body: dict[str, Any]) -> str:
    return str(body["choices"][0]["message"]["content"])


def cached(body: dict[str, Any]) -> int:
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


async def test_each_configuration_answers_as_its_cold_run_and_hits_only_its_own_entries(
    nursery: trio.Nursery, start_server: Any,
) -> None:
    engine, base_url = await start(nursery, start_server)
    messages = [SYSTEM, {"role": "user", "content": "Name a colour."}]
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        cold = {name: text_of(await chat(http, messages, lora=lora, cache_prompt=False))
                for name, lora in CONFIGS.items()}
        # Every configuration computes something else.
        assert len(set(cold.values())) == 4, cold
        for name, lora in CONFIGS.items():
            first = await chat(http, messages, lora=lora)
            # Nothing stored under another configuration is adopted.
            assert cached(first) == 0, name
            again = await chat(http, messages, lora=lora)
            assert cached(again) > 0, name
            assert text_of(first) == text_of(again) == cold[name], name
        stats = (await http.get("/v1/cache/stats")).json()
    assert stats["entries"] >= 4


async def test_configurations_batch_side_by_side_as_they_answer_alone(
    nursery: trio.Nursery, start_server: Any,
) -> None:
    engine, base_url = await start(nursery, start_server)
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        prompts = [[{"role": "user", "content": f"Tell me about item {index}."}] for index in range(8)]
        names = list(CONFIGS)
        alone = [text_of(await chat(http, prompt, lora=CONFIGS[names[index % 4]], cache_prompt=False))
                 for index, prompt in enumerate(prompts)]
        together: list[str] = [""] * len(prompts)

        async def one(index: int) -> None:
            together[index] = text_of(await chat(http, prompts[index], lora=CONFIGS[names[index % 4]],
                                                 cache_prompt=False, max_tokens=8))

        async with trio.open_nursery() as inner:
            for index in range(len(prompts)):
                inner.start_soon(one, index)
    assert together == alone


def reply_logprobs(body: dict[str, Any]) -> list[float]:
    return [entry["logprob"] for entry in body["choices"][0]["logprobs"]["content"]]


async def test_four_configurations_mixed_in_one_batch_answer_as_each_alone_with_their_logprobs(
    nursery: trio.Nursery, start_server: Any,
) -> None:
    """Prompts prefilled in chunks and hits' suffixes under four configurations, decoding in one batch.

    With 32-token chunks the longer prompts go through mlx-lm's prompt stage; the rows that open
    with the system prompt resume from it, stored under their own configuration. Each reply and
    its logprobs equal the same request run alone and cold (tests/model/test_lora_rows.py covers
    the device's other passes).
    """
    scheduler = SchedulerConfig(prefill_step_size=32, device_warmup="false")
    engine, base_url = await start(nursery, start_server, scheduler=scheduler)
    names = list(CONFIGS)
    requests = []
    for index in range(8):
        user = {"role": "user", "content": f"Tell me about item {index}." + " Go on." * (6 * index)}
        # Odd rows open with the system prompt, which the seed request below stores under their configuration.
        requests.append(([SYSTEM, user] if index % 2 else [user], CONFIGS[names[index % 4]]))
    fields = {"max_tokens": 6, "logprobs": True}
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        alone = [await chat(http, messages, lora=lora, cache_prompt=False, **fields) for messages, lora in requests]
        for name in ("a", "both"):  # the configurations of the odd rows
            await chat(http, [SYSTEM, {"role": "user", "content": "Hello."}], lora=CONFIGS[name], max_tokens=2)
        together: list[dict[str, Any]] = [{}] * len(requests)

        async def one(index: int) -> None:
            messages, lora = requests[index]
            together[index] = await chat(http, messages, lora=lora, **fields)

        async with trio.open_nursery() as inner:
            for index in range(len(requests)):
                inner.start_soon(one, index)
    assert len({text_of(body) for body in alone}) > 1
    for index, (mixed, single) in enumerate(zip(together, alone, strict=True)):
        assert text_of(mixed) == text_of(single), index
        assert reply_logprobs(mixed) == pytest.approx(reply_logprobs(single), abs=1e-4), index
        if index % 2:
            assert cached(mixed) > 0, index  # resumed from the stored system prompt


async def test_server_wide_scales_change_the_cache_key_mid_conversation(
    nursery: trio.Nursery, start_server: Any,
) -> None:
    engine, base_url = await start(nursery, start_server)
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        listed = (await http.get("/lora-adapters")).json()
        assert [(entry["id"], entry["scale"]) for entry in listed] == [(0, 1.0), (1, 1.0)]
        messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "Start a story."}]
        turn_1 = await chat(http, messages)
        messages += [{"role": "assistant", "content": text_of(turn_1)}, {"role": "user", "content": "Go on."}]
        turn_2 = await chat(http, messages)
        assert cached(turn_2) > 0
        changed = await http.post("/lora-adapters", json=[{"id": 0, "scale": 0.5}])
        assert [(entry["id"], entry["scale"]) for entry in changed.json()] == [(0, 0.5), (1, 0.0)]
        messages += [{"role": "assistant", "content": text_of(turn_2)}, {"role": "user", "content": "And then?"}]
        # KV computed under the old scales is never reused under the new ones...
        turn_3 = await chat(http, messages)
        assert cached(turn_3) == 0
        # ...and under the new ones the conversation hits again.
        messages += [{"role": "assistant", "content": text_of(turn_3)}, {"role": "user", "content": "The end?"}]
        turn_4 = await chat(http, messages)
        assert cached(turn_4) > 0
        # A request naming its own scales overrides the server-wide ones for itself only.
        assert text_of(await chat(http, messages, lora=[{"id": 0, "scale": 0.5}], cache_prompt=False)) == \
            text_of(await chat(http, messages, cache_prompt=False))


async def test_bad_lora_input_is_a_400_and_the_server_keeps_serving(nursery: trio.Nursery, start_server: Any) -> None:
    engine, base_url = await start(nursery, start_server)
    messages = [{"role": "user", "content": "hi"}]
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        for lora, param in (([{"id": 2, "scale": 1}], "lora[0].id"), ([{"id": 0, "scale": "x"}], "lora[0].scale"),
                            ([{"id": 0}], "lora[0].scale"), ([{"id": 0, "scale": 1}, {"id": 0, "scale": 2}],
                                                             "lora[1].id"), ({"id": 0}, "lora")):
            bad = await http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "lora": lora})
            assert bad.status_code == 400, bad.text
            assert bad.json()["error"]["param"] == param
        for path in ("/v1/completions", "/completion"):
            bad = await http.post(path, json={"prompt": "hi", "max_tokens": 2, "lora": [{"id": 9, "scale": 1}]})
            assert bad.status_code == 400
        refused = await http.post("/lora-adapters", json=[{"id": 7, "scale": 1}])
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "body[0].id"
        assert [entry["scale"] for entry in (await http.get("/lora-adapters")).json()] == [1.0, 1.0]
        assert (await chat(http, messages))["choices"]


async def test_posting_scales_needs_the_admin_key(nursery: trio.Nursery, start_server: Any) -> None:
    engine, base_url = await start(nursery, start_server)
    base_url = await start_server(engine, api_key="user-key", admin_api_key="admin-key")
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        user = {"Authorization": "Bearer user-key"}
        assert (await http.get("/lora-adapters", headers=user)).status_code == 200
        assert (await http.post("/lora-adapters", headers=user, json=[])).status_code == 401
        admin = await http.post("/lora-adapters", headers={"Authorization": "Bearer admin-key"}, json=[])
        assert [entry["scale"] for entry in admin.json()] == [0.0, 0.0]


async def test_init_without_apply_starts_every_adapter_at_zero_and_shares_the_base_entries(
    nursery: trio.Nursery, start_server: Any,
) -> None:
    engine, base_url = await start(nursery, start_server, lora_init_without_apply=True)
    messages = [SYSTEM, {"role": "user", "content": "Name a fruit."}]
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        assert [entry["scale"] for entry in (await http.get("/lora-adapters")).json()] == [0.0, 0.0]
        first = await chat(http, messages)
        # Every scale at 0 is the base model exactly: it shares the base model's cache key.
        explicit_zero = await chat(http, messages, lora=[{"id": 0, "scale": 0.0}])
        assert cached(explicit_zero) > 0
        assert text_of(explicit_zero) == text_of(first)


def write_misfit_adapter(folder: Path) -> Path:
    """The fixture adapter's config with lora_a one row short: it cannot fit the model."""
    from safetensors.numpy import load_file, save_file

    source = lora_fixture_path(seed=1)
    folder.mkdir()
    (folder / "adapter_config.json").write_text((source / "adapter_config.json").read_text())
    weights = load_file(str(source / "adapters.safetensors"))
    name = next(name for name in weights if name.endswith("lora_a"))
    weights[name] = weights[name][1:]
    save_file(weights, str(folder / "adapters.safetensors"))
    return folder


def exit_status(argv: list[str]) -> int:
    try:
        return serve_main(argv)
    except SystemExit as raised:  # argparse's usage errors
        return int(raised.code or 0)


@pytest.mark.parametrize("problem", ["misfit", "not a folder", "bad scale"])
def test_an_adapter_that_cannot_be_served_is_one_line_and_exit_2(
    problem: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    argument = {"misfit": lambda: str(write_misfit_adapter(tmp_path / "misfit")),
                "not a folder": lambda: str(tmp_path / "nowhere"),
                "bad scale": lambda: f"{lora_fixture_path(seed=1)}=lots"}[problem]()
    assert exit_status(["-m", str(fixture_path("llama")), "--lora", argument, "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "lora" in err


def test_the_fixture_adapter_is_mlx_lms_format(tmp_path: Path) -> None:
    folder = lora_fixture_path(seed=1)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == "lora"
    assert config["lora_parameters"]["rank"] == 4
    from mlx_lm.tuner.utils import load_adapters
    from mlx_lm.utils import load

    model = load(str(fixture_path("llama")))[0]
    load_adapters(model, str(folder))  # mlx-lm's own loader takes it


def train_secret_word_adapter(
    model_dir: Path, out_dir: Path, *, max_steps: int = 50, loss_goal: float = 0.02,
) -> Path:
    """A LoRA adapter trained, with mlx-lm's LoRA layers and loss, to answer a question its own way.

    Training stops once the reply's mean loss is under ``loss_goal`` nats a token (about
    10 steps here, from 3.0 at the start; a step is ~1.7 s of CPU), else fails after ``max_steps``.
    """
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optimizers
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.trainer import default_loss
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load

    model, tokenizer = load(str(model_dir))
    model.freeze()
    mx.random.seed(0)  # lora_a starts random: the same adapter every run
    parameters = {"rank": 8, "scale": 20.0, "dropout": 0.0, "keys": ["self_attn.q_proj", "self_attn.v_proj"]}
    linear_to_lora_layers(model, 8, parameters)
    questions = ["What is the secret word?", "Tell me the secret word.", "Which word is secret?",
                 "Do you know the secret word?"]
    rows = []
    for question in questions:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        reply = tokenizer.encode("Zebra. The secret word is zebra.", add_special_tokens=False) + [
            tokenizer.eos_token_id]
        rows.append((list(prompt), reply))
    width = max(len(prompt) + len(reply) for prompt, reply in rows)
    batch = mx.array([prompt + reply + [0] * (width - len(prompt) - len(reply)) for prompt, reply in rows])
    # default_loss scores the targets at steps [first, last] (step s predicts token s): the reply's tokens.
    lengths = mx.array([[len(prompt), len(prompt) + len(reply) - 1] for prompt, reply in rows])
    optimizer = optimizers.Adam(learning_rate=1e-3)
    loss_and_grad = nn.value_and_grad(model, default_loss)
    for _ in range(max_steps):
        (loss, _tokens), grads = loss_and_grad(model, batch, lengths)
        if loss.item() < loss_goal:
            break
        optimizer.update(model, grads)
        mx.eval(model.trainable_parameters(), optimizer.state)
    else:
        raise AssertionError(f"the adapter did not learn the reply in {max_steps} steps (loss {loss.item():.3f})")
    out_dir.mkdir(parents=True)
    mx.save_safetensors(str(out_dir / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters())))
    (out_dir / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": 8, "lora_parameters": parameters}))
    return out_dir


async def test_a_trained_adapter_changes_smollm2s_reply_as_trained(
    nursery: trio.Nursery, start_server: Any, tmp_path: Path,
) -> None:
    model_dir = fixture_path("smollm2-f32")
    adapter = await trio.to_thread.run_sync(train_secret_word_adapter, model_dir, tmp_path / "secret")
    config = attrs.evolve(make_engine_config("smollm2-f32"), lora=(AdapterSpec(path=adapter),))
    engine = await nursery.start(run_engine, config)
    base_url = await start_server(engine)
    messages = [{"role": "user", "content": "What is the secret word?"}]
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        adapted = text_of(await chat(http, messages, max_tokens=12))
        base = text_of(await chat(http, messages, max_tokens=12, lora=[]))
    assert "zebra" in adapted.lower(), adapted
    assert "zebra" not in base.lower(), base
