// The AVX512-VNNI GEMMs of decode_avx512.cpp (included there, after its helpers): int8 weights at
// more than one row, and int4 weights at any row count. Both keep 64 output columns of 4 inputs in
// 4 registers (vpdpbusd's native layout) and broadcast one activation dword to them.
#pragma once

// Several rows: a GEMM with vpdpbusd in its native layout. 64 output columns at a time, each thread
// transposes its weight rows into [K / 4][64 columns][4 inputs] (one register holds 4 inputs of 16
// columns), so one broadcast activation dword feeds 4 registers of columns and a loaded weight
// register feeds ROW_TILE rows: ~1 load per 3 multiplies where the one-row form above needs ~1 per 1,
// and no horizontal sums. The integer sums are exact, so every output equals the one-row kernel's
// bit for bit (the same epilogue): rows stay independent of the batch.
constexpr int64_t TILE_COLS = 64;
constexpr int ROW_TILE = 3;  // 3 rows x 4 column registers x (hi, lo) = 24 accumulators of 32
constexpr int64_t CHUNK = 512;  // inputs per transposed chunk: 32 KB, stays in L1 while every row group reads it

// 16 weight rows x 64 inputs (16 dwords each) -> 16 registers of one dword (4 inputs) per row.
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);      // dwords 0, 4, 8, 12 of rows i..i+3
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);  // 1, 5, 9, 13
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);  // 2, 6, 10, 14
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);  // 3, 7, 11, 15
  }
  for (int j = 0; j < 4; ++j) {  // u[j], u[4 + j], u[8 + j], u[12 + j]: dwords j, j + 4, j + 8, j + 12
    const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88), v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88), v3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xDD);
    r[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[j + 4] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[j + 12] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// tile[(k - k0) / 4 * 64 + c] = the 4 bytes (w + 128) of column n0 + c, inputs k .. k + 3, for k in
// [k0, k1) (multiples of 64); columns past N and inputs past K are zero weights.
void transpose_chunk(const int8_t* w, int64_t N, int64_t K, int64_t n0, int64_t k0, int64_t k1, int32_t* tile) {
  for (int64_t c0 = 0; c0 < TILE_COLS; c0 += 16) {
    for (int64_t k = k0; k < k1; k += 64) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t n = n0 + c0 + i;
        r[i] = n < N && k < K ? load_weight_bytes(w + n * K + k, K - k) : _mm512_set1_epi8((char)0x80);
      }
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(tile + ((k - k0) / 4 + j) * TILE_COLS + c0, r[j]);
    }
  }
}

// Software prefetch of the next chunk's weights (64 rows x its inputs) into L2, a few lines per
// inner iteration, so reading memory overlaps the multiplies (the hardware prefetcher does not run
// that far ahead over 64 row streams).
struct Prefetch {
  const int8_t* w = nullptr;  // first byte of the chunk's first row; nullptr: nothing left
  int64_t K = 0, rows = 0, bytes = 0, per_step = 0;
  int64_t row = 0, offset = 0;
  inline void step() {
    for (int64_t i = 0; i < per_step && w != nullptr; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(w + row * K + offset), _MM_HINT_T1);
      offset += 64;
      if (offset >= bytes) {
        offset = 0;
        if (++row == rows) w = nullptr;
      }
    }
  }
};

// One activation row's 8 accumulators (hi, lo x 4 column registers), named: GCC keeps arrays of
// vectors on the stack across the loop (measured 2x slower), named locals stay in registers.
struct RowSums {
  __m512i h0, h1, h2, h3, l0, l1, l2, l3;
  RowSums() : h0(_mm512_setzero_si512()), h1(h0), h2(h0), h3(h0), l0(h0), l1(h0), l2(h0), l3(h0) {}
  explicit RowSums(const int32_t* s)  // [hi x 64, lo x 64]
      : h0(_mm512_loadu_si512(s)), h1(_mm512_loadu_si512(s + 16)), h2(_mm512_loadu_si512(s + 32)),
        h3(_mm512_loadu_si512(s + 48)), l0(_mm512_loadu_si512(s + 64)), l1(_mm512_loadu_si512(s + 80)),
        l2(_mm512_loadu_si512(s + 96)), l3(_mm512_loadu_si512(s + 112)) {}
  __attribute__((always_inline)) inline void add(__m512i w0, __m512i w1, __m512i w2, __m512i w3, int32_t hi, int32_t lo) {
    const __m512i h = _mm512_set1_epi32(hi), l = _mm512_set1_epi32(lo);
    h0 = _mm512_dpbusd_epi32(h0, w0, h);
    h1 = _mm512_dpbusd_epi32(h1, w1, h);
    h2 = _mm512_dpbusd_epi32(h2, w2, h);
    h3 = _mm512_dpbusd_epi32(h3, w3, h);
    l0 = _mm512_dpbusd_epi32(l0, w0, l);
    l1 = _mm512_dpbusd_epi32(l1, w1, l);
    l2 = _mm512_dpbusd_epi32(l2, w2, l);
    l3 = _mm512_dpbusd_epi32(l3, w3, l);
  }
  // int4: acc[c] += (256 hi + lo - 8 xsum)[c] * scale[c] + xsum * zero[c] for the 64 columns of a group:
  // sum (q - 8) x exactly in integers (|256 hi + lo| <= 32000 * 15 * 128 < 2^31), then fp32.
  __attribute__((always_inline)) inline void scale_into(float* acc, const bf16* scale_zeros, int32_t xsum) const {
    const __m512 xs = _mm512_set1_ps((float)xsum);
    const __m512i mid = _mm512_set1_epi32(8 * xsum);
    const __m512i sums[4] = {
        _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(h0, 8), l0), mid),
        _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(h1, 8), l1), mid),
        _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(h2, 8), l2), mid),
        _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(h3, 8), l3), mid)};
    for (int q = 0; q < 4; ++q) {
      const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[q]), load16_ps(scale_zeros + q * 16, 16),
                                       _mm512_loadu_ps(acc + q * 16));
      _mm512_storeu_ps(acc + q * 16, _mm512_fmadd_ps(xs, load16_ps(scale_zeros + 64 + q * 16, 16), v));
    }
  }
  void store(int32_t* out) const {
    _mm512_storeu_si512(out, h0);
    _mm512_storeu_si512(out + 16, h1);
    _mm512_storeu_si512(out + 32, h2);
    _mm512_storeu_si512(out + 48, h3);
    _mm512_storeu_si512(out + 64, l0);
    _mm512_storeu_si512(out + 80, l1);
    _mm512_storeu_si512(out + 96, l2);
    _mm512_storeu_si512(out + 112, l3);
  }
};

// sums[(m * 2 + hi/lo) * 64 + c] += the exact sums of RT rows (from m0) against the 64 columns of
// `tile`, inputs [k0, k1).
template <int RT>
void tile_sums(const FixedPointRows& f, int64_t m0, const int32_t* tile, int64_t k0, int64_t k1, int32_t* sums,
               Prefetch& prefetch) {
  static_assert(RT >= 1 && RT <= 3, "three rows fill the registers");
  RowSums a(sums), b(RT >= 2 ? sums + 2 * TILE_COLS : sums), c(RT >= 3 ? sums + 4 * TILE_COLS : sums);
  const int32_t* h[3];
  const int32_t* l[3];
  for (int m = 0; m < RT; ++m) {
    h[m] = reinterpret_cast<const int32_t*>(f.hi.data() + (m0 + m) * f.K64);
    l[m] = reinterpret_cast<const int32_t*>(f.lo.data() + (m0 + m) * f.K64);
  }
  for (int64_t k4 = k0 / 4; k4 < k1 / 4; ++k4) {
    const int32_t* wk = tile + (k4 - k0 / 4) * TILE_COLS;
    const __m512i w0 = _mm512_loadu_si512(wk), w1 = _mm512_loadu_si512(wk + 16);
    const __m512i w2 = _mm512_loadu_si512(wk + 32), w3 = _mm512_loadu_si512(wk + 48);
    a.add(w0, w1, w2, w3, h[0][k4], l[0][k4]);
    if constexpr (RT >= 2) b.add(w0, w1, w2, w3, h[1][k4], l[1][k4]);
    if constexpr (RT >= 3) c.add(w0, w1, w2, w3, h[2][k4], l[2][k4]);
    prefetch.step();
  }
  a.store(sums);
  if constexpr (RT >= 2) b.store(sums + 2 * TILE_COLS);
  if constexpr (RT >= 3) c.store(sums + 4 * TILE_COLS);
}

// dot = (256 hi + lo - 128 sum q) * sx, as dots_int8 computes it (exact in double, one rounding each way).
inline void tile_dots(const int32_t* sums, int64_t q_sum, float sx, float* dot) {
  const __m512d shift = _mm512_set1_pd(256.0), fix = _mm512_set1_pd(128.0 * (double)q_sum),
                scale = _mm512_set1_pd((double)sx);
  for (int64_t c = 0; c < TILE_COLS; c += 8) {
    const __m512d hi = _mm512_cvtepi32_pd(_mm256_loadu_si256((const __m256i*)(sums + c)));
    const __m512d lo = _mm512_cvtepi32_pd(_mm256_loadu_si256((const __m256i*)(sums + TILE_COLS + c)));
    const __m512d sum = _mm512_sub_pd(_mm512_fmadd_pd(hi, shift, lo), fix);
    _mm256_storeu_ps(dot + c, _mm512_cvtpd_ps(_mm512_mul_pd(sum, scale)));
  }
}

at::Tensor linear_int8_rows(const at::Tensor& x, const at::Tensor& weight, const bf16* scales,
                               const bf16* bias, bool gelu) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const FixedPointRows f = to_fixed_point_rows(x.data_ptr<bf16>(), M, K);
  const int8_t* wp = weight.data_ptr<int8_t>();
  auto out = at::empty({M, N}, x.options());
  bf16* op = out.data_ptr<bf16>();
  const int64_t groups = (M + ROW_TILE - 1) / ROW_TILE;
  at::parallel_for(0, (N + TILE_COLS - 1) / TILE_COLS, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> tile(CHUNK / 4 * TILE_COLS), sums(groups * ROW_TILE * 2 * TILE_COLS);
    std::vector<float> dot(TILE_COLS);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * TILE_COLS, width = std::min(TILE_COLS, N - n0);
      std::fill(sums.begin(), sums.end(), 0);
      for (int64_t k0 = 0; k0 < f.K64; k0 += CHUNK) {
        const int64_t k1 = std::min(k0 + CHUNK, f.K64);
        transpose_chunk(wp, N, K, n0, k0, k1, tile.data());
        // the next chunk: the rest of this tile's inputs, else the next tile's first
        Prefetch next;
        const int64_t nn0 = k1 < f.K64 ? n0 : n0 + TILE_COLS, nk0 = k1 < f.K64 ? k1 : 0;
        if ((k1 < f.K64 || t + 1 < end) && nk0 < K) {
          next.w = wp + std::min(nn0, N - 1) * K + nk0;
          next.K = K;
          next.rows = std::min(TILE_COLS, N - nn0);
          next.bytes = std::min(CHUNK, K - nk0);
          next.per_step = std::max<int64_t>(1, (next.rows * ((next.bytes + 63) / 64)) / (groups * ((k1 - k0) / 4)) + 1);
        }
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t m0 = g * ROW_TILE, rows = std::min<int64_t>(ROW_TILE, M - m0);
          int32_t* gs = sums.data() + g * ROW_TILE * 2 * TILE_COLS;
          if (rows == 3) tile_sums<3>(f, m0, tile.data(), k0, k1, gs, next);
          else if (rows == 2) tile_sums<2>(f, m0, tile.data(), k0, k1, gs, next);
          else tile_sums<1>(f, m0, tile.data(), k0, k1, gs, next);
        }
      }
      for (int64_t m = 0; m < M; ++m) {
        tile_dots(sums.data() + m * 2 * TILE_COLS, f.sum[m], f.scale[m], dot.data());
        finish_row(dot.data(), width, scales ? scales + n0 : nullptr, bias ? bias + n0 : nullptr, gelu,
                   op + m * N + n0);
      }
    }
  });
  return out;
}

// int4: groups of INT4_GROUP inputs, w = (q - 8) * scale + zero (q in 0..15, scale and zero per column
// and group: torch's convention, whose zero is small, so its bf16 rounding costs little), packed by
// plugins.kernels.quant.pack_int4_tiles in this kernel's order, so nothing is transposed at run
// time: tile t, inputs 4 s .. 4 s + 3 are 128 bytes: bytes [0, 64) hold columns 0-15 in their low
// nibbles and 16-31 in their high ones, bytes [64, 128) columns 32-47 and 48-63, each column a dword
// of 4 inputs. Per group: sum w x = sx * (scale * sum (q - 8) xq + zero * sum xq), the sums exact.
constexpr int64_t INT4_GROUP = 128;
constexpr int INT4_ROW_TILE = 2;  // 16 accumulators: the nibbles' unpacking needs the registers a third row would take

// acc[m * 64 + c] += the groups [k0, k1) of RT rows (from m0) against tile columns c.
template <int RT>
void int4_tile(const FixedPointRows& f, int64_t m0, const uint8_t* tile, const bf16* scale_zeros, int64_t k0,
               int64_t k1, float* acc) {
  const int32_t* h[3];
  const int32_t* l[3];
  for (int m = 0; m < RT; ++m) {
    h[m] = reinterpret_cast<const int32_t*>(f.hi.data() + (m0 + m) * f.K64);
    l[m] = reinterpret_cast<const int32_t*>(f.lo.data() + (m0 + m) * f.K64);
  }
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t g = k0 / INT4_GROUP; g < k1 / INT4_GROUP; ++g) {
    RowSums a, b, c;
    for (int64_t k4 = g * INT4_GROUP / 4; k4 < (g + 1) * INT4_GROUP / 4; ++k4) {
      const __m512i lo_half = _mm512_loadu_si512(tile + k4 * 128), hi_half = _mm512_loadu_si512(tile + k4 * 128 + 64);
      const __m512i w0 = _mm512_and_si512(lo_half, nibble), w1 = _mm512_and_si512(_mm512_srli_epi16(lo_half, 4), nibble);
      const __m512i w2 = _mm512_and_si512(hi_half, nibble), w3 = _mm512_and_si512(_mm512_srli_epi16(hi_half, 4), nibble);
      a.add(w0, w1, w2, w3, h[0][k4], l[0][k4]);
      if constexpr (RT >= 2) b.add(w0, w1, w2, w3, h[1][k4], l[1][k4]);
      if constexpr (RT >= 3) c.add(w0, w1, w2, w3, h[2][k4], l[2][k4]);
    }
    const bf16* so = scale_zeros + g * 2 * TILE_COLS;  // [scale x 64, zero x 64]
    const int32_t* xsum = f.group_sum.data() + m0 * (f.K64 / INT4_GROUP) + g;
    a.scale_into(acc + m0 * TILE_COLS, so, xsum[0]);
    if constexpr (RT >= 2) b.scale_into(acc + (m0 + 1) * TILE_COLS, so, xsum[f.K64 / INT4_GROUP]);
    if constexpr (RT >= 3) c.scale_into(acc + (m0 + 2) * TILE_COLS, so, xsum[2 * f.K64 / INT4_GROUP]);
  }
}

// x [M, K] bf16; packed uint8 [T, K' / 4, 128] (K' = K rounded up to a group); scale_zeros bf16
// [T, K' / INT4_GROUP, 2, 64]; N <= 64 T outputs; bias [N] bf16 or None -> [M, N] bf16.
at::Tensor linear_int4(at::Tensor x, at::Tensor packed, at::Tensor scale_zeros, int64_t N,
                          c10::optional<at::Tensor> bias, bool gelu) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "x: contiguous [M, K] bf16");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == 128 && packed.is_contiguous(),
              "packed: contiguous [T, K / 4, 128] uint8");
  const int64_t M = x.size(0), K = x.size(1), T = packed.size(0), padded = packed.size(1) * 4;
  TORCH_CHECK(padded % INT4_GROUP == 0 && K <= padded && padded - K < INT4_GROUP && N <= T * TILE_COLS &&
                  N > (T - 1) * TILE_COLS, "packed shape does not match x and N");
  TORCH_CHECK(scale_zeros.scalar_type() == at::kBFloat16 && scale_zeros.is_contiguous() &&
                  scale_zeros.numel() == T * (padded / INT4_GROUP) * 2 * TILE_COLS,
              "scale_zeros: contiguous [T, groups, 2, 64] bf16");
  const bf16* bp = decode::vector_ptr(bias, N, "bias");
  const FixedPointRows f = to_fixed_point_rows(x.data_ptr<bf16>(), M, K, INT4_GROUP);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const bf16* sp = scale_zeros.data_ptr<bf16>();
  auto out = at::empty({M, N}, x.options());
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(M * TILE_COLS), dot(TILE_COLS);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * TILE_COLS, width = std::min(TILE_COLS, N - n0);
      const uint8_t* tile = wp + t * (padded / 4) * 128;
      const bf16* so = sp + t * (padded / INT4_GROUP) * 2 * TILE_COLS;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t k0 = 0; k0 < padded; k0 += CHUNK) {  // a chunk (32 KB of weights) is read by every row group
        const int64_t k1 = std::min(k0 + CHUNK, padded);
        for (int64_t m0 = 0; m0 < M; m0 += INT4_ROW_TILE) {
          if (M - m0 >= 2) int4_tile<2>(f, m0, tile, so, k0, k1, acc.data());
          else int4_tile<1>(f, m0, tile, so, k0, k1, acc.data());
        }
      }
      for (int64_t m = 0; m < M; ++m) {
        const __m512 sx = _mm512_set1_ps(f.scale[m]);
        for (int64_t c = 0; c < TILE_COLS; c += 16)
          _mm512_storeu_ps(dot.data() + c, _mm512_mul_ps(_mm512_loadu_ps(acc.data() + m * TILE_COLS + c), sx));
        finish_row(dot.data(), width, nullptr, bp ? bp + n0 : nullptr, gelu, op + m * N + n0);
      }
    }
  });
  return out;
}
