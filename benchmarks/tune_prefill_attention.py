"""Tile and launch choices of the prefill attention kernel, timed on one 2048-token prompt.

For the Llama-2-7B (32/32 heads) and Llama-3-8B (32/8 heads) attention shapes, fp16, D=128,
block size 64: each (BLOCK_M, BLOCK_N, num_warps, num_stages) is checked against the torch
reference, then timed (CUDA events, median of 20 after 3 warm-ups). The default is marked.

    python -m benchmarks.tune_prefill_attention
"""

import functools
import itertools

import torch

from benchmarks.common import cuda_time_us, record, save
from conveyor.kernels.attention import AttentionTuning, paged_attention_ref, paged_attention_triton

CONFIGS = [(bm, bn, w, st) for bm, bn in ((64, 64), (128, 64), (128, 32), (64, 32), (128, 128))
           for w, st in itertools.product((4, 8), (2, 3))]


def problem(heads: int, kv_heads: int, tokens: int = 2048, dim: int = 128, block: int = 64):
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks = tokens // block + 4
    kc = torch.randn(blocks, block, kv_heads, dim, device="cuda", dtype=torch.float16, generator=gen)
    vc = torch.randn(blocks, block, kv_heads, dim, device="cuda", dtype=torch.float16, generator=gen)
    q = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.float16, generator=gen)
    table = torch.randperm(blocks, device="cuda", generator=gen)[: tokens // block][None].to(torch.int32)
    cu = torch.tensor([0, tokens], device="cuda", dtype=torch.int32)
    lens = torch.tensor([tokens], device="cuda", dtype=torch.int32)
    return q, kc, vc, table, cu, lens


def main() -> None:
    records = []
    for name, heads, kv_heads in (("llama2-7b", 32, 32), ("llama3-8b", 32, 8)):
        q, kc, vc, table, cu, lens = problem(heads, kv_heads)
        ref = paged_attention_ref(q, kc, vc, table, cu, lens, 128**-0.5)
        call = functools.partial(paged_attention_triton, q, kc, vc, table, cu, lens, 128**-0.5,
                                 max_seqlen_q=2048, max_seqlen_k=2048)
        default = cuda_time_us(call, 20)
        print(f"{name}: default {default:.1f} us", flush=True)
        records.append(record(engine="conveyor", model=name, precision="float16", benchmark="tune_prefill_attention",
                              input_len=2048, config="default", us=default))
        for bm, bn, w, st in CONFIGS:
            tuning = AttentionTuning(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
            run = functools.partial(call, tuning=tuning)
            try:
                out = run()
                err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
                us = cuda_time_us(run, 20)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile (shared memory)
                print(f"  {bm}x{bn} w{w} s{st}: failed ({type(exc).__name__})", flush=True)
                continue
            print(f"  {bm}x{bn} w{w} s{st}: {us:8.1f} us  rel err {err:.1e}", flush=True)
            records.append(record(engine="conveyor", model=name, precision="float16",
                                  benchmark="tune_prefill_attention", input_len=2048,
                                  config=f"{bm}x{bn}_w{w}_s{st}", us=us, rel_err=err))
    print(f"saved {save(records, 'tune_prefill_attention')}")


if __name__ == "__main__":
    main()
