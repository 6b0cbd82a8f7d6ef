// Linears on x86 CPUs with AVX512-BF16 and AVX512-VNNI, any row count:
//   linear_tiles: bf16 weights packed for vdpbf16ps, fp32 accumulation (gemm_bf16_avx512.h).
//   linear_int8:  int8 weights (per-row scales), integer dot products (see FixedPointRows); one row
//                 here (see common.h for the scheme), more in tiles_avx512.h.
//   linear_int4:  int4 weights in groups, packed for vpdpbusd (tiles_avx512.h).
#include <immintrin.h>

#include "common.h"
#include "layer_norm.h"

namespace {

using namespace decode;

constexpr const char* ISA = "AVX512-BF16 / VNNI";

#include "epilogue_avx512.h"

#define FINISH_ROW finish_row

// int8 weights. Widening int8 to fp32 in registers costs more instructions than the memory
// system leaves time for, so the product is done in integers with vpdpbusd (u8 x s8 -> int32):
// each activation row is written as 16-bit fixed point x ~= sx * q (|q| <= 32000; 16 significant
// bits, finer than bf16's 8) and split q = 256 * hi + lo into two signed bytes. vpdpbusd wants the
// unsigned operand on the weight side: w + 128 (the int8 weight with its top bit flipped), and
// sum_k w q = 256 * sum (w + 128) hi + sum (w + 128) lo - 128 * sum q. Integer sums are exact.
struct FixedPointRows {
  int64_t K64;                 // K rounded up to a multiple of 64 (zero padded: padded lanes add nothing)
  std::vector<int8_t> hi, lo;  // [M, K64]
  std::vector<float> scale;    // sx per row
  std::vector<int64_t> sum;    // sum of q per row
  int64_t group = 0;           // if set, group_sum[m * K64 / group + g]: sum of q over inputs of group g
  std::vector<int32_t> group_sum;
};

// The scalar fixed_point_scale / to_fixed_point (common.h), 16 lanes at a time: the same scale (a max
// is exact), the same q (one division and a round-to-nearest-even conversion, as std::nearbyint).
// `group` (a multiple of 64, or 0): pad K to whole groups and keep each group's sum of q.
FixedPointRows to_fixed_point_rows(const bf16* x, int64_t M, int64_t K, int64_t group = 0) {
  FixedPointRows f;
  const int64_t pad = group ? group : 64;
  f.K64 = (K + pad - 1) / pad * pad;
  f.hi.assign(M * f.K64, 0);
  f.lo.assign(M * f.K64, 0);
  f.scale.assign(M, 0.0f);
  f.sum.assign(M, 0);
  f.group = group;
  if (group) f.group_sum.assign(M * f.K64 / group, 0);
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
      if (group) f.group_sum[(m * f.K64 + k) / group] += _mm512_reduce_add_epi32(q);
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

#include "tiles_avx512.h"
#include "gemm_bf16_avx512.h"
#include "attention_avx512.h"

#define INT8_ROWS linear_int8_rows
#define INT4_LINEAR linear_int4
#define BF16_TILES_LINEAR linear_bf16_tiles
#define MQA_DECODE_ATTENTION mqa_decode_attention

}  // namespace

#include "entry_points.h"
