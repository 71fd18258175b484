"""The tokenizer stage's logic on the real model's tokenizer and chat template (no weights)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conveyor.engine.hf_config import config_eos_ids
from conveyor.engine.weight_loader import load_model_config
from conveyor.protocol import GenerateReq, InvalidRequestError, PromptTooLongError, SamplingParams
from conveyor.services.tokenizer.loader import load_tokenizer
from conveyor.services.tokenizer.preprocess import Preprocessor


@pytest.fixture(scope="module")
def pre(smollm2_dir) -> Preprocessor:
    return Preprocessor(smollm2_dir, 256, model_eos_ids=config_eos_ids(smollm2_dir))  # as the stage's process


# What run_tokenizer_process and run_detokenizer_process import and build before they serve.
_STAGES = """
import sys
from conveyor.engine.hf_config import config_eos_ids
from conveyor.services.detokenizer.batches import Detokenizer
from conveyor.services.detokenizer.process import run_detokenizer_process
from conveyor.services.tokenizer.chat_template import template_config
from conveyor.services.tokenizer.loader import load_tokenizer
from conveyor.services.tokenizer.preprocess import Preprocessor
from conveyor.services.tokenizer.process import run_tokenizer_process
model = sys.argv[1]
Preprocessor(model, 256, template_config(None), config_eos_ids(model))
Detokenizer(load_tokenizer(model))
print(sorted(m for m in ("torch", "triton") if m in sys.modules))
"""


def test_the_stateless_stages_start_without_torch(smollm2_dir) -> None:
    """The tokenizer and detokenizer stages read end ids as JSON and load the tokenizer without
    AutoTokenizer (which imports torch): ~110 MiB a process instead of ~350-420 MiB."""
    out = subprocess.run([sys.executable, "-c", _STAGES, str(smollm2_dir)], capture_output=True, text=True,
                         timeout=300, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_stage_reads_the_end_ids_the_engine_reads(smollm2_dir) -> None:
    assert config_eos_ids(smollm2_dir) == load_model_config(smollm2_dir).eos_token_ids


def test_the_tokenizer_is_the_one_autotokenizer_loads(smollm2_dir) -> None:
    """The torch-free load gives AutoTokenizer's class, vocabulary, special tokens and template."""
    from transformers import AutoTokenizer

    ours, auto = load_tokenizer(smollm2_dir), AutoTokenizer.from_pretrained(str(smollm2_dir))
    assert type(ours) is type(auto) and len(ours) == len(auto)
    assert ours.special_tokens_map == auto.special_tokens_map and ours.chat_template == auto.chat_template
    text = "<|im_start|>user\nHello, wörld! 123 \u4f60\u597d<|im_end|>\n"
    for special in (True, False):
        assert ours.encode(text, add_special_tokens=special) == auto.encode(text, add_special_tokens=special)
    ids = auto.encode(text)
    assert ours.decode(ids) == auto.decode(ids)


def _req(**kw) -> GenerateReq:
    return GenerateReq("r", "inproc://ingress", kw.pop("params", SamplingParams()), **kw)


def test_words_become_ids_and_the_model_end_ids_stop(pre) -> None:
    params = SamplingParams(stop_words=["Paris"], bad_words=["Hello", "hello there"], stop_token_ids=[5])
    out = pre.prepare(_req(prompt="Hi", params=params))
    tok = pre.tokenizer
    assert set(pre.eos_token_ids) | {5} == set(out.params.stop_token_ids)
    assert tok.convert_tokens_to_ids("<|im_end|>") in out.params.stop_token_ids  # the template's end of turn
    assert out.params.bad_token_ids == tok.encode("Hello", add_special_tokens=False)
    assert out.params.bad_sequences == [tok.encode("hello there", add_special_tokens=False)]
    assert out.params.stop_words == ["Paris"]  # matched on text by the detokenizer
    assert out.reply_to == "inproc://ingress" and out.first_turn_ids is None
    assert pre.prepare(_req(prompt="Hi", params=SamplingParams(ignore_eos=True))).params.stop_token_ids == []


def test_a_turn_left_to_the_engine_is_rendered_both_ways(pre) -> None:
    later = pre.prepare(_req(prompt="And of Germany?", session_id=3, sequence_start=False))
    first = pre.prepare(_req(prompt="And of Germany?", session_id=3, sequence_start=True))
    either = pre.prepare(_req(prompt="And of Germany?", session_id=3, sequence_start=None))
    assert either.token_ids == later.token_ids and either.first_turn_ids == first.token_ids
    assert len(first.token_ids) > len(later.token_ids)  # the first turn carries the system prompt
    # A whole conversation renders the same either way: nothing extra is sent.
    chat = [{"role": "user", "content": "Hi"}]
    assert pre.prepare(_req(messages=chat, session_id=3, sequence_start=None)).first_turn_ids is None


@pytest.mark.parametrize("req, param", [
    (_req(prompt=""), "prompt"),
    (_req(input_ids=[]), "prompt"),
    (_req(), "prompt"),
    (_req(prompt="x", params=SamplingParams(temperature=-1.0)), "temperature"),
    (_req(prompt="x", params=SamplingParams(stop_token_ids=[10**9])), "stop_token_ids"),
    (_req(prompt="x", params=SamplingParams(stop_words=[""])), "stop_words"),
    (_req(messages=[{"role": "wizard", "content": "x"}]), "messages"),
])
def test_bad_requests_name_the_field(pre, req, param) -> None:
    with pytest.raises(InvalidRequestError) as err:
        pre.prepare(req)
    assert err.value.param == param


def test_a_prompt_over_session_len(pre) -> None:
    with pytest.raises(PromptTooLongError, match="but session_len is 256") as err:
        pre.prepare(_req(input_ids=[1] * 300))
    assert err.value.param == "prompt"  # /v1/completions' field (was "messages" for every request)
    with pytest.raises(PromptTooLongError) as err:
        pre.prepare(_req(prompt="word " * 300, do_preprocess=False))
    assert err.value.param == "prompt"
    with pytest.raises(PromptTooLongError) as err:
        pre.prepare(_req(messages=[{"role": "user", "content": "word " * 300}]))
    assert err.value.param == "messages"
