// Paged decode attention on the CPU, one query token per sequence, over a float32, bfloat16 or float16 cache (its
// query and output of the same dtype; scores, softmax and sums in float32). K and V are read where they lie in the
// block-paged cache: no gathered copy (index_select of every sequence's blocks, then SDPA reading that copy again,
// was the engine's costliest op after the GEMMs). Each token's K and V rows of all KV heads are contiguous, so both
// passes walk the context token by token and the reads stream. Loops over GCC/Clang vectors of 16 floats (split to
// what the CPU has); no -ffast-math: every sum is taken in a fixed order, whatever the thread count.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "dispatch.h"
#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace {

using namespace sluice;

// Sixteen dot products' lanes summed at once, each in hsum's order (lane l + lane l+8, then +4, +2, +1), by a
// transposing tree of shuffles: about 3 vector ops per sum instead of 15 scalar adds and a spill. A level takes two
// vectors holding groups of 2W lanes (one dot product's partial sums each) and returns one with twice as many
// groups of W lanes: x's and y's group g become output groups 2g and 2g+1, each half of a group added to the other.
constexpr int group_lane(int out_lane, int w, bool upper) {
  const int g = out_lane / (2 * w), within = out_lane % (2 * w);
  return (within < w ? 0 : LANES) + g * 2 * w + within % w + (upper ? w : 0);
}

template <int W, int... L>
inline vec combine(vec x, vec y, std::integer_sequence<int, L...>) {
  return __builtin_shufflevector(x, y, group_lane(L, W, false)...) +
         __builtin_shufflevector(x, y, group_lane(L, W, true)...);
}

template <int W>
inline vec combine(vec x, vec y) {
  return combine<W>(x, y, std::make_integer_sequence<int, LANES>{});
}

// Which input vector each output lane of reduce16 holds: the same tree run on item numbers.
struct ReduceOrder {
  int item[LANES];
  ReduceOrder() {
    int groups[LANES][LANES];  // groups[v]: the items of vector v, in lane-group order
    int count = 1;
    for (int v = 0; v < LANES; ++v) groups[v][0] = v;
    for (int n = LANES; n > 1; n /= 2, count *= 2)
      for (int v = 0; v < n / 2; ++v) {
        int merged[LANES];
        for (int g = 0; g < count; ++g) {
          merged[2 * g] = groups[2 * v][g];
          merged[2 * g + 1] = groups[2 * v + 1][g];
        }
        std::memcpy(groups[v], merged, sizeof merged);
      }
    std::memcpy(item, groups[0], sizeof item);
  }
};

const ReduceOrder REDUCE_ORDER;

// v[0..15] -> out[i] = hsum(v[i]), bit for bit.
inline void reduce16(const vec* v, float* out) {
  vec a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) a[i] = combine<8>(v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < 4; ++i) b[i] = combine<4>(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < 2; ++i) c[i] = combine<2>(b[2 * i], b[2 * i + 1]);
  const vec d = combine<1>(c[0], c[1]);
  float lanes[LANES];
  std::memcpy(lanes, &d, sizeof lanes);
  for (int l = 0; l < LANES; ++l) out[REDUCE_ORDER.item[l]] = lanes[l];
}

// A row of scores becomes exp(score - max) in place; returns 1 / their sum.
inline float softmax_row(float* row, int64_t n) {
  float m = row[0];
  for (int64_t t = 1; t < n; ++t) m = std::max(m, row[t]);
  float sums[LANES] = {0};
  int64_t t = 0;
  for (; t + LANES <= n; t += LANES)
    for (int l = 0; l < LANES; ++l) sums[l] += (row[t + l] = exp_clamped(row[t + l] - m));
  for (; t < n; ++t) sums[0] += (row[t] = exp_clamped(row[t] - m));
  for (int w = LANES / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) sums[l] += sums[l + w];
  return 1.0f / sums[0];
}

struct Shape {
  int64_t block_size, kv_heads, head_dim, group, max_blocks;
};

// What one thread reuses from sequence to sequence.
template <typename T>
struct Scratch {
  std::vector<const T*> rows;      // each context token's K row (all KV heads)
  std::vector<float> scores;       // [heads, context]
  std::vector<float> inv;          // [heads]: 1 / softmax denominator
  std::vector<vec> acc;            // [heads, head_dim / LANES]
};

// Heads h0 .. h0 + H - 1 (one KV head's, whose value rows start `offset` elements after the token's K row): the
// softmax-weighted sum of the values, token by token, scaled by 1 / the denominator and stored.
template <int D, int H, typename T>
inline void value_sums(const Scratch<T>& w, int64_t offset, int64_t h0, int64_t n, T* out) {
  vec acc[H][D] = {};
  for (int64_t t = 0; t < n; ++t) {
    const T* v = w.rows[t] + offset;
    vec kv[D];
    for (int c = 0; c < D; ++c) kv[c] = load(v + c * LANES);
    for (int i = 0; i < H; ++i) {
      const float p = w.scores[(h0 + i) * n + t];
      for (int c = 0; c < D; ++c) acc[i][c] += p * kv[c];
    }
  }
  for (int i = 0; i < H; ++i)
    for (int c = 0; c < D; ++c) store(out + ((h0 + i) * D + c) * LANES, acc[i][c] * w.inv[h0 + i]);
}

// One sequence, all its heads, over the keys [first, ctx): scores (soft-capped if softcap > 0), softmax, then the
// weighted sum of values.
template <int D, typename T>  // head_dim / LANES, the element type
void attend_one(const T* q, const T* k_cache, const T* v_cache, const int32_t* table, int64_t first, int64_t ctx,
                const Shape& s, float scale, float softcap, Scratch<T>& w, T* out) {
  const int64_t n = ctx - first, heads = s.kv_heads * s.group, token_stride = s.kv_heads * s.head_dim;
  const int64_t block_stride = s.block_size * token_stride;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t pos = first + t;
    w.rows[t] = k_cache + table[pos / s.block_size] * block_stride + (pos % s.block_size) * token_stride;
  }
  vec* qs = w.acc.data();  // the scaled queries, until the value pass needs the space
  for (int64_t h = 0; h < heads; ++h)
    for (int c = 0; c < D; ++c) qs[h * D + c] = load(q + (h * D + c) * LANES) * scale;
  // the (token, head) dot products in order, reduced sixteen at a time; the last few one by one, in the same order
  vec dots[LANES];
  float sums[LANES];
  int64_t where[LANES];
  int pending = 0;
  vec kv[D];  // one KV head's row, loaded (and widened) once for its whole group of query heads
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t g = 0; g < s.kv_heads; ++g) {
      const T* k = w.rows[t] + g * s.head_dim;
      for (int c = 0; c < D; ++c) kv[c] = load(k + c * LANES);
      for (int64_t h = g * s.group; h < (g + 1) * s.group; ++h) {
        vec dot = qs[h * D] * kv[0];
        for (int c = 1; c < D; ++c) dot += qs[h * D + c] * kv[c];
        dots[pending] = dot;
        where[pending++] = h * n + t;
        if (pending == LANES) {
          reduce16(dots, sums);
          for (int i = 0; i < LANES; ++i) w.scores[where[i]] = sums[i];
          pending = 0;
        }
      }
    }
  }
  for (int i = 0; i < pending; ++i) w.scores[where[i]] = hsum(dots[i]);
  if (softcap > 0)  // Gemma 2: softcap * tanh(score / softcap), before the softmax
    for (int64_t i = 0; i < heads * n; ++i) w.scores[i] = softcap * std::tanh(w.scores[i] / softcap);
  for (int64_t h = 0; h < heads; ++h) w.inv[h] = softmax_row(w.scores.data() + h * n, n);
  // values: a few heads' sums held in registers over the whole context (each KV head's group taken HEADS_AT heads at
  // a time, so sums and a value row fit the 32 vector registers), adding token after token as before
  const int64_t v_offset = v_cache - k_cache;
  constexpr int HEADS_AT = D >= 16 ? 1 : 16 / D;
  for (int64_t g = 0; g < s.kv_heads; ++g)
    for (int64_t h0 = g * s.group; h0 < (g + 1) * s.group; h0 += HEADS_AT) {
      const int hn = static_cast<int>(std::min<int64_t>(HEADS_AT, (g + 1) * s.group - h0));
      if (hn == HEADS_AT)
        value_sums<D, HEADS_AT>(w, v_offset + g * s.head_dim, h0, n, out);
      else
        for (int i = 0; i < hn; ++i) value_sums<D, 1>(w, v_offset + g * s.head_dim, h0 + i, n, out);
    }
}

template <typename T>
using AttendFn = decltype(&attend_one<1, T>);

template <typename T>
AttendFn<T> attend_for(int64_t head_dim) {
  switch (head_dim) {
    case 16: return attend_one<1, T>;
    case 32: return attend_one<2, T>;
    case 64: return attend_one<4, T>;
    case 96: return attend_one<6, T>;
    case 128: return attend_one<8, T>;
    case 256: return attend_one<16, T>;
    default: TORCH_CHECK(false, "paged_decode: head_dim ", head_dim, " is not 16, 32, 64, 96, 128 or 256");
  }
}

template <typename T>
void paged_decode_impl(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                       const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale,
                       int64_t window, double softcap, torch::Tensor& out) {
  const int64_t seqs = q.size(0), heads = q.size(1);
  if (seqs == 0) return;
  const Shape s{k_cache.size(1), k_cache.size(2), k_cache.size(3), heads / k_cache.size(2), block_tables.size(1)};
  const AttendFn<T> attend = attend_for<T>(s.head_dim);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* ctx = context_lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const int64_t longest = std::max<int64_t>(1, *std::max_element(ctx, ctx + seqs));
  // the loops index the table by position unchecked: a context past its columns would read outside it
  TORCH_CHECK_VALUE(longest <= s.max_blocks * s.block_size, "paged_decode_attention_cpu: a context of ", longest,
                    " tokens is longer than block_tables' ", s.max_blocks, " blocks of ", s.block_size);
  at::parallel_for(0, seqs, 1, [&](int64_t begin, int64_t end) {
    Scratch<T> w{std::vector<const T*>(longest), std::vector<float>(heads * longest), std::vector<float>(heads),
                 std::vector<vec>(heads * s.head_dim / LANES)};
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t n = ctx[seq], first = window > 0 ? std::max<int64_t>(0, n - window) : 0;
      const int64_t offset = seq * heads * s.head_dim;
      attend(qp + offset, kp, vp, tables + seq * s.max_blocks, first, n, s, static_cast<float>(scale),
             static_cast<float>(softcap), w, op + offset);
    }
  });
}

}  // namespace

// q and out [seqs, heads, head_dim], contiguous; k_cache and v_cache [blocks, block_size, kv_heads, head_dim],
// contiguous; block_tables [seqs, max_blocks] int32; context_lens [seqs] int32; window > 0: attend to the last
// `window` tokens only; softcap > 0: scores soft-capped. The caller (kernels/cpu_attention.py) checks dtypes, devices
// and shapes.
void paged_decode(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                  const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale, int64_t window,
                  double softcap, torch::Tensor& out) {
  dispatch(q.scalar_type(), "paged_decode", [&](auto t) {
    paged_decode_impl<decltype(t)>(q, k_cache, v_cache, block_tables, context_lens, scale, window, softcap, out);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention on the CPU");
  m.attr("half") = static_cast<bool>(SLUICE_HAS_HALF);
}
