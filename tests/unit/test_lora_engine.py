"""LoRA adapters in the engine (tiny random Llama, CPU, float32): every request's greedy tokens equal
those of its adapter merged into the base (peft's ``merge_and_unload``, run by transformers), in
batches that mix adapters and the base model; paging through a pool smaller than the adapters;
the prefix cache keyed by adapter; loading and unloading at run time; bad adapters refused with
nothing else affected."""

from __future__ import annotations

import json

import pytest
import torch

from conveyor.engine.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.protocol.errors import AdapterError, EngineConfigError, UnknownAdapterError
from conveyor.protocol.sampling import SamplingParams

from tiny_lora import greedy_batch, hf_greedy, load_base, make_adapter, merged, save_tiny_llama

pytestmark = pytest.mark.usefixtures("torch_single_thread")

N = 10
PROMPTS = [[5, 17, 99, 3, 42, 8, 61], [7, 7, 120, 33], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [90, 11, 64]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(base directory, transformers base model, {name: adapter directory})."""
    root = tmp_path_factory.mktemp("lora")
    base_dir = save_tiny_llama(root / "base")
    base = load_base(base_dir)
    adapters = {
        "all8": make_adapter(base, root / "all8", r=8, alpha=16, seed=1),
        "qv4": make_adapter(base, root / "qv4", r=4, alpha=8, targets=("q_proj", "v_proj"), seed=2,
                            use_rslora=True, scale=2.0),
        "mlp16": make_adapter(base, root / "mlp16", r=16, alpha=8, targets=("gate_proj", "up_proj", "down_proj"),
                              seed=3, rank_pattern={"down_proj": 8}),
    }
    return base_dir, base, adapters


@pytest.fixture(scope="module")
def expected(tiny):
    """{adapter name or None: [greedy tokens of each prompt]} from transformers."""
    _, base, adapters = tiny
    out = {None: [hf_greedy(base, p, N) for p in PROMPTS]}
    for name, path in adapters.items():
        model = merged(base, path)
        out[name] = [hf_greedy(model, p, N) for p in PROMPTS]
    return out


def engine(path, **kw) -> LLMEngine:
    base = dict(device="cpu", dtype="float32", cache_max_entry_count=96, block_size=4, max_batch_size=16,
                max_prefill_token_num=256)
    return LLMEngine(path, EngineConfig(**{**base, **kw}))


def params(adapter: str | None) -> SamplingParams:
    return SamplingParams(max_new_tokens=N, temperature=0.0, ignore_eos=True, adapter_name=adapter)


def run(eng: LLMEngine, requests: list[tuple[list[int], str | None]]) -> list[list[int]]:
    """Queue every (prompt, adapter) at once, step to the end; each request's tokens."""
    return greedy_batch(eng, requests, N)


def test_adapters_change_the_output(expected) -> None:
    """The reference is not the base model's output again (the adapters are strong enough to
    tell apart), so equality below checks that each adapter was applied."""
    for name in ("all8", "qv4", "mlp16"):
        assert expected[name] != expected[None], name


def test_a_batch_mixing_three_adapters_and_the_base_equals_merged(tiny, expected) -> None:
    base_dir, _, adapters = tiny
    eng = engine(base_dir, adapters={k: str(v) for k, v in adapters.items()})
    try:
        assert eng.adapter_names() == ["all8", "qv4", "mlp16"]
        names = [None, "all8", "qv4", "mlp16"]
        requests = [(p, names[(i + j) % 4]) for i, p in enumerate(PROMPTS) for j in range(4)]
        got = run(eng, requests)
        for (prompt, name), tokens in zip(requests, got):
            assert tokens == expected[name][PROMPTS.index(prompt)], (name, prompt)
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    finally:
        eng.close()


def test_a_pool_smaller_than_the_adapters_pages_them(tiny, expected) -> None:
    """Two slots, three adapters in one queue: the scheduler holds back a third adapter while
    two run, the pool pages adapters in over the least recently used; every answer is right."""
    base_dir, _, adapters = tiny
    eng = engine(base_dir, adapters={k: str(v) for k, v in adapters.items()}, max_loras=2)
    loads = []
    original = eng.runner.lora.apply_loads
    eng.runner.lora.apply_loads = lambda pages: (loads.extend(pages), original(pages))
    try:
        assert eng.runner.lora.num_slots == 2
        names = ["all8", "qv4", "mlp16", None, "qv4", "all8"]
        requests = [(PROMPTS[i % 4], name) for i, name in enumerate(names)]
        got = run(eng, requests)
        for (prompt, name), tokens in zip(requests, got):
            assert tokens == expected[name][PROMPTS.index(prompt)], (name, prompt)
        assert len(loads) >= 3 and {slot for _, slot in loads} <= {0, 1}
    finally:
        eng.close()


def test_the_prefix_cache_keys_blocks_by_adapter(tiny, expected) -> None:
    base_dir, _, adapters = tiny
    eng = engine(base_dir, adapters={"all8": str(adapters["all8"])}, enable_prefix_caching=True)
    prompt = PROMPTS[2]  # 13 tokens: three full 4-token blocks before the last
    try:

        def one(name):
            seq = eng.add_request(prompt, params(name))
            out = []
            while eng.has_work:
                out += [o.token for o in eng.step() if o.token is not None]
            return out, seq.num_cached_tokens

        assert one("all8") == (expected["all8"][2], 0)
        assert one(None) == (expected[None][2], 0)  # the adapter's blocks are not the base model's
        assert one("all8") == (expected["all8"][2], 12)
        assert one(None) == (expected[None][2], 12)
    finally:
        eng.close()


def test_loading_and_unloading_at_run_time(tiny, expected, tmp_path) -> None:
    base_dir, _, adapters = tiny
    eng = engine(base_dir, max_loras=2, max_lora_rank=16)
    try:
        assert eng.adapter_names() == []
        with pytest.raises(UnknownAdapterError, match="no LoRA adapter named 'qv4'"):
            eng.add_request(PROMPTS[0], params("qv4"))
        eng.load_adapter("qv4", str(adapters["qv4"]))
        eng.load_adapter("mlp", str(adapters["mlp16"]))
        assert eng.adapter_names() == ["qv4", "mlp"]
        assert eng.stats().adapters == ["qv4", "mlp"]
        # Unloaded while its request runs: the request finishes with it, new ones are refused.
        seq = eng.add_request(PROMPTS[1], params("qv4"))
        out = [o.token for o in eng.step() if o.token is not None]
        eng.unload_adapter("qv4")
        with pytest.raises(UnknownAdapterError):
            eng.add_request(PROMPTS[1], params("qv4"))
        while eng.has_work:
            out += [o.token for o in eng.step() if o.token is not None]
        assert out == expected["qv4"][1]
        old_id = seq.adapter_id
        eng.load_adapter("qv4", str(adapters["all8"]))  # the name again, other weights: a new id
        assert run(eng, [(PROMPTS[1], "qv4")]) == [expected["all8"][1]]
        assert eng.runner.lora.by_name["qv4"] != old_id and old_id not in eng.runner.lora.adapters
        with pytest.raises(UnknownAdapterError):
            eng.unload_adapter("nope")
    finally:
        eng.close()


def _other_base_adapter(tmp_path):
    """An adapter trained on a model of another width."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tiny_lora import TINY_LLAMA

    other = LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, "hidden_size": 32, "intermediate_size": 48})).eval()
    return make_adapter(other, tmp_path / "other", r=4, alpha=4)


def test_bad_adapters_get_clear_errors_and_change_nothing(tiny, expected, tmp_path) -> None:
    base_dir, _, adapters = tiny
    eng = engine(base_dir, adapters={"all8": str(adapters["all8"])}, max_lora_rank=8)
    try:
        with pytest.raises(AdapterError, match="trained on another model"):
            eng.load_adapter("other", str(_other_base_adapter(tmp_path)))
        with pytest.raises(AdapterError, match="adapter_config.json"):
            eng.load_adapter("missing", str(tmp_path / "nowhere"))
        with pytest.raises(AdapterError, match="--max-lora-rank 16"):
            eng.load_adapter("big", str(adapters["mlp16"]))
        with pytest.raises(AdapterError, match="already loaded"):
            eng.load_adapter("all8", str(adapters["qv4"]))
        broken = tmp_path / "broken"
        broken.mkdir()
        (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
        with pytest.raises(AdapterError):
            eng.load_adapter("broken", str(broken))
        with pytest.raises(UnknownAdapterError):
            eng.add_request(PROMPTS[0], params("big"))
        assert eng.adapter_names() == ["all8"]
        assert run(eng, [(PROMPTS[0], "all8"), (PROMPTS[0], None)]) == [expected["all8"][0], expected[None][0]]
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    finally:
        eng.close()


def test_without_a_pool_adapters_are_refused(tiny) -> None:
    base_dir, _, adapters = tiny
    eng = engine(base_dir)
    try:
        assert eng.runner.lora is None
        with pytest.raises(EngineConfigError, match="--max-loras"):
            eng.load_adapter("all8", str(adapters["all8"]))
        with pytest.raises(UnknownAdapterError):
            eng.add_request(PROMPTS[0], params("all8"))
    finally:
        eng.close()


def test_a_bad_start_up_adapter_fails_the_engine_start(tiny, tmp_path) -> None:
    base_dir, _, _ = tiny
    with pytest.raises(AdapterError, match="trained on another model"):
        engine(base_dir, adapters={"other": str(_other_base_adapter(tmp_path))})


def test_the_padded_decode_graph_path_applies_adapters(tiny, expected) -> None:
    """The decode graphs' static buffers (uncaptured on the CPU): rows grouped by slot, padding
    segments skipped, the base model's rows untouched."""
    base_dir, _, adapters = tiny
    eng = engine(base_dir, adapters={k: str(v) for k, v in adapters.items()}, max_batch_size=8)
    try:
        eng.runner.decode_graphs = eng.runner._decode_graphs(capture=False)
        eng.runner.use_cuda_graphs = True
        names = [None, "all8", "qv4", "mlp16", "all8"]  # 5 rows replay the size-8 buffers
        requests = [(PROMPTS[i % 4], name) for i, name in enumerate(names)]
        got = run(eng, requests)
        for (prompt, name), tokens in zip(requests, got):
            assert tokens == expected[name][PROMPTS.index(prompt)], (name, prompt)
        got = run(eng, [(PROMPTS[0], None)])  # a step without adapters replays the plain graphs
        assert got == [expected[None][0]]
    finally:
        eng.close()


def test_sampling_params_carry_the_adapter_name() -> None:
    from conveyor.protocol.errors import InvalidRequestError
    from conveyor.protocol.sampling import validate

    assert validate(SamplingParams(adapter_name="x")).adapter_name == "x"
    with pytest.raises(InvalidRequestError, match="adapter_name"):
        validate(SamplingParams(adapter_name=""))


def test_lora_is_exact_beside_a_linear_at_tensor_parallel_splits() -> None:
    """``LoRASlots.local_weights``: each rank's share of A and B, summed over ranks as tensor
    parallel sums them, is the whole adapter's delta (column-parallel: parts of B's rows;
    row-parallel: A's columns, all-reduced)."""
    from types import SimpleNamespace

    from conveyor.engine.layers.lora import LoRASlots

    gen = torch.Generator().manual_seed(0)
    a_q, b_q = torch.randn(4, 16, generator=gen), torch.randn(8, 4, generator=gen)
    a_k, b_k = torch.randn(4, 16, generator=gen), torch.randn(4, 4, generator=gen)
    x = torch.randn(3, 16, generator=gen)
    full = torch.cat([x @ a_q.T @ b_q.T, x @ a_k.T @ b_k.T], 1)
    outs = []
    for rank in range(2):  # column-parallel: q split 4+4, k 2+2
        slots = SimpleNamespace(rank=16, part_sizes=(4, 2), part_rows=[4 * rank, 2 * rank], in_start=0, in_size=16,
                                a=torch.zeros(1, 32, 16), b=torch.zeros(1, 6, 16))
        a, b = LoRASlots.local_weights(slots, {0: (a_q, b_q), 1: (a_k, b_k)})
        low = x @ a.T
        outs.append(torch.cat([low[:, :16] @ b[:4].T, low[:, 16:] @ b[4:].T], 1))
    got = torch.cat([outs[0][:, :4], outs[1][:, :4], outs[0][:, 4:], outs[1][:, 4:]], 1)
    torch.testing.assert_close(got, full)
    total = 0
    for rank in range(2):  # row-parallel: inputs split 8+8
        slots = SimpleNamespace(rank=16, part_sizes=(8,), part_rows=[0], in_start=8 * rank, in_size=8,
                                a=torch.zeros(1, 16, 8), b=torch.zeros(1, 8, 16))
        a, b = LoRASlots.local_weights(slots, {0: (a_q, b_q)})
        total = total + x[:, 8 * rank: 8 * rank + 8] @ a.T @ b.T
    torch.testing.assert_close(total, x @ a_q.T @ b_q.T)


def test_the_triton_kernels_run_the_mixed_batch(tiny, expected) -> None:
    """The same mixed batch with every kernel in Triton (its interpreter on the CPU)."""
    pytest.importorskip("triton")
    from conveyor.kernels._triton import TRITON_INTERPRETED

    if not TRITON_INTERPRETED and not torch.cuda.is_available():
        pytest.skip("Triton runs compiled but there is no GPU")
    base_dir, _, adapters = tiny
    eng = engine(base_dir, adapters={k: str(v) for k, v in adapters.items()}, kernels="triton")
    try:
        requests = [(PROMPTS[i], name) for i, name in enumerate([None, "all8", "qv4", "mlp16"])]
        for (prompt, name), tokens in zip(requests, run(eng, requests)):
            assert tokens == expected[name][PROMPTS.index(prompt)], name
    finally:
        eng.close()


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [False, True])
def test_on_the_gpu_with_and_without_decode_graphs(tiny, expected, eager) -> None:
    """The Triton kernels on a side stream beside the base linears, replayed in the decode graphs
    (or eagerly): the mixed batch's tokens (float32) equal the merged models'."""
    base_dir, _, adapters = tiny
    eng = engine(base_dir, adapters={k: str(v) for k, v in adapters.items()}, device="cuda", eager_mode=eager,
                 max_loras=2)
    try:
        assert eng.runner.use_cuda_graphs == (not eager)
        names = [None, "all8", "qv4", "mlp16", "all8", None]
        requests = [(PROMPTS[i % 4], name) for i, name in enumerate(names)]
        for (prompt, name), tokens in zip(requests, run(eng, requests)):
            assert tokens == expected[name][PROMPTS.index(prompt)], name
        for name in ("qv4", None):  # batch 1: the GEMV adds the delta in its epilogue
            assert run(eng, [(PROMPTS[2], name)]) == [expected[name][2]], name
    finally:
        eng.close()


@pytest.mark.gpu
def test_a_prefill_step_past_the_side_stream_rows_adds_in_place_on_the_gpu(tiny) -> None:
    """A step of more than SIDE_STREAM_ROWS rows (a prefill) adds its deltas after the base, in
    place: the merged models' tokens."""
    from conveyor.engine.layers.lora import SIDE_STREAM_ROWS

    base_dir, base, adapters = tiny
    long = [[(7 * i + 3 * j) % 120 + 5 for j in range(90)] for i in range(4)]  # 360 rows in one step
    assert sum(map(len, long)) > SIDE_STREAM_ROWS
    names = ["all8", None, "qv4", "mlp16"]
    want = [hf_greedy(merged(base, adapters[n]) if n else base, p, N) for p, n in zip(long, names)]
    eng = engine(base_dir, adapters={k: str(v) for k, v in adapters.items()}, device="cuda",
                 max_prefill_token_num=512, cache_max_entry_count=256)
    try:
        assert run(eng, list(zip(long, names))) == want
    finally:
        eng.close()


def test_a_session_that_switches_adapters_shares_no_blocks_with_either(tiny, expected) -> None:
    """A session's turn with another adapter keys its blocks by the switch: a request that runs
    the whole history with the base model alone finds none of them."""
    base_dir, _, adapters = tiny
    eng = engine(base_dir, adapters={"all8": str(adapters["all8"])}, enable_prefix_caching=True)
    try:
        def turn(prompt, name, session_id=None):
            seq = eng.add_request(prompt, params(name), session_id=session_id)
            while eng.has_work:
                eng.step()
            return seq

        session = turn(PROMPTS[2], "all8", session_id=7)
        assert session.adapter_id
        turn(PROMPTS[0], None, session_id=7)  # the next turn without the adapter
        history = list(session.token_ids)
        fresh = turn(history, None)
        assert fresh.num_cached_tokens == 0  # computed with the adapter (partly): not the base model's
        eng.end_session(7)
    finally:
        eng.close()


def test_adapters_on_quantized_bases(tiny, tmp_path) -> None:
    """AWQ: the adapter on the 4-bit base computes what it computes on the dense checkpoint of the
    dequantized weights. W8A8: the adapter changes the output, and its tokens are (nearly) those of
    the dense checkpoint with the adapter: the activations the base reads are int8-rounded there."""
    from test_awq_engine import write_models as write_awq
    from test_w8a8_engine import write_models as write_w8a8

    for kind, write in (("awq", write_awq), ("w8a8", write_w8a8)):
        quant_dir, dense_dir = write(tmp_path / kind)
        adapter = make_adapter(load_base(dense_dir), tmp_path / f"{kind}-lora", r=8, alpha=16, seed=5, scale=2.0)
        quant = engine(quant_dir, adapters={"a": str(adapter)})
        dense = engine(dense_dir, adapters={"a": str(adapter)})
        try:
            with_adapter = run(quant, [(p, "a") for p in PROMPTS])
            assert with_adapter != run(quant, [(p, None) for p in PROMPTS]), kind
            reference = run(dense, [(p, "a") for p in PROMPTS])
            if kind == "awq":
                assert with_adapter == reference
            else:
                agree = sum(a == b for got, ref in zip(with_adapter, reference) for a, b in zip(got, ref))
                assert agree >= 0.75 * N * len(PROMPTS), agree
        finally:
            quant.close()
            dense.close()


def test_tensor_parallel_splits_the_adapters(tiny, expected) -> None:
    """tp=2 on the CPU (gloo): start-up adapters and one loaded at run time (registered on both
    ranks through the plans), a mixed batch paged through a two-slot pool: the merged models'
    tokens."""
    base_dir, _, adapters = tiny
    eng = engine(base_dir, adapters={"all8": str(adapters["all8"]), "qv4": str(adapters["qv4"])}, tp=2,
                 max_loras=2)
    try:
        eng.load_adapter("mlp16", str(adapters["mlp16"]))
        names = [None, "all8", "qv4", "mlp16"]
        requests = [(PROMPTS[i], name) for i, name in enumerate(names)]
        for (prompt, name), tokens in zip(requests, run(eng, requests)):
            assert tokens == expected[name][PROMPTS.index(prompt)], name
        eng.unload_adapter("qv4")
        assert run(eng, [(PROMPTS[1], "mlp16")]) == [expected["mlp16"][1]]
    finally:
        eng.close()
