// The weights' fingerprint (engine/runtime.py WeightsFingerprint) checked in one call: the bytes
// of a strided sample of every parameter, at addresses computed once when the weights were
// packed. In torch that is a gather per parameter.
#include <cstdint>

// The first i where the byte at addrs[i] differs from expect[i], or -1 (every byte as expected).
extern "C" int64_t sample_bytes_differ(const int64_t* addrs, int64_t n, const uint8_t* expect) {
  for (int64_t i = 0; i < n; ++i)
    if (*reinterpret_cast<const volatile uint8_t*>(addrs[i]) != expect[i]) return i;
  return -1;
}
