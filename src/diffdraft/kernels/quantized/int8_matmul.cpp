// y = x W^T + b over a weight W in one of GGUF's block formats, with the inputs quantized to int8, on
// AVX-512 VNNI.
//
// Each input row is quantized per block of 32 values to int8 codes q with a float32 scale d_x = max|x| /
// 127 (codes round to nearest even), as llama.cpp's Q8_1 does; the block's sum of codes (and that of its
// first 16) is kept. Every format the kernel runs is a weight block of 32 inputs written as unsigned
// integer codes c and per-column float32 values that are exact products of the file's numbers:
//   w = D * (c - z) + M               (one scale for the block), or
//   w = D_half * (c - z)              (Q6_K: a scale per half of 16 inputs),
// so a block's dot product is an exact integer sum S = sum(c q) (VPDPBUSD), z * sum(q) taken off, then
// two float32 operations: d_x * D * (S - z sum(q)) + M * s_x, with s_x = d_x * sum(q).
//   format  codes      z    D                          M
//   Q4_1    4 bits     0    d (float16)                m (float16)
//   Q4_0    4 bits     8    d                          -
//   Q5_0    5 bits    16    d                          -
//   Q8_0    8 bits   128    d                          -        (codes stored plus 128)
//   Q4_K    4 bits     0    d * sc (sc: 6 bits)        -dmin * m (m: 6 bits); d, dmin per 256 inputs
//   Q5_K    5 bits     0    as Q4_K
//   Q6_K    6 bits    32    d * sc_half (sc: int8)     -
// llama.cpp rounds the inputs of its K formats per 256 values (Q8_K); here every format shares the
// 32-value rounding, so one quantized input serves any weight, and rounds no coarser than llama.cpp.
//
// Weights are repacked once (``tiles`` in gguf_blocks.py and block_linear.py) into tiles of 16 output
// columns. Per tile, blocks run in order; the K formats group them by eight (256 inputs) behind a
// header of the group's per-column float16 d (and -dmin). A block holds its code planes, then its
// per-column values (float16 D and M, or the bytes sc and m, or Q6_K's two int8 scales):
// - nibbles, 4 x 64 bytes: for j = 0..3 each column's four bytes in turn (an int32 lane each), byte i
//   holding the low four bits of input 4j + i (low nibble) and of input 16 + 4j + i (high nibble). One
//   VPDPBUSD against inputs 4j..4j+3 broadcast adds each column's products into its own lane, so a
//   block's sum never needs a horizontal add;
// - a fifth bit (Q5_0, Q5_K), 64 bytes in the same (column, i) order: bit j of byte i is that of input
//   4j + i, bit 4 + j that of input 16 + 4j + i;
// - bits 4 and 5 (Q6_K), 2 x 64 bytes, for inputs 0..15 then 16..31: bits 2j, 2j + 1 of byte i are
//   those of input 4j + i (or 16 + 4j + i);
// - Q8_0: eight 64-byte groups of whole bytes, inputs 4j.. then 16 + 4j.. .
// So each format streams about the bits its file holds, and the codes unpack in registers.
// On AVX2 CPUs avx512_subset.h emulates each instruction, 4-bit codes by nibble_dot (cheaper), Q8_0's
// by dpbusd_offset128_epi32.
//
// Every output is one fixed chain of float32 operations over its blocks in order, and a row's codes
// depend on that row alone: a row's result never depends on the rows or threads it shares a call with.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "avx512_subset.h"
#include <torch/library.h>

#include <cstring>
#include <tuple>
#include <utility>
#include <type_traits>

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kTile = 16;     // output columns per weight tile, one int32 / float32 lane each
// Most input rows sharing one unpacked weight tile: each row's sums take two registers, of 32 with
// AVX-512 and of 16 with AVX2 (where a 512-bit register is two); a format with a sum per half-block
// (Q6_K) takes two thirds as many.
#ifdef __AVX512F__
constexpr int kRowTile = 12;
#else
constexpr int kRowTile = 4;
#endif
constexpr int64_t kChunk = 4;     // column tiles every row tile visits in turn while they sit in cache
constexpr int64_t kHalves = kTile * 2;       // a tile's float16 values (scales or offsets) for one block
constexpr int64_t kNibbles = kTile * kBlock / 2;
constexpr int64_t kPlane = kTile * kBlock / 8;  // one bit of each of a block's codes

// A block's per-column values: D (and Q6_K's D for the high half) and M.
struct Values {
  __m512 scale, high_scale, offset;
};

inline __m512 halves_ps(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 bytes_ps(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 signed_bytes_ps(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Bytes shifted left (or right, for a negative count) within 16-bit words: what a mask then keeps of a
// byte comes from the same byte as long as the shift stays inside it.
inline __m512i shift_bytes(__m512i v, int left) {
  return left >= 0 ? _mm512_slli_epi16(v, left) : _mm512_srli_epi16(v, -left);
}

// The low four bits of inputs 4j..4j+3 (low) and 16+4j..16+4j+3 (high) of the tile's 16 columns.
inline void nibbles(const uint8_t* block, int j, __m512i& low, __m512i& high) {
  const __m512i packed = _mm512_loadu_si512(block + 64 * j);
  const __m512i nibble = _mm512_set1_epi8(15);
  low = _mm512_and_si512(packed, nibble);
  high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
}

// Codes of kBits (4, 5 or 6) from the nibbles and the planes after them.
template <int kBits>
inline void codes_of(const uint8_t* block, int j, __m512i& low, __m512i& high) {
  nibbles(block, j, low, high);
  if constexpr (kBits == 5) {
    const __m512i bits = _mm512_loadu_si512(block + kNibbles), fifth = _mm512_set1_epi8(16);
    low = _mm512_or_si512(low, _mm512_and_si512(shift_bytes(bits, 4 - j), fifth));
    high = _mm512_or_si512(high, _mm512_and_si512(shift_bytes(bits, -j), fifth));
  } else if constexpr (kBits == 6) {
    const __m512i top = _mm512_set1_epi8(0x30);
    const __m512i bits_low = _mm512_loadu_si512(block + kNibbles);
    const __m512i bits_high = _mm512_loadu_si512(block + kNibbles + 64);
    low = _mm512_or_si512(low, _mm512_and_si512(shift_bytes(bits_low, 4 - 2 * j), top));
    high = _mm512_or_si512(high, _mm512_and_si512(shift_bytes(bits_high, 4 - 2 * j), top));
  }
}

// Sums over 4-bit codes (nibble_* chains, cheaper on AVX2) or wider ones (VPDPBUSD), z * sum(q) off.
template <int kZero>
struct NibbleSum {
  using Sum = nibble_sum;
  static Sum start(int32_t) { return nibble_zero(); }
  static Sum dot(Sum sum, __m512i low, __m512i high, __m512i in_low, __m512i in_high) {
    return nibble_dot(nibble_dot(sum, low, in_low), high, in_high);
  }
  static __m512i total(Sum sum, int32_t input_sum) {
    return kZero ? _mm512_add_epi32(nibble_total(sum), _mm512_set1_epi32(-kZero * input_sum)) : nibble_total(sum);
  }
};
template <int kZero>
struct WideSum {
  using Sum = __m512i;
  static Sum start(int32_t input_sum) { return _mm512_set1_epi32(-kZero * input_sum); }
  static Sum dot(Sum sum, __m512i low, __m512i high, __m512i in_low, __m512i in_high) {
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sum, low, in_low), high, in_high);
  }
  static __m512i total(Sum sum, int32_t) { return sum; }
};

// The formats: their bytes (kBlockBytes a block, kHeaderBytes ahead of each kGroup blocks), codes and
// per-column values.
struct Q4_1 : NibbleSum<0> {
  static constexpr int64_t kBlockBytes = kNibbles + 2 * kHalves, kHeaderBytes = 0, kGroup = 1;
  static constexpr bool kOffsets = true, kHalfScales = false;
  static void codes(const uint8_t* block, int j, __m512i& low, __m512i& high) { nibbles(block, j, low, high); }
  static Values values(const uint8_t*, const uint8_t* block) {
    return {halves_ps(block + kNibbles), _mm512_setzero_ps(), halves_ps(block + kNibbles + kHalves)};
  }
};

struct Q4_0 : NibbleSum<8> {
  static constexpr int64_t kBlockBytes = kNibbles + kHalves, kHeaderBytes = 0, kGroup = 1;
  static constexpr bool kOffsets = false, kHalfScales = false;
  static void codes(const uint8_t* block, int j, __m512i& low, __m512i& high) { nibbles(block, j, low, high); }
  static Values values(const uint8_t*, const uint8_t* block) { return {halves_ps(block + kNibbles), _mm512_setzero_ps(), _mm512_setzero_ps()}; }
};

struct Q5_0 : WideSum<16> {
  static constexpr int64_t kBlockBytes = kNibbles + kPlane + kHalves, kHeaderBytes = 0, kGroup = 1;
  static constexpr bool kOffsets = false, kHalfScales = false;
  static void codes(const uint8_t* block, int j, __m512i& low, __m512i& high) { codes_of<5>(block, j, low, high); }
  static Values values(const uint8_t*, const uint8_t* block) { return {halves_ps(block + kNibbles + kPlane), _mm512_setzero_ps(), _mm512_setzero_ps()}; }
};

// Codes stored plus 128 (and inputs in -127..127): the sum takes off 128 times the inputs' sum.
struct Q8_0 {
  static constexpr int64_t kBlockBytes = kTile * kBlock + kHalves, kHeaderBytes = 0, kGroup = 1;
  static constexpr bool kOffsets = false, kHalfScales = false;
  using Sum = __m512i;
  static Sum start(int32_t input_sum) { return _mm512_set1_epi32(dpbusd_offset128_start(input_sum)); }
  static Sum dot(Sum sum, __m512i low, __m512i high, __m512i in_low, __m512i in_high) {
    return dpbusd_offset128_epi32(dpbusd_offset128_epi32(sum, low, in_low), high, in_high);
  }
  static __m512i total(Sum sum, int32_t) { return sum; }
  static void codes(const uint8_t* block, int j, __m512i& low, __m512i& high) {
    low = _mm512_loadu_si512(block + 64 * j);
    high = _mm512_loadu_si512(block + 64 * (j + 4));
  }
  static Values values(const uint8_t*, const uint8_t* block) { return {halves_ps(block + kTile * kBlock), _mm512_setzero_ps(), _mm512_setzero_ps()}; }
};

// The K formats' header: per column float16 d, then -dmin; a block ends in the bytes sc, then m.
template <int kBits>
struct KWithMins : std::conditional_t<kBits == 4, NibbleSum<0>, WideSum<0>> {
  static constexpr int64_t kCodeBytes = kNibbles + (kBits == 5 ? kPlane : 0);
  static constexpr int64_t kBlockBytes = kCodeBytes + 2 * kTile, kHeaderBytes = 2 * kHalves, kGroup = 8;
  static constexpr bool kOffsets = true, kHalfScales = false;
  static void codes(const uint8_t* block, int j, __m512i& low, __m512i& high) { codes_of<kBits>(block, j, low, high); }
  static Values values(const uint8_t* header, const uint8_t* block) {
    return {_mm512_mul_ps(bytes_ps(block + kCodeBytes), halves_ps(header)), _mm512_setzero_ps(),
            _mm512_mul_ps(bytes_ps(block + kCodeBytes + kTile), halves_ps(header + kHalves))};
  }
};
using Q4_K = KWithMins<4>;
using Q5_K = KWithMins<5>;

// Q6_K: a sum per half-block (its 16-input scales differ); the header is per column float16 d, a block
// ends in the int8 scales of its two halves.
struct Q6_K {
  static constexpr int64_t kCodeBytes = kNibbles + 2 * kPlane;
  static constexpr int64_t kBlockBytes = kCodeBytes + 2 * kTile, kHeaderBytes = kHalves, kGroup = 8;
  static constexpr bool kOffsets = false, kHalfScales = true;
  static constexpr int32_t kZero = 32;
  struct Sum {
    __m512i low, high;
  };
  static Sum start(int32_t) { return {_mm512_set1_epi32(0), _mm512_set1_epi32(0)}; }
  static Sum dot(Sum sum, __m512i low, __m512i high, __m512i in_low, __m512i in_high) {
    return {_mm512_dpbusd_epi32(sum.low, low, in_low), _mm512_dpbusd_epi32(sum.high, high, in_high)};
  }
  static void codes(const uint8_t* block, int j, __m512i& low, __m512i& high) { codes_of<6>(block, j, low, high); }
  static Values values(const uint8_t* header, const uint8_t* block) {
    const __m512 d = halves_ps(header);
    return {_mm512_mul_ps(signed_bytes_ps(block + kCodeBytes), d),
            _mm512_mul_ps(signed_bytes_ps(block + kCodeBytes + kTile), d), _mm512_setzero_ps()};
  }
};

template <class F>
constexpr int64_t group_bytes() {
  return F::kHeaderBytes + F::kGroup * F::kBlockBytes;
}
template <class F>
constexpr int row_tile() {
  return F::kHalfScales ? kRowTile * 2 / 3 : kRowTile;
}

// The input rows quantized per block: codes [rows, in], and per block d_x, s_x, sum(q_x) and the sum
// over its first 16 inputs.
struct Activations {
  std::vector<int8_t> codes;
  std::vector<float> scales, sums;
  std::vector<int32_t> code_sums, low_sums;
};

inline __m512 bf16_to_float(const at::BFloat16* x) {
  return bf16_to_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}

Activations quantize(const at::BFloat16* x, int64_t values) {
  const int64_t blocks = values / kBlock;
  Activations a{std::vector<int8_t>(values), std::vector<float>(blocks), std::vector<float>(blocks),
                std::vector<int32_t>(blocks), std::vector<int32_t>(blocks)};
  for (int64_t i = 0; i < blocks; ++i) {
    const __m512 low = bf16_to_float(x + i * kBlock), high = bf16_to_float(x + i * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high)));
    const __m512 inverse = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
    const __m512i q_low = _mm512_cvtps_epi32(_mm512_mul_ps(low, inverse));
    const __m512i q_high = _mm512_cvtps_epi32(_mm512_mul_ps(high, inverse));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(&a.codes[i * kBlock]), _mm512_cvtepi32_epi8(q_low));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(&a.codes[i * kBlock + 16]), _mm512_cvtepi32_epi8(q_high));
    a.low_sums[i] = _mm512_reduce_add_epi32(q_low);
    a.code_sums[i] = a.low_sums[i] + _mm512_reduce_add_epi32(q_high);
    a.scales[i] = amax / 127.0f;
    a.sums[i] = a.scales[i] * static_cast<float>(a.code_sums[i]);
  }
  return a;
}

struct Job {
  const uint8_t* weight;  // [tiles, groups, group_bytes<F>()]
  const float* bias;      // [tiles * 16] or null
  const Activations* x;
  at::BFloat16* out;      // [rows, stride], this weight's outputs from column 0
  int64_t blocks, out_features, stride;
};

inline __m512i four_codes(const int8_t* codes) {
  int32_t word;
  std::memcpy(&word, codes, sizeof(word));
  return _mm512_set1_epi32(word);
}

// A decoding forward streams every weight from memory once, in layout order, a few hundred KB a call:
// the hardware prefetchers alone left the 1-row matmuls well below the memory's bandwidth. Asking for the
// bytes kPrefetchBytes ahead of each block makes the layer matmuls and the whole forward faster
// (docs/decisions.md, "prefetch ahead of each weight block"); a prefetch past a weight's end never faults.
constexpr int64_t kPrefetchBytes = 2048;
template <class F>
inline void prefetch_ahead(const uint8_t* block) {
  for (int64_t line = 0; line < F::kBlockBytes + F::kHeaderBytes; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(block) + kPrefetchBytes + line, _MM_HINT_T0);
  }
}

// kRows input rows from row0 against column tile t. One tile at a time, whatever the rows: taking two
// or four tiles at once to hide the dot-product chains' latency for 1-4 rows made a whole decoding
// forward slower (docs/decisions.md, "one column tile at a time").
template <class F, int kRows>
void tile_rows(const Job& job, int64_t row0, int64_t t) {
  const Activations& x = *job.x;
  const uint8_t* tile = job.weight + t * (job.blocks / F::kGroup) * group_bytes<F>();
  __m512 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < job.blocks; ++b) {
    const uint8_t* header = tile + (b / F::kGroup) * group_bytes<F>();
    const uint8_t* block = header + F::kHeaderBytes + (b % F::kGroup) * F::kBlockBytes;
    prefetch_ahead<F>(block);
    typename F::Sum sums[kRows];
    for (int r = 0; r < kRows; ++r) sums[r] = F::start(x.code_sums[(row0 + r) * job.blocks + b]);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m512i low, high;
      F::codes(block, j, low, high);
      for (int r = 0; r < kRows; ++r) {
        const int8_t* q = x.codes.data() + ((row0 + r) * job.blocks + b) * kBlock;
        sums[r] = F::dot(sums[r], low, high, four_codes(q + 4 * j), four_codes(q + 16 + 4 * j));
      }
    }
    const Values w = F::values(header, block);
    for (int r = 0; r < kRows; ++r) {
      const int64_t i = (row0 + r) * job.blocks + b;
      const __m512 d_x = _mm512_set1_ps(x.scales[i]);
      if constexpr (F::kHalfScales) {
        const __m512i low = _mm512_add_epi32(sums[r].low, _mm512_set1_epi32(-F::kZero * x.low_sums[i]));
        const __m512i high =
            _mm512_add_epi32(sums[r].high, _mm512_set1_epi32(-F::kZero * (x.code_sums[i] - x.low_sums[i])));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(low), _mm512_mul_ps(w.scale, d_x), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(high), _mm512_mul_ps(w.high_scale, d_x), acc[r]);
      } else {
        const __m512i total = F::total(sums[r], x.code_sums[i]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(w.scale, d_x), acc[r]);
      }
    }
    if constexpr (F::kOffsets) {
      for (int r = 0; r < kRows; ++r) {
        acc[r] = _mm512_fmadd_ps(w.offset, _mm512_set1_ps(x.sums[(row0 + r) * job.blocks + b]), acc[r]);
      }
    }
  }
  const int64_t column = t * kTile;
  const __mmask16 valid = _cvtu32_mask16((1u << std::min<int64_t>(kTile, job.out_features - column)) - 1);
  for (int r = 0; r < kRows; ++r) {
    __m512 y = acc[r];
    if (job.bias != nullptr) y = _mm512_add_ps(y, _mm512_loadu_ps(job.bias + column));
    _mm256_mask_storeu_epi16(job.out + (row0 + r) * job.stride + column, valid,
                             reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(y)));
  }
}

// ``rows`` input rows from row0 against column tiles [begin, end), the row count made a constant.
template <class F, int kRows = 1>
void row_tile(int rows, const Job& job, int64_t row0, int64_t begin, int64_t end) {
  if constexpr (kRows < row_tile<F>()) {
    if (rows != kRows) return row_tile<F, kRows + 1>(rows, job, row0, begin, end);
  }
  for (int64_t t = begin; t < end; ++t) tile_rows<F, kRows>(job, row0, t);
}

// Rows split into even row tiles of at most row_tile<F>() (9 rows: one tile; 16: two of 8).
template <class F>
int64_t row_step(int64_t rows) {
  const int64_t row_tiles = (rows + row_tile<F>() - 1) / row_tile<F>();
  return (rows + row_tiles - 1) / row_tiles;
}

// Column tiles [begin, end) of ``job`` for all rows, kChunk tiles at a time.
template <class F>
void run_tiles(const Job& job, int64_t rows, int64_t begin, int64_t end) {
  const int64_t step = row_step<F>(rows);
  for (int64_t chunk = begin; chunk < end; chunk += kChunk) {
    const int64_t chunk_end = std::min(end, chunk + kChunk);
    for (int64_t r = 0; r < rows; r += step) {
      row_tile<F>(static_cast<int>(std::min(step, rows - r)), job, r, chunk, chunk_end);
    }
  }
}

// The checks every op makes, and its input as [rows, in] with the bias as float32 over whole tiles.
struct Call {
  at::Tensor x, bias;
  int64_t rows, in_features;
};

Call prepare(const at::Tensor& input, int64_t out_features, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.scalar_type() == at::kBFloat16, "int8 block matmuls take bfloat16 inputs, got ",
              input.scalar_type());
  const int64_t in_features = input.size(-1);
  const at::Tensor x = input.reshape({-1, in_features}).contiguous();
  at::Tensor bias_float;
  if (bias.has_value()) {
    bias_float = at::zeros({(out_features + kTile - 1) / kTile * kTile}, input.options().dtype(at::kFloat));
    bias_float.narrow(0, 0, out_features).copy_(*bias);
  }
  return {x, bias_float, x.size(0), in_features};
}

at::Tensor shaped(const at::Tensor& out, const at::Tensor& input, int64_t out_features) {
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = out_features;
  return out.view(shape);
}

template <class F>
void check_packed(const at::Tensor& packed, int64_t in_features, int64_t out_features) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(2) == group_bytes<F>(),
              "packed weights must be contiguous uint8 [tiles, groups of ", F::kGroup, " blocks, ",
              group_bytes<F>(), "]");
  const int64_t blocks = packed.size(1) * F::kGroup;
  TORCH_CHECK(in_features == blocks * kBlock, "input width ", in_features, " does not match the weight's ",
              blocks, " blocks of ", kBlock);
  TORCH_CHECK(packed.size(0) == (out_features + kTile - 1) / kTile, "packed weights hold ", packed.size(0),
              " tiles, not those of ", out_features, " outputs");
}

template <class F>
at::Tensor int8_matmul(const at::Tensor& input, const at::Tensor& packed, int64_t out_features,
                       const c10::optional<at::Tensor>& bias) {
  const Call call = prepare(input, out_features, bias);
  check_packed<F>(packed, call.in_features, out_features);
  const Activations activations = quantize(call.x.data_ptr<at::BFloat16>(), call.rows * call.in_features);
  at::Tensor out = at::empty({call.rows, out_features}, input.options());
  const Job job{packed.data_ptr<uint8_t>(), bias.has_value() ? call.bias.data_ptr<float>() : nullptr,
                &activations, out.data_ptr<at::BFloat16>(), call.in_features / kBlock, out_features,
                out_features};
  at::parallel_for(0, packed.size(0), 1,
                   [&](int64_t begin, int64_t end) { run_tiles<F>(job, call.rows, begin, end); });
  return shaped(out, input, out_features);
}

// Sibling projections stacked across formats (a Q4_K_M layer's q and k in Q4_K, its v in Q6_K): each
// sibling's tiles in its own format, their outputs side by side, every sibling a whole number of tiles.
// The input is quantized once, as for a single format (the rounding is the same for all), and each
// output column is the bits its sibling's own op gives.
using Formats = std::tuple<Q4_1, Q8_0, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K>;  // as decoder_loop.cpp numbers them

// ``fn`` called with a value of the type of format number ``format`` (one of Formats).
template <int kIndex = 0, class Fn>
void with_format(int64_t format, Fn&& fn) {
  if constexpr (kIndex < std::tuple_size_v<Formats>) {
    if (format == kIndex) return fn(std::tuple_element_t<kIndex, Formats>{});
    return with_format<kIndex + 1>(format, std::forward<Fn>(fn));
  } else {
    TORCH_CHECK(false, "a format is a number in 0..", std::tuple_size_v<Formats> - 1, ", got ", format);
  }
}

// ``packed``: uint8 [bytes], a header of int64 values (the siblings' count, then each one's format
// number and output width; every width a multiple of 16 but the last), then each sibling's tiles in
// turn. The op takes the arguments every format's op takes, so the fused loops call it by its number.
at::Tensor stacked_int8_matmul(const at::Tensor& input, const at::Tensor& packed, int64_t out_features,
                               const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 1 &&
                  packed.numel() >= 8,
              "stacked weights must be contiguous uint8 [bytes] behind their header");
  const uint8_t* data = packed.data_ptr<uint8_t>();
  int64_t siblings;
  std::memcpy(&siblings, data, sizeof(siblings));
  const int64_t header = 8 * (1 + 2 * siblings);
  TORCH_CHECK(siblings > 0 && packed.numel() >= header, "stacked weights' header is cut short");
  std::vector<int64_t> formats(siblings), widths(siblings);
  for (int64_t i = 0; i < siblings; ++i) {
    std::memcpy(&formats[i], data + 8 * (1 + 2 * i), sizeof(int64_t));
    std::memcpy(&widths[i], data + 8 * (2 + 2 * i), sizeof(int64_t));
  }
  int64_t total = 0;
  for (const int64_t width : widths) total += width;
  TORCH_CHECK(total == out_features, "stacked weights hold ", total, " outputs, not ", out_features);
  const Call call = prepare(input, out_features, bias);
  const int64_t blocks = call.in_features / kBlock;
  TORCH_CHECK(call.in_features == blocks * kBlock, "input width ", call.in_features, " is no whole number of blocks");
  std::vector<int64_t> first_tile(siblings + 1, 0), first_byte(siblings + 1, header);
  for (int64_t i = 0; i < siblings; ++i) {
    TORCH_CHECK(i + 1 == siblings || widths[i] % kTile == 0, "every sibling but the last has whole tiles");
    int64_t bytes = 0, group = 1;
    with_format(formats[i], [&](auto format) {
      bytes = group_bytes<decltype(format)>();
      group = decltype(format)::kGroup;
    });
    TORCH_CHECK(blocks % group == 0, "input width ", call.in_features, " is no whole number of groups of ",
                group * kBlock);
    const int64_t tiles = (widths[i] + kTile - 1) / kTile;
    first_tile[i + 1] = first_tile[i] + tiles;
    first_byte[i + 1] = first_byte[i] + tiles * (blocks / group) * bytes;
  }
  TORCH_CHECK(packed.numel() == first_byte[siblings], "stacked weights hold ", packed.numel(), " bytes, not the ",
              first_byte[siblings], " of these siblings");
  const Activations activations = quantize(call.x.data_ptr<at::BFloat16>(), call.rows * call.in_features);
  at::Tensor out = at::empty({call.rows, out_features}, input.options());
  const float* bias_data = bias.has_value() ? call.bias.data_ptr<float>() : nullptr;
  at::parallel_for(0, first_tile[siblings], 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = 0; i < siblings; ++i) {
      const int64_t lo = std::max(begin, first_tile[i]), hi = std::min(end, first_tile[i + 1]);
      if (lo >= hi) continue;
      const int64_t column = first_tile[i] * kTile;
      const Job job{packed.data_ptr<uint8_t>() + first_byte[i], bias_data ? bias_data + column : nullptr,
                    &activations, out.data_ptr<at::BFloat16>() + column, blocks, widths[i], out_features};
      with_format(formats[i], [&](auto format) {
        run_tiles<decltype(format)>(job, call.rows, lo - first_tile[i], hi - first_tile[i]);
      });
    }
  });
  return shaped(out, input, out_features);
}

}  // namespace

// One op per format; decoder_loop.cpp numbers them in this order.
TORCH_LIBRARY_FRAGMENT(diffdraft_blocks, m) {
  m.def("q4_1_int8_matmul(Tensor input, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("q8_0_int8_matmul(Tensor input, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("q4_0_int8_matmul(Tensor input, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("q5_0_int8_matmul(Tensor input, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("q4_k_int8_matmul(Tensor input, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("q5_k_int8_matmul(Tensor input, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("q6_k_int8_matmul(Tensor input, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("stacked_int8_matmul(Tensor input, Tensor packed, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(diffdraft_blocks, CPU, m) {
  m.impl("q4_1_int8_matmul", &int8_matmul<Q4_1>);
  m.impl("q8_0_int8_matmul", &int8_matmul<Q8_0>);
  m.impl("q4_0_int8_matmul", &int8_matmul<Q4_0>);
  m.impl("q5_0_int8_matmul", &int8_matmul<Q5_0>);
  m.impl("q4_k_int8_matmul", &int8_matmul<Q4_K>);
  m.impl("q5_k_int8_matmul", &int8_matmul<Q5_K>);
  m.impl("q6_k_int8_matmul", &int8_matmul<Q6_K>);
  m.impl("stacked_int8_matmul", &stacked_int8_matmul);
}
