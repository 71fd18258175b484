"""Chat templates: exact rendering of the built-ins, config overrides/JSON, matching, HF templates, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conveyor.services.tokenizer.chat_template import (
    CHAT_TEMPLATES,
    TEMPLATE_FIELDS,
    BaseChatTemplate,
    ChatTemplateConfig,
    HFChatTemplate,
    UnknownChatTemplateError,
    get_chat_template,
    list_chat_templates,
)

CHAT = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U1"},
    {"role": "assistant", "content": "A1"},
    {"role": "user", "content": "U2"},
]
CHATML = ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n<|im_start|>assistant\n"
          "A1<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n<|im_start|>assistant\n")
EXPECTED = {
    "base": "SU1A1U2",
    "chatml": CHATML,
    "qwen": CHATML,
    "qwen2": CHATML,
    "internlm2": CHATML,
    "llama3": ("<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nU1<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\nA1<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nU2<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "llama2": "[INST] <<SYS>>\nS\n<</SYS>>\n\nU1 [/INST] A1 </s><s>[INST] U2 [/INST] ",
    "mistral": "[INST] S\n\nU1 [/INST]A1</s>[INST] U2 [/INST]",
    "mixtral": "[INST] S\n\nU1 [/INST]A1</s>[INST] U2 [/INST]",
    "vicuna": "S USER: U1 ASSISTANT: A1</s>USER: U2 ASSISTANT: ",
    # Issue 33's: the original LLaVA repository's conversations and Yi-VL's, as LMDeploy's.
    "llava-v1": "S USER: U1 ASSISTANT: A1</s>USER: U2 ASSISTANT: ",
    "llava-chatml": ("<|im_start|>system\nS<|im_end|><|im_start|>user\nU1<|im_end|><|im_start|>assistant\nA1"
                     "<|im_end|><|im_start|>user\nU2<|im_end|><|im_start|>assistant\n"),
    "yi-vl": "S### Human: U1\n### Assistant:A1\n### Human: U2\n### Assistant:",
    "deepseek-vl": "S\n\nUser: U1\n\nAssistant: A1<\uff5cend\u2581of\u2581sentence\uff5c>User: U2\n\nAssistant:",
    # Issue 30's families; each is checked against its published template in
    # test_chat_templates_families.py.
    "internlm3": CHATML,
    "qwen3": CHATML,
    "internlm": "<|System|>:S\n<|User|>:U1\n<|Bot|>:A1<eoa>\n<|User|>:U2\n<|Bot|>:",
    "baichuan2": "S<reserved_106>U1<reserved_107>A1<reserved_106>U2<reserved_107>",
    "chatglm2": "S\n\n[Round 1]\n\n问：U1\n\n答：A1\n\n[Round 2]\n\n问：U2\n\n答：",
    "chatglm": "S\n\n[Round 1]\n\n问：U1\n\n答：A1\n\n[Round 2]\n\n问：U2\n\n答：",
    "chatglm3": "<|system|>\n S<|user|>\n U1<|assistant|>\n A1<|user|>\n U2<|assistant|>",
    "glm4": "<|system|>\nS<|user|>\nU1<|assistant|>\nA1<|user|>\nU2<|assistant|>",
    "gemma": ("<start_of_turn>user\nS\n\nU1<end_of_turn>\n<start_of_turn>model\nA1<end_of_turn>\n"
              "<start_of_turn>user\nU2<end_of_turn>\n<start_of_turn>model\n"),
    "phi-3": ("<|system|>\nS<|end|>\n<|user|>\nU1<|end|>\n<|assistant|>\nA1<|end|>\n<|user|>\nU2<|end|>\n"
              "<|assistant|>\n"),
    "falcon": "SU1A1U2",
    # Issue 31's families, each checked against its published template in its model test file.
    "dbrx": CHATML,
    "deepseek": "S\n\nUser: U1\n\nAssistant: A1<｜end▁of▁sentence｜>User: U2\n\nAssistant:",
    **dict.fromkeys(("llama3_1", "llama3_2"), (
        "<|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nS<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nU1<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nA1<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nU2<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_builtin_renders_exact_prompt(name: str) -> None:
    assert ChatTemplateConfig(name).to_template().messages2prompt(CHAT) == EXPECTED[name]


def test_every_builtin_is_covered() -> None:
    assert set(list_chat_templates()) == set(EXPECTED)


@pytest.mark.parametrize(("name", "stop"), [("chatml", "<|im_end|>"), ("qwen", "<|im_end|>"),
                                            ("internlm2", "<|im_end|>"), ("llama3", "<|eot_id|>"),
                                            ("llama2", "</s>"), ("mistral", "</s>"), ("vicuna", "</s>")])
def test_stop_words(name: str, stop: str) -> None:
    assert stop in CHAT_TEMPLATES[name]().stop_words


def test_default_system_prompt_and_string_input() -> None:
    qwen = CHAT_TEMPLATES["qwen"]()
    assert qwen.messages2prompt("hi") == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    # An explicit system message replaces the default one.
    assert "helpful" not in qwen.messages2prompt(CHAT)
    llama3 = CHAT_TEMPLATES["llama3"]()
    assert llama3.messages2prompt("hi") == (
        "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert "<|begin_of_text|>" not in llama3.messages2prompt(CHAT)  # the tokenizer adds the BOS


def test_sequence_start_false_drops_system_prompt() -> None:
    qwen = CHAT_TEMPLATES["qwen"]()
    later = qwen.messages2prompt("hi", sequence_start=False)
    assert later == "\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert qwen.get_prompt("hi", sequence_start=False) == qwen.messages2prompt("hi", sequence_start=False)
    assert CHAT_TEMPLATES["llama2"]().get_prompt("hi", sequence_start=False) == "<s>[INST] hi [/INST] "
    assert "InternLM" not in CHAT_TEMPLATES["internlm2"]().get_prompt("hi", sequence_start=False)


def test_base_returns_text_as_is() -> None:
    assert get_chat_template("some/unknown-model").messages2prompt("hello") == "hello"


def test_multipart_content_and_bad_role() -> None:
    chatml = CHAT_TEMPLATES["chatml"]()
    content = [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}]
    parts = [{"role": "user", "content": content}]
    assert chatml.messages2prompt(parts) == "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="role"):
        chatml.messages2prompt([{"role": "tool", "content": "x"}])


def test_config_overrides_builtin() -> None:
    cfg = ChatTemplateConfig("internlm2", meta_instruction="You are a robot.", stop_words=["<|x|>"])
    tpl = get_chat_template("whatever", cfg)
    assert type(tpl).__name__ == "InternLM2" and tpl.stop_words == ["<|x|>"]
    assert tpl.messages2prompt("hi").startswith(
        "<|im_start|>system\nYou are a robot.<|im_end|>\n<|im_start|>user\nhi")
    assert cfg.chat_template == tpl
    assert ChatTemplateConfig("chatml", capability="completion").to_template().messages2prompt("hi") == "hi"


def test_the_config_offers_every_template_field() -> None:
    """ChatTemplateConfig restates the template's fields (LMDeploy's API): the two lists stay equal."""
    from dataclasses import fields

    assert tuple(f.name for f in fields(ChatTemplateConfig))[1:] == TEMPLATE_FIELDS


def test_config_new_name_with_fields_is_custom_template() -> None:
    cfg = ChatTemplateConfig("mine", user="<u>", eoh="</u>", assistant="<a>", eoa="</a>")
    tpl = cfg.to_template()
    assert isinstance(tpl, BaseChatTemplate) and tpl.name == "mine"
    assert tpl.messages2prompt(CHAT[1:]) == "<u>U1</u><a>A1</a><u>U2</u><a>"


def test_unknown_name_raises_typed_error() -> None:
    with pytest.raises(UnknownChatTemplateError, match="conveyor list") as info:
        get_chat_template("x", ChatTemplateConfig("no-such-template"))
    assert isinstance(info.value, ValueError) and "llama3" in str(info.value)


@pytest.mark.parametrize("kwargs", [{"model_name": ""}, {"model_name": "qwen", "capability": "talk"},
                                    {"model_name": "qwen", "stop_words": "<|im_end|>"},
                                    {"model_name": "qwen", "user": 3}])
def test_config_validation(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ChatTemplateConfig(**kwargs)


def test_json_roundtrip(tmp_path: Path) -> None:
    cfg = ChatTemplateConfig("qwen", meta_instruction="中文 ok", stop_words=["<|im_end|>"], capability="chat")
    path = tmp_path / "tpl.json"
    text = cfg.to_json(path)
    assert json.loads(path.read_text(encoding="utf-8")) == json.loads(text)
    assert ChatTemplateConfig.from_json(path) == cfg
    assert ChatTemplateConfig.from_json(str(path)) == cfg
    assert ChatTemplateConfig.from_json(text) == cfg
    assert ChatTemplateConfig.from_json('{"model_name": "llama3"}') == ChatTemplateConfig("llama3")
    with pytest.raises(ValueError, match="valid keys"):
        ChatTemplateConfig.from_json('{"model_name": "llama3", "sytem": "x"}')
    with pytest.raises(ValueError, match="neither"):
        ChatTemplateConfig.from_json(str(tmp_path / "missing.json"))


@pytest.mark.parametrize(("path", "name"), [
    ("meta-llama/Meta-Llama-3-8B-Instruct", "llama3"),
    ("/models/llama3-8b", "llama3"),
    ("/models/llama3.1-8b", "llama3_1"),  # LMDeploy's llama3_1 rule: "llama3.1-" / "llama-3.1-"
    ("meta-llama/Llama-2-7b-chat-hf", "llama2"),
    ("Qwen/Qwen2-7B-Instruct", "qwen"),
    ("internlm/internlm2-chat-7b", "internlm2"),
    ("lmsys/vicuna-7b-v1.5", "vicuna"),
    ("liuhaotian/llava-v1.5-7b", "llava-v1"), ("liuhaotian/llava-v1.6-vicuna-7b", "llava-v1"),
    ("liuhaotian/llava-v1.6-34b", "llava-chatml"), ("01-ai/Yi-VL-6B", "yi-vl"),
    ("deepseek-ai/deepseek-vl-7b-chat", "deepseek-vl"), ("deepseek-ai/deepseek-llm-7b-chat", "deepseek"),
    ("mistralai/Mistral-7B-Instruct-v0.2", "mistral"),
    ("/hub/models--Qwen--Qwen2-7B/snapshots/0123abc", "qwen"),  # falls back to the full path
    ("/data/qwen-models/llama-2-7b-chat", "llama2"),  # the last component wins over parent folders
    ("gpt2", "base"),
])
def test_match_from_path(path: str, name: str) -> None:
    assert get_chat_template(path).name == name


def test_hf_template_matches_transformers(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tpl = get_chat_template(str(smollm2_dir), tokenizer=tok)
    assert isinstance(tpl, HFChatTemplate)
    assert tpl.stop_words == [tok.eos_token]
    for messages in (CHAT, CHAT[1:], [{"role": "user", "content": "hi"}]):
        assert tpl.messages2prompt(messages) == tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)
    assert tpl.messages2prompt("hi") == tpl.messages2prompt([{"role": "user", "content": "hi"}])
    later = tpl.messages2prompt("hi", sequence_start=False)
    assert later == "\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert not tpl.includes_bos  # SmolLM2's tokenizer adds no BOS of its own
    # An explicit config wins over the tokenizer's template.
    assert get_chat_template(str(smollm2_dir), ChatTemplateConfig("llama3"), tok).name == "llama3"


def test_cli_list(capsys: pytest.CaptureFixture[str]) -> None:
    from conveyor.cli import main

    assert main(["list"]) == 0
    out = capsys.readouterr().out.splitlines()
    families = out.index("model families (config.json architectures):")
    assert out[0] == "chat templates:" and [line.strip() for line in out[1:families]] == list_chat_templates()
    assert "LlamaForCausalLM" in [line.strip() for line in out[families + 1:]]


class _FakeBosTokenizer:
    """A tokenizer whose Jinja template renders the BOS that encoding also adds (like Llama 3's)."""

    chat_template = "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    bos_token, bos_token_id, eos_token = "<bos>", 1, "<eos>"

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [1, 7]}

    def apply_chat_template(self, messages: list[dict], tokenize: bool,
                            add_generation_prompt: bool) -> str:
        body = "".join(f"<{m['role']}>{m['content']}<eos>" for m in messages)
        return "<bos>" + body + ("<assistant>" if add_generation_prompt else "")


def test_hf_template_reports_bos_in_prompt() -> None:
    tpl = get_chat_template("m", tokenizer=_FakeBosTokenizer())
    assert tpl.includes_bos and tpl.stop_words == ["<eos>"]
    assert tpl.messages2prompt("hi", sequence_start=False) == "<user>hi<eos><assistant>"
