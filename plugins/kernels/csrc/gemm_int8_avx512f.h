// int8 weights on AVX512F/BW without VNNI (decode_avx512f.cpp, included after its helpers): the avx2
// kernel's arithmetic at 16 lanes. Activation rows become 16-bit fixed point (x ~= sx * q, |q| <= 32000:
// common.h), weights are widened to int16, vpmaddwd adds two exact products per int32 lane, and the
// sums stay exact (int64 / double) until one rounding. So every output equals the avx2 and avx512 int8
// kernels' integer sum, and a row equals that row computed alone, bit for bit, whatever the batch.
//   linear_int8_tiles: the weight packed once as the bf16 GEMM's is ([T][K2][64 columns][2 inputs],
//     plugins.kernels.pack_tiles), any rows: one broadcast activation pair feeds 4 column registers and
//     one widened weight register feeds up to 6 rows. Measured (8 santacoder-1b linears, 2 threads,
//     AVX512F Xeon): 7.0 / 14.0 / 23.1 / 72.7 ms at 1 / 8 / 16 / 64 rows, against 12.6 / 21.2 / 27.8 /
//     89.1 for the bf16 GEMM (which widens bf16 in 2 ops and needs 2 FMAs per pair) and 7.5 for the
//     avx2 kernel's one row.
//   linear_int8 (the weight as stored): dots_int8, DOT_ROWS rows per pass over each weight row; as fast
//     at up to 4 rows, 2x slower at 16 (each pass reads every row's activations from L2). A transposing
//     GEMM on the stored weight measured 40-48 ms at 16 rows: the transposes cost more than the sums.
#pragma once

struct FixedPointRows {
  int64_t K32;               // K rounded up to 32 (zero padded: padded lanes add nothing)
  std::vector<int16_t> q;    // [M, K32]
  std::vector<float> scale;  // sx per row; NaN for a row holding inf / NaN (its q stay 0)
};

// common.h's fixed_point_scale / to_fixed_point 16 lanes at a time: the same scale (a max is exact) and
// the same q (one fp32 division, rounded to nearest even as std::nearbyint).
FixedPointRows to_fixed_point_rows(const bf16* x, int64_t M, int64_t K) {
  FixedPointRows f;
  f.K32 = (K + 31) / 32 * 32;
  f.q.assign(M * f.K32, 0);
  f.scale.assign(M, 0.0f);
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
    f.scale[m] = bad ? NAN : peak > 0.0f ? peak / 32000.0f : 1.0f;
    if (bad) continue;
    const __m512 vs = _mm512_set1_ps(f.scale[m]);
    int16_t* q = f.q.data() + m * f.K32;
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 keep = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
      _mm512_mask_cvtepi32_storeu_epi16(q + k, keep, _mm512_cvtps_epi32(_mm512_div_ps(load16_ps(row + k, K - k), vs)));
    }
  }
  return f;
}

inline __m512i load_int8x32(const int8_t* p, int64_t remaining) {  // 32 int8 -> int16, zero past `remaining`
  const __mmask32 keep = remaining >= 32 ? ~(__mmask32)0 : (__mmask32)((1u << remaining) - 1);
  return _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(keep, p));
}

// A vpmaddwd lane is at most 2 * 128 * 32000 < 2^23: an int32 lane holds 256 of them.
constexpr int64_t MADDS_PER_FLUSH = 256;

inline int64_t lanes_sum(__m512i v) {  // the 16 int32 lanes, exactly
  return _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(v)),
                                                  _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(v, 1))));
}

constexpr int DOT_ROWS = 8;  // rows per pass over a weight row (8 accumulators, named: see ColSums)

// dot[m] = sx[m0 + m] * sum_k w[k] q[m0 + m, k] for MT rows, w one weight row as stored: each 32 weights
// are widened once and multiplied into every row (a full vector each, no broadcasts); the weight
// row stays in L1 across a batch's passes.
template <int MT>
void dots_int8(const FixedPointRows& f, int64_t m0, const int8_t* w, int64_t K, float* dot) {
  static_assert(MT >= 1 && MT <= DOT_ROWS, "eight rows per pass");
  const int16_t* q = f.q.data() + m0 * f.K32;
  const int64_t s = f.K32;
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  int64_t total[MT] = {};
  auto flush = [&]() {
    total[0] += lanes_sum(a0);
    if constexpr (MT >= 2) total[1] += lanes_sum(a1);
    if constexpr (MT >= 3) total[2] += lanes_sum(a2);
    if constexpr (MT >= 4) total[3] += lanes_sum(a3);
    if constexpr (MT >= 5) total[4] += lanes_sum(a4);
    if constexpr (MT >= 6) total[5] += lanes_sum(a5);
    if constexpr (MT >= 7) total[6] += lanes_sum(a6);
    if constexpr (MT >= 8) total[7] += lanes_sum(a7);
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = _mm512_setzero_si512();
  };
  int64_t madds = 0;
  for (int64_t k = 0; k < K; k += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(w + k) + 1024, _MM_HINT_T0);
    const __m512i wv = K - k >= 32 ? _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k)))
                                   : load_int8x32(w + k, K - k);
    a0 = _mm512_add_epi32(a0, _mm512_madd_epi16(wv, _mm512_loadu_si512(q + k)));
    if constexpr (MT >= 2) a1 = _mm512_add_epi32(a1, _mm512_madd_epi16(wv, _mm512_loadu_si512(q + s + k)));
    if constexpr (MT >= 3) a2 = _mm512_add_epi32(a2, _mm512_madd_epi16(wv, _mm512_loadu_si512(q + 2 * s + k)));
    if constexpr (MT >= 4) a3 = _mm512_add_epi32(a3, _mm512_madd_epi16(wv, _mm512_loadu_si512(q + 3 * s + k)));
    if constexpr (MT >= 5) a4 = _mm512_add_epi32(a4, _mm512_madd_epi16(wv, _mm512_loadu_si512(q + 4 * s + k)));
    if constexpr (MT >= 6) a5 = _mm512_add_epi32(a5, _mm512_madd_epi16(wv, _mm512_loadu_si512(q + 5 * s + k)));
    if constexpr (MT >= 7) a6 = _mm512_add_epi32(a6, _mm512_madd_epi16(wv, _mm512_loadu_si512(q + 6 * s + k)));
    if constexpr (MT >= 8) a7 = _mm512_add_epi32(a7, _mm512_madd_epi16(wv, _mm512_loadu_si512(q + 7 * s + k)));
    if (++madds == MADDS_PER_FLUSH) {
      flush();
      madds = 0;
    }
  }
  flush();
  for (int m = 0; m < MT; ++m) dot[m] = (float)((double)total[m] * f.scale[m0 + m]);
}

using DotsInt8 = void (*)(const FixedPointRows&, int64_t, const int8_t*, int64_t, float*);
constexpr DotsInt8 DOTS_INT8[DOT_ROWS + 1] = {nullptr, dots_int8<1>, dots_int8<2>, dots_int8<3>, dots_int8<4>,
                                              dots_int8<5>, dots_int8<6>, dots_int8<7>, dots_int8<8>};

constexpr int64_t INT8_COLS = 64;
// Input pairs per block: 128 vpmaddwd per int32 lane (under the 256 that could overflow), then the lanes
// go to exact doubles; the block's weights (16 KB) stay in L1 while every row tile reads them.
constexpr int64_t INT8_BLOCK = 128;
constexpr int INT8_ROW_TILE = 6;  // 6 rows x 4 column registers = 24 accumulators, as the bf16 GEMM

// One row's 64 column sums, named (GCC keeps arrays of vectors on the stack: see ColSums).
struct PairSums {
  __m512i c0 = _mm512_setzero_si512(), c1 = c0, c2 = c0, c3 = c0;
  __attribute__((always_inline)) inline void add(__m512i w0, __m512i w1, __m512i w2, __m512i w3, const int32_t* pair) {
    const __m512i x = _mm512_set1_epi32(*pair);
    c0 = _mm512_add_epi32(c0, _mm512_madd_epi16(w0, x));
    c1 = _mm512_add_epi32(c1, _mm512_madd_epi16(w1, x));
    c2 = _mm512_add_epi32(c2, _mm512_madd_epi16(w2, x));
    c3 = _mm512_add_epi32(c3, _mm512_madd_epi16(w3, x));
  }
  // s[c] += lane c, in doubles: exact (the totals stay far below 2^53)
  void add_to(double* s) const {
    const __m512i cols[4] = {c0, c1, c2, c3};
    for (int i = 0; i < 4; ++i) {
      double* d = s + 16 * i;
      _mm512_storeu_pd(d, _mm512_add_pd(_mm512_loadu_pd(d), _mm512_cvtepi32_pd(_mm512_castsi512_si256(cols[i]))));
      _mm512_storeu_pd(d + 8, _mm512_add_pd(_mm512_loadu_pd(d + 8),
                                            _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(cols[i], 1))));
    }
  }
};

inline __m512i load_pair_columns(const int8_t* p) {  // 16 columns x 2 inputs -> 16 int32 lanes of two int16
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// sums[r * 64 + c] += rows x + r * stride (activation pairs) against the pairs [0, pairs) of block `w`
// ([pairs][64 columns][2] int8).
template <int RT>
void int8_tile(const int32_t* x, int64_t stride, const int8_t* w, int64_t pairs, double* sums) {
  static_assert(RT >= 1 && RT <= INT8_ROW_TILE, "six rows fill the registers");
  PairSums a0, a1, a2, a3, a4, a5;
  for (int64_t p = 0; p < pairs; ++p) {
    const int8_t* wp = w + p * 2 * INT8_COLS;
    const __m512i w0 = load_pair_columns(wp), w1 = load_pair_columns(wp + 32);
    const __m512i w2 = load_pair_columns(wp + 64), w3 = load_pair_columns(wp + 96);
    a0.add(w0, w1, w2, w3, x + p);
    if constexpr (RT >= 2) a1.add(w0, w1, w2, w3, x + stride + p);
    if constexpr (RT >= 3) a2.add(w0, w1, w2, w3, x + 2 * stride + p);
    if constexpr (RT >= 4) a3.add(w0, w1, w2, w3, x + 3 * stride + p);
    if constexpr (RT >= 5) a4.add(w0, w1, w2, w3, x + 4 * stride + p);
    if constexpr (RT >= 6) a5.add(w0, w1, w2, w3, x + 5 * stride + p);
  }
  a0.add_to(sums);
  if constexpr (RT >= 2) a1.add_to(sums + 64);
  if constexpr (RT >= 3) a2.add_to(sums + 128);
  if constexpr (RT >= 4) a3.add_to(sums + 192);
  if constexpr (RT >= 5) a4.add_to(sums + 256);
  if constexpr (RT >= 6) a5.add_to(sums + 320);
}

using Int8Tile = void (*)(const int32_t*, int64_t, const int8_t*, int64_t, double*);
constexpr Int8Tile INT8_TILES[INT8_ROW_TILE + 1] = {nullptr, int8_tile<1>, int8_tile<2>, int8_tile<3>,
                                                    int8_tile<4>, int8_tile<5>, int8_tile<6>};

// x [M, K] bf16; packed int8 [T, K2, 64, 2] (plugins.kernels.pack_tiles of the [N, K] int8 weight: zero past
// N and K); scales [N] bf16 (weight ~= int8 * scale); bias [N] bf16 or None -> [M, N] bf16, each output
// equal to linear_int8's.
at::Tensor linear_int8_tiles(at::Tensor x, at::Tensor packed, int64_t N, at::Tensor scales,
                                c10::optional<at::Tensor> bias, bool gelu) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "x: contiguous [M, K] bf16");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.size(2) == 64 &&
                  packed.size(3) == 2 && packed.is_contiguous(), "packed: contiguous [T, K2, 64, 2] int8");
  const int64_t M = x.size(0), K = x.size(1), T = packed.size(0), K2 = packed.size(1);
  TORCH_CHECK(K2 == (K + 1) / 2 && N <= T * 64 && N > (T - 1) * 64, "packed shape does not match x and N");
  const bf16* sp = vector_ptr(scales, N, "scales");
  const bf16* bp = vector_ptr(bias, N, "bias");
  const FixedPointRows f = to_fixed_point_rows(x.data_ptr<bf16>(), M, K);
  const int32_t* xp = reinterpret_cast<const int32_t*>(f.q.data());  // activation pairs, K32 / 2 per row
  const int64_t row_pairs = f.K32 / 2;
  const int8_t* wp = packed.data_ptr<int8_t>();
  auto out = at::empty({M, N}, x.options());
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> sums(M * INT8_COLS);
    alignas(64) float dot[INT8_COLS];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * INT8_COLS, width = std::min(INT8_COLS, N - n0);
      std::fill(sums.begin(), sums.end(), 0.0);
      for (int64_t p0 = 0; p0 < K2; p0 += INT8_BLOCK) {
        const int8_t* block = wp + (t * K2 + p0) * 2 * INT8_COLS;
        for (int64_t m = 0; m < M; m += INT8_ROW_TILE) {
          const int64_t rt = std::min<int64_t>(INT8_ROW_TILE, M - m);
          INT8_TILES[rt](xp + m * row_pairs + p0, row_pairs, block, std::min(INT8_BLOCK, K2 - p0), sums.data() + m * 64);
        }
      }
      for (int64_t m = 0; m < M; ++m) {
        const __m512d sx = _mm512_set1_pd((double)f.scale[m]);
        for (int64_t c = 0; c < INT8_COLS; c += 8)
          _mm256_storeu_ps(dot + c, _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_loadu_pd(sums.data() + m * 64 + c), sx)));
        finish_row(dot, width, sp + n0, bp ? bp + n0 : nullptr, gelu, op + m * N + n0);
      }
    }
  });
  return out;
}

// The weight as stored, more than one row: DOT_ROWS rows per pass over each weight row.
at::Tensor linear_int8_rows(const at::Tensor& x, const at::Tensor& weight, const bf16* scales,
                               const bf16* bias, bool gelu) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const FixedPointRows f = to_fixed_point_rows(x.data_ptr<bf16>(), M, K);
  const int8_t* wp = weight.data_ptr<int8_t>();
  return for_each_output(x, N, scales, bias, gelu, [&](int64_t n, float* dot) {
    for (int64_t m = 0; m < M; m += DOT_ROWS) DOTS_INT8[std::min<int64_t>(DOT_ROWS, M - m)](f, m, wp + n * K, K, dot + m);
  }, finish_row);
}
