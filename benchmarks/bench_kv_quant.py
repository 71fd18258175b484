"""The quantized KV cache's kernels against the 16-bit cache's, on Llama-2-7B decode shapes.

    python -m benchmarks.bench_kv_quant [--batch 64] [--context 512]

Times (CUDA events, median of many launches) the decode attention kernel over a cache of
``--batch`` sequences of ``--context`` tokens, and the fused rotary + cache write of one decode
step, for quant_policy 0 / 8 / 4; for the quantized caches with the scales laid out
token-major ([blocks, block_size, heads, 2], as allocated before) and head-major (each head's
scales of a block contiguous). Prints µs and the effective read bandwidth of the attention.
"""

from __future__ import annotations

import argparse
import torch

from benchmarks.common import eager_time_us, record, save
from conveyor.kernels.attention import paged_attention
from conveyor.kernels.kv_cache import KVCacheLayout, rotate_and_store_kv


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--name", default="bench_kv_quant")
    args = ap.parse_args()
    dev, dt = "cuda", torch.float16
    b, ctx, h, hkv, d, bs = args.batch, args.context, args.heads, args.kv_heads, args.head_dim, args.block_size
    per_seq = -(-ctx // bs)
    blocks = b * per_seq + 1
    tables = torch.randperm(blocks - 1, device=dev, dtype=torch.int32)[: b * per_seq].view(b, per_seq)
    cu = torch.arange(b + 1, device=dev, dtype=torch.int32)
    lens = torch.full((b,), ctx, device=dev, dtype=torch.int32)
    q = torch.randn(b, h, d, device=dev, dtype=dt)
    records = []
    for policy in (0, 8, 4):
        for head_major in ((False,) if policy == 0 else (False, True)):
            layout = KVCacheLayout(policy, d)
            kc, ks = layout.allocate((blocks, bs, hkv), dt, dev)
            vc, vs = layout.allocate((blocks, bs, hkv), dt, dev)
            if head_major and ks is not None:  # same shape, each head's block of scales contiguous
                ks = torch.zeros(blocks, hkv, bs, 2, device=dev, dtype=ks.dtype).transpose(1, 2)
                vs = torch.zeros(blocks, hkv, bs, 2, device=dev, dtype=vs.dtype).transpose(1, 2)
            if policy:
                kc.random_(0, 256), vc.random_(0, 256)
                ks[..., 0].fill_(0.01), vs[..., 0].fill_(0.01)
            else:
                kc.normal_(), vc.normal_()
            attn = lambda: paged_attention(q, kc, vc, tables, cu, lens, d**-0.5, max_seqlen_q=1,  # noqa: E731
                                           max_seqlen_k=4096, k_scales=ks, v_scales=vs)
            us = eager_time_us(attn, 50)
            kv_bytes = 2 * b * ctx * hkv * layout.bytes_per_head(dt)
            qkv = torch.randn(b, (h + 2 * hkv) * d, device=dev, dtype=dt)
            qq, kk, vv = qkv.split([h * d, hkv * d, hkv * d], -1)
            qq, kk, vv = qq.view(b, h, d), kk.view(b, hkv, d), vv.view(b, hkv, d)
            pos = torch.full((b,), ctx, device=dev, dtype=torch.int64)
            cs = torch.randn(8192, d, device=dev, dtype=torch.float32)
            slots = (tables[:, -1].long() * bs + (ctx % bs))
            store = lambda: rotate_and_store_kv(qq, kk, vv, pos, cs, kc, vc, slots, ks, vs)  # noqa: E731
            store_us = eager_time_us(store, 50)
            label = f"p{policy}" + ("_headmajor" if head_major else "")
            print(f"{label:>14}: attention {us:8.1f} us ({kv_bytes / us / 1e3:7.0f} GB/s of KV), "
                  f"rotate+store {store_us:6.1f} us", flush=True)
            records.append(record(engine="conveyor", benchmark="bench_kv_quant", model="llama2-7b-layer",
                                  batch=b, input_len=ctx, quant_policy=policy, layout=label, attention_us=us,
                                  kv_gb_s=kv_bytes / us / 1e3, store_us=store_us))
    print(f"saved {save(records, args.name)}")


if __name__ == "__main__":
    main()
