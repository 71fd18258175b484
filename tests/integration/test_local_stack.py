"""The pipeline's stage threads (services/local_stack.py) on the real tokenizer and the model-free
engine of conveyor/testing/fake_engine.py: results, aborts that free blocks before they return,
refusals, and a stage that dies. Waits are polls or queue reads with deadlines."""

from __future__ import annotations

import contextlib
import queue

import pytest

from conveyor.protocol import GenerateReq, SamplingParams
from conveyor.services.local_stack import EngineDiedError, LocalStack, RequestError
from conveyor.services.tokenizer.preprocess import Preprocessor
from conveyor.testing.fake_engine import FILLER, FakeEngine

DEADLINE = 30.0


@pytest.fixture(scope="module")
def pre(smollm2_dir) -> Preprocessor:
    return Preprocessor(smollm2_dir, 512)


@contextlib.contextmanager
def _stack(pre: Preprocessor, step_delay: float = 0.0):
    """A LocalStack on a FakeEngine of 50 blocks, closed at the end, and a queue for results."""
    engine = FakeEngine(pre.tokenizer.encode(FILLER, add_special_tokens=False), session_len=512,
                        num_blocks=50, step_delay=step_delay)
    stack = LocalStack(engine, pre)
    try:
        yield stack, engine, queue.Queue()
    finally:
        stack.close()


def _req(stack: LocalStack, n: int, **params) -> GenerateReq:
    return GenerateReq(stack.new_rid(), "", SamplingParams(max_new_tokens=n, **params), prompt="Hi")


def test_a_request_streams_to_its_end(pre) -> None:
    with _stack(pre) as (stack, _, sink):
        stack.submit(_req(stack, 8), sink, tag=3)
        outs = []
        while not outs or outs[-1].finish_reason is None:
            tag, out = sink.get(timeout=DEADLINE)
            assert tag == 3 and not isinstance(out, RequestError)
            outs.append(out)
        assert outs[-1].finish_reason == "length" and outs[-1].completion_tokens == 8
        assert "".join(o.text for o in outs).startswith("The quick brown fox")


def test_abort_returns_once_the_blocks_are_free(pre) -> None:
    with _stack(pre, step_delay=0.005) as (stack, engine, sink):
        reqs = [_req(stack, 100_000) for _ in range(4)]
        for i, req in enumerate(reqs):
            stack.submit(req, sink, tag=i)
        seen = set()
        while len(seen) < 4:  # every request is generating
            seen.add(sink.get(timeout=DEADLINE)[0])
        assert stack.call(lambda e: e.stats().free_blocks) == 46
        stack.abort([r.rid for r in reqs])
        assert stack.call(lambda e: e.stats().free_blocks) == 50


def test_a_refusal_reaches_the_submitter_and_others_go_on(pre) -> None:
    with _stack(pre) as (stack, _, sink):
        stack.submit(_req(stack, 4, top_p=0.0), sink, tag=0)
        stack.submit(_req(stack, 4), sink, tag=1)
        results: dict[int, object] = {}
        while len(results) < 2:
            tag, out = sink.get(timeout=DEADLINE)
            if isinstance(out, RequestError) or out.finish_reason is not None:
                results[tag] = out
        assert isinstance(results[0], RequestError) and results[0].status == 400 and results[0].param == "top_p"
        assert results[1].finish_reason == "length"


def test_a_dead_stage_fails_waiting_requests_and_new_ones(pre) -> None:
    with _stack(pre, step_delay=0.005) as (stack, engine, sink):
        stack.submit(_req(stack, 100_000), sink, tag=0)
        sink.get(timeout=DEADLINE)  # generating

        def broken_step():
            raise RuntimeError("the GPU fell off")

        engine.step = broken_step
        while True:  # outputs already on their way may come first; then the 503
            _, out = sink.get(timeout=DEADLINE)
            if isinstance(out, RequestError):
                break
        assert out.status == 503 and "the GPU fell off" in out.message
        with pytest.raises(EngineDiedError):
            stack.submit(_req(stack, 1), sink, tag=1)
