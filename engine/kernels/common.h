// Pieces shared by the decode kernels (decode_ops.cpp, eagle_chain.cpp).
#pragma once
#include <cmath>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace tailspec {

// exp(x) in float32 to ~2 ulp (Cephes' expf polynomial), written so that GCC vectorises it
// without -ffast-math (no floor, no min / max calls, no type-punning through memory): every
// element goes through the same operations whatever the vector width or loop length, so results
// do not depend on batch shape.
inline float fast_expf(float x) {
  x = x < -87.33654f ? -87.33654f : x;
  x = x > 88.72283f ? 88.72283f : x;
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln 2): 1.5 * 2^23 trick
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // x - n ln 2, in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * (r * r) + r + 1.0f;
  return y * __builtin_bit_cast(float, ((int32_t)n + 127) << 23);  // y * 2^n
}

// x's bf16 bits, rounded to nearest even (as torch's .bfloat16()); a NaN stays a NaN.
inline uint16_t bf16_bits(float f) {
  const uint32_t u = __builtin_bit_cast(uint32_t, f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// The pair (lo, hi) of bf16s in one 32-bit word, lo in the low half: one element of an operand of
// AVX512_BF16's dot product, which adds lo * lo' and hi * hi' into a float32 lane.
inline uint32_t bf16_pair(float lo, float hi) { return bf16_bits(lo) | (uint32_t)bf16_bits(hi) << 16; }

// HF Llama's half rotation, in place, on `heads` consecutive heads of D floats:
// x = x * cos + rotate_half(x) * sin, with sin_signed = sin whose first half is negated.
inline void rope_heads(float* x, int64_t heads, int64_t D, const float* cos, const float* sin_signed) {
  const int64_t half = D / 2;
  float tmp[1024];  // D <= 1024 (checked by the callers' Python side)
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * D;
    for (int64_t i = 0; i < half; ++i) { tmp[i] = v[i + half]; tmp[i + half] = v[i]; }
    for (int64_t i = 0; i < D; ++i) v[i] = v[i] * cos[i] + tmp[i] * sin_signed[i];
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// acc[t * 4 + c][l] = sum_d q_c[d] * kt_t[d * 8 + l] for four queries q_0..q_3 and one or two tiles
// kt_t [D, 8] of eight keys (lanes over keys): per (query, key) one fused multiply-add per d in
// order of d, the chains interleaved so that they overlap. A core keeps about eight chains of
// fused multiply-adds in flight (two units, four cycles each), so four queries against one tile
// leave half of it idle and two tiles fill it, each query's broadcast serving both. The scores are
// the same whichever form computes them. The attention kernels' scores (decode_ops.cpp,
// causal_attention.cpp) are these, times the scale.
template <int Tiles>
inline void score_four(const float* q0, const float* q1, const float* q2, const float* q3, const float* kt0,
                       const float* kt1, int64_t D, __m256 acc[4 * Tiles]) {
  __m256 a[4 * Tiles];
  for (int c = 0; c < 4 * Tiles; ++c) a[c] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m256 k0 = _mm256_loadu_ps(kt0 + d * 8);
    const __m256 k1 = Tiles == 2 ? _mm256_loadu_ps(kt1 + d * 8) : k0;
    const __m256 b0 = _mm256_broadcast_ss(q0 + d), b1 = _mm256_broadcast_ss(q1 + d), b2 = _mm256_broadcast_ss(q2 + d),
                 b3 = _mm256_broadcast_ss(q3 + d);
    a[0] = _mm256_fmadd_ps(b0, k0, a[0]);
    a[1] = _mm256_fmadd_ps(b1, k0, a[1]);
    a[2] = _mm256_fmadd_ps(b2, k0, a[2]);
    a[3] = _mm256_fmadd_ps(b3, k0, a[3]);
    if (Tiles == 2) {
      a[4] = _mm256_fmadd_ps(b0, k1, a[4]);
      a[5] = _mm256_fmadd_ps(b1, k1, a[5]);
      a[6] = _mm256_fmadd_ps(b2, k1, a[6]);
      a[7] = _mm256_fmadd_ps(b3, k1, a[7]);
    }
  }
  for (int c = 0; c < 4 * Tiles; ++c) acc[c] = a[c];
}
#endif

// out[i * ld + t * 8 + l] = (q_i . key l of tile t) * scale for Q queries qs[i] [D] and Tiles (1 or
// 2) tiles kt [Tiles, D, 8] of eight keys: four queries x the tiles a pass (score_four; a last group
// of 1-3 queries repeats its last one, stored once), or in scalar code, the same chain of fused
// multiply-adds over d per score either way. The attention kernels' scores (decode_ops.cpp,
// causal_attention.cpp).
template <int Tiles>
inline void score_queries(const float* const* qs, int64_t Q, const float* kt, int64_t D, float scale, float* out,
                          int64_t ld) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 sc = _mm256_set1_ps(scale);
  for (; i < Q; i += 4) {
    const int64_t r = Q - i < 4 ? Q - i : 4;
    const float *q0 = qs[i], *q1 = qs[i + (r > 1)], *q2 = qs[i + (r > 2 ? 2 : r - 1)], *q3 = qs[i + r - 1];
    __m256 a[4 * Tiles];
    score_four<Tiles>(q0, q1, q2, q3, kt, kt + D * 8, D, a);
    for (int t = 0; t < Tiles; ++t)
      for (int64_t c = 0; c < r; ++c) _mm256_storeu_ps(out + (i + c) * ld + t * 8, _mm256_mul_ps(a[t * 4 + c], sc));
  }
#endif
  for (; i < Q; ++i)
    for (int t = 0; t < Tiles; ++t) {
      const float* k0 = kt + t * D * 8;
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int64_t d = 0; d < D; ++d)
        for (int64_t l = 0; l < 8; ++l) acc[l] = std::fma(qs[i][d], k0[d * 8 + l], acc[l]);
      for (int64_t l = 0; l < 8; ++l) out[i * ld + t * 8 + l] = acc[l] * scale;
    }
}

// outs[r][:D] (+)= scales[r] * sum_{i < n} ws[r][i * wstride] * x[i * ldx][:D] for R outputs at once:
// each output's chain of fused multiply-adds runs over i in order, from zero (the same operations,
// in the same order, as for one output alone); the R chains interleave, so that they overlap
// instead of each waiting on its own latency. Attention's weighted values (decode_ops.cpp) and the
// training attention's products (causal_attention.cpp).
// With Normalize, scales are not read: each output is multiplied by 1 / sum_{i < n} ws[r][i * wstride],
// that sum taken one add at a time in order of i, in the same pass (every lane of a vector repeats
// the scalar chain on the broadcast weight, so the total is exactly the scalar loop's, and the adds
// run beside the fused multiply-adds instead of in a serial loop of their own).
template <int R, bool Normalize = false>
inline void weigh_rows(const float* const* ws, int64_t wstride, int64_t n, const float* x, int64_t ldx, int64_t D,
                       float* const* outs, const float* scales, bool accumulate) {
  float scale[R];  // with Normalize: 1 / the totals, from the first block of d (the scalar loop if none ran)
  if (!Normalize)
    for (int r = 0; r < R; ++r) scale[r] = scales[r];
  int64_t d0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; d0 + 32 <= D; d0 += 32) {
    __m256 a[R][4], t[R];
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = a[r][2] = a[r][3] = t[r] = _mm256_setzero_ps();
    const bool totals = Normalize && d0 == 0;
    for (int64_t i = 0; i < n; ++i) {
      const float* xr = x + i * ldx + d0;
      const __m256 x0 = _mm256_loadu_ps(xr), x1 = _mm256_loadu_ps(xr + 8), x2 = _mm256_loadu_ps(xr + 16),
                   x3 = _mm256_loadu_ps(xr + 24);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 w = _mm256_broadcast_ss(ws[r] + i * wstride);
        a[r][0] = _mm256_fmadd_ps(w, x0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(w, x1, a[r][1]);
        a[r][2] = _mm256_fmadd_ps(w, x2, a[r][2]);
        a[r][3] = _mm256_fmadd_ps(w, x3, a[r][3]);
        if (totals) t[r] = _mm256_add_ps(t[r], w);
      }
    }
    if (totals)
      for (int r = 0; r < R; ++r) scale[r] = 1.f / _mm256_cvtss_f32(t[r]);
    for (int r = 0; r < R; ++r) {
      const __m256 sc = _mm256_set1_ps(scale[r]);
      for (int c = 0; c < 4; ++c) {
        float* o = outs[r] + d0 + 8 * c;
        const __m256 v = _mm256_mul_ps(a[r][c], sc);
        _mm256_storeu_ps(o, accumulate ? _mm256_add_ps(_mm256_loadu_ps(o), v) : v);
      }
    }
  }
#endif
  if (d0 == D) return;
  if (Normalize && d0 == 0)
    for (int r = 0; r < R; ++r) {
      float total = 0.f;
      for (int64_t i = 0; i < n; ++i) total += ws[r][i * wstride];
      scale[r] = 1.f / total;
    }
  for (int64_t d = d0; d < D; ++d)
    for (int r = 0; r < R; ++r) {
      float acc = 0.f;
      for (int64_t i = 0; i < n; ++i) acc = std::fma(ws[r][i * wstride], x[i * ldx + d], acc);
      outs[r][d] = accumulate ? outs[r][d] + acc * scale[r] : acc * scale[r];
    }
}

}  // namespace tailspec
