"""Overlapped steps (step N+1 queued before step N is read back) change nothing a user can see.

The same mixed workload runs on the real SmolLM2 with overlap on and off; every request must get
the same tokens, finish reasons and logprobs, and every KV block must come back. The cases that
the overlap makes delicate are all in it: a stop token sampled while the next step (which already
holds that sequence) is queued; ``max_new_tokens`` reached at launch; chunked prompts beside
decodes; a repetition penalty (which turns the overlap off for its steps); prefix caching; a
session's second turn; and aborts of sequences whose next token is still on the device.
"""

from __future__ import annotations

import pytest

from conveyor.engine.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.protocol.sampling import SamplingParams
from conveyor.protocol import Finish as FinishReason

from chat_prompts import PROMPTS


def _token(out) -> list[int]:
    """A step output's new token, as a list (empty when it brought none)."""
    return [] if out.token is None else [out.token]


@pytest.fixture(scope="module")
def engines(smollm2_dir):
    def make(overlap: bool) -> LLMEngine:
        cfg = EngineConfig(cache_max_entry_count=64, block_size=16, max_prefill_token_num=48,
                           enable_prefix_caching=True, overlap_schedule=overlap)
        return LLMEngine(smollm2_dir, cfg)

    return {True: make(True), False: make(False)}


def _chat_ids(engine: LLMEngine, prompt: str) -> list[int]:
    from conveyor.services.tokenizer.preprocess import load_tokenizer

    tok = load_tokenizer(engine.model_path)
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    return tok.encode(text)


def _eos(engine: LLMEngine) -> list[int]:
    from conveyor.services.tokenizer.preprocess import load_tokenizer

    return [load_tokenizer(engine.model_path).convert_tokens_to_ids("<|im_end|>")]


def _workload(engine: LLMEngine) -> list[tuple[list[int], SamplingParams]]:
    eos = _eos(engine)
    greedy = SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=eos)
    return [
        (_chat_ids(engine, PROMPTS[0]), greedy),  # stops on <|im_end|> well before 40
        (_chat_ids(engine, PROMPTS[1]), SamplingParams(max_new_tokens=7, temperature=0.0, stop_token_ids=eos)),
        (_chat_ids(engine, PROMPTS[2]), SamplingParams(max_new_tokens=30, temperature=0.9, top_p=0.9,
                                                       random_seed=11, stop_token_ids=eos)),
        (_chat_ids(engine, PROMPTS[3]), SamplingParams(max_new_tokens=25, temperature=0.0, logprobs=2,
                                                       stop_token_ids=eos)),
        (_chat_ids(engine, PROMPTS[4]), SamplingParams(max_new_tokens=20, temperature=0.7, top_k=20,
                                                       repetition_penalty=1.3, random_seed=5, stop_token_ids=eos)),
        (_chat_ids(engine, PROMPTS[0]), greedy),  # same prompt again: prefix-cache hit
        (_chat_ids(engine, "Count: " + "one two three " * 20), SamplingParams(max_new_tokens=12, temperature=0.0)),
        ([5, 6, 7], SamplingParams(max_new_tokens=1, temperature=0.0)),
    ]


def _run(engine: LLMEngine, work, abort_after: dict[int, int] | None = None):
    """Submit everything, step to the end; returns per request (tokens, reason, logprobs)."""
    seqs = [engine.add_request(ids, params) for ids, params in work]
    index = {s.request_id: i for i, s in enumerate(seqs)}
    tokens = {i: [] for i in range(len(work))}
    reasons, logprobs = {}, {i: [] for i in range(len(work))}
    while engine.has_work:
        for o in engine.step():
            i = index[o.request_id]
            tokens[i] += _token(o)
            logprobs[i] += [] if o.logprob is None else [o.logprob]
            if o.finished:
                assert i not in reasons, "a request finished twice"
                reasons[i] = o.finish_reason
        for i, after in (abort_after or {}).items():
            if i not in reasons and len(tokens[i]) >= after:
                engine.abort(seqs[i].request_id)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting
    return tokens, reasons, logprobs


def test_overlap_gives_the_same_tokens(engines):
    work = _workload(engines[True])
    on_tokens, on_reasons, on_lp = _run(engines[True], work)
    off_tokens, off_reasons, off_lp = _run(engines[False], work)
    assert on_tokens == off_tokens
    assert on_reasons == off_reasons
    for i in on_lp:
        assert on_lp[i] == pytest.approx(off_lp[i], abs=1e-4)
    assert on_reasons[0] == FinishReason.STOP and on_tokens[0][-1] == _eos(engines[True])[0]
    assert on_reasons[1] == FinishReason.LENGTH and len(on_tokens[1]) == 7
    assert len(on_tokens[7]) == 1 and len(on_lp[3]) == len(on_tokens[3])
    assert all(t >= 0 for ts in on_tokens.values() for t in ts)


def test_abort_while_a_token_is_on_the_device(engines):
    work = _workload(engines[True])
    full, _, _ = _run(engines[False], work)
    tokens, reasons, _ = _run(engines[True], work, abort_after={0: 3, 2: 5, 6: 1})
    for i in (0, 2, 6):
        assert reasons[i] == FinishReason.ABORT
        assert tokens[i] == full[i][: len(tokens[i])]  # a prefix: nothing invented, nothing reordered
        assert len(tokens[i]) <= len(full[i])
    for i in (1, 3, 4, 5, 7):
        assert tokens[i] == full[i]


def test_session_turn_after_a_stop_token_in_flight(engines):
    """A turn that stops while its next step is queued leaves no placeholder in the history."""
    results = {}
    for overlap, engine in engines.items():
        eos = _eos(engine)
        params = SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=eos)
        turns = []
        for prompt in (PROMPTS[0], PROMPTS[1]):
            seq = engine.add_request(_chat_ids(engine, prompt), params, session_id=77)
            out = []
            while engine.has_work:
                out += [t for o in engine.step() for t in _token(o)]
            assert min(seq.token_ids) >= 0 and seq.num_pending_tokens == 0
            assert seq.num_computed_tokens == seq.num_tokens - 1
            turns.append(out)
        engine.end_session(77)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        results[overlap] = turns
    assert results[True] == results[False]


def test_pipeline_stages_with_overlap(smollm2_dir):
    """The offline pipeline's stages (tokenizer, engine, detokenizer threads) with the overlap on:
    a stop string found by the detokenizer stops a sequence whose next token is on the device,
    streams equal whole responses, and an abandoned stream gives every block back."""
    from conveyor import EngineConfig as PublicEngineConfig
    from conveyor import GenerationConfig, pipeline

    def config(overlap: bool) -> PublicEngineConfig:
        return PublicEngineConfig(cache_max_entry_count=64, block_size=16, overlap_schedule=overlap)

    greedy = GenerationConfig(max_new_tokens=40, top_k=1)
    with pipeline(str(smollm2_dir), config(False)) as plain:
        expected = [r.text for r in plain(PROMPTS[:4], greedy)]
    with pipeline(str(smollm2_dir), config(True)) as pipe:
        assert pipe.engine.overlap
        assert [r.text for r in pipe(PROMPTS[:4], greedy)] == expected
        base = expected[1]
        stop = base[12:21]
        r = pipe(PROMPTS[1], GenerationConfig(max_new_tokens=40, top_k=1, stop_words=[stop]))
        assert r.finish_reason == "stop" and r.text == base[: base.index(stop)]
        texts = [""] * 4
        for chunk in pipe.stream_infer(PROMPTS[:4], greedy):
            texts[chunk.index] += chunk.text
        assert texts == expected
        stream = pipe.stream_infer(PROMPTS[:3], GenerationConfig(max_new_tokens=64, top_k=1, ignore_eos=True))
        next(stream)
        stream.close()
        pipe._stack.call(lambda e: None)  # let the engine thread apply the aborts
        blocks = pipe._stack.call(lambda e: (e.block_manager.num_free_blocks, e.block_manager.num_blocks,
                                             e.has_work))
        assert blocks[0] == blocks[1] and not blocks[2]


def test_session_turn_added_while_the_stale_step_is_in_flight(engines):
    """The next turn arrives right after the read-back that finished the previous one, while the
    step holding the previous turn's discarded token is still queued: same tokens as without overlap."""
    results = {}
    for overlap, engine in engines.items():
        eos = _eos(engine)
        params = SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=eos)
        prompts = [_chat_ids(engine, p) for p in (PROMPTS[2], PROMPTS[3])]
        seq = engine.add_request(prompts[0], params, session_id=88)
        turns: list[list[int]] = [[]]
        while engine.has_work:
            for o in engine.step():
                turns[-1] += _token(o)
                if o.finished and len(turns) == 1:
                    turns.append([])
                    # No drain first: with overlap the step holding the discarded token is queued.
                    assert (engine._inflight is not None) == overlap
                    engine.add_request(prompts[1], params, session_id=88)
        assert min(seq.token_ids) >= 0 and seq.num_pending_tokens == 0 and len(turns) == 2 and turns[1]
        engine.end_session(88)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        results[overlap] = turns
    assert results[True] == results[False]


def test_overlap_setting_is_checked():
    from conveyor.protocol.errors import EngineConfigError

    with pytest.raises(EngineConfigError, match="overlap_schedule='yes': use True, False or None"):
        EngineConfig(overlap_schedule="yes")
    assert EngineConfig().overlap_schedule is None  # on for CUDA, off on the CPU


def test_bad_request_while_a_step_is_in_flight(engines):
    """A request refused while a step is queued on the device changes nothing for the others."""
    from conveyor.protocol.errors import InvalidRequestError

    engine = engines[True]
    work = _workload(engine)[:4]
    full, _, _ = _run(engines[False], work)
    seqs = [engine.add_request(ids, params) for ids, params in work]
    index = {s.request_id: i for i, s in enumerate(seqs)}
    tokens = {i: [] for i in range(len(work))}
    refused = 0
    while engine.has_work:
        for o in engine.step():
            tokens[index[o.request_id]] += _token(o)
        if engine._inflight is not None and refused < 3:
            bad = [([], SamplingParams()), ([1, 2], SamplingParams(temperature=-1.0)),
                   ([engine.model_config.vocab_size], SamplingParams())][refused]
            with pytest.raises(InvalidRequestError):
                engine.add_request(*bad)
            refused += 1
    assert refused == 3
    assert tokens == full
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
