"""Which tokenizers load without torch (services/tokenizer/loader.py), checked against transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conveyor.services.tokenizer.loader import GENERIC_MODEL_TYPES, loads_without_torch


def test_the_generic_model_types_keep_the_generic_class_in_autotokenizer() -> None:
    """AutoTokenizer swaps a generic tokenizer_class for the model type's own only where the type
    has a specific registered class and is on transformers' list of hub configs it distrusts."""
    from transformers.models.auto import tokenization_auto as auto

    distrusted = getattr(auto, "MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS", set())
    for model_type in GENERIC_MODEL_TYPES:
        registered = (auto.TOKENIZER_MAPPING_NAMES.get(model_type) or "TokenizersBackend").removesuffix("Fast")
        assert model_type not in distrusted or registered in ("TokenizersBackend", "PreTrainedTokenizer"), model_type


def _model_dir(tmp_path: Path, tokenizer_config: dict, model_type: str = "llama", tokenizer_json: bool = True) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if tokenizer_json:
        (tmp_path / "tokenizer.json").write_text("{}")
    return tmp_path


@pytest.mark.parametrize("tokenizer_config, model_type, tokenizer_json, expected", [
    ({"tokenizer_class": "TokenizersBackend"}, "llama", True, True),
    ({"tokenizer_class": "PreTrainedTokenizerFast"}, "mistral", True, True),
    ({"tokenizer_class": "TokenizersBackend"}, "llama", False, False),  # nothing to load it from
    ({"tokenizer_class": "LlamaTokenizer"}, "llama", True, False),  # AutoTokenizer may rewrite it
    ({"tokenizer_class": "TokenizersBackend"}, "qwen2", True, False),  # AutoTokenizer swaps in Qwen2Tokenizer
    ({"tokenizer_class": "TokenizersBackend", "auto_map": {"AutoTokenizer": ["x.X", None]}}, "llama", True, False),
])
def test_only_plain_fast_tokenizers_skip_autotokenizer(tmp_path, tokenizer_config, model_type, tokenizer_json,
                                                       expected) -> None:
    assert loads_without_torch(_model_dir(tmp_path, tokenizer_config, model_type, tokenizer_json)) is expected


def test_a_remote_code_tokenizer_runs_unless_the_deployment_refuses_it(tmp_path, monkeypatch) -> None:
    """A tokenizer shipped as Python (auto_map) loads with trust_remote_code, as LMDeploy loads it,
    and CONVEYOR_TRUST_REMOTE_CODE=0 refuses it by name instead of transformers asking on stdin."""
    import json

    import transformers

    from conveyor.protocol.errors import EngineConfigError
    from conveyor.services.tokenizer import loader

    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["tokenization_x.XTokenizer", None]}}))
    seen = {}

    def fake(path, **kwargs):
        seen.update(kwargs)
        return "tokenizer"

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", staticmethod(fake))
    assert loader.load_tokenizer(tmp_path) == "tokenizer" and seen == {"trust_remote_code": True}
    monkeypatch.setenv("CONVEYOR_TRUST_REMOTE_CODE", "0")
    with pytest.raises(EngineConfigError, match="CONVEYOR_TRUST_REMOTE_CODE=0"):
        loader.load_tokenizer(tmp_path)
