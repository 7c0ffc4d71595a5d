// A whole EAGLE chain draft in one call, for b rows at once: the catch-up (the pairs the last
// verification committed go through the one-layer network, the root last) and then D levels of
// (draft head -> coupled sample -> next feature through the network). `eagle_tree_draft` (at the
// end) does the same for top-k trees with coupled children.
//
// On a CPU a draft level of a small drafter is ~40 dispatched torch ops around very
// little arithmetic; here it is a few skinny products (skinny.cpp) and plain loops. It computes
// the same function as EagleDrafter._catch_up + _chain over engine.packed weights (up to float
// rounding). Catch-up: pair j of row r (token pend_tok[r, j], feature pend_feat[r, j]) runs at
// position lengths[r] + j + 1, writing cache slot lengths[r] + j, for j < n[r], all pairs of all
// rows in one pass (the weights are read once: a drafter's weights do not stay cached between
// target forwards); the root's prediction is the output of pair n[r] - 1. Then, with
// lengths' = lengths + n:
//   level d: logits = pred[:, F-H:] @ head; pick = argmax(logits / T + noise[:, d]) (T = 0: argmax);
//            token = vocab_ids[pick];
//            if d + 1 < D: x = fc([embed(token); pred]); one decoder layer (no input norm) at
//            position lengths' + d + 1, its K / V written at cache slot lengths' + d; pred = x
//            (eagle3: pred = [fc_out(x); x]).
// Confidence stop (min_conf > 0, EAGLE-2's idea for chains): a row's chain ends after the first
// level where the product along it of q(token) (q = softmax(logits / T), T = 0: softmax(logits))
// falls below min_conf; later levels skip the row, and once every row has ended the call
// returns. out_len[r] (1..D) tells how many of tokens[r] are real. Verification decides every
// token, so where a chain ends changes speed, never the tokens emitted.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "common.h"

extern "C" void skinny_gemm(const float* x, int64_t ldx, const float* wp, const float* bias, const float* c, int64_t ldc,
                            float* y, int64_t ldy, int64_t M, int64_t K, int64_t N, int nthreads);
extern "C" void skinny_gemm_bf16(const float* x, int64_t ldx, const uint16_t* wp, const float* bias, const float* c,
                                 int64_t ldc, float* y, int64_t ldy, int64_t M, int64_t K, int64_t N, int nthreads);
extern "C" void skinny_gemm_bf16dot(const float* x, int64_t ldx, const uint16_t* wp, const float* bias, const float* c,
                                    int64_t ldc, float* y, int64_t ldy, int64_t M, int64_t K, int64_t N, int nthreads);
extern "C" void silu_mul_rows(const float* x, float* y, int64_t M, int64_t I);
extern "C" void attend_queries(const float* const* qs, const bool* const* masks, float* const* outs, int64_t Q,
                               const float* k, const float* v, int64_t S, int64_t D, float scale);
extern "C" void rms_norm_rows(const float* x, int64_t ldx, const float* w, float eps, float* y, int64_t ldy, int64_t M, int64_t H);


namespace {

struct Net {
  int64_t H, F, nq, nkv, hd, I, Vd, Q;
  const float *embed, *fc, *qkv, *o, *gate_up, *down, *head, *fc_out, *post_norm;
  float eps;
  float *ck, *cv;
  int64_t skb, skh;
  int nthreads;
  int products;  // the panels (fc, qkv, o, gate_up, down, head, fc_out): 0 float32, 1 bf16 bits, 2 bf16 k pairs
};

// y = x @ W (+ c) over the net's panels: float32, bf16 weights, or bf16 arithmetic (skinny.cpp).
void mm(const Net& n, const float* x, int64_t ldx, const float* w, const float* c, int64_t ldc, float* y, int64_t ldy,
        int64_t M, int64_t K, int64_t N) {
  if (n.products == 2)
    skinny_gemm_bf16dot(x, ldx, reinterpret_cast<const uint16_t*>(w), nullptr, c, ldc, y, ldy, M, K, N, n.nthreads);
  else if (n.products == 1)
    skinny_gemm_bf16(x, ldx, reinterpret_cast<const uint16_t*>(w), nullptr, c, ldc, y, ldy, M, K, N, n.nthreads);
  else
    skinny_gemm(x, ldx, w, nullptr, c, ldc, y, ldy, M, K, N, n.nthreads);
}

// One pass of M tokens through fc and the layer. Token m belongs to cache row row[m], has input
// token tok[m] and feature feat[m] (F floats), RoPE rows cos[m] / sin_signed[m] (hd floats),
// and its K / V go to slot[m]; it attends to its row's slots <= slot[m] (the pass writes every
// token's K / V first, so tokens of one row in the same pass see each other causally). Tokens
// with active[m] == 0 are computed but neither written nor attended. out[m] (F floats) = the
// predicted feature, for active tokens. mask (null: all visible) restricts token m to the slots
// j <= slot[m] with mask[m][j] (a tree's tentative slots: its ancestors' and its own).
void step(Net& n, int64_t M, const int64_t* tok, const float* const* feat, const float* const* cos,
          const float* const* sin_signed, const int64_t* row, const int64_t* slot, const uint8_t* active,
          float* const* out, const bool* const* mask = nullptr) {
  const int64_t H = n.H, F = n.F, hd = n.hd, nq = n.nq, nkv = n.nkv, Q = n.Q, I = n.I;
  const int64_t G = nq / nkv;
  const float scale = 1.f / std::sqrt((float)hd);
  std::vector<float> xin(M * (H + F)), x(M * H), qkvb(M * Q), attn(M * nq * hd), h(M * H), gu(M * 2 * I), act(M * I);
  for (int64_t m = 0; m < M; ++m) {
    const int64_t t = active[m] ? tok[m] : 0;  // inactive: any valid row, result unused
    std::memcpy(xin.data() + m * (H + F), n.embed + t * H, H * sizeof(float));
    std::memcpy(xin.data() + m * (H + F) + H, feat[m], F * sizeof(float));
  }
  mm(n, xin.data(), H + F, n.fc, nullptr, 0, x.data(), H, M, H + F, H);
  mm(n, x.data(), H, n.qkv, nullptr, 0, qkvb.data(), Q, M, H, Q);
  for (int64_t m = 0; m < M; ++m) {  // RoPE on q and k heads, then K / V into the cache
    if (!active[m]) continue;
    float* r = qkvb.data() + m * Q;
    tailspec::rope_heads(r, nq + nkv, hd, cos[m], sin_signed[m]);
    for (int64_t kh = 0; kh < nkv; ++kh) {
      std::memcpy(n.ck + row[m] * n.skb + kh * n.skh + slot[m] * hd, r + (nq + kh) * hd, hd * sizeof(float));
      std::memcpy(n.cv + row[m] * n.skb + kh * n.skh + slot[m] * hd, r + (nq + nkv + kh) * hd, hd * sizeof(float));
    }
  }
  // Attention: the active tokens of one row in this pass (consecutive m: a row's catch-up pairs,
  // a tree level's nodes) x the G query heads of a KV head share one pass over the row's keys
  // (decode_ops' attend_queries, the target's attention: scores with lanes over keys). Token m
  // sees slots j <= slot[m] (with mask[m][j] where a mask is given); each query's arithmetic is
  // its own, whatever else shares the call.
  std::vector<uint8_t> vis;  // [tokens of the group, S] visible slots (bool)
  std::vector<const float*> qs;
  std::vector<const bool*> qmask;
  std::vector<float*> qout;
  for (int64_t m0 = 0; m0 < M;) {
    if (!active[m0]) {
      float* out_m = attn.data() + m0 * nq * hd;
      for (int64_t i = 0; i < nq * hd; ++i) out_m[i] = 0.f;
      ++m0;
      continue;
    }
    int64_t m1 = m0 + 1, S = slot[m0] + 1;
    for (; m1 < M && active[m1] && row[m1] == row[m0]; ++m1) S = std::max(S, slot[m1] + 1);
    const int64_t T = m1 - m0;
    vis.assign(T * S, 0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j <= slot[m0 + t]; ++j) vis[t * S + j] = mask ? mask[m0 + t][j] : 1;
    qs.resize(T * G), qmask.resize(T * G), qout.resize(T * G);
    for (int64_t kh = 0; kh < nkv; ++kh) {
      for (int64_t t = 0; t < T; ++t)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t hq = kh * G + g;
          qs[t * G + g] = qkvb.data() + (m0 + t) * Q + hq * hd;
          qmask[t * G + g] = reinterpret_cast<const bool*>(vis.data() + t * S);
          qout[t * G + g] = attn.data() + (m0 + t) * nq * hd + hq * hd;
        }
      attend_queries(qs.data(), qmask.data(), qout.data(), T * G, n.ck + row[m0] * n.skb + kh * n.skh,
                     n.cv + row[m0] * n.skb + kh * n.skh, S, hd, scale);
    }
    m0 = m1;
  }
  mm(n, attn.data(), nq * hd, n.o, x.data(), H, x.data(), H, M, nq * hd, H);  // x += attn @ o
  rms_norm_rows(x.data(), H, n.post_norm, n.eps, h.data(), H, M, H);
  mm(n, h.data(), H, n.gate_up, nullptr, 0, gu.data(), 2 * I, M, H, 2 * I);
  silu_mul_rows(gu.data(), act.data(), M, I);
  mm(n, act.data(), I, n.down, x.data(), H, x.data(), H, M, I, H);  // x += mlp
  std::vector<float> aux;  // eagle3 also predicts the auxiliary features: [fc_out(x); x]
  if (n.fc_out) {
    aux.resize(M * (F - H));
    mm(n, x.data(), H, n.fc_out, nullptr, 0, aux.data(), F - H, M, H, F - H);
  }
  for (int64_t m = 0; m < M; ++m) {
    if (!active[m]) continue;
    std::memcpy(out[m] + (F - H), x.data() + m * H, H * sizeof(float));
    if (n.fc_out) std::memcpy(out[m], aux.data() + m * (F - H), (F - H) * sizeof(float));
  }
}

// Catch-up: every pending pair of every row in one pass; pred [b, F] = each root's prediction.
// RoPE rows come from the tables cos / sin_signed [positions, hd]: a pair or node at cache slot s
// of a chain (or the catch-up) sits at position s + 1; a tree's level-d nodes at lengths' + d.
void catch_up(Net& n, int64_t b, int64_t T, const int64_t* pend_tok, const float* pend_feat, int64_t ldp,
              const int64_t* n_pend, const float* cos, const float* sin_signed, const int64_t* lengths, float* pred) {
  const int64_t M = b * T, F = n.F, hd = n.hd;
  std::vector<float> scratch(M * F);
  std::vector<int64_t> tok(M), row(M), slot(M);
  std::vector<uint8_t> active(M);
  std::vector<const float*> feat(M), c(M), s(M);
  std::vector<float*> out(M);
  for (int64_t r = 0; r < b; ++r)
    for (int64_t j = 0; j < T; ++j) {
      const int64_t m = r * T + j;
      active[m] = j < n_pend[r];
      tok[m] = pend_tok[m];
      feat[m] = pend_feat + r * ldp + j * F;
      c[m] = cos + (lengths[r] + 1 + j) * hd;
      s[m] = sin_signed + (lengths[r] + 1 + j) * hd;
      row[m] = r;
      slot[m] = lengths[r] + j;
      out[m] = scratch.data() + m * F;
    }
  step(n, M, tok.data(), feat.data(), c.data(), s.data(), row.data(), slot.data(), active.data(), out.data());
  for (int64_t r = 0; r < b; ++r)
    std::memcpy(pred + r * F, scratch.data() + (r * T + n_pend[r] - 1) * F, F * sizeof(float));
}

}  // namespace

extern "C" void eagle_draft(
    int64_t b, int64_t T, int64_t D, int64_t H, int64_t F, int64_t nq, int64_t nkv, int64_t hd, int64_t I, int64_t Vd,
    const int64_t* pend_tok,              // [b, T] pending tokens, the root at n[r] - 1
    const float* pend_feat, int64_t ldp,  // [b, >= T, F] pending features, row stride ldp
    const int64_t* n_pend,                // [b] pending pairs per row (>= 1)
    const float* embed,                   // [V, H] the target's embedding rows
    const int64_t* vocab_ids,             // [Vd] draft-vocabulary ids, or null (full vocabulary)
    const float* noise, float temperature,  // [b, D, Vd] Gumbel noise (null: greedy)
    const float* cos, const float* sin_signed,  // [P, hd] RoPE tables by position (P > lengths + n_pend + D)
    const float* fc, const float* qkv, const float* o, const float* gate_up, const float* down,
    const float* head, const float* fc_out,  // skinny panels; fc_out null unless eagle3
    const float* post_norm, float eps,
    float* ck, float* cv, int64_t skb, int64_t skh,  // cache layer [N, Hkv, M, hd]
    const int64_t* lengths,               // [b] committed pairs per row before the catch-up
    float min_conf,                       // the confidence stop (0: every row drafts D levels)
    int64_t* tokens,                      // [b, D] out (past out_len[r]: 0)
    int64_t* out_len,                     // [b] out: real tokens per row
    int products,                         // the panels' kind (Net::products; EagleRuntime.products)
    int nthreads) {
  Net n{H, F, nq, nkv, hd, I, Vd, (nq + 2 * nkv) * hd, embed, fc, qkv, o, gate_up, down, head, fc_out, post_norm, eps,
        ck, cv, skb, skh, nthreads, products};
  std::vector<float> pred(b * F), hbuf(b * H), logits(b * Vd), conf(b, 1.f);
  catch_up(n, b, T, pend_tok, pend_feat, ldp, n_pend, cos, sin_signed, lengths, pred.data());
  std::vector<int64_t> live(b), tok(b), row(b), slot(b);  // live: rows still drafting, in order
  for (int64_t r = 0; r < b; ++r) live[r] = r, out_len[r] = D;
  std::fill(tokens, tokens + b * D, 0);
  std::vector<uint8_t> active(b, 1);
  std::vector<const float*> feat(b), c(b), s(b);
  std::vector<float*> out(b);
  std::vector<float> lg(Vd);
  int64_t nl = b;
  for (int64_t d = 0; d < D && nl > 0; ++d) {
    // Draft distribution and the coupled sample, for the live rows (live[i]'s prediction stays
    // at pred[live[i]]; its logits are row i of this level's product).
    for (int64_t i = 0; i < nl; ++i)
      std::memcpy(hbuf.data() + i * H, pred.data() + live[i] * F + (F - H), H * sizeof(float));
    mm(n, hbuf.data(), H, head, nullptr, 0, logits.data(), Vd, nl, H, Vd);
    int64_t kept = 0;
    for (int64_t i = 0; i < nl; ++i) {
      const int64_t r = live[i];
      const float* lr = logits.data() + i * Vd;
      const float* nr = noise ? noise + (r * D + d) * Vd : nullptr;
      int64_t best = 0;
      float best_v = -INFINITY;
      for (int64_t j = 0; j < Vd; ++j) {
        const float v = nr ? lr[j] / temperature + nr[j] : lr[j];
        if (v > best_v) { best_v = v; best = j; }
      }
      tokens[r * D + d] = vocab_ids ? vocab_ids[best] : best;
      bool stop = d + 1 == D;
      if (min_conf > 0.f) {  // q(best) = exp(v_best - max) / sum_j exp(v_j - max), v = logits / T
        const float inv_t = temperature > 0.f ? 1.f / temperature : 1.f;
        float mx = -INFINITY;
        for (int64_t j = 0; j < Vd; ++j) { lg[j] = lr[j] * inv_t; mx = lg[j] > mx ? lg[j] : mx; }
        float total = 0.f;
        for (int64_t j = 0; j < Vd; ++j) total += std::exp(lg[j] - mx);
        conf[r] *= std::exp(lg[best] - mx) / total;
        if (conf[r] < min_conf) stop = true, out_len[r] = d + 1;
      }
      if (!stop) live[kept++] = r;
    }
    nl = kept;
    if (nl == 0) break;
    for (int64_t i = 0; i < nl; ++i) {
      const int64_t r = live[i];
      tok[i] = tokens[r * D + d];
      feat[i] = pred.data() + r * F;
      c[i] = cos + (lengths[r] + n_pend[r] + 1 + d) * hd;
      s[i] = sin_signed + (lengths[r] + n_pend[r] + 1 + d) * hd;
      row[i] = r;
      slot[i] = lengths[r] + n_pend[r] + d;
      out[i] = pred.data() + r * F;
    }
    step(n, nl, tok.data(), feat.data(), c.data(), s.data(), row.data(), slot.data(), active.data(), out.data());
  }
}

// A whole EAGLE tree draft in one call (coupled children): the catch-up, then D levels. The
// same function as EagleDrafter._catch_up + _expand + _select (up to float rounding). Level d
// (1-based) has a frontier of M nodes (the root at d = 1, then K); each node's children are
// its coupled sample argmax(logits / T + noise[:, d - 1]) (T = 0: argmax) and then the best of
// logits in order, skipping the coupled one, K in all; a child's score is its parent's plus
// log q(x) (q = softmax(logits / T)), for the coupled child max(log q(x), log_prior). Children
// are numbered in creation order (pool index: level by level, frontier node by node). Unless
// d == D, the K best children of the level (ties: the older) become the frontier: node i runs
// through the network at position lengths' + d, cache slot lengths' + (d - 1) K + i, seeing
// the committed slots and the tentative slots of its ancestors and itself. Finally the
// `budget` best nodes (stable: ties to the older; ancestor-closed since scores never increase
// down a path) are kept in creation order.
extern "C" void eagle_tree_draft(
    int64_t b, int64_t T, int64_t D, int64_t K, int64_t budget, int64_t H, int64_t F, int64_t nq, int64_t nkv,
    int64_t hd, int64_t I, int64_t Vd,
    const int64_t* pend_tok, const float* pend_feat, int64_t ldp, const int64_t* n_pend,  // as eagle_draft
    const float* embed, const int64_t* vocab_ids,
    const float* noise, float temperature, float log_prior,  // noise [b, D, Vd] (null: greedy)
    const float* cos, const float* sin_signed,  // [P, hd] RoPE tables by position (P > lengths + n_pend + D)
    const float* fc, const float* qkv, const float* o, const float* gate_up, const float* down,
    const float* head, const float* fc_out, const float* post_norm, float eps,
    float* ck, float* cv, int64_t skb, int64_t skh, const int64_t* lengths,
    int64_t* out_tokens, int64_t* out_parents,  // [b, n] out: kept nodes (n = min(budget, pool)), parents (-1: root)
    int products,                         // the panels' kind (Net::products; EagleRuntime.products)
    int nthreads) {
  Net n{H, F, nq, nkv, hd, I, Vd, (nq + 2 * nkv) * hd, embed, fc, qkv, o, gate_up, down, head, fc_out, post_norm, eps,
        ck, cv, skb, skh, nthreads, products};
  const int64_t P = K + (D - 1) * K * K;  // pool size per row
  const int64_t tent = (D - 1) * K;        // tentative slots per row
  std::vector<float> front(b * K * F), next(b * K * F), logits(b * K * Vd), logq(Vd);
  catch_up(n, b, T, pend_tok, pend_feat, ldp, n_pend, cos, sin_signed, lengths, front.data());
  std::vector<int64_t> pool_tok(b * P), pool_par(b * P);
  std::vector<float> pool_score(b * P);
  std::vector<int64_t> front_idx(b * K, -1);  // pool index of each frontier node (-1: the root)
  std::vector<float> front_score(b * K, 0.f);
  std::vector<uint8_t> front_anc(b * K * tent, 0), next_anc(b * K * tent, 0);  // tentative slots each sees
  std::vector<int64_t> order(K * K), idx(K), tok(b * K), row(b * K), slot(b * K);
  std::vector<uint8_t> active(b * K, 1);
  std::vector<const float*> feat(b * K), c(b * K), s(b * K);
  std::vector<float*> out(b * K);
  std::vector<const bool*> mask(b * K);
  std::vector<std::unique_ptr<bool[]>> vis_store(b * K);
  int64_t size = 0, M = 1;
  for (int64_t d = 1; d <= D; ++d) {
    mm(n, front.data() + (F - H), F, head, nullptr, 0, logits.data(), Vd, b * M, H, Vd);
    const int64_t made = M * K;  // children of this level per row
    for (int64_t r = 0; r < b; ++r) {
      const float* nr = noise ? noise + (r * D + d - 1) * Vd : nullptr;
      for (int64_t i = 0; i < M; ++i) {
        const float* lr = logits.data() + (r * M + i) * Vd;
        // log q = scaled - max - log(sum(exp(scaled - max)))
        float mx = -INFINITY;
        int64_t coupled = 0;
        float best_v = -INFINITY;
        for (int64_t j = 0; j < Vd; ++j) {
          const float v = temperature > 0 ? lr[j] / temperature : lr[j];
          logq[j] = v;
          mx = v > mx ? v : mx;
          const float cv_ = nr ? v + nr[j] : v;
          if (cv_ > best_v) { best_v = cv_; coupled = j; }
        }
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t j = 0; j < Vd; ++j) total += tailspec::fast_expf(logq[j] - mx);
        const float lse = std::log(total);
        for (int64_t j = 0; j < Vd; ++j) logq[j] = (logq[j] - mx) - lse;
        // The K best tokens, descending (ties: the lower index), then the coupled one first.
        int64_t have = 0;
        for (int64_t j = 0; j < Vd; ++j) {
          if (have == K && !(logq[j] > logq[idx[K - 1]])) continue;
          int64_t at = have < K ? have++ : K - 1;
          while (at > 0 && logq[j] > logq[idx[at - 1]]) { idx[at] = idx[at - 1]; --at; }
          idx[at] = j;
        }
        const int64_t base = r * P + size + i * K;
        const float ps = front_score[r * K + i];
        pool_tok[base] = coupled;
        pool_score[base] = ps + std::max(logq[coupled], log_prior);
        for (int64_t j = 0, k = 1; k < K; ++j) {
          if (idx[j] == coupled) continue;
          pool_tok[base + k] = idx[j];
          pool_score[base + k] = ps + logq[idx[j]];
          ++k;
        }
        for (int64_t k = 0; k < K; ++k) pool_par[base + k] = front_idx[r * K + i];
      }
    }
    if (d == D) { size += made; break; }
    // The level's K best children become the frontier (made >= K: M = 1 gives K children).
    for (int64_t r = 0; r < b; ++r) {
      const float* sc = pool_score.data() + r * P + size;
      for (int64_t j = 0; j < made; ++j) order[j] = j;
      std::stable_sort(order.begin(), order.begin() + made, [&](int64_t a, int64_t c_) { return sc[a] > sc[c_]; });
      for (int64_t i = 0; i < K; ++i) {
        const int64_t j = order[i], parent = j / K, m = r * K + i;
        const int64_t pick = pool_tok[r * P + size + j];  // a draft-vocabulary index
        tok[m] = vocab_ids ? vocab_ids[pick] : pick;
        feat[m] = front.data() + (r * M + parent) * F;
        out[m] = next.data() + m * F;
        c[m] = cos + (lengths[r] + n_pend[r] + d) * hd;
        s[m] = sin_signed + (lengths[r] + n_pend[r] + d) * hd;
        row[m] = r;
        const int64_t base = lengths[r] + n_pend[r];  // committed pairs after the catch-up
        slot[m] = base + (d - 1) * K + i;
        uint8_t* anc = next_anc.data() + m * tent;
        if (d == 1) std::memset(anc, 0, tent);  // the root's children see no tentative slot but their own
        else std::memcpy(anc, front_anc.data() + (r * K + parent) * tent, tent);
        anc[(d - 1) * K + i] = 1;
        vis_store[m].reset(new bool[slot[m] + 1]);
        bool* v = vis_store[m].get();
        for (int64_t t = 0; t < base; ++t) v[t] = true;
        for (int64_t t = base; t <= slot[m]; ++t) v[t] = anc[t - base] != 0;
        mask[m] = v;
        front_score[m] = sc[j];
      }
      for (int64_t i = 0; i < K; ++i) front_idx[r * K + i] = size + order[i];
    }
    step(n, b * K, tok.data(), feat.data(), c.data(), s.data(), row.data(), slot.data(), active.data(), out.data(),
         mask.data());
    std::swap(front, next);
    std::swap(front_anc, next_anc);
    size += made;
    M = K;
  }
  // Keep the `budget` best nodes, in creation order, parents remapped.
  const int64_t keep_n = std::min(budget, P);
  std::vector<int64_t> all(P), pos(P);
  for (int64_t r = 0; r < b; ++r) {
    const float* sc = pool_score.data() + r * P;
    for (int64_t j = 0; j < P; ++j) all[j] = j;
    std::stable_sort(all.begin(), all.end(), [&](int64_t a, int64_t c_) { return sc[a] > sc[c_]; });
    std::sort(all.begin(), all.begin() + keep_n);
    std::fill(pos.begin(), pos.end(), -1);
    for (int64_t i = 0; i < keep_n; ++i) pos[all[i]] = i;
    for (int64_t i = 0; i < keep_n; ++i) {
      const int64_t j = all[i], par = pool_par[r * P + j];
      out_tokens[r * keep_n + i] = vocab_ids ? vocab_ids[pool_tok[r * P + j]] : pool_tok[r * P + j];
      out_parents[r * keep_n + i] = par < 0 ? -1 : pos[par];
    }
  }
}
