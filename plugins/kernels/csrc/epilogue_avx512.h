// The AVX512 kernels' shared helpers (decode_avx512.cpp, decode_avx512f.cpp): bf16 loads and
// the vectorized epilogue (scale, bias, tanh GELU in fp32, one rounding to bf16). Included inside
// each source's anonymous namespace, after `using namespace decode`.
#pragma once

inline __m512 load16_ps(const bf16* p, int64_t remaining) {  // 16 bf16 -> fp32, zero past `remaining`
  const __mmask16 keep = remaining >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << remaining) - 1);
  const __m256i raw = _mm256_maskz_loadu_epi16(keep, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// fp32 -> bf16, round to nearest even: one instruction with AVX512-BF16; without it, c10::BFloat16's
// own rule (add 0x7fff plus the kept lowest bit, drop the low half; NaN -> 0x7fc0), so the avx512f
// kernel rounds as torch does.
inline __m256i to_bf16(__m512 v) {
#ifdef __AVX512BF16__
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
#endif
}

// finish_row_scalar 16 outputs at a time; tanh(u) = 1 - 2 / (exp(2u) + 1) with exp from 2^n times a
// degree-6 polynomial on [-0.5, 0.5] (relative error ~1e-7, far below bf16's rounding); each
// output gets the same instructions wherever it falls, the last partial vector masked.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));  // x / ln 2
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));  // in [-0.35, 0.35]
  __m512 p = _mm512_set1_ps(1.0f / 720);
  for (float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

void finish_row(const float* dot, int64_t count, const bf16* scales, const bf16* bias, bool gelu, bf16* out) {
  for (int64_t i = 0; i < count; i += 16) {
    const __mmask16 keep = count - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (count - i)) - 1);
    __m512 v = _mm512_maskz_loadu_ps(keep, dot + i);
    if (scales) v = _mm512_mul_ps(v, load16_ps(scales + i, count - i));
    if (bias) v = _mm512_add_ps(v, load16_ps(bias + i, count - i));
    if (gelu) {
      const __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                     _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), v), _mm512_mul_ps(v, v), v));
      const __m512 th = _mm512_sub_ps(_mm512_set1_ps(1.0f), _mm512_div_ps(_mm512_set1_ps(2.0f),
                                      _mm512_add_ps(exp_ps(_mm512_add_ps(u, u)), _mm512_set1_ps(1.0f))));
      v = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), v), _mm512_add_ps(_mm512_set1_ps(1.0f), th));
    }
    _mm256_mask_storeu_epi16(out + i, keep, to_bf16(v));
  }
}

