"""The multi-head latent attention kernels (kernels/attention/mla.py) against the reference.

A latent cache holds one row ``[c_kv (L), k_pe (R)]`` a token as one kv head, the values a view
of its first L columns; queries are ``[q_lat, q_pe]`` of every head. Interpreter cases (CPU, the
tiny models' L 32 with R 8 or 16, 4 to 20 heads): decode over ragged lengths (1 included),
split over several partitions and merged, heads over several head blocks, a grid sized for a
longer bound than any sequence (a CUDA graph's); prefill and chunked prefill over a cached prefix
with (token, head) rows straddling tiles; one-token blocks (the layer's cache-less path); padded
block tables and NaN past every sequence (``test_kernels.paged_batch``); the dispatcher's
routing and refusals; a tiny DeepSeek-V2 through every Triton kernel, attention included, against
transformers. GPU cases (marked ``gpu``): DeepSeek-V2-Lite's attention (L 512, R 64, 16 heads,
bf16) at contexts up to 8k and batches 1 to 64, prefill and chunks, and a decode captured in a
CUDA graph and replayed over other lengths.
"""

import importlib

import pytest
import torch

# kernel_harness first: where Triton is missing, importing it skips this file.
from kernel_harness import assert_close, compiled_gpu, gpu, interp, run_interpreter_cases_in_child
from test_kernels import FP32_TOL, GPU_TOL, paged_batch

from conveyor.kernels._triton import TRITON_INTERPRETED, set_kernel_mode
from conveyor.kernels.attention import AttentionTuning, paged_attention, paged_attention_ref
from conveyor.kernels.attention.mla import _check_mla_inputs, paged_mla_triton

launch_mod = importlib.import_module("conveyor.kernels.attention.launch")
mla_mod = importlib.import_module("conveyor.kernels.attention.mla")
LITE = dict(lora=512, rope=64, heads=16)  # DeepSeek-V2-Lite's attention (one tp rank of V2/V3 too)
LITE_SCALE = 192**-0.5  # its softmax scale: (qk_nope 128 + rope 64) ** -0.5


def mla_batch(q_lens: list[int], k_lens: list[int], heads: int, lora: int, rope: int, block_size: int, seed: int,
              dtype: torch.dtype = torch.float32, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """q [T, H, L + R], the latent cache [blocks, block_size, 1, L + R] and its values (the view of
    its first L columns), block tables, cu_seqlens_q, seqlens_k: ``paged_batch``'s shuffled
    blocks, padded tables and NaN past every sequence."""
    q, cache, _, tables, cu, lens = paged_batch(q_lens, k_lens, heads, 1, lora + rope, block_size, seed, dtype, device)
    return q, cache, cache[..., :lora], tables, cu, lens


def check_mla(q_lens: list[int], k_lens: list[int], heads: int, lora: int, rope: int, block_size: int, seed: int,
              tol: float, dtype: torch.dtype = torch.float32, device: str = "cpu", scale: float | None = None,
              max_seqlen_k: int | None = None, **tiles: int) -> None:
    """The launcher against the reference; ``max_seqlen_k`` a bound past the longest sequence."""
    q, kc, vc, bt, cu, sk = mla_batch(q_lens, k_lens, heads, lora, rope, block_size, seed, dtype, device)
    scale = (lora + rope) ** -0.5 if scale is None else scale
    out = paged_mla_triton(q, kc, vc, bt, cu, sk, scale, max_seqlen_q=max(q_lens),
                           max_seqlen_k=max_seqlen_k or max(k_lens), tuning=AttentionTuning(**tiles))
    assert out.shape == (q.shape[0], heads, lora)
    assert_close(out, paged_attention_ref(q, kc, vc, bt, cu, sk, scale), tol)


# ------------------------------------------------------------------------------------------ interpreter

# (q_lens, k_lens, H, L, R, block_size, max_seqlen_k bound or None, tile overrides). Decode: q_len 1.
DECODE_CASES = {
    "h4_r8_ragged": ([1] * 4, [16, 1, 17, 40], 4, 32, 8, 16, None, {}),
    "h16_r16_split": ([1] * 4, [1, 33, 100, 64], 16, 32, 16, 16, None, dict(decode_partition=16, block_n=16)),
    # 20 heads in two blocks of 16 (the second 4 real heads and 12 padding rows), split keys.
    "h20_head_blocks_split": ([1] * 3, [70, 5, 48], 20, 32, 8, 16, None,
                              dict(block_m=16, decode_partition=32, block_n=16)),
    # More than 16 heads by default: one block of 32 rows (12 of them padding).
    "h20_default_head_block": ([1] * 2, [70, 5], 20, 32, 8, 16, None, dict(decode_partition=32, block_n=16)),
    # More partitions than the merge kernel's 16 a pass; and a sequence one partition covers.
    "batch1_many_parts": ([1] * 2, [300, 9], 4, 32, 8, 16, None, dict(decode_partition=16, block_n=16)),
    # The grid sized for a graph's bound (512 keys) past every sequence: each cuts its own length.
    "graph_bound": ([1] * 3, [40, 1, 130], 16, 32, 8, 16, 512, dict(decode_partition=32, block_n=16)),
    "one_token_blocks": ([1] * 2, [5, 9], 4, 32, 8, 1, None, {}),
    "block_size_64_r32": ([1] * 2, [63, 129], 4, 64, 32, 64, None, dict(decode_partition=64, block_n=32)),
}

# (q_lens, k_lens, H, L, R, block_size, tile overrides).
PREFILL_CASES = {
    "prefill_ragged_h4": ([16, 1, 17, 5], [16, 1, 17, 5], 4, 32, 8, 16, dict(block_m=16, block_n=16)),
    "chunk_over_prefix_h16": ([5, 20, 1], [37, 64, 20], 16, 32, 16, 16, dict(block_m=32, block_n=16)),
    # 20 heads: a tile's rows straddle tokens (16-row tiles, 20 rows a token).
    "h20_rows_straddle_tokens": ([7, 3], [40, 3], 20, 32, 8, 16, dict(block_m=16, block_n=16)),
    "chunk_default_tiles": ([40], [100], 4, 32, 8, 32, {}),
    "one_token_blocks": ([7, 12], [7, 12], 4, 32, 8, 1, dict(block_m=16, block_n=16)),
    # At most one query a sequence but one brings none: not a decode batch (the prefill kernel).
    "seq_without_queries": ([1, 0, 1], [5, 3, 9], 4, 32, 8, 16, {}),
}


@interp
@pytest.mark.parametrize("case", DECODE_CASES.values(), ids=DECODE_CASES.keys())
def test_mla_decode(case: tuple, seed: int, poisoned_empty: None) -> None:
    q_lens, k_lens, h, lora, rope, bs, bound, tiles = case
    check_mla(q_lens, k_lens, h, lora, rope, bs, seed, FP32_TOL, max_seqlen_k=bound, **tiles)


@interp
@pytest.mark.parametrize("case", PREFILL_CASES.values(), ids=PREFILL_CASES.keys())
def test_mla_prefill(case: tuple, seed: int, poisoned_empty: None) -> None:
    q_lens, k_lens, h, lora, rope, bs, tiles = case
    check_mla(q_lens, k_lens, h, lora, rope, bs, seed, FP32_TOL, **tiles)


@interp
@pytest.mark.parametrize("q_lens,k_lens", [([1, 1], [40, 3]), ([6, 1], [40, 3])], ids=["decode", "prefill"])
def test_mla_fp16(q_lens: list[int], k_lens: list[int], seed: int, poisoned_empty: None) -> None:
    # The interpreter computes fp16 in numpy (round to nearest); bf16 it truncates, so no bf16 here.
    check_mla(q_lens, k_lens, 16, 32, 16, 16, seed, 5e-3, torch.float16, decode_partition=16, block_n=16)


@interp
def test_mla_dispatcher(seed: int, forced: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """``paged_attention`` sends a latent cache to the MLA kernels (with and without the
    max_seqlen hints, decode and prefill), and never to the dense launcher."""

    def boom(*args, **kwargs):
        raise AssertionError("the dense launcher took a latent cache")

    monkeypatch.setattr(launch_mod, "paged_attention_triton", boom)
    for q_lens, k_lens in (([1, 1, 1], [9, 16, 33]), ([4, 1, 9], [9, 16, 33])):
        q, kc, vc, bt, cu, sk = mla_batch(q_lens, k_lens, 4, 32, 8, 8, seed)
        ref = paged_attention_ref(q, kc, vc, bt, cu, sk, 0.1)
        assert_close(paged_attention(q, kc, vc, bt, cu, sk, 0.1), ref, FP32_TOL)
        hinted = paged_attention(q, kc, vc, bt, cu, sk, 0.1, max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens))
        assert_close(hinted, ref, FP32_TOL)


@interp
def test_mla_refusals(forced: None) -> None:
    """What the MLA kernels do not take raises under forced Triton, naming why (the dispatcher
    sends it to the torch paths otherwise): a rank or rope dim that is not a power of two, values
    that are not a view of the rows, two kv heads, a window, soft-capping, ALiBi; the dense
    kernels' inputs are not MLA's to refuse."""
    def attend(q, kc, vc, **kw):
        return paged_attention(q, kc, vc, bt, cu, sk, 0.1, **kw)

    q, kc, vc, bt, cu, sk = mla_batch([1, 3], [9, 20], 4, 32, 8, 8, seed=0)
    for lora, rope in ((24, 8), (32, 12)):
        q2, kc2, vc2, *_ = mla_batch([1, 3], [9, 20], 4, lora, rope, 8, seed=0)
        with pytest.raises(ValueError, match="powers of two"):
            attend(q2, kc2, vc2)
    with pytest.raises(ValueError, match="view of the latent rows"):
        attend(q, kc, vc.clone())
    with pytest.raises(ValueError, match="one kv head"):
        attend(q, kc.expand(-1, -1, 2, -1), vc.expand(-1, -1, 2, -1))
    for mods in (dict(sliding_window=4), dict(softcap=5.0), dict(alibi_slopes=torch.ones(4))):
        with pytest.raises(ValueError, match="not in the MLA kernels"):
            attend(q, kc, vc, **mods)
    assert _check_mla_inputs(q, kc, vc, bt, cu, sk) is None
    q3, kc3, vc3, *_ = paged_batch([1, 3], [9, 20], 4, 2, 32, 8, seed=0)
    assert launch_mod._check_inputs(q3, kc3, vc3, bt, cu, sk) is None and not mla_mod.is_mla_layout(kc3, vc3)


def test_mla_kernels_in_the_model_match_hf(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny DeepSeek-V2 (L 32, R 8, 4 heads) with every kernel in Triton, its attention the MLA
    kernels' (a prefill over the cache, then a decode step): transformers' float32 logits. Under
    the interpreter on CPU, or compiled on a GPU (``check_triton_kernels``; skipped with neither)."""
    from test_models import check_triton_kernels, load_ours, save_tiny
    from test_models_deepseek_v2 import tiny_configs
    from transformers import AutoModelForCausalLM

    used: list[int] = []

    def counted(q, *args, **kwargs):
        used.append(q.shape[0])
        return paged_mla_triton(q, *args, **kwargs)

    monkeypatch.setattr(launch_mod, "paged_mla_triton", counted)
    save_tiny(tiny_configs()["q_lora_yarn"], tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls (tests/conftest.py's torch_single_thread)
    try:
        check_triton_kernels(hf, load_ours(tmp_path))
    finally:
        torch.set_num_threads(previous)
    assert used == [8, 8, 1, 1], used  # two layers' prefill of 8 tokens, then their decode step


@pytest.mark.skipif(TRITON_INTERPRETED, reason="the interpreter cases run in this process")
def test_interpreter_cases_in_child() -> None:
    """Run this file's interpreter cases in a child process that imports triton interpreted."""
    run_interpreter_cases_in_child(__file__)


# -------------------------------------------------------------------------------------------------- GPU

GPU_DTYPES = [torch.bfloat16, torch.float16]

# (batch, context lengths or None for random 1..8192, block_size)
GPU_DECODE = {
    "batch1_8k": (1, [8192], 64),
    "batch1_short": (1, [37], 16),
    "batch8_mixed_bs16": (8, [8192, 1, 17, 4096, 511, 8000, 64, 2049], 16),
    "batch64_random": (64, None, 64),
}


@gpu
@compiled_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", GPU_DECODE.values(), ids=GPU_DECODE.keys())
def test_gpu_mla_decode(case: tuple, dtype: torch.dtype, seed: int, poisoned_empty: None) -> None:
    """DeepSeek-V2-Lite's decode (L 512, R 64, 16 heads); the grid sized for an 8k bound too."""
    batch, lens, bs = case
    if lens is None:
        lens = torch.randint(1, 8193, (batch,), generator=torch.Generator().manual_seed(seed)).tolist()
    for bound in (None, 8192):
        check_mla([1] * batch, lens, LITE["heads"], LITE["lora"], LITE["rope"], bs, seed, GPU_TOL[dtype], dtype,
                  "cuda", scale=LITE_SCALE, max_seqlen_k=bound)


# (q_lens, k_lens, block_size)
GPU_PREFILL = {
    "prefill_2k": ([2048], [2048], 64),
    "varlen_prefill": ([1000, 17, 513, 1], [1000, 17, 513, 1], 16),
    "chunked_over_prefix": ([512, 1000, 1, 33], [3000, 1000, 700, 4129], 64),
    "chunk_after_8k_prefix": ([256], [8448], 16),
}


@gpu
@compiled_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", GPU_PREFILL.values(), ids=GPU_PREFILL.keys())
def test_gpu_mla_prefill(case: tuple, dtype: torch.dtype, seed: int, poisoned_empty: None) -> None:
    q_lens, k_lens, bs = case
    check_mla(q_lens, k_lens, LITE["heads"], LITE["lora"], LITE["rope"], bs, seed, GPU_TOL[dtype], dtype, "cuda",
              scale=LITE_SCALE)


@gpu
@compiled_gpu
def test_gpu_mla_more_heads_and_fp32(seed: int, poisoned_empty: None) -> None:
    """128 heads (DeepSeek-V2/V3 on one rank: four head blocks) in bf16; fp32 exact (no TF32)."""
    check_mla([1] * 4, [4096, 17, 2049, 700], 128, 512, 64, 64, seed, GPU_TOL[torch.bfloat16], torch.bfloat16,
              "cuda", scale=LITE_SCALE)
    check_mla([300, 2], [300, 900], 128, 512, 64, 64, seed, GPU_TOL[torch.bfloat16], torch.bfloat16, "cuda",
              scale=LITE_SCALE)
    check_mla([1] * 3, [700, 5, 1025], 16, 512, 64, 16, seed, 1e-5, torch.float32, "cuda", scale=LITE_SCALE)
    check_mla([100, 2], [100, 300], 16, 512, 64, 16, seed, 1e-5, torch.float32, "cuda", scale=LITE_SCALE)


@gpu
@compiled_gpu
def test_gpu_mla_dispatch_runs_the_kernels(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """With CUDA tensors (auto mode) a latent cache reaches the MLA kernels: neither the reference
    nor the torch decode runs."""
    set_kernel_mode("auto")

    def boom(*args, **kwargs):
        raise AssertionError("a torch path ran on CUDA tensors")

    monkeypatch.setattr(launch_mod, "paged_attention_ref", boom)
    monkeypatch.setattr(launch_mod, "paged_decode_torch", boom)
    for q_lens, k_lens in (([1] * 3, [100, 7, 4000]), ([30, 1], [30, 500])):
        q, kc, vc, bt, cu, sk = mla_batch(q_lens, k_lens, 16, 512, 64, 64, seed, torch.bfloat16, "cuda")
        out = paged_attention(q, kc, vc, bt, cu, sk, LITE_SCALE, max_seqlen_q=max(q_lens), max_seqlen_k=4096)
        assert_close(out, paged_attention_ref(q, kc, vc, bt, cu, sk, LITE_SCALE), GPU_TOL[torch.bfloat16])


@gpu
@compiled_gpu
def test_gpu_mla_decode_in_a_cuda_graph(seed: int) -> None:
    """A decode step captured once (grid sized for an 8k bound, batch 8) and replayed over other
    queries, lengths and block tables written into the captured buffers: the reference's result
    at every replay, so the launch reads nothing back to the host and sizes nothing from the data."""
    dev, dtype, batch, bound, bs = "cuda", torch.bfloat16, 8, 8192, 64
    gen = torch.Generator().manual_seed(seed)
    blocks = batch * bound // bs
    cache = torch.randn(blocks, bs, 1, 576, generator=gen).to(dev, dtype)
    values = cache[..., :512]
    q = torch.zeros(batch, 16, 576, device=dev, dtype=dtype)
    tables = torch.zeros(batch, bound // bs, dtype=torch.int32, device=dev)
    lens = torch.ones(batch, dtype=torch.int32, device=dev)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=dev)

    def step() -> torch.Tensor:
        return paged_attention(q, cache, values, tables, cu, lens, LITE_SCALE, max_seqlen_q=1, max_seqlen_k=bound)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for replay in range(3):
        new_lens = torch.randint(1, bound + 1, (batch,), generator=gen)
        new_lens[replay] = 1 if replay else bound
        q.copy_(torch.randn(batch, 16, 576, generator=gen).to(dev, dtype))
        lens.copy_(new_lens.to(dev, torch.int32))
        tables.copy_(torch.randperm(blocks, generator=gen)[: batch * (bound // bs)].view(batch, -1).to(dev))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, paged_attention_ref(q, cache, values, tables, cu, lens, LITE_SCALE), GPU_TOL[dtype])
