// What the two causal attentions for the update (causal_attention.cpp in float32,
// causal_attention_bf16.cpp in bf16 arithmetic) share: how a call's queries are cut into blocks
// that share each key tile, where a query's rows sit, and the softmax's row max and row total.
// Work is one job per (row, kv head): its GQA group's G query heads share the keys, so a block of
// positions x G heads (at most kBlockQueries queries) shares each key tile.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"

namespace tailspec::causal {

constexpr int64_t kLanes = 8;          // keys per tile: one vector of lanes over keys
constexpr int64_t kBlockQueries = 64;  // at most this many queries (positions x heads) share a pass

// The largest of x[0..n) (n >= 1; max is exact in any order).
inline float row_max(const float* x, int64_t n) {
  int64_t j = 0;
  float mx = -INFINITY;
#if defined(__AVX2__) && defined(__FMA__)
  if (n >= kLanes) {
    __m256 top = _mm256_loadu_ps(x);
    for (j = kLanes; j + kLanes <= n; j += kLanes) top = _mm256_max_ps(top, _mm256_loadu_ps(x + j));
    float lanes[kLanes];
    _mm256_storeu_ps(lanes, top);
    for (int64_t l = 0; l < kLanes; ++l) mx = lanes[l] > mx ? lanes[l] : mx;
  }
#endif
  for (; j < n; ++j) mx = x[j] > mx ? x[j] : mx;
  return mx;
}

// The sum of x[0..n) for n a multiple of kLanes: kLanes partial sums over j in order, then a fixed tree.
inline float row_sum(const float* x, int64_t n) {
  float part[kLanes] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; j < n; j += kLanes) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + j));
  _mm256_storeu_ps(part, acc);
#endif
  for (; j < n; j += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) part[l] += x[j + l];
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

// Where a call's queries sit: q [B, Hq, T, D] with strides (sqb, sqh, sqt), d contiguous; blocks of
// `positions` positions x the G query heads of a kv head.
struct Shape {
  int64_t T, Hq, D, G, positions;  // G * positions <= kBlockQueries
  const float* q;
  int64_t sqb, sqh, sqt;
  // Row offset of query (b, t, hq) in the [B, T, Hq, D] outputs (out, its gradient) and [B, T, Hq] vectors.
  int64_t at(int64_t b, int64_t t, int64_t hq) const { return (b * T + t) * Hq + hq; }
};

inline Shape shape_of(const float* q, int64_t sqb, int64_t sqh, int64_t sqt, int64_t T, int64_t Hq, int64_t Hkv, int64_t D) {
  const int64_t G = Hq / Hkv;
  return {T, Hq, D, G, kBlockQueries / G > 0 ? kBlockQueries / G : 1, q, sqb, sqh, sqt};
}

// n rounded up to whole tiles of keys.
inline int64_t whole_tiles(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

// A block's queries, position-major: query i is at t0 + i / G, head h * G + i % G.
struct Block {
  int64_t t0, count, end;  // first position, queries, one past the last position (keys 0..end-1)
};

inline Block block_at(const Shape& s, int64_t t0) {
  const int64_t end = t0 + s.positions < s.T ? t0 + s.positions : s.T;
  return {t0, (end - t0) * s.G, end};
}

// A job: row b, kv head h (job = b * Hkv + h), and that head's keys and values (strides skb, skh).
struct Job {
  int64_t b, h;
  const float *k, *v;
};

inline Job job_at(int64_t job, int64_t Hkv, const float* k, const float* v, int64_t skb, int64_t skh) {
  const int64_t b = job / Hkv, h = job % Hkv;
  return {b, h, k + b * skb + h * skh, v + b * skb + h * skh};
}

// The job's [T, D] rows of a [B, Hkv, T, D] gradient (dk, dv), zeroed for the blocks to accumulate into.
inline float* zeroed_rows(float* grad, int64_t job, int64_t T, int64_t D) {
  float* rows = grad + job * T * D;
  std::memset(rows, 0, T * D * sizeof(float));
  return rows;
}

// Packs the block's query vectors into xq [count, D] (and, where given, rows of a [B, T, Hq, D] tensor into xo).
inline void pack_block(const Shape& s, const Block& blk, int64_t b, int64_t h, float* xq, const float* rows, float* xo) {
  for (int64_t i = 0; i < blk.count; ++i) {
    const int64_t t = blk.t0 + i / s.G, hq = h * s.G + i % s.G;
    std::memcpy(xq + i * s.D, s.q + b * s.sqb + hq * s.sqh + t * s.sqt, s.D * sizeof(float));
    if (rows) std::memcpy(xo + i * s.D, rows + s.at(b, t, hq) * s.D, s.D * sizeof(float));
  }
}

}  // namespace tailspec::causal
