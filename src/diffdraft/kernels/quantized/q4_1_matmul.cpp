// y = x W^T + b over a Q4_1 block-quantized weight W with bfloat16 activations, on AVX-512 BF16.
//
// A weight row of K inputs is K/32 blocks: w = scale * code + offset, codes 0..15 packed two to a
// byte (byte j of a block holds element j in its low nibble and element j + 16 in its high one, as in
// GGUF). Each block is dequantized in registers to the bfloat16 values a dense bf16 copy of the
// weight holds (scale * code + offset in float32, rounded to nearest even): the block's 16 possible
// values are computed once and a word permute picks every element's. The bf16 dot-product
// instruction then accumulates in float32. Weights stream at 5 bits per value instead of 16, and
// one dequantized block serves up to 16 input rows.
//
// Every output element is one chain of dot products over its blocks in order, whatever the number
// of input rows or threads: a row's result never depends on what it is batched with.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "avx512_subset.h"
#include <torch/library.h>

namespace {

constexpr int64_t kBlock = 32;
constexpr int kRowTile = 16;  // input rows sharing one dequantized block (16 accumulators live)

inline __m512bh q4_1_block(const uint8_t* codes, float scale, float offset) {
  const __m512 code_values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m256bh values =
      _mm512_cvtneps_pbh(_mm512_fmadd_ps(code_values, _mm512_set1_ps(scale), _mm512_set1_ps(offset)));
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  const __m256i low = _mm256_and_si256(bytes, _mm256_set1_epi16(15));
  const __m256i high = _mm256_srli_epi16(bytes, 4);
  const __m512i index = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
  const __m512i table = _mm512_castsi256_si512(reinterpret_cast<__m256i>(values));
  return as_bf16_pairs(_mm512_permutexvar_epi16(index, table));
}

struct Weight {
  const uint8_t* codes;  // [out, in / 2]
  const float* scales;   // [out, in / 32]
  const float* offsets;  // [out, in / 32]
  const float* bias;     // [out] or null
  int64_t in_features, out_features;
};

// Outputs [begin, end) for kRows input rows, kColumns weight rows at a time. Few input rows leave
// the dot-product chain's latency exposed, so they take several weight rows at once instead.
template <int kRows, int kColumns>
void output_columns(const Weight& w, const at::BFloat16* x, at::BFloat16* out, int64_t begin, int64_t end) {
  const int64_t blocks = w.in_features / kBlock;
  int64_t n = begin;
  for (; n + kColumns <= end; n += kColumns) {
    __m512 acc[kColumns][kRows];
    for (int c = 0; c < kColumns; ++c)
      for (int r = 0; r < kRows; ++r) acc[c][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      for (int c = 0; c < kColumns; ++c) {
        const int64_t block = (n + c) * blocks + b;
        const __m512bh weights =
            q4_1_block(w.codes + block * (kBlock / 2), w.scales[block], w.offsets[block]);
        for (int r = 0; r < kRows; ++r) {
          const auto* inputs = x + r * w.in_features + b * kBlock;
          acc[c][r] = _mm512_dpbf16_ps(acc[c][r], weights, as_bf16_pairs(_mm512_loadu_si512(inputs)));
        }
      }
    }
    for (int c = 0; c < kColumns; ++c) {
      for (int r = 0; r < kRows; ++r) {
        float y = _mm512_reduce_add_ps(acc[c][r]);
        if (w.bias != nullptr) y += w.bias[n + c];
        out[r * w.out_features + n + c] = at::BFloat16(y);
      }
    }
  }
  if (n < end) output_columns<kRows, 1>(w, x, out, n, end);
}

template <int kRows = 1>
void row_tile(int rows, const Weight& w, const at::BFloat16* x, at::BFloat16* out, int64_t begin, int64_t end) {
  if constexpr (kRows < kRowTile) {
    if (rows != kRows) return row_tile<kRows + 1>(rows, w, x, out, begin, end);
  }
  output_columns<kRows, kRows == 1 ? 4 : kRows < 4 ? 2 : 1>(w, x, out, begin, end);
}

at::Tensor q4_1_matmul(const at::Tensor& input, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& offsets, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.scalar_type() == at::kBFloat16, "q4_1_matmul takes bfloat16 inputs, got ", input.scalar_type());
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous(), "codes must be contiguous uint8");
  for (const at::Tensor* t : {&scales, &offsets}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->sizes() == scales.sizes(),
                "scales and offsets must be contiguous float32 of one shape");
  }
  const int64_t in_features = input.size(-1), out_features = scales.size(0);
  TORCH_CHECK(in_features % kBlock == 0 && scales.size(1) == in_features / kBlock, "input width ", in_features,
              " does not match the weight's ", scales.size(1), " blocks of ", kBlock);
  TORCH_CHECK(codes.size(0) == out_features && codes.size(1) == in_features / 2, "codes do not match the scales");
  const at::Tensor x = input.reshape({-1, in_features}).contiguous();
  const int64_t rows = x.size(0);
  at::Tensor bias_float;
  if (bias.has_value()) bias_float = bias->to(at::kFloat).contiguous();
  const Weight w{codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), offsets.data_ptr<float>(),
                 bias.has_value() ? bias_float.data_ptr<float>() : nullptr, in_features, out_features};
  at::Tensor out = at::empty({rows, out_features}, input.options());
  const auto* x_data = x.data_ptr<at::BFloat16>();
  auto* out_data = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = 0; r < rows; r += kRowTile) {
      const int tile = static_cast<int>(std::min<int64_t>(kRowTile, rows - r));
      row_tile(tile, w, x_data + r * in_features, out_data + r * out_features, begin, end);
    }
  });
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = out_features;
  return out.view(shape);
}

}  // namespace

TORCH_LIBRARY(diffdraft_blocks, m) {
  m.def("q4_1_matmul(Tensor input, Tensor codes, Tensor scales, Tensor offsets, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(diffdraft_blocks, CPU, m) { m.impl("q4_1_matmul", &q4_1_matmul); }
