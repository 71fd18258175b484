// W4A16 on tensor cores: y[m, n] = sum_k x[m, k] * (q[k, n] - z[g, n]) * s[g, n], fp16.
//
// Compiled at run time by NVRTC (cupy.RawModule; kernels/_cuda.py) with no header at all: half
// arithmetic is written in PTX, so the user's machine needs no CUDA toolkit beyond cupy's wheel.
// kernels/w4a16/tc.py documents the layouts and the launch; in short:
//
// * The product is computed transposed, out^T = W^T x^T, with mma.m16n8k16: the weight supplies
//   the MMA's 16-row A operand (16 output columns) and x the 8-wide B operand (8 rows of x), so a
//   decode step of one row wastes 7/8 of an MMA, not 15/16.
// * The weight is repacked at load (tc.py, ``tc_repack``) so that one int32 read by a lane IS its
//   A fragment for a 16 (n) x 16 (k) tile: nibbles 0/4 -> a0a1, 1/5 -> a2a3, 2/6 -> a4a5, 3/7 ->
//   a6a7. One AND-OR (LOP3) with 0x64006400 turns two nibbles into the fp16 pair (1024 + q) (or
//   1024 + 16q for the upper nibble of a byte), one HSUB2/HFMA2 makes q - z exactly, one HMUL2
//   applies the group's scale: the fp16 weight dequantize_awq_ref gives, without a table.
// * A lane's 4 words of one 64-deep K stage are 16 contiguous bytes; one n16 column tile of a
//   stage is 512 contiguous bytes, and a CTA's N_TILE columns of a stage one contiguous block.
// * Stages of 64 K rows stream through shared memory with cp.async (STAGES deep), weights, x rows
//   (rows past m zero-filled), and the stage's group of scales and zeros (64 divides the group).
// * K is split over gridDim.y; the last CTA of a tile to arrive (a counter per tile) adds the
//   fp32 partials in split order (deterministic) and writes fp16; counters are left at zero.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

struct __align__(16) U4 { u32 x, y, z, w; };

__device__ __forceinline__ u32 lop3_and_or(u32 a, u32 b, u32 c) {
  u32 d;  // (a & b) | c
  asm volatile("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ u32 hsub2(u32 a, u32 b) {
  u32 d;
  asm("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
  u32 d;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
  u32 d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ float h2f(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ u16 f2h(float f) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;\n" : "=h"(h) : "f"(f));
  return h;
}
__device__ __forceinline__ u32 dup_half(u16 h) { return (u32)h | ((u32)h << 16); }


__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }\n" : "=r"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ float load_l2(const float* p) {  // another CTA's partial: skip L1
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];\n" : "=f"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool fill) {
  // dst: a shared-memory address (smem_addr). src-size 0 writes 16 zero bytes (rows of x past
  // m); src must still be a valid address.
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(fill ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(u32 r[4], u32 addr) {  // addr: shared (smem_addr)
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2(u32 r[2], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr(p)));
}

__device__ __forceinline__ void mma_16816(float c[4], const u32 a[4], const u32 b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// One lane's A fragment of a 16 x 16 weight tile from its packed word: q - z in fp16 (exact),
// times the group's scale unless SCALED is false (the scale is then applied to the fp32 sums of
// the group). Nibbles 0/4 and 2/6 are column g (rows a0a1, a4a5), 1/5 and 3/7 column g + 8 (a2a3,
// a6a7); ``zlo_*`` is (1024 + z), ``nzhi_*`` is -(64 + z), ``s_*`` the scale, each in both halves.
template <bool SCALED>
__device__ __forceinline__ void dequant(u32 q, u32 zlo_a, u32 s_a, u32 nzhi_b, u32 s_b, u32 a[4]) {
  const u32 MAGIC = 0x64006400u, LO = 0x000f000fu, HI = 0x00f000f0u;
  const u32 SIXTEENTH = 0x2c002c00u;  // fp16 1/16 in both halves
  u32 lo0 = lop3_and_or(q, LO, MAGIC);
  u32 hi0 = lop3_and_or(q, HI, MAGIC);
  q >>= 8;
  u32 lo1 = lop3_and_or(q, LO, MAGIC);
  u32 hi1 = lop3_and_or(q, HI, MAGIC);
  a[0] = hsub2(lo0, zlo_a);
  a[1] = hfma2(hi0, SIXTEENTH, nzhi_b);
  a[2] = hsub2(lo1, zlo_a);
  a[3] = hfma2(hi1, SIXTEENTH, nzhi_b);
  if constexpr (SCALED) {
    a[0] = hmul2(a[0], s_a);
    a[1] = hmul2(a[1], s_b);
    a[2] = hmul2(a[2], s_a);
    a[3] = hmul2(a[3], s_b);
  }
}

constexpr int STAGE_K = 64;        // K rows per pipeline stage
constexpr int X_ROW = STAGE_K + 8;  // halves per x row in shared memory: 144 bytes, conflict-free ldmatrix

template <int WARPS>
__device__ __forceinline__ void block_sync() {
  if constexpr (WARPS == 1) __syncwarp(); else __syncthreads();
}

// M8: 8-row groups of x per CTA; NW: 16-column tiles per warp; WARPS per CTA, WM of them along
// the rows (each warp then takes M8 / WM of the 8-row groups: 1 or an even number; more warps
// along the rows let one CTA cover many rows without each warp reading all of x's fragments),
// the others along the columns (one warp: its own pipeline, no block barrier). SCALE_SUMS: the scales multiply each group's fp32
// sums (4 FMAs a tile per group, and 4 more registers a tile for the group's sums) instead of
// the fragments (4 HMUL2s per word, whose products are then reused over M8 MMAs).
template <int M8, int NW, int WARPS, int WM, int STAGES, bool SCALE_SUMS>
__global__ void __launch_bounds__(WARPS * 32)
w4a16_tc_gemm(const u16* __restrict__ x, int m, int ldx,
              const U4* __restrict__ qw, const u16* __restrict__ scales, const u8* __restrict__ zeros,
              const u16* __restrict__ bias, u16* __restrict__ out, int ldo,
              float* __restrict__ part, int* __restrict__ counters,
              int n, int k, int group_stages, int stages_per_split) {
  constexpr int THREADS = WARPS * 32;
  constexpr int WN = WARPS / WM;                // warps along the columns
  constexpr int MW = M8 / WM;                   // 8-row groups per warp
  static_assert(WN * WM == WARPS && MW * WM == M8 && (MW == 1 || MW % 2 == 0), "warp grid");
  constexpr int N_TILE = WN * NW * 16;
  constexpr int ROWS = M8 * 8;
  constexpr int W_CHUNKS = N_TILE * 2;          // 16-byte chunks of weights per stage (N_TILE / 16 * 32)
  constexpr int X_CHUNKS = ROWS * (STAGE_K / 8);
  constexpr int S_CHUNKS = N_TILE / 8;          // scales: 8 halves a chunk
  constexpr int Z_CHUNKS = N_TILE / 16;         // zeros: 16 bytes a chunk
  constexpr int W_BYTES = W_CHUNKS * 16;
  constexpr int X_BYTES = ROWS * X_ROW * 2;
  constexpr int S_BYTES = N_TILE * 2;
  constexpr int Z_BYTES = N_TILE;
  constexpr int STAGE_BYTES = W_BYTES + X_BYTES + S_BYTES + Z_BYTES;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int is_last;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int wn = warp % WN, row0 = (warp / WN) * MW * 8;  // this warp's first tile and first row
  const int n_tile0 = blockIdx.x * N_TILE;
  const int split = blockIdx.y, splits = gridDim.y;
  const int m0 = blockIdx.z * ROWS;
  const int n_stages = k / STAGE_K;
  const int st_begin = split * stages_per_split;
  const int st_end = imin(n_stages, st_begin + stages_per_split);
  const int iters = imax(0, st_end - st_begin);

  // Each thread copies the same chunks of every stage: their addresses are set up once and moved
  // by a stage's stride (a stage's weights lie N / 16 * 512 bytes further; x 64 columns; scales
  // and zeros a row further when a group begins).
  constexpr int XPT = (X_CHUNKS + THREADS - 1) / THREADS;
  const int g_first = st_begin / group_stages;
  const U4* wsrc = qw + ((long long)st_begin * (n / 16) + n_tile0 / 16) * 32 + tid;
  const long long w_stride = (long long)(n / 16) * 32;
  const u16* xsrc[XPT];
  bool xok[XPT];
#pragma unroll
  for (int r = 0; r < XPT; ++r) {
    const int i = tid + r * THREADS, row = i / (STAGE_K / 8), c = i % (STAGE_K / 8);
    xok[r] = (X_CHUNKS % THREADS == 0 || i < X_CHUNKS) && m0 + row < m;
    xsrc[r] = xok[r] ? x + (long long)(m0 + row) * ldx + st_begin * STAGE_K + c * 8 : x;
  }
  const u16* ssrc = scales + (long long)g_first * n + n_tile0 + tid * 8;
  const u8* zsrc = zeros + (long long)g_first * n + n_tile0 + tid * 16;
  int load_left = group_stages - st_begin % group_stages;  // stages the loads have left in their group

  // The copies' shared-memory destinations as 32-bit addresses, set up once: a slot adds a
  // constant (no generic-to-shared conversion and 64-bit arithmetic in every stage).
  const u32 sbase = smem_addr(smem);
  int xdst[XPT];
#pragma unroll
  for (int r = 0; r < XPT; ++r) {
    const int i = tid + r * THREADS, row = i / (STAGE_K / 8), c = i % (STAGE_K / 8);
    xdst[r] = W_BYTES + (row * X_ROW + c * 8) * 2;
  }
  auto load_stage = [&](int slot) {
    const u32 base = sbase + slot * STAGE_BYTES;
#pragma unroll
    for (int r = 0; r < (W_CHUNKS + THREADS - 1) / THREADS; ++r)
      if (W_CHUNKS % THREADS == 0 || tid + r * THREADS < W_CHUNKS)
        cp_async16(base + (tid + r * THREADS) * 16, wsrc + r * THREADS, true);
#pragma unroll
    for (int r = 0; r < XPT; ++r) {
      // ldmatrix reads every row, so rows past m are zero-filled; with one 8-row group a warp the
      // lanes of rows past m read nothing (b = 0 below), so those rows are left alone.
      if ((X_CHUNKS % THREADS == 0 || tid + r * THREADS < X_CHUNKS) && (MW > 1 || xok[r]))
        cp_async16(base + xdst[r], xsrc[r], xok[r]);
      xsrc[r] += xok[r] ? STAGE_K : 0;
    }
    if (tid < S_CHUNKS) cp_async16(base + W_BYTES + X_BYTES + tid * 16, ssrc, true);
    if (tid < Z_CHUNKS) cp_async16(base + W_BYTES + X_BYTES + S_BYTES + tid * 16, zsrc, true);
    wsrc += w_stride;
    if (--load_left == 0) {
      load_left = group_stages;
      ssrc += n;
      zsrc += n;
    }
  };

  float acc[NW][MW][4];
  float grp[SCALE_SUMS ? NW : 1][MW][4];  // this group's unscaled sums (SCALE_SUMS)
#pragma unroll
  for (int j = 0; j < NW; ++j)
#pragma unroll
    for (int i = 0; i < MW; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        acc[j][i][e] = 0.f;
        if constexpr (SCALE_SUMS) grp[j][i][e] = 0.f;
      }

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < iters) load_stage(s);
    cp_async_commit();
  }

  const int g4 = lane / 4, t4 = lane % 4;
  // Shared-memory offsets this thread reads in every stage, in bytes from the stage's start (the
  // stage's own offset is a constant in the unrolled loop below, so each read is one LDS with an
  // immediate): its weight words, its x fragments, its columns' scales and zeros.
  const int w_off = ((wn * NW) * 32 + lane) * 16;
  const int xb_off = W_BYTES + ((row0 + g4) * X_ROW) * 2 + t4 * 4;  // one 8-row group: plain loads
  const bool x_live = m0 + row0 + g4 < m;
  int ldm_off[MW / 2 > 0 ? MW / 2 : 1];  // ldmatrix rows of each 16-row pair
#pragma unroll
  for (int p = 0; p < MW / 2; ++p)
    ldm_off[p] = W_BYTES + ((row0 + p * 16 + (lane / 16) * 8 + lane % 8) * X_ROW + ((lane / 8) % 2) * 8) * 2;
  const int s_off = W_BYTES + X_BYTES + ((wn * NW) * 16 + g4) * 2;
  const int z_off = W_BYTES + X_BYTES + S_BYTES + (wn * NW) * 16 + g4;

  u32 zlo[NW], sa[NW], nzhi[NW], sb[NW];
  int left = group_stages - st_begin % group_stages;  // stages the compute has left in its group

  // One stage's products, from the ring slot at `base` (`saddr` as a shared address; both a
  // constant offset where it is called).
  auto compute_stage = [&](const unsigned char* base, u32 saddr, int it) {
    if (it == 0 || left == group_stages) {  // a group begins: its zeros and scales, as fp16 pairs
#pragma unroll
      for (int j = 0; j < NW; ++j) {
        const u16* ss = (const u16*)(base + s_off) + j * 16;
        const u8* sz = base + z_off + j * 16;
        zlo[j] = dup_half((u16)(0x6400u | sz[0]));            // 1024 + z: mantissa z
        nzhi[j] = dup_half((u16)(0xd400u + (sz[8] << 4)));    // -(64 + z): 16 ulps per unit at 64
        sa[j] = dup_half(ss[0]);
        sb[j] = dup_half(ss[8]);
      }
    }
    U4 words[NW];
#pragma unroll
    for (int j = 0; j < NW; ++j) words[j] = *(const U4*)(base + w_off + j * 32 * 16);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      u32 b[MW][2];
      if constexpr (MW == 1) {  // b0b1: row g4, columns 2 t4 (+1); b2b3: 8 columns on
        const u32* row = (const u32*)(base + xb_off + kk * 32);
        b[0][0] = x_live ? row[0] : 0u;
        b[0][1] = x_live ? row[4] : 0u;
      } else {
#pragma unroll
        for (int p = 0; p < MW / 2; ++p) {
          u32 r4[4];
          ldmatrix_x4(r4, saddr + ldm_off[p] + kk * 32);
          b[2 * p][0] = r4[0];
          b[2 * p][1] = r4[1];
          b[2 * p + 1][0] = r4[2];
          b[2 * p + 1][1] = r4[3];
        }
      }
#pragma unroll
      for (int j = 0; j < NW; ++j) {
        const u32 q = kk == 0 ? words[j].x : kk == 1 ? words[j].y : kk == 2 ? words[j].z : words[j].w;
        u32 a[4];
        dequant<!SCALE_SUMS>(q, zlo[j], sa[j], nzhi[j], sb[j], a);
#pragma unroll
        for (int i = 0; i < MW; ++i) {
          if constexpr (SCALE_SUMS) mma_16816(grp[j][i], a, b[i]);
          else mma_16816(acc[j][i], a, b[i]);
        }
      }
    }
    if (--left == 0) left = group_stages;
    if constexpr (SCALE_SUMS) {
      if (left == group_stages || it + 1 == iters) {  // the group (or this split's part of it) ends
#pragma unroll
        for (int j = 0; j < NW; ++j) {
          const float fa = h2f((u16)(sa[j] & 0xffff)), fb = h2f((u16)(sb[j] & 0xffff));
#pragma unroll
          for (int i = 0; i < MW; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              acc[j][i][e] += grp[j][i][e] * (e >= 2 ? fb : fa);
              grp[j][i][e] = 0.f;
            }
        }
      }
    }
  };

  // The ring unrolled STAGES times: stage `it` lives in slot it % STAGES = s, a constant here, so
  // every shared-memory address above is an immediate offset.
  for (int it0 = 0; it0 < iters; it0 += STAGES) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      const int it = it0 + s;
      if (it < iters) {
        cp_async_wait<STAGES - 2>();
        block_sync<WARPS>();  // stage `it` has landed for every thread; slot (it - 1) % STAGES is free
        if (it + STAGES - 1 < iters) load_stage((s + STAGES - 1) % STAGES);
        cp_async_commit();
        compute_stage(smem + s * STAGE_BYTES, sbase + s * STAGE_BYTES, it);
      }
    }
  }
  cp_async_wait<0>();

  // acc[j][i][e] is out^T's row n = tile * 16 + g4 (+8 for e >= 2) and column (this CTA's row)
  // r = row0 + i * 8 + 2 * t4 + (e & 1): ``each_sum(f)`` calls f(n, r, sum) for all of them.
  auto each_sum = [&](auto f) {
#pragma unroll
    for (int j = 0; j < NW; ++j)
#pragma unroll
      for (int i = 0; i < MW; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          f(n_tile0 + (wn * NW + j) * 16 + g4 + (e >= 2 ? 8 : 0), row0 + i * 8 + 2 * t4 + (e & 1), acc[j][i][e]);
  };
  const int rows_here = imin(ROWS, m - m0);
  if (splits == 1) {
    each_sum([&](int nn, int r, float v) {
      if (r < rows_here) out[(long long)(m0 + r) * ldo + nn] = f2h(bias ? v + h2f(bias[nn]) : v);
    });
    return;
  }
  // Split K: park this split's partial sums, and let the tile's last CTA add them in order.
  float* mine = part + ((long long)split * m + m0) * n;
  each_sum([&](int nn, int r, float v) {
    if (r < rows_here) mine[(long long)r * n + nn] = v;
  });
  __threadfence();
  block_sync<WARPS>();
  int* counter = counters + blockIdx.z * gridDim.x + blockIdx.x;
  if (tid == 0) is_last = atomicAdd(counter, 1) == splits - 1;
  block_sync<WARPS>();
  if (!is_last) return;
  __threadfence();
  for (int i = tid; i < rows_here * N_TILE; i += THREADS) {
    const int r = i / N_TILE, nn = n_tile0 + i % N_TILE;
    const long long off = (long long)(m0 + r) * n + nn;
    float v = 0.f;
    for (int s = 0; s < splits; ++s) v += load_l2(part + (long long)s * m * n + off);
    if (bias) v += h2f(bias[nn]);
    out[(long long)(m0 + r) * ldo + nn] = f2h(v);
  }
  if (tid == 0) *counter = 0;
}

// The dense fp16 weight [K, N] from the repacked layout (for the large-M path: cuBLAS then
// multiplies). One CTA of 4 warps per (64-row stage, 64 columns): warp w turns the 16-column
// tile w into fp16 in shared memory, then the CTA writes the 64 rows of 128 bytes whole.
constexpr int DQ_COLS = 64;
__global__ void __launch_bounds__(128)
w4a16_tc_dequant(const U4* __restrict__ qw, const u16* __restrict__ scales, const u8* __restrict__ zeros,
                 u16* __restrict__ out, int n, int group_stages) {
  __shared__ __align__(16) u16 tile[STAGE_K][DQ_COLS + 8];  // +8: rows 144 bytes apart, fewer conflicts
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g4 = lane / 4, t4 = lane % 4;
  const int tn = blockIdx.x * (DQ_COLS / 16) + warp, st = blockIdx.y;
  const U4 w = qw[((long long)st * (n / 16) + tn) * 32 + lane];
  const long long g = st / group_stages;
  const int ca = tn * 16 + g4, cb = ca + 8, col = warp * 16 + g4;
  const u32 zlo = dup_half((u16)(0x6400u | zeros[g * n + ca]));
  const u32 nzhi = dup_half((u16)(0xd400u + (zeros[g * n + cb] << 4)));
  const u32 sa = dup_half(scales[g * n + ca]), sb = dup_half(scales[g * n + cb]);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const u32 q = kk == 0 ? w.x : kk == 1 ? w.y : kk == 2 ? w.z : w.w;
    u32 a[4];
    dequant<true>(q, zlo, sa, nzhi, sb, a);
    const int k0 = kk * 16 + 2 * t4;  // a[0]: rows k0, k0 + 1 of column g4; a[1]: of column g4 + 8; a[2], a[3]: rows + 8
    tile[k0][col] = (u16)(a[0] & 0xffff);
    tile[k0 + 1][col] = (u16)(a[0] >> 16);
    tile[k0][col + 8] = (u16)(a[1] & 0xffff);
    tile[k0 + 1][col + 8] = (u16)(a[1] >> 16);
    tile[k0 + 8][col] = (u16)(a[2] & 0xffff);
    tile[k0 + 9][col] = (u16)(a[2] >> 16);
    tile[k0 + 8][col + 8] = (u16)(a[3] & 0xffff);
    tile[k0 + 9][col + 8] = (u16)(a[3] >> 16);
  }
  __syncthreads();
  // 64 rows of 128 bytes: 8 threads a row, 16 bytes each.
#pragma unroll
  for (int i = tid; i < STAGE_K * DQ_COLS / 8; i += 128) {
    const int r = i / (DQ_COLS / 8), c = i % (DQ_COLS / 8);
    *(U4*)(out + ((long long)st * STAGE_K + r) * n + blockIdx.x * DQ_COLS + c * 8) = *(const U4*)&tile[r][c * 8];
  }
}
