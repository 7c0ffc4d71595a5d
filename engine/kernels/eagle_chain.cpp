// A whole EAGLE chain draft in one call, for b rows at once: the catch-up (the pairs the last
// verification committed go through the one-layer network, the root last) and then D levels of
// (draft head -> coupled sample -> next feature through the network).
//
// On a CPU a draft level of a small drafter is ~40 dispatched torch ops (~0.3 ms) around very
// little arithmetic; here it is a few skinny products (skinny.cpp) and plain loops. It computes
// the same function as EagleDrafter._catch_up + _chain over engine.packed weights (up to float
// rounding). Catch-up: pair j of row r (token pend_tok[r, j], feature pend_feat[r, j]) runs at
// position lengths[r] + j + 1, writing cache slot lengths[r] + j, for j < n[r]; the root's
// prediction is the output of pair n[r] - 1. Then, with lengths' = lengths + n:
//   level d: logits = pred[:, F-H:] @ head; pick = argmax(logits / T + noise[:, d]) (T = 0: argmax);
//            token = vocab_ids[pick];
//            if d + 1 < D: x = fc([embed(token); pred]); one decoder layer (no input norm) at
//            position lengths' + d + 1, its K / V written at cache slot lengths' + d; pred = x
//            (eagle3: pred = [fc_out(x); x]).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

extern "C" void skinny_gemm(const float* x, int64_t ldx, const float* wp, const float* bias, const float* c, int64_t ldc,
                            float* y, int64_t ldy, int64_t M, int64_t K, int64_t N, int nthreads);
extern "C" void rms_norm_rows(const float* x, int64_t ldx, const float* w, float eps, float* y, int64_t ldy, int64_t M, int64_t H);


namespace {

struct Net {
  int64_t H, F, nq, nkv, hd, I, Vd, Q;
  const float *embed, *fc, *qkv, *o, *gate_up, *down, *head, *fc_out, *post_norm;
  float eps;
  float *ck, *cv;
  int64_t skb, skh;
  int nthreads;
  std::vector<float> xin, x, qkvb, attn, h, gu, act, scores;
};

// One token per row through fc and the layer: x = fc([embed(tok); feat]); K / V written at
// slot[r]; RoPE rows cos / sin_signed (row stride ldc); pred_out[r] (row stride F) = the new
// feature, for rows with active[r] (null: all rows).
void step(Net& n, int64_t b, const int64_t* tok, const float* feat, int64_t ldf, const float* cos,
          const float* sin_signed, int64_t ldc, const int64_t* slot, const uint8_t* active, float* pred_out) {
  const int64_t H = n.H, F = n.F, hd = n.hd, nq = n.nq, nkv = n.nkv, Q = n.Q, I = n.I;
  const int64_t G = nq / nkv, half = hd / 2;
  const float scale = 1.f / std::sqrt((float)hd);
  for (int64_t r = 0; r < b; ++r) {
    const int64_t t = (active && !active[r]) ? 0 : tok[r];  // inactive rows: any valid row, result unused
    std::memcpy(n.xin.data() + r * (H + F), n.embed + t * H, H * sizeof(float));
    std::memcpy(n.xin.data() + r * (H + F) + H, feat + r * ldf, F * sizeof(float));
  }
  skinny_gemm(n.xin.data(), H + F, n.fc, nullptr, nullptr, 0, n.x.data(), H, b, H + F, H, n.nthreads);
  skinny_gemm(n.x.data(), H, n.qkv, nullptr, nullptr, 0, n.qkvb.data(), Q, b, H, Q, n.nthreads);
  for (int64_t r = 0; r < b; ++r) {
    float* out_r = n.attn.data() + r * nq * hd;
    if (active && !active[r]) {
      for (int64_t i = 0; i < nq * hd; ++i) out_r[i] = 0.f;
      continue;
    }
    float* row = n.qkvb.data() + r * Q;
    const float* c = cos + r * ldc;
    const float* s = sin_signed + r * ldc;
    float tmp[1024];
    for (int64_t head_i = 0; head_i < nq + nkv; ++head_i) {  // RoPE on q and k heads
      float* v = row + head_i * hd;
      for (int64_t i = 0; i < half; ++i) { tmp[i] = v[i + half]; tmp[i + half] = v[i]; }
      for (int64_t i = 0; i < hd; ++i) v[i] = v[i] * c[i] + tmp[i] * s[i];
    }
    const int64_t sl = slot[r];
    for (int64_t kh = 0; kh < nkv; ++kh) {
      std::memcpy(n.ck + r * n.skb + kh * n.skh + sl * hd, row + (nq + kh) * hd, hd * sizeof(float));
      std::memcpy(n.cv + r * n.skb + kh * n.skh + sl * hd, row + (nq + nkv + kh) * hd, hd * sizeof(float));
    }
    const int64_t S = sl + 1;
    n.scores.resize(S);
    float* sc = n.scores.data();
    for (int64_t hq = 0; hq < nq; ++hq) {
      const float* qr = row + hq * hd;
      const float* kb = n.ck + r * n.skb + (hq / G) * n.skh;
      const float* vb = n.cv + r * n.skb + (hq / G) * n.skh;
      float mx = -INFINITY;
      for (int64_t j = 0; j < S; ++j) {
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < hd; ++i) acc += qr[i] * kb[j * hd + i];
        sc[j] = acc * scale;
        mx = sc[j] > mx ? sc[j] : mx;
      }
      float* out = out_r + hq * hd;
      for (int64_t i = 0; i < hd; ++i) out[i] = 0.f;
      float total = 0.f;
      for (int64_t j = 0; j < S; ++j) {
        const float e = std::exp(sc[j] - mx);
        total += e;
#pragma omp simd
        for (int64_t i = 0; i < hd; ++i) out[i] += e * vb[j * hd + i];
      }
      for (int64_t i = 0; i < hd; ++i) out[i] /= total;
    }
  }
  skinny_gemm(n.attn.data(), nq * hd, n.o, nullptr, n.x.data(), H, n.x.data(), H, b, nq * hd, H, n.nthreads);  // x += attn @ o
  rms_norm_rows(n.x.data(), H, n.post_norm, n.eps, n.h.data(), H, b, H);
  skinny_gemm(n.h.data(), H, n.gate_up, nullptr, nullptr, 0, n.gu.data(), 2 * I, b, H, 2 * I, n.nthreads);
  for (int64_t r = 0; r < b; ++r)
    for (int64_t i = 0; i < I; ++i) {
      const float g = n.gu[r * 2 * I + i];
      n.act[r * I + i] = (g / (1.f + std::exp(-g))) * n.gu[r * 2 * I + I + i];
    }
  skinny_gemm(n.act.data(), I, n.down, nullptr, n.x.data(), H, n.x.data(), H, b, I, H, n.nthreads);  // x += mlp
  // eagle3 also predicts the auxiliary features: [fc_out(x); x].
  std::vector<float> aux;
  if (n.fc_out) {
    aux.resize(b * (F - H));
    skinny_gemm(n.x.data(), H, n.fc_out, nullptr, nullptr, 0, aux.data(), F - H, b, H, F - H, n.nthreads);
  }
  for (int64_t r = 0; r < b; ++r) {
    if (active && !active[r]) continue;
    std::memcpy(pred_out + r * F + (F - H), n.x.data() + r * H, H * sizeof(float));
    if (n.fc_out) std::memcpy(pred_out + r * F, aux.data() + r * (F - H), (F - H) * sizeof(float));
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
        ck, cv, skb, skh, nthreads, {}, {}, {}, {}, {}, {}, {}, {}};
  n.xin.resize(b * (H + F)); n.x.resize(b * H); n.qkvb.resize(b * n.Q); n.attn.resize(b * nq * hd);
  n.h.resize(b * H); n.gu.resize(b * 2 * I); n.act.resize(b * I);
  const int64_t ldc = (T + D) * hd;
  std::vector<float> pred(b * F), scratch(b * F), logits(b * Vd);
  std::vector<int64_t> tok(b), slot(b);
  std::vector<uint8_t> active(b);
  // Catch-up: pair j of every row that has one, in lockstep.
  for (int64_t j = 0; j < T; ++j) {
    for (int64_t r = 0; r < b; ++r) {
      active[r] = j < n_pend[r];
      tok[r] = pend_tok[r * T + j];
      slot[r] = lengths[r] + j;
    }
    step(n, b, tok.data(), pend_feat + j * F, ldp, cos + j * hd, sin_signed + j * hd, ldc, slot.data(), active.data(),
         scratch.data());
    for (int64_t r = 0; r < b; ++r)
      if (j == n_pend[r] - 1) std::memcpy(pred.data() + r * F, scratch.data() + r * F, F * sizeof(float));
  }
  for (int64_t d = 0; d < D; ++d) {
    // Draft distribution and the coupled sample.
    skinny_gemm(pred.data() + (F - H), F, head, nullptr, nullptr, 0, logits.data(), Vd, b, H, Vd, nthreads);
    for (int64_t r = 0; r < b; ++r) {
      const float* lr = logits.data() + r * Vd;
      const float* nr = noise ? noise + (r * D + d) * Vd : nullptr;
      int64_t best = 0;
      float best_v = -INFINITY;
      for (int64_t j = 0; j < Vd; ++j) {
        const float s = nr ? lr[j] / temperature + nr[j] : lr[j];
        if (s > best_v) { best_v = s; best = j; }
      }
      tokens[r * D + d] = vocab_ids ? vocab_ids[best] : best;
    }
    if (d + 1 == D) break;
    for (int64_t r = 0; r < b; ++r) {
      tok[r] = tokens[r * D + d];
      slot[r] = lengths[r] + n_pend[r] + d;
    }
    step(n, b, tok.data(), pred.data(), F, cos + (T + d) * hd, sin_signed + (T + d) * hd, ldc, slot.data(), nullptr,
         pred.data());
  }
}
