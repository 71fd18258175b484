"""Emulation (CPU reference path): would an exact first-token value (the attention sink) close
int8's greedy-answer gap? Dev prompts and a dev text only (not the tests' prompts, not time_machine).

    PYTHONPATH=. python benchmarks/results/quality/s14_sink_value_emulation.py MODEL_DIR DEV_TEXT 12288

DEV_TEXT here: /usr/share/common-licenses/GPL-3 then GFDL-1.3, concatenated."""
import json
import sys
import time

import torch

from benchmarks.awq_chat_agreement import common_prefix, greedy_answers
from benchmarks.quant_quality import perplexity, token_windows
from conveyor.kernels.attention import launch as A  # the dispatcher's module
from conveyor.kernels.attention import reference as AR
from conveyor.kernels import kv_cache as KC
from conveyor.kernels import kv_quant as KQ

EXACT = {}  # id(v_cache) -> float tensor [slots, Hkv, D]
MODE = {"sink": False}
_orig_store = KC.store_kv_ref


def store(k, v, k_cache, v_cache, slot_mapping, k_scales=None, v_scales=None, key_shifts=None):
    _orig_store(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales, key_shifts)
    if k_scales is None:
        return
    key = id(v_cache)
    if key not in EXACT:
        EXACT[key] = torch.zeros(v_cache.shape[0] * v_cache.shape[1], *v_cache.shape[2:3], k.shape[-1])
    keep = slot_mapping >= 0
    EXACT[key][slot_mapping[keep].long()] = v[keep].float()


_orig_deq = KQ.dequantize_kv_ref
_orig_attn = A.paged_attention_ref
_orig_gather = AR.gather_kv_ref
CTX = {}
CALLS = {"patched": 0}


def attn(q, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k, scale, k_scales=None, v_scales=None,
         key_centres=None):
    if not (MODE["sink"] and k_scales is not None):
        return _orig_attn(q, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k, scale, k_scales, v_scales,
                          key_centres)
    # Per sequence: its values' position 0 read exact instead of dequantized.
    out = torch.empty_like(q)
    bs = k_cache.shape[1]
    for b in range(len(seqlens_k)):
        sl = slice(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]))
        if sl.stop == sl.start:
            continue
        CTX.update(first_slot=int(block_tables[b, 0]) * bs, exact=EXACT[id(v_cache)], v_scales=v_scales)
        out[sl] = _orig_attn(q[sl], k_cache, v_cache, block_tables[b:b + 1], cu_seqlens_q[b:b + 2] - cu_seqlens_q[b],
                             seqlens_k[b:b + 1], scale, k_scales, v_scales, key_centres)
    CTX.clear()
    return out


def gather(cache, block_table, length):
    x = _orig_gather(cache, block_table, length)
    if CTX and cache is CTX["v_scales"]:
        CTX["pending"] = True  # the values' dequantize comes next (paged_attention_ref's order)
    return x


def deq2(codes, scales, bits):
    x = _orig_deq(codes, scales, bits)
    if CTX.get("pending"):
        CTX["pending"] = False
        x = x.clone()
        x[0] = CTX["exact"][CTX["first_slot"]]
        CALLS["patched"] += 1
    return x


KC.store_kv_ref = store
A.paged_attention_ref = attn
AR.gather_kv_ref = gather
AR.dequantize_kv_ref = deq2

from pathlib import Path  # noqa: E402

from transformers import AutoTokenizer  # noqa: E402

model = Path(sys.argv[1])
text = Path(sys.argv[2]).read_text()
tok = AutoTokenizer.from_pretrained(str(model))
ids = tok(text, add_special_tokens=False)["input_ids"]
windows = token_windows(ids, 1024, int(sys.argv[3]) if len(sys.argv) > 3 else None)
PROMPTS = [
    "Name a famous painting and its painter.", "What does a thermometer measure?", "Give me a synonym for happy.",
    "How many legs does a spider have?", "Write one sentence about autumn leaves.", "What is the boiling point of water?",
    "Suggest a name for a pet goldfish.", "Why do birds migrate?", "Translate 'good morning' into Spanish.",
    "What is photosynthesis, briefly?", "Describe a rainbow in a few words.", "What is 12 times 12?",
    "Recommend a book for a long train ride.", "Explain gravity to a child.", "What is the largest ocean?",
    "List two uses of a paperclip.", "Who wrote Romeo and Juliet?", "Give a tip for staying focused.",
    "What color do you get by mixing blue and yellow?", "Write a short greeting for a birthday card.",
]
rows = {}
for name, policy, sink in (("fp32", 0, False), ("int8", 8, False), ("int8+sinkV", 8, True),
                           ("int4", 4, False), ("int4+sinkV", 4, True)):
    MODE["sink"] = sink
    EXACT.clear()
    t = time.time()
    ppl = perplexity(model, windows, "cpu", quant_policy=policy, max_prefill_token_num=64)
    EXACT.clear()
    ans, _ = greedy_answers(model, PROMPTS, 64, "cpu", quant_policy=policy)
    rows[name] = {"ppl": ppl, "tokens": [a["token_ids"] for a in ans]}
    base = rows["fp32"]
    same = sum(a == b for a, b in zip(base["tokens"], rows[name]["tokens"]))
    pref = sum(common_prefix(a, b) for a, b in zip(base["tokens"], rows[name]["tokens"]))
    print(CALLS, end=" ")
    print(f"{name}: ppl {ppl:.4f} ({(ppl / base['ppl'] - 1) * 100:+.3f}%), identical {same}/20, common prefix {pref},"
          f" {time.time() - t:.0f}s", flush=True)
json.dump(rows, open("/tmp/sink_value.json", "w"))
