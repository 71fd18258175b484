"""int4 eviction test diagnostic: turn-2 tokens of the evicted and uninterrupted sessions, per
policy, dtype and prefill chunk, with token 5's top logprobs (tests/integration/test_kv_quant_real_model.py)."""
import json
import os
import sys

from conveyor import EngineConfig, GenerationConfig, pipeline

model = sys.argv[1]
dtypes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["bfloat16", "float32"]
gen = GenerationConfig(max_new_tokens=8, top_k=1, logprobs=5)
rows = []


def show(tag, r):
    lp = {int(k): round(v, 3) for k, v in r.logprobs[5].items()} if len(r.logprobs) > 5 else None
    rows.append({"case": tag, "tokens": r.token_ids, "lp5": lp})
    print(tag, r.token_ids, "token5 top:", lp, flush=True)


for dtype in dtypes:
    for policy in [0, 8, 4]:
        tiny = EngineConfig(quant_policy=policy, cache_max_entry_count=10, block_size=16, max_batch_size=8, dtype=dtype)
        with pipeline(model, tiny) as p:
            a = p.chat("Say hello.", gen_config=gen)
            b = p.chat("Count: " + "one two three " * 25, gen_config=gen)
            a = p.chat("Say goodbye.", session=a, gen_config=gen)
            show(f"{dtype} p{policy} evicted", a.response)
            a.close()
            b.close()
        for chunk in [None, 7, 13]:
            extra = {"max_prefill_token_num": chunk} if chunk else {}
            for graphs in ((True, False) if chunk is None else (True,)):
                os.environ["CONVEYOR_CUDA_GRAPHS"] = "1" if graphs else "0"
                roomy = EngineConfig(quant_policy=policy, cache_max_entry_count=256, block_size=16, dtype=dtype,
                                     **extra)
                try:
                    with pipeline(model, roomy) as p:
                        a = p.chat("Say hello.", gen_config=gen)
                        a = p.chat("Say goodbye.", session=a, gen_config=gen)
                        show(f"{dtype} p{policy} roomy chunk={chunk} graphs={graphs}", a.response)
                        a.close()
                except Exception as e:  # noqa: BLE001
                    print("failed", dtype, policy, chunk, graphs, repr(e)[:300], flush=True)
json.dump(rows, open(sys.argv[3] if len(sys.argv) > 3 else "/tmp/evict_diag.json", "w"), indent=1)
