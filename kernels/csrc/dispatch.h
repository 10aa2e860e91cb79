// Runs a kernel body for a tensor's dtype: f(T{}) with T float, c10::BFloat16 or, where the compiler has _Float16,
// c10::Half; any other dtype is an error naming the kernel.
#pragma once

#include <torch/extension.h>

#include "vec_math.h"

namespace sluice {

template <typename F>
void dispatch(at::ScalarType dtype, const char* kernel, F&& f) {
  switch (dtype) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(c10::BFloat16{});
#if SLUICE_HAS_HALF
    case at::kHalf: return f(c10::Half{});
#endif
    default: TORCH_CHECK(false, kernel, ": float32, bfloat16 or float16, not ", dtype);
  }
}

}  // namespace sluice
