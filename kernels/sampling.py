"""Seeded sampling on the device, with no host sync: the exponential race over counter-based noise.

Why: a request's sampled tokens must depend only on its own seed and on how many tokens it has
generated -- not on the batch it happens to share, the device, or generator state that a
preemption or a CUDA graph would have to carry. So the noise is a pure function of
``(seed, step, token id)``, computed where it is used.

The race: with ``E[j] ~ Exp(1)`` independent, ``argmax_j probs[j] / E[j]`` is an exact draw from
``probs`` (``E[j] / probs[j]`` is an exponential clock of rate ``probs[j]``; the first to ring
wins with probability ``probs[j] / sum(probs)``, so rows need not be normalized).

The noise, in two lines (``h`` = the "lowbias32" 32-bit integer finalizer, ``lo``/``hi`` = the
two 32-bit words of the 64-bit seed, ``step`` taken modulo 2**32)::

    key  = h(lo ^ h(hi ^ h(step ^ 0x9E3779B9)))                  # once per row
    x[j] = h(key ^ h(j ^ 0x85EBCA6B));  u = (2 * (x >> 9) + 1) * 2**-24;  E = -ln(u)

For a fixed seed, ``step -> key`` is a bijection (a request never reuses a key in 2**32 steps),
and for a fixed key ``j -> x`` is one too; the xor constants only keep the all-zero inputs (seed
0, step 0, token 0) away from ``h``'s fixed point ``h(0) = 0``. This is statistical, not
cryptographic, randomness. ``u`` takes the 2**23 odd multiples of 2**-24, so it is exact in
float32 and strictly inside (0, 1); ``E`` lies in about [6e-8, 16.6].

Bit-identical on every backend: the integer hash is exact by construction (uint32 in Triton,
int64 masked to 32 bits in torch). ``-ln(u)`` is *not* a library ``log`` (torch's CPU and CUDA
``log``, NumPy's under Triton's interpreter and Triton's own may differ in the last bit, which
could flip a near tie): it is a short fixed sequence of IEEE float32 operations -- exponent
split, ``s = (m - 1) / (m + 1)``, an odd polynomial in ``s`` -- that every backend rounds alike,
given correctly rounded division (``tl.math.div_rn``: Triton's ``/`` is approximate on NVIDIA)
and no fused multiply-adds (the Triton kernels launch with ``enable_fp_fusion=False``; torch's
eager ops never fuse). Its error is about 1e-7 relative, far below what a sampler can notice. So
the Triton kernel and the torch reference give the same noise bits, hence the same token, on
the CPU and on the GPU (for finite, non-negative probabilities; see :func:`seeded_race_ref`).
"""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.


import torch
from ._triton import (
    FLOAT_DTYPES,
    cdiv,
    jit,
    next_pow2,
    row_and_cols,
    sm_count,
    tl,
    triton_takes,
)

_MASK32 = 0xFFFFFFFF
# Xor tweaks of the step and of the token id (see the module doc); the kernels repeat them.
_STEP_TWEAK = 0x9E3779B9
_COL_TWEAK = 0x85EBCA6B
# float32 constants, written as the doubles they round to so that torch (which rounds a Python
# scalar to the tensor's float32) and Triton (which makes float32 literals) use the same bits.
# The Triton helper ``_neg_log_unit`` repeats these literals: keep the two in step.
_LN2 = 0.6931471824645996  # ln 2
_SQRT2 = 1.4142135381698608  # the range-reduction threshold; any value works if both agree
# ln(m) = 2 atanh(s) = s * (2 + z*(2/3 + z*(2/5 + z*(2/7 + z*2/9)))), s = (m-1)/(m+1), z = s*s.
# With m in [sqrt(1/2), sqrt(2)], |s| <= 0.172, the first dropped term is < 3e-9 relative.
_C3 = 0.6666666865348816
_C5 = 0.4000000059604645
_C7 = 0.2857142984867096
_C9 = 0.2222222238779068


# ------------------------------------------------------------------------------- torch reference


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in [0, 2**32) and a 32-bit constant ``c``.

    A 32x32-bit product does not fit in int64 (whose overflow torch leaves undefined), so ``c``
    is split into 16-bit halves: both partial products stay below 2**48.
    """
    c_lo, c_hi = c & 0xFFFF, c >> 16
    return (x * c_lo + (((x * c_hi) & 0xFFFF) << 16)) & _MASK32


def _lowbias32_ref(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' "lowbias32" finalizer on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _row_keys_ref(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """The per-row 32-bit key ``h(lo ^ h(hi ^ h(step ^ tweak)))`` as int64 [B]."""
    seeds, steps = seeds.to(torch.int64), steps.to(torch.int64)
    lo, hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    return _lowbias32_ref(lo ^ _lowbias32_ref(hi ^ _lowbias32_ref((steps & _MASK32) ^ _STEP_TWEAK)))


def _neg_log_unit_ref(x: torch.Tensor) -> torch.Tensor:
    """Hash bits (int64 holding uint32) -> ``E = -ln(u)``, float32; mirrors ``_neg_log_unit``.

    ``u = n * 2**-24`` with odd ``n = 2 * (x >> 9) + 1 < 2**24`` (exact in float32). Write
    ``n = m * 2**e`` with ``m`` in [sqrt(1/2), sqrt(2)); then ``E = (24 - e) ln 2 - ln(m)``.
    Every float step is one correctly rounded float32 op, in the kernel's order.
    """
    n = ((x >> 9) << 1) | 1
    bits = n.to(torch.float32).view(torch.int32).to(torch.int64)
    e = (bits >> 23) - 127  # floor(log2(n)): n is a positive normal float
    m = ((bits & 0x7FFFFF) | 0x3F800000).to(torch.int32).view(torch.float32)  # n / 2**e in [1, 2)
    big = m > _SQRT2
    m = torch.where(big, m * 0.5, m)
    k = 24 - e - big.to(torch.int64)
    s = (m - 1.0) / (m + 1.0)
    z = s * s
    t = z * _C9 + _C7
    t = t * z + _C5
    t = t * z + _C3
    t = t * z + 2.0
    return k.to(torch.float32) * _LN2 - s * t


def exponential_noise_ref(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """The race's Exp(1) noise ``E[b, j]`` for rows seeded ``seeds[b]`` at step ``steps[b]``.

    seeds, steps: [B] integers (seeds are 64-bit, e.g. Python ints in [0, 2**63)) -> [B, vocab]
    float32 on their device. Row ``b`` depends on ``(seeds[b], steps[b])`` alone.
    """
    assert seeds.shape == steps.shape and seeds.dim() == 1, "seeds, steps: [B]"
    keys = _row_keys_ref(seeds, steps.to(seeds.device))
    cols = torch.arange(vocab, dtype=torch.int64, device=seeds.device) ^ _COL_TWEAK
    # h(j ^ tweak) is the same for every row: hash the columns once, then broadcast.
    return _neg_log_unit_ref(_lowbias32_ref(keys[:, None] ^ _lowbias32_ref(cols)[None, :]))


def seeded_race_ref(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """``argmax_j probs[b, j] / E[b, j]``: one draw per row from ``probs`` [B, V] -> int64 [B].

    Rows need not sum to 1. A zero probability is never drawn unless the whole row is zero; an
    all-zero row gives token 0 (every score is 0 and ``argmax`` picks the first maximum). Ties go
    to the lowest index, like ``torch.argmax``. The Triton kernel returns the same token for any
    input without NaN (``argmax`` picks a NaN; the kernel ignores it).
    """
    assert probs.dim() == 2, "probs: [B, V]"
    noise = exponential_noise_ref(seeds.to(probs.device), steps.to(probs.device), probs.shape[1])
    return (probs.to(torch.float32) / noise).argmax(dim=-1)


# ----------------------------------------------------------------------------------------- Triton


@jit
def _lowbias32(x):
    # uint32 in, uint32 out: multiplies wrap modulo 2**32 and shifts are logical, as in C.
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@jit
def _row_key(seed, step):
    # seed, step: int64 scalars. Truncating casts take the low 32 bits, like ``& 0xFFFFFFFF``.
    lo = seed.to(tl.uint32)
    hi = (seed >> 32).to(tl.uint32)
    return _lowbias32(lo ^ _lowbias32(hi ^ _lowbias32(step.to(tl.uint32) ^ 0x9E3779B9)))


@jit
def _neg_log_unit(x):
    # Same operations, same order, same float32 constants as ``_neg_log_unit_ref`` (see there).
    n = ((x >> 9) << 1) | 1
    bits = n.to(tl.float32).to(tl.int32, bitcast=True)
    e = (bits >> 23) - 127
    m = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    big = m > 1.4142135381698608
    m = tl.where(big, m * 0.5, m)
    k = 24 - e - big.to(tl.int32)
    # div_rn: plain ``/`` on float32 is an approximate division on NVIDIA GPUs.
    s = tl.math.div_rn(m - 1.0, m + 1.0)
    z = s * s
    t = z * 0.2222222238779068 + 0.2857142984867096
    t = t * z + 0.4000000059604645
    t = t * z + 0.6666666865348816
    t = t * z + 2.0
    return k.to(tl.float32) * 0.6931471824645996 - s * t


@jit
def _noise(key, cols):
    # key: uint32 scalar (the row's), cols: int32 token ids -> E, float32.
    return _neg_log_unit(_lowbias32(key ^ _lowbias32(cols.to(tl.uint32) ^ 0x85EBCA6B)))


@jit
def _exponential_noise_kernel(
    seeds_ptr, steps_ptr, out_ptr, stride_out, vocab,
    BLOCK: tl.constexpr,
):
    # Grid: (B, cdiv(V, BLOCK)). Only for tests and debugging: the race never stores the noise.
    row, cols = row_and_cols(BLOCK)
    key = _row_key(tl.load(seeds_ptr + row), tl.load(steps_ptr + row))
    tl.store(out_ptr + row * stride_out + cols, _noise(key, cols), mask=cols < vocab)


@jit
def _seeded_race_kernel(
    probs_ptr, seeds_ptr, steps_ptr, out_ptr, part_best_ptr, part_idx_ptr, count_ptr,
    stride_p, vocab, chunk, num_chunks,
    BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
):
    # Grid: (B, num_chunks). A program races the columns [part * chunk, (part + 1) * chunk) of
    # one row, BLOCK at a time, with the noise made in registers (no [B, V] tensor in memory).
    # Splitting a row's vocabulary over several programs keeps the GPU busy when B is small.
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    key = _row_key(tl.load(seeds_ptr + row), tl.load(steps_ptr + row))
    start = part * chunk
    end = tl.minimum(start + chunk, vocab)
    # Per-lane running best. Starting (and masking) at -inf keeps argmax's answers for any
    # non-NaN input, negative or infinite ones included: nothing below -inf can win a lane.
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    for base in range(start, end, BLOCK):
        cols = base + tl.arange(0, BLOCK)
        mask = cols < end
        p = tl.load(probs_ptr + row * stride_p + cols, mask=mask, other=0.0).to(tl.float32)
        score = tl.where(mask, tl.math.div_rn(p, _noise(key, cols)), float("-inf"))
        # Strictly greater: a lane sees its columns in increasing order, so on a tie it keeps
        # the lower index, as torch.argmax does.
        take = score > best
        best = tl.where(take, score, best)
        best_idx = tl.where(take, cols, best_idx)
    top = tl.max(best, axis=0)
    # Among lanes holding the top score, the lowest column (the first maximum, as in argmax).
    top_idx = tl.min(tl.where(best == top, best_idx, vocab), axis=0)
    if CHUNKS == 1:
        tl.store(out_ptr + row, top_idx.to(tl.int64))
    else:
        # Publish this chunk's winner; the row's last program to finish (counted with an atomic
        # on a zeroed counter) picks among the chunks, so one launch does the whole reduction
        # (no second kernel, no host sync). The barrier orders every thread's stores before the
        # release of the counting atomic; its acquire orders the last program's loads after
        # all the other chunks' stores (the CUDA "threadFenceReduction" pattern).
        tl.store(part_best_ptr + row * num_chunks + part, top)
        tl.store(part_idx_ptr + row * num_chunks + part, top_idx)
        tl.debug_barrier()
        if tl.atomic_add(count_ptr + row, 1, sem="acq_rel") == num_chunks - 1:
            parts = tl.arange(0, CHUNKS)
            in_row = parts < num_chunks
            bests = tl.load(part_best_ptr + row * num_chunks + parts, mask=in_row, other=float("-inf"), volatile=True)
            idxs = tl.load(part_idx_ptr + row * num_chunks + parts, mask=in_row, other=vocab, volatile=True)
            # Chunk winners are each their chunk's lowest tied column: the lowest tied one wins.
            top = tl.max(bests, axis=0)
            tl.store(out_ptr + row, tl.min(tl.where(bests == top, idxs, vocab), axis=0).to(tl.int64))


# Tuned on an H100 (Triton 3.6) over B in 1..256 and V up to 128256. The race is compute-bound
# (two hashes, a log and two divisions a column): about 90 us of GPU time for B=256, V=128256
# and 9 us for B=1; for small batches the host's launch cost (45-75 us a call there) dominates.
_BLOCK = 1024
_NUM_WARPS = 8
# Programs per streaming multiprocessor to aim for when splitting a row's vocabulary over several
# programs: with a small batch, one program a row would leave most of the GPU idle.
_PROGRAMS_PER_SM = 8


def _split(batch: int, vocab: int, block: int, device: torch.device) -> tuple[int, int]:
    """(chunk, num_chunks): a row's columns per program (a multiple of ``block``) and programs."""
    tiles = cdiv(vocab, block)
    # the interpreter plans for 4 SMs: a few programs a row, so tests cover the split
    want = max(1, cdiv(_PROGRAMS_PER_SM * sm_count(device, interpreted=4), batch))
    chunk = cdiv(tiles, min(tiles, want)) * block
    return chunk, cdiv(vocab, chunk)


def _int64_rows(t: torch.Tensor, batch: int, device: torch.device) -> torch.Tensor:
    assert t.shape == (batch,), f"expected [{batch}], got {tuple(t.shape)}"
    assert not t.dtype.is_floating_point, f"seeds and steps must be integers, got {t.dtype}"
    return t.to(device=device, dtype=torch.int64).contiguous()


def exponential_noise_triton(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Triton launcher for :func:`exponential_noise_ref` (the same bits)."""
    seeds = _int64_rows(seeds, seeds.shape[0], seeds.device)
    steps = _int64_rows(steps, seeds.shape[0], seeds.device)
    out = torch.empty(seeds.shape[0], vocab, dtype=torch.float32, device=seeds.device)
    if out.numel():
        _exponential_noise_kernel[(seeds.shape[0], cdiv(vocab, _BLOCK))](
            seeds, steps, out, out.stride(0), vocab,
            BLOCK=_BLOCK, num_warps=_NUM_WARPS, enable_fp_fusion=False,
        )
    return out


def seeded_race_triton(
    probs: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    *,
    block: int = _BLOCK,
    num_chunks: int | None = None,
) -> torch.Tensor:
    """Triton launcher for :func:`seeded_race_ref` (the same tokens).

    ``block`` (a power of two) and ``num_chunks`` (programs per row) override the tiling, so
    tests can cover several tiles and chunks on small vocabularies.
    """
    assert probs.dim() == 2, "probs: [B, V]"
    assert probs.dtype in FLOAT_DTYPES, f"unsupported dtype {probs.dtype}"
    batch, vocab = probs.shape
    assert 0 < vocab < 2**31, f"vocab size {vocab} out of range"
    device = probs.device
    seeds = _int64_rows(seeds, batch, device)
    steps = _int64_rows(steps, batch, device)
    if probs.stride(-1) != 1:
        probs = probs.contiguous()
    if batch == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    if num_chunks is None:
        chunk, num_chunks = _split(batch, vocab, block, device)
    else:
        chunk = cdiv(cdiv(vocab, num_chunks), block) * block
        num_chunks = cdiv(vocab, chunk)
    out = torch.empty(batch, dtype=torch.int64, device=device)
    if num_chunks == 1:
        part_best = part_idx = count = out  # unused (CHUNKS=1): any valid pointer will do
    else:
        part_best = torch.empty(batch, num_chunks, dtype=torch.float32, device=device)
        part_idx = torch.empty(batch, num_chunks, dtype=torch.int32, device=device)
        count = torch.zeros(batch, dtype=torch.int32, device=device)
    _seeded_race_kernel[(batch, num_chunks)](
        probs, seeds, steps, out, part_best, part_idx, count,
        probs.stride(0), vocab, chunk, num_chunks,
        BLOCK=block, CHUNKS=next_pow2(num_chunks), num_warps=_NUM_WARPS, enable_fp_fusion=False,
    )
    return out


def _problem(probs: torch.Tensor) -> str | None:
    supported = probs.dim() == 2 and probs.dtype in FLOAT_DTYPES and 0 < probs.shape[1] < 2**31
    return None if supported else f"{probs.dtype} {tuple(probs.shape)}"


def seeded_race(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Sample one token per row of ``probs`` [B, V] from per-row (seed, step) noise -> int64 [B].

    Triton when ``probs`` is on CUDA (``seeds`` and ``steps`` are moved there if they are not),
    else the reference (:func:`seeded_race_ref`, whose doc has the edge cases); both return the
    same tokens.
    """
    if triton_takes("seeded_race", (probs,), _problem, probs):
        return seeded_race_triton(probs, seeds, steps)
    return seeded_race_ref(probs, seeds, steps)
