"""The quantized KV cache's kernels against the 16-bit cache's, on Llama-2-7B decode shapes.

    python -m benchmarks.bench_kv_quant [--batch 64] [--context 512]
    python -m benchmarks.bench_kv_quant --variants 'a=52,64,4' 'b=52,128,4,2' [--before] [--check]

Times (CUDA events, median of many launches) the decode attention kernel over a cache of
``--batch`` sequences of ``--context`` tokens, and the fused rotary + cache write of one decode
step, for quant_policy 0 / 8 / 4; for the quantized caches with the scales laid out
token-major ([blocks, block_size, heads, 2], as allocated before) and head-major (each head's
scales of a block contiguous). Prints µs and the effective read bandwidth of the attention.

``--variants`` times launch variants of the quantized decode kernel instead, each
``label=tune,block_n,num_warps,num_stages,maxnreg,simt`` (fields of ``AttentionTuning``,
simt 1: the CUDA-core walk, 2: the tensor-core walk; a missing or 0 field keeps the default,
``label=`` is the default launch; tune is the kernel's TUNE
bits, ``policy.VARIANT_BITS``, turned into the named variant flags), timed back to back (the
kernel's own time) and one call at a time (``eager``, as the policy rows). ``--before`` adds the
kernel of an older checkout copied to ``kernels/_attention_before.py`` (not committed), ``--check``
compares each variant's output with the torch reference on the first sequences, and
``--profile LABEL[,LABEL]`` only launches those variants twice each (for ncu).
"""

from __future__ import annotations

import argparse
import importlib

import torch

from benchmarks.common import cuda_time_us, record, save
from conveyor.kernels.attention import AttentionTuning, paged_attention, paged_attention_ref, paged_attention_triton
from conveyor.kernels.attention.policy import VARIANT_BITS
from conveyor.kernels.kv_cache import rotate_and_store_kv
from conveyor.kernels.kv_layout import KVCacheLayout

_VARIANT_KEYS = ("tune", "block_n", "num_warps", "num_stages", "maxnreg", "simt")


def parse_variant(spec: str) -> tuple[str, dict[str, int]]:
    """``label=tune,block_n,...`` -> (label, the ``AttentionTuning`` fields it sets, the TUNE bits as
    given under ``tune``); ``label=before`` -> the old kernel."""
    label, _, fields = spec.partition("=")
    if fields == "before":
        return label, {"before": 1}
    values = fields.split(",") if fields else []
    # An empty field keeps the launcher's default; so does 0, except for tune (0: no TUNE bit).
    kw = {k: int(v) for k, v in zip(_VARIANT_KEYS, values) if v and (int(v) or k == "tune")}
    if "simt" in kw:
        kw["simt"] = kw["simt"] == 1
    return label, kw


def tuning(kw: dict[str, int]) -> AttentionTuning:
    """The launch a parsed variant asks for: its TUNE bits as the named variant flags."""
    fields = {k: v for k, v in kw.items() if k != "tune"}
    if "tune" in kw:
        fields.update({name: bool(kw["tune"] & bit) for name, bit in VARIANT_BITS.items()})
    return AttentionTuning(**fields)


def make_cache(policy: int, blocks: int, bs: int, hkv: int, d: int, dt: torch.dtype, head_major: bool = False):
    """Random codes (or values) and scales for one cache: zeros in [-1, 0), scales 0.01."""
    layout = KVCacheLayout(policy, d)
    out = []
    for _ in range(2):
        c, s = layout.allocate((blocks, bs, hkv), dt, "cuda")
        if head_major and s is not None:  # same shape, each head's block of scales contiguous
            s = torch.zeros(blocks, hkv, bs, 2, device="cuda", dtype=s.dtype).transpose(1, 2)
        if policy:
            c.random_(0, 256)
            s[..., 0].fill_(0.01)
            s[..., 1].uniform_(-1, 0)
        else:
            c.normal_()
        out += [c, s]
    return out  # kc, ks, vc, vs


def run_variants(args: argparse.Namespace, q, tables, cu, lens, blocks: int) -> list[dict]:
    b, ctx, hkv, d, bs = args.batch, args.context, args.kv_heads, args.head_dim, args.block_size
    variants = [parse_variant(v) for v in args.variants]
    if args.before:
        variants.insert(0, ("before", {"before": 1}))
    before = importlib.import_module("conveyor.kernels._attention_before") if any(
        "before" in kw for _, kw in variants) else None
    records = []
    for policy in args.policies:
        kc, ks, vc, vs = make_cache(policy, blocks, bs, hkv, d, q.dtype)
        kv_bytes = 2 * b * ctx * hkv * KVCacheLayout(policy, d).bytes_per_head(q.dtype)
        ref = None
        if args.check:
            n = 4
            ref = paged_attention_ref(q[:n].float(), kc, vc, tables[:n], cu[: n + 1], lens[:n], d**-0.5,
                                      ks, vs).to(q.dtype)
        for label, kw in variants:
            if args.profile and label not in args.profile.split(","):
                continue
            if "before" in kw:
                def attn():
                    return before.paged_attention_triton(q, kc, vc, tables, cu, lens, d**-0.5, max_seqlen_q=1,
                                                         max_seqlen_k=4096, k_scales=ks, v_scales=vs)
            else:
                def attn(kw=kw):
                    return paged_attention_triton(q, kc, vc, tables, cu, lens, d**-0.5, max_seqlen_q=1,
                                                  max_seqlen_k=4096, k_scales=ks, v_scales=vs, tuning=tuning(kw))
            if args.profile:
                for _ in range(2):
                    attn()
                torch.cuda.synchronize()
                continue
            err = None
            if ref is not None:
                err = (attn()[:4].float() - ref.float()).abs().max().item()
            us = cuda_time_us(attn, 5, calls=20)  # the kernels' own time, launches overlapped
            eager = cuda_time_us(attn, 20)
            print(f"p{policy} {label:>12}: attention {us:8.1f} us ({kv_bytes / us / 1e3:7.0f} GB/s of KV), "
                  f"eager {eager:8.1f} us" + (f", max err {err:.2e}" if err is not None else ""), flush=True)
            records.append(record(engine="conveyor", benchmark="bench_kv_quant", model="llama2-7b-layer",
                                  batch=b, input_len=ctx, quant_policy=policy, layout=label, attention_us=us,
                                  eager_us=eager, kv_gb_s=kv_bytes / us / 1e3, variant=kw, max_err=err))
    return records


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--variants", nargs="*", default=[])
    ap.add_argument("--policies", type=int, nargs="*", default=[8, 4])
    ap.add_argument("--before", action="store_true")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--profile", default="")
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
    if args.variants or args.before or args.profile:
        records = run_variants(args, q, tables, cu, lens, blocks)
        if not args.profile:
            print(f"saved {save(records, args.name)}")
        return
    records = []
    for policy in (0, 8, 4):
        for head_major in ((False,) if policy == 0 else (False, True)):
            layout = KVCacheLayout(policy, d)
            kc, ks, vc, vs = make_cache(policy, blocks, bs, hkv, d, dt, head_major)
            attn = lambda: paged_attention(q, kc, vc, tables, cu, lens, d**-0.5, max_seqlen_q=1,
                                           max_seqlen_k=4096, k_scales=ks, v_scales=vs)
            us = cuda_time_us(attn, 50)
            kv_bytes = 2 * b * ctx * hkv * layout.bytes_per_head(dt)
            qkv = torch.randn(b, (h + 2 * hkv) * d, device=dev, dtype=dt)
            qq, kk, vv = qkv.split([h * d, hkv * d, hkv * d], -1)
            qq, kk, vv = qq.view(b, h, d), kk.view(b, hkv, d), vv.view(b, hkv, d)
            pos = torch.full((b,), ctx, device=dev, dtype=torch.int64)
            cs = torch.randn(8192, d, device=dev, dtype=torch.float32)
            slots = (tables[:, -1].long() * bs + (ctx % bs))
            store = lambda: rotate_and_store_kv(qq, kk, vv, pos, cs, kc, vc, slots, ks, vs)
            store_us = cuda_time_us(store, 50)
            label = f"p{policy}" + ("_headmajor" if head_major else "")
            print(f"{label:>14}: attention {us:8.1f} us ({kv_bytes / us / 1e3:7.0f} GB/s of KV), "
                  f"rotate+store {store_us:6.1f} us", flush=True)
            records.append(record(engine="conveyor", benchmark="bench_kv_quant", model="llama2-7b-layer",
                                  batch=b, input_len=ctx, quant_policy=policy, layout=label, attention_us=us,
                                  kv_gb_s=kv_bytes / us / 1e3, store_us=store_us))
    print(f"saved {save(records, args.name)}")


if __name__ == "__main__":
    main()
