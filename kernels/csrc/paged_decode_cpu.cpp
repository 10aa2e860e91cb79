// Paged decode attention on the CPU, one query token per sequence, over a float32, bfloat16 or float16 cache (its
// query and output of the same dtype; scores, softmax and sums in float32). K and V are read where they lie in the
// block-paged cache: no gathered copy (index_select of every sequence's blocks, then SDPA reading that copy again,
// was the engine's costliest op after the GEMMs). Each token's K and V rows of all KV heads are contiguous, so both
// passes walk the context token by token and the reads stream. Loops over GCC/Clang vectors of 16 floats (split to
// what the CPU has); no -ffast-math: every sum is taken in a fixed order, whatever the thread count. A bfloat16 cache
// on a CPU with AVX512-BF16 takes its scores from vdpbf16ps over transposed 16-token tiles (bf16_scores), half the
// kernel's time otherwise. The engine also hands it prefill tokens, each a row over its own causal prefix.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "dispatch.h"
#include "vec_math.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

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
  std::vector<vec> acc;            // [heads, head_dim / LANES]: the scaled queries
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

// w.scores[h * n + t] = scale * q_h . k_t for every head h and the n tokens of w.rows: the scaled query's dot
// products with each key, sixteen lanes at a time.
template <int D, typename T>
void scores(const T* q, int64_t n, const Shape& s, float scale, Scratch<T>& w) {
  const int64_t heads = s.kv_heads * s.group;
  vec* qs = w.acc.data();
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
}

#if defined(__AVX512BF16__)
// A 16 x 16 matrix of 32-bit elements (r[i]: row i) transposed: out[j] is column j, its lanes the rows in order.
inline void transpose16(const __m512i (&r)[16], __m512i (&out)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[4b + c], 128-bit lane L: column 4L + c of rows 4b .. 4b + 3
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // the 4 x 4 transpose of 128-bit lanes
    const __m512i a = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), b = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i x = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i y = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    out[c] = _mm512_shuffle_i32x4(a, x, 0x88);
    out[4 + c] = _mm512_shuffle_i32x4(a, x, 0xDD);
    out[8 + c] = _mm512_shuffle_i32x4(b, y, 0x88);
    out[12 + c] = _mm512_shuffle_i32x4(b, y, 0xDD);
  }
}

// scores() for bfloat16 with AVX512-BF16, G query heads per KV head: sixteen tokens' K rows at a time, transposed so
// that a vector holds one pair of dimensions of all sixteen, then vdpbf16ps with each head's query pair broadcast:
// sixteen scores a vector, no horizontal sums. q . k is summed in float32 from exact bfloat16 products, then scaled.
template <int D, int G>
void bf16_scores_g(const c10::BFloat16* q, int64_t n, const Shape& s, float scale, Scratch<c10::BFloat16>& w) {
  constexpr int PAIRS = D * LANES / 2;  // of a head's dimensions
  for (int64_t g = 0; g < s.kv_heads; ++g) {
    int32_t qp[G][PAIRS];
    std::memcpy(qp, q + g * G * D * LANES, sizeof qp);
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      const int valid = static_cast<int>(std::min<int64_t>(16, n - t0));
      __m512 acc[G][2];
      for (int h = 0; h < G; ++h) acc[h][0] = acc[h][1] = _mm512_setzero_ps();
      for (int chunk = 0; chunk < PAIRS / 16; ++chunk) {
        __m512i rows[16], cols[16];
        for (int j = 0; j < 16; ++j)
          rows[j] = j < valid ? _mm512_loadu_si512(w.rows[t0 + j] + g * s.head_dim + chunk * 32) : _mm512_setzero_si512();
        transpose16(rows, cols);
        for (int i = 0; i < 16; ++i)
          for (int h = 0; h < G; ++h)  // two sums a head: twice the chains in flight
            acc[h][i & 1] = _mm512_dpbf16_ps(acc[h][i & 1], (__m512bh)_mm512_set1_epi32(qp[h][chunk * 16 + i]),
                                             (__m512bh)cols[i]);
      }
      const __mmask16 mask = valid == 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
      for (int h = 0; h < G; ++h)
        _mm512_mask_storeu_ps(w.scores.data() + (g * G + h) * n + t0, mask,
                              _mm512_mul_ps(_mm512_add_ps(acc[h][0], acc[h][1]), _mm512_set1_ps(scale)));
    }
  }
}
#endif

// bf16_scores_g for this step's group size, where the CPU has AVX512-BF16, the cache is bfloat16, head_dim a multiple
// of 32 and the group at most 8; false (nothing done) otherwise.
template <int D, typename T>
bool bf16_scores(const T* q, int64_t n, const Shape& s, float scale, Scratch<T>& w) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && D % 2 == 0) {
    switch (s.group) {
      case 1: bf16_scores_g<D, 1>(q, n, s, scale, w); return true;
      case 2: bf16_scores_g<D, 2>(q, n, s, scale, w); return true;
      case 3: bf16_scores_g<D, 3>(q, n, s, scale, w); return true;
      case 4: bf16_scores_g<D, 4>(q, n, s, scale, w); return true;
      case 5: bf16_scores_g<D, 5>(q, n, s, scale, w); return true;
      case 6: bf16_scores_g<D, 6>(q, n, s, scale, w); return true;
      case 7: bf16_scores_g<D, 7>(q, n, s, scale, w); return true;
      case 8: bf16_scores_g<D, 8>(q, n, s, scale, w); return true;
      default: return false;
    }
  }
#endif
  return false;
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
  if (!bf16_scores<D>(q, n, s, scale, w)) scores<D>(q, n, s, scale, w);
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
