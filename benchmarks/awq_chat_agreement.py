"""How often an AWQ checkpoint's greedy chat answers stay those of the unquantized model.

    python -m benchmarks.awq_chat_agreement                  # SmolLM2 fp32 vs AWQ g64 quantized into a temp dir
    python -m benchmarks.awq_chat_agreement --awq DIR        # an existing AWQ checkpoint of --model

Both models answer the chat prompts of the real-model tests (``tests/integration/chat_prompts.py``)
greedily through ``conveyor.pipeline``, up to ``--max-new-tokens``. The script counts the
answers that are identical token for token and measures how long each pair agrees from the
start (the common prefix, in tokens). The record, with both answers of every prompt, goes to
``benchmarks/results/<device>/awq_chat_agreement.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, commit, command_line, gpu_name, results_subdir

PROMPTS_FILE = Path(__file__).resolve().parents[1] / "tests" / "integration"


def chat_prompts() -> list[str]:
    """The real-model tests' chat prompts, as they are."""
    sys.path.insert(0, str(PROMPTS_FILE))
    try:
        from chat_prompts import PROMPTS
    finally:
        sys.path.remove(str(PROMPTS_FILE))
    return list(PROMPTS)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def greedy_answers(model_dir: Path, prompts: list[str], max_new_tokens: int, device: str,
                   **engine: Any) -> tuple[list[dict], float]:
    """Each prompt's greedy answer (text, token ids, finish reason) from ``model_dir``, and the
    seconds taken (``engine``: more EngineConfig fields, e.g. ``quant_policy``)."""
    from conveyor import EngineConfig, GenerationConfig, pipeline

    config = EngineConfig(session_len=512, cache_max_entry_count=64, block_size=16, device=device, **engine)
    gen = GenerationConfig(max_new_tokens=max_new_tokens, top_k=1)
    start = time.perf_counter()
    with pipeline(str(model_dir), backend_config=config) as pipe:
        # One prompt at a time: the answers do not depend on what else is in the batch.
        responses = [pipe([{"role": "user", "content": p}], gen) for p in prompts]
    seconds = time.perf_counter() - start
    return [{"text": r.text, "token_ids": list(r.token_ids), "finish_reason": r.finish_reason}
            for r in responses], seconds


def quantize(model: Path, out: Path, group_size: int) -> float:
    """Write an AWQ checkpoint of ``model`` with ``lite auto_awq``'s default calibration; the seconds taken."""
    from conveyor.lite import auto_awq

    return auto_awq(model, out, w_group_size=group_size, progress=False).seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="the unquantized model (default: SmolLM2-135M)")
    parser.add_argument("--awq", type=Path, default=None,
                        help="an AWQ checkpoint of --model (default: quantize one into a temp dir)")
    parser.add_argument("--group-size", type=int, default=64, help="group size when quantizing (128 does not fit)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--name", default="awq_chat_agreement", help="results file name, without .json")
    args = parser.parse_args()

    from conveyor.default_model import fetch

    model = args.model or fetch()
    prompts = chat_prompts()
    quantize_seconds = None
    with tempfile.TemporaryDirectory(prefix="awq-agreement-") as scratch:
        awq = args.awq
        if awq is None:
            awq = Path(scratch) / f"{model.name}-awq-g{args.group_size}"
            print(f"quantizing {model} into {awq} (group size {args.group_size}, default calibration)")
            quantize_seconds = quantize(model, awq, args.group_size)
            print(f"quantized in {quantize_seconds:.0f} s")
        base, base_s = greedy_answers(model, prompts, args.max_new_tokens, args.device)
        quant, quant_s = greedy_answers(awq, prompts, args.max_new_tokens, args.device)
        quant_config = json.loads((awq / "config.json").read_text()).get("quantization_config")

    rows: list[dict[str, Any]] = []
    for prompt, a, b in zip(prompts, base, quant):
        rows.append({"prompt": prompt, "identical": a["token_ids"] == b["token_ids"],
                     "common_prefix": common_prefix(a["token_ids"], b["token_ids"]), "fp32": a, "awq": b})
    identical = sum(r["identical"] for r in rows)
    mean_prefix = sum(r["common_prefix"] for r in rows) / len(rows)
    record = {"benchmark": "awq_chat_agreement", "model": model.name, "awq": str(args.awq) if args.awq else None,
              "quantization_config": quant_config, "calibration": "default" if args.awq is None else "given",
              "quantize_seconds": quantize_seconds, "max_new_tokens": args.max_new_tokens, "device": gpu_name(),
              "prompts": len(rows), "identical": identical, "mean_common_prefix": mean_prefix,
              "generate_seconds": {"fp32": round(base_s, 1), "awq": round(quant_s, 1)},
              "commit": commit(), "command": command_line(), "answers": rows}
    out_dir = RESULTS_DIR / results_subdir()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{args.name}.json"
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")

    print("\n| prompt | identical | common prefix | fp32 tokens | awq tokens |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['prompt']} | {'yes' if r['identical'] else 'no'} | {r['common_prefix']} "
              f"| {len(r['fp32']['token_ids'])} | {len(r['awq']['token_ids'])} |")
    print(f"\n{identical}/{len(rows)} answers identical token for token; mean common prefix "
          f"{mean_prefix:.1f} tokens (max {args.max_new_tokens}); record in {path}")


if __name__ == "__main__":
    main()
