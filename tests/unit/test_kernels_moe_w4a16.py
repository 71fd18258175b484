"""The fused-MoE kernel on AWQ experts (kernels/moe/: gemm_w4a16.py, launch_w4a16.py) against its
reference (reference_w4a16.py: the experts dequantized, then ``fused_moe_ref``).

As in test_kernels_moe.py: **interpreter** cases (CPU tensors, small H and I, several E, k and
group sizes; fp16 and bf16, the dtypes the W4A16 kernels take), and **gpu** cases (the
Mixtral-8x7B and Qwen3-30B-A3B expert shapes, the dispatcher's choice on CUDA, a CUDA-graph
capture replayed with new routing). Routed ids leave one expert unused and put some pairs on
experts outside [0, E) (other ranks'), which contribute nothing. Buffers the launcher allocates
are NaN-poisoned (``forced``): a row the kernels forget shows as NaN.
"""

import importlib

import pytest
import torch

# kernel_harness first: where Triton is missing, importing it skips this file.
from kernel_harness import assert_close, compiled_gpu, gpu, interp, run_interpreter_cases_in_child
from conveyor.kernels._triton import TRITON_INTERPRETED, set_kernel_mode
from conveyor.kernels.moe import fused_moe_ref, select_experts
from conveyor.kernels.moe.launch_w4a16 import fused_moe_w4a16, fused_moe_w4a16_triton
from conveyor.kernels.moe.policy import MoeConfig
from conveyor.kernels.moe.reference_w4a16 import dequantize_experts_ref, fused_moe_w4a16_ref
from conveyor.kernels.w4a16 import awq_pack

launch_mod = importlib.import_module("conveyor.kernels.moe.launch_w4a16")

# The kernel rounds the dequantized weights, act(gate) * up and each slot's weighted product to
# the dtype (the reference keeps fp32 throughout): test_kernels_moe.py's bounds, the weight
# rounding (half an ulp per weight, averaging out over K) well inside them.
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES, DTYPE_IDS = [torch.float16, torch.bfloat16], ["fp16", "bf16"]


def _awq_stack(experts: int, k: int, n: int, group: int, g: torch.Generator, device: str):
    """Random stacked AWQ triples [E, K, N/8], [E, K/g, N/8], [E, K/g, N] fp32 scales whose
    dequantized weights are ~N(0, 1/K)-sized, drawn and packed on ``device`` (on the CPU and
    expert by expert, the GPU shapes took ~10 s a case)."""
    groups = -(-k // group)
    q = torch.randint(0, 16, (experts, k, n), generator=g, device=device, dtype=torch.int32)
    z = torch.randint(0, 16, (experts, groups, n), generator=g, device=device, dtype=torch.int32)
    s = (0.5 + torch.rand(experts, groups, n, generator=g, device=device)) / (6.0 * k**0.5)
    qweight = awq_pack(q.view(experts * k, n)).view(experts, k, n // 8)
    qzeros = awq_pack(z.view(experts * groups, n)).view(experts, groups, n // 8)
    return qweight, qzeros, s


def make_case(tokens, experts, top_k, hidden, inter, group, dtype, device="cpu", foreign=True, seed=0):
    """(x, w13 triple, w2 triple, weights, ids): ids from a random router over E - 1 experts and,
    with ``foreign``, every fourth pair (from the second) on an expert outside [0, E)."""
    g = torch.Generator(device=device).manual_seed(seed)
    gw = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, device=device, generator=g).to(dtype)
    w13 = _awq_stack(experts, hidden, 2 * inter, group, gw, device)
    w2 = _awq_stack(experts, inter, hidden, group, gw, device)
    w13, w2 = w13[:2] + (w13[2].to(dtype),), w2[:2] + (w2[2].to(dtype),)
    logits = torch.randn(tokens, max(experts - 1, top_k), device=device, generator=g)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    if foreign:
        flat = ids.view(-1)
        others = torch.tensor([-1, experts, experts + 5], dtype=torch.int32, device=device).repeat(flat.numel())
        flat[1::4] = others[: flat[1::4].numel()]
    return x, w13, w2, weights, ids


def run(fn, case, group, activation="silu", **kw):
    x, w13, w2, weights, ids = case
    return fn(x, *w13, *w2, group, weights, ids, activation, **kw)


# ----------------------------------------------------------------------------------- any machine


def test_reference_is_fused_moe_ref_on_the_dequantized_experts() -> None:
    """The reference dequantizes exactly the experts in use: the dense reference on the dense
    experts (every one dequantized) gives the same fp32 result, and pairs of other ranks' experts
    add nothing."""
    case = make_case(7, 4, 2, 32, 64, 32, torch.float32, seed=1)
    x, w13, w2, weights, ids = case
    dense13, dense2 = dequantize_experts_ref(*w13, 32), dequantize_experts_ref(*w2, 32)
    assert dense13.shape == (4, 128, 32) and dense2.shape == (4, 32, 64)
    torch.testing.assert_close(run(fused_moe_w4a16_ref, case, 32), fused_moe_ref(x, dense13, dense2, weights, ids),
                               rtol=0, atol=0)


def test_wrong_shapes_are_named() -> None:
    x, w13, w2, weights, ids = make_case(3, 4, 2, 32, 64, 32, torch.float32)
    with pytest.raises(ValueError, match="w2_scales"):
        fused_moe_w4a16_ref(x, *w13, w2[0], w2[1], w2[2][:, :1], 32, weights, ids)


# ---------------------------------------------------------------------------------- interpreter


@interp
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("tokens", "experts", "top_k", "group"),
                         [(1, 4, 2, 32), (5, 8, 2, 64), (17, 4, 1, 128), (9, 8, 3, 32)])
def test_interp_fused_moe_w4a16(tokens, experts, top_k, group, dtype, forced: None) -> None:
    # H 128, I 128: two groups of 64 or one of 128 over each K; 32: four.
    case = make_case(tokens, experts, top_k, 128, 128, group, dtype, seed=tokens)
    assert_close(run(fused_moe_w4a16, case, group), run(fused_moe_w4a16_ref, case, group), TOL[dtype])


@interp
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_interp_activations(activation: str, forced: None) -> None:
    case = make_case(6, 4, 2, 64, 64, 32, torch.float16, seed=3)
    out = run(fused_moe_w4a16, case, 32, activation)
    assert_close(out, run(fused_moe_w4a16_ref, case, 32, activation), TOL[torch.float16])


@interp
@pytest.mark.parametrize("cfg", [MoeConfig.uniform(16, 16, 16, 4, 1), MoeConfig.uniform(32, 32, 64, 4, 1)],
                         ids=["m16n16k16", "m32n32k64"])
def test_interp_tiles(cfg: MoeConfig, forced: None) -> None:
    """Tiles narrower than I and H (several column programs) and K tiles shorter than a group."""
    case = make_case(11, 4, 2, 64, 96, 32, torch.float16, seed=5)
    out = run(fused_moe_w4a16_triton, case, 32, config=cfg)
    assert_close(out, run(fused_moe_w4a16_ref, case, 32), TOL[torch.float16])


def test_interpreter_cases_in_child() -> None:
    if TRITON_INTERPRETED:
        pytest.skip("this process runs Triton interpreted: the interpreter cases ran here")
    run_interpreter_cases_in_child(__file__)


# ------------------------------------------------------------------------------------------- gpu

MIXTRAL = dict(hidden=4096, inter=14336, experts=8, top_k=2)
QWEN3_30B = dict(hidden=2048, inter=768, experts=128, top_k=8)


def gpu_case(shape: dict, tokens: int, dtype: torch.dtype, group: int = 128, foreign: bool = False, seed: int = 0):
    return make_case(tokens, shape["experts"], shape["top_k"], shape["hidden"], shape["inter"], group, dtype,
                     "cuda", foreign, seed)


@gpu
@compiled_gpu
def test_gpu_dispatch_picks_triton_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    set_kernel_mode("auto")

    def boom(*args, **kwargs):
        raise AssertionError("reference called on CUDA tensors")

    monkeypatch.setattr(launch_mod, "fused_moe_w4a16_ref", boom)
    run(fused_moe_w4a16, gpu_case(dict(hidden=64, inter=96, experts=4, top_k=2), 8, torch.bfloat16, 32), 32)
    torch.cuda.synchronize()


@gpu
@compiled_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("tokens", [1, 16, 256])
def test_gpu_mixtral(tokens: int, dtype: torch.dtype, forced: None) -> None:
    case = gpu_case(MIXTRAL, tokens, dtype)
    assert_close(run(fused_moe_w4a16, case, 128), run(fused_moe_w4a16_ref, case, 128), TOL[dtype])


@gpu
@compiled_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("tokens", [1, 16, 256, 2048])
def test_gpu_qwen3_30b(tokens: int, dtype: torch.dtype, forced: None) -> None:
    """With every fourth pair on another rank's expert, as under expert parallelism."""
    case = gpu_case(QWEN3_30B, tokens, dtype, foreign=True)
    assert_close(run(fused_moe_w4a16, case, 128), run(fused_moe_w4a16_ref, case, 128), TOL[dtype])


@gpu
@compiled_gpu
def test_gpu_cuda_graph_replays_new_routing() -> None:
    """Captured once, a decode-sized call replays with other tokens routed to other experts."""
    set_kernel_mode("auto")
    dtype = torch.bfloat16
    case = gpu_case(QWEN3_30B, 4, dtype, seed=0)
    x, _, _, weights, ids = case
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        run(fused_moe_w4a16, case, 128)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(fused_moe_w4a16, case, 128)
    for seed in (1, 2):
        x2, _, _, weights2, ids2 = gpu_case(QWEN3_30B, 4, dtype, foreign=seed == 2, seed=seed)
        x.copy_(x2), weights.copy_(weights2), ids.copy_(ids2)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, run(fused_moe_w4a16_ref, case, 128), TOL[dtype])
