// What the C++ CPU kernels share: GCC/Clang vectors of 16 floats (split to what the CPU has), an ordered horizontal
// sum, and a branch-free exp. No -ffast-math anywhere: every sum is taken in a fixed order, whatever the threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace sluice {

constexpr int LANES = 16;
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The lanes summed pairwise in a fixed order (halves, then quarters, ...).
inline float hsum(vec v) {
  float s[LANES];
  std::memcpy(s, &v, sizeof s);
  for (int w = LANES / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) s[l] += s[l + w];
  return s[0];
}

// exp(x): 2^n * p(r), r = x - n ln2 with |r| <= ln2 / 2, Cephes' expf polynomial for p; within 2 ulp of expf.
// Clamped so 2^n stays a normal float (so silu's limits come out right: x / (1 + huge) -> 0, x / (1 + tiny) -> x).
// Branch-free arithmetic, so a loop over it vectorises.
inline float exp_clamped(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float big = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer
  const float n = (x * 1.44269504088896341f + big) - big;
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

}  // namespace sluice
