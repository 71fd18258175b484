"""The seeded exponential race (kernels/sampling.py): its noise, its draws, Triton against the reference.

* reference cases (any machine): the hash against plain Python, the noise's determinism, batch
  independence and statistics, and the draws' frequencies;
* Triton cases: the kernel must give the reference's noise *bits* and tokens exactly. They run
  on CPU tensors under Triton's interpreter (tests/conftest.py switches it on where there is no
  GPU, before anything imports triton) or compiled on CUDA tensors otherwise;
* gpu cases (marked ``gpu``): model-sized batches and vocabularies, Triton against the reference
  on the GPU and on the CPU (the same tokens on both devices).
"""

import math

import pytest
import torch
from conveyor.kernels import sampling as sampling_mod
from conveyor.kernels._triton import HAS_TRITON, TRITON_INTERPRETED, set_kernel_mode
from conveyor.kernels.sampling import (
    exponential_noise_ref,
    exponential_noise_triton,
    seeded_race,
    seeded_race_ref,
    seeded_race_triton,
)

gpu = pytest.mark.gpu
compiled_gpu = pytest.mark.skipif(
    not HAS_TRITON or TRITON_INTERPRETED, reason="Triton missing or interpreted in this process"
)
M32 = 0xFFFFFFFF


# --------------------------------------------------------------------------------------------- helpers


@pytest.fixture
def tdev(forced: None) -> str:
    """Where Triton can run in this process, with dispatchers forced to it and poisoned buffers
    (``forced``: ``torch.empty`` returns NaN-filled floats, so a partial result the kernel forgets
    to write shows). CPU under the interpreter, else CUDA; skips when neither.
    """
    if TRITON_INTERPRETED:
        return "cpu"
    if HAS_TRITON and torch.cuda.is_available():
        return "cuda"
    pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1 before triton is imported) or CUDA")


def lowbias32_py(x: int) -> int:
    """The 32-bit finalizer in plain Python integers (the independent statement of the hash)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def noise_py(seed: int, step: int, j: int) -> float:
    """E[j] of the module doc in plain Python, with a float64 log."""
    lo, hi = seed & M32, (seed >> 32) & M32
    key = lowbias32_py(lo ^ lowbias32_py(hi ^ lowbias32_py((step & M32) ^ 0x9E3779B9)))
    x = lowbias32_py(key ^ lowbias32_py(j ^ 0x85EBCA6B))
    return -math.log((2 * (x >> 9) + 1) * 2.0**-24)


def i64(values: list[int], device: str = "cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def random_probs(batch: int, vocab: int, gen: torch.Generator, zero_frac: float = 0.3) -> torch.Tensor:
    """Softmax rows with about ``zero_frac`` of the entries masked to 0, like a top-k/top-p cut."""
    probs = torch.softmax(2.0 * torch.randn(batch, vocab, generator=gen), dim=-1)
    return probs.masked_fill(torch.rand(batch, vocab, generator=gen) < zero_frac, 0.0)


def random_seeds(batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeds over the whole [0, 2**63) range (both 32-bit words in use) and small step counts."""
    seeds = torch.randint(0, 2**62, (batch,), generator=gen) * 2 + torch.randint(0, 2, (batch,), generator=gen)
    return seeds, torch.randint(0, 5000, (batch,), generator=gen)


# ------------------------------------------------------------------------------------ the hash itself


def test_hash_matches_plain_python(seed: int) -> None:
    """The torch 32-bit arithmetic (split multiplies, masks) equals exact integer arithmetic."""
    gen = torch.Generator().manual_seed(seed)
    xs = torch.randint(0, 2**32, (4096,), generator=gen, dtype=torch.int64)
    xs[:4] = i64([0, 1, 2**31, M32])
    got = sampling_mod._lowbias32_ref(xs).tolist()
    assert got == [lowbias32_py(x) for x in xs.tolist()]

    seeds = [0, 1, 2**32 - 1, 2**32, 2**63 - 1, 0x0123456789ABCDEF]
    steps = [0, 7, 1, 2**31, 3, 2**32 - 1]
    vocab = 300
    noise = exponential_noise_ref(i64(seeds), i64(steps), vocab).double()
    expected = torch.tensor([[noise_py(s, t, j) for j in range(vocab)] for s, t in zip(seeds, steps)],
                            dtype=torch.float64)
    # Same bits in, so only the float32 log differs from float64's: ~1e-7 relative.
    torch.testing.assert_close(noise, expected, rtol=5e-7, atol=0)


def test_noise_log_is_accurate_over_all_inputs() -> None:
    """-ln(u) over every one of the 2**23 values u takes, against float64."""
    x = torch.arange(2**23, dtype=torch.int64) << 9  # one hash value per u
    e = sampling_mod._neg_log_unit_ref(x).double()
    u = (2 * torch.arange(2**23, dtype=torch.float64) + 1) * 2.0**-24
    rel = ((e + torch.log(u)) / -torch.log(u)).abs().max().item()
    assert rel < 5e-7, rel
    assert e.min().item() > 0 and math.isclose(e.max().item(), 24 * math.log(2), rel_tol=1e-6)


# ---------------------------------------------------------------------------------- noise properties


def test_noise_is_deterministic_and_batch_independent(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    seeds, steps = random_seeds(6, gen)
    noise = exponential_noise_ref(seeds, steps, 777)
    assert noise.shape == (6, 777) and noise.dtype == torch.float32
    assert torch.equal(noise, exponential_noise_ref(seeds, steps, 777))
    for b in range(6):  # a row computed alone
        assert torch.equal(noise[b], exponential_noise_ref(seeds[b : b + 1], steps[b : b + 1], 777)[0])
    perm = torch.randperm(6, generator=gen)
    assert torch.equal(noise[perm], exponential_noise_ref(seeds[perm], steps[perm], 777))
    # A longer vocabulary extends a row's stream: column j does not depend on V.
    assert torch.equal(noise, exponential_noise_ref(seeds, steps, 1000)[:, :777])


def test_noise_differs_across_seeds_and_steps(seed: int) -> None:
    s = seed * 1_000_003
    seeds = i64([s, s + 1, s + 2**32, s, s, 0, 0])
    steps = i64([10, 10, 10, 11, 12, 0, 1])
    noise = exponential_noise_ref(seeds, steps, 5000)
    for a in range(len(seeds)):
        for b in range(a):
            same = (noise[a] == noise[b]).float().mean().item()
            assert same < 2e-3, f"rows {a} and {b} share {same:.1%} of their noise"


def test_noise_statistics(seed: int) -> None:
    """Exp(1): positive and finite, mean and variance ~ 1, and exp(-E) uniform on (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    seeds, steps = random_seeds(64, gen)
    noise = exponential_noise_ref(seeds, steps, 1000).double()  # 64k draws
    assert torch.isfinite(noise).all() and (noise > 0).all()
    assert abs(noise.mean().item() - 1) < 0.03
    assert abs(noise.var().item() - 1) < 0.06
    assert abs((noise > 1).double().mean().item() - math.exp(-1)) < 0.01
    counts = torch.histc(torch.exp(-noise), bins=10, min=0, max=1) / noise.numel()
    assert (counts - 0.1).abs().max().item() < 0.01, counts
    # Consecutive columns and consecutive rows are uncorrelated.
    assert abs(torch.corrcoef(torch.stack([noise[:, :-1].flatten(), noise[:, 1:].flatten()]))[0, 1]) < 0.03
    assert abs(torch.corrcoef(torch.stack([noise[:-1].flatten(), noise[1:].flatten()]))[0, 1]) < 0.03


# ------------------------------------------------------------------------------------------- the draws

PROBS = [0.35, 0.0, 0.3, 0.2, 0.1, 0.05]


@pytest.mark.parametrize("vary", ["seed", "step"])
def test_draws_follow_probs(vary: str, seed: int) -> None:
    """Over 8000 seeds (or 8000 steps of one seed), frequencies match probs; a zero never wins."""
    n = 8000
    probs = torch.tensor(PROBS).expand(n, -1)
    if vary == "seed":
        seeds, steps = seed * 7919 + torch.arange(n), torch.full((n,), 3)
    else:
        seeds, steps = torch.full((n,), seed), torch.arange(n)
    tokens = seeded_race_ref(probs, seeds, steps)
    freq = torch.bincount(tokens, minlength=len(PROBS)).double() / n
    assert freq[1] == 0, "a zero-probability token was drawn"
    assert (freq - torch.tensor(PROBS, dtype=torch.float64)).abs().max().item() < 0.03, freq
    # Rows need not be normalized: scaling by a power of two changes no score's rounding.
    assert torch.equal(tokens, seeded_race_ref(probs * 4, seeds, steps))


def test_race_edge_cases() -> None:
    seeds, steps = i64([5, 5, 5, 9]), i64([0, 1, 2, 3])
    probs = torch.zeros(4, 9)
    probs[1, 8] = 1e-30  # the only candidate, however small
    probs[2, [3, 6]] = 0.5
    probs[3] = 1.0
    tokens = seeded_race_ref(probs, seeds, steps).tolist()
    assert tokens[0] == 0, "an all-zero row gives token 0"
    assert tokens[1] == 8
    assert tokens[2] in (3, 6)
    expected = exponential_noise_ref(seeds[3:], steps[3:], 9).argmin().item()
    assert tokens[3] == expected, "a flat row picks the smallest noise"


# ------------------------------------------------------------------------- Triton against the reference

# (batch, vocab, block, num_chunks): None = the launcher's default tiling, through the dispatcher.
RACE_CASES = {
    "b1_v7": (1, 7, None, None),
    "b5_v7": (5, 7, None, None),
    "b5_v7_block4_2chunks": (5, 7, 4, 2),
    "b1_v1000": (1, 1000, None, None),
    "b5_v1000": (5, 1000, None, None),
    "b5_v1000_block64": (5, 1000, 64, None),
    "b5_v1000_block64_3chunks": (5, 1000, 64, 3),
    "b3_v1000_block128_1chunk": (3, 1000, 128, 1),
}


@pytest.mark.parametrize("case", RACE_CASES.values(), ids=RACE_CASES.keys())
def test_triton_race_matches_reference(case: tuple, seed: int, tdev: str) -> None:
    batch, vocab, block, num_chunks = case
    gen = torch.Generator().manual_seed(seed)
    wide = random_probs(batch, vocab + 3, gen)
    probs = wide[:, :vocab]  # rows strided wider than the vocabulary
    if batch > 1:
        probs[1] = 0.0  # all zero: token 0
        probs[-1, :-1] = 0.0  # only the last column
        probs[-1, -1] = 0.25
    seeds, steps = random_seeds(batch, gen)
    probs, seeds, steps = probs.to(tdev), seeds.to(tdev), steps.to(tdev)
    if block is None:
        out = seeded_race(probs, seeds, steps)
    else:
        out = seeded_race_triton(probs, seeds, steps, block=block, num_chunks=num_chunks)
    ref = seeded_race_ref(probs, seeds, steps)
    assert out.dtype == torch.int64 and out.shape == (batch,)
    assert out.tolist() == ref.tolist()
    if batch > 1:
        assert out[1].item() == 0 and out[-1].item() == vocab - 1


def test_triton_race_half_precision(seed: int, tdev: str) -> None:
    """fp16/bf16 probs are raced in float32, like the reference."""
    gen = torch.Generator().manual_seed(seed)
    seeds, steps = random_seeds(4, gen)
    seeds, steps = seeds.to(tdev), steps.to(tdev)
    for dtype in (torch.float16, torch.bfloat16):
        probs = random_probs(4, 300, gen).to(tdev, dtype)
        assert seeded_race(probs, seeds, steps).tolist() == seeded_race_ref(probs, seeds, steps).tolist()


def test_triton_race_exact_ties_go_to_the_lower_index(tdev: str) -> None:
    """u takes 2**23 values, so a row of 6000 columns usually holds two with the same noise:
    equal probabilities there (zero elsewhere) make an exact tie, which argmax gives the lower."""
    seeds, steps = torch.arange(8) * 977 + 3, torch.arange(8)
    noise = exponential_noise_ref(seeds, steps, 6000)
    probs = torch.zeros(8, 6000)
    pairs = []
    for b in range(8):
        values, counts = noise[b].unique(return_counts=True)
        if (counts > 1).any():
            cols = (noise[b] == values[counts > 1][0]).nonzero().flatten()[:2].tolist()
            probs[b, cols] = 0.5
            pairs.append((b, cols[0]))
    assert len(pairs) >= 3, "expected some rows with a repeated noise value"
    rows = torch.tensor([b for b, _ in pairs])
    probs, seeds, steps = probs[rows].to(tdev), seeds[rows].to(tdev), steps[rows].to(tdev)
    ref = seeded_race_ref(probs, seeds, steps).tolist()
    assert ref == [low for _, low in pairs]
    assert seeded_race(probs, seeds, steps).tolist() == ref
    assert seeded_race_triton(probs, seeds, steps, block=128, num_chunks=5).tolist() == ref


def test_triton_race_matches_argmax_on_odd_inputs(seed: int, tdev: str) -> None:
    """Not probabilities, but no NaN: negative, -inf and +inf entries give argmax's answer too."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.randn(5, 300, generator=gen)  # about half negative
    probs[1] = float("-inf")  # all -inf: token 0
    probs[2, [40, 250]] = float("inf")  # two infinite scores tie: the lower index
    probs[3] = -probs[3].abs()  # all negative
    probs[4, ::3] = float("-inf")
    seeds, steps = (t.to(tdev) for t in random_seeds(5, gen))
    probs = probs.to(tdev)
    ref = seeded_race_ref(probs, seeds, steps).tolist()
    assert ref[1] == 0 and ref[2] == 40
    assert seeded_race(probs, seeds, steps).tolist() == ref
    assert seeded_race_triton(probs, seeds, steps, block=64, num_chunks=3).tolist() == ref


def test_triton_noise_has_the_reference_bits(seed: int, tdev: str) -> None:
    gen = torch.Generator().manual_seed(seed)
    seeds, steps = random_seeds(5, gen)
    seeds[:2] = i64([0, 2**63 - 1])
    steps[:2] = i64([0, 2**32 + 5])
    seeds, steps = seeds.to(tdev), steps.to(tdev)
    out = exponential_noise_triton(seeds, steps, 1500)
    ref = exponential_noise_ref(seeds, steps, 1500)
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))


def test_forced_triton_rejects_unsupported_inputs(tdev: str) -> None:
    with pytest.raises(ValueError, match="seeded_race"):
        seeded_race(torch.ones(3, 4, device=tdev, dtype=torch.float64), i64([1, 2, 3], tdev), i64([0, 0, 0], tdev))


def test_auto_and_ref_modes_use_the_reference_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("Triton launcher called")

    monkeypatch.setattr(sampling_mod, "seeded_race_triton", boom)
    probs = torch.tensor([[0.5, 0.5, 0.0]])
    for mode in ("auto", "ref"):
        set_kernel_mode(mode)
        assert seeded_race(probs, i64([3]), i64([0])).tolist() == seeded_race_ref(probs, i64([3]), i64([0])).tolist()


# -------------------------------------------------------------------------------------------------- GPU


@gpu
@compiled_gpu
def test_gpu_dispatch_picks_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    set_kernel_mode("auto")

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("reference called on CUDA tensors")

    monkeypatch.setattr(sampling_mod, "seeded_race_ref", boom)
    seeded_race(torch.rand(3, 100, device="cuda"), i64([1, 2, 3], "cuda"), i64([0, 1, 2], "cuda"))
    torch.cuda.synchronize()


@gpu
@compiled_gpu
@pytest.mark.parametrize("batch,vocab", [(256, 128256), (1, 128256), (7, 49152), (64, 32000), (33, 1000)])
def test_gpu_race_matches_reference(batch: int, vocab: int, seed: int) -> None:
    """Triton on the GPU, the reference on the GPU and on the CPU: the same tokens."""
    gen = torch.Generator().manual_seed(seed)
    probs = random_probs(batch, vocab, gen, zero_frac=0.5)
    probs[0, : vocab // 2] = 0.0
    seeds, steps = random_seeds(batch, gen)
    dev = [t.to("cuda") for t in (probs, seeds, steps)]
    out = seeded_race(*dev)
    assert out.is_cuda and out.tolist() == seeded_race_ref(*dev).tolist()
    assert out.tolist() == seeded_race_ref(probs, seeds, steps).tolist()


@gpu
@compiled_gpu
def test_gpu_noise_has_the_cpu_reference_bits(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    seeds, steps = random_seeds(16, gen)
    out = exponential_noise_triton(seeds.cuda(), steps.cuda(), 128256).cpu()
    assert torch.equal(out.view(torch.int32), exponential_noise_ref(seeds, steps, 128256).view(torch.int32))
    on_gpu = exponential_noise_ref(seeds.cuda(), steps.cuda(), 128256).cpu()
    assert torch.equal(on_gpu.view(torch.int32), out.view(torch.int32))


@gpu
@compiled_gpu
def test_gpu_chunk_reduction_has_no_race(seed: int) -> None:
    """Small batches split each row over ~100 programs, the last of which reduces the rest:
    repeated launches must all give the reference's tokens (a stale read would show)."""
    gen = torch.Generator().manual_seed(seed)
    probs = random_probs(3, 128256, gen).cuda()
    seeds, steps = (t.cuda() for t in random_seeds(3, gen))
    ref = seeded_race_ref(probs, seeds, steps)
    outs = torch.stack([seeded_race(probs, seeds, steps) for _ in range(300)])
    assert torch.equal(outs, ref.expand_as(outs))
