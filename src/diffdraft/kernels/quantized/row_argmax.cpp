// The index of each row's largest value, for float32 or bfloat16 rows on AVX-512: greedy decoding's
// pick among the vocabulary's logits, for every node of a verified tree.
//
// torch's max over the last dimension reads one element at a time: more than a tree's acceptance walk,
// and paid by every node (docs/decisions.md, "greedy picks on the row-argmax kernel"). This reads whole
// registers and gives the same index: the first among equal maxima (-0 and +0 equal), and the first
// NaN where a row holds one (torch's max propagates NaN).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "avx512_subset.h"
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>

namespace {

using at::BFloat16;

constexpr int64_t kLanes = 16;
constexpr int64_t kRowGrain = 16;  // rows below which a call stays on one thread

inline __mmask16 lanes_below(int64_t count) {
  return count >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
}

inline __m512 load(const float* p, __mmask16 lanes) {
  return lanes == 0xFFFF ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(lanes, p);
}

inline __m512 load(const BFloat16* p, __mmask16 lanes) {
  return bf16_to_ps(lanes == 0xFFFF ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                    : _mm256_maskz_loadu_epi16(lanes, p));
}

template <typename T>
int64_t first_nan(const T* row, int64_t width) {
  for (int64_t i = 0; i < width; ++i) {
    if (std::isnan(static_cast<float>(row[i]))) {
      return i;
    }
  }
  return -1;
}

// Two passes over the row: its maximum (lanes past the row's end held at -inf), then the first lane
// equal to it. A NaN anywhere sends the row to a scalar search for the first one.
template <typename T>
int64_t row_argmax(const T* row, int64_t width) {
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 best = lowest;
  __mmask16 unordered = 0;
  for (int64_t i = 0; i < width; i += kLanes) {
    const __mmask16 lanes = lanes_below(width - i);
    const __m512 x = _mm512_mask_mov_ps(lowest, lanes, load(row + i, lanes));
    unordered |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, x);
  }
  if (unordered != 0) {
    return first_nan(row, width);
  }
  const __m512 target = _mm512_set1_ps(_mm512_reduce_max_ps(best));
  for (int64_t i = 0; i < width; i += kLanes) {
    const __mmask16 lanes = lanes_below(width - i);
    const __mmask16 equal = _mm512_mask_cmp_ps_mask(lanes, load(row + i, lanes), target, _CMP_EQ_OQ);
    if (equal != 0) {
      return i + __builtin_ctz(equal);
    }
  }
  return 0;  // unreachable: the maximum is one of the row's values
}

// logits [..., V] (contiguous float32 or bfloat16): the int64 index of each row's maximum, [...].
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.is_contiguous() && logits.dim() >= 1 && logits.size(-1) > 0,
              "argmax_rows takes contiguous rows of at least one value");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "argmax_rows takes float32 or bfloat16 rows, got ", logits.scalar_type());
  const int64_t width = logits.size(-1), rows = logits.numel() / width;
  at::Tensor out = at::empty(logits.sizes().slice(0, logits.dim() - 1), logits.options().dtype(at::kLong));
  auto* indices = out.data_ptr<int64_t>();
  const bool bf16 = logits.scalar_type() == at::kBFloat16;
  const void* data = logits.data_ptr();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      indices[r] = bf16 ? row_argmax(static_cast<const BFloat16*>(data) + r * width, width)
                        : row_argmax(static_cast<const float*>(data) + r * width, width);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(diffdraft_argmax, m) { m.def("argmax_rows(Tensor logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(diffdraft_argmax, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
