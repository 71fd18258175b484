"""ALiBi's slopes against the closed form BLOOM's ``build_alibi_tensor`` (and Baichuan-13B's and
Falcon-RW's copies of it) computes: for the largest power of two p <= n heads, base 2^(-8/p) to
the powers 1..p; past p, base 2^(-4/p) to the odd powers 1, 3, 5, ..."""

import math

import pytest
import torch

from conveyor.kernels.attention import alibi_slopes


def _bloom_slopes(n: int) -> list[float]:
    closest = 2 ** math.floor(math.log2(n))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = [base**i for i in range(1, closest + 1)]
    if closest != n:
        extra_base = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        remaining = min(closest, n - closest)
        slopes += [extra_base**i for i in range(1, 1 + 2 * remaining, 2)]
    return slopes


@pytest.mark.parametrize("num_heads", [8, 12, 40, 71])
def test_alibi_slopes_match_the_published_formula(num_heads: int) -> None:
    slopes = alibi_slopes(num_heads)
    assert slopes.dtype == torch.float32 and slopes.shape == (num_heads,)
    expected = torch.tensor(_bloom_slopes(num_heads), dtype=torch.float32)
    torch.testing.assert_close(slopes, expected, rtol=1e-7, atol=0)


def test_alibi_slopes_first_values() -> None:
    """8 heads: 1/2, 1/4, ..., 1/256; 12 heads add 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 (Press et al.)."""
    assert alibi_slopes(8).tolist() == [2.0**-i for i in range(1, 9)]
    torch.testing.assert_close(alibi_slopes(12)[8:], torch.tensor([2**-0.5, 2**-1.5, 2**-2.5, 2**-3.5]))
    with pytest.raises(ValueError):
        alibi_slopes(0)


def test_attention_layer_keeps_its_slopes() -> None:
    """The engine's layer holds this rank's slopes as a buffer and refuses a wrong count."""
    from conveyor.engine.layers.attention import Attention

    layer = Attention(4, 2, 64, alibi_slopes=alibi_slopes(8)[4:])
    assert torch.equal(layer.alibi_slopes, alibi_slopes(8)[4:])
    assert Attention(4, 2, 64).alibi_slopes is None
    with pytest.raises(ValueError, match="one slope"):
        Attention(4, 2, 64, alibi_slopes=alibi_slopes(8))
