// bf16 linear for decode-sized inputs (a few rows) on x86 CPUs with AVX512-BF16.
//
// A decode step reads every weight once and does ~1 FLOP per byte, so it is bound by memory
// bandwidth. oneDNN's packed GEMV streams weights at ~28 GB/s on 2 cores here, where a plain read
// reaches ~50 GB/s. This kernel reads the weight as stored ([out, in], row-major) in one pass:
// each thread owns a contiguous run of output rows, takes them four at a time, and multiplies
// every 32-element chunk of those rows into all input rows (up to 4 at once) with vdpbf16ps
// (fp32 accumulation). Bias and tanh GELU are applied in fp32 before the one rounding to bf16.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>

namespace {

constexpr int ROWS = 4;  // weight rows per block: 4 streams per thread

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
  __m512 acc[MT][ROWS];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < ROWS; ++r) acc[m][r] = _mm512_setzero_ps();
  const at::BFloat16* rows[ROWS];
  for (int r = 0; r < ROWS; ++r) rows[r] = w + (n0 + (r < nrows ? r : 0)) * K;
  for (int64_t k = 0; k < K; k += 32) {
    const int64_t left = K - k;
    __m512bh wv[ROWS];
    for (int r = 0; r < ROWS; ++r) wv[r] = load_chunk(rows[r] + k, left);
    for (int m = 0; m < MT; ++m) {
      __m512bh xv = load_chunk(x + m * K + k, left);
      for (int r = 0; r < ROWS; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < nrows; ++r)
      out[m * N + n0 + r] = at::BFloat16(finish(_mm512_reduce_add_ps(acc[m][r]), bias, n0 + r, gelu));
}

void rows_tile(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias, at::BFloat16* out,
               int64_t n0, int nrows, int64_t M, int64_t K, int64_t N, bool gelu) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) block<4>(x + m * K, w, bias, out + m * N, n0, nrows, K, N, gelu);
  switch (M - m) {
    case 3: block<3>(x + m * K, w, bias, out + m * N, n0, nrows, K, N, gelu); break;
    case 2: block<2>(x + m * K, w, bias, out + m * N, n0, nrows, K, N, gelu); break;
    case 1: block<1>(x + m * K, w, bias, out + m * N, n0, nrows, K, N, gelu); break;
    default: break;
  }
}

}  // namespace

// x [M, K] bf16, weight [N, K] bf16 (both contiguous), bias [N] bf16 or None -> [M, N] bf16.
torch::Tensor linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias, bool gelu) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "x [M, K], weight [N, K]");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "contiguous inputs only");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const at::BFloat16* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == N && bias->is_contiguous(), "bias [N] bf16");
    b = bias->data_ptr<at::BFloat16>();
  }
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "bf16 decode linear (AVX512-BF16)");
}
