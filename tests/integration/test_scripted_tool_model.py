"""A real weights file that always answers with one tool call, served by mlxcel and by `mlx_lm.server` side by side.

The "scripted" llama: its greedy next token depends only on the current one.
Attention and MLP write nothing back (o_proj and down_proj are zero), so the
residual stream at the last layer is the token's own embedding; the chain's
tokens have orthonormal embedding rows, and lm_head row ``next(t)`` is ``t``'s
embedding scaled up (RMSNorm only rescales a unit row by sqrt(hidden)), every
other row zero. The chain starts at the ``\\n`` ending ``<|im_start|>assistant\\n``
and spells ``<tool_call>{json}</tool_call><|im_end|>``. Every token in it has one
successor, hence the JSON's odd spacing (no token repeats) and no newline
after ``<tool_call>``. ``<tool_call>`` and ``</tool_call>`` are added tokens, as
in Qwen2.5 (ids right after ``<|im_end|>``: the tokenizers library renumbers
added tokens whose ids leave a gap).

Both servers get the same requests through the openai SDK, with and without
streaming, and must give the same reply structure.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httpx
import numpy as np
import openai
import pytest
import trio

from mlxcel.engine import run_engine
from mlxcel.fixtures import SPECIAL_TOKENS, fixture_path
from tests.integration.test_tool_calls import TOOL_TEMPLATE
from tests.support import make_engine_config

pytestmark = pytest.mark.slow

TOOL_CALL_TOKENS = {"<tool_call>": 151646, "</tool_call>": 151647}
# No token repeats in this spelling (checked in `write_scripted_tool_model`).
CALL_JSON = '{"name":"get_weather","arguments":{"city": "Paris"}}'
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
PROMPT_TOKENS = 79  # MESSAGES and TOOLS through TOOL_TEMPLATE


def write_scripted_tool_model(folder: Path) -> list[int]:
    """Write the scripted llama into the new `folder`; returns its token chain."""
    import mlx.core as mx
    from tokenizers import Tokenizer

    source = fixture_path("llama")
    folder.mkdir(parents=True)
    tokenizer_json = json.loads((source / "tokenizer.json").read_text())
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    for content, token in TOOL_CALL_TOKENS.items():
        entry = {"content": content, "single_word": False, "lstrip": False, "rstrip": False,
                 "normalized": False, "special": False}
        tokenizer_json["added_tokens"].append({"id": token, **entry})
        tokenizer_config["added_tokens_decoder"][str(token)] = entry
    tokenizer_config["chat_template"] = TOOL_TEMPLATE
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    encode = partial(tokenizer.encode, add_special_tokens=False)
    assert encode("<tool_call>x</tool_call>").ids == [TOOL_CALL_TOKENS["<tool_call>"], 87,
                                                      TOOL_CALL_TOKENS["</tool_call>"]]
    chain = [*encode("\n").ids, *encode(f"<tool_call>{CALL_JSON}</tool_call>").ids, SPECIAL_TOKENS["<|im_end|>"]]
    assert len(set(chain)) == len(chain), "a token with two successors"

    config = json.loads((source / "config.json").read_text())
    hidden, intermediate, vocab = config["hidden_size"], config["intermediate_size"], 151680
    assert len(chain) <= hidden
    config.update(vocab_size=vocab, tie_word_embeddings=False, num_hidden_layers=1)
    (folder / "config.json").write_text(json.dumps(config))

    rng = np.random.default_rng(0)
    embed = (rng.standard_normal((vocab, hidden)) * 0.01).astype(np.float32)
    orthonormal, _ = np.linalg.qr(rng.standard_normal((hidden, hidden)))
    embed[chain] = orthonormal.T[: len(chain)]
    lm_head = np.zeros((vocab, hidden), np.float32)
    lm_head[chain[1:]] = 50.0 * embed[chain[:-1]]

    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]

    def small(*shape: int) -> mx.array:
        return mx.array((rng.standard_normal(shape) * 0.02).astype(np.float32))

    layer = "model.layers.0."
    weights = {
        "model.embed_tokens.weight": mx.array(embed),
        "lm_head.weight": mx.array(lm_head),
        "model.norm.weight": mx.ones((hidden,)),
        layer + "input_layernorm.weight": mx.ones((hidden,)),
        layer + "post_attention_layernorm.weight": mx.ones((hidden,)),
        layer + "self_attn.q_proj.weight": small(heads * head_dim, hidden),
        layer + "self_attn.k_proj.weight": small(kv_heads * head_dim, hidden),
        layer + "self_attn.v_proj.weight": small(kv_heads * head_dim, hidden),
        layer + "self_attn.o_proj.weight": mx.zeros((hidden, heads * head_dim)),
        layer + "mlp.gate_proj.weight": small(intermediate, hidden),
        layer + "mlp.up_proj.weight": small(intermediate, hidden),
        layer + "mlp.down_proj.weight": mx.zeros((hidden, intermediate)),
    }
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    return chain


@pytest.fixture(scope="module")
def scripted_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("scripted") / "scripted-tool-llama"
    write_scripted_tool_model(folder)
    return folder


@pytest.fixture(scope="module")
def mlx_lm_server(scripted_model: Path) -> Iterator[str]:
    """Base URL of `python -m mlx_lm server` serving the scripted model."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = scripted_model.parent / "mlx_lm_server.log"
    with log.open("wb") as stderr:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(
            [sys.executable, "-m", "mlx_lm", "server", "--model", str(scripted_model), "--host", "127.0.0.1",
             "--port", str(port), "--temp", "0", "--log-level", "WARNING"],
            stdout=subprocess.DEVNULL, stderr=stderr, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, log.read_text()
            try:
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "mlx_lm.server did not answer in 60 s"
            time.sleep(0.2)
        yield base_url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def reply_shape(client: openai.OpenAI, model: str, *, stream: bool) -> dict[str, Any]:
    """The parts of a chat reply that both servers must agree on, with `stream` or not."""
    request = {"model": model, "messages": MESSAGES, "tools": TOOLS, "temperature": 0, "max_tokens": 40}
    if not stream:
        reply = client.chat.completions.create(**request)
        choice = reply.choices[0]
        calls = [(call.type, call.function.name, json.loads(call.function.arguments), bool(call.id))
                 for call in choice.message.tool_calls or []]
        # Same rendering, same prompt. (completion_tokens differs: mlx_lm.server counts the EOS token.)
        assert reply.usage is not None
        assert reply.usage.prompt_tokens == PROMPT_TOKENS
        return {"finish_reason": choice.finish_reason, "content": choice.message.content or None, "tool_calls": calls}
    content, finish_reason = "", None
    calls: dict[int, dict[str, Any]] = {}
    with client.chat.completions.create(**request, stream=True) as chunks:
        for chunk in chunks:
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"type": None, "name": "", "arguments": "", "id": False})
                call["type"] = delta.type or call["type"]
                call["id"] = call["id"] or bool(delta.id)
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
            finish_reason = choice.finish_reason or finish_reason
    return {"finish_reason": finish_reason, "content": content or None,
            "tool_calls": [(call["type"], call["name"], json.loads(call["arguments"]), call["id"])
                           for _, call in sorted(calls.items())]}


async def test_mlxcel_and_mlx_lm_server_reply_with_the_same_tool_call(
    nursery: trio.Nursery, start_server: Any, scripted_model: Path, mlx_lm_server: str,
) -> None:
    engine = await nursery.start(run_engine, attrs.evolve(make_engine_config(), model_path=scripted_model))
    mlxcel_url = await start_server(engine)
    expected = {"finish_reason": "tool_calls", "content": None,
                "tool_calls": [("function", "get_weather", {"city": "Paris"}, True)]}
    clients = {"mlxcel": (f"{mlxcel_url}/v1", engine.model_id), "mlx_lm": (f"{mlx_lm_server}/v1", "default_model")}
    shapes = {}
    for server, (base_url, model) in clients.items():
        with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60) as client:
            for stream in (False, True):
                shapes[server, stream] = await trio.to_thread.run_sync(
                    partial(reply_shape, client, model, stream=stream))
    for key, shape in shapes.items():
        assert shape == expected, (key, shape)
