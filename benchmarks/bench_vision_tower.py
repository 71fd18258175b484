"""A vision-language model's tower alone: ms to encode B images (``encode_images``: tower and
projector), on random weights of a published shape, for each B of ``--images``.

Each batch size is timed on its first call (what a step with a new image count pays: cuDNN and
SDPA choose or build their kernels then) and as the median of ``--runs`` calls after it. Run it
for two trees in one device call to compare them (``PYTHONPATH`` picks the tree's package; the
record's ``commit`` is ``$CONVEYOR_COMMIT``).

    python -m benchmarks.bench_vision_tower --model llava-1.5-7b --images 1 8 32
    python -m benchmarks.bench_vision_tower --model qwen2.5-vl-7b --images 1 8 32 --profile

Images are the shapes ``bench_vlm`` sends (LLaVA's square; Qwen2-VL's ``--image-side`` square of
patches with its grid). ``--profile`` prints the largest batch's top CUDA ops.
"""

from __future__ import annotations

import argparse
import time
from statistics import median

import torch

from benchmarks.bench_vlm import image_geometry
from benchmarks.common import record, save
from conveyor.engine.dummy_model import shape_config
from conveyor.engine.model_config import ModelConfig
from conveyor.engine.model_runner import init_dummy_weights
from conveyor.engine.models import build_model


def encode_ms(model, pixels: torch.Tensor, grids: list[list[int]]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.encode_images(pixels, grids)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llava-1.5-7b")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--images", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--image-side", type=int, default=448, help="Qwen2-VL: the square image's side in pixels")
    ap.add_argument("--profile", action="store_true", help="print the largest batch's top CUDA ops")
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    config = shape_config(args.model)
    dtype = getattr(torch, args.dtype)
    model = build_model(ModelConfig.from_dict(config), dtype=dtype, device="cuda")
    init_dummy_weights(model)
    shape, rows, grid = image_geometry(config, args.image_side)
    records = []
    for n in args.images:
        pixels = torch.randn(n, *shape, device="cuda", dtype=dtype)
        grids = [grid] * n
        first = encode_ms(model, pixels, grids)
        steady = median(encode_ms(model, pixels, grids) for _ in range(args.runs))
        print(f"{n:3d} images: first call {first:8.1f} ms, then {steady:7.2f} ms ({steady / n:.2f} ms an image)",
              flush=True)
        records.append(record(benchmark="bench_vision_tower", engine="conveyor", model=args.model, precision=args.dtype,
                              batch=n, input_len=None, output_len=None, first_call_ms=first, encode_ms=steady,
                              ms_per_image=steady / n, image_tokens=rows, pixel_shape=shape))
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            encode_ms(model, pixels, grids)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    out = save(records, args.name or f"bench_vision_tower_{args.model}")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
