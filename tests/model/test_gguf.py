"""The GGUF conversion: SmolLM2-135M-Instruct's Q4_1 file as an MLX model folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from mlxcel import fixtures
from mlxcel.cli import fixture_main
from mlxcel.model.gguf import gguf_to_mlx_name

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("gguf", "mlx"), [
    ("blk.7.attn_q.scales", "model.layers.7.self_attn.q_proj.scales"),
    ("blk.0.attn_output.weight", "model.layers.0.self_attn.o_proj.weight"),
    ("blk.29.ffn_down.biases", "model.layers.29.mlp.down_proj.biases"),
    ("blk.3.ffn_norm.weight", "model.layers.3.post_attention_layernorm.weight"),
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
])
def test_tensor_names(gguf: str, mlx: str) -> None:
    assert gguf_to_mlx_name(gguf) == mlx


def test_unknown_tensor_is_refused() -> None:
    with pytest.raises(ValueError, match="unexpected GGUF tensor"):
        gguf_to_mlx_name("blk.0.attn_qkv.weight")


def test_fixture_command_writes_the_4_bit_folder(tmp_path: Path) -> None:
    assert fixture_main(["--family", "smollm2", "--out", str(tmp_path)]) == 0
    config = json.loads((tmp_path / "config.json").read_text())
    # Q4_1 layers are 4-bit; the GGUF keeps the embedding in 8 bits.
    assert config["quantization"] == {"group_size": 32, "bits": 4,
                                      "model.embed_tokens": {"group_size": 32, "bits": 8}}
    assert config["rope_traditional"] is True
    assert config["rope_theta"] == 100000.0
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (30, 9, 3)
    tokenizer_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"].startswith("{% for message in messages %}")
    assert tokenizer_config["eos_token"] == "<|im_end|>"


def test_tokenizer_splits_digits_then_bytes() -> None:
    tokenizer = Tokenizer.from_file(str(fixtures.fixture_path("smollm2-f32") / "tokenizer.json"))
    # SmolLM2's ids: <|im_start|> 1, "\n" 198, each digit alone.
    assert tokenizer.encode("<|im_start|>user\n").ids[0] == 1
    assert tokenizer.encode("In 2024, 12345 cats").ids == [788, 216, 34, 32, 34, 36, 28, 216, 33, 34, 35, 36, 37, 7680]
    text = "Grüße, naïve café 🙂\n  spaced\ttabs"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_4_bit_model_answers_paris_through_mlx_lm() -> None:
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(str(fixtures.fixture_path("smollm2")))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    assert "Paris" in generate(model, tokenizer, prompt=prompt, max_tokens=8, sampler=make_sampler(0.0))
