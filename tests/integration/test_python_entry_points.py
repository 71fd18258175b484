"""LMDeploy's Python entry points: ``conveyor.serve`` / ``conveyor.client`` / ``APIClient.chat``,
``pipeline(path, 'model-name')``, and a chat template given to the server as a JSON file."""

from __future__ import annotations

import json

import pytest

import conveyor
from conveyor import EngineConfig, GenerationConfig, pipeline
from conveyor.testing.server_process import free_port


def test_serve_starts_a_server_and_its_client_chats_in_a_session(smollm2_dir, tmp_path) -> None:
    template = conveyor.ChatTemplateConfig(model_name="chatml", system="<|im_start|>system\n")
    api = conveyor.serve(str(smollm2_dir), "smol", backend="pytorch", server_name="127.0.0.1", server_port=free_port(),
                         backend_config=EngineConfig(cache_max_entry_count=64, session_len=2048),
                         chat_template_config=template, log_level="WARNING")
    try:
        assert api.available_models == ["smol"]
        first = list(api.chat("What is the capital of France?", session_id=7, request_output_len=12, stream=True))
        assert "".join(text for text, _, _ in first) and first[-1][2] in ("stop", "length")
        second = list(api.chat("And of Germany?", session_id=7, request_output_len=8))
        assert len(second) == 1 and second[0][0]
        other = conveyor.client(api.base)  # a second client of the same server
        assert other.available_models == ["smol"]
        other.close()
        with pytest.raises(ValueError, match="session id"):
            list(api.chat("hi", session_id=-1))
    finally:
        api.close()
    assert api.server.poll() is not None  # close() stopped the server


def test_serve_refuses_what_it_cannot_do() -> None:
    with pytest.raises(ValueError, match="backend"):
        conveyor.serve("x", backend="vllm")
    with pytest.raises(ValueError, match="ssl"):
        conveyor.serve("x", ssl=True)
    with pytest.raises(ValueError, match="rope_scaling_factor"):  # no flag carries it: refused, not dropped
        conveyor.serve("x", backend_config=EngineConfig(rope_scaling_factor=2.0))


def test_pipeline_takes_a_model_name_second(smollm2_dir) -> None:
    cfg = EngineConfig(cache_max_entry_count=32, session_len=1024)
    with pipeline(str(smollm2_dir), "llama3", backend_config=cfg) as pipe:
        assert pipe.preprocessor.template.name == "llama3"  # the name picked the template
        assert pipe("Hi", GenerationConfig(max_new_tokens=2)).text is not None


def test_pipeline_refuses_what_it_would_otherwise_ignore(smollm2_dir) -> None:
    from conveyor import EngineConfigError, UnknownChatTemplateError

    with pytest.raises(UnknownChatTemplateError, match="no-such-family"):
        pipeline(str(smollm2_dir), "no-such-family")
    with pytest.raises(EngineConfigError, match="give one"):
        pipeline(str(smollm2_dir), EngineConfig(tp=2), tp=3)
    with pytest.raises(TypeError):
        pipeline(str(smollm2_dir), cache_max_entry_count=8)  # an engine field belongs in backend_config
    with pytest.raises(TypeError, match="both"):
        pipeline(str(smollm2_dir), EngineConfig(), backend_config=EngineConfig())


def test_a_chat_template_file_on_the_command_line(smollm2_dir, tmp_path) -> None:
    from conveyor.cli import main

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model_name": "no-such", "system": "x"}))
    # refused before any stage starts (before: a tokenizer stage that kept restarting)
    assert main(["serve", "api_server", str(smollm2_dir), "--chat-template", str(bad)]) == 2
