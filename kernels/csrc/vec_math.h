// What the C++ CPU kernels share: GCC/Clang vectors of 16 floats (split to what the CPU has), loads and stores of
// them from float32, bfloat16 and float16 memory (the arithmetic is float32 whatever the storage), an ordered
// horizontal sum, and a branch-free exp. No -ffast-math anywhere: every sum is taken in a fixed order, whatever the
// threads.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace sluice {

constexpr int LANES = 16;
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef uint16_t u16vec __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t u32vec __attribute__((vector_size(LANES * sizeof(uint32_t))));

#ifdef __FLT16_MAX__  // the compiler has _Float16 (GCC 12+, Clang 15+ on x86-64 and AArch64): float16 kernels
#define SLUICE_HAS_HALF 1
typedef _Float16 hvec __attribute__((vector_size(LANES * sizeof(_Float16))));
#else
#define SLUICE_HAS_HALF 0
#endif

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof v); }

// bfloat16 is float32's upper half: widening is a shift.
inline vec load(const c10::BFloat16* p) {
  u16vec h;
  std::memcpy(&h, p, sizeof h);
  const u32vec w = __builtin_convertvector(h, u32vec) << 16;
  vec v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

// Rounded to nearest even and NaN made the quiet 0x7FC0, bit for bit c10::BFloat16(float) (PyTorch's rounding).
inline void store(c10::BFloat16* p, vec v) {
  u32vec b;
  std::memcpy(&b, &v, sizeof b);
  u32vec r = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  const u32vec nan = (u32vec)(v != v);  // all ones where v is NaN
  r = (r & ~nan) | (0x7FC0u & nan);
  const u16vec h = __builtin_convertvector(r, u16vec);
  std::memcpy(p, &h, sizeof h);
}

#if SLUICE_HAS_HALF
inline vec load(const c10::Half* p) {
  hvec h;
  std::memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, vec);
}

inline void store(c10::Half* p, vec v) {  // IEEE round to nearest even, as c10::Half(float)
  const hvec h = __builtin_convertvector(v, hvec);
  std::memcpy(p, &h, sizeof h);
}
#endif

// v rounded to T's precision and widened back: an op PyTorch runs in T rounds its result so.
template <typename T>
inline vec round_to(vec v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    T buf[LANES];
    store(buf, v);
    return load(buf);
  }
}

template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
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
