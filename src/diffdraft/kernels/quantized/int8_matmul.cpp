// y = x W^T + b over a block-quantized weight W with the inputs quantized to int8, on AVX-512 VNNI.
//
// Each input row is quantized per block of 32 values to int8 codes q_x with a float32 scale d_x =
// max|x| / 127 (codes round to nearest even), as llama.cpp's Q8_1 does. A block's dot product is then
// an integer sum (exact) times float scales:
//   Q4_1 (w = d_w * c + m_w, codes c in 0..15): d_w * d_x * sum(c q_x) + m_w * s_x, s_x = d_x * sum(q_x)
//   Q8_0 (w = d_w * c, codes c in -128..127):   d_w * d_x * sum(c q_x)
// VPDPBUSD multiplies unsigned by signed bytes, so Q8_0 codes are stored plus 128 and each block's sum
// starts at -128 * sum(q_x) instead of zero (dpbusd_offset128_start / _epi32).
//
// Weights are repacked once (``tiled`` in block_linear.py) into tiles of 16 output columns: per tile
// and block, the codes of inputs 4j..4j+3 of all 16 columns form 64 contiguous bytes, so one VPDPBUSD
// against those four inputs broadcast adds into each int32 lane one column's sum and a block's sum
// never needs a horizontal add; the columns' float16 scales (and Q4_1 offsets) follow. Both kinds of
// sum then cost three float32 operations per 16 columns and block, against 8 VPDPBUSD.
// A Q4_1 byte holds input k in its low nibble and input k + 16 in its high one, as in GGUF.
// On AVX2 CPUs avx512_subset.h emulates each instruction, the dot products of either format by its
// own cheaper form (nibble_dot for Q4_1's codes, dpbusd_offset128_epi32 for Q8_0).
//
// Every output is one fixed chain of float32 operations over its blocks in order, and a row's codes
// depend on that row alone: a row's result never depends on the rows or threads it shares a call with.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "avx512_subset.h"
#include <torch/library.h>

#include <cstring>

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kTile = 16;     // output columns per weight tile, one int32 / float32 lane each
// Most input rows sharing one unpacked weight tile: each row's sums take two registers, of 32 with
// AVX-512 and of 16 with AVX2 (where a 512-bit register is two).
#ifdef __AVX512F__
constexpr int kRowTile = 12;
#else
constexpr int kRowTile = 4;
#endif
constexpr int64_t kChunk = 4;     // column tiles every row tile visits in turn while they sit in cache
constexpr int64_t kScaleBytes = kTile * 2;  // a tile's float16 scales (or offsets) for one block

struct Q4_1 {
  static constexpr int64_t kCodeBytes = kTile * kBlock / 2;
  static constexpr int64_t kBytes = kCodeBytes + 2 * kScaleBytes;
  static constexpr bool kOffsets = true;
  // A block's sum starts at zero and takes eight dot products of nibble codes.
  using Sum = nibble_sum;
  static Sum start(int32_t) { return nibble_zero(); }
  static Sum dot(Sum sum, __m512i codes, __m512i inputs) { return nibble_dot(sum, codes, inputs); }
  static __m512i total(Sum sum) { return nibble_total(sum); }
  // Codes of inputs 4j..4j+3 (low) and 16+4j..16+4j+3 (high) of the tile's 16 columns.
  static void codes(const uint8_t* tile, int j, __m512i& low, __m512i& high) {
    const __m512i packed = _mm512_loadu_si512(tile + 64 * j);
    const __m512i nibble = _mm512_set1_epi8(15);
    low = _mm512_and_si512(packed, nibble);
    high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
  }
};

struct Q8_0 {
  static constexpr int64_t kCodeBytes = kTile * kBlock;
  static constexpr int64_t kBytes = kCodeBytes + kScaleBytes;
  static constexpr bool kOffsets = false;
  // Codes stored plus 128 (and inputs in -127..127): the sum takes off 128 times the inputs' sum.
  using Sum = __m512i;
  static Sum start(int32_t input_sum) { return _mm512_set1_epi32(dpbusd_offset128_start(input_sum)); }
  static Sum dot(Sum sum, __m512i codes, __m512i inputs) { return dpbusd_offset128_epi32(sum, codes, inputs); }
  static __m512i total(Sum sum) { return sum; }
  static void codes(const uint8_t* tile, int j, __m512i& low, __m512i& high) {
    low = _mm512_loadu_si512(tile + 64 * j);
    high = _mm512_loadu_si512(tile + 64 * (j + 4));
  }
};

// The input rows quantized per block: codes [rows, in], and per block d_x, s_x and sum(q_x).
struct Activations {
  std::vector<int8_t> codes;
  std::vector<float> scales, sums;
  std::vector<int32_t> code_sums;
};

inline __m512 bf16_to_float(const at::BFloat16* x) {
  return bf16_to_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}

Activations quantize(const at::BFloat16* x, int64_t values) {
  const int64_t blocks = values / kBlock;
  Activations a{std::vector<int8_t>(values), std::vector<float>(blocks), std::vector<float>(blocks),
                std::vector<int32_t>(blocks)};
  for (int64_t i = 0; i < blocks; ++i) {
    const __m512 low = bf16_to_float(x + i * kBlock), high = bf16_to_float(x + i * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high)));
    const __m512 inverse = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
    const __m512i q_low = _mm512_cvtps_epi32(_mm512_mul_ps(low, inverse));
    const __m512i q_high = _mm512_cvtps_epi32(_mm512_mul_ps(high, inverse));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(&a.codes[i * kBlock]), _mm512_cvtepi32_epi8(q_low));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(&a.codes[i * kBlock + 16]), _mm512_cvtepi32_epi8(q_high));
    a.code_sums[i] = _mm512_reduce_add_epi32(_mm512_add_epi32(q_low, q_high));
    a.scales[i] = amax / 127.0f;
    a.sums[i] = a.scales[i] * static_cast<float>(a.code_sums[i]);
  }
  return a;
}

struct Job {
  const uint8_t* weight;  // [tiles, blocks, Format::kBytes]
  const float* bias;      // [tiles * 16] or null
  const Activations* x;
  at::BFloat16* out;      // [rows, out_features]
  int64_t blocks, out_features;
};

inline __m512i four_codes(const int8_t* codes) {
  int32_t word;
  std::memcpy(&word, codes, sizeof(word));
  return _mm512_set1_epi32(word);
}

// A decoding forward streams every weight from memory once, in layout order, a few hundred KB a call:
// the hardware prefetchers alone left the 1-row matmuls of SmolLM2's Q4_1 layers at ~14 GB/s on a Zen 3.
// Asking for the block kPrefetchBytes ahead took a forward's layer matmuls 6-11% faster at 1-9 rows
// and the whole forward 4-6% (benchmarks/README.md, 'Measurements behind the code'); a prefetch past
// a weight's end never faults.
constexpr int64_t kPrefetchBytes = 2048;
template <class F>
inline void prefetch_ahead(const uint8_t* block) {
  for (int64_t line = 0; line < F::kBytes; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(block) + kPrefetchBytes + line, _MM_HINT_T0);
  }
}

// kRows input rows from row0 against column tile t. One tile at a time, whatever the rows: taking two
// or four tiles at once to hide the dot-product chains' latency for 1-4 rows made a whole decoding
// forward of the default target 7-20% slower (benchmarks/README.md, 'Measurements behind the code').
template <class F, int kRows>
void tile_rows(const Job& job, int64_t row0, int64_t t) {
  const Activations& x = *job.x;
  __m512 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < job.blocks; ++b) {
    const uint8_t* tile = job.weight + (t * job.blocks + b) * F::kBytes;
    prefetch_ahead<F>(tile);
    typename F::Sum sums[kRows];
    for (int r = 0; r < kRows; ++r) sums[r] = F::start(x.code_sums[(row0 + r) * job.blocks + b]);
    for (int j = 0; j < 4; ++j) {
      __m512i low, high;
      F::codes(tile, j, low, high);
      for (int r = 0; r < kRows; ++r) {
        const int8_t* q = x.codes.data() + ((row0 + r) * job.blocks + b) * kBlock;
        sums[r] = F::dot(sums[r], low, four_codes(q + 4 * j));
        sums[r] = F::dot(sums[r], high, four_codes(q + 16 + 4 * j));
      }
    }
    const auto* halves = reinterpret_cast<const __m256i*>(tile + F::kCodeBytes);
    const __m512 scales = _mm512_cvtph_ps(_mm256_loadu_si256(halves));
    for (int r = 0; r < kRows; ++r) {
      const __m512 scale = _mm512_mul_ps(scales, _mm512_set1_ps(x.scales[(row0 + r) * job.blocks + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(F::total(sums[r])), scale, acc[r]);
    }
    if constexpr (F::kOffsets) {
      const __m512 offsets = _mm512_cvtph_ps(_mm256_loadu_si256(halves + 1));
      for (int r = 0; r < kRows; ++r) {
        acc[r] = _mm512_fmadd_ps(offsets, _mm512_set1_ps(x.sums[(row0 + r) * job.blocks + b]), acc[r]);
      }
    }
  }
  const int64_t column = t * kTile;
  const __mmask16 valid = _cvtu32_mask16((1u << std::min<int64_t>(kTile, job.out_features - column)) - 1);
  for (int r = 0; r < kRows; ++r) {
    __m512 y = acc[r];
    if (job.bias != nullptr) y = _mm512_add_ps(y, _mm512_loadu_ps(job.bias + column));
    _mm256_mask_storeu_epi16(job.out + (row0 + r) * job.out_features + column, valid,
                             reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(y)));
  }
}

// ``rows`` input rows from row0 against column tiles [begin, end), the row count made a constant.
template <class F, int kRows = 1>
void row_tile(int rows, const Job& job, int64_t row0, int64_t begin, int64_t end) {
  if constexpr (kRows < kRowTile) {
    if (rows != kRows) return row_tile<F, kRows + 1>(rows, job, row0, begin, end);
  }
  for (int64_t t = begin; t < end; ++t) tile_rows<F, kRows>(job, row0, t);
}

template <class F>
at::Tensor int8_matmul(const at::Tensor& input, const at::Tensor& packed, int64_t out_features,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.scalar_type() == at::kBFloat16, "int8 block matmuls take bfloat16 inputs, got ",
              input.scalar_type());
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(2) == F::kBytes,
              "packed weights must be contiguous uint8 [tiles, blocks, ", F::kBytes, "]");
  const int64_t in_features = input.size(-1), tiles = packed.size(0), blocks = packed.size(1);
  TORCH_CHECK(in_features == blocks * kBlock, "input width ", in_features, " does not match the weight's ",
              blocks, " blocks of ", kBlock);
  TORCH_CHECK(tiles == (out_features + kTile - 1) / kTile, "packed weights hold ", tiles,
              " tiles, not those of ", out_features, " outputs");
  const at::Tensor x = input.reshape({-1, in_features}).contiguous();
  const int64_t rows = x.size(0);
  at::Tensor bias_float;
  if (bias.has_value()) {
    bias_float = at::zeros({tiles * kTile}, input.options().dtype(at::kFloat));
    bias_float.narrow(0, 0, out_features).copy_(*bias);
  }
  const Activations activations = quantize(x.data_ptr<at::BFloat16>(), rows * in_features);
  at::Tensor out = at::empty({rows, out_features}, input.options());
  const Job job{packed.data_ptr<uint8_t>(), bias.has_value() ? bias_float.data_ptr<float>() : nullptr,
                &activations, out.data_ptr<at::BFloat16>(), blocks, out_features};
  // Rows split into even row tiles of at most kRowTile (9 rows: one tile; 16: two of 8).
  const int64_t row_tiles = (rows + kRowTile - 1) / kRowTile, row_step = (rows + row_tiles - 1) / row_tiles;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = begin; chunk < end; chunk += kChunk) {
      const int64_t chunk_end = std::min(end, chunk + kChunk);
      for (int64_t r = 0; r < rows; r += row_step) {
        row_tile<F>(static_cast<int>(std::min(row_step, rows - r)), job, r, chunk, chunk_end);
      }
    }
  });
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = out_features;
  return out.view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(diffdraft_blocks, m) {
  m.def("q4_1_int8_matmul(Tensor input, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("q8_0_int8_matmul(Tensor input, Tensor packed, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(diffdraft_blocks, CPU, m) {
  m.impl("q4_1_int8_matmul", &int8_matmul<Q4_1>);
  m.impl("q8_0_int8_matmul", &int8_matmul<Q8_0>);
}
