// One-token attention on a one-head (MQA) bf16 cache with AMX tiles for the scores (Xeons with
// AMX-BF16): each block of 16 cached keys is one tile read straight from the cache, the query's heads
// (bf16, pairs of dims interleaved as TDPBF16PS wants) the other, fp32 sums; scaled after the sum.
// Softmax and the weighted sum of values are attention_avx512.h's. A module of its own so that a
// compiler without AMX support costs only this kernel, not the avx512 rung.
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

// Tiles: 0 the scores [16 keys][16 heads] fp32, 1 keys [16][32 dims] bf16, 2 the query's 32 dims
// [16 pairs][16 heads x 2] bf16. Each thread that runs it loads the configuration and releases the
// tiles when done. A head dim that is not a multiple of 32 is zero-padded (keys copied, as the last
// block of fewer than 16 keys is: a tile must not read past the cache).
struct AmxScores {
  int64_t D32;
  std::vector<bf16> qv, tail;
  alignas(64) float sums[256];
  explicit AmxScores(int64_t D) : D32((D + 31) / 32 * 32), qv(D32 * 16), tail(16 * D32) {
    TileConfig config;
    for (int t = 0; t < 3; ++t) config.rows[t] = 16, config.colsb[t] = 64;
    _tile_loadconfig(&config);
  }
  ~AmxScores() { _tile_release(); }
  void operator()(const bf16* qb, int64_t qs1, int64_t nh, const bf16* kb, int64_t ks1, int64_t L, int64_t D,
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
};

// Whether this process may use AMX tiles: Linux grants them on request (once per process).
bool amx_ready() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
}

at::Tensor mqa_decode_attention_amx(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const c10::optional<at::Tensor>& allowed, double scale) {
  TORCH_CHECK(amx_ready(), "the OS did not grant AMX tiles to this process");
  return decode_attention<AmxScores>(q, k, v, allowed, scale);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("amx_ready", &amx_ready, "whether the OS grants this process AMX tiles");
  m.def("mqa_decode_attention", &mqa_decode_attention_amx,
        "one-token attention on a one-head bf16 cache, scores on AMX tiles");
}
