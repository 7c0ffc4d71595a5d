// Small fused ops for CPU decoding, where per-op dispatch costs more than the arithmetic:
// RMSNorm of a few rows (torch's is ~10 dispatched ops) and attention of a few query tokens per
// row over a KV cache with a boolean mask (a decode step, or a verify pass over a draft tree).
//
// Each output row is computed on its own, in a fixed order (keys in slot order, masked slots
// skipped), so a token's result does not depend on how many other tokens or rows share the call:
// a verify pass over [root, draft tree] gives bit for bit the values sequential decoding gives.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

extern "C" {

// y[m] = (x[m] * rsqrt(mean(x[m]^2) + eps)) * w, for M rows of H (HF Llama's order of operations).
void rms_norm_rows(const float* x, int64_t ldx, const float* w, float eps, float* y, int64_t ldy, int64_t M, int64_t H) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * ldx;
    float* yr = y + m * ldy;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < H; ++i) ss += xr[i] * xr[i];
    const float r = 1.f / std::sqrt(ss / (float)H + eps);
#pragma omp simd
    for (int64_t i = 0; i < H; ++i) yr[i] = (w ? (xr[i] * r) * w[i] : xr[i] * r);
  }
}

// out[b, t, hq, :] = softmax_j(q[b, t, hq] . k[b, hq / G, j] * scale | mask[b, t, j]) @ v[b, hq / G, j]
// q: [B, T, Hq, D] with strides (sqb, sqt, D, 1); k, v: [B, Hkv, M, D] contiguous (a cache layer,
// rows 0..B-1); mask: [B, T, S] bool, contiguous; out: [B, T, Hq, D] contiguous.
void attend_rows(const float* q, int64_t sqb, int64_t sqt, const float* k, const float* v, int64_t skb, int64_t skh,
                 const bool* mask, float* out, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t S, int64_t D,
                 float scale, int nthreads) {
  const int64_t G = Hq / Hkv;
  const int64_t jobs = B * T * Hq;
  const bool parallel = nthreads > 1 && jobs * S * D > 32768;
#pragma omp parallel num_threads(parallel ? nthreads : 1)
  {
    std::vector<float> p(S);
#pragma omp for schedule(static)
    for (int64_t job = 0; job < jobs; ++job) {
      const int64_t b = job / (T * Hq), t = (job / Hq) % T, hq = job % Hq, h = hq / G;
      tailspec::attend_one(q + b * sqb + t * sqt + hq * D, k + b * skb + h * skh, v + b * skb + h * skh,
                           mask + (b * T + t) * S, S, D, scale, p.data(), out + ((b * T + t) * Hq + hq) * D);
    }
  }
}

// The attention half of a decoder layer from its fused q/k/v projection, in one call:
// RoPE on the q and k heads of every new token, its k / v written to the cache at slots[b, t],
// then attend_rows over the cache with the mask (new tokens see each other through the cache).
// qkv: [B, T, Hq + 2 Hkv, D] contiguous (modified in place: q and k rotated);
// cos / sin_signed: [B, T, D] (sin_signed: the first half negated, HF's rotate-half folded in);
// slots: [B, T]; k, v: a cache layer [N, Hkv, M, D] with row / head strides skb / skh;
// mask [B, T, S]; out: [B, T, Hq, D].
void rope_write_attend(float* qkv, const float* cos, const float* sin_signed, const int64_t* slots, float* k, float* v,
                       int64_t skb, int64_t skh, const bool* mask, float* out, int64_t B, int64_t T, int64_t Hq,
                       int64_t Hkv, int64_t S, int64_t D, float scale, int nthreads) {
  const int64_t W = (Hq + 2 * Hkv) * D;
  for (int64_t bt = 0; bt < B * T; ++bt) {
    float* row = qkv + bt * W;
    tailspec::rope_heads(row, Hq + Hkv, D, cos + bt * D, sin_signed + bt * D);
    const int64_t b = bt / T, slot = slots[bt];
    for (int64_t h = 0; h < Hkv; ++h) {
      std::memcpy(k + b * skb + h * skh + slot * D, row + (Hq + h) * D, D * sizeof(float));
      std::memcpy(v + b * skb + h * skh + slot * D, row + (Hq + Hkv + h) * D, D * sizeof(float));
    }
  }
  attend_rows(qkv, T * W, W, k, v, skb, skh, mask, out, B, T, Hq, Hkv, S, D, scale, nthreads);
}

// y[m, i] = silu(x[m, i]) * x[m, I + i] for x [M, 2I] (the gate and up halves of one product).
void silu_mul_rows(const float* x, float* y, int64_t M, int64_t I) {
  for (int64_t m = 0; m < M; ++m) {
    const float* g = x + m * 2 * I;
    float* out = y + m * I;
#pragma omp simd
    for (int64_t i = 0; i < I; ++i) out[i] = (g[i] / (1.f + tailspec::fast_expf(-g[i]))) * g[I + i];
  }
}
}
