// The decoder's element-wise layers on the CPU, each one pass over memory where PyTorch takes three to five ops (and
// as many passes and dispatches): RMSNorm with the residual add before it, SiLU(gate) * up, and neox-style rotary
// embedding in place. For float32, bfloat16 and float16 tensors: the arithmetic is float32, and wherever PyTorch's
// form of a layer (worker/engine/layers.py) rounds an intermediate to the tensor's dtype, so does the kernel, so a
// bfloat16 layer rounds as transformers' bfloat16 forward does. Built with -ffp-contract=off: no fused
// multiply-adds, so rotary is bit for bit transformers' x*cos + rotate_half(x)*sin, and RMSNorm differs from it only
// in its sum's order.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "dispatch.h"
#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>

namespace {

using namespace sluice;

// Rows of `grain` work items: about 16k elements a task, so small steps stay on one thread.
inline int64_t grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

// out = weight * round(x * rsqrt(mean(x^2) + eps)), transformers' order of operations and roundings.
template <typename T>
void norm_row(const T* x, const T* weight, int64_t d, float eps, T* out) {
  int64_t i = 0;
  vec acc{};
  for (; i + LANES <= d; i += LANES) {
    const vec v = load(x + i);
    acc += v * v;
  }
  float sum = hsum(acc);
  for (; i < d; ++i) sum += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  const float r = 1.0f / std::sqrt(sum / static_cast<float>(d) + eps);
  int64_t j = 0;
  for (; j + LANES <= d; j += LANES) store(out + j, load(weight + j) * round_to<T>(load(x + j) * r));
  for (; j < d; ++j) out[j] = static_cast<T>(static_cast<float>(weight[j]) * round_to<T>(static_cast<float>(x[j]) * r));
}

// res += x, rounded once, as PyTorch's add.
template <typename T>
void add_row(T* res, const T* x, int64_t d) {
  int64_t j = 0;
  for (; j + LANES <= d; j += LANES) store(res + j, load(res + j) + load(x + j));
  for (; j < d; ++j) res[j] = static_cast<T>(static_cast<float>(res[j]) + static_cast<float>(x[j]));
}

template <typename T>
void rms_norm_impl(const torch::Tensor& x, const std::optional<torch::Tensor>& residual, const torch::Tensor& weight,
                   float eps, torch::Tensor& out) {
  const int64_t rows = x.size(0), d = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* rp = residual ? residual->data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0), rs = residual ? residual->stride(0) : 0, os = out.stride(0);
  at::parallel_for(0, rows, grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* src = xp + row * xs;
      if (rp) {
        T* res = rp + row * rs;
        add_row(res, src, d);
        src = res;
      }
      norm_row(src, wp, d, eps, op + row * os);
    }
  });
}

// silu(g) = g / (1 + exp(-g)) as PyTorch computes it, rounded to T as F.silu's output is, then times up.
template <typename T>
void silu_and_mul_impl(const torch::Tensor& x, torch::Tensor& out) {
  const int64_t rows = out.size(0), d = out.size(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, grain(2 * d), [&](int64_t begin, int64_t end) {
    float silu[LANES];
    for (int64_t row = begin; row < end; ++row) {
      const T* gate = xp + row * xs;
      const T* up = gate + d;
      T* o = op + row * os;
      int64_t j = 0;
      for (; j + LANES <= d; j += LANES) {
        const vec g = load(gate + j);
        for (int l = 0; l < LANES; ++l) silu[l] = g[l] / (1.0f + exp_clamped(-g[l]));
        store(o + j, round_to<T>(load(silu)) * load(up + j));
      }
      for (; j < d; ++j) {
        const float g = static_cast<float>(gate[j]);
        o[j] = static_cast<T>(round_to<T>(g / (1.0f + exp_clamped(-g))) * static_cast<float>(up[j]));
      }
    }
  });
}

// First half x1*c - x2*s, second x2*c + x1*s, each product and sum rounded to T, with c and s the float32 table's
// values rounded to T: transformers' x*cos + rotate_half(x)*sin with cos and sin cast to x's dtype.
template <typename T>
void rotate_head(T* a, T* b, const float* c, const float* s, int64_t half) {
  int64_t j = 0;
  for (; j + LANES <= half; j += LANES) {
    const vec x1 = load(a + j), x2 = load(b + j);
    const vec cj = round_to<T>(load(c + j)), sj = round_to<T>(load(s + j));
    store(a + j, round_to<T>(x1 * cj) - round_to<T>(x2 * sj));
    store(b + j, round_to<T>(x2 * cj) + round_to<T>(x1 * sj));
  }
  for (; j < half; ++j) {
    const float x1 = static_cast<float>(a[j]), x2 = static_cast<float>(b[j]);
    const float cj = round_to<T>(c[j]), sj = round_to<T>(s[j]);
    a[j] = static_cast<T>(round_to<T>(x1 * cj) - round_to<T>(x2 * sj));
    b[j] = static_cast<T>(round_to<T>(x2 * cj) + round_to<T>(x1 * sj));
  }
}

template <typename T>
void rotary_impl(torch::Tensor& x, const torch::Tensor& positions, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  T* xp = x.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t ts = x.stride(0), hs = x.stride(1), table = cos.stride(0);
  at::parallel_for(0, tokens, grain(heads * 2 * half), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        T* a = xp + t * ts + h * hs;
        rotate_head(a, a + half, cp + pos[t] * table, sp + pos[t] * table, half);
      }
  });
}

}  // namespace

// x, out [rows, d] with unit column stride, any row stride; weight [d], all of one dtype. residual given: residual
// += x first (in place), and the norm is of the sum, as a decoder layer adds its sublayer's output to the residual
// stream.
void rms_norm(const torch::Tensor& x, const std::optional<torch::Tensor>& residual, const torch::Tensor& weight,
              double eps, torch::Tensor& out) {
  dispatch(x.scalar_type(), "rms_norm", [&](auto t) {
    rms_norm_impl<decltype(t)>(x, residual, weight, static_cast<float>(eps), out);
  });
}

// x [rows, 2d] (gate | up), out [rows, d], of one dtype.
void silu_and_mul(const torch::Tensor& x, torch::Tensor& out) {
  dispatch(x.scalar_type(), "silu_and_mul", [&](auto t) { silu_and_mul_impl<decltype(t)>(x, out); });
}

// In place: x [tokens, heads, head_dim] (unit stride within a head), the token's table row picked by positions
// [tokens] from the float32 cos and sin [max_positions, head_dim] whose two halves are equal.
void rotary(torch::Tensor& x, const torch::Tensor& positions, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0, limit = cos.size(0); t < x.size(0); ++t)  // the loops index the tables unchecked
    TORCH_CHECK_INDEX(pos[t] >= 0 && pos[t] < limit, "rotary: position ", pos[t], " is outside the table's ", limit);
  dispatch(x.scalar_type(), "rotary", [&](auto t) { rotary_impl<decltype(t)>(x, positions, cos, sin); });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm, with an optional residual add before it, on the CPU");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up on the CPU");
  m.def("rotary", &rotary, "neox-style rotary embedding in place on the CPU");
  m.attr("half") = static_cast<bool>(SLUICE_HAS_HALF);
}
