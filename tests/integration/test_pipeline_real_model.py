"""The offline pipeline on the real SmolLM2-135M-Instruct, checked against Hugging Face transformers."""

from __future__ import annotations

import math

import pytest
import torch

from conveyor import (
    ChatTemplateConfig,
    EngineConfig,
    GenerationConfig,
    InvalidRequestError,
    PromptTooLongError,
    UnknownChatTemplateError,
    UnsupportedModelError,
    pipeline,
)

from chat_prompts import PROMPTS

MAX_NEW = 24
GREEDY = GenerationConfig(max_new_tokens=MAX_NEW, top_k=1)


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return tok, model


def hf_chat_ids(tok, prompt: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    return tok.encode(text)


@pytest.fixture(scope="module")
def hf_greedy(hf):
    tok, model = hf
    out = {}
    for p in PROMPTS:
        ids = hf_chat_ids(tok, p)
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False)
        out[p] = (len(ids), gen[0, len(ids):].tolist())
    return out


@pytest.fixture(scope="module")
def pipe(smollm2_dir):
    # Small blocks so prompts span several blocks and block boundaries are exercised.
    cfg = EngineConfig(cache_max_entry_count=512, block_size=16, max_prefill_token_num=512)
    with pipeline(str(smollm2_dir), cfg) as p:
        yield p


@pytest.fixture(scope="module")
def prefix_pipe(smollm2_dir):
    cfg = EngineConfig(cache_max_entry_count=256, block_size=16, enable_prefix_caching=True)
    with pipeline(str(smollm2_dir), cfg) as p:
        yield p


def test_greedy_matches_transformers_one_at_a_time(pipe, hf_greedy):
    for p in PROMPTS:
        r = pipe(p, GREEDY)
        n_in, expected = hf_greedy[p]
        assert r.input_token_len == n_in
        assert r.token_ids == expected, p
        assert r.generate_token_len == len(expected)
        assert r.finish_reason == ("stop" if len(expected) < MAX_NEW else "length")


def test_greedy_matches_transformers_in_one_batch(pipe, hf_greedy):
    responses = pipe(PROMPTS, GREEDY)
    assert len(responses) == len(PROMPTS)
    for p, r in zip(PROMPTS, responses):
        assert r.input_token_len == hf_greedy[p][0]
        assert r.token_ids == hf_greedy[p][1], p


def test_chunked_prefill_gives_same_tokens(smollm2_dir, hf_greedy):
    # A 7-token budget cuts every prompt into chunks that straddle 16-token blocks.
    cfg = EngineConfig(cache_max_entry_count=256, block_size=16, max_prefill_token_num=7)
    with pipeline(str(smollm2_dir), cfg) as p:
        for prompt, r in zip(PROMPTS[:3], p(PROMPTS[:3], GREEDY)):
            assert r.token_ids == hf_greedy[prompt][1]


def test_openai_messages_and_text_match(pipe):
    a = pipe([{"role": "user", "content": PROMPTS[0]}], GREEDY)
    b = pipe(PROMPTS[0], GREEDY)
    assert a.text == b.text and a.token_ids == b.token_ids
    batch = pipe([[{"role": "user", "content": PROMPTS[0]}], [{"role": "user", "content": PROMPTS[1]}]], GREEDY)
    assert [r.index for r in batch] == [0, 1]


def test_stream_concatenation_equals_non_stream(pipe):
    gen = GenerationConfig(max_new_tokens=40, top_k=1)
    full = pipe(PROMPTS[:4], gen)
    texts, ids, reasons = [""] * 4, [[] for _ in range(4)], [[] for _ in range(4)]
    for chunk in pipe.stream_infer(PROMPTS[:4], gen):
        texts[chunk.index] += chunk.text
        ids[chunk.index] += chunk.token_ids
        reasons[chunk.index].append(chunk.finish_reason)
    for i, r in enumerate(full):
        assert texts[i] == r.text
        assert ids[i] == r.token_ids
        assert [x for x in reasons[i] if x is not None] == [r.finish_reason]  # exactly one
        assert reasons[i][-1] is not None


def test_prefix_cache_reuses_blocks_and_keeps_tokens(prefix_pipe, pipe):
    system = "You are a careful assistant. " * 12  # a long shared prefix, several blocks
    msgs = lambda q: [{"role": "system", "content": system}, {"role": "user", "content": q}]
    first = prefix_pipe(msgs("Name a fruit."), GREEDY)
    second = prefix_pipe(msgs("Name a planet."), GREEDY)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= 64  # the shared system prompt came from the cache
    assert second.num_cached_tokens % 16 == 0
    plain = pipe(msgs("Name a planet."), GREEDY)
    assert second.token_ids == plain.token_ids
    assert prefix_pipe._stack.call(lambda e: e.stats()).prefix_hit_tokens >= second.num_cached_tokens


def test_chat_turn_returns_a_logprob_entry_per_token(pipe):
    """A non-streamed chat turn gathers every streamed piece's logprobs, not only the last one's."""
    sess = pipe.chat("Say hello.", gen_config=GenerationConfig(max_new_tokens=8, top_k=1, logprobs=3))
    assert len(sess.response.logprobs) == len(sess.response.token_ids) > 1
    assert all(len(lp) >= 1 for lp in sess.response.logprobs)
    sess.close()


def test_multi_turn_session_equals_full_history(pipe, hf):
    tok, _ = hf
    gen = GenerationConfig(max_new_tokens=32, top_k=1)
    sess = pipe.chat("What is the capital of France?", gen_config=gen)
    first = sess.response.text
    # Equal only if the first turn ended on its end-of-turn token, as the template renders it.
    assert sess.response.finish_reason == "stop"
    sess = pipe.chat("And of Germany?", session=sess, gen_config=gen)
    # The same conversation sent as one message list must give the same second answer.
    history = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "And of Germany?"},
    ]
    again = pipe(history, gen)
    assert sess.response.text == again.text
    assert len(sess.history) == 2
    # Only the new turn's tokens were sent; the history came from the session's KV.
    assert sess.response.input_token_len < again.input_token_len
    sess.close()
    assert pipe._stack.call(lambda e: e.block_manager.num_free_blocks) == pipe.engine.block_manager.num_blocks


def test_session_survives_eviction(smollm2_dir):
    # 12 blocks of 16 tokens: a second session's long prompt forces the first one out.
    cfg = EngineConfig(cache_max_entry_count=12, block_size=16)
    gen = GenerationConfig(max_new_tokens=8, top_k=1)
    with pipeline(str(smollm2_dir), cfg) as p:
        a = p.chat("Say hello.", gen_config=gen)
        b = p.chat("Count: " + "one two three " * 25, gen_config=gen)
        a = p.chat("Say goodbye.", session=a, gen_config=gen)
        assert a.response.finish_reason in ("stop", "length")
        assert a.response.generate_token_len > 0
        a.close()
        b.close()
        assert p.engine.block_manager.num_free_blocks == 12


def test_seed_reproducible_whatever_the_batch(pipe):
    gen = GenerationConfig(max_new_tokens=16, top_k=50, top_p=0.9, temperature=1.0, random_seed=1234)
    alone = pipe(PROMPTS[1], gen)
    others = GenerationConfig(max_new_tokens=16, top_k=0, temperature=1.2)
    batch = pipe([PROMPTS[1], PROMPTS[2], PROMPTS[3]], gen)
    mixed_thread = pipe(PROMPTS[2:5], others)  # noqa: F841 - runs other sampled traffic in between
    assert batch[0].token_ids == alone.token_ids
    assert pipe(PROMPTS[1], gen).token_ids == alone.token_ids


def test_n_samples(pipe):
    gen = GenerationConfig(n=3, max_new_tokens=12, top_k=0, temperature=1.0, random_seed=7)
    out = pipe(["Tell me a story.", "Pick a number."], gen)
    assert len(out) == 6
    assert [r.index for r in out] == [0, 0, 0, 1, 1, 1]
    assert len({tuple(r.token_ids) for r in out[:3]}) > 1  # different seeds per sample


def test_stop_words_multi_token_are_not_returned(pipe):
    prompt, gen = PROMPTS[1], GenerationConfig(max_new_tokens=40, top_k=1)
    base = pipe(prompt, gen)
    stop = base.text[12:21]  # nine characters from the middle: several tokens
    assert len(pipe.tokenizer.encode(stop, add_special_tokens=False)) > 1
    r = pipe(prompt, GenerationConfig(max_new_tokens=40, top_k=1, stop_words=[stop]))
    assert r.finish_reason == "stop"
    assert r.text == base.text[: base.text.index(stop)]
    assert r.generate_token_len < base.generate_token_len
    kept = pipe(prompt, GenerationConfig(max_new_tokens=40, top_k=1, stop_words=[stop],
                                         include_stop_str_in_output=True))
    assert kept.text == base.text[: base.text.index(stop) + len(stop)]


def test_bad_words_never_generated(pipe):
    base = pipe(PROMPTS[0], GREEDY)
    assert "Paris" in base.text
    r = pipe(PROMPTS[0], GenerationConfig(max_new_tokens=MAX_NEW, top_k=1, bad_words=[" Paris"]))
    assert "Paris" not in r.text


def test_ignore_eos_and_min_new_tokens(pipe):
    r = pipe(PROMPTS[0], GenerationConfig(max_new_tokens=30, top_k=1, ignore_eos=True))
    assert r.generate_token_len == 30 and r.finish_reason == "length"
    r = pipe(PROMPTS[0], GenerationConfig(max_new_tokens=30, top_k=1, min_new_tokens=15))
    assert r.generate_token_len >= 15


def test_logprobs_match_transformers(pipe, hf):
    tok, model = hf
    r = pipe(PROMPTS[0], GenerationConfig(max_new_tokens=5, top_k=1, logprobs=3))
    assert len(r.logprobs) == len(r.token_ids)
    ids = hf_chat_ids(tok, PROMPTS[0]) + r.token_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits, -1)
    start = len(ids) - len(r.token_ids) - 1
    for i, (tid, entry) in enumerate(zip(r.token_ids, r.logprobs)):
        assert len(entry) >= 3 and tid in entry
        assert math.isclose(entry[tid], ref[start + i, tid].item(), abs_tol=1e-3)


def test_get_ppl_matches_transformers(pipe, hf):
    tok, model = hf
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 6)
    loss = pipe.get_ppl(ids)[0]
    with torch.no_grad():
        ref = model(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    assert math.isclose(loss, ref, rel_tol=1e-4)
    assert len(pipe.get_ppl([ids, ids[:10]])) == 2


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda p: p("", GREEDY), InvalidRequestError),
        (lambda p: p([], GREEDY), InvalidRequestError),
        (lambda p: p([{"role": "wizard", "content": "x"}], GREEDY), InvalidRequestError),
        (lambda p: p("hi", GenerationConfig(max_new_tokens=0)), InvalidRequestError),
        (lambda p: p("hi", GenerationConfig(temperature=-1)), InvalidRequestError),
        (lambda p: p("word " * 9000, GREEDY), PromptTooLongError),
        (lambda p: p.get_ppl([1]), InvalidRequestError),
    ],
)
def test_bad_input_raises_typed_error_and_engine_keeps_serving(pipe, call, error):
    with pytest.raises(error) as info:
        call(pipe)
    assert str(info.value)  # a message that names the fix
    assert pipe(PROMPTS[0], GenerationConfig(max_new_tokens=4, top_k=1)).generate_token_len == 4
    bm = pipe.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # nothing leaked


def test_images_to_a_text_model_are_refused(pipe):
    from PIL import Image

    with pytest.raises(InvalidRequestError, match="takes no images"):
        pipe(("Describe the picture.", Image.new("RGB", (32, 32), (200, 30, 30))), GREEDY)
    bm = pipe.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_prompt_too_long_names_both_numbers(smollm2_dir):
    with pipeline(str(smollm2_dir), EngineConfig(session_len=64, cache_max_entry_count=32, block_size=16)) as p:
        with pytest.raises(PromptTooLongError, match=r"\d+ tokens but session_len is 64"):
            p("word " * 100)
        r = p("Hi", GenerationConfig(max_new_tokens=200, top_k=1, ignore_eos=True))
        assert r.finish_reason == "length" and r.input_token_len + r.generate_token_len == 64


def test_unknown_template_and_unsupported_model(smollm2_dir, tmp_path):
    with pytest.raises(UnknownChatTemplateError, match="conveyor list"):
        pipeline(str(smollm2_dir), EngineConfig(cache_max_entry_count=8),
                 chat_template_config=ChatTemplateConfig(model_name="no-such-template"))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        pipeline(str(tmp_path))


def test_abandoned_stream_frees_its_blocks(pipe):
    stream = pipe.stream_infer(PROMPTS[:3], GenerationConfig(max_new_tokens=64, top_k=1, ignore_eos=True))
    next(stream)
    stream.close()  # the consumer walks away mid-generation
    bm = pipe.engine.block_manager
    pipe._stack.call(lambda e: None)  # let the engine thread process the aborts
    assert pipe._stack.call(lambda e: e.block_manager.num_free_blocks) == bm.num_blocks
    assert not pipe.engine.scheduler.has_work


def test_plain_script_without_main_guard(smollm2_dir, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text(
        "from conveyor import pipeline, EngineConfig, GenerationConfig\n"
        f"pipe = pipeline({str(smollm2_dir)!r}, EngineConfig(cache_max_entry_count=32, block_size=16))\n"
        "print(pipe('Hi', GenerationConfig(max_new_tokens=3, ignore_eos=True)).generate_token_len)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "3"


def test_gguf_file_through_the_pipeline(smollm2_dir, hf_greedy):
    pytest.importorskip("gguf")
    from conveyor.default_model import gguf_path

    with pipeline(str(gguf_path(smollm2_dir)), EngineConfig(cache_max_entry_count=64, block_size=16)) as p:
        r = p(PROMPTS[0], GREEDY)
    assert r.token_ids == hf_greedy[PROMPTS[0]][1]


def test_a_streamed_turn_stopped_early_stays_in_the_session(pipe):
    gen = GenerationConfig(max_new_tokens=48, top_k=1, ignore_eos=True)
    sess = pipe.session()
    stream = pipe.chat("Tell me a long story about a cat.", session=sess, gen_config=gen, stream_response=True)
    next(stream), next(stream)
    stream.close()  # what Ctrl-C in `conveyor chat` does: the engine aborts the turn before this returns
    assert len(sess.history) == 1
    pipe.chat("Shorter, please.", session=sess, gen_config=GenerationConfig(max_new_tokens=4, top_k=1))
    assert len(sess.history) == 2
    sess.close()
    assert pipe._stack.call(lambda e: e.block_manager.num_free_blocks) == pipe.engine.block_manager.num_blocks


def test_the_default_model_by_name(smollm2_dir):
    with pipeline("SmolLM2-135M-Instruct", EngineConfig(cache_max_entry_count=64, block_size=16)) as p:
        assert p.model_path == smollm2_dir
        assert p("Hi", GenerationConfig(max_new_tokens=2, ignore_eos=True)).generate_token_len == 2
