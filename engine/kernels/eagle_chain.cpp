// A whole EAGLE chain draft in one call, for b rows at once: the catch-up (the pairs the last
// verification committed go through the one-layer network, the root last) and then D levels of
// (draft head -> coupled sample -> next feature through the network).
//
// On a CPU a draft level of a small drafter is ~40 dispatched torch ops (~0.3 ms) around very
// little arithmetic; here it is a few skinny products (skinny.cpp) and plain loops. It computes
// the same function as EagleDrafter._catch_up + _chain over engine.packed weights (up to float
// rounding). Catch-up: pair j of row r (token pend_tok[r, j], feature pend_feat[r, j]) runs at
// position lengths[r] + j + 1, writing cache slot lengths[r] + j, for j < n[r], all pairs of all
// rows in one pass (the weights are read once: a drafter's ~36 MB do not stay cached between
// target forwards); the root's prediction is the output of pair n[r] - 1. Then, with
// lengths' = lengths + n:
//   level d: logits = pred[:, F-H:] @ head; pick = argmax(logits / T + noise[:, d]) (T = 0: argmax);
//            token = vocab_ids[pick];
//            if d + 1 < D: x = fc([embed(token); pred]); one decoder layer (no input norm) at
//            position lengths' + d + 1, its K / V written at cache slot lengths' + d; pred = x
//            (eagle3: pred = [fc_out(x); x]).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

extern "C" void skinny_gemm(const float* x, int64_t ldx, const float* wp, const float* bias, const float* c, int64_t ldc,
                            float* y, int64_t ldy, int64_t M, int64_t K, int64_t N, int nthreads);
extern "C" void silu_mul_rows(const float* x, float* y, int64_t M, int64_t I);
extern "C" void rms_norm_rows(const float* x, int64_t ldx, const float* w, float eps, float* y, int64_t ldy, int64_t M, int64_t H);


namespace {

struct Net {
  int64_t H, F, nq, nkv, hd, I, Vd, Q;
  const float *embed, *fc, *qkv, *o, *gate_up, *down, *head, *fc_out, *post_norm;
  float eps;
  float *ck, *cv;
  int64_t skb, skh;
  int nthreads;
};

// One pass of M tokens through fc and the layer. Token m belongs to cache row row[m], has input
// token tok[m] and feature feat[m] (F floats), RoPE rows cos[m] / sin_signed[m] (hd floats),
// and its K / V go to slot[m]; it attends to its row's slots <= slot[m] (the pass writes every
// token's K / V first, so tokens of one row in the same pass see each other causally). Tokens
// with active[m] == 0 are computed but neither written nor attended. out[m] (F floats) = the
// predicted feature, for active tokens.
void step(Net& n, int64_t M, const int64_t* tok, const float* const* feat, const float* const* cos,
          const float* const* sin_signed, const int64_t* row, const int64_t* slot, const uint8_t* active,
          float* const* out) {
  const int64_t H = n.H, F = n.F, hd = n.hd, nq = n.nq, nkv = n.nkv, Q = n.Q, I = n.I;
  const int64_t G = nq / nkv;
  const float scale = 1.f / std::sqrt((float)hd);
  std::vector<float> xin(M * (H + F)), x(M * H), qkvb(M * Q), attn(M * nq * hd), h(M * H), gu(M * 2 * I), act(M * I);
  for (int64_t m = 0; m < M; ++m) {
    const int64_t t = active[m] ? tok[m] : 0;  // inactive: any valid row, result unused
    std::memcpy(xin.data() + m * (H + F), n.embed + t * H, H * sizeof(float));
    std::memcpy(xin.data() + m * (H + F) + H, feat[m], F * sizeof(float));
  }
  skinny_gemm(xin.data(), H + F, n.fc, nullptr, nullptr, 0, x.data(), H, M, H + F, H, n.nthreads);
  skinny_gemm(x.data(), H, n.qkv, nullptr, nullptr, 0, qkvb.data(), Q, M, H, Q, n.nthreads);
  for (int64_t m = 0; m < M; ++m) {  // RoPE on q and k heads, then K / V into the cache
    if (!active[m]) continue;
    float* r = qkvb.data() + m * Q;
    tailspec::rope_heads(r, nq + nkv, hd, cos[m], sin_signed[m]);
    for (int64_t kh = 0; kh < nkv; ++kh) {
      std::memcpy(n.ck + row[m] * n.skb + kh * n.skh + slot[m] * hd, r + (nq + kh) * hd, hd * sizeof(float));
      std::memcpy(n.cv + row[m] * n.skb + kh * n.skh + slot[m] * hd, r + (nq + nkv + kh) * hd, hd * sizeof(float));
    }
  }
  std::vector<float> scores;
  for (int64_t m = 0; m < M; ++m) {
    float* out_m = attn.data() + m * nq * hd;
    if (!active[m]) {
      for (int64_t i = 0; i < nq * hd; ++i) out_m[i] = 0.f;
      continue;
    }
    const float* r = qkvb.data() + m * Q;
    const int64_t S = slot[m] + 1;
    scores.resize(S);
    float* sc = scores.data();
    for (int64_t hq = 0; hq < nq; ++hq)
      tailspec::attend_one(r + hq * hd, n.ck + row[m] * n.skb + (hq / G) * n.skh, n.cv + row[m] * n.skb + (hq / G) * n.skh,
                           nullptr, S, hd, scale, sc, out_m + hq * hd);
  }
  skinny_gemm(attn.data(), nq * hd, n.o, nullptr, x.data(), H, x.data(), H, M, nq * hd, H, n.nthreads);  // x += attn @ o
  rms_norm_rows(x.data(), H, n.post_norm, n.eps, h.data(), H, M, H);
  skinny_gemm(h.data(), H, n.gate_up, nullptr, nullptr, 0, gu.data(), 2 * I, M, H, 2 * I, n.nthreads);
  silu_mul_rows(gu.data(), act.data(), M, I);
  skinny_gemm(act.data(), I, n.down, nullptr, x.data(), H, x.data(), H, M, I, H, n.nthreads);  // x += mlp
  std::vector<float> aux;  // eagle3 also predicts the auxiliary features: [fc_out(x); x]
  if (n.fc_out) {
    aux.resize(M * (F - H));
    skinny_gemm(x.data(), H, n.fc_out, nullptr, nullptr, 0, aux.data(), F - H, M, H, F - H, n.nthreads);
  }
  for (int64_t m = 0; m < M; ++m) {
    if (!active[m]) continue;
    std::memcpy(out[m] + (F - H), x.data() + m * H, H * sizeof(float));
    if (n.fc_out) std::memcpy(out[m], aux.data() + m * (F - H), (F - H) * sizeof(float));
  }
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
    const float* cos, const float* sin_signed,  // [b, T + D, hd]: catch-up positions, then chain positions
    const float* fc, const float* qkv, const float* o, const float* gate_up, const float* down,
    const float* head, const float* fc_out,  // skinny panels; fc_out null unless eagle3
    const float* post_norm, float eps,
    float* ck, float* cv, int64_t skb, int64_t skh,  // cache layer [N, Hkv, M, hd]
    const int64_t* lengths,               // [b] committed pairs per row before the catch-up
    int64_t* tokens,                      // [b, D] out
    int nthreads) {
  Net n{H, F, nq, nkv, hd, I, Vd, (nq + 2 * nkv) * hd, embed, fc, qkv, o, gate_up, down, head, fc_out, post_norm, eps,
        ck, cv, skb, skh, nthreads};
  const int64_t L = T + D;  // RoPE rows per cache row
  std::vector<float> pred(b * F), scratch(b * T * F), logits(b * Vd);
  // Catch-up: every pending pair of every row in one pass.
  {
    const int64_t M = b * T;
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
        c[m] = cos + (r * L + j) * hd;
        s[m] = sin_signed + (r * L + j) * hd;
        row[m] = r;
        slot[m] = lengths[r] + j;
        out[m] = scratch.data() + m * F;
      }
    step(n, M, tok.data(), feat.data(), c.data(), s.data(), row.data(), slot.data(), active.data(), out.data());
    for (int64_t r = 0; r < b; ++r)
      std::memcpy(pred.data() + r * F, scratch.data() + (r * T + n_pend[r] - 1) * F, F * sizeof(float));
  }
  std::vector<int64_t> tok(b), row(b), slot(b);
  std::vector<uint8_t> active(b, 1);
  std::vector<const float*> feat(b), c(b), s(b);
  std::vector<float*> out(b);
  for (int64_t d = 0; d < D; ++d) {
    // Draft distribution and the coupled sample.
    skinny_gemm(pred.data() + (F - H), F, head, nullptr, nullptr, 0, logits.data(), Vd, b, H, Vd, nthreads);
    for (int64_t r = 0; r < b; ++r) {
      const float* lr = logits.data() + r * Vd;
      const float* nr = noise ? noise + (r * D + d) * Vd : nullptr;
      int64_t best = 0;
      float best_v = -INFINITY;
      for (int64_t j = 0; j < Vd; ++j) {
        const float v = nr ? lr[j] / temperature + nr[j] : lr[j];
        if (v > best_v) { best_v = v; best = j; }
      }
      tokens[r * D + d] = vocab_ids ? vocab_ids[best] : best;
    }
    if (d + 1 == D) break;
    for (int64_t r = 0; r < b; ++r) {
      tok[r] = tokens[r * D + d];
      feat[r] = pred.data() + r * F;
      c[r] = cos + (r * L + T + d) * hd;
      s[r] = sin_signed + (r * L + T + d) * hd;
      row[r] = r;
      slot[r] = lengths[r] + n_pend[r] + d;
      out[r] = pred.data() + r * F;
    }
    step(n, b, tok.data(), feat.data(), c.data(), s.data(), row.data(), slot.data(), active.data(), out.data());
  }
}
