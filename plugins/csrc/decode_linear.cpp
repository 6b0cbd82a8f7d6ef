// bf16 linear for decode-sized inputs (a few rows) on x86 CPUs with AVX512-BF16.
//
// A decode step reads every weight once and does ~1 FLOP per byte, so it is bound by memory
// bandwidth. oneDNN's packed GEMV streams weights at ~28 GB/s on 2 cores here, where a plain read
// reaches ~50 GB/s. This kernel reads the weight as stored ([out, in], row-major) in one pass:
// each thread owns a contiguous run of output rows, takes them four at a time, and multiplies
// every 32-element chunk of those rows into all input rows (up to 4 at once) with vdpbf16ps
// (fp32 accumulation). Bias and tanh GELU are applied in fp32 before the one rounding to bf16.
// `linear_int8` does the same for int8 weights (per-row scales), with integer dot products.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>

namespace {

constexpr int ROWS = 1;  // weight rows per block: one sequential stream per thread (measured fastest)

inline __m512bh load_chunk(const at::BFloat16* p, int64_t remaining) {
  if (remaining >= 32) return (__m512bh)_mm512_loadu_si512(p);
  __mmask32 mask = (__mmask32)((1ull << remaining) - 1);  // zero-filled tail
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

inline float finish(float v, const at::BFloat16* bias, int64_t n, bool gelu) {
  if (bias) v += static_cast<float>(bias[n]);
  if (gelu) v = 0.5f * v * (1.0f + std::tanh(0.7978845608028654f * (v + 0.044715f * v * v * v)));
  return v;
}

// out[m, n0 + r] for r < nrows (<= ROWS) and m < MT input rows starting at x.
template <int MT>
void block(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias, at::BFloat16* out,
           int64_t n0, int nrows, int64_t K, int64_t N, bool gelu) {
  // two accumulators per output (even / odd chunks, unrolled so they stay in registers):
  // two dependency chains of vdpbf16ps per output instead of one
  __m512 acc0[MT][ROWS], acc1[MT][ROWS];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < ROWS; ++r) acc0[m][r] = acc1[m][r] = _mm512_setzero_ps();
  const at::BFloat16* rows[ROWS];
  for (int r = 0; r < ROWS; ++r) rows[r] = w + (n0 + (r < nrows ? r : 0)) * K;
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    __m512bh wa[ROWS], wb[ROWS];
    for (int r = 0; r < ROWS; ++r) {
      wa[r] = load_chunk(rows[r] + k, 32);
      wb[r] = load_chunk(rows[r] + k + 32, 32);
    }
    for (int m = 0; m < MT; ++m) {
      const __m512bh xa = load_chunk(x + m * K + k, 32), xb = load_chunk(x + m * K + k + 32, 32);
      for (int r = 0; r < ROWS; ++r) {
        acc0[m][r] = _mm512_dpbf16_ps(acc0[m][r], xa, wa[r]);
        acc1[m][r] = _mm512_dpbf16_ps(acc1[m][r], xb, wb[r]);
      }
    }
  }
  for (; k < K; k += 32) {  // at most one full and one partial chunk
    const int64_t left = K - k;
    __m512bh wv[ROWS];
    for (int r = 0; r < ROWS; ++r) wv[r] = load_chunk(rows[r] + k, left);
    for (int m = 0; m < MT; ++m) {
      const __m512bh xv = load_chunk(x + m * K + k, left);
      for (int r = 0; r < ROWS; ++r) acc0[m][r] = _mm512_dpbf16_ps(acc0[m][r], xv, wv[r]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < nrows; ++r) {
      const float v = _mm512_reduce_add_ps(_mm512_add_ps(acc0[m][r], acc1[m][r]));
      out[m * N + n0 + r] = at::BFloat16(finish(v, bias, n0 + r, gelu));
    }
}

void rows_tile(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias, at::BFloat16* out,
               int64_t n0, int nrows, int64_t M, int64_t K, int64_t N, bool gelu) {
  int64_t m = 0;  // input rows 8 at a time (16 accumulators), then the rest in one block
  for (; m + 8 <= M; m += 8) block<8>(x + m * K, w, bias, out + m * N, n0, nrows, K, N, gelu);
  const at::BFloat16* xm = x + m * K;
  at::BFloat16* om = out + m * N;
  switch (M - m) {
    case 7: block<7>(xm, w, bias, om, n0, nrows, K, N, gelu); break;
    case 6: block<6>(xm, w, bias, om, n0, nrows, K, N, gelu); break;
    case 5: block<5>(xm, w, bias, om, n0, nrows, K, N, gelu); break;
    case 4: block<4>(xm, w, bias, om, n0, nrows, K, N, gelu); break;
    case 3: block<3>(xm, w, bias, om, n0, nrows, K, N, gelu); break;
    case 2: block<2>(xm, w, bias, om, n0, nrows, K, N, gelu); break;
    case 1: block<1>(xm, w, bias, om, n0, nrows, K, N, gelu); break;
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
  int64_t K64;                     // K rounded up to 64 (zero padded: padded lanes add nothing)
  std::vector<int8_t> hi, lo;      // [M, K64]
  std::vector<float> scale;        // sx per row
  std::vector<int64_t> sum;        // sum of q per row
};

FixedPointRows to_fixed_point(const at::BFloat16* x, int64_t M, int64_t K) {
  FixedPointRows f;
  f.K64 = (K + 63) / 64 * 64;
  f.hi.assign(M * f.K64, 0);
  f.lo.assign(M * f.K64, 0);
  f.scale.assign(M, 0.0f);
  f.sum.assign(M, 0);
  for (int64_t m = 0; m < M; ++m) {
    const at::BFloat16* row = x + m * K;
    float amax = 0.0f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::abs(static_cast<float>(row[k])));
    const float sx = amax > 0.0f ? amax / 32000.0f : 1.0f;
    f.scale[m] = std::isfinite(amax) ? sx : NAN;
    int64_t total = 0;
    for (int64_t k = 0; k < K; ++k) {
      const int32_t q = static_cast<int32_t>(std::nearbyint(static_cast<float>(row[k]) / sx));
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
  const __m512i top = _mm512_set1_epi8((char)0x80);
  __m512i w = remaining >= 64 ? _mm512_loadu_si512(p)
                              : _mm512_maskz_loadu_epi8(remaining >= 64 ? ~0ull : ((1ull << remaining) - 1), p);
  return _mm512_xor_si512(w, top);  // w + 128 as unsigned bytes (padded lanes: 128 * 0 activation)
}

template <int MT>
void block_int8(const FixedPointRows& f, int64_t m0, const int8_t* w, const at::BFloat16* scales,
                const at::BFloat16* bias, at::BFloat16* out, int64_t n0, int nrows, int64_t K, int64_t N, bool gelu) {
  __m512i acc_hi[MT][ROWS], acc_lo[MT][ROWS];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < ROWS; ++r) acc_hi[m][r] = acc_lo[m][r] = _mm512_setzero_si512();
  const int8_t* rows[ROWS];
  for (int r = 0; r < ROWS; ++r) rows[r] = w + (n0 + (r < nrows ? r : 0)) * K;
  for (int64_t k = 0; k < K; k += 64) {
    const int64_t left = K - k;
    __m512i wv[ROWS];
    for (int r = 0; r < ROWS; ++r) wv[r] = load_weight_bytes(rows[r] + k, left);
    for (int m = 0; m < MT; ++m) {
      const __m512i hv = _mm512_loadu_si512(f.hi.data() + (m0 + m) * f.K64 + k);
      const __m512i lv = _mm512_loadu_si512(f.lo.data() + (m0 + m) * f.K64 + k);
      for (int r = 0; r < ROWS; ++r) {
        acc_hi[m][r] = _mm512_dpbusd_epi32(acc_hi[m][r], wv[r], hv);
        acc_lo[m][r] = _mm512_dpbusd_epi32(acc_lo[m][r], wv[r], lv);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < nrows; ++r) {
      const int64_t dot = 256 * (int64_t)_mm512_reduce_add_epi32(acc_hi[m][r]) +
                          (int64_t)_mm512_reduce_add_epi32(acc_lo[m][r]) - 128 * f.sum[m0 + m];
      const float v = (float)((double)dot * f.scale[m0 + m]) * static_cast<float>(scales[n0 + r]);
      out[(m0 + m) * N + n0 + r] = at::BFloat16(finish(v, bias, n0 + r, gelu));
    }
}

void rows_tile_int8(const FixedPointRows& f, const int8_t* w, const at::BFloat16* scales, const at::BFloat16* bias,
                    at::BFloat16* out, int64_t n0, int nrows, int64_t M, int64_t K, int64_t N, bool gelu) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) block_int8<2>(f, m, w, scales, bias, out, n0, nrows, K, N, gelu);
  if (m < M) block_int8<1>(f, m, w, scales, bias, out, n0, nrows, K, N, gelu);
}

const at::BFloat16* bias_ptr(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == N && bias->is_contiguous(), "bias [N] bf16");
  return bias->data_ptr<at::BFloat16>();
}

}  // namespace

// x [M, K] bf16, weight [N, K] bf16 (both contiguous), bias [N] bf16 or None -> [M, N] bf16.
torch::Tensor linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias, bool gelu) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "x [M, K], weight [N, K]");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "contiguous inputs only");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const at::BFloat16* b = bias_ptr(bias, N);
  auto out = torch::empty({M, N}, x.options());
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = weight.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t blocks = (N + ROWS - 1) / ROWS;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n0 = i * ROWS;
      rows_tile(xp, wp, b, op, n0, (int)std::min<int64_t>(ROWS, N - n0), M, K, N, gelu);
    }
  });
  return out;
}

// x [M, K] bf16, weight [N, K] int8, scales [N] bf16 (weight ~= int8 * scale), bias [N] bf16 or None.
torch::Tensor linear_int8(torch::Tensor x, torch::Tensor weight, torch::Tensor scales,
                          c10::optional<torch::Tensor> bias, bool gelu) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kChar, "bf16 x, int8 weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "x [M, K], weight [N, K]");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "contiguous inputs only");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.numel() == N && scales.is_contiguous(), "scales [N] bf16");
  const at::BFloat16* b = bias_ptr(bias, N);
  const FixedPointRows f = to_fixed_point(x.data_ptr<at::BFloat16>(), M, K);  // once, read by every weight row
  auto out = torch::empty({M, N}, x.options());
  const int8_t* wp = weight.data_ptr<int8_t>();
  const at::BFloat16* sp = scales.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t blocks = (N + ROWS - 1) / ROWS;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n0 = i * ROWS;
      rows_tile_int8(f, wp, sp, b, op, n0, (int)std::min<int64_t>(ROWS, N - n0), M, K, N, gelu);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "bf16 decode linear (AVX512-BF16)");
  m.def("linear_int8", &linear_int8, "int8 weight decode linear, bf16 in and out (AVX512-VNNI)");
}
