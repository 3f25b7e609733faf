from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from mlxcel.model import fixtures


@pytest.fixture(scope="module")
def raw_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(fixtures.tokenizer_json_path()))


def test_tokenizer_has_qwen_vocabulary_and_specials(raw_tokenizer: Tokenizer) -> None:
    assert raw_tokenizer.get_vocab_size() == fixtures.VOCAB_SIZE
    for token, token_id in fixtures.SPECIAL_TOKENS.items():
        assert raw_tokenizer.token_to_id(token) == token_id
        assert raw_tokenizer.encode(token).ids == [token_id]


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! The quick brown fox jumps over 1234567 lazy dogs.",
        "  leading spaces,\ttabs\nand\r\nnewlines  ",
        "Grüße aus Köln — naïve café, 東京タワー, 你好世界, Привет, 🙂🚀",
    ],
)
def test_tokenizer_round_trip(raw_tokenizer: Tokenizer, text: str) -> None:
    ids = raw_tokenizer.encode(text).ids
    assert ids
    assert raw_tokenizer.decode(ids) == text


def test_tokenizer_known_ids(raw_tokenizer: Tokenizer) -> None:
    # Qwen's BPE: "Hello" is 9707, "\n" is 198; digits split one by one.
    assert raw_tokenizer.encode("Hello").ids == [9707]
    assert raw_tokenizer.encode("\n").ids == [198]
    assert len(raw_tokenizer.encode("123").ids) == 3


def test_special_tokens_inside_text(raw_tokenizer: Tokenizer) -> None:
    ids = raw_tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n").ids
    assert ids[0] == 151644
    assert 151645 in ids
    assert raw_tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n"


def test_tokenizer_cache_is_reused() -> None:
    first = fixtures.tokenizer_json_path()
    modified = first.stat().st_mtime_ns
    assert fixtures.tokenizer_json_path() == first
    assert first.stat().st_mtime_ns == modified
    assert first.name == f"{fixtures.TOKENIZER_VERSION}.json"


def test_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MLXCEL_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert fixtures.cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("MLXCEL_CACHE_DIR")
    assert fixtures.cache_dir() == tmp_path / "xdg" / "mlxcel"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert fixtures.cache_dir() == tmp_path / "home" / ".cache" / "mlxcel"


@pytest.mark.parametrize("family", fixtures.FAMILIES)
def test_fixture_config_shapes(family: str) -> None:
    config = fixtures.fixture_config(family)
    assert config["vocab_size"] >= 151_646
    assert config["eos_token_id"] == 151645
    assert config["tie_word_embeddings"] is True
    assert config["max_position_embeddings"] >= 4096


def test_fixture_config_is_a_fresh_copy() -> None:
    fixtures.fixture_config("llama")["hidden_size"] = 1
    assert fixtures.fixture_config("llama")["hidden_size"] == 64


def test_phi3_longrope_factors_differ() -> None:
    scaling = fixtures.fixture_config("phi3-longrope")["rope_scaling"]
    head_dim = 64 // 4
    assert len(scaling["short_factor"]) == len(scaling["long_factor"]) == head_dim // 2
    assert scaling["short_factor"] != scaling["long_factor"]


def test_unknown_family() -> None:
    with pytest.raises(ValueError, match="unknown fixture family"):
        fixtures.fixture_config("gpt5")
    with pytest.raises(ValueError, match="unknown fixture family"):
        fixtures.fixture_path("gpt5")


def test_cached_folder_contents(fixture_folder, family: str) -> None:
    folder = fixture_folder(family)
    assert folder == fixture_folder(family)
    assert folder.parent == fixtures.cache_dir() / "models"
    names = sorted(path.name for path in folder.iterdir())
    assert names == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert tokenizer_config["chat_template"] == fixtures.CHAT_TEMPLATE
    assert json.loads((folder / "config.json").read_text()) == fixtures.fixture_config(family)


def test_same_seed_same_weights_other_seed_other_weights(tmp_path: Path) -> None:
    import mlx.core as mx

    first = fixtures.write_fixture("llama", tmp_path / "a", seed=7)
    second = fixtures.write_fixture("llama", tmp_path / "b", seed=7)
    third = fixtures.write_fixture("llama", tmp_path / "c", seed=8)
    weights_first = mx.load(str(first / "model.safetensors"))
    weights_second = mx.load(str(second / "model.safetensors"))
    weights_third = mx.load(str(third / "model.safetensors"))
    assert weights_first.keys() == weights_second.keys() == weights_third.keys()
    assert "lm_head.weight" not in weights_first
    for name, value in weights_first.items():
        assert value.dtype == mx.float32
        assert mx.array_equal(value, weights_second[name]).item(), name
    embedding = "model.embed_tokens.weight"
    assert weights_first[embedding].shape == (151_646, 64)
    assert not mx.array_equal(weights_first[embedding], weights_third[embedding]).item()


def test_safetensors_metadata(fixture_folder) -> None:
    import mlx.core as mx

    _, metadata = mx.load(str(fixture_folder("llama") / "model.safetensors"), return_metadata=True)
    assert metadata == {"format": "mlx"}


def test_demo_model_path_is_cached_llama() -> None:
    path = fixtures.demo_model_path()
    assert path.name == fixtures.DEMO_MODEL_NAME
    assert path == fixtures.demo_model_path()
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"


def test_fixture_main_writes_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "model"
    assert fixtures.fixture_main(["--family", "gemma3", "--out", str(out), "--seed", "3"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert json.loads((out / "config.json").read_text())["model_type"] == "gemma3_text"
    assert (out / "model.safetensors").stat().st_size > 0


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--family", "llama"],
        ["--out", "x"],
        ["--family", "gpt5", "--out", "x"],
        ["--family", "llama", "--out", "x", "--seed", "many"],
    ],
)
def test_fixture_main_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        fixtures.fixture_main(argv)
    assert raised.value.code == 2
    assert "error:" in capsys.readouterr().err
