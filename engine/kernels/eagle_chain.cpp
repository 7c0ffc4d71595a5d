// A whole EAGLE chain draft in one call: D levels of (draft head -> coupled sample -> next
// feature through the one-layer network), for b rows at once.
//
// On a CPU a draft level of a small drafter is ~40 dispatched torch ops (~0.3 ms) around very
// little arithmetic; here it is a few skinny products (skinny.cpp) and plain loops. It computes
// the same function as EagleDrafter._chain over engine.packed weights (up to float rounding):
//   level d: logits = pred[:, F-H:] @ head; pick = argmax(logits / T + noise[:, d]) (T = 0: argmax);
//            token = vocab_ids[pick];
//            if d + 1 < D: x = fc([embed(token); pred]); one decoder layer (no input norm) at
//            position lengths + d + 1, its K / V written at cache slot lengths + d; pred = x
//            (eagle3: pred = [fc_out(x); x]).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

extern "C" void skinny_gemm(const float* x, int64_t ldx, const float* wp, const float* bias, const float* c, int64_t ldc,
                            float* y, int64_t ldy, int64_t M, int64_t K, int64_t N, int nthreads);
extern "C" void rms_norm_rows(const float* x, int64_t ldx, const float* w, float eps, float* y, int64_t ldy, int64_t M, int64_t H);

extern "C" void eagle_chain(
    int64_t b, int64_t D, int64_t H, int64_t F, int64_t nq, int64_t nkv, int64_t hd, int64_t I, int64_t Vd,
    const float* pred0,                   // [b, F] the root's predicted feature
    const float* embed,                   // [V, H] the target's embedding rows
    const int64_t* vocab_ids,             // [Vd] draft-vocabulary ids, or null (full vocabulary)
    const float* noise, float temperature,  // [b, D, Vd] Gumbel noise (null: greedy)
    const float* cos, const float* sin_signed,  // [b, D, hd] RoPE at positions lengths + 1 + d
    const float* fc, const float* qkv, const float* o, const float* gate_up, const float* down,
    const float* head, const float* fc_out,  // skinny panels; fc_out null unless eagle3
    const float* post_norm, float eps,
    float* ck, float* cv, int64_t skb, int64_t skh,  // cache layer [N, Hkv, M, hd]
    const int64_t* lengths,               // [b] committed pairs per row
    int64_t* tokens,                      // [b, D] out
    int nthreads) {
  const int64_t Q = (nq + 2 * nkv) * hd, G = nq / nkv, half = hd / 2;
  const float scale = 1.f / std::sqrt((float)hd);
  std::vector<float> pred(pred0, pred0 + b * F), logits(b * Vd), xin(b * (H + F)), x(b * H), qkvb(b * Q),
      attn(b * nq * hd), h(b * H), gu(b * 2 * I), act(b * I), scores;
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
    // Next feature: x = fc([embed(token); pred]).
    for (int64_t r = 0; r < b; ++r) {
      std::memcpy(xin.data() + r * (H + F), embed + tokens[r * D + d] * H, H * sizeof(float));
      std::memcpy(xin.data() + r * (H + F) + H, pred.data() + r * F, F * sizeof(float));
    }
    skinny_gemm(xin.data(), H + F, fc, nullptr, nullptr, 0, x.data(), H, b, H + F, H, nthreads);
    skinny_gemm(x.data(), H, qkv, nullptr, nullptr, 0, qkvb.data(), Q, b, H, Q, nthreads);
    for (int64_t r = 0; r < b; ++r) {
      float* row = qkvb.data() + r * Q;
      const float* c = cos + (r * D + d) * hd;
      const float* s = sin_signed + (r * D + d) * hd;
      float tmp[1024];
      for (int64_t head_i = 0; head_i < nq + nkv; ++head_i) {  // RoPE on q and k heads
        float* v = row + head_i * hd;
        for (int64_t i = 0; i < hd; ++i) tmp[i] = v[(i + half) % hd];
        for (int64_t i = 0; i < hd; ++i) v[i] = v[i] * c[i] + tmp[i] * s[i];
      }
      const int64_t slot = lengths[r] + d;
      for (int64_t kh = 0; kh < nkv; ++kh) {
        std::memcpy(ck + r * skb + kh * skh + slot * hd, row + (nq + kh) * hd, hd * sizeof(float));
        std::memcpy(cv + r * skb + kh * skh + slot * hd, row + (nq + nkv + kh) * hd, hd * sizeof(float));
      }
      const int64_t S = slot + 1;
      scores.resize(S);
      for (int64_t hq = 0; hq < nq; ++hq) {
        const float* qr = row + hq * hd;
        const float* kb = ck + r * skb + (hq / G) * skh;
        const float* vb = cv + r * skb + (hq / G) * skh;
        float mx = -INFINITY;
        for (int64_t j = 0; j < S; ++j) {
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t i = 0; i < hd; ++i) acc += qr[i] * kb[j * hd + i];
          scores[j] = acc * scale;
          mx = scores[j] > mx ? scores[j] : mx;
        }
        float* out = attn.data() + r * nq * hd + hq * hd;
        for (int64_t i = 0; i < hd; ++i) out[i] = 0.f;
        float total = 0.f;
        for (int64_t j = 0; j < S; ++j) {
          const float e = std::exp(scores[j] - mx);
          total += e;
#pragma omp simd
          for (int64_t i = 0; i < hd; ++i) out[i] += e * vb[j * hd + i];
        }
        for (int64_t i = 0; i < hd; ++i) out[i] /= total;
      }
    }
    skinny_gemm(attn.data(), nq * hd, o, nullptr, x.data(), H, x.data(), H, b, nq * hd, H, nthreads);  // x += attn @ o
    rms_norm_rows(x.data(), H, post_norm, eps, h.data(), H, b, H);
    skinny_gemm(h.data(), H, gate_up, nullptr, nullptr, 0, gu.data(), 2 * I, b, H, 2 * I, nthreads);
    for (int64_t r = 0; r < b; ++r)
      for (int64_t i = 0; i < I; ++i) {
        const float g = gu[r * 2 * I + i];
        act[r * I + i] = (g / (1.f + std::exp(-g))) * gu[r * 2 * I + I + i];
      }
    skinny_gemm(act.data(), I, down, nullptr, x.data(), H, x.data(), H, b, I, H, nthreads);  // x += mlp
    for (int64_t r = 0; r < b; ++r) std::memcpy(pred.data() + r * F + (F - H), x.data() + r * H, H * sizeof(float));
    if (fc_out) skinny_gemm(x.data(), H, fc_out, nullptr, nullptr, 0, pred.data(), F, b, H, F - H, nthreads);
  }
}
