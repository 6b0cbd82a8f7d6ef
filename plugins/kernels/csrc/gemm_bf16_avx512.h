// The bf16 GEMM of decode_avx512.cpp and decode_avx512f.cpp (included there, after their helpers),
// for every row count.
//
// Weights are packed once (plugins.kernels.pack_tiles) as [T][K2][64 columns][2 inputs]: one
// register holds 16 columns x 2 consecutive inputs (vdpbf16ps's layout), so one pair of activations
// feeds 4 column registers and one loaded weight register feeds up to BF16_ROW_TILE rows, with no
// horizontal sums. A thread's tiles are one contiguous stream. Each output keeps one fp32 lane that
// adds its input pairs in order from zero, whatever the row count or the tiling: every row equals
// the same row computed alone, bit for bit.
//
// With AVX512-BF16 a pair is one vdpbf16ps on the bf16 activation pair. Without it (AVX512F) a
// weight register is widened in two ALU ops (input 2p of each column: a shift; input 2p + 1: a
// mask), and each row adds two FMAs on fp32 activations (the even input, then the odd): 2 widening
// ops per 12 FMAs at 6 rows. GCC keeps the 12 activation broadcasts in registers and spills 7 of the
// 24 sums to the stack; a 16-row tile of one column register (no spills) measured 1.3-2x slower.
#pragma once

#include <cstring>

#ifdef __AVX512BF16__
using XPair = uint32_t;       // an activation pair: two bf16 in one element
constexpr int64_t XPAIR = 1;  // elements per pair
#else
using XPair = float;          // an activation pair: two fp32 elements, the even input first
constexpr int64_t XPAIR = 2;
#endif
constexpr int BF16_ROW_TILE = 6;      // 6 rows x 4 column registers = 24 accumulators
constexpr int64_t BF16_BLOCK = 128;   // input pairs per block: 32 KB of weights, in L1 while every row tile reads it
constexpr int64_t BF16_ROW_CHUNK = 96;  // rows whose activation blocks (48 KB) stay in L2 across a tile's blocks

// One row's 64 columns, named (GCC keeps arrays of vectors on the stack; see RowSums).
struct ColSums {
  __m512 c0, c1, c2, c3;
  __attribute__((always_inline)) inline void load(const float* s) {
    c0 = _mm512_loadu_ps(s);
    c1 = _mm512_loadu_ps(s + 16);
    c2 = _mm512_loadu_ps(s + 32);
    c3 = _mm512_loadu_ps(s + 48);
  }
  __attribute__((always_inline)) inline void store(float* s) const {
    _mm512_storeu_ps(s, c0);
    _mm512_storeu_ps(s + 16, c1);
    _mm512_storeu_ps(s + 32, c2);
    _mm512_storeu_ps(s + 48, c3);
  }
#ifdef __AVX512BF16__
  __attribute__((always_inline)) inline void add(__m512bh w0, __m512bh w1, __m512bh w2, __m512bh w3, const XPair* pair) {
    uint32_t bits;
    std::memcpy(&bits, pair, 4);
    const __m512bh x = (__m512bh)_mm512_set1_epi32((int)bits);
    c0 = _mm512_dpbf16_ps(c0, w0, x);
    c1 = _mm512_dpbf16_ps(c1, w1, x);
    c2 = _mm512_dpbf16_ps(c2, w2, x);
    c3 = _mm512_dpbf16_ps(c3, w3, x);
  }
#else
  // column register C += even * x[0], then += odd * x[1]
  template <int C>
  __attribute__((always_inline)) inline void add(__m512 even, __m512 odd, const XPair* pair) {
    __m512& c = C == 0 ? c0 : C == 1 ? c1 : C == 2 ? c2 : c3;
    c = _mm512_fmadd_ps(even, _mm512_set1_ps(pair[0]), c);
    c = _mm512_fmadd_ps(odd, _mm512_set1_ps(pair[1]), c);
  }
#endif
};

#ifndef __AVX512BF16__
// Column register C of the pair at `wp`, widened, into every row tile's sums.
template <int C, int RT>
__attribute__((always_inline)) inline void add_column(const bf16* wp, const XPair* x, int64_t stride, ColSums& a0,
                                                      ColSums& a1, ColSums& a2, ColSums& a3, ColSums& a4, ColSums& a5) {
  const __m512i w = _mm512_loadu_si512(wp + 32 * C);
  const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  a0.add<C>(even, odd, x);
  if constexpr (RT >= 2) a1.add<C>(even, odd, x + stride);
  if constexpr (RT >= 3) a2.add<C>(even, odd, x + 2 * stride);
  if constexpr (RT >= 4) a3.add<C>(even, odd, x + 3 * stride);
  if constexpr (RT >= 5) a4.add<C>(even, odd, x + 4 * stride);
  if constexpr (RT >= 6) a5.add<C>(even, odd, x + 5 * stride);
}
#endif

// Prefetch of the next block (contiguous bytes) into L2, spread over the current block's iterations.
struct BlockPrefetch {
  const char* next = nullptr;
  const char* end = nullptr;
  int64_t per_step = 0;
  __attribute__((always_inline)) inline void step() {
    for (int64_t i = 0; i < per_step && next < end; ++i, next += 64) _mm_prefetch(next, _MM_HINT_T1);
  }
};

// acc[r * 64 + c] += the pairs [0, pairs) of block `w` ([pairs][64][2]) against rows x + r * stride.
template <int RT>
void bf16_tile(const XPair* x, int64_t stride, const bf16* w, int64_t pairs, float* acc, BlockPrefetch& pf) {
  static_assert(RT >= 1 && RT <= BF16_ROW_TILE, "six rows fill the registers");
  ColSums a0, a1, a2, a3, a4, a5;
  a0.load(acc);
  if constexpr (RT >= 2) a1.load(acc + 64);
  if constexpr (RT >= 3) a2.load(acc + 128);
  if constexpr (RT >= 4) a3.load(acc + 192);
  if constexpr (RT >= 5) a4.load(acc + 256);
  if constexpr (RT >= 6) a5.load(acc + 320);
  for (int64_t p = 0; p < pairs; ++p) {
    const bf16* wp = w + p * 128;
#ifdef __AVX512BF16__
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wp + 64), w3 = (__m512bh)_mm512_loadu_si512(wp + 96);
    a0.add(w0, w1, w2, w3, x + p);
    if constexpr (RT >= 2) a1.add(w0, w1, w2, w3, x + stride + p);
    if constexpr (RT >= 3) a2.add(w0, w1, w2, w3, x + 2 * stride + p);
    if constexpr (RT >= 4) a3.add(w0, w1, w2, w3, x + 3 * stride + p);
    if constexpr (RT >= 5) a4.add(w0, w1, w2, w3, x + 4 * stride + p);
    if constexpr (RT >= 6) a5.add(w0, w1, w2, w3, x + 5 * stride + p);
#else
    const XPair* xp = x + 2 * p;
    add_column<0, RT>(wp, xp, stride, a0, a1, a2, a3, a4, a5);
    add_column<1, RT>(wp, xp, stride, a0, a1, a2, a3, a4, a5);
    add_column<2, RT>(wp, xp, stride, a0, a1, a2, a3, a4, a5);
    add_column<3, RT>(wp, xp, stride, a0, a1, a2, a3, a4, a5);
#endif
    pf.step();
  }
  a0.store(acc);
  if constexpr (RT >= 2) a1.store(acc + 64);
  if constexpr (RT >= 3) a2.store(acc + 128);
  if constexpr (RT >= 4) a3.store(acc + 192);
  if constexpr (RT >= 5) a4.store(acc + 256);
  if constexpr (RT >= 6) a5.store(acc + 320);
}

using Bf16Tile = void (*)(const XPair*, int64_t, const bf16*, int64_t, float*, BlockPrefetch&);
constexpr Bf16Tile BF16_TILES[BF16_ROW_TILE + 1] = {nullptr, bf16_tile<1>, bf16_tile<2>, bf16_tile<3>,
                                                    bf16_tile<4>, bf16_tile<5>, bf16_tile<6>};

// x [M, K] bf16; packed bf16 [T, K2, 64, 2] (K2 = ceil(K / 2), zero past N and K); bias [N] bf16 or
// None -> [M, N] bf16, through the one-row kernels' epilogue.
at::Tensor linear_bf16_tiles(at::Tensor x, at::Tensor packed, int64_t N, c10::optional<at::Tensor> bias,
                                bool gelu) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "x: [M, K] bf16");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.size(2) == 64 &&
                  packed.size(3) == 2 && packed.is_contiguous(), "packed: contiguous [T, K2, 64, 2] bf16");
  const int64_t M = x.size(0), K = x.size(1), T = packed.size(0), K2 = packed.size(1);
  TORCH_CHECK(K2 == (K + 1) / 2 && N <= T * 64 && N > (T - 1) * 64, "packed shape does not match x and N");
  const bf16* bp = decode::vector_ptr(bias, N, "bias");
  // activation pairs, zero-padded when K is odd (the last pair's second input)
#ifdef __AVX512BF16__
  const at::Tensor xs = K % 2 ? at::constant_pad_nd(x, {0, 1}).contiguous() : x.contiguous();
  const XPair* xp = reinterpret_cast<const XPair*>(xs.data_ptr<bf16>());
#else
  // in fp32, widened here (torch's own conversion took ~4x the time, measured at 16 x 8192)
  const at::Tensor xc = x.contiguous();
  std::vector<float> xs(M * K2 * 2, 0.0f);
  for (int64_t m = 0; m < M; ++m) {
    const bf16* src = xc.data_ptr<bf16>() + m * K;
    float* dst = xs.data() + m * K2 * 2;
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 keep = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
      _mm512_mask_storeu_ps(dst + k, keep, load16_ps(src + k, K - k));
    }
  }
  const XPair* xp = xs.data();
#endif
  const bf16* wp = packed.data_ptr<bf16>();
  auto out = at::empty({M, N}, x.options());
  bf16* op = out.data_ptr<bf16>();
  const int64_t tile_elems = K2 * 128, blocks = (K2 + BF16_BLOCK - 1) / BF16_BLOCK;
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(std::min(M, BF16_ROW_CHUNK) * 64);
    const char* stream_end = reinterpret_cast<const char*>(wp + end * tile_elems);
    for (int64_t r0 = 0; r0 < M; r0 += BF16_ROW_CHUNK) {
      const int64_t rows = std::min(BF16_ROW_CHUNK, M - r0), row_tiles = (rows + BF16_ROW_TILE - 1) / BF16_ROW_TILE;
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n0 = t * 64, width = std::min<int64_t>(64, N - n0);
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t p0 = b * BF16_BLOCK, pairs = std::min(BF16_BLOCK, K2 - p0);
          const bf16* block = wp + t * tile_elems + p0 * 128;
          // The next block of this thread's stream (the next tile's first, at a tile's end) into L2 while
          // the row tiles reread this one; one row tile reads once, the hardware prefetcher keeps up.
          BlockPrefetch pf;
          if (row_tiles > 1) {
            pf.next = reinterpret_cast<const char*>(block + pairs * 128);
            pf.end = std::min(stream_end, pf.next + BF16_BLOCK * 256);
            pf.per_step = (BF16_BLOCK * 4 + pairs * row_tiles - 1) / (pairs * row_tiles);
          }
          for (int64_t m = 0; m < rows; m += BF16_ROW_TILE) {
            const int64_t rt = std::min<int64_t>(BF16_ROW_TILE, rows - m);
            BF16_TILES[rt](xp + ((r0 + m) * K2 + p0) * XPAIR, K2 * XPAIR, block, pairs, acc.data() + m * 64, pf);
          }
        }
        for (int64_t m = 0; m < rows; ++m)
          finish_row(acc.data() + m * 64, width, nullptr, bp ? bp + n0 : nullptr, gelu, op + (r0 + m) * N + n0);
      }
    }
  });
  return out;
}
