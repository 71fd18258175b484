"""The gated MLP's batch-1 fusion (``SiluAndMul.gate_of``): one row of a dense gate/up projection
takes the gated GEMV (``kernels/gemv.gemv_silu_mul``) and gives what the projection and then the
gate give; a projection with forward hooks (Partial LoRA, calibration recorders), adapters or an
int8 reader keeps the two steps."""

from __future__ import annotations

import importlib

import pytest
import torch

from conveyor.engine.layers.activation import GeluAndMul, SiluAndMul
from conveyor.engine.layers.linear import MergedLinear

# the module, not the ``activation`` function that conveyor.engine.layers exports under its name
activation_mod = importlib.import_module("conveyor.engine.layers.activation")


def _proj(seed: int, bias: bool = False) -> MergedLinear:
    torch.manual_seed(seed)
    proj = MergedLinear(64, [48, 48], bias=bias)
    with torch.no_grad():
        proj.weight.normal_(0, 0.2)
        if bias:
            proj.bias.normal_()
    return proj


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of every call of the gated GEMV from the activation layer."""
    seen: list[int] = []
    real = activation_mod.gemv_silu_mul

    def counted(x, weight, bias=None):
        seen.append(x.shape[0])
        return real(x, weight, bias)

    monkeypatch.setattr(activation_mod, "gemv_silu_mul", counted)
    return seen


@pytest.mark.parametrize("bias", [False, True])
def test_one_row_takes_the_gated_gemv(bias: bool, seed: int, calls: list[int]) -> None:
    proj, act = _proj(seed, bias), SiluAndMul()
    for rows in (1, 5):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(act.gate_of(proj, x), act(proj(x)), rtol=1e-6, atol=1e-6)
    assert calls == [1, 5]  # 5 rows: the kernel's own fallback, the projection then the gate


def test_hooks_adapters_and_int8_readers_keep_two_steps(seed: int, calls: list[int]) -> None:
    proj, x = _proj(seed), torch.randn(1, 64)
    seen = []
    handle = proj.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    SiluAndMul().gate_of(proj, x)
    handle.remove()
    assert seen == [(1, 96)] and calls == []  # the hook saw the projection's [gate | up] rows

    proj.lora = object()  # adapter slots attached: LinearBase.forward applies them
    with pytest.raises(AttributeError):
        SiluAndMul().gate_of(proj, x)  # proj(x) called: the fake slots have no begin()
    proj.lora = None
    SiluAndMul(quantize_output=True).gate_of(proj, x)
    assert calls == []
    torch.testing.assert_close(GeluAndMul().gate_of(proj, x), GeluAndMul()(proj(x)))
