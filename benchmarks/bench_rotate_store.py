"""The fused rotary + KV-cache-write kernel alone, per cache policy and token count.

    python -m benchmarks.bench_rotate_store [--tokens 1 256 1024 4096] [--policies 0 8 4]

Llama-2-7B's shapes (32 query and 32 KV heads of 128 dims, cache blocks of 64 tokens), fp16.
Each case is the median of 5 samples of 40 launches queued back to back (``cuda_time_us``);
the record gives microseconds a launch and the bytes moved per second (q, k, v read, q and the
cache entries written). Below ~2,000 tokens the launches are bound by the host's launch cost (~45 us on the
H200's host), so the kernel's own speed shows at 4,096. Needs a GPU.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import cuda_time_us, record, save
from conveyor.kernels.kv_cache import rotate_and_store_kv_triton
from conveyor.kernels.kv_layout import KVCacheLayout

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 32, 128, 64


def time_case(tokens: int, bits: int) -> float:
    """Microseconds per launch."""
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(tokens, HEADS + 2 * KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.float16, generator=g)
    q, k, v = qkv.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
    positions = torch.randint(0, 4096, (tokens,), device="cuda", generator=g)
    inv = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2, device="cuda") / HEAD_DIM)
    angles = torch.arange(8192, device="cuda")[:, None] * inv[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    blocks = tokens // BLOCK + 2
    layout = KVCacheLayout(bits, HEAD_DIM)
    (kc, ks), (vc, vs) = (layout.allocate((blocks, BLOCK, KV_HEADS), torch.float16, "cuda") for _ in range(2))
    slots = torch.randperm(blocks * BLOCK, device="cuda", generator=g)[:tokens]

    def launch() -> None:
        rotate_and_store_kv_triton(q, k, v, positions, cos_sin, kc, vc, slots, ks, vs)

    return cuda_time_us(launch, samples=5, calls=40)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 256, 1024, 4096])
    ap.add_argument("--policies", type=int, nargs="+", default=[0, 8, 4])
    ap.add_argument("--name", default="bench_rotate_store")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("times a CUDA kernel: it needs a GPU")
    rows = []
    for bits in args.policies:
        entry = KVCacheLayout(bits, HEAD_DIM).bytes_per_head(torch.float16)  # codes and (scale, zero)
        for tokens in args.tokens:
            # q read and written; k and v read and stored
            moved = tokens * (HEADS * HEAD_DIM * 2 * 2 + 2 * KV_HEADS * (HEAD_DIM * 2 + entry))
            us = time_case(tokens, bits)
            rows.append(record(benchmark="bench_rotate_store", model="llama2-7b", quant_policy=bits, batch=tokens,
                               us=round(us, 2), gb_s=round(moved / us / 1e3, 1)))
            print(f"policy {bits} tokens {tokens:5d}: {us:8.2f} us, {moved / us / 1e3:7.1f} GB/s", flush=True)
    print(f"saved {save(rows, args.name)}")


if __name__ == "__main__":
    main()
