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
__device__ __forceinline__ float load_l2(const float* p) {  // other CTAs' partials: skip L1
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];\n" : "=f"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ float4 load_l2x4(const float* p) {
  float4 v;
  asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
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

// Programmatic dependent launch (sm_90): wait for the grids this one depends on (their writes
// visible); let dependents launch. Both are no-ops for a kernel launched without the attribute.
__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dependents_may_launch() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::);
#endif
}

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
// Split K's end, run by the tile's last CTA: out[m0 + r, n0 + c] = the splits' fp32 partials
// (part [splits, m, n]) added in split order, + bias. What keeps it short is loads in flight:
// a tile of up to 8 rows (decode) has a value or two a thread, and the compiler batches the
// loads of many splits (the loop below unrolls); a taller tile goes four columns a thread, U
// float4s of two splits at once, else it waits one L2 round trip per THREADS values
// (bench_w4a16_tc, session 27: 64-row tiles 20-40 % faster; the decode tile 10-30 % slower).
template <int THREADS, int COLS, int ROWS>
__device__ __forceinline__ void add_splits(const float* part, int splits, int m, int n, int m0, int n0,
                                           int rows_here, const u16* bias, u16* out, int ldo, int tid) {
  const long long step = (long long)m * n;
  if constexpr (ROWS <= 8) {
    for (int i = tid; i < rows_here * COLS; i += THREADS) {
      const int r = i / COLS, nn = n0 + i % COLS;
      const float* p = part + (long long)(m0 + r) * n + nn;
      float v = 0.f;
      for (int s = 0; s < splits; ++s) v += load_l2(p + s * step);
      if (bias) v += h2f(bias[nn]);
      out[(long long)(m0 + r) * ldo + nn] = f2h(v);
    }
  } else {
    constexpr int Q = COLS / 4, U = 4;  // float4s a row; a thread's float4s a round
    static_assert(COLS % 4 == 0, "COLS: a multiple of 4");
    for (int base = 0; base < rows_here * Q; base += U * THREADS) {
      float4 v[U];
      long long off[U];
      bool ok[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = base + u * THREADS + tid;
        ok[u] = i < rows_here * Q;
        off[u] = ok[u] ? (long long)(m0 + i / Q) * n + n0 + (i % Q) * 4 : 0;
        v[u] = ok[u] ? load_l2x4(part + off[u]) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
      for (int s = 1; s < splits; s += 2) {
        const bool two = s + 1 < splits;
        float4 a[U], b[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (ok[u]) a[u] = load_l2x4(part + s * step + off[u]);
          if (ok[u] && two) b[u] = load_l2x4(part + (s + 1) * step + off[u]);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (ok[u]) v[u].x += a[u].x, v[u].y += a[u].y, v[u].z += a[u].z, v[u].w += a[u].w;
          if (ok[u] && two) v[u].x += b[u].x, v[u].y += b[u].y, v[u].z += b[u].z, v[u].w += b[u].w;
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (!ok[u]) continue;
        const int i = base + u * THREADS + tid, r = i / Q, nn = n0 + (i % Q) * 4;
        float f[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
        if (bias)
#pragma unroll
          for (int e = 0; e < 4; ++e) f[e] += h2f(bias[nn + e]);
        u16* o = out + (long long)(m0 + r) * ldo + nn;
#pragma unroll
        for (int e = 0; e < 4; ++e) o[e] = f2h(f[e]);
      }
    }
  }
}

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
  // A stage's copies in two parts: what no earlier kernel writes (weights, scales, zeros) and x,
  // which the kernel before this one may still be writing (see the prologue).
  auto load_weights = [&](int slot) {
    const u32 base = sbase + slot * STAGE_BYTES;
#pragma unroll
    for (int r = 0; r < (W_CHUNKS + THREADS - 1) / THREADS; ++r)
      if (W_CHUNKS % THREADS == 0 || tid + r * THREADS < W_CHUNKS)
        cp_async16(base + (tid + r * THREADS) * 16, wsrc + r * THREADS, true);
    if (tid < S_CHUNKS) cp_async16(base + W_BYTES + X_BYTES + tid * 16, ssrc, true);
    if (tid < Z_CHUNKS) cp_async16(base + W_BYTES + X_BYTES + S_BYTES + tid * 16, zsrc, true);
    wsrc += w_stride;
    if (--load_left == 0) {
      load_left = group_stages;
      ssrc += n;
      zsrc += n;
    }
  };
  auto load_x = [&](int slot) {
    const u32 base = sbase + slot * STAGE_BYTES;
#pragma unroll
    for (int r = 0; r < XPT; ++r) {
      // ldmatrix reads every row, so rows past m are zero-filled; with one 8-row group a warp the
      // lanes of rows past m read nothing (b = 0 below), so those rows are left alone.
      if ((X_CHUNKS % THREADS == 0 || tid + r * THREADS < X_CHUNKS) && (MW > 1 || xok[r]))
        cp_async16(base + xdst[r], xsrc[r], xok[r]);
      xsrc[r] += xok[r] ? STAGE_K : 0;
    }
  };
  auto load_stage = [&](int slot) {
    load_weights(slot);
    load_x(slot);
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

  // Prologue. Launched with programmatic dependent launch (``_cuda.launch(pdl=True)``), this CTA
  // may start while the kernel before it still runs: the weights of the first stages are
  // requested before waiting for that kernel, x after. The first commit group then holds every
  // prologue weight copy and stage 0's x, the next ones one stage's x each, so waiting for group
  // s still means stage s has landed. Without such a launch the wait returns at once.
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s)
    if (s < iters) load_weights(s);
  grid_dependency_wait();
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < iters) load_x(s);
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
  grid_dependents_may_launch();  // this CTA reads nothing more: a dependent kernel may start

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
  add_splits<THREADS, N_TILE, ROWS>(part, splits, m, n, m0, n_tile0, rows_here, bias, out, ldo, tid);
  if (tid == 0) *counter = 0;
}

// ----------------------------------------------------------------------------------------------
// Warp-group MMAs (Hopper, sm_90a): the same product for 16-127 rows. One CTA is one warp group
// (4 warps) and an output tile of 64 columns by ROWS rows of x. The weights enter wgmma as its
// register A operand: warp w holds columns 16 w .. 16 w + 15 of the tile, and a repacked word is
// already that warp's A fragment (wgmma's m64 A is four mma.m16n8k16 A fragments, one a warp).
// x enters through a shared-memory descriptor: each stage's ROWS x 64 halves as 128-byte rows in
// the 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)), so the k16 steps of a
// stage are the descriptor's start moved by 32 bytes. The products are asynchronous: a stage's
// four wgmmas run while the threads issue the next stages' copies and dequantize the next stage
// into the other of two fragment buffers: the wait lets one group run on, so a slot is refilled
// two stages after its wgmmas were issued and the copies run STAGES - 2 stages ahead (waiting
// for every group instead was 5-30 % slower in bench_w4a16_tc, session 27). Scales multiply the fp16
// fragments (scale sums would need a wait each group). Compiled only for sm_90a (the arch-
// specific features), as the W4A16_WGMMA guard says: the warp-group module (W4A16_REQUIRE_WGMMA)
// refuses any other target, and the mma.sync module never instantiates this kernel.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define W4A16_WGMMA 1
#elif defined(W4A16_REQUIRE_WGMMA) && defined(__CUDA_ARCH__)
// The warp-group module is built with this defined: a target without the sm_90a features (a
// compiler that swapped the arch) fails here rather than leaving the kernel an empty body.
#error "w4a16_wg_gemm needs the sm_90a target"
#endif

// The descriptor of a 128-byte-swizzled, K-major tile at shared address `saddr` (1024-aligned
// atoms of 8 rows): start address >> 4, leading offset 1 (unused in this mode), stride 1024 bytes
// between 8-row groups, swizzle mode 1 (128 B).
__device__ __forceinline__ unsigned long long wg_desc(u32 saddr) {
  return (unsigned long long)((saddr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory"); }
// Copies made by threads (cp.async) become visible to the asynchronous proxy that wgmma reads with.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// d[ROWS / 2] += A (this warp's 16 x 16 fragment, registers) x B (16 x ROWS, descriptor).
template <int ROWS>
struct Wgmma;
template <>
struct Wgmma<32> {
  static __device__ __forceinline__ void run(float (&d)[16], const u32 a[4], unsigned long long desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
  }
};
template <>
struct Wgmma<64> {
  static __device__ __forceinline__ void run(float (&d)[32], const u32 a[4], unsigned long long desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
  }
};
template <>
struct Wgmma<128> {
  static __device__ __forceinline__ void run(float (&d)[64], const u32 a[4], unsigned long long desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
  }
};

constexpr int WG_COLS = 64;  // output columns a CTA (one warp group, a 16-column tile a warp)

template <int ROWS>
__host__ __device__ constexpr int wg_stage_bytes() {  // x (swizzled), weights, scales, zeros; 1024-aligned
  return ((ROWS * 128 + 4 * 32 * 16 + WG_COLS * 2 + WG_COLS) + 1023) / 1024 * 1024;
}

template <int ROWS, int STAGES>
__global__ void __launch_bounds__(128)
w4a16_wg_gemm(const u16* __restrict__ x, int m, int ldx,
              const U4* __restrict__ qw, const u16* __restrict__ scales, const u8* __restrict__ zeros,
              const u16* __restrict__ bias, u16* __restrict__ out, int ldo,
              float* __restrict__ part, int* __restrict__ counters,
              int n, int k, int group_stages, int stages_per_split) {
#ifdef W4A16_WGMMA
  // LAG: wgmma groups left running at a stage's end. The ring then holds LAG slots being read,
  // the stage being issued and AHEAD stages in flight from global memory.
  constexpr int LAG = 1, AHEAD = STAGES - 1 - LAG;
  static_assert(ROWS % 16 == 0 && AHEAD >= 1, "ROWS: a multiple of 16 (x copies a thread)");
  static_assert(STAGES % 2 == 0, "two fragment buffers alternate with the stage's slot");
  constexpr int X_BYTES = ROWS * 128, W_BYTES = 4 * 32 * 16, S_BYTES = WG_COLS * 2;
  constexpr int STAGE_BYTES = wg_stage_bytes<ROWS>();
  constexpr int XPT = ROWS * 8 / 128;  // x chunks a thread a stage
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int is_last;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g4 = lane / 4, t4 = lane % 4;
  const int n0 = blockIdx.x * WG_COLS, split = blockIdx.y, splits = gridDim.y, m0 = blockIdx.z * ROWS;
  const int n_stages = k / STAGE_K;
  const int st_begin = split * stages_per_split;
  const int iters = imax(0, imin(n_stages, st_begin + stages_per_split) - st_begin);
  // The ring starts at the first 1024-byte boundary (the launcher adds 1024 bytes for it).
  const u32 sraw = smem_addr(smem), sbase = (sraw + 1023) & ~1023u;
  const unsigned char* gbase = smem + (sbase - sraw);

  // Copies: x rows (swizzled), one weight chunk a thread (warp w's tile, its lane's word),
  // the tile's 64 scales (8 chunks) and zeros (4 chunks) when a group begins.
  const int g_first = st_begin / group_stages;
  const U4* wsrc = qw + ((long long)st_begin * (n / 16) + n0 / 16) * 32 + tid;
  const long long w_stride = (long long)(n / 16) * 32;
  const u16* xsrc[XPT];
  bool xok[XPT];
  int xdst[XPT];
#pragma unroll
  for (int r = 0; r < XPT; ++r) {
    const int i = tid + r * 128, row = i / 8, c = i % 8;
    xok[r] = m0 + row < m;
    xsrc[r] = xok[r] ? x + (long long)(m0 + row) * ldx + st_begin * STAGE_K + c * 8 : x;
    xdst[r] = row * 128 + ((c ^ (row % 8)) * 16);
  }
  const u16* ssrc = scales + (long long)g_first * n + n0 + tid * 8;
  const u8* zsrc = zeros + (long long)g_first * n + n0 + tid * 16;
  int load_left = group_stages - st_begin % group_stages;
  auto load_stage = [&](int slot) {
    const u32 base = sbase + slot * STAGE_BYTES;
#pragma unroll
    for (int r = 0; r < XPT; ++r) {
      cp_async16(base + xdst[r], xsrc[r], xok[r]);  // rows past m: zeros
      xsrc[r] += xok[r] ? STAGE_K : 0;
    }
    cp_async16(base + X_BYTES + tid * 16, wsrc, true);
    if (tid < 8) cp_async16(base + X_BYTES + W_BYTES + tid * 16, ssrc, true);
    if (tid < 4) cp_async16(base + X_BYTES + W_BYTES + S_BYTES + tid * 16, zsrc, true);
    wsrc += w_stride;
    if (--load_left == 0) {
      load_left = group_stages;
      ssrc += n;
      zsrc += n;
    }
  };

  float d[ROWS / 2];
#pragma unroll
  for (int i = 0; i < ROWS / 2; ++i) d[i] = 0.f;
#pragma unroll
  for (int s = 0; s < AHEAD; ++s) {
    if (s < iters) load_stage(s);
    cp_async_commit();
  }
  u32 zlo = 0, sa = 0, nzhi = 0, sb = 0;
  u32 a[2][4][4];  // this stage's fragments and the running group's
  int left = group_stages - st_begin % group_stages;
  const int ca = warp * 16 + g4;  // this thread's columns in the tile: ca and ca + 8
  for (int it0 = 0; it0 < iters; it0 += STAGES) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      const int it = it0 + s;
      if (it < iters) {
        cp_async_wait<AHEAD - 1>();
        fence_proxy_async();
        // Stage `it` is in for every thread, and every thread has waited for the wgmmas of stage
        // it - 1 - LAG: its slot, (s + AHEAD) % STAGES, takes stage it + AHEAD.
        __syncthreads();
        if (it + AHEAD < iters) load_stage((s + AHEAD) % STAGES);
        cp_async_commit();
        const unsigned char* base = gbase + s * STAGE_BYTES;
        if (it == 0 || left == group_stages) {
          const u16* ss = (const u16*)(base + X_BYTES + W_BYTES);
          const u8* sz = base + X_BYTES + W_BYTES + S_BYTES;
          zlo = dup_half((u16)(0x6400u | sz[ca]));
          nzhi = dup_half((u16)(0xd400u + (sz[ca + 8] << 4)));
          sa = dup_half(ss[ca]);
          sb = dup_half(ss[ca + 8]);
        }
        if (--left == 0) left = group_stages;
        const U4 w = *(const U4*)(base + X_BYTES + tid * 16);
        u32 (&f)[4][4] = a[s % 2];  // not the running group's
        dequant<true>(w.x, zlo, sa, nzhi, sb, f[0]);
        dequant<true>(w.y, zlo, sa, nzhi, sb, f[1]);
        dequant<true>(w.z, zlo, sa, nzhi, sb, f[2]);
        dequant<true>(w.w, zlo, sa, nzhi, sb, f[3]);
        const u32 xs = sbase + s * STAGE_BYTES;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) Wgmma<ROWS>::run(d, f[kk], wg_desc(xs + kk * 32));
        wg_commit();
        wg_wait<LAG>();  // the group before this one is done: its fragments and slot are free
      }
    }
  }
  cp_async_wait<0>();
  wg_wait<0>();

  // d[4 j + e] is out^T's row n0 + 16 warp + g4 (+8 for e >= 2) and column (row of x)
  // 8 j + 2 t4 + (e & 1), as mma.m16n8's C fragment repeated along the rows.
  auto each_sum = [&](auto f) {
#pragma unroll
    for (int j = 0; j < ROWS / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) f(n0 + ca + (e >= 2 ? 8 : 0), 8 * j + 2 * t4 + (e & 1), d[4 * j + e]);
  };
  // The same end as w4a16_tc_gemm's, written again on purpose: as one shared device function it
  // changed the mma.sync kernels' main-loop code (+24 SASS instructions from other if-conversion,
  // nvcc 13), which is not to land without a GPU A/B.
  const int rows_here = imin(ROWS, m - m0);
  if (splits == 1) {
    each_sum([&](int nn, int r, float v) {
      if (r < rows_here) out[(long long)(m0 + r) * ldo + nn] = f2h(bias ? v + h2f(bias[nn]) : v);
    });
    return;
  }
  float* mine = part + ((long long)split * m + m0) * n;
  each_sum([&](int nn, int r, float v) {
    if (r < rows_here) mine[(long long)r * n + nn] = v;
  });
  __threadfence();
  __syncthreads();
  int* counter = counters + blockIdx.z * gridDim.x + blockIdx.x;
  if (tid == 0) is_last = atomicAdd(counter, 1) == splits - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  add_splits<128, WG_COLS, ROWS>(part, splits, m, n, m0, n0, rows_here, bias, out, ldo, tid);
  if (tid == 0) *counter = 0;
#endif
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
