// The k largest values of each row and their indices, for float32 rows on AVX-512: a draft tree's
// candidates, the likeliest tokens of every drafted position.
//
// torch's topk works through every element of a row one at a time, most of a DDTree round's tree
// building on a CPU (docs/decisions.md, "draft candidates on the row-top-k kernel"). A row's k-th largest value so far is a threshold
// that almost every value stays below, so this compares whole registers against it and inserts only
// the few values above it into a sorted list of k. Values come largest first, equal values in index
// order (torch's order among ties is unspecified); NaN sorts above every number, as in torch.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "avx512_subset.h"
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kRowGrain = 16;  // rows below which a call stays on one thread

// Whether a ranks above b: NaN above every number, then larger values (equal ones keep index order,
// as the later of two equal values never ranks above the earlier).
inline bool above(float a, float b) { return (std::isnan(a) && !std::isnan(b)) || a > b; }

// Insert value x at index i into the sorted list (length `count` < k, or == k: the last drops out).
inline void insert(float x, int64_t i, float* values, int64_t* indices, int64_t& count, int64_t k) {
  int64_t at = count < k ? count : k - 1;
  while (at > 0 && above(x, values[at - 1])) {
    values[at] = values[at - 1];
    indices[at] = indices[at - 1];
    --at;
  }
  values[at] = x;
  indices[at] = i;
  count = count < k ? count + 1 : k;
}

void row_topk(const float* row, int64_t width, int64_t k, float* values, int64_t* indices) {
  int64_t count = 0;
  int64_t i = 0;
  for (; i < width && count < k; ++i) insert(row[i], i, values, indices, count, k);
  // a lane passes while it might rank above the k-th: above it, or unordered (NaN) against it
  for (; i + kLanes <= width; i += kLanes) {
    const __m512 x = _mm512_loadu_ps(row + i);
    const __m512 threshold = _mm512_set1_ps(values[k - 1]);
    __mmask16 passing = _mm512_cmp_ps_mask(x, threshold, _CMP_NLE_UQ);
    while (passing != 0) {
      const int lane = __builtin_ctz(passing);
      passing &= passing - 1;
      if (above(row[i + lane], values[k - 1])) insert(row[i + lane], i + lane, values, indices, count, k);
    }
  }
  for (; i < width; ++i) {
    if (above(row[i], values[k - 1])) insert(row[i], i, values, indices, count, k);
  }
}

// scores [..., V] (contiguous float32), 1 <= k <= V: (values, int64 indices) [..., k], largest first.
std::tuple<at::Tensor, at::Tensor> topk_rows(const at::Tensor& scores, int64_t k) {
  TORCH_CHECK(scores.is_contiguous() && scores.dim() >= 1 && scores.scalar_type() == at::kFloat,
              "topk_rows takes contiguous float32 rows");
  const int64_t width = scores.size(-1), rows = width == 0 ? 0 : scores.numel() / width;
  TORCH_CHECK(k >= 1 && k <= width, "topk_rows: k must be in [1, ", width, "], got ", k);
  std::vector<int64_t> shape(scores.sizes().begin(), scores.sizes().end());
  shape.back() = k;
  at::Tensor values = at::empty(shape, scores.options());
  at::Tensor indices = at::empty(shape, scores.options().dtype(at::kLong));
  const float* data = scores.data_ptr<float>();
  float* value_data = values.data_ptr<float>();
  int64_t* index_data = indices.data_ptr<int64_t>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      row_topk(data + r * width, width, k, value_data + r * k, index_data + r * k);
    }
  });
  return {values, indices};
}

}  // namespace

TORCH_LIBRARY(diffdraft_topk, m) { m.def("topk_rows(Tensor scores, int k) -> (Tensor, Tensor)"); }

TORCH_LIBRARY_IMPL(diffdraft_topk, CPU, m) { m.impl("topk_rows", &topk_rows); }
