// Skinny matrix products for CPU decoding: y[M, N] = x[M, K] @ W[K, N] (+ bias[N]) (+ c[M, N])
// for few rows M (a decode step, a verify pass of a few tokens per row).
//
// Such products stream W from memory once and do little arithmetic per weight, so they are
// memory-bound; MKL's general GEMM loses 20-45% of the bandwidth at 4-16 rows (ENVIRONMENT.md,
// docs/BENCHMARKS.md). Here W is pre-packed into column panels [P][K][TN] (TN = two vector
// registers), so each thread streams whole panels sequentially with software prefetch ahead,
// keeping up to RMAX rows x TN columns of accumulators in registers; more rows re-read the
// panel from L2. Vector width follows the compiler's target (-march=native: AVX-512 or AVX2).
// Called through ctypes (engine/kernels/skinny.py); threads from the OpenMP runtime torch loaded.
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
constexpr int VW = 16;
#else
constexpr int VW = 8;
#endif
typedef float vf __attribute__((vector_size(VW * 4), aligned(4)));
constexpr int TN = 2 * VW;
#if defined(__AVX512F__)
constexpr int RMAX = 8;
#else
constexpr int RMAX = 6;
#endif

constexpr int64_t PREFETCH = 32;  // rows of the panel ahead (4 KB with AVX-512): measured best of 8-64

static inline vf ld(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
static inline void st(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

template <int R>
static void panel(const float* x, int64_t ldx, const float* w, int64_t K, vf b0, vf b1,
                  const float* c, int64_t ldc, float* y, int64_t ldy, int ncols) {
  vf a0[R], a1[R];
  for (int r = 0; r < R; ++r) { a0[r] = b0; a1[r] = b1; }
  for (int64_t k = 0; k < K; ++k) {
    __builtin_prefetch(w + (k + PREFETCH) * TN);  // past the panel's end: harmless hints
    __builtin_prefetch(w + (k + PREFETCH) * TN + VW);
    vf w0 = ld(w + k * TN), w1 = ld(w + k * TN + VW);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      float s = x[r * ldx + k];
      a0[r] += s * w0;
      a1[r] += s * w1;
    }
  }
  for (int r = 0; r < R; ++r) {
    float* yr = y + r * ldy;
    if (ncols == TN) {
      if (c) { a0[r] += ld(c + r * ldc); a1[r] += ld(c + r * ldc + VW); }
      st(yr, a0[r]); st(yr + VW, a1[r]);
    } else {
      float tmp[TN];
      st(tmp, a0[r]); st(tmp + VW, a1[r]);
      for (int j = 0; j < ncols; ++j) yr[j] = tmp[j] + (c ? c[r * ldc + j] : 0.f);
    }
  }
}

typedef void (*panel_fn)(const float*, int64_t, const float*, int64_t, vf, vf, const float*, int64_t, float*, int64_t, int);
static const panel_fn PANELS[9] = {nullptr, panel<1>, panel<2>, panel<3>, panel<4>, panel<5>, panel<6>,
#if defined(__AVX512F__)
                                   panel<7>, panel<8>
#else
                                   nullptr, nullptr
#endif
};

extern "C" {
int skinny_tile_n() { return TN; }
int skinny_max_rows() { return RMAX; }

void skinny_gemm(const float* x, int64_t ldx, const float* wp, const float* bias, const float* c, int64_t ldc,
                 float* y, int64_t ldy, int64_t M, int64_t K, int64_t N, int nthreads) {
  const int64_t P = (N + TN - 1) / TN;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t p = 0; p < P; ++p) {
    const float* w = wp + p * K * TN;
    const int ncols = (int)((N - p * TN) < TN ? (N - p * TN) : TN);
    vf b0 = {}, b1 = {};
    if (bias) {
      float tb[TN] = {};
      for (int j = 0; j < ncols; ++j) tb[j] = bias[p * TN + j];
      b0 = ld(tb); b1 = ld(tb + VW);
    }
    for (int64_t r0 = 0; r0 < M; r0 += RMAX) {
      const int rn = (int)(M - r0 < RMAX ? M - r0 : RMAX);
      PANELS[rn](x + r0 * ldx, ldx, w, K, b0, b1, c ? c + r0 * ldc + p * TN : nullptr, ldc,
                 y + r0 * ldy + p * TN, ldy, ncols);
    }
  }
}

// W [K, N] (row stride ldw) -> panels [P][K][TN], zero padded.
void skinny_pack(const float* w, int64_t ldw, float* out, int64_t K, int64_t N) {
  const int64_t P = (N + TN - 1) / TN;
  for (int64_t p = 0; p < P; ++p)
    for (int64_t k = 0; k < K; ++k)
      for (int j = 0; j < TN; ++j) {
        int64_t n = p * TN + j;
        out[(p * K + k) * TN + j] = n < N ? w[k * ldw + n] : 0.f;
      }
}
}
