// The decoder's element-wise layers on the CPU, float32, each one pass over memory where PyTorch takes three to
// five ops (and as many passes and dispatches): RMSNorm with the residual add before it, SiLU(gate) * up, and
// neox-style rotary embedding in place. Built with -ffp-contract=off: no fused multiply-adds, so rotary is bit for
// bit transformers' x*cos + rotate_half(x)*sin, and RMSNorm differs from it only in its sum's order.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>

namespace {

using namespace sluice;

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
