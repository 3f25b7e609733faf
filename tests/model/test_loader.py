from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mlxcel.fixtures import CHAT_TEMPLATE
from mlxcel.model.family import FamilyKind
from mlxcel.model.loader import ModelLoadError, load_model, read_chat_template, read_model_config, resolve_model

pytestmark = pytest.mark.slow

EXPECTED = {
    "llama": ("llama", FamilyKind.DENSE, None, True, False),
    "phi3-longrope": ("phi3", FamilyKind.DENSE, 512, True, False),
    "gemma3": ("gemma3", FamilyKind.SLIDING_WINDOW, None, True, True),
    "hybrid": ("qwen3_next", FamilyKind.RECURRENT, None, False, True),
}


def test_loaded_model_fields(loaded_model, fixture_folder, family: str) -> None:
    loaded = loaded_model(family)
    model_type, kind, longrope, apc_supported, snapshot_only = EXPECTED[family]
    assert loaded.path == fixture_folder(family).resolve()
    assert loaded.model_id == fixture_folder(family).name
    assert loaded.config == read_model_config(loaded.path)
    assert loaded.family.model_type == model_type
    assert loaded.family.kind is kind
    assert loaded.family.longrope_original_max_positions == longrope
    assert loaded.family.apc_supported is apc_supported
    assert loaded.family.snapshot_only is snapshot_only
    assert loaded.family.context_size == 4096
    assert loaded.chat_template == CHAT_TEMPLATE
    assert loaded.eos_token_ids == frozenset({151645})


def test_chat_template_renders_chatml(loaded_model) -> None:
    tokenizer = loaded_model("llama").tokenizer
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "tool", "content": "{\"ok\": true}"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>tool\n{\"ok\": true}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without_prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=False)
    assert without_prompt.endswith("Hi<|im_end|>\n")
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert ids[0] == 151644
    assert ids.count(151645) == 4


def test_loaded_tokenizer_round_trip(loaded_model) -> None:
    tokenizer = loaded_model("llama").tokenizer
    text = "Prefix caching, naïvely: 東京 🙂"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert tokenizer.encode("<|im_end|>", add_special_tokens=False) == [151645]


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="model folder not found") as raised:
        load_model(tmp_path / "absent")
    assert "\n" not in str(raised.value)


def test_path_is_a_file(tmp_path: Path) -> None:
    file = tmp_path / "weights.bin"
    file.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a folder"):
        load_model(file)


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)
    with pytest.raises(ModelLoadError, match="no config.json"):
        read_model_config(tmp_path)


def test_invalid_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read"):
        read_model_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="JSON object"):
        read_model_config(tmp_path)


def test_missing_weights(tmp_path: Path, fixture_folder) -> None:
    shutil.copyfile(fixture_folder("llama") / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match="no model"):
        load_model(tmp_path)


def test_unsupported_model_type(tmp_path: Path, fixture_folder) -> None:
    source = fixture_folder("llama")
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).symlink_to(source / name)
    config = json.loads((source / "config.json").read_text())
    config["model_type"] = "no_such_architecture"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="no_such_architecture") as raised:
        load_model(tmp_path)
    assert "\n" not in str(raised.value)


def test_loader_imports_mlx_only_inside_load_model() -> None:
    # read_model_config must stay usable before the CLI's BLAS re-exec.
    import ast

    from mlxcel.model import loader

    tree = ast.parse(Path(loader.__file__).read_text())
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            assert (node.module or "").split(".")[0] not in ("mlx", "mlx_lm"), node.module
        elif isinstance(node, ast.Import):
            assert not any(alias.name.split(".")[0] in ("mlx", "mlx_lm") for alias in node.names)


def test_read_chat_template_variants(tmp_path: Path) -> None:
    assert read_chat_template(tmp_path) == ""
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]})
    )
    assert read_chat_template(tmp_path) == "D"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert read_chat_template(tmp_path) == "J"


def fake_hub_cache(hf_home: Path, repo_id: str, source: Path) -> Path:
    """The layout huggingface_hub's cache has: refs/main names the snapshot folder."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for entry in source.iterdir():
        (snapshot / entry.name).symlink_to(entry.resolve())
    return snapshot


def run_offline(code: str, hf_home: Path) -> subprocess.CompletedProcess[str]:
    # huggingface_hub reads HF_HOME and HF_HUB_OFFLINE when imported: a fresh process.
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env={**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"},
    )


def test_a_repo_id_in_the_hub_cache_loads_offline(tmp_path: Path, fixture_folder) -> None:
    snapshot = fake_hub_cache(tmp_path / "hf", "test-org/tiny-llama", fixture_folder("llama"))
    result = run_offline(
        "from mlxcel.model.loader import load_model, read_model_config\n"
        "assert read_model_config('test-org/tiny-llama')['model_type'] == 'llama'\n"
        "loaded = load_model('test-org/tiny-llama')\n"
        "print(loaded.model_id, loaded.path)\n",
        tmp_path / "hf",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["test-org/tiny-llama", str(snapshot)]


def test_a_repo_id_missing_from_the_hub_cache_is_one_line(tmp_path: Path) -> None:
    result = run_offline(
        "from mlxcel.model.loader import ModelLoadError, resolve_model\n"
        "try:\n    resolve_model('test-org/absent')\nexcept ModelLoadError as error:\n    print(error)\n",
        tmp_path / "hf",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        "model not found: 'test-org/absent' is neither a local folder nor a repo in the Hugging Face cache "
        "(HF_HUB_OFFLINE is set)"
    )


@pytest.mark.parametrize("text", ["./relative/folder", "/abs/org/name", "org/name/extra", "org--x/name", "-org/name"])
def test_paths_that_are_not_repo_ids_stay_folders(text: str) -> None:
    with pytest.raises(ModelLoadError, match="model folder not found"):
        resolve_model(text)
