// One-token attention on a one-head (MQA) bf16 cache on AMX tiles (Xeons with AMX-BF16), both products
// with fp32 sums; the softmax between them is attention_avx512.h's.
// Scores: each block of 16 cached keys is one tile read straight from the cache, the query's heads
// (pairs of dims interleaved as TDPBF16PS wants) the other; scaled after the sum.
// Values: the probabilities of 32 keys for the 16 heads are two tiles, p = hi + lo with hi and lo bf16
// (hi + lo carries 16 bits of p's mantissa: nearly fp32's weights, where one bf16 would round each
// weight to 8 bits), each value tile two keys interleaved per row; the output [16 heads][16 dims] per
// accumulator tile, four at a time.
// A module of its own so that a compiler without AMX support costs only this kernel, not the avx512 rung.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

#include <torch/csrc/utils/pybind.h>

#include "common.h"
#include "layer_norm.h"

namespace {

using namespace decode;

#include "epilogue_avx512.h"
#include "attention_avx512.h"

struct TileConfig {  // the LDTILECFG operand, palette 1
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The four output tiles (4..7) of `values` (the intrinsics take a tile's number as a literal):
// op 0 zeroes tile 4 + t, 1 adds the hi and lo weights (tiles 1, 2) times the values (3), 2 stores it
#define OUTPUT_TILE(T)                      \
  if (op == 0) _tile_zero(T);               \
  else if (op == 1) {                       \
    _tile_dpbf16ps(T, 1, 3);                \
    _tile_dpbf16ps(T, 2, 3);                \
  } else _tile_stored(T, sums, 64);

inline void output_tile(int t, int op, float* sums) {
  if (t == 0) { OUTPUT_TILE(4) }
  else if (t == 1) { OUTPUT_TILE(5) }
  else if (t == 2) { OUTPUT_TILE(6) }
  else { OUTPUT_TILE(7) }
}

// Tiles (16 rows of 64 bytes each): scores: 0 [16 keys][16 heads] fp32, 1 keys [16][32 dims] bf16,
// 2 the query's 32 dims [16 pairs][16 heads x 2] bf16; values: 1 and 2 the probabilities' hi and lo
// [16 heads][32 keys] bf16, 3 values [16 key pairs][16 dims x 2] bf16, 4..7 out [16 heads][16 dims] fp32.
// Each thread that runs it loads the configuration and releases the tiles when done. A head dim that
// is not a multiple of 32 is zero-padded (keys copied, as the last block of fewer than 16 keys is: a
// tile must not read past the cache).
struct AmxAttention {
  int64_t D32;
  std::vector<bf16> qv, tail;
  std::vector<uint32_t> p_hi, p_lo;  // [16 heads][key pairs]: two keys' bf16 weights per element
  alignas(64) float sums[256];
  alignas(64) uint16_t pairs[16 * 32];
  explicit AmxAttention(int64_t D) : D32((D + 31) / 32 * 32), qv(D32 * 16), tail(16 * D32) {
    TileConfig config;
    for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
    _tile_loadconfig(&config);
  }
  ~AmxAttention() { _tile_release(); }
  void scores(const bf16* qb, int64_t qs1, int64_t nh, const bf16* kb, int64_t ks1, int64_t L, int64_t D,
                  float scale, float* sc) {
    std::fill(qv.begin(), qv.end(), bf16(0.0f));
    for (int64_t j = 0; j < nh; ++j)  // qv[c][r][2j + i] = q_j[32c + 2r + i]
      for (int64_t d = 0; d < D; ++d) qv[(d / 32) * 512 + ((d % 32) / 2) * 32 + 2 * j + d % 2] = qb[j * qs1 + d];
    const __m512 fscale = _mm512_set1_ps(scale);
    for (int64_t l0 = 0; l0 < L; l0 += 16) {
      const int64_t n = std::min<int64_t>(16, L - l0);
      const bf16* keys = kb + l0 * ks1;
      int64_t stride = ks1 * 2;
      if (n < 16 || D32 != D) {
        std::fill(tail.begin(), tail.end(), bf16(0.0f));
        for (int64_t i = 0; i < n; ++i) std::memcpy(tail.data() + i * D32, keys + i * ks1, D * sizeof(bf16));
        keys = tail.data(), stride = D32 * 2;
      }
      _tile_zero(0);
      for (int64_t c = 0; c < D32 / 32; ++c) {
        _tile_loadd(1, keys + c * 32, stride);
        _tile_loadd(2, qv.data() + c * 512, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, sums, 64);
      for (int64_t i = 0; i < n; ++i)
        _mm512_storeu_ps(sc + (l0 + i) * 16, _mm512_mul_ps(_mm512_load_ps(sums + i * 16), fscale));
    }
  }

  void values(const float* p, const bf16* vb, int64_t vs1, int64_t L, int64_t D, __m512 inv, int64_t nh, bf16* ob) {
    const int64_t L32 = (L + 31) / 32 * 32, P2 = L32 / 2;
    p_hi.assign(16 * P2, 0), p_lo.assign(16 * P2, 0);
    // (key 2i, key 2i + 1) of head j side by side: the 16-bit lanes of two 16-head rows interleaved
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    alignas(64) uint32_t hi[16], lo[16];
    for (int64_t i = 0; i < (L + 1) / 2; ++i) {
      const __m512 a = _mm512_loadu_ps(p + 2 * i * 16);
      const __m512 b = 2 * i + 1 < L ? _mm512_loadu_ps(p + (2 * i + 1) * 16) : _mm512_setzero_ps();
      const __m256i ah = (__m256i)_mm512_cvtneps_pbh(a), bh = (__m256i)_mm512_cvtneps_pbh(b);
      const __m512 a_rest = _mm512_sub_ps(a, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(ah), 16)));
      const __m512 b_rest = _mm512_sub_ps(b, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bh), 16)));
      const __m256i al = (__m256i)_mm512_cvtneps_pbh(a_rest), bl = (__m256i)_mm512_cvtneps_pbh(b_rest);
      _mm512_store_si512(hi, _mm512_permutexvar_epi16(interleave, _mm512_inserti64x4(_mm512_castsi256_si512(ah), bh, 1)));
      _mm512_store_si512(lo, _mm512_permutexvar_epi16(interleave, _mm512_inserti64x4(_mm512_castsi256_si512(al), bl, 1)));
      for (int j = 0; j < 16; ++j) p_hi[j * P2 + i] = hi[j], p_lo[j * P2 + i] = lo[j];
    }
    const int64_t dim_tiles = (D + 15) / 16;
    for (int64_t g0 = 0; g0 < dim_tiles; g0 += 4) {
      const int group = static_cast<int>(std::min<int64_t>(4, dim_tiles - g0));
      for (int t = 0; t < group; ++t) output_tile(t, 0, sums);
      for (int64_t l0 = 0; l0 < L32; l0 += 32) {
        _tile_loadd(1, p_hi.data() + l0 / 2, P2 * 4);
        _tile_loadd(2, p_lo.data() + l0 / 2, P2 * 4);
        for (int t = 0; t < group; ++t) {
          const int64_t d0 = (g0 + t) * 16;
          const __mmask16 dims = D - d0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (D - d0)) - 1);
          for (int64_t r = 0; r < 16; ++r) {  // keys l0 + 2r and l0 + 2r + 1, dims d0 .. d0 + 15
            const int64_t k0 = l0 + 2 * r;
            const __m256i x = k0 < L ? _mm256_maskz_loadu_epi16(dims, vb + k0 * vs1 + d0) : _mm256_setzero_si256();
            const __m256i y = k0 + 1 < L ? _mm256_maskz_loadu_epi16(dims, vb + (k0 + 1) * vs1 + d0) : _mm256_setzero_si256();
            _mm512_store_si512(pairs + r * 32,
                               _mm512_permutexvar_epi16(interleave, _mm512_inserti64x4(_mm512_castsi256_si512(x), y, 1)));
          }
          _tile_loadd(3, pairs, 64);
          output_tile(t, 1, sums);
        }
      }
      alignas(64) float scales[16];
      _mm512_store_ps(scales, inv);
      for (int t = 0; t < group; ++t) {
        output_tile(t, 2, sums);
        const int64_t d0 = (g0 + t) * 16, width = std::min<int64_t>(16, D - d0);
        for (int64_t j = 0; j < nh; ++j)
          for (int64_t d = 0; d < width; ++d) ob[j * D + d0 + d].x = round_bf16(sums[j * 16 + d] * scales[j]);
      }
    }
  }
};

// Whether this process may use AMX tiles: Linux grants them on request (once per process).
bool amx_ready() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
}

at::Tensor mqa_decode_attention_amx(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const c10::optional<at::Tensor>& allowed, double scale) {
  TORCH_CHECK(amx_ready(), "the OS did not grant AMX tiles to this process");
  return decode_attention<AmxAttention>(q, k, v, allowed, scale);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("amx_ready", &amx_ready, "whether the OS grants this process AMX tiles");
  m.def("mqa_decode_attention", &mqa_decode_attention_amx,
        "one-token attention on a one-head bf16 cache on AMX tiles");
}
