"""W4A16 matrix products on AWQ checkpoints: 4-bit weights, fp16/bf16 activations, ``y = x @ W``.

Weights stay in AutoAWQ's "GEMM" layout, exactly as its checkpoints store them, so loading
needs no repacking:

* ``qweight`` int32 [K, N // 8]: row ``k`` packs 8 consecutive output columns per int32;
* ``qzeros``  int32 [G, N // 8]: the 4-bit zero points, packed the same way;
* ``scales``  fp16  [G, N];  ``G = ceil(K / group_size)`` (the last group may be shorter);
* ``w[k, n] = (q[k, n] - z[k // group_size, n]) * s[k // group_size, n]``.

Inside an int32 the 8 columns are interleaved: the nibble at bit offset ``4 * i`` holds column
``AWQ_PACK_ORDER[i]`` of the 8, so column ``j`` sits at nibble ``AWQ_NIBBLE_OF_COLUMN[j]``. Read
from AutoAWQ (github.com/casper-hansen/AutoAWQ, commit 88e4c76, May 2025):
``awq/modules/linear/gemm.py`` ``WQLinear_GEMM.from_linear`` packs
``qweight[:, col] |= intweight[:, col * 8 + order_map[i]] << (i * 4)`` with
``order_map = [0, 2, 4, 6, 1, 3, 5, 7]``, and ``qzeros`` with the same loop;
``awq/utils/packing_utils.py`` undoes it: ``unpack_awq`` shifts by 0, 4, ..., 28 (nibble order)
and ``reverse_awq_order`` picks nibble ``AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7][j]`` for
column ``j``; ``dequantize_gemm`` is ``(iweight - izeros) * scales`` with the group rows repeated.
(The interleave puts columns ``2j`` and ``2j + 1`` in nibbles ``j`` and ``j + 4``, i.e. in the two
16-bit halves of the word, for CUDA kernels that convert two at a time.) AutoAWQ requires
``K % group_size == 0``; here a shorter last group is allowed too.

Reading 4-bit codes without conversions. Column ``2j + h`` of a word is nibble ``j`` of its
half ``h``, so one AND-OR (LOP3) of ``word`` or ``word >> 8`` with ``0x000F000F`` or
``0x00F000F0`` and ``0x64006400`` gives two fp16 values ``1024 + c`` (or ``1024 + 16 c``) at
once, the "magic number" read of the codes (FasterTransformer, LMDeploy). One fp16x2 fused
multiply-add (PTX ``fma.rn.f16x2``, via ``tl.inline_asm_elementwise``) then makes ``q - z`` of
both exactly (``v * 1 - (1024 + z)`` or ``v / 16 - (64 + z)``). fp16 activations use this path
(the half2 kernels); bf16 ones the older fp32 form: with ``hi = word >> 16`` every column is
``bits(2**23 + c * 16**j) = 0x4B000000 | (half & 0xF << 4j)``, and two such values subtract to
``(q - z) * 16**j`` exactly, ``16**-j`` folded into the scale. Under Triton's interpreter (no
inline assembly) the fp16x2 arithmetic is emulated through fp32 with the same roundings.

* **M == 1** (batch-1 decode): a GEMV. A program takes 8 * BLOCK_P columns and a range of rows;
  the next step's loads are issued before this step's arithmetic. fp16: per two weights one
  LOP3 and two HFMA2 (``q - z``, then ``x * (q - z)`` into an fp16 chain of 8 rows a thread),
  each chain added into fp32 times the group's scales (``_gemv_f16_kernel``). bf16: ``x * q *
  16**j`` summed in fp32 and the zeros folded in per group (``sum x (q - z) = sum x q - z sum
  x``, ``_gemv_kernel``). N tiles alone are too few for 132 SMs, so K is split as well; the
  fp16 kernel adds the per-split partial sums in the last program of each column tile to
  arrive (a counter per tile, no second launch), the bf16 one in a second small kernel; both
  in a fixed order (deterministic, unlike atomics).
* **2 <= M < DEQUANT_MIN_ROWS** (batched decode): a tiled GEMM; each K tile of packed weights
  is dequantized in registers to x's dtype (fp16: ``q - z`` and the scale product both HFMA2,
  the planes joined into natural column order) and fed to one ``tl.dot`` accumulating in fp32.
  Split over K too when the output tiles are fewer than the SMs. Up to 32 rows (and for wide or
  deep layers at 64) the operands are swapped (``_gemm_swap_kernel``, ``out^T = W^T x^T``): the
  weight columns fill the warp-group MMA's 64-row side and the few rows its narrow side.
* **M >= DEQUANT_MIN_ROWS** (prefill, large batches): a Triton kernel writes the dense weight in
  x's dtype and cuBLAS multiplies, as AutoAWQ and vLLM do for large batches. A transient
  K * N * 2 bytes (180 MB for Llama-2-7B's gate_up) is allocated per call.

Measured on one H200 (``benchmarks/bench_w4a16.py``, Llama-2-7B projections, group 128, fp16,
commit bcd5b31 against e884025 in the same call; ``docs/benchmarks.md`` has the table): at M = 1
the GEMV takes 8.9-23 µs per projection (qkv 14.7, o_proj 8.9, was 10.0, gate_up 23.1, was
28.1, down 15.2), 1.6-2.0x fp16 cuBLAS but only ~40-50% of HBM bandwidth. Its loop is ~3.5
SASS instructions per weight, and a one-warp program keeps one step of loads in flight. The
fused GEMM matches or beats fp16 at 16 rows (0.9-1.25x) and at 32 rows reaches 0.9-1.1x.
At 64 rows it reaches 0.6-0.8x: each K step's dequantized tile goes through shared memory
into the MMA's operand, and the step's MMA is waited on before the next dequantization. From
128 rows the dense-weight path (~0.5x fp16 at 128-256 rows) is used. A K tile never straddles
two groups (``BLOCK_K`` and the GEMV's row step divide ``group_size``, or one group covers K).
Launch choices are in ``gemv_config`` / ``gemv_splits`` / ``gemm_config`` / ``split_k``.

The package, one concern a module: ``packing`` (AWQ's layout: pack, unpack, shape check),
``reference`` (plain torch), ``codes`` (reading 4-bit codes in registers), ``gemv``, ``gemm`` and
``dequant`` (the kernels of the three paths), ``policy`` (tile and split choices) and ``launch``
(the launchers and the dispatcher).
"""

from .launch import dequantize_awq_triton, w4a16_matmul, w4a16_matmul_triton
from .packing import AWQ_NIBBLE_OF_COLUMN, AWQ_PACK_ORDER, PACK, awq_pack, awq_unpack, check_awq_shapes
from .policy import DEQUANT_MIN_ROWS, GemmConfig, GemvConfig, gemm_config, gemv_config
from .reference import dequantize_awq_ref, w4a16_matmul_ref

__all__ = [
    "AWQ_NIBBLE_OF_COLUMN", "AWQ_PACK_ORDER", "DEQUANT_MIN_ROWS", "PACK", "GemmConfig", "GemvConfig", "awq_pack",
    "awq_unpack", "check_awq_shapes", "dequantize_awq_ref", "dequantize_awq_triton", "gemm_config", "gemv_config",
    "w4a16_matmul", "w4a16_matmul_ref", "w4a16_matmul_triton",
]
