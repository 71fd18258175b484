"""Perplexity of a model and its quantizations (W4A16 AWQ, W8A8 SmoothQuant) on held-out English prose.

    python -m benchmarks.quant_quality                      # SmolLM2: fp32 and the four below (built if absent)
    python -m benchmarks.quant_quality --model DIR --quantized rtn=DIR1 awq=DIR2 --window 1024

Each model scores the same token windows of ``benchmarks/data/time_machine.txt`` (H. G. Wells;
never used for calibration) through ``conveyor.pipeline(...).get_ppl``, loaded by the engine as
it is (the quantized formats run through their own linear methods); perplexity is ``exp`` of the
token-weighted mean loss over all windows. Without ``--quantized`` the script makes, in
``--cache`` with the tools' defaults (timed): 4-bit round-to-nearest and AWQ checkpoints of
``--model`` (``conveyor lite auto_awq``, group size ``--group-size``), and W8A8 ones without and
with smoothing (``conveyor lite smooth_quant``). Results go to
``benchmarks/results/quality/<name>.json`` and a table is printed.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import commit, command_line, gpu_name

DATA = Path(__file__).resolve().parent / "data" / "time_machine.txt"
RESULTS = Path(__file__).resolve().parent / "results" / "quality"


def token_windows(token_ids: list[int], window: int, max_tokens: int | None) -> list[list[int]]:
    """Consecutive non-overlapping windows of ``window`` tokens (the last partial one dropped)."""
    ids = token_ids[:max_tokens] if max_tokens else token_ids
    return [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]


def perplexity(model_dir: str | Path, windows: list[list[int]], device: str, model_format: str | None = None,
               **engine: Any) -> float:
    """exp(token-weighted mean cross-entropy) of ``windows`` under the model at ``model_dir``
    (``engine``: more EngineConfig fields, e.g. ``quant_policy`` and ``max_prefill_token_num``)."""
    from conveyor import EngineConfig, pipeline

    window = len(windows[0])
    blocks = 2 * math.ceil(window / 64) + 2
    config = EngineConfig(session_len=window + 64, cache_max_entry_count=blocks, device=device,
                          model_format=model_format, **engine)
    with pipeline(str(model_dir), backend_config=config) as pipe:
        losses = pipe.get_ppl(windows)
    nll = sum(loss * (len(w) - 1) for loss, w in zip(losses, windows))
    return math.exp(nll / sum(len(w) - 1 for w in windows))


BUILDS = {  # name -> (tool, keyword arguments); "{g}" is the group size
    "rtn-g{g}": ("auto_awq", {"search_scale": False}),
    "awq-g{g}": ("auto_awq", {"search_scale": True}),
    "w8a8-nosmooth": ("smooth_quant", {"smooth": False}),
    "w8a8-smooth": ("smooth_quant", {"smooth": True}),
}


def build(model: Path, cache: Path, name: str, group_size: int) -> tuple[Path, float | None]:
    """The checkpoint ``name`` of BUILDS for ``model`` in ``cache``, made with the CLI defaults (and its
    build time, or None when it was already there)."""
    from conveyor import lite

    tool, kwargs = BUILDS[name]
    out = cache / f"{model.name}-{name.format(g=group_size)}"
    if (out / "config.json").exists():
        return out, None
    if tool == "auto_awq":
        kwargs = {**kwargs, "w_group_size": group_size}
    result = getattr(lite, tool)(model, out, **kwargs)
    return out, result.seconds


def loaded_as(model_dir: Path) -> str:
    """The format the engine runs a directory in: hf, awq or smooth_quant."""
    from conveyor.engine.model_config import ModelConfig
    from conveyor.engine.quant_format import resolve_quant_format

    fmt = resolve_quant_format(ModelConfig.from_pretrained(model_dir), None)
    return fmt.model_format if fmt else "hf"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="the unquantized model directory (default: SmolLM2-135M)")
    parser.add_argument("--quantized", nargs="*", default=None, metavar="NAME=DIR",
                        help="quantized checkpoints to score (default: build rtn and awq ones in --cache)")
    parser.add_argument("--text", type=Path, default=DATA, help="held-out text (never a calibration text)")
    parser.add_argument("--window", type=int, default=1024, help="tokens per scored window")
    parser.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens")
    parser.add_argument("--group-size", type=int, default=64, help="group size of the checkpoints it builds")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "conveyor-quant-quality")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--name", default=None, help="results file name (default: <model>-g<group size>)")
    args = parser.parse_args()

    from conveyor.default_model import fetch

    model = Path(args.model) if args.model else fetch()
    args.cache.mkdir(parents=True, exist_ok=True)
    build_seconds: dict[str, float | None] = {}
    if args.quantized is None:
        quantized = {}
        for name in BUILDS:
            key = name.format(g=args.group_size)
            quantized[key], build_seconds[key] = build(model, args.cache, name, args.group_size)
    else:
        quantized = {k: Path(v) for k, v in (item.split("=", 1) for item in args.quantized)}

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    ids = tokenizer(args.text.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    windows = token_windows(ids, args.window, args.max_tokens)
    scored = sum(len(w) for w in windows)
    print(f"{args.text.name}: {len(ids)} tokens; scoring {len(windows)} windows of {args.window} ({scored} tokens)")

    rows: list[dict[str, Any]] = []
    for name, path in {"fp32": model, **quantized}.items():
        start = time.perf_counter()
        ppl = perplexity(Path(path), windows, args.device)
        rows.append({"model": name, "path": str(path), "loaded_as": loaded_as(Path(path)), "ppl": ppl,
                     "eval_seconds": round(time.perf_counter() - start, 1),
                     "quantize_seconds": build_seconds.get(name)})
        print(f"{name:>10}: ppl {ppl:.4f}")

    base = rows[0]["ppl"]
    for row in rows:
        row["ppl_increase"] = row["ppl"] / base - 1
    increases = {r["model"]: r["ppl_increase"] for r in rows[1:]}
    rtn_key = next((k for k in increases if k.startswith("rtn")), None)
    awq_key = next((k for k in increases if k.startswith("awq")), None)
    ratio = increases[awq_key] / increases[rtn_key] if rtn_key and awq_key and increases[rtn_key] > 0 else None
    record = {"benchmark": "quant_quality", "model": model.name, "text": args.text.name, "text_tokens": len(ids),
              "window": args.window, "windows": len(windows), "scored_tokens": scored, "device": gpu_name(),
              "commit": commit(), "command": command_line(), "results": rows, "awq_over_rtn_increase": ratio}
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = args.name or f"{model.name}-g{args.group_size}"
    (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")

    print("\n| model | ppl | increase over fp32 | loaded as | quantize s |\n| --- | --- | --- | --- | --- |")
    for row in rows:
        secs = "" if row["quantize_seconds"] is None else f"{row['quantize_seconds']:.0f}"
        print(f"| {row['model']} | {row['ppl']:.3f} | {100 * row['ppl_increase']:+.1f} % | {row['loaded_as']} "
              f"| {secs} |")
    if ratio is not None:
        print(f"\nAWQ's perplexity increase is {ratio:.2f}x RTN's ({RESULTS / f'{name}.json'})")


if __name__ == "__main__":
    main()
