// Skinny matrix products for CPU decoding: y[M, N] = x[M, K] @ W[K, N] (+ bias[N]) (+ c[M, N])
// for few rows M (a decode step, a verify pass of a few tokens per row) up to a few thousand.
//
// Such products stream W from memory once and do little arithmetic per weight, so at few rows
// they are memory-bound. W is pre-packed into column panels [P][K][TN] (TN = NV vector
// registers), so each thread streams whole panels sequentially with software prefetch ahead,
// keeping R rows x TN columns of accumulators in registers; more rows re-read the panel from
// cache. Vector width follows the compiler's target (-march=native: AVX-512 or AVX2).
//
// The shape of the loops is set at run time by `skinny_set_params` (engine/kernels/tune.py
// measures them per host): NV (panel width, fixed when W is packed), R (rows per register
// block), the prefetch distance, and MC (rows per chunk: threads split (chunk, panel) pairs, so
// MC >= M splits columns and a small MC splits rows too), and RW (rows per register block of a
// wide pass, of WIDE rows or more: prefill, long verify passes, where the best block shape is not
// a decode step's; 0: R). None of them changes a result: every
// output element is one float accumulator fed x[m, k] * W[k, n] for k = 0..K-1 in order, so a
// row's result does not depend on M, on the parameters, or on the threads.
// `skinny_gemm_bf16dot` is the same product in bf16 arithmetic for drafters (whose numerics change
// proposals, never tokens): x and W rounded to bf16 (to nearest even), pairs of k multiplied and
// added into float32 accumulators by AVX512_BF16's dot product (2x float32's multiply-adds per
// instruction), in order of k pair, so it keeps the row independence above. Without AVX512_BF16
// the same sums run as scalar code (correct, slow; engine.spec.drafter_products=auto does not pick it).
// Called through ctypes (engine/kernels/skinny.py); threads from the OpenMP runtime torch loaded.
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "common.h"  // tailspec::bf16_bits
#if defined(__AVX512F__)
constexpr int VW = 16, NREG = 32;
#else
constexpr int VW = 8, NREG = 16;
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4), may_alias));  // unaligned access
constexpr int NV_MAX = 4;
constexpr int R_CAP = 12;
// Rows per register block that fit: R * NV accumulators + NV weights + one broadcast.
constexpr int r_max(int nv) { return (NREG - 1 - nv) / nv < R_CAP ? (NREG - 1 - nv) / nv : R_CAP; }

static inline vf ld(const float* p) { return *reinterpret_cast<const vfu*>(p); }
// VW bf16 weights widened to float32 exactly (a bf16 is a float32's top 16 bits): half the bytes
// streamed, the same float32 arithmetic after the load.
static inline vf ld(const uint16_t* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
#elif defined(__AVX2__)
  return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
#else
  vf r;
  for (int i = 0; i < VW; ++i) r[i] = __builtin_bit_cast(float, (uint32_t)p[i] << 16);
  return r;
#endif
}
static inline void st(float* p, vf v) { *reinterpret_cast<vfu*>(p) = v; }
// a + s * w, fused, always: left to the compiler, `a += s * w` became an FMA in some tile shapes
// and a multiply then an add in others (GCC's -mtune=znver* splits lone FMA chains for latency),
// and then a row's result depended on how many rows shared its register block.
static inline vf fmadd(vf a, float s, vf w) {
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps(_mm512_set1_ps(s), (__m512)w, (__m512)a);
#elif defined(__FMA__)
  return (vf)_mm256_fmadd_ps(_mm256_set1_ps(s), (__m256)w, (__m256)a);
#else
  vf p = s * w;  // no FMA on this target: a rounded product, then the sum, in every shape
  return a + p;
#endif
}

namespace {
struct Params {
  int nv = 2;          // vectors per panel row (TN = nv * VW)
  int r = NREG == 32 ? 8 : 6;  // rows per register block
  int64_t pf = 32;     // panel rows prefetched ahead (0: none)
  int64_t mc = 1 << 30;  // rows per chunk
  int rw = 0;          // rows per register block from WIDE rows on (0: r)
};
constexpr int64_t WIDE = 128;
Params g;

// WT: the packed weights' type, float (float32) or uint16_t (bf16 bits).
template <typename WT, int NV, int R>
void panel(const float* x, int64_t ldx, const WT* w, int64_t K, const float* bias, const float* c, int64_t ldc,
           float* y, int64_t ldy, int ncols, int64_t pf) {
  constexpr int TN = NV * VW;
  vf a[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) a[r][v] = ld(bias + v * VW);
  for (int64_t k = 0; k < K; ++k) {
    if (pf) {  // past the panel's end: harmless hints
#pragma GCC unroll 4
      for (int v = 0; v < NV; v += 64 / (VW * (int)sizeof(WT))) __builtin_prefetch(w + (k + pf) * TN + v * VW);
    }
    vf wv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) wv[v] = ld(w + k * TN + v * VW);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const float s = x[r * ldx + k];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) a[r][v] = fmadd(a[r][v], s, wv[v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* yr = y + r * ldy;
    if (ncols == TN) {
      for (int v = 0; v < NV; ++v) st(yr + v * VW, c ? a[r][v] + ld(c + r * ldc + v * VW) : a[r][v]);
    } else {
      float tmp[TN];
      for (int v = 0; v < NV; ++v) st(tmp + v * VW, a[r][v]);
      for (int j = 0; j < ncols; ++j) yr[j] = c ? tmp[j] + c[r * ldc + j] : tmp[j];
    }
  }
}

template <typename WT>
using panel_fn = void (*)(const float*, int64_t, const WT*, int64_t, const float*, const float*, int64_t, float*,
                          int64_t, int, int64_t);

// Panel kernels by (panel vectors NV, register rows R): Family::at<NV, R>() -> its function pointer.
template <typename WT>
struct Panels {
  using fn_t = panel_fn<WT>;
  template <int NV, int R>
  static constexpr fn_t at() { return &panel<WT, NV, R>; }
};

template <typename Family, int NV, int... Rs>
constexpr void fill_row(typename Family::fn_t* row, std::integer_sequence<int, Rs...>) {
  ((row[Rs + 1] = (Rs + 1 <= r_max(NV) ? Family::template at<NV, (Rs + 1 <= r_max(NV) ? Rs + 1 : 1)>() : nullptr)), ...);
}

// fn[nv][r]: a family's kernel for every panel width and register rows that fit (else null).
template <typename Family>
struct Table {
  typename Family::fn_t fn[NV_MAX + 1][R_CAP + 1] = {};
  Table() {
    fill_row<Family, 1>(fn[1], std::make_integer_sequence<int, R_CAP>{});
    fill_row<Family, 2>(fn[2], std::make_integer_sequence<int, R_CAP>{});
    fill_row<Family, 3>(fn[3], std::make_integer_sequence<int, R_CAP>{});
    fill_row<Family, 4>(fn[4], std::make_integer_sequence<int, R_CAP>{});
  }
};
const Table<Panels<float>> TABLE_F32;
const Table<Panels<uint16_t>> TABLE_BF16;

// The work split every product shares: chunks of rows (whole register blocks) x column panels over
// the threads; block(r0, rows, panel, bias of the panel's columns, ncols) for each block of rows.
template <typename Block>
void split(const Params& p, const float* bias, int64_t M, int64_t N, int nthreads, Block block) {
  const int64_t TN = p.nv * VW;
  const int64_t P = (N + TN - 1) / TN;
  const int64_t mc = ((p.mc < M ? p.mc : M) + p.r - 1) / p.r * p.r;  // whole register blocks per chunk
  const int64_t C = (M + mc - 1) / mc;
#pragma omp parallel for collapse(2) num_threads(nthreads) schedule(static)
  for (int64_t ci = 0; ci < C; ++ci)
    for (int64_t pi = 0; pi < P; ++pi) {
      const int ncols = (int)((N - pi * TN) < TN ? (N - pi * TN) : TN);
      float tb[NV_MAX * VW] = {};
      if (bias)
        for (int j = 0; j < ncols; ++j) tb[j] = bias[pi * TN + j];
      const int64_t end = (ci + 1) * mc < M ? (ci + 1) * mc : M;
      for (int64_t r0 = ci * mc; r0 < end; r0 += p.r) block(r0, (int)(end - r0 < p.r ? end - r0 : p.r), pi, tb, ncols);
    }
}

Params params_for(int64_t M) {
  Params p = g;
  if (M >= WIDE && p.rw) p.r = p.rw;
  return p;
}

template <typename WT>
void gemm(const float* x, int64_t ldx, const WT* wp, const float* bias, const float* c, int64_t ldc, float* y,
          int64_t ldy, int64_t M, int64_t K, int64_t N, int nthreads, const panel_fn<WT>* fns) {
  const Params p = params_for(M);
  const int64_t TN = p.nv * VW;
  split(p, bias, M, N, nthreads, [&](int64_t r0, int rn, int64_t pi, const float* tb, int ncols) {
    fns[rn](x + r0 * ldx, ldx, wp + pi * K * TN, K, tb, c ? c + r0 * ldc + pi * TN : nullptr, ldc, y + r0 * ldy + pi * TN,
            ldy, ncols, p.pf);
  });
}

// W [K, N] (row stride ldw) -> panels [P][K][TN] (TN = skinny_tile_n() when packing), zero padded.
template <typename WI, typename WT>
void pack(const WI* w, int64_t ldw, WT* out, int64_t K, int64_t N) {
  const int64_t TN = g.nv * VW;
  const int64_t P = (N + TN - 1) / TN;
  for (int64_t p = 0; p < P; ++p)
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < TN; ++j) {
        int64_t n = p * TN + j;
        out[(p * K + k) * TN + j] = n < N ? w[k * ldw + n] : WT(0);
      }
}
// x [M, K] float32 -> [M, K2] pairs of bf16 (as uint32: element 2j low, 2j + 1 high; K odd: a zero
// pads the last pair), rounded to nearest even.
using tailspec::bf16_bits;
void to_bf16_pairs(const float* x, int64_t ldx, uint32_t* xp, int64_t M, int64_t K) {
  const int64_t K2 = (K + 1) / 2;
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * ldx;
    uint32_t* out = xp + m * K2;
    int64_t k = 0;
#if defined(__AVX512BF16__)
    for (; k + 32 <= K; k += 32)  // the same rounding as bf16_bits
      _mm512_storeu_si512(out + k / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + k + 16), _mm512_loadu_ps(xr + k)));
#endif
    for (; k < K; k += 2)
      out[k / 2] = bf16_bits(xr[k]) | (k + 1 < K ? (uint32_t)bf16_bits(xr[k + 1]) << 16 : 0u);
  }
}

// The bf16 dot-product panel: w [K2][TN][2] (the pair of k = 2j, 2j + 1 adjacent per column).
// acc += x[2j + 1] w[2j + 1] then += x[2j] w[2j], each product exact in float32 (AVX512_BF16's
// order, without its flushing of subnormals in the scalar build).
static inline float bf16_value(uint32_t bits16) { return __builtin_bit_cast(float, bits16 << 16); }
template <int NV, int R>
void panel_dot(const uint32_t* xp, int64_t ldxp, const uint16_t* w, int64_t K2, const float* bias, const float* c,
               int64_t ldc, float* y, int64_t ldy, int ncols) {
  constexpr int TN = NV * VW;
  float tmp[TN];
#if defined(__AVX512BF16__)
  __m512 a[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) a[r][v] = _mm512_loadu_ps(bias + v * VW);
  for (int64_t k = 0; k < K2; ++k) {
    __m512i wv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) wv[v] = _mm512_loadu_si512(w + (k * TN + v * VW) * 2);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512i s = _mm512_set1_epi32((int)xp[r * ldxp + k]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) a[r][v] = _mm512_dpbf16_ps(a[r][v], (__m512bh)s, (__m512bh)wv[v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(tmp + v * VW, a[r][v]);
#else
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < TN; ++j) {
      float acc = bias[j];
      for (int64_t k = 0; k < K2; ++k) {
        const uint32_t xv = xp[r * ldxp + k];
        acc += bf16_value(xv >> 16) * bf16_value(w[(k * TN + j) * 2 + 1]);
        acc += bf16_value(xv & 0xffffu) * bf16_value(w[(k * TN + j) * 2]);
      }
      tmp[j] = acc;
    }
#endif
    float* yr = y + r * ldy;
    for (int j = 0; j < ncols; ++j) yr[j] = c ? tmp[j] + c[r * ldc + j] : tmp[j];
  }
}

using dot_fn = void (*)(const uint32_t*, int64_t, const uint16_t*, int64_t, const float*, const float*, int64_t, float*,
                        int64_t, int);
struct DotPanels {
  using fn_t = dot_fn;
  template <int NV, int R>
  static constexpr fn_t at() { return &panel_dot<NV, R>; }
};
const Table<DotPanels> TABLE_DOT;

void gemm_dot(const float* x, int64_t ldx, const uint16_t* wp, const float* bias, const float* c, int64_t ldc, float* y,
              int64_t ldy, int64_t M, int64_t K, int64_t N, int nthreads) {
  const Params p = params_for(M);
  const int64_t TN = p.nv * VW, K2 = (K + 1) / 2;
  thread_local std::vector<uint32_t> xp;
  if ((int64_t)xp.size() < M * K2) xp.resize(M * K2);
  to_bf16_pairs(x, ldx, xp.data(), M, K);
  const uint32_t* xq = xp.data();
  const dot_fn* fns = TABLE_DOT.fn[p.nv];
  split(p, bias, M, N, nthreads, [&](int64_t r0, int rn, int64_t pi, const float* tb, int ncols) {
    fns[rn](xq + r0 * K2, K2, wp + pi * K2 * TN * 2, K2, tb, c ? c + r0 * ldc + pi * TN : nullptr, ldc,
            y + r0 * ldy + pi * TN, ldy, ncols);
  });
}
}  // namespace

extern "C" {
int skinny_vector_width() { return VW; }
int skinny_max_rows(int nv) { return nv >= 1 && nv <= NV_MAX ? r_max(nv) : 0; }
int skinny_tile_n() { return g.nv * VW; }
int64_t skinny_wide_rows() { return WIDE; }

// Returns 0, or -1 (nothing changed) when nv / r / rw are out of range.
int skinny_set_params(int nv, int r, int64_t pf, int64_t mc, int rw) {
  if (nv < 1 || nv > NV_MAX || r < 1 || r > r_max(nv) || rw < 0 || rw > r_max(nv) || pf < 0 || mc < 1) return -1;
  g.nv = nv, g.r = r, g.pf = pf, g.mc = mc, g.rw = rw;
  return 0;
}

void skinny_gemm(const float* x, int64_t ldx, const float* wp, const float* bias, const float* c, int64_t ldc,
                 float* y, int64_t ldy, int64_t M, int64_t K, int64_t N, int nthreads) {
  gemm<float>(x, ldx, wp, bias, c, ldc, y, ldy, M, K, N, nthreads, TABLE_F32.fn[g.nv]);
}

// The same product over bf16 weights (their bits, uint16): each widened to float32 exactly, so the
// result is the float32 product over the bf16-rounded matrix, with every property above.
void skinny_gemm_bf16(const float* x, int64_t ldx, const uint16_t* wp, const float* bias, const float* c, int64_t ldc,
                      float* y, int64_t ldy, int64_t M, int64_t K, int64_t N, int nthreads) {
  gemm<uint16_t>(x, ldx, wp, bias, c, ldc, y, ldy, M, K, N, nthreads, TABLE_BF16.fn[g.nv]);
}

void skinny_pack(const float* w, int64_t ldw, float* out, int64_t K, int64_t N) { pack(w, ldw, out, K, N); }

// bf16 bits W [K, N] -> bf16 panels, as skinny_pack.
void skinny_pack_bf16(const uint16_t* w, int64_t ldw, uint16_t* out, int64_t K, int64_t N) { pack(w, ldw, out, K, N); }

// The product in bf16 arithmetic (see the top): x rounded to bf16 here, W packed by skinny_pack_bf16dot.
void skinny_gemm_bf16dot(const float* x, int64_t ldx, const uint16_t* wp, const float* bias, const float* c,
                         int64_t ldc, float* y, int64_t ldy, int64_t M, int64_t K, int64_t N, int nthreads) {
  gemm_dot(x, ldx, wp, bias, c, ldc, y, ldy, M, K, N, nthreads);
}

// bf16 bits W [K, N] -> panels of k pairs [P][K2][TN][2] (K2 = ceil(K / 2)), zero padded.
void skinny_pack_bf16dot(const uint16_t* w, int64_t ldw, uint16_t* out, int64_t K, int64_t N) {
  const int64_t TN = g.nv * VW, K2 = (K + 1) / 2;
  const int64_t P = (N + TN - 1) / TN;
  for (int64_t p = 0; p < P; ++p)
    for (int64_t k2 = 0; k2 < K2; ++k2)
      for (int64_t j = 0; j < TN; ++j)
        for (int64_t e = 0; e < 2; ++e) {
          const int64_t n = p * TN + j, k = 2 * k2 + e;
          out[((p * K2 + k2) * TN + j) * 2 + e] = n < N && k < K ? w[k * ldw + n] : 0;
        }
}

// Whether skinny_gemm_bf16dot runs on AVX512_BF16 (else its scalar form).
int skinny_bf16dot_native() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}
}
