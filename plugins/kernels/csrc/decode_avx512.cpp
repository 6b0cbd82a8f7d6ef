// Decode linears on x86 CPUs with AVX512-BF16 and AVX512-VNNI (see common.h for the scheme).
//   linear:      bf16 weights, vdpbf16ps with fp32 accumulation.
//   linear_int8: int8 weights (per-row scales), integer dot products (see FixedPointRows).
// oneDNN's packed GEMV streams ~28-33 GB/s on 2 cores here, where a plain read gets 31-61 GB/s;
// this kernel reads at 85-90 % of a plain read.
#include <immintrin.h>

#include "common.h"

namespace {

using namespace decode;

constexpr const char* ISA = "AVX512-BF16 / VNNI";

inline __m512bh load_bf16(const bf16* p, int64_t remaining) {
  if (remaining >= 32) return (__m512bh)_mm512_loadu_si512(p);
  return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1ull << remaining) - 1), p);  // zero-filled tail
}

inline __m512 load16_ps(const bf16* p, int64_t remaining) {  // 16 bf16 -> fp32, zero past `remaining`
  const __mmask16 keep = remaining >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << remaining) - 1);
  const __m256i raw = _mm256_maskz_loadu_epi16(keep, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// finish_row_scalar 16 outputs at a time; tanh(u) = 1 - 2 / (exp(2u) + 1) with exp from 2^n times a
// degree-6 polynomial on [-0.5, 0.5] (relative error ~1e-7, far below bf16's rounding); each
// output gets the same instructions wherever it falls, the last partial vector masked.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));  // x / ln 2
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));  // in [-0.35, 0.35]
  __m512 p = _mm512_set1_ps(1.0f / 720);
  for (float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

void finish_row(const float* dot, int64_t count, const bf16* scales, const bf16* bias, bool gelu, bf16* out) {
  for (int64_t i = 0; i < count; i += 16) {
    const __mmask16 keep = count - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (count - i)) - 1);
    __m512 v = _mm512_maskz_loadu_ps(keep, dot + i);
    if (scales) v = _mm512_mul_ps(v, load16_ps(scales + i, count - i));
    if (bias) v = _mm512_add_ps(v, load16_ps(bias + i, count - i));
    if (gelu) {
      const __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                     _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), v), _mm512_mul_ps(v, v), v));
      const __m512 th = _mm512_sub_ps(_mm512_set1_ps(1.0f), _mm512_div_ps(_mm512_set1_ps(2.0f),
                                      _mm512_add_ps(exp_ps(_mm512_add_ps(u, u)), _mm512_set1_ps(1.0f))));
      v = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), v), _mm512_add_ps(_mm512_set1_ps(1.0f), th));
    }
    _mm256_mask_storeu_epi16(out + i, keep, (__m256i)_mm512_cvtneps_pbh(v));
  }
}

#define FINISH_ROW finish_row

// dot[m] = x[m, :] . w for MT input rows. Two accumulators per row (even / odd 32-element chunks,
// unrolled so they stay in registers): two dependency chains of vdpbf16ps instead of one.
template <int MT>
void dots_bf16(const bf16* x, const bf16* w, int64_t K, float* dot) {
  __m512 acc0[MT], acc1[MT];
  for (int m = 0; m < MT; ++m) acc0[m] = acc1[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    const __m512bh wa = load_bf16(w + k, 32), wb = load_bf16(w + k + 32, 32);
    for (int m = 0; m < MT; ++m) {
      acc0[m] = _mm512_dpbf16_ps(acc0[m], load_bf16(x + m * K + k, 32), wa);
      acc1[m] = _mm512_dpbf16_ps(acc1[m], load_bf16(x + m * K + k + 32, 32), wb);
    }
  }
  for (; k < K; k += 32) {  // at most one full and one partial chunk
    const __m512bh wv = load_bf16(w + k, K - k);
    for (int m = 0; m < MT; ++m) acc0[m] = _mm512_dpbf16_ps(acc0[m], load_bf16(x + m * K + k, K - k), wv);
  }
  for (int m = 0; m < MT; ++m) dot[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[m], acc1[m]));
}

// All M input rows against one weight row: 8 at a time (16 accumulators), then the rest at once.
void row_bf16(const bf16* x, const bf16* w, int64_t M, int64_t K, float* dot) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) dots_bf16<8>(x + m * K, w, K, dot + m);
  const bf16* xm = x + m * K;
  switch (M - m) {
    case 7: dots_bf16<7>(xm, w, K, dot + m); break;
    case 6: dots_bf16<6>(xm, w, K, dot + m); break;
    case 5: dots_bf16<5>(xm, w, K, dot + m); break;
    case 4: dots_bf16<4>(xm, w, K, dot + m); break;
    case 3: dots_bf16<3>(xm, w, K, dot + m); break;
    case 2: dots_bf16<2>(xm, w, K, dot + m); break;
    case 1: dots_bf16<1>(xm, w, K, dot + m); break;
    default: break;
  }
}

// int8 weights. Widening int8 to fp32 in registers costs more instructions than the memory
// system leaves time for, so the product is done in integers with vpdpbusd (u8 x s8 -> int32):
// each activation row is written as 16-bit fixed point x ~= sx * q (|q| <= 32000; 16 significant
// bits, finer than bf16's 8) and split q = 256 * hi + lo into two signed bytes. vpdpbusd wants the
// unsigned operand on the weight side: w + 128 (the int8 weight with its top bit flipped), and
// sum_k w q = 256 * sum (w + 128) hi + sum (w + 128) lo - 128 * sum q. Integer sums are exact.
struct FixedPointRows {
  int64_t K64;                 // K rounded up to 64 (zero padded: padded lanes add nothing)
  std::vector<int8_t> hi, lo;  // [M, K64]
  std::vector<float> scale;    // sx per row
  std::vector<int64_t> sum;    // sum of q per row
};

// The scalar fixed_point_scale / to_fixed_point (common.h), 16 lanes at a time: the same scale (a max
// is exact), the same q (one division and a round-to-nearest-even conversion, as std::nearbyint).
FixedPointRows to_fixed_point_rows(const bf16* x, int64_t M, int64_t K) {
  FixedPointRows f;
  f.K64 = (K + 63) / 64 * 64;
  f.hi.assign(M * f.K64, 0);
  f.lo.assign(M * f.K64, 0);
  f.scale.assign(M, 0.0f);
  f.sum.assign(M, 0);
  for (int64_t m = 0; m < M; ++m) {
    const bf16* row = x + m * K;
    __m512 amax = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (int64_t k = 0; k < K; k += 16) {
      const __m512 v = _mm512_abs_ps(load16_ps(row + k, K - k));
      bad |= _mm512_cmp_ps_mask(v, _mm512_set1_ps(std::numeric_limits<float>::max()), _CMP_NLE_UQ);  // inf, NaN
      amax = _mm512_max_ps(amax, v);
    }
    const float peak = _mm512_reduce_max_ps(amax);
    const float sx = bad ? NAN : peak > 0.0f ? peak / 32000.0f : 1.0f;
    f.scale[m] = sx;
    if (bad) continue;  // q = 0 for a row holding inf / NaN; its outputs are NaN through sx
    const __m512 vs = _mm512_set1_ps(sx);
    __m512i total = _mm512_setzero_si512();
    int8_t* hi = f.hi.data() + m * f.K64;
    int8_t* lo = f.lo.data() + m * f.K64;
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 keep = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
      const __m512i q = _mm512_cvtps_epi32(_mm512_div_ps(load16_ps(row + k, K - k), vs));
      const __m512i h = _mm512_srai_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(128)), 8);  // floor
      _mm512_mask_cvtepi32_storeu_epi8(hi + k, keep, h);
      _mm512_mask_cvtepi32_storeu_epi8(lo + k, keep, _mm512_sub_epi32(q, _mm512_slli_epi32(h, 8)));
      total = _mm512_add_epi32(total, q);  // |q| <= 32000: a lane sums K / 16 of them, far from 2^31
    }
    f.sum[m] = _mm512_reduce_add_epi32(total);
  }
  return f;
}

inline __m512i load_weight_bytes(const int8_t* p, int64_t remaining) {
  const __m512i w = remaining >= 64 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8((1ull << remaining) - 1, p);
  return _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80));  // w + 128 as unsigned bytes
}

// dot[m] = sx[m0 + m] * sum_k w[k] q[m0 + m, k] for MT input rows.
template <int MT>
void dots_int8(const FixedPointRows& f, int64_t m0, const int8_t* w, int64_t K, float* dot) {
  __m512i acc_hi[MT], acc_lo[MT];
  for (int m = 0; m < MT; ++m) acc_hi[m] = acc_lo[m] = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 64) {
    const __m512i wv = load_weight_bytes(w + k, K - k);
    for (int m = 0; m < MT; ++m) {
      acc_hi[m] = _mm512_dpbusd_epi32(acc_hi[m], wv, _mm512_loadu_si512(f.hi.data() + (m0 + m) * f.K64 + k));
      acc_lo[m] = _mm512_dpbusd_epi32(acc_lo[m], wv, _mm512_loadu_si512(f.lo.data() + (m0 + m) * f.K64 + k));
    }
  }
  for (int m = 0; m < MT; ++m) {
    const int64_t sum = 256 * (int64_t)_mm512_reduce_add_epi32(acc_hi[m]) +
                        (int64_t)_mm512_reduce_add_epi32(acc_lo[m]) - 128 * f.sum[m0 + m];
    dot[m] = (float)((double)sum * f.scale[m0 + m]);
  }
}

// Several rows: a GEMM with vpdpbusd in its native layout. 64 output columns at a time, each thread
// transposes its weight rows into [K / 4][64 columns][4 inputs] (one register holds 4 inputs of 16
// columns), so one broadcast activation dword feeds 4 registers of columns and a loaded weight
// register feeds ROW_TILE rows: ~1 load per 3 multiplies where the one-row form above needs ~1 per 1,
// and no horizontal sums. The integer sums are exact, so every output equals the one-row kernel's
// bit for bit (the same epilogue): rows stay independent of the batch.
constexpr int64_t TILE_COLS = 64;
constexpr int ROW_TILE = 3;  // 3 rows x 4 column registers x (hi, lo) = 24 accumulators of 32
constexpr int64_t CHUNK = 512;  // inputs per transposed chunk: 32 KB, stays in L1 while every row group reads it

// 16 weight rows x 64 inputs (16 dwords each) -> 16 registers of one dword (4 inputs) per row.
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);      // dwords 0, 4, 8, 12 of rows i..i+3
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);  // 1, 5, 9, 13
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);  // 2, 6, 10, 14
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);  // 3, 7, 11, 15
  }
  for (int j = 0; j < 4; ++j) {  // u[j], u[4 + j], u[8 + j], u[12 + j]: dwords j, j + 4, j + 8, j + 12
    const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88), v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88), v3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xDD);
    r[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[j + 4] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[j + 12] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// tile[(k - k0) / 4 * 64 + c] = the 4 bytes (w + 128) of column n0 + c, inputs k .. k + 3, for k in
// [k0, k1) (multiples of 64); columns past N and inputs past K are zero weights.
void transpose_chunk(const int8_t* w, int64_t N, int64_t K, int64_t n0, int64_t k0, int64_t k1, int32_t* tile) {
  for (int64_t c0 = 0; c0 < TILE_COLS; c0 += 16) {
    for (int64_t k = k0; k < k1; k += 64) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t n = n0 + c0 + i;
        r[i] = n < N && k < K ? load_weight_bytes(w + n * K + k, K - k) : _mm512_set1_epi8((char)0x80);
      }
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(tile + ((k - k0) / 4 + j) * TILE_COLS + c0, r[j]);
    }
  }
}

// Software prefetch of the next chunk's weights (64 rows x its inputs) into L2, a few lines per
// inner iteration, so reading memory overlaps the multiplies (the hardware prefetcher does not run
// that far ahead over 64 row streams).
struct Prefetch {
  const int8_t* w = nullptr;  // first byte of the chunk's first row; nullptr: nothing left
  int64_t K = 0, rows = 0, bytes = 0, per_step = 0;
  int64_t row = 0, offset = 0;
  inline void step() {
    for (int64_t i = 0; i < per_step && w != nullptr; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(w + row * K + offset), _MM_HINT_T1);
      offset += 64;
      if (offset >= bytes) {
        offset = 0;
        if (++row == rows) w = nullptr;
      }
    }
  }
};

// One activation row's 8 accumulators (hi, lo x 4 column registers), named: GCC keeps arrays of
// vectors on the stack across the loop (measured 2x slower), named locals stay in registers.
struct RowSums {
  __m512i h0, h1, h2, h3, l0, l1, l2, l3;
  explicit RowSums(const int32_t* s)  // [hi x 64, lo x 64]
      : h0(_mm512_loadu_si512(s)), h1(_mm512_loadu_si512(s + 16)), h2(_mm512_loadu_si512(s + 32)),
        h3(_mm512_loadu_si512(s + 48)), l0(_mm512_loadu_si512(s + 64)), l1(_mm512_loadu_si512(s + 80)),
        l2(_mm512_loadu_si512(s + 96)), l3(_mm512_loadu_si512(s + 112)) {}
  inline void add(__m512i w0, __m512i w1, __m512i w2, __m512i w3, int32_t hi, int32_t lo) {
    const __m512i h = _mm512_set1_epi32(hi), l = _mm512_set1_epi32(lo);
    h0 = _mm512_dpbusd_epi32(h0, w0, h);
    h1 = _mm512_dpbusd_epi32(h1, w1, h);
    h2 = _mm512_dpbusd_epi32(h2, w2, h);
    h3 = _mm512_dpbusd_epi32(h3, w3, h);
    l0 = _mm512_dpbusd_epi32(l0, w0, l);
    l1 = _mm512_dpbusd_epi32(l1, w1, l);
    l2 = _mm512_dpbusd_epi32(l2, w2, l);
    l3 = _mm512_dpbusd_epi32(l3, w3, l);
  }
  void store(int32_t* out) const {
    _mm512_storeu_si512(out, h0);
    _mm512_storeu_si512(out + 16, h1);
    _mm512_storeu_si512(out + 32, h2);
    _mm512_storeu_si512(out + 48, h3);
    _mm512_storeu_si512(out + 64, l0);
    _mm512_storeu_si512(out + 80, l1);
    _mm512_storeu_si512(out + 96, l2);
    _mm512_storeu_si512(out + 112, l3);
  }
};

// sums[(m * 2 + hi/lo) * 64 + c] += the exact sums of RT rows (from m0) against the 64 columns of
// `tile`, inputs [k0, k1).
template <int RT>
void tile_sums(const FixedPointRows& f, int64_t m0, const int32_t* tile, int64_t k0, int64_t k1, int32_t* sums,
               Prefetch& prefetch) {
  static_assert(RT >= 1 && RT <= 3, "three rows fill the registers");
  RowSums a(sums), b(RT >= 2 ? sums + 2 * TILE_COLS : sums), c(RT >= 3 ? sums + 4 * TILE_COLS : sums);
  const int32_t* h[3];
  const int32_t* l[3];
  for (int m = 0; m < RT; ++m) {
    h[m] = reinterpret_cast<const int32_t*>(f.hi.data() + (m0 + m) * f.K64);
    l[m] = reinterpret_cast<const int32_t*>(f.lo.data() + (m0 + m) * f.K64);
  }
  for (int64_t k4 = k0 / 4; k4 < k1 / 4; ++k4) {
    const int32_t* wk = tile + (k4 - k0 / 4) * TILE_COLS;
    const __m512i w0 = _mm512_loadu_si512(wk), w1 = _mm512_loadu_si512(wk + 16);
    const __m512i w2 = _mm512_loadu_si512(wk + 32), w3 = _mm512_loadu_si512(wk + 48);
    a.add(w0, w1, w2, w3, h[0][k4], l[0][k4]);
    if constexpr (RT >= 2) b.add(w0, w1, w2, w3, h[1][k4], l[1][k4]);
    if constexpr (RT >= 3) c.add(w0, w1, w2, w3, h[2][k4], l[2][k4]);
    prefetch.step();
  }
  a.store(sums);
  if constexpr (RT >= 2) b.store(sums + 2 * TILE_COLS);
  if constexpr (RT >= 3) c.store(sums + 4 * TILE_COLS);
}

// dot = (256 hi + lo - 128 sum q) * sx, as dots_int8 computes it (exact in double, one rounding each way).
inline void tile_dots(const int32_t* sums, int64_t q_sum, float sx, float* dot) {
  const __m512d shift = _mm512_set1_pd(256.0), fix = _mm512_set1_pd(128.0 * (double)q_sum),
                scale = _mm512_set1_pd((double)sx);
  for (int64_t c = 0; c < TILE_COLS; c += 8) {
    const __m512d hi = _mm512_cvtepi32_pd(_mm256_loadu_si256((const __m256i*)(sums + c)));
    const __m512d lo = _mm512_cvtepi32_pd(_mm256_loadu_si256((const __m256i*)(sums + TILE_COLS + c)));
    const __m512d sum = _mm512_sub_pd(_mm512_fmadd_pd(hi, shift, lo), fix);
    _mm256_storeu_ps(dot + c, _mm512_cvtpd_ps(_mm512_mul_pd(sum, scale)));
  }
}

torch::Tensor linear_int8_rows(const torch::Tensor& x, const torch::Tensor& weight, const bf16* scales,
                               const bf16* bias, bool gelu) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const FixedPointRows f = to_fixed_point_rows(x.data_ptr<bf16>(), M, K);
  const int8_t* wp = weight.data_ptr<int8_t>();
  auto out = torch::empty({M, N}, x.options());
  bf16* op = out.data_ptr<bf16>();
  const int64_t groups = (M + ROW_TILE - 1) / ROW_TILE;
  at::parallel_for(0, (N + TILE_COLS - 1) / TILE_COLS, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> tile(CHUNK / 4 * TILE_COLS), sums(groups * ROW_TILE * 2 * TILE_COLS);
    std::vector<float> dot(TILE_COLS);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * TILE_COLS, width = std::min(TILE_COLS, N - n0);
      std::fill(sums.begin(), sums.end(), 0);
      for (int64_t k0 = 0; k0 < f.K64; k0 += CHUNK) {
        const int64_t k1 = std::min(k0 + CHUNK, f.K64);
        transpose_chunk(wp, N, K, n0, k0, k1, tile.data());
        // the next chunk: the rest of this tile's inputs, else the next tile's first
        Prefetch next;
        const int64_t nn0 = k1 < f.K64 ? n0 : n0 + TILE_COLS, nk0 = k1 < f.K64 ? k1 : 0;
        if ((k1 < f.K64 || t + 1 < end) && nk0 < K) {
          next.w = wp + std::min(nn0, N - 1) * K + nk0;
          next.K = K;
          next.rows = std::min(TILE_COLS, N - nn0);
          next.bytes = std::min(CHUNK, K - nk0);
          next.per_step = std::max<int64_t>(1, (next.rows * ((next.bytes + 63) / 64)) / (groups * ((k1 - k0) / 4)) + 1);
        }
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t m0 = g * ROW_TILE, rows = std::min<int64_t>(ROW_TILE, M - m0);
          int32_t* gs = sums.data() + g * ROW_TILE * 2 * TILE_COLS;
          if (rows == 3) tile_sums<3>(f, m0, tile.data(), k0, k1, gs, next);
          else if (rows == 2) tile_sums<2>(f, m0, tile.data(), k0, k1, gs, next);
          else tile_sums<1>(f, m0, tile.data(), k0, k1, gs, next);
        }
      }
      for (int64_t m = 0; m < M; ++m) {
        tile_dots(sums.data() + m * 2 * TILE_COLS, f.sum[m], f.scale[m], dot.data());
        finish_row(dot.data(), width, scales ? scales + n0 : nullptr, bias ? bias + n0 : nullptr, gelu,
                   op + m * N + n0);
      }
    }
  });
  return out;
}

#define INT8_ROWS linear_int8_rows

}  // namespace

#include "entry_points.h"
