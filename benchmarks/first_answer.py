"""Time from launching a server to its first answered chat request, against mlx_lm.server.

Usage:
  python benchmarks/first_answer.py [--model DIR] [--repeats 2] [--mlxcel-path PATH ...]
      [--mlxcel-flags "--device-warmup false" ...] [--no-peer]

Without --model it writes (once) a 4-bit model of SmolLM2-135M's shape with
random weights (the fixtures' Qwen tokenizer), under ~/.cache/mlxcel/bench.
Each server is launched on a free loopback port and polled every 20 ms with
one greedy 8-token chat request; printed per run: when the port first
answered anything (`/health` for mlxcel, the chat route for the peer), when
the first chat answer came back, and how long that answer itself took.
`--mlxcel-path` runs the mlxcel of another checkout (e.g. a `git worktree`
of an older commit) from the same virtual environment.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_SHAPE = dict(hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64)
DEFAULT_MODEL = Path.home() / ".cache" / "mlxcel" / "bench" / "smollm2-shape-4bit"
CHAT = {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8, "temperature": 0}


def write_4bit_model(out: Path) -> None:
    if (out / "model.safetensors").exists():
        return
    sys.path.insert(0, str(REPO))
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    from mlxcel.fixtures import fixture_path

    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=151646,
                  rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
                  tie_word_embeddings=True, torch_dtype="float32", eos_token_id=151645, **SMOLLM2_SHAPE)
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    config["quantization"] = {"group_size": 32, "bits": 4}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer_dir = fixture_path("llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((tokenizer_dir / name).read_bytes())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(command: list[str], port: int, env: dict[str, str], probe_health: bool, limit: float) -> dict[str, float]:
    started = time.perf_counter()
    # `python -m` puts the working directory first on sys.path: run from the checkout served.
    process = subprocess.Popen(command, env=env, cwd=env.get("PYTHONPATH", str(REPO)),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    port_open = None
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            while time.perf_counter() - started < limit:
                if process.poll() is not None:
                    raise RuntimeError(f"{command[0]} exited {process.returncode}: "
                                       f"{process.stderr.read().decode()[-400:]}")
                try:
                    if probe_health and port_open is None:
                        client.get("/health")
                        port_open = time.perf_counter() - started
                    sent = time.perf_counter()
                    response = client.post("/v1/chat/completions", json=CHAT)
                except httpx.TransportError:
                    time.sleep(0.02)
                    continue
                if port_open is None:
                    port_open = time.perf_counter() - started
                if response.status_code == 200:
                    answered = time.perf_counter()
                    return {"port_open_s": port_open, "first_answer_s": answered - started,
                            "answer_latency_s": answered - sent}
                time.sleep(0.02)
        raise RuntimeError(f"no answer within {limit} s")
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--mlxcel-path", action="append", default=None,
                        help="checkout whose mlxcel to run (repeatable; default this one)")
    parser.add_argument("--mlxcel-flags", action="append", default=None,
                        help="extra mlxcel serve flags, one string per variant (repeatable)")
    parser.add_argument("--no-peer", action="store_true", help="skip mlx_lm.server")
    parser.add_argument("--limit", type=float, default=300.0, help="seconds to wait for an answer")
    arguments = parser.parse_args()
    model = arguments.model or DEFAULT_MODEL
    if arguments.model is None:
        write_4bit_model(model)
    variants: list[tuple[str, list[str], dict[str, str], bool]] = []
    for path in arguments.mlxcel_path or [str(REPO)]:
        for flags in arguments.mlxcel_flags or [""]:
            env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}
            name = f"mlxcel[{Path(path).name}]{(' ' + flags) if flags else ''}"
            variants.append((name, ["-m", "mlxcel", "serve", "-m", str(model), *shlex.split(flags)], env, True))
    if not arguments.no_peer:
        variants.append(("mlx_lm.server", ["-m", "mlx_lm.server", "--model", str(model)],
                         {**os.environ, "HF_HUB_OFFLINE": "1"}, False))
    print(f"model: {model}")
    print(f"{'server':<48} {'port open s':>12} {'first answer s':>15} {'answer latency s':>17}")
    for name, arguments_tail, env, probe_health in variants:
        runs = []
        for _ in range(arguments.repeats):
            port = free_port()
            tail = [*arguments_tail, "--port", str(port)]
            runs.append(measure([sys.executable, *tail], port, env, probe_health, arguments.limit))
        median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        print(f"{name:<48} {median['port_open_s']:>12.2f} {median['first_answer_s']:>15.2f} "
              f"{median['answer_latency_s']:>17.2f}", flush=True)


if __name__ == "__main__":
    main()
