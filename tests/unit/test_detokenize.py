"""Tests for conveyor.services.detokenizer.incremental (incremental detokenization + stop strings)."""

from __future__ import annotations

import random

import pytest

from conveyor.services.detokenizer.incremental import IncrementalDetokenizer


TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x  *  2\n\n\tif x:\n        pass  ",
    "Smile 🙂 please 🙂🙂 ok",
    "你好世界，这是一个测试。",
    "Café crème brûlée, naïve résumé é",
    "   leading spaces and trailing   ",
    "Mixed: 日本語 and English and emoji 👍🏽 and ünïcödé",
    "1234567890 + 0.5 = 1234567890.5",
    "<html><body>x &amp; y</body></html>",
    "\n\nNew lines\n\n\nand tabs\t\there",
    "Family 👨‍👩‍👧‍👦 ZWJ sequence",
    "Ελληνικά και русский текст",
]


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir):
    """The test model's byte-level BPE tokenizer (the shared fixture fetches the model)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="module")
def sp_tokenizer():
    """A tiny Llama-style SentencePiece tokenizer (Unigram, "▁" spaces, byte fallback)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast
    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    vocab += [(f"<0x{b:02X}>", -10.0) for b in range(256)]
    words = ["▁Hello", "▁world", "▁the", "▁cat", "▁sat", "▁on", "▁mat", "▁", "Hello", "!", ",", "."]
    vocab += [(w, -1.0) for w in words] + [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyzHW"]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def stream(det: IncrementalDetokenizer, ids: list[int], chunks: list[int] | None = None) -> list[str]:
    """Feed ids (one at a time or in the given chunk sizes); return the deltas incl. finish()."""
    deltas, i = [], 0
    for n in chunks or [1] * len(ids):
        deltas.append(det.step(ids[i:i + n]).text)
        i += n
    deltas.append(det.finish())
    return deltas


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode(smollm2_tokenizer, text):
    ids = enc(smollm2_tokenizer, text)
    deltas = stream(IncrementalDetokenizer(smollm2_tokenizer), ids)
    assert "".join(deltas) == smollm2_tokenizer.decode(ids) == text
    # Byte tokens of a multi-byte char are held back, never shown half-done.
    assert all("\ufffd" not in d for d in deltas)


def test_random_chunks_equal_full_decode(smollm2_tokenizer):
    rng = random.Random(0)
    for text in TEXTS:
        ids = enc(smollm2_tokenizer, text)
        chunks, left = [], len(ids)
        while left:
            chunks.append(min(left, rng.randint(1, 5)))
            left -= chunks[-1]
        det = IncrementalDetokenizer(smollm2_tokenizer)
        assert "".join(stream(det, ids, chunks)) == text == det.output_text


def test_prompt_context(smollm2_tokenizer):
    prompt, out = enc(smollm2_tokenizer, "The answer is"), enc(smollm2_tokenizer, " 42 🙂 done")
    det = IncrementalDetokenizer(smollm2_tokenizer, prompt_ids=prompt)
    assert "".join(stream(det, out)) == smollm2_tokenizer.decode(prompt + out)[len("The answer is"):]


def test_emoji_byte_tokens_never_broken(smollm2_tokenizer):
    ids = enc(smollm2_tokenizer, "🙂🙂你好世界")
    assert any("\ufffd" in smollm2_tokenizer.decode([i]) for i in ids)  # really split into bytes
    det = IncrementalDetokenizer(smollm2_tokenizer)
    for i in ids:
        assert "\ufffd" not in det.step([i]).text
    assert det.finish() == "" and det.output_text == "🙂🙂你好世界"


def test_incomplete_char_released_on_finish(smollm2_tokenizer):
    ids = enc(smollm2_tokenizer, "ok 你好世界")
    det = IncrementalDetokenizer(smollm2_tokenizer)
    text = "".join(det.step([i]).text for i in ids[:-1])  # cut the emoji short
    assert "\ufffd" not in text
    tail = det.finish()
    assert tail.endswith("\ufffd") and text + tail == smollm2_tokenizer.decode(ids[:-1])


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens(smollm2_tokenizer, include):
    ids = enc(smollm2_tokenizer, "Hello there. STOP_HERE and more text")
    det = IncrementalDetokenizer(smollm2_tokenizer, stop_strings=["STOP_HERE"], include_stop_str=include)
    for n, i in enumerate(ids, 1):  # noqa: B007 - n is read after the loop: the tokens it took
        res = det.step([i])
        assert "STOP" not in det.output_text or (include and res.stopped)
        if res.stopped:
            break
    assert res.stopped
    assert det.output_text == ("Hello there. STOP_HERE" if include else "Hello there. ")
    # num_tokens: exactly the tokens needed to complete the stop string.
    assert res.num_tokens == n and "STOP_HERE" in smollm2_tokenizer.decode(ids[:n])
    assert "STOP_HERE" not in smollm2_tokenizer.decode(ids[:n - 1])
    assert det.step(enc(smollm2_tokenizer, " more")).text == "" and det.finish() == ""


def test_stop_in_one_chunk_ignores_later_tokens(smollm2_tokenizer):
    ids = enc(smollm2_tokenizer, "abc END xyz")
    det = IncrementalDetokenizer(smollm2_tokenizer, stop_strings=["END"])
    res = det.step(ids)
    assert res.stopped and res.text == "abc " and res.num_tokens < len(ids)
    assert "END" in smollm2_tokenizer.decode(ids[:res.num_tokens])


def test_partial_stop_prefix_released_later(smollm2_tokenizer):
    ids = enc(smollm2_tokenizer, "We are STOPPING soon")
    det = IncrementalDetokenizer(smollm2_tokenizer, stop_strings=["STOP!"])
    deltas = stream(det, ids)
    assert "".join(deltas) == "We are STOPPING soon" and not det.stopped
    # The "STOP" prefix was held back until the text diverged from the stop string.
    released = ""
    for d in deltas:
        released += d
        assert not released.endswith(("S", "ST", "STO", "STOP")) or released.endswith("STOPPING soon")


def test_finish_flushes_held_stop_prefix(smollm2_tokenizer):
    det = IncrementalDetokenizer(smollm2_tokenizer, stop_strings=["</answer>"])
    text = det.step(enc(smollm2_tokenizer, "result </ans")).text
    assert text == "result " and det.finish() == "</ans"
    assert det.output_text == "result </ans"


def test_earliest_stop_wins(smollm2_tokenizer):
    det = IncrementalDetokenizer(smollm2_tokenizer, stop_strings=["world", "lo w", "xyz"])
    res = det.step(enc(smollm2_tokenizer, "Hello world xyz"))
    assert res.stopped and res.text == "Hel"
    det = IncrementalDetokenizer(smollm2_tokenizer, stop_strings=["xyz", "world"], include_stop_str=True)
    assert det.step(enc(smollm2_tokenizer, "Hello world xyz")).text == "Hello world"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(smollm2_tokenizer, skip):
    tok = smollm2_tokenizer
    ids = enc(tok, "Hi there") + [tok.convert_tokens_to_ids("<|im_end|>")] + enc(tok, " after")
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    out = "".join(stream(det, ids))
    assert out == tok.decode(ids, skip_special_tokens=skip)
    assert out == ("Hi there after" if skip else "Hi there<|im_end|> after")


def test_sentencepiece_leading_space(sp_tokenizer):
    tok = sp_tokenizer
    for text in ["Hello world, the cat sat on the mat.", "Hi 🙂 é 你好 world", "the  cat"]:
        ids = enc(tok, text)
        deltas = stream(IncrementalDetokenizer(tok), ids)
        assert "".join(deltas) == tok.decode(ids) == text
        assert all("\ufffd" not in d for d in deltas)
    # With prompt context the first output token keeps its leading space, as in a full decode.
    prompt, out = enc(tok, "Hello"), enc(tok, "world the cat")
    assert tok.decode(out) == "world the cat"  # decoded alone, the "▁" is stripped
    det = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert "".join(stream(det, out)) == " world the cat" == tok.decode(prompt + out)[len("Hello"):]


def test_invalid_byte_runs_released(smollm2_tokenizer):
    # Lone lead / continuation bytes never form a character; after a bounded hold they
    # are released as U+FFFD, and the total still equals the full decode.
    tok = smollm2_tokenizer
    lead, cont = enc(tok, "你")[:2]
    ids = [lead] * 3 + [cont] * 12 + enc(tok, " ok") + [lead] * 10 + enc(tok, "你x")
    assert "".join(stream(IncrementalDetokenizer(tok), ids)) == tok.decode(ids)
