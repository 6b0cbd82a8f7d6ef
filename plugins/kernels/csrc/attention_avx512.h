// Decode attention on a one-head (MQA) bf16 cache, for decode_avx512.cpp and decode_avx512f.cpp
// (included after epilogue_avx512.h): one query token per sequence, all query heads against the
// same keys and values.
//
// The heads are the vector lanes: 16 heads of a sequence are one register, so each key and value
// element is widened to fp32 once and broadcast into one FMA for all 16 heads; no horizontal sums.
// Scores, softmax (exp_ps) and the weighted sum of values are fp32; the output is rounded once.
// santacoder-1b at bs16 (16 heads x 136 keys x 128, 2 threads, AVX512F Xeon): ~0.47 ms a layer against
// SDPA's 0.54-0.65 in the same run (~0.8 inside a decode step); one thread runs ~0.9 G FMAs of 16 lanes
// a second here, two thirds of the GEMM's rate (each FMA takes a broadcast load).
#pragma once

constexpr int64_t ATTN_KEYS = 64;  // keys (or values) widened to fp32 at a time: 32 KB at head dim 128

inline void widen_rows(const bf16* src, int64_t stride, int64_t rows, int64_t D, float* dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < D; d += 16) {
      const __mmask16 keep = D - d >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (D - d)) - 1);
      _mm512_mask_storeu_ps(dst + r * D + d, keep, load16_ps(src + r * stride + d, D - d));
    }
}

// Named accumulators below: GCC keeps arrays of vectors on the stack, and a sum that goes through
// memory every step (store, reload) runs several times slower.

// s[0..7] = sum over d of qt[d] * kf[i * D + d] for eight keys, 16 heads each (eight FMA chains)
inline void scores8(const float* qt, const float* kf, int64_t D, __m512* s) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t d = 0; d < D; ++d) {
    const __m512 qv = _mm512_loadu_ps(qt + d * 16);
    a0 = _mm512_fmadd_ps(qv, _mm512_set1_ps(kf[d]), a0);
    a1 = _mm512_fmadd_ps(qv, _mm512_set1_ps(kf[D + d]), a1);
    a2 = _mm512_fmadd_ps(qv, _mm512_set1_ps(kf[2 * D + d]), a2);
    a3 = _mm512_fmadd_ps(qv, _mm512_set1_ps(kf[3 * D + d]), a3);
    a4 = _mm512_fmadd_ps(qv, _mm512_set1_ps(kf[4 * D + d]), a4);
    a5 = _mm512_fmadd_ps(qv, _mm512_set1_ps(kf[5 * D + d]), a5);
    a6 = _mm512_fmadd_ps(qv, _mm512_set1_ps(kf[6 * D + d]), a6);
    a7 = _mm512_fmadd_ps(qv, _mm512_set1_ps(kf[7 * D + d]), a7);
  }
  s[0] = a0, s[1] = a1, s[2] = a2, s[3] = a3, s[4] = a4, s[5] = a5, s[6] = a6, s[7] = a7;
}

inline __m512 scores1(const float* qt, const float* kf, int64_t D) {
  __m512 a = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) a = _mm512_fmadd_ps(_mm512_loadu_ps(qt + d * 16), _mm512_set1_ps(kf[d]), a);
  return a;
}

// ot[j] += sum over n keys of p[l] * vf[l * D + j] for head-dim columns j < 8 (16 heads each)
inline void weighted_sum8(const float* p, const float* vf, int64_t D, int64_t n, float* ot) {
  __m512 a0 = _mm512_loadu_ps(ot), a1 = _mm512_loadu_ps(ot + 16), a2 = _mm512_loadu_ps(ot + 32),
         a3 = _mm512_loadu_ps(ot + 48), a4 = _mm512_loadu_ps(ot + 64), a5 = _mm512_loadu_ps(ot + 80),
         a6 = _mm512_loadu_ps(ot + 96), a7 = _mm512_loadu_ps(ot + 112);
  for (int64_t l = 0; l < n; ++l) {
    const __m512 pl = _mm512_loadu_ps(p + l * 16);
    const float* v = vf + l * D;
    a0 = _mm512_fmadd_ps(pl, _mm512_set1_ps(v[0]), a0);
    a1 = _mm512_fmadd_ps(pl, _mm512_set1_ps(v[1]), a1);
    a2 = _mm512_fmadd_ps(pl, _mm512_set1_ps(v[2]), a2);
    a3 = _mm512_fmadd_ps(pl, _mm512_set1_ps(v[3]), a3);
    a4 = _mm512_fmadd_ps(pl, _mm512_set1_ps(v[4]), a4);
    a5 = _mm512_fmadd_ps(pl, _mm512_set1_ps(v[5]), a5);
    a6 = _mm512_fmadd_ps(pl, _mm512_set1_ps(v[6]), a6);
    a7 = _mm512_fmadd_ps(pl, _mm512_set1_ps(v[7]), a7);
  }
  _mm512_storeu_ps(ot, a0), _mm512_storeu_ps(ot + 16, a1), _mm512_storeu_ps(ot + 32, a2);
  _mm512_storeu_ps(ot + 48, a3), _mm512_storeu_ps(ot + 64, a4), _mm512_storeu_ps(ot + 80, a5);
  _mm512_storeu_ps(ot + 96, a6), _mm512_storeu_ps(ot + 112, a7);
}

inline void weighted_sum1(const float* p, const float* vf, int64_t D, int64_t n, float* ot) {
  __m512 a = _mm512_loadu_ps(ot);
  for (int64_t l = 0; l < n; ++l) a = _mm512_fmadd_ps(_mm512_loadu_ps(p + l * 16), _mm512_set1_ps(vf[l * D]), a);
  _mm512_storeu_ps(ot, a);
}

// One query token's 16 heads against every key with fp32 FMAs (heads j < nh; the other lanes 0):
// `scores`: sc[l * 16 + j] = scale * q_j . k_l; `values`: ob[j * D + d] = bf16(inv_j * sum over l of
// p[l * 16 + j] v_l[d]). Per thread: the query and a block of keys or values widened to fp32.
struct FmaAttention {
  std::vector<float> qt, block, ot;
  explicit FmaAttention(int64_t D) : qt(D * 16), block(ATTN_KEYS * D), ot(D * 16) {}
  void scores(const bf16* qb, int64_t qs1, int64_t nh, const bf16* kb, int64_t ks1, int64_t L, int64_t D,
              float scale, float* sc) {
    std::fill(qt.begin(), qt.end(), 0.0f);
    for (int64_t j = 0; j < nh; ++j)
      for (int64_t d = 0; d < D; ++d) qt[d * 16 + j] = static_cast<float>(qb[j * qs1 + d]) * scale;
    __m512 s[8];
    for (int64_t l0 = 0; l0 < L; l0 += ATTN_KEYS) {  // eight keys at a time
      const int64_t n = std::min(ATTN_KEYS, L - l0);
      widen_rows(kb + l0 * ks1, ks1, n, D, block.data());
      for (int64_t l = 0; l < n;) {
        const int64_t keys = n - l >= 8 ? 8 : 1;
        if (keys == 8) scores8(qt.data(), block.data() + l * D, D, s);
        else s[0] = scores1(qt.data(), block.data() + l * D, D);
        for (int64_t i = 0; i < keys; ++i, ++l) _mm512_storeu_ps(sc + (l0 + l) * 16, s[i]);
      }
    }
  }
  void values(const float* p, const bf16* vb, int64_t vs1, int64_t L, int64_t D, __m512 inv, int64_t nh, bf16* ob) {
    std::fill(ot.begin(), ot.end(), 0.0f);  // ot [D][16 heads], eight head-dim columns at a time
    for (int64_t l0 = 0; l0 < L; l0 += ATTN_KEYS) {
      const int64_t n = std::min(ATTN_KEYS, L - l0);
      widen_rows(vb + l0 * vs1, vs1, n, D, block.data());
      for (int64_t d0 = 0; d0 < D; d0 += 8) {
        if (D - d0 >= 8) weighted_sum8(p + l0 * 16, block.data() + d0, D, n, ot.data() + d0 * 16);
        else
          for (int64_t d = d0; d < D; ++d) weighted_sum1(p + l0 * 16, block.data() + d, D, n, ot.data() + d * 16);
      }
    }
    alignas(64) float row[16];
    for (int64_t d = 0; d < D; ++d) {
      _mm512_store_ps(row, _mm512_mul_ps(_mm512_loadu_ps(ot.data() + d * 16), inv));
      for (int64_t j = 0; j < nh; ++j) ob[j * D + d].x = round_bf16(row[j]);
    }
  }
};

// q [B, H, D], k and v [B, L, D] (head dim contiguous, other strides free: views of the cache),
// allowed [B, L] bool or None -> [B, H * D]: softmax(scale * q k^T, over allowed keys) v per head.
// A sequence with no allowed key gets zeros. `Kernel` (FmaAttention, or the AMX kernel's) computes the
// scores and the weighted sum of values; the softmax between them is this function's.
template <class Kernel>
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& allowed, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "bf16 q, k, v");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && k.size(0) == q.size(0) && k.size(2) == q.size(2),
              "q [B, H, D], k and v [B, L, D]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "the head dim must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), L = k.size(1);
  const bool* mp = nullptr;
  int64_t mb = 0, ml = 0;
  if (allowed.has_value() && allowed->defined()) {
    TORCH_CHECK(allowed->scalar_type() == at::kBool && allowed->dim() == 2 && allowed->size(0) == B &&
                allowed->size(1) == L, "allowed must be bool [B, L]");
    mp = allowed->data_ptr<bool>();
    mb = allowed->stride(0);
    ml = allowed->stride(1);
  }
  auto out = at::empty({B, H * D}, q.options());
  const bf16 *qp = q.data_ptr<bf16>(), *kp = k.data_ptr<bf16>(), *vp = v.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  // strides read once: Tensor::stride() checks its argument on every call
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0),
                vs1 = v.stride(1);
  const int64_t chunks = (H + 15) / 16;
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, B * chunks, 1, [&](int64_t begin, int64_t end) {
    Kernel kernel(D);
    std::vector<float> probs(L * 16);
    float* sc = probs.data();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / chunks, h0 = (task % chunks) * 16, nh = std::min<int64_t>(16, H - h0);
      auto is_allowed = [&](int64_t l) { return mp == nullptr || mp[b * mb + l * ml]; };
      kernel.scores(qp + b * qs0 + h0 * qs1, qs1, nh, kp + b * ks0, ks1, L, D, fscale, sc);
      __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int64_t l = 0; l < L; ++l)
        if (is_allowed(l)) top = _mm512_max_ps(top, _mm512_loadu_ps(sc + l * 16));
      __m512 total = _mm512_setzero_ps();
      const bool any = _mm512_reduce_min_ps(top) > -std::numeric_limits<float>::infinity();
      for (int64_t l = 0; l < L; ++l) {
        const __m512 p = any && is_allowed(l) ? exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sc + l * 16), top))
                                              : _mm512_setzero_ps();
        _mm512_storeu_ps(sc + l * 16, p);
        total = _mm512_add_ps(total, p);
      }

      const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_max_ps(total, _mm512_set1_ps(1e-30f)));
      kernel.values(sc, vp + b * vs0, vs1, L, D, inv, nh, op + b * H * D + h0 * D);
    }
  });
  return out;
}

inline at::Tensor mqa_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const c10::optional<at::Tensor>& allowed, double scale) {
  return decode_attention<FmaAttention>(q, k, v, allowed, scale);
}
