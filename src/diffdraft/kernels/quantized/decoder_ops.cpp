// The work of a Llama-family decoder layer between its matmuls, one op per step, for bfloat16
// activations on AVX-512 BF16 (emulated on AVX2 CPUs by avx512_subset.h): RMSNorm (with the residual
// add before it), rotary (after Qwen3's per-head norms, where given) on the stacked q|k|v projection,
// attention over the cache, and SiLU gating; for Gemma 3 also its RMSNorm (a float32 weight, 1 + weight),
// the normed update's residual add, GELU (tanh) gating, and sliding-window layers that read only the cache
// rows their queries can see.
//
// Each op computes in float32 and rounds to bfloat16 where Hugging Face's modules round (RMSNorm
// rounds the normalized row before the weight, rotary rounds each product and the sum, SiLU rounds
// before the gate's product), rounding to nearest even as torch does. Every output row is computed
// on its own in a fixed order, whatever the other rows of the call or the number of threads.
//
// Attention leaves out the keys a query's additive mask hides (mask values at the mask dtype's
// lowest, or -inf: their softmax weight is exactly zero anyway) and sums the visible keys in cache
// order, so a query's output depends on the keys it sees and not on where they lie in the cache: a
// tree node attends exactly as the same token does once its path is all that is cached. The query
// heads of a token that share a K/V head see the same keys and are attended together, loading each key
// and value once for all of them, and so are a few tokens of one sequence (a tree's nodes: the context
// before the tree is the start of every node's keys); every head's sums are its own, in the order of a
// head alone. A packed forward appends every sequence's keys and values to its cache and attends all
// sequences in one call a layer (attend_cached), their work shared out among the threads at once.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "avx512_subset.h"
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using at::BFloat16;

constexpr int64_t kLanes = 16;            // float32 lanes of a register
constexpr int64_t kElementwiseGrain = 1 << 15;  // elements below which an op stays on one thread
constexpr int kMaxPairs = 8;                    // attention takes head_dim up to 8 x 32

inline __mmask16 lanes_below(int64_t count) {
  return count >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
}

// Masked loads and stores are slow on Zen 4: only a row's last, partial register takes them.
inline __m512 load(const BFloat16* p, __mmask16 lanes) {
  return bf16_to_ps(lanes == 0xFFFF ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                    : _mm256_maskz_loadu_epi16(lanes, p));
}

// Round to nearest even as c10::BFloat16 does (NaN to its quiet NaN); the bf16 in each lane's low half.
inline __m512i bfloat16_bits(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

inline __m512 round_bf16(__m512 x) { return _mm512_castsi512_ps(_mm512_slli_epi32(bfloat16_bits(x), 16)); }

inline void store(BFloat16* p, __m512 x, __mmask16 lanes) {
  const __m256i bits = _mm512_cvtepi32_epi16(bfloat16_bits(x));
  if (lanes == 0xFFFF) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bits);
  } else {
    _mm256_mask_storeu_epi16(p, lanes, bits);
  }
}

// e^x to about one float32 ulp: x = n ln2 + r with |r| <= ln2 / 2, a degree-7 polynomial for e^r.
inline __m512 exponential(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.8f)), _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 in two parts: exact n * high
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f}) {
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  }
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

void check_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.is_contiguous(), name, " must be contiguous bfloat16");
}

// A norm's weight: bfloat16 for Hugging Face's Llama RMSNorm, which rounds the normalized row to bfloat16
// before the weight's product; float32 for Gemma's, which multiplies the unrounded float32 row by
// (1 + weight) in float32 and rounds once (the caller passes 1 + weight, as Gemma computes it in float32).
struct NormWeight {
  const void* data;
  bool gemma;  // float32 (1 + weight), applied to the unrounded row

  __m512 scaled(__m512 unit, int64_t i, __mmask16 lanes) const {
    if (!gemma) return _mm512_mul_ps(round_bf16(unit), load(static_cast<const BFloat16*>(data) + i, lanes));
    const float* p = static_cast<const float*>(data) + i;
    return _mm512_mul_ps(unit, lanes == 0xFFFF ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(lanes, p));
  }
};

NormWeight norm_weight(const at::Tensor& weight, const char* name) {
  TORCH_CHECK((weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat) && weight.is_contiguous(),
              name, " must be contiguous bfloat16 (Llama's norm) or float32 (Gemma's 1 + weight)");
  return {weight.data_ptr(), weight.scalar_type() == at::kFloat};
}

// Rows of `x` (+ `update`, rounded, written to `sum`) normalized like Hugging Face's RMSNorm (Llama's or
// Gemma's, by the weight). `update` may be `sum` itself: each value is read before it is written.
void rms_norm_rows(const BFloat16* x, const BFloat16* update, NormWeight weight, BFloat16* sum,
                   BFloat16* normed, int64_t width, float eps) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < width; i += kLanes) {
    const __mmask16 lanes = lanes_below(width - i);
    __m512 v = load(x + i, lanes);
    if (update != nullptr) {
      v = round_bf16(_mm512_add_ps(v, load(update + i, lanes)));
      store(sum + i, v, lanes);
    }
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const float inverse = 1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(width) + eps);
  const BFloat16* source = update != nullptr ? sum : x;
  for (int64_t i = 0; i < width; i += kLanes) {
    const __mmask16 lanes = lanes_below(width - i);
    const __m512 unit = _mm512_mul_ps(load(source + i, lanes), _mm512_set1_ps(inverse));
    store(normed + i, weight.scaled(unit, i, lanes), lanes);
  }
}

std::tuple<at::Tensor, at::Tensor> norm(const at::Tensor& x, const c10::optional<at::Tensor>& update,
                                        const at::Tensor& weight, double eps) {
  check_bf16(x, "x");
  const NormWeight w = norm_weight(weight, "weight");
  const int64_t width = x.size(-1), rows = x.numel() / width;
  TORCH_CHECK(weight.numel() == width, "weight has ", weight.numel(), " entries for rows of ", width);
  at::Tensor sum;
  if (update.has_value()) {
    check_bf16(*update, "update");
    TORCH_CHECK(update->sizes() == x.sizes(), "update and x differ in shape");
    sum = at::empty_like(x);
  }
  at::Tensor normed = at::empty_like(x);
  const auto* update_data = update.has_value() ? update->data_ptr<BFloat16>() : nullptr;
  auto* sum_data = update.has_value() ? sum.data_ptr<BFloat16>() : nullptr;
  at::parallel_for(0, rows, std::max<int64_t>(1, kElementwiseGrain / width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      rms_norm_rows(x.data_ptr<BFloat16>() + r * width, update_data ? update_data + r * width : nullptr, w,
                    sum_data ? sum_data + r * width : nullptr, normed.data_ptr<BFloat16>() + r * width, width,
                    static_cast<float>(eps));
    }
  });
  return {sum, normed};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<1>(norm(x, c10::nullopt, weight, eps));
}

std::tuple<at::Tensor, at::Tensor> residual_rms_norm(const at::Tensor& x, const at::Tensor& update,
                                                     const at::Tensor& weight, double eps) {
  return norm(x, update, weight, eps);
}

// Gemma's residual step: `update` normed by `update_weight` (rounded to bfloat16), added to `x` (rounded:
// the new residual stream, returned first), and that sum normed by `weight` (the next norm's output).
std::tuple<at::Tensor, at::Tensor> normed_residual_rms_norm(const at::Tensor& x, const at::Tensor& update,
                                                            const at::Tensor& update_weight, double update_eps,
                                                            const at::Tensor& weight, double eps) {
  check_bf16(x, "x");
  check_bf16(update, "update");
  TORCH_CHECK(update.sizes() == x.sizes(), "update and x differ in shape");
  const NormWeight inner = norm_weight(update_weight, "update_weight"), outer = norm_weight(weight, "weight");
  const int64_t width = x.size(-1), rows = x.numel() / width;
  TORCH_CHECK(weight.numel() == width && update_weight.numel() == width, "the norm weights must have ", width,
              " entries");
  at::Tensor sum = at::empty_like(x), normed = at::empty_like(x);
  const auto* x_data = x.data_ptr<BFloat16>();
  const auto* update_data = update.data_ptr<BFloat16>();
  auto* sum_data = sum.data_ptr<BFloat16>();
  auto* normed_data = normed.data_ptr<BFloat16>();
  at::parallel_for(0, rows, std::max<int64_t>(1, kElementwiseGrain / width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      BFloat16* row_sum = sum_data + r * width;
      rms_norm_rows(update_data + r * width, nullptr, inner, nullptr, row_sum, width, static_cast<float>(update_eps));
      rms_norm_rows(x_data + r * width, row_sum, outer, row_sum, normed_data + r * width, width,
                    static_cast<float>(eps));
    }
  });
  return {sum, normed};
}

// One head of `dim` values rotated by Hugging Face's rotate_half convention: the first half pairs with
// the second, x1 * cos - x2 * sin and x2 * cos + x1 * sin, each product and sum rounded to bf16.
void rotate_head(const BFloat16* x, const BFloat16* cos, const BFloat16* sin, BFloat16* out, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; i += kLanes) {
    const __mmask16 lanes = lanes_below(half - i);
    const __m512 first = load(x + i, lanes), second = load(x + half + i, lanes);
    const __m512 first_cos = round_bf16(_mm512_mul_ps(first, load(cos + i, lanes)));
    const __m512 second_sin = round_bf16(_mm512_mul_ps(second, load(sin + i, lanes)));
    store(out + i, _mm512_sub_ps(first_cos, second_sin), lanes);
    const __m512 second_cos = round_bf16(_mm512_mul_ps(second, load(cos + half + i, lanes)));
    const __m512 first_sin = round_bf16(_mm512_mul_ps(first, load(sin + half + i, lanes)));
    store(out + half + i, _mm512_add_ps(second_cos, first_sin), lanes);
  }
}

// Qwen3's (bfloat16 weights) or Gemma 3's (float32 1 + weight) per-head RMSNorm of query and key heads before
// their rotation, when given (q_norm with k_norm).
std::tuple<at::Tensor, at::Tensor, at::Tensor> rotary_split(const at::Tensor& qkv, const at::Tensor& cos,
                                                            const at::Tensor& sin, int64_t heads, int64_t kv_heads,
                                                            const c10::optional<at::Tensor>& q_norm,
                                                            const c10::optional<at::Tensor>& k_norm, double eps) {
  check_bf16(qkv, "qkv");
  check_bf16(cos, "cos");
  check_bf16(sin, "sin");
  const int64_t tokens = qkv.numel() / qkv.size(-1), dim = qkv.size(-1) / (heads + 2 * kv_heads);
  TORCH_CHECK(qkv.size(-1) == dim * (heads + 2 * kv_heads) && dim % 2 == 0, "qkv width ", qkv.size(-1),
              " is not ", heads, " + 2 x ", kv_heads, " heads of an even size");
  TORCH_CHECK(cos.numel() == tokens * dim && sin.numel() == tokens * dim, "cos and sin must be [tokens, head_dim]");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "give both per-head norms or neither");
  TORCH_CHECK(dim <= 32 * kMaxPairs, "head_dim ", dim, " unsupported");
  NormWeight norm_weights[2] = {{nullptr, false}, {nullptr, false}};
  if (q_norm.has_value()) {
    for (int n = 0; n < 2; ++n) {
      const at::Tensor& weight = n == 0 ? *q_norm : *k_norm;
      norm_weights[n] = norm_weight(weight, "a per-head norm weight");
      TORCH_CHECK(weight.numel() == dim, "a per-head norm weight has ", weight.numel(), " entries for heads of ", dim);
    }
  }
  at::Tensor query = at::empty({tokens, heads, dim}, qkv.options());
  at::Tensor key = at::empty({1, kv_heads, tokens, dim}, qkv.options());
  at::Tensor value = at::empty({1, kv_heads, tokens, dim}, qkv.options());
  const auto* in = qkv.data_ptr<BFloat16>();
  const int64_t row = qkv.size(-1), all_heads = heads + 2 * kv_heads;
  const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / dim);
  at::parallel_for(0, tokens * all_heads, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / all_heads, head = item % all_heads;
      const BFloat16* x = in + t * row + head * dim;
      BFloat16 normed[32 * kMaxPairs];
      if (norm_weights[0].data != nullptr && head < heads + kv_heads) {
        rms_norm_rows(x, nullptr, norm_weights[head < heads ? 0 : 1], nullptr, normed, dim, static_cast<float>(eps));
        x = normed;
      }
      if (head < heads) {
        rotate_head(x, cos.data_ptr<BFloat16>() + t * dim, sin.data_ptr<BFloat16>() + t * dim,
                    query.data_ptr<BFloat16>() + (t * heads + head) * dim, dim);
      } else if (head < heads + kv_heads) {
        rotate_head(x, cos.data_ptr<BFloat16>() + t * dim, sin.data_ptr<BFloat16>() + t * dim,
                    key.data_ptr<BFloat16>() + ((head - heads) * tokens + t) * dim, dim);
      } else {
        std::copy(x, x + dim, value.data_ptr<BFloat16>() + ((head - heads - kv_heads) * tokens + t) * dim);
      }
    }
  });
  return {query, key, value};
}

struct Cached {
  const BFloat16* data;
  int64_t head_stride, row_stride;

  const BFloat16* row(int64_t head, int64_t index) const { return data + head * head_stride + index * row_stride; }
};

// A segment's rows of the additive mask, read in their own dtype: widening bfloat16 and float16 to float32
// is exact, so the biases and the hidden test are those of the rows converted first.
struct MaskRows {
  const char* data;  // the first row; nullptr: every key visible, no bias
  int64_t stride;    // bytes from one row to the next
  at::ScalarType type;
  float hidden_at;  // a bias at or below it hides its key

  MaskRows from(int64_t row) const {
    return {data != nullptr ? data + row * stride : nullptr, stride, type, hidden_at};
  }

  // Row `row`'s biases of the keys from `from` on (`lanes` of them); zero without a mask.
  __m512 bias(int64_t row, int64_t from, __mmask16 lanes) const {
    if (data == nullptr) return _mm512_setzero_ps();
    const char* p = data + row * stride;
    switch (type) {
      case at::kBFloat16: return load(reinterpret_cast<const BFloat16*>(p) + from, lanes);
      case at::kHalf: {
        const auto* h = reinterpret_cast<const c10::Half*>(p) + from;
        return _mm512_cvtph_ps(lanes == 0xFFFF ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h))
                                               : _mm256_maskz_loadu_epi16(lanes, h));
      }
      default: {
        const auto* f = reinterpret_cast<const float*>(p) + from;
        return lanes == 0xFFFF ? _mm512_loadu_ps(f) : _mm512_maskz_loadu_ps(lanes, f);
      }
    }
  }
};

#ifdef __AVX512F__
constexpr int kMaxGroup = 4;       // query heads attended together; a larger group is split
constexpr int kAccumulators = 24;  // registers the weighted sum of values keeps its sums in
constexpr int kParities = 2;       // sets of sums the visible keys alternate between (hides FMA latency)
#else
// AVX2 has 16 registers, two to each 512-bit one: heads attended in groups of two and 4 512-bit
// registers of value sums in one set (its 8 chains already hide the latency). With more, the sums
// spilled to memory and each step waited on the last one's store.
constexpr int kMaxGroup = 2;
constexpr int kAccumulators = 4;
constexpr int kParities = 1;
#endif

#ifdef __AVX512F__
// Sums of the lanes of 16 registers, register k's in lane k. Every sum is the same tree over lane
// indices, (p0 + p2) + (p1 + p3) with p_j = (l_j + l_j+8) + (l_j+4 + l_j+12), so a key's score does not
// depend on which register of a tile it took.
inline __m512 lane_sums(__m512 (&v)[kLanes]) {
  for (int k = 0; k < 8; ++k) {  // halves
    v[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[k], v[k + 8], 0x44), _mm512_shuffle_f32x4(v[k], v[k + 8], 0xEE));
  }
  for (int k = 0; k < 4; ++k) {  // quarters
    v[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[k], v[k + 4], 0x88), _mm512_shuffle_f32x4(v[k], v[k + 4], 0xDD));
  }
  for (int k = 0; k < 2; ++k) {  // pairs within quarters
    v[k] = _mm512_add_ps(_mm512_shuffle_ps(v[k], v[k + 2], 0x44), _mm512_shuffle_ps(v[k], v[k + 2], 0xEE));
  }
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
  const __m512i register_order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return _mm512_permutexvar_ps(register_order, sums);
}

// One query row's dot products with 16 keys (the first `keys_here` of them), key t's in lane t: each
// key's in one register, the 16 then summed across lanes by lane_sums.
template <int kPairs, class LoadPair>
__m512 key_dots(const __m512bh (&q)[kPairs], const BFloat16* key, int64_t row_stride, int64_t keys_here,
                LoadPair load_pair) {
  __m512 dots[kLanes];
#pragma GCC unroll 16  // in registers: a loop keeps the tile's dot products in memory
  for (int t = 0; t < kLanes; ++t) {
    dots[t] = _mm512_setzero_ps();
    if (t >= keys_here) continue;  // past the last key: its lane is not shown
    for (int c = 0; c < kPairs; ++c) {
      dots[t] = _mm512_dpbf16_ps(dots[t], q[c], as_bf16_pairs(load_pair(key + t * row_stride + 32 * c, c)));
    }
  }
  return lane_sums(dots);
}
#else
// Eight AVX2 registers' lane sums, register k's in lane k, every sum by the same tree
// ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
inline __m256 lane_sums8(const __m256 (&v)[8]) {
  const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
}

// key_dots on AVX2: eight keys at a time, each key's products in one 256-bit register (16 keys of two
// registers each spilled), q's dimensions widened to floats once per call.
template <int kPairs, class LoadPair>
__m512 key_dots(const __m512bh (&q)[kPairs], const BFloat16* key, int64_t row_stride, int64_t keys_here,
                LoadPair load_pair) {
  using avx512_on_avx2::bf16_even_half, avx512_on_avx2::bf16_odd_half;
  __m256 query[kPairs][2][2];  // [pair][half][odd, even dimensions]
  for (int c = 0; c < kPairs; ++c) {
    for (int h = 0; h < 2; ++h) {
      const __m256i v = h ? q[c].hi : q[c].lo;
      query[c][h][0] = bf16_odd_half(v);
      query[c][h][1] = bf16_even_half(v);
    }
  }
  __m256 sums[2];
  for (int half = 0; half < 2; ++half) {
    __m256 dots[8];
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      dots[t] = _mm256_setzero_ps();
      if (8 * half + t >= keys_here) continue;  // past the last key: its lane is not shown
      for (int c = 0; c < kPairs; ++c) {
        const __m512i pair = load_pair(key + (8 * half + t) * row_stride + 32 * c, c);
        for (int h = 0; h < 2; ++h) {
          const __m256i v = h ? pair.hi : pair.lo;
          dots[t] = _mm256_fmadd_ps(query[c][h][0], bf16_odd_half(v), dots[t]);
          dots[t] = _mm256_fmadd_ps(query[c][h][1], bf16_even_half(v), dots[t]);
        }
      }
    }
    sums[half] = lane_sums8(dots);
  }
  return {sums[0], sums[1]};
}
#endif

// A work item attends up to kMaxChunkTokens tokens of a segment: more save no reads worth having, and
// their scores outgrow L1 (docs/decisions.md, "a tree's tokens attended in chunks").
constexpr int64_t kMaxChunkTokens = 8;
// The values of the keys a chunk's tokens all see, added a block of this many bf16 values at a time:
// 16 KB, in L1 beside the tokens' weights while each token adds them in turn.
constexpr int64_t kBlockValues = 8192;

// What a thread keeps between the passes of attend_chunk, grown to the largest chunk and the longest
// cache of a call and kept across calls (not allocated again).
struct ChunkScratch {
  std::vector<float> scores;     // [token][head][stride]: the visible keys' scores, then their weights
  std::vector<int32_t> visible;  // [token][stride]: each token's visible keys, in cache order
  std::vector<int64_t> counts;   // [token]: how many keys each token sees
  std::vector<float> totals;     // [token][head]: the softmax denominators
  std::vector<float> sums;       // [token][register][parity][head][even, odd][lane]: sums between blocks

  void fit(int64_t tokens, int64_t group, int64_t stride, int64_t dim) {
    auto grow = [](auto& buffer, int64_t size) {
      if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
    };
    grow(scores, tokens * group * stride);
    grow(visible, tokens * stride);
    grow(counts, tokens);
    grow(totals, tokens * group);
    grow(sums, tokens * ((dim + 31) / 32) * kParities * group * 2 * kLanes);
  }
};

// Softmax attention of `tokens` consecutive tokens of one segment (`token_stride` elements apart in
// `query` and `out`), each with kGroup query rows (kPairs x 32 >= dim values each, the last register
// partial if kPartial, consecutive) that share one K/V head, over that head's keys under the token's
// mask row. Each row's arithmetic is that of the row alone: the tokens share only the reading of keys
// and values, a token's query rows also the widening of values to float32 and the mask's tests.
// Scores are computed 16 keys at a time, every token's while the tile is in L1, and the visible ones
// of each token packed in order. The weighted sum of values goes down each token's visible list; with
// AVX-512 it alternates two sets of accumulators by a key's place in the list, so the latency of one
// chain does not bound it. The keys in the same places of every token's list (the context before a
// tree) are added a block at a time, each token in turn while the block's values stay in L1, its sums
// stored between blocks (a float stored and loaded again is the same float); each token then adds the
// rest of its list. `scratch` must fit `tokens` tokens of kGroup rows over `stride` >= length + 16 keys.
template <int kPairs, bool kPartial, int kGroup>
void attend_chunk(const BFloat16* query, int64_t tokens, int64_t token_stride, const Cached& keys,
                  const Cached& values, int64_t kv_head, int64_t length, const MaskRows& mask, float scale,
                  int64_t dim, ChunkScratch& scratch, int64_t stride, BFloat16* out) {
  __mmask32 pair_lanes[kPairs];
  for (int c = 0; c < kPairs; ++c) {
    const int64_t left = dim - 32 * c;
    pair_lanes[c] = left >= 32 ? __mmask32(0xFFFFFFFF) : __mmask32((1u << left) - 1);
  }
  // 32 bf16 values; only a partial register takes a masked load
  auto load_pair = [&](const BFloat16* p, int c) {
    return kPartial && c == kPairs - 1 ? _mm512_maskz_loadu_epi16(pair_lanes[c], p) : _mm512_loadu_si512(p);
  };
  float* scores = scratch.scores.data();
  int32_t* visible = scratch.visible.data();
  int64_t* counts = scratch.counts.data();
  float* totals = scratch.totals.data();
  std::fill_n(counts, tokens, 0);
  const __m512i lane_index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t tile = 0; tile < length; tile += kLanes) {
    const int64_t keys_here = std::min(kLanes, length - tile);
    const __mmask16 present = lanes_below(keys_here);
    const __m512i index = _mm512_add_epi32(lane_index, _mm512_set1_epi32(static_cast<int32_t>(tile)));
    const BFloat16* key = keys.row(kv_head, tile);
    for (int64_t t = 0; t < tokens; ++t) {
      const __m512 bias = mask.bias(t, tile, present);
      const __mmask16 shown = _mm512_mask_cmp_ps_mask(present, bias, _mm512_set1_ps(mask.hidden_at), _CMP_GT_OQ);
      const int64_t count = counts[t];
      // compress in registers and store whole: compressing stores are microcoded and slow on Zen 4
      _mm512_storeu_si512(visible + t * stride + count, _mm512_maskz_compress_epi32(shown, index));
      // a row at a time: the 16 dot products of a tile fill half the registers (the keys come again from L1)
      for (int g = 0; g < kGroup; ++g) {
        const BFloat16* row = query + t * token_stride + g * dim;
        __m512bh q[kPairs];
        for (int c = 0; c < kPairs; ++c) q[c] = as_bf16_pairs(load_pair(row + 32 * c, c));
        const __m512 dots = key_dots<kPairs>(q, key, keys.row_stride, keys_here, load_pair);
        const __m512 score = _mm512_add_ps(_mm512_mul_ps(dots, _mm512_set1_ps(scale)), bias);
        _mm512_storeu_ps(scores + (t * kGroup + g) * stride + count, _mm512_maskz_compress_ps(shown, score));
      }
      counts[t] = count + __builtin_popcount(shown);
    }
  }
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t count = counts[t];
    TORCH_CHECK(count > 0, "a query's mask hides every key");
    for (int g = 0; g < kGroup; ++g) {
      float* row_scores = scores + (t * kGroup + g) * stride;
      __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int64_t i = 0; i < count; i += kLanes) {
        top = _mm512_mask_max_ps(top, lanes_below(count - i), top, _mm512_loadu_ps(row_scores + i));
      }
      const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(top));
      __m512 total = _mm512_setzero_ps();
      for (int64_t i = 0; i < count; i += kLanes) {
        const __mmask16 lanes = lanes_below(count - i);
        const __m512 weight = exponential(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, row_scores + i), max));
        _mm512_mask_storeu_ps(row_scores + i, lanes, weight);
        total = _mm512_mask_add_ps(total, lanes, total, weight);
      }
      totals[t * kGroup + g] = _mm512_reduce_add_ps(total);
    }
  }
  // The weighted sum of values, 32 bf16 values at a time: a word shift and a mask make floats of the
  // even and odd dimensions without a lane-crossing widen; the output interleaves them back. Each
  // register of dimensions has its own sums, so a pass over the visible keys takes only as many
  // registers as stay in the CPU's, and the next pass the next ones: the sums are the same.
  constexpr int kStep = std::max(1, std::min(kPairs, kAccumulators / (2 * kParities * kGroup)));
  constexpr int64_t kTokenSums = int64_t{kPairs} * kParities * kGroup * 2 * kLanes;  // floats
  float* sums = scratch.sums.data();
  // Token t's sums of the dimensions of registers [first, first + kStep) (none yet at place 0, else from
  // `sums`) plus the keys in places [begin, end) of its visible list (their cache rows in `list`, `begin`
  // even): back to `sums`, or divided by the softmax's totals to `out` (`last`).
  auto add_values = [&](int64_t t, int first, const int32_t* list, int64_t begin, int64_t end, bool last) {
    const float* token_scores = scores + t * kGroup * stride;
    auto slot = [&](int p, int g, int s) {
      return sums + t * kTokenSums + (((first + s) * kParities + p) * kGroup + g) * 2 * kLanes;
    };
    __m512 even[kParities][kGroup][kStep], odd[kParities][kGroup][kStep];  // [key parity][row][32 dimensions]
    for (int p = 0; p < kParities; ++p) {
      for (int g = 0; g < kGroup; ++g) {
        for (int s = 0; s < kStep && first + s < kPairs; ++s) {
          even[p][g][s] = begin == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(slot(p, g, s));
          odd[p][g][s] = begin == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(slot(p, g, s) + kLanes);
        }
      }
    }
    // inlined, or the sums would live in memory (GCC left it a call)
    auto accumulate = [&](int parity, int64_t i) __attribute__((always_inline)) {
      const BFloat16* value = values.row(kv_head, list[i]);
      __m512 weight[kGroup];
      for (int g = 0; g < kGroup; ++g) weight[g] = _mm512_set1_ps(token_scores[g * stride + i]);
      for (int s = 0; s < kStep && first + s < kPairs; ++s) {
        const __m512i pair = load_pair(value + 32 * (first + s), first + s);
        const __m512 low = bf16_even_ps(pair), high = bf16_odd_ps(pair);
        for (int g = 0; g < kGroup; ++g) {
          even[parity][g][s] = _mm512_fmadd_ps(weight[g], low, even[parity][g][s]);
          odd[parity][g][s] = _mm512_fmadd_ps(weight[g], high, odd[parity][g][s]);
        }
      }
    };
    int64_t i = begin;  // the key in place i of the list goes to set i % 2, as in a single pass
    if constexpr (kParities == 2) {
      for (; i + 1 < end; i += 2) {
        accumulate(0, i);
        accumulate(1, i + 1);
      }
    }
    for (; i < end; ++i) accumulate(0, i);
    for (int g = 0; g < kGroup; ++g) {
      for (int s = 0; s < kStep && first + s < kPairs; ++s) {
        if (!last) {
          for (int p = 0; p < kParities; ++p) {
            _mm512_storeu_ps(slot(p, g, s), even[p][g][s]);
            _mm512_storeu_ps(slot(p, g, s) + kLanes, odd[p][g][s]);
          }
          continue;
        }
        __m512 even_sum = even[0][g][s], odd_sum = odd[0][g][s];
        if constexpr (kParities == 2) {
          even_sum = _mm512_add_ps(even_sum, even[1][g][s]);
          odd_sum = _mm512_add_ps(odd_sum, odd[1][g][s]);
        }
        const __m512 total = _mm512_set1_ps(totals[t * kGroup + g]);
        const __m512i low = bfloat16_bits(_mm512_div_ps(even_sum, total));
        const __m512i high = bfloat16_bits(_mm512_div_ps(odd_sum, total));
        const int c = first + s;
        _mm512_mask_storeu_epi16(out + t * token_stride + g * dim + 32 * c, pair_lanes[c],
                                 _mm512_or_si512(low, _mm512_slli_epi32(high, 16)));
      }
    }
  };
  // The keys in the same places of every token's list, the first `common` (a lone token shares none), in
  // blocks of whole tiles; the last block each token adds with the rest of its own list, the same keys up
  // to `common`.
  int64_t common = tokens > 1 ? counts[0] : 0;
  for (int64_t t = 1; t < tokens; ++t) {
    const int32_t* own = visible + t * stride;
    common = std::mismatch(visible, visible + common, own, own + counts[t]).first - visible;
  }
  const int64_t block = std::max<int64_t>(1, kBlockValues / dim / kLanes) * kLanes;
  const int64_t shared = common > 0 ? (common - 1) / block * block : 0;
  for (int64_t begin = 0; begin < shared; begin += block) {
    for (int64_t t = 0; t < tokens; ++t) {
      for (int first = 0; first < kPairs; first += kStep) add_values(t, first, visible, begin, begin + block, false);
    }
  }
  for (int64_t t = 0; t < tokens; ++t) {
    for (int first = 0; first < kPairs; first += kStep) {
      add_values(t, first, visible + t * stride, shared, counts[t], true);
    }
  }
}

using GroupKernel = decltype(&attend_chunk<1, false, 1>);

template <int kPairs = 1, int kGroup = 1>
GroupKernel group_kernel(int64_t dim, int64_t group) {
  if constexpr (kPairs < kMaxPairs) {
    if (dim > 32 * kPairs) return group_kernel<kPairs + 1, kGroup>(dim, group);
  }
  if constexpr (kGroup < kMaxGroup) {
    if (group > kGroup) return group_kernel<kPairs, kGroup + 1>(dim, group);
  }
  return dim % 32 == 0 ? &attend_chunk<kPairs, false, kGroup> : &attend_chunk<kPairs, true, kGroup>;
}

float hidden_value(at::ScalarType type) {
  switch (type) {
    case at::kBFloat16: return static_cast<float>(std::numeric_limits<c10::BFloat16>::lowest());
    case at::kHalf: return static_cast<float>(std::numeric_limits<c10::Half>::lowest());
    case at::kFloat: return std::numeric_limits<float>::lowest();
    default: TORCH_CHECK(false, "the mask must be bfloat16, float16 or float32, got ", type);
  }
  return 0.0f;
}

// One sequence's share of an attention call: its queries are the call's rows [first, first + tokens),
// over the first `length` keys and values of its cache, under its additive mask rows (or none).
struct CachedSegment {
  Cached keys, values;
  int64_t first, tokens, length;
  MaskRows mask;
};

// `mask` [1, 1, tokens, skipped + length] additive, or none (every key visible), read in place in its own
// dtype, its first `skipped` columns (keys the segment leaves out) passed over; returns the rows tensor the
// segment reads (kept alive by the caller: a reshape may copy).
at::Tensor use_mask(CachedSegment& segment, const c10::optional<at::Tensor>& mask, int64_t skipped = 0) {
  segment.mask = {nullptr, 0, at::kFloat, -std::numeric_limits<float>::infinity()};
  if (!mask.has_value()) return at::Tensor();
  const int64_t columns = skipped + segment.length;
  TORCH_CHECK(mask->numel() == segment.tokens * columns && mask->size(-1) == columns,
              "the mask must be [1, 1, tokens, keys] = [1, 1, ", segment.tokens, ", ", columns, "], got ",
              mask->sizes());
  at::Tensor rows = mask->reshape({segment.tokens, columns});
  if (rows.stride(1) != 1) rows = rows.contiguous();
  segment.mask = {static_cast<const char*>(rows.data_ptr()) + skipped * rows.element_size(),
                  rows.stride(0) * rows.element_size(), rows.scalar_type(), hidden_value(mask->scalar_type())};
  return rows;
}

// Every segment's queries [tokens, heads, dim] over its own keys (`kv_heads` of them): [tokens, heads * dim],
// the heads side by side, as the output projection reads them. The query heads of a token that share a
// K/V head are attended together, up to kMaxGroup at a time, and so are a chunk of a segment's tokens;
// the work of all segments is shared out among the threads at once. A chunk reads its keys and values
// once for all its tokens, so a segment's tokens go in as few chunks as give every thread two work items
// (3 K/V heads of one chunk each would leave one of 2 threads idle half the time), of at most
// kMaxChunkTokens; which chunk a token falls in changes none of its bits.
at::Tensor attend_segments(const at::Tensor& query, const std::vector<CachedSegment>& segments, int64_t kv_heads,
                           double scale) {
  const int64_t tokens = query.size(0), heads = query.size(1), dim = query.size(2);
  TORCH_CHECK(dim <= 32 * kMaxPairs, "head_dim ", dim, " unsupported");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, heads, " query heads do not share ", kv_heads, " kv heads");
  at::Tensor out = at::empty({tokens, heads * dim}, query.options());
  const int64_t group = heads / kv_heads;
  // a group larger than kMaxGroup in parts of at most kMaxGroup, as even as they come
  const int64_t parts = (group + kMaxGroup - 1) / kMaxGroup, part = (group + parts - 1) / parts;
  const GroupKernel kernel = group_kernel(dim, part), last_kernel = group_kernel(dim, group - (parts - 1) * part);
  const int64_t chunk_items = kv_heads * parts;  // a chunk's work items: one per K/V head and part
  const int64_t one_chunk_items = chunk_items * static_cast<int64_t>(segments.size());
  const int64_t spread = (2 * at::get_num_threads() + one_chunk_items - 1) / one_chunk_items;
  std::vector<int64_t> chunks, ends;  // each segment's chunks and its last work item + 1
  int64_t items = 0, longest = 0, widest = 0;
  for (const CachedSegment& segment : segments) {
    const int64_t fewest = (segment.tokens + kMaxChunkTokens - 1) / kMaxChunkTokens;
    const int64_t n = std::min(segment.tokens, std::max(spread, fewest));
    chunks.push_back(n);
    items += n * chunk_items;
    ends.push_back(items);
    longest = std::max(longest, segment.length);
    widest = std::max(widest, (segment.tokens + n - 1) / n);
  }
  const auto* query_data = query.data_ptr<BFloat16>();
  auto* out_data = out.data_ptr<BFloat16>();
  const int64_t stride = longest + kLanes;  // room for a whole register past the last key
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    thread_local ChunkScratch scratch;
    scratch.fit(widest, part, stride, dim);
    size_t s = std::upper_bound(ends.begin(), ends.end(), begin) - ends.begin();
    for (int64_t item = begin; item < end; ++item) {
      while (item >= ends[s]) ++s;
      const CachedSegment& segment = segments[s];
      // a K/V head's chunks one after another: a thread's run of items reads fewer heads' keys
      const int64_t local = item - (s == 0 ? 0 : ends[s - 1]), n = chunks[s];
      const int64_t kv_head = local / (parts * n), index = local / n % parts, chunk = local % n;
      const int64_t first = chunk * segment.tokens / n, count = (chunk + 1) * segment.tokens / n - first;
      const int64_t row = (segment.first + first) * heads + kv_head * group + index * part;
      (index == parts - 1 ? last_kernel : kernel)(query_data + row * dim, count, heads * dim, segment.keys,
                                                   segment.values, kv_head, segment.length,
                                                   segment.mask.from(first), static_cast<float>(scale), dim,
                                                   scratch, stride, out_data + row * dim);
    }
  });
  return out;
}

// query [tokens, heads, dim]; keys, values [1, kv_heads, length, dim] (rows of dim contiguous, any head
// and row strides, as views of a cache buffer); mask [1, 1, tokens, length] additive, or none (every key
// visible to every token, as a draft block's rows see their block). Returns [tokens, heads * dim].
at::Tensor attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                     const c10::optional<at::Tensor>& mask, double scale) {
  check_bf16(query, "query");
  TORCH_CHECK(query.dim() == 3, "query must be [tokens, heads, head_dim]");
  for (const at::Tensor* t : {&keys, &values}) {
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 4 && t->size(0) == 1 && t->stride(3) == 1,
                "keys and values must be bfloat16 [1, kv_heads, length, head_dim] with contiguous rows");
    TORCH_CHECK(t->sizes() == keys.sizes(), "keys and values differ in shape");
  }
  TORCH_CHECK(keys.size(3) == query.size(2), "keys of head_dim ", keys.size(3), " for queries of ", query.size(2));
  CachedSegment segment{{keys.data_ptr<BFloat16>(), keys.stride(1), keys.stride(2)},
                        {values.data_ptr<BFloat16>(), values.stride(1), values.stride(2)},
                        0, query.size(0), keys.size(2)};
  const at::Tensor rows = use_mask(segment, mask);
  return attend_segments(query, {segment}, keys.size(1), scale);
}

// The attention of a packed forward's segments, each over its own cache after this forward's keys and
// values are appended to it. query [tokens, heads, dim], key and value [1, kv_heads, tokens, dim] (from
// rotary_split): segment s owns the next counts[s] tokens. buffers[s]: segment s's cache of every layer,
// [layers, 2 (keys, values), 1, kv_heads, capacity, dim], holding starts[s] rows; this writes layer `layer`'s
// rows starts[s].. and attends over the first starts[s] + counts[s] under masks[s] ([1, 1, counts[s],
// starts[s] + counts[s]], or none: every key visible). One call for every segment: no per-segment views,
// copies or dispatch. A sliding-window layer (`window` > 0) reads the rows from max(0, starts[s] - window + 1)
// on: the first a query of its segment can see, the segment's first token sitting at position starts[s]
// (attention_window.window_start); the mask hides what else the window does (none: the segment is one
// token, which sees the rows from there). The keys left out are hidden keys, so the sums are the same.
at::Tensor attend_cached(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         at::TensorList buffers, int64_t layer, at::IntArrayRef starts, at::IntArrayRef counts,
                         const c10::List<c10::optional<at::Tensor>>& masks, double scale, int64_t window) {
  check_bf16(query, "query");
  check_bf16(key, "key");
  check_bf16(value, "value");
  TORCH_CHECK(query.dim() == 3, "query must be [tokens, heads, head_dim]");
  const int64_t tokens = query.size(0), dim = query.size(2);
  TORCH_CHECK(key.dim() == 4 && key.size(0) == 1 && key.size(2) == tokens && key.size(3) == dim &&
                  value.sizes() == key.sizes(),
              "key and value must be [1, kv_heads, tokens, head_dim] for the query's tokens and head_dim");
  const int64_t kv_heads = key.size(1);
  const size_t count = buffers.size();
  TORCH_CHECK(starts.size() == count && counts.size() == count && masks.size() == count,
              "give one start, count and mask per cache buffer");
  const auto* key_data = key.data_ptr<BFloat16>();
  const auto* value_data = value.data_ptr<BFloat16>();
  std::vector<CachedSegment> segments(count);
  std::vector<at::Tensor> mask_rows(count);
  int64_t first = 0;
  for (size_t s = 0; s < count; ++s) {
    const at::Tensor& buffer = buffers[s];
    check_bf16(buffer, "a cache buffer");
    TORCH_CHECK(buffer.dim() == 6 && layer >= 0 && layer < buffer.size(0) && buffer.size(1) == 2 &&
                    buffer.size(2) == 1 && buffer.size(3) == kv_heads && buffer.size(5) == dim,
                "a cache buffer must be [layers, 2, 1, kv_heads, capacity, head_dim] holding layer ", layer,
                ", got ", buffer.sizes());
    const int64_t capacity = buffer.size(4), start = starts[s], rows = counts[s];
    TORCH_CHECK(start >= 0 && rows >= 1 && start + rows <= capacity, "segment ", s, ": ", rows, " rows after ", start,
                " do not fit a buffer of ", capacity);
    TORCH_CHECK(first + rows <= tokens, "the counts add up to more than the ", tokens, " tokens");
    BFloat16* key_rows = buffer.data_ptr<BFloat16>() + (2 * layer) * kv_heads * capacity * dim;
    BFloat16* value_rows = key_rows + kv_heads * capacity * dim;
    for (int64_t h = 0; h < kv_heads; ++h) {
      std::copy_n(key_data + (h * tokens + first) * dim, rows * dim, key_rows + (h * capacity + start) * dim);
      std::copy_n(value_data + (h * tokens + first) * dim, rows * dim, value_rows + (h * capacity + start) * dim);
    }
    const c10::optional<at::Tensor> mask = masks.get(s);
    TORCH_CHECK(window >= 0, "a window is a count of keys, or 0 for none; got ", window);
    TORCH_CHECK(window == 0 || mask.has_value() || rows == 1,
                "a sliding-window layer's segment of several tokens needs a mask that applies the window");
    const int64_t skipped = window > 0 ? std::max<int64_t>(0, start - window + 1) : 0;
    CachedSegment& segment = segments[s];
    segment.keys = {key_rows + skipped * dim, capacity * dim, dim};
    segment.values = {value_rows + skipped * dim, capacity * dim, dim};
    segment.first = first;
    segment.tokens = rows;
    segment.length = start + rows - skipped;
    mask_rows[s] = use_mask(segment, mask, skipped);
    first += rows;
  }
  TORCH_CHECK(first == tokens, "the counts add up to ", first, " of the ", tokens, " tokens");
  return attend_segments(query, segments, kv_heads, scale);
}

enum class Activation { kSilu, kGeluTanh };

// act(gate) * up for the stacked gate|up projection [..., 2 x width]: [..., width]. The activation rounds
// to bfloat16 before the product, as Hugging Face's `act_fn(gate_proj(x)) * up_proj(x)` does. SiLU is
// x / (1 + e^-x); GELU's tanh form, 0.5 x (1 + tanh(u)) with u = sqrt(2 / pi) (x + 0.044715 x^3), is the same
// sigmoid at 2u: x / (1 + e^-2u).
template <Activation kActivation>
at::Tensor gate(const at::Tensor& gate_up) {
  check_bf16(gate_up, "gate_up");
  const int64_t width = gate_up.size(-1) / 2, rows = gate_up.numel() / gate_up.size(-1);
  TORCH_CHECK(gate_up.size(-1) == 2 * width, "gate_up must be two halves of equal width");
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = width;
  at::Tensor out = at::empty(shape, gate_up.options());
  const auto* in = gate_up.data_ptr<BFloat16>();
  auto* out_data = out.data_ptr<BFloat16>();
  at::parallel_for(0, rows, std::max<int64_t>(1, kElementwiseGrain / width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = 0; i < width; i += kLanes) {
        const __mmask16 lanes = lanes_below(width - i);
        const __m512 gate = load(in + 2 * r * width + i, lanes);
        const __m512 one = _mm512_set1_ps(1.0f);
        __m512 negated;
        if constexpr (kActivation == Activation::kSilu) {
          negated = _mm512_sub_ps(_mm512_setzero_ps(), gate);
        } else {
          const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(gate, gate), gate);
          const __m512 inner = _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), cube, gate);
          negated = _mm512_mul_ps(inner, _mm512_set1_ps(-2.0f * 0.7978845608028654f));  // -2 sqrt(2 / pi)
        }
        const __m512 act = round_bf16(_mm512_div_ps(gate, _mm512_add_ps(one, exponential(negated))));
        store(out_data + r * width + i, _mm512_mul_ps(act, load(in + (2 * r + 1) * width + i, lanes)), lanes);
      }
    }
  });
  return out;
}

at::Tensor silu_gate(const at::Tensor& gate_up) { return gate<Activation::kSilu>(gate_up); }

at::Tensor gelu_tanh_gate(const at::Tensor& gate_up) { return gate<Activation::kGeluTanh>(gate_up); }

}  // namespace

TORCH_LIBRARY(diffdraft_decoder, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("residual_rms_norm(Tensor x, Tensor update, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def(
      "rotary_split(Tensor qkv, Tensor cos, Tensor sin, int heads, int kv_heads, Tensor? q_norm=None, "
      "Tensor? k_norm=None, float eps=0.0) -> (Tensor, Tensor, Tensor)");
  m.def("attention(Tensor query, Tensor keys, Tensor values, Tensor? mask, float scale) -> Tensor");
  m.def(
      "attend_cached(Tensor query, Tensor key, Tensor value, Tensor[] buffers, int layer, int[] starts, "
      "int[] counts, Tensor?[] masks, float scale, int window=0) -> Tensor");
  m.def("silu_gate(Tensor gate_up) -> Tensor");
  m.def("gelu_tanh_gate(Tensor gate_up) -> Tensor");
  m.def(
      "normed_residual_rms_norm(Tensor x, Tensor update, Tensor update_weight, float update_eps, Tensor weight, "
      "float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(diffdraft_decoder, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("residual_rms_norm", &residual_rms_norm);
  m.impl("rotary_split", &rotary_split);
  m.impl("attention", &attention);
  m.impl("attend_cached", &attend_cached);
  m.impl("silu_gate", &silu_gate);
  m.impl("gelu_tanh_gate", &gelu_tanh_gate);
  m.impl("normed_residual_rms_norm", &normed_residual_rms_norm);
}
