// Causal self-attention for the actor's update on CPU (float32): the forward, which also keeps each
// query's log-sum-exp, and the backward that recomputes the softmax from it (FlashAttention-2's
// scheme). At the tiny model's head dim of 32, torch's CPU flash kernel runs at 20-40 GFLOP/s: each
// block's products are small BLAS calls that pack their operands every time. These kernels keep a
// row's keys and values transposed into tiles of 8 keys once per (row, kv head) and run every
// product from registers (1.4-1.8x its speed forward and backward: bench.attention).
//
// Work is one job per (row, kv head): its GQA group's G query heads share the keys, so a block of
// positions x G heads (at most 64 queries) shares each key tile. A job's results are sums in a
// fixed order (over d, then keys in order, then query blocks in order), so a result does not
// depend on the thread count. Rows are right-padded: a query at position t sees keys 0..t, so no
// real token sees a pad.
// This file alone is compiled without trapping math, as decode_ops.cpp is: GCC then vectorises the
// compare-and-select of exp (it changes no value).
#pragma GCC optimize("no-trapping-math")
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "causal_blocks.h"  // with common.h, and immintrin.h where AVX2 and FMA are on

namespace {

using namespace tailspec::causal;
#if defined(__AVX512VL__)
constexpr int kWeighRows = 4;  // outputs accumulated together (4 x 4 vectors: 32 vector registers)
#else
constexpr int kWeighRows = 2;  // 16 vector registers
#endif

// xt[tile][d][l] = x[tile * kLanes + l][d] for rows < n; rows past n are zeros.
void transpose_rows(const float* x, int64_t ldx, int64_t n, int64_t D, float* xt) {
  const int64_t tiles = (n + kLanes - 1) / kLanes;
  for (int64_t tile = 0; tile < tiles; ++tile) {
    float* out = xt + tile * D * kLanes;
    for (int64_t l = 0; l < kLanes; ++l) {
      const int64_t j = tile * kLanes + l;
      const float* r = x + j * ldx;
      for (int64_t d = 0; d < D; ++d) out[d * kLanes + l] = j < n ? r[d] : 0.f;
    }
  }
}

// s[i * ld + j] = scale * (x_i . key_j) for queries i < Q (rows of x [Q, D]) and the keys of
// `tiles` transposed tiles: two tiles x four queries a pass, a last odd tile alone
// (tailspec::score_queries: each score's chain of fused multiply-adds runs over d in order).
void score_tiles(const float* x, int64_t Q, const float* kt, int64_t tiles, int64_t D, float scale, float* s,
                 int64_t ld) {
  const float* qs[kBlockQueries];
  for (int64_t i0 = 0; i0 < Q; i0 += kBlockQueries) {  // a block holds more only where G > kBlockQueries
    const int64_t n = Q - i0 < kBlockQueries ? Q - i0 : kBlockQueries;
    for (int64_t i = 0; i < n; ++i) qs[i] = x + (i0 + i) * D;
    float* out = s + i0 * ld;
    int64_t tile = 0;
    for (; tile + 2 <= tiles; tile += 2)
      tailspec::score_queries<2>(qs, n, kt + tile * D * kLanes, D, scale, out + tile * kLanes, ld);
    if (tile < tiles) tailspec::score_queries<1>(qs, n, kt + tile * D * kLanes, D, scale, out + tile * kLanes, ld);
  }
}

// tailspec::weigh_rows for any count of outputs: kWeighRows at a time, then one at a time.
void weigh_all(const float* const* ws, int64_t wstride, int64_t n, const float* x, int64_t ldx, int64_t D,
               float* const* outs, const float* scales, int64_t count, bool accumulate) {
  int64_t r = 0;
  for (; r + kWeighRows <= count; r += kWeighRows)
    tailspec::weigh_rows<kWeighRows>(ws + r, wstride, n, x, ldx, D, outs + r, scales + r, accumulate);
  for (; r < count; ++r) tailspec::weigh_rows<1>(ws + r, wstride, n, x, ldx, D, outs + r, scales + r, accumulate);
}

}  // namespace

extern "C" {

// out [B, T, Hq, D] = softmax_{j <= t}(q[b, hq, t] . k[b, hq / G, j] * scale) @ v[b, hq / G, j], and
// lse [B, T, Hq] = the log of each softmax's denominator plus its max (the backward's input).
void causal_attention_forward(const float* q, int64_t sqb, int64_t sqh, int64_t sqt, const float* k, const float* v,
                              int64_t skb, int64_t skh, int64_t skt, float* out, float* lse, int64_t B, int64_t T,
                              int64_t Hq, int64_t Hkv, int64_t D, float scale, int nthreads) {
  const Shape s = shape_of(q, sqb, sqh, sqt, T, Hq, Hkv, D);
  const int64_t G = s.G, ld = whole_tiles(T), Qmax = s.positions * G;
#pragma omp parallel num_threads(nthreads > 1 && B * Hkv > 1 ? nthreads : 1)
  {
    std::vector<float> kt(ld * D), sc(Qmax * ld), xq(Qmax * D), scales(Qmax);
    std::vector<const float*> ws(Qmax);
    std::vector<float*> outs(Qmax);
#pragma omp for schedule(dynamic)
    for (int64_t job = 0; job < B * Hkv; ++job) {
      const auto [b, h, kb, vb] = job_at(job, Hkv, k, v, skb, skh);
      transpose_rows(kb, skt, T, D, kt.data());
      for (int64_t t0 = 0; t0 < T; t0 += s.positions) {
        const Block blk = block_at(s, t0);
        const int64_t keys = whole_tiles(blk.end);
        pack_block(s, blk, b, h, xq.data(), nullptr, nullptr);
        score_tiles(xq.data(), blk.count, kt.data(), keys / kLanes, D, scale, sc.data(), ld);
        for (int64_t i = 0; i < blk.count; ++i) {
          const int64_t t = t0 + i / G, seen = t + 1;
          float* row = sc.data() + i * ld;
          const float mx = row_max(row, seen);
          for (int64_t j = 0; j < seen; ++j) row[j] = tailspec::fast_expf(row[j] - mx);
          for (int64_t j = seen; j < keys; ++j) row[j] = 0.f;
          const float total = row_sum(row, keys);
          const int64_t at = s.at(b, t, h * G + i % G);
          lse[at] = mx + std::log(total);
          scales[i] = 1.f / total;
          ws[i] = row;
          outs[i] = out + at * D;
        }
        weigh_all(ws.data(), 1, blk.end, vb, skt, D, outs.data(), scales.data(), blk.count, false);
      }
    }
  }
}

// From dout [B, T, Hq, D] (contiguous), the forward's out and lse: dq [B, T, Hq, D] (contiguous),
// dk, dv [B, Hkv, T, D] (contiguous). With p = exp(s - lse) and delta = dout . out per query:
// dv_j = sum_i p_ij dout_i, ds_ij = p_ij (dout_i . v_j - delta_i), dq_i = scale sum_j ds_ij k_j,
// dk_j = scale sum_i ds_ij q_i.
void causal_attention_backward(const float* q, int64_t sqb, int64_t sqh, int64_t sqt, const float* k, const float* v,
                               int64_t skb, int64_t skh, int64_t skt, const float* out, const float* lse,
                               const float* dout, float* dq, float* dk, float* dv, int64_t B, int64_t T, int64_t Hq,
                               int64_t Hkv, int64_t D, float scale, int nthreads) {
  const Shape s = shape_of(q, sqb, sqh, sqt, T, Hq, Hkv, D);
  const int64_t G = s.G, ld = whole_tiles(T), Qmax = s.positions * G;
#pragma omp parallel num_threads(nthreads > 1 && B * Hkv > 1 ? nthreads : 1)
  {
    std::vector<float> kt(ld * D), vt(ld * D), p(Qmax * ld), ds(Qmax * ld), xq(Qmax * D), xo(Qmax * D),
        scales(Qmax > kLanes ? Qmax : kLanes);
    std::vector<const float*> ws(Qmax > kLanes ? Qmax : kLanes);
    std::vector<float*> outs(Qmax > kLanes ? Qmax : kLanes);
#pragma omp for schedule(dynamic)
    for (int64_t job = 0; job < B * Hkv; ++job) {
      const auto [b, h, kb, vb] = job_at(job, Hkv, k, v, skb, skh);
      float *dkb = zeroed_rows(dk, job, T, D), *dvb = zeroed_rows(dv, job, T, D);
      transpose_rows(kb, skt, T, D, kt.data());
      transpose_rows(vb, skt, T, D, vt.data());
      for (int64_t t0 = 0; t0 < T; t0 += s.positions) {
        const Block blk = block_at(s, t0);
        const int64_t keys = whole_tiles(blk.end);
        pack_block(s, blk, b, h, xq.data(), dout, xo.data());
        score_tiles(xq.data(), blk.count, kt.data(), keys / kLanes, D, scale, p.data(), ld);
        score_tiles(xo.data(), blk.count, vt.data(), keys / kLanes, D, 1.f, ds.data(), ld);
        for (int64_t i = 0; i < blk.count; ++i) {
          const int64_t t = t0 + i / G, seen = t + 1, at = s.at(b, t, h * G + i % G);
          const float* o = out + at * D;
          const float* g = xo.data() + i * D;
          float dl = 0.f;
          for (int64_t d = 0; d < D; ++d) dl = std::fma(g[d], o[d], dl);
          const float m = lse[at];
          float* pr = p.data() + i * ld;
          float* dr = ds.data() + i * ld;
          for (int64_t j = 0; j < seen; ++j) pr[j] = tailspec::fast_expf(pr[j] - m);
          for (int64_t j = 0; j < seen; ++j) dr[j] = pr[j] * (dr[j] - dl);
          for (int64_t j = seen; j < keys; ++j) pr[j] = dr[j] = 0.f;
          ws[i] = dr;
          outs[i] = dq + at * D;
          scales[i] = scale;
        }
        // dq for the block's queries, over its keys.
        weigh_all(ws.data(), 1, blk.end, kb, skt, D, outs.data(), scales.data(), blk.count, false);
        // dv and dk for the keys the block sees, over its queries (in order of blocks: fixed).
        for (int64_t j = 0; j < blk.end; ++j) {
          ws[j % kLanes] = p.data() + j;
          outs[j % kLanes] = dvb + j * D;
          scales[j % kLanes] = 1.f;
          if (j % kLanes == kLanes - 1 || j == blk.end - 1) {
            const int64_t n = j % kLanes + 1;
            weigh_all(ws.data(), ld, blk.count, xo.data(), D, D, outs.data(), scales.data(), n, true);
            for (int64_t r = 0; r < n; ++r) {
              ws[r] = ds.data() + (j - n + 1 + r);
              outs[r] = dkb + (j - n + 1 + r) * D;
              scales[r] = scale;
            }
            weigh_all(ws.data(), ld, blk.count, xq.data(), D, D, outs.data(), scales.data(), n, true);
          }
        }
      }
    }
  }
}
}
