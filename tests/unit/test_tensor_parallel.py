"""Tensor parallel on the CPU (gloo): tiny random Llamas at tp=2 and tp=4 against tp=1.

Each tp>1 engine starts real rank processes (engine/tp_workers.py) that load their slices of the
checkpoint and meet rank 0 in the collectives, so these tests run the whole path CI can run:
sharded loading (dense, AWQ, W8A8), vocab-parallel embedding and LM head, row-parallel
all-reduces, kv heads split and replicated, the per-step plans, and the failure watchdog.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from conveyor.engine.tp_workers import TPWorkerError
from conveyor.protocol import EngineConfigError
from conveyor.protocol.sampling import SamplingParams
from conveyor.protocol.tp import StepKind
from conveyor.testing.waiting import wait_until

from test_awq_engine import AWQ_CONFIG, GROUP as AWQ_GROUP, rtn_awq, write_models as write_awq_models
from test_w8a8_engine import write_models as write_w8a8_models
from tiny_llama import engine, random_tensors, write_checkpoint

PROMPTS = [[1, 5, 9, 17, 33, 2], [7] * 11, list(range(40, 75)), [100, 3]]


def _trace(eng, prompts=PROMPTS, n=10, k=5, **params):
    """Greedy tokens and each token's top-k logprobs, per request, all prompts batched."""
    for i, p in enumerate(prompts):
        eng.add_request(p, SamplingParams(max_new_tokens=n, temperature=0.0, logprobs=k, **params), request_id=f"r{i}")
    tokens, top = {}, {}
    while eng.has_work:
        for o in eng.step():
            if o.token is not None:
                tokens.setdefault(o.request_id, []).append(o.token)
                top.setdefault(o.request_id, []).append(dict(o.top_logprobs))
    return tokens, top


def _same(a, b, atol=2e-4) -> None:
    """Identical greedy tokens, and the top-k logprobs of each step equal within fp32 tolerance."""
    (tok_a, top_a), (tok_b, top_b) = a, b
    assert tok_a == tok_b
    for rid in top_a:
        for step_a, step_b in zip(top_a[rid], top_b[rid]):
            for tid in step_a.keys() & step_b.keys():
                assert step_a[tid] == pytest.approx(step_b[tid], abs=atol)
            assert len(step_a.keys() & step_b.keys()) >= len(step_a) - 1  # a near tie may swap the last


def _run(path, tp, **kw):
    eng = engine(path, tp=tp, **kw)
    try:
        return _trace(eng), eng.get_ppl([list(range(3, 60))])[0]
    finally:
        eng.close()


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    common, linears = random_tensors(torch.Generator().manual_seed(3))
    tensors = dict(common)
    tensors.update({f"{name}.weight": w for name, w in linears.items()})
    return write_checkpoint(tmp_path_factory.mktemp("tp") / "dense", tensors)


@pytest.mark.parametrize("tp", [2, 4])  # 4 > num_key_value_heads (2): each kv head on two ranks
def test_tp_matches_tp1_logits_and_tokens(dense_dir, tp) -> None:
    (ref, ref_ppl), (got, got_ppl) = _run(dense_dir, 1), _run(dense_dir, tp)
    _same(ref, got)
    assert got_ppl == pytest.approx(ref_ppl, rel=1e-5)


GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
SAMPLED = SamplingParams(max_new_tokens=8, temperature=0.8, top_k=0, top_p=0.9, random_seed=7)


def _tokens(eng, requests) -> dict[str, list[int]]:
    """Each request's tokens (``requests``: (prompt, params) pairs), all batched."""
    for i, (prompt, params) in enumerate(requests):
        eng.add_request(prompt, params, request_id=f"r{i}")
    tokens = {}
    while eng.has_work:
        for o in eng.step():
            if o.token is not None:
                tokens.setdefault(o.request_id, []).append(o.token)
    return tokens


def _watch(runner) -> tuple[list[tuple[StepKind, bool]], list[int]]:
    """(the (kind, vocab_argmax) of every plan that samples, the sampler's calls) from now on."""
    plans, calls = [], []
    execute, sample = runner._execute, runner.sampler.sample

    def recording(plan, prev_ids):
        if plan.num_sampled:
            plans.append((plan.kind, plan.vocab_argmax))
        return execute(plan, prev_ids)

    runner._execute = recording
    runner.sampler.sample = lambda *a, **kw: (calls.append(1), sample(*a, **kw))[1]
    return plans, calls


def test_greedy_steps_exchange_shard_argmaxes_and_a_sampled_row_gathers_the_logits(dense_dir) -> None:
    """tp=2: a step whose every row is plain greedy gathers no logits and runs no sampler (each
    rank's argmax of its vocabulary shard, exchanged), with tp=1's tokens; overlapped, so the next
    step's pending inputs read those ids on rank 1 too. A step with a sampled row gathers the
    logits for rank 0's sampler, as before."""
    greedy = [(p, GREEDY) for p in PROMPTS]
    mixed = [(PROMPTS[0], GREEDY), (PROMPTS[2], SAMPLED)]
    ref = engine(dense_dir, overlap_schedule=True)
    try:
        want_greedy, want_mixed = _tokens(ref, greedy), _tokens(ref, mixed)
    finally:
        ref.close()
    eng = engine(dense_dir, tp=2, overlap_schedule=True)
    try:
        plans, calls = _watch(eng.runner)
        assert _tokens(eng, greedy) == want_greedy
        assert plans and all(argmax for _, argmax in plans) and not calls
        plans.clear()
        assert _tokens(eng, mixed) == want_mixed
        assert plans and not any(argmax for _, argmax in plans) and len(calls) == len(plans)
    finally:
        eng.close()


def test_the_decode_graphs_stop_at_the_head_s_shard_and_either_finish_follows(dense_dir) -> None:
    """A process group of one rank (every collective runs, over gloo) and the decode graphs'
    static buffers (uncaptured off the GPU): the graphs end at the LM head's shard, and each
    decode step then takes the vocab-parallel argmax (all greedy) or gathers the logits for the
    sampler (a sampled row), with the tokens of an engine without a process group."""
    greedy = [(p, GREEDY) for p in PROMPTS]
    mixed = [(PROMPTS[0], GREEDY), (PROMPTS[2], SAMPLED)]
    ref = engine(dense_dir, overlap_schedule=True)
    try:
        want_greedy, want_mixed = _tokens(ref, greedy), _tokens(ref, mixed)
        assert ref.runner.decode_graphs is None
    finally:
        ref.close()
    eng = engine(dense_dir, process_group=True, overlap_schedule=True)
    try:
        eng.runner.decode_graphs = eng.runner._decode_graphs(capture=False)
        eng.runner.use_cuda_graphs = True
        assert eng.runner.decode_graphs.split_head
        plans, _ = _watch(eng.runner)
        assert _tokens(eng, greedy) == want_greedy
        assert (StepKind.GRAPH, True) in plans and (StepKind.GRAPH, False) not in plans
        plans.clear()
        assert _tokens(eng, mixed) == want_mixed
        assert (StepKind.GRAPH, False) in plans and (StepKind.GRAPH, True) not in plans
    finally:
        eng.close()


def test_tp_with_prefix_cache_sessions_and_an_int8_cache(dense_dir) -> None:
    def turns(tp):
        eng = engine(dense_dir, tp=tp, enable_prefix_caching=True, quant_policy=8)
        out = []
        try:
            for turn in ([5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15]):  # the second turn reads the first's cache
                eng.add_request(turn, SamplingParams(max_new_tokens=6, temperature=0.0), session_id=1)
                while eng.has_work:
                    out += [o.token for o in eng.step() if o.token is not None]
            out.append(_trace(eng, [PROMPTS[2], PROMPTS[2][:30]], n=4)[0])  # a prefix hit
        finally:
            eng.close()
        return out

    assert turns(2) == turns(1)


def _awq_models(root, inter=128):
    """An AWQ checkpoint whose MLP is ``inter`` wide, and the dense one of its dequantized weights."""
    gen = torch.Generator().manual_seed(5)
    common, linears = random_tensors(gen)
    for i in range(2):
        linears[f"model.layers.{i}.mlp.gate_proj"] = torch.randn(inter, 64, generator=gen) * 0.2
        linears[f"model.layers.{i}.mlp.up_proj"] = torch.randn(inter, 64, generator=gen) * 0.2
        linears[f"model.layers.{i}.mlp.down_proj"] = torch.randn(64, inter, generator=gen) * 0.2
    awq, dense = dict(common), dict(common)
    for prefix, weight in linears.items():
        qweight, qzeros, scales, w = rtn_awq(weight, AWQ_GROUP)
        awq.update({f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros, f"{prefix}.scales": scales})
        dense[f"{prefix}.weight"] = w
    return (write_checkpoint(root / "awq", awq, torch_dtype="float16", quantization_config=AWQ_CONFIG,
                             intermediate_size=inter),
            write_checkpoint(root / "dense", dense, intermediate_size=inter))


def test_tp_on_an_awq_checkpoint(tmp_path) -> None:
    awq_dir, dense_dir = _awq_models(tmp_path)
    (ref, ref_ppl), (got, got_ppl) = _run(dense_dir, 1), _run(awq_dir, 2)  # the packed shards, dequantized
    _same(ref, got)
    assert got_ppl == pytest.approx(ref_ppl, rel=1e-4)


def test_an_awq_split_off_group_boundaries_is_refused(tmp_path) -> None:
    path, _ = write_awq_models(tmp_path)  # down_proj: 96 inputs / 2 ranks = 48, not whole groups of 32
    with pytest.raises(EngineConfigError, match="group"):
        engine(path, tp=2)


def test_tp_on_a_w8a8_checkpoint(tmp_path) -> None:
    path, _ = write_w8a8_models(tmp_path)
    (ref, _), (got, _) = _run(path, 1), _run(path, 2)
    # Each rank quantizes its own part of o_proj's and down_proj's inputs per token (with its
    # own scale): not one rank's rounding, so the logprobs agree loosely.
    _same(ref, got, atol=0.1)


def test_every_rank_logs_its_step_times_when_asked(dense_dir, tmp_path) -> None:
    """EngineConfig.rank_timing_dir: rank 1 writes, as it stops, each step kind's wait for the plan
    and host time (the GPU span off a GPU: none); rank 0's hook logs the same steps."""
    from conveyor.engine.rank_timing import read_all, table

    eng = engine(dense_dir, tp=2, rank_timing_dir=str(tmp_path))
    try:
        _trace(eng, n=4)
    finally:
        eng.close()
    summaries = read_all(tmp_path)
    assert [s["rank"] for s in summaries] == [0, 1]
    assert summaries[0]["steps"] == summaries[1]["steps"] > 0  # rank 1 followed every step rank 0 ran
    eager = summaries[1]["by_kind"]["eager"]
    assert eager["mean_tokens"] > 0 and eager["mean_host_ms"] > 0 and eager["mean_wait_ms"] >= 0
    assert eager["mean_gpu_ms"] is None and summaries[1]["gpu_busy_s"] is None
    assert "eager" in table(summaries)


def test_a_model_the_ranks_cannot_split_is_refused_before_anything_starts(dense_dir) -> None:
    with pytest.raises(EngineConfigError, match="num_attention_heads|tp=3"):
        engine(dense_dir, tp=3)


def test_init_tp_makes_the_rank_s_gpu_current_before_joining(monkeypatch) -> None:
    """Triton launches and CUDA graphs act on the current device: rank 1 on cuda:1 with cuda:0
    current fails its first kernel (seen on two H200s)."""
    import torch.distributed as dist

    from conveyor.engine import distributed

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(("init", backend)))
    monkeypatch.setattr(dist, "all_reduce", lambda x, group=None: None)
    monkeypatch.setattr(torch, "zeros", lambda *a, **kw: None)
    monkeypatch.setattr(distributed, "_GROUP", distributed.TPGroup())
    distributed.init_tp(1, 2, "tcp://127.0.0.1:1", torch.device("cuda", 1))
    assert calls == [("set_device", torch.device("cuda", 1)), ("init", "nccl")]


def test_close_lets_the_ranks_leave_the_group_with_rank_0(dense_dir, monkeypatch) -> None:
    """Rank 0 leaves the group while the ranks do (told to stop, not yet waited for), having freed
    its decode graphs first, and the ranks then exit by themselves, not killed."""
    from conveyor.engine import llm_engine

    seen = []
    real_close_tp = llm_engine.close_tp

    def close_tp():
        workers = eng.tp_workers
        seen.append((workers is not None and workers._stopping, workers is not None and workers._closing))
        real_close_tp()

    monkeypatch.setattr(llm_engine, "close_tp", close_tp)
    eng = engine(dense_dir, tp=2)
    real_release = eng.runner.release_graphs
    eng.runner.release_graphs = lambda wait=True: (seen.append("graphs released"), real_release(wait))
    procs = list(eng.tp_workers.procs)
    eng.close()
    # stopped, not yet waited for; the decode graphs freed first (NCCL's teardown waits on them)
    assert seen == ["graphs released", (True, False)]
    assert [p.exitcode for p in procs] == [0]


def test_leaving_an_nccl_group_aborts_it_and_never_waits_in_the_collective_destroy(monkeypatch) -> None:
    """On two H200s both ranks of a group that had run decode graphs waited forever, together, in
    NCCL's destroy_process_group; the abort is local."""
    from conveyor.engine import distributed

    calls = []
    monkeypatch.setattr(distributed, "_GROUP", distributed.TPGroup(0, 2, group=object()))
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: not calls)
    monkeypatch.setattr(distributed.dist, "get_backend", lambda: "nccl")
    monkeypatch.setattr(distributed.dist.distributed_c10d, "_abort_process_group", lambda: calls.append("abort"))
    monkeypatch.setattr(distributed.dist, "destroy_process_group", lambda: calls.append("destroy"))
    distributed.close_tp()
    assert calls == ["abort"]
    assert not distributed.tp_group().active


_SCRIPT = """
import sys, time
sys.path.insert(0, {tests!r})
from pathlib import Path
from tiny_llama import engine, greedy

eng = engine(Path({model!r}), tp=2)
print("TOKENS", greedy(eng, [1, 5, 9], 4), flush=True)
{close}
print("LAST", time.monotonic(), flush=True)
"""


@pytest.mark.parametrize("close", [True, False], ids=["closed", "left-open"])
def test_a_tp2_script_without_a_main_guard_runs_and_exits_promptly(dense_dir, tmp_path, close) -> None:
    """A user's script at module level (no ``if __name__ == "__main__":``): the ranks, started
    by spawn, must not run it again (each would start an engine of its own), and the script
    exits within seconds of its last line, whether or not it closed the engine."""
    import subprocess
    import sys
    import time

    script = tmp_path / "user_script.py"
    script.write_text(_SCRIPT.format(tests=str(Path(__file__).parent), model=str(dense_dir),
                                     close="eng.close()" if close else ""))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    ended = time.monotonic()
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert len(eval(lines["TOKENS"])) == 4
    assert ended - float(lines["LAST"]) < 20


def test_a_rank_that_fails_before_joining_the_group_is_reported_at_once(tmp_path) -> None:
    """Rank 0 joins the process group only once every rank is about to: torch's rendezvous
    would wait for a rank that died while starting for the whole collective timeout."""
    from conveyor.engine.config import EngineConfig
    from conveyor.engine.tp_workers import TPWorkers

    workers = TPWorkers(tmp_path / "no-such-model", EngineConfig(device="cpu", tp=2))
    try:
        with pytest.raises(TPWorkerError, match="failed while starting"):
            workers.wait_joining(timeout=120)
    finally:
        workers.close()


def test_a_frozen_rank_is_found_and_every_rank_stopped(dense_dir) -> None:
    eng = engine(dense_dir, tp=2)
    try:
        workers = eng.tp_workers
        workers.hang_timeout = 2.0  # (EngineConfig.tp_hang_timeout; 30 s by default)
        pid = workers.procs[0].pid
        os.kill(pid, signal.SIGSTOP)  # alive but frozen: its heartbeat stops
        wait_until(lambda: workers.failure is not None, "the frozen rank to be found", 20, every=0.1)
        assert "heartbeat" in workers.failure
        assert not any(p.is_alive() for p in workers.procs)  # killed, stopped or not
        # removed before on_failure, which in the engine process leaves by os._exit (no clean-up after it)
        assert not Path(workers._dir).exists()
        eng.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))
        with pytest.raises(TPWorkerError, match="heartbeat"):
            eng.step()
    finally:
        eng.close()


def test_a_wait_on_a_step_that_a_killed_rank_never_ends_raises_instead_of_hanging(dense_dir) -> None:
    """Under NCCL a step whose collective waits on a dead rank may never end: rank 0 waits for
    its step's results by polling (TPWorkers.wait_for), which ends in the rank's failure."""
    import time

    eng = engine(dense_dir, tp=2)
    try:
        workers = eng.tp_workers
        os.kill(workers.procs[0].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(TPWorkerError, match="exited"):
            workers.wait_for(lambda: False)  # the query of an event that never completes
        assert time.monotonic() - start < 10
    finally:
        start = time.monotonic()
        eng.close()
        assert time.monotonic() - start < 10


@pytest.mark.parametrize("value, tp, error", [("bogus", 2, "not one of nccl, one_shot, two_shot, fused"),
                                              ("one_shot", 2, "needs CUDA devices"),
                                              ("fused", 2, "needs CUDA devices"),
                                              ("fused", 1, "runs tp=1 with none"),
                                              ("two_shot", 1, "runs tp=1 with none")])
def test_a_wrong_all_reduce_path_is_refused_before_any_rank_starts(dense_dir, value, tp, error) -> None:
    import multiprocessing

    before = multiprocessing.active_children()
    with pytest.raises(EngineConfigError, match=error):
        engine(dense_dir, tp=tp, tp_all_reduce=value)
    assert multiprocessing.active_children() == before


def test_a_peer_path_refuses_float16_which_its_kernels_lack() -> None:
    from conveyor.engine.peer_all_reduce import check_all_reduce

    cuda = torch.device("cuda", 0)  # only checked, never touched
    for kind in ("one_shot", "two_shot"):
        with pytest.raises(EngineConfigError, match="no torch.float16.*bfloat16"):
            check_all_reduce(kind, cuda, True, torch.float16)
        check_all_reduce(kind, cuda, True, torch.bfloat16)
    check_all_reduce("nccl", cuda, True, torch.float16)  # NCCL sums any dtype
    check_all_reduce("fused", cuda, True, torch.float16)  # and so does the fused kernel (kernels/peer_norm.py)


@pytest.mark.parametrize("sites, ring", [(64, 2), (2, 2), (7, 4), (5, 3), (13, None), (1, None)])
def test_the_fused_all_reduce_s_slot_ring_never_repeats_a_slot_twice_running(sites, ring) -> None:
    """Consecutive sums, the last of a forward and the first of the next included, never share a
    slot: a rank would otherwise overwrite a part a slower peer still reads."""
    from types import SimpleNamespace

    from conveyor.engine.peer_all_reduce import FusedNormAllReduce

    linears = [SimpleNamespace(reduce_slot=None) for _ in range(sites)]
    assigned = FusedNormAllReduce.assign(object.__new__(FusedNormAllReduce), linears)
    assert assigned == (ring is not None)
    slots = [lin.reduce_slot for lin in linears]
    if ring is None:
        assert slots == [None] * sites
        return
    assert max(slots) == ring - 1
    order = slots + slots  # two forwards
    assert all(a != b for a, b in zip(order, order[1:]))


def test_an_unwritable_timing_directory_loses_nothing(dense_dir, tmp_path) -> None:
    """The step times cannot be saved (the directory is a file): the ranks still answer, leave
    the group with rank 0 and exit by themselves."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    eng = engine(dense_dir, tp=2, rank_timing_dir=str(blocker))
    procs = list(eng.tp_workers.procs)
    try:
        tokens, _ = _trace(eng, n=3)
        assert all(len(t) == 3 for t in tokens.values())
    finally:
        eng.close()
    assert [p.exitcode for p in procs] == [0]


def test_small_all_reduces_take_the_peer_path_and_large_ones_the_group() -> None:
    from conveyor.engine.distributed import TPGroup

    class Peer:
        def __init__(self):
            self.summed = []

        def fits(self, x):
            return x.numel() <= 8

        def __call__(self, x):
            self.summed.append(x.numel())
            return x.mul_(2)

    peer = Peer()
    group = TPGroup(0, 2, None, peer)
    small, large = torch.ones(2, 4), torch.ones(3, 4)
    assert group.all_reduce(small) is small and small.eq(2).all()
    assert group.all_reduce(large) is large and large.eq(1).all()  # no process group here: unchanged
    assert peer.summed == [8]


@pytest.mark.gpu
@pytest.mark.parametrize("allreduce", ["nccl", "one_shot", "two_shot", "fused"])
def test_the_nccl_path_at_world_size_1_runs_inside_the_decode_graphs(dense_dir, allreduce) -> None:
    """Tensor parallel's collectives (an all-reduce in every row-parallel layer and the embedding,
    by NCCL or by peer reads, EngineConfig.tp_all_reduce) captured in the decode CUDA graphs and
    replayed, the LM head's all-gather and the sampled ids' broadcast (or, for greedy steps, the
    vocab-parallel argmax's exchange) after them: the same tokens and logprobs as the engine
    without a process group."""
    import torch.distributed as dist

    from conveyor.engine.config import EngineConfig
    from conveyor.engine.distributed import tp_group
    from conveyor.engine.llm_engine import LLMEngine

    def gpu_engine(**kw):
        # bfloat16: the peer paths' kernels have no float16 (test above)
        config = EngineConfig(device="cuda", dtype="bfloat16", cache_max_entry_count=64, block_size=16,
                              max_batch_size=8, tp_all_reduce=kw.pop("tp_all_reduce", "nccl"))
        return LLMEngine(dense_dir, config, **kw)

    plain = gpu_engine()
    try:
        assert not tp_group().active and plain.runner.decode_graphs.captured
        ref = _trace(plain)
    finally:
        plain.close()
    eng = gpu_engine(process_group=True, tp_all_reduce=allreduce)
    try:
        assert tp_group().active and dist.get_backend() == "nccl"
        assert (tp_group().peer is None) == (allreduce in ("nccl", "fused"))  # fused has its own buffer
        assert (tp_group().fused is None) == (allreduce != "fused")
        assert eng.runner.decode_graphs.captured and eng.runner.use_cuda_graphs
        replays = []
        eng.runner.step_hooks.append(type("Hook", (), {"begin": lambda self, graph: replays.append(graph),
                                                        "end": lambda self: None})())
        got = _trace(eng)
        assert sum(replays) > 0  # decode steps replayed the graphs
        # Without logprobs, every step is plain greedy: the graphs' shard, then the vocab-parallel
        # argmax over NCCL, for the ids the sampler took on the gathered logits just now.
        plans, calls = _watch(eng.runner)
        assert _tokens(eng, [(p, SamplingParams(max_new_tokens=10, temperature=0.0)) for p in PROMPTS]) == got[0]
        assert (StepKind.GRAPH, True) in plans and all(argmax for _, argmax in plans) and not calls
    finally:
        eng.close()
    assert not tp_group().active
    _same(ref, got, atol=1e-3)


def test_a_row_parallel_product_lands_in_its_fused_slot_without_a_copy(monkeypatch) -> None:
    """Under the fused all-reduce a dense row-parallel linear writes its product straight into
    its slot of the shared buffer (the GEMV's or cuBLAS's output is the slot: no copy kernel
    after it); a part past the slot's rows is all-reduced as before, and a weight format that
    cannot write into a given buffer is copied in (``stage``). On the CPU, with the buffer a
    plain tensor: the same values as the layer without tensor parallel."""
    from conveyor.engine import distributed
    from conveyor.engine.layers.linear import RowParallelLinear
    from conveyor.engine.peer_all_reduce import FusedNormAllReduce, PartialSum

    fused = object.__new__(FusedNormAllReduce)
    fused.device, fused.max_rows, fused.slot_bytes = torch.device("cpu"), 8, 4096
    fused._slots = [torch.zeros(4096, dtype=torch.uint8) for _ in range(4)]
    monkeypatch.setattr(distributed, "_GROUP", distributed.TPGroup(fused=fused))
    gen = torch.Generator().manual_seed(0)
    layer = RowParallelLinear(16, 24, bias=True)
    layer.weight.data = torch.randn(24, 16, generator=gen)
    layer.bias.data = torch.randn(24, generator=gen)
    layer.reduce_slot = 1
    x = torch.randn(3, 16, generator=gen)
    want = torch.nn.functional.linear(x, layer.weight, layer.bias)

    got = layer(x)
    assert isinstance(got, PartialSum) and got.slot == 1
    assert got.part.untyped_storage().data_ptr() == fused._slots[1].untyped_storage().data_ptr()
    assert torch.equal(got.part, want)

    big = torch.randn(9, 16, generator=gen)  # past max_rows: summed by the group's all-reduce
    out = layer(big)
    assert not isinstance(out, PartialSum)
    assert torch.equal(out, torch.nn.functional.linear(big, layer.weight, layer.bias))

    class CopiedIn(type(layer.method)):  # a weight format without ``out``
        writes_into = False

        def apply(self, lay, t):
            return super().apply(lay, t)

    layer.method = CopiedIn()
    staged = layer(x)
    assert isinstance(staged, PartialSum)
    assert staged.part.untyped_storage().data_ptr() != fused._slots[1].untyped_storage().data_ptr()
    assert torch.equal(fused._slots[1][:3 * 24 * 4].view(torch.float32).view(3, 24), want)



def test_a_second_peer_path_engine_in_one_process_is_refused_not_waited_on(monkeypatch) -> None:
    """torch's symmetric-memory rendezvous numbers its store keys with a count kept per process:
    a process that set it up for an earlier engine and the fresh rank processes of the next wait
    on different keys forever (two H200s, a second fused engine in one process). Every peer path
    maps its buffers that way, so once one has, another is refused before any rank starts, with
    the fix in the message; NCCL needs none and starts as often as asked, and a group of this
    process alone (tp=1 with a process group, the world-size-1 graph test) reads its own keys."""
    from conveyor.engine import peer_all_reduce

    gpu = torch.device("cuda", 0)  # only checked, never touched
    monkeypatch.setattr(peer_all_reduce, "_SYMMETRIC_MEMORY_SET_UP", False)  # (a GPU test may have)
    for kind in ("one_shot", "two_shot", "fused"):  # nothing set up yet: the first engine may
        peer_all_reduce.check_all_reduce(kind, gpu, dtype=torch.bfloat16, ranks=2)
    monkeypatch.setattr(peer_all_reduce, "_SYMMETRIC_MEMORY_SET_UP", True)  # by an earlier engine
    for kind in ("one_shot", "two_shot", "fused"):
        with pytest.raises(EngineConfigError, match="fresh process"):
            peer_all_reduce.check_all_reduce(kind, gpu, dtype=torch.bfloat16, ranks=2)
        peer_all_reduce.check_all_reduce(kind, gpu, dtype=torch.bfloat16, ranks=1)
    peer_all_reduce.check_all_reduce("nccl", gpu, dtype=torch.bfloat16, ranks=2)
