"""The chat template's request options: chat_template_kwargs reach a model's own Jinja template
(Qwen3's enable_thinking), built-in templates ignore what they do not know, add_generation_prompt
and continue_final_message end the prompt where asked, and a content list of text parts works
with Jinja templates of both kinds (those that loop over parts and those that expect a string)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.protocol import GenerateReq, InvalidRequestError, SamplingParams
from conveyor.services.tokenizer.chat_template import CHAT_TEMPLATES, HFChatTemplate, _reads_content_parts
from conveyor.services.tokenizer.preprocess import Preprocessor

# Qwen3's template, cut to what matters here: string content, and the empty think block that
# enable_thinking=false closes after the generation prompt.
THINKING = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")
# A multimodal-style template: it loops over the parts (and takes a string as it is).
PARTS = (
    "{%- for message in messages %}<{{ message['role'] }}>"
    "{%- if message['content'] is string %}{{ message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}[{{ part['type'] }}:{{ part['text'] }}]{%- endfor %}"
    "{%- endif %}</{{ message['role'] }}>{%- endfor %}"
    "{%- if add_generation_prompt %}<assistant>{%- endif %}")
# The same through a variable set from the content.
PARTS_BY_VARIABLE = (
    "{%- for message in messages %}{%- set c = message.content %}<{{ message.role }}>"
    "{%- if c is string %}{{ c }}{%- else %}{%- for part in c %}[{{ part.text }}]{%- endfor %}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<assistant>{%- endif %}")

PARTS_MESSAGE = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
WORDS = ["hi", "there", "x", "The", "answer", "is", "<think>", "</think>"]


def tokenizer(template: str):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "<s>", "</s>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="[UNK]")
    fast.chat_template = template
    return fast


@pytest.fixture(scope="module")
def thinking_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("thinking")
    tokenizer(THINKING).save_pretrained(path)
    return path


def test_chat_template_kwargs_reach_the_jinja_template() -> None:
    tpl = HFChatTemplate(tokenizer(THINKING))
    messages = [{"role": "user", "content": "x"}]
    thinking = tpl.messages2prompt(messages)
    assert thinking == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    assert tpl.messages2prompt(messages, enable_thinking=False) == thinking + "<think>\n\n</think>\n\n"
    assert tpl.messages2prompt(messages, enable_thinking=True) == thinking
    # A session's later turn renders with the same variables.
    later = tpl.messages2prompt("x", sequence_start=False, enable_thinking=False)
    assert later.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_builtin_templates_take_what_they_know_and_ignore_the_rest() -> None:
    messages = [{"role": "user", "content": "x"}]
    qwen3, chatml = CHAT_TEMPLATES["qwen3"](), CHAT_TEMPLATES["chatml"]()
    plain = qwen3.messages2prompt(messages)
    assert qwen3.messages2prompt(messages, enable_thinking=False) == plain + "<think>\n\n</think>\n\n"
    assert qwen3.messages2prompt(messages, enable_thinking=True, some_flag=3) == plain
    assert chatml.messages2prompt(messages, enable_thinking=False, some_flag=3) == chatml.messages2prompt(messages)
    # No generation prompt: no think block either.
    assert qwen3.messages2prompt(messages, add_generation_prompt=False, enable_thinking=False) == \
        "<|im_start|>user\nx<|im_end|>\n"


@pytest.mark.parametrize("name", sorted(n for n, cls in CHAT_TEMPLATES.items() if cls().assistant))
def test_every_builtin_ends_where_asked(name: str) -> None:
    tpl = CHAT_TEMPLATES[name]()
    chat = [{"role": "user", "content": "U"}]
    full = tpl.messages2prompt(chat)
    bare = tpl.messages2prompt(chat, add_generation_prompt=False)
    assert full.startswith(bare) and full != bare and bare.rstrip().endswith("U" + tpl.eoh.rstrip())
    answered = [*chat, {"role": "assistant", "content": "The answer is "}]
    continued = tpl.messages2prompt(answered, continue_final_message=True)
    # The chat up to where the assistant's text starts, then that text as it is (trailing space kept).
    assert continued.removesuffix("The answer is ") in (full, bare + tpl.assistant)
    assert tpl.messages2prompt(answered, add_generation_prompt=False).startswith(continued)


def test_continue_final_message_on_a_jinja_template() -> None:
    tpl = HFChatTemplate(tokenizer(THINKING))
    chat = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "The answer is "}]
    assert tpl.messages2prompt(chat, continue_final_message=True) == \
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\nThe answer is "
    assert tpl.messages2prompt(chat[:1], add_generation_prompt=False) == "<|im_start|>user\nx<|im_end|>\n"
    with pytest.raises(InvalidRequestError, match="assistant"):
        tpl.messages2prompt(chat[:1], continue_final_message=True)


def test_text_parts_are_joined_for_a_template_that_expects_a_string() -> None:
    tpl = HFChatTemplate(tokenizer(THINKING))
    assert not tpl.reads_parts
    # transformers itself would raise TypeError ('...' + a list) on this template.
    with pytest.raises(TypeError):
        tpl.tokenizer.apply_chat_template(PARTS_MESSAGE, tokenize=False)
    assert tpl.messages2prompt(PARTS_MESSAGE) == "<|im_start|>user\nhi\nthere<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("template", [PARTS, PARTS_BY_VARIABLE])
def test_text_parts_are_kept_for_a_template_that_loops_over_them(template: str) -> None:
    tpl = HFChatTemplate(tokenizer(template))
    assert tpl.reads_parts
    prompt = tpl.messages2prompt(PARTS_MESSAGE)
    assert "hi]" in prompt and "there]" in prompt and "hi\nthere" not in prompt
    assert tpl.messages2prompt([{"role": "user", "content": "x"}]) == "<user>x</user><assistant>" or \
        tpl.messages2prompt([{"role": "user", "content": "x"}]) == "<user>x<assistant>"


@pytest.mark.parametrize("source, expected", [
    ("{% for m in messages %}{{ m.content }}{% endfor %}", False),
    ("{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}", True),
    ("{% for m in messages %}{% for p in m['content'] | selectattr('type') %}{% endfor %}{% endfor %}", True),
    ("{% generation %}x{% endgeneration %}", False),  # a tag only transformers knows: read as strings
    ("{% for m in messages %}{% for k in m.tool_calls %}{% endfor %}{% endfor %}", False),
])
def test_which_templates_read_parts(source: str, expected: bool) -> None:
    assert _reads_content_parts(source) is expected


def test_preprocessor_prepares_with_the_request_options(thinking_dir: Path) -> None:
    pre = Preprocessor(thinking_dir, 256)
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    req = GenerateReq("r", "", SamplingParams(), messages=messages)
    plain = pre.prepare(req).token_ids
    no_think = pre.prepare(GenerateReq("r", "", SamplingParams(), messages=messages,
                                       chat_template_kwargs={"enable_thinking": False})).token_ids
    think = pre.tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    assert no_think[:len(plain)] == plain and no_think[len(plain):] == think
    cont = pre.prepare(GenerateReq("r", "", SamplingParams(), continue_final_message=True, add_generation_prompt=False,
                                   messages=[*messages, {"role": "assistant", "content": "The answer"}])).token_ids
    assert pre.tokenizer.convert_ids_to_tokens(cont[-2:]) == ["The", "answer"]


@pytest.mark.parametrize("kwargs, hint", [
    ({"add_generation_prompt": False}, "request's own"),
    ({"chat_template": "{{ 1 }}"}, "server's"),
    ({"eos_token": "x"}, "special tokens"),
    ({"1x": 1}, "variable name"),
])
def test_reserved_template_kwargs_are_refused(thinking_dir: Path, kwargs: dict, hint: str) -> None:
    pre = Preprocessor(thinking_dir, 256)
    with pytest.raises(InvalidRequestError, match=hint) as err:
        pre.render([{"role": "user", "content": "x"}], chat_template_kwargs=kwargs)
    assert err.value.param == "chat_template_kwargs"
