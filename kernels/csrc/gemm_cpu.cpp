// y = x W^T (+ b) on the CPU with the weight packed once at load, for bfloat16 (AVX512-BF16's vdpbf16ps: pairs of
// bfloat16 products summed into float32) and float32 (AVX-512 FMA). oneDNN's GEMM, which the engine used before,
// loses most where a decode step lives: at 8-64 rows it ran 0.4-1.0 of these loops' speed on the bench shapes with
// weights not in cache, and these reach 92-99% of the vector units' peak from 8 rows up (bench/NOTES.md). The whole kernel is one register tile: MR rows of
// x by NR = 32 output columns (two vectors of 16 float32 sums), over all of K, the weight's 32-column panel streaming
// from memory once and then from L2 for every further tile of rows. Threads take whole panels, so each output
// element is one thread's sum over K in order: the result does not depend on the thread count.
//
// A gated MLP's gate_up weight [2I, K] packs as panels of 16 gate rows and the 16 up rows that pair with them, so one
// tile holds both halves of its outputs: the epilogue writes them to their own columns (the [gate | up] output any
// caller expects) or applies silu(gate) * up there (an [M, I] output; the [M, 2I] one is never written), rounding
// as the separate SiLU kernel (csrc/layers_cpu.cpp) does after a GEMM: bit for bit the same values.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include "dispatch.h"
#include "vec_math.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

constexpr int NR = 32;  // output columns per panel: two vectors
constexpr int MR = 8;   // rows per register tile: 16 accumulators

#if defined(__AVX512F__)
#define SLUICE_GEMM_F32 1
#else
#define SLUICE_GEMM_F32 0
#endif
#if defined(__AVX512BF16__)
#define SLUICE_GEMM_BF16 1
#else
#define SLUICE_GEMM_BF16 0
#endif

enum Mode : int64_t { PLAIN = 0, GATED = 1, SILU = 2 };  // what a tile's two vectors of columns become

#if SLUICE_GEMM_F32
// Where a tile's sums go: y [M, N] (PLAIN: panel p's 32 columns from 32p, the last panel's cut at N), or for a gated
// weight (N = 2I) gate and up to columns 16p and I + 16p (GATED), or silu(gate) * up to column 16p of [M, I] (SILU).
template <typename T>
struct Epilogue {
  T* c;
  int64_t ldc, n;
  const float* bias;  // float32 [panels * 32] in the packed order, or null
  Mode mode;

  template <int R>
  void operator()(__m512 (&acc)[R][2], int64_t row, int64_t panel) const {
    if (bias)
      for (int h = 0; h < 2; ++h) {
        const __m512 b = _mm512_loadu_ps(bias + panel * NR + h * 16);
        for (int r = 0; r < R; ++r) acc[r][h] = _mm512_add_ps(acc[r][h], b);
      }
    T* out = c + row * ldc;
    if (mode == SILU) {
      for (int r = 0; r < R; ++r) silu_mul(acc[r][0], acc[r][1], out + r * ldc + panel * 16);
    } else if (mode == GATED) {
      for (int r = 0; r < R; ++r) {
        put(out + r * ldc + panel * 16, acc[r][0], 0xFFFF);
        put(out + r * ldc + n / 2 + panel * 16, acc[r][1], 0xFFFF);
      }
    } else {
      const int64_t cols = std::min<int64_t>(NR, n - panel * NR);
      const __mmask16 lo = cols >= 16 ? 0xFFFF : (1u << cols) - 1;
      const __mmask16 hi = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (1u << (cols - 16)) - 1;
      for (int r = 0; r < R; ++r) {
        put(out + r * ldc + panel * NR, acc[r][0], lo);
        put(out + r * ldc + panel * NR + 16, acc[r][1], hi);
      }
    }
  }

  static void put(T* p, __m512 v, __mmask16 mask) {
    if constexpr (std::is_same_v<T, float>) {
      _mm512_mask_storeu_ps(p, mask, v);
    } else if (mask == 0xFFFF) {
      sluice::store(p, static_cast<sluice::vec>(v));  // rounded to nearest even, as PyTorch rounds
    } else {
      T buf[16];
      sluice::store(buf, static_cast<sluice::vec>(v));
      _mm256_mask_storeu_epi16(p, mask, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(buf)));
    }
  }

  // The GEMM's gate and up rounded to T as its [gate | up] output would be, then silu_and_mul's arithmetic.
  static void silu_mul(__m512 gate, __m512 up, T* p) {
    const sluice::vec g = sluice::round_to<T>(static_cast<sluice::vec>(gate));
    const sluice::vec u = sluice::round_to<T>(static_cast<sluice::vec>(up));
    float silu[16];
    for (int l = 0; l < 16; ++l) silu[l] = g[l] / (1.0f + sluice::exp_clamped(-g[l]));
    sluice::store(p, sluice::round_to<T>(sluice::load(silu)) * u);
  }
};
#endif

#if SLUICE_GEMM_BF16
// R rows of x (bfloat16, row stride lda) times one panel [K/2][NR][2]: each step takes a pair of x's columns,
// broadcast, against the panel's pair-interleaved rows.
template <int R, typename E>
inline void tile_bf16(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t pairs, const E& epilogue,
                      int64_t row, int64_t panel) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + p * 2 * NR);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + p * 2 * NR + NR);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + r * lda + 2 * p, sizeof pair);
      const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b1);
    }
  }
  epilogue.template operator()<R>(acc, row, panel);
}
#endif

#if SLUICE_GEMM_F32
// R rows of x (float32) times one panel [K][NR].
template <int R, typename E>
inline void tile_f32(const float* a, int64_t lda, const float* b, int64_t k, const E& epilogue, int64_t row,
                     int64_t panel) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k; ++p) {
    const __m512 b0 = _mm512_loadu_ps(b + p * NR), b1 = _mm512_loadu_ps(b + p * NR + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * lda + p]);
      acc[r][0] = _mm512_fmadd_ps(x, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(x, b1, acc[r][1]);
    }
  }
  epilogue.template operator()<R>(acc, row, panel);
}
#endif

// tile(std::integral_constant<int, R>, first_row) over m rows: whole MR-row tiles, then one of the remainder.
template <typename F>
void row_tiles(int64_t m, F&& tile) {
  int64_t r = 0;
  for (; r + MR <= m; r += MR) tile(std::integral_constant<int, MR>{}, r);
  switch (m - r) {
    case 1: return tile(std::integral_constant<int, 1>{}, r);
    case 2: return tile(std::integral_constant<int, 2>{}, r);
    case 3: return tile(std::integral_constant<int, 3>{}, r);
    case 4: return tile(std::integral_constant<int, 4>{}, r);
    case 5: return tile(std::integral_constant<int, 5>{}, r);
    case 6: return tile(std::integral_constant<int, 6>{}, r);
    case 7: return tile(std::integral_constant<int, 7>{}, r);
    default: return;
  }
}

}  // namespace

// x [M, K] contiguous, packed: bfloat16 [ceil(N/32), K/2, 32, 2] or float32 [ceil(N/32), K, 32] (kernels/cpu_gemm.py
// packs them), n = N, bias float32 [panels * 32] (zero-padded) or None, mode: PLAIN, or
// for a weight packed gated, GATED or SILU -> y [M, N] ([M, N/2] for SILU) of x's dtype. The caller
// (kernels/cpu_gemm.py) checks dtypes and shapes.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                     const c10::optional<torch::Tensor>& bias, int64_t mode) {
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0);
  const int64_t width = mode == SILU ? n / 2 : n;
  auto y = torch::empty({m, width}, x.options());
  if (m == 0) return y;
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  bool done = false;
#if SLUICE_GEMM_F32  // every kernel here is AVX-512
  sluice::dispatch(x.scalar_type(), "cpu_gemm", [&](auto t) {
    using T = decltype(t);
    const Epilogue<T> epilogue{y.data_ptr<T>(), width, n, bp, static_cast<Mode>(mode)};
#if SLUICE_GEMM_BF16
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      const auto* a = reinterpret_cast<const uint16_t*>(x.data_ptr());
      const auto* b = reinterpret_cast<const uint16_t*>(packed.data_ptr());
      at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1; ++p)
          row_tiles(m, [&](auto rows, int64_t r) {
            tile_bf16<decltype(rows)::value>(a + r * k, k, b + p * NR * k, k / 2, epilogue, r, p);
          });
      });
      done = true;
    }
#endif
    if constexpr (std::is_same_v<T, float>) {
      const float* a = x.data_ptr<float>();
      const float* b = packed.data_ptr<float>();
      at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1; ++p)
          row_tiles(m, [&](auto rows, int64_t r) {
            tile_f32<decltype(rows)::value>(a + r * k, k, b + p * NR * k, k, epilogue, r, p);
          });
      });
      done = true;
    }
  });
#endif
  TORCH_CHECK(done, "sluice's CPU GEMM was not built for ", x.scalar_type(), " on this CPU");
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "x W^T + b over packed panels");
  m.attr("bf16") = static_cast<bool>(SLUICE_GEMM_BF16);
  m.attr("f32") = static_cast<bool>(SLUICE_GEMM_F32);
}
