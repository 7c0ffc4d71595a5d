// The noise-indexed sampler's uniforms (engine/sampling.py `uniform`), computed in one pass:
// integer hashing only, so the values equal torch's bit for bit (the float conversion at the end
// is exact). A [N, V] draw over a 49k vocabulary is ~16 elementwise int64 ops in torch.
#include <cstdint>

namespace {
constexpr uint64_t M1 = 0xBF58476D1CE4E5B9ull, M2 = 0x94D049BB133111EBull;
constexpr uint64_t GOLDEN = 0x9E3779B97F4A7C15ull, VOCAB_MUL = 0xD6E8FEB86659FD93ull;

inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= M1;
  x ^= x >> 27;
  x *= M2;
  return x ^ (x >> 31);
}
}  // namespace

// out[n, v] = uniform in (0, 1) for row key keys[n] at response position positions[n] and token
// id ids[v] (ids null: v itself), exactly as engine.sampling.uniform.
extern "C" void uniform_rows(const int64_t* keys, const int64_t* positions, const int64_t* ids, int64_t N, int64_t V,
                             float* out, int nthreads) {
#pragma omp parallel for num_threads(N * V > 65536 ? nthreads : 1) schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const uint64_t site = mix64((uint64_t)keys[n] ^ mix64((uint64_t)positions[n] + GOLDEN));
    float* o = out + n * V;
#pragma omp simd
    for (int64_t v = 0; v < V; ++v) {
      const uint64_t id = ids ? (uint64_t)ids[v] : (uint64_t)v;
      uint64_t x = (site ^ (id * VOCAB_MUL)) * M1;
      x = (x ^ (x >> 29)) * M2;
      o[v] = ((float)(x >> 40) + 0.5f) * (1.0f / 16777216.0f);
    }
  }
}
