"""The quantized KV cache (quant_policy 8 and 4) on the real SmolLM2-135M-Instruct.

What works with the 16-bit cache must keep working with codes in it: batching, chunked prefill,
prefix caching, sessions after eviction, preemption, overlapped steps, and no block left behind.
Exact equality with the unquantized cache cannot hold, so every case compares the quantized
engine to its own single-request runs (one prompt alone, no prefix cache, one prefill chunk).

Even that equality is not exact: a batch or a chunk boundary changes a key's fp32 value by an
ulp, which moves a code across a rounding boundary now and then, and the step it makes (1/255
of the vector's range, more for int4) then carries into every later layer (a sequence's key
centre, computed from its first chunk, carries such a change into all of its keys). So greedy
tokens are compared up to the first place where the single run itself hesitated: there the two
may part, provided the other run took one of the single run's top candidates within
``NEAR_TIE`` nats of its best. A real fault (a wrong slot, block or scale) breaks a confident token.
How close the quantized cache stays to the unquantized one is measured by perplexity in
``benchmarks/kv_quant_quality.py``.

Every engine here runs in float32, on the GPU as on the CPU: the cases test the cache's
bookkeeping, and bfloat16 would bury it in rounding noise. Two runs whose keys differ only by
bf16 rounding (one prefill against decode steps) flip enough int4 codes to move a logit by more
than 1.5 nats. Measured on the H200 (session 14): the evicted session's token 5 lies at a near tie
of the model itself (three tokens within 0.6 nats with the unquantized cache). In bf16 the int4
runs there picked 11081, 9563 or 9101 as only the prefill chunks changed (whole, 13, 7 tokens).
In float32 the unquantized cache gave the same logits on every path, to three decimals. The
kernels' bf16 and fp16 paths are tested against their references in ``tests/unit``.
"""

from __future__ import annotations

import pytest

from conveyor import EngineConfig, EngineConfigError, GenerationConfig, pipeline
from conveyor.engine.llm_engine import LLMEngine

from chat_prompts import PROMPTS

GREEDY = GenerationConfig(max_new_tokens=24, top_k=1)
LOGPROBS = GenerationConfig(max_new_tokens=24, top_k=1, logprobs=5)
SOME = PROMPTS[:5]
# Nats between the single run's two best tokens below which another run may take the second:
# an int4 code step is 17x an int8 one, and so are the logit shifts a flipped code causes
# (measured: up to ~0.05 nats with int8 and ~0.75 with int4, SmolLM2).
NEAR_TIE = {8: 0.25, 4: 1.5}
DTYPE = "float32"  # module doc


def assert_agrees(tokens: list[int], ref: tuple[list[int], list[dict], int], what: str) -> None:
    """``tokens`` equal the reference run's, or part from them only at a near tie (module doc)."""
    ref_tokens, ref_logprobs, policy = ref
    for i, (a, b) in enumerate(zip(tokens, ref_tokens)):
        if a != b:
            best = max(ref_logprobs[i].values())
            assert a in ref_logprobs[i] and best - ref_logprobs[i][a] < NEAR_TIE[policy], \
                f"{what}: token {i} is {a}, the single run chose {b} with {ref_logprobs[i]}"
            return
    assert len(tokens) == len(ref_tokens), what


def _free_all(p) -> bool:
    bm = p.engine.block_manager
    return p._stack.call(lambda e: bm.num_free_blocks) == bm.num_blocks


@pytest.fixture(scope="module", params=[8, 4], ids=["int8", "int4"])
def policy(request) -> int:
    return request.param


def _alone(smollm2_dir, policy, **config):
    cfg = EngineConfig(quant_policy=policy, dtype=DTYPE, cache_max_entry_count=256, block_size=16, **config)
    with pipeline(str(smollm2_dir), cfg) as p:
        out = {}
        for prompt in SOME:
            r = p(prompt, LOGPROBS)
            out[prompt] = (r.token_ids, r.logprobs, policy)
        assert _free_all(p)
    return out


@pytest.fixture(scope="module")
def alone(smollm2_dir, policy):
    """Each prompt's greedy tokens from a quantized engine that runs it alone, in one chunk."""
    return _alone(smollm2_dir, policy)


@pytest.fixture(scope="module")
def alone_in_chunks(smollm2_dir, policy):
    """The same, in 7-token chunks. A sequence's key centre averages its first chunk's keys (up
    to 64 tokens: kernels/kv_cache.py), so the chunk size changes the stored codes; what else
    the batch carries does not."""
    return _alone(smollm2_dir, policy, max_prefill_token_num=7)


def test_policy_reaches_the_cache(smollm2_dir, policy):
    cfg = EngineConfig(quant_policy=policy, dtype=DTYPE, cache_max_entry_count=8, block_size=16)
    with pipeline(str(smollm2_dir), cfg) as p:
        runner = p.engine.runner
        assert runner.k_cache.dtype.is_floating_point is False and runner.k_scales is not None
        assert runner.k_cache.shape[-1] == runner.model_config.head_dim // (2 if policy == 4 else 1)


def test_batched_chunked_and_prefix_cached_runs_equal_single_runs(smollm2_dir, policy, alone_in_chunks):
    """One batch, prompts cut into 7-token chunks that straddle 16-token blocks, the chat
    template's shared system prompt served from the prefix cache: the same tokens as alone."""
    alone = alone_in_chunks
    cfg = EngineConfig(quant_policy=policy, dtype=DTYPE, cache_max_entry_count=256, block_size=16,
                       max_prefill_token_num=7, enable_prefix_caching=True)
    with pipeline(str(smollm2_dir), cfg) as p:
        first = p(SOME, GREEDY)
        again = p(SOME, GREEDY)  # every prompt now a full prefix-cache hit up to its last block
        for prompt, a, b in zip(SOME, first, again):
            assert_agrees(a.token_ids, alone[prompt], prompt)
            assert_agrees(b.token_ids, alone[prompt], prompt)
        assert any(r.num_cached_tokens >= 32 for r in again)
        assert _free_all(p)


def test_preemption_and_session_eviction(smollm2_dir, policy, alone):
    """A cache too small for the batch preempts and recomputes; a session evicted between turns
    is recomputed from its token ids. Both give the tokens of runs that were never interrupted."""
    tiny = EngineConfig(quant_policy=policy, dtype=DTYPE, cache_max_entry_count=10, block_size=16, max_batch_size=8)
    gen = GenerationConfig(max_new_tokens=8, top_k=1)
    with pipeline(str(smollm2_dir), tiny) as p:
        out = p(SOME, GREEDY)
        for prompt, r in zip(SOME, out):
            assert_agrees(r.token_ids, alone[prompt], prompt)
        a = p.chat("Say hello.", gen_config=gen)
        b = p.chat("Count: " + "one two three " * 25, gen_config=gen)  # pushes session a out
        a = p.chat("Say goodbye.", session=a, gen_config=gen)
        evicted = a.response.token_ids
        a.close()
        b.close()
        assert _free_all(p)
    roomy = EngineConfig(quant_policy=policy, dtype=DTYPE, cache_max_entry_count=256, block_size=16)
    with pipeline(str(smollm2_dir), roomy) as p:
        a = p.chat("Say hello.", gen_config=gen)
        a = p.chat("Say goodbye.", session=a, gen_config=GenerationConfig(max_new_tokens=8, top_k=1, logprobs=5))
        assert_agrees(evicted, (a.response.token_ids, a.response.logprobs, policy), "session after eviction")
        a.close()


def test_overlap_on_and_off_agree(smollm2_dir, policy):
    """The overlap test's mixed workload (stops in flight, prefix hits, aborts-free) on quantized
    engines: overlapped steps change nothing."""
    from test_overlap_real_model import _run, _workload

    def make(overlap: bool) -> LLMEngine:
        return LLMEngine(smollm2_dir, EngineConfig(quant_policy=policy, dtype=DTYPE, cache_max_entry_count=64,
                                                   block_size=16, max_prefill_token_num=48, enable_prefix_caching=True,
                                                   overlap_schedule=overlap))

    on, off = make(True), make(False)
    work = _workload(on)
    on_tokens, on_reasons, _ = _run(on, work)
    off_tokens, off_reasons, _ = _run(off, work)
    assert on_tokens == off_tokens and on_reasons == off_reasons


def test_int8_greedy_answers_mostly_match_the_unquantized_cache(smollm2_dir, policy, alone):
    """A floor, not the measurement (benchmarks/kv_quant_quality.py): int8 keeps most answers."""
    if policy != 8:
        pytest.skip("int4 changes more answers; its quality is measured as perplexity")
    with pipeline(str(smollm2_dir), EngineConfig(dtype=DTYPE, cache_max_entry_count=256, block_size=16)) as p:
        same = sum(p(prompt, GREEDY).token_ids == alone[prompt][0] for prompt in SOME)
    assert same >= len(SOME) - 2


def test_odd_head_dim_is_refused_with_the_fix(tmp_path):
    import json

    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=66, intermediate_size=64,
                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                  max_position_embeddings=64, rms_norm_eps=1e-6, torch_dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineConfigError, match="even head_dim.*quant_policy=0"):
        LLMEngine(tmp_path, EngineConfig(quant_policy=4, load_format="dummy", cache_max_entry_count=4))
