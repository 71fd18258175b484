"""``conveyor lite``: model compression tools shaped like ``lmdeploy lite``.

    conveyor lite auto_awq [MODEL] --work-dir DIR [--calib-dataset FILE] [--calib-samples 128]
        [--calib-seqlen 512] [--w-bits 4] [--w-group-size 128|64|32] [--search-scale [BOOL] | --no-search-scale]
        [--batch-size 1] [--device auto] [--dtype auto]

writes a 4-bit AWQ checkpoint in AutoAWQ's "gemm" layout. Unlike LMDeploy, ``--search-scale`` is
on by default (the AWQ search with clipping); ``--no-search-scale`` is plain round-to-nearest
with no calibration at all. Without ``--w-group-size`` the group size is the largest of 128, 64
and 32 that divides every layer's input width (LMDeploy's 128 where it fits; SmolLM2's 576 takes 64).

    conveyor lite smooth_quant [MODEL] --work-dir DIR [--calib-dataset FILE] [--calib-samples 128]
        [--calib-seqlen 512] [--w-bits 8] [--alpha 0.5] [--smooth | --no-smooth]
        [--batch-size 1] [--device auto] [--dtype auto]

writes a W8A8 checkpoint (SmoothQuant smoothing, int8 weights per channel, int8 activations per
token at run time) in compressed-tensors' int8 layout. Without ``--calib-dataset`` both tools
calibrate on the public-domain novel shipped in ``conveyor/data/`` (see its PROVENANCE.md).

MODEL is a Hugging Face model directory; left out, or named as the default model
(``SmolLM2-135M-Instruct``, ``HuggingFaceTB/SmolLM2-135M-Instruct``), it is the default model,
fetched once and cached, as every other command reads it (``conveyor/default_model.py``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path

DEFAULT_CALIB_DATASET = Path(__file__).resolve().parent / "data" / "frankenstein.txt"
DEFAULT_GROUP_SIZE = 128  # LMDeploy's, taken where it divides the model's widths (fitting_group_size)


def auto_awq(model: str | Path | None = None, work_dir: str | Path = "./work_dir",
             calib_dataset: str | Path | None = None, calib_samples: int = 128, calib_seqlen: int = 512,
             w_bits: int = 4, w_group_size: int | None = None, search_scale: bool = True, batch_size: int = 1,
             device: str = "auto", dtype: str = "auto", progress: bool = True):
    """Quantize a Hugging Face model directory (None or the default model's name: the default
    model) to 4-bit AWQ in ``work_dir`` (LMDeploy's ``lite.auto_awq``). ``w_group_size`` None: the
    largest supported group size that divides the model's layer widths.

    Returns the run's ``AwqResult``; raises ``QuantizationError`` (before doing any work) when a
    setting does not fit the model, the work directory is not empty, or the dataset is unusable.
    """
    from conveyor.engine.quantization import AwqConfig
    from conveyor.engine.quantization import auto_awq as run

    _refuse_unused_dataset(calib_dataset, search_scale, "--search-scale False is round-to-nearest here, which "
                           "calibrates on nothing (LMDeploy's False still calibrates a fixed-ratio smoothing)")
    # The flags are checked before the default model may be fetched (a minute); the group size, once it is here.
    config = AwqConfig(w_bits=w_bits, w_group_size=DEFAULT_GROUP_SIZE if w_group_size is None else w_group_size,
                       search_scale=search_scale, calib_samples=calib_samples, calib_seqlen=calib_seqlen,
                       batch_size=batch_size)
    model = _model_dir(model)
    if w_group_size is None:
        config = replace(config, w_group_size=fitting_group_size(model))
    dataset = calib_dataset if calib_dataset is not None else DEFAULT_CALIB_DATASET
    return run(model, work_dir, config, dataset if search_scale else None, device=device, dtype=dtype,
               progress=progress)


def smooth_quant(model: str | Path | None = None, work_dir: str | Path = "./work_dir",
                 calib_dataset: str | Path | None = None, calib_samples: int = 128, calib_seqlen: int = 512,
                 w_bits: int = 8, alpha: float = 0.5, smooth: bool = True, batch_size: int = 1,
                 device: str = "auto", dtype: str = "auto", progress: bool = True):
    """Quantize a Hugging Face model directory (None or the default model's name: the default
    model) to W8A8 with SmoothQuant in ``work_dir`` (LMDeploy's ``lite.smooth_quant``). Returns
    the run's ``SmoothQuantResult``; raises ``QuantizationError`` (before doing any work) for a bad
    setting, a non-empty work directory or an unusable dataset."""
    from conveyor.engine.quantization import SmoothQuantConfig
    from conveyor.engine.quantization import smooth_quant as run

    _refuse_unused_dataset(calib_dataset, smooth, "--no-smooth calibrates on nothing")
    config = SmoothQuantConfig(w_bits=w_bits, alpha=alpha, smooth=smooth, calib_samples=calib_samples,
                               calib_seqlen=calib_seqlen, batch_size=batch_size)
    dataset = calib_dataset if calib_dataset is not None else DEFAULT_CALIB_DATASET
    return run(_model_dir(model), work_dir, config, dataset if smooth else None, device=device, dtype=dtype,
               progress=progress)


def _model_dir(model: str | Path | None) -> str:
    """``model``, or the cached default model's directory when it is None or names it (as every
    command reads MODEL; fetched on first use)."""
    from conveyor.default_model import local_path

    return local_path(None if model is None else str(model))


def fitting_group_size(model_dir: str | Path) -> int:
    """The largest supported AWQ group size dividing every quantized layer's input width of the
    model in ``model_dir`` (``DEFAULT_GROUP_SIZE`` where it fits). None fits: ``DEFAULT_GROUP_SIZE``,
    for the run's check to refuse with the reason."""
    from conveyor.engine.quantization import AwqConfig, QuantizationError
    from conveyor.engine.quantization.calibration import checked_model_dir
    from conveyor.engine.quantization.config import SUPPORTED_GROUP_SIZES

    _, hf_config = checked_model_dir(model_dir, "auto_awq")
    for size in sorted(SUPPORTED_GROUP_SIZES, reverse=True):
        try:
            AwqConfig(w_group_size=size).check_model(hf_config)
        except QuantizationError:
            continue
        return size
    return DEFAULT_GROUP_SIZE


def _refuse_unused_dataset(calib_dataset: str | Path | None, calibrates: bool, why: str) -> None:
    """A dataset given to a run that calibrates on nothing would be silently unused: refuse it."""
    from conveyor.engine.quantization import QuantizationError

    if calib_dataset is not None and not calibrates:
        raise QuantizationError(f"--calib-dataset {calib_dataset} would be unused: {why}; leave out one of them")


def _boolean(text: str) -> bool:
    """A flag's value as LMDeploy's docs write it (``--search-scale False``)."""
    value = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r}: give True or False")
    return value


def _run_tool(name: str, args: argparse.Namespace, call) -> int:
    """Run a tool: exit 0, or 2 with a one-line reason for a bad setting."""
    from conveyor.engine.quantization import QuantizationError

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        result = call()
    except QuantizationError as exc:
        print(f"conveyor lite {name}: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {result.work_dir} in {result.seconds:.0f} s", file=sys.stderr)
    return 0


def _cmd_smooth_quant(args: argparse.Namespace) -> int:
    return _run_tool("smooth_quant", args, lambda: smooth_quant(
        args.model, args.work_dir, args.calib_dataset, args.calib_samples, args.calib_seqlen, args.w_bits,
        args.alpha, args.smooth, args.batch_size, args.device, args.dtype))


def _cmd_auto_awq(args: argparse.Namespace) -> int:
    """The ``lite auto_awq`` handler: exit 0, or 2 with a one-line reason for a bad setting."""
    return _run_tool("auto_awq", args, lambda: auto_awq(
        args.model, args.work_dir, args.calib_dataset, args.calib_samples, args.calib_seqlen, args.w_bits,
        args.w_group_size, args.search_scale, args.batch_size, args.device, args.dtype))


def add_lite_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``conveyor lite`` and its subcommands on the top-level parser's subparsers."""
    lite = sub.add_parser("lite", help="compress a model (weight quantization)")
    lite_sub = lite.add_subparsers(dest="lite_command", metavar="LITE_COMMAND", required=True)
    p = lite_sub.add_parser(
        "auto_awq", help="4-bit AWQ weight quantization into an AutoAWQ 'gemm' checkpoint",
        description="Quantize a Hugging Face model's linear layers to 4 bits with AWQ (activation-aware scales "
                    "and clipping searched on calibration text) and write an AutoAWQ 'gemm' checkpoint.")
    _common_arguments(p)
    p.add_argument("--w-bits", type=int, default=4, help="weight bits (only 4)")
    p.add_argument("--w-group-size", type=int, default=None,
                   help="input channels per quantization group: 32, 64 or 128, dividing every layer's input size "
                        "(default: the largest that does; 128 where it fits, 64 for SmolLM2's 576)")
    p.add_argument("--search-scale", type=_boolean, nargs="?", const=True, default=True, metavar="BOOL",
                   help="search AWQ scales and clipping (default); --search-scale False or --no-search-scale: "
                        "round-to-nearest, no calibration (LMDeploy's False still smooths at a fixed ratio)")
    p.add_argument("--no-search-scale", dest="search_scale", action="store_false", help="round-to-nearest only")
    _run_arguments(p)
    p.set_defaults(func=_cmd_auto_awq)
    p = lite_sub.add_parser(
        "smooth_quant", help="W8A8 (SmoothQuant) quantization into a compressed-tensors int8 checkpoint",
        description="Smooth a Hugging Face model's activation outliers into its weights (SmoothQuant, calibrated "
                    "on text), quantize its linear layers' weights to int8 per output channel and write a "
                    "compressed-tensors int8 checkpoint; activations are quantized per token at run time.")
    _common_arguments(p)
    p.add_argument("--w-bits", type=int, default=8, help="weight bits (only 8)")
    p.add_argument("--alpha", type=float, default=0.5,
                   help="migration strength: s = max|x|**alpha / max|w|**(1-alpha) per input channel")
    p.add_argument("--smooth", action=argparse.BooleanOptionalAction, default=True,
                   help="smooth on calibration text (default); --no-smooth: int8 weights as they are")
    _run_arguments(p)
    p.set_defaults(func=_cmd_smooth_quant)


def _common_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="Hugging Face model directory (Llama, Mistral, Qwen2, Qwen3, InternLM3 or Gemma 1/2/3 "
                        "family; default: SmolLM2-135M-Instruct)")
    p.add_argument("--work-dir", required=True,
                   help="where to write the quantized model; must not exist or be empty")
    p.add_argument("--calib-dataset", default=None,
                   help="calibration text: a .txt file, or a .jsonl file with a \"text\" field per line "
                        f"(default: the shipped {DEFAULT_CALIB_DATASET.name})")
    p.add_argument("--calib-samples", type=int, default=128, help="calibration windows")
    p.add_argument("--calib-seqlen", type=int, default=512, help="tokens per calibration window")


def _run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=int, default=1, help="calibration windows per forward pass")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="compute dtype (auto: float32 on CPU, the model's half type on GPU)")
    p.add_argument("--log-level", default="INFO")
