"""The fused-MoE Triton kernel (kernels/moe/: align.py, gemm.py, launch.py) against the reference.

As in test_kernels.py, two kinds of case:

* **interpreter** cases (CPU tensors, small sizes, fp32): Triton's interpreter runs the alignment
  and both grouped GEMMs; where this process has Triton compiled, ``test_interpreter_cases_in_child``
  runs them in a child pytest with ``TRITON_INTERPRET=1``. The ids leave some experts unused and
  put some pairs on experts outside [0, E) (other ranks'), which must contribute nothing;
* **gpu** cases (marked ``gpu``): the Mixtral-8x7B and Qwen3-30B-A3B expert shapes in fp16/bf16,
  the dispatcher's choice on CUDA, and a CUDA-graph capture replayed with new routing.

Buffers the launcher allocates with ``torch.empty`` are NaN-poisoned (``forced``/``poisoned_empty``):
a row the kernels forget, or one they read unwritten, shows as NaN.
"""

import importlib

import pytest
import torch

# kernel_harness first: where Triton is missing, importing it skips this file.
from kernel_harness import assert_close, compiled_gpu, gpu, interp, run_interpreter_cases_in_child
from conveyor.kernels._triton import TRITON_INTERPRETED, set_kernel_mode
from conveyor.kernels.moe import fused_moe, fused_moe_ref, select_experts
from conveyor.kernels.moe.align import KERNEL_MAX_PAIRS, max_tiles, moe_align, moe_align_ref, moe_align_triton
from conveyor.kernels.moe.launch import fused_moe_triton
from conveyor.kernels.moe.policy import MoeConfig, moe_config
from conveyor.kernels.moe.routing import select_experts_ref
from conveyor.kernels.moe.router import router_logits_ref, router_logits_triton
from conveyor.kernels.moe.topk import select_experts_triton

launch_mod = importlib.import_module("conveyor.kernels.moe.launch")

# fp32 with ieee dots: only the summation order differs from the reference.
INTERP_TOL = 1e-5
# The kernel rounds act(gate)*up and each slot's weighted product to the dtype before the sum over
# k (the reference keeps them fp32): about three roundings of half an ulp each, in norm
# ~1e-3 (fp16, ulp 2**-10) and ~8e-3 (bf16, 2**-7); the bounds leave twice that.
GPU_TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def make_case(tokens, experts, top_k, hidden, inter, dtype=torch.float32, device="cpu", foreign=True, seed=0):
    """x, w13, w2, weights, ids with ids from a random router over E - 1 experts (the last expert
    gets no token) and, with ``foreign``, every fourth pair (from the second) on an expert outside
    [0, E). Drawn on ``device``: model-sized weights drawn on the CPU take seconds a case."""
    g = torch.Generator(device=device).manual_seed(seed)
    to = dict(device=device, generator=g)
    x = torch.randn(tokens, hidden, **to).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, **to) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, **to) / inter**0.5).to(dtype)
    logits = torch.randn(tokens, max(experts - 1, top_k), **to)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    if foreign:
        flat = ids.view(-1)
        others = torch.tensor([-1, experts, experts + 5], dtype=torch.int32, device=device).repeat(flat.numel())
        flat[1::4] = others[: flat[1::4].numel()]
    return x, w13, w2, weights, ids

# ----------------------------------------------------------------------------------- any machine


@pytest.mark.parametrize("block_m", [4, 16])
def test_align_layout(block_m: int) -> None:
    """moe_align's layout is the host loop's: each expert's pairs in order, padded to block_m; the
    used tiles first, then -1; the grid bound holds."""
    g = torch.Generator().manual_seed(1)
    for tokens, top_k, experts in [(1, 2, 8), (5, 2, 4), (33, 2, 8), (40, 8, 128), (3, 1, 1)]:
        ids = torch.randint(-2, experts + 2, (tokens, top_k), generator=g, dtype=torch.int32)
        pairs, tile_expert, used = moe_align(ids, experts, block_m)
        ref_pairs, ref_experts = moe_align_ref(ids, experts, block_m)
        n = used.item()
        assert tile_expert.numel() == max_tiles(tokens * top_k, experts, block_m) >= n == len(ref_experts)
        assert tile_expert[:n].tolist() == ref_experts and (tile_expert[n:] == -1).all()
        assert pairs[: n * block_m].tolist() == ref_pairs and (pairs[n * block_m :] == tokens * top_k).all()


def test_align_is_capturable() -> None:
    """No op of moe_align syncs with the host or copies a host scalar in (the first GPU run's
    graph capture failed on ``tiles_of[E] = 0``, a copy_ from a CPU scalar): run on the meta
    device under a dispatch mode that lists every op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    ids = torch.randint(0, 8, (4, 2), dtype=torch.int32).to("meta")
    with Ops():
        moe_align(ids, 8, 16)
    bad = [op for op in seen if any(s in op for s in ("copy_", "_local_scalar_dense", "nonzero", "item"))]
    assert seen and not bad, bad


def test_policy_by_rows_per_expert() -> None:
    assert moe_config(1, 2, 8).block_m == 16  # decode
    assert moe_config(16, 8, 128).block_m == 16
    assert moe_config(2048, 2, 8).block_m == 64  # prefill: 512 rows per expert
    assert moe_config(8192, 2, 8).block_m == 128
    assert moe_config(1, 2, 8, element_size=4).gate_up.num_stages == 2


# ---------------------------------------------------------------------------------- interpreter


@interp
@pytest.mark.parametrize("tokens", [1, 5, 33])
@pytest.mark.parametrize("experts", [4, 8])
@pytest.mark.parametrize("top_k", [1, 2])
def test_interp_fused_moe(tokens: int, experts: int, top_k: int, forced: None) -> None:
    x, w13, w2, weights, ids = make_case(tokens, experts, top_k, 32, 48)
    assert_close(fused_moe(x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids), INTERP_TOL)


@interp
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_interp_activations(activation: str, forced: None) -> None:
    x, w13, w2, weights, ids = make_case(9, 4, 2, 32, 48, seed=3)
    out = fused_moe(x, w13, w2, weights, ids, activation)
    assert_close(out, fused_moe_ref(x, w13, w2, weights, ids, activation), INTERP_TOL)


@interp
@pytest.mark.parametrize(
    "cfg",
    [MoeConfig.uniform(16, 16, 16, 4, 1), MoeConfig.uniform(32, 32, 32, 4, 1), MoeConfig.uniform(64, 64, 64, 4, 1)],
    ids=["m16", "m32", "m64"],
)
def test_interp_tiles(cfg: MoeConfig, poisoned_empty: None) -> None:
    """Tiles smaller than H and I (several K steps, several column tiles, ragged ends) and larger."""
    x, w13, w2, weights, ids = make_case(21, 8, 2, 40, 72, seed=4)
    out = fused_moe_triton(x, w13, w2, weights, ids, config=cfg)
    assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), INTERP_TOL)


@interp
def test_interp_all_foreign_and_strided_x(forced: None) -> None:
    """Every pair on another rank's expert: zeros. A strided x view is read as it is."""
    x, w13, w2, weights, ids = make_case(6, 4, 2, 32, 48, seed=5, foreign=False)
    out = fused_moe(x, w13, w2, weights, torch.full_like(ids, 7))
    assert torch.equal(out, torch.zeros_like(x))
    wide = torch.randn(6, 64)
    xs = wide[:, :32]
    assert_close(fused_moe(xs, w13, w2, weights, ids), fused_moe_ref(xs, w13, w2, weights, ids), INTERP_TOL)


@interp
def test_interp_forced_rejects(forced: None) -> None:
    x, w13, w2, weights, ids = make_case(2, 4, 1, 32, 48)
    with pytest.raises(ValueError, match="activation"):
        fused_moe(x, w13, w2, weights, ids, "relu")
    with pytest.raises(ValueError, match="dtype"):
        fused_moe(x.double(), w13.double(), w2.double(), weights, ids)


@interp
@pytest.mark.parametrize("block_m", [4, 16])
def test_interp_align_kernels_layout(block_m: int) -> None:
    """The two Triton alignment kernels lay the pairs out as the host loop does: chunks of 64 pairs
    (several, and a ragged last one), ids outside [0, E) on both sides, unused experts, E not a
    power of two, and a single expert."""
    g = torch.Generator().manual_seed(2)
    for tokens, top_k, experts in [(1, 2, 8), (5, 2, 4), (33, 2, 8), (40, 8, 128), (3, 1, 1), (70, 3, 6), (150, 8, 60)]:
        ids = torch.randint(-2, experts + 3, (tokens, top_k), generator=g, dtype=torch.int32)
        pairs, tile_expert, used = moe_align_triton(ids, experts, block_m)
        ref_pairs, ref_experts = moe_align_ref(ids, experts, block_m)
        n = used.item()
        assert tile_expert.numel() == max_tiles(tokens * top_k, experts, block_m) and n == len(ref_experts)
        assert tile_expert[:n].tolist() == ref_experts and (tile_expert[n:] == -1).all()
        assert pairs[: n * block_m].tolist() == ref_pairs and (pairs[n * block_m :] == tokens * top_k).all()


@interp
def test_interp_align_dispatch_by_pairs(monkeypatch: pytest.MonkeyPatch, forced: None) -> None:
    """Up to KERNEL_MAX_PAIRS pairs take the kernels, past it the torch ops: the same layout."""
    align_mod = importlib.import_module("conveyor.kernels.moe.align")
    calls = []
    monkeypatch.setattr(align_mod, "moe_align_triton", lambda *a: calls.append("triton") or moe_align_triton(*a))
    small = torch.randint(0, 8, (3, 2), dtype=torch.int32)
    big = torch.randint(0, 8, (KERNEL_MAX_PAIRS // 2 + 1, 2), dtype=torch.int32)
    moe_align(small, 8, 16)
    assert calls == ["triton"]
    pairs, tile_expert, used = moe_align(big, 8, 16)
    assert calls == ["triton"]
    ref_pairs, ref_experts = moe_align_ref(big, 8, 16)
    assert tile_expert[: used.item()].tolist() == ref_experts and pairs[: len(ref_pairs)].tolist() == ref_pairs


@interp
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(("experts", "top_k"), [(8, 2), (60, 4), (128, 8), (5, 5)])
def test_interp_select_experts_kernel(scoring: str, renormalize: bool, experts: int, top_k: int) -> None:
    """One program per token gives the reference's experts, in its order, and their weights;
    fp16 logits are scored in fp32."""
    g = torch.Generator().manual_seed(experts + top_k)
    for dtype in (torch.float32, torch.float16):
        logits = (torch.randn(7, experts, generator=g) * 3).to(dtype)
        weights, ids = select_experts_triton(logits, top_k, renormalize, scoring)
        ref_w, ref_ids = select_experts_ref(logits, top_k, renormalize, scoring)
        assert ids.dtype == torch.int32 and torch.equal(ids, ref_ids)
        assert_close(weights, ref_w, 1e-6)


@interp
@pytest.mark.parametrize(("tokens", "experts", "hidden"), [(1, 128, 2048), (3, 8, 300), (16, 60, 64), (2, 5, 17)])
def test_interp_router_logits_kernel(tokens: int, experts: int, hidden: int) -> None:
    """fp32 router logits from bf16 / fp32 x against F.linear on x.float(): ragged E and H."""
    g = torch.Generator().manual_seed(tokens * experts)
    w = torch.randn(experts, hidden, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(tokens, hidden, generator=g).to(dtype)
        out = router_logits_triton(x, w)
        assert out.dtype == torch.float32
        assert_close(out, router_logits_ref(x, w), 1e-6)


@interp
def test_interp_select_experts_ties_take_the_lowest_index() -> None:
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0]])
    _, ids = select_experts_triton(logits, 3, True)
    assert ids.tolist() == [[1, 2, 4]]


@pytest.mark.skipif(TRITON_INTERPRETED, reason="the interpreter cases run in this process")
def test_interpreter_cases_in_child() -> None:
    """Run this file's interpreter cases in a child process that imports triton interpreted."""
    run_interpreter_cases_in_child(__file__)


# ------------------------------------------------------------------------------------------ GPU

GPU_DTYPES = [torch.float16, torch.bfloat16]
GPU_IDS = ["fp16", "bf16"]
MIXTRAL = dict(hidden=4096, inter=14336, experts=8, top_k=2)
QWEN3_30B = dict(hidden=2048, inter=768, experts=128, top_k=8)


def gpu_case(shape: dict, tokens: int, dtype: torch.dtype, foreign: bool = False, seed: int = 0):
    return make_case(tokens, shape["experts"], shape["top_k"], shape["hidden"], shape["inter"], dtype,
                     "cuda", foreign, seed)


@gpu
@compiled_gpu
def test_gpu_dispatch_picks_triton_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    set_kernel_mode("auto")

    def boom(*args, **kwargs):
        raise AssertionError("reference called on CUDA tensors")

    monkeypatch.setattr(launch_mod, "fused_moe_ref", boom)
    x, w13, w2, weights, ids = gpu_case(dict(hidden=64, inter=96, experts=4, top_k=2), 8, torch.bfloat16)
    fused_moe(x, w13, w2, weights, ids)
    torch.cuda.synchronize()


@gpu
@compiled_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=GPU_IDS)
@pytest.mark.parametrize("tokens", [1, 16, 256])
def test_gpu_mixtral(tokens: int, dtype: torch.dtype, forced: None) -> None:
    x, w13, w2, weights, ids = gpu_case(MIXTRAL, tokens, dtype)
    assert_close(fused_moe(x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids), GPU_TOL[dtype])


@gpu
@compiled_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=GPU_IDS)
@pytest.mark.parametrize("tokens", [1, 16, 256, 2048])
def test_gpu_qwen3_30b(tokens: int, dtype: torch.dtype, forced: None) -> None:
    """With every fourth pair on another rank's expert, as under expert parallelism."""
    x, w13, w2, weights, ids = gpu_case(QWEN3_30B, tokens, dtype, foreign=True)
    assert_close(fused_moe(x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids), GPU_TOL[dtype])


@gpu
@compiled_gpu
def test_gpu_cuda_graph_replays_new_routing() -> None:
    """Captured once, a decode-sized call replays with other tokens routed to other experts."""
    set_kernel_mode("auto")
    dtype = torch.bfloat16
    x, w13, w2, weights, ids = gpu_case(QWEN3_30B, 4, dtype, seed=0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        fused_moe(x, w13, w2, weights, ids)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids)
    for seed in (1, 2):
        x2, _, _, weights2, ids2 = gpu_case(QWEN3_30B, 4, dtype, foreign=seed == 2, seed=seed)
        x.copy_(x2), weights.copy_(weights2), ids.copy_(ids2)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), GPU_TOL[dtype])
