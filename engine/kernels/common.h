// Pieces shared by the decode kernels (decode_ops.cpp, eagle_chain.cpp).
#pragma once
#include <cmath>
#include <cstdint>

namespace tailspec {

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

// One query q [D] against one head's keys / values k, v [S, D] (slots 0..S-1; mask[j] false or
// a null mask: slot j is skipped / all visible) -> out [D]. Slots are visited in order, so the
// result does not depend on what else shares the call. scores: scratch of S floats.
inline void attend_one(const float* q, const float* k, const float* v, const bool* mask, int64_t S, int64_t D,
                       float scale, float* scores, float* out) {
  float mx = -INFINITY;
  for (int64_t j = 0; j < S; ++j) {
    if (mask && !mask[j]) continue;
    const float* kr = k + j * D;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < D; ++d) s += q[d] * kr[d];
    s *= scale;
    scores[j] = s;
    mx = s > mx ? s : mx;
  }
  for (int64_t d = 0; d < D; ++d) out[d] = 0.f;
  if (mx == -INFINITY) return;  // nothing visible: zeros (never happens for a real token)
  float total = 0.f;
  for (int64_t j = 0; j < S; ++j) {
    if (mask && !mask[j]) continue;
    const float e = std::exp(scores[j] - mx);
    total += e;
    const float* vr = v + j * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) out[d] += e * vr[d];
  }
  const float inv = 1.f / total;
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) out[d] *= inv;
}

}  // namespace tailspec
