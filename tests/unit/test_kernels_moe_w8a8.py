"""The fused-MoE kernel on W8A8 experts (kernels/moe/: gemm_w8a8.py, launch_w8a8.py) against its
reference (reference_w8a8.py: the kernels' int8 arithmetic in plain torch).

As in test_kernels_moe_w4a16.py: **interpreter** cases (CPU tensors, small H and I, several E and
k; fp16 and bf16, the dtypes the kernels take), and **gpu** cases (the Mixtral-8x7B and
Qwen3-30B-A3B expert shapes, the dispatcher's choice on CUDA, a CUDA-graph capture replayed with
new routing). Routed ids leave one expert unused and put some pairs on experts outside [0, E)
(other ranks'), which contribute nothing. Buffers the launcher allocates are NaN-poisoned
(``forced``): a row the kernels forget shows as NaN.
"""

import importlib

import pytest
import torch
import torch.nn.functional as F

# kernel_harness first: where Triton is missing, importing it skips this file.
from kernel_harness import assert_close, compiled_gpu, gpu, interp, run_interpreter_cases_in_child
from conveyor.kernels._triton import TRITON_INTERPRETED, set_kernel_mode
from conveyor.kernels.moe import fused_moe_ref, select_experts
from conveyor.kernels.moe.launch_w8a8 import fused_moe_w8a8, fused_moe_w8a8_triton
from conveyor.kernels.moe.policy import MoeConfig
from conveyor.kernels.moe.reference_w8a8 import fused_moe_w8a8_ref
from conveyor.kernels.w8a8 import quant_per_token_ref

launch_mod = importlib.import_module("conveyor.kernels.moe.launch_w8a8")

# Kernel and reference share every code and every fp32 operation but the activation's exp (an
# ulp apart), which may move an intermediate code by one: errors far below W8A8's own (~1e-2).
TOL = {torch.float16: 2e-3, torch.bfloat16: 8e-3}
# Triton's interpreter casts fp32 to bf16 by truncation (the GPU rounds to nearest): up to an ulp
# (2**-8) at each of h's and y's roundings, and the intermediate codes that follow h.
INTERP_TOL = {torch.float16: 2e-3, torch.bfloat16: 3e-2}
DTYPES, DTYPE_IDS = [torch.float16, torch.bfloat16], ["fp16", "bf16"]


def _int8_stack(experts: int, n: int, k: int, g: torch.Generator, device: str):
    """Random experts quantized per output channel: (int8 [E, N, K], fp32 scales [E, N]) whose
    dequantized weights are ~N(0, 1/K)-sized."""
    w = torch.randn(experts, n, k, generator=g, device=device) / k**0.5
    q, s = quant_per_token_ref(w)
    return q.view(experts, n, k), s.view(experts, n)


def make_case(tokens, experts, top_k, hidden, inter, dtype, device="cpu", foreign=True, seed=0):
    """(x, (w13, w13_scale), (w2, w2_scale), weights, ids): ids from a random router over E - 1
    experts and, with ``foreign``, every fourth pair (from the second) on an expert outside [0, E)."""
    g = torch.Generator(device=device).manual_seed(seed)
    # The experts come from a generator of their own, on the case's device: drawn on the CPU and
    # moved, the GPU shapes' billions of weights took ~10 s a case.
    gw = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, device=device, generator=g).to(dtype)
    w13 = _int8_stack(experts, 2 * inter, hidden, gw, device)
    w2 = _int8_stack(experts, hidden, inter, gw, device)
    logits = torch.randn(tokens, max(experts - 1, top_k), device=device, generator=g)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    if foreign:
        flat = ids.view(-1)
        others = torch.tensor([-1, experts, experts + 5], dtype=torch.int32, device=device).repeat(flat.numel())
        flat[1::4] = others[: flat[1::4].numel()]
    return x, w13, w2, weights, ids


def run(fn, case, activation="silu", **kw):
    x, w13, w2, weights, ids = case
    return fn(x, *w13, *w2, weights, ids, activation, **kw)


# ----------------------------------------------------------------------------------- any machine


def test_reference_is_w8a8_arithmetic() -> None:
    """The reference equals a per-token loop written from the format's definition: x quantized
    per token, (xq @ wq.T) * s_x * s_w, act(gate) * up rounded to x's dtype and quantized per
    row, the down product scaled and weighted, summed over the slots; other ranks' pairs add nothing."""
    case = make_case(7, 4, 2, 32, 64, torch.float16, seed=1)
    x, (w13, s13), (w2, s2), weights, ids = case
    want = torch.zeros(7, 32, dtype=torch.float32)
    for t in range(7):
        xq, xs = quant_per_token_ref(x[t:t + 1])
        for j in range(2):
            e = int(ids[t, j])
            if not 0 <= e < 4:
                continue
            gu = (xq.double() @ w13[e].double().t()).float() * xs * s13[e]
            h = (F.silu(gu[:, :64]) * gu[:, 64:]).half()
            hq, hs = quant_per_token_ref(h)
            y = (hq.double() @ w2[e].double().t()).float() * hs * s2[e] * weights[t, j]
            want[t] += y.half().float()[0]
    torch.testing.assert_close(run(fused_moe_w8a8_ref, case), want.half(), rtol=0, atol=0)


def test_reference_tracks_the_float_experts() -> None:
    """W8A8 of the dequantized experts stays near fused_moe_ref on them (the quantization error of
    x and the intermediate only)."""
    case = make_case(9, 4, 2, 64, 64, torch.float32, seed=2)
    x, (w13, s13), (w2, s2), weights, ids = case
    dense = fused_moe_ref(x, w13.float() * s13[..., None], w2.float() * s2[..., None], weights, ids)
    assert_close(run(fused_moe_w8a8_ref, case), dense, 3e-2)


def test_wrong_shapes_and_dtypes_are_named() -> None:
    x, (w13, s13), (w2, s2), weights, ids = make_case(3, 4, 2, 32, 64, torch.float32)
    with pytest.raises(ValueError, match="w2_scale"):
        fused_moe_w8a8_ref(x, w13, s13, w2, s2[:, :1], weights, ids)
    with pytest.raises(ValueError, match="int8 weights"):
        fused_moe_w8a8_ref(x, w13.float(), s13, w2, s2, weights, ids)


# ---------------------------------------------------------------------------------- interpreter


@interp
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 4, 2), (5, 8, 2), (17, 4, 1), (9, 8, 3)])
def test_interp_fused_moe_w8a8(tokens, experts, top_k, dtype, forced: None) -> None:
    case = make_case(tokens, experts, top_k, 128, 96, dtype, seed=tokens)
    assert_close(run(fused_moe_w8a8, case), run(fused_moe_w8a8_ref, case), INTERP_TOL[dtype])


@interp
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_interp_activations(activation: str, forced: None) -> None:
    case = make_case(6, 4, 2, 64, 64, torch.float16, seed=3)
    assert_close(run(fused_moe_w8a8, case, activation), run(fused_moe_w8a8_ref, case, activation),
                 TOL[torch.float16])


@interp
@pytest.mark.parametrize("cfg", [MoeConfig.uniform(16, 16, 32, 4, 1), MoeConfig.uniform(32, 32, 64, 4, 1)],
                         ids=["m16n16k32", "m32n32k64"])
def test_interp_tiles(cfg: MoeConfig, forced: None) -> None:
    """Tiles narrower than I and H (several column programs), K tiles that do not divide K."""
    case = make_case(11, 4, 2, 80, 96, torch.float16, seed=5)
    assert_close(run(fused_moe_w8a8_triton, case, config=cfg), run(fused_moe_w8a8_ref, case), TOL[torch.float16])


def test_interpreter_cases_in_child() -> None:
    if TRITON_INTERPRETED:
        pytest.skip("this process runs Triton interpreted: the interpreter cases ran here")
    run_interpreter_cases_in_child(__file__)


# ------------------------------------------------------------------------------------------- gpu

MIXTRAL = dict(hidden=4096, inter=14336, experts=8, top_k=2)
QWEN3_30B = dict(hidden=2048, inter=768, experts=128, top_k=8)


def gpu_case(shape: dict, tokens: int, dtype: torch.dtype, foreign: bool = False, seed: int = 0):
    return make_case(tokens, shape["experts"], shape["top_k"], shape["hidden"], shape["inter"], dtype, "cuda",
                     foreign, seed)


@gpu
@compiled_gpu
def test_gpu_dispatch_picks_triton_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    set_kernel_mode("auto")

    def boom(*args, **kwargs):
        raise AssertionError("reference called on CUDA tensors")

    monkeypatch.setattr(launch_mod, "fused_moe_w8a8_ref", boom)
    run(fused_moe_w8a8, gpu_case(dict(hidden=64, inter=96, experts=4, top_k=2), 8, torch.bfloat16))
    torch.cuda.synchronize()


@gpu
@compiled_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("tokens", [1, 16, 256])
def test_gpu_mixtral(tokens: int, dtype: torch.dtype, forced: None) -> None:
    case = gpu_case(MIXTRAL, tokens, dtype)
    assert_close(run(fused_moe_w8a8, case), run(fused_moe_w8a8_ref, case), TOL[dtype])


@gpu
@compiled_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("tokens", [1, 16, 256, 2048])
def test_gpu_qwen3_30b(tokens: int, dtype: torch.dtype, forced: None) -> None:
    """With every fourth pair on another rank's expert, as under expert parallelism."""
    case = gpu_case(QWEN3_30B, tokens, dtype, foreign=True)
    assert_close(run(fused_moe_w8a8, case), run(fused_moe_w8a8_ref, case), TOL[dtype])


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
        run(fused_moe_w8a8, case)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(fused_moe_w8a8, case)
    for seed in (1, 2):
        x2, _, _, weights2, ids2 = gpu_case(QWEN3_30B, 4, dtype, foreign=seed == 2, seed=seed)
        x.copy_(x2), weights.copy_(weights2), ids.copy_(ids2)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, run(fused_moe_w8a8_ref, case), TOL[dtype])
