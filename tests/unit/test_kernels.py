"""Triton kernels against their torch references.

Two kinds of case:

* **interpreter** cases (CPU tensors, small sizes, fp32 mostly): run by Triton's interpreter.
  Triton picks interpreter or compiled mode once per process, when ``triton`` is first imported.
  On a machine without CUDA where nothing has imported triton yet, this module switches the
  interpreter on below and the cases run here. Otherwise (a GPU machine, or an earlier test module
  already imported triton compiled) they are skipped here and ``test_interpreter_cases_in_child``
  runs them in a child pytest with ``TRITON_INTERPRET=1``.
* **gpu** cases (marked ``gpu``, skipped without CUDA): realistic sizes in fp16/bf16.

Outputs are checked as ``||out - ref|| / ||ref||``; every output buffer a launcher allocates is
filled with NaN first (``poisoned_empty``), so an element a kernel forgets to write fails.
"""

import importlib

import pytest
import torch

# kernel_harness first: where Triton is missing, importing it skips this file.
from kernel_harness import assert_close, check_after_the_norm, compiled_gpu, gpu, interp, run_interpreter_cases_in_child
from conveyor.kernels._triton import TRITON_INTERPRETED, set_kernel_mode
from conveyor.kernels.activation import silu_and_mul, silu_and_mul_ref
from conveyor.kernels.attention import (
    AttentionTuning,
    alibi_slopes,
    paged_attention,
    paged_attention_ref,
    paged_attention_triton,
)
from conveyor.kernels.gemv import gemv, gemv_ref
from conveyor.kernels.kv_cache import (
    rotate_and_store_kv,
    rotate_and_store_kv_ref,
    store_kv,
    store_kv_ref,
)
from conveyor.kernels.rms_norm import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref
from conveyor.kernels.rotary import apply_rotary, apply_rotary_ref

# The package re-exports functions named like their modules (``rms_norm``): fetch the modules
# (for attention, the one whose dispatcher looks up the launcher and the reference).
activation_mod, attention_mod, kv_cache_mod, rms_norm_mod, rotary_mod = (
    importlib.import_module(f"conveyor.kernels.{name}")
    for name in ("activation", "attention.launch", "kv_cache", "rms_norm", "rotary")
)
gemv_mod = importlib.import_module("conveyor.kernels.gemv")
FP32_TOL = 1e-5
GPU_TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-5}


# --------------------------------------------------------------------------------------------- helpers


def randn(*shape: int, gen: torch.Generator, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def paged_batch(
    q_lens: list[int], k_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
    block_size: int, seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
) -> tuple[torch.Tensor, ...]:
    """q, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k for a varlen batch.

    Block ids are shuffled (tables are not contiguous); slots past a sequence's length, unused
    table entries and one spare block hold NaN, so reading anything outside the sequence shows.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in k_lens]
    total = sum(blocks) + 1
    perm = torch.randperm(total, generator=gen)
    poison = int(perm[-1])
    tables = torch.full((len(k_lens), max(blocks) + 1), poison, dtype=torch.int32)
    k_cache = torch.randn(total, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(total, block_size, num_kv_heads, head_dim, generator=gen)
    k_cache[poison] = v_cache[poison] = float("nan")
    start = 0
    for b, (n, nb) in enumerate(zip(k_lens, blocks)):
        tables[b, :nb] = perm[start : start + nb]
        start += nb
        last, used = int(tables[b, nb - 1]), n - (nb - 1) * block_size
        k_cache[last, used:] = v_cache[last, used:] = float("nan")
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seqlens = torch.tensor(k_lens, dtype=torch.int32)
    return (
        q.to(device, dtype), k_cache.to(device, dtype), v_cache.to(device, dtype),
        tables.to(device), cu.to(device), seqlens.to(device),
    )


def check_attention(
    q_lens: list[int], k_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
    block_size: int, seed: int, tol: float, dtype: torch.dtype = torch.float32, device: str = "cpu",
    window: int | None = None, softcap: float | None = None, alibi: bool = False, **tiles: int,
) -> None:
    """The launcher against the reference; ``window`` / ``softcap`` / ``alibi``: the layer's sliding
    window, soft-capping and ALiBi slopes (``paged_attention_ref``)."""
    q, kc, vc, bt, cu, sk = paged_batch(
        q_lens, k_lens, num_heads, num_kv_heads, head_dim, block_size, seed, dtype, device
    )
    scale = head_dim**-0.5
    slopes = alibi_slopes(num_heads).to(device) if alibi else None
    mods = dict(sliding_window=window, softcap=softcap, alibi_slopes=slopes)
    out = paged_attention_triton(
        q, kc, vc, bt, cu, sk, scale, max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens),
        tuning=AttentionTuning(**tiles), **mods,
    )
    ref = paged_attention_ref(q, kc, vc, bt, cu, sk, scale, **mods)
    assert_close(out, ref, tol)


# ------------------------------------------------------------------------------- interpreter: attention

# (q_lens, k_lens, H, Hkv, D, block_size, tile overrides). Decode: every q_len is 1.
DECODE_CASES = {
    "g3_d64_bs16_boundaries": ([1] * 4, [16, 15, 17, 1], 9, 3, 64, 16, {}),
    "g4_d128_split": ([1] * 3, [33, 64, 65], 8, 2, 128, 16, dict(decode_partition=32, block_n=16)),
    "g8_batch1_split": ([1], [100], 8, 1, 64, 32, dict(decode_partition=32, block_n=16)),
    "g1_bs64_split": ([1] * 3, [63, 64, 129], 4, 4, 64, 64, dict(decode_partition=64, block_n=32)),
    "g3_d128_bs128": ([1] * 2, [130, 7], 6, 2, 128, 128, {}),
    "one_token_blocks": ([1] * 2, [5, 9], 4, 2, 64, 1, {}),
    "many_partitions": ([1] * 2, [300, 17], 4, 1, 64, 16, dict(decode_partition=16, block_n=16)),
    # Split grid, but the short sequences fit one partition: written directly, merge skipped.
    "split_with_single_partition_rows": ([1] * 4, [5, 16, 200, 1], 4, 2, 64, 16,
                                         dict(decode_partition=32, block_n=16)),
}

PREFILL_CASES = {
    "prefill_g3_bs16": ([16, 17, 15], [16, 17, 15], 9, 3, 64, 16, dict(block_m=16, block_n=16)),
    "prefix_mixed_d128": ([5, 32, 1], [37, 64, 20], 8, 2, 128, 16, dict(block_m=16, block_n=16)),
    "chunk_g8_batch1": ([40], [100], 8, 1, 64, 32, {}),
    "g1_bs64": ([3, 64], [130, 64], 4, 4, 64, 64, dict(block_m=32, block_n=32)),
    "one_token_blocks": ([7, 12], [7, 12], 4, 2, 64, 1, dict(block_m=16, block_n=16)),
    "g3_d128_bs128": ([20], [200], 6, 2, 128, 128, dict(block_m=16, block_n=64)),
    # At most one query per sequence but one sequence brings none: not a decode batch.
    "seq_without_queries": ([1, 0, 1], [5, 3, 9], 4, 2, 64, 16, {}),
}


@interp
@pytest.mark.parametrize("case", DECODE_CASES.values(), ids=DECODE_CASES.keys())
def test_decode_attention(case: tuple, seed: int, poisoned_empty: None) -> None:
    q_lens, k_lens, h, hkv, d, bs, tiles = case
    check_attention(q_lens, k_lens, h, hkv, d, bs, seed, FP32_TOL, **tiles)


@interp
@pytest.mark.parametrize("case", PREFILL_CASES.values(), ids=PREFILL_CASES.keys())
def test_prefill_attention(case: tuple, seed: int, poisoned_empty: None) -> None:
    q_lens, k_lens, h, hkv, d, bs, tiles = case
    check_attention(q_lens, k_lens, h, hkv, d, bs, seed, FP32_TOL, **tiles)


# Sliding windows and soft-capping: (q_lens, k_lens, H, Hkv, D, block_size, window, softcap, tiles).
# Windows shorter than, equal to and longer than the sequences; starting mid-tile and mid-partition
# (decode over split partitions); a chunk over a cached prefix whose window starts inside the
# prefix (the prefill kernel's three kinds of key tile: masked before the last row's window start,
# whole, and diagonal); one-token windows and blocks; the cap alone and with a window.
MOD_CASES = {
    "decode_window_split": ([1] * 4, [40, 7, 100, 33], 4, 2, 32, 16, 20, None,
                            dict(decode_partition=16, block_n=16)),
    "decode_window_equal_and_longer": ([1] * 3, [20, 5, 19], 4, 1, 32, 16, 20, None, {}),
    "decode_window_longer_split": ([1] * 2, [50, 9], 4, 2, 32, 16, 1000, None, dict(decode_partition=16, block_n=16)),
    "decode_window_one": ([1] * 2, [20, 5], 4, 2, 32, 16, 1, None, dict(decode_partition=16, block_n=16)),
    "decode_softcap": ([1] * 2, [40, 3], 6, 2, 32, 16, None, 1.0, dict(decode_partition=16, block_n=16)),
    "decode_window_softcap": ([1] * 3, [70, 17, 3], 4, 2, 32, 16, 24, 1.5, dict(decode_partition=16, block_n=16)),
    "prefill_chunk_window_in_prefix": ([20], [70], 4, 2, 32, 16, 30, None, dict(block_m=16, block_n=16)),
    "prefill_window_whole_tiles_softcap": ([40], [100], 4, 2, 32, 16, 50, 1.5, dict(block_m=16, block_n=16)),
    "prefill_window_short": ([16, 17, 15], [16, 17, 15], 4, 2, 32, 16, 8, None, dict(block_m=16, block_n=16)),
    "prefill_window_longer": ([9, 4], [9, 30], 4, 2, 32, 16, 64, None, dict(block_m=16, block_n=16)),
    "prefill_one_token_blocks": ([7, 12], [7, 12], 4, 2, 32, 1, 3, None, dict(block_m=16, block_n=16)),
    "prefill_softcap": ([6, 1], [40, 3], 4, 2, 32, 16, None, 1.0, dict(block_m=16, block_n=16)),
}


@interp
@pytest.mark.parametrize("case", MOD_CASES.values(), ids=MOD_CASES.keys())
def test_attention_window_softcap(case: tuple, seed: int, poisoned_empty: None) -> None:
    q_lens, k_lens, h, hkv, d, bs, window, softcap, tiles = case
    check_attention(q_lens, k_lens, h, hkv, d, bs, seed, FP32_TOL, window=window, softcap=softcap, **tiles)


# ALiBi (head counts that are not powers of two, as Baichuan-13B's 40): (q_lens, k_lens, H, Hkv, D,
# block_size, window, tiles): decode over split partitions, a chunk over a prefix, with a window.
ALIBI_CASES = {
    "decode_split_mha": ([1] * 3, [40, 7, 100], 6, 6, 32, 16, None, dict(decode_partition=16, block_n=16)),
    "decode_window_g3": ([1] * 2, [70, 5], 6, 2, 32, 16, 24, dict(decode_partition=16, block_n=16)),
    "prefill_chunk_over_prefix": ([20, 5], [70, 5], 6, 6, 32, 16, None, dict(block_m=16, block_n=16)),
    "prefill_window": ([40], [100], 6, 2, 32, 16, 50, dict(block_m=16, block_n=16)),
}


@interp
@pytest.mark.parametrize("case", ALIBI_CASES.values(), ids=ALIBI_CASES.keys())
def test_attention_alibi(case: tuple, seed: int, poisoned_empty: None) -> None:
    q_lens, k_lens, h, hkv, d, bs, window, tiles = case
    check_attention(q_lens, k_lens, h, hkv, d, bs, seed, FP32_TOL, window=window, alibi=True, **tiles)


@interp
def test_alibi_dispatcher(seed: int, forced: None) -> None:
    """The public entry point takes the slopes to the kernels; slopes of the wrong count or dtype
    are refused (forced Triton raises where the dispatcher would fall back)."""
    q, kc, vc, bt, cu, sk = paged_batch([3, 1], [20, 9], 6, 2, 32, 8, seed)
    slopes = alibi_slopes(6)
    ref = paged_attention_ref(q, kc, vc, bt, cu, sk, 0.1, alibi_slopes=slopes)
    assert_close(paged_attention(q, kc, vc, bt, cu, sk, 0.1, alibi_slopes=slopes), ref, FP32_TOL)
    for wrong in (slopes[:4], slopes.double()):
        with pytest.raises(ValueError, match="alibi_slopes"):
            paged_attention(q, kc, vc, bt, cu, sk, 0.1, alibi_slopes=wrong)


@interp
@pytest.mark.parametrize("d", [96, 80])
def test_attention_head_dim_not_pow2(d: int, seed: int, poisoned_empty: None) -> None:
    """Head dims padded to a power of two inside the kernels (Phi-3-mini's 96; 80): decode over
    split partitions and their merge, one partition, prefill over a prefix; a window with ALiBi."""
    check_attention([1] * 3, [40, 7, 100], 6, 2, d, 16, seed, FP32_TOL, decode_partition=16, block_n=16)
    check_attention([1] * 2, [40, 7], 4, 4, d, 16, seed, FP32_TOL)
    check_attention([20, 3], [70, 9], 4, 2, d, 16, seed, FP32_TOL, block_m=16, block_n=16)
    check_attention([20, 1], [70, 9], 4, 2, d, 16, seed, FP32_TOL, window=30, alibi=True, block_m=16, block_n=16)


@interp
@pytest.mark.parametrize("q_lens,k_lens", [([1, 1], [40, 3]), ([6, 1], [40, 3])], ids=["decode", "prefill"])
def test_attention_fp16(q_lens: list[int], k_lens: list[int], seed: int, poisoned_empty: None) -> None:
    # The interpreter computes fp16 in numpy (round to nearest); bf16 it truncates, so no bf16 here.
    check_attention(q_lens, k_lens, 8, 2, 64, 16, seed, 5e-3, dtype=torch.float16)


@interp
def test_attention_dispatcher(seed: int, forced: None) -> None:
    """The public entry point, with and without the max_seqlen hints, on decode and prefill."""
    for q_lens, k_lens in (([1, 1, 1], [9, 16, 33]), ([4, 1, 9], [9, 16, 33])):
        q, kc, vc, bt, cu, sk = paged_batch(q_lens, k_lens, 6, 2, 64, 8, seed)
        ref = paged_attention_ref(q, kc, vc, bt, cu, sk, 0.1)
        assert_close(paged_attention(q, kc, vc, bt, cu, sk, 0.1), ref, FP32_TOL)
        hinted = paged_attention(q, kc, vc, bt, cu, sk, 0.1, max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens))
        assert_close(hinted, ref, FP32_TOL)


@interp
def test_attention_strided_cache(seed: int, poisoned_empty: None) -> None:
    """The layer's cache-less path: one-token 'blocks' that are views of a fused qkv projection."""
    gen = torch.Generator().manual_seed(seed)
    h, hkv, d, lens = 4, 2, 64, [6, 3]
    qkv = randn(sum(lens), (h + 2 * hkv) * d, gen=gen)
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(-1, h, d), k.view(-1, hkv, d).unsqueeze(1), v.view(-1, hkv, d).unsqueeze(1)
    cu = torch.tensor([0, 6, 9], dtype=torch.int32)
    sk = torch.tensor(lens, dtype=torch.int32)
    tables = torch.tensor([[0, 1, 2, 3, 4, 5], [6, 7, 8, 0, 0, 0]], dtype=torch.int32)
    out = paged_attention_triton(q, k, v, tables, cu, sk, d**-0.5,
                                 tuning=AttentionTuning(block_m=16, block_n=16))
    assert_close(out, paged_attention_ref(q, k, v, tables, cu, sk, d**-0.5), FP32_TOL)


# ------------------------------------------------------------------------------- interpreter: the rest


@interp
@pytest.mark.parametrize("block_size,d", [(1, 64), (16, 64), (16, 80)])
def test_store_kv(block_size: int, d: int, seed: int, forced: None) -> None:
    gen = torch.Generator().manual_seed(seed)
    hkv, num_blocks = 3, 8
    kv = randn(7, 2 * hkv * d + 5, gen=gen)  # strided views, like slices of a fused qkv
    k = kv[:, : hkv * d].view(7, hkv, d)
    v = kv[:, hkv * d : 2 * hkv * d].view(7, hkv, d)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:7]
    slots[[1, 4]] = -1  # padding tokens
    caches = [torch.full((num_blocks, block_size, hkv, d), float("nan")) for _ in range(4)]
    store_kv(k, v, caches[0], caches[1], slots)
    store_kv_ref(k, v, caches[2], caches[3], slots)
    torch.testing.assert_close(caches[0], caches[2], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(caches[1], caches[3], rtol=0, atol=0, equal_nan=True)


@interp
@pytest.mark.parametrize("hidden", [64, 100, 576])
def test_rms_norm(hidden: int, seed: int, forced: None) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = randn(5, hidden + 3, gen=gen)[:, :hidden]  # rows with a stride wider than the row
    w = randn(hidden, gen=gen)
    assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), FP32_TOL)
    assert_close(rms_norm(x[:1], w, 1e-5), rms_norm_ref(x[:1], w, 1e-5), FP32_TOL)


@interp
@pytest.mark.parametrize("hidden", [64, 100, 576])
def test_add_rms_norm(hidden: int, seed: int, forced: None) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, res, w = randn(2, 3, hidden, gen=gen), randn(2, 3, hidden, gen=gen), randn(hidden, gen=gen)
    out, new_res = add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_res = add_rms_norm_ref(x, res, w, 1e-6)
    assert_close(out, ref_out, FP32_TOL)
    assert_close(new_res, ref_res, FP32_TOL)


@interp
@pytest.mark.parametrize("h,hkv,d", [(9, 3, 64), (4, 4, 128), (8, 1, 64), (2, 1, 96), (2, 1, 80)])
def test_apply_rotary(h: int, hkv: int, d: int, seed: int, forced: None) -> None:
    gen = torch.Generator().manual_seed(seed)
    t = 6
    qkv = randn(t, (h + 2 * hkv) * d, gen=gen)  # q and k as views of a fused projection
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d : (h + hkv) * d].view(t, hkv, d)
    cos_sin = randn(64, d, gen=gen)
    positions = torch.randint(0, 64, (t,), generator=gen)
    q_before, k_before = q.clone(), k.clone()
    out_q, out_k = apply_rotary(q, k, positions, cos_sin)
    ref_q, ref_k = apply_rotary_ref(q, k, positions, cos_sin)
    assert_close(out_q, ref_q, FP32_TOL)
    assert_close(out_k, ref_k, FP32_TOL)
    assert torch.equal(q, q_before) and torch.equal(k, k_before), "inputs must be left untouched"


def _rotate_and_store_case(t: int, h: int, hkv: int, d: int, block_size: int, gen: torch.Generator,
                           dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """q, k, v as views of one fused projection; positions; slots with two padding rows; 6 caches."""
    qkv = randn(t, (h + 2 * hkv) * d, gen=gen, dtype=dtype, device=device)
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(t, h, d), k.view(t, hkv, d), v.view(t, hkv, d)
    cos_sin = randn(4096, d, gen=gen, device=device)
    positions = torch.randint(0, 4096, (t,), generator=gen).to(device)
    num_blocks = -(-t // block_size) + 3
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]
    slots[[0, t // 2]] = -1
    caches = [torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype, device=device)
              for _ in range(6)]
    return q, k, v, positions, cos_sin, slots.to(device), caches


@interp
@pytest.mark.parametrize("h,hkv,d,block_size", [(9, 3, 64, 16), (4, 4, 128, 1), (8, 1, 64, 16), (2, 1, 96, 8),
                                                (2, 1, 80, 8)])
def test_rotate_and_store_kv(h: int, hkv: int, d: int, block_size: int, seed: int, forced: None) -> None:
    """The fused kernel equals its reference, and writes exactly what rotary then store_kv write."""
    q, k, v, positions, cos_sin, slots, c = _rotate_and_store_case(7, h, hkv, d, block_size,
                                                                   torch.Generator().manual_seed(seed))
    q_before, k_before = q.clone(), k.clone()
    out_q = rotate_and_store_kv(q, k, v, positions, cos_sin, c[0], c[1], slots)
    ref_q = rotate_and_store_kv_ref(q, k, v, positions, cos_sin, c[2], c[3], slots)
    assert_close(out_q, ref_q, FP32_TOL)
    torch.testing.assert_close(c[0], c[2], rtol=FP32_TOL, atol=FP32_TOL, equal_nan=True)
    torch.testing.assert_close(c[1], c[3], rtol=0, atol=0, equal_nan=True)
    two_q, two_k = apply_rotary(q, k, positions, cos_sin)
    store_kv(two_k, v, c[4], c[5], slots)
    torch.testing.assert_close(out_q, two_q, rtol=0, atol=0)
    torch.testing.assert_close(c[0], c[4], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(q, q_before) and torch.equal(k, k_before), "inputs must be left untouched"


@interp
@pytest.mark.parametrize("m,n,k,bias", [(1, 37, 100, False), (3, 64, 513, True), (4, 20, 64, False),
                                        (2, 9, 1030, True)])
def test_gemv(m: int, n: int, k: int, bias: bool, seed: int, forced: None) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = randn(m, k + 3, gen=gen)[:, :k]  # a strided view, like a slice of a wider activation
    w = randn(n, k, gen=gen)
    b = randn(n, gen=gen) if bias else None
    assert_close(gemv(x, w, b), gemv_ref(x, w, b), FP32_TOL)
    # Into a given buffer (tensor parallel's fused all-reduce slot): a view of a wider one.
    buf = torch.full((m, n + 5), float("nan"))
    got = gemv(x, w, b, out=buf[:, :n])
    assert got.data_ptr() == buf.data_ptr() and torch.isnan(buf[:, n:]).all()
    assert_close(buf[:, :n], gemv_ref(x, w, b), FP32_TOL)


@interp
@pytest.mark.parametrize("shape", [(5, 128), (2, 3, 2 * 1536)])
def test_silu_and_mul(shape: tuple[int, ...], seed: int, forced: None) -> None:
    x = randn(*shape, gen=torch.Generator().manual_seed(seed))
    assert_close(silu_and_mul(x), silu_and_mul_ref(x), FP32_TOL)


@interp
def test_forced_triton_rejects_unsupported_shapes(forced: None) -> None:
    q, kc, vc, bt, cu, sk = paged_batch([1], [5], 2, 1, 64, 16, seed=0)
    small = (q[..., :8].contiguous(), kc[..., :8].contiguous(), vc[..., :8].contiguous())
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention(*small, bt, cu, sk, 0.1)


# -------------------------------------------------------------------------------- dispatch (any mode)


def test_auto_and_ref_modes_use_the_reference_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU tensors (auto) and in the ref mode, no Triton launcher is reached."""

    def boom(*args, **kwargs):
        raise AssertionError("Triton launcher called")

    for mod, name in ((attention_mod, "paged_attention_triton"), (kv_cache_mod, "store_kv_triton"),
                      (kv_cache_mod, "rotate_and_store_kv_triton"), (gemv_mod, "gemv_triton"),
                      (rms_norm_mod, "rms_norm_triton"), (rms_norm_mod, "add_rms_norm_triton"),
                      (rotary_mod, "apply_rotary_triton"), (activation_mod, "silu_and_mul_triton")):
        monkeypatch.setattr(mod, name, boom)
    for mode in ("auto", "ref"):
        set_kernel_mode(mode)
        q, kc, vc, bt, cu, sk = paged_batch([2], [5], 2, 1, 64, 16, seed=1)
        paged_attention(q, kc, vc, bt, cu, sk, 0.1)
        store_kv(q[:, :1], q[:, :1], kc, vc, torch.tensor([0, -1]))
        rms_norm(q, torch.ones(64), 1e-6)
        add_rms_norm(q, q, torch.ones(64), 1e-6)
        apply_rotary(q, q[:, :1], torch.tensor([0, 1]), torch.randn(4, 64))
        silu_and_mul(q)
        gemv(torch.randn(1, 8), torch.randn(3, 8))


def test_unknown_mode_is_rejected() -> None:
    with pytest.raises(ValueError, match="kernels='cuda': use one of auto, ref, triton"):
        set_kernel_mode("cuda")


@pytest.mark.skipif(TRITON_INTERPRETED, reason="Triton runs interpreted in this process")
def test_forced_triton_on_cpu_without_interpreter_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    set_kernel_mode("triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        silu_and_mul(torch.randn(2, 4))


@pytest.mark.skipif(TRITON_INTERPRETED, reason="the interpreter cases run in this process")
def test_interpreter_cases_in_child() -> None:
    """Run this file's interpreter cases in a child process that imports triton interpreted."""
    run_interpreter_cases_in_child(__file__)


# -------------------------------------------------------------------------------------------------- GPU

GPU_DTYPES = [torch.bfloat16, torch.float16]


@gpu
@compiled_gpu
def test_dispatch_picks_triton_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """With CUDA tensors (auto mode) no reference runs: every dispatcher reaches its kernel."""
    set_kernel_mode("auto")

    def boom(*args, **kwargs):
        raise AssertionError("reference called on CUDA tensors")

    for mod, name in ((attention_mod, "paged_attention_ref"), (kv_cache_mod, "store_kv_ref"),
                      (rms_norm_mod, "rms_norm_ref"), (rms_norm_mod, "add_rms_norm_ref"),
                      (rotary_mod, "apply_rotary_ref"), (activation_mod, "silu_and_mul_ref")):
        monkeypatch.setattr(mod, name, boom)
    dev = "cuda"
    q, kc, vc, bt, cu, sk = paged_batch([3, 1], [20, 7], 4, 2, 64, 16, seed=2, dtype=torch.bfloat16, device=dev)
    paged_attention(q, kc, vc, bt, cu, sk, 0.125, max_seqlen_q=3, max_seqlen_k=20)
    store_kv(q[:, :2], q[:, :2], kc, vc, torch.tensor([0, 1, 2, -1], device=dev))
    w = torch.ones(64, device=dev, dtype=torch.bfloat16)
    rms_norm(q, w, 1e-6)
    add_rms_norm(q, q, w, 1e-6)
    apply_rotary(q, q[:, :2], torch.arange(4, device=dev), torch.randn(8, 64, device=dev))
    silu_and_mul(q)
    torch.cuda.synchronize()



@gpu
@compiled_gpu
@pytest.mark.parametrize("k_in", [4096, 11008, 1000], ids=["k4096", "k11008", "k1000"])
def test_a_gemv_started_early_by_the_norm_before_it_reads_the_norm_s_output(k_in: int) -> None:
    """The fp16 one-row GEMV requests its first weight slice before it waits for the norm
    (``check_after_the_norm``). K below one slice (1000) leaves the loop after the peeled slice
    empty."""
    gen = torch.Generator().manual_seed(k_in)
    w = (torch.randn(12288, k_in, generator=gen) * 0.02).half().cuda()
    check_after_the_norm(lambda x: gemv(x, w), lambda x: gemv_ref(x, w), k_in, gen, GPU_TOL[torch.float16])


# (batch, context lengths, H, Hkv, D, block_size)
GPU_DECODE = {
    "batch1_4k_g3_d64": (1, [4096], 9, 3, 64, 16),
    "batch1_32k_g4_d128": (1, [32768], 32, 8, 128, 64),
    "batch1_short": (1, [37], 8, 8, 128, 16),
    "batch256_mixed_g8": (256, None, 32, 4, 128, 16),
    "batch256_mixed_g3_bs64": (256, None, 9, 3, 64, 64),
    "batch4_long_mixed": (4, [17000, 4096, 511, 8193], 16, 2, 128, 64),
}


@gpu
@compiled_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", GPU_DECODE.values(), ids=GPU_DECODE.keys())
def test_gpu_decode(case: tuple, dtype: torch.dtype, seed: int, poisoned_empty: None) -> None:
    batch, lens, h, hkv, d, bs = case
    if lens is None:
        lens = torch.randint(1, 2049, (batch,), generator=torch.Generator().manual_seed(seed)).tolist()
    check_attention([1] * batch, lens, h, hkv, d, bs, seed, GPU_TOL[dtype], dtype, "cuda")


# (q_lens, k_lens, H, Hkv, D, block_size)
GPU_PREFILL = {
    "prefill_2k_g3_d64": ([2048], [2048], 9, 3, 64, 16),
    "prefill_2k_g4_d128_bs64": ([2048], [2048], 32, 8, 128, 64),
    "varlen_prefill": ([1000, 17, 513, 64], [1000, 17, 513, 64], 16, 2, 128, 16),
    "chunked_over_prefix": ([512, 1000, 1, 33], [3000, 1000, 700, 4129], 32, 8, 128, 64),
    "chunk_after_long_prefix": ([256], [16384], 9, 3, 64, 16),
}


@gpu
@compiled_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", GPU_PREFILL.values(), ids=GPU_PREFILL.keys())
def test_gpu_prefill(case: tuple, dtype: torch.dtype, seed: int, poisoned_empty: None) -> None:
    q_lens, k_lens, h, hkv, d, bs = case
    check_attention(q_lens, k_lens, h, hkv, d, bs, seed, GPU_TOL[dtype], dtype, "cuda")


# Gemma 2's layers (window 4096, cap 50) and smaller windows: (q_lens, k_lens, H, Hkv, D, block_size,
# window, softcap). Decode reads only the window (32k context); prefill skips the keys before it.
GPU_MODS = {
    "decode_batch1_32k_window4k_g2_d256": ([1], [32768], 16, 8, 256, 16, 4096, 50.0),
    "decode_mixed_window_g4": ([1] * 64, None, 32, 8, 128, 16, 1000, None),
    "decode_softcap_g8": ([1] * 8, [3000, 1, 17, 512, 513, 4096, 70, 2049], 32, 4, 128, 64, None, 30.0),
    "prefill_2k_window512_softcap": ([2048], [2048], 16, 8, 128, 16, 512, 50.0),
    "chunked_over_prefix_window": ([512, 1000, 1, 33], [3000, 1000, 700, 4129], 32, 8, 128, 64, 777, None),
}


@gpu
@compiled_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", GPU_MODS.values(), ids=GPU_MODS.keys())
def test_gpu_window_softcap(case: tuple, dtype: torch.dtype, seed: int, poisoned_empty: None) -> None:
    q_lens, k_lens, h, hkv, d, bs, window, softcap = case
    if k_lens is None:
        k_lens = torch.randint(1, 4097, (len(q_lens),), generator=torch.Generator().manual_seed(seed)).tolist()
    check_attention(q_lens, k_lens, h, hkv, d, bs, seed, GPU_TOL[dtype], dtype, "cuda", window=window, softcap=softcap)


@gpu
@compiled_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["bf16", "fp16"])
def test_gpu_alibi(dtype: torch.dtype, seed: int, poisoned_empty: None) -> None:
    """Baichuan-13B's attention (40 heads, MHA, D 128): decode over long contexts, prefill, a chunk."""
    check_attention([1] * 4, [4096, 17, 2049, 700], 40, 40, 128, 16, seed, GPU_TOL[dtype], dtype, "cuda", alibi=True)
    check_attention([2048], [2048], 40, 40, 128, 16, seed, GPU_TOL[dtype], dtype, "cuda", alibi=True)
    check_attention([512, 33], [3000, 4129], 40, 40, 128, 64, seed, GPU_TOL[dtype], dtype, "cuda", alibi=True,
                    window=1000)


@gpu
@compiled_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["bf16", "fp16"])
def test_gpu_head_dim_96(dtype: torch.dtype, seed: int, poisoned_empty: None) -> None:
    """Phi-3-mini's attention (32 heads, MHA, D 96, padded to 128 in the kernels): decode at batch
    1 over a long context and a mixed batch, prefill, a chunk over a prefix; and the cache writes."""
    tol = GPU_TOL[dtype]
    check_attention([1], [4096], 32, 32, 96, 16, seed, tol, dtype, "cuda")
    check_attention([1] * 64, [1 + 37 * i for i in range(64)], 32, 32, 96, 16, seed, tol, dtype, "cuda")
    check_attention([2048], [2048], 32, 32, 96, 16, seed, tol, dtype, "cuda")
    check_attention([512, 1, 33], [3000, 700, 4129], 32, 32, 96, 64, seed, tol, dtype, "cuda")
    check_attention([1] * 4, [17000, 4096, 511, 8193], 40, 8, 80, 64, seed, tol, dtype, "cuda")
    gen = torch.Generator().manual_seed(seed)
    q, k, v, positions, cos_sin, slots, c = _rotate_and_store_case(2048, 32, 32, 96, 16, gen, dtype, "cuda")
    out_q = rotate_and_store_kv(q, k, v, positions, cos_sin, c[0], c[1], slots)
    assert_close(out_q, rotate_and_store_kv_ref(q, k, v, positions, cos_sin, c[2], c[3], slots), tol)
    store_kv(k, v, c[4], c[5], slots)
    store_kv_ref(k, v, c[2], c[3], slots)
    torch.testing.assert_close(c[4], c[2], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(c[5], c[3], rtol=0, atol=0, equal_nan=True)


@gpu
@compiled_gpu
def test_gpu_attention_fp32_exact(seed: int, poisoned_empty: None) -> None:
    """fp32 inputs must not silently drop to TF32 tensor-core products."""
    check_attention([1] * 3, [700, 5, 1025], 8, 2, 128, 16, seed, 1e-5, torch.float32, "cuda")
    check_attention([300, 2], [300, 900], 8, 2, 128, 16, seed + 1, 1e-5, torch.float32, "cuda")


@gpu
@compiled_gpu
def test_gpu_dispatcher_without_hints(seed: int, poisoned_empty: None) -> None:
    """paged_attention reads max_seqlen_q/k from the device when the caller does not pass them."""
    for q_lens, k_lens in (([1] * 5, [3000, 1, 17, 512, 513]), ([100, 1, 7], [100, 900, 7])):
        q, kc, vc, bt, cu, sk = paged_batch(q_lens, k_lens, 8, 2, 128, 16, seed, torch.bfloat16, "cuda")
        out = paged_attention(q, kc, vc, bt, cu, sk, 0.1)
        assert_close(out, paged_attention_ref(q, kc, vc, bt, cu, sk, 0.1), GPU_TOL[torch.bfloat16])


@gpu
@compiled_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["bf16", "fp16"])
def test_gpu_pointwise_kernels(dtype: torch.dtype, seed: int, poisoned_empty: None) -> None:
    """store_kv, (add_)rms_norm, rotary, silu_and_mul at model sizes; exact or within one rounding."""
    gen = torch.Generator().manual_seed(seed)
    dev, t, h, hkv, d, hidden, inter = "cuda", 2048, 32, 8, 128, 4096, 11008
    qkv = randn(t, (h + 2 * hkv) * d, gen=gen, dtype=dtype, device=dev)
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(t, h, d), k.view(t, hkv, d), v.view(t, hkv, d)

    num_blocks, bs = 200, 16
    slots = torch.randperm(num_blocks * bs, generator=gen)[:t]
    slots[::7] = -1
    slots = slots.to(dev)
    caches = [torch.full((num_blocks, bs, hkv, d), float("nan"), dtype=dtype, device=dev) for _ in range(4)]
    store_kv(k, v, caches[0], caches[1], slots)
    store_kv_ref(k, v, caches[2], caches[3], slots)
    torch.testing.assert_close(caches[0], caches[2], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(caches[1], caches[3], rtol=0, atol=0, equal_nan=True)

    cos_sin = randn(8192, d, gen=gen, device=dev)
    positions = torch.randint(0, 8192, (t,), generator=gen).to(dev)
    for out, ref in zip(apply_rotary(q, k, positions, cos_sin), apply_rotary_ref(q, k, positions, cos_sin)):
        assert_close(out, ref, GPU_TOL[dtype])

    # The fused rotary + store: its reference within one rounding, and the two-kernel path exactly.
    q2, k2, v2, pos2, cs2, slots2, c = _rotate_and_store_case(t, h, hkv, d, 16, gen, dtype, dev)
    out_q = rotate_and_store_kv(q2, k2, v2, pos2, cs2, c[0], c[1], slots2)
    ref_q = rotate_and_store_kv_ref(q2, k2, v2, pos2, cs2, c[2], c[3], slots2)
    assert_close(out_q, ref_q, GPU_TOL[dtype])
    written = slots2 >= 0
    flat = [x.view(-1, hkv, d) for x in c]
    idx = slots2[written].long()
    assert_close(flat[0][idx], flat[2][idx], GPU_TOL[dtype])
    torch.testing.assert_close(flat[1][idx], flat[3][idx], rtol=0, atol=0)
    two_q, two_k = apply_rotary(q2, k2, pos2, cs2)
    store_kv(two_k, v2, c[4], c[5], slots2)
    torch.testing.assert_close(out_q, two_q, rtol=0, atol=0)
    torch.testing.assert_close(c[0], c[4], rtol=0, atol=0, equal_nan=True)

    x = randn(t, hidden, gen=gen, dtype=dtype, device=dev)
    res = randn(t, hidden, gen=gen, dtype=dtype, device=dev)
    w = randn(hidden, gen=gen, dtype=dtype, device=dev)
    assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), GPU_TOL[dtype])
    out, new_res = add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_res = add_rms_norm_ref(x, res, w, 1e-6)
    assert_close(out, ref_out, GPU_TOL[dtype])
    torch.testing.assert_close(new_res, ref_res, rtol=0, atol=0)

    # The batch-1 decode GEMV at Llama-2 shapes (1, 2 and 4 rows; the head's 32000 outputs).
    for rows, n_out, k_in in ((1, 12288, 4096), (2, 4096, 11008), (4, 32000, 4096), (1, 4095, 4096)):
        xr = randn(rows, k_in, gen=gen, dtype=dtype, device=dev)
        wr = randn(n_out, k_in, gen=gen, dtype=dtype, device=dev) * 0.02
        assert_close(gemv(xr, wr), gemv_ref(xr, wr), GPU_TOL[dtype])

    gate_up = randn(t, 2 * inter, gen=gen, dtype=dtype, device=dev)
    assert_close(silu_and_mul(gate_up), silu_and_mul_ref(gate_up), GPU_TOL[dtype])
