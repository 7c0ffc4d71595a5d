// Causal self-attention for the actor's update on CPU in bf16 arithmetic, for bf16-mixed precision:
// the forward and backward of causal_attention.cpp (FlashAttention-2's scheme: the forward keeps
// each query's log-sum-exp, the backward recomputes the softmax from it), with every product's
// operands rounded to bf16 (to nearest even) and pairs of products summed into float32 by
// AVX512_BF16's dot-product instruction (twice float32's multiply-adds per instruction), as GPU
// flash attention runs in bf16. What stays float32: the scores and their softmax (max, exp, the
// row totals, the log-sum-exp), delta (= dout . out), and every accumulator and output. What is
// rounded to bf16: q, k, v and dout where they enter a product, and the probabilities p and
// ds = p (dp - delta) where they weigh values, keys or queries (FlashAttention-2 in bf16 does the
// same).
//
// Layouts: a dot-product instruction multiplies pairs, so each product's operand holds pairs along
// its reduction: scores (over d) take queries as pairs of d and keys in tiles [D / 2][8 keys] of
// pairs of d; the weighted sums (over keys, or over queries for dk and dv) take the summed rows as
// pairs of rows [n / 2][D] and the weights as pairs of consecutive weights. Jobs, blocks and the
// fixed order of every sum are causal_attention.cpp's, so a result does not depend on the thread
// count. Built only where the compiler targets AVX512_BF16 and AVX512VL
// (`causal_attention_bf16_native`); elsewhere the actor keeps the float32 kernels.
#pragma GCC optimize("no-trapping-math")
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "causal_blocks.h"

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define TAILSPEC_ATTENTION_BF16 1

namespace {

using namespace tailspec::causal;
using tailspec::bf16_pair;

constexpr int kWeighRows = 4;  // outputs accumulated together

// xt[tile][p][l] = the pair (x[j][2p], x[j][2p + 1]) of row j = tile * 8 + l (rows past n: zero).
void tile_pairs(const float* x, int64_t ldx, int64_t n, int64_t D, uint32_t* xt) {
  const int64_t D2 = D / 2, tiles = (n + kLanes - 1) / kLanes;
  for (int64_t tile = 0; tile < tiles; ++tile) {
    uint32_t* out = xt + tile * D2 * kLanes;
    for (int64_t l = 0; l < kLanes; ++l) {
      const int64_t j = tile * kLanes + l;
      const float* r = x + j * ldx;
      for (int64_t p = 0; p < D2; ++p) out[p * kLanes + l] = j < n ? bf16_pair(r[2 * p], r[2 * p + 1]) : 0u;
    }
  }
}

// out[0 .. n / 2) = the pairs (x[2m], x[2m + 1]) of n floats (n a multiple of 8): x in bf16, in order;
// packed query (or dout) rows [Q, D] so become operands of a score [Q][D / 2].
void contiguous_pairs(const float* x, int64_t n, uint32_t* out) {
  for (int64_t j = 0; j < n; j += 8)
    _mm_storeu_si128((__m128i*)(out + j / 2), (__m128i)_mm256_cvtneps_pbh(_mm256_loadu_ps(x + j)));
}

// out[m * ldo + j] = the pair (x[2m][j], x[2m + 1][j]) for rows < n of x (row stride ldx; a last
// odd row pairs with zero) and columns j < cols (a multiple of 8): rows summed over in pairs (keys,
// values, queries, dout), or a block's probabilities and ds as weights over its queries.
void interleave_pairs(const float* x, int64_t ldx, int64_t n, int64_t cols, uint32_t* out, int64_t ldo) {
  const __m128i zero = _mm_setzero_si128();
  for (int64_t m = 0; 2 * m < n; ++m) {
    const float* a = x + 2 * m * ldx;
    const float* b = 2 * m + 1 < n ? a + ldx : nullptr;
    uint32_t* o = out + m * ldo;
    for (int64_t j = 0; j < cols; j += 8) {
      const __m128i lo = (__m128i)_mm256_cvtneps_pbh(_mm256_loadu_ps(a + j));
      const __m128i hi = b ? (__m128i)_mm256_cvtneps_pbh(_mm256_loadu_ps(b + j)) : zero;
      _mm_storeu_si128((__m128i*)(o + j), _mm_unpacklo_epi16(lo, hi));
      _mm_storeu_si128((__m128i*)(o + j + 4), _mm_unpackhi_epi16(lo, hi));
    }
  }
}

// s[i * ld + t * 8 + l] = scale * (q_i . key l of tile t) for Q queries qp [Q][D2] (pairs of d) and
// `tiles` tiles kt [tiles][D2][8]: four queries x two tiles a pass (eight chains of dot products,
// over pairs of d in order; a last group of 1-3 queries repeats its last one, stored once).
void score_pairs(const uint32_t* qp, int64_t Q, const uint32_t* kt, int64_t tiles, int64_t D2, float scale, float* s,
                 int64_t ld) {
  const __m256 sc = _mm256_set1_ps(scale);
  for (int64_t i = 0; i < Q; i += 4) {
    const int64_t r = Q - i < 4 ? Q - i : 4;
    const uint32_t* q[4] = {qp + i * D2, qp + (i + (r > 1)) * D2, qp + (i + (r > 2 ? 2 : r - 1)) * D2,
                            qp + (i + r - 1) * D2};
    for (int64_t tile = 0; tile < tiles; tile += 2) {
      const bool two = tile + 1 < tiles;
      const uint32_t* k0 = kt + tile * D2 * kLanes;
      const uint32_t* k1 = two ? k0 + D2 * kLanes : k0;
      __m256 a[8];
      for (int c = 0; c < 8; ++c) a[c] = _mm256_setzero_ps();
      for (int64_t p = 0; p < D2; ++p) {
        const __m256bh t0 = (__m256bh)_mm256_loadu_si256((const __m256i*)(k0 + p * kLanes));
        const __m256bh t1 = (__m256bh)_mm256_loadu_si256((const __m256i*)(k1 + p * kLanes));
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
          const __m256bh b = (__m256bh)_mm256_set1_epi32((int)q[c][p]);
          a[c] = _mm256_dpbf16_ps(a[c], b, t0);
          a[4 + c] = _mm256_dpbf16_ps(a[4 + c], b, t1);
        }
      }
      for (int64_t c = 0; c < r; ++c) {
        _mm256_storeu_ps(s + (i + c) * ld + tile * kLanes, _mm256_mul_ps(a[c], sc));
        if (two) _mm256_storeu_ps(s + (i + c) * ld + (tile + 1) * kLanes, _mm256_mul_ps(a[4 + c], sc));
      }
    }
  }
}

// outs[r][:D] (+)= scales[r] * sum_{m < n2} ws[r][m * wstride] . xp[m][:D] for R outputs: weights
// and rows xp [n2][D] both as pairs (of consecutive items), each output's chain of dot products
// over m in order, the R chains interleaved. D a multiple of 8: 32 columns a pass, then 8.
template <int R>
void weigh_pairs(const uint32_t* const* ws, int64_t wstride, int64_t n2, const uint32_t* xp, int64_t D,
                 float* const* outs, const float* scales, bool accumulate) {
  int64_t d0 = 0;
  for (; d0 + 32 <= D; d0 += 32) {
    __m256 a[R][4];
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = a[r][2] = a[r][3] = _mm256_setzero_ps();
    for (int64_t m = 0; m < n2; ++m) {
      const uint32_t* xr = xp + m * D + d0;
      __m256bh x[4];
      for (int c = 0; c < 4; ++c) x[c] = (__m256bh)_mm256_loadu_si256((const __m256i*)(xr + 8 * c));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256bh w = (__m256bh)_mm256_set1_epi32((int)ws[r][m * wstride]);
        for (int c = 0; c < 4; ++c) a[r][c] = _mm256_dpbf16_ps(a[r][c], w, x[c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) {
        float* o = outs[r] + d0 + 8 * c;
        const __m256 v = _mm256_mul_ps(a[r][c], _mm256_set1_ps(scales[r]));
        _mm256_storeu_ps(o, accumulate ? _mm256_add_ps(_mm256_loadu_ps(o), v) : v);
      }
  }
  for (; d0 < D; d0 += 8) {
    __m256 a[R];
    for (int r = 0; r < R; ++r) a[r] = _mm256_setzero_ps();
    for (int64_t m = 0; m < n2; ++m) {
      const __m256bh x = (__m256bh)_mm256_loadu_si256((const __m256i*)(xp + m * D + d0));
      for (int r = 0; r < R; ++r) a[r] = _mm256_dpbf16_ps(a[r], (__m256bh)_mm256_set1_epi32((int)ws[r][m * wstride]), x);
    }
    for (int r = 0; r < R; ++r) {
      float* o = outs[r] + d0;
      const __m256 v = _mm256_mul_ps(a[r], _mm256_set1_ps(scales[r]));
      _mm256_storeu_ps(o, accumulate ? _mm256_add_ps(_mm256_loadu_ps(o), v) : v);
    }
  }
}

// weigh_pairs for any count of outputs: kWeighRows at a time, then one at a time.
void weigh_all(const uint32_t* const* ws, int64_t wstride, int64_t n2, const uint32_t* xp, int64_t D,
               float* const* outs, const float* scales, int64_t count, bool accumulate) {
  int64_t r = 0;
  for (; r + kWeighRows <= count; r += kWeighRows)
    weigh_pairs<kWeighRows>(ws + r, wstride, n2, xp, D, outs + r, scales + r, accumulate);
  for (; r < count; ++r) weigh_pairs<1>(ws + r, wstride, n2, xp, D, outs + r, scales + r, accumulate);
}

// sum_j a[j] b[j] for n a multiple of kLanes: kLanes partial sums over j in order, then a fixed tree.
float row_dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += kLanes) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc);
  float part[kLanes];
  _mm256_storeu_ps(part, acc);
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

}  // namespace
#endif

extern "C" {

// Whether this build has the bf16 kernels below (AVX512_BF16 and AVX512VL); else they are not to be called.
int causal_attention_bf16_native() {
#ifdef TAILSPEC_ATTENTION_BF16
  return 1;
#else
  return 0;
#endif
}

// causal_attention_forward (causal_attention.cpp) in bf16 arithmetic: the same arguments and outputs
// (out [B, T, Hq, D] and lse [B, T, Hq], float32); D a multiple of 8.
void causal_attention_forward_bf16(const float* q, int64_t sqb, int64_t sqh, int64_t sqt, const float* k,
                                   const float* v, int64_t skb, int64_t skh, int64_t skt, float* out, float* lse,
                                   int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, float scale, int nthreads) {
#ifdef TAILSPEC_ATTENTION_BF16
  const Shape s = shape_of(q, sqb, sqh, sqt, T, Hq, Hkv, D);
  const int64_t G = s.G, ld = whole_tiles(T), Qmax = s.positions * G, D2 = D / 2;
#pragma omp parallel num_threads(nthreads > 1 && B * Hkv > 1 ? nthreads : 1)
  {
    std::vector<uint32_t> kt(ld * D2), vp((ld / 2) * D), qp(Qmax * D2), wp(Qmax * (ld / 2));
    std::vector<float> sc(Qmax * ld), xq(Qmax * D), scales(Qmax);
    std::vector<const uint32_t*> ws(Qmax);
    std::vector<float*> outs(Qmax);
#pragma omp for schedule(dynamic)
    for (int64_t job = 0; job < B * Hkv; ++job) {
      const auto [b, h, kb, vb] = job_at(job, Hkv, k, v, skb, skh);
      tile_pairs(kb, skt, T, D, kt.data());
      interleave_pairs(vb, skt, T, D, vp.data(), D);
      for (int64_t t0 = 0; t0 < T; t0 += s.positions) {
        const Block blk = block_at(s, t0);
        const int64_t end = blk.end, count = blk.count, keys = whole_tiles(end), n2 = (end + 1) / 2;
        pack_block(s, blk, b, h, xq.data(), nullptr, nullptr);
        contiguous_pairs(xq.data(), count * D, qp.data());
        score_pairs(qp.data(), count, kt.data(), keys / kLanes, D2, scale, sc.data(), ld);
        for (int64_t i = 0; i < count; ++i) {
          const int64_t t = t0 + i / G, seen = t + 1;
          float* row = sc.data() + i * ld;
          const float mx = row_max(row, seen);
          for (int64_t j = 0; j < seen; ++j) row[j] = tailspec::fast_expf(row[j] - mx);
          for (int64_t j = seen; j < keys; ++j) row[j] = 0.f;
          const float total = row_sum(row, keys);
          const int64_t at = s.at(b, t, h * G + i % G);
          lse[at] = mx + std::log(total);
          scales[i] = 1.f / total;
          contiguous_pairs(row, keys, wp.data() + i * (ld / 2));
          ws[i] = wp.data() + i * (ld / 2);
          outs[i] = out + at * D;
        }
        weigh_all(ws.data(), 1, n2, vp.data(), D, outs.data(), scales.data(), count, false);
      }
    }
  }
#endif
}

// causal_attention_backward (causal_attention.cpp) in bf16 arithmetic: the same arguments and outputs
// (dq [B, T, Hq, D], dk, dv [B, Hkv, T, D], float32); D a multiple of 8. `out` is not read: delta is
// sum_j p_j dp_j over this pass's own p and dp (see below).
void causal_attention_backward_bf16(const float* q, int64_t sqb, int64_t sqh, int64_t sqt, const float* k,
                                    const float* v, int64_t skb, int64_t skh, int64_t skt, const float* out,
                                    const float* lse, const float* dout, float* dq, float* dk, float* dv, int64_t B,
                                    int64_t T, int64_t Hq, int64_t Hkv, int64_t D, float scale, int nthreads) {
#ifdef TAILSPEC_ATTENTION_BF16
  const Shape s = shape_of(q, sqb, sqh, sqt, T, Hq, Hkv, D);
  const int64_t G = s.G, ld = whole_tiles(T), Qmax = s.positions * G, D2 = D / 2, Q2max = (Qmax + 1) / 2;
#pragma omp parallel num_threads(nthreads > 1 && B * Hkv > 1 ? nthreads : 1)
  {
    std::vector<uint32_t> kt(ld * D2), vt(ld * D2), kp((ld / 2) * D), qp(Qmax * D2), op(Qmax * D2),
        qi(Q2max * D), oi(Q2max * D), wd(Qmax * (ld / 2)), pt(Q2max * ld), dt(Q2max * ld);
    std::vector<float> p(Qmax * ld), ds(Qmax * ld), xq(Qmax * D), xo(Qmax * D), scales(Qmax > ld ? Qmax : ld);
    std::vector<const uint32_t*> ws(Qmax > ld ? Qmax : ld);
    std::vector<float*> outs(Qmax > ld ? Qmax : ld);
#pragma omp for schedule(dynamic)
    for (int64_t job = 0; job < B * Hkv; ++job) {
      const auto [b, h, kb, vb] = job_at(job, Hkv, k, v, skb, skh);
      float *dkb = zeroed_rows(dk, job, T, D), *dvb = zeroed_rows(dv, job, T, D);
      tile_pairs(kb, skt, T, D, kt.data());
      tile_pairs(vb, skt, T, D, vt.data());
      interleave_pairs(kb, skt, T, D, kp.data(), D);
      for (int64_t t0 = 0; t0 < T; t0 += s.positions) {
        const Block blk = block_at(s, t0);
        const int64_t end = blk.end, count = blk.count, keys = whole_tiles(end), n2 = (end + 1) / 2,
                      q2 = (count + 1) / 2;
        pack_block(s, blk, b, h, xq.data(), dout, xo.data());
        contiguous_pairs(xq.data(), count * D, qp.data());
        contiguous_pairs(xo.data(), count * D, op.data());
        score_pairs(qp.data(), count, kt.data(), keys / kLanes, D2, scale, p.data(), ld);
        score_pairs(op.data(), count, vt.data(), keys / kLanes, D2, 1.f, ds.data(), ld);
        for (int64_t i = 0; i < count; ++i) {
          const int64_t t = t0 + i / G, seen = t + 1, at = s.at(b, t, h * G + i % G);
          const float m = lse[at];
          float* pr = p.data() + i * ld;
          float* dr = ds.data() + i * ld;
          for (int64_t j = 0; j < seen; ++j) pr[j] = tailspec::fast_expf(pr[j] - m);
          for (int64_t j = seen; j < keys; ++j) pr[j] = dr[j] = 0.f;
          // delta = sum_j p_j dp_j over the dp computed here (dout . out in exact arithmetic): each
          // row of ds then sums to zero as the softmax's gradient does, where dout . out from the
          // float32 out would differ from these bf16 dp by their rounding, biasing dq and dk.
          const float dl = row_dot(pr, dr, keys);
          for (int64_t j = 0; j < seen; ++j) dr[j] = pr[j] * (dr[j] - dl);
          contiguous_pairs(dr, keys, wd.data() + i * (ld / 2));
          ws[i] = wd.data() + i * (ld / 2);
          outs[i] = dq + at * D;
          scales[i] = scale;
        }
        // dq for the block's queries, over its keys.
        weigh_all(ws.data(), 1, n2, kp.data(), D, outs.data(), scales.data(), count, false);
        // dv and dk for the keys the block sees, over its queries in pairs (in order of blocks: fixed).
        interleave_pairs(xo.data(), D, count, D, oi.data(), D);
        interleave_pairs(xq.data(), D, count, D, qi.data(), D);
        interleave_pairs(p.data(), ld, count, keys, pt.data(), ld);  // [q2][keys]: key j's weights at stride ld
        interleave_pairs(ds.data(), ld, count, keys, dt.data(), ld);
        for (int64_t j = 0; j < end; ++j) {
          ws[j] = pt.data() + j;
          outs[j] = dvb + j * D;
          scales[j] = 1.f;
        }
        weigh_all(ws.data(), ld, q2, oi.data(), D, outs.data(), scales.data(), end, true);
        for (int64_t j = 0; j < end; ++j) {
          ws[j] = dt.data() + j;
          outs[j] = dkb + j * D;
          scales[j] = scale;
        }
        weigh_all(ws.data(), ld, q2, qi.data(), D, outs.data(), scales.data(), end, true);
      }
    }
  }
#endif
}
}
