// Linears on x86 CPUs with AVX512F/BW/VL but no bf16 instructions and no VNNI, any row count:
//   linear_tiles: the bf16 GEMM of gemm_bf16_avx512.h on weights packed once, each weight register
//                 widened to fp32 in two ALU ops and multiplied in fp32 FMAs (16 lanes: twice the
//                 avx2 kernel's).
//   linear_int8:  int8 weights as stored, vpmaddwd on 16-bit fixed-point activations (gemm_int8_avx512f.h);
//   linear_int8_tiles: the same sums on int8 weights packed once as the bf16 GEMM's are.
// int4 runs torch's kernel at this rung.
#include <immintrin.h>

#include "common.h"
#include "layer_norm.h"

namespace {

using namespace decode;

constexpr const char* ISA = "AVX512F";

#include "epilogue_avx512.h"

#define FINISH_ROW finish_row

#include "gemm_bf16_avx512.h"
#include "gemm_int8_avx512f.h"
#include "attention_avx512.h"

#define INT8_ROWS linear_int8_rows
#define INT8_TILES_LINEAR linear_int8_tiles
#define BF16_TILES_LINEAR linear_bf16_tiles
#define MQA_DECODE_ATTENTION mqa_decode_attention

}  // namespace

#include "entry_points.h"
