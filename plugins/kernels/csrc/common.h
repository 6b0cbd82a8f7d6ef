// What the decode kernels share: input checks, the per-thread loop over output rows, the epilogue.
//
// A decode step reads every weight once and does ~1 FLOP per byte: it is bound by memory
// bandwidth. Each kernel reads the weight as stored ([out, in], row-major) in one pass: each
// thread owns a contiguous run of output rows, i.e. one sequential stream (measured faster than
// interleaving rows), and multiplies each weight row into every input row. Bias and tanh GELU
// are applied in fp32 before the one rounding to bf16. Each output is computed by the same
// instructions in the same order whatever the number of input rows (row-invariant).
#pragma once

// The few ATen headers the kernels use, not <torch/extension.h>: that one (all of libtorch's C++
// API) is most of the compile time of a kernel.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace decode {

using bf16 = at::BFloat16;

inline void check_inputs(const at::Tensor& x, const at::Tensor& weight, at::ScalarType weight_type) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == weight_type, "bf16 x, weight of ",
              weight_type);
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "x [M, K], weight [N, K]");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "contiguous inputs only");
}

inline const bf16* vector_ptr(const c10::optional<at::Tensor>& t, int64_t N, const char* name) {
  if (!t.has_value() || !t->defined()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->numel() == N && t->is_contiguous(), name, " must be [N] bf16");
  return t->data_ptr<bf16>();
}

// The epilogue of `count` outputs of one input row: out = bf16(gelu?(dot * scale + bias)), in fp32.
inline void finish_row_scalar(const float* dot, int64_t count, const bf16* scales, const bf16* bias, bool gelu,
                              bf16* out) {
  for (int64_t i = 0; i < count; ++i) {
    float v = dot[i];
    if (scales) v *= static_cast<float>(scales[i]);
    if (bias) v += static_cast<float>(bias[i]);
    if (gelu) v = 0.5f * v * (1.0f + std::tanh(0.7978845608028654f * (v + 0.044715f * v * v * v)));
    out[i] = bf16(v);
  }
}

// out[:, n] = finish(row_dots(n)) for every output row n; threads take contiguous runs of n (one
// sequential stream each: measured faster than interleaving rows), keep their dots in fp32 and
// finish each input row's run at once (`finish`: finish_row_scalar's contract).
template <typename RowDots, typename Finish>
at::Tensor for_each_output(const at::Tensor& x, int64_t N, const bf16* scales, const bf16* bias, bool gelu,
                              const RowDots& row_dots, const Finish& finish) {
  const int64_t M = x.size(0);
  auto out = at::empty({M, N}, x.options());
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    const int64_t width = end - begin;
    std::vector<float> dots(M * width), dot(M);
    for (int64_t n = begin; n < end; ++n) {
      row_dots(n, dot.data());
      for (int64_t m = 0; m < M; ++m) dots[m * width + n - begin] = dot[m];
    }
    for (int64_t m = 0; m < M; ++m)
      finish(dots.data() + m * width, width, scales ? scales + begin : nullptr, bias ? bias + begin : nullptr, gelu,
             op + m * N + begin);
  });
  return out;
}

// Activation rows as 16-bit fixed point for the int8 kernels: x ~= scale * q, |q| <= 32000 (16
// significant bits, finer than bf16's 8). Returns per-row scales (NaN for a row holding inf/NaN).
inline float fixed_point_scale(const bf16* row, int64_t K) {
  float amax = 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    const float v = std::abs(static_cast<float>(row[k]));
    if (!(v <= std::numeric_limits<float>::max())) return NAN;  // inf or NaN (std::max would skip a NaN)
    amax = std::max(amax, v);
  }
  return amax > 0.0f ? amax / 32000.0f : 1.0f;
}

inline int32_t to_fixed_point(bf16 v, float scale) {
  return std::isfinite(scale) ? static_cast<int32_t>(std::nearbyint(static_cast<float>(v) / scale)) : 0;
}

// bf16 weights on a CPU without a fast bf16 GEMM (AVX2): the product in fp32. Each thread
// converts a tile of weight rows into its own small buffer (reused: no large allocation, no page
// faults) and multiplies it with torch's fp32 GEMM (single-threaded inside the parallel region);
// the epilogue is the kernels' own. Memory: one tile per thread (~1 MB), never a copy of the weight.
inline at::Tensor linear_fp32_tiles(const at::Tensor& x, const at::Tensor& weight,
                                       const c10::optional<at::Tensor>& bias, bool gelu) {
  check_inputs(x, weight, at::kBFloat16);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const bf16* bp = vector_ptr(bias, N, "bias");
  const auto x32 = x.to(at::kFloat);
  auto out = at::empty({M, N}, x.options());
  bf16* op = out.data_ptr<bf16>();
  const bf16* wp = weight.data_ptr<bf16>();
  const int64_t tile = std::max<int64_t>(8, std::min<int64_t>(256, (1 << 18) / std::max<int64_t>(K, 1)));
  at::parallel_for(0, (N + tile - 1) / tile, 1, [&](int64_t begin, int64_t end) {
    auto wt = at::empty({tile, K}, x32.options());
    float* wtp = wt.data_ptr<float>();
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * tile, rows = std::min(tile, N - n0);
      for (int64_t i = 0; i < rows * K; ++i) wtp[i] = static_cast<float>(wp[n0 * K + i]);
      const auto prod = at::mm(x32, wt.narrow(0, 0, rows).t());  // [M, rows] fp32
      const float* pp = prod.data_ptr<float>();
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t j = 0; j < rows; ++j) {
          float v = pp[m * rows + j];
          if (bp) v += static_cast<float>(bp[n0 + j]);
          if (gelu) v = 0.5f * v * (1.0f + std::tanh(0.7978845608028654f * (v + 0.044715f * v * v * v)));
          op[m * N + n0 + j] = bf16(v);
        }
      }
    }
  });
  return out;
}

}  // namespace decode
