"""A vision-language model's speed: one image per request, on random weights of a published shape
(LLaVA's: a 336-pixel square; Qwen2-VL's and Qwen2.5-VL's: ``--image-side`` pixels square at
native resolution, 448 by default: 1,024 patches, 256 tokens).

Engine side (the GPU): time to first token at batch 1 (each request a new image, so the vision
tower runs every time; the median of ``--ttft-runs``), the same with the image seen before (the
prefix cache holds its span), and output tok/s at batch ``-b`` (each request its own image).
Requests go to the engine as the tokenizer stage sends them: token ids with the image's span of
placeholder tokens and its preprocessed pixels (random values of the processor's shape).

Tokenizer side (the host's CPU): the time to decode a ``--image-size`` JPEG sent as a data URL
and run the family's transformers image processor on it, per image, one worker; with the engine's
images per second at batch ``-b`` this says how many tokenizer workers keep the engine fed.

    python -m benchmarks.bench_vlm --model llava-1.5-7b -b 32 --input-len 64 --output-len 128
    python -m benchmarks.bench_vlm --model qwen2.5-vl-7b -b 32 --input-len 64 --output-len 128
"""

from __future__ import annotations

import argparse
import base64
import io
import random
import time
from pathlib import Path
from statistics import median

import numpy as np

from benchmarks.common import default_tokenizer, random_prompt, record, run_batch, save
from conveyor.engine.config import EngineConfig
from conveyor.engine.dummy_model import served_model_dir, shape_config
from conveyor.engine.llm_engine import LLMEngine
from conveyor.protocol.multimodal import ImageInput
from conveyor.protocol.sampling import SamplingParams


def is_qwen_vl(config: dict) -> bool:
    return (config.get("architectures") or [""])[0].startswith(("Qwen2VL", "Qwen2_5_VL"))


def image_geometry(config: dict, side: int = 448) -> tuple[list[int], int, list[int]]:
    """(pixel shape, tokens, grid) of one image for the shape's vision tower. LLaVA: a square of
    the tower's image size, one token a patch (the CLS row dropped by the default strategy), no
    grid. Qwen2-VL: a ``side``-pixel square's patch rows, one token per 2 x 2 patches, the grid
    ``[1, side / 14, side / 14]``."""
    vision = config["vision_config"]
    if is_qwen_vl(config):
        patch, merge, temporal = int(vision["patch_size"]), int(vision["spatial_merge_size"]), 2
        cells = side // patch
        return [cells * cells, 3 * temporal * patch * patch], cells * cells // (merge * merge), [1, cells, cells]
    side, patch = int(vision["image_size"]), int(vision["patch_size"])
    rows = (side // patch) ** 2 + (1 if config.get("vision_feature_select_strategy") == "full" else 0)
    return [3, side, side], rows, []


def request(rng: random.Random, config: dict, image_token: int, vocab: int, input_len: int,
            seed: int, side: int = 448) -> tuple[list[int], list[ImageInput]]:
    """A prompt of ``input_len`` text tokens around one image's span, and the image (its pixels
    drawn from ``seed``: a new seed is an image the prefix cache has never seen)."""
    shape, rows, grid = image_geometry(config, side)
    pixels = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32).astype(np.float16)
    head = random_prompt(rng, input_len // 2, vocab)
    tail = random_prompt(rng, input_len - len(head), vocab)
    image = ImageInput(len(head), rows, f"bench-{seed}", pixels.tobytes(), shape, "float16", grid)
    return head + [image_token] * rows + tail, [image]


def run(engine: LLMEngine, requests: list[tuple[list[int], list[ImageInput]]], params: SamplingParams) -> dict:
    """``run_batch`` of (token ids, images) requests, without the per-request lengths."""
    r = run_batch(engine, [ids for ids, _ in requests], params, [images for _, images in requests])
    r.pop("lengths")
    return r


def preprocess_ms(config: dict, size: tuple[int, int], runs: int) -> float:
    """Median ms to decode a JPEG data URL of ``size`` and run the image processor the shape uses
    (CLIP's, or Qwen2-VL's at its published pixel limits)."""
    from PIL import Image

    from conveyor.services.tokenizer.images import ImageLimits, resolve_image

    if is_qwen_vl(config):
        from transformers import Qwen2VLImageProcessor

        processor = Qwen2VLImageProcessor()
    else:
        from transformers import CLIPImageProcessor

        side = int(config["vision_config"]["image_size"])
        processor = CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    rng = np.random.default_rng(0)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buffer, format="JPEG")
    url = "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()
    limits = ImageLimits()
    times = []
    for _ in range(runs + 1):
        t0 = time.perf_counter()
        image = resolve_image(url, limits)
        processor(images=[image], return_tensors="np")
        times.append((time.perf_counter() - t0) * 1e3)
    return median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llava-1.5-7b")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--tokenizer", default=None, help="a model directory lending its tokenizer (SmolLM2's)")
    ap.add_argument("-b", "--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64, help="text tokens around the image")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--ttft-runs", type=int, default=5)
    ap.add_argument("--image-size", default="640x480", help="the JPEG the tokenizer-side timing decodes")
    ap.add_argument("--image-side", type=int, default=448, help="Qwen2-VL: the square image's side in pixels")
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    config = shape_config(args.model)
    engine = LLMEngine(served_model_dir(args.model, Path(default_tokenizer(args.tokenizer))),
                       EngineConfig(dtype=args.dtype, load_format="dummy", enable_prefix_caching=True))
    image_token = engine.runner.model.image_token_id
    vocab = min(engine.model_config.vocab_size, image_token)  # text ids below the image token
    rng = random.Random(0)
    seeds = iter(range(1, 1 << 30))
    shape, rows, _ = image_geometry(config, args.image_side)
    common = dict(engine="conveyor", model=args.model, precision=args.dtype, input_len=args.input_len + rows,
                  image_tokens=rows, pixel_shape=shape)
    records = []
    one_token = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)

    def images(n: int) -> list:
        return [request(rng, config, image_token, vocab, args.input_len, next(seeds), args.image_side)
                for _ in range(n)]

    def texts(n: int) -> list:
        return [(random_prompt(rng, args.input_len + rows, vocab), []) for _ in range(n)]

    # Warm-up: every case once, so no Triton kernel compiles and no first call runs inside a clock
    # (the first 640-token prefill of a process took 0.9 s, the first of a batch's sizes ~1.5 s).
    seen = images(1)
    for reqs, p in ((seen, one_token), (seen, one_token), (texts(1), one_token), (images(args.batch), params),
                    (texts(args.batch), params)):
        run(engine, reqs, p)
    cases = (("new_image", lambda: images(1), "a new image each"),
             ("text_only", lambda: texts(1), "text only, the same length"),
             ("cached_image", lambda: seen, "the same image again (prefix cache)"))
    for name, make, label in cases:
        ttfts = [run(engine, make(), one_token)["ttft_ms"] for _ in range(args.ttft_runs)]
        print(f"batch 1, {label}: first token {median(ttfts):.1f} ms (median of {len(ttfts)}: "
              f"{', '.join(f'{t:.1f}' for t in ttfts)})", flush=True)
        records.append(record(benchmark=f"bench_vlm_ttft_{name}", **common, batch=1, output_len=1,
                              ttft_ms=median(ttfts), ttft_runs_ms=ttfts))
    for batch in sorted({1, args.batch}):
        for label, make in (("image", images), ("text_only", texts)):
            r = run(engine, make(batch), params)
            print(f"batch {batch}, {label}, {args.input_len}+{rows} tokens / {args.output_len}: "
                  f"{r['out_tok_s']:.1f} out tok/s, ttft {r['ttft_ms']:.1f} ms", flush=True)
            records.append(record(benchmark=f"bench_vlm_generation_{label}", **common, batch=batch,
                                  output_len=args.output_len, **r))
    width, height = (int(v) for v in args.image_size.split("x"))
    ms = preprocess_ms(config, (width, height), runs=20)
    engine_images_s = args.batch / records[-2]["wall_s"]  # the image run at batch -b
    workers = engine_images_s * ms / 1e3
    print(f"tokenizer stage: {ms:.1f} ms per {args.image_size} JPEG (decode + processor), one worker: "
          f"{1e3 / ms:.0f} images/s; the engine took {engine_images_s:.1f} images/s at batch {args.batch}: "
          f"{workers:.2f} worker(s) keep it fed", flush=True)
    records.append(record(benchmark="bench_vlm_preprocess", **common, batch=1, image_size=args.image_size,
                          preprocess_ms=ms, engine_images_s=engine_images_s, workers_needed=workers))
    out = save(records, args.name or f"bench_vlm_{args.model}")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
