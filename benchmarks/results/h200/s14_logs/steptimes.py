"""Step times of the kv-quant eviction test's tiny engine (float32, int4) on first use."""
import sys
import time

from transformers import AutoTokenizer

from conveyor import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.protocol import SamplingParams

model = sys.argv[1]
tok = AutoTokenizer.from_pretrained(model)
prompts = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain what a prime number is in one sentence.", "List three colors.", "How do I reverse a list in Python?"]
for policy in (4, 8):
    eng = LLMEngine(model, EngineConfig(quant_policy=policy, dtype="float32", cache_max_entry_count=10, block_size=16,
                                        max_batch_size=8))
    for p in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False)
        ids = ids["input_ids"] if isinstance(ids, dict) else ids
        eng.add_request(list(ids), SamplingParams(max_new_tokens=24, temperature=0.0))
    times = []
    while eng.has_work:
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    print(f"policy {policy}: {len(times)} steps, longest {sorted(times)[-5:]}, first 5 {times[:5]}", flush=True)
    eng.close()
