"""`conveyor lite auto_awq` on tiny random Llamas: folding, the search, the packed layout, the CLI's refusals."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaForCausalLM

from conveyor.cli import main
from conveyor.engine.quantization import (
    AwqConfig,
    LayerwiseRunner,
    QuantizationError,
    auto_awq,
    awq_pack,
    awq_unpack,
    calibration_windows,
    dequantize_awq_ref,
    dequantize_checkpoint,
    fake_quantize,
    pack_linear,
    quantize,
    read_text,
    unpack_linear,
)
from conveyor.engine.quantization.awq import (
    _weight_mean,
    awq_layer,
    candidate_scales,
    keep_samples,
    search_clip,
    search_scale,
)
from conveyor.engine.quantization.scale_groups import apply_scale, recorded_inputs, scale_groups

from calibration_models import logits, text, tiny_model, tokenizer, windows

pytestmark = pytest.mark.usefixtures("torch_single_thread")  # tiny models: see tests/conftest.py


# ---- quantizer and packed layout ---------------------------------------------------------------


def test_rtn_quantize_pack_unpack_dequantize_round_trip():
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(0)) * 0.05
    w[:, 5] *= 20  # a wide group next to narrow ones
    q = quantize(w, bits=4, group_size=32)
    assert q.codes.min() >= 0 and q.codes.max() <= 15 and q.scales.dtype == torch.float16
    packed = pack_linear(q)
    assert packed["qweight"].shape == (128, 6) and packed["qweight"].dtype == torch.int32
    assert packed["qzeros"].shape == (4, 6) and packed["qzeros"].dtype == torch.int32
    assert packed["scales"].shape == (4, 48) and packed["scales"].dtype == torch.float16
    back = unpack_linear(packed["qweight"], packed["qzeros"], packed["scales"], 32)
    assert torch.equal(back.codes, q.codes) and torch.equal(back.zeros, q.zeros)
    assert torch.equal(back.scales, q.scales)
    dense = dequantize_awq_ref(packed["qweight"], packed["qzeros"], packed["scales"], 32).t()
    assert torch.equal(dense, q.dequantize())
    # Round to nearest: weights within half a step, except at a range's ends, where the rounded zero
    # point can push one step out of 0..15 (AutoAWQ's scheme has the same property).
    step = q.scales.float().repeat_interleave(32, dim=1)
    err = (dense - w).abs()
    assert (err <= step + 1e-6).all() and (err <= step / 2 + 1e-6).float().mean() > 0.97
    assert torch.equal(fake_quantize(w, 4, 32), dense)


def test_awq_nibble_order_matches_autoawq():
    # Nibble i of each int32 holds column [0, 2, 4, 6, 1, 3, 5, 7][i] of its eight.
    values = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [15, 14, 13, 12, 11, 10, 9, 8]])
    packed = awq_pack(values)
    assert packed[0, 0].item() == 0x75316420
    assert packed[1, 0].item() == 0x8ACE9BDF - 2**32  # the sign bit set: stored as a negative int32
    # Against AutoAWQ's packing loop, written out independently.
    rand = torch.randint(0, 16, (5, 32))
    expected = torch.zeros(5, 4, dtype=torch.int64)
    for word in range(4):
        for i, col in enumerate((0, 2, 4, 6, 1, 3, 5, 7)):
            expected[:, word] |= rand[:, word * 8 + col] << (4 * i)
    expected = torch.where(expected >= 2**31, expected - 2**32, expected).to(torch.int32)
    assert torch.equal(awq_pack(rand), expected)
    assert torch.equal(awq_unpack(expected).to(torch.int32), rand.to(torch.int32))


def test_quantize_handles_constant_and_one_signed_groups():
    w = torch.zeros(8, 32)
    w[1] = 0.3  # all positive: the range still includes 0, nothing is clipped
    deq = quantize(w, 4, 32).dequantize()
    assert torch.equal(deq[0], w[0])
    assert torch.allclose(deq[1], w[1], atol=1e-3)


# ---- calibration -------------------------------------------------------------------------------


def test_calibration_windows_spread_and_refuse_shorttext():
    ids = list(range(1000))
    w = calibration_windows(ids, 4, 100)
    assert w.shape == (4, 100)
    assert sorted(int(row[0]) for row in w) == [0, 250, 500, 750]  # spread over the text, shuffled order
    assert calibration_windows(ids, 50, 100).shape == (10, 100)  # fewer windows than asked: all there are
    with pytest.raises(QuantizationError, match="fewer than one window"):
        calibration_windows(ids[:50], 4, 100)


def test_read_text_txt_and_jsonl(tmp_path: Path):
    (tmp_path / "a.txt").write_text("hello world")
    (tmp_path / "b.jsonl").write_text('{"text": "one"}\n\n{"text": "two"}\n')
    (tmp_path / "c.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "d.csv").write_text("x")
    assert read_text(tmp_path / "a.txt") == "hello world"
    assert read_text(tmp_path / "b.jsonl") == "one\n\ntwo"
    with pytest.raises(QuantizationError, match='"text" field'):
        read_text(tmp_path / "c.jsonl")
    with pytest.raises(QuantizationError, match=".txt or .jsonl"):
        read_text(tmp_path / "d.csv")
    with pytest.raises(QuantizationError, match="not a file"):
        read_text(tmp_path / "missing.txt")


def test_layerwise_runner_reproduces_the_model():
    model = tiny_model()
    ids = windows(4, 32)
    runner = LayerwiseRunner(model, ids, batch_size=3)
    for layer in runner.layers:
        runner.advance(runner.forward(layer))
    hidden = torch.cat(runner.hidden)
    with torch.no_grad():
        out = model.lm_head(model.model.norm(hidden))
    torch.testing.assert_close(out, logits(model, ids), rtol=1e-4, atol=1e-4)


# ---- scale folding and the search --------------------------------------------------------------


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha-scales-o_proj", "gqa"])
def test_folding_scales_keeps_the_unquantized_model(kv_heads: int):
    model = tiny_model(kv_heads)
    ids = windows(4, 32)
    before = logits(model, ids)
    runner = LayerwiseRunner(model, ids)
    gen = torch.Generator().manual_seed(1)
    for layer in runner.layers:
        groups = scale_groups(layer, runner)
        assert ("o" in [g.name for g in groups]) == (kv_heads == 4)  # GQA: o_proj is not scaled (AutoAWQ)
        for group in groups:
            scales = torch.rand(next(iter(group.linears.values())).in_features, generator=gen) * 4 + 0.25
            apply_scale(group, scales)
    torch.testing.assert_close(logits(model, ids), before, rtol=1e-4, atol=1e-4)


def _scaled_loss(group, before: dict[str, torch.Tensor], x: torch.Tensor, ref: torch.Tensor,
                 scales: torch.Tensor) -> float:
    """``group``'s output error against ``ref`` with its weights ``before`` scaled, quantized (4
    bits, groups of 32) and unscaled; the weights are put back after."""
    for n, lin in group.linears.items():
        lin.weight.copy_(fake_quantize(before[n] * scales, 4, 32) / scales)
    loss = float((group.block(x) - ref).pow(2).mean())
    for n, lin in group.linears.items():
        lin.weight.copy_(before[n])
    return loss


@pytest.mark.parametrize("duo", [False, True], ids=["paper-scales", "duo-scales"])
def test_search_never_worse_than_alpha_zero_or_rtn(duo: bool):
    model = tiny_model(kv_heads=4)
    config = AwqConfig(w_group_size=32, calib_samples=8, calib_seqlen=32, duo_scaling=duo)
    runner = LayerwiseRunner(model, windows(8, 32), batch_size=4)
    layer = runner.layers[0]
    _, records = runner.record(layer, recorded_inputs(layer), keep_samples(config, 8))
    improved = 0
    for group in scale_groups(layer, runner):
        record = records[group.input_name]
        before = {n: lin.weight.clone() for n, lin in group.linears.items()}
        x = record.kept
        ref = group.block(x)

        scales, alpha, rtn_loss, best_loss = search_scale(group, record, config, runner)
        assert all(torch.equal(lin.weight, before[n]) for n, lin in group.linears.items())  # restored
        assert alpha is None or 0 <= alpha < 1
        # Its objective, recomputed here: plain RTN, alpha = 0, and what it chose.
        w_mean = _weight_mean(list(group.linears.values()), 32) if duo else None
        loss_with = functools.partial(_scaled_loss, group, before, x, ref)
        assert rtn_loss == pytest.approx(loss_with(torch.ones_like(scales)), rel=1e-4)
        assert best_loss == pytest.approx(loss_with(scales), rel=1e-4)
        assert best_loss <= rtn_loss
        assert best_loss <= loss_with(candidate_scales(record.absmean, 0.0, w_mean)) * (1 + 1e-5)
        improved += best_loss < rtn_loss
    assert improved >= 2  # with outlier channels, scaling helps


def test_clip_search_never_worse_than_no_clip():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, generator=gen)
    w[3, 7] = 9.0  # one outlier weight that stretches its group's grid
    x = torch.randn(256, 64, generator=gen)
    bound = search_clip(w, x, 4, 32)
    assert bound.shape == (64, 2)
    clipped = w.view(64, 2, 32).clamp(-bound[..., None], bound[..., None]).view(64, 64)

    def err(weight: torch.Tensor) -> torch.Tensor:
        return ((fake_quantize(weight, 4, 32) - w) @ x.t()).pow(2).sum()

    assert err(clipped) <= err(w)


def test_awq_layer_beats_rtn_on_the_layer_output():
    model = tiny_model(kv_heads=4)
    ids = windows(8, 32)
    config = AwqConfig(w_group_size=32, calib_samples=8, calib_seqlen=32)
    rtn_model = tiny_model(kv_heads=4)
    with torch.no_grad():
        for lin in rtn_model.model.layers[0].modules():
            if isinstance(lin, torch.nn.Linear):
                lin.weight.copy_(fake_quantize(lin.weight, 4, 32))
    runner = LayerwiseRunner(model, ids, batch_size=4)
    layer = runner.layers[0]
    ref, records = runner.record(layer, recorded_inputs(layer), keep_samples(config, 8))
    awq_layer(layer, runner, config, records)
    from conveyor.engine.quantization.awq import quantize_linears

    quantize_linears(layer, config)
    awq_err = sum(float((o - r).pow(2).sum()) for o, r in zip(runner.forward(layer), ref))
    rtn_runner = LayerwiseRunner(rtn_model, ids, batch_size=4)
    rtn_err = sum(float((o - r).pow(2).sum()) for o, r in zip(rtn_runner.forward(rtn_model.model.layers[0]), ref))
    assert awq_err < rtn_err


# ---- the tool: checkpoint, refusals, atomic work dir ------------------------------------------


@pytest.mark.parametrize("search", [True, False], ids=["awq", "rtn"])
def test_auto_awq_writes_an_autoawq_gemm_checkpoint(tiny_dir: Path, tmp_path: Path, search: bool):
    out = tmp_path / "out"
    config = AwqConfig(w_group_size=32, calib_samples=8, calib_seqlen=32, search_scale=search)
    result = auto_awq(tiny_dir, out, config, tmp_path / "calib.txt" if search else None, progress=False)
    assert result.work_dir == out and len(result.layers) == (2 if search else 0)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                                          "version": "gemm"}
    assert (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists()
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        t = {n: f.get_tensor(n) for n in names}
    shapes = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
              "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)}  # (in, out)
    for i in range(2):
        for proj, (inp, outp) in shapes.items():
            part = "self_attn" if proj[0] in "qkvo" else "mlp"
            base = f"model.layers.{i}.{part}.{proj}"
            assert f"{base}.weight" not in names
            assert t[f"{base}.qweight"].shape == (inp, outp // 8) and t[f"{base}.qweight"].dtype == torch.int32
            assert t[f"{base}.qzeros"].shape == (inp // 32, outp // 8) and t[f"{base}.qzeros"].dtype == torch.int32
            assert t[f"{base}.scales"].shape == (inp // 32, outp) and t[f"{base}.scales"].dtype == torch.float16
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                 "model.layers.0.input_layernorm.weight"):
        assert t[name].dtype == torch.float16
    # The dequantized copy is an ordinary checkpoint that transformers runs, close to the original.
    deq = dequantize_checkpoint(out, tmp_path / "deq")
    original = LlamaForCausalLM.from_pretrained(tiny_dir)
    restored = LlamaForCausalLM.from_pretrained(deq)
    ids = windows(2, 32)
    a, b = logits(original, ids), logits(restored, ids)
    assert (a - b).norm() / a.norm() < 0.5  # 4-bit noise, not a broken layout (that is ~1)


def test_awq_checkpoint_is_closer_to_the_model_than_rtn(tiny_dir: Path, tmp_path: Path):
    calib = tmp_path / "calib.txt"
    paths = {}
    for search in (False, True):
        out = tmp_path / f"out-{search}"
        config = AwqConfig(w_group_size=32, calib_samples=16, calib_seqlen=32, search_scale=search)
        auto_awq(tiny_dir, out, config, calib, progress=False)
        paths[search] = dequantize_checkpoint(out, tmp_path / f"deq-{search}")
    ids = calibration_windows(tokenizer()(text(seed=7), add_special_tokens=False)["input_ids"], 4, 32)
    ref = logits(LlamaForCausalLM.from_pretrained(tiny_dir), ids)
    errors = {s: float((logits(LlamaForCausalLM.from_pretrained(p), ids) - ref).norm()) for s, p in paths.items()}
    assert errors[True] < errors[False]


@pytest.mark.parametrize("flags, message", [
    (["--w-bits", "3"], "--w-bits 3 is not supported"),
    (["--w-bits", "8"], "use --w-bits 4"),
    (["--w-group-size", "48"], "use one of 32, 64, 128"),
    (["--w-group-size", "128"], "does not divide the model's hidden_size .* of 64 .*use --w-group-size 64 or 32"),
    (["--calib-samples", "0"], "calib-samples must be at least 1"),
    (["--w-group-size", "32", "--calib-dataset", "missing.txt"], "not a file"),
    (["--w-group-size", "32", "--calib-dataset", "ptb"], "ptb, wikitext2, c4, pileval, are hub downloads"),
    (["--w-group-size", "32", "--calib-dataset", "x.txt", "--search-scale", "False"],
     "x.txt would be unused: --search-scale False is round-to-nearest here"),
], ids=["bits3", "bits8", "group48", "group128", "samples0", "nodata", "ptb", "unused"])
def test_bad_flags_fail_before_any_work(tiny_dir: Path, tmp_path: Path, capsys, monkeypatch, flags, message):
    import conveyor.engine.quantization.tool_run as tool  # where both tools load the model

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded despite a bad setting")

    monkeypatch.setattr(tool, "load_causal_lm", no_load)
    out = tmp_path / "out"
    code = main(["lite", "auto_awq", str(tiny_dir), "--work-dir", str(out), *flags])
    assert code == 2
    err = capsys.readouterr().err
    assert "error:" in err
    import re
    assert re.search(message, err), err
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))


def test_refuses_a_non_empty_work_dir_and_an_unsupported_model(tiny_dir: Path, tmp_path: Path):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    with pytest.raises(QuantizationError, match="not an empty directory"):
        auto_awq(tiny_dir, busy, AwqConfig(w_group_size=32, search_scale=False), progress=False)
    assert (busy / "keep.txt").read_text() == "mine"
    cfg = json.loads((tiny_dir / "config.json").read_text())
    (tiny_dir / "config.json").write_text(json.dumps({**cfg, "model_type": "internlm2"}))
    with pytest.raises(QuantizationError, match="supports model types llama, mistral, qwen2"):
        auto_awq(tiny_dir, tmp_path / "x", AwqConfig(w_group_size=32, search_scale=False), progress=False)


def test_a_failure_mid_way_leaves_no_work_dir(tiny_dir: Path, tmp_path: Path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("disk full")

    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="disk full"):
        auto_awq(tiny_dir, out, AwqConfig(w_group_size=32, search_scale=False), progress=False)
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))
    # An empty directory is accepted and filled.
    out.mkdir()
    monkeypatch.undo()
    auto_awq(tiny_dir, out, AwqConfig(w_group_size=32, search_scale=False), progress=False)
    assert (out / "model.safetensors").exists() and not list(tmp_path.glob(".out.partial-*"))


@pytest.mark.parametrize("flags, search", [([], True), (["--search-scale"], True), (["--search_scale", "True"], True),
                                           (["--search-scale", "False"], False), (["--no-search-scale"], False)])
def test_search_scale_as_lmdeploys_docs_write_it(flags, search):
    from conveyor.cli import build_parser, hyphenate_options

    argv = hyphenate_options(["lite", "auto_awq", "m", "--work-dir", "w", *flags])
    assert build_parser().parse_args(argv).search_scale is search


@pytest.mark.parametrize("name", [["SmolLM2-135M-Instruct"], ["HuggingFaceTB/SmolLM2-135M-Instruct"], []],
                         ids=["folder-name", "hub-id", "no-model"])
def test_the_default_model_is_named_or_left_out_as_every_command_takes_it(tiny_dir: Path, tmp_path: Path, monkeypatch,
                                                                          name):
    import conveyor.default_model

    monkeypatch.chdir(tmp_path)  # no folder of the default model's name here
    monkeypatch.setattr(conveyor.default_model, "fetch", lambda dest=None, report=None: tiny_dir)
    out = tmp_path / "out"
    assert main(["lite", "auto_awq", *name, "--work-dir", str(out), "--no-search-scale"]) == 0
    # the group size left out: the largest that fits (the tiny model's hidden size is 64)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["group_size"] == 64


@pytest.mark.parametrize("widths, group", [((576, 9, 1536), 64), ((4096, 32, 11008), 128), ((4096, 32, 14336), 128),
                                           ((2048, 16, 5504), 128), ((96, 3, 160), 32)],
                         ids=["smollm2-135m", "llama2-7b", "llama3-8b", "qwen-1.8b-like", "only-32"])
def test_the_default_group_size_fits_the_model(tmp_path: Path, widths, group):
    from conveyor.lite import fitting_group_size

    hidden, heads, inter = widths
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": hidden,
                                                      "num_attention_heads": heads, "intermediate_size": inter}))
    assert fitting_group_size(tmp_path) == group
