"""Inline PTX that turns quantized KV codes into floats in registers (the magic-number trick),
as Triton ``tl.constexpr`` strings for ``tl.inline_asm_elementwise`` (``codes.py`` uses them).
Built as Python strings so the variants (biased or not, fp16 / bf16 / fp32, int8 / int4) share
one template each."""

from .._triton import HAS_TRITON, tl


_asm = tl.constexpr if HAS_TRITON else str  # jitted code reads only constexpr globals

# Codes to 16-bit floats on the GPU, four codes (one 32-bit word) per asm block, by the magic
# number trick: a byte placed under the fp16 exponent of 1024 (0x64) reads as 1024 + c, one byte
# permute per two codes. The *_BIASED forms stop there (the kernel subtracts 1024 x the dot's
# other operand's sum once instead); the others subtract 1024 with one packed instruction. Not
# runnable under the interpreter: the launcher passes FAST=False there, and the portable twin
# (_codes_as) runs instead.
def _u8_to_f16(biased: bool) -> str:
    # Unbiased: one packed subtraction of 1024 per two codes more.
    regs, setup, sub = ("k", "", "") if biased else (
        "k, m", "mov.b32 m, 0x64006400;\n", "sub.f16x2 $0, $0, m;\nsub.f16x2 $1, $1, m;\n")
    return f"""{{
.reg .b32 {regs};
mov.b32 k, 0x64646464;
{setup}prmt.b32 $0, $2, k, 0x4140;
prmt.b32 $1, $2, k, 0x4342;
{sub}}}"""


_U8_TO_F16_BIASED = _asm(_u8_to_f16(biased=True))
_U8_TO_F16 = _asm(_u8_to_f16(biased=False))
# bf16 has too few mantissa bits for a byte under one exponent: 2**23 + c in fp32, then packed.
_U8_TO_BF16 = _asm("""{
.reg .b32 k, f0, f1, f2, f3;
mov.b32 k, 0x4B000000;
prmt.b32 f0, $2, k, 0x7440;
prmt.b32 f1, $2, k, 0x7441;
prmt.b32 f2, $2, k, 0x7442;
prmt.b32 f3, $2, k, 0x7443;
sub.f32 f0, f0, 0f4B000000;
sub.f32 f1, f1, 0f4B000000;
sub.f32 f2, f2, 0f4B000000;
sub.f32 f3, f3, 0f4B000000;
cvt.rn.bf16x2.f32 $0, f1, f0;
cvt.rn.bf16x2.f32 $1, f3, f2;
}""")
# int4: $0,$1 the low nibbles, $2,$3 the high ones; each byte's two nibbles spread into the two
# halves of a word first. fp16: the low nibble under 0x6400 is 1024 + n; the high one, masked in
# place, 1024 + 16 n, which one fma brings to 1024 + n (biased) or n.
def _u4_to_f16(biased: bool) -> str:
    # The high nibbles' fma lands on 1024 + n (biased) or n; unbiased, the low ones lose 1024 too.
    sub = "" if biased else "sub.f16x2 $0, $0, k;\nsub.f16x2 $1, $1, k;\n"
    return f"""{{
.reg .b32 z, t0, t1, k, s, o;
mov.b32 z, 0;
mov.b32 k, 0x64006400;
mov.b32 s, 0x2C002C00;
mov.b32 o, {'0x63806380' if biased else '0xD400D400'};
prmt.b32 t0, $4, z, 0x4140;
prmt.b32 t1, $4, z, 0x4342;
lop3.b32 $0, t0, 0x000F000F, k, 0xEA;
lop3.b32 $1, t1, 0x000F000F, k, 0xEA;
lop3.b32 $2, t0, 0x00F000F0, k, 0xEA;
lop3.b32 $3, t1, 0x00F000F0, k, 0xEA;
{sub}fma.rn.f16x2 $2, $2, s, o;
fma.rn.f16x2 $3, $3, s, o;
}}"""


_U4_TO_F16_BIASED = _asm(_u4_to_f16(biased=True))
_U4_TO_F16 = _asm(_u4_to_f16(biased=False))
# bf16: 128 + n under 0x4300 (exact for n < 128), the high nibbles shifted down first.
_U4_TO_BF16 = _asm("""{
.reg .b32 z, t0, t1, u0, u1, k, one, o;
mov.b32 z, 0;
mov.b32 k, 0x43004300;
mov.b32 one, 0x3F803F80;
mov.b32 o, 0xC300C300;
prmt.b32 t0, $4, z, 0x4140;
prmt.b32 t1, $4, z, 0x4342;
shr.b32 u0, t0, 4;
shr.b32 u1, t1, 4;
lop3.b32 $0, t0, 0x000F000F, k, 0xEA;
lop3.b32 $1, t1, 0x000F000F, k, 0xEA;
lop3.b32 $2, u0, 0x000F000F, k, 0xEA;
lop3.b32 $3, u1, 0x000F000F, k, 0xEA;
fma.rn.bf16x2 $0, $0, one, o;
fma.rn.bf16x2 $1, $1, one, o;
fma.rn.bf16x2 $2, $2, one, o;
fma.rn.bf16x2 $3, $3, one, o;
}""")
# Codes to fp32 for the CUDA-core decode kernel (_decode_simt_kernel): a byte placed under the fp32
# exponent of 2**23 (0x4B000000) reads as 2**23 + c, taken back by one subtraction (a plain
# int-to-float conversion runs at a quarter of the rate). Four codes per 32-bit word; int4: the
# word's low nibbles and high nibbles, masked apart first.
def _bytes_to_f32(src: str, first: int) -> str:
    # The four bytes of register src into outputs $first.. $first+3, each 2**23 + c, then c.
    permutes = "".join(f"prmt.b32 ${first + i}, {src}, k, 0x744{i};\n" for i in range(4))
    return permutes + "".join(f"sub.f32 ${first + i}, ${first + i}, 0f4B000000;\n" for i in range(4))


_U8_TO_F32 = _asm("{\n.reg .b32 k;\nmov.b32 k, 0x4B000000;\n" + _bytes_to_f32("$4", 0) + "}")
_U4_TO_F32 = _asm("{\n.reg .b32 k, lo, hi;\nmov.b32 k, 0x4B000000;\nand.b32 lo, $8, 0x0F0F0F0F;\n"
                  "shr.u32 hi, $8, 4;\nand.b32 hi, hi, 0x0F0F0F0F;\n"
                  + _bytes_to_f32("lo", 0) + _bytes_to_f32("hi", 4) + "}")
