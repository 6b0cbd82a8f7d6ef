// The Python entry points of a decode kernel, included at the end of each ISA's source after it
// has defined, in its anonymous namespace: `ISA` (a name), `row_bf16(x, w, M, K, dot)` (unless it has
// BF16_TILES_LINEAR, a bf16 linear on packed weights bound as `linear_tiles` instead of `linear`),
// `FixedPointRows`, `to_fixed_point_rows(x, M, K)` and `dots_int8<MT>(rows, m0, w, K, dot)`; and
// may define FINISH_ROW, a vectorized decode::finish_row_scalar, and INT8_ROWS, an int8 linear for
// more than one row (x, weight, scales, bias, gelu) whose outputs equal the one-row path's, and
// INT8_TILES_LINEAR (bound as `linear_int8_tiles`), INT4_LINEAR (bound as `linear_int4`),
// MQA_DECODE_ATTENTION (bound as `mqa_decode_attention`).
#pragma once

#include <torch/csrc/utils/pybind.h>  // pybind11 and its at::Tensor caster

#ifndef FINISH_ROW
#define FINISH_ROW decode::finish_row_scalar
#endif

namespace {

void row_int8(const FixedPointRows& f, const int8_t* w, int64_t M, int64_t K, float* dot) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) dots_int8<2>(f, m, w, K, dot + m);
  if (m < M) dots_int8<1>(f, m, w, K, dot + m);
}

}  // namespace

#ifndef BF16_TILES_LINEAR
// x [M, K] bf16, weight [N, K] bf16, bias [N] bf16 or None -> [M, N] bf16.
at::Tensor linear(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias, bool gelu) {
  decode::check_inputs(x, weight, at::kBFloat16);
  const int64_t M = x.size(0), K = x.size(1);
  const decode::bf16* xp = x.data_ptr<decode::bf16>();
  const decode::bf16* wp = weight.data_ptr<decode::bf16>();
  return decode::for_each_output(x, weight.size(0), nullptr, decode::vector_ptr(bias, weight.size(0), "bias"), gelu,
                                 [&](int64_t n, float* dot) { row_bf16(xp, wp + n * K, M, K, dot); }, FINISH_ROW);
}
#endif

// x [M, K] bf16, weight [N, K] int8, scales [N] bf16 (weight ~= int8 * scale), bias [N] bf16 or None.
at::Tensor linear_int8(at::Tensor x, at::Tensor weight, at::Tensor scales,
                          c10::optional<at::Tensor> bias, bool gelu) {
  decode::check_inputs(x, weight, at::kChar);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
#ifdef INT8_ROWS
  if (M > 1)
    return INT8_ROWS(x, weight, decode::vector_ptr(scales, N, "scales"), decode::vector_ptr(bias, N, "bias"), gelu);
#endif
  const FixedPointRows f = to_fixed_point_rows(x.data_ptr<decode::bf16>(), M, K);  // once, read by every weight row
  const int8_t* wp = weight.data_ptr<int8_t>();
  return decode::for_each_output(x, N, decode::vector_ptr(scales, N, "scales"), decode::vector_ptr(bias, N, "bias"),
                                 gelu, [&](int64_t n, float* dot) { row_int8(f, wp + n * K, M, K, dot); }, FINISH_ROW);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_fp32", &decode::linear_fp32_tiles, "bf16 weights, fp32 GEMM on converted tiles, bf16 out");
#ifdef BF16_TILES_LINEAR
  m.def("linear_tiles", &BF16_TILES_LINEAR, (std::string("bf16 linear on packed tiles, any rows (") + ISA + ")").c_str());
#else
  m.def("linear", &linear, (std::string("bf16 decode linear (") + ISA + ")").c_str());
#endif
  m.def("linear_int8", &linear_int8, (std::string("int8 weight decode linear, bf16 in and out (") + ISA + ")").c_str());
  m.def("add_layer_norm", &decode::add_layer_norm, "bf16 rows: (x + y + bias, layer_norm of it)");
  m.def("add_residuals_", &decode::add_residuals_, "bf16 rows, in place: x + a + a_bias, then + y + y_bias");
#ifdef MQA_DECODE_ATTENTION
  m.def("mqa_decode_attention", &MQA_DECODE_ATTENTION, (std::string("one-token attention on a one-head bf16 cache (") + ISA + ")").c_str());
#endif
#ifdef INT8_TILES_LINEAR
  m.def("linear_int8_tiles", &INT8_TILES_LINEAR, (std::string("int8 linear on packed tiles, any rows (") + ISA + ")").c_str());
#endif
#ifdef INT4_LINEAR
  m.def("linear_int4", &INT4_LINEAR, (std::string("int4 weight linear, bf16 in and out (") + ISA + ")").c_str());
#endif
}
