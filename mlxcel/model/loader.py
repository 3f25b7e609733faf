"""Loading a model folder through mlx-lm: a local folder, or a Hugging Face repo id.

A repo id resolves as mlx-lm resolves it, through huggingface_hub's cache
(``snapshot_download`` with mlx-lm's file patterns): offline
(``HF_HUB_OFFLINE=1``) a repo already in the cache loads, a missing one is a
`ModelLoadError`.

MLX is imported inside `load_model` only, so `read_model_config` (and a CLI
that still has to decide whether to re-exec with a faster BLAS) can use this
module without pulling MLX in.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from mlxcel.model.family import ModelFamily, detect_family
from mlxcel.vision.processing import VisionSpec, vision_spec

if TYPE_CHECKING:
    import mlx.nn as nn
    from mlx_lm.tokenizer_utils import TokenizerWrapper

__all__ = [
    "LoadedModel", "ModelLoadError", "default_prefill_step_size", "load_model", "read_chat_template",
    "read_model_config", "resolve_model",
]

# The files mlx-lm fetches of a repo (mlx_lm.utils.DEFAULT_ALLOW_PATTERNS; not imported: it pulls in MLX).
HUB_ALLOW_PATTERNS = (
    "*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model", "*.txt", "*.jsonl",
    "*.jinja",
)
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")


def default_prefill_step_size() -> int:
    """The prefill chunk when none is configured, measured per backend (benchmarks/prefill_step.py):
    256 on the CPU, where attention dominates prefill, 2048 on a GPU."""
    import mlx.core as mx

    return 256 if mx.default_device() == mx.cpu else 2048


class ModelLoadError(Exception):
    """A model folder that cannot be loaded; the message is one line for the user."""


@attrs.frozen(kw_only=True)
class LoadedModel:
    model: nn.Module = attrs.field(eq=False, repr=False)
    tokenizer: TokenizerWrapper = attrs.field(eq=False, repr=False)
    config: dict[str, Any] = attrs.field(repr=False)
    model_id: str
    path: Path
    family: ModelFamily
    chat_template: str = attrs.field(repr=False)
    eos_token_ids: frozenset[int]
    vision: VisionSpec | None = None


def _is_repo_id(text: str) -> bool:
    return _REPO_ID.fullmatch(text) is not None and ".." not in text and "--" not in text


def _hub_folder(repo_id: str) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=list(HUB_ALLOW_PATTERNS)))
    except LocalEntryNotFoundError:
        where = "in the Hugging Face cache (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else (
            "in the Hugging Face cache, and the hub could not be reached")
        raise ModelLoadError(f"model not found: {repo_id!r} is neither a local folder nor a repo {where}") from None
    except (HfHubHTTPError, HFValidationError, OSError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelLoadError(f"cannot fetch model {repo_id!r} from the Hugging Face hub: {first_line}") from None


def resolve_model(path: str | Path) -> tuple[Path, str]:
    """The local folder of a model and its id: a folder's name, or the repo id of a hub model."""
    text = str(path)
    folder = Path(text).expanduser()
    if not folder.exists() and _is_repo_id(text):
        return _hub_folder(text), text
    if not folder.exists():
        raise ModelLoadError(f"model folder not found: {folder}")
    if not folder.is_dir():
        raise ModelLoadError(f"model path is not a folder: {folder}")
    return folder.resolve(), folder.resolve().name


def _model_folder(path: str | Path) -> Path:
    return resolve_model(path)[0]


def read_model_config(path: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a model folder (or repo id), without touching the weights."""
    folder = _model_folder(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"no config.json in model folder {folder}")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelLoadError(f"cannot read {config_file}: {error}") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{config_file} does not hold a JSON object")
    return config


def read_chat_template(path: str | Path) -> str:
    """The chat template source a model folder ships, "" if it has none."""
    folder = Path(path)
    # Newer checkpoints keep the template in its own file.
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    tokenizer_config_file = folder / "tokenizer_config.json"
    if not tokenizer_config_file.is_file():
        return ""
    try:
        tokenizer_config = json.loads(tokenizer_config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return ""
    template = tokenizer_config.get("chat_template") if isinstance(tokenizer_config, dict) else None
    if isinstance(template, list):
        # The named-template form: [{"name": "default", "template": ...}, ...].
        named = {
            entry.get("name"): entry.get("template")
            for entry in template
            if isinstance(entry, dict)
        }
        template = named.get("default")
    return template if isinstance(template, str) else ""


def _tokenizer_files_stamp(folder: Path) -> tuple[tuple[str, int, int], ...]:
    """Changes whenever a tokenizer file changes, so the memo below never goes stale."""
    return tuple(
        (entry.name, entry.stat().st_mtime_ns, entry.stat().st_size)
        for entry in sorted(folder.iterdir())
        if entry.suffix in (".json", ".jinja", ".model", ".tiktoken", ".txt")
    )


def _eos_key(model_config: dict[str, Any]) -> tuple[int, ...] | int | None:
    eos = model_config.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else eos


@functools.lru_cache(maxsize=4)
def _load_tokenizer(folder: Path, _stamp: object, eos_token_ids: tuple[int, ...] | int | None) -> Any:
    """mlx-lm's tokenizer wrapper, built once per folder per process.

    Building it over a large vocabulary takes seconds and it is read-only
    afterwards (each request copies its own streaming detokenizer), so
    engines in one process (tests, embedding apps) share it.
    """
    from mlx_lm.utils import load_tokenizer

    eos = list(eos_token_ids) if isinstance(eos_token_ids, tuple) else eos_token_ids
    return load_tokenizer(folder, eos_token_ids=eos)


def load_model(path: str | Path) -> LoadedModel:
    """Load the model and tokenizer of a local folder or a Hugging Face repo id (see `resolve_model`)."""
    folder, model_id = resolve_model(path)
    config = read_model_config(folder)
    if not any(folder.glob("model*.safetensors")):
        raise ModelLoadError(f"no model*.safetensors weights in model folder {folder}")

    from mlx_lm.utils import load_model as load_weights

    try:
        # mlx-lm only downloads when the path does not exist, which was checked.
        model, model_config = load_weights(folder)
        tokenizer = _load_tokenizer(folder, _tokenizer_files_stamp(folder), _eos_key(model_config))
    except (ValueError, FileNotFoundError, KeyError, TypeError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelLoadError(f"cannot load model from {folder}: {first_line}") from error

    try:
        vision = vision_spec(config, folder, tokenizer)
    except (ValueError, OSError) as error:
        raise ModelLoadError(f"cannot read the vision settings of {folder}: {error}") from error
    chat_template = read_chat_template(folder)
    if not chat_template:
        fallback = getattr(tokenizer, "chat_template", None)
        chat_template = fallback if isinstance(fallback, str) else ""

    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        config=config,
        model_id=model_id,
        path=folder,
        family=detect_family(config),
        chat_template=chat_template,
        eos_token_ids=frozenset(int(token_id) for token_id in tokenizer.eos_token_ids),
        vision=vision,
    )
