"""The quantized KV cache (quant_policy 8 and 4): the quantizer, the quantizing cache writes and the
attention kernels that read codes, each against its torch reference on fresh random inputs.

Interpreter cases run on the CPU in CI (as in ``test_kernels.py``); GPU cases at model sizes.
Outside the sequences the caches' scales are NaN, so a kernel that reads a slot it should not
fails; one channel 100x the rest stands for the outliers real keys carry.
"""

import pytest
import torch

# kernel_harness first: where Triton is missing, importing it skips this file.
from kernel_harness import assert_close, compiled_gpu, gpu, interp, run_interpreter_cases_in_child
from conveyor.kernels._triton import TRITON_INTERPRETED
from conveyor.kernels.attention import (
    AttentionTuning,
    alibi_slopes,
    paged_attention,
    paged_attention_ref,
    paged_attention_triton,
)
from conveyor.kernels.attention.policy import VARIANT_BITS
from conveyor.kernels.kv_basis import key_basis, to_key_basis
from conveyor.kernels.kv_cache import (
    rotate_and_store_kv,
    rotate_and_store_kv_ref,
    store_kv,
    store_kv_ref,
)
from conveyor.kernels.kv_centres import KeyCentres, KeyCentring, key_shifts_ref
from conveyor.kernels.kv_layout import CENTRE_TOKENS, KVCacheLayout, turned_centres
from conveyor.kernels.kv_quant import dequantize_kv_ref, quantize_kv_ref
from conveyor.kernels.rotary import apply_rotary
from test_kernels import paged_batch, randn

# bf16: the probabilities times the value scales are rounded to bf16 for the dot (the reference keeps
# fp32); over a long prefix with int4 values that reaches 2.1 % on some seeds.
GPU_TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}


def variant(*on: str) -> dict[str, bool]:
    """The quantized decode kernel's variant flags (``AttentionTuning``) with only ``on`` set."""
    return {name: name in on for name in VARIANT_BITS}


def quantized(cache: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A float cache [..., D] as codes and scales; slots holding NaN get NaN scales (poison)."""
    nan = torch.isnan(cache).any(-1)
    codes, scales = quantize_kv_ref(torch.nan_to_num(cache), bits)
    scales[nan] = float("nan")
    return codes, scales


def quantized_batch(q_lens, k_lens, h, hkv, d, block_size, seed, bits, dtype=torch.float32, device="cpu",
                    outlier=True):
    """``paged_batch`` with its caches quantized; with ``outlier``, one key channel and one value
    channel are 100x the rest."""
    q, kc, vc, bt, cu, sk = paged_batch(q_lens, k_lens, h, hkv, d, block_size, seed)
    if outlier:
        kc[..., 3] *= 100
        vc[..., d - 5] *= 100
    kq, ks = quantized(kc, bits)
    vq, vs = quantized(vc, bits)
    to = lambda t: t.to(device)
    return q.to(device, dtype), to(kq), to(vq), to(ks), to(vs), to(bt), to(cu), to(sk)


def check_quantized_attention(q_lens, k_lens, h, hkv, d, block_size, seed, bits, tol, dtype=torch.float32,
                              device="cpu", centred=False, window=None, softcap=None, alibi=False, **tiles):
    """The kernel against the reference; ``centred``: keys stored centred (``KeyCentres``), with
    random centre rows for half the blocks (first blocks past them read the zero row) and a
    rotary table that ends 3 positions past the longest sequence (centre positions clamp).
    ``window`` / ``softcap`` / ``alibi``: the layer's sliding window, soft-capping and ALiBi slopes."""
    q, kq, vq, ks, vs, bt, cu, sk = quantized_batch(q_lens, k_lens, h, hkv, d, block_size, seed, bits, dtype, device)
    scale = d**-0.5
    centres = ref_centres = None
    if centred:
        gen = torch.Generator().manual_seed(seed + 1)
        rows = kq.shape[0] // 2 + 1
        table = randn(rows, 2, hkv, d, gen=gen).to(torch.float16)
        table[-1] = 0
        cos_sin = rope_table(d, max(k_lens) + 3)
        ref_centres = KeyCentres(table, cos_sin)
        centres = KeyCentres(table.to(device), cos_sin.to(device), q)
        q = to_key_basis(q.float()).to(dtype)
    slopes = alibi_slopes(h) if alibi else None
    mods = dict(sliding_window=window, softcap=softcap)
    out = paged_attention_triton(q, kq, vq, bt, cu, sk, scale, max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens),
                                 k_scales=ks, v_scales=vs, key_centres=centres, tuning=AttentionTuning(**tiles),
                                 alibi_slopes=None if slopes is None else slopes.to(device), **mods)
    ref = paged_attention_ref(q.float().cpu(), kq.cpu(), vq.cpu(), bt.cpu(), cu.cpu(), sk.cpu(), scale, ks.cpu(),
                              vs.cpu(), ref_centres, alibi_slopes=slopes, **mods).to(dtype)
    assert_close(out.cpu(), ref, tol)


# ----------------------------------------------------------------------------------------- the format


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_round_trip_within_half_a_step(bits: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = randn(50, 3, 64, gen=gen)
    x[..., 7] *= 100  # an outlier channel widens the range of every vector
    x[0, 0] = 1.5  # a constant vector: scale 0, read back exactly (1.5 is an fp16 value)
    codes, scales = quantize_kv_ref(x, bits)
    layout = KVCacheLayout(bits, 64)
    assert codes.dtype == torch.uint8 and codes.shape == (50, 3, layout.code_dim)
    assert scales.dtype == torch.float16 and scales.shape == (50, 3, 2)
    back = dequantize_kv_ref(codes, scales, bits)
    step = scales[..., 0:1].float()
    # Half a step of rounding, plus the zero's own rounding to fp16 (a few ulp of min(x)).
    bound = 0.5 * step * (1 + 1e-3) + x.abs().amax(-1, keepdim=True) * 2**-10
    assert ((back - x).abs() <= bound).all()
    assert torch.equal(back[0, 0], x[0, 0])


def test_int4_codes_pack_the_two_halves() -> None:
    """Byte j holds dim j in its low nibble and dim j + D/2 in its high one."""
    x = torch.tensor([[0.0, 1, 2, 3, 15, 14, 13, 12]])  # range 15: codes equal the values
    codes, scales = quantize_kv_ref(x, 4)
    assert codes.tolist() == [[0 | 15 << 4, 1 | 14 << 4, 2 | 13 << 4, 3 | 12 << 4]]
    assert scales.float().tolist() == [[1.0, 0.0]]


@pytest.mark.parametrize("d", [64, 128, 96])
def test_key_basis_keeps_dot_products(d: int, seed: int) -> None:
    """Orthonormal (Hadamard for a power of two): (q B) . (k B) = q . k, and an outlier channel
    is spread over every dim."""
    basis = key_basis(d, dtype=torch.float64)
    torch.testing.assert_close(basis @ basis.T, torch.eye(d, dtype=torch.float64))
    gen = torch.Generator().manual_seed(seed)
    q, k = randn(5, d, gen=gen).double(), randn(7, d, gen=gen).double()
    k[:, 2] *= 100
    torch.testing.assert_close((q @ basis) @ (k @ basis).T, q @ k.T)
    assert (to_key_basis(k.float()).abs().amax(-1) < 0.5 * k.abs().amax(-1)).all()


@interp
@pytest.mark.parametrize("bits,tol", [(8, 0.02), (4, 0.25)])
def test_quantized_cache_attends_like_the_float_one(bits: int, tol: float, seed: int, forced: None) -> None:
    """End to end through the kernels (queries and keys in the key basis): close to attention
    over the unquantized cache, within what the bits allow."""
    from test_kernels import _rotate_and_store_case

    gen = torch.Generator().manual_seed(seed)
    q, k, v, positions, cos_sin, _, _ = _rotate_and_store_case(40, 8, 2, 64, 16, gen)
    k = k.clone()
    k[:, :, 9] *= 20  # an outlier channel
    slots = torch.arange(40)
    (kq, ks), (vq, vs) = _caches(bits, 3, 16, 2, 64, 2)
    kf, vf = torch.zeros(3, 16, 2, 64), torch.zeros(3, 16, 2, 64)
    tables, cu, lens = torch.tensor([[0, 1, 2]], dtype=torch.int32), torch.tensor([0, 40], dtype=torch.int32), \
        torch.tensor([40], dtype=torch.int32)
    q_quant = rotate_and_store_kv(q, k, v, positions, cos_sin, kq, vq, slots, ks, vs)
    out = paged_attention(q_quant, kq, vq, tables, cu, lens, 0.125, k_scales=ks, v_scales=vs)
    q_float = rotate_and_store_kv(q, k, v, positions, cos_sin, kf, vf, slots)
    assert_close(out, paged_attention(q_float, kf, vf, tables, cu, lens, 0.125), tol)


def test_layout_sizes_and_refusals() -> None:
    fp16, int8, int4 = (KVCacheLayout(p, 128) for p in (0, 8, 4))
    assert fp16.bytes_per_head(torch.float16) == 256
    assert int8.bytes_per_head(torch.float16) == 128 + 4  # codes + fp16 (scale, zero)
    assert int4.bytes_per_head(torch.float16) == 64 + 4
    assert 256 / int4.bytes_per_head(torch.float16) > 3.7
    k, s = int4.allocate((2, 16, 8), torch.float16, "cpu")
    assert k.shape == (2, 16, 8, 64) and k.dtype == torch.uint8 and s.shape == (2, 16, 8, 2)
    assert fp16.allocate((2, 16, 8), torch.bfloat16, "cpu")[1] is None
    with pytest.raises(ValueError, match="even head_dim"):
        KVCacheLayout(4, 63)
    with pytest.raises(ValueError, match="quant_policy=2"):
        KVCacheLayout(2, 64)


# ------------------------------------------------------------------------------- interpreter: stores


def _caches(bits: int, blocks: int, block_size: int, hkv: int, d: int, n: int, device: str = "cpu") -> list:
    """``n`` (codes, scales) pairs, codes 0xAB and scales NaN where nothing was written."""
    layout = KVCacheLayout(bits, d)
    out = []
    for _ in range(n):
        codes, scales = layout.allocate((blocks, block_size, hkv), torch.float32, device)
        out.append((codes.fill_(0xAB), scales.fill_(float("nan"))))
    return out


def assert_same_codes(a: tuple, b: tuple, bits: int = 8, exact: bool = True) -> None:
    """Codes and scales equal (scales NaN alike). ``exact=False`` (keys go through a basis product
    whose sums are ordered differently from torch's, and GPU division may round differently): a
    code may sit one off where its value lay on a rounding boundary (at most 2 or 0.1% of them)."""
    torch.testing.assert_close(a[1], b[1], rtol=0 if exact else 1e-3, atol=0, equal_nan=True)
    if exact:
        assert torch.equal(a[0], b[0])
    else:
        unpack = (lambda c: torch.cat([c & 0xF, c >> 4], -1)) if bits == 4 else (lambda c: c)
        diff = (unpack(a[0]).int() - unpack(b[0]).int()).abs()
        assert diff.max() <= 1
        assert (diff > 0).sum() <= max(2, 1e-3 * diff.numel())


@interp
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("hkv,d,block_size", [(3, 64, 16), (1, 128, 1), (8, 64, 4), (2, 96, 16), (1, 80, 4)])
def test_quantized_store_kv(bits: int, hkv: int, d: int, block_size: int, seed: int, forced: None) -> None:
    gen = torch.Generator().manual_seed(seed)
    t = 7
    kv = randn(t, 2 * hkv * d + 5, gen=gen)  # strided views, like slices of a fused qkv
    kv[:, 1] *= 100
    k, v = kv[:, : hkv * d].view(t, hkv, d), kv[:, hkv * d : 2 * hkv * d].view(t, hkv, d)
    blocks = -(-t // block_size) + 2
    slots = torch.randperm(blocks * block_size, generator=gen)[:t]
    slots[[1, 4]] = -1
    (kc, ks), (vc, vs), (kr, ksr), (vr, vsr) = _caches(bits, blocks, block_size, hkv, d, 4)
    store_kv(k, v, kc, vc, slots, ks, vs)
    store_kv_ref(k, v, kr, vr, slots, ksr, vsr)
    assert_same_codes((kc, ks), (kr, ksr), bits, exact=False)  # keys: through the basis product
    assert_same_codes((vc, vs), (vr, vsr))
    assert (kc.view(-1, hkv, kc.shape[-1])[slots[slots >= 0]] != 0xAB).any()


@interp
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("h,hkv,d,block_size", [(9, 3, 64, 16), (4, 4, 128, 1), (8, 1, 64, 16), (4, 2, 96, 16),
                                                (2, 1, 80, 4)])
def test_quantized_rotate_and_store_kv(bits: int, h: int, hkv: int, d: int, block_size: int, seed: int,
                                       forced: None) -> None:
    """The fused kernel equals its reference, and stores what rotary then the quantizing store do."""
    from test_kernels import _rotate_and_store_case

    q, k, v, positions, cos_sin, slots, _ = _rotate_and_store_case(7, h, hkv, d, block_size,
                                                                  torch.Generator().manual_seed(seed))
    blocks = -(-7 // block_size) + 3
    c = _caches(bits, blocks, block_size, hkv, d, 6)
    out_q = rotate_and_store_kv(q, k, v, positions, cos_sin, c[0][0], c[1][0], slots, c[0][1], c[1][1])
    ref_q = rotate_and_store_kv_ref(q, k, v, positions, cos_sin, c[2][0], c[3][0], slots, c[2][1], c[3][1])
    assert_close(out_q, ref_q, 1e-5)
    assert_same_codes(c[0], c[2], bits, exact=False)
    assert_same_codes(c[1], c[3])
    rot_q, rot_k = apply_rotary(q, k, positions, cos_sin)
    assert_close(out_q, to_key_basis(rot_q), 1e-5)  # queries come back in the key basis
    store_kv(rot_k, v, c[4][0], c[5][0], slots, c[4][1], c[5][1])
    assert_same_codes(c[0], c[4], bits, exact=False)


def rope_table(d: int, positions: int) -> torch.Tensor:
    """A rotary ``cos_sin_cache`` [positions, d] (base 10000), position 0 the identity."""
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.arange(positions, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], -1)


def _centring_case(t: int, hkv: int, d: int, blocks: int, gen: torch.Generator, bits: int, device: str = "cpu"):
    """Two sequences in one step: one starting here (its first ``t - 5`` tokens, its centre in
    row 2) and one continuing (5 tokens, its centre already in row 5). Table rows are random
    (but for int8's mean keys, which stay zero: ``turned_centres``)."""
    table = randn(blocks, 2, hkv, d, gen=gen).to(torch.float16)
    if not turned_centres(bits):
        table[:, 0] = 0
    index = torch.tensor([2] * (t - 5) + [5] * 5, dtype=torch.int32)
    new = torch.tensor([[0, min(t - 5, CENTRE_TOKENS), 2]], dtype=torch.int32)
    return table.to(device), index.to(device), new.to(device)


@interp
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("h,hkv,d,block_size", [(9, 3, 64, 16), (4, 4, 128, 1), (8, 1, 64, 16), (4, 2, 96, 16),
                                                (2, 1, 80, 4)])
def test_centred_stores(bits: int, h: int, hkv: int, d: int, block_size: int, seed: int, forced: None) -> None:
    """The quantizing write with key centres equals the reference: the centre of the sequence
    starting here is computed first (from its keys before the rotary embedding), every key is
    stored minus its own sequence's centre turned to its position, values are untouched, and
    the queries come back in both bases."""
    from test_kernels import _rotate_and_store_case

    t = 12
    gen = torch.Generator().manual_seed(seed)
    q, k, v, positions, cos_sin, slots, _ = _rotate_and_store_case(t, h, hkv, d, block_size, gen)
    k += 4 * randn(1, hkv, d, gen=gen)  # the offset the centre takes off
    positions[: t - 5] = torch.arange(t - 5)
    blocks = -(-t // block_size) + 8
    table, index, new = _centring_case(t, hkv, d, blocks, gen, bits)
    tables = [table.clone() for _ in range(2)]
    c = _caches(bits, blocks, block_size, hkv, d, 6)
    qm = [torch.full_like(q, float("nan")) for _ in range(2)]
    out_q = rotate_and_store_kv(q, k, v, positions, cos_sin, c[0][0], c[1][0], slots, c[0][1], c[1][1],
                                KeyCentring(tables[0], index, new), qm[0])
    ref_q = rotate_and_store_kv_ref(q, k, v, positions, cos_sin, c[2][0], c[3][0], slots, c[2][1], c[3][1],
                                    KeyCentring(tables[1], index, new), qm[1])
    assert_close(out_q, ref_q, 1e-5)
    assert_close(qm[0], qm[1], 1e-5)
    assert_close(qm[0], apply_rotary(q, k, positions, cos_sin)[0], 1e-5)
    assert_close(tables[0].float(), tables[1].float(), 2e-3)
    assert torch.equal(tables[0][5], table[5])  # a continuing sequence's centre is read, not written
    assert_same_codes(c[0], c[2], bits, exact=False)
    assert_same_codes(c[1], c[3])
    # Uncentred, the keys store otherwise.
    rotate_and_store_kv_ref(q, k, v, positions, cos_sin, c[4][0], c[5][0], slots, c[4][1], c[5][1])
    assert not torch.equal(c[4][0], c[2][0])


@interp
@pytest.mark.parametrize("bits", [8, 4])
def test_first_blocks_past_the_centre_rows_store_uncentred(bits: int, seed: int, forced: None) -> None:
    """The table has rows for the first R blocks (and a last, zero row): a sequence starting at
    block R or later is neither given a centre nor stored with one."""
    gen = torch.Generator().manual_seed(seed)
    t, h, hkv, d, bs = 12, 4, 2, 64, 16
    q, k, v = randn(t, h, d, gen=gen), randn(t, hkv, d, gen=gen) + 3, randn(t, hkv, d, gen=gen)
    positions = torch.cat([torch.arange(7), torch.arange(5)])
    cos_sin = rope_table(d, 64)
    slots = torch.arange(t) + bs
    index = torch.tensor([1] * 7 + [5] * 5, dtype=torch.int32)  # rows 0..2 exist (R = 3); block 5 has none
    new = torch.tensor([[0, 7, 1], [7, 5, 5]], dtype=torch.int32)
    c = _caches(bits, 4, bs, hkv, d, 6)
    tables = [torch.zeros(4, 2, hkv, d, dtype=torch.float16) for _ in range(2)]
    qm = torch.empty_like(q)
    rotate_and_store_kv(q, k, v, positions, cos_sin, c[0][0], c[1][0], slots, c[0][1], c[1][1],
                        KeyCentring(tables[0], index, new), qm)
    rotate_and_store_kv_ref(q, k, v, positions, cos_sin, c[2][0], c[3][0], slots, c[2][1], c[3][1],
                            KeyCentring(tables[1], index, new), qm)
    rotate_and_store_kv_ref(q, k, v, positions, cos_sin, c[4][0], c[5][0], slots, c[4][1], c[5][1])  # uncentred
    assert_same_codes(c[0], c[2], bits, exact=False)
    assert torch.equal(tables[0][3], torch.zeros(2, hkv, d, dtype=torch.float16)) and tables[0][1].abs().max() > 0
    second = slice(bs + 7, bs + 12)  # the second sequence's slots: as if uncentred
    flat = [(x.view(-1, hkv, x.shape[-1])[second], y.view(-1, hkv, 2)[second]) for x, y in (c[0], c[4])]
    assert_same_codes(flat[0], flat[1], bits, exact=False)


@pytest.mark.parametrize("bits", [8, 4])
def test_centred_keys_keep_scores_and_store_the_first_key_exactly(bits: int, seed: int) -> None:
    """Keys that share an offset before the rotary embedding (as real keys do) are stored with
    less error centred than not, the first key (the attention sink) exactly but for the centre's
    fp16 rounding; attention adds the centres back, and the constant shift ``e`` changes every
    score of a query by the same amount, so leaving it out (as the kernels do) keeps the output."""
    gen = torch.Generator().manual_seed(seed)
    t, h, hkv, d, block_size = 200, 4, 2, 64, 16
    # The offset sits in the slowly turning dim pairs (the upper half of each half), as real keys'
    # does: a centre turned to the middle of 16 positions misses fast pairs by up to 8 turns.
    slow = (torch.arange(d) % (d // 2)) >= d // 4
    k = randn(t, hkv, d, gen=gen) + 6 * randn(1, hkv, d, gen=gen) * slow
    k[0] *= 8  # the sink's key: far from the rest
    q, v = randn(t, h, d, gen=gen), randn(t, hkv, d, gen=gen)
    positions, cos_sin = torch.arange(t), rope_table(d, t)
    slots = torch.arange(t)
    blocks = -(-t // block_size)
    table = torch.zeros(blocks + 1, 2, hkv, d, dtype=torch.float16)
    centring = KeyCentring(table, torch.zeros(t, dtype=torch.int32), torch.tensor([[0, t, 0]], dtype=torch.int32))
    (kc, ks), (vc, vs), (kp, kps), (vp, vps) = _caches(bits, blocks, block_size, hkv, d, 4)
    qm = torch.empty_like(q)
    rotate_and_store_kv_ref(q, k, v, positions, cos_sin, kc, vc, slots, ks, vs, centring, qm)
    rotate_and_store_kv_ref(q, k, v, positions, cos_sin, kp, vp, slots, kps, vps)  # no centre
    exact = to_key_basis(apply_rotary(q, k, positions, cos_sin)[1])
    shifts = key_shifts_ref(table, centring.index, positions, cos_sin)
    centred = dequantize_kv_ref(kc.view(-1, hkv, kc.shape[-1])[:t], ks.view(-1, hkv, 2)[:t], bits) + shifts
    plain = dequantize_kv_ref(kp.view(-1, hkv, kp.shape[-1])[:t], kps.view(-1, hkv, 2)[:t], bits)
    step = ks.view(-1, hkv, 2)[:t, :, 0].float()
    assert ((centred[0] - exact[0]).abs() < 0.01 * step[0, :, None] + 2e-3 * exact[0].abs()).all()
    assert (centred[1:] - exact[1:]).norm() < 0.6 * (plain[1:] - exact[1:]).norm()
    bt = torch.arange(blocks, dtype=torch.int32)[None]
    cu, sk = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([t], dtype=torch.int32)
    qb = to_key_basis(q[-1:])
    out = paged_attention_ref(qb, kc, vc, bt, cu, sk, 0.125, ks, vs, KeyCentres(table, cos_sin))
    vd = dequantize_kv_ref(vc, vs, bits)
    kfull = torch.zeros(blocks * block_size, hkv, d)
    kfull[:t] = centred
    assert_close(out, paged_attention_ref(qb, kfull.view(blocks, block_size, hkv, d), vd, bt, cu, sk, 0.125), 1e-4)
    no_shift = table.clone()
    no_shift[:, 1] = 0
    assert_close(out, paged_attention_ref(qb, kc, vc, bt, cu, sk, 0.125, ks, vs, KeyCentres(no_shift, cos_sin)), 1e-4)


def test_centre_arguments_refused_where_they_cannot_act() -> None:
    """Key centres for an unquantized cache, or queries before the key basis without centred
    keys to read them: refused, not ignored."""
    q, kc, vc, bt, cu, sk = paged_batch([1], [20], 4, 2, 64, 16, 0)
    with pytest.raises(AssertionError, match="quantized cache"):
        paged_attention_ref(q, kc, vc, bt, cu, sk, 0.1,
                            key_centres=KeyCentres(torch.zeros(2, 2, 2, 64), rope_table(64, 32)))
    c = _caches(8, 2, 16, 2, 64, 2)
    q, k = torch.randn(3, 4, 64), torch.randn(3, 2, 64)
    with pytest.raises(AssertionError, match="centred keys"):
        rotate_and_store_kv_ref(q, k, k, torch.arange(3), rope_table(64, 8), c[0][0], c[1][0], torch.arange(3),
                                c[0][1], c[1][1], model_queries=torch.empty_like(q))


def test_centre_of_a_one_token_first_chunk() -> None:
    """A first chunk of one token has no other keys to average: its mean is zero and its shift
    the first key's own quantization error, so that key still comes back exact."""
    k = torch.randn(1, 2, 64) * 5
    q = torch.randn(1, 4, 64)
    table = torch.zeros(4, 2, 2, 64, dtype=torch.float16)
    c = _caches(4, 4, 16, 2, 64, 2)
    cos_sin, positions = rope_table(64, 16), torch.zeros(1, dtype=torch.long)
    index = torch.tensor([1], dtype=torch.int32)
    rotate_and_store_kv_ref(q, k, k, positions, cos_sin, c[0][0], c[1][0], torch.tensor([16]), c[0][1], c[1][1],
                            KeyCentring(table, index, torch.tensor([[0, 1, 1]], dtype=torch.int32)))
    back = dequantize_kv_ref(c[0][0].view(-1, 2, 32)[16], c[0][1].view(-1, 2, 2)[16], 4)
    back = back + key_shifts_ref(table, index, positions, cos_sin)[0]
    assert_close(back, to_key_basis(k)[0], 2e-3)
    assert table[1, 0].abs().max() == 0
    assert table[1, 1].abs().max() < 0.5 * c[0][1].view(-1, 2, 2)[16, :, 0].float().max()  # only the error


# ---------------------------------------------------------------------------- interpreter: attention

# (q_lens, k_lens, H, Hkv, D, block_size, tile overrides): GQA 1 / 3 / 4 / 8, D 64 and 128,
# sequences ending on, before and after block boundaries, split decode, prefill over a prefix.
QUANT_CASES = {
    "decode_g3_d64_boundaries": ([1] * 4, [16, 15, 17, 1], 9, 3, 64, 16, {}),
    "decode_g4_d128_split": ([1] * 3, [33, 64, 65], 8, 2, 128, 16, dict(decode_partition=32, block_n=16)),
    "decode_g8_batch1_split": ([1], [100], 8, 1, 64, 32, dict(decode_partition=32, block_n=16)),
    "decode_g1": ([1] * 2, [63, 129], 4, 4, 64, 64, dict(decode_partition=64, block_n=32)),
    "prefill_g3": ([16, 17, 15], [16, 17, 15], 9, 3, 64, 16, dict(block_m=16, block_n=16)),
    "prefill_over_prefix_g4_d128": ([5, 32, 1], [37, 64, 20], 8, 2, 128, 16, dict(block_m=16, block_n=16)),
    "prefill_g8_chunk": ([40], [100], 8, 1, 64, 32, {}),
    "prefill_g1_bs64": ([3, 64], [130, 64], 4, 4, 64, 64, dict(block_m=32, block_n=32)),
}


@interp
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("case", QUANT_CASES.values(), ids=QUANT_CASES.keys())
@pytest.mark.parametrize("centred", [False, True], ids=["plain", "centred"])
def test_quantized_attention(case: tuple, bits: int, centred: bool, seed: int, poisoned_empty: None) -> None:
    q_lens, k_lens, h, hkv, d, bs, tiles = case
    # fp32: the kernel computes s * (q . c) + z * sum(q), the reference q . (c * s + z).
    check_quantized_attention(q_lens, k_lens, h, hkv, d, bs, seed, bits, 1e-4, centred=centred, **tiles)


# Decode cases whose sequences end inside, on and past tiles: whole tiles inside one cache block
# (block 64, tiles of 32: the block table read once a tile) and tiles spanning blocks (block 16).
DECODE_TAILS = {
    "in_block": ([1] * 5, [1, 31, 32, 33, 95], 4, 4, 64, 64, dict(decode_partition=64, block_n=32)),
    "in_block_one_partition": ([1] * 3, [7, 64, 130], 4, 2, 64, 64, {}),
    "across_blocks": ([1] * 3, [17, 48, 70], 8, 2, 128, 16, dict(decode_partition=32, block_n=32)),
}


@interp
@pytest.mark.parametrize("tune", [variant(), variant("lazy", "scale_ahead"), variant("fold", "lazy", "scale_ahead")],
                         ids=["plain", "lazy_ahead", "fold_lazy_ahead"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("case", DECODE_TAILS.values(), ids=DECODE_TAILS.keys())
def test_quantized_decode_variants(case: tuple, bits: int, tune: dict, seed: int, poisoned_empty: None) -> None:
    """The tensor-core decode walk's tuning variants (its TUNE bits) compute the same attention;
    the fold of the biased codes (1024 + c) is an fp16 one, so fp16 runs too."""
    q_lens, k_lens, h, hkv, d, bs, tiles = case
    check_quantized_attention(q_lens, k_lens, h, hkv, d, bs, seed, bits, 1e-4, simt=False, **tune, **tiles)
    check_quantized_attention(q_lens, k_lens, h, hkv, d, bs, seed, bits, 1e-4, simt=False, centred=True,
                              **tune, **tiles)
    check_quantized_attention(q_lens, k_lens, h, hkv, d, bs, seed, bits, 5e-3, dtype=torch.float16,
                              simt=False, **tune, **tiles)


# The CUDA-core walk (one query a kv head) on the decode cases above, their query heads cut to
# one per kv head: tiles inside and across cache blocks, split partitions, D 64 and 128.
SIMT_CASES = {k: (q, kl, hkv, hkv, d, bs, tiles) for k, (q, kl, h, hkv, d, bs, tiles)
              in {**DECODE_TAILS, **QUANT_CASES}.items() if k.startswith(("decode", "in_block", "across"))}


@interp
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("case", SIMT_CASES.values(), ids=SIMT_CASES.keys())
def test_quantized_decode_simt(case: tuple, bits: int, seed: int, poisoned_empty: None) -> None:
    q_lens, k_lens, h, hkv, d, bs, tiles = case
    check_quantized_attention(q_lens, k_lens, h, hkv, d, bs, seed, bits, 1e-4, simt=True, **tiles)
    check_quantized_attention(q_lens, k_lens, h, hkv, d, bs, seed, bits, 1e-4, simt=True, centred=True, **tiles)
    check_quantized_attention(q_lens, k_lens, h, hkv, d, bs, seed, bits, 5e-3, dtype=torch.float16, simt=True,
                              **variant(), **tiles)


# Sliding windows and soft-capping over a quantized cache: (q_lens, k_lens, H, Hkv, D, block_size,
# window, softcap, tiles). Decode windows starting mid-tile over split partitions, with tiles
# inside one cache block and across blocks; a chunk over a prefix whose window starts inside it.
QUANT_MOD_CASES = {
    "decode_window_split": ([1] * 3, [40, 7, 100], 4, 4, 32, 16, 20, None, dict(decode_partition=16, block_n=16)),
    "decode_window_in_block_softcap": ([1] * 2, [95, 33], 4, 4, 32, 64, 40, 1.5,
                                       dict(decode_partition=32, block_n=32)),
    "decode_softcap": ([1] * 2, [40, 3], 4, 4, 32, 16, None, 1.0, {}),
    "prefill_chunk_window_softcap": ([20, 3], [70, 9], 4, 4, 32, 16, 30, 1.5, dict(block_m=16, block_n=16)),
}


@interp
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("case", QUANT_MOD_CASES.values(), ids=QUANT_MOD_CASES.keys())
def test_quantized_attention_window_softcap(case: tuple, bits: int, seed: int, poisoned_empty: None) -> None:
    """Both decode walks (groups of 2 on the tensor cores, one query a kv head on the CUDA cores),
    and the prefill kernel; centred keys under the window alone (soft-capping over centred keys
    goes to the reference: ``test_softcap_over_centred_keys_is_refused``)."""
    q_lens, k_lens, h, hkv, d, bs, window, softcap, tiles = case
    mods = dict(window=window, softcap=softcap)
    centred = dict(centred=True, window=window)
    if max(q_lens) == 1:
        check_quantized_attention(q_lens, k_lens, 2 * h, hkv, d, bs, seed, bits, 1e-4, **mods, **tiles)
        check_quantized_attention(q_lens, k_lens, h, hkv, d, bs, seed, bits, 1e-4, simt=True, **mods, **tiles)
        if window:
            check_quantized_attention(q_lens, k_lens, h, hkv, d, bs, seed, bits, 1e-4, simt=False,
                                      **variant("lazy", "scale_ahead"), **centred, **tiles)
    else:
        check_quantized_attention(q_lens, k_lens, h, hkv, d, bs, seed, bits, 1e-4, **mods, **tiles)
        check_quantized_attention(q_lens, k_lens, 2 * h, hkv, d, bs, seed, bits, 1e-4, **centred, **tiles)


@interp
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_attention_alibi(bits: int, seed: int, poisoned_empty: None) -> None:
    """ALiBi over a quantized cache: both decode walks (split partitions, one with a window) and
    prefill over a prefix (centred keys: their scores come before the slopes' terms)."""
    tiles = dict(decode_partition=16, block_n=16)
    check_quantized_attention([1] * 2, [40, 7], 12, 4, 32, 16, seed, bits, 1e-4, alibi=True, window=20, **tiles)
    check_quantized_attention([1] * 2, [40, 7], 6, 6, 32, 16, seed, bits, 1e-4, simt=True, alibi=True, **tiles)
    check_quantized_attention([20, 3], [70, 9], 6, 2, 32, 16, seed, bits, 1e-4, alibi=True, centred=True,
                              block_m=16, block_n=16)


@interp
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("d", [96, 80])
def test_quantized_attention_head_dim_not_pow2(d: int, bits: int, seed: int, poisoned_empty: None) -> None:
    """Head dims padded to a power of two inside the kernels (int4: rows of d / 2 bytes, 48 for
    Phi-3-mini's 96): the tensor-core decode walk over split partitions (plain, centred and, for
    96, the fp16 fold), the CUDA-core one, and prefill over a prefix with centred keys."""
    tiles = dict(decode_partition=16, block_n=16)
    check_quantized_attention([1] * 3, [40, 7, 100], 6, 2, d, 16, seed, bits, 1e-4, centred=True, **tiles)
    if d == 96:
        check_quantized_attention([1] * 3, [40, 7, 100], 6, 2, d, 16, seed, bits, 1e-4, **tiles)
        check_quantized_attention([1] * 2, [40, 7], 4, 2, d, 16, seed, bits, 5e-3, dtype=torch.float16,
                                  **variant("fold", "lazy"), **tiles)
    check_quantized_attention([1] * 2, [40, 7], 4, 4, d, 16, seed, bits, 1e-4, simt=True, centred=True, **tiles)
    check_quantized_attention([20, 3], [70, 9], 4, 2, d, 16, seed, bits, 1e-4, centred=True, block_m=16, block_n=16)


def test_softcap_over_centred_keys_is_refused() -> None:
    """The kernels drop each centre's constant score (softmax ignores it; the cap does not): the
    launcher check sends soft-capped layers over centred keys to the reference."""
    from conveyor.kernels.attention.launch import _check_inputs

    q, kq, vq, ks, vs, bt, cu, sk = quantized_batch([1], [20], 4, 2, 64, 16, 0, 4)
    centres = KeyCentres(torch.zeros(2, 2, 2, 64, dtype=torch.float16), rope_table(64, 32), q)
    why = _check_inputs(q, kq, vq, bt, cu, sk, ks, vs, None, 1.0, None, centres)
    assert why is not None and "centred keys" in why
    assert _check_inputs(q, kq, vq, bt, cu, sk, ks, vs, 8, None, None, centres) is None


@interp
def test_quantized_decode_simt_takes_one_query_a_kv_head(seed: int) -> None:
    q, kq, vq, ks, vs, bt, cu, sk = quantized_batch([1, 1], [20, 7], 4, 2, 64, 16, seed, 8)
    with pytest.raises(AssertionError, match="one query a kv head"):
        paged_attention_triton(q, kq, vq, bt, cu, sk, 0.1, max_seqlen_q=1, max_seqlen_k=20, k_scales=ks,
                               v_scales=vs, tuning=AttentionTuning(simt=True))


@interp
def test_quantized_attention_fp16(seed: int, poisoned_empty: None) -> None:
    for q_lens in ([1, 1], [6, 1]):
        check_quantized_attention(q_lens, [40, 3], 8, 2, 64, 16, seed, 8, 5e-3, dtype=torch.float16)


@interp
def test_quantized_dispatcher_and_refusals(seed: int, forced: None) -> None:
    q, kq, vq, ks, vs, bt, cu, sk = quantized_batch([3, 1], [20, 7], 4, 2, 64, 16, seed, 8)
    ref = paged_attention_ref(q, kq, vq, bt, cu, sk, 0.1, ks, vs)
    assert_close(paged_attention(q, kq, vq, bt, cu, sk, 0.1, k_scales=ks, v_scales=vs), ref, 1e-4)
    with pytest.raises(ValueError, match="scales must be fp16"):
        paged_attention(q, kq, vq, bt, cu, sk, 0.1, k_scales=ks.float(), v_scales=vs.float())


def test_reference_reads_the_dequantized_cache(seed: int) -> None:
    """On the CPU path the reference is what runs: it must attend over exactly the values that
    ``dequantize_kv_ref`` gives back."""
    q, kq, vq, ks, vs, bt, cu, sk = quantized_batch([1, 4], [30, 12], 4, 2, 64, 8, seed, 4, outlier=False)
    kd = dequantize_kv_ref(kq, torch.nan_to_num(ks), 4)
    vd = dequantize_kv_ref(vq, torch.nan_to_num(vs), 4)
    assert_close(paged_attention_ref(q, kq, vq, bt, cu, sk, 0.125, ks, vs),
                 paged_attention_ref(q, kd, vd, bt, cu, sk, 0.125), 1e-6)


@pytest.mark.skipif(TRITON_INTERPRETED, reason="the interpreter cases run in this process")
def test_interpreter_cases_in_child() -> None:
    """Run this file's interpreter cases in a child process that imports triton interpreted."""
    run_interpreter_cases_in_child(__file__)


# -------------------------------------------------------------------------------------------------- GPU

GPU_QUANT = {  # (q_lens, k_lens, H, Hkv, D, block_size)
    "decode_batch1_4k_g3_d64": ([1], [4096], 9, 3, 64, 16),
    "decode_batch256_g4_d128": ([1] * 256, None, 32, 8, 128, 64),
    "decode_long_mixed_g8": ([1] * 4, [17000, 4096, 511, 8193], 16, 2, 128, 64),
    "prefill_2k_g4_d128": ([2048], [2048], 32, 8, 128, 64),
    "chunked_over_prefix": ([512, 1000, 1, 33], [3000, 1000, 700, 4129], 32, 8, 128, 64),
    "prefill_g1_d64": ([300], [700], 8, 8, 64, 16),
}


@gpu
@compiled_gpu
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", GPU_QUANT.values(), ids=GPU_QUANT.keys())
@pytest.mark.parametrize("centred", [False, True], ids=["plain", "centred"])
def test_gpu_quantized_attention(case: tuple, dtype: torch.dtype, bits: int, centred: bool, seed: int,
                                 poisoned_empty: None) -> None:
    q_lens, k_lens, h, hkv, d, bs = case
    if k_lens is None:
        k_lens = torch.randint(1, 2049, (len(q_lens),), generator=torch.Generator().manual_seed(seed)).tolist()
    check_quantized_attention(q_lens, k_lens, h, hkv, d, bs, seed, bits, GPU_TOL[dtype], dtype, "cuda", centred)


@gpu
@compiled_gpu
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_quantized_window_softcap(dtype: torch.dtype, bits: int, seed: int, poisoned_empty: None) -> None:
    """Sliding windows and soft-capping over a quantized cache: both decode walks and prefill."""
    k_lens = [1, 63, 700, 2049, 5000]
    for h in (16, 4):  # groups of 4 (tensor cores), one query a kv head (CUDA cores)
        check_quantized_attention([1] * len(k_lens), k_lens, h, 4, 128, 64, seed, bits, GPU_TOL[dtype], dtype, "cuda",
                                  window=1000, softcap=50.0)
    check_quantized_attention([1] * len(k_lens), k_lens, 16, 4, 128, 16, seed, bits, GPU_TOL[dtype], dtype, "cuda",
                              centred=True, window=777)
    check_quantized_attention([512, 1, 33], [3000, 700, 4129], 32, 8, 128, 64, seed, bits, GPU_TOL[dtype], dtype,
                              "cuda", window=1000, softcap=50.0)


@gpu
@compiled_gpu
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_quantized_head_dim_96(dtype: torch.dtype, bits: int, seed: int, poisoned_empty: None) -> None:
    """Phi-3-mini's D 96 over a quantized cache: both decode walks with the PTX conversions and all
    variants, centred keys, prefill over a prefix."""
    k_lens = [1, 63, 700, 2049, 5000]
    for simt, h in ((True, 8), (False, 32)):
        check_quantized_attention([1] * len(k_lens), k_lens, h, 8, 96, 64, seed, bits, GPU_TOL[dtype], dtype, "cuda",
                                  simt=simt, fast_codes=True, **variant(*VARIANT_BITS))
        check_quantized_attention([1] * len(k_lens), k_lens, h, 8, 96, 16, seed, bits, GPU_TOL[dtype], dtype, "cuda",
                                  simt=simt, centred=True)
    check_quantized_attention([512, 1, 33], [3000, 700, 4129], 32, 32, 96, 64, seed, bits, GPU_TOL[dtype], dtype,
                              "cuda", centred=True)


@gpu
@compiled_gpu
@pytest.mark.parametrize("bits", [8, 4])
def test_gpu_quantized_alibi(bits: int, seed: int, poisoned_empty: None) -> None:
    """Baichuan-13B's attention (40 heads, MHA) over a quantized cache: the CUDA-core decode walk,
    the tensor-core one (forced) and a chunk over a prefix."""
    dt, k_lens = torch.bfloat16, [1, 63, 700, 2049, 5000]
    for simt in (True, False):
        check_quantized_attention([1] * len(k_lens), k_lens, 40, 40, 128, 64, seed, bits, GPU_TOL[dt], dt, "cuda",
                                  alibi=True, simt=simt)
    check_quantized_attention([512, 1, 33], [3000, 700, 4129], 40, 40, 128, 64, seed, bits, GPU_TOL[dt], dt, "cuda",
                              alibi=True)


@gpu
@compiled_gpu
@pytest.mark.parametrize("simt", [False, True], ids=["tensor_cores", "cuda_cores"])
@pytest.mark.parametrize("fast,tune", [(False, {}), (True, variant()), (True, variant(*VARIANT_BITS))],
                         ids=["portable", "asm_plain", "asm_all"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_quantized_decode_paths(dtype: torch.dtype, bits: int, fast: bool, tune: dict, simt: bool, seed: int,
                                    poisoned_empty: None) -> None:
    """Both code conversions (inline PTX, and the portable one the interpreter runs), the
    tuning variants and both walks, on sequences ending inside and past whole tiles, some split
    in partitions; groups of 4 (the tensor cores only) and 1."""
    k_lens = [1, 63, 64, 65, 700, 2049]
    check_quantized_attention([1] * len(k_lens), k_lens, 4 if simt else 16, 4, 128, 64, seed, bits, GPU_TOL[dtype],
                              dtype, "cuda", fast_codes=fast, simt=simt, **tune)
    check_quantized_attention([1] * len(k_lens), k_lens, 16, 16, 128, 16, seed, bits, GPU_TOL[dtype], dtype, "cuda",
                              fast_codes=fast, simt=simt, decode_partition=256, **tune)
    check_quantized_attention([1] * len(k_lens), k_lens, 16, 16, 128, 64, seed, bits, GPU_TOL[dtype], dtype, "cuda",
                              centred=True, fast_codes=fast, simt=simt, **tune)


@gpu
@compiled_gpu
@pytest.mark.parametrize("centred", [False, True], ids=["plain", "centred"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_quantized_stores(dtype: torch.dtype, bits: int, centred: bool, seed: int, poisoned_empty: None) -> None:
    """Both quantizing writes at model sizes against the CPU reference (codes within one step),
    with and without key centres (a sequence starting here and one continuing)."""
    from test_kernels import _rotate_and_store_case

    gen = torch.Generator().manual_seed(seed)
    t, h, hkv, d, bs = 2048, 32, 8, 128, 16
    q, k, v, positions, _, slots, _ = _rotate_and_store_case(t, h, hkv, d, bs, gen, dtype, "cuda")
    cos_sin = rope_table(d, 4096).cuda()
    k[:, :, 5] *= 100
    k += 3 * torch.randn(1, hkv, d, generator=gen).to(k)
    positions[: t - 5] = torch.arange(t - 5, device="cuda")
    blocks = -(-t // bs) + 8
    gpu_c = _caches(bits, blocks, bs, hkv, d, 2, "cuda")
    cpu_c = _caches(bits, blocks, bs, hkv, d, 2)
    table, index, new = _centring_case(t, hkv, d, blocks, gen, bits)
    gpu_centres = KeyCentring(table.cuda(), index.cuda(), new.cuda()) if centred else None
    cpu_centres = KeyCentring(table.clone(), index, new) if centred else None
    qm = torch.empty_like(q) if centred else None
    out_q = rotate_and_store_kv(q, k, v, positions, cos_sin, gpu_c[0][0], gpu_c[1][0], slots, gpu_c[0][1], gpu_c[1][1],
                                gpu_centres, qm)
    ref_q = rotate_and_store_kv_ref(q.cpu().float(), k.cpu().float(), v.cpu().float(), positions.cpu(), cos_sin.cpu(),
                                    cpu_c[0][0], cpu_c[1][0], slots.cpu(), cpu_c[0][1], cpu_c[1][1], cpu_centres)
    assert_close(out_q.float().cpu(), ref_q, GPU_TOL[dtype])
    if centred:
        assert_close(qm.float().cpu(), apply_rotary(q.cpu().float(), k.cpu().float(), positions.cpu(),
                                                    cos_sin.cpu())[0], GPU_TOL[dtype])
        ref_table = cpu_centres.table.float()
        near = (gpu_centres.table.float().cpu() - ref_table).abs() <= 2e-2 * (1 + ref_table.abs())
        assert near.float().mean() > 0.99

    # The rotation itself rounds to the model's dtype on the GPU: compare the keys they read back
    # (with their centres added back: each side's own).
    keep = slots.cpu() >= 0
    written = slots.cpu()[keep]
    for (gc, gs), (cc, cs), kind in zip(gpu_c, cpu_c, ("keys", "values")):
        g = dequantize_kv_ref(gc.cpu().view(-1, hkv, gc.shape[-1])[written], gs.cpu().view(-1, hkv, 2)[written], bits)
        c = dequantize_kv_ref(cc.view(-1, hkv, cc.shape[-1])[written], cs.view(-1, hkv, 2)[written], bits)
        if centred and kind == "keys":
            pos = positions.cpu()[keep]
            g += key_shifts_ref(gpu_centres.table.cpu(), index[keep], pos, cos_sin.cpu())
            c += key_shifts_ref(cpu_centres.table, index[keep], pos, cos_sin.cpu())
        step = cs.view(-1, hkv, 2)[written][..., 0:1].float()
        assert ((g - c).abs() <= 1.01 * step + 0.02 * c.abs()).float().mean() > 0.999
    # store_kv (keys as given, uncentred) writes what the reference writes.
    a = _caches(bits, blocks, bs, hkv, d, 2, "cuda")
    b = _caches(bits, blocks, bs, hkv, d, 2)
    store_kv(k, v, a[0][0], a[1][0], slots, a[0][1], a[1][1])
    store_kv_ref(k.cpu(), v.cpu(), b[0][0], b[1][0], slots.cpu(), b[0][1], b[1][1])
    for x, y in zip(a, b):
        assert_same_codes((x[0].cpu(), x[1].cpu()), y, bits, exact=False)
