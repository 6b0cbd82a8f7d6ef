// Decode linears on x86 CPUs with AVX2 + FMA only (no AVX512, no native bf16 arithmetic); see
// common.h for the scheme.
//   linear:      bf16 weights and inputs widened to fp32 in registers (a shift or a mask: see
//                load_block), FMA with fp32 accumulation.
//   linear_int8: int8 weights widened to int16, vpmaddwd against activations as 16-bit fixed
//                point (exact int32 pair sums), flushed to int64 before they could overflow.
// Rows of input: up to 3 per pass over a weight row (bf16; 2 for int8), then the rest; the weight
// row stays in L1 between passes.
#include <immintrin.h>

#include "common.h"
#include "layer_norm.h"

namespace {

using namespace decode;

constexpr const char* ISA = "AVX2 + FMA";

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// A bf16 is the top half of an fp32. Sixteen bf16 loaded as eight 32-bit lanes hold the odd
// elements in their high halves (lane & 0xffff0000 is element 2i+1 as fp32) and the even ones in
// their low halves (lane << 16 is element 2i): two cheap ALU ops widen 16 values, no shuffles.
// Weights and inputs are widened the same way, so lane i of the even (odd) vectors pairs weight
// and input element 2i (2i+1), and the inputs stay bf16 in memory: as fp32 they would be read at
// twice the bytes of the weights they meet, once per weight row.
constexpr int64_t BLOCK = 16;
constexpr int CHAINS = 4;  // accumulators per row: 2 blocks per step, even and odd halves
constexpr int64_t PREFETCH_BYTES = 2048;

inline void widen(__m256i raw, __m256& even, __m256& odd) {
  even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

inline void load_block(const bf16* p, __m256& even, __m256& odd) {
  widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), even, odd);
}

// The last, partial block: zero past `remaining` (< BLOCK).
inline void load_tail(const bf16* p, int64_t remaining, __m256& even, __m256& odd) {
  alignas(32) uint16_t tmp[BLOCK] = {0};
  for (int64_t i = 0; i < std::max<int64_t>(remaining, 0); ++i) tmp[i] = reinterpret_cast<const uint16_t*>(p)[i];
  widen(_mm256_load_si256(reinterpret_cast<const __m256i*>(tmp)), even, odd);
}

// dot[m] = x[m0 + m, :] . w for MT rows: four accumulator chains per row (FMA latency is 4
// cycles: one chain would stall a one-row step at half the memory system's pace).
template <int MT>
void dots_bf16(const bf16* x, int64_t m0, const bf16* w, int64_t K, float* dot) {
  __m256 acc[MT][CHAINS];
  for (int m = 0; m < MT; ++m)
    for (int c = 0; c < CHAINS; ++c) acc[m][c] = _mm256_setzero_ps();
  auto step = [&](int c, const __m256& we, const __m256& wo, int64_t kb, bool tail) {
    for (int m = 0; m < MT; ++m) {
      __m256 xe, xo;
      if (tail) load_tail(x + (m0 + m) * K + kb, K - kb, xe, xo);
      else load_block(x + (m0 + m) * K + kb, xe, xo);
      acc[m][c] = _mm256_fmadd_ps(we, xe, acc[m][c]);
      acc[m][c + 1] = _mm256_fmadd_ps(wo, xo, acc[m][c + 1]);
    }
  };
  int64_t k = 0;
  for (; k + 2 * BLOCK <= K; k += 2 * BLOCK) {
    _mm_prefetch(reinterpret_cast<const char*>(w + k) + PREFETCH_BYTES, _MM_HINT_T0);
    __m256 we, wo;
    load_block(w + k, we, wo);
    step(0, we, wo, k, false);
    load_block(w + k + BLOCK, we, wo);
    step(2, we, wo, k + BLOCK, false);
  }
  for (int c = 0; k < K; k += BLOCK, c += 2) {  // at most two blocks, the last partial
    __m256 we, wo;
    const bool tail = K - k < BLOCK;
    if (tail) load_tail(w + k, K - k, we, wo);
    else load_block(w + k, we, wo);
    step(c, we, wo, k, tail);
  }
  for (int m = 0; m < MT; ++m)
    dot[m] = hsum(_mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]), _mm256_add_ps(acc[m][2], acc[m][3])));
}

void row_bf16(const bf16* x, const bf16* w, int64_t M, int64_t K, float* dot) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) dots_bf16<3>(x, m, w, K, dot + m);
  switch (M - m) {
    case 2: dots_bf16<2>(x, m, w, K, dot + m); break;
    case 1: dots_bf16<1>(x, m, w, K, dot + m); break;
    default: break;
  }
}

// ---- int8 weights -----------------------------------------------------------------------------

struct FixedPointRows {
  int64_t K16;               // K rounded up to 16 (zero padded: padded lanes add nothing)
  std::vector<int16_t> q;    // [M, K16]
  std::vector<float> scale;  // per row
};

FixedPointRows to_fixed_point_rows(const bf16* x, int64_t M, int64_t K) {
  FixedPointRows f;
  f.K16 = (K + 15) / 16 * 16;
  f.q.assign(M * f.K16, 0);
  f.scale.assign(M, 0.0f);
  for (int64_t m = 0; m < M; ++m) {
    const bf16* row = x + m * K;
    f.scale[m] = fixed_point_scale(row, K);
    for (int64_t k = 0; k < K; ++k) f.q[m * f.K16 + k] = static_cast<int16_t>(to_fixed_point(row[k], f.scale[m]));
  }
  return f;
}

inline __m256i load_int8x16(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256i load_int8_tail(const int8_t* p, int64_t remaining) {
  alignas(16) int8_t tmp[16] = {0};
  for (int64_t i = 0; i < remaining; ++i) tmp[i] = p[i];
  return _mm256_cvtepi8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(tmp)));
}

// Each vpmaddwd lane sum is at most 2 * 127 * 32000 < 2^23: 256 of them fit an int32 lane.
constexpr int64_t FLUSH_CHUNKS = 256;

inline __m256i add_to_int64(__m256i acc64, __m256i acc32) {
  acc64 = _mm256_add_epi64(acc64, _mm256_cvtepi32_epi64(_mm256_castsi256_si128(acc32)));
  return _mm256_add_epi64(acc64, _mm256_cvtepi32_epi64(_mm256_extracti128_si256(acc32, 1)));
}

inline int64_t hsum_int64(__m256i v) {
  alignas(32) int64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), v);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

template <int MT>
void dots_int8(const FixedPointRows& f, int64_t m0, const int8_t* w, int64_t K, float* dot) {
  __m256i acc32[MT], acc64[MT];
  for (int m = 0; m < MT; ++m) acc32[m] = acc64[m] = _mm256_setzero_si256();
  auto step = [&](const __m256i& wv, int64_t k) {
    for (int m = 0; m < MT; ++m) {
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(f.q.data() + (m0 + m) * f.K16 + k));
      acc32[m] = _mm256_add_epi32(acc32[m], _mm256_madd_epi16(wv, xq));
    }
  };
  auto flush = [&]() {
    for (int m = 0; m < MT; ++m) {
      acc64[m] = add_to_int64(acc64[m], acc32[m]);
      acc32[m] = _mm256_setzero_si256();
    }
  };
  int64_t k = 0, chunks = 0;
  for (; k + 32 <= K; k += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(w + k) + PREFETCH_BYTES, _MM_HINT_T0);
    step(load_int8x16(w + k), k);
    step(load_int8x16(w + k + 16), k + 16);
    if ((chunks += 2) == FLUSH_CHUNKS) {
      flush();
      chunks = 0;
    }
  }
  for (; k < K; k += 16) step(K - k >= 16 ? load_int8x16(w + k) : load_int8_tail(w + k, K - k), k);
  for (int m = 0; m < MT; ++m) {
    const int64_t sum = hsum_int64(add_to_int64(acc64[m], acc32[m]));
    dot[m] = (float)((double)sum * f.scale[m0 + m]);
  }
}

}  // namespace

#include "entry_points.h"
