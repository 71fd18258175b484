"""The tensor-core W4A16 kernels (``kernels/w4a16/tc.py``, CUDA C++ compiled by NVRTC through cupy).

On the CPU: the weight layout (packing, its inverse, and an independent reading of each lane's
word as the PTX ISA's ``mma.m16n8k16`` A fragment), the reference dequantization and the launch
policy. **gpu** cases: every compiled instance against the plain-torch reference on fresh random
inputs, K splits, bias, groups, rows past a tile, the dense-weight path, CUDA graph capture, and
the AWQ layer's repacking after loading.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels.w4a16 import awq_pack, dequantize_awq_ref, w4a16_matmul_ref
from conveyor.kernels.w4a16.tc import (
    CONFIGS,
    STAGE_K,
    WG_CONFIGS,
    tc_config,
    tc_dequantize_ref,
    tc_pack_codes,
    tc_problem,
    tc_repack,
    tc_stages_per_split,
    tc_unpack_codes,
    wg_config,
    wg_splits,
)
from kernel_harness import assert_close, check_after_the_norm, gpu


def awq_layer(k: int, n: int, group: int, gen: torch.Generator, device: str = "cpu"):
    """A random AWQ triple [K, N] (codes, zeros 0..15, scales ~1e-2) on ``device``."""
    g = k if group == -1 else group
    groups = -(-k // g)
    codes = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (groups, n), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.005).half()
    return awq_pack(codes).to(device), awq_pack(zeros).to(device), scales.to(device)


def fragment(word: int, g: int, c: int) -> dict[tuple[int, int], int]:
    """The PTX ISA's A fragment of ``mma.m16n8k16`` (.f16) for lane ``4 g + c``: registers a0..a7
    at (row, column) of the 16 x 16 tile, read from the word's nibbles as the kernel's LOP3s do
    (mask 0x000f000f: nibbles 0 and 4; 0x00f000f0: 1 and 5; after >> 8: 2 and 6, 3 and 7)."""
    nib = [(word >> (4 * i)) & 0xF for i in range(8)]
    return {(g, 2 * c): nib[0], (g, 2 * c + 1): nib[4], (g + 8, 2 * c): nib[1], (g + 8, 2 * c + 1): nib[5],
            (g, 2 * c + 8): nib[2], (g, 2 * c + 9): nib[6], (g + 8, 2 * c + 8): nib[3], (g + 8, 2 * c + 9): nib[7]}


def test_each_lane_word_is_its_mma_fragment() -> None:
    k, n = 128, 32
    codes = torch.randint(0, 16, (k, n), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    qw = tc_pack_codes(codes)
    assert qw.shape == (k // STAGE_K, n // 16, 32, 4) and qw.dtype == torch.int32
    seen = torch.full((k, n), -1, dtype=torch.int64)
    for s in range(k // STAGE_K):
        for t in range(n // 16):
            for lane in range(32):
                for i in range(4):  # word i: the 16-row step i of the stage
                    word = int(qw[s, t, lane, i]) & 0xFFFFFFFF
                    # The transposed product: the A tile's row is a weight column, its column a K row.
                    for (row, col), v in fragment(word, lane // 4, lane % 4).items():
                        seen[s * STAGE_K + 16 * i + col, 16 * t + row] = v
    assert torch.equal(seen, codes.long())


@pytest.mark.parametrize("shape", [(64, 64), (256, 192)])
def test_pack_unpack_round_trip(shape: tuple[int, int]) -> None:
    codes = torch.randint(0, 16, shape, generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    assert torch.equal(tc_unpack_codes(tc_pack_codes(codes)), codes)


@pytest.mark.parametrize(("k", "group"), [(640, 128), (256, 64), (192, -1)])
def test_repack_dequantizes_to_the_awq_weight(k: int, group: int) -> None:
    qweight, qzeros, scales = awq_layer(k, 128, group, torch.Generator().manual_seed(2))
    w = tc_repack(qweight, qzeros, scales, group)
    assert (w.k, w.n, w.group_size) == (k, 128, k if group == -1 else group)
    torch.testing.assert_close(tc_dequantize_ref(w), dequantize_awq_ref(qweight, qzeros, scales, group).float(),
                               rtol=0, atol=0)


def test_problems_are_named() -> None:
    assert tc_problem(4096, 12288, 128, torch.float16) is None
    assert "fp16" in tc_problem(4096, 4096, 128, torch.bfloat16)
    assert "multiple of 64" in tc_problem(96, 128, 96, torch.float16)
    assert "group_size 32" in tc_problem(256, 128, 32, torch.float16)
    qweight, qzeros, scales = awq_layer(128, 64, 32, torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="cannot take this layer: group_size 32"):
        tc_repack(qweight, qzeros, scales, 32)


def test_policy() -> None:
    assert [tc_config(m, 4096, 4096).m8 for m in (1, 8, 9, 16, 17, 32, 64, 100)] == [1, 1, 2, 2, 4, 4, 4, 8]
    assert tc_config(1, 12288, 4096).n_tile == 256 and tc_config(1, 4096, 4096).n_tile == 128
    assert tc_config(1, 8256, 4096).n_tile == 64  # 4 or 2 tiles a warp do not divide N: one
    assert tc_config(64, 12288, 4096).target_per_sm == 1 and tc_config(64, 4096, 4096).target_per_sm == 4
    assert tc_config(100, 22016, 4096).wm == 2 and tc_config(8, 4096, 4096).target_per_sm == 4
    # whatever the shape, a compiled instance whose tile divides N (N = 16448 past 64 rows asked
    # for one that was never compiled: (8, 2, 4, 2, 4, false))
    names = {c.name for c in CONFIGS}
    for m in (1, 3, 8, 12, 16, 20, 32, 40, 64, 65, 100, 127):
        for n in (64, 192, 4096, 4160, 8256, 12288, 16448, 22016):
            for k in (256, 4096, 11008):
                cfg = tc_config(m, n, k)
                assert cfg.name in names and n % cfg.n_tile == 0, (m, n, k, cfg)
    # 32 tiles of 64 stages on 132 SMs at 4 CTAs each: 16 splits of 4 stages; never under 2 stages.
    assert tc_stages_per_split(32, 4096, 132, 4) == 4
    assert tc_stages_per_split(1, 256, 132, 4) == 2
    assert tc_stages_per_split(1000, 4096, 132, 4) == 64
    assert tc_stages_per_split(8, 4096, 132, 4, splits=3) == 22
    assert all(c.shared_bytes() <= 227 * 1024 for c in CONFIGS + WG_CONFIGS)
    # The warp-group kernel: 32-row tiles up to 32 rows, then 64; K splits a power of two up to
    # 3 CTAs an SM (Llama-2-7B on 132 SMs: qkv 192 tiles -> 2, gate_up 344 -> 1, 64 tiles -> 4).
    assert [wg_config(m).rows for m in (16, 32, 33, 64, 127)] == [32, 32, 64, 64, 64]
    assert [wg_splits(t, 4096, 132) for t in (192, 344, 64, 128, 384, 688)] == [2, 1, 4, 2, 1, 1]
    assert wg_splits(1, 256, 132) == 2 and wg_splits(1, 128, 132) == 1  # each split 2 stages or more
    assert all(wg_config(m) in WG_CONFIGS for m in range(1, 128))
    assert len({c.name for c in CONFIGS}) == len(CONFIGS)


def test_bad_input_is_refused_before_any_launch() -> None:
    from conveyor.kernels.w4a16.tc import tc_matmul

    w = tc_repack(*awq_layer(128, 64, 64, torch.Generator().manual_seed(4)), 64)
    with pytest.raises(ValueError, match=r"x must be fp16 \[\.\.\., 128\]"):
        tc_matmul(torch.zeros(2, 128), w)  # float32
    with pytest.raises(ValueError, match=r"x must be fp16 \[\.\.\., 128\]"):
        tc_matmul(torch.zeros(2, 96, dtype=torch.float16), w)  # the wrong K
    with pytest.raises(ValueError, match="not a multiple of the 128-column tile"):
        tc_matmul(torch.zeros(2, 128, dtype=torch.float16), w, cfg=CONFIGS[1])  # 128 columns a CTA, N = 64
    from conveyor.kernels.w4a16.tc import WgConfig, wg_matmul

    with pytest.raises(ValueError, match=r"x must be fp16 \[\.\.\., 128\]"):
        wg_matmul(torch.zeros(20, 128), w)  # the warp-group kernel checks the same way
    with pytest.raises(ValueError, match=r"w4a16_wg_gemm<48, 6> is not compiled; one of \("):
        wg_matmul(torch.zeros(20, 128, dtype=torch.float16), w, cfg=WgConfig(48, 6))


def test_a_module_that_does_not_build_is_reported_and_left_out(monkeypatch, caplog) -> None:
    """A cupy whose NVRTC does not match the driver: the layers keep Triton, and the log says why."""
    from pathlib import Path

    from conveyor.kernels import _cuda

    def broken(*args):
        raise RuntimeError("nvrtc: cannot open cuda_fp16.h")

    monkeypatch.setattr(_cuda, "_module", broken)
    _cuda.compiles.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert not _cuda.compiles(Path("tc_gemm.cu"), ("f",), 0)
        assert "tc_gemm.cu" in caplog.text and "cannot open cuda_fp16.h" in caplog.text
    finally:
        _cuda.compiles.cache_clear()


# --- on the GPU -------------------------------------------------------------------------------

def _cuda_kernels() -> bool:
    if not torch.cuda.is_available():
        return False
    from conveyor.kernels._cuda import cuda_kernels_available

    return cuda_kernels_available(torch.device("cuda", 0))


needs_cuda_kernels = pytest.mark.skipif(not _cuda_kernels(), reason="needs a CUDA GPU (sm_80+) and cupy")


def _check(m: int, k: int, n: int, group: int, seed: int, bias: bool = False, fn=None, **kw) -> None:
    from conveyor.kernels.w4a16.tc import tc_matmul

    fn = fn or tc_matmul
    gen = torch.Generator().manual_seed(seed)
    layer = awq_layer(k, n, group, gen, "cuda")
    x = torch.randn(m, k, generator=gen).half().cuda()
    b = (torch.randn(n, generator=gen) * 0.1).half().cuda() if bias else None
    w = tc_repack(*layer, group)
    out = fn(x, w, b, **kw)
    ref = w4a16_matmul_ref(x.float(), *layer, group, None if b is None else b.float())
    assert out.shape == (m, n) and out.dtype == torch.float16
    assert_close(out.float(), ref, 2e-3)


@gpu
@needs_cuda_kernels
@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_instance_matches_the_reference(cfg) -> None:
    for m in sorted({1, 8 * cfg.m8 - 3, 8 * cfg.m8 + 5}):  # a partial tile, and rows past one
        _check(m, 512, 256, 128, seed=m, cfg=cfg, dequant=False)
        _check(m, 512, 256, 128, seed=m, cfg=cfg, splits=1, dequant=False)


def _replays_in_a_graph(fn, rows: int, n: int, seed: int) -> None:
    """``fn(x, w)`` captured in a CUDA graph gives the reference on new x at every replay (the
    split counters must be left at zero by each)."""
    gen = torch.Generator().manual_seed(seed)
    layer = awq_layer(2048, n, 128, gen, "cuda")
    w = tc_repack(*layer, 128)
    x = torch.randn(rows, 2048, generator=gen).half().cuda()
    fn(x, w)  # compile and allocate outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x, w)
    for _ in range(3):
        x.copy_(torch.randn(rows, 2048, generator=gen).half())
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out.float(), w4a16_matmul_ref(x.float(), *layer, 128), 2e-3)


def _wg_kernels() -> bool:
    if not _cuda_kernels():
        return False
    from conveyor.kernels.w4a16.tc import wg_builds

    return wg_builds(torch.device("cuda", 0))


needs_wg = pytest.mark.skipif(not _wg_kernels(), reason="needs an sm_90 GPU, cupy and an NVRTC that builds sm_90a")


@gpu
@needs_wg
@pytest.mark.parametrize("cfg", WG_CONFIGS, ids=[c.name for c in WG_CONFIGS])
def test_warp_group_instances_match_the_reference(cfg) -> None:
    """The wgmma kernel (weights as the register operand, x through the swizzled descriptor):
    row counts inside, at and past its tile, groups of 64 and 128, K splits (down to 2 stages a
    split, fewer than the pipeline's depth), bias."""
    from conveyor.kernels.w4a16.tc import wg_matmul

    for m in sorted({1, 17, cfg.rows - 3, cfg.rows, cfg.rows + 5}):
        _check(m, 1024, 256, 128, seed=m, fn=wg_matmul, cfg=cfg, splits=1)
        _check(m, 4096, 384, 64, seed=m + 1, bias=True, fn=wg_matmul, cfg=cfg)
        _check(m, 4096, 192, 128, seed=m + 2, fn=wg_matmul, cfg=cfg, splits=5)
        _check(m, 4096, 128, 128, seed=m + 3, fn=wg_matmul, cfg=cfg, splits=32)


@gpu
@needs_wg
def test_the_nvrtc_route_builds_what_cupy_would(monkeypatch) -> None:
    """When cupy's RawModule cannot take the sm_90a option, ``_cuda`` builds the cubin with NVRTC
    through cuda-python and loads it into cupy: the kernels from that module give the same bits."""
    from conveyor.kernels import _cuda
    from conveyor.kernels.w4a16.tc import _WG_NAMES, SOURCE, WG_OPTIONS, wg_matmul

    gen = torch.Generator().manual_seed(11)
    w = tc_repack(*awq_layer(2048, 256, 128, gen, "cuda"), 128)
    x = torch.randn(40, 2048, generator=gen).half().cuda()
    want, want_split = wg_matmul(x, w), wg_matmul(x, w, splits=4)  # cupy's module
    lowered = _cuda._nvrtc_module(SOURCE, _WG_NAMES, WG_OPTIONS)
    monkeypatch.setattr(_cuda, "_module", lambda *args: lowered)
    _cuda.kernel.cache_clear()
    try:
        # 40 rows: the 64-row tile, whose 68 KiB of shared memory are allowed through the driver
        assert torch.equal(wg_matmul(x, w), want)
        assert torch.equal(wg_matmul(x, w, splits=4), want_split)
    finally:
        _cuda.kernel.cache_clear()  # the other tests get cupy's module again


@gpu
@needs_wg
def test_warp_group_kernel_replays_in_a_graph() -> None:
    from conveyor.kernels.w4a16.tc import wg_matmul

    _replays_in_a_graph(wg_matmul, rows=48, n=512, seed=9)


@gpu
@needs_cuda_kernels
@pytest.mark.parametrize("m", [1, 2, 7, 16, 24, 61, 64, 100, 127])
@pytest.mark.parametrize(("k", "n", "group"), [(4096, 512, 128), (1024, 384, 64), (704, 128, -1)])
def test_default_policy_matches_the_reference(m: int, k: int, n: int, group: int) -> None:
    _check(m, k, n, group, seed=k + m)


@gpu
@needs_cuda_kernels
@pytest.mark.parametrize("splits", [1, 2, 5, 64])
def test_k_splits_and_bias(splits: int) -> None:
    _check(3, 4096, 256, 128, seed=splits, bias=True, splits=splits)
    _check(40, 4096, 256, 128, seed=splits, bias=True, splits=splits)


@gpu
@needs_cuda_kernels
@pytest.mark.parametrize("m", [128, 300])
def test_dense_weight_path(m: int) -> None:
    from conveyor.kernels.w4a16.tc import tc_dequantize

    gen = torch.Generator().manual_seed(m)
    layer = awq_layer(1024, 384, 128, gen, "cuda")
    w = tc_repack(*layer, 128)
    torch.testing.assert_close(tc_dequantize(w), dequantize_awq_ref(*layer, 128, dtype=torch.float16), rtol=0, atol=0)
    _check(m, 1024, 384, 128, seed=m, bias=True)
    _check(m, 1024, 384, 128, seed=m, dequant=False)  # the fused kernel past 64 rows: several row tiles


@gpu
@needs_cuda_kernels
def test_a_gemv_started_early_by_the_norm_before_it_reads_the_norm_s_output() -> None:
    """The tensor-core GEMV requests its first stages' weights before it waits for the norm
    (``check_after_the_norm``)."""
    from conveyor.kernels.w4a16.tc import tc_matmul

    gen = torch.Generator().manual_seed(13)
    layer = awq_layer(4096, 12288, 128, gen, "cuda")
    w = tc_repack(*layer, 128)
    check_after_the_norm(lambda x: tc_matmul(x, w), lambda x: w4a16_matmul_ref(x.float(), *layer, 128), 4096, gen,
                         2e-3)


@gpu
@needs_cuda_kernels
def test_cuda_graph_replays_the_kernel() -> None:
    from conveyor.kernels.w4a16.tc import tc_matmul

    _replays_in_a_graph(tc_matmul, rows=4, n=256, seed=5)


@gpu
@needs_cuda_kernels
def test_awq_layer_repacks_after_loading() -> None:
    from torch import nn

    from conveyor.engine.layers.awq_linear import AWQLinearMethod

    method = AWQLinearMethod(128)
    layer = nn.Module()
    method.create_weights(layer, 1024, 384, bias=True)
    gen = torch.Generator().manual_seed(6)
    qweight, qzeros, scales = awq_layer(1024, 384, 128, gen)
    bias = (torch.randn(384, generator=gen) * 0.1).half()
    for name, value in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales), ("bias", bias)):
        getattr(layer, name).data = value.cuda()
    method.after_loading(layer)
    assert layer.tc is not None and layer.qweight.numel() == 0  # the weight is held once
    for m in (1, 9, 200):
        x = torch.randn(m, 1024, generator=gen).half().cuda()
        ref = w4a16_matmul_ref(x.float(), qweight.cuda(), qzeros.cuda(), scales.cuda(), 128, bias.cuda().float())
        assert_close(method.apply(layer, x).float(), ref, 2e-3)


@gpu
@needs_cuda_kernels
def test_an_awq_engine_runs_the_tensor_core_kernels_in_its_graphs(tmp_path) -> None:
    """An fp16 engine on dummy AWQ weights of shapes the kernels take: every decoder linear is
    repacked (its AWQ tensors dropped), decode CUDA graphs replay the cupy launches (tokens as
    eager steps give them), and the tokens are the Triton kernels' (kernel mode ``triton``)."""
    import json

    from conveyor.engine.config import EngineConfig
    from conveyor.engine.llm_engine import LLMEngine
    from conveyor.kernels import set_kernel_mode
    from conveyor.protocol.sampling import SamplingParams

    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256, intermediate_size=512,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                  max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, torch_dtype="float16",
                  quantization_config={"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
                                       "version": "gemm"})
    (tmp_path / "config.json").write_text(json.dumps(config))

    def tokens(**kw) -> tuple[int, list[list[int]]]:
        """(decoder linears repacked with their AWQ tensors dropped, each prompt's greedy tokens)."""
        eng = LLMEngine(tmp_path, EngineConfig(dtype="float16", load_format="dummy", cache_max_entry_count=64,
                                               max_batch_size=8, **kw))
        try:
            repacked = sum(getattr(m, "tc", None) is not None and m.qweight.numel() == 0
                           for m in eng.runner.model.modules())
            for prompt in ([1, 2, 3], [7, 9, 11, 13, 200], [5] * 40):
                eng.add_request(prompt, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
            out: dict[str, list[int]] = {}
            while eng.has_work:
                for o in eng.step():
                    if o.token is not None:
                        out.setdefault(o.request_id, []).append(o.token)
            return repacked, [out[k] for k in sorted(out)]
        finally:
            eng.close()

    try:
        repacked, with_graphs = tokens()
        _, eager = tokens(eager_mode=True)
        none, triton = tokens(kernels="triton")
    finally:
        set_kernel_mode("auto")
    assert repacked == 2 * 4 and none == 0  # qkv, o_proj, gate_up, down of both layers
    assert with_graphs == eager
    assert with_graphs == triton
