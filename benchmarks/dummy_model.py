"""Model directories of published shapes (config.json only) for benchmarks with random weights.

The engine builds the model from the config and, with ``EngineConfig(load_format="dummy")``,
fills it with seeded random weights directly on the GPU: no 13.5 GB of weight files are written
or read, and the timings are those of the real shape (the kernels do not depend on the values).

    python -m benchmarks.dummy_model llama2-7b /tmp/llama2-7b   # prints the directory
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

_LLAMA_COMMON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "float16",
}

SHAPES: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-2-7b-hf
    "llama2-7b": {
        **_LLAMA_COMMON,
        "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "intermediate_size": 11008, "vocab_size": 32000, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2,
    },
    # meta-llama/Meta-Llama-3-8B
    "llama3-8b": {
        **_LLAMA_COMMON,
        "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "intermediate_size": 14336, "vocab_size": 128256, "rope_theta": 500000.0,
        "max_position_embeddings": 8192, "bos_token_id": 128000, "eos_token_id": 128001,
    },
    # meta-llama/Llama-2-70b-hf: 138 GB of fp16 weights, more than one H200 holds (tensor parallel)
    "llama2-70b": {
        **_LLAMA_COMMON,
        "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "intermediate_size": 28672, "vocab_size": 32000, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2,
    },
    # A toy of the same family, for smoke-testing the benchmarks on a CPU.
    "tiny": {
        **_LLAMA_COMMON,
        "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 512, "vocab_size": 1000, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2,
    },
}


def write_model_dir(shape: str, dest: str | Path) -> Path:
    """Write ``dest/config.json`` for ``shape`` (a key of SHAPES); returns ``dest``."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {sorted(SHAPES)}")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(SHAPES[shape], indent=2) + "\n")
    return dest


def param_count(shape: str) -> int:
    """Parameters of the shape (for bandwidth arithmetic in the reports)."""
    c = SHAPES[shape]
    h, inter, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * inter + 2 * h
    return layers * per_layer + 2 * vocab * h + h


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("dest")
    args = ap.parse_args()
    print(write_model_dir(args.shape, args.dest))


if __name__ == "__main__":
    main()
