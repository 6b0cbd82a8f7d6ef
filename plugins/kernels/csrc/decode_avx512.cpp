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

FixedPointRows to_fixed_point_rows(const bf16* x, int64_t M, int64_t K) {
  FixedPointRows f;
  f.K64 = (K + 63) / 64 * 64;
  f.hi.assign(M * f.K64, 0);
  f.lo.assign(M * f.K64, 0);
  f.scale.assign(M, 0.0f);
  f.sum.assign(M, 0);
  for (int64_t m = 0; m < M; ++m) {
    const bf16* row = x + m * K;
    const float sx = fixed_point_scale(row, K);
    f.scale[m] = sx;
    int64_t total = 0;
    for (int64_t k = 0; k < K; ++k) {
      const int32_t q = to_fixed_point(row[k], sx);
      const int32_t h = (q + 128) >> 8;  // floor: lo = q - 256 h in [-128, 127], |h| <= 125
      f.hi[m * f.K64 + k] = static_cast<int8_t>(h);
      f.lo[m * f.K64 + k] = static_cast<int8_t>(q - 256 * h);
      total += q;
    }
    f.sum[m] = total;
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

}  // namespace

#include "entry_points.h"
