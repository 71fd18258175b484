"""Constrained decoding's cost: batch B with a JSON schema on every request against the same
batch unconstrained, in one process, alternated (free, guided, guided, free), plus the first
token's latency with a schema the engine has never compiled.

Random weights of a published shape (``--model``) with another model's tokenizer
(``--tokenizer``, a model directory: the grammar needs token strings; SmolLM2's by default).
Greedy decoding on random weights settles on a few tokens, which the schema's string fields take
until ``--output-len`` or until the output completes the schema; the free runs then generate
exactly the lengths the guided run did, request by request, so the comparison is the mask's cost
(fill on the host while the forward runs, copy, apply), not output length.

    python -m benchmarks.bench_guided --model llama2-7b -b 64 --input-len 128 --output-len 512
"""

from __future__ import annotations

import argparse
import json
import random
import uuid
from pathlib import Path
from statistics import mean

import msgspec

from benchmarks.common import default_tokenizer, random_prompt, record, run_batch, save
from conveyor.engine.config import EngineConfig
from conveyor.engine.dummy_model import served_model_dir
from conveyor.engine.llm_engine import LLMEngine
from conveyor.protocol.guided import Guide
from conveyor.protocol.sampling import SamplingParams

# A string field the output spends its tokens in (see the module docstring).
SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["title", "year", "tags"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--tokenizer", default=None, help="a model directory whose tokenizer the grammar uses")
    ap.add_argument("-b", "--batch", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2, help="free/guided pairs, alternated")
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    model_dir = served_model_dir(args.model, Path(default_tokenizer(args.tokenizer)))
    engine = LLMEngine(model_dir, EngineConfig(dtype=args.dtype, load_format="dummy"))
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [random_prompt(rng, args.input_len, vocab) for _ in range(args.batch)]
    eos = [2]  # the tokenizer's end id: the grammar's only way out once complete
    free = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    guided = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, stop_token_ids=eos,
                            guide=Guide("json_schema", json.dumps(SCHEMA, sort_keys=True)))
    run_batch(engine, prompts[:4], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    run_batch(engine, prompts[:4], SamplingParams(max_new_tokens=4, temperature=0.0, stop_token_ids=eos,
                                            guide=guided.guide))
    common = dict(engine="conveyor", model=args.model, precision=args.dtype, batch=args.batch,
                  input_len=args.input_len, output_len=args.output_len)
    records = []
    # A request whose output completes the schema ends early: the free runs generate exactly the
    # lengths the first guided run did, request by request, so both decode the same tokens.
    lengths = run_batch(engine, prompts, guided)["lengths"]
    free = [msgspec.structs.replace(free, max_new_tokens=max(n, 1)) for n in lengths]
    order = [("free", free), ("guided", guided), ("guided", guided), ("free", free)] * ((args.rounds + 1) // 2)
    for label, params in order:
        r = run_batch(engine, prompts, params)
        r.pop("lengths")
        print(f"{label:>7} batch {args.batch} {args.input_len}/{args.output_len}: {r['out_tok_s']:9.1f} tok/s "
              f"({r['out_tokens']} tokens, ttft {r['ttft_ms']:.1f} ms)", flush=True)
        records.append(record(benchmark=f"bench_guided_{label}", **common, **r))
    free_rate = mean(r["out_tok_s"] for r in records if r["benchmark"].endswith("free"))
    guided_rate = mean(r["out_tok_s"] for r in records if r["benchmark"].endswith("guided"))
    print(f"guided / free: {guided_rate / free_rate:.3f}", flush=True)

    # First token at batch 1: a schema never compiled (its own property name), the same schema
    # again (cached), and no schema.
    one = prompts[:1]
    for label in ("new_schema", "cached_schema", "no_schema"):
        if label == "new_schema":
            fresh = dict(SCHEMA, properties={**SCHEMA["properties"], f"k{uuid.uuid4().hex[:8]}": {"type": "number"}})
            params = SamplingParams(max_new_tokens=1, temperature=0.0, stop_token_ids=eos,
                                    guide=Guide("json_schema", json.dumps(fresh, sort_keys=True)))
        elif label == "no_schema":
            params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        r = run_batch(engine, one, params)
        r.pop("lengths")
        print(f"first token, {label}: {r['ttft_ms']:.1f} ms", flush=True)
        records.append(record(benchmark=f"bench_guided_ttft_{label}", **{**common, "batch": 1, "output_len": 1}, **r))
    out = save(records, args.name or f"bench_guided_{args.model}")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
