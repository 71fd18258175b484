"""Mixture-of-experts: routing and the fused expert MLP, each beside its plain-torch reference.

``router_logits`` (``router.py``) computes the router's fp32 logits from a 16-bit hidden state
(one kernel for a decode step's tokens). ``select_experts`` (``routing.py``; its kernel in
``topk.py``) turns router logits [T, E] into (weights [T, k] fp32, ids [T, k] int32) with a
family's rule: softmax then top-k (Mixtral, Qwen2/3-MoE), with or without renormalising the k
weights, optionally top-k within the best groups of experts (DeepSeek-V2's grouped top-k).

``fused_moe(x, w13, w2, weights, ids)`` is the expert MLP of every token:
``out[t] = sum_j weights[t, j] * w2[e] @ (act(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t]))`` with
``e = ids[t, j]``; ``w13`` [E, 2I, H] holds each expert's gate rows then its up rows (the engine's
fused ``gate_up`` order), ``w2`` [E, H, I] its down projection. The reference gathers each
expert's tokens and runs them as one product (no per-token loop); the Triton kernel (CUDA) sorts
the (token, slot) pairs by expert and runs one grouped GEMM per projection:

* ``align.py``: ``moe_align`` lays the T*k pairs out expert by expert, each run padded to a
  multiple of BLOCK_M, on the device (no host sync; sizes from T, k, E alone: CUDA graphs capture
  it), with each tile's expert: two Triton kernels up to 4096 pairs, torch ops past it;
* ``gemm.py``: the gate/up GEMM (``act(gate) * up`` in its epilogue, [T*k, I]) and the down GEMM
  (the routing weight in its epilogue, [T*k, H], summed over k by the launcher);
* ``policy.py``: the tiles: per-shape tunings saved in ``configs/<GPU>/`` (written by
  ``benchmarks/tune_moe.py``), else a table by rows per expert (BLOCK_M 16 for decode);
* ``launch.py``: ``fused_moe`` takes the Triton path through ``triton_takes`` (fp16/bf16/fp32,
  contiguous weights of x's dtype, silu/gelu/gelu_tanh), else the reference.

On AWQ (W4A16) experts, ``fused_moe_w4a16`` (``launch_w4a16.py``) runs the same layout and
epilogues with each K tile of 4-bit weights dequantized in registers (``gemm_w4a16.py``, by
``kernels/w4a16``'s tile reader; fp16/bf16); its reference (``reference_w4a16.py``) dequantizes
the experts in use and runs ``fused_moe_ref``.

On W8A8 (SmoothQuant int8) experts, ``fused_moe_w8a8`` (``launch_w8a8.py``) quantizes x per token
(``kernels/w8a8``), runs the same layout with int8 x int8 -> int32 tiles and both scales in the
epilogues (``gemm_w8a8.py``), and quantizes the intermediate per (token, slot) pair between the
two GEMMs; its reference (``reference_w8a8.py``) is the same integer arithmetic in plain torch.
"""

from .align import moe_align
from .launch import fused_moe, fused_moe_triton
from .launch_w4a16 import fused_moe_w4a16
from .launch_w8a8 import fused_moe_w8a8
from .reference import fused_moe_ref
from .routing import select_experts, select_experts_ref

__all__ = ["fused_moe", "fused_moe_ref", "fused_moe_triton", "fused_moe_w4a16", "fused_moe_w8a8", "moe_align",
           "select_experts", "select_experts_ref"]
