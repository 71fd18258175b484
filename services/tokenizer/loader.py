"""Loading a model's tokenizer, without torch where the model's files allow it.

``AutoTokenizer`` imports torch (transformers 5: ``models/auto/tokenization_auto.py`` imports
``configuration_utils``, which imports ``modeling_rope_utils``, which imports torch whenever it
is installed), and the stateless stages would carry ~300 MiB for it. A directory whose
``tokenizer_config.json`` names the generic fast tokenizer loads as that class directly, which
needs only the ``tokenizers`` package: the class AutoTokenizer would pick for it too, for the
model types listed below. Anything else (GGUF files, model-specific or remote-code tokenizer
classes, other model types) goes through AutoTokenizer as before.

A tokenizer the model directory ships as Python (``auto_map``: Qwen-7B's tiktoken, InternLM2's
sentencepiece wrapper) runs that code, as LMDeploy always does (transformers would otherwise ask
on stdin, which a server stage cannot answer); ``CONVEYOR_TRUST_REMOTE_CODE=0`` refuses it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ... import envs
from ...protocol.errors import EngineConfigError

# What transformers writes for a plain fast tokenizer (v5; v4 wrote PreTrainedTokenizerFast).
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# Model types for which AutoTokenizer keeps a generic class named in tokenizer_config.json. For
# some others (qwen2, phi3, ...) it swaps in the type's own class, so those keep AutoTokenizer.
# tests/unit/test_tokenizer_loader.py checks this list against the installed transformers.
GENERIC_MODEL_TYPES = ("llama", "mistral", "internlm2")


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def loads_without_torch(model_dir: Path) -> bool:
    """Whether the directory's tokenizer is transformers' generic fast tokenizer (see the module doc)."""
    if not (model_dir / "tokenizer.json").is_file():
        return False
    tok_cfg = _json(model_dir / "tokenizer_config.json")
    model_type = _json(model_dir / "config.json").get("model_type")
    return tok_cfg.get("tokenizer_class") in _GENERIC_CLASSES and "auto_map" not in tok_cfg \
        and model_type in GENERIC_MODEL_TYPES


def load_tokenizer(model_path: str | Path):
    """A transformers tokenizer from a model directory or a single .gguf file."""
    path = Path(model_path)
    if path.suffix == ".gguf":
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if loads_without_torch(path):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer

    trust = envs.flag("CONVEYOR_TRUST_REMOTE_CODE")
    if not trust and "auto_map" in _json(path / "tokenizer_config.json"):
        raise EngineConfigError(f"the tokenizer of {path} is Python code shipped with the model (tokenizer_config.json "
                                "auto_map) and CONVEYOR_TRUST_REMOTE_CODE=0 refuses it: unset it to run that code")
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust)
