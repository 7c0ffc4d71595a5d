// Small fused ops for CPU decoding, where per-op dispatch costs more than the arithmetic:
// RMSNorm of a few rows (torch's is ~10 dispatched ops) and attention of a few query tokens per
// row over a KV cache with a boolean mask (a decode step, or a verify pass over a draft tree).
//
// Each output's arithmetic is fixed by its own inputs (every score a chain of fused multiply-adds
// in order of d; the softmax and the weighted values over slots in slot order, masked slots adding
// exact zeros), so a token's result does not depend on how many other tokens or rows share the
// call: a verify pass over [root, draft tree] gives bit for bit the values sequential decoding
// gives. The queries of one row and KV head (its GQA group x its new tokens) share each tile of
// keys, so a verify pass of T tokens reads the cache once, not T times.
// This file alone is compiled without trapping math: GCC then vectorises the compare-and-select in
// exp and the softmax (it changes no value; the other kernels keep the default codegen).
#pragma GCC optimize("no-trapping-math")
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

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

// Up to this many query vectors of one (row, kv head) share a pass over its keys.
constexpr int64_t kQueryChunk = 64;
constexpr int64_t kLanes = 8;  // keys scored together: one vector of lanes over keys
constexpr int64_t kStep = 2 * kLanes;  // keys a pass scores: two tiles (tailspec::score_four)

// kt[d * kLanes + l] = rows[l][d]: kLanes keys of D floats, as a tile of lanes over keys.
static void transpose_keys(const float* const* rows, int64_t D, float* kt) {
  int64_t d0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; d0 + 8 <= D; d0 += 8) {  // an 8 x 8 transpose in registers
    __m256 r0 = _mm256_loadu_ps(rows[0] + d0), r1 = _mm256_loadu_ps(rows[1] + d0), r2 = _mm256_loadu_ps(rows[2] + d0),
           r3 = _mm256_loadu_ps(rows[3] + d0), r4 = _mm256_loadu_ps(rows[4] + d0), r5 = _mm256_loadu_ps(rows[5] + d0),
           r6 = _mm256_loadu_ps(rows[6] + d0), r7 = _mm256_loadu_ps(rows[7] + d0);
    const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3),
                 t3 = _mm256_unpackhi_ps(r2, r3), t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
                 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE),
                 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE),
                 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE),
                 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    float* out = kt + d0 * kLanes;
    _mm256_storeu_ps(out + 0 * kLanes, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_storeu_ps(out + 1 * kLanes, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_storeu_ps(out + 2 * kLanes, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_storeu_ps(out + 3 * kLanes, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_storeu_ps(out + 4 * kLanes, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_storeu_ps(out + 5 * kLanes, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_storeu_ps(out + 6 * kLanes, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_storeu_ps(out + 7 * kLanes, _mm256_permute2f128_ps(u3, u7, 0x31));
  }
#endif
  for (int64_t d = d0; d < D; ++d)
    for (int64_t l = 0; l < kLanes; ++l) kt[d * kLanes + l] = rows[l][d];
}

extern "C++" {  // templates, inside this file's C linkage block
// For R queries' softmax weights sc[q] (exact zeros on masked slots): the weighted values times
// 1 / total, the total in slot order, one add at a time (the visible slots' order is what decoding
// sees, but not their positions: a tree's ancestors sit at scattered tentative slots, so no lanes
// by slot), in the pass of the weighted values (tailspec::weigh_rows<R, true>); the R queries'
// serial chains interleave.
template <int R>
static void finish_queries(float* const* sc, int64_t end, const float* v, int64_t D, float* const* outs) {
  tailspec::weigh_rows<R, true>(sc, 1, end, v, D, D, outs, nullptr, false);
}
}  // extern "C++"

// Attention of Q queries that share one head's keys / values k, v [S, D] (a row's GQA group:
// its G query heads x T new tokens) -> outs[i] [D]. Every (query, key) score is the same
// arithmetic whatever else shares the call: sequential fused multiply-adds over d (lanes run over
// keys, never over d, so no horizontal sum), then the softmax over visible slots in slot order
// and the weighted sum of values in slot order. So a verify pass over [root, draft] gives bit for
// bit what sequential decoding gives, while the keys are read once per chunk of queries instead
// of once per query. kt: scratch of D * kStep floats; scores: of kQueryChunk * S (rounded up to kStep) floats.
static void attend_group(const float* const* qs, const bool* const* masks, float* const* outs, int64_t Q, const float* k,
                         const float* v, int64_t S, int64_t D, float scale, float* kt, float* scores) {
  int64_t end = 0;  // one past the last slot any query sees
  for (int64_t i = 0; i < Q; ++i)
    for (int64_t j = S - 1; j >= end; --j)
      if (masks[i][j]) {
        end = j + 1;
        break;
      }
  const int64_t padded = (end + kLanes - 1) / kLanes * kLanes;
  const int64_t ld = (S + kStep - 1) / kStep * kStep;  // a query's row of scores
  for (int64_t j0 = 0; j0 < end; j0 += kStep) {
    const int64_t n = end - j0 < kStep ? end - j0 : kStep;
    const float* rows[kStep];  // lanes past the end: any finite key (its scores are masked)
    for (int64_t l = 0; l < kStep; ++l) rows[l] = k + (j0 + (l < n ? l : 0)) * D;
    transpose_keys(rows, D, kt);
    if (n > kLanes) {
      transpose_keys(rows + kLanes, D, kt + D * kLanes);
      tailspec::score_queries<2>(qs, Q, kt, D, scale, scores + j0, ld);
    } else {
      tailspec::score_queries<1>(qs, Q, kt, D, scale, scores + j0, ld);
    }
  }
  float* live_sc[kQueryChunk];  // the queries that see a slot (every real token's): scores, outputs
  float* live_out[kQueryChunk];
  int64_t live = 0;
  for (int64_t i = 0; i < Q; ++i) {
    const uint8_t* m = reinterpret_cast<const uint8_t*>(masks[i]);
    float* sc = scores + i * ld;
    float* out = outs[i];
    for (int64_t j = 0; j < end; ++j) {
      const float x = sc[j];
      sc[j] = m[j] ? x : -INFINITY;
    }
    for (int64_t j = end; j < padded; ++j) sc[j] = -INFINITY;
    float top[kLanes];  // the largest visible score, by lane (max is exact in any order)
    for (int64_t l = 0; l < kLanes; ++l) top[l] = -INFINITY;
    for (int64_t j0 = 0; j0 < padded; j0 += kLanes) {
#pragma omp simd
      for (int64_t l = 0; l < kLanes; ++l) top[l] = sc[j0 + l] > top[l] ? sc[j0 + l] : top[l];
    }
    float mx = -INFINITY;
    for (int64_t l = 0; l < kLanes; ++l) mx = top[l] > mx ? top[l] : mx;
    for (int64_t d = 0; d < D; ++d) out[d] = 0.f;
    if (mx == -INFINITY) continue;  // nothing visible: zeros (never happens for a real token)
    // Weights: exp(s - max) on visible slots, exact zeros elsewhere (adding a zero changes no sum).
    for (int64_t j = 0; j < end; ++j) sc[j] = tailspec::fast_expf(sc[j] - mx);
    for (int64_t j = 0; j < end; ++j) sc[j] = sc[j] * (float)m[j];
    live_sc[live] = sc, live_out[live] = out, ++live;
  }
  // Totals, weighted values and divisions, four queries at a time (a last 1-3 together).
  int64_t i = 0;
  for (; i + 4 <= live; i += 4) finish_queries<4>(live_sc + i, end, v, D, live_out + i);
  if (live - i == 3) finish_queries<3>(live_sc + i, end, v, D, live_out + i);
  if (live - i == 2) finish_queries<2>(live_sc + i, end, v, D, live_out + i);
  if (live - i == 1) finish_queries<1>(live_sc + i, end, v, D, live_out + i);
}

// out[b, t, hq, :] = softmax_j(q[b, t, hq] . k[b, hq / G, j] * scale | mask[b, t, j]) @ v[b, hq / G, j]
// q: [B, T, Hq, D] with strides (sqb, sqt, D, 1); k, v: [B, Hkv, M, D] contiguous (a cache layer,
// rows 0..B-1); mask: [B, T, S] bool, contiguous; out: [B, T, Hq, D] contiguous.
// One job per (row, kv head, chunk of its G * T queries): attend_group.
void attend_rows(const float* q, int64_t sqb, int64_t sqt, const float* k, const float* v, int64_t skb, int64_t skh,
                 const bool* mask, float* out, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t S, int64_t D,
                 float scale, int nthreads) {
  const int64_t G = Hq / Hkv;
  const int64_t per_head = G * T;
  const int64_t chunks = (per_head + kQueryChunk - 1) / kQueryChunk;
  const int64_t jobs = B * Hkv * chunks;
  const bool parallel = nthreads > 1 && B * T * Hq * S * D > 32768;
#pragma omp parallel num_threads(parallel ? nthreads : 1)
  {
    std::vector<float> kt(D * kStep), scores(kQueryChunk * ((S + kStep - 1) / kStep * kStep));
    const float* qs[kQueryChunk];
    const bool* masks[kQueryChunk];
    float* outs[kQueryChunk];
#pragma omp for schedule(static)
    for (int64_t job = 0; job < jobs; ++job) {
      const int64_t b = job / (Hkv * chunks), h = (job / chunks) % Hkv, c = job % chunks;
      const int64_t first = c * kQueryChunk, n = per_head - first < kQueryChunk ? per_head - first : kQueryChunk;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = (first + i) / G, hq = h * G + (first + i) % G;
        qs[i] = q + b * sqb + t * sqt + hq * D;
        masks[i] = mask + (b * T + t) * S;
        outs[i] = out + ((b * T + t) * Hq + hq) * D;
      }
      attend_group(qs, masks, outs, n, k + b * skb + h * skh, v + b * skb + h * skh, S, D, scale, kt.data(),
                   scores.data());
    }
  }
}

// attend_group for Q queries that share one head's keys / values (any Q: chunks of kQueryChunk):
// the EAGLE drafter's attention (eagle_chain.cpp), where the queries are a row's new tokens x its
// GQA group, as in attend_rows. masks[i]: S bools per query. The scratch is the calling thread's,
// kept between calls (a draft calls this per row, KV head and level) and grown as needed.
void attend_queries(const float* const* qs, const bool* const* masks, float* const* outs, int64_t Q, const float* k,
                    const float* v, int64_t S, int64_t D, float scale) {
  thread_local std::vector<float> kt, scores;
  const int64_t rows = Q < kQueryChunk ? Q : kQueryChunk, need = rows * ((S + kStep - 1) / kStep * kStep);
  if ((int64_t)kt.size() < D * kStep) kt.resize(D * kStep);
  if ((int64_t)scores.size() < need) scores.resize(need);
  for (int64_t i = 0; i < Q; i += kQueryChunk)
    attend_group(qs + i, masks + i, outs + i, Q - i < kQueryChunk ? Q - i : kQueryChunk, k, v, S, D, scale, kt.data(),
                 scores.data());
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
