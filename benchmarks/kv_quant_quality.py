"""Quality of the quantized KV cache (``quant_policy`` 8 and 4) against the model's own dtype.

    python -m benchmarks.kv_quant_quality                   # SmolLM2-135M-Instruct, fp32 weights, on the CPU
    python -m benchmarks.kv_quant_quality --model DIR --policies 0 8 4 --chunk 64

Two measures per policy, the model and everything else unchanged:

* perplexity on ``benchmarks/data/time_machine.txt`` (as ``benchmarks.quant_quality`` scores it:
  non-overlapping windows, ``pipeline.get_ppl``), with prefill chunks of at most ``--chunk``
  tokens, so that every later chunk attends to keys and values read back from the cache (each
  chunk's own keys are written to the cache, quantized, before it attends to them as well);
* the greedy answers to the real-model tests' chat prompts (``tests/integration/chat_prompts.py``),
  counted identical token for token to the unquantized cache's, with the common prefix of each pair.

The record goes to ``benchmarks/results/quality/<name>.json`` and a table is printed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.awq_chat_agreement import chat_prompts, common_prefix, greedy_answers
from benchmarks.common import commit, command_line, gpu_name
from benchmarks.quant_quality import DATA, RESULTS, perplexity, token_windows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--policies", type=int, nargs="+", default=[0, 8, 4], help="quant_policy values; 0 first")
    parser.add_argument("--text", type=Path, default=DATA)
    parser.add_argument("--window", type=int, default=1024, help="tokens per scored window")
    parser.add_argument("--chunk", type=int, default=64, help="prefill tokens per step (max_prefill_token_num)")
    parser.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="greedy answer length")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--name", default=None, help="results file name (default: <model>-kv-quant)")
    args = parser.parse_args()
    if args.policies[0] != 0:
        parser.error("--policies must start with 0: the unquantized cache is the reference")

    from transformers import AutoTokenizer

    from conveyor.default_model import fetch

    model = Path(args.model) if args.model else fetch()
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    ids = tokenizer(args.text.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    windows = token_windows(ids, args.window, args.max_tokens)
    prompts = chat_prompts()
    print(f"{args.text.name}: scoring {len(windows)} windows of {args.window} tokens in chunks of {args.chunk}; "
          f"{len(prompts)} chat prompts")

    rows: list[dict[str, Any]] = []
    for policy in args.policies:
        start = time.perf_counter()
        ppl = perplexity(model, windows, args.device, quant_policy=policy, max_prefill_token_num=args.chunk)
        answers, _ = greedy_answers(model, prompts, args.max_new_tokens, args.device, quant_policy=policy)
        rows.append({"quant_policy": policy, "ppl": ppl, "answers": answers,
                     "seconds": round(time.perf_counter() - start, 1)})
        print(f"quant_policy {policy}: ppl {ppl:.4f} ({rows[-1]['seconds']} s)")

    base = rows[0]
    for row in rows:
        row["ppl_increase"] = row["ppl"] / base["ppl"] - 1
        pairs = [(a["token_ids"], b["token_ids"]) for a, b in zip(base["answers"], row["answers"])]
        row["identical_answers"] = sum(a == b for a, b in pairs)
        row["common_prefix_tokens"] = [common_prefix(a, b) for a, b in pairs]
    record = {"benchmark": "kv_quant_quality", "model": model.name, "text": args.text.name, "window": args.window,
              "chunk": args.chunk, "scored_tokens": sum(len(w) for w in windows), "prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "device": gpu_name(), "commit": commit(),
              "command": command_line(), "results": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{args.name or model.name + '-kv-quant'}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")

    print("\n| quant_policy | ppl | over the unquantized cache | identical greedy answers |\n| --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['quant_policy']} | {row['ppl']:.3f} | {100 * row['ppl_increase']:+.2f} % | "
              f"{row['identical_answers']} / {len(prompts)} |")
    print(f"\n{out}")


if __name__ == "__main__":
    main()
