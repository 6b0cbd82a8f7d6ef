// bf16 linears on x86 CPUs with AVX512F/BW/VL but no bf16 instructions (no AVX512-BF16), any row
// count: linear_tiles, the GEMM of gemm_bf16_avx512.h on weights packed once, each weight register
// widened to fp32 in two ALU ops and multiplied in fp32 FMAs (16 lanes: twice the avx2 kernel's).
// int8 and int4 stay on the avx2 kernel / torch at this rung (no VNNI here).
#include <immintrin.h>

#include "common.h"
#include "layer_norm.h"

namespace {

using namespace decode;

constexpr const char* ISA = "AVX512F";

#include "epilogue_avx512.h"
#include "gemm_bf16_avx512.h"
#include "attention_avx512.h"

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_fp32", &decode::linear_fp32_tiles, "bf16 weights, fp32 GEMM on converted tiles, bf16 out");
  m.def("linear_tiles", &linear_bf16_tiles, (std::string("bf16 linear on packed tiles, any rows (") + ISA + ")").c_str());
  m.def("add_layer_norm", &decode::add_layer_norm, "bf16 rows: (x + y + bias, layer_norm of it)");
  m.def("add_residuals_", &decode::add_residuals_, "bf16 rows, in place: x + a + a_bias, then + y + y_bias");
  m.def("mqa_decode_attention", &mqa_decode_attention, (std::string("one-token attention on a one-head bf16 cache (") + ISA + ")").c_str());
}
