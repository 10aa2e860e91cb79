// The decoder's element-wise layers on the CPU, float32, each one pass over memory where PyTorch takes three to
// five ops (and as many passes and dispatches): RMSNorm with the residual add before it, SiLU(gate) * up, and
// neox-style rotary embedding in place. Built with -ffp-contract=off: no fused multiply-adds, so rotary is bit for
// bit transformers' x*cos + rotate_half(x)*sin, and RMSNorm differs from it only in its sum's order.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>

namespace {

constexpr int LANES = 16;
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float hsum(vec v) {  // pairwise, in a fixed order
  float s[LANES];
  std::memcpy(s, &v, sizeof s);
  for (int w = LANES / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) s[l] += s[l + w];
  return s[0];
}

// exp(x): 2^n * p(r), r = x - n ln2, Cephes' expf polynomial (within 2 ulp of expf); clamped so 2^n stays a
// normal float (silu's limits come out right: x / (1 + huge) -> 0, x / (1 + tiny) -> x). Branch-free: vectorises.
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

// Rows of `grain` work items: about 16k floats a task, so small steps stay on one thread.
inline int64_t grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

// out = weight * (x * rsqrt(mean(x^2) + eps)), transformers' order of operations.
inline void norm_row(const float* x, const float* weight, int64_t d, float eps, float* out) {
  int64_t i = 0;
  vec acc{};
  for (; i + LANES <= d; i += LANES) {
    const vec v = load(x + i);
    acc += v * v;
  }
  float sum = hsum(acc);
  for (; i < d; ++i) sum += x[i] * x[i];
  const float r = 1.0f / std::sqrt(sum / static_cast<float>(d) + eps);
  for (int64_t j = 0; j < d; ++j) out[j] = weight[j] * (x[j] * r);
}

}  // namespace

// x, out [rows, d] with unit column stride, any row stride; weight [d]. residual given: residual += x first (in
// place), and the norm is of the sum, as a decoder layer adds its sublayer's output to the residual stream.
void rms_norm(const torch::Tensor& x, const std::optional<torch::Tensor>& residual, const torch::Tensor& weight,
              double eps, torch::Tensor& out) {
  const int64_t rows = x.size(0), d = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* rp = residual ? residual->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = residual ? residual->stride(0) : 0, os = out.stride(0);
  at::parallel_for(0, rows, grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* src = xp + row * xs;
      if (rp) {
        float* res = rp + row * rs;
        for (int64_t j = 0; j < d; ++j) res[j] += src[j];
        src = res;
      }
      norm_row(src, wp, d, static_cast<float>(eps), op + row * os);
    }
  });
}

// x [rows, 2d] (gate | up), out [rows, d]: silu(gate) * up, silu(g) = g / (1 + exp(-g)) as PyTorch computes it.
void silu_and_mul(const torch::Tensor& x, torch::Tensor& out) {
  const int64_t rows = out.size(0), d = out.size(1);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, grain(2 * d), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* gate = xp + row * xs;
      const float* up = gate + d;
      float* o = op + row * os;
      for (int64_t j = 0; j < d; ++j) o[j] = gate[j] / (1.0f + exp_clamped(-gate[j])) * up[j];
    }
  });
}

// In place: x [tokens, heads, head_dim] (unit stride within a head), the token's table row picked by positions
// [tokens] from cos and sin [max_positions, head_dim] whose two halves are equal. First half x1*c - x2*s, second
// x2*c + x1*s: transformers' x*cos + rotate_half(x)*sin, rounded the same.
void rotary(torch::Tensor& x, const torch::Tensor& positions, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  float* xp = x.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t ts = x.stride(0), hs = x.stride(1), table = cos.stride(0), limit = cos.size(0);
  for (int64_t t = 0; t < tokens; ++t)  // the loop indexes the tables unchecked
    TORCH_CHECK_INDEX(pos[t] >= 0 && pos[t] < limit, "rotary: position ", pos[t], " is outside the table's ", limit);
  at::parallel_for(0, tokens, grain(heads * 2 * half), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + pos[t] * table;
      const float* s = sp + pos[t] * table;
      for (int64_t h = 0; h < heads; ++h) {
        float* a = xp + t * ts + h * hs;
        float* b = a + half;
        for (int64_t j = 0; j < half; ++j) {
          const float x1 = a[j], x2 = b[j];
          a[j] = x1 * c[j] - x2 * s[j];
          b[j] = x2 * c[j] + x1 * s[j];
        }
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm, with an optional residual add before it, float32, on the CPU");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up, float32, on the CPU");
  m.def("rotary", &rotary, "neox-style rotary embedding in place, float32, on the CPU");
}
